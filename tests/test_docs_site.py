"""The docs site (``docs/``, ``mkdocs.yml``): it builds strictly and offline, what it shows is real
(examples the operator accepts, command lines the tools parse, metric names and spec paths that
exist), and a real browser renders it. The generated reference pages are checked for freshness in
``tests/test_docs_reference.py``."""

from __future__ import annotations

import ast
import functools
import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_crd import walk
from ucm.cli import build_parser as ucm_parser
from ucm.deploy.spec import UCMDeploymentSpec
from ucm_operator.cli import build_parser as operator_parser
from ucm_proxy.cli import build_parser as proxy_parser

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGES = [*sorted(ROOT.glob("docs/**/*.md")), ROOT / "README.md"]
# The image prefix the Kubernetes guide tells the chart's policy to allow.
GUIDE_REGISTRY = "registry.example.com/ucm/"


def blocks(language: str) -> Iterator[tuple[Path, str]]:
    """The fenced code blocks of one language in every page."""
    fence = re.compile(rf"^```{language}\n(.*?)^```", re.M | re.S)
    for page in PAGES:
        for match in fence.finditer(page.read_text()):
            yield page, match.group(1)


def command_lines(text: str, tools: set[str]) -> Iterator[list[str]]:
    """The shell commands of a block that run one of ``tools``, as words: continuations joined,
    comments dropped, a pipeline or list cut at its first command."""
    for line in text.replace("\\\n", " ").splitlines():
        if not line.split() or Path(line.split()[0]).name not in tools:
            continue
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word in {"|", "&", "&&", ";"}:
                words = words[:i]
                break
        if words:
            yield words


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-6000:]
    return out


def test_the_site_builds_strictly_with_every_page_in_it(site):
    """--strict: a broken link, a missing anchor or a page outside the nav fails the build."""
    for page in (
        "index.html",
        "getting-started/kubernetes.html",
        "reference/crd.html",
        "operations/troubleshooting.html",
    ):
        assert (site / page).is_file(), page


def test_the_site_loads_nothing_from_the_network(site):
    """Readers behind a firewall (and this machine) have no CDN and no web fonts."""
    remote = re.compile(r"""(?:src|href)=["'](?:https?:)?//""")
    offenders = [
        str(path.relative_to(site))
        for path in site.rglob("*.html")
        for tag in re.findall(r"<(?:script|link|img)\b[^>]*>", path.read_text())
        if remote.search(tag)
    ]
    assert offenders == []
    assert not [p for p in site.rglob("*.css") if "fonts.googleapis" in p.read_text()]


