"""What the tuning pipeline asks of a problem, for every kind of problem it tunes.

One pipeline tunes dense forward / backward problems (flashgen.problem.TuneProblem), decode problems
(flashgen.tune_decode.DecodeProblem: a tile x num_splits) and varlen / window problems
(flashgen.tune_varlen.VarlenProblem): the search (flashgen.search: an Optuna study per problem), the GPU
worker (flashgen.worker: a process a faulting or hanging kernel cannot take the tuner down with), the study
storage and the fleet (flashgen.fleet: several GPUs and hosts, `--collect`). They reach a problem only through
its `Kind` here (`kind_of`):

- `names`: the Optuna parameters of its candidates (a decode candidate's split count is one of them), and
  `params_of` / `candidate` between a candidate and its parameter values;
- `space`: its candidates; `unfit_reason`: why one cannot run on the problem's GPU;
- `default`: what its figures are compared with (the dense default configuration; for decode and varlen the
  untuned choice a call makes, a `Rule` measured by the worker beside the search and never stored);
- `kernels`: the configurations to compile ahead for a candidate; `compile_reason`: why a compiled one is
  refused before it is timed (a varlen kernel that spills);
- `trial_task` / `retime_task`: the worker's tasks that verify against the float64 reference and time (None:
  the worker's own dense tasks), and `task_args`: what else they are given (a modifier problem's modifiers, as data);
- `rate`: the figure a time gives (TFLOP/s; decode: TB/s of K/V read), `entry`: the store entry of an outcome,
  `from_entry`: the candidate of a store entry, `from_dict`: the problem a study or entry records.

A candidate has a `name` (unique in its problem: trials, logs and failures are reported by it).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from . import tune_decode as td, tune_modifier as tm, tune_varlen as tv
from .bench import flops
from .config import SM90_KNOBS, BwdConfig, ConfigError, KernelConfig, bwd_space, space as config_space
from .modifiers import ModifierError, registered
from .problem import Rule, TuneProblem
from .store import config_from_entry, make_entry

PARAMS = ("block_m", "block_n", "num_warps", "num_stages")  # Optuna's parameter names = KernelConfig fields
BWD_PARAMS = ("block_m", "block_n", "num_warps")  # = BwdConfig's tuned fields (deterministic is a choice, not a knob)
# Keyed by `params_key`: the family for a forward or varlen problem, "bwd_<family>" for a backward one, "decode".
FAMILY_PARAMS = {"sm80": PARAMS, "sm90": (*PARAMS, *SM90_KNOBS),
                 "bwd_sm80": BWD_PARAMS,
                 "bwd_sm90": (*BWD_PARAMS, "num_stages", "stagger", "dq_tma", "lse_ahead"),
                 "decode": (*PARAMS, "num_splits", "fused_combine", "key_warps")}

Problem = TuneProblem | td.DecodeProblem | tv.VarlenProblem
Candidate = KernelConfig | BwdConfig | td.DecodeCandidate | Rule
Params = tuple


def params_of(cfg: KernelConfig | BwdConfig) -> Params:
    """A dense (or varlen) configuration's parameter values, by its family."""
    key = f"bwd_{cfg.family}" if isinstance(cfg, BwdConfig) else cfg.family
    return tuple(getattr(cfg, p) for p in FAMILY_PARAMS[key])


