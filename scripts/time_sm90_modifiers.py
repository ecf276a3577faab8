"""Time the sm90 family's modifier kernels schedule by schedule on `bench --kind flex`'s cases (FlexAttention's
examples, d128 by default, 16 heads, batch x N = 16384): the forward at each block_n in order, overlapped
(FlashAttention-3's schedule), each persistent or not, and in order with the warpgroups taking turns (ping-pong), and
the backward at each of SM90_MODIFIER_BWD_SCHEDULES, each forced one at a time beside the rule's own choice.

    python scripts/time_sm90_modifiers.py [--seqlen 4096,16384] [--cases document,alibi] [--flex] [--forward-only]
    FLASHGEN_CACHE_DIR=.kcache python scripts/time_sm90_modifiers.py --compile   # no GPU: build them all first

Prints one line per N, case and pass: TFLOP/s over the pairs the mask keeps (forward 4 d per pair, backward 2.5x),
the public call back to back (host included, as the bench times it), and where an output differs from
the rule's choice's by more than a bf16 rounding, that difference. A backward schedule that does not build clean
falls back to the sm80 family's kernel, and its label says so. --flex adds compiled flex_attention's forward and
flashgen's built-in kernel where the case has one.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen import bench_flex, resolve  # noqa: E402
from flashgen.compare import back_to_back_ms  # noqa: E402
from flashgen.kernels import serving  # noqa: E402

HEADS = 16
OVERLAP, IN_ORDER = serving.SM90_OVERLAP, serving.SM90_IN_ORDER
PERSISTENT = (("persistent", True),)
KNOBS = {"in_order": IN_ORDER, "overlap": OVERLAP, "in_order_persistent": IN_ORDER + PERSISTENT,
         "overlap_persistent": OVERLAP + PERSISTENT, "in_order_pingpong": IN_ORDER + (("pingpong", True),)}


def forward_schedules(head_dim: int) -> dict[str, tuple]:
    """label -> (block_n, knobs): each block_n SM90_MODIFIER_SCHEDULES lists for the head dim, each schedule."""
    block_ns = dict.fromkeys(bn for bn, _ in serving.SM90_MODIFIER_SCHEDULES[head_dim])
    return {f"bn{bn}_{name}": (bn, knobs) for bn in block_ns for name, knobs in KNOBS.items()}


def backward_schedules(head_dim: int) -> dict[str, tuple]:
    """label -> one entry of SM90_MODIFIER_BWD_SCHEDULES[head_dim] (block_m, block_n, warps, stages, stagger)."""
    return {f"bwd_{bm}x{bn}_w{w}_s{s}{'_st' if st else ''}": (bm, bn, w, s, st)
            for bm, bn, w, s, st in serving.SM90_MODIFIER_BWD_SCHEDULES.get(head_dim, ())}


class Forced:
    """The rule's schedule tables with one schedule in place of the head dim's list (forward, backward or both),
    restored on exit; the choice caches and `flashgen.attention`'s routes (a repeated call's kept plan) are emptied
    either way, so that each call inside takes the forced schedule."""

    def __init__(self, head_dim: int, fwd: tuple | None = None, bwd: tuple | None = None) -> None:
        self.head_dim, self.fwd, self.bwd = head_dim, fwd, bwd

    def __enter__(self) -> "Forced":
        self.saved = serving.SM90_MODIFIER_SCHEDULES, serving.SM90_MODIFIER_BWD_SCHEDULES
        if self.fwd is not None:  # twice: the last entry is taken unchecked, so a spilling schedule runs too
            serving.SM90_MODIFIER_SCHEDULES = {**self.saved[0], self.head_dim: (self.fwd, self.fwd)}
        if self.bwd is not None:
            serving.SM90_MODIFIER_BWD_SCHEDULES = {**self.saved[1], self.head_dim: (self.bwd,)}
        serving._sm90_modifier_config.cache_clear()
        flashgen.reload()
        return self

    def __exit__(self, *exc: Any) -> None:
        serving.SM90_MODIFIER_SCHEDULES, serving.SM90_MODIFIER_BWD_SCHEDULES = self.saved
        serving._sm90_modifier_config.cache_clear()
        flashgen.reload()


def kernel_configs(head_dim: int, dtype: str, names: tuple[str, ...], seqlens: tuple[int, ...] = (4096,),
                   backward: bool = True) -> set:
    """Every kernel the timing loads, for sm90 (forward and, with `backward`, backward per schedule), without a GPU
    (per sequence length: a captured table's shape is part of the kernel)."""
    out = set()
    for case in (c for n in seqlens for c in bench_flex.cases(n, max(1, 16384 // n), HEADS, "cpu", names=names)):
        mods = bench_flex.case_mods(case)
        if mods is None:  # the plain kernel runs
            continue
        digests = (*serving.modifier_digests(mods).values(), mods.mask_mod is not None)
        for fwd in forward_schedules(head_dim).values():
            with Forced(head_dim, fwd=fwd):
                out.add(serving.sm90_modifier_config(head_dim, dtype, False, mods))
        out.add(serving.sm90_modifier_config(head_dim, dtype, False, mods))
        if not backward:
            continue
        for bwd in backward_schedules(head_dim).values():
            with Forced(head_dim, bwd=bwd):
                out.add(serving.sm90_modifier_bwd_config(head_dim, dtype, False, (), False, *digests))
        out.add(resolve.modifier_bwd_config(head_dim, dtype, False, "sm90", False, (), score_mod=digests[0],
                                            mask_mod=digests[1], block_map=digests[2]))  # where none builds clean
    return {c for c in out if c is not None}


def compile_all(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    from flashgen.compile import CompileError, compile_kernel, target_for  # noqa: PLC0415

    seqlens = tuple(int(x) for x in args.seqlen.split(","))
    cfgs = sorted(kernel_configs(args.head_dim, args.dtype, names, seqlens, not args.forward_only),
                  key=lambda c: c.name)

    def one(cfg: Any) -> str | None:
        try:
            compile_kernel(cfg, target_for("sm90", cfg.family))
        except CompileError as e:
            return f"{cfg.name}: {str(e).splitlines()[0]}"
        return None

    with ThreadPoolExecutor(args.jobs) as pool:
        failed = [f for f in pool.map(one, cfgs) if f]
    print(f"{len(cfgs) - len(failed)} kernels compiled")
    for f in failed:
        print("FAILED", f)


def call_ms(fn: Callable[[], object], reps: int) -> float:
    """Milliseconds per call of `fn` back to back, host included, as bench --kind flex times its calls: the median of
    7 loops of `reps` calls after 5 (H200: loops of 10 calls, 3 of them, scattered by up to 10% between identical
    configurations; 40 x 7 came within 1-4% of the kernels timed alone)."""
    return back_to_back_ms(lambda i: fn(), calls=reps, loops=7, warmup=5)


def time_all(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    import torch  # noqa: PLC0415

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    d = args.head_dim
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415
        flex = torch.compile(flex_attention, dynamic=False)
    for n in (int(x) for x in args.seqlen.split(",")):
        batch = max(1, 16384 // n)
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, n, HEADS, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for case in bench_flex.cases(n, batch, HEADS, q.device, names=names):
            mods = bench_flex.case_mods(case)
            if mods is None:
                continue
            digests = (*serving.modifier_digests(mods).values(), mods.mask_mod is not None)
            flops = 4 * d * bench_flex.kept_pairs(case, batch, n, q.device) * HEADS

            def call() -> Any:  # arch="sm90": the modifier kernel even where a band mask would take the built-in
                return flashgen.attention(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod, arch="sm90")

            with torch.no_grad():
                ref = call().float()
                line = [f"rule {flops / call_ms(call, args.reps) / 1e9:4.0f}"]
                if flex is not None:
                    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
                    bm = (create_block_mask(case.mask_mod, batch, None, n, n, device=q.device)
                          if case.mask_mod is not None else None)
                    ms = call_ms(lambda: flex(qt, kt, vt, score_mod=case.score_mod, block_mask=bm), args.reps)
                    line.append(f"flex {flops / ms / 1e9:4.0f}")
                    if case.builtin is not None:
                        ms = call_ms(lambda: flashgen.attention(q, k, v, **case.builtin), args.reps)
                        line.append(f"built-in {flops / ms / 1e9:4.0f}")
                for label, fwd in forward_schedules(d).items():
                    with Forced(d, fwd=fwd):
                        diff = float((call().float() - ref).abs().max())
                        ms = call_ms(call, args.reps)
                    line.append(f"{label} {flops / ms / 1e9:4.0f}" + ("" if diff < 0.05 else f" (differs {diff:.2g})"))
            print(f"N={n:5d} {case.name:13s} forward TFLOP/s: " + " | ".join(line), flush=True)
            if args.forward_only:
                continue
            held = call()
            want = torch.autograd.grad(held, (q, k, v), dout, retain_graph=True)
            line = []
            for label, bwd in backward_schedules(d).items():
                with Forced(d, bwd=bwd):
                    built = serving.sm90_modifier_bwd_config(d, args.dtype, False, (), False, *digests)
                    got = torch.autograd.grad(held, (q, k, v), dout, retain_graph=True)
                    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
                    ms = call_ms(lambda: torch.autograd.grad(held, (q, k, v), dout, retain_graph=True), args.reps)
                line.append(f"{label}{'' if built else ' (sm80)'} {2.5 * flops / ms / 1e9:4.0f}"
                            + ("" if diff < 0.1 else f" (differs {diff:.2g})"))
            print(f"N={n:5d} {case.name:13s} backward TFLOP/s: " + " | ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", default="4096,16384")
    ap.add_argument("--head-dim", type=int, default=128, choices=sorted(serving.SM90_MODIFIER_SCHEDULES))
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--reps", type=int, default=40, help="calls per timed loop (default 40)")
    ap.add_argument("--cases", default=None, help="comma-separated case names of bench --kind flex (default: all)")
    ap.add_argument("--flex", action="store_true", help="also compiled flex_attention and the built-in kernel")
    ap.add_argument("--forward-only", action="store_true", help="time (or --compile) the forward schedules only")
    ap.add_argument("--compile", action="store_true", help="build every kernel into FLASHGEN_CACHE_DIR, no GPU")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    names = tuple(args.cases.split(",")) if args.cases else bench_flex.CASES
    unknown = set(names) - set(bench_flex.CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; bench --kind flex has {', '.join(bench_flex.CASES)}")
    if args.compile:
        compile_all(args, names)
        return
    time_all(args, names)


if __name__ == "__main__":
    main()
