"""Search and store for packed (varlen) batches and sliding-window problems (`tune --kind varlen`).

A varlen call and a dense call with a window run the serving forward (on Hopper the sm90 family with the
varlen / window features compiled in, elsewhere the sm80 family's). Which tiles and schedule suit them is
not the dense problem's answer: a packed batch is many short loops of different lengths, a window a short
key loop per row block at any N. `tune_problem` measures the family's whole fitting space (every tile and,
on sm90, overlap / ping-pong and, for a window alone, the persistent schedule; configurations whose
features make them spill are left out) on one problem's own random inputs: each candidate verified against
float64 built sequence by sequence with poisoned outputs before it is timed (CUDA-event medians), the
fastest verified one stored ("pass_": "varlen"). flashgen.resolve.tuned_prefill is what those calls ask: the
kernel of the nearest stored problem with the same head dim, dtype, mask and features, or None (then the dense
tuned tiles apply, see flashgen.resolve.sm90_config).
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .__version__ import __version__
from .bench import median_ms, retime_best, time_cuda
from .bench_serving import lengths, seen_pairs
from .checks import Mods
from .compile import nvcc_version, target_for
from .config import ConfigError, KernelConfig, space as dense_space
from .driver import version as driver_version
from .kernels import serving as serve_kernels
from .kernels.dense import compiled_kernel
from .resolve import untuned_prefill_config
from .tensors import torch_dtype
from .verify import packed_ref, poisoned_error

# (packed, num_seqs, min_len, max_len, window): the bench's packed causal batch (64 sequences, lengths
# log-uniform in 64..8192) and its window point (one sequence of 16k, window 1024).
VARLEN_POINTS = ((True, 64, 64, 8192, -1), (False, 1, 16384, 16384, 1024))
SEED = 0  # the lengths' draw (bench_serving.lengths): the same batch every run


def parse_point(text: str) -> tuple[bool, int, int, int, int]:
    """A point of VARLEN_POINTS from the command line: "SEQSxMIN-MAX" (a packed batch, e.g. 64x64-8192) or
    "wWINDOW@N" (a causal window of WINDOW keys at one sequence of N, e.g. w1024@16384)."""
    import re  # noqa: PLC0415

    packed = re.fullmatch(r"(\d+)x(\d+)-(\d+)", text.strip().lower())
    window = re.fullmatch(r"w(\d+)@(\d+)", text.strip().lower())
    if packed:
        seqs, lo, hi = map(int, packed.groups())
        if seqs >= 1 and 1 <= lo <= hi:
            return True, seqs, lo, hi, -1
    elif window:
        win, n = map(int, window.groups())
        if n >= 1:
            return False, 1, n, n, win
    raise ValueError(f"varlen point {text!r}: expected SEQSxMIN-MAX (e.g. 64x64-8192, 1 <= MIN <= MAX) or "
                     f"wWINDOW@N (e.g. w1024@16384)")


@dataclass(frozen=True)
class VarlenProblem:
    """One problem on one GPU: a packed batch of num_seqs sequences with lengths log-uniform in
    [min_len, max_len] (q and k the same lengths), or (packed False) a dense batch of num_seqs sequences of
    max_len; window: the left window (-1: none; the right edge is the diagonal when causal, else unbounded)."""

    head_dim: int
    dtype: str
    causal: bool
    heads: int
    heads_k: int
    packed: bool
    num_seqs: int
    min_len: int
    max_len: int
    window: int
    gpu_name: str
    gpu_arch: str

    @property
    def key(self) -> str:
        return (f"{'varlen' if self.packed else 'window'}_d{self.head_dim}_{self.dtype}_"
                f"{'causal' if self.causal else 'full'}_h{self.heads}k{self.heads_k}_s{self.num_seqs}"
                f"_n{self.min_len}-{self.max_len}_w{self.window}")

    @property
    def features(self) -> dict[str, bool]:
        return {"varlen": self.packed, "window": self.window >= 0}

    def lengths(self) -> list[int]:
        if not self.packed:
            return [self.max_len] * self.num_seqs
        return lengths(self.num_seqs, self.min_len, self.max_len, SEED)

    def flops(self) -> float:
        """Useful FLOPs: 4 d h per (query, key) pair the mask and window let through."""
        right = 0 if self.causal else -1
        return sum(4.0 * self.head_dim * self.heads * seen_pairs(n, n, self.window, right) for n in self.lengths())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pass_": "varlen"}


def space(problem: VarlenProblem, compiled: Callable[[KernelConfig], Any] | None = None) -> list[KernelConfig]:
    """Every configuration of the family a call on problem.gpu_arch takes (sm90 on Hopper, else sm80) with
    the problem's features that fits the GPU; with `compiled` (cfg -> Kernel), those that spill registers or
    serialize their wgmmas are left out (the features' extra live registers tip some wide tiles over)."""
    import re  # noqa: PLC0415

    p = problem
    family = "sm90" if p.gpu_arch == "sm90" else "sm80"
    out: dict[KernelConfig, None] = {}
    for base in dense_space(family, p.head_dim, p.dtype, p.causal):
        if p.packed and base.persistent:  # varlen is built non-persistent: its flat twin is in the space too
            continue
        try:
            cfg = dataclasses.replace(base, **{f: on for f, on in p.features.items() if on})
        except ConfigError:
            continue
        if cfg.unfit_reason(p.gpu_arch) is None:
            out[cfg] = None
    cfgs = list(out)
    if compiled is not None:
        kept = []
        for cfg in cfgs:
            k = compiled(cfg)
            if not k.resources.spills and not re.search(r"C751[239]", k.ptxas_log):
                kept.append(cfg)
        cfgs = kept
    return cfgs


def tune_problem(problem: VarlenProblem, candidates: list[KernelConfig] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Measure every candidate (default: the whole fitting space, spilling ones left out) of `problem` on this GPU;
    the store entry of the fastest verified one (None if none verified). The untuned choice (what the call takes
    without a stored entry) is measured beside it."""
    import itertools  # noqa: PLC0415

    import torch  # noqa: PLC0415

    p = problem
    tdt = torch_dtype(p.dtype)
    lens = p.lengths()
    cu = [0, *itertools.accumulate(lens)]
    total = cu[-1]
    q = torch.randn(total, p.heads, p.head_dim, device="cuda", dtype=tdt)
    k, v = (torch.randn(total, p.heads_k, p.head_dim, device="cuda", dtype=tdt) for _ in range(2))
    ref = packed_ref(q, k, v, cu, cu, p.causal, p.window, torch.float64)
    same = packed_ref(q, k, v, cu, cu, p.causal, p.window, tdt).double()
    bound = 2 * (same - ref).abs().max().item() + 1e-5  # flash_attn's bar: twice PyTorch's own error in the dtype
    del same
    out = torch.empty_like(q)
    mods = Mods(window=(p.window, -1))
    if p.packed:
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        views, cus = (q, k, v, out), dict(cu_q=cu_t, cu_k=cu_t)
    else:
        views = tuple(t.view(p.num_seqs, p.max_len, *t.shape[1:]) for t in (q, k, v, out))
        cus = dict(cu_q=None, cu_k=None)
    n_max = max(lens)
    dev = q.get_device()
    if candidates is None:
        candidates = space(p, lambda c: compiled_kernel(c, target_for(p.gpu_arch, c.family)))

    def launch(cfg: KernelConfig) -> None:
        serve_kernels.launch_prefill(cfg, *views, None, **cus, max_seqlen_q=n_max, max_seqlen_k=n_max, num_splits=1,
                                     mods=mods, softmax_scale=None)

    def timer(cfg: KernelConfig) -> list[float]:
        return time_cuda(lambda i: launch(cfg), warmup=3, reps=20)

    def measure(cfg: KernelConfig) -> tuple[float | None, str]:
        err = poisoned_error(out, ref, lambda: launch(cfg))
        if not err <= bound:  # NaN (an unwritten element) fails too
            return None, f"max error {err:.3g} > {bound:.3g}"
        return median_ms(timer(cfg)), "ok"

    default = untuned_prefill_config(dev, p.head_dim, p.dtype, p.causal, n_max, n_max, p.features)
    default_ms, default_status = measure(default)
    results, failed = [], 0
    for cfg in candidates:
        ms, status = measure(cfg)
        if ms is None:
            failed += 1
            if progress:
                progress(f"  {cfg.name}: not verified ({status})")
            continue
        results.append((ms, cfg))
    if not results:
        return None
    # The leaders and the untuned choice timed again side by side: the stored winner must beat noise.
    final = retime_best(results, timer, keep=(default,) if default_ms else ())
    verified = {c for _, c in results}
    ms, cfg = next((m, c) for m, c in final if c in verified)  # the untuned choice, timed beside, wins only as a candidate
    default_ms = next((m for m, c in final if c == default), default_ms)
    flops = p.flops()
    tflops = flops / (ms * 1e-3) / 1e12
    if progress:
        progress(f"{p.key}: {tflops:.0f} TFLOP/s useful ({ms:.3f} ms) {cfg.name}; untuned {default.name} "
                 + (f"{flops / (default_ms * 1e-3) / 1e12:.0f}" if default_ms else default_status)
                 + f"; {len(results)} verified, {failed} failed")
    return {
        "problem": p.to_dict(), "kernel": cfg.name, "config": cfg.to_dict(), "median_ms": ms, "tflops": tflops,
        "trials": len(candidates), "date": datetime.date.today().isoformat(), "flashgen": __version__,
        "nvcc": nvcc_version(), "driver": driver_version(),
        "default": {"kernel": default.name, "status": default_status, "median_ms": default_ms,
                    "tflops": flops / (default_ms * 1e-3) / 1e12 if default_ms else None},
    }


__all__ = ["VARLEN_POINTS", "VarlenProblem", "parse_point", "space", "tune_problem"]
