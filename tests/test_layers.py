"""One-way layers, read from the source: the library loaded inside vLLM imports no deployable; the
deploy layer imports the library and nothing above it; nothing shipped imports test scaffolding;
a wheel built from the repository carries none of it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "ucm": ROOT / "ucm",
    "ucm_proxy": ROOT / "proxy" / "ucm_proxy",
    "ucm_operator": ROOT / "operator" / "ucm_operator",
}
SCAFFOLDING = ("ucm_testing", "kmock", "pytest")
DEPLOY = ("ucm.deploy", "ucm.cli", "ucm.__main__")  # the `ucm` command sits with the deploy layer
# layer -> (its modules, what they must not import)
RULES = {
    "library": (
        lambda m: _is(m, ("ucm",)) and not _is(m, DEPLOY),
        (*DEPLOY, "ucm_proxy", "ucm_operator", *SCAFFOLDING),
    ),
    "deploy": (lambda m: _is(m, DEPLOY), ("ucm_proxy", "ucm_operator", *SCAFFOLDING)),
    "proxy": (lambda m: _is(m, ("ucm_proxy",)), (*DEPLOY, "ucm_operator", *SCAFFOLDING)),
    "operator": (lambda m: _is(m, ("ucm_operator",)), SCAFFOLDING),
}


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def modules() -> dict[str, set[str]]:
    """Every shipped module and the modules it imports (absolute names)."""
    out: dict[str, set[str]] = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            imported: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            out[name] = imported
    return out


@pytest.mark.parametrize("layer", RULES)
def test_imports_point_one_way(layer):
    member, forbidden = RULES[layer]
    found = modules()
    assert any(member(m) for m in found), layer
    bad = sorted(f"{m} imports {i}" for m, imports in found.items() if member(m) for i in imports if _is(i, forbidden))
    assert bad == []


def test_the_rules_catch_a_bad_import():
    member, forbidden = RULES["library"]
    assert member("ucm.store.posix") and member("ucm.sparse.esa") and member("ucm.integration.vllm.worker")
    assert not member("ucm.deploy.plan") and not member("ucm.cli") and not member("ucm_proxy.app")
    assert _is("ucm_proxy.config", forbidden) and _is("ucm.deploy.plan", forbidden) and _is("kmock", forbidden)


@pytest.mark.slow
def test_the_wheel_carries_no_test_scaffolding(tmp_path):
    # Built from a copy of what the images copy (setuptools writes build/ next to the sources).
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    for part in ("ucm", "proxy", "operator"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("ucm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"ucm", "ucm_proxy", "ucm_operator"}
    for name in names:
        if name.endswith(".py"):
            text = zipfile.ZipFile(wheel).read(name).decode()
            imported = {a.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom) and n.module}
            assert not [i for i in imported if _is(i, SCAFFOLDING)], name
