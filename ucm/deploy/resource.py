"""A ``UCMDeployment`` read from a file: the whole resource, or just its spec."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from ucm.config import ConfigError, format_validation_error, load_mapping
from ucm.deploy.spec import GROUP, KIND, VERSION, UCMDeploymentSpec, deprecated_fields, read_spec


@dataclass(frozen=True)
class Resource:
    spec: UCMDeploymentSpec
    name: str | None = None
    namespace: str | None = None
    uid: str | None = None  # set when the resource came from the API server (kubectl get -o yaml)


def load_resource(path: str, where: str = "-f") -> Resource:
    """``path`` ("-": standard input) holding a UCMDeployment or its spec, validated; old spellings of
    fields are reported on standard error."""
    if path == "-":
        try:
            doc: Any = yaml.safe_load(sys.stdin.read())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: standard input is not valid YAML/JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: standard input must hold a {KIND} (or its spec)")
    else:
        doc = load_mapping(path, where, f"a {KIND} (or its spec)")
    meta: dict[str, Any] = {}
    if "spec" in doc and "model" not in doc:  # the resource, not just its spec
        if doc.get("kind", KIND) != KIND or doc.get("apiVersion", f"{GROUP}/{VERSION}") != f"{GROUP}/{VERSION}":
            raise ConfigError(f"{where}: {path} holds a {doc.get('apiVersion')} {doc.get('kind')}, not a {KIND}")
        meta = doc.get("metadata") or {}
        doc = doc["spec"]
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: {path} must hold a {KIND} (or its spec)")
    try:
        spec = read_spec(doc)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "spec")) from None
    for message in deprecated_fields(doc):
        print(f"ucm: warning: {path}: {message}", file=sys.stderr)
    return Resource(spec, meta.get("name"), meta.get("namespace"), meta.get("uid"))
