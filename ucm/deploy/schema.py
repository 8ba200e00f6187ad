"""What every ``UCMDeployment`` model shares: camelCase fields, no unknown fields, CEL rules.

Cross-field rules are written twice, on purpose: as CEL (``x-kubernetes-validations``, enforced by
the API server) and as a Python validator right beside it (enforced here, and the only way the rule
is tested, since nothing here runs CEL).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

Quantity = int | str  # Kubernetes quantities: 8, "500m", "16Gi"


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


def cel(*rules: tuple[str, str]) -> ConfigDict:
    """Model config carrying CEL rules: (expression, message)."""
    return ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]},
    )


def one_of(model: BaseModel, fields: tuple[str, ...], where: str) -> None:
    set_ = [f for f in fields if getattr(model, f) is not None]
    if len(set_) != 1:
        names = ", ".join(to_camel(f) for f in fields)
        raise ValueError(f"{where}: exactly one of {names} must be set, got {len(set_)}")
