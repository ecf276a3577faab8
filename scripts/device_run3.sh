#!/bin/bash
# Device run: tune the sm80 family for the issue-3 problems (and d256 at 4096), bench the
# sm80 grid against SDPA, then a first look at the sm90 family. Logs under $OUT.
set -o pipefail
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1 FLASHGEN_TUNED_DIR=$OUT/tuned
mkdir -p "$OUT/tuned" "$OUT/bench"; cp tuned/*.json "$OUT/tuned/"
R="--block-m 128,256 --block-n 32,64,128 --num-warps 4,8 --num-stages 2,3,4 --trials 8 --tuned-dir $OUT/tuned --storage sqlite:///$OUT/studies.db"
{ timeout 300 python3 cli.py tune --arch sm80 --head-dim 64,128 --dtype bf16,fp16 --causal both --seqlen 1024,4096,16384 $R
  timeout 60 python3 cli.py tune --arch sm80 --head-dim 256 --dtype bf16,fp16 --causal both --seqlen 4096 \
     --block-m 64,128 --block-n 32,64 --num-warps 4,8 --num-stages 1,2 --trials 6 --tuned-dir $OUT/tuned --storage sqlite:///$OUT/studies.db
} 2>&1 | grep -v "it/s\|trial/s\|s/trial" | tee "$OUT/tune_sm80.txt" | tail -45
timeout 130 python3 cli.py bench --arch sm80 --head-dim 64,128,256 --dtype bf16,fp16 --out "$OUT/bench" 2>&1 \
  | grep -v "point/s\|s/point" | tee "$OUT/bench_sm80.txt" | tail -64
{ timeout 45 python3 cli.py bench --arch sm90 --head-dim 64,128,256 --dtype bf16 --seqlen 4096,16384
  timeout 60 python3 cli.py tune --arch sm90 --head-dim 128 --dtype bf16 --causal no --seqlen 4096 --trials 16 \
     --tuned-dir $OUT/tuned --storage sqlite:///$OUT/studies.db
} 2>&1 | grep -v "point/s\|s/point\|trial/s\|s/trial" | tee "$OUT/sm90.txt" | tail -30
rm -f "$OUT"/tuned/.*.lock
