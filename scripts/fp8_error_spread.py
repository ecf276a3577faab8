"""The spread of FP8 kernels' RMS error against plain FP8's over many random inputs of one shape.

    python scripts/fp8_error_spread.py --shape 2,1,1023,6,2 --causal --seeds 40 KERNEL_NAME ...

The verify bar (RMS no worse than plain FP8's) is a statistical comparison; on small problems (one query
row) a kernel close to plain FP8 may miss it on some inputs. Prints, per kernel, the ratio kernel RMS /
plain FP8 RMS over the seeds: median, mean, max, and how many seeds miss the bar; kernels named together
see the same inputs, so a change (a knob on / off) reads as the difference of two rows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.compile import compile_kernel, target_for  # noqa: E402
from flashgen.kernels.dense import run  # noqa: E402
from flashgen.tensors import torch_dtype  # noqa: E402
from flashgen.verify import poisoned_outputs, random_fp8, reference_fp8  # noqa: E402

from time_configs import parse  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="FP8 kernel names (or store:KEY)")
    ap.add_argument("--shape", default="2,1,1023,6,2", help="batch,seqlen_q,seqlen_k,heads,heads_k")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--per-head", action="store_true", help="descale factors per (batch, KV head)")
    args = ap.parse_args()
    import torch
    b, sq, sk, h, hk = (int(x) for x in args.shape.split(","))
    kernels = [compile_kernel(c, target_for("sm90", "sm90")) for c in map(parse, args.names)]
    if len({k.config.head_dim for k in kernels}) != 1 or not all(k.config.fp8 for k in kernels):
        raise SystemExit("name FP8 kernels of one head dim")
    ratios: dict[str, list[float]] = {k.name: [] for k in kernels}
    for seed in range(args.seeds):
        q, k8, v, descale = random_fp8(b, sq, sk, h, hk, kernels[0].config.head_dim, seed=seed, per_head=args.per_head)
        refs = {}
        for kern in kernels:
            c = kern.config.causal
            if c not in refs:
                refs[c] = reference_fp8(q, k8, v, descale, c)
            ref = refs[c]
            out, lse = poisoned_outputs(q, torch_dtype(kern.config.output_dtype))
            run(kern, q, k8, v, None, out=out, lse=lse, descale=descale)
            torch.cuda.synchronize()
            rms = (out.double() - ref.out).pow(2).mean().sqrt().item()
            ratios[kern.name].append(rms / ref.rms_bound)
    print(f"shape b,sq,sk,h,hk = {args.shape}, {args.seeds} seeds: kernel RMS / plain FP8 RMS")
    print(f"{'kernel':78} {'median':>7} {'mean':>7} {'max':>7} {'missed':>6}")
    for name, rs in ratios.items():
        print(f"{name:78} {statistics.median(rs):7.3f} {statistics.fmean(rs):7.3f} {max(rs):7.3f} "
              f"{sum(x > 1 for x in rs):6d}")


if __name__ == "__main__":
    main()
