"""A function's parameters schema placed inside a larger one (the `required` array of calls, the Hermes grammar's
call object), with its local references kept pointing where they pointed.

A schema's `$ref: "#/$defs/X"` is relative to its own root. Nested under `anyOf[i].properties.arguments` of a
wrapper, that root is the wrapper's, where `/$defs/X` does not exist. So each function's `$defs` (and the older
`definitions`) move up to the wrapper's `$defs` under a name unique to the function, and its references are
rewritten to match; a reference to the function's own root (`#`, recursion) points at a copy of it kept there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEF_KEYS = ("$defs", "definitions")


def embedded(parameters: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the schema to nest, the definitions the wrapper's root must carry under `$defs`) for one function's
    parameters; `prefix` keeps functions' definitions of the same name apart."""
    schema = dict(parameters)
    local = {(key, name): sub for key in DEF_KEYS if isinstance(schema.get(key), Mapping)
             for name, sub in schema.pop(key).items()}
    names = {_pointer(key, name): f"{prefix}{name}" for key, name in local}
    root = f"{prefix}__root"
    needs_root = _refers_to_root(schema) or any(_refers_to_root(sub) for sub in local.values())

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(n) for n in node]
        if not isinstance(node, Mapping):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = _moved(ref, names, root)
        return out

    defs = {names[_pointer(key, name)]: rewrite(sub) for (key, name), sub in local.items()}
    schema = rewrite(schema)
    if needs_root:
        defs[root] = schema
    return schema, defs


def _pointer(key: str, name: str) -> str:
    return f"#/{key}/" + name.replace("~", "~0").replace("/", "~1")


def _moved(ref: str, names: dict[str, str], root: str) -> str:
    """Where a local reference points once the definitions moved up; `#` (the function's root) is `root`."""
    if ref in ("#", "#/"):
        return f"#/$defs/{root}"
    for pointer, name in names.items():
        if ref == pointer or ref.startswith(pointer + "/"):
            return f"#/$defs/{name}" + ref[len(pointer):]
    return f"#/$defs/{root}" + ref[1:]  # a pointer into the function's own body (#/properties/x)


def _refers_to_root(node: Any) -> bool:
    if isinstance(node, list):
        return any(_refers_to_root(n) for n in node)
    if not isinstance(node, Mapping):
        return False
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
        return True
    return any(_refers_to_root(v) for v in node.values())
