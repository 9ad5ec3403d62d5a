"""The HTTP layer's protections: a graceful stop that ends every stream properly, and a header timeout.

uvicorn on its own, on Ctrl-C, stops its loop while responses are still streaming: after its grace period it
cancels them (a CancelledError traceback, a client cut off without [DONE]) while the engine thread goes on
feeding a closed loop. Here a stop runs in order: stop accepting, refuse new requests, let running requests
finish for up to `shutdown_timeout` seconds, abort what is left (each stream then ends with its final chunk
and [DONE]), and only then let uvicorn close the connections. A second Ctrl-C skips the wait.

uvicorn also has no timeout for a request's headers, so a client that opens connections and never finishes
its headers holds them forever (slowloris). HeaderTimeout closes a connection whose headers are not complete
within `header_timeout` seconds of it opening (or of its previous response).
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("nanoserve.http")

ABORTED_DRAIN_S = 5.0  # after the aborts: time for their final outputs to reach the clients


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, host, shutdown_timeout: float, announce=print):
        super().__init__(config)
        self.host, self.shutdown_timeout, self.announce = host, shutdown_timeout, announce
        self.signals: list[int] = []

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            live = self.host.live_requests()
            self.announce(f"nanoserve: stopping: {live} request(s) in flight get up to {self.shutdown_timeout:g} s "
                          "to finish (Ctrl-C again to abort them now)")
        self.signals.append(sig)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting connections
            server.close()
        self.host.close_admission("the server is shutting down; retry against another replica or after restart")
        deadline = time.monotonic() + self.shutdown_timeout
        while self.host.live_requests() and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        left = self.host.live_requests()
        if left:
            log.warning("aborting %d request(s) still running at shutdown", left)
            self.host.abort_all()
            deadline = time.monotonic() + ABORTED_DRAIN_S
            while self.host.live_requests() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers."""

    class HeaderTimeout(H11Protocol):
        header_timeout = seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            self._awaited = self.cycle  # a different cycle at expiry means the headers came
            self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

        def _expire(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if self.cycle is self._awaited and waiting and not self.transport.is_closing():
                log.info("closing a connection whose request headers took over %g s", self.header_timeout)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            between_requests = self.cycle is None or self.cycle.response_complete
            if self._header_timer is None and between_requests:
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return HeaderTimeout
