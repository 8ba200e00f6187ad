"""docs/reference/ is generated from the code (ucm_testing.docs_reference): each checked-in page is
what its generator returns now, and mentions what it must."""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Iterator

import pytest
import yaml

from ucm_testing import docs_reference
from ucm_testing.docs_reference import PAGES, ROOT

REFERENCE = ROOT / "docs" / "reference"


@functools.cache
def generated(name: str) -> str:
    return PAGES[name]()


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_is_current(name: str) -> None:
    path = REFERENCE / name
    stale = f"docs/reference/{name} is out of date: run make generate"
    if not path.exists():
        pytest.fail(f"{stale} (the file is missing)")
    checked_in, now = path.read_text(), generated(name)
    if checked_in != now:
        old, new = checked_in.splitlines(keepends=True), now.splitlines(keepends=True)
        line = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
        pytest.fail(f"{stale} (first difference at line {line + 1})")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_is_plain_markdown(name: str) -> None:
    text = generated(name)
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2].startswith("Generated from ") and lines[2].endswith(" by `make generate`; do not edit.")
    fenced = False
    columns = 0
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose = re.sub(r"(`+).+?\1", "", line)  # code spans show < as it is
        assert not re.search(r"<[A-Za-z/!?]", prose), f"{name}:{number}: raw HTML: {line}"
        if line.startswith("|"):
            cells = len(re.findall(r"(?<!\\)\|", line)) - 1  # GitHub splits cells at | even in code spans
            if not columns:
                columns = cells  # the header row
            assert cells == columns, f"{name}:{number}: {cells} cells in a table of {columns}: {line}"
        else:
            columns = 0
    assert not fenced, f"{name}: a code block is not closed"


