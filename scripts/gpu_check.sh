#!/bin/bash
# On a GPU machine: clocks, SASS counts of the defaults, the GPU test suite and a bench at N=4096; logs under $OUT.
# Usage: OUT=/tmp/out bash scripts/gpu_check.sh [pytest paths or options, default tests/]
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,compute_cap,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
ARCH=sm$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
FAMILY=sm80; [ "$ARCH" = sm90 ] && FAMILY=sm90
python3 scripts/sass_counts.py --arch "$ARCH" 2>&1 | tee "$OUT/sass.txt"
python3 -m pytest -m gpu -q --durations=5 "${@:-tests/}" 2>&1 | tee "$OUT/pytest_gpu.txt"
python3 cli.py bench --arch "$FAMILY" --head-dim 64,128,256 --seqlen 4096 2>&1 | tee "$OUT/bench.txt"
