"""Step 7: an Optuna study per problem over its space of candidates, pruning what cannot fit.

Problems of every kind (dense forward / backward, decode, varlen) are searched alike: what the search needs of
one (its parameters, candidates, default, figures) is its kind's in flashgen.tunable.

The loop uses Optuna's ask/tell so that `ahead` configurations are sampled (and handed
to the backend to compile) while the previous one is timed. Every outcome is told to
the study with user attributes `status` and `reason`: pruned configurations as PRUNED,
failures as FAIL, timed ones with their median ms; an error or timeout is tried once
more before it is final. Studies live in an Optuna storage (SQLite by default, a database
server or a journal file for a fleet: `studies`), so running the same search again
continues it; a study is named by the problem and the space it samples.

A halving search (`SearchOptions.halving_eta`) times every fitting configuration briefly and the fastest of
each rung again with more calls (flashgen.halving): its study (the space's, named "...@halving") records each
measurement as a trial with its rung (user attribute `rung`), so a rerun continues from the recorded rungs, and
the trials of rungs above 0 are re-measurements: they count neither toward the trials nor the statuses.

Tuners anywhere may share a study; each asks for its next trial. Each keeps a heartbeat on
the trials it holds, and a trial whose tuner died (no heartbeat for a grace period) is
failed and retried once by another. The budget counts the trials other tuners hold, and
a configuration is timed once per study: before timing, a tuner reads the study again and
takes the result of an earlier trial of the same configuration, waiting for it if another
tuner holds it.
"""
from __future__ import annotations

import hashlib
import threading
import time
import warnings
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from .backend import Backend, TrialResult, tflops
from .config import SM90_KNOBS, BwdConfig, ConfigError, KernelConfig
from .halving import RUNG0_REPS, Schedule
from .problem import DEFAULT_TRIALS, EXHAUSTIVE_MAX, Rule
from .tunable import BWD_PARAMS, FAMILY_PARAMS, PARAMS, params_of  # noqa: F401 - re-exported
from .tunable import Candidate, Problem, kind_of
from .studies import default_storage, make_storage as open_storage  # noqa: F401 - default_storage: re-exported

SAMPLERS = ("tpe", "random")
RETRIED = ("error", "timeout")  # may pass on a second try (a busy or restarted GPU worker)
POLL_S = 0.25  # how often a tuner waiting for another's trial reads the study
PARAMS_WAIT_S = 10.0  # a running trial without parameters is being sampled: wait this long for them
OWNER_WAIT_S = 20 * 60.0  # an earlier trial of the same configuration that neither ends nor goes stale: ignored

Params = tuple  # values of FAMILY_PARAMS[family], in order
AnyConfig = Candidate  # a configuration, a decode (config, num_splits) pair, or a Rule (see flashgen.tunable)


def _infeasible(t: FrozenTrial) -> list[float]:
    # Pruned trials count as infeasible, so TPE learns to avoid them instead of ranking them among the best.
    return [1.0 if t.user_attrs.get("status") == "pruned" else 0.0]


_TRIAL_CONSTRAINTS = hasattr(optuna.Trial, "set_constraint")  # Optuna >= 5; older ones take a constraints_func


def make_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        with warnings.catch_warnings():  # constant_liar and constraints are "experimental" in some versions
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # The liar keeps configurations held (asked ahead and being compiled, or timed by another
            # tuner of the study) from being sampled again; with no trial held it changes nothing.
            return optuna.samplers.TPESampler(seed=seed, constant_liar=True,
                                              constraints_func=None if _TRIAL_CONSTRAINTS else _infeasible)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler={name!r}; choose one of {', '.join(SAMPLERS)}")


