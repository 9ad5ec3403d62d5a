"""`--data-parallel-size 2` (the mp backend) on the tiny checkpoint: every answer is the single engine's, requests
sharing a prefix go where it is cached, /health and /metrics show each replica, the operator's calls reach them
all, and a replica killed mid-run ends its streams with an error, is routed around, and comes back."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from nanoserve.server.serve import DataParallel
from tests.helpers import tiny_server_running, wait_until

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away", "1 2 3 4 5 6 7", "hello " * 30]


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), data_parallel=DataParallel(2), prompt_tokens_details=True) as s:
        yield s


def _complete(server, prompt, **fields):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, **fields}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _replicas(server):
    return httpx.get(server.url + "/health", timeout=10).json()["data_parallel"]["replicas"]


def _replica_of(server, request_id):
    rows = httpx.get(server.url + "/requests", params={"match": request_id}, timeout=10).json()["requests"]
    return {row["replica"] for row in rows if row["request_id"] == request_id}


def test_health_lists_each_replica(dp_server):
    body = httpx.get(dp_server.url + "/health", timeout=10).json()
    dp = body["data_parallel"]
    assert body["status"] == "ok" and dp["size"] == 2 and dp["backend"] == "mp" and dp["replicas_ready"] == 2
    pids = {r["pid"] for r in dp["replicas"]}
    assert len(pids) == 2 and None not in pids
    assert [r["status"] for r in dp["replicas"]] == ["ready", "ready"]
    assert body["kv"]["blocks_total"] == 2 * dp_server.host.links[0].stats.kv.blocks_total  # the pools add up


def test_every_replica_answers_as_the_single_engine_does(dp_server, tiny_offline):
    """Both replicas serve, and each answer is byte for byte the offline engine's (greedy)."""
    from nanoserve import SamplingParams

    want = [o.outputs[0].text for o in tiny_offline.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]
    got, served_by = [], set()
    for prompt in PROMPTS * 2:
        answer = _complete(dp_server, prompt, cache_salt=f"s{len(got)}")  # a salt each: no affinity, load decides
        got.append(answer["choices"][0]["text"])
        served_by |= _replica_of(dp_server, answer["id"])
    assert got == want * 2
    assert served_by == {0, 1}


def test_a_shared_prefix_goes_where_it_is_cached(dp_server):
    prefix = "You are a careful assistant. Answer briefly and exactly. " * 3
    first = _complete(dp_server, prefix + "Question one?", cache_salt="affinity")
    home = _replica_of(dp_server, first["id"])
    assert len(home) == 1
    matched_before = sum(r["routed_prefix_blocks_matched"] for r in _replicas(dp_server))
    for n in range(4):
        again = _complete(dp_server, prefix + f"Question {n}?", cache_salt="affinity")
        assert _replica_of(dp_server, again["id"]) == home
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert sum(r["routed_prefix_blocks_matched"] for r in _replicas(dp_server)) > matched_before


def test_finished_rows_reach_health_from_the_replicas(dp_server):
    """A replica sends its finished rows only when they change; /health still lists each with its user."""
    users = {f"rows-{n}" for n in range(4)}
    for n, user in enumerate(sorted(users)):
        _complete(dp_server, PROMPTS[n], user=user, cache_salt=user)

    def listed():
        rows = httpx.get(dp_server.url + "/health", timeout=10).json()["finished_rows"]
        return {row["user"]: row["replica"] for row in rows if row["user"] in users}

    assert wait_until(lambda: set(listed()) == users, timeout=30)
    assert set(listed().values()) <= {0, 1}


