"""What every ``UCMDeployment`` model shares: camelCase fields, no unknown fields, CEL rules, element types.

Cross-field rules are written twice, on purpose: as CEL (``x-kubernetes-validations``, enforced by
the API server) and as a Python validator right beside it (enforced here, and the only way the rule
is tested, since nothing here runs CEL).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

Quantity = int | str  # Kubernetes quantities: 8, "500m", "16Gi"
M = TypeVar("M", bound=BaseModel)

# Element types that carry a description for the CRD (``kubectl explain``); no validation of their own.
Arg = Annotated[str, Field(description="One argument, e.g. --enforce-eager")]
LabelValue = Annotated[str, Field(description="The label's value")]
ResourceQuantity = Annotated[Quantity, Field(description="A quantity: an integer or a string such as 500m, 16Gi")]


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


# Resource fields that were once snake_case carry their old name here; the CRD keeps a deprecated
# twin under that name (without a default, which would set both), so that stored resources written
# with it still validate and keep their values.
DEPRECATED_NAME = "deprecatedName"


@cache
def camel(model: type[M], name: str | None = None) -> type[M]:
    """``model`` (settings an engine reads in snake_case) as the resource spells it: camelCase fields,
    nested models too. The snake_case names stay accepted, deprecated (:func:`deprecated_spellings`);
    ``model_dump()`` still gives the engine its own names. ``name``: the class's (default ``model``'s)."""
    fields: dict[str, Any] = {}
    renamed: dict[str, str] = {}  # camelCase name -> the old one
    for field, info in model.model_fields.items():
        annotation = _camel_types(info.annotation)
        alias = to_camel(field)
        if alias == field and annotation == info.annotation:
            continue
        extra: dict[str, Any] = {}
        if alias != field:
            renamed[alias] = field
            extra = {
                "validation_alias": AliasChoices(alias, field),
                "serialization_alias": alias,
                "json_schema_extra": {**(info.json_schema_extra or {}), DEPRECATED_NAME: field},  # type: ignore[dict-item]
            }
        fields[field] = (annotation, FieldInfo.merge_field_infos(info, annotation=annotation, **extra))

    def one_spelling(data: Any) -> Any:
        if isinstance(data, Mapping):
            both = sorted(a for a, n in renamed.items() if a in data and n in data)
            if both:
                raise ValueError(both_spellings(both[0], renamed[both[0]]))
        return data

    return create_model(  # type: ignore[call-overload,no-any-return]
        name or model.__name__,
        __base__=model,
        __module__=model.__module__,
        __doc__=model.__doc__,
        __validators__={"_one_spelling": model_validator(mode="before")(one_spelling)},
        **fields,
    )


DEPRECATED_SPELLING = "its deprecated spelling"


def both_spellings(name: str, old: str) -> str:
    return f"{name} and {old} ({DEPRECATED_SPELLING}) both given: keep {name}"


def _camel_types(annotation: Any) -> Any:
    """``annotation`` with each settings model in it (alone or ``| None``) replaced by its camel variant."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return camel(annotation)
    if get_origin(annotation) in (Union, UnionType):
        members = tuple(_camel_types(a) for a in get_args(annotation))
        return Union[members] if members != get_args(annotation) else annotation  # noqa: UP007
    return annotation


def deprecated_spellings(model: type[BaseModel], data: Any, path: str) -> list[str]:
    """Where ``data`` (input to ``model``) uses a field's deprecated name: one message per place."""
    found: list[str] = []
    if not isinstance(data, Mapping):
        return found
    for name, info in model.model_fields.items():
        choices = info.validation_alias.choices if isinstance(info.validation_alias, AliasChoices) else []
        alias = info.alias or name
        given = [c for c in choices if isinstance(c, str) and c in data]
        for old in (c for c in given if c != choices[0]):
            found.append(f"{path}.{old} is deprecated: write {path}.{choices[0]}")
        key = given[0] if given else alias
        if key not in data:
            continue
        found += _deprecated_within(info.annotation, data[key], f"{path}.{choices[0] if choices else alias}")
    return found


def _deprecated_within(annotation: Any, value: Any, where: str) -> list[str]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return deprecated_spellings(annotation, value, where)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, UnionType):
        return [m for a in args for m in _deprecated_within(a, value, where)]
    if origin is list and isinstance(value, list) and args:
        return [m for i, item in enumerate(value) for m in _deprecated_within(args[0], item, f"{where}[{i}]")]
    if origin is dict and isinstance(value, Mapping) and len(args) == 2:
        return [m for k, v in value.items() for m in _deprecated_within(args[1], v, f"{where}.{k}")]
    return []
