"""Time the forward of FlexAttention's example modifiers on Hopper: flashgen's sm90 modifier kernel in each schedule
(kernels.serving.SM90_MODIFIER_SCHEDULES forced one at a time, and the rule's choice), the sm80 family's, compiled
torch flex_attention with its block mask, and flashgen's built-in kernel where the same attention has one.

    python scripts/time_sm90_modifiers.py --seqlen 4096,16384 --head-dim 128

batch = 16384 // seqlen, 16 heads (as `flashgen bench --kind flex`); CUDA-event medians of whole calls (host
included) after warm-up, forward only. Prints one line per case, schedule and seqlen in ms, and the ratios the speed
targets name: flex_attention / flashgen (>= 1.4 wanted) and flashgen / built-in (a modifier that changes nothing
within 3%, causal / window / ALiBi / softcap within 10%).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen.kernels import serving  # noqa: E402

HEADS = 16
SCHEDULES = {"in_order": serving.SM90_IN_ORDER, "overlap": serving.SM90_OVERLAP,
             "persistent": serving.SM90_OVERLAP + (("persistent", True),)}


def forced(schedule: tuple) -> dict:
    """SM90_MODIFIER_SCHEDULES with one schedule: 128 keys where that builds clean, else 64 (d256: 64)."""
    return {d: tuple((bn, schedule) for bn in ((128, 64) if d < 256 else (64,))) for d in (32, 64, 96, 128, 256)}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(n: int, device: str) -> dict[str, tuple[Callable | None, Callable | None, dict]]:
    """name -> (score_mod, mask_mod, the built-in call's keyword arguments or None)."""
    slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=device) / HEADS)
    doc = torch.arange(n, device=device) // (n // 8)

    def noop(score, b, h, q_idx, kv_idx):
        return score

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= n // 4)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < n // 4) | (q_idx >= kv_idx)

    return {"noop": (noop, None, {}), "causal": (None, causal, {"causal": True}),
            "window": (None, window, {"causal": True, "window_size": (n // 4, 0)}),
            "alibi": (alibi, None, {"alibi_slopes": slopes}), "softcap": (softcap, None, {"softcap": 30.0}),
            "document": (None, document, None), "prefix_lm": (None, prefix_lm, None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", default="4096,16384")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = ap.parse_args()
    fa = __import__("torch.nn.attention.flex_attention", fromlist=["flex_attention"])
    flex = torch.compile(fa.flex_attention)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    default_schedules = serving.SM90_MODIFIER_SCHEDULES
    with torch.no_grad():
        for n in (int(x) for x in args.seqlen.split(",")):
            batch, d = max(1, 16384 // n), args.head_dim
            q, k, v = (torch.randn(batch, n, HEADS, d, device="cuda", dtype=dtype) for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for name, (score, mask, builtin) in cases(n, "cuda").items():
                if args.cases and name not in args.cases.split(","):
                    continue
                bm = fa.create_block_mask(mask, None, None, n, n, device="cuda") if mask is not None else None
                theirs = median_ms(lambda: flex(qt, kt, vt, score_mod=score, block_mask=bm), args.reps)
                plain = (median_ms(lambda: flashgen.attention(q, k, v, **builtin), args.reps)
                         if builtin is not None else float("nan"))
                rows = {"sm80": None, "sm90": None, **{f"sm90_{s}": s for s in SCHEDULES}}
                for label, sched in rows.items():
                    serving.SM90_MODIFIER_SCHEDULES = (forced(SCHEDULES[sched]) if sched in SCHEDULES
                                                       else default_schedules)
                    arch = "sm80" if label == "sm80" else "sm90"
                    ms = median_ms(lambda: flashgen.attention(q, k, v, score_mod=score, mask_mod=mask, arch=arch),
                                   args.reps)
                    print(f"n={n:6d} {name:10s} {label:14s} {ms:8.3f} ms  flex/ours {theirs / ms:5.2f}  "
                          f"ours/built-in {ms / plain:5.2f}", flush=True)
                serving.SM90_MODIFIER_SCHEDULES = default_schedules


if __name__ == "__main__":
    main()
