"""Chat: talk to the hosted model through its own OpenAI server, so the console exercises what clients use.

The whole conversation goes to /v1/chat/completions on every turn (the server applies the chat template), and
the answer streams into a Markdown widget as its tokens arrive. The shared stop key (ctrl+b) closes the HTTP
stream, which makes the server abort the request and free its blocks, and gives the prompt back. Esc only leaves
the text field, as on every screen, so leaving the field never costs an answer.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.validation import Integer, Number
from textual.widgets import Input, Label, Markdown, Static
from textual.worker import WorkerState

from console import keys
from console.screens.base import ConsoleScreen
from nanoserve.client import error_message, sse_events

CONTROLS = {  # control id -> (label, default, validator, empty allowed)
    "chat-temperature": ("temperature", "0.7", Number(minimum=0), False),
    "chat-max-tokens": ("max tokens", "256", Integer(minimum=1), False),
    "chat-seed": ("seed", "", Integer(), True),
}


class ChatError(Exception):
    """The server answered, but not with a stream (a refused request, an engine that stopped)."""


class ChatScreen(ConsoleScreen):
    """Multi-turn chat; `history` holds the finished turns the next request sends, as OpenAI messages."""

    AUTO_FOCUS = "#chat-input"  # type straight away; Esc leaves the field for the screen keys (the footer says so)
    BINDINGS = [
        Binding("enter", "focus_prompt", "Write", id="chat_prompt"),
        keys.stop("cancel", "chat_stop", "Cancel answer"),
        keys.reset("clear", "chat_clear", "New chat"),
    ]

    DEFAULT_CSS = """
    ChatScreen #chat-log { height: 1fr; border: round $primary; border-title-color: $accent; padding: 0 1; }
    ChatScreen .user-turn { margin-top: 1; padding: 0 1; color: $accent; text-style: bold; }
    ChatScreen .exchange { height: auto; }
    ChatScreen .assistant-turn { margin: 0; }
    ChatScreen .chat-error { margin-top: 1; padding: 0 1; color: $error; }
    ChatScreen #chat-stats { height: 1; padding: 0 1; color: $text-muted; }
    ChatScreen #chat-controls { height: 3; }
    ChatScreen #chat-controls Label { padding: 1 1 0 2; }
    ChatScreen #chat-controls Input { width: 12; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history: list[dict] = []
        self.generating = False
        self.last_ttft_s: float | None = None
        self.last_tokens = 0
        self.last_tok_s: float | None = None
        self.last_finish: str | None = None
        self._worker = None
        self._exchange: Vertical | None = None  # the turn being answered: the user line and the Markdown
        self._prompt = ""

    def compose_body(self) -> ComposeResult:
        yield VerticalScroll(id="chat-log")
        yield Static("no answer yet", markup=False, id="chat-stats")
        with Horizontal(id="chat-controls"):
            for control_id, (label, default, validator, empty_ok) in CONTROLS.items():
                yield Label(label)
                yield Input(default, placeholder="none" if empty_ok else "", id=control_id,
                            validators=[validator], valid_empty=empty_ok)
        yield Input(placeholder="Ask the model… (Enter sends, ctrl+b cancels an answer, Esc leaves)", id="chat-input")

    def on_mount(self) -> None:
        self.query_one("#chat-log").border_title = "Conversation"

    # ---- sending ------------------------------------------------------------------------------------
    def sampling(self) -> dict | None:
        """The controls as request fields, or None (and a message) when one of them does not parse."""
        fields = {}
        for control_id, (label, *_) in CONTROLS.items():
            control = self.query_one(f"#{control_id}", Input)
            result = control.validate(control.value)
            if result is not None and not result.is_valid:
                self.notify(f"{label}: {' '.join(result.failure_descriptions)} Nothing was sent.",
                            severity="error")
                return None
            fields[label] = control.value.strip()
        return {"temperature": float(fields["temperature"]), "max_tokens": int(fields["max tokens"]),
                "seed": int(fields["seed"]) if fields["seed"] else None}

    @on(Input.Submitted, "#chat-input")
    async def send(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.generating:
            self.notify(f"still answering; {keys.STOP} cancels the answer", severity="warning")
            return
        server = self.app.server
        if server is None or self.app.phase != "serving":
            state = "did not load" if self.app.load_error is not None else "is still loading"
            self.notify(f"the engine {state} ({self.app.phase}); the prompt stays here", severity="warning")
            return
        sampling = self.sampling()
        if sampling is None:
            return
        self.history.append({"role": "user", "content": prompt})
        body = {"messages": list(self.history), "stream": True, "stream_options": {"include_usage": True},
                **sampling}
        answer = Markdown(classes="assistant-turn")
        self._exchange = exchange = Vertical(Static(f"> {prompt}", markup=False, classes="user-turn"), answer,
                                             classes="exchange")
        self._prompt, event.input.value = prompt, ""
        log = self.query_one("#chat-log", VerticalScroll)
        await log.mount(exchange)
        log.anchor()  # a new turn: to the bottom, following the answer until the reader scrolls up
        self.show_stats(None, 0, None, "waiting for the first token…")
        url = f"{server.url}/v1/chat/completions"
        self._worker = self.run_worker(self.answer(url, server.headers, body, exchange, answer), exclusive=True,
                                       group="chat", name="chat")
        self.generating = True  # only now: cancelling needs the worker

    async def answer(self, url: str, headers: dict, body: dict, exchange: Vertical, answer: Markdown) -> None:
        """The worker: stream one answer; cancelling it closes the stream, so the server aborts the request."""
        stream = Markdown.get_stream(answer)
        try:
            try:
                text = await self.read_stream(url, headers, body, stream)
            finally:
                await stream.stop()
        except asyncio.CancelledError:
            await exchange.remove()  # `cancel` has already given the prompt back
            raise
        except (httpx.HTTPError, ChatError, ValueError) as e:
            await exchange.remove()
            await self.query_one("#chat-log").mount(
                Static(f"error: {str(e) or type(e).__name__} (the prompt is back in the input)", markup=False,
                       classes="chat-error"))
            self.give_back()
            self.query_one("#chat-stats", Static).update("the last request failed")
            return
        self.history.append({"role": "assistant", "content": text})
        self.generating = False

    async def read_stream(self, url: str, headers: dict, body: dict, stream) -> str:
        """POST the conversation and feed each delta to the Markdown stream; returns the whole answer."""
        started, first, tokens, finish, text = time.monotonic(), None, 0, None, ""
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as client:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    raise ChatError(error_message(response.status_code, await response.aread()))
                async for chunk in sse_events(response):
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        delta = choice["delta"].get("content") or ""
                        finish = choice.get("finish_reason") or finish
                        if delta:
                            first = first or time.monotonic()
                            tokens += 1  # a chunk per token, near enough until usage arrives at the end
                            text += delta
                            await stream.write(delta)  # the anchored log follows it while the reader is at the bottom
                    if first is not None:
                        self.show_stats(first - started, tokens, decode_rate(tokens, first), finish or "streaming…")
        self.show_stats(first - started if first else None, tokens, decode_rate(tokens, first), finish)
        return text

    def show_stats(self, ttft_s: float | None, tokens: int, tok_s: float | None, finish: str | None) -> None:
        self.last_ttft_s, self.last_tokens, self.last_tok_s, self.last_finish = ttft_s, tokens, tok_s, finish
        parts = [f"TTFT {ttft_s * 1000:.0f} ms" if ttft_s is not None else "TTFT –",
                 f"{tok_s:.1f} tok/s" if tok_s is not None else "– tok/s", f"{tokens} tokens"]
        if finish:
            parts.append(finish if finish.endswith("…") else f"finish {finish}")
        self.query_one("#chat-stats", Static).update(" · ".join(parts))

    def give_back(self) -> None:
        """The turn did not happen: drop its user message and put the prompt back in the input."""
        if self.history and self.history[-1]["role"] == "user":
            self.history.pop()
        self.generating = False
        self.query_one("#chat-input", Input).value = self._prompt

    # ---- actions ------------------------------------------------------------------------------------
    def action_focus_prompt(self) -> None:
        """Enter from the transcript: into the prompt (Tab leaves it, for the screen keys)."""
        self.query_one("#chat-input").focus()

    def action_cancel(self) -> None:
        """The stop key: stop the answer (the server aborts it) and give the prompt back."""
        if not self.generating:
            return
        worker, exchange = self._worker, self._exchange
        if worker.state is WorkerState.PENDING:  # it never ran, so it cannot remove its own turn
            exchange.remove()
        worker.cancel()
        self.give_back()
        self.query_one("#chat-stats", Static).update("cancelled")

    def action_clear(self) -> None:
        """A new conversation: the model sees none of the earlier turns."""
        self.action_cancel()
        self.history.clear()
        self.query_one("#chat-log").remove_children()
        self.query_one("#chat-stats", Static).update("no answer yet")


def decode_rate(tokens: int, first: float | None) -> float | None:
    """Tokens per second after the first one: the decode speed, without the prefill in TTFT."""
    elapsed = time.monotonic() - first if first is not None else 0.0
    return (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else None
