"""Engine: the wiring of one step, at vLLM V1's seams.

    sched   = scheduler.schedule()                   who runs, how many tokens (blocks from the KV manager)
    result  = runner.execute(sched)                  the forward and the sampler (runner/)
    scheduler.update_from_output(sched, result)      computed counts, tokens appended, sequences retired
    output_processor.process(result)                 text, stop strings, logprobs, latency
    output_processor.outputs()                       RequestOutputs

Each component owns its state; the engine writes none of it. See docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nanoserve.admission import Admission
from nanoserve.config import EngineConfig
from nanoserve.kv.events import KVEventHub
from nanoserve.kv.manager import KVManager
from nanoserve.kv.publisher import KVEventsConfig, ZmqEventPublisher
from nanoserve.live_knobs import LiveKnobs, log_level
from nanoserve.model.loader import LoadedModel
from nanoserve.model.quant.linears import row_quantum
from nanoserve.optional import require_all
from nanoserve.output_processor import OutputProcessor
from nanoserve.outputs import RequestOutput
from nanoserve.request import Request
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.speculative.drafter import Drafter
from nanoserve.stalls import StallWatch
from nanoserve.stats import EngineStats, RowStats, SchedulerStats
from nanoserve.step_budget import StepBudget
from nanoserve.structured.grammars import Grammars
from nanoserve.timeline import TimelineRecorder

log = logging.getLogger("nanoserve.engine")


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
        self._started = time.monotonic()
        progress = progress or (lambda phase: None)
        tracer = self._tracer(config.otlp_traces_endpoint)  # before the load: a missing package is said at once
        kv_events = KVEventsConfig.parse(config.kv_events_config)
        if kv_events is not None and kv_events.publishing:
            require_all(("zmq", "msgpack"), "--kv-events-config")
        self.runner = runner = ModelRunner(config, loaded, progress)
        self.tokenizer, self.model_config = runner.loaded.tokenizer, runner.model_config
        self.max_model_len, self.numerics = runner.max_model_len, runner.numerics
        self.kv = KVManager(runner.num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching,
                            cache_identity=(runner.loaded.name, config.quantization, str(runner.dtype)))
        self.step_budget = StepBudget(config.max_step_ms, config.block_size, row_quantum(runner.model))
        self.drafter = self.make_drafter(config.speculative_config)
        self.kv_events = KVEventHub(self.kv)  # each step's named and evicted blocks, to whoever listens
        self.kv_publisher = None
        if kv_events is not None and kv_events.publishing:
            self.kv_publisher = ZmqEventPublisher(kv_events, config.data_parallel_rank)
            self.kv_events.listen(self.kv_publisher.publish)
        self.timelines = TimelineRecorder(detokenize=self.tokenizer.decode)  # each sequence's life, step by step
        self.tracer = None
        if tracer is not None:
            self.use_tracer(tracer)
        self.knobs = LiveKnobs(config)  # the flags that change at the next step, and who changed them
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.step_budget,
                                   self.drafter, on_finish=self._finished)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids,
                                 stats=runner.sampler.masker.stats)
        self.admission = Admission(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                   config.max_logprobs, self.grammars, in_use=self.output_processor.__contains__)
        self.stalls = StallWatch(config.stall_factor, config.stall_drop_fraction)  # steps far slower than the ones before, with what they carried
        progress("ready")
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d (%.1fs)",
                 runner.loaded.name, runner.device, str(runner.dtype).removeprefix("torch."), runner.num_blocks - 1,
                 config.block_size, self.max_model_len, time.monotonic() - self._started)

    @property
    def failed(self) -> str | None:
        """Why the engine cannot serve any more (a tensor-parallel rank failed), or None."""
        return self.runner.failed

    def close(self) -> None:
        """Release what outlives a dropped engine: the other ranks of a tensor-parallel group, the tracer's
        exporter (its batched spans sent first)."""
        if self.tracer is not None:
            self.tracer.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        self.runner.close()

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, user: str | None = None,
                    cache_salt: str | None = None, session_id: str | None = None, streamed: bool = True,
                    trace_origin=None) -> str:
        """Queue a prompt (text or token ids). Every limit is checked here, before anything is allocated.

        `user` names who sent it (OpenAI's field) and `session_id` the conversation or agent session it belongs
        to (vLLM's); its rows in the stats snapshot carry both. With a `cache_salt` (vLLM's) the request shares
        prefix-cache blocks only with requests that carry the same salt. With `params.n` > 1 the request is n
        sequences sharing the prompt (see SamplingParams.for_completion). `streamed` says whether someone sees its
        tokens as they come: only a streamed request's decode rows hold other prompts' prefill to the step-time
        budget (a request answered at its end wants throughput, not smooth gaps). `trace_origin`
        (tracing.TraceOrigin): its trace headers and API operation, for its span under --otlp-traces-endpoint.
        """
        group = self.admission.sequences(prompt, params, request_id, arrival_time=arrival_time, user=user,
                                         cache_salt=cache_salt, session_id=session_id)
        self.output_processor.add(group)
        for req in group:
            req.streamed = streamed
            self.scheduler.add(req)
            self.timelines.arrived(req, trace_origin)
        return group[0].request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its sequences) wherever it is; its blocks return to the pool now, its final
        output comes next step."""
        live = self.output_processor.abort(request_id)
        for req in live:
            self.scheduler.finish(req, "abort")
        return bool(live)

    def set_live(self, changes: dict, who: str) -> list:
        """Change live flags (live_knobs.LIVE) for the next step, with no restart; ConfigError names what cannot
        change live or is out of range. Call between steps (the host runs it on the engine thread)."""
        return self.knobs.apply(self, changes, who)

    def reset_prefix_cache(self, who: str = "api") -> int:
        """Forget every cached block's name (vLLM's reset_prefix_cache); returns how many were named. Logged
        beside the live knobs' changes, with who asked."""
        forgotten = self.kv.reset_prefix_cache()
        self.knobs.record(self, who, "prefix_cache", f"{forgotten} blocks named", "reset")
        self.kv_events.flush()  # an idle engine runs no step to carry it
        return forgotten

    def add_kv_event_listener(self, listener) -> None:
        """`listener(events)` hears each step's KV events (kv/events.py) on the engine thread, from now on."""
        self.kv_events.listen(listener)

    def sequences(self, request_id: str) -> list[Request]:
        """The live sequences of a request (n of them), for inspection; empty once it has finished."""
        return self.output_processor.sequences(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.output_processor.has_pending

    # ---- the step -----------------------------------------------------------------------------------
    step_clock = staticmethod(time.perf_counter)  # what a step's time is read from (a test scripts it)

    def step(self) -> list[RequestOutput]:
        """One step. If computing it fails (a kernel, the sampler, the detokenizer), the requests it carried
        end there, their blocks back in the pool, and StepFailed says which; every other request and the
        engine itself carry on, so the next step is sound."""
        sched = self.scheduler.schedule()
        if sched.empty:
            return self._outputs()
        started, began = self.step_clock(), time.monotonic()
        try:
            result = self.runner.execute(sched)
            self._apply(sched, result)
        except Exception as error:
            self.timelines.step(sched, began, time.monotonic(), {})
            failure = self._fail(sched, error)
            self.timelines.settle(time.monotonic())
            raise failure from error
        self.output_processor.iterations.step_done()
        self._record_step(sched, self.step_clock() - started)
        self.timelines.step(sched, began, time.monotonic(), result.accepted)
        return self._outputs()

    def _outputs(self) -> list[RequestOutput]:
        outputs = self.output_processor.outputs()  # an aborted request's final output sets its finish time
        self.timelines.settle(time.monotonic())
        self.kv_events.flush()
        return outputs

    @staticmethod
    def _tracer(endpoint: str | None):
        """The tracer exporting to `endpoint`; None (and nothing of OpenTelemetry imported) without one."""
        if endpoint is None:
            return None
        from nanoserve.tracing import RequestTracer

        return RequestTracer.to_endpoint(endpoint)

    def use_tracer(self, tracer) -> None:
        """Export a span for each request queued from now on through `tracer` (tracing.RequestTracer)."""
        tracer.model = tracer.model or self.runner.loaded.name
        self.tracer = tracer
        self.timelines.on_request_done = tracer.request_done

    @staticmethod
    def make_drafter(speculative_config: str | None) -> Drafter | None:
        """The drafter `speculative_config` asks for, None for none: a live change builds it before anything
        changes, so a failure changes nothing."""
        spec = SpeculativeConfig.parse(speculative_config)
        return Drafter(spec) if spec is not None else None

    def use_drafter(self, drafter: Drafter | None) -> None:
        """Speculation on, off or another method from the next step (a live knob): running requests keep their
        outputs either way, since drafts never change a token; the counters start again with the new drafter."""
        self.drafter = self.scheduler.drafter = drafter
        for req in self.scheduler.live():  # a pause or draft length the old drafter set means nothing to this one
            req.spec_paused_until, req.spec_length = 0, None

    def _finished(self, req: Request) -> None:
        """The scheduler retired `req`: speculation's cache keeps its output, its timeline ends."""
        if self.drafter is not None:
            self.drafter.finished(req)
        self.timelines.ending(req)

    def _apply(self, sched, result) -> None:
        """The step's tokens onto its requests, a token a request at a time (a verified draft's kept tokens in
        order, so a stop on one of them ends the request there, as it would one token a step)."""
        first, *later = result.layers()
        self.scheduler.update_from_output(sched, first)
        self._process(first)
        for layer in later:
            layer = layer.without_finished()
            self.scheduler.append(layer)
            self._process(layer)
        if self.drafter is not None:
            self.drafter.observe(sched, result.accepted)

    def _process(self, layer) -> None:
        """A layer's appended tokens into text; a request whose own grammar failed on its token ends first, alone
        (the other rows' tokens and bytes are what they would be without it)."""
        faulted = self._end_faulted()
        if faulted:
            layer = layer.without_requests(faulted)
        for req in self.output_processor.process(layer):  # ended by a stop string
            self.scheduler.finish(req, "stop")

    def _end_faulted(self) -> set[str]:
        """End each request (all n sequences) whose grammar failed this step, finish reason "error" with why."""
        faulted, self.scheduler.faulted = self.scheduler.faulted, []
        ended: set[str] = set()
        for req in faulted:
            if req.request_id in ended:
                continue
            ended.add(req.request_id)
            error = (f"its structured output's grammar failed at generated token {len(req.output_ids) + 1} "
                     f"({req.matcher.failure}); simplify the grammar (e.g. fewer alternatives in one rule) or "
                     f"send the request without it")
            log.warning("request %s ended alone: %s", req.request_id, error)
            for seq in self.output_processor.fault(req.request_id, error):
                self.scheduler.finish(seq, "error")
        return ended

    def _fail(self, sched, error: Exception) -> StepFailed:
        """Retire every request of the failed step (all n sequences of each) with finish reason "error"."""
        failed = sched.request_ids
        self.scheduler.fail(self.output_processor.fail(failed))
        text = str(error)
        log.error("step %d failed (%s: %s); ended %d request(s): %s", self.runner.steps, type(error).__name__,
                  text if len(text) <= 2000 else f"{text[:2000]}... ({len(text)} characters)", len(failed),
                  ", ".join(sorted(failed)))
        return StepFailed(error, sorted(failed))

    def _record_step(self, sched, seconds: float) -> None:
        self.output_processor.step_time(seconds)
        if self.drafter is not None:
            self.drafter.timed(sched, seconds)
        prompts = tuple(dict.fromkeys(c.request.request_id for c in sched.prefills))
        self.step_budget.observe(len(sched.decodes), sched.prefill_tokens, seconds, sched.cut_by_time, prompts,
                                 streams=sched.streamed_decodes)
        # every sequence it carried, by name: the Requests table's key (n > 1 completions are n rows)
        carried = tuple([c.request.name for c in sched.decodes] + [c.request.name for c in sched.prefills])
        self.stalls.step(seconds, len(sched.decodes), sched.prefill_tokens, len(sched.preempted),
                         running=len(self.scheduler.running), prefill_requests=prompts, requests=carried)

    # ---- observation --------------------------------------------------------------------------------
    def audit(self) -> None:
        """Assert every KV block is free or held by a live request (see BlockPool.audit)."""
        self.kv.audit(self.scheduler.owners())

    def resolved_at_load(self) -> dict:
        """What the flags left unset came to at load: the context length and the KV pool's size as built."""
        return {"max_model_len": self.max_model_len, "kv_cache_gib": round(self.runner.kv_bytes / 2**30, 3)}

    decided = resolved_at_load  # its earlier name

    def scheduler_stats(self) -> SchedulerStats:
        """The queue's counts alone: cheap enough to read for every admission."""
        return self.scheduler.stats(dict(self.output_processor.finished), self.runner.steps)

    def stats(self) -> EngineStats:
        now, runner = time.monotonic(), self.runner
        kv, prefix = self.kv.stats(runner.kv_bytes)
        return EngineStats(
            model=runner.loaded.name, device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size, numerics=self.numerics,
            flags=self.config.public(), scheduler=self.scheduler_stats(), kv=kv, paged_read=runner.read_stats(),
            rows=tuple(_row(r, now) for r in self.scheduler.live()),
            finished_rows=tuple(reversed(self.timelines.finished_rows)),
            features={**runner.published(),
                      **({"structured": self.grammars.stats.as_dict()} if self.grammars.stats.compiles else {}),
                      "windows": self.output_processor.recent.snapshot(now, self._started),
                      "stalls": self.stalls.as_dict(), "step_budget": self.step_budget.as_dict(),
                      "live": {"log_level": log_level()},  # the live operation that is not a flag
                      **({"speculative": self.drafter.as_dict()} if self.drafter is not None else {}),
                      **({"kv_events": self.kv_publisher.stats()} if self.kv_publisher is not None else {})},
            latency=self.output_processor.latency(), prefix_cache=prefix,
            vllm_counts=self.output_processor.iterations.as_dict(),
        )


def _row(r: Request, now: float) -> RowStats:
    """A live sequence as the running-rows table shows it; its rate is tokens/s since its first token (the first
    token itself marks time zero)."""
    generated, first = len(r.output_ids), r.first_token_time
    rate = (generated - 1) / (now - first) if first is not None and generated >= 2 and now > first else 0.0
    ttft = None if first is None else first - r.arrival_time
    tpot = (now - first) / (generated - 1) if first is not None and generated >= 2 else None
    return RowStats(r.name, r.status.value, len(r.prompt_ids), generated, len(r.blocks), rate, r.user,
                    r.session_id, r.spec_draft_tokens, r.spec_accepted_tokens, ttft, tpot, now - r.arrival_time)
