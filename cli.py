#!/usr/bin/env python3
"""flashgen's command line: tune kernels for this GPU, show the tuned store, export kernels, check defaults.

    python cli.py tune --arch sm80 --head-dim 64,128 --dtype bf16 --trials 60
    python cli.py tune --arch sm80 --head-dim 64 --compile-only      # no GPU needed
    python cli.py tune --arch sm80 --gpus all --storage postgresql://tuner@db-host/flashgen  # on each host
    python cli.py tune --collect --storage postgresql://tuner@db-host/flashgen  # the fleet's winners -> tuned/
    python cli.py tune --kind decode --head-dim 128 --points 32x8192,1x131072 --pages 0,16,256  # KV-cache decoding
    python cli.py tune --kind varlen --head-dim 128 --points 64x64-8192,w1024@16384   # packed batches, windows
    python cli.py dashboard --storage postgresql://tuner@db-host/flashgen
    python cli.py show
    python cli.py export --arch sm80 --out exported/
    python cli.py export --features varlen,paged,split,pack_gqa --head-dim 128 --causal no --out exported/
    python cli.py check --head-dim 64,128
    python cli.py bench --arch sm80 --head-dim 64,128,256 --dtype bf16,fp16 --out benchmarks/
    python cli.py bench --kind serving --out benchmarks/       # decode, varlen, window, train
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import sys
from typing import Any
from pathlib import Path

from flashgen import config as C
from flashgen.problem import (BATCH_TOKENS, DEFAULT_TRIALS, EXHAUSTIVE_MAX, HEADS_DIM_TOTAL, SEQLEN_BUCKETS,
                              TuneProblem)

STORAGE_HELP = ("Optuna storage shared by the tuners: a database URL (sqlite:///f.db, postgresql://user@host/db) "
                "or a journal file on a shared filesystem (journal:///shared/f.log, or a path not ending in "
                ".db/.sqlite/.sqlite3); default: SQLite in the user data dir")
CHECK_SHAPES = [(2, 128, 128, 4, 4), (1, 1000, 1000, 8, 2), (2, 77, 333, 4, 1), (1, 333, 77, 4, 4), (1, 4096, 4096, 16, 16)]


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def duration(text: str) -> float:
    """Seconds from "90", "90s", "10m", "1.5h"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def gpu_list(text: str) -> list[int] | str:
    """"all", or GPU indices such as 0,1 (an index given twice runs two tuners on that GPU)."""
    if text.strip() == "all":
        return "all"
    gpus = int_list(text)
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"expected 'all' or GPU indices like 0,1, got {text!r}")
    return gpus


def causal_list(text: str) -> list[bool]:
    return {"yes": [True], "no": [False], "both": [False, True]}[text]


def dtype_list(s: str) -> list[str]:
    """--dtype: names as the config spells them; "fp8" is short for fp8_e4m3."""
    return ["fp8_e4m3" if d == "fp8" else d for d in str_list(s)]


def _check(name: str, values: list, allowed: tuple) -> None:
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise CliError(f"--{name} {','.join(map(str, bad)) or '(empty)'}: choose from {','.join(map(str, allowed))}")


