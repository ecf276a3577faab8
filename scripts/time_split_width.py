"""Time the split-width forward (q, k 192 wide, v 128: DeepSeek-V3's MLA prefill) against d128 and d192, the
kernel alone, in TFLOP/s per useful FLOP.

    python scripts/time_split_width.py [--seqlen 4096,16384] [--dtype bf16] [--heads 16]
        [--variant block_n=96,o_tma=1 ...]

batch = 16384 // seqlen, 16 heads, causal and not; CUDA-event medians after warm-up, inputs rotated past L2 (as
`flashgen bench`). d128 and d192 run the kernels flashgen.attention takes on this GPU (tuned, else the default);
(192, 128) its split-width default, and each --variant (the default with these fields changed). Useful FLOPs are
2 * batch * heads * seqlen^2 * (d_qk + d_v), halved for causal: d128's 4 * ... * 128, and for (192, 128) what the
padded d192 kernel did before at 2 * ... * (192 + 192) counts only 192 + 128. Each kernel is verified against
float64 first. Prints one line per kernel and point, with its ratio to d128's TFLOP/s; the target is a ratio of at
least 0.9 for (192, 128).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.bench import time_kernel  # noqa: E402
from flashgen.compile import compile_kernel, target_for  # noqa: E402
from flashgen.config import KernelConfig, default_config  # noqa: E402
from flashgen.resolve import choose_config, gpu  # noqa: E402
from flashgen.verify import verify  # noqa: E402

TOKENS = 16384  # batch * seqlen


def useful_flops(batch: int, heads: int, seqlen: int, d_qk: int, d_v: int, causal: bool) -> float:
    f = 2.0 * batch * heads * seqlen * seqlen * (d_qk + d_v)
    return f / 2 if causal else f


def with_fields(cfg: KernelConfig, spec: str) -> KernelConfig:
    """`cfg` with FIELD=VALUE,... changed (ints; 0/1, true/false for the knobs)."""
    conv = {"true": True, "false": False, "yes": True, "no": False}
    changes = {}
    for item in filter(None, spec.split(",")):
        field, _, value = item.partition("=")
        old = getattr(cfg, field)
        changes[field] = bool(int(value)) if isinstance(old, bool) and value.isdigit() else (
            conv[value.lower()] if value.lower() in conv else int(value))
    return dataclasses.replace(cfg, **changes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", default="4096,16384")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variant", action="append", default=[], metavar="FIELD=V,...",
                    help="also time the (192, 128) default with these fields changed")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    name, arch = gpu(torch.cuda.current_device())
    if arch != "sm90":
        raise SystemExit(f"the split-width kernels are family sm90's: {name} is {arch}")
    h = args.heads
    print(f"{name}, {args.dtype}, {h} heads, batch * seqlen = {TOKENS}; TFLOP/s per useful FLOP "
          "(2 b h N^2 (d_qk + d_v), halved for causal)")
    print(f"{'seqlen':>6} {'mask':>6}  {'d_qk,d_v':>9}  {'ms':>8} {'TFLOP/s':>8} {'vs d128':>8}  kernel")
    for n in (int(s) for s in args.seqlen.split(",")):
        b = max(1, TOKENS // n)
        for causal in (False, True):
            split = default_config(192, args.dtype, causal, arch, "sm90", head_dim_v=128)
            rows = [((128, 128), choose_config(128, args.dtype, causal, arch, n, "sm90", gpu=(name, arch))),
                    ((192, 192), choose_config(192, args.dtype, causal, arch, n, "sm90", gpu=(name, arch))),
                    ((192, 128), split)] + [((192, 128), with_fields(split, v)) for v in args.variant]
            base = None
            for (d_qk, d_v), cfg in rows:
                kern = compile_kernel(cfg, target_for(arch, cfg.family))
                res = verify(kern, 1, 1023, 1023, 4, 4, seed=n)
                if not res.ok:
                    print(f"{n:>6} {'causal' if causal else 'full':>6}  {d_qk:>4},{d_v:<4}  verify failed: {res.reason}"
                          f"  {cfg.name}")
                    continue
                ms = time_kernel(kern, b, n, n, h, warmup=args.warmup, reps=args.reps)
                tf = useful_flops(b, h, n, d_qk, d_v, causal) / ms / 1e9
                base = tf if (d_qk, d_v) == (128, 128) else base
                ratio = f"{tf / base:8.3f}" if base else f"{'-':>8}"
                print(f"{n:>6} {'causal' if causal else 'full':>6}  {d_qk:>4},{d_v:<4}  {ms:8.3f} {tf:8.1f} {ratio}  "
                      f"{cfg.name}")
                if (d_qk, d_v) == (192, 192):  # the padded path of a (192, 128) call: this kernel, fewer useful FLOPs
                    tf = useful_flops(b, h, n, 192, 128, causal) / ms / 1e9
                    ratio = f"{tf / base:8.3f}" if base else f"{'-':>8}"
                    print(f"{n:>6} {'causal' if causal else 'full':>6}  {'192,128':>9}  {ms:8.3f} {tf:8.1f} {ratio}  "
                          "(padded to d192, as before)")


if __name__ == "__main__":
    main()
