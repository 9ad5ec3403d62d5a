"""The server tabs: one per server the console is attached to (replicas behind a load balancer), each named
host:port with the word its last poll brought back; the chosen one is what every screen shows and sends to."""

from __future__ import annotations

from textual.widgets import Tab, Tabs

MARKS = {"ok": "ok", "unreachable": "DOWN", "connecting": "…", "locked": "KEY?"}  # any other: as it came


def tab_label(server) -> str:
    status = server.host.health.status
    return f"{server.label} {MARKS.get(status, status.upper())}"


class ServerTabs(Tabs):
    """Clicking a tab (or [ and ]) selects its server. The tabs take no focus, so Tab still moves through the
    screen's own fields."""

    can_focus = False

    def __init__(self, servers, **kwargs):
        super().__init__(*(Tab(tab_label(s), id=f"server-{i}") for i, s in enumerate(servers)), **kwargs)
        self.servers = servers

    def follow(self, selected: int) -> None:
        """Relabel the tabs from the last polls (only a changed label is written) and mark the selected one."""
        for index, server in enumerate(self.servers):
            tab = self.query_one(f"#server-{index}", Tab)
            label = tab_label(server)
            if tab.label_text != label:
                tab.label = label
        if self.active != f"server-{selected}":
            self.active = f"server-{selected}"

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        event.stop()
        if event.tab is not None and event.tab.id:
            self.app.select_server(int(event.tab.id.removeprefix("server-")))
