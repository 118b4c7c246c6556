"""The console's forms, generated from the admin API's own schemas.

A plan's, a tenant's or a price's form has one input per property of the OpenAPI document's
`PlanTable`, `TenantTable` or `PriceTable` (gateway/openapi/document.py, from the typed dicts the
admin API is documented by): a field added to the tenants file's tables reaches the console with
no edit here. A posted form becomes the JSON table the API takes: empty inputs are left out (an
optional limit unset), numbers are parsed, and a value the schema refuses is a `FormError` naming
the field before the API is called (which checks again, as for any client).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.openapi.document import component_schemas

GROUPS = ("Limits", "Budget", "Optional limits")


class FormError(ValueError):
    """A form value the schema refuses: `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    kind: str  # "integer", "number", "choice" or "text"
    required: bool
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    group: str = "Limits"

    @property
    def step(self) -> str:
        return "1" if self.kind == "integer" else "any"

    def parse(self, raw: str) -> Any:
        """The table's value of a non-empty input; FormError when the schema refuses it."""
        if self.kind == "choice":
            if raw not in self.choices:
                raise FormError(self.name, f"must be one of {', '.join(self.choices)}")
            return raw
        if self.kind == "text":
            return raw
        try:
            value: float = int(raw) if self.kind == "integer" else float(raw)
        except ValueError:
            what = "a whole number" if self.kind == "integer" else "a number"
            raise FormError(self.name, f"must be {what}, got {raw!r}") from None
        if not math.isfinite(value):
            raise FormError(self.name, f"must be a finite number, got {raw!r}")
        if self.minimum is not None and value < self.minimum:
            raise FormError(self.name, f"must be at least {self.minimum:g}")
        if self.exclusive_minimum is not None and value <= self.exclusive_minimum:
            raise FormError(self.name, f"must be more than {self.exclusive_minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise FormError(self.name, f"must be at most {self.maximum:g}")
        return value


def _label(name: str) -> str:
    return name.replace("_", " ").capitalize().replace(" usd", " (USD)")


def fields_of(schema_name: str) -> list[Field]:
    """The form of one of the admin API's tables, in its schema's order, grouped: required limits,
    budget fields, the optional rest."""
    schema = component_schemas()[schema_name]
    required = set(schema.get("required", ()))
    fields = []
    for name, prop in schema["properties"].items():
        kind = "choice" if "enum" in prop else str(prop.get("type", "text"))
        if kind not in ("integer", "number", "choice"):
            kind = "text"
        group = "Limits" if name in required else "Optional limits"
        if name.startswith("budget_"):
            group = "Budget"
        fields.append(
            Field(
                name=name,
                label=_label(name),
                kind=kind,
                required=name in required,
                choices=tuple(prop.get("enum", ())),
                minimum=prop.get("minimum"),
                maximum=prop.get("maximum"),
                exclusive_minimum=prop.get("exclusiveMinimum"),
                group=group,
            )
        )
    return sorted(fields, key=lambda f: GROUPS.index(f.group))


def table_from_form(fields: list[Field], form: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON table of a posted form: each filled input parsed, the empty ones left out; a
    required one left empty is a FormError."""
    table: dict[str, Any] = {}
    for field in fields:
        raw = str(form.get(field.name) or "").strip()
        if not raw:
            if field.required:
                raise FormError(field.name, "is required")
            continue
        table[field.name] = field.parse(raw)
    return table


def required(form: Mapping[str, Any], name: str) -> str:
    """A form's text input that must not be empty (a name, a path); FormError otherwise."""
    value = str(form.get(name) or "").strip()
    if not value:
        raise FormError(name, "is required")
    return value
