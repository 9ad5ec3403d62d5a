"""`nanoserve-console --attach URL`: the console watches servers that run elsewhere, over their /health.

The servers here are real (the tiny checkpoint on loopback); the console reaches them only by HTTP, as it would a
server on another machine. A dead replica is a port nothing listens on.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

pytest.importorskip("textual")

from console.app import NanoserveConsole  # noqa: E402
from console.cli import main  # noqa: E402
from console.panels.rows import RowsTable  # noqa: E402
from console.panels.servers import ServerTabs  # noqa: E402
from console.remote import AttachedServer, RemoteHost, normalise_url  # noqa: E402
from console.screens.chat import ChatScreen  # noqa: E402
from console.screens.flags import FlagsScreen  # noqa: E402
from console.screens.load import LoadScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.stats import EngineStats  # noqa: E402
from tests.console_helpers import Requests, notes, text, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def dead_url():
    """A loopback port that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def second_server(tiny_checkpoint):
    """Another replica, with its own flags, so the tabs can be told apart."""
    from nanoserve.server.serve import Server

    s = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=512, kv_cache_gib=0.01,
                            max_num_seqs=3), port=0, served_model_name="tiny-b", api_key="sesame").start()
    yield s
    s.stop()


def test_the_snapshot_survives_its_json(tiny_server):
    """What /health publishes reads back as the same snapshot: every field and section the panels read."""
    Requests(tiny_server.url, n=2, max_tokens=8).join()
    body = httpx.get(f"{tiny_server.url}/health").json()
    stats = EngineStats.from_dict(body)
    assert json.loads(json.dumps(stats.as_dict())) == {k: v for k, v in body.items()
                                                       if k not in ("status", "reason", "failed_steps_total")}
    assert stats.scheduler.generation_tokens_total >= 16 and stats.vocab_size > 0
    assert "windows" in stats.features and "stalls" in stats.features
    with pytest.raises(ValueError, match="not a nanoserve stats snapshot"):
        EngineStats.from_dict({"model": "x"})


def test_urls_name_the_server_root():
    assert normalise_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalise_url("http://h:8000/v1/") == "http://h:8000"
    assert normalise_url(" https://h/ ") == "https://h"


def test_a_dead_server_is_unreachable_with_the_reason(dead_url):
    host = RemoteHost(dead_url, interval=0.05).start()
    try:
        assert host.wait_polled()
        assert host.stats() is None
        assert host.health.status == "unreachable" and "Connect" in host.health.reason
    finally:
        host.stop()


def test_a_server_that_wants_a_key_is_locked_not_down(second_server, capsys):
    """Without its key (or with a wrong one) a keyed server's /health gives no snapshot: the console says which
    key to give, and --once exits 1 saying so; with the key it watches as usual."""
    for headers, said in (({}, "wants an API key for its stats: --api-key"),
                          ({"Authorization": "Bearer nope"}, "did not accept the API key given")):
        host = RemoteHost(second_server.url, interval=0.05, headers=headers).start()
        assert host.wait_polled()
        host.stop()
        assert host.health.status == "locked" and said in host.health.reason and "ok" in host.health.reason
        assert host.stats() is None and not host.health.serving
    assert main(["--once", "--refresh", "0.1", "--attach", second_server.url]) == 1
    assert "no snapshot: locked (this server wants an API key for its stats: --api-key" in capsys.readouterr().out
    assert main(["--once", "--refresh", "0.1", "--attach", second_server.url, "--api-key", "sesame"]) == 0
    assert "serving tiny-b" in capsys.readouterr().out


def test_a_stopped_engine_is_read_from_its_503(tiny_checkpoint):
    """/health answers 503 with the snapshot and a reason; the poller keeps both."""
    from nanoserve.server.serve import Server

    server = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01),
                    port=0).start()
    try:
        server.host.shutdown(drain=False)
        host = RemoteHost(server.url, interval=0.05).start()
        assert host.wait_polled()
        host.stop()
        assert host.health.status == "stopped" and not host.health.serving
        assert host.stats() is not None and host.stats().max_model_len == 128
    finally:
        server.stop()