def test_metrics_carry_a_series_per_replica(dp_server):
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(dp_server.url + "/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert sorted(s.labels["engine"] for s in families[name].samples) == ["0", "1"], name
    assert sorted(s.labels["engine"] for s in families["vllm:cache_config_info"].samples) == ["0", "1"]


def test_the_operators_calls_reach_every_replica(dp_server):
    _complete(dp_server, PROMPTS[3])
    r = httpx.post(dp_server.url + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 200 and r.json()["reset"] is True
    changed = httpx.post(dp_server.url + "/knobs", json={"max_num_seqs": 8}, timeout=10)
    assert changed.status_code == 200, changed.text
    assert wait_until(lambda: all(link.stats.flags["max_num_seqs"] == 8 for link in dp_server.host.links))
    log = httpx.get(dp_server.url + "/knobs", timeout=10).json()["log"]
    assert any("max_num_seqs" in json.dumps(change) for change in log)
    answer = _complete(dp_server, PROMPTS[0])
    timeline = httpx.get(dp_server.url + f"/requests/{answer['id']}", timeout=10).json()
    assert timeline["sequences"][0]["replica"] in (0, 1)
    refused = httpx.post(dp_server.url + "/knobs", json={"model": "x"}, timeout=10)
    assert refused.status_code == 400


def test_a_duplicate_live_request_id_is_refused(dp_server):
    """The front end keeps the ids unique across replicas, as one engine does."""
    host = dp_server.host
    with host._lock:
        host._requests["dup-id"] = None  # a live request of that id, as the table holds it
    try:
        import asyncio

        from nanoserve.errors import RequestError
        from nanoserve.sampling import SamplingParams

        with pytest.raises(RequestError, match="already in use"):
            asyncio.run(host.open("hi", SamplingParams(max_tokens=1), request_id="dup-id"))
    finally:
        with host._lock:
            host._requests.pop("dup-id", None)


def _stream(server, prompt, results, index):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 90, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_salt": f"k{index}"}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        if r.status_code != 200:  # refused before its stream started (its replica died before admitting it)
            r.read()
            events = [json.dumps(r.json()), "[DONE]"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    results[index] = events


def test_a_killed_replica_ends_its_streams_and_comes_back(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), data_parallel=DataParallel(2)) as server:
        host = server.host
        assert host.address[0] == "127.0.0.1"  # local replicas: the listener is on loopback
        for value in [4, 5] * 15:  # a restarted replica takes where the changes ended, not their history
            assert httpx.post(server.url + "/knobs", json={"max_num_seqs": value}, timeout=10).status_code == 200
        results: dict = {}
        threads = [threading.Thread(target=_stream, args=(server, PROMPTS[i % 4], results, i)) for i in range(6)]
        for t in threads:
            t.start()
        assert wait_until(lambda: host.links[1].view.in_flight > 0 and host.links[0].view.in_flight > 0)
        old_pid = host.links[1].pid
        host.launcher.kill(1)
        for t in threads:
            t.join(60)
        assert len(results) == 6
        failed = [events for events in results.values() if any('"error"' in e for e in events)]
        finished = [events for events in results.values() if not any('"error"' in e for e in events)]
        assert failed and finished  # replica 1's streams heard the error, replica 0's ran to their end
        for events in results.values():
            assert events[-1] == "[DONE]"  # every stream ended properly
        for events in failed:
            error = json.loads(next(e for e in events if '"error"' in e))["error"]
            assert "replica 1 stopped" in error["message"]
        for events in finished:
            assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) > 0
        assert wait_until(lambda: host.links[1].status == "ready", timeout=60)
        assert wait_until(lambda: host.links[1].stats.flags["max_num_seqs"] == 5)  # the live change, replayed
        log = host._op(host.links[1], "knobs").result(timeout=10)["log"]
        assert [(c["name"], c["new"]) for c in log if "replayed" in c["who"]] == [("max_num_seqs", 5)]
        replica = _replicas(server)[1]
        assert replica["restarts"] == 1 and replica["pid"] != old_pid
        assert host.accounting()["live"] == 0
        served = {next(iter(_replica_of(server, _complete(server, p, cache_salt=p)["id"]))) for p in PROMPTS}
        assert served == {0, 1}  # the new replica 1 serves again


def test_a_replica_killed_again_while_starting_is_started_again(tiny_checkpoint):
    """A restarted replica that dies before it connects (killed, out of memory while loading) has no connection
    to drop: the front end still notices, and starts it again."""
    with tiny_server_running(tiny_checkpoint("llama"), data_parallel=DataParallel(2)) as server:
        host = server.host
        host.launcher.kill(1)
        assert wait_until(lambda: host.links[1].status == "starting" and host.links[1].conn is None
                          and host.launcher.running(1), timeout=60)  # spawned (starting is said before spawning)
        host.launcher.kill(1)  # before its Hello: no connection to drop
        assert wait_until(lambda: "while starting" in (host.links[1].reason or ""), timeout=30)
        assert wait_until(lambda: host.links[1].status == "ready", timeout=120), host.links[1].describe()
        assert _replicas(server)[1]["restarts"] == 2


def test_replicas_that_cannot_load_stop_the_start_with_the_reason(tmp_path):
    from nanoserve import EngineConfig
    from nanoserve.dp.front import ReplicaStartFailed
    from nanoserve.server.serve import Server

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ReplicaStartFailed, match="not valid JSON"):
        Server(EngineConfig(model=str(tmp_path)), port=0, data_parallel=DataParallel(2))


