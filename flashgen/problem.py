"""What the tuner tunes for: one problem on one GPU, its key, and the shapes it is timed on."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .config import BwdConfig, KernelConfig, default_bwd_config, default_config

SEQLEN_BUCKETS = (1024, 4096, 16384)
HEADS_DIM_TOTAL = 2048  # heads * head_dim of the model the problem stands for
BATCH_TOKENS = 16384  # batch * seqlen
# Scores (batch * heads * seqlen_q * seqlen_k) the float64 reference computes per trial: a bound on
# its time. Its memory is one chunk of query rows sized from free memory (verify.ref_chunk_rows).
VERIFY_REF_SCORES = 2**30
# The backward's reference (autograd through explicit attention, not chunked) keeps several score-sized
# float64 tensors at once: a smaller bound.
VERIFY_REF_SCORES_BWD = 2**26
PASSES = ("fwd", "bwd")
# How a problem is searched by default (search.exhaustive_for): all of its configurations that fit the GPU
# when there are at most EXHAUSTIVE_MAX (sampling saves little there and may miss the best), else
# DEFAULT_TRIALS sampled by TPE.
EXHAUSTIVE_MAX = 400
DEFAULT_TRIALS = 60


@dataclass(frozen=True)
class Rule:
    """A candidate that is no configuration: what a call takes without a stored entry (the serving problems'
    untuned choice, chosen where it runs: attention_with_kvcache's split rule, the prefill's resolved tiles).
    It is measured beside the search, never stored."""

    name: str

    def unfit_reason(self, arch: str) -> str | None:
        return None


class HeldInputs:
    """A GPU worker's inputs of the serving problem it is tuning: made at the problem's first trial, kept for its
    later ones, and dropped (memory back first) when the next problem starts; one problem at a time."""

    def __init__(self, make: Callable[[Any], Any]):
        self._make, self._held = make, {}

    def __call__(self, problem: Any) -> Any:
        if problem not in self._held:
            self._held.clear()
            self._held[problem] = self._make(problem)
        return self._held[problem]

    def trial(self, problem: Any, cand: Any, warmup: int, reps: int) -> dict[str, Any]:
        """The GPU worker's task for one candidate (flashgen.worker.GpuBackend): verified, then timed."""
        return self(problem).trial(cand, warmup, reps)

    def retime(self, problem: Any, cands: list[Any], rounds: int, warmup: int, reps: int) -> list[float]:
        """The GPU worker's task timing the leaders again side by side."""
        return self(problem).retime(cands, rounds, warmup, reps)


def gpu_slug(gpu_name: str, arch: str) -> str:
    """File-system name of a GPU: "NVIDIA H200", "sm90" -> "nvidia-h200-sm90"."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") + f"-{arch}"


def verify_cut(batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int,
               cap: int) -> tuple[int, int, int, int, int]:
    """A shape to verify on: batch, then heads, cut (keeping the GQA ratio) until the float64 reference's
    (batch, heads, seqlen_q, seqlen_k) scores are at most `cap`; the lengths are kept."""
    b, h, hk = batch, heads, heads_k
    g = h // hk
    while b > 1 and b * h * seqlen_q * seqlen_k > cap:
        b //= 2
    while hk > 1 and b * h * seqlen_q * seqlen_k > cap:
        hk //= 2
        h = hk * g
    while h > 1 and b * h * seqlen_q * seqlen_k > cap:  # one k/v head left: cut the group instead
        h //= 2
    return b, seqlen_q, seqlen_k, h, hk


@dataclass(frozen=True)
class TuneProblem:
    """(GPU, template family, dtype, head_dim, causal, seqlen bucket, GQA group size) plus how it is shaped."""

    gpu_name: str
    gpu_arch: str  # the GPU that compiles for and times the kernel, e.g. "sm90"
    family: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    gqa_group: int = 1
    batch_tokens: int = BATCH_TOKENS
    heads_dim_total: int = HEADS_DIM_TOTAL
    pass_: str = "fwd"  # "fwd": a KernelConfig; "bwd": a BwdConfig (its kernels timed alone)
    # A traced score_mod / mask_mod (flashgen.modifiers digests; "": none): the kernel (forward or backward) is timed
    # with them compiled in (a mask_mod with its block map), and its entry answers calls with exactly these modifiers.
    score_mod: str = ""
    mask_mod: str = ""

    def __post_init__(self) -> None:
        if self.pass_ not in PASSES:
            raise ValueError(f"pass_={self.pass_!r}; choose one of {', '.join(PASSES)}")
        if (self.score_mod or self.mask_mod) and self.family not in ("sm80", "sm90"):
            raise ValueError("a problem with a score_mod or mask_mod is of family sm80 or sm90 (the modifiers' "
                             "kernels)")

    @property
    def key(self) -> str:
        """The problem's name in the store and (with the GPU slug) the Optuna study name: it names
        everything the measured time depends on, sizes included, so that results of different
        sizes never compete. A backward problem ends in "_bwd"; a forward one has no pass suffix
        (the keys of stores made before the backward stay valid). A problem with modifiers ends in their digests,
        `_sm<score_mod>` and `_mm<mask_mod>`: a kernel tuned for one modifier never answers another."""
        mask = "causal" if self.causal else "full"
        return (f"{self.family}_d{self.head_dim}_{self.dtype}_{mask}_s{self.seqlen}_g{self.gqa_group}"
                f"_bt{self.batch_tokens}_hdt{self.heads_dim_total}" + ("_bwd" if self.pass_ == "bwd" else "")
                + (f"_sm{self.score_mod}" if self.score_mod else "") + (f"_mm{self.mask_mod}" if self.mask_mod else ""))

    @property
    def gpu_slug(self) -> str:
        return gpu_slug(self.gpu_name, self.gpu_arch)

    @property
    def study_name(self) -> str:
        return f"{self.gpu_slug}/{self.key}"

    @property
    def batch(self) -> int:
        return max(1, self.batch_tokens // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, self.heads_dim_total // self.head_dim)

    @property
    def heads_k(self) -> int:
        return max(1, self.heads // self.gqa_group)

    def shape(self) -> tuple[int, int, int, int, int]:
        """(batch, seqlen_q, seqlen_k, heads, heads_k) the kernel is timed on."""
        return self.batch, self.seqlen, self.seqlen, self.heads, self.heads_k

    def verify_shape(self) -> tuple[int, int, int, int, int]:
        """The timed shape with batch, then heads, cut (keeping the GQA ratio) until the
        float64 reference's (batch, heads, seqlen, seqlen) scores are at most VERIFY_REF_SCORES
        (VERIFY_REF_SCORES_BWD for a backward problem)."""
        return verify_cut(*self.shape(), VERIFY_REF_SCORES_BWD if self.pass_ == "bwd" else VERIFY_REF_SCORES)

    def default_config(self) -> KernelConfig | BwdConfig:
        if self.pass_ == "bwd":
            return default_bwd_config(self.head_dim, self.dtype, self.causal, self.gpu_arch, family=self.family)
        return default_config(self.head_dim, self.dtype, self.causal, self.gpu_arch, self.family)

    def to_dict(self) -> dict:
        return asdict(self)
