"""flashgen's command line: tune kernels for this GPU, show the tuned store, export kernels, check defaults.

    flashgen tune --arch sm80 --head-dim 64,128 --dtype bf16 --trials 60
    flashgen tune --arch sm80 --head-dim 64 --compile-only      # no GPU needed
    flashgen tune --arch sm80 --gpus all --storage postgresql://tuner@db-host/flashgen  # on each host
    flashgen tune --collect --storage postgresql://tuner@db-host/flashgen  # the fleet's winners -> tuned/
    flashgen tune --kind decode --head-dim 128 --points 32x8192,1x131072 --pages 0,16,256  # KV-cache decoding
    flashgen tune --kind varlen --head-dim 128 --points 64x64-8192,w1024@16384   # packed batches, windows
    flashgen dashboard --storage postgresql://tuner@db-host/flashgen
    flashgen show
    flashgen export --arch sm80 --out exported/
    flashgen export --features varlen,paged,split,pack_gqa --head-dim 128 --causal no --out exported/
    flashgen check --head-dim 64,128
    flashgen bench --arch sm80 --head-dim 64,128,256 --dtype bf16,fp16 --out benchmarks/
    flashgen bench --kind serving --out benchmarks/       # decode, varlen, window, train
"""
from __future__ import annotations

import argparse
import sys

from flashgen import config as C
from flashgen.compile import CompileError
from flashgen.driver import CudaError
from flashgen.store import StoreError

from . import bench, check, dashboard, export, show, tune
from .common import CliError

VERBS = (tune, show, export, check, bench, dashboard)  # each adds its subparser, whose `run` handles it


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command (argv: its words, default sys.argv[1:]); the exit status: 0, 1 where a check failed, 2 on a
    user error (printed as one line), 130 when interrupted."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CliError, StoreError, C.ConfigError, CompileError, CudaError) as e:
        print(f"flashgen {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.cmd == "dashboard":
            return 0
        print("interrupted; rerun the same command to continue the studies", file=sys.stderr)
        return 130