def test_the_ray_backend_without_ray_names_the_extra(monkeypatch):
    import sys

    from nanoserve import EngineConfig
    from nanoserve.dp.launch import launcher
    from nanoserve.optional import MissingDependency

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependency, match=r"nanoserve\[ray\]"):
        launcher("ray", EngineConfig(), 2, None)


async def test_the_attached_console_shows_each_replica(dp_server):
    pytest.importorskip("textual")
    from console.app import NanoserveConsole
    from console.panels.replicas import ReplicasPanel
    from console.panels.rows import RowsTable
    from console.remote import AttachedServer
    from nanoserve.config import EngineConfig
    from tests.console_helpers import Requests, text
    from tests.console_helpers import wait_until as wait_in_app

    app = NanoserveConsole(EngineConfig(), refresh_s=0.05, servers=[AttachedServer(dp_server.url, 0.05)])
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_in_app(pilot, lambda: "2 of 2 ready" in text(app, "#replicas"), 15, "the replicas panel")
        assert app.screen.query_one(ReplicasPanel).display
        shown = text(app, "#replicas")
        assert "mp · prefix-affinity · 2 of 2 ready" in shown
        lines = [line for line in shown.splitlines() if line.split()[:2] in (["0", "ready"], ["1", "ready"])]
        assert len(lines) == 2 and all("pid " in line for line in lines)
        assert "replicas" not in text(app, "#features-off")  # not a feature switched off
        table = app.screen.query_one(RowsTable)

        def states() -> set:
            return {str(table.get_row_at(i)[1]) for i in range(table.row_count)}

        load = Requests(dp_server.url, n=4, max_tokens=40)
        await wait_in_app(pilot, lambda: any(s.endswith((" @0", " @1")) for s in states()), 30,
                          "a row marked with its replica")
        load.join()


def test_each_replica_publishes_kv_events_with_its_rank(tiny_checkpoint):
    """--kv-events-config under data parallelism: replica r binds the port plus r, and its batches carry r; what a
    subscriber rebuilds per replica is what the front end routes by."""
    pytest.importorskip("zmq")
    import socket as sockets

    from tests.test_kv_events import Subscriber

    def two_free_ports() -> int:
        """A port free on loopback with the next one free too (replica 1 takes the port plus one)."""
        while True:
            with sockets.socket() as s, sockets.socket() as t:
                s.bind(("127.0.0.1", 0))
                try:
                    t.bind(("127.0.0.1", s.getsockname()[1] + 1))
                except OSError:
                    continue
                return s.getsockname()[1]

    port = two_free_ports()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    with tiny_server_running(tiny_checkpoint("llama"), {"kv_events_config": config},
                             data_parallel=DataParallel(2)) as server:
        subs = [Subscriber(f"tcp://127.0.0.1:{port + rank}", "") for rank in (0, 1)]
        try:
            def joined() -> bool:  # a SUB socket hears only what is sent once it has joined: a reset tells when
                httpx.post(server.url + "/reset_prefix_cache", timeout=10)
                for sub in subs:
                    sub.drain(100)
                return all("AllBlocksCleared" in sub.kinds for sub in subs)

            assert wait_until(joined, timeout=20, every=0.1)
            for i in range(6):
                _complete(server, f"kv events prompt number {i} " * 4, cache_salt=f"e{i}")
            for sub in subs:
                sub.drain()
            assert [sub.ranks for sub in subs] == [{0}, {1}]
            for rank, sub in enumerate(subs):
                assert sub.blocks and sub.blocks == server.host.links[rank].view.cached
        finally:
            for sub in subs:
                sub.close()


def test_a_replica_killed_while_loading_fails_the_start(tiny_checkpoint, monkeypatch):
    """Dying before Ready (out of memory while loading, say) stops the start with how it ended; no retry loop."""
    from nanoserve import EngineConfig
    from nanoserve.dp import front
    from nanoserve.dp.front import ReplicaStartFailed
    from nanoserve.server.serve import Server

    read = front.DataParallelHost._read

    def killed_after_hello(host, link, conn):  # replica 1 is SIGKILLed as soon as it has said Hello
        if link.rank == 1:
            host.launcher.kill(1)
        read(host, link, conn)

    monkeypatch.setattr(front.DataParallelHost, "_read", killed_after_hello)
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    with pytest.raises(ReplicaStartFailed, match=r"replica 1 did not start: it stopped while loading \(exit code"):
        Server(config, port=0, data_parallel=DataParallel(2))


def test_offline_data_parallelism_is_refused_with_where_to_get_it():
    from nanoserve import LLM
    from nanoserve.errors import ConfigError

    with pytest.raises(ConfigError, match="nanoserve serve --data-parallel-size N"):
        LLM(data_parallel_size=2)
