#!/usr/bin/env bash
# Every GPU claim in one bounded run (about 6 minutes), made to fit the lent GPU machine: Python 3.12 with torch,
# triton and transformers but no package index, 64 MiB carried a call, 8 files back from $OUT.
#
#   here:  bash scripts/gpu-carry.sh                 # .gpu-carry/: wheels for 3.12 + the tokenizer (~9 MiB)
#   there: bash scripts/gpu-check.sh                 # carry [".gpu-carry"], timeout_s 540
#   CI:    bash scripts/gpu-check.sh --dry-run       # no GPU: the same steps' plumbing (see dry_run below)
#
# The carried wheels go into a folder of their own on PYTHONPATH (--no-index --no-deps --target), never into the
# image's environment. Tests that need the default model skip there (NANOSERVE_NO_DEFAULT_MODEL=1); the tiny
# checkpoints take the carried tokenizer (NANOSERVE_TEST_TOKENIZER). Each step runs under `timeout`; steps that
# would start past the budget (GPU_CHECK_BUDGET_S, default 480) are skipped and say so. Into $OUT (else
# bench-results/gpu): gpu-check.txt (each step's status and the tail of its output, the summary last),
# pytest.log, junit.xml and bench.tar.gz (every benchmark's CSV/JSON). Exits 1 if any step failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
budget=${GPU_CHECK_BUDGET_S:-480}
carry="${NANOSERVE_GPU_CARRY:-$root/.gpu-carry}"
py=python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=()
ran=()

dry_run_setup() {
    # The carry folder as the machine gets it (its size checked), then a stand-in for the machine: a virtual
    # environment of only the GPU image's own packages (the CPU torch for its CUDA one) plus the same carried
    # versions built for this Python, and a stub nvidia-smi. No CUDA, so the tests skip and each benchmark's
    # command line is parsed, not run: what is proved is that everything imports, collects and parses, and
    # that $OUT comes back as the machine returns it.
    bash scripts/gpu-carry.sh "$root/.gpu-carry" 3.12 || exit 1
    local dry_dir="$root/build/gpu-dry"
    local here
    here=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    rm -rf "$dry_dir"
    bash scripts/gpu-carry.sh "$dry_dir/carry" "$here" >/dev/null || exit 1
    python3 -m venv "$dry_dir/venv"
    "$dry_dir/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    # the image's packages that nanoserve and its GPU tests touch (device tool, KINDS.md)
    "$dry_dir/venv/bin/python" -m pip install -q torch==2.13.0 triton transformers safetensors tokenizers numpy \
        jinja2 httpx pytest prometheus-client tqdm pyyaml requests anyio h11 click attrs annotated-doc || exit 1
    mkdir -p "$dry_dir/bin"
    printf '#!/bin/sh\necho "stub GPU (dry run), 0 MiB, no driver"\n' >"$dry_dir/bin/nvidia-smi"
    chmod +x "$dry_dir/bin/nvidia-smi"
    export PATH="$dry_dir/bin:$PATH" OUT="$dry_dir/out"
    carry="$dry_dir/carry"
    py="$dry_dir/venv/bin/python"
    rm -rf "$OUT"
}

[ "$dry" = 1 ] && dry_run_setup
out="${OUT:-$root/bench-results/gpu}"
mkdir -p "$out" "$work/bench"
report="$out/gpu-check.txt"
: >"$report"
started=$SECONDS

say() { echo "$*" | tee -a "$report"; }

step() {  # step NAME LIMIT_S COMMAND...: run it bounded, keep its log, record its exit status
    local name=$1 limit=$2
    shift 2
    local log="$work/$name.log"
    if [ $((SECONDS - started + limit)) -gt "$budget" ] && [ "$dry" = 0 ]; then
        say "== $name: skipped, $((SECONDS - started)) s of the ${budget} s budget spent"
        failed+=("$name (out of time)")
        return
    fi
    local began=$SECONDS status=0
    timeout "$limit" "$@" >"$log" 2>&1 || status=$?
    ran+=("$name")
    [ "$status" = 0 ] || failed+=("$name (exit $status$([ "$status" = 124 ] && echo ", timed out at ${limit} s"))")
    say "== $name: exit $status in $((SECONDS - began)) s"
    grep -v -i -E "warn|it/s\]" "$log" | tail -n "${TAIL:-25}" | tee -a "$report"
}

