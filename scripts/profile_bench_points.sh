#!/bin/bash
# ncu (clocks left alone) on bench points: what holds each kernel back. Default: four points where the two families trailed SDPA on the H200.
# Usage: bash scripts/profile_bench_points.sh ["FAMILY HEAD_DIM SEQLEN CAUSAL(0|1) [DTYPE] [PASS]" ...] > ncu.txt
# KERNELS: the regex of the kernels to profile (default fwd_; for PASS bwd e.g. 'bwd_.*_st[01]$', the main kernel).
POINTS=("$@")
[ ${#POINTS[@]} -eq 0 ] && POINTS=("sm90 128 4096 0" "sm90 64 1024 0" "sm80 256 1024 1" "sm80 128 2048 0")
for point in "${POINTS[@]}"; do
  echo "== $point"
  # shellcheck disable=SC2086  # the point splits into the launcher's four arguments
  timeout 120 ncu --clock-control none -k "regex:${KERNELS:-fwd_}" -s 2 -c 1 --section SpeedOfLight --section Occupancy \
     --section WarpStateStats --section ComputeWorkloadAnalysis python3 scripts/launch_bench_point.py $point 2>&1 \
     | grep -E "fwd_|bwd_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall|stall|Pipe|pipe" | head -24
done
