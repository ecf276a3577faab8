"""`flashgen tune`: search the tile space per problem on this GPU and store the fastest verified kernel; also
`--compile-only` (no GPU: the space compiled, with each configuration's resources), `--collect` (a fleet's
winners into the store) and the serving kinds (flashgen.cli.tune_serving)."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flashgen import compile as kernel_compile  # as modules: tests stand in for nvcc_version and the GPU worker
from flashgen import config as C
from flashgen import worker
from flashgen.backend import SimulatedBackend
from flashgen.halving import ETA, RUNG0_REPS
from flashgen.compile import CompileError, target_for
from flashgen.problem import (BATCH_TOKENS, DEFAULT_TRIALS, EXHAUSTIVE_MAX, HEADS_DIM_TOTAL, SEQLEN_BUCKETS,
                              TuneProblem)
from flashgen.store import config_from_entry, current_gpu, merge, read_store, store_path
from flashgen.tunable import entry_of, space_of
from flashgen.tune_modifier import modifier_space, remember

from flashgen import fleet
from flashgen.fleet import Job, Tuner, worker_names
from flashgen.fleet import run as run_fleet
from flashgen.search import SearchOptions, exhaustive_for, viable_count
from flashgen.studies import describe, resolve
from . import tune_serving
from .common import (STORAGE_HELP, CliError, add_problem_args, causal_list, check_choices, check_family, duration,
                     gpu_list, int_list, load_modifier, open_storage, passes, str_list, table, validate_grid,
                     validate_problem)
from .show import entry_row


def add_parser(sub: Any) -> None:
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
    t.add_argument("--search", choices=("auto", "halving"), default="auto",
                   help="auto: exhaustive or sampled as --exhaustive and --trials say (default); halving: every "
                        "fitting configuration timed briefly (--halving-reps calls), the fastest 1/eta timed again "
                        "with eta times the calls, and so on until --retime remain, which are re-timed side by side "
                        "(about n*eta/(eta-1) short measurements for n configurations; one GPU)")
    t.add_argument("--halving-eta", type=int, default=ETA, metavar="ETA",
                   help=f"--search halving: each rung keeps the fastest 1/ETA (default {ETA})")
    t.add_argument("--halving-reps", type=int, default=RUNG0_REPS, metavar="N",
                   help=f"--search halving: timed calls of a first-rung measurement, ETA times more each rung "
                        f"(default {RUNG0_REPS}; a normal trial times 50)")
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
                       help=f"sm90: restrict {knob} to on (any nonzero choice) or off (default: both)")
    t.add_argument("--around-store", type=str_list, default=None, metavar="FIELD,...",
                   help="each problem's space is its stored configuration with only these fields free (e.g. "
                        "lazy_rescale after a new knob, or dq_tma with --pass bwd: a re-tune of the stored tile, not "
                        "of the whole space); "
                        "problems without a stored entry keep the whole space")
    t.add_argument("--score-mod", default=None, metavar="FILE.py:FUNC",
                   help="tune the forward (or --pass bwd the backward) with this score_mod(score, b, h, q_idx, "
                        "kv_idx) compiled in (--arch sm90 "
                        "on Hopper, as flashgen.attention runs it there; sm80 elsewhere); the store keys end in its "
                        "digest, so that attention(..., score_mod=FUNC) finds the entry. FILE.py runs again in the "
                        "GPU worker for the tensors FUNC reads: size them for the tuned --seqlen")
    t.add_argument("--mask-mod", default=None, metavar="FILE.py:FUNC",
                   help="likewise a mask_mod(b, h, q_idx, kv_idx) (true: keep), tuned with its block map")
    t.add_argument("--max-configs", type=int, default=None, help="keep only the first N configurations of the space")
    t.add_argument("--jobs", type=int, default=None, help="compile processes (default: all cores)")
    t.add_argument("--deadline", type=duration, default=120.0, help="a trial hanging longer is killed (default 120s)")
    t.add_argument("--compile-timeout", type=duration, default=600.0,
                   help="a compile (nvcc, ptxas) taking longer is killed and fails its trial (default 10m)")
    t.add_argument("--simulate", action="store_true",
                   help="testing only: time with flashgen.backend.SimulatedBackend's cost model (fake numbers)")
    t.add_argument("--simulate-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: seconds per trial
    t.add_argument("--simulate-log", default=None, help=argparse.SUPPRESS)  # tests: a log of every evaluation

    t.set_defaults(run=run)


def pass_family(args: argparse.Namespace, pass_: str, head_dim: int) -> str:
    """The template family a pass is tuned in: --arch for the forward; for the backward --arch where that
    family has a backward for the head dim (sm90: C.SM90_BWD_HEAD_DIMS; with modifiers, where one consumer
    warpgroup holds each key's rows: C.sm90_bwd_kv_split 1), else sm80."""
    modified = bool(getattr(args, "modifiers", None))
    if pass_ == "fwd" or (args.arch == "sm90" and head_dim in C.SM90_BWD_HEAD_DIMS
                          and not (modified and C.sm90_bwd_kv_split(head_dim) > 1)):
        return args.arch
    return "sm80"


def restricted_space(args: argparse.Namespace, head_dim: int, dtype: str, causal: bool,
                     pass_: str = "fwd", gqa_group: int = 1) -> list:
    family = pass_family(args, pass_, head_dim)
    if getattr(args, "modifiers", None):
        cfgs = modifier_space(family, head_dim, dtype, causal, gqa_group, **args.modifiers, pass_=pass_)
    elif pass_ == "bwd":
        cfgs = C.bwd_space(head_dim, dtype, causal, family=family)
    else:
        cfgs = C.space(args.arch, head_dim, dtype, causal, gqa_group)
    for field in ("block_m", "block_n", "num_warps") + ("num_stages",) * (pass_ == "fwd" or family == "sm90"):
        keep = getattr(args, field)
        if keep is not None:
            cfgs = [c for c in cfgs if getattr(c, field) in keep]
    for knob in C.SM90_KNOBS if pass_ == "fwd" else ():
        if getattr(args, knob) is not None:
            cfgs = [c for c in cfgs if bool(getattr(c, knob)) == (getattr(args, knob) == "yes")]  # exp2_fma: any share
    return cfgs[: args.max_configs] if args.max_configs else cfgs


def around_store(args: argparse.Namespace, problem: Any, space: list, stores: dict) -> tuple:
    """--around-store: the configurations of `space` equal to the problem's stored one but in the free fields.
    `stores` keeps each GPU's store entries, read once for all problems."""
    if not args.around_store:
        return tuple(space)
    path = store_path(problem.gpu_name, problem.gpu_arch, args.tuned_dir)
    if path not in stores:
        stores[path] = read_store(path)["entries"]
    entry = stores[path].get(problem.key)
    if entry is None and problem.gqa_group > 1:  # a GQA problem: around the same shape's MHA entry
        entry = stores[path].get(dataclasses.replace(problem, gqa_group=1).key)
    if entry is None:
        return tuple(space)
    return tuple(C.around(config_from_entry(entry), space, args.around_store))


def tune_modifiers(args: argparse.Namespace) -> dict[str, str]:
    """The digests of --score-mod and --mask-mod (traced here, so that the compile pool and the GPU worker can be
    given them; a modifier that reads tensors also names its file, which the worker runs to have them); {} without
    them. Only dense problems take them (forward and backward), in the family the call runs (--arch sm90 on Hopper,
    sm80 elsewhere)."""
    if not (args.score_mod or args.mask_mod):
        return {}
    given = " and ".join(o for o, v in (("--score-mod", args.score_mod), ("--mask-mod", args.mask_mod)) if v)
    if args.kind != "dense":
        raise CliError(f"{given}: --kind {args.kind} takes no modifier (they tune dense forward problems)")
    here = None if args.simulate or args.compile_only else current_gpu()
    if here is not None and here[1] == "sm90" and args.arch != "sm90":
        print(f"flashgen tune: {given} with --arch {args.arch} on {here[0]}: attention() there runs family sm90's "
              "modifier kernels, and takes these entries only with arch=\"sm80\"; --arch sm90 tunes what it runs",
              file=sys.stderr, flush=True)
    out = {"score_mod": "", "mask_mod": ""}
    for kind, spec in (("score", args.score_mod), ("mask", args.mask_mod)):
        if spec:
            mod = load_modifier(spec, kind)
            remember(mod, spec)
            out[f"{kind}_mod"] = mod.digest
    return out


def validate(args: argparse.Namespace) -> None:
    """tune's arguments, each wrong one a CliError naming it."""
    validate_problem(args, dense=args.kind == "dense" and not (args.score_mod or args.mask_mod))
    args.modifiers = tune_modifiers(args)
    validate_grid(args, ("trials", "heartbeat", "grace"))
    if args.retime < 0:
        raise CliError("--retime must be 0 (off) or more")
    if args.around_store:
        args.around_store = [f.replace("-", "_") for f in args.around_store]
        fields = {f.name for cls in (C.KernelConfig, C.BwdConfig) for f in dataclasses.fields(cls)}
        check_choices("around-store", args.around_store, tuple(sorted(fields)))
    if args.grace <= args.heartbeat:
        raise CliError(f"--grace {args.grace} must be longer than --heartbeat {args.heartbeat}")
    if args.simulate and args.gpus == "all":
        raise CliError("--gpus all needs real GPUs; with --simulate give indices, e.g. --gpus 0,1")
    if args.trials is not None and args.exhaustive:
        raise CliError("--trials and --exhaustive conflict: an exhaustive search evaluates every configuration")
    if args.search == "halving":
        if args.trials is not None or args.exhaustive is not None:
            given = "--trials" if args.trials is not None else "--exhaustive" if args.exhaustive else "--no-exhaustive"
            raise CliError(f"--search halving and {given} conflict: halving times every fitting configuration "
                           "(--max-configs or the space options restrict them)")
        if args.halving_eta < 2:
            raise CliError(f"--halving-eta {args.halving_eta}: each rung must keep at most half (2 or more)")
        if args.halving_reps < 1:
            raise CliError("--halving-reps must be at least 1")
        if args.gpus == "all" or (args.gpus is not None and len(args.gpus) > 1):
            raise CliError("--search halving runs on one GPU: give --gpus one index, or leave it out")
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
                check_choices(field.replace("_", "-"), getattr(args, field), allowed)
    if args.gpu_arch is not None:
        check_choices("gpu-arch", [args.gpu_arch], tuple(C.ARCHS))
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
    """--compile-only: the restricted space compiled for --gpu-arch, a row of resources (or why not) each."""
    kernel_compile.nvcc_version()  # no nvcc: one clear error now rather than one per configuration
    gpu_arch = args.gpu_arch or (current_gpu() or (None, args.arch))[1]
    check_family(args.arch, f"an {gpu_arch} GPU", gpu_arch)
    target = target_for(gpu_arch, args.arch)  # the backward's family (sm80) compiles for the same GPU
    cfgs = list(dict.fromkeys(c for p, hd, dt, ca, g in itertools.product(passes(args), args.head_dim, args.dtype,
                                                                          causal_list(args.causal), args.gqa)
                              for c in restricted_space(args, hd, dt, ca, p, g)))
    print(f"compiling {len(cfgs)} configurations of family {args.arch} for {target} ({gpu_arch} limits)")
    pool = worker.CompileAhead(args.jobs, args.compile_timeout)
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
                res, reason = ["-", c.smem_bytes, "-"], "compile failed: " + worker.compile_reason(e, 1)
            passing += reason is None
            rows.append([c.name, *res, "yes" if reason is None else f"no: {reason}"])
            print(table([rows[-1]], ["config", "regs", "smem B", "spill st/ld", "passes"]).splitlines()[-1]
                  if len(rows) > 1 else table(rows, ["config", "regs", "smem B", "spill st/ld", "passes"]), flush=True)
    finally:
        pool.close()
    print(f"{passing} of {len(cfgs)} configurations pass the constraints of {gpu_arch}")
    return 0


def make_tuners(args: argparse.Namespace) -> list:
    """One tuner per GPU of --gpus (the current GPU without it), or simulated ones with --simulate."""

    if args.simulate:
        gpu_arch = args.gpu_arch or "sm90"
        return [Tuner(name, SimulatedBackend(delay_s=args.simulate_delay, log=args.simulate_log),
                      "Simulated GPU", gpu_arch, {"nvcc": "simulated", "driver": "simulated"})
                for name in worker_names(args.gpus or [0])]
    try:
        if args.gpus is None:  # the current GPU, as without a fleet
            backends = [worker.GpuBackend(args.jobs, args.deadline, compile_timeout_s=args.compile_timeout)]
            devices: list = [os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0]
        else:
            devices = [d["index"] for d in worker.gpu_devices()] if args.gpus == "all" else args.gpus
            if not devices:
                raise worker.NoGpuError("the driver lists no GPU")
            compiler = worker.CompileAhead(args.jobs, args.compile_timeout)  # the host's cores, shared by every GPU
            with ThreadPoolExecutor(len(devices)) as pool:  # each worker imports torch: start them together
                started = [pool.submit(worker.GpuBackend, args.jobs, args.deadline,
                                       compile_timeout_s=args.compile_timeout, device=d, compiler=compiler)
                           for d in devices]
            failed = [f.exception() for f in started if f.exception() is not None]
            if failed:
                for f in started:
                    if f.exception() is None:
                        f.result().close()
                compiler.close()
                raise failed[0]
            backends = [f.result() for f in started]
    except worker.NoGpuError as e:
        raise CliError(f"no GPU to time kernels on ({e}): tuning needs an NVIDIA GPU, with torch built for CUDA and "
                       "pycuda (pip install -e '.[gpu]'). Without a GPU, use --compile-only to render and compile the "
                       "space and see each configuration's resources.") from None
    nvcc = kernel_compile.nvcc_version()
    return [Tuner(name, b, b.gpu_name, b.gpu_arch, {"nvcc": nvcc, "driver": b.driver_version})
            for name, b in zip(worker_names(devices), backends)]


STORE_HEAD = ["problem", "best kernel", "ms", "TFLOP/s", "default ms", "speedup", "trials/pruned/failed", "store"]


def run(args: argparse.Namespace) -> int:
    validate(args)
    if args.collect:  # every kind's studies
        return collect(args)
    serving = tune_serving.PROBLEMS.get(args.kind)
    if serving is not None:
        serving(args, "-", args.gpu_arch or "sm90")  # the arguments checked before a GPU is sought
    if args.compile_only:
        return tune_serving.COMPILE.get(args.kind, compile_only)(args)
    return tune(args)


def tune(args: argparse.Namespace) -> int:
    """The search on --gpus (or --simulate), each problem's winner merged into the store: dense problems, or a
    serving kind's (decode, varlen) through the same pipeline."""
    import optuna  # heavy: imported when a search runs, not for --help
    from tqdm import tqdm


    optuna.logging.set_verbosity(optuna.logging.WARNING)
    open_storage(args.storage, args.heartbeat, args.grace)
    tuners = make_tuners(args)
    rows: dict[tuple[str, str], list] = {}
    lock = threading.Lock()
    bars: dict = {}
    try:
        serving = tune_serving.PROBLEMS.get(args.kind)
        for t in tuners if serving is None else ():  # a serving kind takes the family its calls take
            check_family(args.arch, t.gpu_name, t.gpu_arch)
        ahead = 1 if args.simulate else max(2, (args.jobs or 8) // len(tuners))
        # --exhaustive / --no-exhaustive decide; else --trials asks for a sampled search; else per problem
        # (search.exhaustive_for): every configuration when at most EXHAUSTIVE_MAX fit, else DEFAULT_TRIALS sampled
        exhaustive = args.exhaustive if args.exhaustive is not None else (False if args.trials is not None else None)
        opts = SearchOptions(args.trials or DEFAULT_TRIALS, args.timeout, args.sampler, args.seed, exhaustive,
                             args.storage, ahead=ahead, heartbeat_s=args.heartbeat, grace_s=args.grace,
                             retime_top=args.retime, halving_eta=args.halving_eta if args.search == "halving" else 0,
                             halving_reps=args.halving_reps)
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
                                             args.batch_tokens, args.heads_dim_total, p,
                                             **getattr(args, "modifiers", {}))]]
        empty = [j.problem.key for j in jobs if not j.space]
        if empty:  # only --around-store can empty a problem's space here (validate checked the rest)
            raise CliError(f"--around-store {','.join(args.around_store)}: no configuration of the restricted space "
                           f"matches the stored one of {', '.join(empty)} in the other fields; loosen the restrictions")
        modes = {j: exhaustive_for(j.problem, opts, list(j.space)) for j in jobs}
        for j in jobs:
            n = viable_count(j.problem, list(j.space))
            how = (f"exhaustive: all {n} fitting configurations" if modes[j] else
                   f"{opts.sampler}: {opts.trials} trials of {n} fitting configurations")
            if opts.halving is not None:
                sizes = opts.halving.sizes(n)
                how = (f"halving (eta {opts.halving.eta}): all {n} fitting configurations at {opts.halving.reps0} "
                       f"timed calls, rungs of {'/'.join(map(str, sizes))}, {sum(sizes)} measurements at most")
            print(f"{j.problem.study_name}: {how}", flush=True)
        per_job = lambda j: viable_count(j.problem, list(j.space)) if modes[j] else opts.trials  # noqa: E731
        single = len(tuners) == 1
        state = {"pruned": 0, "failed": 0, "best": 0.0}
        if not single:
            print(f"{len(tuners)} tuners: " + ", ".join(f"{t.name} ({t.gpu_name})" for t in tuners), flush=True)
            bars[None] = tqdm(total=sum(map(per_job, jobs)), desc=f"{len(jobs)} problems", unit="trial")

        rungs: dict = {}  # a halving search's job -> the rung its bar shows

        def on_start(tuner, job) -> None:
            if single and job not in bars and opts.halving is None:  # one bar per problem, as it starts
                bars[job] = tqdm(total=per_job(job), desc=job.problem.key, unit="trial", leave=True)
                state.update(pruned=0, failed=0, best=0.0)

        def on_trial(tuner, job, rec) -> None:
            with lock:
                if rec.rung is not None:  # a halving search: one bar per rung
                    if rungs.get(job) != rec.rung:
                        if job in bars:
                            bars.pop(job).close()
                        reps = opts.halving.reps(rec.rung) if opts.halving else "?"
                        bars[job] = tqdm(total=rec.rung_size, desc=f"{job.problem.key} rung {rec.rung} ({reps} calls)",
                                         unit="config", leave=True)
                        rungs[job] = rec.rung
                        state.update(pruned=0, failed=0, best=0.0)
                    bars[job].n = rec.rung_done - 1
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
                if single and job in bars:  # a halving search resumed when complete opened none
                    bars.pop(job).close()
                action = merge(store_path(p.gpu_name, p.gpu_arch, args.tuned_dir), p.gpu_name, p.gpu_arch,
                               {p.key: entry}, args.force)[p.key] if entry else "nothing verified"
                rows.setdefault((p.gpu_name, p.gpu_arch), []).append(store_row(p.key, out, action))

        run_fleet(tuners, jobs, opts, on_trial, on_done, on_start)
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


def store_row(key: str, out: Any, action: str) -> list:
    """A row of tune's table for a search outcome."""
    d = out.default
    speed = f"{d.ms / out.best.ms:.2f}x" if out.best and d and d.ok else "-"
    failed = sum(v for k, v in out.counts.items() if k not in ("ok", "pruned"))
    return [key, out.best_config.name if out.best_config else "-", f"{out.best.ms:.4f}" if out.best else "-",
            f"{out.best.tflops:.1f}" if out.best else "-", f"{d.ms:.4f}" if d and d.ok else (d.status if d else "-"),
            speed, f"{out.trials}/{out.counts['pruned']}/{failed}", action]


def collect(args: argparse.Namespace) -> int:
    """tune --collect: the winners of every study in the storage, merged into the tuned store per GPU model."""

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


