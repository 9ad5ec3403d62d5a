"""A data-parallel replica's Status every STATUS_EVERY_S carries its latest finished rows (each with its user and
session) only when one was added: a quiet replica sends no row text, and the front end's link keeps the rows
last sent. The real replica, host and tiny engine, joined by a pipe instead of a socket."""

from __future__ import annotations

import pickle
from multiprocessing import Pipe

from nanoserve import LLM, SamplingParams
from nanoserve.dp.link import ReplicaLink
from nanoserve.dp.replica import Replica
from nanoserve.dp.routing import ReplicaView
from nanoserve.server.host import EngineHost
from nanoserve.server.protocol import MAX_USER_CHARS
from tests.helpers import wait_until


def test_a_status_carries_finished_rows_only_when_they_changed(tiny_checkpoint):
    host = EngineHost(LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine).start()
    here, _there = Pipe()
    replica, link = Replica(here, 0), ReplicaLink(0, ReplicaView(0))
    replica.host = host
    users = [f"{i}".ljust(MAX_USER_CHARS, "u") for i in range(3)]  # distinct: pickle writes a repeated one once
    try:
        link.take_status(first := replica._status())
        assert first.finished_rows == () and link.stats.finished_rows == ()
        for i, user in enumerate(users):
            host.submit(f"Hello {i}", SamplingParams(max_tokens=2), lambda _: None, user=user)
        assert wait_until(lambda: len(host.stats().finished_rows) == 3, timeout=60)
        link.take_status(changed := replica._status())
        assert [r.user for r in changed.finished_rows] == users[::-1] and changed.stats.finished_rows == ()
        quiet = [replica._status() for _ in range(5)]  # nothing finished since: no row travels
        assert all(s.finished_rows is None for s in quiet)
        for status in quiet:
            link.take_status(status)
        assert link.stats.finished_rows == host.stats().finished_rows  # the front end keeps the rows last sent
        assert len(pickle.dumps(quiet[-1])) + 3 * MAX_USER_CHARS < len(pickle.dumps(changed))
    finally:
        host.shutdown()