@dataclass
class SearchOptions:
    trials: int = DEFAULT_TRIALS  # the study's total of evaluated (not pruned, not repeated) trials
    timeout_s: float | None = None  # for this run of this problem
    sampler: str = "tpe"
    seed: int = 0
    exhaustive: bool | None = False  # enumerate the whole (restricted) space instead of sampling; None: per
    # problem, exhaustive when its fitting configurations are at most EXHAUSTIVE_MAX (see `exhaustive_for`)
    storage: str | None = None  # URL or path (see `studies`); None: default_storage()
    ahead: int = 1  # configurations sampled and prefetched ahead of the one being timed
    heartbeat_s: int = 30  # a held trial's heartbeat; Optuna wants whole seconds
    grace_s: int = 120  # a trial without a heartbeat this long was held by a killed tuner: failed, retried once
    worker: str = ""  # this tuner's name (host:pid/gpu), recorded with its trials and mixed into the sampler's
    # seed: tuners sharing a study must not all propose the same sequence
    versions: dict[str, str] = field(default_factory=dict)  # nvcc, driver: recorded with each timed trial
    stop: threading.Event | None = None  # when set: stop after the trial being evaluated (a fleet's Ctrl-C)
    retime_top: int = 5  # the fastest verified configurations timed again side by side before the outcome (0: none)
    retime_rounds: int = 3
    halving_eta: int = 0  # > 0: a successive-halving search of the whole (restricted) space keeping 1/eta per rung
    # (flashgen.halving); one tuner only. 0: sampled or exhaustive as `exhaustive` says
    halving_reps: int = RUNG0_REPS  # the timed calls of a rung-0 measurement; eta times more each rung

    @property
    def halving(self) -> Schedule | None:
        """The rungs of a halving search (it ends once at most `retime_top` configurations, or one, remain)."""
        return Schedule(self.halving_eta, self.halving_reps, max(1, self.retime_top)) if self.halving_eta else None

    @property
    def sampler_seed(self) -> int:
        return zlib.crc32(f"{self.seed}/{self.worker}".encode()) if self.worker else self.seed


@dataclass
class TrialRecord:
    """One told trial, as the progress display sees it."""

    number: int
    config: AnyConfig | None
    params: Params
    result: TrialResult
    duplicate_of: int | None = None
    rung: int | None = None  # a halving search's rung (None: any other search)
    rung_size: int = 0  # the configurations of that rung
    rung_done: int = 0  # of which measured, this one included


@dataclass
class SearchOutcome:
    problem: Problem
    best_config: AnyConfig | None
    best: TrialResult | None
    default_config: AnyConfig
    default: TrialResult | None
    counts: Counter = field(default_factory=Counter)  # statuses of this study's trials
    trials: int = 0  # evaluated trials in the study (all runs)
    in_flight: int = 0  # trials other tuners still hold in an unfinished study: come back for it later
    versions: dict[str, str] = field(default_factory=dict)  # those the best trial was timed with


def params_key(problem: Problem) -> str:
    """The FAMILY_PARAMS entry of a problem: its family (a forward or varlen problem), "bwd_<family>" (a backward
    one) or "decode"."""
    return kind_of(problem).key(problem)


def params_for(problem: Problem, cand: AnyConfig) -> Params:
    """A candidate's parameter values in the problem's study."""
    return kind_of(problem).params_of(problem, cand)


def config_of(problem: Problem, params: Params) -> AnyConfig:
    """The candidate of parameter values (raises ConfigError for values no configuration has)."""
    return kind_of(problem).candidate(problem, params)


def problem_space(problem: Problem) -> list[AnyConfig]:
    """The whole space of a problem (arch fit not checked)."""
    return kind_of(problem).space(problem)


def _unfit(problem: Problem, cand: AnyConfig) -> str | None:
    return kind_of(problem).unfit_reason(problem, cand)


def viable_count(problem: Problem, space: list[AnyConfig] | None = None) -> int:
    """How many configurations of `space` (default: the problem's) fit the problem's GPU."""
    space = problem_space(problem) if space is None else space
    return sum(1 for c in space if _unfit(problem, c) is None)


def exhaustive_for(problem: Problem, opts: SearchOptions, space: list[AnyConfig] | None = None) -> bool:
    """Whether the search of `problem` enumerates its space: `opts.exhaustive` when given, else
    (None) when at most EXHAUSTIVE_MAX configurations fit, where sampling saves little and may miss the best."""
    if opts.exhaustive is not None:
        return opts.exhaustive
    return viable_count(problem, space) <= EXHAUSTIVE_MAX


