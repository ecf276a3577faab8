"""SASS instruction counts of each family's default kernels, from nvcc and cuobjdump (no GPU needed).

    python scripts/sass_counts.py [--arch sm90] [--dtype bf16] [--causal]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.compile import compile_kernel, target_for  # noqa: E402
from flashgen.config import ARCHS, FAMILIES, HEAD_DIMS, arch_limits, default_config  # noqa: E402

# Tensor-core MMAs (HMMA: mma.sync, HGMMA: wgmma), shared->register tiles (LDSM: ldmatrix), global->shared
# copies (LDGSTS: cp.async, UTMALDG: TMA), and local memory (STL/LDL: spills or stack arrays).
OPS = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "STL", "LDL")

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--arch", default="sm90", choices=ARCHS, help="the GPU to build for (default sm90)")
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--causal", action="store_true")
args = ap.parse_args()

for family in FAMILIES:
    if arch_limits(family).sm > arch_limits(args.arch).sm:
        continue  # the sm90 family runs on sm90 only
    for d in HEAD_DIMS:
        k = compile_kernel(default_config(d, args.dtype, args.causal, args.arch, family), target_for(args.arch, family))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.cubin)
            f.flush()
            sass = subprocess.run(["cuobjdump", "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
        n = Counter(re.findall(r"\b(" + "|".join(OPS) + r")\b", sass))
        r = k.resources
        print(f"{k.name}: regs={r.registers} spill_bytes={r.spill_stores + r.spill_loads} "
              + " ".join(f"{op}={n[op]}" for op in OPS), flush=True)
