"""JSON schemas the structured-output tests constrain the real model with (shared helper).

Nested objects, arrays with bounds, enums, ``anyOf``, string formats and lengths,
``additionalProperties: false``, numbers with ranges, ``$defs`` references. Each entry is
(name, instruction, schema).
"""

from __future__ import annotations

from typing import Any

_OBJ = {"type": "object", "additionalProperties": False}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {**_OBJ, "properties": props, "required": list(props) if required is None else required, **extra}


_NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "a person", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("colour", "a colour", _obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("flag", "a yes/no answer", _obj({"answer": {"type": "boolean"}})),
    ("point", "a 2D point", _obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("tags", "up to three tags", _obj({"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}})),
    ("scores", "two scores", _obj({"scores": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}})),
    ("nested", "a book with its author", _obj({"title": _NAME, "author": _obj({"name": _NAME, "born": {"type": "integer"}})})),
    ("deep", "three nested levels", _obj({"a": _obj({"b": _obj({"c": {"type": "string", "maxLength": 10}})})})),
    ("optional", "a city, the country optional", _obj({"city": _NAME, "country": _NAME}, required=["city"])),
    ("any_of", "a number or a word", _obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}})),
    ("nullable", "a nickname or null", _obj({"nickname": {"type": ["string", "null"], "maxLength": 12}})),
    ("date", "a date", _obj({"date": {"type": "string", "format": "date"}})),
    ("email", "an email address", _obj({"email": {"type": "string", "format": "email"}})),
    ("uuid", "an identifier", _obj({"id": {"type": "string", "format": "uuid"}})),
    ("pattern", "a product code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}})),
    ("const", "version one", _obj({"version": {"const": 1}, "name": _NAME})),
    ("int_enum", "a dice roll", _obj({"roll": {"enum": [1, 2, 3, 4, 5, 6]}})),
    ("range", "a temperature", _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("list_of_objects", "two people", _obj({"people": {"type": "array", "minItems": 1, "maxItems": 2,
                                                       "items": _obj({"name": _NAME, "age": {"type": "integer"}})}})),
    ("defs", "an order with one line", {
        **_obj({"line": {"$ref": "#/$defs/line"}}),
        "$defs": {"line": _obj({"item": _NAME, "qty": {"type": "integer", "minimum": 1}})},
    }),
    ("one_of", "a circle or a square", _obj({"shape": {"oneOf": [
        _obj({"kind": {"const": "circle"}, "r": {"type": "number"}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "number"}}),
    ]}})),
    ("string_array", "the days of a weekend", {"type": "array", "items": {"enum": ["Saturday", "Sunday"]}, "minItems": 2,
                                               "maxItems": 2}),
    ("top_string", "a word", {"type": "string", "maxLength": 16}),
    ("top_integer", "a number", {"type": "integer", "minimum": 0, "maximum": 1000}),
    ("top_boolean", "true or false", {"type": "boolean"}),
    ("many_fields", "a car", _obj({"make": _NAME, "model": _NAME, "year": {"type": "integer", "minimum": 1900,
                                   "maximum": 2030}, "electric": {"type": "boolean"}})),
    ("matrix", "a 2x2 matrix", _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer"}}}})),
    ("empty_object", "an empty object", _obj({})),
    ("map", "word counts", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}),
    ("all_of", "a named thing with an id", {"allOf": [_obj({"name": _NAME, "id": {"type": "integer"}})]}),
    ("any_json", "anything", {}),
]
