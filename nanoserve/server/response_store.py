"""The responses kept for `previous_response_id` and GET / DELETE /v1/responses/{id}: in memory, bounded.

A response is kept (with `store`, OpenAI's default) together with its conversation so far: the items of the turns
before it, its input and its output, so a later request that names it continues that conversation. Nothing is
written to disk: a restart of the process forgets them all (a restart of the engine from the console keeps them,
as the app is the same).

Bounds, each measured as JSON: one entry (the response with its whole conversation) at most MAX_ENTRY_BYTES (a
larger one is not kept), all of them at most MAX_BYTES and MAX_KEPT, each for MAX_AGE_S seconds. An entry's
conversation is counted whole even where it shares items with the entry it continues: an over-count, never an
under-count. Entries belong to their request's `user` (or `safety_identifier`; "" when it named none); when the
store is over a bound, the oldest entry of whoever holds the most (bytes, or entries for the count) goes first,
so a caller that stores many or large responses pushes out its own before anyone else's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_KEPT = 1000
MAX_AGE_S = 3600.0
MAX_BYTES = 256 * 2**20
MAX_ENTRY_BYTES = 8 * 2**20


def json_size(value) -> int:
    """Bytes of `value` as ASCII JSON: what the store counts (non-ASCII text counts 6 bytes a character)."""
    return len(json.dumps(value))


@dataclass
class Stored:
    response: dict
    conversation: list[dict]  # every input and output item up to and including this response
    at: float
    owner: str = ""
    conversation_bytes: int = 0  # json_size of the conversation, counted as it grew
    size: int = 0  # what the entry counts against the store's bounds: its conversation and its response


@dataclass
class _Holding:
    """One owner's entries, oldest first, and their bytes."""

    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    size: int = 0


class ResponseStore:
    def __init__(self, max_kept: int | None = None, max_age_s: float | None = None, max_bytes: int | None = None,
                 max_entry_bytes: int | None = None):
        """Each bound None: the module's (read here, so a test can set them for a server it starts)."""
        self.max_kept = MAX_KEPT if max_kept is None else max_kept
        self.max_age_s = MAX_AGE_S if max_age_s is None else max_age_s
        self.max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self.max_entry_bytes = MAX_ENTRY_BYTES if max_entry_bytes is None else max_entry_bytes
        self._kept: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self._owners: dict[str, _Holding] = {}
        self.size = 0  # bytes of every entry kept
        self._lock = threading.Lock()

    @staticmethod
    def conversation_bytes(prior: Stored | None, items: list[dict]) -> int:
        """The bytes of `prior`'s conversation followed by `items` (without measuring the prior's again)."""
        return (prior.conversation_bytes if prior is not None else 0) + json_size(items)

    def put(self, response: dict, conversation: list[dict], owner: str = "",
            conversation_bytes: int | None = None) -> bool:
        """Keep `response` with its conversation for `owner`; False (nothing kept) when the entry alone is over
        max_entry_bytes. Older entries go as the bounds require (the module's docstring says whose)."""
        if conversation_bytes is None:
            conversation_bytes = json_size(conversation)
        size = conversation_bytes + json_size(response)
        if size > self.max_entry_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._kept[response["id"]] = Stored(response, conversation, time.monotonic(), owner, conversation_bytes,
                                                size)
            holding = self._owners.setdefault(owner, _Holding())
            holding.ids[response["id"]] = None
            holding.size += size
            self.size += size
            self._expire()
            self._make_room()
        return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def held_by(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) `owner` holds."""
        with self._lock:
            holding = self._owners.get(owner)
            return (len(holding.ids), holding.size) if holding is not None else (0, 0)

    def _drop(self, response_id: str) -> bool:
        stored = self._kept.pop(response_id, None)
        if stored is None:
            return False
        holding = self._owners[stored.owner]
        del holding.ids[response_id]
        holding.size -= stored.size
        self.size -= stored.size
        if not holding.ids:
            del self._owners[stored.owner]
        return True

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self._kept and next(iter(self._kept.values())).at < oldest:
            self._drop(next(iter(self._kept)))

    def _make_room(self) -> None:
        while len(self._kept) > self.max_kept or self.size > self.max_bytes:
            by_count = len(self._kept) > self.max_kept
            owner = max(self._owners, key=lambda o: len(self._owners[o].ids) if by_count else self._owners[o].size)
            self._drop(next(iter(self._owners[owner].ids)))
