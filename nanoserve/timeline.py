"""Request timelines: each sequence's life as the engine's steps saw it, from arrival to its finish reason.

Serving metrics say the fleet is slow; a timeline says which request was, and where its time went: the wait in
the queue, each prefill chunk (its tokens, and how many the prefix cache held), the decode steps (how many, and
how many rows each shared), preemptions and the recompute after them, drafts kept, grammar masking, and how it
ended. The engine feeds the recorder once a step from what it scheduled, so the cost is a few appends a row and a
step; live sequences and the latest RECENT finished ones are kept (the console's request screen reads them, and an
attached console reads them over HTTP).

Times are time.monotonic() seconds, as the requests' own arrival and first-token times; the dicts give them as
seconds since the sequence arrived.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.stats import RowStats

log = logging.getLogger("nanoserve.timeline")
RECENT = 1000  # finished sequences kept
FINISHED_ROWS = 100  # of those, the latest the stats snapshot lists (the Requests table's finished rows)
TEXT_KEPT = 16_000  # characters of a finished sequence's prompt and answer kept for its screen


@dataclass
class Span:
    """A stretch of a sequence's time: queued (waiting, or again after a preemption), one prefill chunk, a run of
    consecutive decode steps, or the instant it was preempted."""

    kind: str  # "queued", "prefill", "decode", "preempted"
    start: float
    end: float
    steps: int = 0
    tokens: int = 0  # prefill: prompt tokens computed; decode: tokens made (drafts kept included)
    cached: int = 0  # prefill: prompt tokens the prefix cache held when this chunk's admission began
    rows: int = 0  # decode: the rows of its steps, summed (rows / steps: the mean batch it shared)
    most_rows: int = 0
    drafted: int = 0  # decode: tokens drafted for it, and of those, kept
    kept: int = 0

    def as_dict(self, origin: float) -> dict:
        out = {"kind": self.kind, "start_s": round(self.start - origin, 6), "end_s": round(self.end - origin, 6)}
        if self.kind == "prefill":
            out |= {"tokens": self.tokens, "cached": self.cached}
        elif self.kind == "decode":
            out |= {"steps": self.steps, "tokens": self.tokens, "mean_rows": round(self.rows / self.steps, 2),
                    "most_rows": self.most_rows, "drafted": self.drafted, "kept": self.kept}
        return out


@dataclass
class Timeline:
    """One sequence's spans and what it was: enough for its screen once the Request itself is gone."""

    name: str
    request_id: str
    serial: int
    arrival: float
    prompt_tokens: int
    params: dict
    spans: list[Span] = field(default_factory=list)
    request: object | None = None  # the live Request (its tokens, blocks, first-token time); None once finished
    summary: dict | None = None  # what the finished sequence was (its Request's figures, taken at the finish)
    prompt: str | list[int] = ""  # the prompt's text, or its token ids when it came as ids (decoded when shown)
    kept_text: dict = field(default_factory=dict)  # the answer, kept at the finish

    def open_span(self, kind: str, at: float) -> Span:
        span = Span(kind, at, at)
        self.spans.append(span)
        return span

    def close_queue(self, at: float) -> None:
        """The sequence was scheduled at `at`: its open queued span ends there."""
        if self.spans and self.spans[-1].kind == "queued":
            self.spans[-1].end = at

    def figures(self, now: float) -> dict:
        """Its latency figures: the request's own while live, the ones taken at its finish after."""
        if self.summary is not None:
            return self.summary
        return _figures(self.request, self.arrival, now, self.spans)

    def row(self, now: float) -> dict:
        """One line for the requests table."""
        return {"name": self.name, "request_id": self.request_id, "serial": self.serial,
                "prompt_tokens": self.prompt_tokens, **self.figures(now)}

    def as_dict(self, now: float, detokenize=None) -> dict:
        """Everything the request screen shows. A prompt given as token ids is shown as `detokenize` reads
        them (its first TEXT_KEPT tokens), when given."""
        live = self.request
        text = {"answer": live.text[:TEXT_KEPT], "blocks": list(live.blocks)} if live is not None else self.kept_text
        prompt = self.prompt
        if not isinstance(prompt, str):
            prompt = detokenize(list(prompt[:TEXT_KEPT])) if detokenize is not None else None
        return {**self.row(now), "params": self.params, "spans": [s.as_dict(self.arrival) for s in self.spans],
                "prompt": None if prompt is None else prompt[:TEXT_KEPT], **text}


