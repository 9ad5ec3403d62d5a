"""Running, waiting and recently finished requests: a keyed table updated by row diff, sortable by any column
(TTFT, TPOT, total time and tokens among them), filterable by text and by a set of ids (the latest stall's
requests). Enter on a row opens the request's screen."""

from __future__ import annotations

import time
from collections.abc import Iterable

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Input

from nanoserve.stats import EngineStats, RowStats
from nanoserve.timeline import finished_row

SEARCH_EVERY_S = 1.0  # while a text filter is set, how often the host's kept finished requests are searched

# short labels, so all ten columns fit 100 columns (help and the README say what "gen" counts)
COLUMNS = (("id", "id"), ("state", "state"), ("prompt", "prompt"), ("generated", "gen"),
           ("rate", "tok/s"), ("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("total", "total s"), ("blocks", "blocks"),
           ("drafts", "drafts kept"))
ID_WIDTH = 18  # an id's cell: 'chatcmpl-…7f46a039' (the full id is matched by the filter and shown on Enter)
LARGEST_FIRST = ("prompt", "generated", "rate", "ttft", "tpot", "total", "blocks")  # the keyboard sort's order


def _ms(seconds: float | None) -> float | str:
    return "-" if seconds is None else round(seconds * 1000, 1)


def _sort_key(largest_first: bool):
    """A cell's place: numbers in order (largest first when asked), "-" (not known yet) after them either way."""
    def key(value) -> tuple:
        if isinstance(value, (int, float)):
            return (0, -value if largest_first else value, "")
        return (2, 0, "") if value == "-" else (1, 0, str(value))
    return key


def _drafts(row: RowStats) -> str:
    """Its speculative drafts: the share kept of the tokens drafted, or '-' before any."""
    drafted = row.spec_draft_tokens
    return f"{round(100 * row.spec_accepted_tokens / drafted)}% of {drafted}" if drafted else "-"


def short_id(rid: str) -> str:
    """An id that fits its column: the start (its kind) and the end (the part that tells requests apart)."""
    return rid if len(rid) <= ID_WIDTH else f"{rid[:9]}…{rid[-(ID_WIDTH - 10):]}"


def _cells(row: RowStats) -> tuple:
    state = f"{row.state} ({row.finish_reason})" if row.finish_reason else row.state
    if row.replica is not None:  # a data-parallel server's: which replica serves it
        state = f"{state} @{row.replica}"
    total = "-" if row.total_s is None else round(row.total_s, 2)
    return (short_id(row.request_id), state, row.prompt_tokens, row.generated_tokens, round(row.tokens_per_s, 1),
            _ms(row.ttft_s), _ms(row.tpot_s), total, row.blocks, _drafts(row))


class RowsTable(DataTable):
    """Rows keyed by request id: a snapshot adds, updates (changed cells only) and removes rows.

    Unsorted, the live requests (running, then waiting) come first and then the finished ones, newest first,
    so what runs now is at the top however many finished rows are kept. Selecting a column header sorts by it
    (again: reverses); the sort holds as rows come and go.
    """

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._shown: dict[str, tuple] = {}
        self.filter_text = ""
        self.only: frozenset[str] | None = None  # the ids a set filter keeps (None: every row)
        self.sort_column: str | None = None
        self.sort_reverse = False
        self._place: dict[str, int] = {}  # id -> its place unsorted: the snapshot's order, live rows first
        self._widths: tuple[int, ...] = ()  # the columns' widths at the last snapshot

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        column = event.column_key.value
        self.sort_reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column = column
        self._sort()

    def cycle_sort(self) -> str:
        """The keyboard's way to sort: the next column (numbers largest first); after the last, arrival order."""
        keys = [key for key, _ in COLUMNS]
        at = keys.index(self.sort_column) + 1 if self.sort_column in keys else 0
        self.sort_column = keys[at] if at < len(keys) else None
        self.sort_reverse = self.sort_column in LARGEST_FIRST
        self._sort()
        if self.sort_column is None:  # back to arrival order: the next snapshot refills the table
            self.set_filter(self.filter_text)
        return dict(COLUMNS).get(self.sort_column, "arrival order")

    def set_filter(self, text: str) -> None:
        """Show only rows whose id or state contains `text`; the next snapshot refills the table."""
        self.filter_text = text
        self.clear()
        self._shown.clear()

    def set_only(self, ids: Iterable[str] | None) -> None:
        """Show only the rows keyed by `ids` (beside the text filter); None shows all again. The next snapshot
        refills the table."""
        self.only = None if ids is None else frozenset(ids)
        self.set_filter(self.filter_text)

    def _visible(self, rid: str, cells: tuple) -> bool:
        if self.only is not None and rid not in self.only:
            return False
        needle = self.filter_text.lower()
        return not needle or needle in rid.lower() or needle in cells[1].lower()

    def show(self, stats: EngineStats, found: Iterable[RowStats] = ()) -> None:
        """The snapshot's rows, and `found`: finished rows a search brought from beyond the snapshot's."""
        self._repaint_if_widened()
        ordered = [*stats.rows, *stats.finished_rows, *found]  # running and waiting, finished newest first, found
        live: dict[str, tuple] = {}
        for row in ordered:  # a row the snapshot lists wins over the same request found by a search
            if row.request_id not in live:
                live[row.request_id] = _cells(row)
        place = {rid: at for at, rid in enumerate(live)}
        live = {rid: cells for rid, cells in live.items() if self._visible(rid, cells)}
        moved = place != self._place
        self._place = place
        changed = False
        for rid in [rid for rid in self._shown if rid not in live]:
            self.remove_row(rid)
            del self._shown[rid]
        for rid, cells in live.items():
            old = self._shown.get(rid)
            if old is None:
                self.add_row(*cells, key=rid)
                changed = True
            elif old != cells:
                for (column, _), before, after in zip(COLUMNS, old, cells):
                    if before != after:
                        self.update_cell(rid, column, after, update_width=True)
                        changed |= column == self.sort_column
            self._shown[rid] = cells
        if changed or (moved and self.sort_column is None):
            self._sort()

    def _repaint_if_widened(self) -> None:
        """Repaint everything once the columns' widths have changed: Textual 8.2 widens a column when idle after
        a row arrives, and a header line it rendered in between stays cached at the old widths (seen as a header
        out of line with its rows, which no later snapshot that changes nothing would redraw)."""
        widths = tuple(column.content_width for column in self.columns.values())
        if widths != self._widths:
            self._widths = widths
            clear = getattr(self, "_clear_caches", None)  # DataTable's own, in every Textual 8
            if clear is not None:
                clear()
            self.refresh()

    def _sort(self) -> None:
        if self.sort_column is None and self.row_count:  # unsorted: live rows first, then the newest finished
            place = {short_id(rid): at for rid, at in self._place.items()}  # the key sees cells, not row keys
            self.sort("id", key=lambda shown: place.get(shown, len(place)))
        if self.sort_column is not None and self.row_count:
            if self.sort_column in LARGEST_FIRST:  # numbers: the direction inside the key, "-" last both ways
                self.sort(self.sort_column, key=_sort_key(self.sort_reverse))
            else:
                self.sort(self.sort_column, key=str, reverse=self.sort_reverse)

    def visible_rows(self) -> int | None:
        """How many rows the table's height shows at once (None before it is laid out)."""
        height = self.scrollable_content_region.height
        return max(0, height - self.header_height) if height else None


def showing(listed: int, live: int, visible: int | None) -> str:
    """The panel's subtitle when rows are cut: by the height ("showing 2 of 8, z: full height") or by the filter;
    empty when every live row is in view."""
    shown = listed if visible is None else min(listed, visible)
    if shown >= live:
        return ""
    why = "z: full height" if shown < listed else "the rest filtered out"
    return f"showing {shown} of {live} · {why}"


def stall_subtitle(stall: dict, listed: int, key: str) -> str:
    """The subtitle while the table shows a stall's requests: how many of those it named are still listed
    (requests that finished long ago leave the table)."""
    named = f"{len(stall.get('requests') or ())}{'+' if stall.get('requests_cut') else ''}"
    return f"requests in the stall at {stall['at']}: {listed} of {named} still listed · {key} or Esc: all"


class RowsPanel(Vertical):
    """The rows table with a filter line that `/` opens and Esc (or an empty filter) closes, and a stall's
    requests alone (`show_stall`) until `show_all`."""

    DEFAULT_CSS = """
    RowsPanel #rows-filter { display: none; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stall: dict | None = None  # the stall entry (stalls.StallWatch) whose requests the table shows
        self._stall_key = ""
        # A text filter also searches every finished request the engine keeps (1,000; the snapshot lists the
        # latest 100): the host is asked on a worker thread, at most every SEARCH_EVERY_S.
        self.found: dict[str, RowStats] = {}
        self._searched: tuple[str, float] | None = None  # (text, when) of the latest search asked

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter by id or state (Esc closes)", id="rows-filter", disabled=True)
        yield RowsTable(id="rows-table")

    def open_filter(self) -> None:
        box = self.query_one("#rows-filter", Input)
        box.disabled = False
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one(RowsTable).set_filter(event.value)
        self.found, self._searched = {}, None

    def _search(self, text: str) -> None:
        """Ask the host (this process's, or an attached server's GET /requests?match=) for kept finished rows
        that match `text`; they join the table at the next snapshot."""
        if not text or (self._searched is not None and self._searched[0] == text
                        and time.monotonic() - self._searched[1] < SEARCH_EVERY_S):
            return
        server = getattr(self.app, "server", None)  # an app hosting the panel alone has none
        rows_of = getattr(server.host, "rows", None) if server is not None else None
        if rows_of is None:
            return
        self._searched = (text, time.monotonic())

        def search() -> None:
            try:
                found = {r["name"]: finished_row(r) for r in rows_of(text) if r["status"] == "finished"}
            except Exception:  # an attached server that did not answer: the next tick asks again
                return
            self.app.call_from_thread(self._found, text, found)

        self.run_worker(search, thread=True, exclusive=True, group="rows-search")

    def _found(self, text: str, found: dict) -> None:
        if self.query_one(RowsTable).filter_text == text:  # not a search the user has typed past
            self.found = found

    def on_key(self, event) -> None:
        box = self.query_one("#rows-filter", Input)
        if event.key == "escape" and box.has_focus:
            event.stop()
            box.value = ""
            box.display = False
            box.disabled = True
            self.query_one(RowsTable).focus()

    def show(self, stats: EngineStats) -> None:
        table = self.query_one(RowsTable)
        self._search(table.filter_text)
        table.show(stats, self.found.values() if table.filter_text else ())
        if self.stall is not None:
            self.border_subtitle = stall_subtitle(self.stall, table.row_count, self._stall_key)
        else:
            extra = len(set(self.found) - {r.request_id for r in stats.finished_rows}) if table.filter_text else 0
            self.border_subtitle = showing(table.row_count, len(stats.rows) + len(stats.finished_rows) + extra,
                                           table.visible_rows())

    def show_stall(self, stall: dict, key: str) -> None:
        """Only the rows of the requests `stall` carried; `key` (or Esc) brings every row back."""
        self.stall, self._stall_key = stall, key
        self.query_one(RowsTable).set_only(stall.get("requests") or ())

    def show_all(self) -> None:
        self.stall = None
        self.query_one(RowsTable).set_only(None)

    def cycle_sort(self) -> str:
        return self.query_one(RowsTable).cycle_sort()
