#!/bin/bash
# Device run: sm90 smoke, GPU suites, tuner end to end, the issue-3 tune. Logs under $OUT.
set -o pipefail
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1
mkdir -p "$OUT/tuned"
timeout 90 python3 scripts/sm90_smoke.py 2>&1 | tee "$OUT/sm90_smoke.txt"; smoke=$?
echo "sm90 smoke rc=$smoke"
fam=sm80; [ $smoke -eq 0 ] && fam=sm80,sm90
FLASHGEN_TEST_FAMILIES=$fam timeout 240 python3 -m pytest -m gpu -q tests/test_gpu_fwd.py 2>&1 | tee "$OUT/gpu_fwd.txt" | tail -25
timeout 200 python3 -m pytest -m gpu -q -s tests/test_tune_gpu.py 2>&1 | tee "$OUT/tune_gpu.txt" | tail -25
timeout 170 python3 cli.py tune --arch sm80 --head-dim 128 --dtype bf16 --causal no --seqlen 4096 --trials 40 \
  --tuned-dir "$OUT/tuned" --storage "sqlite:///$OUT/studies.db" 2>&1 | tee "$OUT/tune_d128.txt" | tail -30
