#!/usr/bin/env bash
# Build the virtual environment of third-party clients that tests/clients/ drives against a live server
# (lm-eval, guidellm, litellm, langchain-openai, schemathesis): tests/clients/requirements.txt, every package
# held to tests/clients/constraints.txt. About 1.5-2 minutes from an empty pip cache, 2.2 GB (mostly CPU torch).
# Usage: scripts/client-envs.sh [DIR]   (default: $NANOSERVE_CLIENT_ENV, else build/client-env)
# Then: export NANOSERVE_CLIENT_ENV=DIR and run pytest; without it those tests skip and say why.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${1:-${NANOSERVE_CLIENT_ENV:-$root/build/client-env}}"
py="$(command -v python3.11 || command -v python3)"
start=$SECONDS
if [ -e "$env_dir" ] && [ ! -f "$env_dir/pyvenv.cfg" ]; then  # only ever replace a virtual environment
    echo "$env_dir exists and is not a virtual environment; pass another directory" >&2
    exit 1
fi
rm -rf "$env_dir"
"$py" -m venv "$env_dir"
"$env_dir/bin/python" -m pip install -q --upgrade pip >/dev/null
"$env_dir/bin/python" -m pip install -q -r "$root/tests/clients/requirements.txt" \
    -c "$root/tests/clients/constraints.txt"
# guidellm declares torch; a CUDA build here would be gigabytes that the tests never use.
"$env_dir/bin/python" - <<'PY'
import importlib.metadata as md
import sys

import torch

cuda = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia-"))
if torch.version.cuda is not None or cuda:
    sys.exit(f"client env pulled a CUDA torch ({torch.__version__}, {cuda}); pin torch to the CPU build")
PY
echo "client env ready in $((SECONDS - start))s: export NANOSERVE_CLIENT_ENV=$env_dir"
