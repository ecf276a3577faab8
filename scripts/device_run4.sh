#!/bin/bash
# Device run: sm90 overlap / ping-pong smoke, GPU suite, then (only if both pass) tune the
# sm90 family over the bench grid and bench it against SDPA. Logs under $OUT.
set -o pipefail
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1 FLASHGEN_TUNED_DIR=$OUT/tuned
mkdir -p "$OUT/tuned" "$OUT/bench"; cp tuned/*.json "$OUT/tuned/"
timeout 100 python3 scripts/sm90_smoke.py > "$OUT/sm90_smoke.txt" 2>&1; smoke=$?
grep -c "ok=True" "$OUT/sm90_smoke.txt"; grep -v "ok=True" "$OUT/sm90_smoke.txt" | tail -20; echo "smoke rc=$smoke"
timeout 200 python3 -m pytest -m gpu -q -p no:warnings tests/test_gpu_fwd.py > "$OUT/gpu_fwd.txt" 2>&1; suite=$?
tail -15 "$OUT/gpu_fwd.txt"

T="--arch sm90 --block-m 128 --block-n 64,128 --num-stages 2,3 --trials 7 --deadline 20s --tuned-dir $OUT/tuned --storage sqlite:///$OUT/studies.db"
{ timeout 170 python3 cli.py tune $T --head-dim 64,128,256 --dtype bf16 --causal both --seqlen 1024,4096,16384
  timeout 75 python3 cli.py tune $T --head-dim 64,128,256 --dtype fp16 --causal both --seqlen 4096
} 2>&1 | grep -v "s/trial\|trial/s" | tee "$OUT/tune_sm90.txt" | tail -30
timeout 110 python3 cli.py bench --arch sm90 --head-dim 64,128,256 --dtype bf16,fp16 --out "$OUT/bench" 2>&1 \
  | grep -v "point/s\|s/point\|kern = \|UserWarning" | tee "$OUT/bench_sm90.txt" | tail -64
rm -f "$OUT"/tuned/.*.lock
