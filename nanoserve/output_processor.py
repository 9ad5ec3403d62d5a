"""OutputProcessor: from a step's sampled tokens to the RequestOutputs a caller sees.

It owns each sequence's text stream (detokenizing, stop strings), the n > 1 groups (a request is finished once
all of its sequences are), the logprobs a sequence collects, its latency bookkeeping (first token, finish, the
TTFT / TPOT windows) and the finish counts. The scheduler owns the tokens and whether a sequence runs; this owns
what is said about it.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from nanoserve.iteration_stats import IterationStats
from nanoserve.outputs import (
    CompletionOutput,
    LogprobSequence,
    RequestMetrics,
    RequestOutput,
    TextSoFar,
    TokenIds,
)
from nanoserve.request import Request
from nanoserve.stats import LatencyStats, percentiles
from nanoserve.streaming import TextStream
from nanoserve.windows import RecentActivity

LATENCY_WINDOW = 256  # finished requests (and steps) the published latency percentiles cover

Emitted = tuple[Request, str, tuple[int, ...]]  # a sequence that moved, its new text and its new token ids


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int = 2**16):
        """`max_model_len` caps the token-count buckets of the vLLM-style request histograms."""
        self._tokenizer = tokenizer
        self._groups: dict[str, list[Request]] = {}  # request id -> its sequences (n of them), until all finish
        self._streams: dict[int, TextStream] = {}  # Request.serial -> the sequence's text
        self._emitted: list[Emitted] = []  # what the next outputs() reports: this step's, and aborts since
        self.finished = Counter()  # finish reason -> requests' sequences that ended so
        self._ttfts: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._tpots: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._step_times: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._request_latency: tuple | None = None  # (ttft p50, p99, tpot p50, p99); recomputed after a finish
        self.recent = RecentActivity()  # the same latencies and finishes, by time: the sliding windows
        self.iterations = IterationStats(max_model_len)  # steps, tokens, finished requests: vLLM's counting

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, group: list[Request]) -> None:
        self._groups[group[0].request_id] = group
        for req in group:
            self._streams[req.serial] = TextStream(self._tokenizer, req.params, req.prompt_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def sequences(self, request_id: str) -> list[Request]:
        return list(self._groups.get(request_id, ()))

    def abort(self, request_id: str) -> list[Request]:
        """The request's unfinished sequences, whose final outputs the next outputs() reports (the caller has the
        scheduler retire them)."""
        live = [r for r in self._groups.get(request_id, ()) if not r.finished]
        now = time.monotonic()
        for req in live:
            req.finished_time = now
            self._emitted.append((req, "", ()))
        return live

    def fail(self, request_ids: set[str]) -> list[Request]:
        """Forget the requests a failed step carried (every sequence of each, counted as "error"); returns those
        sequences so the scheduler can retire them. Their outputs are never reported."""
        now, failed = time.monotonic(), []
        for rid in request_ids:
            for req in self._groups.pop(rid, ()):
                req.finished_time = req.finished_time or now
                self._streams.pop(req.serial, None)
                self.finished["error"] += 1
                self.recent.finished("error", now)
                failed.append(req)
        self._emitted = [e for e in self._emitted if e[0].request_id not in request_ids]
        return failed

    @property
    def has_pending(self) -> bool:
        """Whether outputs are owed (an abort's final one) though nothing runs."""
        return bool(self._emitted)

    def fault(self, request_id: str, error: str) -> list[Request]:
        """The request's own input failed (its grammar): its live sequences, whose final outputs the next
        outputs() reports with `error` (the caller has the scheduler retire them with finish reason "error")."""
        live = self.abort(request_id)
        for req in live:
            req.error = error
        return live

    # ---- a step ---------------------------------------------------------------------------------------
    def process(self, result) -> list[Request]:
        """Take a step's tokens (the scheduler has appended them): text, logprobs, latency. Returns the sequences
        a stop string ended, which the scheduler must now retire."""
        for req, position, entry in result.prompt_logprobs:
            req.prompt_logprobs[position] = entry
        now, stopped = time.monotonic(), []
        for req, token, logprobs in result.rows():
            since = None if req.last_token_time is None else now - req.last_token_time
            self.iterations.token(len(req.prompt_ids), req.first_token_time is None, since)
            req.last_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
            if logprobs is not None:
                req.logprobs.append(logprobs)
                req.cumulative_logprob += logprobs.logprob
            self._emitted.append(self._text(req, token, now, stopped))
        return stopped

    def _text(self, req: Request, token: int, now: float, stopped: list[Request]) -> Emitted:
        """The text a token adds. A token that ended the sequence itself (EOS, a stop token id) adds none."""
        stream, delta, matched = self._streams[req.serial], "", None
        ended_on_token = req.finished and req.finish_reason == "stop"  # stop strings are found only below
        if not ended_on_token:
            delta, matched = stream.push(token, armed=len(req.output_ids) >= req.params.min_tokens)
        if matched is not None:
            req.stop_reason = matched
            if req.finished:  # it also reached max_tokens: the stop string names the end (vLLM's rule)
                req.finish_reason = "stop"
            else:
                stopped.append(req)
        if req.finished or matched is not None:
            delta += stream.flush()  # held-back text (a split character, a possible stop prefix) is owed
            self._record_finish(req, now)
        if delta:
            req.text_pieces.append(delta)
        return req, delta, (token,)

    def _record_finish(self, req: Request, now: float) -> None:
        req.finished_time = now
        self._ttfts.append(req.first_token_time - req.arrival_time)
        self.recent.latency("ttft", self._ttfts[-1], now)
        self._request_latency = None
        if len(req.output_ids) > 1:
            self._tpots.append((now - req.first_token_time) / (len(req.output_ids) - 1))
            self.recent.latency("tpot", self._tpots[-1], now)

    def step_time(self, seconds: float) -> None:
        self._step_times.append(seconds)
        self.recent.latency("step", seconds, time.monotonic())

    def outputs(self) -> list[RequestOutput]:
        """One output per sequence that moved; a request is `finished` on its last output once all of its
        sequences are, and only then is it forgotten."""
        emitted, self._emitted = self._emitted, []
        last_of = {req.request_id: i for i, (req, _, _) in enumerate(emitted)}
        outputs = []
        for i, (req, delta, ids) in enumerate(emitted):
            group = self._groups.get(req.request_id, (req,))
            done = last_of[req.request_id] == i and all(r.finished for r in group)
            if req.finished:
                self.finished[req.finish_reason] += 1
                self.iterations.finished(req)
                self.recent.finished(req.finish_reason, req.finished_time or time.monotonic())
                self._streams.pop(req.serial, None)
            if done:
                self._groups.pop(req.request_id, None)
            outputs.append(self._output(req, group[0], delta, ids, done))
        return outputs

    def _output(self, req: Request, first: Request, delta: str, delta_ids: tuple[int, ...],
                done: bool) -> RequestOutput:
        text = self._tokenizer.token_text
        wants = req.params.logprobs is not None
        completion = CompletionOutput(
            req.index, TextSoFar(req.text_pieces), TokenIds(req.output_ids), req.finish_reason, req.stop_reason,
            LogprobSequence(req.logprobs, text) if wants else None,
            req.cumulative_logprob if wants else None,
        )
        prompt_logprobs = None
        if first.prompt_logprobs is not None and first.num_computed >= len(first.prompt_ids):
            prompt_logprobs = LogprobSequence(first.prompt_logprobs, text)
        metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time, req.num_preemptions,
                                 req.spec_draft_tokens, req.spec_accepted_tokens, req.first_scheduled_time,
                                 req.max_tokens, req.params.n, req.last_token_time)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_tuple, [completion], done, delta, delta_ids, metrics,
            prompt_logprobs, first.num_cached_tokens, req.error, first.num_cache_written_tokens,
        )

    # ---- observation ----------------------------------------------------------------------------------
    def latency(self) -> LatencyStats:
        """TTFT and TPOT p50/p99 (sorted only when a request has finished since the last snapshot), and steps'."""
        if self._request_latency is None:
            self._request_latency = (*percentiles(self._ttfts, 0.5, 0.99), *percentiles(self._tpots, 0.5, 0.99))
        return LatencyStats(len(self._ttfts), *self._request_latency, *percentiles(self._step_times, 0.5, 0.99))

    def leftovers(self) -> dict:
        """What is still kept per request (the soak benchmark checks it drains to nothing)."""
        return {"groups": len(self._groups), "streams": len(self._streams)}
