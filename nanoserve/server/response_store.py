"""The responses kept for `previous_response_id` and GET / DELETE /v1/responses/{id}: in memory, bounded.

A response is kept (with `store`, OpenAI's default) together with its conversation so far: the items of the turns
before it, its input and its output, so a later request that names it continues that conversation. At most
MAX_KEPT are kept, each for MAX_AGE_S seconds; the oldest go first. Nothing is written to disk: a restart of the
process forgets them all (a restart of the engine from the console keeps them, as the app is the same).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_KEPT = 1000
MAX_AGE_S = 3600.0


@dataclass
class Stored:
    response: dict
    conversation: list[dict]  # every input and output item up to and including this response
    at: float


class ResponseStore:
    def __init__(self, max_kept: int = MAX_KEPT, max_age_s: float = MAX_AGE_S):
        self.max_kept, self.max_age_s = max_kept, max_age_s
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._kept[response["id"]] = Stored(response, conversation, time.monotonic())
            self._expire()

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self._kept and (len(self._kept) > self.max_kept or next(iter(self._kept.values())).at < oldest):
            self._kept.popitem(last=False)
