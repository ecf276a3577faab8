#!/bin/bash
# Device run: GPU suites after the host-overhead and timing fixes, host cost per call, tune the
# sm90 family over the wider block_n choices, then bench both families. One log: $OUT/run7.txt.
set -o pipefail
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1 FLASHGEN_TUNED_DIR=$OUT/tuned
mkdir -p "$OUT/tuned" "$OUT/b80" "$OUT/b90"; cp tuned/*.json "$OUT/tuned/"
L="$OUT/run7.txt"
timeout 90 python3 -m pytest -m gpu -q -p no:warnings tests/test_gpu_fwd.py 2>&1 | tail -4 | tee -a "$L"
timeout 90 python3 -m pytest -m gpu -q -p no:warnings tests/test_tune_gpu.py 2>&1 | tail -2 | tee -a "$L"
timeout 30 python3 scripts/host_overhead.py 2>&1 | grep -v Warn | tee -a "$L"
T="--arch sm90 --block-m 128 --block-n 96,128,160,176,192 --num-stages 2 --trials 8 --deadline 20s --tuned-dir $OUT/tuned --storage sqlite:////tmp/studies.db"
{ timeout 95 python3 cli.py tune $T --head-dim 64,128 --dtype bf16 --causal both --seqlen 1024,4096,16384
  timeout 30 python3 cli.py tune $T --head-dim 64,128 --dtype fp16 --causal both --seqlen 4096
} 2>&1 | grep -v "s/trial\|trial/s" | grep -E "^sm90|^problem" | tee -a "$L"
for fam in sm80 sm90; do
  timeout 105 python3 cli.py bench --arch $fam --head-dim 64,128,256 --dtype bf16,fp16 --out "$OUT/b${fam#sm}" 2>&1 \
    | grep -v "point/s\|s/point\|kern = \|UserWarning" | tee -a "$L" | tail -64
done
rm -f "$OUT"/tuned/.*.lock
