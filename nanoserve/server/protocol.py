"""The OpenAI request shapes nanoserve accepts, validated strictly, and the error body it answers with.

Unknown fields are refused (a typo'd field silently ignored is a wrong answer with a 200), and every
sampling field maps onto SamplingParams, whose own checks give the messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both routes; names follow OpenAI's API, with vLLM's extensions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, logprobs: int | None, default_max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, min_tokens=self.min_tokens,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True

    def chat_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