def add_problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="sm80", help=f"template family, one of {', '.join(C.FAMILIES)} (default sm80)")
    p.add_argument("--head-dim", type=int_list, default=[64, 128], help="head dims, e.g. 64,128 (default 64,128)")
    p.add_argument("--dtype", type=dtype_list, default=["bf16"],
                   help="dtypes, e.g. bf16,fp16, or fp8 (e4m3, --arch sm90; default bf16)")
    p.add_argument("--causal", choices=("yes", "no", "both"), default="both", help="masking (default both)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cli.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{tune,show,export,check,bench,dashboard}")

    t = sub.add_parser("tune", help="search the tile space per problem on this GPU and store the fastest verified kernel")
    add_problem_args(t)
    t.add_argument("--kind", choices=("dense", "decode", "varlen"), default="dense",
                   help="dense: the tile space per seqlen bucket (default); decode: KV-cache decoding (one query "
                        "token): every decode tile x num_splits per --points and --pages, the fastest verified one "
                        "stored and taken by attention_with_kvcache(num_splits=0); varlen: a packed batch of mixed "
                        "lengths and a sliding window at a long sequence, the whole serving forward space each, "
                        "taken by attention_varlen and attention(window_size=...)")
    t.add_argument("--points", type=str_list, default=None,
                   help="decode: batch x cache length points, e.g. 32x8192,1x131072 (default: the bench's six); "
                        "varlen: packed batches SEQSxMIN-MAX (lengths log-uniform in [MIN, MAX]) and causal windows "
                        "wWINDOW@N, e.g. 64x64-8192,w1024@16384 (the default)")
    t.add_argument("--pages", type=int_list, default=None, help="decode: page sizes, 0 = contiguous (default 0,16,256)")
    t.add_argument("--heads", type=int_list, default=[32, 8], help="decode: query heads, KV heads (default 32,8)")
    t.add_argument("--seqlen", type=int_list, default=list(SEQLEN_BUCKETS), help="seqlen buckets (default 1024,4096,16384)")
    t.add_argument("--gqa", type=int_list, default=[1], help="GQA group sizes, heads // heads_k (default 1)")
    t.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, help="batch = batch_tokens // seqlen (default 16384)")
    t.add_argument("--heads-dim-total", type=int, default=HEADS_DIM_TOTAL, help="heads = this // head_dim (default 2048)")
    t.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "both"), default="fwd",
                   help="tune the forward, the backward (its kernels timed alone, gradients verified against "
                        "float64; --arch sm90 tunes family sm90's backward where it has the head dim, else sm80's) "
                        "or both (default fwd)")
    t.add_argument("--trials", type=int, default=None,
                   help=f"evaluated trials per problem, in total over reruns: a sampled search (default: every "
                        f"configuration when at most {EXHAUSTIVE_MAX} fit the GPU, else {DEFAULT_TRIALS} sampled)")
    t.add_argument("--timeout", type=duration, default=None, help="time limit per problem, e.g. 10m")
    t.add_argument("--sampler", choices=("tpe", "random"), default="tpe", help="Optuna sampler (default tpe)")
    t.add_argument("--seed", type=int, default=0,
                   help="sampler seed, mixed with each tuner's name so that tuners of one study differ (default 0)")
    t.add_argument("--exhaustive", action=argparse.BooleanOptionalAction, default=None,
                   help="evaluate every configuration of the (restricted) space; --no-exhaustive: sample "
                        f"--trials with --sampler (default: exhaustive when at most {EXHAUSTIVE_MAX} fit, unless "
                        "--trials is given)")
    t.add_argument("--retime", type=int, default=5, metavar="N",
                   help="before storing, time the N fastest verified configurations (and the default) again, "
                        "side by side in 3 interleaved rounds, and store the fastest of those (0: store the "
                        "search's fastest single figure; default 5)")
    t.add_argument("--storage", default=None, help=STORAGE_HELP)
    t.add_argument("--gpus", type=gpu_list, default=None,
                   help="tune on these GPUs, one tuner each (e.g. 0,1 or all; default: the current GPU only)")
    t.add_argument("--collect", action="store_true",
                   help="tune nothing: write the winners of every study in --storage into the tuned store, each "
                        "compiled and verified again on this host's GPU first (--simulate: the simulated backend)")
    t.add_argument("--heartbeat", type=int, default=30, help="seconds between heartbeats of held trials (default 30)")
    t.add_argument("--grace", type=int, default=120,
                   help="a trial without a heartbeat this many seconds was held by a dead tuner: failed and "
                        "retried once elsewhere (default 120)")
    t.add_argument("--tuned-dir", type=Path, default=None, help="tuned store directory (default FLASHGEN_TUNED_DIR or tuned/)")
    t.add_argument("--force", action="store_true", help="replace stored entries even when the new result is slower")
    t.add_argument("--compile-only", action="store_true", help="no GPU: compile the configurations that fit --gpu-arch, print their resources (and why the others do not fit)")
    t.add_argument("--gpu-arch", default=None, help="GPU arch to compile for with --compile-only or --simulate (default: this GPU, else --arch)")
    for field, choices in (("block-m", C.BLOCK_MS), ("block-n", C.BLOCK_NS), ("num-warps", C.NUM_WARPS),
                           ("num-stages", C.NUM_STAGES)):
        t.add_argument(f"--{field}", type=int_list, default=None, help=f"restrict {field.replace('-', '_')} to these "
                       f"of {','.join(map(str, choices))}")
    for knob in C.SM90_KNOBS:
        t.add_argument(f"--{knob.replace('_', '-')}", choices=("yes", "no"), default=None,
                       help=f"sm90: restrict {knob} to on or off (default: both)")
    t.add_argument("--around-store", type=str_list, default=None, metavar="FIELD,...",
                   help="forward: each problem's space is its stored configuration with only these fields free (e.g. "
                        "lazy_rescale after a new knob: a re-tune of the stored tile, not of the whole space); "
                        "problems without a stored entry keep the whole space")
    t.add_argument("--max-configs", type=int, default=None, help="keep only the first N configurations of the space")
    t.add_argument("--jobs", type=int, default=None, help="compile processes (default: all cores)")
    t.add_argument("--deadline", type=duration, default=120.0, help="a trial hanging longer is killed (default 120s)")
    t.add_argument("--compile-timeout", type=duration, default=600.0,
                   help="a compile (nvcc, ptxas) taking longer is killed and fails its trial (default 10m)")
    t.add_argument("--simulate", action="store_true",
                   help="testing only: time with flashgen.backend.SimulatedBackend's cost model (fake numbers)")
    t.add_argument("--simulate-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: seconds per trial
    t.add_argument("--simulate-log", default=None, help=argparse.SUPPRESS)  # tests: a log of every evaluation

    s = sub.add_parser("show", help="print the tuned table")
    s.add_argument("--gpu", default=None, help="only this GPU (its name, e.g. 'NVIDIA H200', or file slug)")
    s.add_argument("--tuned-dir", type=Path, default=None, help="tuned store directory")
    s.add_argument("--from-storage", default=None, metavar="STORAGE",
                   help="show the winners held in this study storage (URL or journal path) instead of the store")

    e = sub.add_parser("export", help="write tuned kernels as .cu + launch header for a C++ project")
    e.add_argument("--arch", default="sm80", help="template family to export (default sm80)")
    e.add_argument("--out", type=Path, required=True, help="output directory")
    e.add_argument("--gpu", default=None, help="only kernels tuned on this GPU (name or file slug)")
    e.add_argument("--tuned-dir", type=Path, default=None, help="tuned store directory")
    # Serving kernels are not tuned (the store holds none): --features picks them the way
    # attention_varlen / attention_with_kvcache do (flashgen.kernels.serving.serve_config).
    e.add_argument("--features", type=str_list, action="append", default=None, metavar="F,F,...",
                   help=f"export serving kernels with these features (of {','.join(C.FEATURES)}) instead of the "
                        "tuned store, tiles as flashgen.kernels.serving chooses them; repeat for several sets")
    e.add_argument("--head-dim", type=int_list, default=[64, 128], help="with --features: head dims (default 64,128)")
    e.add_argument("--dtype", type=str_list, default=["bf16"], help="with --features: dtypes (default bf16)")
    e.add_argument("--causal", choices=("yes", "no", "both"), default="both", help="with --features: masking (default both)")
    e.add_argument("--rows", type=int, default=None,
                   help="with --features: query rows per sequence the kernels serve (seqlen_q, times heads/heads_k "
                        "with pack_gqa); up to 32 takes the decode tiles (default: 1 with paged or pack_gqa, else 1024)")
    e.add_argument("--gpu-arch", default="sm80",
                   help=f"with --features: the GPU to build and fit them for, one of {', '.join(C.ARCHS)} (default sm80)")

    c = sub.add_parser("check", help="on a GPU: verify the default config of each problem on a few shapes")
    add_problem_args(c)

    b = sub.add_parser("bench", help="time tuned kernels against PyTorch SDPA backends; table, JSON, CSV, PNG")
    add_problem_args(b)
    b.set_defaults(head_dim=[64, 128, 256])
    b.add_argument("--seqlen", type=int_list, default=[1024, 2048, 4096, 8192, 16384],
                   help="seqlens (default 1024,2048,4096,8192,16384)")
    b.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, help="batch = batch_tokens // seqlen (default 16384)")
    b.add_argument("--heads-dim-total", type=int, default=HEADS_DIM_TOTAL, help="heads = this // head_dim (default 2048)")
    b.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "both"), default="fwd",
                   help="time the forward, the backward (flashgen's backward kernels against SDPA's backward "
                        "per peer; 2.5x the forward's FLOPs) or both (default fwd)")
    b.add_argument("--kind", choices=("dense", "decode", "varlen", "window", "train", "serving"), default="dense",
                   help="dense: the grid above; decode: KV-cache decoding (contiguous and paged) against a copy of "
                        "the same bytes and SDPA; varlen: a packed causal batch against the dense kernels; window: a "
                        "causal sliding window at N=16384; train: the backward of those two against the dense backward; "
                        "serving: the last four (default dense)")
    b.add_argument("--peers", type=str_list, default=["flash", "cudnn"],
                   help="SDPA backends to compare with: flash,cudnn,efficient (default flash,cudnn)")
    b.add_argument("--out", type=Path, default=None, help="write <gpu>-<date>.json/.csv/.png here")
    b.add_argument("--reps", type=int, default=50, help="timed repetitions per kernel (default 50)")
    b.add_argument("--rounds", type=int, default=3,
                   help="forward kernels alone (flashgen and each peer) are timed in this many interleaved rounds of "
                        "--reps each, the median over all (default 3)")
    b.add_argument("--simulate", action="store_true",
                   help="testing only: time with flashgen.compare.SimulatedRunner (fake numbers)")

    d = sub.add_parser("dashboard", help="open optuna-dashboard on the studies: trials, failures, importances "
                                         "(pip install -e '.[fleet]')")
    d.add_argument("--storage", default=None, help=STORAGE_HELP)
    d.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1; the dashboard has no authentication: anyone who "
                        "reaches another address can change the studies)")
    d.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    return ap


