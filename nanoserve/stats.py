"""EngineStats: one immutable snapshot that /health, /metrics, the console and the benchmarks all read.

Readers format these numbers; none computes a counter of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from nanoserve.attention.dispatch import ReadStats


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    peak_running: int
    preemptions: int
    finished: dict  # finish reason -> count
    prompt_tokens_total: int
    generation_tokens_total: int
    steps: int


@dataclass(frozen=True)
class KVStats:
    block_size: int
    blocks_total: int  # usable blocks (the null block excluded)
    blocks_free: int
    blocks_used: int
    bytes: int

    @property
    def usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


@dataclass(frozen=True)
class PrefixCacheStats:
    """Automatic prefix caching, in tokens as vLLM counts it: tokens looked up and tokens found cached."""

    enabled: bool
    queries: int = 0  # tokens of the requests that looked (each admission, preemption's re-admission too)
    hits: int = 0  # of those, tokens served from cached blocks
    cached_blocks: int = 0  # blocks holding named content, held or free
    cached_free_blocks: int = 0  # of those, free: kept until the pool needs them
    evictions: int = 0  # cached blocks handed out for new content

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class RowStats:
    """One request as the Requests table shows it: live (its state "running" or "waiting"), or among the latest
    finished (state "finished", with its finish reason)."""

    request_id: str
    state: str
    prompt_tokens: int
    generated_tokens: int
    blocks: int
    tokens_per_s: float = 0.0  # generated tokens over the time since its first token
    user: str | None = None  # the client's `user` field, when it sent one
    session_id: str | None = None  # vLLM's `session_id`, when the client sent one
    spec_draft_tokens: int = 0  # tokens speculative decoding drafted for it, and of those, kept
    spec_accepted_tokens: int = 0
    ttft_s: float | None = None  # its first token's time after arrival (None before it)
    tpot_s: float | None = None  # time a token after the first (None before a second)
    total_s: float | None = None  # arrival to finish, or to now while live
    finish_reason: str | None = None
    replica: int | None = None  # the data-parallel replica serving it (None: a single engine)


@dataclass(frozen=True)
class LatencyStats:
    """Percentiles over the engine's most recent finished requests and steps (seconds; None before any)."""

    window: int  # finished requests the request percentiles cover
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    step_p50: float | None = None  # wall time of one engine step, over the most recent steps
    step_p99: float | None = None


def percentiles(values, *qs: float) -> tuple[float | None, ...]:
    """Nearest-rank percentiles (each q in [0, 1]) of a small sample, sorted once; Nones for an empty one."""
    if not values:
        return (None,) * len(qs)
    ordered = sorted(values)
    return tuple(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] for q in qs)


@dataclass(frozen=True)
class Numerics:
    """What the engine computes in, as built (see numerics.numerics_of)."""

    weights: str  # e.g. "int4 (head bfloat16, rest float32)": the decoder linears' form first
    activations: str  # e.g. "bfloat16 in linears, float32"
    kv_cache: str
    determinism: str = ""  # "batch-invariant", or why not (the flag off, or a kernel of this machine)

    def text(self) -> str:
        tail = f" · {self.determinism}" if self.determinism else ""
        return f"weights {self.weights} · activations {self.activations} · KV {self.kv_cache}{tail}"


@dataclass(frozen=True)
class EngineStats:
    model: str
    device: str
    dtype: str
    max_model_len: int
    flags: dict
    scheduler: SchedulerStats
    kv: KVStats
    paged_read: ReadStats
    rows: tuple[RowStats, ...]
    finished_rows: tuple[RowStats, ...] = ()  # the latest finished requests, newest first (timeline.FINISHED_ROWS)
    latency: LatencyStats = LatencyStats(window=0)
    prefix_cache: PrefixCacheStats = PrefixCacheStats(enabled=False)
    features: dict = field(default_factory=dict)  # what optional features publish (e.g. inputs); absent while off
    vocab_size: int = 0  # the tokenizer's ids (what a load generator draws random prompts from)
    vllm_counts: dict = field(default_factory=dict)  # iteration_stats.IterationStats.as_dict(): for vllm: metrics
    numerics: Numerics | None = None  # what runs: weights, activations, KV cache (None from an older server)

    @property
    def sections(self) -> dict:
        """The name `features` had before (kept for scripts that read it)."""
        return self.features

    def as_dict(self) -> dict:
        """JSON-ready: the shape /health publishes."""
        return {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "numerics": asdict(self.numerics) if self.numerics is not None else None,
            "flags": dict(self.flags),
            "scheduler": asdict(self.scheduler),
            "kv": {**asdict(self.kv), "usage": self.kv.usage},
            "paged_read": self.paged_read.as_dict(),
            "latency": asdict(self.latency),
            "prefix_cache": {**asdict(self.prefix_cache), "hit_rate": self.prefix_cache.hit_rate},
            "rows": [asdict(r) for r in self.rows],
            "finished_rows": [asdict(r) for r in self.finished_rows],
            **self.features,
        }

    @classmethod
    def from_dict(cls, data: dict) -> EngineStats:
        """The snapshot back from its published shape (a /health body): what `--attach` watches. Keys that
        are not the snapshot's own (health's status and reason) are dropped; every other key is a feature's.
        Derived figures (usage, saving, hit_rate) are recomputed, so the JSON's copies are not trusted twice."""
        try:
            return cls(
                model=data["model"], device=data["device"], dtype=data["dtype"],
                max_model_len=data["max_model_len"], vocab_size=data.get("vocab_size", 0), flags=dict(data["flags"]),
                numerics=_build(Numerics, data["numerics"]) if data.get("numerics") else None,
                scheduler=_build(SchedulerStats, data["scheduler"]), kv=_build(KVStats, data["kv"]),
                paged_read=_build(ReadStats, data["paged_read"]),
                rows=tuple(_build(RowStats, row) for row in data["rows"]),
                finished_rows=tuple(_build(RowStats, row) for row in data.get("finished_rows", ())),
                latency=_build(LatencyStats, data["latency"]),
                prefix_cache=_build(PrefixCacheStats, data["prefix_cache"]),
                features={k: v for k, v in data.items() if k not in _OWN_KEYS and k not in NOT_FEATURES},
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a nanoserve stats snapshot (missing or malformed {e}); is this a nanoserve "
                             "server's /health?") from None


NOT_FEATURES = ("status", "reason", "failed_steps_total")  # what /health adds around the snapshot
_OWN_KEYS = frozenset(f.name for f in fields(EngineStats)) - {"features"}  # every other key is a feature's


def _build(cls, values: dict):
    """A snapshot dataclass from its dict, keeping only its own fields (a newer server may publish more)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})