def test_the_readme_is_short_and_the_license_is_the_declared_one():
    assert (ROOT / "README.md").stat().st_size <= 10 * 1024
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert re.search(r'^license = "Apache-2.0"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_the_readmes_links_lead_to_files_that_exist():
    """The README is read on a forge, outside the site: its links are repository paths."""
    links = re.findall(r"\]\(([^)#]+)", (ROOT / "README.md").read_text())
    assert links and [link for link in links if not (ROOT / link).exists()] == []


def test_every_resource_shown_is_one_the_operator_renders(tmp_path):
    shown = [
        (page, doc)
        for page, text in blocks("yaml")
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, dict) and doc.get("kind") == "UCMDeployment"
    ]
    assert shown, "the Kubernetes guide shows a UCMDeployment"
    for page, doc in shown:
        UCMDeploymentSpec.model_validate(doc["spec"])
        path = tmp_path / "cr.yaml"
        path.write_text(yaml.safe_dump(doc))
        r = subprocess.run(
            [
                str(BIN / "ucm"),
                "render",
                "-f",
                str(path),
                *("--allow-image-prefix", "ucm/", "--allow-image-prefix", GUIDE_REGISTRY),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, f"{page.relative_to(ROOT)}: {r.stderr}"
        assert "kind: Deployment" in r.stdout


PARSERS = {"ucm": ucm_parser, "ucm-proxy": proxy_parser, "ucm-operator": operator_parser}


def test_every_ucm_command_line_shown_parses():
    seen = 0
    for page, text in blocks("sh"):
        for words in command_lines(text, set(PARSERS)):
            try:
                PARSERS[Path(words[0]).name]().parse_args(words[1:])
            except SystemExit:
                pytest.fail(f"{page.relative_to(ROOT)}: {shlex.join(words)} does not parse")
            seen += 1
    assert seen >= 3


def test_every_helm_command_line_shown_works_on_the_chart():
    """`helm install` lines render the chart (as `helm template`, with their values); other helm
    lines use only flags their subcommand has."""
    helm = str(BIN / "helm")
    seen = set()
    for page, text in blocks("sh"):
        for words in command_lines(text, {"helm"}):
            sub = words[1]
            seen.add(sub)
            where = f"{page.relative_to(ROOT)}: {shlex.join(words)}"
            if sub == "install":
                args = [w for w in words[2:] if w != "--create-namespace"]
                r = subprocess.run([helm, "template", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
                assert r.returncode == 0, f"{where}: {r.stderr}"
            else:
                usage = subprocess.run([helm, sub, "--help"], capture_output=True, text=True, timeout=60)
                assert usage.returncode == 0, where
                for flag in (w.split("=", 1)[0] for w in words[2:] if w.startswith("-")):
                    assert re.search(rf"(?:^|[\s,]){re.escape(flag)}\b", usage.stdout), f"{where}: {flag}"
    assert {"install", "upgrade", "uninstall"} <= seen


def crd_paths() -> set[str]:
    """Every field path of the CRD as the docs write it: spec.a.b, a list's items under the list's path."""
    crd = yaml.safe_load((ROOT / "crds/ucm.io_ucmdeployments.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return {path.removeprefix("schema.").replace("[]", "") for path, _ in walk(schema) if "{}" not in path}


def test_every_spec_path_named_in_the_docs_exists():
    """`spec.<pool>.x` stands for both pools; what follows `spec.proxy.config.` is the proxy's own
    configuration (free-form in the CRD)."""
    known = crd_paths()
    from ucm_proxy.config import ProxyConfig

    proxy_fields = set(ProxyConfig.model_fields)
    named = re.compile(r"`((?:spec|status)\.[A-Za-z0-9_.<>]+)")
    wrong = []
    for page in PAGES:
        for path in named.findall(page.read_text()):
            path = path.rstrip(".")
            if path.endswith(".py") or "<" in path.replace("<pool>", ""):
                continue  # a module (spec.py), or a placeholder such as spec.<field>
            if path.startswith("spec.proxy.config."):
                if path.split(".")[3] not in proxy_fields:
                    wrong.append((page.name, path))
                continue
            pools = ("prefill", "decode") if "<pool>" in path else ("",)
            if not all(path.replace("<pool>", pool) in known for pool in pools):
                wrong.append((page.name, path))
    assert wrong == []


def exposed_metrics() -> set[str]:
    """Every series name UCM exposes (the metrics reference's own collection) and the recording
    rules' names."""
    from ucm_testing.docs_reference import collect_metrics

    names: set[str] = set()
    for m in collect_metrics():
        names |= {m.name, m.exposed} | {
            m.name + suffix for suffix in ("_total", "_created", "_bucket", "_sum", "_count")
        }
    rules = yaml.safe_load((ROOT / "charts/ucm-operator/files/ucm-rules.yaml").read_text())
    names.update(r["record"] for group in rules["groups"] for r in group["rules"] if "record" in r)
    return names


# Backticked names shaped like metrics that are UCM-style configuration keys instead.
CONFIG_KEYS = {"ucm_sparse_config"}


def test_every_metric_named_in_the_docs_exists():
    names = exposed_metrics() | CONFIG_KEYS
    metric = re.compile(r"`(ucm_(?:store|proxy|operator|connector|sparse|blend|cache|pd|kv)_[a-z0-9_]+)(?:\{[^`]*\})?`")
    named = {(page.name, name) for page in PAGES for name in metric.findall(page.read_text())}
    assert len(named) > 20  # the troubleshooting page and the guides name many
    assert sorted((page, name) for page, name in named if name not in names) == []


@pytest.fixture
def served(site) -> Iterator[str]:
    """The built site over HTTP, as `python -m http.server` would serve it (search needs that)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_real_browser_renders_the_site_its_navigation_and_search(served):
    """Debian's chromium through Playwright, as a reader opens the site: the home page with its
    picture, the nav into the CRD reference, a search; nothing fails to load. Screenshots are kept
    in build/test-artifacts/."""
    from playwright.sync_api import sync_playwright

    artifacts = ROOT / "build" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: make dev installs it (scripts/system-deps.sh)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            failed: list[str] = []
            # A fetch cut short by the next navigation is no failure of the site.
            page.on(
                "requestfailed",
                lambda request: request.failure != "net::ERR_ABORTED" and failed.append(request.url),
            )
            page.on("response", lambda response: response.status >= 400 and failed.append(response.url))
            page.goto(f"{served}/index.html")
            assert page.locator("article h1").first.inner_text().startswith("UCM")
            picture = page.locator("img[src$='architecture.svg']").first
            assert picture.evaluate("img => img.complete && img.naturalWidth") > 0
            page.screenshot(path=str(artifacts / "docs-home.png"), full_page=True)

            page.get_by_role("link", name="UCMDeployment", exact=True).first.click()
            page.wait_for_url("**/reference/crd.html")
            assert "spec.prefill.autoscaling.maxReplicas" in page.locator("article").inner_text()
            page.screenshot(path=str(artifacts / "docs-crd.png"))

            page.keyboard.press("s")  # Material's search shortcut
            page.locator("input.md-search__input").press_sequentially("maxReplicas", delay=50)  # as typed
            results = page.locator(".md-search-result__item")
            results.first.wait_for(timeout=15_000)
            assert results.count() > 0
            assert failed == []
        finally:
            browser.close()


def test_every_benchmark_page_says_how_to_reproduce_it():
    """Every page of docs/benchmarks/ but the index has a `## Reproduce` section whose sh block runs
    a script of benchmarks/, and every flag on that line (its comment's included) is one the
    script's argparse defines. The flags are read from the scripts' source: importing one imports
    vLLM."""

    def flags(script: Path) -> set[str]:
        return {
            arg.value
            for node in ast.walk(ast.parse(script.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for arg in node.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")
        }

    fence = re.compile(r"^```sh\n(.*?)^```", re.M | re.S)
    section = re.compile(r"^## Reproduce\n(.*?)(?=^## |\Z)", re.M | re.S)
    pages = [page for page in sorted(ROOT.glob("docs/benchmarks/*.md")) if page.name != "index.md"]
    assert len(pages) >= 10
    wrong = []
    for page in pages:
        name = page.relative_to(ROOT)
        found = section.search(page.read_text())
        if found is None:
            wrong.append(f"{name}: no '## Reproduce' section")
            continue
        runs = 0
        for text in fence.findall(found.group(1)):
            for line in text.replace("\\\n", " ").splitlines():
                code, comment = re.fullmatch(r"(.*?)(?:(?<!\S)#(.*))?", line).groups(default="")
                words = shlex.split(code)
                at = [i for i, word in enumerate(words) if re.fullmatch(r"benchmarks/\w+\.py", word)]
                if not at:
                    continue
                script = ROOT / words[at[0]]
                if not script.is_file():
                    wrong.append(f"{name}: {words[at[0]]} does not exist")
                    continue
                runs += 1
                args = []
                for word in words[at[0] + 1 :]:
                    if word in {"|", "&", "&&", "||", ";"}:
                        break
                    args.append(word)
                shown = {word.split("=", 1)[0] for word in args if word.startswith("--")}
                shown |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", comment))
                wrong += [f"{name}: {script.name} has no {flag}" for flag in sorted(shown - flags(script))]
        if not runs:
            wrong.append(f"{name}: no sh block in its Reproduce section runs a script of benchmarks/")
    assert wrong == []
