"""ModelRunner: turns a SchedulerOutput into a StepResult.

It owns what a step is computed with (the model, the KV cache, the paged read, the sampler), picks the path for
each step (the planned decode fast path, its captured replay, or the general batch; through the tensor-parallel
group when there is one) and publishes what those paths counted. Nothing outside knows about capture, tensor
parallelism or the read mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nanoserve.attention.dispatch import paged_read_for
from nanoserve.config import EngineConfig
from nanoserve.kv.cache import KVCache, kv_layout
from nanoserve.model.loader import LoadedModel
from nanoserve.numerics import numerics_of
from nanoserve.parallel.driver import ParallelModel
from nanoserve.runner import loading, sizing
from nanoserve.runner.batch import general_batch
from nanoserve.runner.decode.capture import CapturedDecode
from nanoserve.runner.decode.path import DecodePath
from nanoserve.runner.result import StepResult
from nanoserve.sampler import token_logprobs
from nanoserve.sampling import Sampler, SamplingRow
from nanoserve.speculative.verify import accept
from nanoserve.structured.mask import GrammarMasker

log = logging.getLogger("nanoserve.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 progress: Callable[[str], None] = lambda phase: None):
        self.config, self.progress = config, progress
        self.device = config.torch_device()
        self.read = paged_read_for(config.streamed_read, config.read_block, self.device, config.batch_invariant)
        self.parallel = None
        if loaded is None:
            loaded, self.parallel = loading.load(config, self.device, progress)
        self.loaded = loaded
        # model_config is the whole model's (the vocabulary, the heads); self.model.config is this rank's part
        self.model, self.model_config = loaded.model, loaded.config
        self.forward = self.model if self.parallel is None else \
            ParallelModel(self.model, self.parallel, self.model_config.vocab_size)
        self.dtype = next(self.model.parameters()).dtype
        progress("sizing the KV pool")
        self.num_blocks = sizing.pool_blocks(self)
        self.cache = KVCache(self.model.config, self.num_blocks, config.block_size, self.dtype, self.device,
                             kv_layout(config, self.model.fused is not None))
        self.not_invariant = loading.not_invariant_reason(config, self.model, self.device)
        if self.not_invariant is not None and config.batch_invariant:
            log.warning("batch invariance does not hold here: %s; outputs may depend on the batch",
                        self.not_invariant)
        self.numerics = numerics_of(self.model, self.cache.k.dtype,
                                    loading.determinism_text(config, self.not_invariant))
        if self.parallel is not None:
            self.parallel.build_pools(self.model, self.cache)
        self.max_model_len = sizing.resolve_max_model_len(
            config.max_model_len, self.model_config.max_position_embeddings, (self.num_blocks - 1) * config.block_size,
            self.model_config.sliding_window)
        self.decode_path, self.captured = self.decode_fast_path(self.cache, self.max_model_len)
        if self.captured is not None:
            progress("capturing CUDA graphs")
            self.captured.capture()
        fused = self.loaded.fused.kernels if self.loaded.fused is not None else None
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed), GrammarMasker(),
                               argmax=fused.argmax if fused is not None else None)
        self.steps = 0  # steps executed (a failed one too)

    def decode_fast_path(self, cache: KVCache, max_model_len: int):
        """The DecodePath for the switches in force (None when all are off), and its CapturedDecode if capturing."""
        sw, cfg = self.config.decode_switches(), self.config
        if not any(sw.values()):
            return None, None
        path = DecodePath(cfg.max_num_seqs, -(-max_model_len // cfg.block_size), cfg.block_size, self.device,
                          buckets=sw["buckets"], persistent=sw["persistent"], compaction=sw["compaction"],
                          full_logits=sw["capture"], width_axis=not cfg.streamed_read)
        captured = None
        if sw["capture"]:
            mc = self.model_config
            captured = CapturedDecode(self.model, cache, self.read, path, heads=mc.num_heads, layers=mc.num_layers)
        return path, captured

    # ---- a step ---------------------------------------------------------------------------------------
    def execute(self, sched) -> StepResult:
        """Compute the scheduled chunks' K/V and logits, score their prompt logprobs, sample the rows that end a
        sequence's known tokens, and keep the drafts that sampling agrees with (speculative/verify.py)."""
        self.steps += 1
        logits, sampled, prompt_rows, before = self._logits(sched)
        prompt_logprobs = self._prompt_logprobs(logits[len(sampled):], prompt_rows) if prompt_rows else []
        if not sampled:
            return StepResult(prompt_logprobs=prompt_logprobs)
        rows = [SamplingRow(r.params, r.prompt_ids, [*r.output_ids, *b] if b else r.output_ids, r.eos_token_ids,
                            r.bad_word_ids, r.matcher.after(b) if b and r.matcher is not None else r.matcher)
                for r, b in zip(sampled, before)]
        result = self.sampler(logits[: len(sampled)], rows)
        drafts_of = {c.request.serial: c.drafts for c in sched.decodes if c.drafts}
        if not drafts_of:
            return StepResult(sampled, result.token_ids, result.logprobs, prompt_logprobs)
        kept, tokens, logprobs, accepted = accept(sampled, before, result.token_ids, result.logprobs, drafts_of)
        return StepResult(kept, tokens, logprobs, prompt_logprobs, accepted)

    def _logits(self, sched) -> tuple[torch.Tensor, list, list, list]:
        """The step's logits (sampled rows first, then the prompt positions scored), by the path that fits it:
        a decode-only step without drafts takes the planned fast path (replayed from a captured graph when
        capturing)."""
        if self.decode_path is not None and not sched.prefills and not sched.draft_tokens:
            batch, sampled = self.decode_path.build([c.request for c in sched.decodes])
            before = [()] * len(sampled)
            if self.captured is not None:
                return self.captured.replay(self.decode_path.last_plan.shape, len(sampled)), sampled, [], before
            prompt_rows = []
        else:
            batch, sampled, prompt_rows, before = general_batch(sched, self.config.block_size, self.device)
        with torch.inference_mode():
            return self.forward(batch, self.cache, self.read), sampled, prompt_rows, before

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple]) -> list[tuple]:
        """Logprobs of each prompt token given the ones before it, from the logits at the position before it."""
        chosen = [req.prompt_ids[p + 1] for req, p in rows]
        entries = token_logprobs(logits, chosen, [req.params.prompt_logprobs for req, _ in rows])
        return [(req, p + 1, entry) for (req, p), entry in zip(rows, entries)]

    # ---- observation and lifetime ---------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """This rank's KV pool, in bytes."""
        return self.cache.nbytes

    def read_stats(self):
        """What the paged read did (its mode and counters)."""
        return self.read.stats()

    def published(self) -> dict:
        """What the runner's optional parts publish in the stats snapshot (each absent while off)."""
        return {**(self.decode_path.published() if self.decode_path is not None else {}),
                **({"linear": self.loaded.quant.as_dict()} if self.loaded.quant is not None else {}),
                **({"fused": self.loaded.fused.as_dict()} if self.loaded.fused is not None else {}),
                **({"capture": self.captured.stats.as_dict()} if self.captured is not None else {}),
                **({"parallel": self.parallel.stats(self.steps)} if self.parallel is not None else {})}

    @property
    def failed(self) -> str | None:
        """Why the runner cannot compute any more (a tensor-parallel rank failed), or None."""
        return self.parallel.failed if self.parallel is not None else None

    def close(self) -> None:
        """Release what outlives a dropped runner: the other ranks of a tensor-parallel group."""
        if self.parallel is not None:
            self.parallel.close()
