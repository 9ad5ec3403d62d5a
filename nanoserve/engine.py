"""Engine: add_request / step / abort / stats. A step is schedule -> build batch -> forward -> sample -> emit."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from nanoserve.attention.dispatch import PagedRead, paged_read_for
from nanoserve.config import EngineConfig
from nanoserve.errors import ConfigError, RequestError
from nanoserve.kv.cache import KVCache, blocks_from_budget, kv_layout
from nanoserve.kv.pool import BlockPool
from nanoserve.model.batch import PrefillSegment, StepBatch
from nanoserve.model.loader import LoadedModel, load_model, peek_config
from nanoserve.numerics import numerics_of
from nanoserve.outputs import (
    CompletionOutput,
    LogprobSequence,
    RequestMetrics,
    RequestOutput,
    TextSoFar,
    TokenIds,
)
from nanoserve.parallel.driver import ParallelGroup, ParallelModel
from nanoserve.parallel.shard import check_divisible
from nanoserve.request import Request
from nanoserve.runner.batch import general_batch
from nanoserve.runner.decode.capture import CapturedDecode
from nanoserve.runner.decode.path import DecodePath
from nanoserve.sampler import token_logprobs
from nanoserve.sampling import Sampler, SamplingParams, SamplingRow
from nanoserve.scheduler import Scheduler
from nanoserve.stalls import StallWatch
from nanoserve.stats import (
    EngineStats,
    KVStats,
    LatencyStats,
    PrefixCacheStats,
    RowStats,
    SchedulerStats,
    percentiles,
)
from nanoserve.streaming import TextStream
from nanoserve.structured.grammars import Grammars
from nanoserve.structured.mask import GrammarMasker
from nanoserve.windows import RecentActivity

log = logging.getLogger("nanoserve.engine")

CPU_DEFAULT_KV_GIB = 1.0
LATENCY_WINDOW = 256  # finished requests (and steps) the published latency percentiles cover


class StepFailed(RuntimeError):
    """A step failed while computing; the requests it carried (`request_ids`) were ended with it."""

    def __init__(self, error: Exception, request_ids: list[str]):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.request_ids = error, request_ids


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 progress: Callable[[str], None] | None = None):
        """`progress`, when given, hears each start-up phase ("loading weights", "sizing the KV pool", ...)."""
        self.config = config = config or EngineConfig()
        self.device = config.torch_device()
        self.read = paged_read_for(config.streamed_read, config.read_block, self.device, config.batch_invariant)
        self._progress = progress or (lambda phase: None)
        started = time.monotonic()
        self.parallel: ParallelGroup | None = None
        if loaded is None:
            loaded = self._load(config)
        self.loaded = loaded
        # model_config is the whole model's (the vocabulary, the heads); self.model.config is this rank's part
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.forward = self.model if self.parallel is None else \
            ParallelModel(self.model, self.parallel, self.model_config.vocab_size)
        self.dtype = next(self.model.parameters()).dtype
        self._progress("sizing the KV pool")
        num_blocks = self._size_pool()
        self.cache = KVCache(self.model.config, num_blocks, config.block_size, self.dtype, self.device,
                             kv_layout(config))
        self.not_invariant = self._invariance()
        self.numerics = numerics_of(self.model, self.cache.k.dtype, self._determinism())
        if self.parallel is not None:
            self.parallel.build_pools(self.model, self.cache)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.max_model_len = self._resolve_max_model_len()
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefix_caching=config.enable_prefix_caching,
                                   cache_identity=(loaded.name, config.quantization, str(self.dtype)))
        self.decode_path, self.captured = self._decode_fast_path(self.cache, self.max_model_len)
        if self.captured is not None:
            self._progress("capturing CUDA graphs")
            self.captured.capture()
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed),
                               GrammarMasker(self.grammars.stats))
        self._groups: dict[str, list[Request]] = {}  # request id -> its sequences (n of them), until all finish
        self._streams: dict[int, TextStream] = {}  # Request.serial -> the sequence's text
        self._aborted: list[Request] = []
        self._ids = itertools.count()
        self._finished = Counter()
        self._prompt_tokens = self._generation_tokens = self._steps = 0
        self._ttfts: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._tpots: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._request_latency: tuple | None = None  # (ttft p50, p99, tpot p50, p99); recomputed after a finish
        self._step_times: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.recent = RecentActivity()  # the same latencies and finishes, by time: the sliding windows
        self.stalls = StallWatch()  # steps far slower than the ones before, with what they carried
        self._started = started
        self._progress("ready")
        log.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d (%.1fs)",
            loaded.name, self.device, str(self.dtype).removeprefix("torch."), num_blocks - 1,
            config.block_size, self.max_model_len, time.monotonic() - started,
        )

    def _invariance(self) -> str | None:
        """Why this engine is not batch-invariant (the flag off, or a kernel of this machine), or None."""
        if not self.config.batch_invariant:
            return "--no-batch-invariant"
        from nanoserve.invariance import report

        reason = report(self.model, self.device) or self._group_not_invariant()
        if reason is not None:
            log.warning("batch invariance does not hold here: %s; outputs may depend on the batch", reason)
        return reason

    def _group_not_invariant(self) -> str | None:
        """Two ranks sum their partial outputs exactly alike whatever the order (a + b = b + a); three or more
        through the backend's ring, whose order for an element depends on the tensor's size."""
        world = self.config.tensor_parallel_size
        if world <= 2:
            return None
        return (f"{world} ranks sum partial outputs in an order that depends on the tensor's size (the "
                "backend's ring); 1 or 2 ranks hold it")

    def _determinism(self) -> str:
        if self.not_invariant is None:
            return "batch-invariant"
        if not self.config.batch_invariant:
            return "not batch-invariant (--no-batch-invariant)"
        return f"not batch-invariant here: {self.not_invariant}"

    def _load(self, config: EngineConfig) -> LoadedModel:
        """The model, or under tensor parallelism this rank's part of it, with the other ranks started and
        loading theirs. A size that does not divide the model is refused before any process starts."""
        if config.tensor_parallel_size == 1:
            self._progress("loading weights")
            return load_model(config.model, config.torch_dtype, self.device, config.max_model_len,
                              config.quantization, invariant=config.batch_invariant)
        shapes = peek_config(config.model)
        check_divisible(shapes, config.tensor_parallel_size)
        self._progress(f"starting {config.tensor_parallel_size} tensor-parallel ranks")
        self.parallel = ParallelGroup(config, self.device, shapes.hidden_size, shapes.vocab_size)
        self._progress("loading weights (every rank its shard)")
        try:
            with self.parallel.own_threads():
                loaded = load_model(config.model, config.torch_dtype, self.device, config.max_model_len,
                                    config.quantization, shard=self.parallel.shard,
                                    invariant=config.batch_invariant)
        except Exception as e:
            self.parallel.confirm(f"{type(e).__name__}: {e}", "load")  # stops the other ranks, then raises
            raise
        self.parallel.confirm(None, "load")
        loaded.model.parallelize(self.parallel.group, vocab_start=0)
        return loaded

    @property
    def failed(self) -> str | None:
        """Why the engine cannot serve any more (a tensor-parallel rank failed), or None."""
        return self.parallel.failed if self.parallel is not None else None

    def close(self) -> None:
        """Release what outlives a dropped engine: the other ranks of a tensor-parallel group."""
        if self.parallel is not None:
            self.parallel.close()

    # ---- sizing -------------------------------------------------------------------------------------
    def _size_pool(self) -> int:
        cfg = self.config
        if cfg.kv_cache_gib is not None:
            budget = cfg.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_GIB * 2**30
        return blocks_from_budget(self.model.config, budget, cfg.block_size, self.dtype)  # this rank's kv heads

    def _cuda_kv_budget(self) -> float:
        """A fraction of the card, less weights and the peak of a warm-up step at the full token budget."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._progress("warming up")
        self._warm_up()
        # memory an engine closed before this one left in torch's cache counts as used in mem_get_info: hand it
        # back first (a restart from the console, a second LLM in one script)
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        graphs = self._graph_reserve()
        return (total * self.config.gpu_memory_utilization - (total - free)
                - (peak - torch.cuda.memory_allocated(self.device)) - graphs)

    def _warm_up(self) -> None:
        """One step at the full token budget, so its peak memory can be measured before the KV pool is sized.

        The positions wrap at the rope table's length: --max-model-len below the token budget builds a shorter
        table, and indexing past it is a device-side assert on CUDA that poisons the process. The step's size,
        which is what sets its peak, is unchanged."""
        n = min(self.config.max_num_batched_tokens, self.model_config.max_position_embeddings)
        cache = KVCache(self.model.config, 2, self.config.block_size, self.dtype, self.device,
                        kv_layout(self.config))
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % self.model.rope.cos.shape[0]
        batch = StepBatch(
            input_ids=ids, positions=positions, slots=ids % self.config.block_size,
            num_decode=0, decode_block_table=ids[:0, None], decode_context_lens=ids[:0],
            prefills=(PrefillSegment(0, n, 0),), logits_indices=ids[-1:],
            prefill_blocks=(torch.zeros(-(-n // self.config.block_size), dtype=torch.long, device=self.device),),
        )
        with torch.inference_mode():
            self.forward(batch, cache, PagedRead("gathered", invariant=self.config.batch_invariant))
        del cache

    def _decode_fast_path(self, cache: KVCache, max_model_len: int):
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

    def _graph_reserve(self) -> int:
        """Device bytes the captured graphs will hold, measured by capturing the largest shape on a scratch cache."""
        if not self.config.decode_switches()["capture"]:
            return 0
        self._progress("measuring the CUDA-graph pool")
        longest = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                      self.model_config.max_position_embeddings)
        scratch = KVCache(self.model.config, 2, self.config.block_size, self.dtype, self.device,
                          kv_layout(self.config))
        path, captured = self._decode_fast_path(scratch, longest)
        captured.capture(shapes=[max(path.buckets.shapes)])
        reserve = captured.stats.pool_bytes
        del path, captured, scratch
        with torch.cuda.device(self.device):  # empty_cache empties the current device's cache: name ours
            torch.cuda.empty_cache()
        return reserve

    def _resolve_max_model_len(self) -> int:
        capacity = self.pool.num_usable * self.config.block_size
        model_len = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None:
            if wanted > model_len:
                raise ConfigError(
                    f"max_model_len {wanted} exceeds the {model_len} positions this model was trained for; "
                    f"use --max-model-len {model_len} or less"
                )
            if wanted > capacity:
                raise ConfigError(
                    f"max_model_len {wanted} needs {wanted} KV slots but the pool holds {capacity}; "
                    "raise --kv-cache-gib or lower --max-model-len"
                )
            return wanted
        if capacity < model_len:
            log.warning("max_model_len capped at %d tokens: the KV pool holds no more", capacity)
        return min(model_len, capacity)

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        user: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids). Every limit is checked here, before anything is allocated.

        `user` names who sent it (OpenAI's field) and `session_id` the conversation or agent session it belongs
        to (vLLM's); its rows in the stats snapshot carry both. With a `cache_salt`
        (vLLM's) the request shares prefix-cache blocks only with requests that carry the same salt.
        With `params.n` > 1 the request is n sequences sharing the prompt (see SamplingParams.for_completion).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string, got {cache_salt!r}; send one per tenant")
        if request_id in self._groups:
            raise RequestError(f"request id {request_id!r} is already in use; pick a unique id")
        text, ids = self._prompt_ids(prompt)
        params = params.validate_against(self.model_config.vocab_size, self.config.max_logprobs)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise RequestError(
                f"prompt is {len(ids)} tokens but max_model_len is {self.max_model_len}; shorten it or "
                "start with a larger --max-model-len"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}; lower max_tokens to at most {room} or shorten the prompt"
            )
        bad_words = self._bad_word_ids(params.bad_words)
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        group = []
        for index in range(params.n):
            own = params if params.n == 1 else params.for_completion(index)
            if index:  # the prompt's logprobs are the same for every completion: compute them once
                own = dataclasses.replace(own, prompt_logprobs=None)
            req = Request(request_id, text, ids, own, max_tokens, index=index, bad_word_ids=bad_words, user=user,
                          session_id=session_id, cache_salt=cache_salt, matcher=grammar.matcher() if grammar else None)
            if own.prompt_logprobs is not None:
                req.prompt_logprobs = [None] * len(ids)
            if arrival_time is not None:
                req.arrival_time = arrival_time
            group.append(req)
        self._groups[request_id] = group
        for req in group:
            self._streams[req.serial] = TextStream(self.tokenizer, req.params, ids)
            self.scheduler.add(req)
        return request_id

    def _bad_word_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the token sequences it can be written with: alone, and after a space (vLLM's rule)."""
        seqs = set()
        for word in words or ():
            for form in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(form, add_special_tokens=False))
                if ids:
                    seqs.add(ids)
        return tuple(sorted(seqs))

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size}); "
                    "encode the prompt with this model's tokenizer"
                )
        else:
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty; send at least one token")
        return text, ids

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its sequences) wherever it is; its blocks return to the pool now, its final
        output comes next step."""
        live = [r for r in self._groups.get(request_id, ()) if not r.finished]
        for req in live:
            self.scheduler.finish(req, "abort")
            req.finished_time = time.monotonic()
            self._aborted.append(req)
        return bool(live)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's name (vLLM's reset_prefix_cache); returns how many were named."""
        return self.pool.reset_cache()

    def sequences(self, request_id: str) -> list[Request]:
        """The live sequences of a request (n of them), for inspection; empty once it has finished."""
        return list(self._groups.get(request_id, ()))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. If computing it fails (a kernel, the sampler, the detokenizer), the requests it carried
        end there, their blocks back in the pool, and StepFailed says which; every other request and the
        engine itself carry on, so the next step is sound."""
        preempted = self.scheduler.num_preemptions
        sched = self.scheduler.schedule()
        emitted: list[tuple[Request, str, tuple[int, ...]]] = [(r, "", ()) for r in self._aborted]
        self._aborted.clear()
        if sched.empty:
            return self._outputs(emitted)
        self._steps += 1
        try:
            self._compute(sched, emitted)
        except Exception as error:
            self.pool.forget(sched.committed)  # named for content this step was to write, and never did
            raise self._fail_step(sched, error, emitted) from error
        self.stalls.step(self._step_times[-1], len(sched.decodes), sum(c.length for c in sched.prefills),
                         self.scheduler.num_preemptions - preempted, running=len(self.scheduler.running))
        return self._outputs(emitted)

    def _fail_step(self, sched, error: Exception, emitted) -> StepFailed:
        """Retire every request of the failed step (all n sequences of each) with finish reason "error"."""
        failed = {c.request.request_id for c in (*sched.decodes, *sched.prefills)}
        now = time.monotonic()
        for rid in failed:
            for req in self._groups.pop(rid, ()):
                if not req.finished:
                    self.scheduler.finish(req, "error")
                    req.finished_time = now
                self._streams.pop(req.serial, None)
                self._finished["error"] += 1
                self.recent.finished("error", now)
        self._aborted.extend(r for r, _, _ in emitted if r.request_id not in failed)  # their outputs come next
        log.error("step %d failed (%s: %s); ended %d request(s): %s", self._steps, type(error).__name__, error,
                  len(failed), ", ".join(sorted(failed)))
        return StepFailed(error, sorted(failed))

    def _compute(self, sched, emitted: list) -> None:
        step_started = time.perf_counter()
        logits = None
        prompt_rows: list[tuple[Request, int]] = []
        if self.decode_path is not None and not sched.prefills:  # decode-only: the planned fast path
            batch, sampled = self.decode_path.build([c.request for c in sched.decodes])
            if self.captured is not None:
                logits = self.captured.replay(self.decode_path.last_plan.shape, len(sampled))
        else:
            batch, sampled, prompt_rows = general_batch(sched, self.config.block_size, self.device)
        if logits is None:
            with torch.inference_mode():
                logits = self.forward(batch, self.cache, self.read)
        if prompt_rows:
            self._record_prompt_logprobs(logits[len(sampled):], prompt_rows)
        logits = logits[: len(sampled)]
        for chunk in (*sched.decodes, *sched.prefills):
            chunk.request.num_computed += chunk.length
            if not chunk.request.output_ids and chunk.completes:  # a prompt's first completion
                self._prompt_tokens += len(chunk.request.prompt_ids)
        if sampled:
            rows = [SamplingRow(r.params, r.prompt_ids, r.output_ids, self.tokenizer.eos_token_ids, r.bad_word_ids,
                                r.matcher) for r in sampled]
            result = self.sampler(logits, rows)
            now = time.monotonic()
            for req, token, lp in zip(sampled, result.token_ids, result.logprobs):
                emitted.append(self._append(req, token, lp, now))
        self._step_times.append(time.perf_counter() - step_started)
        self.recent.latency("step", self._step_times[-1], time.monotonic())

    def _record_prompt_logprobs(self, logits: torch.Tensor, rows: list[tuple[Request, int]]) -> None:
        """Logprobs of each prompt token given the ones before it, from the logits at the position before it."""
        chosen = [req.prompt_ids[p + 1] for req, p in rows]
        entries = token_logprobs(logits, chosen, [req.params.prompt_logprobs for req, _ in rows])
        for (req, p), entry in zip(rows, entries):
            req.prompt_logprobs[p + 1] = entry

    def _append(self, req: Request, token: int, logprobs, now: float) -> tuple[Request, str, tuple[int, ...]]:
        """Add a sampled token, decide whether the sequence is done, and say what it can emit."""
        if req.first_token_time is None:
            req.first_token_time = now
        if req.matcher is not None:
            req.matcher.consume(token)
        req.output_ids.append(token)
        self._generation_tokens += 1
        if logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs.logprob
        stream = self._streams[req.serial]
        delta, reason, stop_reason = stream.push(token, len(req.output_ids))
        if reason is None and len(req.output_ids) >= req.max_tokens:
            reason = "length"
        if reason is not None:
            delta += stream.flush()  # held-back text (a split character, a possible stop prefix) is owed
            req.stop_reason = stop_reason
            self.scheduler.finish(req, reason)
            req.finished_time = now
            self._ttfts.append(req.first_token_time - req.arrival_time)
            self.recent.latency("ttft", self._ttfts[-1], now)
            self._request_latency = None
            if len(req.output_ids) > 1:
                self._tpots.append((now - req.first_token_time) / (len(req.output_ids) - 1))
                self.recent.latency("tpot", self._tpots[-1], now)
        if delta:
            req.text_pieces.append(delta)
        return req, delta, (token,)

    def _outputs(self, emitted: list[tuple[Request, str, tuple[int, ...]]]) -> list[RequestOutput]:
        """One output per sequence that moved; a request is `finished` on its last output once all of its
        sequences are, and only then does the engine forget it."""
        last_of = {req.request_id: i for i, (req, _, _) in enumerate(emitted)}
        outputs = []
        for i, (req, delta, ids) in enumerate(emitted):
            group = self._groups.get(req.request_id, (req,))
            done = last_of[req.request_id] == i and all(r.finished for r in group)
            if req.finished:
                self._finished[req.finish_reason] += 1
                self.recent.finished(req.finish_reason, req.finished_time or time.monotonic())
                self._streams.pop(req.serial, None)
            if done:
                self._groups.pop(req.request_id, None)
            outputs.append(self._output(req, group[0], delta, ids, done))
        return outputs

    def _output(self, req: Request, first: Request, delta: str, delta_ids: tuple[int, ...],
                done: bool) -> RequestOutput:
        text = self.tokenizer.token_text
        wants = req.params.logprobs is not None
        completion = CompletionOutput(
            req.index, TextSoFar(req.text_pieces), TokenIds(req.output_ids), req.finish_reason, req.stop_reason,
            LogprobSequence(req.logprobs, text) if wants else None,
            req.cumulative_logprob if wants else None,
        )
        prompt_logprobs = None
        if first.prompt_logprobs is not None and first.num_computed >= len(first.prompt_ids):
            prompt_logprobs = LogprobSequence(first.prompt_logprobs, text)
        metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time, req.num_preemptions)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_tuple, [completion], done, delta, delta_ids, metrics,
            prompt_logprobs, first.num_cached_tokens,
        )

    # ---- observation --------------------------------------------------------------------------------
    def audit(self) -> None:
        """Assert every KV block is free or held by a live request (see BlockPool.audit)."""
        self.pool.audit(self.scheduler.owners())

    def _latency_percentiles(self) -> tuple:
        """TTFT and TPOT p50/p99, sorted only when a request has finished since the last snapshot."""
        if self._request_latency is None:
            self._request_latency = (*percentiles(self._ttfts, 0.5, 0.99), *percentiles(self._tpots, 0.5, 0.99))
        return self._request_latency

    def decided(self) -> dict:
        """What the flags left unset came to at load: the context length and the KV pool's size as built."""
        return {"max_model_len": self.max_model_len, "kv_cache_gib": round(self.cache.nbytes / 2**30, 3)}

    def stats(self) -> EngineStats:
        s = self.scheduler
        now = time.monotonic()
        rows = tuple(
            RowStats(r.name, r.status.value, len(r.prompt_ids), len(r.output_ids), len(r.blocks),
                     _rate(len(r.output_ids), r.first_token_time, now), r.user, r.session_id)
            for r in (*s.running, *s.waiting)
        )
        return EngineStats(
            model=self.loaded.name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            numerics=self.numerics,
            flags=self.config.public(),
            scheduler=SchedulerStats(
                running=len(s.running), waiting=len(s.waiting), peak_running=s.peak_running,
                preemptions=s.num_preemptions, finished=dict(self._finished),
                prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self._generation_tokens,
                steps=self._steps,
            ),
            kv=KVStats(self.pool.block_size, self.pool.num_usable, self.pool.num_free, self.pool.num_used,
                       self.cache.nbytes),
            paged_read=self.read.stats(),
            rows=rows,
            sections={**(self.decode_path.sections() if self.decode_path is not None else {}),
                      **({"linear": self.loaded.quant.as_dict()} if self.loaded.quant is not None else {}),
                      **({"capture": self.captured.stats.as_dict()} if self.captured is not None else {}),
                      **({"structured": self.grammars.stats.as_dict()} if self.grammars.stats.compiles else {}),
                      **({"parallel": self.parallel.stats(self._steps)} if self.parallel is not None else {}),
                      "windows": self.recent.snapshot(now, self._started),
                      "stalls": self.stalls.as_dict()},
            latency=LatencyStats(len(self._ttfts), *self._latency_percentiles(),
                                 *percentiles(self._step_times, 0.5, 0.99)),
            prefix_cache=PrefixCacheStats(s.prefix_caching, s.prefix_queries, s.prefix_hits, self.pool.num_cached,
                                          self.pool.num_cached_free, self.pool.evictions),
        )


def _rate(generated: int, first_token_time: float | None, now: float) -> float:
    """A row's tokens/s since its first token (its first token itself marks time zero)."""
    if first_token_time is None or generated < 2 or now <= first_token_time:
        return 0.0
    return (generated - 1) / (now - first_token_time)