def static_reason(problem: Problem, params: Params, allowed: set[Params]) -> str | None:
    """Why this configuration is pruned before compiling, or None."""
    try:
        cfg = config_of(problem, params)
    except ConfigError as e:
        return str(e)
    if params not in allowed:
        return "outside the restricted search space"
    return _unfit(problem, cfg)


def result_of(t: FrozenTrial) -> TrialResult:
    a = t.user_attrs
    return TrialResult(a["status"], a.get("ms"), a.get("tflops"), a.get("reason", ""), a.get("info", {}))


# Knobs added after studies may have been stored (every sm90 knob after the first three): a finished trial without
# one ran with its default (off: False, or 0 for a knob of several choices).
LATE_KNOBS = {f.name: f.default for f in fields(KernelConfig)
              if f.name in SM90_KNOBS[SM90_KNOBS.index("overlap_epilogue"):]}
# The same for the sm90 backward: its knobs after num_stages and stagger.
LATE_BWD_KNOBS = {f.name: f.default for f in fields(BwdConfig) if f.name in ("dq_tma", "lse_ahead")}
# The same for decode: the fused combine and the key split.
LATE_DECODE_KNOBS = {"fused_combine": False, "key_warps": 1}


def _params(t: FrozenTrial, family: str) -> Params:
    late = LATE_BWD_KNOBS if family.startswith("bwd_") else LATE_DECODE_KNOBS if family == "decode" else LATE_KNOBS
    return tuple(t.params[p] if p in t.params or p not in late else late[p] for p in FAMILY_PARAMS[family])


def _params_or_none(t: FrozenTrial, family: str) -> Params | None:
    """A trial's configuration, or None while it is being sampled (its parameters are set one by one)."""
    names = FAMILY_PARAMS[family]
    return tuple(t.params[p] for p in names) if all(p in t.params for p in names) else None


def _finished(study: optuna.Study) -> list[FrozenTrial]:
    # Trials without a status were abandoned (the tuner was killed or timed out holding them).
    return [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and "status" in t.user_attrs]


def _tell(study: optuna.Study, trial: optuna.Trial, res: TrialResult, duplicate_of: int | None = None,
          opts: SearchOptions | None = None) -> None:
    try:
        trial.set_user_attr("status", res.status)
    except optuna.exceptions.UpdateFinishedTrialError:
        # Another tuner found it stale (this process missed heartbeats for the grace period) and
        # queued it again: its retry times the configuration.
        warnings.warn(f"trial {trial.number} of {study.study_name} was failed as stale while this tuner held it; "
                      "its retry times it again (raise the grace period if this tuner is starved)", stacklevel=2)
        return
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
    elif opts is not None and opts.versions and res.status != "pruned":
        trial.set_user_attr("versions", opts.versions)
    if res.ok:
        study.tell(trial, res.ms, skip_if_finished=True)
    else:
        study.tell(trial, state=TrialState.PRUNED if res.status == "pruned" else TrialState.FAIL, skip_if_finished=True)


def study_name(problem: Problem, space: list[AnyConfig]) -> str:
    """The problem's study, named by a digest of the space it samples: Optuna fixes the value sets
    of a study, so a restricted space or changed fit rules (arch limits, register or shared-memory
    formulas) open a study of their own instead of failing on resume."""
    allowed = sorted(params_for(problem, c) for c in space)
    viable = [params_for(problem, c) for c in space if _unfit(problem, c) is None]
    digest = hashlib.sha1(repr((allowed, sorted(viable))).encode()).hexdigest()[:8]
    return f"{problem.study_name}@space-{digest}"


def make_storage(opts: SearchOptions) -> optuna.storages.BaseStorage:
    """The study storage of `opts`, with heartbeats: a trial whose tuner stopped beating for
    `grace_s` is failed and queued again once; the live trials of other tuners are left alone."""
    return open_storage(opts.storage, opts.heartbeat_s, opts.grace_s)


