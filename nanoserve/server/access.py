"""What a caller without the API key may read, in one table.

With `--api-key`, a route answers a caller without the key only if it is listed here; every other route (the
whole of /v1, the tokenizer routes, operator actions, and any route added later) answers 401. `/health` keeps
answering probes and load balancers, but with its status word and reason only: the snapshot names requests,
users and the server's configuration. `/metrics` stays open, as vLLM's does: its labels carry no per-request
identifier. Without `--api-key` every route is open. tests/test_server_access.py walks every route against this.
"""

from __future__ import annotations

OPEN = "open"  # the whole answer, key or no key
LIVENESS = "liveness"  # without the key: only whether it serves, and why not
KEYED = "keyed"  # without the key: 401

WITHOUT_KEY = {
    "/health": LIVENESS,
    "/metrics": OPEN,  # aggregates only
    "/version": OPEN,
    "/ping": OPEN,  # SageMaker's health check (vLLM's): status and reason, what /health tells anyone
    "/load": OPEN,  # one count: the generation requests in flight
    "/openapi.json": OPEN,  # the API's own description
    "/docs": OPEN,
    "/docs/oauth2-redirect": OPEN,
    "/redoc": OPEN,
}

WITHHELD = "the stats snapshot needs the API key: send 'Authorization: Bearer <key>'"


def access(path: str) -> str:
    """What `path` answers a caller without the key, when the server has one."""
    return WITHOUT_KEY.get(path, KEYED)


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only ("localhost", 127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it is reachable from elsewhere