def _figures(req, arrival: float, now: float, spans: list[Span]) -> dict:
    first, done = req.first_token_time, req.finished_time
    made = len(req.output_ids)
    end = done if done is not None else now
    queued = sum(s.end - s.start for s in spans if s.kind == "queued")
    tpot = (end - first) / (made - 1) if first is not None and made > 1 else None
    matcher = req.matcher
    return {"status": req.status.value if done is None else "finished", "finish_reason": req.finish_reason,
            "queued_s": round(queued, 6), "ttft_s": None if first is None else round(first - arrival, 6),
            "tpot_s": None if tpot is None else round(tpot, 6), "total_s": round(end - arrival, 6),
            "tokens_per_s": None if tpot in (None, 0) else round(1 / tpot, 3), "output_tokens": made,
            "cached_tokens": req.num_cached_tokens or 0, "preemptions": req.num_preemptions,
            "drafted": req.spec_draft_tokens, "kept": req.spec_accepted_tokens,
            "grammar_mask_s": None if matcher is None else round(matcher.mask_seconds, 6)}


def _row_stats(req, summary: dict) -> RowStats:
    return RowStats(req.name, "finished", len(req.prompt_ids), len(req.output_ids), 0,
                    summary["tokens_per_s"] or 0.0, req.user, req.session_id, req.spec_draft_tokens,
                    req.spec_accepted_tokens, summary["ttft_s"], summary["tpot_s"], summary["total_s"],
                    req.finish_reason)


def finished_row(row: dict) -> RowStats:
    """A finished sequence's line (rows()) as the Requests table's RowStats: how a search beyond the snapshot's
    latest FINISHED_ROWS reaches the table."""
    return RowStats(row["name"], "finished", row["prompt_tokens"], row["output_tokens"], 0,
                    row["tokens_per_s"] or 0.0, None, None, row["drafted"], row["kept"], row["ttft_s"],
                    row["tpot_s"], row["total_s"], row["finish_reason"])


