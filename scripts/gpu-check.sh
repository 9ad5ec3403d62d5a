#!/usr/bin/env bash
# One shot on a CUDA machine: every gpu-marked test, then the benchmarks, output kept under bench-results/gpu/.
# Usage: bash scripts/gpu-check.sh   (expects torch with CUDA, transformers and the package installed or on PYTHONPATH)
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench-results/gpu
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "# gpu-check $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pytest -q -m gpu tests 2>&1 | tail -25
  python3 -m nanoserve.cli bench throughput --num-requests 64 --out "$out" 2>&1 | grep -v -i warn | tail -20
} | tee "$out/gpu-check.txt"
