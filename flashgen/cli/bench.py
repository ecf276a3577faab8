"""`flashgen bench`: tuned kernels timed against PyTorch SDPA's backends (dense grid) or each serving path
beside its same-run reference; a table, and JSON/CSV/PNG with --out."""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from flashgen import __version__
from flashgen import bench_serving as bs
from flashgen import bench_flex, bench_step
from flashgen.compare import (PEERS, SimulatedRunner, TorchRunner, grid, host_line, host_problem, matmul_ceiling,
                              run_grid, write)
from flashgen.compare import table as bench_table
from flashgen.problem import BATCH_TOKENS, HEADS_DIM_TOTAL

from .common import (add_problem_args, causal_list, check_choices, check_family, cuda_torch, int_list, passes,
                     str_list, validate_grid, validate_problem)


def add_parser(sub: Any) -> None:
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
    b.add_argument("--kind", choices=("dense", "decode", "varlen", "window", "train", "serving", "step", "flex"), default="dense",
                   help="dense: the grid above; decode: KV-cache decoding (contiguous and paged) against a copy of "
                        "the same bytes and SDPA; varlen: a packed causal batch against the dense kernels; window: a "
                        "causal sliding window at N=16384; train: the backward of those two against the dense backward; "
                        "serving: the last four; step: a training step (forward + backward) of a transformers Llama "
                        "layer stack (GQA 32/8, d128, 4k tokens) on flashgen against SDPA's flash and cuDNN backends; "
                        "flex: FlexAttention's examples (masks and score modifiers) on flashgen against compiled "
                        "flex_attention, d128, 16 heads, per --seqlen (default dense)")
    b.add_argument("--cases", type=str_list, default=list(bench_flex.CASES),
                   help=f"--kind flex: these of FlexAttention's examples (default all: {','.join(bench_flex.CASES)})")
    b.add_argument("--peers", type=str_list, default=["flash", "cudnn"],
                   help="SDPA backends to compare with: flash,cudnn,efficient (default flash,cudnn)")
    b.add_argument("--out", type=Path, default=None, help="write <gpu>-<date>.json/.csv/.png here")
    b.add_argument("--reps", type=int, default=50, help="timed repetitions per kernel (default 50)")
    b.add_argument("--rounds", type=int, default=3,
                   help="forward kernels alone (flashgen and each peer) are timed in this many interleaved rounds of "
                        "--reps each, the median over all (default 3)")
    b.add_argument("--simulate", action="store_true",
                   help="testing only: time with flashgen.compare.SimulatedRunner (fake numbers)")
    b.set_defaults(run=run)


def bench_serving(args: argparse.Namespace) -> int:
    """`bench --kind decode|varlen|window|train|serving`: each serving path beside its same-run reference."""
    torch = cuda_torch("bench")
    gpu = torch.cuda.get_device_name()
    kinds = ("decode", "varlen", "window", "train") if args.kind == "serving" else (args.kind,)
    dtype = args.dtype[0]
    result: dict = {"gpu": gpu, "date": str(datetime.date.today()), "flashgen": __version__, "torch": torch.__version__,
                    "dtype": dtype}
    if "decode" in kinds:
        result["decode"] = bs.decode_rows(128, dtype)
        print(f"{gpu}, {datetime.date.today()}: decode, heads 32/8, d128, {dtype}, seqlen_q 1. kernel: device time "
              "(CUDA events, L2 flushed and the GPU kept busy ahead); b2b: attention_with_kvcache back to back (validate=False); "
              "validated: validate=True, the opt-in host checks (one host sync per call); the default call checks its "
              "inputs in the kernel")
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


def bench_train_step(args: argparse.Namespace) -> int:
    """`bench --kind step`: a Llama training step on flashgen and on SDPA's backends, same run."""
    torch = cuda_torch("bench")
    gpu = torch.cuda.get_device_name()
    dtype = args.dtype[0]
    shape = {"layers": 4, "tokens": 4096, "batch": 1}
    rows = bench_step.step_rows(shape["layers"], shape["tokens"], shape["batch"], dtype)
    result = {"gpu": gpu, "date": str(datetime.date.today()), "flashgen": __version__, "torch": torch.__version__,
              "dtype": dtype, "shape": shape, "step": rows}
    print(f"{gpu}, {datetime.date.today()}: transformers Llama training step (forward + backward, back to back, host "
          f"included), {shape['layers']} layers, GQA 32/8, d128, {shape['batch']} x {shape['tokens']} tokens, {dtype}")
    print(bench_step.step_table(rows))
    if args.out:
        write_result(args.out, gpu, "step", result, bench_step.plot_step)
    return 0


def write_result(out: Path, gpu: str, kind: str, result: dict, plot: Any) -> None:
    """<out>/<gpu>-<date>-<kind>.json and its plot (.png, drawn by `plot`)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{gpu.lower().replace(' ', '-')}-{datetime.date.today()}-{kind}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, {stem}.png")


def bench_flex_cases(args: argparse.Namespace) -> int:
    """`bench --kind flex`: FlexAttention's examples (--cases) on flashgen and on compiled flex_attention, same run."""
    check_choices("cases", args.cases, bench_flex.CASES)
    torch = cuda_torch("bench")
    gpu = torch.cuda.get_device_name()
    dtype = args.dtype[0]
    rows = [r for n in args.seqlen for r in bench_flex.flex_rows(n, 128, 16, args.batch_tokens, dtype,
                                                                  names=tuple(args.cases))]
    result = {"gpu": gpu, "date": str(datetime.date.today()), "flashgen": __version__, "torch": torch.__version__,
              "dtype": dtype, "head_dim": 128, "heads": 16, "flex": rows}
    print(f"{gpu}, {datetime.date.today()}: FlexAttention's examples, d128, 16 heads, batch x N = {args.batch_tokens}, "
          f"{dtype}; TFLOP/s forward / backward (2.5x) over the pairs each mask keeps, per call back to back (host "
          "included); sm80: the modifier forward with arch=\"sm80\"; x flex, x built-in: flashgen's ratios; max diff: "
          "flashgen's output against flex_attention's")
    print(bench_flex.flex_table(rows))
    if args.out:
        write_result(args.out, gpu, "flex", result, bench_flex.plot_flex)
    return 0


def run(args: argparse.Namespace) -> int:
    validate_problem(args, dense=args.kind == "dense")
    validate_grid(args, ("reps", "rounds"))
    if args.kind == "step":
        return bench_train_step(args)
    if args.kind == "flex":
        return bench_flex_cases(args)
    if args.kind != "dense":
        return bench_serving(args)
    check_choices("peers", args.peers, PEERS)
    points = grid(args.dtype, args.head_dim, causal_list(args.causal), args.seqlen, args.batch_tokens,
                  args.heads_dim_total, passes(args))
    ceiling: dict[str, float] = {}
    if args.simulate:
        runner, gpu = SimulatedRunner(), "simulated"
    else:
        torch = cuda_torch("bench", " (or --simulate for a dry run)")
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

