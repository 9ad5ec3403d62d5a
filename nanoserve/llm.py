"""LLM: the offline API, shaped like vLLM's so scripts carry over (generate, chat, beam_search, get_tokenizer)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.errors import ConfigError, RequestError
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams

# vLLM's prompt forms: a string, token ids, TextPrompt {"prompt": ...} or TokensPrompt {"prompt_token_ids": ...}.
Prompt = str | list[int] | Mapping[str, Any]
_TEXT_KEYS = {"prompt", "multi_modal_data", "mm_processor_kwargs", "cache_salt"}
_TOKENS_KEYS = {"prompt_token_ids", "prompt", "multi_modal_data", "mm_processor_kwargs", "cache_salt",
                "token_type_ids"}


class LLM:
    """`LLM(model=None, **engine_flags)`; with no model the embedded default model runs."""

    def __init__(self, model: str | None = None, data_parallel_size: int = 1, **engine_flags):
        """`data_parallel_size` other than 1 is refused: replicas are served (`nanoserve serve
        --data-parallel-size N`), not run in one offline process."""
        if data_parallel_size != 1:
            raise ConfigError(f"LLM(data_parallel_size={data_parallel_size}) is not built: serve replicas with "
                              "`nanoserve serve --data-parallel-size N`, or run one LLM per process, each on its "
                              "own share of the machine")
        self.engine = Engine(EngineConfig.from_flags(model=model, **engine_flags))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer: encode, decode, __call__, len(), apply_chat_template, eos_token_id."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs come back in prompt order.

        A prompt is a string, a list of token ids, {"prompt": text} or {"prompt_token_ids": ids}; `prompts` is
        one of those or a list mixing them. `use_tqdm` shows a progress bar over finished prompts.
        """
        prompts = [_prompt_input(p, i) for i, p in enumerate(_as_prompt_list(prompts))]
        params = self._params_for(len(prompts), sampling_params)
        ids = []
        try:
            for (prompt, salt), p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, cache_salt=salt, streamed=False))  # answered at the end
        except Exception:
            for rid in ids:  # refuse the whole call without leaving half of it queued
                self.engine.abort(rid)
            self._drain()
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation (one, or a list of them) with the chat template, then generate.

        The keywords are vLLM's; any other keyword is a TypeError rather than a template variable, so a typo is
        never rendered silently. Template variables go in `chat_template_kwargs`.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        if documents is not None:
            extra["documents"] = documents
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template,
                continue_final_message=continue_final_message, **extra,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params, use_tqdm: bool = False) -> list:
        """vLLM's offline beam search (nanoserve.beam_search): per prompt, a BeamSearchOutput whose `sequences`
        are the `beam_width` best beams, best first, each with the prompt's tokens and its own, and their text."""
        import asyncio

        from nanoserve.beam_search import BeamSearchOutput, BeamSearchSequence, beam_search

        ends = set(self.engine.tokenizer.eos_token_ids)
        outputs = []
        for i, prompt in enumerate(_as_prompt_list(prompts)):
            text_or_ids, _ = _prompt_input(prompt, i)
            ids = self.engine.tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
            beams = asyncio.run(beam_search(self._beam_step, ids, params, ends))
            outputs.append(BeamSearchOutput([BeamSearchSequence(
                ids + b.tokens, b.logprobs, b.cum_logprob,
                self.engine.tokenizer.decode(ids + b.tokens, skip_special_tokens=params.skip_special_tokens),
                b.finish_reason, b.stop_reason) for b in beams]))
        return outputs

    async def _beam_step(self, prompts: list[list[int]], alternatives: int, allowed) -> list:
        """One token of every beam, with the logprobs the search reads (run to its end here: this is offline)."""
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False,
                                logprobs=alternatives, logprob_token_ids=allowed)
        done = self.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [out.outputs[0].logprobs.entries()[0] for out in done]

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

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done; a request with n > 1 comes back with all n completions."""
        final: dict[str, RequestOutput] = {}
        completions: dict[str, dict] = {rid: {} for rid in ids}
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    completions[out.request_id][out.outputs[0].index] = out.outputs[0]
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [dataclasses.replace(final[i], outputs=[c for _, c in sorted(completions[i].items())]) for i in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()


def _as_prompt_list(prompts) -> list:
    """One prompt or a list of them: a string, a dict or a flat list of ints is one prompt."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(_is_token(t) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise RequestError(f"prompts must be a string, a list of token ids, a prompt dict or a list of those, got "
                       f"{type(prompts).__name__}")


def _prompt_input(prompt, i: int) -> tuple[str | list[int], str | None]:
    """A prompt of any accepted form as the text or token ids the engine takes, and its cache salt; anything
    else is refused."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Sequence) and all(_is_token(t) for t in prompt):
        return list(prompt), None
    if isinstance(prompt, Mapping):
        for key in ("multi_modal_data", "mm_processor_kwargs", "token_type_ids"):
            if prompt.get(key) is not None:
                raise RequestError(f"prompt {i} has {key}, but this model takes text only; send text or token ids")
        keys = _TOKENS_KEYS if "prompt_token_ids" in prompt else _TEXT_KEYS
        unknown = sorted(set(prompt) - keys)
        if unknown:
            raise RequestError(f"prompt {i} has unknown keys {unknown}; a prompt dict is {{'prompt': text}} or "
                               "{'prompt_token_ids': [ids]}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(_is_token(t) for t in ids):
                raise RequestError(f"prompt {i}: prompt_token_ids must be a list of ints")
            return list(ids), prompt.get("cache_salt")
        if not isinstance(prompt.get("prompt"), str):
            raise RequestError(f"prompt {i}: 'prompt' must be a string (or send 'prompt_token_ids')")
        return prompt["prompt"], prompt.get("cache_salt")
    raise RequestError(f"prompt {i} must be a string, a list of token ids, {{'prompt': text}} or "
                       f"{{'prompt_token_ids': [ids]}}, got {type(prompt).__name__}")


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