def fail_stale_trials(study: optuna.Study) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def open_study(problem: Problem, opts: SearchOptions, name: str | None = None) -> optuna.Study:
    """The problem's study (`name`, by default that of its whole space), created if new; trials
    of killed tuners (no heartbeat for `opts.grace_s`) are failed and queued again."""
    if name is None:
        name = study_name(problem, problem_space(problem))
    study = optuna.create_study(study_name=name, storage=make_storage(opts),
                                sampler=make_sampler(opts.sampler, opts.sampler_seed), direction="minimize",
                                load_if_exists=True)
    if "problem" not in study.user_attrs:
        study.set_user_attr("problem", problem.to_dict())
    fail_stale_trials(study)
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


def evaluate(backend: Backend, cfg: AnyConfig, problem: Problem, reps: int | None = None) -> TrialResult:
    """The backend's result, with a transient failure (RETRIED) tried once more before it is final:
    a configuration is never timed twice, so a first error would otherwise stay for good. `reps`: the
    timed calls (None: the backend's own number; only then is a backend asked without it)."""
    def once() -> TrialResult:
        return backend.evaluate(cfg, problem) if reps is None else backend.evaluate(cfg, problem, reps=reps)

    res = once()
    if res.status not in RETRIED:
        return res
    again = once()
    return replace(again, info={**again.info, "first_try": f"{res.status}: {res.reason}"})


@dataclass
class _View:
    """The study as one tuner needs it, read afresh: other tuners add to it all the time."""

    done: dict[Params, FrozenTrial]  # per configuration, the trial whose result stands (told with a status)
    counted: int  # finished trials that count toward the budget
    held: dict[int, Params | None]  # running trials (any tuner's) by id: their configuration, None while sampled


def _view(study: optuna.Study, family: str) -> _View:
    done: dict[Params, FrozenTrial] = {}
    counted, held = 0, {}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.RUNNING:
            held[t._trial_id] = _params_or_none(t, family)
        elif t.state.is_finished() and "status" in t.user_attrs:
            done.setdefault(_params(t, family), t)  # trials are in order: a duplicate never shadows its source
            counted += _counts(t)
    return _View(done, counted, held)


def _owner(study: optuna.Study, trial: optuna.Trial, params: Params, family: str, opts: SearchOptions,
           stopped: Callable[[], bool]) -> FrozenTrial | None:
    """The trial whose result `trial` takes instead of timing its configuration again: a finished
    one of the same configuration, or an earlier running one (another tuner's), waited for. None:
    this trial times it. Earlier trials still being sampled are waited for too: they may turn out to
    be this configuration. While waiting, trials of dead tuners are failed, so a wait ends."""
    start = time.monotonic()
    next_check = start + opts.heartbeat_s
    while True:
        view = _view(study, family)
        if params in view.done:
            return view.done[params]
        waited = time.monotonic() - start
        earlier = [p for i, p in view.held.items() if i < trial._trial_id
                   and ((p == params and waited < OWNER_WAIT_S) or (p is None and waited < PARAMS_WAIT_S))]
        if not earlier or stopped():
            return None
        time.sleep(POLL_S)
        if time.monotonic() > next_check:
            fail_stale_trials(study)
            next_check = time.monotonic() + opts.heartbeat_s


def distributions(problem: Problem, space: list[AnyConfig]) -> dict[str, CategoricalDistribution]:
    """What the study samples: per parameter, the values some fitting configuration of `space` has
    (fewer combinations to prune), or those of the whole space when none fits."""
    allowed = {params_for(problem, c) for c in space}
    viable = {params_for(problem, c) for c in space if _unfit(problem, c) is None}
    return {p: CategoricalDistribution(sorted({v[i] for v in viable or allowed}))
            for i, p in enumerate(FAMILY_PARAMS[params_key(problem)])}


ASIDE = "default"  # the key of the default measured aside among the re-timed figures (the others: trial numbers)


def default_aside(study: optuna.Study, default: AnyConfig) -> TrialResult | None:
    """The default's result measured outside a restricted space, as recorded in the study."""
    rec = study.user_attrs.get("default_aside")
    return TrialResult(**rec["result"]) if isinstance(rec, dict) and rec.get("kernel") == default.name else None


