"""The tensor-parallel group's key: every value a rank unpickles (start-up words through rank 0's TCPStore, each
step's message) carries an HMAC-SHA256 under it, and is refused unread when the HMAC does not match.

torch's TCPStore takes any caller that reaches its port, and a pickle runs code as it loads: without the key,
whoever could reach rank 0's port could run code on every rank. Ranks spawned on this machine share a random key
rank 0 makes; ranks that meet through --distributed-init (other machines) read the same secret from
NANOSERVE_DISTRIBUTED_KEY, and refuse to start without one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from nanoserve.errors import ConfigError

KEY_ENV = "NANOSERVE_DISTRIBUTED_KEY"
MIN_KEY_CHARS = 16
DIGEST_BYTES = 32


class Unauthenticated(RuntimeError):
    """A value in the group's store or broadcast that is not signed with this group's key."""


def group_key(distributed_init: str | None) -> bytes:
    """A fresh key for ranks spawned here (distributed_init None: it reaches them as a process argument), else
    NANOSERVE_DISTRIBUTED_KEY; ConfigError naming the fix when that is missing or short."""
    if distributed_init is None:
        return secrets.token_bytes(32)
    key = os.environ.get(KEY_ENV, "")
    if len(key) < MIN_KEY_CHARS:
        state = "is not set" if not key else f"has {len(key)} characters, fewer than {MIN_KEY_CHARS}"
        raise ConfigError(f"--distributed-init needs a shared secret, and {KEY_ENV} {state}: rank 0's store takes "
                          "any caller that reaches its port, and the ranks load what they read from it. Export "
                          f"the same {KEY_ENV} on every rank (e.g. the output of `python -c \"import secrets; "
                          "print(secrets.token_hex(32))\"`)")
    return key.encode()


def seal(key: bytes, label: str, data: bytes) -> bytes:
    """`data` with its HMAC over the label (the store key it is written at: a value cannot be moved to another)."""
    return _mac(key, label, data) + data


def unseal(key: bytes, label: str, sealed: bytes) -> bytes:
    """The data `seal` wrapped; Unauthenticated when the HMAC does not match (nothing is unpickled)."""
    data = sealed[DIGEST_BYTES:]
    if len(sealed) < DIGEST_BYTES or not hmac.compare_digest(sealed[:DIGEST_BYTES], _mac(key, label, data)):
        raise Unauthenticated(f"{label!r} in the tensor-parallel group is not signed with the group's key; refused "
                              "unread. Either another process wrote it to rank 0's store port, or the ranks were "
                              f"started with different {KEY_ENV} values (give every rank the same one)")
    return data


def _mac(key: bytes, label: str, data: bytes) -> bytes:
    return hmac.new(key, label.encode() + b"\0" + data, hashlib.sha256).digest()
