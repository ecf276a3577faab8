#!/bin/bash
# Device run: widen the sm80 tuning where it trails SDPA flash (d128/d256 short sequences,
# d256 long ones), bench the sm80 grid again, and profile two short-fall kernels with ncu.
set -o pipefail
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1 FLASHGEN_TUNED_DIR=$OUT/tuned
mkdir -p "$OUT/tuned" "$OUT/bench"; cp tuned/*.json "$OUT/tuned/"
S="--arch sm80 --deadline 20s --tuned-dir $OUT/tuned --storage sqlite:///$OUT/studies.db"
{ timeout 200 python3 cli.py tune $S --head-dim 128,256 --dtype bf16,fp16 --causal both --seqlen 1024,2048 --trials 10 \
     --block-m 64,128,256 --block-n 32,64,128 --num-warps 4,8 --num-stages 1,2,3
  timeout 110 python3 cli.py tune $S --head-dim 256 --dtype bf16,fp16 --causal both --seqlen 8192,16384 --trials 7 \
     --block-m 64,128 --block-n 32,64 --num-warps 4,8 --num-stages 1,2,3,4
} 2>&1 | grep -v "s/trial\|trial/s" | tee "$OUT/tune_sm80.txt" | tail -30
timeout 130 python3 cli.py bench --arch sm80 --head-dim 64,128,256 --dtype bf16,fp16 --out "$OUT/bench" 2>&1 \
  | grep -v "point/s\|s/point\|kern = \|UserWarning" | tee "$OUT/bench_sm80.txt" | tail -64
for a in "sm90 128 1024 1" "sm80 256 1024 0"; do set -- $a
  timeout 60 ncu --clock-control none -k regex:fwd_ -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
     python3 scripts/profile_kernel.py $1 $2 $3 $4 2>&1 | grep -E "fwd_|Duration|Throughput|Occupancy|Registers|Waves|Block Size|Grid Size|Shared Memory Config" | head -20
done | tee "$OUT/ncu.txt"
rm -f "$OUT"/tuned/.*.lock