def search(problem: Problem, backend: Backend, opts: SearchOptions, space: list[AnyConfig] | None = None,
           on_trial: Callable[[TrialRecord], Any] | None = None) -> SearchOutcome:
    """Run (or continue, or join) the study of `problem` until it holds `opts.trials` evaluated trials
    (those other tuners hold count), the space is exhausted, or `opts.timeout_s` passes. When other
    tuners still hold trials of an unfinished study, `in_flight` of the outcome says how many."""
    space = space if space is not None else problem_space(problem)
    opts = replace(opts, exhaustive=exhaustive_for(problem, opts, space))
    if not space:
        raise ValueError(f"the search space of {problem.key} is empty")
    if opts.halving is not None:
        return _halving_search(problem, backend, opts, space, on_trial)
    allowed = {params_for(problem, c) for c in space}
    viable = {params_for(problem, c) for c in space if _unfit(problem, c) is None}
    kind = params_key(problem)
    names = FAMILY_PARAMS[kind]
    dists = distributions(problem, space)
    study = open_study(problem, opts, study_name(problem, space))
    view = _view(study, kind)
    default = kind_of(problem).default(problem)
    queued: set[Params] = set()

    def enqueue(params: Params) -> None:
        if params not in view.done and params not in queued and all(v in dists[p].choices for p, v in zip(names, params)):
            study.enqueue_trial(dict(zip(names, params)), skip_if_exists=True)
            queued.add(params)

    enqueue(params_for(problem, default))  # the default is measured first: the figure tuned kernels are compared with
    if opts.exhaustive:
        for c in space:
            enqueue(params_for(problem, c))

    def open_configs(v: _View) -> set[Params]:  # viable, neither done nor held by any tuner
        return viable - set(v.done) - set(v.held.values())

    def claimed(v: _View) -> int:  # evaluated, or held by a tuner and to be evaluated
        return v.counted + len({p for p in v.held.values() if p in viable and p not in v.done})

    def wanted(v: _View) -> bool:
        return bool(open_configs(v)) and (opts.exhaustive or claimed(v) < opts.trials)

    budget = len(viable - set(view.done)) if opts.exhaustive else opts.trials - claimed(view)
    max_asks = 5 * max(budget, 0) + 2 * len(allowed) + 16  # TPE repeating itself must not loop forever
    start, asks = time.monotonic(), 0
    pending: deque[tuple[optuna.Trial, Params]] = deque()
    current: optuna.Trial | None = None  # the trial being evaluated
    heart = _Heartbeat(study, opts.heartbeat_s)

    def out_of_time() -> bool:
        return opts.timeout_s is not None and time.monotonic() - start > opts.timeout_s

    def stopped() -> bool:
        return out_of_time() or (opts.stop is not None and opts.stop.is_set())

    def tell(trial: optuna.Trial, cfg: AnyConfig | None, params: Params, res: TrialResult,
             duplicate_of: int | None = None) -> None:
        _tell(study, trial, res, duplicate_of, opts)
        heart.release(trial)
        _report(on_trial, trial.number, cfg, params, res, duplicate_of)

    try:
        while True:
            while len(pending) < max(1, opts.ahead) and asks < max_asks and not stopped():
                if not wanted(_view(study, kind)):
                    break
                with warnings.catch_warnings():  # "heartbeat ... supposed to be used with Study.optimize": see _Heartbeat
                    warnings.filterwarnings("ignore", message="Heartbeat of storage")
                    trial, asks = study.ask(dists), asks + 1
                heart.hold(trial)
                if opts.worker:
                    trial.set_user_attr("worker", opts.worker)
                params = tuple(trial.params[p] for p in names)
                reason = static_reason(problem, params, allowed)  # type: ignore[arg-type]
                if reason is not None:
                    tell(trial, None, params, TrialResult("pruned", reason=reason))  # type: ignore[arg-type]
                    continue
                pending.append((trial, params))  # type: ignore[arg-type]
                backend.prefetch([config_of(problem, params)], problem)  # type: ignore[arg-type]
            if not pending or stopped():
                break
            trial, params = pending.popleft()
            current = trial
            cfg = config_of(problem, params)
            prev = _owner(study, trial, params, kind, opts, stopped)
            if stopped():
                break
            if prev is not None:  # never time a configuration twice in one study
                tell(trial, cfg, params, result_of(prev), prev.number)
            else:
                res = evaluate(backend, cfg, problem)
                if opts.stop is not None and opts.stop.is_set() and not res.ok:
                    break  # Ctrl-C reaches the GPU worker too: its death is not the kernel's failure
                tell(trial, cfg, params, res)
            current = None
    finally:
        heart.stop()
        for trial in [t for t, _ in pending] + [current] * (current is not None):
            # asked but never evaluated (timeout, Ctrl-C): closed without a status, not left to go stale
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    # Trials other tuners still hold (budget met or not) will change the outcome: come back for them.
    in_flight = 0 if stopped() or asks >= max_asks else len(_view(study, kind).held)
    return _conclude(study, problem, backend, opts, default, allowed, view.done.get(params_for(problem, default)),
                     stopped(), in_flight)


