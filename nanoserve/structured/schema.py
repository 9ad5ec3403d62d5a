"""JSON-schema rewrites that structured outputs apply before compiling."""

from __future__ import annotations

from typing import Any

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (`additionalProperties: false`)
    unless it says otherwise: vLLM's disable_additional_properties. Tool calls use it, since arguments the function
    does not declare are never wanted, and an open object lets a model write keys without end."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = closed(out[key])
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
