"""Typed configuration with errors that name the field and what it accepts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range. The message names the field."""


class StrictModel(BaseModel):
    """Base of every config model: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


M = TypeVar("M", bound=BaseModel)


def parse_config(model: type[M], data: Mapping[str, Any] | None, where: str) -> M:
    """Validate ``data`` as ``model``; on failure raise ConfigError with ``where.field: reason`` lines."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of options, got {type(data).__name__}")
    try:
        return model.model_validate(dict(data or {}))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None


def format_validation_error(exc: ValidationError, where: str = "") -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in (where, *err["loc"]) if p != "")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        lines.append(f"{path}: {msg}")
    return "; ".join(lines)


def load_mapping(path: str | Path, where: str, what: str = "a mapping of options") -> dict[str, Any]:
    """A YAML (or JSON) file that must hold a mapping; ``where`` names the flag that gave it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {path} is not valid YAML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {path} must hold {what}")
    return data
