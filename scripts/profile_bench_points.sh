#!/bin/bash
# ncu (clocks left alone) on the kernels where the bench falls short: what holds them back.
export FLASHGEN_CACHE_DIR=/tmp/fgcache PYTHONUNBUFFERED=1
for a in "sm90 128 4096 0" "sm90 64 1024 0" "sm80 256 1024 1" "sm80 128 2048 0"; do set -- $a
  echo "== $a"
  timeout 45 ncu --clock-control none -k regex:fwd_ -s 2 -c 1 --section SpeedOfLight --section Occupancy \
     --section WarpStateStats --section ComputeWorkloadAnalysis python3 scripts/profile_kernel.py $1 $2 $3 $4 2>&1 \
     | grep -E "fwd_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall|stall|Pipe|pipe" | head -16
done 2>&1 | tee "$OUT/ncu.txt"
