"""Running and waiting requests, keyed by request id and updated by a keyed row diff."""

from __future__ import annotations

from textual.widgets import DataTable

from nanoserve.stats import EngineStats, RowStats

COLUMNS = (("id", "id"), ("state", "state"), ("prompt", "prompt tokens"), ("generated", "generated tokens"),
           ("blocks", "blocks"))


def _cells(row: RowStats) -> tuple:
    return (row.request_id, row.state, row.prompt_tokens, row.generated_tokens, row.blocks)


class RowsTable(DataTable):
    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._shown: dict[str, tuple] = {}

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, stats: EngineStats) -> None:
        live = {row.request_id: _cells(row) for row in stats.rows}
        for rid in [rid for rid in self._shown if rid not in live]:
            self.remove_row(rid)
            del self._shown[rid]
        for rid, cells in live.items():
            old = self._shown.get(rid)
            if old is None:
                self.add_row(*cells, key=rid)
            elif old != cells:
                for (column, _), before, after in zip(COLUMNS, old, cells):
                    if before != after:
                        self.update_cell(rid, column, after)
            self._shown[rid] = cells
