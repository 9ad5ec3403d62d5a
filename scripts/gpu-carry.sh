#!/usr/bin/env bash
# The folder a GPU check carries to the lent GPU machine, which reaches no package index and takes at most 64 MiB
# a call: manylinux wheels of scripts/gpu-carry.txt for its Python (3.12), and the default model's tokenizer
# exported as a Hugging Face directory (the model's 98 MB GGUF file stays behind). Fails, with the size, past
# 60 MiB. Needs the test extra (transformers exports the tokenizer) and the default model here.
# Usage: scripts/gpu-carry.sh [DIR] [PYTHON_VERSION]   (default: .gpu-carry, git-ignored, and 3.12)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/.gpu-carry}"
pyver="${2:-3.12}"
limit_mib=60
cd "$root"
rm -rf "$dir"
mkdir -p "$dir/wheels"
platforms=()
for n in 39 35 34 31 28 27 26 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$dir/wheels" -r scripts/gpu-carry.txt
wanted=$(grep -c '^[a-z]' scripts/gpu-carry.txt)
got=$(find "$dir/wheels" -name '*.whl' | wc -l)
[ "$got" = "$wanted" ] || { echo "fetched $got wheels for $wanted pins in scripts/gpu-carry.txt" >&2; exit 1; }
python -m tests.tokenizer_source "$dir/tokenizer" >/dev/null
size=$(du -sb "$dir" | cut -f1)
if [ "$size" -gt $((limit_mib * 1024 * 1024)) ]; then
    echo "$dir is $((size / 1024 / 1024)) MiB, over the ${limit_mib} MiB a call can carry beside the tree" >&2
    du -sh "$dir"/wheels/* "$dir/tokenizer" | sort -h | tail -5 >&2
    exit 1
fi
echo "$dir: $got wheels for Python $pyver and the tokenizer, $((size / 1024 / 1024)) MiB (limit ${limit_mib} MiB)"
