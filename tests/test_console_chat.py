"""The chat screen hosted by Textual's pilot, talking to a real engine through the console's own OpenAI server."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from textual.widgets import Input, Markdown  # noqa: E402

from console.app import NanoserveConsole  # noqa: E402
from console.screens.chat import ChatScreen  # noqa: E402
from console.screens.dashboard import Dashboard  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import notes, pace, started, text, wait_until  # noqa: E402


@pytest.fixture
def tiny_config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=512, kv_cache_gib=0.01, device="cpu")


async def open_chat(app, pilot, **controls) -> ChatScreen:
    """Switch to the chat screen with the key a user presses, and set its controls (temperature=..., max_tokens=...)."""
    await pilot.press("c")
    await wait_until(pilot, lambda: isinstance(app.screen, ChatScreen), 5, "the chat screen")
    chat = app.screen
    for name, value in controls.items():
        chat.query_one(f"#chat-{name.replace('_', '-')}", Input).value = value
    assert app.focused is chat.query_one("#chat-input")  # a question can be typed at once
    return chat


async def send(pilot, chat: ChatScreen, prompt: str) -> None:
    chat.query_one("#chat-input", Input).value = prompt
    await pilot.press("enter")


async def test_multi_turn_chat_with_the_default_model():
    app = NanoserveConsole(EngineConfig(device="cpu", max_model_len=512, kv_cache_gib=0.05), refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot, timeout=120)
        chat = await open_chat(app, pilot, temperature="0", max_tokens="24")
        await send(pilot, chat, "What is the capital of France?")
        await wait_until(pilot, lambda: not chat.generating, 60, "the first answer")
        assert chat.query_one("#chat-input", Input).value == ""  # sending took the prompt out of the input

        assert [m["role"] for m in chat.history] == ["user", "assistant"]
        assert "Paris" in chat.history[1]["content"]
        await wait_until(pilot, lambda: "Paris" in chat.query(Markdown).last().source, 5, "the streamed Markdown")
        stats = text(app, "#chat-stats")
        assert "TTFT" in stats and " ms" in stats and "tokens" in stats and "finish" in stats, stats
        assert chat.last_ttft_s is not None and chat.last_ttft_s > 0 and 0 < chat.last_tokens <= 24

        chat.query_one("#chat-max-tokens", Input).value = "12"
        await send(pilot, chat, "And what is the capital of Italy?")
        await wait_until(pilot, lambda: not chat.generating, 60, "the second answer")
        assert [m["role"] for m in chat.history] == ["user", "assistant", "user", "assistant"]
        assert chat.history[3]["content"].strip()
        assert len(chat.query(".exchange")) == 2

        await pilot.press("ctrl+n")  # a new chat forgets the turns
        await wait_until(pilot, lambda: not chat.query(".exchange"), 5, "the transcript to clear")
        assert chat.history == []


async def test_stop_key_cancels_frees_blocks_and_gives_the_prompt_back(tiny_config):
    app = NanoserveConsole(tiny_config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        pace(app.server.host.engine)  # the keys below must meet its requests still running
        chat = await open_chat(app, pilot, max_tokens="400")
        prompt = "Tell me a very long story"
        await send(pilot, chat, prompt)
        await wait_until(pilot, lambda: chat.last_tokens >= 3, 30, "the first tokens")
        assert chat.generating
        await pilot.press("escape")  # Esc leaves the field, as the README says; the answer streams on
        assert chat.generating and app.focused is None
        await pilot.press("ctrl+b")  # the cancel key

        assert not chat.generating
        assert chat.query_one("#chat-input", Input).value == prompt
        assert chat.history == []
        host = app.server.host
        await wait_until(pilot, lambda: host.stats().kv.blocks_used == 0 and host.stats().scheduler.running == 0,
                         10, "the engine to free the request's blocks")
        assert host.stats().scheduler.finished.get("abort", 0) == 1
        await wait_until(pilot, lambda: not chat.query(".exchange"), 5, "the partial turn to leave")

        assert chat.query_one("#chat-input", Input).value == prompt and app.focused is None

        chat.query_one("#chat-max-tokens", Input).value = "4"
        await pilot.press("enter", "enter")  # back into the prompt; the prompt that came back sends as it is
        await wait_until(pilot, lambda: not chat.generating, 30, "the resent answer")
        assert [m["role"] for m in chat.history] == ["user", "assistant"] and chat.history[0]["content"] == prompt

        await pilot.press("tab")  # out of the prompt, and the screen keys work again
        assert app.focused is chat.query_one("#chat-log")
        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, Dashboard), 5, "the dashboard")


async def test_bad_controls_send_nothing(tiny_config):
    app = NanoserveConsole(tiny_config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        chat = await open_chat(app, pilot)
        await pilot.press(*"hello")  # typed: the app's screen keys (e, l) go into the prompt, not to the app
        assert chat.query_one("#chat-input", Input).value == "hello" and isinstance(app.screen, ChatScreen)
        for control, bad in (("temperature", "hot"), ("max-tokens", "0"), ("seed", "1.5")):
            app.clear_notifications()
            field = chat.query_one(f"#chat-{control}", Input)
            good, field.value = field.value, bad
            await pilot.press("enter")
            await wait_until(pilot, lambda: "Nothing was sent" in notes(app), 5, f"the message about {control}")
            assert chat.history == [] and not chat.generating and not chat.query(".exchange")
            assert chat.query_one("#chat-input", Input).value == "hello"
            assert field.has_class("-invalid")
            field.value = good
        assert app.server.host.stats().scheduler.prompt_tokens_total == 0  # nothing reached the engine

        chat.query_one("#chat-max-tokens", Input).value = "100000"  # valid here, refused by the server
        await pilot.press("enter")
        await wait_until(pilot, lambda: chat.query(".chat-error"), 10, "the error line")
        assert "HTTP 400" in text(app, ".chat-error") and "max_model_len" in text(app, ".chat-error")
        await wait_until(pilot, lambda: not chat.generating and not chat.query(".exchange"), 5, "the failed turn to go")
        assert chat.history == [] and chat.query_one("#chat-input", Input).value == "hello"


async def test_an_engine_not_serving_keeps_the_prompt():
    app = NanoserveConsole(EngineConfig(model="/nonexistent/model", device="cpu"), refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await wait_until(pilot, lambda: app.load_error is not None, 30, "the load to fail")
        chat = await open_chat(app, pilot)
        await send(pilot, chat, "hello")
        await wait_until(pilot, lambda: "the engine did not load" in notes(app), 5, "the message")
        assert chat.history == [] and not chat.generating and not chat.query(".exchange")
        assert chat.query_one("#chat-input", Input).value == "hello"


async def test_the_answer_is_followed_only_while_the_reader_is_at_the_bottom(tiny_config):
    """A streaming answer keeps the transcript at its end; a reader who scrolls up keeps their place while it
    streams on, and scrolling back to the end follows it again."""
    app = NanoserveConsole(tiny_config, refresh_s=0.05)
    async with app.run_test(size=(100, 20)) as pilot:
        await started(app, pilot)
        # a reader's pace: the tiny model on a busy 2-core machine could otherwise finish its 400 tokens before the
        # transcript had grown past the reader (a CI failure)
        pace(app.server.host.engine, 0.01)
        chat = await open_chat(app, pilot, max_tokens="400")
        log = chat.query_one("#chat-log")
        await send(pilot, chat, "Tell me a very long story")
        await wait_until(pilot, lambda: log.max_scroll_y > 4, 30, "the answer to overflow the transcript")
        await wait_until(pilot, lambda: log.scroll_y == log.max_scroll_y > 4, 5, "the transcript following it")
        log.scroll_home(animate=False)  # the reader goes back up to read
        read_at = log.max_scroll_y
        await wait_until(pilot, lambda: log.max_scroll_y > read_at + 4, 30, "the answer to grow")
        assert log.scroll_y == 0  # kept their place
        log.scroll_end(animate=False)  # back at the end: followed again
        end_at = log.max_scroll_y
        await wait_until(pilot, lambda: not chat.generating, 60, "the answer")
        await pilot.pause()
        assert log.max_scroll_y > end_at and log.scroll_y == log.max_scroll_y