bench() {  # bench NAME LIMIT_S ARGS...: a benchmark; in a dry run its command line is parsed, not run
    local name=$1 limit=$2
    shift 2
    if [ "$dry" = 1 ]; then
        step "$name" "$limit" "$py" -c 'import sys; from nanoserve.cli import build_parser
build_parser().parse_args(sys.argv[1:]); print("parsed:", *sys.argv[1:])' "$@"
    else
        step "$name" "$limit" "$py" -m nanoserve.cli "$@"
    fi
}

# The carried packages: a folder of their own, never the image's environment.
if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
        "$carry"/wheels/*.whl; then
    say "could not install the carried wheels from $carry/wheels (built by scripts/gpu-carry.sh?)"
    exit 1
fi
export PYTHONPATH="$root:$work/site" PYTHONUNBUFFERED=1 NANOSERVE_TEST_TOKENIZER="$carry/tokenizer"
if ! "$py" -c "from nanoserve.model.loader import default_model_path; default_model_path()" 2>/dev/null; then
    export NANOSERVE_NO_DEFAULT_MODEL=1
fi

say "# gpu-check $(date -u +%Y-%m-%dT%H:%MZ)$([ "$dry" = 1 ] && echo ' (dry run: no GPU)')"
TAIL=8 step machine 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c 'import sys, torch, triton; print(sys.version.split()[0], \"torch\", torch.__version__, \"triton\",
        triton.__version__, \"cuda\", torch.cuda.is_available(), torch.cuda.device_count())'"
TAIL=30 step pytest 270 "$py" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/junit.xml" \
    tests/test_gpu*.py
[ -f "$work/pytest.log" ] && cp "$work/pytest.log" "$out/pytest.log"
step checkpoint 90 "$py" scripts/random-checkpoint.py --out "$work/llama-8h" --tokenizer "$carry/tokenizer"
bench throughput 90 bench throughput --model "$work/llama-8h" --device cuda --dtype bfloat16 \
    --num-requests 32 --repeats 3 --kv-cache-gib 4 --skip-llama-cpp --out "$work/bench"
bench graphs 100 bench graphs --random-big --tokenizer "$carry/tokenizer" --batches 1 2 4 8 32 128 \
    --out "$work/bench"
bench reads 60 bench reads --batches 1 16 256 --contexts 512 8192 32768 --repeats 5 --out "$work/bench"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
for n in 2 4; do  # tensor parallelism over NCCL, one rank beside the group, where the machine has the GPUs
    if [ "$gpus" -ge "$n" ]; then
        bench "tp$n" 90 bench throughput --model "$work/llama-8h" --device cuda --tensor-parallel-size "$n" \
            --num-requests 32 --repeats 3 --skip-hf --skip-llama-cpp --out "$work/bench/tp$n"
    fi
done
if [ "$gpus" -ge 2 ]; then  # data parallelism: one replica per GPU beside one GPU, affinity beside round-robin
    bench dp2 120 bench serve --data-parallel-size 2 --model "$work/llama-8h" --device cuda \
        --dataset shared-prefix --input-len 512 --output-len 64 --num-prompts 64 --concurrency 16 --rounds 2 \
        --kv-cache-gib 4 --out "$work/bench/dp2"
fi
tar czf "$out/bench.tar.gz" -C "$work" bench

say "== summary: ${#ran[@]} steps ran in $((SECONDS - started)) s; ${#failed[@]} failed${failed:+: ${failed[*]}}"
if [ "$dry" = 1 ]; then  # what the machine would hand back: at most 8 files, 2 folders down, plain names
    files=$(find "$out" -type f | wc -l)
    bad=$(find "$out" -mindepth 1 | sed "s|^$out/||" | grep -v -E '^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}$')
    tar tzf "$out/bench.tar.gz" | grep -q '^bench/' || failed+=("bench.tar.gz unreadable")
    [ "$files" -le 8 ] || failed+=("$files files in \$OUT, over the 8 that come back")
    [ -z "$bad" ] || failed+=("names the machine would not return: $bad")
    [ -s "$out/junit.xml" ] || failed+=("no junit.xml")
    say "dry run: $files files in \$OUT ($(cd "$out" && ls | tr '\n' ' '))${failed:+; failed: ${failed[*]}}"
fi
[ "${#failed[@]}" = 0 ]
