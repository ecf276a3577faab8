#!/bin/bash
# Final device run: both bench grids with the matmul ceiling measured in the same process.
set -o pipefail
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1
for fam in sm80 sm90; do
  timeout 115 python3 cli.py bench --arch $fam --head-dim 64,128,256 --dtype bf16,fp16 --out "$OUT/b${fam#sm}" 2>&1 \
    | grep -v "point/s\|s/point\|kern = \|UserWarning" | tee -a "$OUT/run8.txt" | tail -3
done
