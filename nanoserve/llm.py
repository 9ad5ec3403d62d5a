"""LLM: the offline API, shaped like vLLM's so scripts carry over (generate, chat)."""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.errors import RequestError
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=None, **engine_flags)`; with no model the embedded default model runs."""

    def __init__(self, model: str | None = None, **engine_flags):
        self.engine = Engine(EngineConfig.from_flags(model=model, **engine_flags))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_for(len(prompts), sampling_params)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:  # refuse the whole call without leaving half of it queued
                self.engine.abort(rid)
            self._drain()
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _params_for(n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise RequestError(f"got {n} prompts but {len(params)} sampling params; pass one, or one per prompt")
        return params

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
