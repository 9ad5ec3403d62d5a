"""`StructuredOutputsParams`: what a request's output must match, with vLLM's names.

Exactly one constraint per request: a JSON schema (`json`), any JSON object (`json_object`), a regular expression
(`regex`), one of a list of strings (`choice`), or a grammar (`grammar`: Lark, or GBNF as llama.cpp writes it).
Whitespace inside JSON is bounded (see grammars.JSON_WHITESPACE) unless `disable_any_whitespace` (compact JSON) or a
`whitespace_pattern` says otherwise; `disable_additional_properties` closes every object to keys it does not
list. A value that cannot work raises SamplingParamsError naming the field, so the server answers 400.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from nanoserve.errors import RequestError

__all__ = ["StructuredOutputsParams"]

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# What one constraint may weigh: each is compiled before the request is admitted, and past these a compile takes
# seconds to minutes (100,000 choices: 69 s, then a failure inside the compiler), on a thread other requests share.
MAX_CHOICES = 4096
CHOICES_CHARS = 256 * 1024  # all the choices together
TEXT_CHARS = {"regex": 10_000, "grammar": 100_000, "whitespace_pattern": 1_000}
SCHEMA_CHARS = 100_000  # the JSON schema, as compact JSON text


class StructuredOutputsError(RequestError):
    """A structured-outputs value the engine refuses; `field` names where it was given."""

    field = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"structured_outputs takes exactly one of {', '.join(_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}; send one constraint per request")
        if isinstance(self.json, str):
            try:
                schema = jsonlib.loads(self.json)
            except ValueError as e:
                raise StructuredOutputsError(f"structured_outputs.json is not valid JSON ({e}); send a JSON "
                                             "schema object or its text") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (Mapping, bool)):
            raise StructuredOutputsError(f"structured_outputs.json must be a JSON schema (an object), got "
                                         f"{type(self.json).__name__}")
        self._check_sizes()
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputsError("structured_outputs.choice must be a non-empty list of non-empty "
                                             "strings, e.g. ['yes', 'no']")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name) not in (None, True, False):
                raise StructuredOutputsError(f"structured_outputs.{name} must be true or false")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise StructuredOutputsError("disable_any_whitespace and whitespace_pattern disagree; send one")

    def _check_sizes(self) -> None:
        """Refuse a constraint past the limits above, naming the limit, before anything compiles it."""
        for name, limit in TEXT_CHARS.items():
            value = getattr(self, name)
            if isinstance(value, str) and len(value) > limit:
                raise StructuredOutputsError(f"structured_outputs.{name} is {len(value):,} characters; the limit is "
                                             f"{limit:,}; send a shorter one")
        if isinstance(self.choice, Sequence) and not isinstance(self.choice, str):
            if len(self.choice) > MAX_CHOICES:
                raise StructuredOutputsError(f"structured_outputs.choice (guided_choice) has {len(self.choice):,} "
                                             f"entries; the limit is {MAX_CHOICES:,}; send fewer choices, or a "
                                             "regex or grammar that covers them")
            chars = sum(len(c) for c in self.choice if isinstance(c, str))
            if chars > CHOICES_CHARS:
                raise StructuredOutputsError(f"structured_outputs.choice (guided_choice) is {chars:,} characters in "
                                             f"all; the limit is {CHOICES_CHARS:,}; send shorter or fewer choices")
        if isinstance(self.json, Mapping):
            chars = len(jsonlib.dumps(self.json, separators=(",", ":"), default=str))
            if chars > SCHEMA_CHARS:
                raise StructuredOutputsError(f"structured_outputs.json is a schema of {chars:,} characters (as "
                                             f"compact JSON); the limit is {SCHEMA_CHARS:,}; send a smaller one")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint: equal constraints share one compiled grammar."""
        return jsonlib.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True,
                             default=list)

    @classmethod
    def coerce(cls, value: object) -> StructuredOutputsParams | None:
        """A StructuredOutputsParams, or a dict of its fields (the body's form), as the dataclass."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise StructuredOutputsError(f"structured_outputs has unknown fields {unknown}; it takes "
                                             f"{', '.join(sorted(names))}")
            return cls(**value)
        raise StructuredOutputsError(f"structured_outputs must be a StructuredOutputsParams or a dict, got "
                                     f"{type(value).__name__}")
