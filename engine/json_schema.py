"""Bounds that a JSON schema gets before it constrains output: plain JSON in, JSON out, no torch.

The gateway bounds the schemas of response formats and tools with it (gateway/openai/tools.py)
without loading the engine's torch side; engine/grammar/backend.py compiles the bounded schema.
"""

from __future__ import annotations

from typing import Any

# Bounds against runaway output (a small model runs an unbounded field to max_tokens): numbers
# without a bound get JSON's interoperable range (RFC 8259: doubles are exact to 2**53 - 1) and
# at most NUMBER_DECIMALS decimals without `multipleOf`; an email's local part gets RFC 5321's 64
# octets and a URI's scheme 64 characters, the parts that may end only at a separator.
MAX_SAFE_INTEGER = 2**53 - 1
NUMBER_DECIMALS = 6
FORMAT_PREFIXES = {"email": "^[^@]{1,64}@", "uri": "^[A-Za-z][A-Za-z0-9+.-]{0,63}:"}


def bound_schema(schema: Any) -> Any:
    """`schema` with `minimum`/`maximum` +-MAX_SAFE_INTEGER added to every integer or number
    subschema that lacks them, `multipleOf` 10**-NUMBER_DECIMALS to every number subschema that
    lacks one, and FORMAT_PREFIXES' bound as the `pattern` of every email or URI string without one
    (a copy; everything else unchanged). An output of the bounded schema validates against the
    original."""
    if isinstance(schema, list):
        return [bound_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bound_schema(value) for key, value in schema.items()}
    prefix = FORMAT_PREFIXES.get(str(schema.get("format")))
    if prefix is not None and "pattern" not in out:
        out["pattern"] = prefix
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "integer" in kinds or "number" in kinds:
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_SAFE_INTEGER
    if "number" in kinds and "multipleOf" not in out:
        out["multipleOf"] = 10.0**-NUMBER_DECIMALS
    return out
