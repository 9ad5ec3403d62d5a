"""Public sampling names in one place: `SamplingParams` lives in `sampling_params`, `Sampler` in `sampler`."""

from __future__ import annotations

from nanoserve.sampler import Sampler, SampleResult, SamplingRow, TokenLogprobs
from nanoserve.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, SamplingParamsError

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "SamplingRow",
    "TokenLogprobs",
]
