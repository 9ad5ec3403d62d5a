"""Watching servers that run elsewhere (`nanoserve-console --attach URL`): each is polled through its /health.

An AttachedServer stands where the console's own Server would: it has a `url` the chat and load screens send to,
and a `host` whose `stats()` is the latest snapshot. The snapshot is fetched on a thread of its own, so a slow or
dead server never freezes the screen; `stats()` only reads what the last fetch brought. Nothing is computed
here that the snapshot does not carry: the panels read it exactly as they read a local engine's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

from nanoserve.stats import EngineStats


@dataclass(frozen=True)
class Health:
    """What the last poll found: `status` is the server's own word ("ok", "unhealthy", "stopped", "failed"),
    or "unreachable" when no snapshot came back, or "locked" when the server wants an API key for it, with
    `reason` saying why."""

    status: str
    reason: str | None = None
    failed_steps: int = 0
    at: float = 0.0  # time.monotonic() of the poll

    @property
    def serving(self) -> bool:
        return self.status == "ok"

    @property
    def brought_snapshot(self) -> bool:
        """Whether the poll this describes brought a snapshot (a server that wants a key sends none)."""
        return self.status not in ("unreachable", "locked", "connecting")


def normalise_url(url: str) -> str:
    """The server's root: 'host:8000', 'http://host:8000/' and 'http://host:8000/v1' all name one server."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1")


class RemoteHost:
    """Polls `/health` every `interval` seconds on a daemon thread; `stats()` is the last snapshot it brought
    (None before the first, and kept through a failed poll, so the panels show the last known state while the
    status line says the server stopped answering)."""

    def __init__(self, url: str, interval: float = 1.0, timeout: float = 2.0, headers: dict | None = None):
        self.url, self.interval, self.timeout, self.headers = url, interval, timeout, headers or {}
        self.health = Health("connecting", f"no answer yet from {url}")
        self.model_name: str | None = None  # the name /v1/models serves it under
        self.polls = 0
        self.fetched_at = 0.0  # time.monotonic() of the last snapshot that came back
        self._stats: EngineStats | None = None
        self._stop = threading.Event()
        self._polled = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"attach {url}", daemon=True)

    def start(self) -> RemoteHost:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> EngineStats | None:
        return self._stats

    def timeline(self, request_id: str) -> list[dict]:
        """GET /requests/{id}: the request's timelines; [] when the server keeps none by that id. Raises
        httpx.HTTPError when the server cannot be asked."""
        from urllib.parse import quote

        response = httpx.get(f"{self.url}/requests/{quote(request_id, safe='')}", headers=self.headers,
                             timeout=self.timeout)
        if response.status_code == 404:
            return []
        response.raise_for_status()
        return response.json()["sequences"]

    def rows(self, match: str = "") -> list[dict]:
        """GET /requests?match=: the kept sequences whose id, status or finish reason contains `match`. Raises
        httpx.HTTPError when the server cannot be asked."""
        response = httpx.get(f"{self.url}/requests", params={"match": match}, headers=self.headers,
                             timeout=self.timeout)
        response.raise_for_status()
        return response.json()["requests"]

    def wait_polled(self, polls: int = 1, timeout: float = 10.0) -> bool:
        """Block until `polls` polls have ended (whatever they found); False on timeout."""
        with self._polled:
            return self._polled.wait_for(lambda: self.polls >= polls, timeout)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                self.poll(client)
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def poll(self, client: httpx.Client) -> None:
        """One fetch of /health (and, until it answers, /v1/models for the served name). A server with an API
        key answers a caller without it with its status alone: that is "locked", with the fix, not "down"."""
        try:
            response = client.get(f"{self.url}/health")
            body = response.json()
            if isinstance(body, dict) and "snapshot" in body and "model" not in body:
                self.health = Health("locked", self._locked_reason(body), self.health.failed_steps,
                                     time.monotonic())
                return
            self._stats, self.fetched_at = EngineStats.from_dict(body), time.monotonic()
            self.health = Health(body.get("status", "ok" if response.status_code == 200 else "unhealthy"),
                                 body.get("reason"), body.get("failed_steps_total", 0), time.monotonic())
            if self.model_name is None:
                self.model_name = self._served_name(client)
        except (httpx.HTTPError, ValueError) as e:  # refused, timed out, not JSON, not a snapshot
            self.health = Health("unreachable", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
                                 self.health.failed_steps, time.monotonic())
        finally:
            with self._polled:
                self.polls += 1
                self._polled.notify_all()

    def _locked_reason(self, body: dict) -> str:
        said = f"; its status: {body.get('status')}" + (f", {body['reason']}" if body.get("reason") else "")
        if "Authorization" in self.headers:
            return f"this server did not accept the API key given: check --api-key{said}"
        return f"this server wants an API key for its stats: --api-key{said}"

    def _served_name(self, client: httpx.Client) -> str | None:
        try:
            response = client.get(f"{self.url}/v1/models")
            return response.json()["data"][0]["id"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None


class AttachedServer:
    """A server the console watches but did not start: it outlives the console, which only polls it."""

    attached = True

    def __init__(self, url: str, interval: float = 1.0, api_key: str | None = None):
        self.url = normalise_url(url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.host = RemoteHost(self.url, interval, headers=self.headers)

    @property
    def model_name(self) -> str:
        stats = self.host.stats()
        return self.host.model_name or (stats.model if stats is not None else "?")

    @property
    def label(self) -> str:
        """The tab's name: host:port."""
        return self.url.split("://", 1)[-1]

    def start(self) -> AttachedServer:
        self.host.start()
        return self

    def stop(self) -> None:
        self.host.stop()
