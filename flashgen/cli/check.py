"""`flashgen check`: on a GPU, the default configuration of each problem verified on a few ragged shapes."""
from __future__ import annotations

import argparse
import itertools
from typing import Any

from flashgen import config as C
from flashgen.compile import compile_kernel, target_for
from flashgen.worker import NoGpuError, Worker

from .common import CliError, add_problem_args, causal_list, check_family, table, validate_problem

CHECK_SHAPES = [(2, 128, 128, 4, 4), (1, 1000, 1000, 8, 2), (2, 77, 333, 4, 1), (1, 333, 77, 4, 4), (1, 4096, 4096, 16, 16)]


def add_parser(sub: Any) -> None:
    c = sub.add_parser("check", help="on a GPU: verify the default config of each problem on a few shapes")
    add_problem_args(c)
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    validate_problem(args)
    worker = Worker(hello="flashgen.worker:gpu_hello")
    try:
        try:
            worker.call("builtins:len", ())
        except NoGpuError as e:
            raise CliError(f"check needs a GPU ({e})") from None
        gpu = worker.info
        check_family(args.arch, gpu["name"], gpu["arch"])
        rows, failed = [], 0
        for hd, dt, ca in itertools.product(args.head_dim, args.dtype, causal_list(args.causal)):
            cfg = C.default_config(hd, dt, ca, gpu["arch"], args.arch)
            kernel = compile_kernel(cfg, target_for(gpu["arch"], args.arch))
            kind, value = worker.call("flashgen.worker:gpu_check", kernel, CHECK_SHAPES, deadline_s=300)
            if kind != "ok":
                failed += 1
                rows.append([cfg.name, "all", "-", "-", "-", f"{kind}: {value}"])
                continue
            for r in value:
                failed += not r["ok"]
                rows.append([cfg.name, "x".join(map(str, r["shape"])), f"{r['max_err']:.2e}", f"{r['bound']:.2e}",
                             f"{r['lse_err']:.2e}", "ok" if r["ok"] else r["reason"]])
    finally:
        worker.close()
    print(f"{gpu['name']} ({gpu['arch']}); shapes are batch x seqlen_q x seqlen_k x heads x heads_k")
    print(table(rows, ["kernel", "shape", "max err", "bound", "lse err", "result"]))
    return 1 if failed else 0

