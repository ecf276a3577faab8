"""Step 7: an Optuna study per problem over the tile space, pruning what cannot fit.

The loop uses Optuna's ask/tell so that `ahead` configurations are sampled (and handed
to the backend to compile) while the previous one is timed. Every outcome is told to
the study with user attributes `status` and `reason`: pruned configurations as PRUNED,
failures as FAIL, timed ones with their median ms; an error or timeout is tried once
more before it is final. Studies live in an RDB storage (SQLite by default), so running
the same search again continues it; a study is named by the problem and the space it
samples. Tuners may share a study: each keeps a heartbeat on the trials it holds, and a
trial whose tuner was killed (no heartbeat for a grace period) is failed and retried once.
"""
from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import optuna
import platformdirs
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from .backend import Backend, TrialResult
from .config import ConfigError, KernelConfig, space as config_space
from .problem import TuneProblem

PARAMS = ("block_m", "block_n", "num_warps", "num_stages")  # Optuna's parameter names = KernelConfig fields
FAMILY_PARAMS = {"sm80": PARAMS, "sm90": (*PARAMS, "overlap", "pingpong")}
SAMPLERS = ("tpe", "random")
RETRIED = ("error", "timeout")  # may pass on a second try (a busy or restarted GPU worker)

Params = tuple  # values of FAMILY_PARAMS[family], in order


def default_storage() -> str:
    """SQLite file in the user data dir: the same command finds its study again."""
    path = Path(platformdirs.user_data_dir("flashgen")) / "studies.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def _infeasible(t: FrozenTrial) -> list[float]:
    # Pruned trials count as infeasible, so TPE learns to avoid them instead of ranking them among the best.
    return [1.0 if t.user_attrs.get("status") == "pruned" else 0.0]


_TRIAL_CONSTRAINTS = hasattr(optuna.Trial, "set_constraint")  # Optuna >= 5; older ones take a constraints_func


def make_sampler(name: str, seed: int, ahead: int = 1) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        with warnings.catch_warnings():  # constant_liar and constraints are "experimental" in some versions
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # The liar keeps configurations asked ahead (still being compiled) from being sampled twice.
            return optuna.samplers.TPESampler(seed=seed, constant_liar=ahead > 1,
                                              constraints_func=None if _TRIAL_CONSTRAINTS else _infeasible)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler={name!r}; choose one of {', '.join(SAMPLERS)}")


@dataclass
class SearchOptions:
    trials: int = 60  # the study's total of evaluated (not pruned, not repeated) trials
    timeout_s: float | None = None  # for this run of this problem
    sampler: str = "tpe"
    seed: int = 0
    exhaustive: bool = False  # enumerate the whole (restricted) space instead of sampling
    storage: str | None = None  # SQLAlchemy URL; None: default_storage()
    ahead: int = 1  # configurations sampled and prefetched ahead of the one being timed
    heartbeat_s: int = 30  # a held trial's heartbeat; Optuna wants whole seconds
    grace_s: int = 120  # a trial without a heartbeat this long was held by a killed tuner: failed, retried once


@dataclass
class TrialRecord:
    """One told trial, as the progress display sees it."""

    number: int
    config: KernelConfig | None
    params: Params
    result: TrialResult
    duplicate_of: int | None = None


@dataclass
class SearchOutcome:
    problem: TuneProblem
    best_config: KernelConfig | None
    best: TrialResult | None
    default_config: KernelConfig
    default: TrialResult | None
    counts: Counter = field(default_factory=Counter)  # statuses of this study's trials
    trials: int = 0  # evaluated trials in the study (all runs)


def params_of(cfg: KernelConfig) -> Params:
    return tuple(getattr(cfg, p) for p in FAMILY_PARAMS[cfg.family])


def config_of(problem: TuneProblem, params: Params) -> KernelConfig:
    return KernelConfig(problem.head_dim, problem.dtype, problem.causal, family=problem.family,
                        **dict(zip(FAMILY_PARAMS[problem.family], params)))


def static_reason(problem: TuneProblem, params: Params, allowed: set[Params]) -> str | None:
    """Why this configuration is pruned before compiling, or None."""
    try:
        cfg = config_of(problem, params)
    except ConfigError as e:
        return str(e)
    if params not in allowed:
        return "outside the restricted search space"
    return cfg.unfit_reason(problem.gpu_arch)


def result_of(t: FrozenTrial) -> TrialResult:
    a = t.user_attrs
    return TrialResult(a["status"], a.get("ms"), a.get("tflops"), a.get("reason", ""), a.get("info", {}))


def _params(t: FrozenTrial, family: str) -> Params:
    return tuple(t.params[p] for p in FAMILY_PARAMS[family])


def _finished(study: optuna.Study) -> list[FrozenTrial]:
    # Trials without a status were abandoned (the tuner was killed or timed out holding them).
    return [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and "status" in t.user_attrs]