def table(rows: list[list], head: list[str]) -> str:
    cells = [head, *[[str(x) for x in r] for r in rows]]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def passes(args: argparse.Namespace) -> list[str]:
    """The passes of `tune --pass`."""
    p = getattr(args, "pass_", "fwd")
    return ["fwd", "bwd"] if p == "both" else [p]


def pass_family(args: argparse.Namespace, pass_: str, head_dim: int) -> str:
    """The template family a pass is tuned in: --arch for the forward; for the backward --arch where that
    family has a backward for the head dim (sm90: C.SM90_BWD_HEAD_DIMS), else sm80."""
    if pass_ == "fwd" or (args.arch == "sm90" and head_dim in C.SM90_BWD_HEAD_DIMS):
        return args.arch
    return "sm80"


def restricted_space(args: argparse.Namespace, head_dim: int, dtype: str, causal: bool,
                     pass_: str = "fwd", gqa_group: int = 1) -> list:
    family = pass_family(args, pass_, head_dim)
    if pass_ == "bwd":
        cfgs = C.bwd_space(head_dim, dtype, causal, family=family)
    else:
        cfgs = C.space(args.arch, head_dim, dtype, causal, gqa_group)
    for field in ("block_m", "block_n", "num_warps") + ("num_stages",) * (pass_ == "fwd" or family == "sm90"):
        keep = getattr(args, field)
        if keep is not None:
            cfgs = [c for c in cfgs if getattr(c, field) in keep]
    for knob in C.SM90_KNOBS if pass_ == "fwd" else ():
        if getattr(args, knob) is not None:
            cfgs = [c for c in cfgs if getattr(c, knob) == (getattr(args, knob) == "yes")]
    return cfgs[: args.max_configs] if args.max_configs else cfgs


def around_store(args: argparse.Namespace, problem: Any, space: list, stores: dict) -> tuple:
    """--around-store: the configurations of `space` equal to the problem's stored one but in the free fields.
    `stores` keeps each GPU's store entries, read once for all problems."""
    if not args.around_store or problem.pass_ != "fwd":
        return tuple(space)
    from flashgen.store import config_from_entry, read_store, store_path
    path = store_path(problem.gpu_name, problem.gpu_arch, args.tuned_dir)
    if path not in stores:
        stores[path] = read_store(path)["entries"]
    entry = stores[path].get(problem.key)
    if entry is None and problem.gqa_group > 1:  # a GQA problem: around the same shape's MHA entry
        entry = stores[path].get(dataclasses.replace(problem, gqa_group=1).key)
    if entry is None:
        return tuple(space)
    return tuple(C.around(config_from_entry(entry), space, args.around_store))


def check_family(family: str, gpu_name: str, gpu_arch: str) -> None:
    if C.arch_limits(family).sm > C.arch_limits(gpu_arch).sm if gpu_arch in C.ARCHS else False:
        raise CliError(f"--arch {family} kernels need an {family} or newer GPU; {gpu_name} is {gpu_arch}")


