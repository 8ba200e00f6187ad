"""The docs site's reference pages (``docs/reference/``), generated from the code, never hand-copied.

One function per page returns its Markdown; ``PAGES`` maps each file name to its function, and
``python -m ucm_testing.docs_reference docs/reference`` writes them all (the last step of ``make
generate``). ``tests/test_docs_reference.py`` fails when a checked-in page differs from what its
function returns now.

Every page reads its source: the CRD's openAPIV3Schema, the argparse parsers of the console
scripts ``pyproject.toml`` declares, the pydantic models' JSON schemas, the environment variables
the code reads (found in its syntax tree), the chart's values schema and values.yaml, the
Prometheus metrics the code registers (imported, or instantiated on a registry of their own), and
the chart's rules file. What the code cannot say (what an environment variable means) sits in
tables here that the generator checks against the code both ways. The output is deterministic and
machine-independent (no paths of this checkout, no home directory, no terminal width), and plain
GitHub-flavoured Markdown: no raw HTML, table cells without raw ``|`` or line breaks.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import json
import re
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from ucm.deploy.schema import DEPRECATED_SPELLING

ROOT = Path(__file__).resolve().parents[2]
CRD = "crds/ucm.io_ucmdeployments.yaml"
VALUES_SCHEMA = "charts/ucm-operator/values.schema.json"
VALUES = "charts/ucm-operator/values.yaml"
RULES = "charts/ucm-operator/files/ucm-rules.yaml"
# The Python packages of the project, by directory: where metrics and environment reads are looked for.
PACKAGES = {"ucm": "ucm", "ucm_proxy": "proxy/ucm_proxy", "ucm_operator": "operator/ucm_operator"}
USAGE_WIDTH = 100  # argparse wraps usage lines at this width, whatever the terminal's

# ----------------------------------------------------------------------------------------------
# Markdown


def _escape(s: str, in_table: bool) -> str:
    s = s.replace("\\", "\\\\")
    for ch in "`*[]" + ("|" if in_table else ""):
        s = s.replace(ch, "\\" + ch)
    return s.replace("<", "&lt;")


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def text(s: Any, in_table: bool = True) -> str:
    """Prose from the code (a description, a help text) as one line of Markdown: its code spans
    kept, no raw HTML, nothing that starts a link or emphasis, in a table no ``|``."""
    s = " ".join(str(s).split())
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(s):
        out.append(_escape(s[pos : m.start()], in_table))
        out.append(_escape(m.group(2), in_table) if in_table and "|" in m.group(2) else m.group(0))
        pos = m.end()
    out.append(_escape(s[pos:], in_table))
    return "".join(out)


def code(value: Any, in_table: bool = True) -> str:
    """A code span. In a table a value with ``|`` is escaped text instead: GitHub needs ``\\|`` even
    inside a code span, and MkDocs' Markdown would print that backslash."""
    s = " ".join(str(value).split())
    if not s:
        return ""
    if in_table and "|" in s:
        return _escape(s, in_table)
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s}{pad}{ticks}"


def as_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        assert len(row) == len(header), row
        lines.append("| " + " | ".join(cell if cell else " " for cell in row) + " |")
    return "\n".join(lines)


def fenced(body: str, lang: str = "text") -> str:
    fence = "`" * max(3, max((len(run) + 1 for run in re.findall(r"`{3,}", body)), default=0))
    return f"{fence}{lang}\n{body.rstrip()}\n{fence}"


def page(title: str, sources: list[str], blocks: list[str], also: str = "") -> str:
    """A page: its title, the generated-from note, then its blocks separated by blank lines."""
    named = [code(s, False) for s in sources] + ([also] if also else [])
    note = f"Generated from {_series(named)} by `make generate`; do not edit."
    out = "\n\n".join([f"# {title}", note, *[b.strip("\n") for b in blocks if b]]) + "\n"
    for local in {str(ROOT), str(Path.home())} - {"/"}:
        # As a path of its own (after a space, quote or backtick, then / or the end): a checkout at
        # /ucm must not trip on crds/ucm.io_... or /etc/ucm.
        if re.search(rf"(?:^|[\s`'\"(]){re.escape(local)}(?:/|[\s`'\")]|$)", out):
            raise ValueError(f"{title}: the page names {local}, a path of this machine")
    return out


def _series(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _source(path: str) -> str:
    return (ROOT / path).read_text()


def _module_path(module: Any) -> str:
    return Path(module.__file__).resolve().relative_to(ROOT).as_posix()


# ----------------------------------------------------------------------------------------------
# Schemas: the CRD's structural schema, JSON Schema (pydantic's, the chart's), one walker


_MISSING = object()
# Keys of a schema node the walker reads; any other stops generation, to be taught here.
_HANDLED = {
    "$ref", "$defs", "$schema", "definitions", "allOf", "anyOf", "oneOf", "title", "description", "default",
    "type", "nullable", "properties", "required", "items", "additionalProperties", "enum", "const", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "gt", "ge", "lt", "le", "multipleOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties",
    "maxProperties", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "examples",
}  # fmt: skip


@dataclass
class Row:
    path: str
    type: str
    default: str
    checks: list[str]
    description: str


@dataclass
class Flat:
    """A schema flattened: one row per field, and its CEL rules as (path, message, rule)."""

    rows: list[Row] = field(default_factory=list)
    rules: list[tuple[str, str, str]] = field(default_factory=list)


@functools.cache
def _byte_size_branches() -> list[dict[str, Any]]:
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize).json_schema()["anyOf"]


