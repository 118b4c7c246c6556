"""A set of varied JSON schemas for structured output: shared by the grammar benches and the tests.

Each entry: a name, the schema, and a user prompt that asks for it. They cover what clients send:
nested objects, arrays (with bounds), enums and consts, numbers and integers with bounds, optional
fields, `anyOf`/nullable, `$ref`/`$defs`, string lengths, patterns and the formats the grammar
engine supports (date, date-time, email, uuid, ipv4, uri). Schemas are kept bounded (maxItems,
maxLength) where a small model would otherwise ramble, as a client asking for short output would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


_NAME = {"type": "string", "minLength": 1, "maxLength": 40}
_SHORT = {"type": "string", "maxLength": 60}

SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
        "Describe a person called Ada who is 36.",
    ),
    SchemaCase(
        "city",
        _obj({"city": _NAME, "country": _NAME, "population": {"type": "integer", "minimum": 0}}),
        "Give the capital of France and its population.",
    ),
    SchemaCase(
        "boolean_answer",
        _obj({"answer": {"type": "boolean"}, "reason": _SHORT}),
        "Is the sky blue? Answer with a reason.",
    ),
    SchemaCase(
        "sentiment_enum",
        _obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        "Classify the sentiment of: 'I love this phone'.",
    ),
    SchemaCase(
        "rating_bounds",
        _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": _SHORT}),
        "Rate a pizza you liked.",
    ),
    SchemaCase(
        "temperature",
        _obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60}, "unit": {"const": "C"}}),
        "What is a warm summer temperature?",
    ),
    SchemaCase(
        "tags_array",
        _obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 20},
                    "minItems": 1,
                    "maxItems": 5,
                }
            }
        ),
        "Give tags for a blog post about baking bread.",
    ),
    SchemaCase(
        "numbers_array",
        _obj({"values": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 6}}),
        "List some prime numbers.",
    ),
    SchemaCase(
        "nested_address",
        _obj(
            {
                "name": _NAME,
                "address": _obj(
                    {"street": _SHORT, "city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                ),
            }
        ),
        "Give a fictional person's address in the US.",
    ),
    SchemaCase(
        "optional_fields",
        _obj({"title": _NAME, "subtitle": _SHORT, "year": {"type": "integer"}}, required=["title"]),
        "Describe a book.",
    ),
    SchemaCase(
        "nullable", _obj({"name": _NAME, "nickname": {"anyOf": [_NAME, {"type": "null"}]}}), "Describe a cat."
    ),
    SchemaCase(
        "any_of_shapes",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                        _obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}}),
                    ]
                }
            }
        ),
        "Describe a geometric shape.",
    ),
    SchemaCase(
        "date_format",
        _obj({"event": _NAME, "date": {"type": "string", "format": "date"}}),
        "When did the first moon landing happen?",
    ),
    SchemaCase(
        "datetime_format",
        _obj({"meeting": _NAME, "start": {"type": "string", "format": "date-time"}}),
        "Schedule a meeting for tomorrow morning.",
    ),
    SchemaCase(
        "email_format",
        _obj({"name": _NAME, "email": {"type": "string", "format": "email"}}),
        "Make up a contact with an email address.",
    ),
    SchemaCase(
        "uuid_format",
        _obj({"id": {"type": "string", "format": "uuid"}, "label": _NAME}),
        "Create a record with an id.",
    ),
    SchemaCase(
        "ipv4_format",
        _obj({"host": _NAME, "ip": {"type": "string", "format": "ipv4"}}),
        "Give a server's hostname and address.",
    ),
    SchemaCase(
        "uri_format",
        _obj({"site": _NAME, "url": {"type": "string", "format": "uri"}}),
        "Name a website and its address.",
    ),
    SchemaCase(
        "pattern_code",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
        "Give a product code.",
    ),
    SchemaCase(
        "array_of_objects",
        _obj(
            {
                "items": {
                    "type": "array",
                    "maxItems": 4,
                    "minItems": 1,
                    "items": _obj({"name": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}),
                }
            }
        ),
        "Write a short shopping list.",
    ),
    SchemaCase(
        "deep_nesting",
        _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer"}})})})}),
        "Fill in a nested structure with a number.",
    ),
    SchemaCase(
        "defs_ref",
        {
            "$defs": {"point": _obj({"x": {"type": "number"}, "y": {"type": "number"}})},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
        "Give a line segment's two end points.",
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "title": _NAME,
                "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                "ingredients": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 6},
                "vegetarian": {"type": "boolean"},
            }
        ),
        "Give a simple pancake recipe.",
    ),
    SchemaCase(
        "weather_report",
        _obj(
            {
                "location": _NAME,
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "high": {"type": "number"},
                "low": {"type": "number"},
            }
        ),
        "Report the weather in London.",
    ),
    SchemaCase(
        "user_profile",
        _obj(
            {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "role": {"enum": ["admin", "editor", "viewer"]},
                "active": {"type": "boolean"},
                "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
            }
        ),
        "Create a user profile for an editor.",
    ),
    SchemaCase(
        "multiple_choice",
        _obj(
            {
                "question": _SHORT,
                "choices": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 2,
                    "maxItems": 4,
                },
                "answer_index": {"type": "integer", "minimum": 0, "maximum": 3},
            }
        ),
        "Write a quiz question about planets.",
    ),
    SchemaCase(
        "key_value_map",
        _obj({"counts": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 4}}),
        "Count the letters in the word 'apple'.",
    ),
    SchemaCase(
        "tuple_items",
        _obj(
            {
                "pair": {
                    "type": "array",
                    "prefixItems": [_NAME, {"type": "integer"}],
                    "items": False,
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
        "Give a name and an age.",
    ),
    SchemaCase(
        "one_of_numbers",
        _obj({"value": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}),
        "Give a value.",
    ),
    SchemaCase(
        "event_list",
        _obj(
            {
                "events": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "title": _NAME,
                            "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                            "all_day": {"type": "boolean"},
                        }
                    ),
                }
            }
        ),
        "Plan three events for the week.",
    ),
    SchemaCase(
        "order",
        _obj(
            {
                "order_id": {"type": "integer", "minimum": 1},
                "customer": _obj({"name": _NAME, "vip": {"type": "boolean"}}),
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z0-9]{4,8}$"},
                            "price": {"type": "number", "minimum": 0},
                        }
                    ),
                },
                "status": {"enum": ["new", "paid", "shipped"]},
            }
        ),
        "Create an order for two items.",
    ),
    SchemaCase(
        "translation",
        _obj({"source": {"const": "en"}, "target": {"enum": ["fr", "de", "es"]}, "text": _SHORT}),
        "Translate 'good morning' to French.",
    ),
    SchemaCase(
        "empty_object_allowed",
        {"type": "object", "properties": {"note": _SHORT}, "additionalProperties": False},
        "Return an object, optionally with a note.",
    ),
    SchemaCase("string_root", {"type": "string", "maxLength": 40}, "Say hello."),
)
