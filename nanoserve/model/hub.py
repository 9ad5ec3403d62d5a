"""A Hugging Face hub id as the model: found in the local Hugging Face cache, never downloaded at run time.

An engine that fetches gigabytes when a flag is mistyped surprises its user and hangs offline machines, so a
hub id resolves only to a copy already on disk, in the cache layout `huggingface_hub` writes
(`models--Org--Name/refs/main` naming a folder under `snapshots/`), and the error says how to get one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from nanoserve.errors import CheckpointError

# Org/Name or a legacy bare Name, as the hub spells them; anything else is only ever a path.
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*")


def looks_like_repo_id(text: str) -> bool:
    """True when `text` could name a hub model; the caller asks only once no such path exists."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text


def hub_cache_dir() -> Path:
    """The cache `huggingface_hub` uses: HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub.

    Read from the environment on each call (huggingface_hub reads it once, at import), so a change counts.
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_repo_id(repo_id: str) -> Path:
    """The snapshot directory of `repo_id`'s main revision in the local cache; CheckpointError when absent."""
    cache = hub_cache_dir()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    get = (f"get a copy with `hf download {repo_id}` (or `huggingface-cli download {repo_id}`), "
           "or pass a local checkpoint directory or .gguf file")
    if not ref.is_file():
        raise CheckpointError(
            f"model {repo_id!r} is not a path on disk, and the Hugging Face model {repo_id} is not in the "
            f"local cache {cache} (HF_HUB_CACHE / HF_HOME choose it); nanoserve never downloads at run time: "
            f"{get}"
        )
    commit = ref.read_text().strip()
    snapshot = repo / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        raise CheckpointError(
            f"the local Hugging Face cache entry for {repo_id} is broken: {ref} names snapshot {commit!r} "
            f"but {snapshot} does not exist; {get}"
        )
    return snapshot
