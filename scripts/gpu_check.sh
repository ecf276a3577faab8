#!/bin/bash
# One device run: GPU test suite, SASS facts of the default kernels, speed line.
# Usage on the device: source .devkit/setup.sh && bash scripts/device_check.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FLASHGEN_CACHE_DIR=/tmp/fgcache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/sass.txt"
import subprocess, tempfile, os
from flashgen.config import default_config, HEAD_DIMS
from flashgen.compile import compile_kernel
for d in HEAD_DIMS:
    k = compile_kernel(default_config(d, "bf16", False, "sm90"), "sm_90")
    p = tempfile.mktemp(suffix=".cubin"); open(p, "wb").write(k.cubin)
    sass = subprocess.run(["cuobjdump", "--dump-sass", p], capture_output=True, text=True).stdout
    count = lambda s: sass.count(s)
    print(f"{k.name}: regs={k.resources.registers} spills={k.resources.spill_stores} HMMA={count('HMMA')} LDSM={count('LDSM')} LDGSTS.128={count('LDGSTS.E.BYPASS.128')} STL={count('STL')} LDL={count('LDL')}")
PY
python3 -m pytest -m gpu -q --durations=5 ${TESTS:-tests/} "$@" 2>&1 | tee "$OUT/pytest_gpu.txt"
python3 scripts/speed_line.py --head-dim 64 128 256 --seqlen 4096 2>&1 | tee "$OUT/speed.txt"
