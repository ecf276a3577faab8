"""Time named kernel configurations (the kernel alone) on the bench's shape, each verified first.

    python scripts/time_configs.py --seqlen 1024,4096 fwd_sm90_d128_bf16_full_bm128_bn128_w12_s2_ov1_pp0 ...
    python scripts/time_configs.py fwd_sm90_d64_bf16_full_bm128_bn128_w12_s2_ov0_pp0_ps@1024,16384 ...
    python scripts/time_configs.py store:sm90_d128_bf16_full_s4096_g1_bt16384_hdt2048@4096 ...   (a tuned entry's kernel)
    python scripts/time_configs.py store:sm90_d64_bf16_full_s4096_g1_bt16384_hdt2048+exp2_fma=1 ...  (one knob changed)
    python scripts/time_configs.py store:sm90_d128_bf16_full_s4096_g1_bt16384_hdt2048_bwd+dq_tma=true ...  (a backward)

    python scripts/time_configs.py --rounds 3 --seqlen 1024,4096,16384 store:KEY store:KEY+desc_step=true ...  (an A/B)

For before/after checks of a template change on chosen configurations: batch = 16384 // seqlen,
heads = 2048 // head_dim (as in `flashgen bench`), CUDA-event medians after warm-up, inputs
rotated past L2. A name may carry its own seqlens after `@`. Every point is verified first, then timed once per
round (--rounds, the points in turn), and one line per configuration and seqlen gives the rounds, their median and its
ratio to the first point of the same problem (the base of an A/B); a kernel that fails to verify is reported and not
timed. A backward (a tuned backward entry) is verified
against float64 gradients and timed alone, all its launches, out and LSE from the default forward; its TFLOP/s count
2.5x the forward's FLOPs.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.bench import flops, time_backward, time_kernel  # noqa: E402
from flashgen.compile import compile_kernel, target_for  # noqa: E402
from flashgen.config import BwdConfig, KernelConfig, backward_forward_config  # noqa: E402
from flashgen.problem import VERIFY_REF_SCORES_BWD, verify_cut  # noqa: E402
from flashgen.store import config_from_entry, read_store  # noqa: E402
from flashgen.verify import verify, verify_backward  # noqa: E402

_NAME = re.compile(r"fwd_(sm\d+)_d(\d+)_(fp16|bf16|fp8_e4m3)_(full|causal)_bm(\d+)_bn(\d+)_w(\d+)_s(\d+)"
                   r"(?:_ov([01])_pp([01])(_ps)?(_oe)?)?(?:_o(bf16|fp16)(_bq)?(_rs)?)?(_lz)?(_qr)?(_psm)?(_ot)?(_cl)?(_hl)?"
                   r"(?:_ef([12]))?(_dst)?(_dc)?(_vt)?(_pk)?$")


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
    fam, d, dt, mask, bm, bn, w, s, ov, pp, ps, oe, out, bq, rs, lz, qr, psm, ot, cl, hl, ef, dst, dc, vt, pk = m.groups()
    cfg = KernelConfig(int(d), dt, mask == "causal", int(bm), int(bn), int(w), int(s), fam,
                       bool(int(ov or 0)), bool(int(pp or 0)), bool(ps), out_dtype=out or "", block_quant_p=bool(bq),
                       overlap_epilogue=bool(oe), mma_rowsum=bool(rs), lazy_rescale=bool(lz),
                       q_regs=bool(qr), p_smem=bool(psm), o_tma=bool(ot), pack_gqa=bool(pk),
                       cluster=bool(cl), lpt_by_head=bool(hl), exp2_fma=int(ef or 0), desc_step=bool(dst),
                       diag_cut=bool(dc), v_t=bool(vt))
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


class Point(NamedTuple):
    """One configuration at one shape: what is timed, once verified."""

    name: str  # as given (a store key with +knob changes, or a kernel name)
    cfg: KernelConfig | BwdConfig
    where: str  # "N=4096" or the --shape
    shape: tuple  # (batch, seqlen_q, seqlen_k, heads, heads_k or None)
    kern: Any
    fwd: Any  # a backward's forward kernel (out and LSE), else None
    max_err: float

    def tflops(self, ms: float) -> float:
        b, sq, sk, h, _ = self.shape
        bwd = isinstance(self.cfg, BwdConfig)
        return flops(b, h, sq, sk, self.cfg.head_dim, self.cfg.causal) * (2.5 if bwd else 1) / (ms * 1e-3) / 1e12


def compiled(cfg: KernelConfig | BwdConfig, gpu_arch: str) -> tuple[Any, Any]:
    """The configuration's kernel and, for a backward, the forward that makes its out and LSE (the tuner's), else
    None."""
    kern = compile_kernel(cfg, target_for(gpu_arch, cfg.family))
    if not isinstance(cfg, BwdConfig):
        return kern, None
    fwd_cfg = backward_forward_config(cfg.head_dim, cfg.dtype, cfg.causal, gpu_arch)
    return kern, compile_kernel(fwd_cfg, target_for(gpu_arch, fwd_cfg.family))


def verified_points(names: list[str], seqlen: str, gpu_arch: str, shape: tuple | None) -> list[Point]:
    """Each name at each of its seqlens (or the --shape), compiled and verified; one that fails is reported, not kept."""
    out = []
    for arg in names:
        name, _, seqlens = arg.partition("@")
        cfg = with_knobs(name)
        kern, fwd = compiled(cfg, gpu_arch)
        bwd = fwd is not None
        for n in [None] if shape else [int(x) for x in (seqlens or seqlen).split(",")]:
            b, sq, sk, h, hk = shape or (max(1, 16384 // n), n, n, max(1, 2048 // cfg.head_dim), None)
            where = f"shape {b}x{sq}x{sk}x{h}x{hk}" if shape else f"N={n}"
            if bwd:  # float64 autograd keeps several (batch, heads, sq, sk) tensors: cut as the tuner cuts them
                vr = verify_backward(kern, fwd, *verify_cut(min(b, 2), sq, sk, h, hk or h, VERIFY_REF_SCORES_BWD))
            else:
                vr = verify(kern, min(b, 2), sq, sk, h, hk)
            if not vr.ok:
                print(f"{name} {where}: VERIFY FAILED {vr.reason}", flush=True)
                continue
            out.append(Point(name, cfg, where, (b, sq, sk, h, hk), kern, fwd, vr.max_err))
    return out


def time_point(pt: Point, reps: int) -> float:
    """The median milliseconds of one point's kernels alone (time_kernel / time_backward)."""
    b, sq, sk, h, hk = pt.shape
    if pt.fwd is not None:
        return time_backward(pt.kern, pt.fwd, b, sq, sk, h, hk, reps=reps)
    return time_kernel(pt.kern, b, sq, sk, h, hk, reps=reps)