def _conclude(study: optuna.Study, problem: Problem, backend: Backend, opts: SearchOptions, default: AnyConfig,
              allowed: set[Params], default_res: FrozenTrial | None, stopped: bool, in_flight: int,
              lead: list[FrozenTrial] | None = None) -> SearchOutcome:
    """The outcome of a search run: the default measured aside where the space lacks it, the leaders (`lead`, by
    default the fastest verified trials) re-timed once the study is complete, and the study's best."""
    if default_res is not None:
        default_value: TrialResult | None = result_of(default_res)
    elif params_for(problem, default) not in allowed:  # outside a restricted space: measured aside, once per study,
        default_value = default_aside(study, default)  # by a tuner leaving it finished
        if default_value is None and not stopped and not in_flight:
            default_value = evaluate(backend, default, problem)
            study.set_user_attr("default_aside", {"kernel": default.name, "result": default_value.to_dict()})
    else:
        default_value = None
    if not stopped and not in_flight and opts.retime_top > 0:
        retime_leaders(study, problem, backend, opts, default, lead)
    out = outcome(study, problem, default, default_value)
    out.in_flight = in_flight
    return out


def _rung(t: FrozenTrial) -> int:
    return t.user_attrs.get("rung", 0)


def _record(study: optuna.Study, dists: dict[str, CategoricalDistribution], params: Params, res: TrialResult,
            attrs: dict[str, Any]) -> None:
    """A measurement told to the study as a finished trial (a halving search holds none while it measures: a
    measurement interrupted before it is recorded is simply taken again)."""
    user_attrs: dict[str, Any] = {"status": res.status, "reason": res.reason, **attrs}
    if res.ok:
        user_attrs.update(ms=res.ms, tflops=res.tflops)
    if res.info:
        user_attrs["info"] = res.info
    state = TrialState.COMPLETE if res.ok else TrialState.PRUNED if res.status == "pruned" else TrialState.FAIL
    study.add_trial(optuna.trial.create_trial(params=dict(zip(dists, params)), distributions=dists, state=state,
                                              value=res.ms if res.ok else None, user_attrs=user_attrs))


def halving_study_name(problem: Problem, space: list[AnyConfig]) -> str:
    """A halving search's study: its short measurements stay out of the sampled and exhaustive studies' ranking."""
    return f"{study_name(problem, space)}@halving"


