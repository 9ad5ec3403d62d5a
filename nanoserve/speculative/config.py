"""SpeculativeConfig: vLLM's `speculative_config` (a dict offline, JSON on the command line), checked at start.

Only what is built is accepted: an unknown method or key is refused with the list of supported ones, never
carried and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nanoserve.errors import ConfigError, shown

NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}  # vLLM's
METHODS = {"ngram": NGRAM_KEYS, "suffix": tuple(SUFFIX_DEFAULTS)}  # each method's own keys
KEYS = {"method", "num_speculative_tokens", *NGRAM_KEYS, *SUFFIX_DEFAULTS}
MAX_DRAFT = 16  # drafted tokens a step may verify for one request


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafted tokens a request verifies in a step, at most
    prompt_lookup_max: int  # the longest suffix of the sequence looked up in its earlier tokens
    prompt_lookup_min: int  # ... and the shortest
    suffix: dict | None = None  # the suffix method's suffix_decoding_* values, None for ngram

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
            raise ConfigError(f"speculative_config method {shown(method)} is not supported; supported: "
                              f"{', '.join(METHODS)}")
        foreign = sorted(key for other, keys in METHODS.items() if other != method for key in keys if key in value)
        if foreign:
            raise ConfigError(f"speculative_config keys {foreign} do not apply to method {method!r}; its keys: "
                              f"{sorted({'method', 'num_speculative_tokens', *METHODS[method]})}")
        return cls._ngram(value) if method == "ngram" else cls._suffix(value)

    @staticmethod
    def _draft_length(value: dict, default: int | None = None) -> int:
        k = value.get("num_speculative_tokens", default)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT:
            raise ConfigError(f"speculative_config needs num_speculative_tokens, an integer in 1..{MAX_DRAFT}; "
                              f"got {shown(k)}")
        return k

    @classmethod
    def _suffix(cls, value: dict) -> SpeculativeConfig:
        """vLLM's suffix decoding keys and defaults; num_speculative_tokens defaults to the tree depth, as
        vLLM's does, capped at the MAX_DRAFT tokens a request verifies in a step here."""
        suffix = {key: value.get(key, default) for key, default in SUFFIX_DEFAULTS.items()}
        for key in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            n, low = suffix[key], 1 if key.endswith("depth") else 0
            if not isinstance(n, int) or isinstance(n, bool) or n < low:
                raise ConfigError(f"speculative_config {key} must be an integer >= {low}, got {shown(n)}")
        factor, prob = suffix["suffix_decoding_max_spec_factor"], suffix["suffix_decoding_min_token_prob"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= MAX_DRAFT:
            raise ConfigError(f"speculative_config suffix_decoding_max_spec_factor must be a number > 0 and at most "
                              f"{MAX_DRAFT} (a request drafts at most {MAX_DRAFT} tokens a step, so a larger factor "
                              f"drafts no more), got {shown(factor)}")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ConfigError(f"speculative_config suffix_decoding_min_token_prob must be in [0, 1], "
                              f"got {shown(prob)}")
        k = cls._draft_length(value, min(suffix["suffix_decoding_max_tree_depth"], MAX_DRAFT))
        return cls("suffix", k, 0, 0, suffix)

    @classmethod
    def _ngram(cls, value: dict) -> SpeculativeConfig:
        k = cls._draft_length(value)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low = high if low is None else low  # vLLM's rule: one given stands for both, neither means 5
        high = low if high is None else high
        low, high = (5, 5) if low is None else (low, high)
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"speculative_config {name} must be an integer >= 1, got {shown(n)}")
        if low > high:
            raise ConfigError(f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls("ngram", k, high, low)

    def as_dict(self) -> dict:
        """The config as vLLM spells it, every default filled in."""
        own = self.suffix if self.method == "suffix" else {"prompt_lookup_max": self.prompt_lookup_max,
                                                            "prompt_lookup_min": self.prompt_lookup_min}
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens, **own}

    def as_json(self) -> str:
        return json.dumps(self.as_dict())
