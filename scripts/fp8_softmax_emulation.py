"""Emulate, on the CPU, how the FP8 kernel quantizes P, to study variants without a GPU.

    python scripts/fp8_softmax_emulation.py --head-dim 128 --shape 2,256,1023,4 --seeds 4 --causal

The sm90 FP8 forward's online softmax, tile by tile (last key tile first, as the kernel): P = 2^(s·log2e·scale −
m + offset) quantized to e4m3 against the running max m, O += P·V exactly (the tensor cores' products are
exact), l += P, O / l at the end. Variants: the offset (the kernel's P_OFFSET, 8), lazy rescaling with a slack (m
kept while no row of a 16-row warp grows by more than it), l from the quantized P. Prints each variant's RMS error
against float64 attention of the dequantized inputs, as a ratio to plain FP8's (flashgen.fp8.emulate_dequantized:
the verify bar is ratio <= 1). Measured with it (docs/fp8.md): only integer offsets keep the ratio
(the max element then quantizes against a power of two); a slack moves it off, as a fractional offset does.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from flashgen.fp8 import emulate_dequantized  # noqa: E402

E4M3 = torch.float8_e4m3fn
VARIANTS = {"kernel (offset 8)": {}, "offset 7.6": {"offset": 7.6}, "offset 6": {"offset": 6.0},
            "lazy, slack 0.8": {"slack": 0.8}, "lazy, slack 0.2": {"slack": 0.2}, "lazy, no slack": {"slack": 0.0},
            "l of quantized P": {"l_of_quantized": True}}


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x through per-tensor e4m3 quantization and back (flashgen.fp8.quantize's scale)."""
    s = 448.0 / x.abs().amax()
    return (x * s).to(E4M3).float() / s


def causal_mask(sq: int, sk: int) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)  # bottom-right aligned


def kernel_emulation(q, k, v, causal: bool, block_n: int = 64, offset: float = 8.0, slack: float | None = None,
                     warp_rows: int = 16, l_of_quantized: bool = False) -> torch.Tensor:
    b, sq, h, d = q.shape
    sk = k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()).float() * (math.log2(math.e) / math.sqrt(d))
    if causal:
        s = s.masked_fill(causal_mask(sq, sk), -math.inf)
    m = torch.full((b, h, sq), -math.inf)
    l, o, vt = torch.zeros(b, h, sq), torch.zeros(b, h, sq, d), v.permute(0, 2, 1, 3).float()
    for j in range(-(-sk // block_n) - 1, -1, -1):
        st = s[..., j * block_n:(j + 1) * block_n]
        m_new = torch.maximum(m, st.amax(-1))
        if slack is not None:  # keep the max when every row of the warp stays within the slack
            keep = torch.isfinite(m) & (st.amax(-1) <= m + slack)
            if sq % warp_rows == 0:
                keep = keep.reshape(b, h, -1, warp_rows).all(-1, keepdim=True).expand(-1, -1, -1, warp_rows).reshape(b, h, sq)
            m_new = torch.where(keep, m, m_new)
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        corr = torch.exp2(m - m_use)
        p = torch.exp2(st - m_use[..., None] + offset)
        p8 = p.to(E4M3).float()
        l = l * corr + (p8 if l_of_quantized else p).sum(-1)
        o = o * corr[..., None] + torch.einsum("bhqk,bhkd->bhqd", p8, vt[:, :, j * block_n:(j + 1) * block_n])
        m = m_new
    return (o / l[..., None]).permute(0, 2, 1, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--shape", default="2,256,1023,4", help="batch,seqlen_q,seqlen_k,heads")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, sq, sk, h = (int(x) for x in args.shape.split(","))
    d = args.head_dim
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        q, k, v = (quantized(torch.randn(b, n, h, d)) for n in (sq, sk, sk))
        sc = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(d)
        if args.causal:
            sc = sc.masked_fill(causal_mask(sq, sk), -math.inf)
        ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(sc, -1), v.double())
        rms = lambda out: (out.to(torch.bfloat16).double() - ref).pow(2).mean().sqrt().item()  # noqa: E731
        plain = rms(emulate_dequantized(q, k, v, args.causal))
        for name, kw in VARIANTS.items():
            ratios[name].append(rms(kernel_emulation(q, k, v, args.causal, **kw)) / plain)
    print(f"d{d} b,sq,sk,h = {args.shape} {'causal' if args.causal else 'full'}, {args.seeds} seeds: RMS / plain FP8's")
    for name, r in ratios.items():
        print(f"  {name:20} median {statistics.median(r):.3f}  max {max(r):.3f}")


if __name__ == "__main__":
    main()
