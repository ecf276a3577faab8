"""Search and store for packed (varlen) batches and sliding-window problems (`tune --kind varlen`).

A varlen call and a dense call with a window run the serving forward (on Hopper the sm90 family with the
varlen / window features compiled in, elsewhere the sm80 family's). Which tiles and schedule suit them is
not the dense problem's answer: a packed batch is many short loops of different lengths, a window a short
key loop per row block at any N. A problem is tuned by the one pipeline of every kind (flashgen.tunable,
flashgen.search, the GPU worker) over the family's whole fitting space (every tile and, on sm90, overlap /
ping-pong and, for a window alone, the persistent schedule; configurations whose features make them spill are
refused as they compile) on the problem's own random inputs (`Inputs`, built once in the worker): each
candidate verified against float64 built sequence by sequence with poisoned outputs before it is timed
(CUDA-event medians), the fastest verified one stored ("pass_": "varlen", `entry`). flashgen.resolve.tuned_prefill is what those calls ask: the
kernel of the nearest stored problem with the same head dim, dtype, mask and features, or None (then the dense
tuned tiles apply, see flashgen.resolve.sm90_config).
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .__version__ import __version__
from .bench import TrialInputs
from .bench_serving import lengths, seen_pairs
from .checks import Mods
from .config import ConfigError, KernelConfig, space as dense_space
from .kernels import serving as serve_kernels
from .problem import HeldInputs, Rule, gpu_slug
from .resolve import untuned_prefill_config
from .tensors import torch_dtype
from .verify import packed_ref

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
    def study_name(self) -> str:
        """The problem's Optuna study (with the space's digest, see flashgen.search.study_name): GPU slug / key."""
        return f"{gpu_slug(self.gpu_name, self.gpu_arch)}/{self.key}"

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


def spill_reason(kernel: Any) -> str | None:
    """Why a compiled candidate is left out of the space: it spills registers or serializes its wgmmas (the
    features' extra live registers tip some wide tiles over; kernels.serving.build_fault); None to keep it."""
    return serve_kernels.build_fault(kernel)


def space(problem: VarlenProblem, compiled: Callable[[KernelConfig], Any] | None = None) -> list[KernelConfig]:
    """Every configuration of the family a call on problem.gpu_arch takes (sm90 on Hopper, else sm80) with
    the problem's features that fits the GPU; with `compiled` (cfg -> Kernel), those `spill_reason` refuses are
    left out (the GPU backend refuses them as it compiles them, see flashgen.tunable)."""
    p = problem
    out: dict[KernelConfig, None] = {}
    for base in dense_space(family_of(p), p.head_dim, p.dtype, p.causal):
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
        cfgs = [c for c in cfgs if spill_reason(compiled(c)) is None]
    return cfgs


def family_of(problem: VarlenProblem) -> str:
    """The template family a varlen / window call takes on the problem's GPU."""
    return "sm90" if problem.gpu_arch == "sm90" else "sm80"


RULE = Rule("untuned (flashgen.resolve)")  # what the call takes without a stored entry, resolved in the worker


def problems(head_dims: list[int], dtypes: list[str], causals: list[bool], heads_dim_total: int,
             points: list[tuple[bool, int, int, int, int]], gpu_name: str, gpu_arch: str) -> list[VarlenProblem]:
    """Every (head dim, dtype, mask, point) on one GPU model; a window point only causal (a sliding window)."""
    return [VarlenProblem(hd, dt, ca, heads_dim_total // hd, heads_dim_total // hd, packed, seqs, lo, hi, win,
                          gpu_name, gpu_arch)
            for hd, dt, ca, (packed, seqs, lo, hi, win) in itertools.product(head_dims, dtypes, causals, points)
            if packed or ca]


class Inputs(TrialInputs):
    """A varlen / window problem's random inputs on this GPU, its float64 reference built sequence by sequence,
    and the bar a candidate must meet (twice PyTorch's own error in the dtype). Built once in the GPU worker."""

    def __init__(self, problem: VarlenProblem):
        import torch  # noqa: PLC0415

        p = self.problem = problem
        tdt = torch_dtype(p.dtype)
        lens = p.lengths()
        cu = [0, *itertools.accumulate(lens)]
        total = cu[-1]
        q = torch.randn(total, p.heads, p.head_dim, device="cuda", dtype=tdt)
        k, v = (torch.randn(total, p.heads_k, p.head_dim, device="cuda", dtype=tdt) for _ in range(2))
        self.ref = packed_ref(q, k, v, cu, cu, p.causal, p.window, torch.float64)
        same = packed_ref(q, k, v, cu, cu, p.causal, p.window, tdt).double()
        self.bound = 2 * (same - self.ref).abs().max().item() + 1e-5
        del same
        self.out = torch.empty_like(q)
        self.mods = Mods(window=(p.window, -1))
        if p.packed:
            cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
            self.views, self.cus = (q, k, v, self.out), dict(cu_q=cu_t, cu_k=cu_t)
        else:
            self.views = tuple(t.view(p.num_seqs, p.max_len, *t.shape[1:]) for t in (q, k, v, self.out))
            self.cus = dict(cu_q=None, cu_k=None)
        self.n_max = max(lens)
        self.untuned = untuned_prefill_config(q.get_device(), p.head_dim, p.dtype, p.causal, self.n_max, self.n_max,
                                              p.features)

    def config(self, cand: KernelConfig | Rule) -> KernelConfig:
        return self.untuned if isinstance(cand, Rule) else cand

    def launch(self, cfg: KernelConfig) -> None:
        serve_kernels.launch_prefill(cfg, *self.views, None, **self.cus, max_seqlen_q=self.n_max,
                                     max_seqlen_k=self.n_max, num_splits=1, mods=self.mods, softmax_scale=None)

    def runner(self, cand: KernelConfig | Rule) -> tuple[Callable[[], Any], dict[str, Any]]:
        """One launch of `cand` writing self.out; the trial result names the kernel (the rule's is resolved here)."""
        cfg = self.config(cand)
        return lambda: self.launch(cfg), {"kernel": cfg.name}


inputs = HeldInputs(Inputs)  # the GPU worker's, of the problem it is tuning
gpu_trial, gpu_retime = inputs.trial, inputs.retime  # the worker's tasks (flashgen.tunable.VarlenKind)


def entry(problem: VarlenProblem, best: KernelConfig, ms: float, trials: int, default: Any,
          versions: dict[str, str]) -> dict[str, Any]:
    """The store entry ("pass_": "varlen") of the fastest verified candidate; `default`: the untuned choice's
    TrialResult (its info names the kernel the worker resolved)."""
    flops = problem.flops()
    dms = default.ms if default is not None and default.ok else None
    return {
        "problem": problem.to_dict(), "kernel": best.name, "config": best.to_dict(), "median_ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12, "trials": trials, "date": datetime.date.today().isoformat(),
        "flashgen": __version__, **versions,
        "default": {"kernel": default.info.get("kernel", RULE.name) if default is not None else RULE.name,
                    "status": "not measured" if default is None else "ok" if dms else (default.reason or default.status),
                    "median_ms": dms, "tflops": flops / (dms * 1e-3) / 1e12 if dms else None},
    }


__all__ = ["RULE", "VARLEN_POINTS", "Inputs", "VarlenProblem", "entry", "family_of", "gpu_retime", "gpu_trial",
           "parse_point", "problems", "space", "spill_reason"]
