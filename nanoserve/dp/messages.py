"""What the front end and a replica send each other over their connection (multiprocessing.connection: pickled
objects, authenticated with a key only the front end's launcher hands out).

The front end sends Add / Abort / Op / Stop; the replica answers with Hello (once, before loading), Ready (once
loaded) or LoadFailed, then Accepted or Refused for each Add, Output for each step of a request, Failed when its
engine ended one with an error, Status every STATUS_EVERY_S, KVEvents after each step that named or evicted
blocks, and OpDone for each Op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATUS_EVERY_S = 0.1  # how often a replica reports its snapshot (load, KV use, rows) to the front end


# ---- front end -> replica --------------------------------------------------------------------------------
@dataclass
class Add:
    request_id: str
    prompt: Any  # text or token ids, as the route passed them
    params: Any  # SamplingParams
    user: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    streamed: bool = True
    origin: Any = None  # tracing.TraceOrigin


@dataclass
class Abort:
    request_id: str


@dataclass
class Op:
    """An operator's call on the replica's engine (see replica.OPS): reset_prefix_cache, knobs, set_live, rows,
    timeline."""

    call_id: int
    name: str
    args: tuple = ()


@dataclass
class Stop:
    drain: bool = False


# ---- replica -> front end --------------------------------------------------------------------------------
@dataclass
class Hello:
    rank: int
    pid: int
    node: str  # the host name it runs on
    actor_id: str | None = None  # a Ray actor's id


@dataclass
class Ready:
    """Loaded: what the front end needs to render and route prompts as the replica's engine will see them."""

    model_name: str
    tokenizer: Any
    model_config: Any
    max_model_len: int
    block_size: int
    cache_root: bytes  # KVManager.cache_root: the parent of every unsalted block-name chain
    prefix_caching: bool


@dataclass
class LoadFailed:
    reason: str


@dataclass
class Accepted:
    request_id: str


@dataclass
class Refused:
    request_id: str
    error: BaseException


@dataclass
class Output:
    request_id: str
    output: Any  # RequestOutput


@dataclass
class Failed:
    request_id: str
    error: BaseException


@dataclass
class Status:
    """The replica's snapshot. Its latest finished rows (each with its request's user and session) change only
    when a request finishes, so they travel apart, and only then: `stats` carries none, and `finished_rows` is
    None while they are the ones sent last."""

    stats: Any  # EngineStats, its finished_rows empty
    health: Any  # server.health.Health
    failed_steps_total: int
    finished_rows: tuple | None = None  # the latest finished RowStats, newest first; None: unchanged


@dataclass
class KVEvents:
    events: list = field(default_factory=list)  # kv.events records, in order


@dataclass
class OpDone:
    call_id: int
    result: Any = None
    error: BaseException | None = None


def portable(error: BaseException) -> BaseException:
    """An exception that survives pickling with its type and message (a class whose __init__ takes other
    arguments would not): rebuilt as its own type from the message when it can be, else as a RuntimeError
    naming the type."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        try:
            return type(error)(str(error))
        except Exception:
            return RuntimeError(f"{type(error).__name__}: {error}")
