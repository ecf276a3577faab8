"""Backward speed: flashgen's backward kernels against SDPA's flash and cuDNN backward. A thin wrapper of

    flashgen bench --pass bwd [--head-dim 64,128,256] [--seqlen 1024,4096,16384] [--dtype bf16] [--out DIR]

(flashgen/compare.py times it: the backward kernels alone, autograd through flashgen.attention, and
SDPA's backward per peer; TFLOP/s count 2.5x the forward's FLOPs). Any `flashgen bench` option passes through.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.main(["bench", "--pass", "bwd", "--seqlen", "1024,4096,16384", *sys.argv[1:]]))