def test_crd_page() -> None:
    text = generated("crd.md")
    crd = yaml.safe_load((ROOT / docs_reference.CRD).read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for field in spec["properties"]:
        assert f"\n## spec.{field}\n" in text
    for path in (
        "spec.prefill.autoscaling.maxReplicas",
        "spec.store.type",
        "spec.store.pvc.create.accessModes",
        "spec.prefill.env[].valueFrom.secretKeyRef.key",
        "spec.proxy.service.port",
        "status.pdPath.reporter",
    ):
        assert f"| `{path}` |" in text, path
    assert "model.source: exactly one of pvc, hostPath, hf must be set" in text  # a CEL rule's message
    assert "int-or-string" in text and "nullable" in text


def test_cli_page() -> None:
    text = generated("cli.md")
    for command in ("ucm up", "ucm serve", "ucm store gc", "ucm config convert", "ucm-proxy", "ucm-operator"):
        assert f"\n## {command}\n" in text, command
    assert "usage: ucm up [-h]" in text and "`--monitor`" in text and "`--kv-config KV_CONFIG`" in text
    for script, entry in docs_reference.console_scripts().items():
        parser = docs_reference.tool_parser(entry)
        for _prog, sub, _help in docs_reference.walk_parsers(script, parser):
            for action in sub._actions:
                for flag in action.option_strings:
                    assert flag in text, f"{script}: {flag}"


def test_every_cli_option_has_help() -> None:
    """Each command, subcommand, option and argument of the console scripts says what it is for: one
    without help is a blank cell in cli.md (and in ``-h``)."""
    bare = []
    for script, entry in docs_reference.console_scripts().items():
        root = docs_reference.tool_parser(entry)
        for prog, parser, listed_help in docs_reference.walk_parsers(script, root):
            if not (parser.description or listed_help or "").strip():
                bare.append(f"{prog} (the command itself: no help= in add_parser, no description)")
            for action in parser._actions:
                if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                    continue  # argparse's own -h; subcommands are checked above, as commands
                if action.help is argparse.SUPPRESS:
                    continue  # not shown anywhere
                if not (action.help or "").strip():
                    bare.append(f"{prog} {', '.join(action.option_strings) or action.dest}")
    assert not bare, "without help text: " + "; ".join(bare)


def _config_models() -> list[tuple[str, object]]:
    """The pydantic models configuration.md documents, each with the path prefix of its fields there."""
    from ucm.integration.vllm.config import ConnectorConfig
    from ucm.store import factory
    from ucm_proxy.config import ProxyConfig

    stores = [(f"store.{name}", factory.REGISTRY[name].config) for name in sorted(factory.REGISTRY)]
    return [("", ConnectorConfig), *stores, ("", ProxyConfig)]


def test_every_config_field_has_a_description() -> None:
    """Every field of the connector's, the stores' and the proxy's config (nested models, list items
    and map values included, as the page flattens them) has a description in its JSON schema."""
    bare = []
    for prefix, model in _config_models():
        for row in docs_reference.model_rows(model, prefix):
            if not row.description.strip():
                bare.append(f"{model.__module__}.{model.__qualname__}: {row.path}")  # type: ignore[attr-defined]
    from ucm.integration.vllm.config import ConnectorConfig

    if not (ConnectorConfig.__doc__ or "").strip():
        bare.append("ucm.integration.vllm.config.ConnectorConfig itself (no docstring; the page shows it)")
    assert not bare, "without a description (Field(description=...), or a docstring on its model): " + "; ".join(bare)


def test_configuration_page() -> None:
    text = generated("configuration.md")
    for key in (
        "pd_wait_timeout_s",
        "store_breaker.timeout_s",
        "sparse.esa.sparse_ratio",
        "store.posix.roots",
        "store.cache.capacity",
        "routing.kv_events.port",
        "disaggregation.min_prefill_tokens",
    ):
        assert f"| `{key}` |" in text, key
    for variable in ("UCM_LOG_LEVEL", "UCM_STORE_HEALTH_FILE", "UCM_STORAGE_BACKEND", "KUBERNETES_SERVICE_HOST"):
        assert f"| `{variable}` |" in text, variable
    assert "Path.home()" in text  # UCM_MODEL_CACHE's default as the code writes it, not this machine's


def test_helm_values_page() -> None:
    text = generated("helm-values.md")
    assert '| `image.repository` | string | `"ucm/operator"` |' in text
    for path in ("metrics.serviceMonitor.interval", "policy.allowedNfs", "monitoring.prometheusOperator"):
        assert f"| `{path}` |" in text, path
    assert "In values.yaml but not in the schema" not in text


def _schema_paths(node: dict, path: str) -> Iterator[tuple[str, dict]]:
    """Every value path under a JSON Schema node, as the page writes it (``a.b``, ``a[]``,
    ``a.<key>``): properties, recursively; an array's items and a map's values where they have
    properties of their own (a plain string list's items are its path's, not a path)."""
    for name, sub in (node.get("properties") or {}).items():
        child = f"{path}.{name}" if path else name
        yield child, sub
        yield from _schema_paths(sub, child)
    for key, suffix in (("items", "[]"), ("additionalProperties", ".<key>")):
        sub = node.get(key)
        if isinstance(sub, dict) and sub.get("properties"):
            yield path + suffix, sub
            yield from _schema_paths(sub, path + suffix)


def test_every_chart_value_has_a_description() -> None:
    """Every value path of the chart's values schema says what it does in its own ``description``
    (helm-values.md joins it with the comment above the key in values.yaml, which may add to it)."""
    schema = json.loads((ROOT / docs_reference.VALUES_SCHEMA).read_text())
    paths = dict(_schema_paths(schema, ""))
    rows = [
        r.path for name, sub in schema["properties"].items() for r in docs_reference.flatten(sub, name, schema).rows
    ]
    assert sorted(paths) == sorted(rows), "the walk and helm-values.md disagree on the value paths"
    bare = [path for path, node in paths.items() if not str(node.get("description", "")).strip()]
    assert not bare, f"without a description in {docs_reference.VALUES_SCHEMA}: " + ", ".join(bare)


def test_metrics_page() -> None:
    text = generated("metrics.md")
    for name in (
        "ucm_proxy_requests_total",
        "ucm_proxy_backend_healthy",
        "ucm_store_operation_seconds",
        "ucm_operator_reconciles_total",
        "ucm_connector_external_hit_tokens_total",
    ):
        assert f"| `{name}` |" in text, name


def test_alerts_page() -> None:
    text = generated("alerts.md")
    rules = yaml.safe_load((ROOT / docs_reference.RULES).read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert f"\n## {rule['alert']}\n" in text
            else:
                assert f"| `{rule['record']}` |" in text
    assert "\n## UCMPDPathBroken\n\n```promql\n" in text and "- Severity: critical" in text
