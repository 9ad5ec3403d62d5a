"""One request's screen: its timeline from arrival to finish, its figures, sampling parameters, prompt, answer
and KV blocks. Opened by Enter on a row of the dashboard's Requests table; Esc goes back. It reads the request's
timelines from the selected server's host (the engine's recorder in this process, GET /requests/{id} on an
attached server) and follows a live request every REFRESH_S."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from console.numbers import decimal

REFRESH_S = 0.5
AXIS_WIDTH = 100  # characters of the time axis
MARKS = {"queued": "·", "prefill": "▓", "decode": "█", "preempted": "!"}


def time_axis(spans: list[dict], total_s: float, width: int = AXIS_WIDTH) -> str:
    """The spans on one line, scaled to `total_s`: · queued, ▓ prefill, █ decode, ! preempted (a preemption
    is an instant: it takes one character). A span shorter than a character still shows where it falls."""
    line = [" "] * width
    scale = (width - 1) / total_s if total_s > 0 else 0.0
    for span in spans:
        first = min(width - 1, int(span["start_s"] * scale))
        last = min(width - 1, max(first, int(span["end_s"] * scale)))
        for i in range(first, last + 1):
            line[i] = MARKS[span["kind"]]
    return "".join(line)


def span_line(span: dict) -> str:
    """A span as a line of the list under the axis."""
    when = f"{span['start_s']:8.3f} - {span['end_s']:8.3f} s  "
    kind = span["kind"]
    if kind == "prefill":
        return when + f"prefill chunk, {span['tokens']} tokens" + \
            (f" ({span['cached']} already cached)" if span["cached"] else "")
    if kind == "decode":
        drafts = f", drafts kept {span['kept']} of {span['drafted']}" if span["drafted"] else ""
        return when + (f"decode, {span['steps']} steps, {span['tokens']} tokens, sharing steps with "
                       f"{decimal(span['mean_rows'])} rows on average (at most {span['most_rows']}){drafts}")
    return when + ("preempted: its blocks freed, to be computed again" if kind == "preempted" else "queued")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def figures_text(seq: dict) -> str:
    """Its latency and token figures in two lines."""
    rate = f" ({decimal(seq['tokens_per_s'])} tok/s)" if seq.get("tokens_per_s") else ""
    first = (f"queued {_seconds(seq['queued_s'])} · TTFT {_seconds(seq['ttft_s'])} · TPOT {_seconds(seq['tpot_s'])}"
             f"{rate} · total {_seconds(seq['total_s'])}")
    drafts = f" · drafts kept {seq['kept']} of {seq['drafted']}" if seq.get("drafted") else ""
    grammar = f" · grammar masking {_seconds(seq['grammar_mask_s'])}" if seq.get("grammar_mask_s") is not None \
        else ""
    second = (f"{seq['prompt_tokens']} prompt tokens ({seq['cached_tokens']} cached) · {seq['output_tokens']} "
              f"generated · {seq['preemptions']} preemption{'' if seq['preemptions'] == 1 else 's'}{drafts}{grammar}")
    return f"{first}\n{second}"


def sequence_text(seq: dict, axis_width: int = AXIS_WIDTH) -> str:
    """Everything of one sequence but its prompt and answer; the time axis `axis_width` characters wide."""
    ended = f", {seq['finish_reason']}" if seq.get("finish_reason") else ""
    params = ", ".join(f"{k} {v}" for k, v in seq["params"].items() if v is not None)
    blocks = seq.get("blocks") or []
    return "\n".join([
        f"{seq['name']}: {seq['status']}{ended}",
        figures_text(seq),
        "",
        time_axis(seq["spans"], seq["total_s"], axis_width),
        "· queued  ▓ prefill  █ decode  ! preempted",
        *(span_line(s) for s in seq["spans"]),
        "",
        f"sampling: {params}",
        f"KV blocks: {len(blocks)}" + (f" ({', '.join(map(str, blocks[:32]))}{', ...' if len(blocks) > 32 else ''})"
                                      if blocks else (" (returned to the pool)" if seq["status"] == "finished"
                                                      else "")),
    ])


class RequestScreen(Screen):
    """A request's timelines, one section a sequence (n > 1 has several)."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back", id="request_back")]
    DEFAULT_CSS = """
    RequestScreen #request-body { padding: 0 1; }
    RequestScreen .request-text { color: $text-muted; margin-bottom: 1; }
    """

    def __init__(self, request_name: str, **kwargs):
        super().__init__(**kwargs)
        self.request_name = request_name  # the table row's id: the request id, or "id#k" for its k-th completion
        self.sequences: list[dict] | None = None  # the last timelines read (None before the first answer)
        self.failure: str | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="request-body"):
            yield Static(f"request {self.request_name}: reading its timeline…", markup=False, id="request-timeline")
            yield Static("", markup=False, classes="request-text", id="request-prompt")
            yield Static("", markup=False, classes="request-text", id="request-answer")
        yield Footer()

    def on_mount(self) -> None:
        self.load()
        self.set_interval(REFRESH_S, self.load)

    def load(self) -> None:
        if self.sequences is None or any(s["status"] != "finished" for s in self.sequences):
            self.run_worker(self._read, thread=True, exclusive=True, group="request-timeline")

    def _read(self) -> None:
        server = self.app.server
        try:
            found = [] if server is None else _lookup(server.host, self.request_name)
            failure = None if found else f"request {self.request_name} is no longer kept (the latest 1,000 are)"
        except Exception as e:  # an attached server that stopped answering: said on the screen, not raised
            found, failure = self.sequences or [], f"could not read its timeline: {type(e).__name__}: {e}"
        self.app.call_from_thread(self.show, found, failure)

    def axis_width(self) -> int:
        """The time axis as wide as the screen's text, up to AXIS_WIDTH: a wider one would wrap onto a second line
        and read as two timelines."""
        room = self.query_one("#request-body").scrollable_content_region.width - 1
        return AXIS_WIDTH if room <= 0 else max(20, min(AXIS_WIDTH, room))

    def on_resize(self) -> None:
        if self.sequences:
            self.show(self.sequences, self.failure)

    def show(self, sequences: list[dict], failure: str | None) -> None:
        self.sequences, self.failure = sequences, failure
        width = self.axis_width()
        text = "\n\n".join(sequence_text(s, width) for s in sequences)
        self.query_one("#request-timeline", Static).update(f"{failure}\n\n{text}" if failure else text)
        if sequences:
            first = sequences[0]
            self.query_one("#request-prompt", Static).update(f"prompt:\n{first.get('prompt') or '(token ids)'}")
            self.query_one("#request-answer", Static).update(
                "\n\n".join(f"answer of {s['name']}:\n{s.get('answer', '')}" for s in sequences))


def _lookup(host, name: str) -> list[dict]:
    """A table row's sequences: its name is the request id, or "id#k" for the k-th of n completions."""
    found = host.timeline(name)
    if not found and "#" in name:
        found = host.timeline(name.rsplit("#", 1)[0])
    return found