def _tell(study: optuna.Study, trial: optuna.Trial, res: TrialResult, duplicate_of: int | None = None) -> None:
    trial.set_user_attr("status", res.status)
    if _TRIAL_CONSTRAINTS:
        trial.set_constraint("pruned", 1.0 if res.status == "pruned" else 0.0)
    trial.set_user_attr("reason", res.reason)
    if res.ok:
        trial.set_user_attr("ms", res.ms)
        trial.set_user_attr("tflops", res.tflops)
    if res.info:
        trial.set_user_attr("info", res.info)
    if duplicate_of is not None:
        trial.set_user_attr("duplicate_of", duplicate_of)
    if res.ok:
        study.tell(trial, res.ms)
    else:
        study.tell(trial, state=TrialState.PRUNED if res.status == "pruned" else TrialState.FAIL)


def study_name(problem: TuneProblem, space: list[KernelConfig]) -> str:
    """The problem's study, named by a digest of the space it samples: Optuna fixes the value sets
    of a study, so a restricted space or changed fit rules (arch limits, register or shared-memory
    formulas) open a study of their own instead of failing on resume."""
    allowed = sorted(params_of(c) for c in space)
    viable = [p for c, p in zip(space, map(params_of, space)) if c.unfit_reason(problem.gpu_arch) is None]
    digest = hashlib.sha1(repr((allowed, sorted(viable))).encode()).hexdigest()[:8]
    return f"{problem.study_name}@space-{digest}"


def make_storage(opts: SearchOptions) -> optuna.storages.RDBStorage:
    """The RDB storage with heartbeats: a trial whose tuner stopped beating for `grace_s` is failed
    and queued again once; the live trials of other tuners sharing the study are left alone."""
    stale = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)  # Optuna >= 4.9
    with warnings.catch_warnings():  # heartbeats are "experimental"
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        callback = {"heartbeat_stale_trial_callback": stale(max_retry=1)} if stale else \
            {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}
        return optuna.storages.RDBStorage(opts.storage or default_storage(), heartbeat_interval=opts.heartbeat_s,
                                          grace_period=opts.grace_s, **callback)