class TimelineRecorder:
    """Live sequences' timelines by serial, and the latest RECENT finished ones."""

    def __init__(self, keep: int = RECENT, detokenize=None):
        self.detokenize = detokenize  # token ids -> text, for prompts that came as ids
        self.live: dict[int, Timeline] = {}
        self.recent: deque[Timeline] = deque(maxlen=keep)
        self._ending: list = []  # sequences the scheduler finished, settled once the step's outputs are made
        self.finished_rows: deque[RowStats] = deque(maxlen=FINISHED_ROWS)  # newest last, built once at the finish
        # Called with a request's timelines (its n sequences) and its origin once the last one finished; the
        # tracer's hook. Unset, no request is followed past its sequences.
        self.on_request_done: Callable[[list[Timeline], object], None] | None = None
        self._requests: dict[str, list] = {}  # request id -> [sequences, finished timelines, origin]

    def arrived(self, req, origin=None) -> None:
        """`req` was queued; `origin` (tracing.TraceOrigin) goes to on_request_done with its timelines."""
        p = req.params
        params = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_tokens": req.max_tokens,
                  "seed": p.seed, "n": p.n, "structured": req.matcher is not None}
        timeline = Timeline(req.name, req.request_id, req.serial, req.arrival_time, len(req.prompt_ids), params,
                            request=req, prompt=req.prompt if req.prompt is not None else req.prompt_ids)
        timeline.open_span("queued", req.arrival_time)
        self.live[req.serial] = timeline
        if self.on_request_done is not None:
            self._requests.setdefault(req.request_id, [0, [], origin])[0] += 1

    def step(self, sched, started: float, ended: float, accepted: dict[int, int]) -> None:
        """A step ran from `started` to `ended`: its preemptions, prefill chunks and decode rows."""
        for req in sched.preempted:
            timeline = self.live.get(req.serial)
            if timeline is not None:
                timeline.close_queue(started)
                timeline.open_span("preempted", started)
                timeline.open_span("queued", started)
        for chunk in sched.prefills:
            timeline = self.live.get(chunk.request.serial)
            if timeline is None:
                continue
            admitted = bool(timeline.spans) and timeline.spans[-1].kind == "queued"
            timeline.close_queue(started)
            span = timeline.open_span("prefill", started)
            span.end, span.steps, span.tokens = ended, 1, chunk.length
            span.cached = chunk.start if admitted else 0
        rows = len(sched.decodes)
        for chunk in sched.decodes:
            timeline = self.live.get(chunk.request.serial)
            if timeline is not None:
                self._decode(timeline, started, ended, rows, len(chunk.drafts), accepted.get(chunk.request.serial, 0))

    @staticmethod
    def _decode(timeline: Timeline, started: float, ended: float, rows: int, drafted: int, kept: int) -> None:
        last = timeline.spans[-1] if timeline.spans else None
        if last is None or last.kind != "decode":
            timeline.close_queue(started)
            last = timeline.open_span("decode", started)
        last.end, last.steps, last.tokens = ended, last.steps + 1, last.tokens + 1 + kept
        last.rows, last.most_rows = last.rows + rows, max(last.most_rows, rows)
        last.drafted, last.kept = last.drafted + drafted, last.kept + kept

    def ending(self, req) -> None:
        """The scheduler finished `req` (any reason). Its figures are taken at `settle`, once the step's outputs
        have given it its first-token and finish times."""
        self._ending.append(req)

    def settle(self, at: float) -> None:
        """Every sequence that ended since the last call joins the recent ones."""
        ending, self._ending = self._ending, []
        for req in ending:
            self._finished(req, at)

    def _finished(self, req, at: float) -> None:
        timeline = self.live.pop(req.serial, None)
        if timeline is None:
            return
        timeline.close_queue(at)
        timeline.summary = _figures(req, timeline.arrival, at, timeline.spans)
        timeline.kept_text = {"answer": req.text[:TEXT_KEPT], "blocks": []}
        timeline.request = None
        self.recent.append(timeline)
        self.finished_rows.append(_row_stats(req, timeline.summary))
        if self.on_request_done is not None:
            self._request_part_done(timeline)

    def _request_part_done(self, timeline: Timeline) -> None:
        entry = self._requests.get(timeline.request_id)
        if entry is None:
            return  # arrived before the hook was set
        entry[1].append(timeline)
        if len(entry[1]) < entry[0]:
            return
        del self._requests[timeline.request_id]
        try:
            self.on_request_done(sorted(entry[1], key=lambda t: t.serial), entry[2])
        except Exception:  # a tracing failure never ends a step
            log.exception("the finished-request hook failed for %s", timeline.request_id)

    def rows(self, now: float, match: str = "") -> list[dict]:
        """Every kept sequence, one line each: live ones first (oldest first), then finished (newest first);
        with `match`, only those whose name, status or finish reason contains it (any case). Safe to call from
        another thread than the engine's: the containers are copied in one step each (under the GIL) before
        anything is read."""
        live, recent = list(self.live.values()), list(self.recent)
        rows = [t.row(now) for t in live] + [t.row(now) for t in reversed(recent)]
        needle = match.lower()
        return [r for r in rows if needle in f"{r['name']} {r['status']} {r['finish_reason'] or ''}".lower()]

    def find(self, request_id: str, now: float) -> list[dict]:
        """The timelines of a request's sequences (n of them), live or recently finished; [] if none is kept.
        Safe from another thread, as rows() is."""
        live, recent = list(self.live.values()), list(self.recent)
        return [t.as_dict(now, self.detokenize) for t in (*live, *recent) if t.request_id == request_id]