def timed_rounds(points: list[Point], rounds: int, reps: int,
                 timer: Callable[[Point, int], float] = time_point) -> list[list[float]]:
    """Each point's milliseconds per round; a round times every point once, in order, so that a drift of the card
    (clocks, temperature) falls on all of them alike rather than on whichever was timed last."""
    times: list[list[float]] = [[] for _ in points]
    for _ in range(rounds):
        for i, pt in enumerate(points):
            times[i].append(timer(pt, reps))
    return times


def table(points: list[Point], times: list[list[float]]) -> list[str]:
    """A line per point: its rounds, their median, TFLOP/s, and the median's ratio to the first point of the same
    problem (pass, head dim, dtype, mask, shape): in an A/B the base comes first."""
    med = [statistics.median(t) for t in times]
    first: dict[tuple, float] = {}
    for pt, m in zip(points, med):
        first.setdefault(problem_of(pt), m)
    lines = []
    for pt, t, m in zip(points, times, med):
        label = pt.name + (f" ({pt.cfg.name})" if pt.name != pt.cfg.name else "")
        lines.append(f"{label} {pt.where}: {m:.3f} ms {pt.tflops(m):.1f} TFLOP/s, x{m / first[problem_of(pt)]:.3f} "
                     f"the base's time (rounds {' '.join(f'{x:.3f}' for x in t)}; max err {pt.max_err:.2e})")
    return lines


def problem_of(pt: Point) -> tuple:
    c = pt.cfg
    return type(c).__name__, c.head_dim, c.dtype, c.causal, pt.shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--seqlen", default="4096", help="comma-separated, e.g. 1024,4096")
    ap.add_argument("--gpu-arch", default="sm90")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every verified point once per round, this many rounds; the table gives each one's "
                         "median and its ratio to the first name's at the same shape")
    ap.add_argument("--shape", default=None, metavar="B,SQ,SK,H,HK",
                    help="time on this shape instead of the bench's (e.g. 16,64,8192,32,8: a few queries per GQA "
                         "group against a long cache); --seqlen is then ignored")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1:
        raise SystemExit("--rounds and --reps must be at least 1")
    shape = tuple(int(x) for x in args.shape.split(",")) if args.shape else None
    points = verified_points(args.names, args.seqlen, args.gpu_arch, shape)
    for line in table(points, timed_rounds(points, args.rounds, args.reps)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
