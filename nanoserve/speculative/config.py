"""SpeculativeConfig: vLLM's `speculative_config` (a dict offline, JSON on the command line), checked at start.

Only what is built is accepted: an unknown method or key is refused with the list of supported ones, never
carried and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nanoserve.errors import ConfigError

METHODS = ("ngram",)
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
MAX_DRAFT = 16  # drafted tokens a step may verify for one request


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafted tokens a request verifies in a step, at most
    prompt_lookup_max: int  # the longest suffix of the sequence looked up in its earlier tokens
    prompt_lookup_min: int  # ... and the shortest

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None for None or {}; else the config from a dict or its JSON text, or ConfigError saying what to fix."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not JSON ({e}); pass e.g. "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        if not value:
            return None
        unknown = sorted(set(value) - KEYS)
        if unknown:
            raise ConfigError(f"speculative_config keys {unknown} are not supported; supported: {sorted(KEYS)}")
        method = value.get("method")
        if method not in METHODS:
            raise ConfigError(f"speculative_config method {method!r} is not supported; supported: "
                              f"{', '.join(METHODS)}")
        return cls._ngram(value)

    @classmethod
    def _ngram(cls, value: dict) -> SpeculativeConfig:
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT:
            raise ConfigError(f"speculative_config needs num_speculative_tokens, an integer in 1..{MAX_DRAFT}; "
                              f"got {k!r}")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low = high if low is None else low  # vLLM's rule: one given stands for both, neither means 5
        high = low if high is None else high
        low, high = (5, 5) if low is None else (low, high)
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
        if low > high:
            raise ConfigError(f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls("ngram", k, high, low)

    def as_json(self) -> str:
        return json.dumps({"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min})
