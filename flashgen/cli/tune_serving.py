"""`flashgen tune --kind decode|varlen`: the serving problems, each measured over its whole space on this GPU
(or, with --compile-only, the space compiled for a GPU run to load from the kernel cache)."""
from __future__ import annotations

import argparse
import importlib.util
import itertools
from pathlib import Path
from typing import Any

from tqdm import tqdm

from flashgen import tune_decode as td
from flashgen import tune_varlen as tv
from flashgen.compile import target_for
from flashgen.driver import device_info
from flashgen.store import merge, store_path
from flashgen.worker import CompileAhead

from .common import CliError, causal_list, table


def tuning_torch(kind: str) -> Any:
    """torch where `tune --kind <kind>` can time kernels: an NVIDIA GPU visible to torch, and pycuda; else the
    CliError saying what is missing and what works without a GPU."""
    reason = None
    try:
        import torch  # optional dependency: only a tune on the GPU needs it
    except ImportError:
        reason = "torch is not installed"
    else:
        if not torch.cuda.is_available():
            reason = "torch sees no CUDA GPU"
        elif importlib.util.find_spec("pycuda") is None:
            reason = "pycuda is not installed"
    if reason is not None:
        raise CliError(f"tune --kind {kind} times kernels: it needs an NVIDIA GPU, with torch built for CUDA and "
                       f"pycuda (pip install -e '.[gpu]'); {reason}. Without a GPU, --compile-only compiles the "
                       "kernels for a GPU run to load from the kernel cache")
    return torch


def tune_and_store(problems: list, tune_problem: Any, desc: str, info: Any,
                   args: argparse.Namespace) -> tuple[dict, dict, Path]:
    """Each serving problem measured in full (tune_problem(p, progress=...) -> entry or None), one progress bar;
    the winners merged into this GPU's store. Returns (entries, merge actions, store path)."""
    entries = {}
    for p in tqdm(problems, desc=desc, unit="problem"):
        e = tune_problem(p, progress=tqdm.write)
        if e is not None:
            entries[p.key] = e
    path = store_path(info.name, info.arch, args.tuned_dir)
    return entries, merge(path, info.name, info.arch, entries, args.force) if entries else {}, path


def compile_all(cfgs: list, arch: str, args: argparse.Namespace, what: str) -> int:
    """--compile-only of a serving kind: every configuration compiled for `arch` on --jobs processes, one progress
    bar, for a GPU run to load from FLASHGEN_CACHE_DIR."""
    cfgs = sorted(set(cfgs), key=lambda c: c.name)
    pool = CompileAhead(args.jobs, args.compile_timeout)
    try:
        for c in cfgs:
            pool.submit(c, target_for(arch, c.family))
        for c in tqdm(cfgs, desc="compile", unit="kernel"):
            pool.get(c, target_for(arch, c.family))
    finally:
        pool.close()
    print(f"{len(cfgs)} {what} kernels compiled for {arch}")
    return 0


def decode(args: argparse.Namespace) -> int:
    """tune --kind decode: each (head dim, dtype, point, page size) measured in full, the winners merged into the store."""
    points = [tuple(int(x) for x in p.lower().split("x")) for p in args.points] if args.points else list(td.DECODE_POINTS)
    if any(len(p) != 2 or min(p) < 1 for p in points):
        raise CliError(f"--points {','.join(args.points)}: expected BATCHxCACHE_LEN, e.g. 32x8192")
    pages = args.pages if args.pages is not None else list(td.PAGE_SIZES)
    if any(p < 0 or p % 16 for p in pages):
        raise CliError(f"--pages {','.join(map(str, pages))}: 0 (contiguous) or multiples of 16")
    if len(args.heads) != 2 or args.heads[0] % args.heads[1]:
        raise CliError("--heads: query heads, KV heads (a multiple of them), e.g. 32,8")
    if args.compile_only:  # the whole space, for a GPU run to load from FLASHGEN_CACHE_DIR
        arch = args.gpu_arch or "sm90"
        return compile_all([c for hd, dt in itertools.product(args.head_dim, args.dtype) for pg in (False, True)
                            for c, _ in td.space(hd, dt, arch, pg, max(n for _, n in points))], arch, args, "decode")
    torch = tuning_torch("decode")
    info = device_info(torch.cuda.current_device())
    problems = [td.DecodeProblem(hd, dt, args.heads[0], args.heads[1], b, n, pg, info.name, info.arch)
                for hd, dt, (b, n), pg in itertools.product(args.head_dim, args.dtype, points, pages)
                if not pg or n % pg == 0]
    entries, actions, path = tune_and_store(problems, td.tune_problem, "decode problems", info, args)
    rows = []
    for key, e in entries.items():
        d = e["default"]
        rows.append([key, e["kernel"], e["num_splits"], f"{e['median_ms'] * 1e3:.1f}", f"{e['tb_s']:.2f}",
                     f"{d['tb_s']:.2f}" if d.get("tb_s") else d["status"],
                     f"{d['median_ms'] / e['median_ms']:.2f}x" if d.get("median_ms") else "-", actions[key]])
    print(table(rows, ["problem", "kernel", "splits", "us", "TB/s", "untuned TB/s", "speedup", "store"]))
    print(f"{len(entries)} of {len(problems)} problems stored in {path}")
    return 0


def varlen(args: argparse.Namespace) -> int:
    """tune --kind varlen: each (head dim, dtype, mask, point of tune_varlen.VARLEN_POINTS) measured over the
    family's whole fitting space, the winners merged into the store."""
    try:
        points = [tv.parse_point(p) for p in args.points] if args.points else list(tv.VARLEN_POINTS)
    except ValueError as e:
        raise CliError(f"--points: {e}") from None

    def problems(name: str, arch: str) -> list:
        return [tv.VarlenProblem(hd, dt, ca, args.heads_dim_total // hd, args.heads_dim_total // hd, packed, seqs, lo,
                                 hi, win, name, arch)
                for hd, dt, ca, (packed, seqs, lo, hi, win) in itertools.product(
                    args.head_dim, args.dtype, causal_list(args.causal), points)
                if packed or ca]  # a window point is a causal sliding window

    if any(dt == "fp8_e4m3" for dt in args.dtype):
        raise CliError("tune --kind varlen: varlen and window are built for bf16 and fp16")
    if args.compile_only:  # the whole space, for a GPU run to load from FLASHGEN_CACHE_DIR
        arch = args.gpu_arch or "sm90"
        return compile_all([c for p in problems("-", arch) for c in tv.space(p)], arch, args, "varlen / window")
    torch = tuning_torch("varlen")
    info = device_info(torch.cuda.current_device())
    todo = problems(info.name, info.arch)
    entries, actions, path = tune_and_store(todo, tv.tune_problem, "varlen problems", info, args)
    rows = []
    for key, e in entries.items():
        d = e["default"]
        rows.append([key, e["kernel"], f"{e['median_ms']:.3f}", f"{e['tflops']:.0f}",
                     f"{d['tflops']:.0f}" if d.get("tflops") else d["status"],
                     f"{d['median_ms'] / e['median_ms']:.2f}x" if d.get("median_ms") else "-", actions[key]])
    print(table(rows, ["problem", "kernel", "ms", "TFLOP/s", "untuned TFLOP/s", "speedup", "store"]))
    print(f"{len(entries)} of {len(todo)} problems stored in {path}")
    return 0