def _halving_search(problem: Problem, backend: Backend, opts: SearchOptions, space: list[AnyConfig],
                    on_trial: Callable[[TrialRecord], Any] | None) -> SearchOutcome:
    """Successive halving over the fitting configurations of `space` (flashgen.halving), continuing from the
    measurements its study records: a configuration measured at a rung is never measured there again. Once the
    last rung is timed, its configurations are the leaders the retime ranks."""
    sched = opts.halving
    assert sched is not None
    kind = params_key(problem)
    allowed = {params_for(problem, c) for c in space}
    order = list(dict.fromkeys(params_for(problem, c) for c in space if _unfit(problem, c) is None))
    dists = distributions(problem, space)
    study = open_study(problem, opts, halving_study_name(problem, space))
    default = kind_of(problem).default(problem)
    measured: dict[int, dict[Params, TrialResult]] = {}
    recorded = study.get_trials(deepcopy=False)
    for t in recorded:
        if t.state.is_finished() and "status" in t.user_attrs:
            measured.setdefault(_rung(t), {}).setdefault(_params(t, kind), result_of(t))
    number, start = len(recorded), time.monotonic()
    ahead = max(1, opts.ahead)
    attrs: dict[str, Any] = {"worker": opts.worker} if opts.worker else {}
    if opts.versions:
        attrs["versions"] = opts.versions

    def stopped() -> bool:
        return (opts.timeout_s is not None and time.monotonic() - start > opts.timeout_s) or (
            opts.stop is not None and opts.stop.is_set())

    cands, rung, timed, finished = order, 0, [], False
    while not stopped():
        done = measured.setdefault(rung, {})
        todo = [p for p in cands if p not in done]
        reps = sched.reps(rung)
        if todo:
            backend.prefetch([config_of(problem, p) for p in todo[:ahead]], problem)
        for i, params in enumerate(todo):
            if stopped():
                break
            if i + ahead < len(todo):  # compiles ahead of the one being timed (rung 0: the only compiles)
                backend.prefetch([config_of(problem, todo[i + ahead])], problem)
            cfg = config_of(problem, params)
            res = evaluate(backend, cfg, problem, reps)
            if opts.stop is not None and opts.stop.is_set() and not res.ok:
                break  # Ctrl-C reaches the GPU worker too: its death is not the kernel's failure
            _record(study, dists, params, res, {**attrs, "rung": rung, "reps": reps})
            done[params] = res
            _report(on_trial, number, cfg, params, res, rung=rung, rung_size=len(cands),
                    rung_done=len(cands) - len(todo) + i + 1)
            number += 1
        if any(p not in done for p in cands):
            break
        timed = [(p, done[p].ms) for p in cands if done[p].ok]
        if sched.finished(len(timed)):
            finished = True
            break
        cands, rung = sched.promoted(timed), rung + 1
    lead: list[FrozenTrial] = []
    if finished:
        last = {p for p, _ in timed}
        for t in _verified(study):
            if _rung(t) == rung and _params(t, kind) in last and all(_params(t, kind) != _params(x, kind) for x in lead):
                lead.append(t)
    # The default's figure is left to `outcome`: its re-timed or highest rung's, not its rung-0 one.
    return _conclude(study, problem, backend, opts, default, allowed, None, not finished, 0, lead)


def _verified(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in _finished(study) if t.user_attrs["status"] == "ok" and "duplicate_of" not in t.user_attrs]


def _retimed(study: optuna.Study, ok: list[FrozenTrial]) -> dict[str, float]:
    """The study's re-timed figures (trial number -> ms), if they were taken after its last verified trial."""
    rec = study.user_attrs.get("retimed")
    return rec["ms"] if isinstance(rec, dict) and rec.get("verified") == len(ok) else {}


