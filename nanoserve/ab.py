"""A/B: two engines one flag set apart, the same crowd of requests, a verdict per request.

A flag that must change no output is proven here: the same greedy and seeded-sampled requests go to engines A
and B, each client's streamed text is compared with the other side's, and the counters are set side by side.
A seeded request's text does not depend on what shares its batch, so any difference is the flag's doing. A
run where an engine never ran two rows at once proves nothing about batching: it is flagged (CLI: refused).
The console's A/B screen and `nanoserve bench ab` (bench/ab.py) both run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import torch

from nanoserve import client
from nanoserve.config import EngineConfig, FlagSpec
from nanoserve.errors import ConfigError
from nanoserve.workload import SAMPLED

DEFAULT_B = "decode_buckets=on persistent_inputs=on row_compaction=on"  # the CPU's decode fast path: no output change
NOT_EVIDENCE = "this engine is not deterministic here: differences are not evidence"
SCHEDULING_B = "max_num_seqs=4 max_num_batched_tokens=64"  # another scheduling: must change no output either
Progress = Callable[[str, int, int], None]  # (phase, requests done, requests in all)


class ABCancelled(Exception):
    """The run was stopped before both sides had answered; every server it started is down."""


# ---- flag overrides ---------------------------------------------------------------------------------
def parse_value(spec: FlagSpec, text: str):
    """One flag's value from text (FlagSpec.parse), refused as a ConfigError."""
    try:
        return spec.parse(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_overrides(text: str) -> dict:
    """'max_num_seqs=4 seed=1' -> {'max_num_seqs': 4, 'seed': 1}; unknown names are refused, known listed."""
    specs = {spec.name: spec for spec in EngineConfig.flag_specs()}
    try:
        items = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"cannot split flags {text!r}: {e}") from None
    overrides = {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.lstrip("-").replace("-", "_")
        if not eq:
            raise ConfigError(f"{item!r} is not NAME=VALUE (e.g. max_num_seqs=4)")
        if name not in specs:
            raise ConfigError(f"unknown engine flag {name!r}; known flags: {', '.join(sorted(specs))}")
        overrides[name] = parse_value(specs[name], value)
    return overrides


def variant(base: EngineConfig, text: str) -> EngineConfig:
    """`base` with the overrides in `text`; ConfigError names a bad name, value or combination."""
    return dataclasses.replace(base, **parse_overrides(text))


# ---- requests and verdicts --------------------------------------------------------------------------
def ab_requests(prompts, max_tokens: int, sampled_seed: int = 1234, chat: bool = True,
                ignore_eos: bool | None = None) -> list[dict]:
    """Streamed bodies alternating greedy and seeded-sampled.

    A chat prompt's answer ends where the chat's does, at the end of the assistant's turn (the chat route stops
    on the template's end-of-turn token, as for the console's chat, which sends no ignore_eos): run past it, the
    model writes a made-up next turn ("Paris.⏎system⏎⏎") that no client would see. A raw prompt has no turn to
    end and runs to max_tokens. `ignore_eos` forces one or the other (True: every text max_tokens long)."""
    bodies = []
    for i, prompt in enumerate(prompts):
        body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        body.update(max_tokens=max_tokens, ignore_eos=not chat if ignore_eos is None else ignore_eos, stream=True)
        body.update({**SAMPLED, "seed": sampled_seed + i} if i % 2 else {"temperature": 0})
        bodies.append(body)
    return bodies


@dataclass
class Reply:
    """What one client received: its streamed deltas joined, the finish reason, or the error."""

    text: str = ""
    finish_reason: str | None = None
    error: str = ""


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character (the shorter length when one is a prefix); None when equal."""
    if a == b:
        return None
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), shorter)


@dataclass(frozen=True)
class Verdict:
    index: int
    kind: str  # "greedy" or "sampled"
    identical: bool
    first_difference: int | None  # character index into text_a / text_b; None when the texts are equal
    text_a: str
    text_b: str
    finish_a: str | None = None
    finish_b: str | None = None
    error: str = ""

    @property
    def label(self) -> str:
        return ("identical" if self.identical else f"failed ({self.error})" if self.error
                else f"differs at {self.first_difference}" if self.first_difference is not None
                else f"differs in finish reason ({self.finish_a} / {self.finish_b})")


def judge(index: int, body: dict, a: Reply, b: Reply) -> Verdict:
    """Identical means the same text, the same finish reason, and neither side failed."""
    kind = "greedy" if body.get("temperature", 1.0) == 0 else "sampled"
    error = "; ".join(f"{side}: {reply.error}" for side, reply in (("A", a), ("B", b)) if reply.error)
    diff = first_difference(a.text, b.text)
    return Verdict(index, kind, not error and diff is None and a.finish_reason == b.finish_reason, diff,
                   a.text, b.text, a.finish_reason, b.finish_reason, error)


# ---- firing -----------------------------------------------------------------------------------------
@dataclass
class Fired:
    replies: list[Reply]
    duration_s: float


async def fire(url: str, bodies: list[dict], concurrency: int,
               on_done: Callable[[Reply], None] | None = None, cancel=None) -> Fired:
    """Stream every body at `url`, `concurrency` clients at once (bench serve's `run`, /health left alone).

    `cancel` is anything with is_set() (an asyncio.Event, or a threading.Event set from another thread):
    once set, the clients hang up, which aborts their requests and frees their blocks, and ABCancelled rises.
    """

    def heard(result: client.Result) -> None:
        if on_done is not None:
            on_done(as_reply(result))

    firing = asyncio.create_task(client.fire(url, bodies, concurrency, None, {}, 0, heard, watch_health=False))
    while not firing.done():
        if cancel is not None and cancel.is_set():
            firing.cancel()  # run cancels every request in flight, closing their streams
            await asyncio.gather(firing, return_exceptions=True)
            raise ABCancelled("stopped while firing")
        await asyncio.wait([firing], timeout=0.05)
    results, duration, _ = firing.result()
    return Fired([as_reply(result) for result in results], duration)


def as_reply(result: client.Result) -> Reply:
    return Reply(result.text, result.finish_reason, result.error)


def settled_health(url: str, timeout: float = 30.0) -> dict:
    """/health once the last step's counters are published (a client hears its end before they are)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=timeout).json()
        busy = health["scheduler"]["running"] + health["scheduler"]["waiting"]
        if not busy or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


# ---- one A/B run ------------------------------------------------------------------------------------
@dataclass
class Side:
    name: str  # "A" or "B"
    config: EngineConfig
    health_before: dict = field(default_factory=dict)
    health_after: dict = field(default_factory=dict)
    fired: Fired | None = None
    blocks_held_after_stop: int | None = None  # KV blocks still in use once its server stopped (want 0)

    @property
    def peak_running(self) -> int:
        """The most rows its engine ran at once: the engine is fresh, so its own peak is this run's."""
        return self.health_after.get("scheduler", {}).get("peak_running", 0)


@dataclass
class ABResult:
    a: Side
    b: Side
    bodies: list[dict]
    verdicts: list[Verdict]

    def __post_init__(self) -> None:
        self.sides = (self.a, self.b)
        self.differing = sum(not v.identical for v in self.verdicts)
        self.all_identical = self.differing == 0
        self.uncrowded = [side for side in self.sides if side.peak_running < 2]  # never ran 2 rows at once
        self.crowded = not self.uncrowded

    @property
    def same_arms(self) -> bool:
        """An A/A run: both arms the same flags, so any difference is the engine's noise, not a flag's."""
        return self.a.config == self.b.config

    def summary(self, aa: ABResult | None = None) -> str:
        """The verdict line. `aa`: the last A/A run of this A, whose differences make this run's no evidence;
        without one, an A that is not batch-invariant is said to be unchecked."""
        n, differ = len(self.verdicts), self.differing
        verdict = f"{n}/{n} identical" if not differ else f"{differ} differ ({n - differ}/{n} identical)"
        if self.same_arms:
            verdict = f"A/A {verdict}" + ("" if not differ else f" · {NOT_EVIDENCE}")
        elif aa is not None and not aa.all_identical:
            verdict += f" · {NOT_EVIDENCE} (A/A: {aa.differing} of {len(aa.verdicts)} differ)"
        elif aa is None and differ and not self.a.config.batch_invariant:
            verdict += " · A is not batch-invariant: run A/A before reading these differences"
        crowd = f"peak running A {self.a.peak_running}, B {self.b.peak_running}"
        if not self.crowded:
            crowd += " - UNCROWDED: a side never ran 2 rows at once, so this proves nothing about batching"
        return f"{verdict} · {crowd}"

    def counter_rows(self) -> list[tuple[str, object, object]]:
        """(counter, A, B): the flags that differ, peak running, then each /health section, later ones too."""
        flags_a, flags_b = self.a.config.public(), self.b.config.public()
        rows = [(f"flag {k}", flags_a[k], flags_b[k]) for k in flags_a if flags_a[k] != flags_b[k]]
        rows.append(("peak running", self.a.peak_running, self.b.peak_running))
        health_a, health_b = self.a.health_after, self.b.health_after
        sections = [s for s in ("scheduler", "latency", "paged_read") if s in health_a or s in health_b]
        sections += [s for s in {**health_a, **health_b} if s not in sections and s != "flags"
                     and isinstance(health_a.get(s, health_b.get(s)), dict)]
        for section in sections:
            part_a, part_b = health_a.get(section) or {}, health_b.get(section) or {}
            for key in {**part_a, **part_b}:
                va, vb = part_a.get(key), part_b.get(key)
                if section == "latency" and key != "window":  # seconds on the wire, milliseconds to read
                    rows.append((f"latency.{key} ms", *(None if v is None else v * 1000 for v in (va, vb))))
                else:
                    rows.append((f"{section}.{key}", va, vb))
        return rows


@contextlib.contextmanager
def labelled_logs(label: str, logger: str = "nanoserve"):
    """Prefix `label` to what this thread logs through the engine's loggers while the block runs (an A/B arm
    loading beside a console's own engine), for every handler."""
    me = threading.get_ident()

    def label_it(record: logging.LogRecord) -> bool:
        if record.thread == me and not getattr(record, "labelled", False):
            record.msg, record.labelled = f"{label}: {record.msg}", True
        return True

    loggers = [logging.getLogger(name) for name in [logger, *logging.root.manager.loggerDict]
               if name == logger or name.startswith(logger + ".")]
    for each in loggers:
        each.addFilter(label_it)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(label_it)


def show(value, name: str = "") -> str:
    """A counter as a table cell: thousands separated, a count of bytes in MiB or GiB (by its name)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return "-" if value is None else str(value)
    if isinstance(value, (int, float)) and name.endswith("bytes"):
        return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.1f} MiB"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return " · ".join(f"{k} {show(v)}" for k, v in value.items()) or "-"
    return str(value)


class ABRun:
    """One A/B comparison, run from a worker thread: `phase`, `done`, `total` and `live` may be read from any
    thread, and `cancel()` stops it, taking down whichever server is up.

    The sides run one after the other (load A, fire, stop A; then B), not at once: each engine's step times
    are then measured without the other competing for the same cores or card, and on CUDA an engine sizes
    its KV pool as a share of the card, so a second one loaded beside the first would be starved. Identity
    needs no simultaneity: a seeded request's text does not depend on what else is batched with it.
    """

    def __init__(self, config_a: EngineConfig, config_b: EngineConfig, bodies: list[dict], concurrency: int,
                 progress: Progress | None = None):
        self.a, self.b = Side("A", config_a), Side("B", config_b)
        self.bodies, self.concurrency, self.progress = bodies, concurrency, progress
        self.phase, self.done, self.total = "waiting", 0, 2 * len(bodies)
        self.live: list = []  # servers up right now: empty again once run() returns or raises
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> ABResult:
        for side in (self.a, self.b):
            self._run_side(side)
        replies = zip(self.bodies, self.a.fired.replies, self.b.fired.replies)
        verdicts = [judge(i, body, reply_a, reply_b) for i, (body, reply_a, reply_b) in enumerate(replies)]
        self._report("done")
        return ABResult(self.a, self.b, self.bodies, verdicts)

    def _run_side(self, side: Side) -> None:
        from nanoserve.server.serve import Server

        if self._cancel.is_set():
            raise ABCancelled("stopped before loading")
        self._report(f"loading {side.name}")
        with labelled_logs(f"A/B arm {side.name}"):  # its "engine ready" line is not the main engine's
            server = Server(side.config, port=0)  # loads the engine (not interruptible; a cancel waits for it)
        self.live.append(server)
        try:
            server.start()
            if self._cancel.is_set():
                raise ABCancelled("stopped while loading")
            side.health_before = settled_health(server.url)
            self._report(f"firing {side.name}")
            side.fired = asyncio.run(fire(server.url, self.bodies, self.concurrency,
                                          lambda reply: self._report(self.phase, 1), self._cancel))
            side.health_after = settled_health(server.url)
        finally:
            server.stop()
            side.blocks_held_after_stop = server.host.stats().kv.blocks_used
            self.live.remove(server)
            del server  # its memory goes back before the next side loads, which on CUDA sizes to what is free
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _report(self, phase: str, finished: int = 0) -> None:
        self.phase, self.done = phase, self.done + finished
        if self.progress is not None:
            self.progress(phase, self.done, self.total)


def run_ab(config_a: EngineConfig, config_b: EngineConfig, bodies: list[dict], concurrency: int,
           progress: Progress | None = None) -> ABResult:
    return ABRun(config_a, config_b, bodies, concurrency, progress).run()


def snippet(text: str, width: int = 40) -> str:
    """A reply's start on one line, for a table cell."""
    return text[:width].replace("\n", "⏎")