class Kind:
    """The pipeline's view of one kind of problem (see the module doc); the dense kind's rules by default."""

    trial_task: str | None = None
    retime_task: str | None = None

    def key(self, problem: Any) -> str:
        """The FAMILY_PARAMS entry of the problem's parameters."""
        return problem.family if problem.pass_ == "fwd" else f"bwd_{problem.family}"

    def names(self, problem: Any) -> tuple[str, ...]:
        return FAMILY_PARAMS[self.key(problem)]

    def params_of(self, problem: Any, cand: Candidate) -> Params:
        return params_of(cand)  # type: ignore[arg-type]

    def candidate(self, problem: Any, params: Params) -> Candidate:
        make = BwdConfig if problem.pass_ == "bwd" else KernelConfig
        return make(problem.head_dim, problem.dtype, problem.causal, family=problem.family,
                    **dict(zip(self.names(problem), params)))

    def space(self, problem: Any) -> list[Candidate]:
        """The whole space (arch fit not checked)."""
        if problem.pass_ == "bwd":
            return bwd_space(problem.head_dim, problem.dtype, problem.causal, family=problem.family)  # type: ignore[return-value]
        return config_space(problem.family, problem.head_dim, problem.dtype, problem.causal,  # type: ignore[return-value]
                            problem.gqa_group)

    def unfit_reason(self, problem: Any, cand: Candidate) -> str | None:
        return cand.unfit_reason(problem.gpu_arch)

    def default(self, problem: Any) -> Candidate:
        return problem.default_config()

    def kernels(self, problem: Any, cand: Candidate) -> list[KernelConfig | BwdConfig]:
        return [] if isinstance(cand, Rule) else [getattr(cand, "config", cand)]

    def compile_reason(self, problem: Any, kernel: Any) -> str | None:
        return None

    def task_args(self, problem: Any) -> tuple:
        """What the worker's trial and retime tasks take after their own arguments."""
        return ()

    def rate(self, problem: Any, ms: float) -> float:
        b, sq, sk, h, _ = problem.shape()
        return flops(b, h, sq, sk, problem.head_dim, problem.causal, problem.pass_) / (ms * 1e-3) / 1e12

    def entry(self, outcome: Any, versions: dict[str, str]) -> dict[str, Any] | None:
        return make_entry(outcome, versions)

    def from_entry(self, e: dict[str, Any]) -> Candidate:
        return config_from_entry(e)

    def from_dict(self, d: dict[str, Any]) -> Problem:
        return TuneProblem(**d)


class ServingKind(Kind):
    """A serving kind, tuned through its module (`tuner`: flashgen.tune_decode or tune_varlen): the GPU worker's
    tasks, the store entry and the problem's type are that module's."""

    tuner: Any
    problem_type: type

    def __init__(self) -> None:
        self.trial_task = f"{self.tuner.__name__}:gpu_trial"
        self.retime_task = f"{self.tuner.__name__}:gpu_retime"

    def entry(self, outcome: Any, versions: dict[str, str]) -> dict[str, Any] | None:
        if outcome.best is None:
            return None
        return self.tuner.entry(outcome.problem, outcome.best_config, outcome.best.ms, outcome.trials,
                                outcome.default, versions)

    def from_dict(self, d: dict[str, Any]) -> Problem:
        return self.problem_type(**{k: v for k, v in d.items() if k != "pass_"})

    def default(self, problem: Any) -> Candidate:
        return self.tuner.RULE


class DecodeKind(ServingKind):
    """Decode problems: a candidate is a decode tile and a split count (td.DecodeCandidate)."""

    tuner, problem_type = td, td.DecodeProblem

    def key(self, problem: Any) -> str:
        return "decode"

    def params_of(self, problem: Any, cand: Candidate) -> Params:
        if isinstance(cand, Rule):
            return (0,) * len(FAMILY_PARAMS["decode"])  # no parameters: never sampled, measured aside
        c = cand.config  # type: ignore[union-attr]
        return (c.block_m, c.block_n, c.num_warps, c.num_stages, cand.num_splits,  # type: ignore[union-attr]
                c.fused_combine, c.key_warps)  # type: ignore[union-attr]

    def candidate(self, problem: Any, params: Params) -> Candidate:
        *tile, splits, fused, key_warps = params
        if splits < 1:
            raise ConfigError(f"num_splits={splits}; at least 1")
        cfg = td.decode_config(problem.head_dim, problem.dtype, (*tile, key_warps), bool(problem.page_size),
                               splits > 1, bool(fused))
        return td.DecodeCandidate(cfg, splits)

    def space(self, problem: Any) -> list[Candidate]:
        return td.candidates(problem)  # type: ignore[return-value]

    def rate(self, problem: Any, ms: float) -> float:
        return problem.kv_bytes / (ms * 1e-3) / 1e12  # TB/s: a decode kernel is bound by reading K and V

    def from_entry(self, e: dict[str, Any]) -> Candidate:
        return td.DecodeCandidate(KernelConfig.from_dict(e["config"]), e["num_splits"])


