"""Where an API key comes from: the command line, a file, or the environment.

A key on the command line is readable by every local user in `ps`, so it may come from a file
(`--api-key-file`, as secrets are mounted) or an environment variable instead: nanoserve's own, or vLLM's, so a
deployment written for `vllm serve` keeps working. The server and the console's --attach read it alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from nanoserve.errors import ConfigError

ENV_NAMES = ("NANOSERVE_API_KEY", "VLLM_API_KEY")  # in this order, after --api-key and --api-key-file


def add_api_key_flags(parser, what: str) -> None:
    """--api-key and --api-key-file; `what` says what the key does, for the help."""
    parser.add_argument("--api-key", default=None,
                        help=f"{what}. Visible to local users in `ps`: prefer --api-key-file or the "
                             f"{' or '.join(ENV_NAMES)} environment variable (read in that order, after this)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the API key from PATH (its trailing newline dropped), e.g. a mounted secret")


def resolve_api_key(flag: str | None, path: str | None,
                    environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(the key, where it came from) by precedence: --api-key, --api-key-file, then ENV_NAMES; (None, None)
    when none is given. A key file that is missing, unreadable or empty is a ConfigError: a server started
    without the key it was meant to require would be open to everyone."""
    if flag:
        return flag, "--api-key"
    if path is not None:
        return _read_key_file(path), f"--api-key-file {path}"
    for name in ENV_NAMES:
        if environ.get(name):
            return environ[name], f"the {name} environment variable"
    return None, None


def _read_key_file(path: str) -> str:
    try:
        key = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except FileNotFoundError:
        raise ConfigError(f"--api-key-file {path}: no such file; write the key there, or give its path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--api-key-file {path} cannot be read ({e}); check the path and its permissions") \
            from None
    if not key.strip():
        raise ConfigError(f"--api-key-file {path} is empty; write the key into it (a newline after it is dropped)")
    if "\n" in key or "\r" in key:
        raise ConfigError(f"--api-key-file {path} holds more than one line; the key is one line")
    return key
