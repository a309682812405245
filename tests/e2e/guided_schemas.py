"""Twenty JSON schemas for the structured-output tests: nested objects, enums, arrays, numbers, required fields."""

STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = [
    obj({"name": STR}),
    obj({"name": STR, "age": INT}),
    obj({"title": STR, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    obj({"ok": BOOL, "count": INT}),
    obj({"price": NUM, "currency": {"enum": ["USD", "EUR"]}}),
    obj({"tags": {"type": "array", "items": STR, "maxItems": 3}}),
    obj({"scores": {"type": "array", "items": INT, "minItems": 1, "maxItems": 4}}),
    obj({"point": obj({"x": NUM, "y": NUM})}),
    obj({"user": obj({"name": STR, "address": obj({"city": STR, "zip": STR})})}),
    obj({"items": {"type": "array", "items": obj({"id": INT, "label": STR}), "maxItems": 2}}),
    obj({"name": STR, "nickname": STR}, required=["name"]),
    obj({"kind": {"enum": ["function", "class", "module"]}, "doc": STR}),
    obj({"value": {"anyOf": [INT, STR]}}),
    obj({"status": {"type": "string", "enum": ["open", "closed"]}, "priority": {"type": "integer", "minimum": 1,
                                                                                "maximum": 5}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}}),
    obj({"meta": obj({"version": STR, "stable": BOOL}), "files": {"type": "array", "items": STR, "maxItems": 2}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}, "label": {"enum": ["low", "high"]}}),
    obj({"a": obj({"b": obj({"c": obj({"d": {"enum": [1, 2, 3]}})})})}),
]