class VarlenKind(ServingKind):
    """Varlen / window problems: a candidate is a configuration of the call's family with the problem's features."""

    tuner, problem_type = tv, tv.VarlenProblem

    def key(self, problem: Any) -> str:
        return tv.family_of(problem)

    def params_of(self, problem: Any, cand: Candidate) -> Params:
        if isinstance(cand, Rule):
            return (None,) * len(self.names(problem))  # no parameters: never sampled, measured aside
        return tuple(getattr(cand, p) for p in self.names(problem))

    def candidate(self, problem: Any, params: Params) -> Candidate:
        return KernelConfig(problem.head_dim, problem.dtype, problem.causal, family=tv.family_of(problem),
                            **dict(zip(self.names(problem), params)), **{f: True for f, on in problem.features.items()
                                                                         if on})

    def space(self, problem: Any) -> list[Candidate]:
        return tv.space(problem)  # type: ignore[return-value]

    def compile_reason(self, problem: Any, kernel: Any) -> str | None:
        return tv.spill_reason(kernel)

    def rate(self, problem: Any, ms: float) -> float:
        return problem.flops() / (ms * 1e-3) / 1e12  # useful TFLOP/s: the pairs the mask and window let through

    def from_entry(self, e: dict[str, Any]) -> Candidate:
        return KernelConfig.from_dict(e["config"])


class ModifierKind(Kind):
    """Forward problems with a score_mod or mask_mod (TuneProblem's digests): the family's space generated with them
    (flashgen.tune_modifier.space), compared with the kernel an untuned call takes, verified and timed by
    flashgen.tune_modifier in the GPU worker, which gets the modifiers as data (`task_args`: their registered
    Modifiers, CUDA text and graph, no tensors; and the FILE.py:FUNC of those that read tensors, which the worker
    loads). Stored as dense entries whose keys end in the digests."""

    trial_task = "flashgen.tune_modifier:gpu_trial"
    retime_task = "flashgen.tune_modifier:gpu_retime"

    def candidate(self, problem: Any, params: Params) -> Candidate:
        return dataclasses.replace(super().candidate(problem, params), **tm.fields(problem))  # type: ignore[type-var]

    def space(self, problem: Any) -> list[Candidate]:
        return tm.space(problem)  # type: ignore[return-value]

    def default(self, problem: Any) -> Candidate:
        return tm.default_config(problem)

    def compile_reason(self, problem: Any, kernel: Any) -> str | None:
        return tm.compile_reason(problem, kernel)

    def task_args(self, problem: Any) -> tuple:
        try:
            return registered((problem.score_mod, problem.mask_mod)), tm.sources(problem)
        except ModifierError:
            raise ModifierError(f"{problem.key}: its modifiers were not traced in this process; load the same ones "
                                "(tune --score-mod / --mask-mod) where it is tuned or collected") from None


DENSE, DECODE, VARLEN, MODIFIER = Kind(), DecodeKind(), VarlenKind(), ModifierKind()
KINDS = {"fwd": DENSE, "bwd": DENSE, "decode": DECODE, "varlen": VARLEN}  # by the problem's pass_


def kind_of(problem: Problem) -> Kind:
    if isinstance(problem, td.DecodeProblem):
        return DECODE
    if isinstance(problem, tv.VarlenProblem):
        return VARLEN
    if problem.score_mod or problem.mask_mod:
        return MODIFIER
    return DENSE


def problem_from_dict(d: dict[str, Any]) -> Problem:
    """The problem a study's "problem" attribute or a store entry's "problem" records (TypeError if it is not one
    this version knows)."""
    kind = KINDS.get(d.get("pass_", "fwd"))
    if kind is None:
        raise TypeError(f"unknown problem pass_ {d.get('pass_')!r}")
    return kind.from_dict(d)


def entry_of(outcome: Any, versions: dict[str, str]) -> dict[str, Any] | None:
    """The store entry of a search outcome (None without a verified result), in its kind's format."""
    return kind_of(outcome.problem).entry(outcome, versions)


def candidate_of_entry(e: dict[str, Any]) -> Candidate:
    """The candidate a store entry stores (a decode entry's with its split count)."""
    return KINDS[e.get("problem", {}).get("pass_", "fwd")].from_entry(e)


def space_of(problem: Problem) -> list[Candidate]:
    return kind_of(problem).space(problem)


__all__ = ["BWD_PARAMS", "Candidate", "FAMILY_PARAMS", "KINDS", "Kind", "ModifierKind", "PARAMS", "Problem",
           "candidate_of_entry", "entry_of", "kind_of", "params_of", "problem_from_dict", "space_of"]