def retime_leaders(study: optuna.Study, problem: Problem, backend: Backend, opts: SearchOptions,
                   default: AnyConfig, lead: list[FrozenTrial] | None = None) -> None:
    """Time the `retime_top` fastest verified configurations (and the default, the figure they are compared
    with) again in interleaved rounds on one input set, and record the figures in the study (user attribute
    "retimed"), which `outcome` then ranks by. Each trial's figure is one median of a few dozen calls; among
    hundreds, the fastest is often one that a clock or the GPU's state favoured (single medians of one
    kernel moved by up to 15%: docs/performance.md). Done once per set of verified trials. `lead`: the trials
    to re-time instead of the fastest (a halving search's last rung)."""
    ok = _verified(study)
    if len(ok) < 2 or _retimed(study, ok) or not hasattr(backend, "retime"):
        return
    kind = params_key(problem)
    if lead is None:
        lead = sorted(ok, key=lambda t: (t.user_attrs["ms"], t.number))[:opts.retime_top]
    lead = list(lead)
    dflt = next((t for t in ok if _params(t, kind) == params_for(problem, default)), None)
    lead += [dflt] if dflt is not None and all(_params(t, kind) != _params(dflt, kind) for t in lead) else []
    # A serving problem's untuned choice (a Rule, always measured outside the space) is timed beside them too.
    aside = default_aside(study, default) if dflt is None and isinstance(default, Rule) else None
    cands = [config_of(problem, _params(t, kind)) for t in lead] + ([default] if aside is not None and aside.ok else [])
    ms = backend.retime(cands, problem, opts.retime_rounds)
    timed = {str(t.number): m for t, m in zip(lead, ms) if m is not None}
    if len(cands) > len(lead) and ms[-1] is not None:
        timed[ASIDE] = ms[-1]
    if len(timed) - (ASIDE in timed) >= 2:
        study.set_user_attr("retimed", {"verified": len(ok), "rounds": opts.retime_rounds, "ms": timed})


def _counts(t: FrozenTrial) -> bool:
    """Whether a finished trial counts toward the budget: evaluated, not pruned, not a repeat (nor a halving
    search's re-measurement at a later rung)."""
    return t.user_attrs.get("status") != "pruned" and "duplicate_of" not in t.user_attrs and _rung(t) == 0


def _report(on_trial: Callable[[TrialRecord], Any] | None, number: int, cfg: AnyConfig | None, params: Params,
            res: TrialResult, duplicate_of: int | None = None, **rung: int) -> None:
    if on_trial is not None:
        on_trial(TrialRecord(number, cfg, params, res, duplicate_of, **rung))


def outcome(study: optuna.Study, problem: Problem, default: AnyConfig,
            default_res: TrialResult | None = None) -> SearchOutcome:
    """The best verified trial of a study, with counts of every status."""
    finished = _finished(study)
    counts = Counter(t.user_attrs["status"] for t in finished if "duplicate_of" not in t.user_attrs and _rung(t) == 0)
    ok = _verified(study)
    retimed = _retimed(study, ok)
    # A halving search's best unretimed figures are those of its highest rung (the most timed calls).
    top = max(map(_rung, ok), default=0)
    # Re-timed leaders (see retime_leaders) rank by their side-by-side figures; the rest were slower the first time.
    best = min([t for t in ok if str(t.number) in retimed] or [t for t in ok if _rung(t) == top],
               key=lambda t: (retimed.get(str(t.number), t.user_attrs["ms"]), t.number), default=None)

    def result(t: FrozenTrial) -> TrialResult:
        res = result_of(t)
        if str(t.number) not in retimed:
            return res
        ms = retimed[str(t.number)]
        return replace(res, ms=ms, tflops=tflops(problem, ms), info={**res.info, "first_ms": res.ms})

    mine = [t for t in finished if _params(t, params_key(problem)) == params_for(problem, default)]
    # the default's figure: re-timed, else its highest rung's (the first trial of it when there are no rungs)
    d = next((t for t in mine if str(t.number) in retimed), max(mine, key=_rung, default=None))
    aside = default_aside(study, default) if d is None and ASIDE in retimed else None
    if d is not None and str(d.number) in retimed:
        default_res = result(d)  # timed beside the leaders: the speed-up is a same-run ratio
    elif aside is not None:  # measured outside the space, and timed beside the leaders too
        ms = retimed[ASIDE]
        default_res = replace(aside, ms=ms, tflops=tflops(problem, ms), info={**aside.info, "first_ms": aside.ms})
    elif default_res is None:
        default_res = result_of(d) if d is not None else default_aside(study, default)
    return SearchOutcome(problem, config_of(problem, _params(best, params_key(problem))) if best else None,
                         result(best) if best else None, default, default_res, counts,
                         sum(1 for t in finished if _counts(t)), versions=dict(best.user_attrs.get("versions", {}))
                         if best else {})
