"""Live knobs: the flags that change at the next step, with no restart, and the log of every change.

Operators tune by feel under load; a restart for each try drops the load they are tuning for. A live knob is one
the engine reads afresh each step (the scheduler's row and token limits, the step-time budget's target); every
other flag still needs a restart, which the flags screen and the route say. A change is checked as a whole new
EngineConfig first (the same checks as at start: the kind, so a boolean is no number, and the range, so inf and
NaN are refused), applied whole or not at all between two steps, and logged with who asked and the old and new
values. The row and token limits go live up to the values the engine started with: the decode fast
path's buffers, its captured graphs, the tensor-parallel buffers and the KV pool's sizing were made for those,
so raising them further takes a restart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque

from nanoserve.errors import ConfigError, shown
from nanoserve.step_budget import MOST_MS

CONFIG_LIVE = ("max_num_seqs", "max_num_batched_tokens", "max_step_ms",  # read by the scheduler each step
               "speculative_config",  # the drafter the scheduler asks: on, off, or another method
               "stall_factor", "stall_drop_fraction")  # the stall watch's thresholds, read each step
PROCESS_LIVE = ("log_level",)  # the process's, not an EngineConfig flag: the "nanoserve" loggers' level
LIVE = CONFIG_LIVE + PROCESS_LIVE
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_KEPT = 200  # changes the log keeps
LOGGER = "nanoserve"  # every module logs under it (nanoserve.engine, nanoserve.server, ...)


def log_level() -> str:
    """The level the engine's loggers log at now."""
    return logging.getLevelName(logging.getLogger(LOGGER).getEffectiveLevel())


def _check_log_level(value) -> str:
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ConfigError(f"log_level takes one of {', '.join(LOG_LEVELS)}, got {shown(value)}")
    return value.upper()


@dataclasses.dataclass(frozen=True)
class KnobChange:
    """One flag changed live: when (wall clock), at which step it took effect, who asked, old and new."""

    at: float
    step: int
    who: str
    name: str
    old: object
    new: object


class LiveKnobs:
    """Applies live changes to an engine's config, scheduler and step budget, and keeps their log."""

    def __init__(self, started_with):
        self.log: deque[KnobChange] = deque(maxlen=LOG_KEPT)
        self.ceilings = {name: getattr(started_with, name) for name in ("max_num_seqs", "max_num_batched_tokens")}

    def check(self, config, changes: dict):
        """The config with `changes`, or ConfigError naming what cannot change live or is out of range."""
        restart = sorted(set(changes) - set(LIVE))
        if restart:
            raise ConfigError(f"{', '.join(restart)} cannot change while the engine runs (a restart applies them); "
                              f"live: {', '.join(LIVE)}")
        changes = {name: value for name, value in changes.items() if name not in PROCESS_LIVE}
        if isinstance(changes.get("speculative_config"), dict):  # as vLLM's LLM takes it: kept as JSON
            changes = {**changes, "speculative_config": json.dumps(changes["speculative_config"]) or None}
        specs = {spec.name: spec for spec in type(config).flag_specs()}
        for name, value in changes.items():
            try:
                specs[name].check_kind(value)
            except ConfigError as e:
                raise ConfigError(f"{e}; {name} goes live {self.ranges()[name]}") from None
        new = dataclasses.replace(config, **changes)  # __post_init__ checks every value as at start
        for name, most in self.ceilings.items():
            if getattr(new, name) > most:
                raise ConfigError(f"{name} goes live up to {most}, what the engine started with (its buffers were "
                                  f"sized for it); a restart with --{name.replace('_', '-')} "
                                  f"{getattr(new, name)} raises it")
        return new

    def ranges(self) -> dict[str, str]:
        """Each live flag's values in words, for a refusal of the wrong kind (the range checks say their own)."""
        seqs, tokens = self.ceilings["max_num_seqs"], self.ceilings["max_num_batched_tokens"]
        return {"max_num_seqs": f"from 1 to {seqs}, what the engine started with",
                "max_num_batched_tokens": f"from max_num_seqs to {tokens}, what the engine started with",
                "max_step_ms": f"from 0 (off) to {MOST_MS} ms, or null (automatic)",
                "speculative_config": "as vLLM's speculative_config, an object or its JSON, or null (off)",
                "stall_factor": "as a finite number > 1", "stall_drop_fraction": "as a number between 0 and 1"}

    def apply(self, engine, changes: dict, who: str) -> list[KnobChange]:
        """Put `changes` in force for the engine's next step; returns what changed (unchanged values skipped).
        All or nothing: every value is checked, and the new drafter built, before anything changes."""
        new = self.check(engine.config, changes)
        level = _check_log_level(changes["log_level"]) if "log_level" in changes else None
        respec = new.speculative_config != engine.config.speculative_config
        drafter = engine.make_drafter(new.speculative_config) if respec else None
        done = [KnobChange(time.time(), engine.runner.steps + 1, who, name, getattr(engine.config, name),
                           getattr(new, name)) for name in changes
                if name in CONFIG_LIVE and getattr(engine.config, name) != getattr(new, name)]
        if level is not None and level != log_level():
            done.append(KnobChange(time.time(), engine.runner.steps + 1, who, "log_level", log_level(), level))
            logging.getLogger(LOGGER).setLevel(level)
        if respec:
            engine.use_drafter(drafter)
        engine.config = new
        engine.scheduler.max_num_seqs = new.max_num_seqs
        engine.scheduler.max_num_batched_tokens = new.max_num_batched_tokens
        engine.step_budget.max_step_ms = new.max_step_ms
        engine.stalls.factor, engine.stalls.drop_fraction = new.stall_factor, new.stall_drop_fraction
        self.log.extend(done)
        return done

    def record(self, engine, who: str, name: str, old, new) -> KnobChange:
        """Log an operation that is not a flag (the prefix cache's reset) beside the flag changes."""
        change = KnobChange(time.time(), engine.runner.steps + 1, who, name, old, new)
        self.log.append(change)
        return change

    def as_dict(self) -> dict:
        return {"live": list(LIVE), "log_level": log_level(), "log": [dataclasses.asdict(c) for c in self.log]}