def _resolve(node: Mapping[str, Any], root: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The node with ``$ref``, a lone ``allOf`` and ``anyOf: [X, null]`` folded in, and whether
    null is allowed. Keys beside a reference (a field's description, default) win over the target's."""
    node, nullable = dict(node), False
    while True:
        nullable |= bool(node.pop("nullable", False))
        if "$ref" in node:
            ref = node.pop("$ref")
            target: Any = root
            for part in ref.removeprefix("#/").split("/"):
                target = target[part]
            node = {**target, **node}
            continue
        if "allOf" in node and len(node["allOf"]) == 1:
            node = {**node.pop("allOf")[0], **node}
            continue
        for key in ("anyOf", "oneOf"):
            if key not in node:
                continue
            branches = [b for b in node[key] if b != {"type": "null"}]
            nullable |= len(branches) < len(node[key])
            if branches == _byte_size_branches():
                node.pop(key)
                node = {"type": "byte size", **node}
            elif len(branches) == 1:
                node.pop(key)
                node = {**branches[0], **node}
            else:
                node[key] = branches
                continue
            break
        else:
            types = node.get("type")
            if isinstance(types, list):
                nullable |= "null" in types
                kept = [t for t in types if t != "null"]
                node["type"] = kept[0] if len(kept) == 1 else kept
            unknown = set(node) - _HANDLED
            if unknown:
                raise ValueError(f"schema keys not rendered by docs_reference: {sorted(unknown)}")
            return node, nullable


def _type(node: Mapping[str, Any], root: Mapping[str, Any]) -> str:
    node, _ = _resolve(node, root)
    if node.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    for key in ("anyOf", "oneOf"):
        if key in node:
            return " or ".join(_type(b, root) for b in node[key])
    kind = node.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"array of {_type(node['items'], root)}" if isinstance(node.get("items"), dict) else "array"
    if kind == "object" or (kind is None and "properties" in node):
        extra = node.get("additionalProperties")
        if node.get("properties"):
            return "object"
        if isinstance(extra, dict) and extra:
            return f"map of {_type(extra, root)}"
        if node.get("x-kubernetes-preserve-unknown-fields") or extra is True or extra == {}:
            return "object (any fields)"
        return "object"
    if kind is None:
        values = node.get("enum", [node["const"]] if "const" in node else None)
        if values is None:
            return "any"
        names = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "NoneType": "null"}
        return " or ".join(sorted({names.get(type(v).__name__, "any") for v in values}))
    return f"{kind} ({node['format']})" if "format" in node else kind


def _number(v: Any) -> str:
    return as_json(v)


def _checks(node: Mapping[str, Any]) -> list[str]:
    out = []
    if "enum" in node:
        out.append("one of " + ", ".join(code(v if isinstance(v, str) else as_json(v)) for v in node["enum"]))
    if "const" in node:
        out.append("exactly " + code(as_json(node["const"])))
    # Bounds, lower first: the CRD's exclusiveMinimum/Maximum are flags on minimum/maximum, JSON
    # Schema's are the bound itself; pydantic leaves gt/ge/lt/le as they are beside an anyOf.
    for key, sign, flag in (("minimum", "≥", "exclusiveMinimum"), ("maximum", "≤", "exclusiveMaximum")):
        if key in node:
            out.append(f"{ ({'≥': '>', '≤': '<'}[sign] if node.get(flag) is True else sign) } {_number(node[key])}")
        if key == "minimum":
            bounds = (("exclusiveMinimum", ">"), ("gt", ">"), ("ge", "≥"))
        else:
            bounds = (("exclusiveMaximum", "<"), ("lt", "<"), ("le", "≤"))
        for bound, bound_sign in bounds:
            if bound in node and not isinstance(node[bound], bool):
                out.append(f"{bound_sign} {_number(node[bound])}")
    if "multipleOf" in node:
        out.append(f"multiple of {_number(node['multipleOf'])}")
    if "minLength" in node:
        out.append(f"length ≥ {node['minLength']}")
    if "maxLength" in node:
        out.append(f"length ≤ {node['maxLength']}")
    if "pattern" in node:
        out.append("pattern " + code(node["pattern"]))
    if "minItems" in node:
        out.append(f"at least {node['minItems']} item{'s' * (node['minItems'] != 1)}")
    if "maxItems" in node:
        out.append(f"at most {node['maxItems']} item{'s' * (node['maxItems'] != 1)}")
    if node.get("uniqueItems"):
        out.append("items unique")
    if node.get("x-kubernetes-list-type") == "map":  # the API server keeps one item per key
        out.append("items unique by " + ", ".join(code(k) for k in node.get("x-kubernetes-list-map-keys", ())))
    if "minProperties" in node:
        out.append(f"at least {node['minProperties']} keys")
    if "maxProperties" in node:
        out.append(f"at most {node['maxProperties']} keys")
    if node.get("x-kubernetes-preserve-unknown-fields"):
        out.append("fields not validated")
    if node.get("x-kubernetes-validations"):
        out.append("CEL rules (below)")
    return out


def _fields_defaults(default: Any, node: Mapping[str, Any], root: Mapping[str, Any]) -> bool:
    """Whether an object's default is what its fields' own defaults say, key for key."""
    props = node.get("properties") or {}
    if not isinstance(default, dict) or not props or not set(default) <= set(props):
        return False
    for key, value in default.items():
        child, _ = _resolve(props[key], root)
        own = child.get("default", _MISSING)
        if own is _MISSING:
            # a field without a default is absent: the object's default may say so as null or empty
            if not (value in (None, [], {}) or _fields_defaults(value, child, root)):
                return False
        elif own != value and not (_fields_defaults(value, child, root) and _fields_defaults(own, child, root)):
            return False
    return True


def _default(node: Mapping[str, Any], root: Mapping[str, Any]) -> str:
    if "default" not in node:
        return ""
    if _fields_defaults(node["default"], node, root):
        return "its fields' defaults"
    return code(as_json(node["default"]))


def flatten(node: Mapping[str, Any], path: str, root: Mapping[str, Any], required: bool = False) -> Flat:
    """Every field under ``node`` (itself first): ``a.b`` for properties, ``a[]`` for an array's
    items, ``a.<key>`` for a map's values, when those have fields of their own."""
    flat = Flat()
    _walk(node, path, required, root, flat)
    return flat


def _walk(node: Mapping[str, Any], path: str, required: bool, root: Mapping[str, Any], flat: Flat) -> None:
    node, nullable = _resolve(node, root)
    checks = (["required"] if required else []) + _checks(node)
    children: list[tuple[str, Mapping[str, Any], bool]] = []
    for name, sub in (node.get("properties") or {}).items():
        children.append((f"{path}.{name}" if path else name, sub, name in node.get("required", ())))
    for key, suffix, label in (("items", "[]", "items"), ("additionalProperties", ".<key>", "values")):
        sub = node.get(key)
        if not isinstance(sub, dict) or not sub:
            continue
        inner, inner_nullable = _resolve(sub, root)
        if inner.get("properties") or inner.get("x-kubernetes-validations"):
            children.append((path + suffix, sub, False))
        else:
            checks += [f"{label}: {c}" for c in _checks(inner) + (["nullable"] if inner_nullable else [])]
    for rule in node.get("x-kubernetes-validations", ()):
        flat.rules.append((path, rule.get("message") or rule.get("messageExpression", ""), rule["rule"]))
    kind = _type(node, root) + (", nullable" if nullable else "")
    flat.rows.append(Row(path, kind, _default(node, root), checks, node.get("description", "")))
    for child_path, sub, child_required in children:
        _walk(sub, child_path, child_required, root, flat)


def field_table(rows: list[Row]) -> str:
    return table(
        ["Field", "Type", "Default", "Validation", "Description"],
        [[code(r.path), text(r.type), r.default, "; ".join(r.checks), text(r.description)] for r in rows],
    )


def rules_list(rules: list[tuple[str, str, str]]) -> str:
    rules = [r for r in rules if DEPRECATED_SPELLING not in r[1]]  # one sentence on the page says them all
    if not rules:
        return ""
    lines = ["Validation rules (CEL, checked by the API server when the resource is written):", ""]
    for path, message, rule in rules:
        lines.append(f"- {code(path, False)}: {text(message, False)}  ")
        lines.append(f"  rule: {code(rule, False)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# crd.md


def crd_page() -> str:
    crd = yaml.safe_load(_source(CRD))
    names = crd["spec"]["names"]
    blocks = []
    for version in crd["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        spec = root["properties"]["spec"]
        blocks.append(
            f"`apiVersion: {crd['spec']['group']}/{version['name']}`, `kind: {names['kind']}` "
            f"({crd['spec']['scope'].lower()}; plural {code(names['plural'], False)}"
            + "".join(f", short name {code(s, False)}" for s in names.get("shortNames", []))
            + f"). {text(root.get('description', ''), False)}"
        )
        blocks.append(
            "Paths are written as in the resource (camelCase); `[]` stands for each item of a list and "
            "`<key>` for each key of a map. A field that is not required may be left out; "
            '"nullable" fields also take `null`. An object whose default is "its fields\' defaults" '
            "is filled in from the defaults of the fields below it."
        )
        blocks.append(
            "`spec.sparse` and `spec.blend` once took the engines' snake_case names (`sparse_ratio`, "
            "`recompute_ratio`, ...). Those names are still accepted, each as a deprecated twin of its camelCase "
            "field (listed below it, without a default: the default is applied by UCM, as the description says); "
            "a resource that uses one gets a `DeprecatedField` Event from the operator and a warning from "
            "`ucm render` and `ucm up`, and one that gives both spellings of a field is refused."
        )
        scale = version.get("subresources", {}).get("scale")
        if scale:
            blocks.append(
                "The scale subresource (`kubectl scale`, autoscalers) acts on "
                + ", ".join(f"{k} {code(v, False)}" for k, v in scale.items())
                + "."
            )
        columns = version.get("additionalPrinterColumns", [])
        if columns:
            blocks.append("Columns of `kubectl get " + names["plural"] + "` (`-o wide` adds those of priority 1):")
            blocks.append(
                table(
                    ["Column", "Type", "Priority", "JSONPath"],
                    [[text(c["name"]), c["type"], str(c.get("priority", 0)), code(c["jsonPath"])] for c in columns],
                )
            )
        whole = flatten(spec, "spec", root, required="spec" in root.get("required", ()))
        top = whole.rows[0]
        blocks.append("## spec")
        blocks.append(
            text(top.description, False)
            + " Fields: "
            + ", ".join(code(f"spec.{k}", False) for k in spec["properties"])
            + "; required: "
            + (", ".join(code(f"spec.{k}", False) for k in spec.get("required", ())) or "none")
            + "."
        )
        blocks.append(rules_list([r for r in whole.rules if r[0] == "spec"]))
        for name, sub in spec["properties"].items():
            flat = flatten(sub, f"spec.{name}", root, required=name in spec.get("required", ()))
            blocks += [f"## spec.{name}", field_table(flat.rows), rules_list(flat.rules)]
        status = root["properties"].get("status")
        if status is not None:
            flat = flatten(status, "status", root)
            blocks += [
                "## status",
                field_table(flat.rows),
                rules_list(flat.rules),
            ]
    return page(f"{names['kind']} resource", [CRD], blocks)


# ----------------------------------------------------------------------------------------------
# cli.md


def console_scripts() -> dict[str, str]:
    """``pyproject.toml``'s console scripts: command -> ``module:function``."""
    return tomllib.loads(_source("pyproject.toml"))["project"]["scripts"]


def tool_parser(entry: str) -> argparse.ArgumentParser:
    module = importlib.import_module(entry.partition(":")[0])
    build = getattr(module, "build_parser", None)
    if build is None:
        raise ValueError(f"{entry}: no build_parser() in {module.__name__}; teach docs_reference how it parses")
    return build()


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)


def _usage(parser: argparse.ArgumentParser) -> str:
    kept = parser.formatter_class
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=USAGE_WIDTH)  # type: ignore[assignment]
    try:
        return parser.format_usage()
    finally:
        parser.formatter_class = kept


def walk_parsers(prog: str, parser: argparse.ArgumentParser, help_text: str = "") -> Iterator[tuple[str, Any, str]]:
    """(command, parser, its help in the parent's list) for the parser and every subcommand."""
    yield prog, parser, help_text
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from walk_parsers(f"{prog} {name}", sub, helps.get(name, ""))


def _invocation(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    return f"{flags} {formatter._format_args(action, formatter._get_default_metavar_for_optional(action))}"


def _option_row(action: argparse.Action, formatter: argparse.HelpFormatter) -> list[str]:
    details = []
    if action.required and action.nargs not in ("?", "*", argparse.REMAINDER):
        details.append("required")
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse._StoreConstAction):
        details.append("flag")
    if isinstance(action, argparse._AppendAction):
        details.append("repeatable")
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        details.append("one of " + ", ".join(code(c) for c in action.choices))
    if action.type is not None:
        name = getattr(action.type, "__name__", "")
        details.append({"int": "integer", "float": "number"}.get(name, f"parsed by {code(name.lstrip('_'))}"))
    if action.nargs == argparse.REMAINDER:
        details.append("the rest of the command line")
    elif action.nargs in ("*", "+", "?") or (isinstance(action.nargs, int) and action.nargs > 1):
        details.append(f"nargs {code(action.nargs)}")
    default = action.default
    show_default = default is not None and default is not argparse.SUPPRESS
    if isinstance(action, argparse._StoreTrueAction) and default is False:
        show_default = False
    if isinstance(action, argparse._StoreFalseAction) and default is True:
        show_default = False
    help_text = formatter._expand_help(action) if action.help else ""
    return [
        code(_invocation(action, formatter)),
        code(as_json(default) if not isinstance(default, str) else default or '""') if show_default else "",
        "; ".join(details),
        text(help_text),
    ]


def cli_page() -> str:
    scripts = console_scripts()
    blocks = [
        "Every command and subcommand of the console scripts UCM installs ("
        + ", ".join(code(s, False) for s in scripts)
        + "), from their argparse parsers. Each also takes `-h`/`--help`, which prints the same."
    ]
    for script, entry in scripts.items():
        root = tool_parser(entry)
        root.prog = script
        for prog, parser, listed_help in walk_parsers(script, root):
            formatter = _formatter(parser)
            blocks.append(f"## {prog}")
            about = parser.description or listed_help
            if about:
                blocks.append(text(about, False))
            blocks.append(fenced(_usage(parser)))
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    rows = [[code(f"{prog} {a.dest}"), text(a.help or "")] for a in action._choices_actions]
                    blocks += ["Subcommands:", table(["Command", "Description"], rows)]
            for group in parser._action_groups:
                actions = [
                    a
                    for a in group._group_actions
                    if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
                    and a.help is not argparse.SUPPRESS
                ]
                if not actions:
                    continue
                title = group.title or ""
                if title in ("positional arguments", "options", "optional arguments"):
                    title = "Arguments:" if title.startswith("positional") else "Options:"
                else:
                    title = f"Options, {text(title, False)}:"
                exclusive = [
                    g for g in parser._mutually_exclusive_groups if set(g._group_actions) & set(group._group_actions)
                ]
                rows = [_option_row(a, formatter) for a in actions]
                blocks += [
                    title,
                    table(["Argument" if title == "Arguments:" else "Option", "Default", "Details", "Help"], rows),
                ]
                for g in exclusive:
                    blocks.append(
                        "Mutually exclusive: "
                        + ", ".join(code(max(a.option_strings, key=len), False) for a in g._group_actions)
                        + "."
                    )
    return page("Command line", ["pyproject.toml", *sorted({_entry_file(e) for e in scripts.values()})], blocks)


def _entry_file(entry: str) -> str:
    return _module_path(importlib.import_module(entry.partition(":")[0]))


# ----------------------------------------------------------------------------------------------
# configuration.md


def model_schema(model: Any) -> dict[str, Any]:
    """The model's JSON schema, with the defaults of fields that have a default factory (pydantic
    leaves those out)."""
    from pydantic.json_schema import GenerateJsonSchema

    class WithFactoryDefaults(GenerateJsonSchema):
        def get_default_value(self, schema: Any) -> Any:
            factory = schema.get("default_factory")
            if factory is not None and not schema.get("default_factory_takes_data"):
                return factory()
            return super().get_default_value(schema)

    return model.model_json_schema(schema_generator=WithFactoryDefaults)


def model_rows(model: Any, prefix: str = "") -> list[Row]:
    schema = model_schema(model)
    rows = []
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        rows += flatten(sub, path, schema, required=name in schema.get("required", ())).rows
    return rows


def configuration_page() -> str:
    from ucm import serve as ucm_serve
    from ucm import ucm_style
    from ucm.integration.vllm import config as connector
    from ucm.store import factory
    from ucm_proxy import config as proxy

    store_row = model_schema(connector.ConnectorConfig)["properties"]["store"]
    blocks = [
        'Types: "byte size" takes a number of bytes or a string with a unit (`128MiB`, `4GiB`, `500MB`); '
        '"nullable" fields also take `null`. Unknown keys are errors everywhere.',
        "## Engine: kv_connector_extra_config",
        f"The {code(connector.WHERE, False)} of vLLM's `--kv-transfer-config` with UCMConnector (the file "
        "`ucm serve --kv-config` reads; the operator and `ucm up` write it from the resource). "
        + text(connector.ConnectorConfig.__doc__ or "", False),
        field_table(model_rows(connector.ConnectorConfig)),
        "### store",
        text(store_row.get("description", ""), False)
        + " "
        + code("store.spec", False)
        + " names the stages front to back, separated by `|`; each stage's options sit under its name. "
        + "Stages: "
        + ", ".join(code(n, False) for n in sorted(factory.REGISTRY))
        + "; "
        + ", ".join(code(n, False) for n in sorted(factory.REGISTRY) if factory.REGISTRY[n].is_tier)
        + " only in front of another store.",
    ]
    for name in sorted(factory.REGISTRY):
        backend = factory.REGISTRY[name]
        rows = model_rows(backend.config, f"store.{name}")
        blocks.append(f"#### store.{name}")
        doc = model_schema(backend.config).get("description")
        if doc:
            blocks.append(text(doc, False))
        blocks.append(field_table(rows) if rows else "No options.")
    blocks += [
        "### UCM's own keys",
        "UCM's configuration shape is accepted in the same place and translated (`ucm config convert` prints "
        "the translation). Its top-level keys: "
        + ", ".join(code(k, False) for k in sorted(ucm_style.UCM_KEYS))
        + "; the short form: "
        + ", ".join(code(k, False) for k in sorted(ucm_style.FLAT_KEYS))
        + "; "
        + code("ucm_sparse_config", False)
        + " becomes `sparse` (or `blend`). Connector names accepted: "
        + ", ".join(code(k, False) for k in ucm_style.CONNECTOR_NAMES)
        + ". UCM's store options that are refused, and why:",
        table(["Option", "Why"], [[code(k), text(v)] for k, v in sorted(ucm_style.REFUSED.items())]),
        "## Proxy: ucm-proxy --config",
        "The YAML file `ucm-proxy --config` reads (the operator writes it from `spec.proxy`); command line "
        "flags win over it (see the command line reference). "
        + text(proxy.__doc__.splitlines()[0] if proxy.__doc__ else "", False),
        field_table(model_rows(proxy.ProxyConfig)),
        "## Environment variables",
        "Every environment variable the code of `ucm`, `ucm_proxy` and `ucm_operator` reads, where, and "
        "what for. UCM's own settings live in the configuration above; variables that would duplicate "
        "it are refused at startup, naming where the setting goes.",
        env_table(ucm_serve),
    ]
    sources = [
        _module_path(connector),
        _module_path(factory),
        *sorted({_module_path(importlib.import_module(b.config.__module__)) for b in factory.REGISTRY.values()}),
        _module_path(ucm_style),
        _module_path(proxy),
    ]
    also = "the environment reads of the code under " + ", ".join(code(p, False) for p in PACKAGES.values())
    return page("Configuration", sources, blocks, also)


# --- environment variables: found in the syntax tree, explained here (checked both ways)

# What each variable means: the one thing the code cannot say. Generation fails when the code reads
# a variable missing here, or when one here is no longer read.
ENV_MEANINGS = {
    "UCM_LOG_LEVEL": "Level of the `ucm` loggers ({levels}). Without it, `UCM_DEBUG`, `UCM_LOG_FORMAT` and "
    "`UCM_LOG_FILE`, logging stays as the host process (vLLM) set it up",
    "UCM_DEBUG": "`true`: the same as `UCM_LOG_LEVEL=DEBUG`",
    "UCM_LOG_FORMAT": "A `logging` format string for UCM's records (default {log_format})",
    "UCM_LOG_FILE": "UCM's log records go to this file instead of standard error",
    "UCM_METRICS_ENABLE": "Accepted from UCM's documentation: metrics are always on; `false` is refused",
    "UCM_ENABLE_METRICS": "Accepted from UCM's documentation: metrics are always on; `false` is refused",
    "UCM_NATIVE_CUDA": "`0`: the native CUDA copy kernels are not used (torch copies instead)",
    "UCM_MODEL_CACHE": "Where the generated demo models (`ucm up`'s default tiny model) are built and kept",
    "UCM_STORE_HEALTH_FILE": "The file through which the engine's scheduler and workers tell its `/health` "
    "that the store is stuck; `ucm serve` sets a fresh one per start",
    "UCM_ENGINE_WARMUP": "`1` (set by `ucm serve`): the engine's `/health` answers 503 until one warm-up "
    "request has run through it",
    "UCM_KV_IDENTITY": "The engine's pairing identity (set by `ucm serve`), sent in `/health`'s "
    "`X-UCM-KV-Identity` header so the proxy pairs prefill and decode engines that share KV",
    "PROMETHEUS_MULTIPROC_DIR": "`prometheus_client`'s directory for the metrics of vLLM's processes; "
    "`ucm serve` makes a fresh one per start unless it is set",
    "VLLM_API_KEY": "vLLM's API key: the engine's warm-up request sends it",
    "KUBERNETES_SERVICE_HOST": "The in-cluster API server the proxy's discovery watches (set in every pod; "
    "`discovery.api_server` overrides it)",
    "KUBERNETES_SERVICE_PORT": "Its port",
    "POD_NAME": "The proxy names itself with it in `status.pdPath.reporter`; an operator replica, in the "
    "Lease it elects its leader with (`--identity`)",
    "POD_NAMESPACE": "The operator's leader election Lease's namespace (`--lease-namespace`)",
}
# Reads whose variable name is computed: (file, function) -> the constant that lists the names, and
# what such a variable is for.
ENV_DYNAMIC = {
    ("ucm/serve.py", "_expand.fill"): (
        "ucm.serve:EXPANDABLE",
        "May be used as `${{{name}}}` in string values of the kv-config file; filled in by `ucm serve` "
        "(Kubernetes' downward API sets it in UCM's pods)",
    ),
}


@dataclass
class EnvRead:
    name: str
    where: str  # file (function)
    default: str  # the code of its default, "" when none
    written: bool


def _py_files() -> Iterator[tuple[str, str]]:
    """(module name, repo-relative path) of every module of the project's packages."""
    for package, directory in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            rel = path.relative_to(ROOT / directory).with_suffix("")
            parts = [package, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path.relative_to(ROOT).as_posix()


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, a name ``environ``/``env`` (a mapping of the environment passed in), or an
    expression choosing between them."""
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return True
    if isinstance(node, ast.Name):
        return node.id in ("environ", "env")
    if isinstance(node, ast.IfExp):
        return _is_environ(node.body) or _is_environ(node.orelse)
    return False


class _Scopes(ast.NodeVisitor):
    """Environment reads and writes of one module, each with its enclosing function and loops."""

    def __init__(self) -> None:
        self.stack: list[ast.AST] = []
        self.found: list[tuple[ast.expr, ast.expr | None, bool, list[ast.AST]]] = []  # key, default, write, stack
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.calls: list[tuple[ast.Call, list[ast.AST]]] = []

    def generic_visit(self, node: ast.AST) -> None:
        scoped = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.For | ast.comprehension)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            self.functions[node.name] = node
        if scoped:
            self.stack.append(node)
        if isinstance(node, ast.Call):
            self.calls.append((node, list(self.stack)))
            func = node.func
            if isinstance(func, ast.Attribute) and node.args:
                environ_get = func.attr in ("get", "setdefault", "pop") and _is_environ(func.value)
                getenv = func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os"
                if environ_get or getenv:
                    default = node.args[1] if len(node.args) > 1 else None
                    self.found.append((node.args[0], default, False, list(self.stack)))
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            self.found.append((node.slice, None, isinstance(node.ctx, ast.Store), list(self.stack)))
        if (
            isinstance(node, ast.Compare)
            and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            and any(_is_environ(c) for c in node.comparators)
        ):
            self.found.append((node.left, None, False, list(self.stack)))
        super().generic_visit(node)
        if scoped:
            self.stack.pop()


def _qualname(stack: list[ast.AST]) -> str:
    return ".".join(n.name for n in stack if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))


def _names(expr: ast.expr, stack: list[ast.AST], module: str, scopes: _Scopes) -> list[str] | None:
    """The variable names an expression can hold: a constant, a module constant, a loop variable
    over constants, or a parameter every call passes one of those; None when it cannot be told."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.Tuple | ast.List | ast.Set):
        out: list[str] = []
        for e in expr.elts:
            names = _names(e, stack, module, scopes)
            if names is None:
                return None
            out += names
        return out
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("items", "keys"):
        return _names(expr.func.value, stack, module, scopes)
    if not isinstance(expr, ast.Name):
        return None
    for i in range(len(stack) - 1, -1, -1):
        node = stack[i]
        if isinstance(node, ast.For | ast.comprehension):
            target = node.target
            first = target.elts[0] if isinstance(target, ast.Tuple) else target
            if isinstance(first, ast.Name) and first.id == expr.id:
                return _names(node.iter, stack[:i], module, scopes)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            if expr.id in params:
                position = params.index(expr.id)
                out = []
                callers = [(c, s) for c, s in scopes.calls if isinstance(c.func, ast.Name) and c.func.id == node.name]
                for call, call_stack in callers:
                    arg = next((k.value for k in call.keywords if k.arg == expr.id), None)
                    if arg is None and position < len(call.args):
                        arg = call.args[position]
                    names = None if arg is None else _names(arg, call_stack, module, scopes)
                    if names is None:
                        return None
                    out += names
                return out or None
            if any(
                isinstance(n, ast.Name) and n.id == expr.id and isinstance(n.ctx, ast.Store) for n in ast.walk(node)
            ):
                return None  # assigned in the function: computed
    value = getattr(importlib.import_module(module), expr.id, None)
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping | tuple | list | frozenset | set) and all(isinstance(v, str) for v in value):
        return sorted(value) if isinstance(value, frozenset | set) else list(value)
    return None


def env_reads() -> list[EnvRead]:
    reads = []
    for module, path in _py_files():
        tree = ast.parse((ROOT / path).read_text(), path)
        scopes = _Scopes()
        scopes.visit(tree)
        for key, default, written, stack in scopes.found:
            where = _qualname(stack)
            names = _names(key, stack, module, scopes)
            if names is None:
                dynamic = ENV_DYNAMIC.get((path, where))
                if dynamic is None:
                    raise ValueError(
                        f"{path} ({where}): reads an environment variable whose name docs_reference cannot tell; "
                        "add the constant that lists the names to ENV_DYNAMIC"
                    )
                owner, _, attr = dynamic[0].partition(":")
                names = sorted(getattr(importlib.import_module(owner), attr))
            code_of_default = ast.unparse(default) if default is not None else ""
            reads += [EnvRead(n, f"{path} ({where or 'module'})", code_of_default, written) for n in names]
    return reads


def env_table(ucm_serve: Any) -> str:
    from ucm import environment

    reads = env_reads()
    dynamic = {}
    for owner_attr, meaning in ENV_DYNAMIC.values():
        owner, _, attr = owner_attr.partition(":")
        for name in getattr(importlib.import_module(owner), attr):
            dynamic[name] = meaning.format(name=name)
    names = sorted({r.name for r in reads})
    explained = set(ENV_MEANINGS) | set(environment.REFUSED) | set(dynamic)
    missing, stale = sorted(set(names) - explained), sorted(set(ENV_MEANINGS) - set(names))
    if missing or stale:
        raise ValueError(
            f"docs_reference.ENV_MEANINGS: no meaning for {missing} (read by the code); {stale} no longer read"
        )
    fills = {"levels": ", ".join(environment.LEVELS), "log_format": code(environment.DEFAULT_FORMAT, False)}
    rows = []
    for name in names:
        mine = [r for r in reads if r.name == name]
        meaning = [ENV_MEANINGS[name].format(**fills)] if name in ENV_MEANINGS else []
        if name in environment.REFUSED:
            meaning.append(f"Refused at startup (unset it): {environment.REFUSED[name]}")
        if name in dynamic:
            meaning.append(dynamic[name])
        rows.append(
            [
                code(name),
                "; ".join(sorted({code(r.where) for r in mine if not r.written})),
                "; ".join(sorted({code(r.default) for r in mine if r.default})),
                "; ".join(sorted({code(r.where) for r in mine if r.written})),
                text(". ".join(meaning)),
            ]
        )
    return table(["Variable", "Read in", "Default", "Set in", "Meaning"], rows)


# ----------------------------------------------------------------------------------------------
# helm-values.md


def _values_comments(lines: list[str]) -> dict[str, str]:
    """values.yaml's comment lines right above each key (no blank line between), by value path."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_.-]+):", line)
        if m is None:
            pending = []
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if pending:
            comments[".".join(k for _, k in stack)] = " ".join(pending)
        pending = []
    return comments


def _lookup(values: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(values, dict) or part not in values:
            return _MISSING
        values = values[part]
    return values


def helm_values_page() -> str:
    schema = json.loads(_source(VALUES_SCHEMA))
    values = yaml.safe_load(_source(VALUES))
    comments = _values_comments(_source(VALUES).splitlines())
    rows = []
    for name, sub in schema["properties"].items():
        rows += flatten(sub, name, schema, required=name in schema.get("required", ())).rows
    covered = {r.path for r in rows}
    parents = {r.path.rpartition(".")[0] for r in rows}
    for row in rows:
        value = _lookup(values, row.path)
        if value is not _MISSING:
            fields = (
                isinstance(value, dict) and row.path in parents and all(f"{row.path}.{k}" in covered for k in value)
            )
            row.default = "its fields' defaults" if fields and value else code(as_json(value))
        row.description = _join(row.description, comments.get(row.path, ""))
    free = {r.path for r in rows if r.path not in parents}
    unschemed = [p for p in _leaf_paths(values) if p not in covered and not any(p.startswith(f + ".") for f in free)]
    blocks = [
        "Every value of the `ucm-operator` chart: its type and validation from the chart's values schema "
        "(`helm install` refuses values that break it), its default from values.yaml, and its description "
        "from both (the schema's, then the comment above the key in values.yaml).",
        field_table(rows),
    ]
    if unschemed:
        blocks.append("In values.yaml but not in the schema: " + ", ".join(code(p, False) for p in unschemed))
    return page("Helm chart values", [VALUES_SCHEMA, VALUES], blocks)


def _join(first: str, second: str) -> str:
    """Two descriptions of one thing, the second left out where it repeats the first and the first
    where the second begins with it."""
    first, second = first.strip(), second.strip()
    if not first or first.rstrip(".") in second[: len(first)]:
        return second or first
    if not second or second.rstrip(".") in first:
        return first
    return f"{first.rstrip('.')}. {second}"


def _leaf_paths(values: Any, prefix: str = "") -> list[str]:
    if not isinstance(values, dict) or not values:
        return [prefix] if prefix else []
    out = [prefix] if prefix else []
    for k, v in values.items():
        out += _leaf_paths(v, f"{prefix}.{k}" if prefix else k)
    return out


# ----------------------------------------------------------------------------------------------
# metrics.md

# Which process exposes the metrics a package defines, and where.
EXPOSED_BY = {
    "ucm": (
        "Engines",
        "The engines (vLLM with UCMConnector, started by `ucm serve`): on the vLLM server's own "
        "`/metrics`, summed over vLLM's processes.",
    ),
    "ucm_proxy": ("Proxy", "`ucm-proxy`: on its `/metrics` (behind the `metrics_token_file` token when one is set)."),
    "ucm_operator": ("Operator", "`ucm-operator`: on `--metrics-port` (the chart's `metrics.port`)."),
}
_CONSTRUCTORS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
_VLLM_FACTORIES = {"_counter_cls", "_gauge_cls", "_histogram_cls"}


@dataclass
class Metric:
    name: str  # as registered (a counter's without _total)
    kind: str
    labels: tuple[str, ...]
    help: str
    package: str
    module: str
    buckets: tuple[float, ...] = ()
    multiprocess_mode: str = ""

    @property
    def exposed(self) -> str:
        return {"counter": f"{self.name}_total", "info": f"{self.name}_info"}.get(self.kind, self.name)


def _metric_modules() -> dict[str, str]:
    """Modules that create Prometheus metrics (module name -> path), from their syntax tree."""
    found = {}
    for module, path in _py_files():
        tree = ast.parse((ROOT / path).read_text(), path)
        imported = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("prometheus_client")
            for a in n.names
        }
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            func = n.func
            direct = isinstance(func, ast.Name) and func.id in _CONSTRUCTORS & imported
            qualified = (
                isinstance(func, ast.Attribute)
                and func.attr in _CONSTRUCTORS
                and isinstance(func.value, ast.Name)
                and func.value.id == "prometheus_client"
            )
            vllm = isinstance(func, ast.Attribute) and func.attr in _VLLM_FACTORIES  # a connector's, vLLM's classes
            if direct or qualified or vllm:
                found[module] = path
    return found


def _vllm_engine_labels() -> list[str]:
    """The labels vLLM gives its per-engine metrics (``labelnames`` in PrometheusStatLogger), which
    a connector's metrics carry too."""
    spec = importlib.util.find_spec("vllm.v1.metrics.loggers")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "PrometheusStatLogger":
            for n in ast.walk(cls):
                if isinstance(n, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "labelnames" for t in n.targets
                ):
                    return list(ast.literal_eval(n.value))
    raise ValueError("vLLM's PrometheusStatLogger has no literal labelnames; teach docs_reference where they are")


def _from_collector(m: Any, package: str, module: str) -> Metric:
    buckets = tuple(b for b in getattr(m, "_upper_bounds", ()) if b != float("inf"))
    mode = getattr(m, "_multiprocess_mode", "") if m._type == "gauge" else ""
    return Metric(m._name, m._type, tuple(m._labelnames), m._documentation, package, module, buckets, mode)


def collect_metrics() -> list[Metric]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.metrics import MetricWrapperBase

    metrics = []
    for module_name, path in sorted(_metric_modules().items()):
        package = module_name.partition(".")[0]
        module = importlib.import_module(module_name)
        found = [
            _from_collector(v, package, module_name) for v in vars(module).values() if isinstance(v, MetricWrapperBase)
        ]
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module_name):
                continue
            bases = {b.__name__ for b in cls.__mro__}
            if "KVConnectorPromMetrics" not in bases:
                continue
            # vLLM builds a connector's metrics with its metric classes and engine labels: build them
            # on a registry of their own, with no engines (no series), and read them back.
            registry = CollectorRegistry()
            types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
            cls(SimpleNamespace(kv_transfer_config=None), types, _vllm_engine_labels(), {})
            found += [
                _from_collector(c, package, module_name)
                for c in list(registry._collector_to_names)
                if isinstance(c, MetricWrapperBase)
            ]
        if not found:
            raise ValueError(f"{path} creates Prometheus metrics docs_reference cannot collect; teach it how")
        metrics += found
    names = [m.exposed for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"metrics defined twice: {sorted({n for n in names if names.count(n) > 1})}")
    unknown = {m.package for m in metrics} - set(EXPOSED_BY)
    if unknown:
        raise ValueError(f"docs_reference.EXPOSED_BY: which process exposes the metrics of {sorted(unknown)}?")
    return metrics


def metrics_page() -> str:
    metrics = collect_metrics()
    modules = sorted({m.module for m in metrics})
    blocks = [
        "Every Prometheus metric UCM's code registers, by the process that exposes it. Names are as "
        "scraped: a counter `X_total` also has `X_created`; a histogram `X` is the series `X_bucket` "
        "(label `le`), `X_sum` and `X_count`. The chart's recording rules and alerts built on them: "
        "see the alerts reference.",
    ]
    for package in EXPOSED_BY:
        mine = sorted((m for m in metrics if m.package == package), key=lambda m: m.exposed)
        if not mine:
            continue
        title, where = EXPOSED_BY[package]
        blocks += [f"## {title}", where]
        rows = []
        for m in mine:
            kind = m.kind + (
                f" (multiprocess: {m.multiprocess_mode})" if m.multiprocess_mode not in ("", "all") else ""
            )
            rows.append(
                [
                    code(m.exposed),
                    kind,
                    ", ".join(code(label) for label in m.labels) or "none",
                    text(m.help) if m.help else "(no help text)",
                    code(m.module),
                ]
            )
        blocks.append(table(["Metric", "Type", "Labels", "Help", "Defined in"], rows))
        histograms = [m for m in mine if m.buckets]
        if histograms:
            blocks.append("Histogram buckets (upper bounds, seconds where the name says so; `+Inf` besides):")
            blocks.append(
                table(
                    ["Histogram", "Buckets"],
                    [[code(m.name), ", ".join(f"{b:g}" for b in m.buckets)] for m in histograms],
                )
            )
    paths = [_module_path(importlib.import_module(m)) for m in modules]
    return page("Metrics", paths, blocks)


# ----------------------------------------------------------------------------------------------
# alerts.md


def alerts_page() -> str:
    from ucm.deploy import rules as rules_module

    data = yaml.safe_load(_source(RULES))
    records = [(g["name"], r) for g in data["groups"] for r in g["rules"] if "record" in r]
    alerts = [(g["name"], r) for g in data["groups"] for r in g["rules"] if "alert" in r]
    names = [r["alert"] for _, r in alerts]
    if len(set(n.lower() for n in names)) != len(names):
        raise ValueError("two alerts share a name: their sections' anchors would collide")
    blocks = [
        text((rules_module.__doc__ or "").strip(), False),
        "The rules file is the chart's PrometheusRule (with `monitoring.prometheusOperator`) and what "
        "`ucm up --monitor` loads. Each alert below has a section of its own: link to it as "
        "`alerts.md#<alert name in lower case>`.",
        "## Recording rules",
        table(
            ["Record", "Group", "Labels", "Expression"],
            [
                [
                    code(r["record"]),
                    code(group),
                    ", ".join(code(f"{k}={v}") for k, v in (r.get("labels") or {}).items()),
                    code(r["expr"]),
                ]
                for group, r in records
            ],
        ),
        "## Alerts",
        table(
            ["Alert", "Severity", "For", "Summary"],
            [
                [
                    code(r["alert"]),
                    text((r.get("labels") or {}).get("severity", "")),
                    code(r.get("for", "0s")),
                    text((r.get("annotations") or {}).get("summary", "")),
                ]
                for _, r in alerts
            ],
        ),
    ]
    for group, r in alerts:
        labels = dict(r.get("labels") or {})
        annotations = dict(r.get("annotations") or {})
        lines = [
            f"- Severity: {text(labels.pop('severity', 'none'), False)}",
            f"- For: {code(r.get('for', '0s'), False)} (how long the expression must hold before it fires)",
            f"- Group: {code(group, False)}",
        ]
        lines += [f"- Label {code(k, False)}: {text(v, False)}" for k, v in labels.items()]
        for key in ("summary", "description"):
            if key in annotations:
                lines.append(f"- {key.capitalize()}: {text(annotations.pop(key), False)}")
        lines += [f"- {code(k, False)}: {text(v, False)}" for k, v in annotations.items()]
        blocks += [f"## {r['alert']}", fenced(r["expr"], "promql"), "\n".join(lines)]
    return page("Alerts and recording rules", [RULES, _module_path(rules_module)], blocks)


# ----------------------------------------------------------------------------------------------

PAGES: dict[str, Callable[[], str]] = {
    "crd.md": crd_page,
    "cli.md": cli_page,
    "configuration.md": configuration_page,
    "helm-values.md": helm_values_page,
    "metrics.md": metrics_page,
    "alerts.md": alerts_page,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm_testing.docs_reference", description=__doc__)
    parser.add_argument("directory", type=Path, help="where the pages go (docs/reference)")
    parser.add_argument("pages", nargs="*", metavar="PAGE", help=f"only these of {', '.join(PAGES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.pages) - set(PAGES))
    if unknown:
        parser.error(f"no such page: {', '.join(unknown)}")
    args.directory.mkdir(parents=True, exist_ok=True)
    for name in args.pages or PAGES:
        (args.directory / name).write_text(PAGES[name]())
        print(args.directory / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