async def test_tabs_watch_replicas_and_screens_follow_the_selected_one(tiny_server, second_server, dead_url):
    servers = [AttachedServer(tiny_server.url, 0.05), AttachedServer(second_server.url, 0.05, "sesame"),
               AttachedServer(dead_url, 0.05)]
    app = NanoserveConsole(EngineConfig(), refresh_s=0.05, servers=servers)
    async with app.run_test(size=(150, 48)) as pilot:
        await wait_until(pilot, lambda: app.server is not None, 15, "the first snapshot")
        assert app.phase == "serving"
        tabs = app.screen.query_one(ServerTabs)
        await wait_until(pilot, lambda: "DOWN" in str(tabs.query_one("#server-2").label), 5, "the dead tab")
        assert "ok" in str(tabs.query_one("#server-0").label)
        await wait_until(pilot, lambda: f"attached to {tiny_server.url} (1 of 3" in text(app, "#status"), 5,
                         "the status line")
        assert "max_model_len 128" in text(app, "#header")

        # rows of requests sent to the server itself (not through the console) reach the dashboard
        table = app.screen.query_one(RowsTable)
        seen = []
        load = Requests(tiny_server.url, n=3, max_tokens=60)
        await wait_until(pilot, lambda: seen.append(table.row_count) or not load.is_alive(), 30, "the requests")
        assert not load.errors and max(seen) > 0
        await wait_until(pilot, lambda: "finished    " in text(app, "#throughput-text") and
                         int(text(app, "#throughput-text").split("finished")[1].split()[0].replace(",", "")) >= 3,
                         5, "the finishes")

        await pilot.press("right_square_bracket")  # the second replica: its own flags in the header
        await wait_until(pilot, lambda: "max_num_seqs=3" in text(app, "#header"), 5, "the second header")
        await wait_until(pilot, lambda: f"attached to {second_server.url} (2 of 3" in text(app, "#status"), 5,
                         "the second status")
        assert tabs.active == "server-1"

        await pilot.press("right_square_bracket")  # the dead one: said on the status line, in red
        await wait_until(pilot, lambda: "unreachable" in text(app, "#status"), 5, "the dead status")
        assert app.screen.query_one("#status").has_class("failed")
        # none of the second server's figures under the dead one's name
        assert "no snapshot yet" in text(app, "#header") and not app.screen.query_one("#panels").display
        assert "no snapshot from" in text(app, "#no-snapshot")
        assert app.phase.startswith("unreachable")

        await pilot.press("right_square_bracket")  # round to the first again
        await wait_until(pilot, lambda: app.selected == 0 and app.phase == "serving", 5, "the first again")
        await wait_until(pilot, lambda: app.screen.query_one("#panels").display, 5, "the panels again")
        assert "max_model_len 128" in text(app, "#header")


async def test_flags_are_shown_not_applied_and_chat_sends_with_the_key(second_server):
    app = NanoserveConsole(EngineConfig(), refresh_s=0.05,
                           servers=[AttachedServer(second_server.url, 0.05, "sesame")])
    async with app.run_test(size=(150, 48)) as pilot:
        await wait_until(pilot, lambda: app.phase == "serving", 15, "the server")
        assert not app.screen.query(ServerTabs), "one server needs no tabs"
        await pilot.press("f")
        await wait_until(pilot, lambda: isinstance(app.screen, FlagsScreen), 5, "the flags screen")
        await wait_until(pilot, lambda: app.screen.query_one("#flag-max_num_seqs").value == "3", 5,
                         "the published flags in the form")
        assert "tiny-b" in str(app.screen.query_one("#fixed-model").content)
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "not applied: attached to" in notes(app), 5, "the refusal")
        flags = app.screen
        flags.query_one("#flag-max_num_seqs").value = "2"  # a live flag: through the server's POST /knobs
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "applied live" in text(app, "#flags-message"), 10, "the live change")
        assert f"max_num_seqs 3 -> 2; no restart on {second_server.url}" in text(app, "#flags-message")
        assert second_server.host.serving().config.max_num_seqs == 2
        assert second_server.host.serving().knobs.log[-1].who.startswith("http ")
        flags.query_one("#flag-max_step_ms").value = "100000"  # the server's range refuses it: said, not crashed
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "not applied" in text(app, "#flags-message"), 10, "the server's refusal")
        assert "max_step_ms must be a number of milliseconds in [0, 60000]" in text(app, "#flags-message")
        assert second_server.host.serving().config.max_step_ms is None
        flags.query_one("#flag-max_step_ms").value = ""
        second_server.host.serving().set_live({"max_num_seqs": 3}, "test")  # as the other tests expect it

        await pilot.press("c")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatScreen), 5, "the chat screen")
        await pilot.press(*"hi", "enter")
        chat = app.screen
        # the turn is over only when the screen stops generating (the finish reason arrives a moment before): an
        # Esc pressed while it still generates cancels the answer and keeps the focus in the field
        await wait_until(pilot, lambda: (chat.last_finish in ("stop", "length") and not chat.generating)
                         or chat.query(".chat-error"), 30, "the answer")
        assert not chat.query(".chat-error"), str(chat.query_one(".chat-error").content)  # the key was sent
        assert chat.last_tokens > 0

        await pilot.press("escape", "l")  # a load run against it: synthetic prompts from its published vocabulary
        await wait_until(pilot, lambda: isinstance(app.screen, LoadScreen), 5, "the load screen")
        load = app.screen
        for field, value in (("load-n", "4"), ("load-concurrency", "2"), ("load-output", "8"), ("load-input", "16"),
                             ("load-dataset", "synthetic")):
            load.query_one(f"#{field}").value = value
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: load.summary is not None, 60, "the load run")
        assert "successful 4  failed 0" in text(app, "#load-summary")


def test_once_prints_every_replica_and_fails_for_a_dead_one(tiny_server, dead_url, capsys):
    assert main(["--once", "--refresh", "0.1", "--attach", tiny_server.url]) == 0
    out = capsys.readouterr().out
    assert f"attached to {tiny_server.url}: serving tiny" in out and "== KV cache ==" in out
    assert main(["--once", "--refresh", "0.1", "--attach", tiny_server.url, "--attach", dead_url]) == 1
    out = capsys.readouterr().out
    assert out.count("== KV cache ==") == 1 and f"== {dead_url} ==\nno snapshot: unreachable" in out


def test_engine_flags_with_attach_are_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--attach", "http://127.0.0.1:9", "--max-num-seqs", "4"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs would configure an engine here" in err
    with pytest.raises(SystemExit):
        main(["--api-key", "k"])
    assert "--api-key is for --attach" in capsys.readouterr().err
