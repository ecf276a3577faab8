"""Time named kernel configurations (the kernel alone) on the bench's shape, each verified first.

    python scripts/time_configs.py --seqlen 1024,4096 fwd_sm90_d128_bf16_full_bm128_bn128_w12_s2_ov1_pp0 ...
    python scripts/time_configs.py fwd_sm90_d64_bf16_full_bm128_bn128_w12_s2_ov0_pp0_ps@1024,16384 ...
    python scripts/time_configs.py store:sm90_d128_bf16_full_s4096_g1_bt16384_hdt2048@4096 ...   (a tuned entry's kernel)
    python scripts/time_configs.py store:sm90_d64_bf16_full_s4096_g1_bt16384_hdt2048+exp2_fma=1 ...  (one knob changed)
    python scripts/time_configs.py store:sm90_d128_bf16_full_s4096_g1_bt16384_hdt2048_bwd+dq_tma=true ...  (a backward)

For before/after checks of a template change on chosen configurations: batch = 16384 // seqlen,
heads = 2048 // head_dim (as in `flashgen bench`), CUDA-event medians after warm-up, inputs
rotated past L2. A name may carry its own seqlens after `@`. Prints one line per configuration
and seqlen; a kernel that fails to verify is reported and not timed. A backward (a tuned backward entry) is verified
against float64 gradients and timed alone, all its launches, out and LSE from the default forward; its TFLOP/s count
2.5x the forward's FLOPs.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.bench import flops, time_backward, time_kernel  # noqa: E402
from flashgen.compile import compile_kernel, target_for  # noqa: E402
from flashgen.config import BwdConfig, KernelConfig, default_config  # noqa: E402
from flashgen.problem import VERIFY_REF_SCORES_BWD, verify_cut  # noqa: E402
from flashgen.store import config_from_entry, read_store  # noqa: E402
from flashgen.verify import verify, verify_backward  # noqa: E402

_NAME = re.compile(r"fwd_(sm\d+)_d(\d+)_(fp16|bf16|fp8_e4m3)_(full|causal)_bm(\d+)_bn(\d+)_w(\d+)_s(\d+)"
                   r"(?:_ov([01])_pp([01])(_ps)?(_oe)?)?(?:_o(bf16|fp16)(_bq)?(_rs)?)?(_lz)?(_qr)?(_psm)?(_ot)?(_cl)?(_pk)?$")


def parse(name: str) -> KernelConfig | BwdConfig:
    """The KernelConfig a kernel name spells (KernelConfig.name, read back), or store:KEY's (tuned/*.json)."""
    if name.startswith("store:"):
        key = name[len("store:"):]
        for path in sorted((Path(__file__).resolve().parent.parent / "tuned").glob("*.json")):
            entry = read_store(path)["entries"].get(key)
            if entry is not None:
                return config_from_entry(entry)
        raise SystemExit(f"no tuned entry {key}")
    m = _NAME.match(name)
    if not m:
        raise SystemExit(f"not a forward kernel name: {name}")
    fam, d, dt, mask, bm, bn, w, s, ov, pp, ps, oe, out, bq, rs, lz, qr, psm, ot, cl, pk = m.groups()
    cfg = KernelConfig(int(d), dt, mask == "causal", int(bm), int(bn), int(w), int(s), fam,
                       bool(int(ov or 0)), bool(int(pp or 0)), bool(ps), out_dtype=out or "", block_quant_p=bool(bq),
                       overlap_epilogue=bool(oe), mma_rowsum=bool(rs), lazy_rescale=bool(lz),
                       q_regs=bool(qr), p_smem=bool(psm), o_tma=bool(ot), pack_gqa=bool(pk),
                       cluster=bool(cl))
    if cfg.name != name:
        raise SystemExit(f"{name} reads back as {cfg.name}")
    return cfg


def with_knobs(spec: str) -> KernelConfig | BwdConfig:
    """parse()'s configuration with `+field=value` changes after the name (ints, or true/false)."""
    name, *changes = spec.split("+")
    cfg = parse(name)
    for change in changes:
        field, _, value = change.partition("=")
        if not hasattr(cfg, field):
            raise SystemExit(f"{spec}: {type(cfg).__name__} has no field {field}")
        cfg = dataclasses.replace(cfg, **{field: value == "true" if value in ("true", "false") else int(value)})
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--seqlen", default="4096", help="comma-separated, e.g. 1024,4096")
    ap.add_argument("--gpu-arch", default="sm90")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--shape", default=None, metavar="B,SQ,SK,H,HK",
                    help="time on this shape instead of the bench's (e.g. 16,64,8192,32,8: a few queries per GQA "
                         "group against a long cache); --seqlen is then ignored")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(",")) if args.shape else None
    for arg in args.names:
        name, _, seqlens = arg.partition("@")
        cfg = with_knobs(name)
        kern = compile_kernel(cfg, target_for(args.gpu_arch, cfg.family))
        bwd = isinstance(cfg, BwdConfig)
        if bwd:  # out and LSE for the backward's inputs
            fwd_cfg = default_config(cfg.head_dim, cfg.dtype, cfg.causal, "sm80")
            fwd = compile_kernel(fwd_cfg, target_for(args.gpu_arch, fwd_cfg.family))
        ns = [None] if shape else [int(x) for x in (seqlens or args.seqlen).split(",")]
        for n in ns:
            b, sq, sk, h, hk = shape or (max(1, 16384 // n), n, n, max(1, 2048 // cfg.head_dim), None)
            where = f"shape {b}x{sq}x{sk}x{h}x{hk}" if shape else f"N={n}"
            if bwd:  # float64 autograd keeps several (batch, heads, sq, sk) tensors: cut as the tuner cuts them
                vr = verify_backward(kern, fwd, *verify_cut(min(b, 2), sq, sk, h, hk or h, VERIFY_REF_SCORES_BWD))
            else:
                vr = verify(kern, min(b, 2), sq, sk, h, hk)
            if not vr.ok:
                print(f"{name} {where}: VERIFY FAILED {vr.reason}")
                continue
            if bwd:
                ms = time_backward(kern, fwd, b, sq, sk, h, hk, reps=args.reps)
            else:
                ms = time_kernel(kern, b, sq, sk, h, hk, reps=args.reps)
            tf = flops(b, h, sq, sk, cfg.head_dim, cfg.causal) * (2.5 if bwd else 1) / (ms * 1e-3) / 1e12
            print(f"{name} {where} {cfg.name if name != cfg.name else ''}: {ms:.3f} ms {tf:.1f} TFLOP/s "
                  f"(max err {vr.max_err:.2e})", flush=True)


if __name__ == "__main__":
    main()
