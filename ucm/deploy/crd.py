"""The CustomResourceDefinition, generated from the spec models (``python -m ucm.deploy.crd``).

pydantic's JSON Schema is turned into a structural ``openAPIV3Schema``: references inlined,
``X | None`` as ``X`` with ``nullable``, int-or-string quantities as
``x-kubernetes-int-or-string``, free-form objects as ``x-kubernetes-preserve-unknown-fields``,
titles dropped, and the models' CEL rules kept. ``crds/`` holds the output; a test fails when it
drifts from what the models generate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from ucm.deploy.schema import DEPRECATED_NAME, both_spellings
from ucm.deploy.spec import GROUP, KIND, PLURAL, VERSION, UCMDeploymentSpec, UCMDeploymentStatus

CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON Schema node -> a structural OpenAPI v3 node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        types = {o.get("type") for o in options}
        if types == {"integer", "string"}:
            node: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        elif len(options) == 1:
            node = structural(options[0], defs)
        else:
            raise ValueError(f"cannot express anyOf {options} structurally")
        node.update({k: v for k, v in schema.items() if k in _KEEP and k != "type" and v is not None})
        if nullable:
            node["nullable"] = True
        return node
    out = {k: v for k, v in schema.items() if k in _KEEP}
    if "const" in schema:  # Literal[x]: one accepted value, of the type pydantic gives beside it
        out.setdefault("type", "string")
        out["enum"] = [schema["const"]]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), (int, float)) and not isinstance(out[bound], bool):
            out[limit], out[bound] = out[bound], True  # OpenAPI 3.0 form: a flag beside the limit
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None:
            out["properties"] = {}
            for name, p in props.items():
                out["properties"].update(_spellings(name, structural(p, defs), p.get(DEPRECATED_NAME)))
            twins = [
                {"rule": f"!has(self.{name}) || !has(self.{old})", "message": both_spellings(name, old)}
                for name, p in props.items()
                if (old := p.get(DEPRECATED_NAME))
            ]
            if twins:
                out["x-kubernetes-validations"] = out.get("x-kubernetes-validations", []) + twins
            if schema.get("required"):
                out["required"] = list(schema["required"])
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = structural(schema.get("items", {}), defs)
    elif kind is None and "enum" in schema:
        out["type"] = "string"
    elif kind is None:  # Any
        out = {"x-kubernetes-preserve-unknown-fields": True}
    if out.get("default") is None:
        out.pop("default", None)
    return out


def _spellings(name: str, node: dict[str, Any], old: str | None) -> dict[str, dict[str, Any]]:
    """A field's property, and with an ``old`` name its deprecated twin. Neither has a default: the API
    server would set it on the spelling left out, and both would then be given (UCM applies it)."""
    if old is None:
        return {name: node}
    default = node.pop("default", None)
    if default is not None:
        node["description"] = f"{node.get('description', '').rstrip('.')}. Default: {json.dumps(default)}"
    return {name: node, old: {**node, "description": f"Deprecated: write {name}. {node.get('description', '')}"}}


def open_api_schema(model: type, defs_key: str = "$defs") -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    return structural(raw, raw.get(defs_key, {}))


def generate() -> dict[str, Any]:
    spec = open_api_schema(UCMDeploymentSpec)
    status = open_api_schema(UCMDeploymentStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["ucmd"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    # `kubectl scale ucmd NAME --replicas N` (and an HPA targeting the resource)
                    # sets the decode pool's replicas in the spec: the operator never fights it.
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.readyReplicas.decode",
                            "labelSelectorPath": ".status.decodeSelector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
                        },
                        {"name": "Prefill", "type": "integer", "jsonPath": ".status.readyReplicas.prefill"},
                        {"name": "Decode", "type": "integer", "jsonPath": ".status.readyReplicas.decode"},
                        {"name": "Store", "type": "string", "jsonPath": ".spec.store.type"},
                        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "vLLM with UCM: prefill and decode pools, a KV store, a PD proxy.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m ucm.deploy.crd` from ucm/deploy/spec.py. Do not edit.\n"
    return header + yaml.safe_dump(generate(), sort_keys=False, width=120)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    text = render()
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
