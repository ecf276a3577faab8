"""`flashgen tune --kind decode|varlen`: the serving problems, which the tuning pipeline measures as it does dense
ones (flashgen.tunable), and their spaces compiled for a GPU run to load from the kernel cache (--compile-only)."""
from __future__ import annotations

import argparse
import itertools

from tqdm import tqdm

from flashgen import tune_decode as td
from flashgen import tune_varlen as tv
from flashgen.compile import target_for
from flashgen.worker import CompileAhead

from .common import CliError, causal_list


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


def decode_problems(args: argparse.Namespace, gpu_name: str, gpu_arch: str) -> list:
    """tune --kind decode's problems on one GPU model: each (head dim, dtype, point, page size)."""
    points = [tuple(int(x) for x in p.lower().split("x")) for p in args.points] if args.points else list(td.DECODE_POINTS)
    if any(len(p) != 2 or min(p) < 1 for p in points):
        raise CliError(f"--points {','.join(args.points)}: expected BATCHxCACHE_LEN, e.g. 32x8192")
    pages = args.pages if args.pages is not None else list(td.PAGE_SIZES)
    if any(p < 0 or p % 16 for p in pages):
        raise CliError(f"--pages {','.join(map(str, pages))}: 0 (contiguous) or multiples of 16")
    if len(args.heads) != 2 or args.heads[0] % args.heads[1]:
        raise CliError("--heads: query heads, KV heads (a multiple of them), e.g. 32,8")
    return td.problems(args.head_dim, args.dtype, args.heads[0], args.heads[1], points, pages, gpu_name, gpu_arch)


def compile_decode(args: argparse.Namespace) -> int:
    """tune --kind decode --compile-only: the whole space, for a GPU run to load from FLASHGEN_CACHE_DIR."""
    arch = args.gpu_arch or "sm90"
    n = max(p.cache_len for p in decode_problems(args, "-", arch))
    return compile_all([c for hd, dt in itertools.product(args.head_dim, args.dtype) for pg in (False, True)
                        for c, _ in td.space(hd, dt, arch, pg, n)], arch, args, "decode")


def varlen_problems(args: argparse.Namespace, gpu_name: str, gpu_arch: str) -> list:
    """tune --kind varlen's problems on one GPU model: each (head dim, dtype, mask, point of
    tune_varlen.VARLEN_POINTS)."""
    try:
        points = [tv.parse_point(p) for p in args.points] if args.points else list(tv.VARLEN_POINTS)
    except ValueError as e:
        raise CliError(f"--points: {e}") from None
    if any(dt == "fp8_e4m3" for dt in args.dtype):
        raise CliError("tune --kind varlen: varlen and window are built for bf16 and fp16")
    return tv.problems(args.head_dim, args.dtype, causal_list(args.causal), args.heads_dim_total, points, gpu_name,
                       gpu_arch)


def compile_varlen(args: argparse.Namespace) -> int:
    """tune --kind varlen --compile-only: the spaces of the problems, for a GPU run to load from FLASHGEN_CACHE_DIR."""
    arch = args.gpu_arch or "sm90"
    return compile_all([c for p in varlen_problems(args, "-", arch) for c in tv.space(p)], arch, args,
                       "varlen / window")


PROBLEMS = {"decode": decode_problems, "varlen": varlen_problems}  # a serving kind's problems on one GPU model
COMPILE = {"decode": compile_decode, "varlen": compile_varlen}
