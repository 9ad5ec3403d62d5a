#!/usr/bin/env bash
# Every documented command, in a virtual environment made by the README's first quick-start command alone (no
# test extra, which would hide a missing runtime dependency). CI runs it on a clean clone; so can you.
# Usage: scripts/quickstart-check.sh [DIR]   (default: build/quickstart-env; rebuilt from scratch)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${1:-$root/build/quickstart-env}"
py="$(command -v python3.11 || command -v python3)"
cd "$root"

# The README's console command, taken from the README itself so the two cannot drift: its installs, not the app.
cmd=$(awk '/<!-- console-command -->/{f=1} f && /^pip /{print; exit}' README.md)
[ -n "$cmd" ] || { echo "README has no console command (<!-- console-command -->)" >&2; exit 1; }
install=${cmd% && nanoserve-console}
[ "$install" != "$cmd" ] || { echo "the console command does not end with nanoserve-console: $cmd" >&2; exit 1; }
if [ -e "$env_dir" ] && [ ! -f "$env_dir/pyvenv.cfg" ]; then  # only ever replace a virtual environment
    echo "$env_dir exists and is not a virtual environment; pass another directory" >&2
    exit 1
fi
rm -rf "$env_dir"
"$py" -m venv "$env_dir"
# shellcheck disable=SC1091
. "$env_dir/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
start=$SECONDS
echo "+ $install"
bash -c "$install"
echo "quick-start install took $((SECONDS - start))s"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
check() {  # check NAME COMMAND...: run it (5 minutes at most); a failure shows its output and is counted
    local name=$1
    shift
    local began=$SECONDS
    if timeout 300 "$@" >"$work/out" 2>&1; then
        echo "ok    $name ($((SECONDS - began))s)"
    else
        echo "FAIL  $name (exit $?):"
        tail -30 "$work/out" | sed 's/^/      /'
        failures=$((failures + 1))
    fi
}
refused() {  # refused NAME EXPECTED COMMAND...: exit 2 with one line on stderr that contains EXPECTED
    local name=$1 expected=$2
    shift 2
    local status=0
    "$@" >"$work/out" 2>"$work/err" || status=$?
    if [ "$status" = 2 ] && [ "$(wc -l <"$work/err")" = 1 ] && grep -qF -- "$expected" "$work/err"; then
        echo "ok    $name: $(cat "$work/err")"
    else
        echo "FAIL  $name (exit $status, expected 2 and one line with '$expected'):"
        tail -30 "$work/err" | sed 's/^/      /'
        failures=$((failures + 1))
    fi
}

# The environment is the quick start's: none of the test extra's packages are in it.
check "no test-only package installed" python -c "
import importlib.util, sys
present = [m for m in ('pytest', 'transformers', 'triton', 'pexpect', 'jsonschema', 'openai')
           if importlib.util.find_spec(m)]
sys.exit(f'the quick-start environment has {present}: it is not the quick start' if present else 0)"
check "nanoserve --help" nanoserve --help
check "nanoserve --version" nanoserve --version
check "nanoserve serve --help" nanoserve serve --help
check "nanoserve generate --help" nanoserve generate --help
for bench in $(python -c "from nanoserve.cli import BENCHMARKS; print(*BENCHMARKS)"); do
    check "nanoserve bench $bench --help" nanoserve bench "$bench" --help
done
check "python -m console.costbench --help" python -m console.costbench --help
check "nanoserve-console --help" nanoserve-console --help
check "nanoserve generate (default model)" bash -c \
    'out=$(nanoserve generate "The capital of France is" --max-tokens 8 --temperature 0) && echo "$out" && [ -n "$out" ]'
check "nanoserve-console --once" nanoserve-console --once
check "nanoserve bench throughput (default model, peers left out)" bash -c "
    nanoserve bench throughput --num-requests 4 --output-len 4 8 --single-tokens 8 --repeats 1 --out $work/bench \
      >$work/bench.log && cat $work/bench.log && grep 'transformers arm left out' $work/bench.log \
      && test -s $work/bench/throughput.json"
check "nanoserve serve --port 0 answers a completion" python "$root/scripts/quickstart_serve.py"
check "nanoserve serve --data-parallel-size 2 answers a completion" python "$root/scripts/quickstart_serve.py" \
    --data-parallel-size 2
refused "nanoserve serve --data-parallel-backend ray (no Ray)" "pip install 'nanoserve[ray]'" \
    nanoserve serve --port 0 --data-parallel-size 2 --data-parallel-backend ray
refused "nanoserve serve --kv-events-config (no pyzmq)" "pip install 'nanoserve[kv-events]'" \
    nanoserve serve --port 0 --kv-events-config '{"enable_kv_cache_events": true}'
refused "nanoserve bench reads (no CUDA, no Triton)" "pip install 'nanoserve[gpu]'" nanoserve bench reads
refused "nanoserve bench sizes (no llama-cpp-python)" "pip install 'nanoserve[peers]'" \
    nanoserve bench sizes --shapes smoke --files "$work/files" --out "$work/sizes"
refused "scripts/random-checkpoint.py (no transformers)" "pip install 'nanoserve[hf]'" \
    python scripts/random-checkpoint.py --out "$work/ckpt"

if [ "$failures" -gt 0 ]; then
    echo "quick-start check: $failures failed" >&2
    exit 1
fi
echo "quick-start check: every documented command works from the quick-start install"