def validate(args: argparse.Namespace) -> None:
    _check("arch", [args.arch], C.FAMILIES)
    _check("head-dim", args.head_dim, C.HEAD_DIMS)
    _check("dtype", args.dtype, C.DTYPES)
    if set(args.dtype) & set(C.FP8_DTYPES):
        if args.arch != "sm90":
            raise CliError(f"--dtype fp8 is built in family sm90 (FP8 wgmma): use --arch sm90, not {args.arch}")
        bad = [d for d in args.head_dim if d not in C.FP8_HEAD_DIMS]
        if bad:
            raise CliError(f"--head-dim {','.join(map(str, bad))}: FP8 has head dims "
                           f"{','.join(map(str, C.FP8_HEAD_DIMS))}")
    if args.cmd in ("tune", "bench"):  # the problem grid: positive counts and lengths
        for name in ("trials", "heartbeat", "grace") * (args.cmd == "tune") + ("reps", "rounds") * (args.cmd == "bench") \
                + ("batch_tokens", "heads_dim_total"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise CliError(f"--{name.replace('_', '-')} must be at least 1")
        bad = [s for s in args.seqlen if s < 1]
        if bad:
            raise CliError(f"--seqlen values must be positive, got {bad}")
    if args.cmd != "tune":
        return
    if args.retime < 0:
        raise CliError("--retime must be 0 (off) or more")
    if args.around_store:
        args.around_store = [f.replace("-", "_") for f in args.around_store]
        fields = {f.name for f in dataclasses.fields(C.KernelConfig)}
        _check("around-store", args.around_store, tuple(sorted(fields)))
    if args.grace <= args.heartbeat:
        raise CliError(f"--grace {args.grace} must be longer than --heartbeat {args.heartbeat}")
    if args.simulate and args.gpus == "all":
        raise CliError("--gpus all needs real GPUs; with --simulate give indices, e.g. --gpus 0,1")
    if args.trials is not None and args.exhaustive:
        raise CliError("--trials and --exhaustive conflict: an exhaustive search evaluates every configuration")
    dense_bm = tuple(b for b in C.FAMILY_BLOCK_MS[args.arch] if b >= C.DENSE_MIN_BLOCK_M)  # decode tiles: not here
    choices = {"fwd": (("block_m", dense_bm), ("block_n", C.FAMILY_BLOCK_NS[args.arch]),
                       ("num_warps", tuple(w for w in C.NUM_WARPS if w > 1)), ("num_stages", C.NUM_STAGES)),
               "bwd": (("block_m", C.BWD_BLOCK_MS), ("block_n", C.BWD_BLOCK_NS), ("num_warps", C.BWD_NUM_WARPS))}
    if args.arch == "sm90":  # the backward's sm90 family: warps follow block_n (12: two consumer warpgroups)
        choices["bwd"] = (("block_m", C.BWD_BLOCK_MS), ("block_n", C.BWD_BLOCK_NS),
                          ("num_warps", tuple(sorted(set(C.BWD_NUM_WARPS) | {12}))), ("num_stages", C.SM90_BWD_STAGES))
    for p in passes(args):
        for field, allowed in choices[p]:
            if getattr(args, field) is not None:
                _check(field.replace("_", "-"), getattr(args, field), allowed)
    if args.gpu_arch is not None:
        _check("gpu-arch", [args.gpu_arch], tuple(C.ARCHS))
    for hd, g in itertools.product(args.head_dim, args.gqa):
        heads = max(1, args.heads_dim_total // hd)  # as TuneProblem.heads
        if g < 1:
            raise CliError(f"--gqa {g}: the group size (heads // heads_k) must be at least 1")
        if heads % g:
            raise CliError(f"--gqa {g}: heads = max(1, {args.heads_dim_total} // {hd}) = {heads} is not a multiple of it")
    for hd, dt, ca, p, g in itertools.product(args.head_dim, args.dtype, causal_list(args.causal), passes(args),
                                              args.gqa):
        if not restricted_space(args, hd, dt, ca, p, g):
            raise CliError(f"the restricted {p} space of family {pass_family(args, p, hd)} is empty for d{hd} {dt} "
                           f"{'causal' if ca else 'full'} gqa {g}: loosen --block-m/--block-n/--num-warps/--num-stages/"
                           + "/".join(f"--{k.replace('_', '-')}" for k in C.SM90_KNOBS))


def compile_only(args: argparse.Namespace) -> int:
    from flashgen.compile import CompileError, target_for
    from flashgen.store import current_gpu
    from flashgen.worker import CompileAhead, compile_reason

    from flashgen.compile import nvcc_version

    nvcc_version()  # no nvcc: one clear error now rather than one per configuration
    gpu_arch = args.gpu_arch or (current_gpu() or (None, args.arch))[1]
    check_family(args.arch, f"an {gpu_arch} GPU", gpu_arch)
    target = target_for(gpu_arch, args.arch)  # the backward's family (sm80) compiles for the same GPU
    cfgs = list(dict.fromkeys(c for p, hd, dt, ca, g in itertools.product(passes(args), args.head_dim, args.dtype,
                                                                          causal_list(args.causal), args.gqa)
                              for c in restricted_space(args, hd, dt, ca, p, g)))
    print(f"compiling {len(cfgs)} configurations of family {args.arch} for {target} ({gpu_arch} limits)")
    pool = CompileAhead(args.jobs, args.compile_timeout)
    try:
        for c in cfgs:
            if c.unfit_reason(gpu_arch) is None:  # a config the GPU cannot run is not worth nvcc's minutes
                pool.submit(c, target_for(gpu_arch, c.family))
        rows, passing = [], 0
        for c in cfgs:
            reason = c.unfit_reason(gpu_arch)
            try:
                if reason is not None:
                    res = ["-", c.smem_bytes, "-"]
                else:
                    r = pool.get(c, target_for(gpu_arch, c.family)).resources
                    res = [r.registers, r.smem_bytes, f"{r.spill_stores}/{r.spill_loads}"]
            except CompileError as e:
                res, reason = ["-", c.smem_bytes, "-"], "compile failed: " + compile_reason(e, 1)
            passing += reason is None
            rows.append([c.name, *res, "yes" if reason is None else f"no: {reason}"])
            print(table([rows[-1]], ["config", "regs", "smem B", "spill st/ld", "passes"]).splitlines()[-1]
                  if len(rows) > 1 else table(rows, ["config", "regs", "smem B", "spill st/ld", "passes"]), flush=True)
    finally:
        pool.close()
    print(f"{passing} of {len(cfgs)} configurations pass the constraints of {gpu_arch}")
    return 0


def open_storage(storage: str | None, heartbeat_s: int | None = None, grace_s: int | None = None):
    """The study storage, or one clear line on why it cannot be opened (server down, no driver, bad URL)."""
    from flashgen.studies import describe, make_storage, redact_text, resolve

    try:
        return make_storage(storage, heartbeat_s, grace_s)
    except ImportError as e:
        raise CliError(f"cannot open {describe(resolve(storage))}: {redact_text(str(e), resolve(storage))} "
                       "(pip install -e '.[fleet]' brings the PostgreSQL driver)") from None
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's and the journal's errors, as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CliError(f"cannot open {describe(resolve(storage))}: {type(e).__name__}: "
                       f"{redact_text(first, resolve(storage))}") from None


def make_tuners(args: argparse.Namespace) -> list:
    """One tuner per GPU of --gpus (the current GPU without it), or simulated ones with --simulate."""
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.backend import SimulatedBackend
    from flashgen.compile import nvcc_version
    from flashgen.fleet import Tuner, worker_names
    from flashgen.worker import CompileAhead, GpuBackend, NoGpuError, gpu_devices

    if args.simulate:
        gpu_arch = args.gpu_arch or "sm90"
        return [Tuner(name, SimulatedBackend(delay_s=args.simulate_delay, log=args.simulate_log),
                      "Simulated GPU", gpu_arch, {"nvcc": "simulated", "driver": "simulated"})
                for name in worker_names(args.gpus or [0])]
    try:
        if args.gpus is None:  # the current GPU, as without a fleet
            backends = [GpuBackend(args.jobs, args.deadline, compile_timeout_s=args.compile_timeout)]
            devices: list = [os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0]
        else:
            devices = [d["index"] for d in gpu_devices()] if args.gpus == "all" else args.gpus
            if not devices:
                raise NoGpuError("the driver lists no GPU")
            compiler = CompileAhead(args.jobs, args.compile_timeout)  # the host's cores, shared by every GPU
            with ThreadPoolExecutor(len(devices)) as pool:  # each worker imports torch: start them together
                started = [pool.submit(GpuBackend, args.jobs, args.deadline, compile_timeout_s=args.compile_timeout,
                                       device=d, compiler=compiler) for d in devices]
            failed = [f.exception() for f in started if f.exception() is not None]
            if failed:
                for f in started:
                    if f.exception() is None:
                        f.result().close()
                compiler.close()
                raise failed[0]
            backends = [f.result() for f in started]
    except NoGpuError as e:
        raise CliError(f"no GPU to time kernels on ({e}). Without a GPU, use --compile-only to render and "
                       "compile the space and see each configuration's resources.") from None
    nvcc = nvcc_version()
    return [Tuner(name, b, b.gpu_name, b.gpu_arch, {"nvcc": nvcc, "driver": b.driver_version})
            for name, b in zip(worker_names(devices), backends)]


STORE_HEAD = ["problem", "best kernel", "ms", "TFLOP/s", "default ms", "speedup", "trials/pruned/failed", "store"]


def tune(args: argparse.Namespace) -> int:
    import threading

    import optuna
    from tqdm import tqdm

    from flashgen.fleet import Job, run
    from flashgen.search import SearchOptions, exhaustive_for, viable_count
    from flashgen.store import merge, store_path
    from flashgen.tunable import entry_of, space_of

    if args.collect:  # every kind's studies
        return collect(args)
    serving = {"decode": decode_problems, "varlen": varlen_problems}.get(args.kind)
    if serving is not None:
        serving(args, "-", args.gpu_arch or "sm90")  # the arguments checked before a GPU is sought
    if args.compile_only:
        return {"decode": tune_decode, "varlen": tune_varlen}.get(args.kind, compile_only)(args)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    open_storage(args.storage, args.heartbeat, args.grace)
    tuners = make_tuners(args)
    rows: dict[tuple[str, str], list] = {}
    lock = threading.Lock()
    bars: dict = {}
    try:
        for t in tuners if serving is None else ():  # a serving kind takes the family its calls take
            check_family(args.arch, t.gpu_name, t.gpu_arch)
        ahead = 1 if args.simulate else max(2, (args.jobs or 8) // len(tuners))
        # --exhaustive / --no-exhaustive decide; else --trials asks for a sampled search; else per problem
        # (search.exhaustive_for): every configuration when at most EXHAUSTIVE_MAX fit, else DEFAULT_TRIALS sampled
        exhaustive = args.exhaustive if args.exhaustive is not None else (False if args.trials is not None else None)
        opts = SearchOptions(args.trials or DEFAULT_TRIALS, args.timeout, args.sampler, args.seed, exhaustive,
                             args.storage, ahead=ahead, heartbeat_s=args.heartbeat, grace_s=args.grace,
                             retime_top=args.retime)
        models = list(dict.fromkeys((t.gpu_name, t.gpu_arch) for t in tuners))
        stores: dict = {}
        if serving is not None:  # decode / varlen: each problem's whole space (--max-configs: its first N)
            jobs = [Job(prob, tuple(space_of(prob)[:args.max_configs or None]))
                    for gpu, arch in models for prob in serving(args, gpu, arch)]
        else:
            jobs = [Job(prob, around_store(args, prob, restricted_space(args, hd, dt, ca, p, g), stores))
                    for gpu, arch in models
                    for p, hd, dt, ca, sl, g in itertools.product(passes(args), args.head_dim, args.dtype,
                                                                  causal_list(args.causal), args.seqlen, args.gqa)
                    for prob in [TuneProblem(gpu, arch, pass_family(args, p, hd), dt, hd, ca, sl, g,
                                             args.batch_tokens, args.heads_dim_total, p)]]
        empty = [j.problem.key for j in jobs if not j.space]
        if empty:  # only --around-store can empty a problem's space here (validate checked the rest)
            raise CliError(f"--around-store {','.join(args.around_store)}: no configuration of the restricted space "
                           f"matches the stored one of {', '.join(empty)} in the other fields; loosen the restrictions")
        modes = {j: exhaustive_for(j.problem, opts, list(j.space)) for j in jobs}
        for j in jobs:
            n = viable_count(j.problem, list(j.space))
            how = (f"exhaustive: all {n} fitting configurations" if modes[j] else
                   f"{opts.sampler}: {opts.trials} trials of {n} fitting configurations")
            print(f"{j.problem.study_name}: {how}", flush=True)
        per_job = lambda j: viable_count(j.problem, list(j.space)) if modes[j] else opts.trials  # noqa: E731
        single = len(tuners) == 1
        state = {"pruned": 0, "failed": 0, "best": 0.0}
        if not single:
            print(f"{len(tuners)} tuners: " + ", ".join(f"{t.name} ({t.gpu_name})" for t in tuners), flush=True)
            bars[None] = tqdm(total=sum(map(per_job, jobs)), desc=f"{len(jobs)} problems", unit="trial")

        def on_start(tuner, job) -> None:
            if single and job not in bars:  # one bar per problem, as it starts
                bars[job] = tqdm(total=per_job(job), desc=job.problem.key, unit="trial", leave=True)
                state.update(pruned=0, failed=0, best=0.0)

        def on_trial(tuner, job, rec) -> None:
            with lock:
                bar = bars[job if single else None]
                if rec.result.status == "pruned":
                    state["pruned"] += 1
                elif rec.duplicate_of is None:
                    bar.update(1)
                    if rec.result.ok:
                        state["best"] = max(state["best"], rec.result.tflops)
                    else:
                        state["failed"] += 1
                        who = "" if single else f"[{tuner.name}] {job.problem.key} "
                        tqdm.write(f"  {who}trial {rec.number} {rec.config.name}: {rec.result.status}: "
                                   f"{rec.result.reason.splitlines()[0] if rec.result.reason else ''}")
                bar.set_postfix(pruned=state["pruned"], failed=state["failed"], best_tflops=f"{state['best']:.1f}")

        def on_done(job, out) -> None:
            p = job.problem
            entry = entry_of(out, out.versions or next(t.versions for t in tuners
                                                          if (t.gpu_name, t.gpu_arch) == (p.gpu_name, p.gpu_arch)))
            with lock:
                if single:
                    bars.pop(job).close()
                action = merge(store_path(p.gpu_name, p.gpu_arch, args.tuned_dir), p.gpu_name, p.gpu_arch,
                               {p.key: entry}, args.force)[p.key] if entry else "nothing verified"
                rows.setdefault((p.gpu_name, p.gpu_arch), []).append(store_row(p.key, out, action))

        run(tuners, jobs, opts, on_trial, on_done, on_start)
    finally:
        for bar in bars.values():
            bar.close()
        for t in tuners:
            t.backend.close()
        if not args.simulate and tuners and args.gpus is not None:
            tuners[0].backend.compiler.close()  # the shared pool
    head = [h.replace("TFLOP/s", "TB/s") for h in STORE_HEAD] if args.kind == "decode" else STORE_HEAD
    for (gpu, arch), model_rows in rows.items():
        print(f"\n{gpu} ({arch}) -> {store_path(gpu, arch, args.tuned_dir)}")
        print(table(model_rows, head))
    return 0


def store_row(key: str, out, action: str) -> list:
    """A row of tune's table for a search outcome."""
    d = out.default
    speed = f"{d.ms / out.best.ms:.2f}x" if out.best and d and d.ok else "-"
    failed = sum(v for k, v in out.counts.items() if k not in ("ok", "pruned"))
    return [key, out.best_config.name if out.best_config else "-", f"{out.best.ms:.4f}" if out.best else "-",
            f"{out.best.tflops:.1f}" if out.best else "-", f"{d.ms:.4f}" if d and d.ok else (d.status if d else "-"),
            speed, f"{out.trials}/{out.counts['pruned']}/{failed}", action]


def compile_all(cfgs: list, arch: str, args: argparse.Namespace, what: str) -> int:
    """--compile-only of a serving kind: every configuration compiled for `arch` on --jobs processes, one progress
    bar, for a GPU run to load from FLASHGEN_CACHE_DIR."""
    from tqdm import tqdm

    from flashgen.compile import target_for
    from flashgen.worker import CompileAhead

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
    from flashgen import tune_decode as td

    points = [tuple(int(x) for x in p.lower().split("x")) for p in args.points] if args.points else list(td.DECODE_POINTS)
    if any(len(p) != 2 or min(p) < 1 for p in points):
        raise CliError(f"--points {','.join(args.points)}: expected BATCHxCACHE_LEN, e.g. 32x8192")
    pages = args.pages if args.pages is not None else list(td.PAGE_SIZES)
    if any(p < 0 or p % 16 for p in pages):
        raise CliError(f"--pages {','.join(map(str, pages))}: 0 (contiguous) or multiples of 16")
    if len(args.heads) != 2 or args.heads[0] % args.heads[1]:
        raise CliError("--heads: query heads, KV heads (a multiple of them), e.g. 32,8")
    return td.problems(args.head_dim, args.dtype, args.heads[0], args.heads[1], points, pages, gpu_name, gpu_arch)


def tune_decode(args: argparse.Namespace) -> int:
    """tune --kind decode --compile-only: the whole space, for a GPU run to load from FLASHGEN_CACHE_DIR."""
    from flashgen import tune_decode as td

    arch = args.gpu_arch or "sm90"
    n = max(p.cache_len for p in decode_problems(args, "-", arch))
    return compile_all([c for hd, dt in itertools.product(args.head_dim, args.dtype) for pg in (False, True)
                        for c, _ in td.space(hd, dt, arch, pg, n)], arch, args, "decode")


def varlen_problems(args: argparse.Namespace, gpu_name: str, gpu_arch: str) -> list:
    """tune --kind varlen's problems on one GPU model: each (head dim, dtype, mask, point of
    tune_varlen.VARLEN_POINTS)."""
    from flashgen import tune_varlen as tv

    try:
        points = [tv.parse_point(p) for p in args.points] if args.points else list(tv.VARLEN_POINTS)
    except ValueError as e:
        raise CliError(f"--points: {e}") from None
    if any(dt == "fp8_e4m3" for dt in args.dtype):
        raise CliError("tune --kind varlen: varlen and window are built for bf16 and fp16")
    return tv.problems(args.head_dim, args.dtype, causal_list(args.causal), args.heads_dim_total, points, gpu_name,
                       gpu_arch)


def tune_varlen(args: argparse.Namespace) -> int:
    """tune --kind varlen --compile-only: the spaces of the problems, for a GPU run to load from FLASHGEN_CACHE_DIR."""
    from flashgen import tune_varlen as tv

    arch = args.gpu_arch or "sm90"
    return compile_all([c for p in varlen_problems(args, "-", arch) for c in tv.space(p)], arch, args,
                       "varlen / window")


def collect(args: argparse.Namespace) -> int:
    """tune --collect: the winners of every study in the storage, merged into the tuned store per GPU model."""
    from flashgen import fleet
    from flashgen.store import merge, store_path
    from flashgen.studies import describe, resolve

    open_storage(args.storage)
    found = fleet.collect(args.storage)
    if not found:
        print(f"no verified results in {describe(resolve(args.storage))}")
        return 0
    try:
        backend, here = fleet.collect_backend(args.simulate)
    except fleet.NoVerifier as e:
        raise CliError(str(e)) from None
    try:
        found, refused = fleet.verify_winners(found, backend, here)
    finally:
        backend.close()
    for key, why in refused:
        print(f"not stored: {key}: {why}", file=sys.stderr)
    for (gpu, arch), entries in sorted(found.items()):
        path = store_path(gpu, arch, args.tuned_dir)
        actions = merge(path, gpu, arch, entries, args.force)
        rows = [[key, *entry_row(e)[:-1], e.get("trials", "?"), actions[key]] for key, e in sorted(entries.items())]
        print(f"{gpu} ({arch}) <- {describe(resolve(args.storage))} -> {path}")
        print(table(rows, ["problem", "kernel", "ms", "TFLOP/s", "default ms", "speedup", "trials", "store"]) + "\n")
    return 1 if refused else 0


def entry_row(e: dict) -> list:
    """kernel, ms, TFLOP/s, default ms, speedup, date of a store entry."""
    d = e.get("default") or {}
    speed = f"{d['median_ms'] / e['median_ms']:.2f}x" if d.get("median_ms") else "-"
    if e.get("num_splits"):  # a decode entry: its split count, and K/V read rate rather than TFLOP/s
        return [f"{e.get('kernel', '?')} x{e['num_splits']}", f"{e['median_ms']:.4f}", f"{e.get('tb_s') or 0:.2f} TB/s",
                f"{d['median_ms']:.4f}" if d.get("median_ms") else "-", speed, e.get("date", "?")]
    return [e.get("kernel", "?"), f"{e['median_ms']:.4f}", f"{e.get('tflops') or 0:.1f}",
            f"{d['median_ms']:.4f}" if d.get("median_ms") else "-", speed, e.get("date", "?")]


def show_doc(doc: dict, where: str) -> None:
    rows = []
    for key, e in sorted(doc["entries"].items()):
        kernel, ms, tf, dms, speed, date = entry_row(e)
        rows.append([key, kernel, ms, tf, dms, speed, e.get("trials", "?"), date])
    print(f"{doc['gpu'].get('name')} ({doc['gpu'].get('arch')}): {where}")
    print(table(rows, ["problem", "kernel", "ms", "TFLOP/s", "default ms", "speedup", "trials", "date"]) + "\n")


def show(args: argparse.Namespace) -> int:
    from flashgen.paths import tuned_dir
    from flashgen.store import read_store

    if args.from_storage:
        from flashgen import fleet
        from flashgen.problem import gpu_slug
        from flashgen.studies import describe, resolve

        where = describe(resolve(args.from_storage))
        open_storage(args.from_storage)
        shown = 0
        for (gpu, arch), entries in sorted(fleet.collect(args.from_storage).items()):
            if args.gpu and args.gpu not in (gpu, gpu_slug(gpu, arch)):
                continue
            shown += 1
            show_doc({"gpu": {"name": gpu, "arch": arch}, "entries": entries}, f"{where} (not in the store; "
                     "write it with tune --collect)")
        if not shown:
            print(f"no verified results{' for ' + args.gpu if args.gpu else ''} in {where}")
        return 0
    root = args.tuned_dir or tuned_dir()
    files = sorted(Path(root).glob("*.json"))
    shown = 0
    for path in files:
        doc = read_store(path)
        if args.gpu and args.gpu not in (path.stem, doc["gpu"].get("name")):
            continue
        shown += 1
        show_doc(doc, str(path))
    if not shown:
        print(f"no tuned results{' for ' + args.gpu if args.gpu else ''} in {root}; run: python cli.py tune --arch sm80")
    return 0


def dashboard(args: argparse.Namespace) -> int:
    try:
        import optuna_dashboard
    except ImportError:
        raise CliError("the dashboard needs optuna-dashboard: pip install -e '.[fleet]'") from None
    from flashgen import fleet
    from flashgen.studies import describe, resolve

    storage = open_storage(args.storage)
    exposed = fleet.dashboard_exposure(args.host)
    if exposed:
        print(exposed, file=sys.stderr, flush=True)
    print(f"optuna-dashboard for {describe(resolve(args.storage))} on http://{args.host}:{args.port}/ "
          "(Ctrl-C stops it)", flush=True)
    optuna_dashboard.run_server(storage, host=args.host, port=args.port)
    return 0


def serving_configs(args: argparse.Namespace) -> list[C.KernelConfig]:
    """export --features: the serving kernel of each feature set x head dim x dtype x mask, chosen by
    flashgen.kernels.serving.serve_config for --rows rows on --gpu-arch (what the runtime would launch)."""
    from flashgen.kernels.serving import serve_config

    if args.arch != "sm80":
        raise CliError(f"--arch {args.arch}: serving kernels are family sm80 (they run on Hopper too: --gpu-arch sm90)")
    if args.gpu or args.tuned_dir:
        raise CliError("--features exports serving kernels, which are not tuned: drop --gpu and --tuned-dir")
    _check("head-dim", args.head_dim, C.HEAD_DIMS)
    _check("dtype", args.dtype, C.DTYPES)
    _check("gpu-arch", [args.gpu_arch], tuple(C.ARCHS))
    if args.rows is not None and args.rows < 1:
        raise CliError(f"--rows must be at least 1; got {args.rows}")
    cfgs = []
    for feats in args.features:
        _check("features", feats, C.FEATURES)
        rows = args.rows if args.rows is not None else (1 if {"paged", "pack_gqa"} & set(feats) else 1024)
        for d, dtype, causal in itertools.product(args.head_dim, args.dtype, causal_list(args.causal)):
            try:
                cfg = serve_config(d, dtype, causal, rows, args.gpu_arch, **{f: True for f in feats})
            except ValueError as e:  # a feature rule (ConfigError) or no tile that fits
                raise CliError(f"--features {','.join(feats)}: {e}") from None
            cfgs.append(cfg)
    return cfgs


def export(args: argparse.Namespace) -> int:
    from flashgen.export import export as do_export
    from flashgen.export import export_configs

    if args.features:
        cfgs = serving_configs(args)
        files = export_configs(cfgs, args.out, args.gpu_arch)
        kernels = sum(1 for f in files if f.suffix == ".cu")
        print(f"wrote {kernels} serving kernels ({len(files)} files) to {args.out}")
        return 0
    _check("arch", [args.arch], C.FAMILIES)
    files = do_export(args.arch, args.out, args.tuned_dir, args.gpu)
    kernels = sum(1 for f in files if f.suffix == ".cu")
    print(f"wrote {kernels} kernels ({len(files)} files) to {args.out}")
    if not kernels:
        print("nothing tuned for this family yet: run python cli.py tune first")
    return 0


def check(args: argparse.Namespace) -> int:
    from flashgen.compile import compile_kernel, target_for
    from flashgen.worker import NoGpuError, Worker

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


def _bench_torch(hint: str) -> Any:
    """torch, where it can run on a CUDA GPU; else the CliError saying what is missing."""
    try:
        import torch
    except ImportError:
        raise CliError(f"bench needs torch with CUDA on a GPU machine{hint}") from None
    if not torch.cuda.is_available():
        raise CliError("bench needs a CUDA GPU; none is visible")
    return torch


def bench_serving(args: argparse.Namespace) -> int:
    """`bench --kind decode|varlen|window|train|serving`: each serving path beside its same-run reference."""
    import datetime
    import json

    from flashgen import __version__
    from flashgen import bench_serving as bs

    torch = _bench_torch("")
    gpu = torch.cuda.get_device_name()
    kinds = ("decode", "varlen", "window", "train") if args.kind == "serving" else (args.kind,)
    dtype = args.dtype[0]
    result: dict = {"gpu": gpu, "date": str(datetime.date.today()), "flashgen": __version__, "torch": torch.__version__,
                    "dtype": dtype}
    if "decode" in kinds:
        result["decode"] = bs.decode_rows(128, dtype)
        print(f"{gpu}, {datetime.date.today()}: decode, heads 32/8, d128, {dtype}, seqlen_q 1. kernel: device time "
              "(CUDA events, L2 flushed and the GPU kept busy ahead); b2b: attention_with_kvcache back to back (validate=False); "
              "validated: with the default checks (one host sync per call)")
        print(bs.decode_table(result["decode"]))
    if "varlen" in kinds:
        result["varlen"] = bs.varlen_rows(128, dtype)
    if "window" in kinds:
        result["window"] = bs.window_rows(128, dtype)
    if "train" in kinds:
        result["train"] = bs.train_rows(128, dtype)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{gpu.lower().replace(' ', '-')}-{datetime.date.today()}-{args.kind}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plotted = any(k in result for k in ("decode", "varlen", "window"))
        if plotted:
            bs.plot_serving(result, stem.with_suffix(".png"))
        print(f"wrote {stem}.json" + (f", {stem}.png" if plotted else ""))
    return 0


def bench(args: argparse.Namespace) -> int:
    import datetime

    if args.kind != "dense":
        return bench_serving(args)

    from flashgen import __version__
    from flashgen.compare import (PEERS, SimulatedRunner, TorchRunner, grid, host_line, host_problem, matmul_ceiling,
                                  run_grid, write)
    from flashgen.compare import table as bench_table

    _check("peers", args.peers, PEERS)
    points = grid(args.dtype, args.head_dim, causal_list(args.causal), args.seqlen, args.batch_tokens,
                  args.heads_dim_total, passes(args))
    ceiling: dict[str, float] = {}
    if args.simulate:
        runner, gpu = SimulatedRunner(), "simulated"
    else:
        torch = _bench_torch(" (or --simulate for a dry run)")
        gpu = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        check_family(args.arch, gpu, f"sm{major}{minor}")
        runner = TorchRunner(arch=args.arch, reps=args.reps, rounds=args.rounds)
        ceiling = {dt: matmul_ceiling(dt) for dt in args.dtype}
    rows = run_grid(points, runner, args.peers)
    first = points[0]
    host = runner.host_us(first.dtype, first.head_dim, first.causal)
    if any(p.pass_ == "bwd" for p in points):
        print("backward (bwd) rows: flashgen = its backward kernels alone (tuned for this GPU, else the default), api = "
              "torch.autograd.grad through flashgen.attention, <peer> = SDPA's backward the same way; "
              "TFLOP/s count 2.5x the forward's FLOPs")
    print(f"{gpu}, {datetime.date.today()}, family {args.arch}: TFLOP/s (4*B*H*N*N*D, halved for causal) and flashgen's ratio")
    print("flashgen: the kernel alone (L2 flushed and the GPU kept busy ahead of each call, as FA4's figures are taken); api: flashgen.attention() back to back, "
          "host cost included; x <peer>: the kernel's ratio; <peer> b2b: SDPA back to back, api x <peer>: "
          "what a user gets, both called back to back")
    if ceiling:
        print("matmul ceiling (8192^3, this run): " + ", ".join(f"{dt} {t:.0f} TFLOP/s" for dt, t in ceiling.items()))
    print(bench_table(rows, args.peers, ceiling))
    print(host_line(host, first.dtype, first.head_dim))
    if args.out:
        meta = {"flashgen": __version__, "family": args.arch, "simulated": bool(args.simulate),
                "host_us_per_call": host, "host_problem": host_problem(first)}
        if not args.simulate:
            meta["torch"] = torch.__version__
        paths = write(rows, args.peers, args.out, gpu, meta, ceiling=ceiling, family=args.arch)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    from flashgen.compile import CompileError
    from flashgen.driver import CudaError
    from flashgen.store import StoreError

    args = build_parser().parse_args(argv)
    try:
        if args.cmd in ("tune", "check", "bench"):
            validate(args)
        return {"tune": tune, "show": show, "export": export, "check": check, "bench": bench,
                "dashboard": dashboard}[args.cmd](args)
    except (CliError, StoreError, C.ConfigError, CompileError, CudaError) as e:
        print(f"cli.py {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.cmd == "dashboard":
            return 0
        print("interrupted; rerun the same command to continue the studies", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