def open_study(problem: TuneProblem, opts: SearchOptions, name: str | None = None) -> optuna.Study:
    """The problem's study (`name`, by default that of its whole space), created if new; trials
    of killed tuners (no heartbeat for `opts.grace_s`) are failed and queued again."""
    if name is None:
        name = study_name(problem, config_space(problem.family, problem.head_dim, problem.dtype, problem.causal))
    study = optuna.create_study(study_name=name, storage=make_storage(opts),
                                sampler=make_sampler(opts.sampler, opts.seed, opts.ahead), direction="minimize",
                                load_if_exists=True)
    if "problem" not in study.user_attrs:
        study.set_user_attr("problem", problem.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return study


class _Heartbeat:
    """Records the heartbeat of the trials this process holds (asked, not yet told), in a thread,
    so that they stay alive through long compiles and timings."""

    def __init__(self, study: optuna.Study, interval_s: float):
        self._storage, self._interval = study._storage, interval_s
        self._held: set[int] = set()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashgen-heartbeat", daemon=True)
        self._thread.start()

    def hold(self, trial: optuna.Trial) -> None:
        self._storage.record_heartbeat(trial._trial_id)  # a trial never beaten is never found stale
        with self._lock:
            self._held.add(trial._trial_id)

    def release(self, trial: optuna.Trial) -> None:
        with self._lock:
            self._held.discard(trial._trial_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                held = list(self._held)
            for trial_id in held:
                try:
                    self._storage.record_heartbeat(trial_id)
                except Exception as e:  # noqa: BLE001 - a missed beat is retried at the next one
                    warnings.warn(f"heartbeat of trial {trial_id} not recorded: {e}", stacklevel=1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def evaluate(backend: Backend, cfg: KernelConfig, problem: TuneProblem) -> TrialResult:
    """The backend's result, with a transient failure (RETRIED) tried once more before it is final:
    a configuration is never timed twice, so a first error would otherwise stay for good."""
    res = backend.evaluate(cfg, problem)
    if res.status not in RETRIED:
        return res
    again = backend.evaluate(cfg, problem)
    return replace(again, info={**again.info, "first_try": f"{res.status}: {res.reason}"})


def search(problem: TuneProblem, backend: Backend, opts: SearchOptions, space: list[KernelConfig] | None = None,
           on_trial: Callable[[TrialRecord], Any] | None = None) -> SearchOutcome:
    """Run (or continue) the study of `problem` until it holds `opts.trials` evaluated trials,
    the space is exhausted, or `opts.timeout_s` passes."""
    space = space if space is not None else config_space(problem.family, problem.head_dim, problem.dtype, problem.causal)
    allowed = {params_of(c) for c in space}
    viable = {params_of(c) for c in space if c.unfit_reason(problem.gpu_arch) is None}
    # Sample only values some fitting configuration has: fewer combinations to prune.
    names = FAMILY_PARAMS[problem.family]
    dists = {p: CategoricalDistribution(sorted({v[i] for v in viable or allowed})) for i, p in enumerate(names)}
    if not viable and not allowed:
        raise ValueError(f"the search space of {problem.key} is empty")
    study = open_study(problem, opts, study_name(problem, space))
    seen: dict[Params, FrozenTrial] = {}
    for t in _finished(study):
        seen.setdefault(_params(t, problem.family), t)
    evaluated = sum(1 for t in _finished(study) if _counts(t))
    default = problem.default_config()
    queued: set[Params] = set()

    def enqueue(params: Params) -> None:
        if params not in seen and params not in queued and all(v in dists[p].choices for p, v in zip(names, params)):
            study.enqueue_trial(dict(zip(names, params)), skip_if_exists=True)
            queued.add(params)

    enqueue(params_of(default))  # the default is measured first: the figure tuned kernels are compared with
    if opts.exhaustive:
        for c in space:
            enqueue(params_of(c))
    budget = len(viable - set(seen)) if opts.exhaustive else opts.trials - evaluated
    max_asks = 5 * max(budget, 0) + 2 * len(allowed) + 16  # TPE repeating itself must not loop forever
    start, asks, done = time.monotonic(), 0, 0
    pending: deque[tuple[optuna.Trial, Params]] = deque()
    current: optuna.Trial | None = None  # the trial being evaluated
    heart = _Heartbeat(study, opts.heartbeat_s)

    def out_of_time() -> bool:
        return opts.timeout_s is not None and time.monotonic() - start > opts.timeout_s

    def exhausted() -> bool:
        return viable <= set(seen) | {p for _, p in pending}

    try:
        while True:
            while (len(pending) < min(max(1, opts.ahead), budget - done) and asks < max_asks
                   and not exhausted() and not out_of_time()):
                with warnings.catch_warnings():  # "heartbeat ... supposed to be used with Study.optimize": see _Heartbeat
                    warnings.filterwarnings("ignore", message="Heartbeat of storage")
                    trial, asks = study.ask(dists), asks + 1
                heart.hold(trial)
                params = tuple(trial.params[p] for p in names)
                reason = static_reason(problem, params, allowed)  # type: ignore[arg-type]
                if reason is not None:
                    res = TrialResult("pruned", reason=reason)
                    _tell(study, trial, res)
                    heart.release(trial)
                    seen.setdefault(params, study.trials[trial.number])  # type: ignore[arg-type]
                    _report(on_trial, trial.number, None, params, res)  # type: ignore[arg-type]
                    continue
                pending.append((trial, params))  # type: ignore[arg-type]
                backend.prefetch([config_of(problem, params)], problem)  # type: ignore[arg-type]
            if not pending or out_of_time():
                break
            trial, params = pending.popleft()
            current = trial
            cfg = config_of(problem, params)
            prev = seen.get(params)
            if prev is not None:  # never time a configuration twice in one study
                res = result_of(prev)
                _tell(study, trial, res, duplicate_of=prev.number)
                heart.release(trial)
                current = None
                _report(on_trial, trial.number, cfg, params, res, prev.number)
                continue
            res = evaluate(backend, cfg, problem)
            _tell(study, trial, res)
            heart.release(trial)
            current = None
            seen[params] = study.trials[trial.number]
            done += 1
            _report(on_trial, trial.number, cfg, params, res)
    finally:
        heart.stop()
        for trial in [t for t, _ in pending] + [current] * (current is not None):
            # asked but never evaluated (timeout, Ctrl-C): closed without a status, not left to go stale
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    default_res = seen.get(params_of(default))
    if default_res is None and params_of(default) not in allowed:  # outside a restricted space: measure it aside
        default_res_value: TrialResult | None = evaluate(backend, default, problem)
    else:
        default_res_value = result_of(default_res) if default_res is not None else None
    return outcome(study, problem, default, default_res_value)


def _counts(t: FrozenTrial) -> bool:
    """Whether a finished trial counts toward the budget: evaluated, not pruned, not a repeat."""
    return t.user_attrs.get("status") != "pruned" and "duplicate_of" not in t.user_attrs


def _report(on_trial: Callable[[TrialRecord], Any] | None, number: int, cfg: KernelConfig | None, params: Params,
            res: TrialResult, duplicate_of: int | None = None) -> None:
    if on_trial is not None:
        on_trial(TrialRecord(number, cfg, params, res, duplicate_of))


def outcome(study: optuna.Study, problem: TuneProblem, default: KernelConfig,
            default_res: TrialResult | None = None) -> SearchOutcome:
    """The best verified trial of a study, with counts of every status."""
    finished = _finished(study)
    counts = Counter(t.user_attrs["status"] for t in finished if "duplicate_of" not in t.user_attrs)
    ok = [t for t in finished if t.user_attrs["status"] == "ok"]
    best = min(ok, key=lambda t: t.user_attrs["ms"], default=None)
    if default_res is None:
        d = next((t for t in finished if _params(t, problem.family) == params_of(default)), None)
        default_res = result_of(d) if d is not None else None
    return SearchOutcome(problem, config_of(problem, _params(best, problem.family)) if best else None,
                         result_of(best) if best else None, default, default_res, counts,
                         sum(1 for t in finished if _counts(t)))
