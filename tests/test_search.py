"""The search, driven by SimulatedBackend (a deterministic cost model, no GPU), and the worker's restarts."""
from __future__ import annotations

import dataclasses
import threading
import time
import types

import optuna
import pytest
from optuna.trial import TrialState

from flashgen import config, search as search_mod
from flashgen.backend import SimulatedBackend, TrialResult
from flashgen.compile import CompileError
from flashgen.config import ArchLimits, space
from flashgen.problem import TuneProblem
from flashgen.search import PARAMS, SearchOptions, distributions, open_study, params_of, search, study_name
from flashgen.worker import CompileAhead, Worker

optuna.logging.set_verbosity(optuna.logging.WARNING)


def problem(arch: str = "sm90", head_dim: int = 128, causal: bool = False) -> TuneProblem:
    return TuneProblem("Test GPU", arch, "sm80", "bf16", head_dim, causal, 4096)


def opts(tmp_path, **kw) -> SearchOptions:
    return SearchOptions(storage=f"sqlite:///{tmp_path / 'studies.db'}", **kw)


def small_space(p: TuneProblem) -> list:
    return [c for c in space("sm80", p.head_dim, p.dtype, p.causal) if c.num_warps == 4 and c.block_n in (32, 64)]


def test_static_constraints_prune_before_the_backend(tmp_path):
    p = problem(arch="sm86", head_dim=256)  # 99 KB of shared memory: many d256 tiles cannot fit
    backend = SimulatedBackend()
    out = search(p, backend, opts(tmp_path, trials=15))
    study = open_study(p, opts(tmp_path))
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert pruned and all(t.user_attrs["status"] == "pruned" and t.user_attrs["reason"] for t in pruned)
    assert any("shared memory" in t.user_attrs["reason"] for t in pruned)
    fits = {c.name for c in space("sm80", 256, "bf16", False) if c.unfit_reason("sm86") is None}
    assert set(backend.calls) <= fits  # nothing pruned was ever compiled or timed
    assert out.counts["pruned"] == len(pruned) and sum(out.counts.values()) - out.counts["pruned"] == out.trials
    assert out.trials == len(fits)  # only 4 tiles fit: the space ran out before the trials


def test_failures_and_faults_do_not_stop_the_study(tmp_path):
    p = problem()
    cfgs = small_space(p)
    best_sim = min(cfgs, key=lambda c: SimulatedBackend().cost_ms(c, p))
    kinds = ["verify_failed", "compile_failed", "faulted", "timeout"]
    others = [c for c in cfgs if c != best_sim][:3]
    failures = {c.name: k for c, k in zip([best_sim, *others], kinds)}
    backend = SimulatedBackend(failures)
    out = search(p, backend, opts(tmp_path, exhaustive=True), cfgs)
    # every fitting configuration, and the default (8 warps: outside this space, so measured aside);
    # the timeout is transient, so tried twice
    assert sorted(backend.calls) == sorted([c.name for c in cfgs if c.unfit_reason("sm90") is None]
                                           + [p.default_config().name, others[2].name])
    for k in kinds:
        assert out.counts[k] == 1
    assert out.best is not None and out.best.ok
    assert out.best_config != best_sim  # the fastest kernel was wrong: it is never the result
    study = open_study(p, opts(tmp_path), study_name(p, cfgs))
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert {t.user_attrs["status"] for t in failed} == set(kinds)
    assert all(t.user_attrs["reason"] for t in failed)


def test_default_config_is_measured_first(tmp_path):
    p = problem()
    out = search(p, SimulatedBackend(), opts(tmp_path, trials=5))
    study = open_study(p, opts(tmp_path))
    first = study.trials[0]
    assert tuple(first.params[k] for k in PARAMS) == params_of(p.default_config())
    assert out.default is not None and out.default.ok
    assert out.best.ms <= out.default.ms


def test_resume_continues_the_same_study(tmp_path):
    p = problem()
    first = SimulatedBackend()
    out1 = search(p, first, opts(tmp_path, trials=6))
    assert out1.trials == 6 and len(first.calls) == 6
    again = SimulatedBackend()
    out2 = search(p, again, opts(tmp_path, trials=6))  # same command again: already complete
    assert again.calls == [] and out2.trials == 6
    more = SimulatedBackend()
    out3 = search(p, more, opts(tmp_path, trials=12))
    assert len(more.calls) == 6 and out3.trials == 12
    assert not set(more.calls) & set(first.calls)  # nothing timed twice across runs
    assert len(optuna.get_all_study_summaries(opts(tmp_path).storage)) == 1
    assert out3.best.ms <= out1.best.ms


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # the test asks outside Study.optimize, as search() does
def test_a_killed_run_is_retried_after_the_grace_period_and_live_trials_are_left_alone(tmp_path):
    p = problem()
    o = opts(tmp_path, trials=3, heartbeat_s=1, grace_s=3)
    search(p, SimulatedBackend(), o)
    study = open_study(p, o)
    storage = study._storage
    victim, other = [c for c in small_space(p) if c.unfit_reason("sm90") is None
                     and params_of(c) not in search_mod._view(study, "sm80").done][:2]
    dists = distributions(p, space("sm80", 128, "bf16", False))  # as a tuner asks: with its configuration
    study.enqueue_trial(dict(zip(PARAMS, params_of(victim))))
    study.enqueue_trial(dict(zip(PARAMS, params_of(other))))
    dead = study.ask(dists)  # held by a tuner that is then killed: one heartbeat, then none
    storage.record_heartbeat(dead._trial_id)
    live = study.ask(dists)  # held by another tuner on the same study, alive and beating
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            storage.record_heartbeat(live._trial_id)

    beater = threading.Thread(target=beat)
    beater.start()
    state = lambda t: open_study(p, o).trials[t.number].state  # noqa: E731
    try:
        storage.record_heartbeat(live._trial_id)
        first = SimulatedBackend()
        out = search(p, first, dataclasses.replace(o, trials=4))  # within the grace period: nothing failed
        assert state(dead) == state(live) == TrialState.RUNNING and victim.name not in first.calls
        assert first.calls == [] and out.trials == 3 and out.in_flight == 2  # both held trials count toward 4
        time.sleep(4.5)
        later = SimulatedBackend()
        out = search(p, later, dataclasses.replace(o, trials=6))
        assert state(dead) == TrialState.FAIL and state(live) == TrialState.RUNNING
        assert victim.name in later.calls  # the dead trial's configuration, retried once
        retry = [t for t in open_study(p, o).trials if t.system_attrs.get("failed_trial") == dead.number]
        assert len(retry) == 1 and retry[0].user_attrs["status"] == "ok"
        assert out.trials == 5 and out.in_flight == 1 and len(later.calls) == 2  # the live trial is the sixth
    finally:
        stop.set()
        beater.join()


def test_a_configuration_is_never_timed_twice(tmp_path):
    p = problem()
    cfgs = small_space(p)[:4]
    backend = SimulatedBackend()
    out = search(p, backend, opts(tmp_path, trials=40), cfgs)  # more trials than configurations
    assert sorted(backend.calls) == sorted({c.name for c in cfgs} | {p.default_config().name})
    assert out.trials == len(cfgs)  # the space ran out: the study stops (the default was measured aside)


def test_compile_ahead_asks_ahead_and_exhaustive_covers_space(tmp_path):
    p = problem()
    cfgs = small_space(p)

    class Recording(SimulatedBackend):
        def __init__(self):
            super().__init__()
            self.prefetched: list[str] = []

        def prefetch(self, configs, problem):
            self.prefetched += [c.name for c in configs]

    backend = Recording()
    search(p, backend, opts(tmp_path, exhaustive=True, ahead=4), cfgs)
    aside = p.default_config().name  # outside this space: measured after the study, not prefetched
    assert sorted(backend.prefetched) == sorted(c for c in backend.calls if c != aside)
    assert {c.name for c in cfgs if c.unfit_reason("sm90") is None} <= set(backend.calls)


def test_seeded_search_is_reproducible(tmp_path):
    p = problem()
    runs = []
    for i in range(2):
        o = SearchOptions(trials=8, seed=3, storage=f"sqlite:///{tmp_path / f'{i}.db'}")
        b = SimulatedBackend()
        search(p, b, o)
        runs.append(b.calls)
    assert runs[0] == runs[1]


def test_timeout_stops_the_study_midway(tmp_path, monkeypatch):
    clock = [0.0]  # each evaluation takes one fake second
    monkeypatch.setattr(search_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    class Slow(SimulatedBackend):
        def evaluate(self, config, problem):
            clock[0] += 1.0
            return super().evaluate(config, problem)

    backend = Slow()
    out = search(problem(), backend, opts(tmp_path, trials=50, timeout_s=4.5))
    assert out.trials == len(backend.calls) == 5  # evaluations end at t=1..5; t=5 > 4.5 stops the study


def test_the_problem_size_is_part_of_the_key_and_the_study(tmp_path):
    """A quick tune at a small size must not resume (or be resumed by) the full-size study."""
    full = problem()
    small = dataclasses.replace(full, batch_tokens=1024)
    wide = dataclasses.replace(full, heads_dim_total=4096)
    assert len({full.key, small.key, wide.key}) == 3 and len({full.study_name, small.study_name, wide.study_name}) == 3
    search(small, SimulatedBackend(), opts(tmp_path, trials=4))
    backend = SimulatedBackend()
    out = search(full, backend, opts(tmp_path, trials=4))
    assert out.trials == 4 and len(backend.calls) == 4  # a study of its own, not the small one's
    assert len(optuna.get_all_study_names(opts(tmp_path).storage)) == 2


def test_a_changed_fit_rule_opens_a_new_study(tmp_path, monkeypatch):
    """Optuna fixes the value sets a study samples: a new fit rule must not crash the resumed study."""
    p = problem(arch="sm86", head_dim=256)
    search(p, SimulatedBackend(), opts(tmp_path, trials=3))
    before = search_mod.study_name(p, space("sm80", 256, "bf16", False))
    monkeypatch.setitem(config.ARCHS, "sm86", ArchLimits("sm86", 227 * 1024))  # more tiles fit now
    assert search_mod.study_name(p, space("sm80", 256, "bf16", False)) != before
    backend = SimulatedBackend()
    out = search(p, backend, opts(tmp_path, trials=6))
    assert out.trials == 6 and len(backend.calls) == 6


class FlakyOnce(SimulatedBackend):
    """Fails some configurations with a transient status on their first evaluation only."""

    def __init__(self, once: dict[str, str], failures: dict[str, str] | None = None):
        super().__init__(failures)
        self.once = dict(once)

    def evaluate(self, config, problem):
        if config.name in self.once:
            self.calls.append(config.name)
            status = self.once.pop(config.name)
            return TrialResult(status, reason=f"transient {status}")
        return super().evaluate(config, problem)


def test_a_transient_failure_is_retried_once(tmp_path):
    p = problem()
    cfgs = [c for c in small_space(p) if c.unfit_reason("sm90") is None]
    once = {cfgs[0].name: "timeout", cfgs[1].name: "error"}
    always = {cfgs[2].name: "error", cfgs[3].name: "verify_failed"}
    backend = FlakyOnce(once, always)
    out = search(p, backend, opts(tmp_path, exhaustive=True), cfgs)
    n = backend.calls.count
    assert n(cfgs[0].name) == n(cfgs[1].name) == 2  # retried, then timed
    assert n(cfgs[2].name) == 2 and n(cfgs[3].name) == 1  # an error twice is failed for good; a wrong kernel at once
    assert out.counts["timeout"] == 0 and out.counts["error"] == 1 and out.counts["verify_failed"] == 1
    assert out.trials == len(cfgs)


def test_trial_result_rejects_unknown_status():
    with pytest.raises(ValueError):
        TrialResult("exploded")


def test_worker_survives_hangs_deaths_and_errors():
    w = Worker()
    try:
        assert w.call("math:sqrt", 4.0) == ("ok", 2.0)
        kind, reason = w.call("time:sleep", 30, deadline_s=1.0)
        assert kind == "timeout" and "restarted" in reason
        kind, reason = w.call("os:_exit", 7)
        assert kind == "faulted" and "exit code 7" in reason
        kind, reason = w.call("math:sqrt", "x")
        assert kind == "error" and "TypeError" in reason
        assert w.call("math:sqrt", 9.0) == ("ok", 3.0)
        assert w.restarts == 2
    finally:
        w.close()


def test_compile_ahead_pool(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    pool = CompileAhead(jobs=2)
    cfg = problem(head_dim=64).default_config()
    try:
        pool.submit(cfg, "sm_80")
        k = pool.get(cfg, "sm_80")
        assert k.config == cfg and k.cubin and k.resources.registers > 0
        with pytest.raises(CompileError):
            pool.get(cfg, "sm_10")  # no such target: nvcc fails, reported as CompileError
    finally:
        pool.close()


def test_gpu_backend_turns_every_outcome_into_a_value(tmp_path, monkeypatch):
    from flashgen.worker import GpuBackend

    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    answers = iter([("ok", {"status": "ok", "ms": 2.0, "max_err": 1e-3, "reason": ""}),
                    ("ok", {"status": "verify_failed", "ms": None, "max_err": 0.5, "reason": "max error 0.5 > bound"}),
                    ("faulted", "CudaError: cuCtxSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"),
                    ("timeout", "no answer within 60 s"),
                    ("error", "ValueError: bad shape")])

    class FakeWorker:
        def call(self, task, *args, deadline_s=0):
            assert task == "flashgen.worker:gpu_trial"
            return next(answers)

        def close(self):
            pass

    b = object.__new__(GpuBackend)  # no GPU here: the worker is replaced, the compile pool is real
    b.worker, b.gpu_arch, b.compiler = FakeWorker(), "sm80", CompileAhead(2)
    b.deadline_s, b.warmup, b.reps = 60, 1, 1
    p = problem(arch="sm80", head_dim=64)
    cfg = p.default_config()
    try:
        b.prefetch([cfg], p)
        statuses = [b.evaluate(cfg, p) for _ in range(5)]
        assert [r.status for r in statuses] == ["ok", "verify_failed", "faulted", "timeout", "error"]
        assert statuses[0].tflops > 0 and statuses[0].info["registers"] > 0
        assert "ILLEGAL_ADDRESS" in statuses[2].reason
        b.gpu_arch = "sm10"  # nvcc has no such target: a compile failure, as a value
        assert b.evaluate(cfg, p).status == "compile_failed"
    finally:
        b.close()


def test_a_restricted_space_is_a_study_of_its_own(tmp_path):
    """Resuming with another restriction must neither crash (Optuna fixes a study's value sets)
    nor leave configurations pruned as 'outside the space' in the unrestricted study."""
    p = problem()
    small = small_space(p)
    search(p, SimulatedBackend(), opts(tmp_path, exhaustive=True), small)
    whole = study_name(p, space("sm80", 128, "bf16", False))
    assert study_name(p, small) != whole and study_name(p, small).startswith(p.study_name + "@space-")
    full = search(p, SimulatedBackend(), opts(tmp_path, trials=6))
    assert full.trials == 6 and whole.startswith(p.study_name + "@space-")


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # the test asks outside Study.optimize, as search() does
def test_a_trial_of_a_configuration_another_tuner_holds_waits_for_its_result(tmp_path):
    """Samplers of different tuners can propose the same configuration at once: the later trial must
    take the earlier one's result (once it is told), not time the configuration a second time."""
    p = problem()
    o = opts(tmp_path, trials=3)
    study = open_study(p, o, study_name(p, space("sm80", 128, "bf16", False)))
    cfg = next(c for c in small_space(p) if c.unfit_reason("sm90") is None)
    dists = distributions(p, space("sm80", 128, "bf16", False))
    for _ in range(2):
        study.enqueue_trial(dict(zip(PARAMS, params_of(cfg))))
    first, second = study.ask(dists), study.ask(dists)  # held by two tuners
    found = []
    waiter = threading.Thread(target=lambda: found.append(
        search_mod._owner(study, second, params_of(cfg), "sm80", o, lambda: False)))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not found  # the earlier trial is still being timed: wait for it
    search_mod._tell(study, first, SimulatedBackend().evaluate(cfg, p))
    waiter.join(10)
    assert [t.number for t in found] == [first.number]
    assert search_mod._owner(study, first, params_of(cfg), "sm80", o, lambda: False).number == first.number


def test_tuners_in_threads_on_one_study_time_each_configuration_once(tmp_path):
    p = problem()
    cfgs = small_space(p)
    backends = [SimulatedBackend(delay_s=0.05) for _ in range(3)]
    outs: list = []
    threads = [threading.Thread(target=lambda b=b, i=i: outs.append(search(
        p, b, opts(tmp_path, trials=10, worker=f"t{i}", heartbeat_s=1, grace_s=30), cfgs)))
        for i, b in enumerate(backends)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    aside = p.default_config().name  # outside this space: measured aside by the tuners leaving last
    calls = [c for b in backends for c in b.calls if c != aside]
    assert len(calls) == len(set(calls)) and sum(1 for b in backends if b.calls) >= 2
    study = open_study(p, opts(tmp_path), study_name(p, cfgs))
    timed = [t for t in study.trials if t.user_attrs.get("status") == "ok" and "duplicate_of" not in t.user_attrs]
    assert 10 <= len(timed) <= 12 and len(calls) == len(timed)
    assert all(t.state.is_finished() for t in study.trials)
    assert max(o.trials for o in outs) == len(timed)


def test_a_failure_while_stopping_is_not_the_kernels(tmp_path):
    """Ctrl-C of a fleet reaches the GPU workers too: the trial being timed then fails without a status
    (retried by a later run), never recorded as the configuration's fault."""
    stop = threading.Event()

    class Interrupted(SimulatedBackend):
        def evaluate(self, config, problem):
            if len(self.calls) == 2:
                stop.set()
                self.calls.append(config.name)
                return TrialResult("faulted", reason="the worker died (exit code -2); restarted")
            return super().evaluate(config, problem)

    p = problem()
    out = search(p, Interrupted(), opts(tmp_path, trials=6, stop=stop))
    trials = open_study(p, opts(tmp_path)).trials
    assert out.counts["faulted"] == 0 and out.trials == 2
    assert [t.state for t in trials if "status" not in t.user_attrs] == [TrialState.FAIL]


def test_a_stored_trial_from_before_a_knob_reads_as_the_knob_off():
    """Studies stored before overlap_epilogue, mma_rowsum, lazy_rescale, q_regs, p_smem, o_tma, pack_gqa and cluster existed (`tune --collect` reads every study in a storage):
    their finished trials lack the parameters and ran without them."""
    from optuna.distributions import CategoricalDistribution

    old_names = [n for n in search_mod.FAMILY_PARAMS["sm90"] if n not in search_mod.LATE_KNOBS]
    values = dict(zip(old_names, (128, 128, 12, 2, True, False, True)))
    t = optuna.trial.create_trial(params=values, value=1.0, user_attrs={"status": "ok"},
                                  distributions={n: CategoricalDistribution([v]) for n, v in values.items()})
    params = search_mod._params(t, "sm90")
    assert params == (128, 128, 12, 2, True, False, True) + (False,) * len(search_mod.LATE_KNOBS)
    p90 = TuneProblem("Test GPU", "sm90", "sm90", "bf16", 128, False, 4096)
    assert search_mod.config_of(p90, params).name == "fwd_sm90_d128_bf16_full_bm128_bn128_w12_s2_ov1_pp0_ps"
    p8 = TuneProblem("Test GPU", "sm90", "sm90", "fp8_e4m3", 128, False, 4096)  # FP8's row sums by FADD, as measured
    assert search_mod.config_of(p8, params).name == "fwd_sm90_d128_fp8_e4m3_full_bm128_bn128_w12_s2_ov1_pp0_ps_obf16"


def test_a_stored_backward_trial_from_before_dq_tma_reads_as_it_off():
    from optuna.distributions import CategoricalDistribution

    assert search_mod.FAMILY_PARAMS["bwd_sm90"][-2:] == ("dq_tma", "lse_ahead")
    assert search_mod.LATE_BWD_KNOBS == {"dq_tma": False, "lse_ahead": 0}
    values = dict(zip(search_mod.FAMILY_PARAMS["bwd_sm90"][:-2], (64, 128, 12, 3, True)))
    t = optuna.trial.create_trial(params=values, value=1.0, user_attrs={"status": "ok"},
                                  distributions={n: CategoricalDistribution([v]) for n, v in values.items()})
    params = search_mod._params(t, "bwd_sm90")
    assert params == (64, 128, 12, 3, True, False, 0)
    p = TuneProblem("Test GPU", "sm90", "sm90", "bf16", 128, True, 4096, pass_="bwd")
    assert search_mod.config_of(p, params).name == "bwd_sm90_d128_bf16_causal_bm64_bn128_w12_s3_st1"
    assert search_mod.config_of(p, params[:-2] + (True, 0)).name.endswith("_s3_st1_dqt")
    assert search_mod.config_of(p, params[:-1] + (2,)).name.endswith("_s3_st1_la2")


def test_leaders_are_timed_again_before_the_outcome(tmp_path):
    """A configuration whose one measurement was lucky (noise: half its cost) leads the study; timed again beside
    the other leaders, it loses to the truly fastest, and the outcome keeps its first figure for the record."""
    p = problem()
    cfgs = small_space(p)
    sim = SimulatedBackend()
    ranked = sorted([c for c in cfgs if c.unfit_reason(p.gpu_arch) is None], key=lambda c: sim.cost_ms(c, p))
    lucky = ranked[-1]  # the slowest, measured once at a quarter of its cost
    backend = SimulatedBackend(noise={lucky.name: 0.25})
    assert backend.cost_ms(lucky, p) * 0.25 < backend.cost_ms(ranked[0], p)
    out = search(p, backend, opts(tmp_path, exhaustive=True), cfgs)
    assert out.best_config == ranked[0] and out.best.ms == pytest.approx(sim.cost_ms(ranked[0], p))
    assert "first_ms" in out.best.info
    assert len(backend.retimed) == 1 and lucky.name in backend.retimed[0] and len(backend.retimed[0]) == 5
    # the record stays with the study: a later outcome (tune --collect) reads the same, and nothing is timed again
    again = SimulatedBackend(noise={lucky.name: 0.25})
    out2 = search(p, again, opts(tmp_path, exhaustive=True), cfgs)
    assert out2.best_config == ranked[0] and again.retimed == [] and again.calls == []
    # without re-timing, the lucky figure wins: what the re-timing is for
    plain = SimulatedBackend(noise={lucky.name: 0.25})
    (tmp_path / "plain").mkdir()
    out3 = search(p, plain, opts(tmp_path / "plain", exhaustive=True, retime_top=0), cfgs)
    assert out3.best_config == lucky and plain.retimed == []


def test_new_trials_make_the_retimed_figures_stale(tmp_path):
    p = problem()
    cfgs = small_space(p)
    backend = SimulatedBackend()
    search(p, backend, opts(tmp_path, trials=4, sampler="random"), cfgs)
    assert len(backend.retimed) == 1
    more = SimulatedBackend()
    out = search(p, more, opts(tmp_path, trials=8, sampler="random"), cfgs)
    assert len(more.retimed) == 1  # four more verified trials: the leaders are timed again
    st = open_study(p, opts(tmp_path), study_name(p, cfgs))
    assert st.user_attrs["retimed"]["verified"] == out.counts["ok"]


def test_gqa_problems_search_pack_gqa_too():
    """An sm90 GQA problem's space adds each configuration (but o_tma's, cluster's and lpt_by_head's) with pack_gqa (a
    parameter like the other knobs); an MHA problem's space has none."""
    mha = TuneProblem("Test GPU", "sm90", "sm90", "bf16", 128, True, 1024)
    gqa = TuneProblem("Test GPU", "sm90", "sm90", "bf16", 128, True, 1024, gqa_group=4)
    assert not any(c.pack_gqa for c in search_mod.problem_space(mha))
    packed = [c for c in search_mod.problem_space(gqa) if c.pack_gqa]
    assert len(packed) == len([c for c in search_mod.problem_space(mha)
                               if not c.o_tma and not c.cluster and not c.lpt_by_head])  # not packed
    assert all(search_mod.config_of(gqa, params_of(c)) == c for c in packed[:50])
    assert study_name(mha, search_mod.problem_space(mha)) != study_name(gqa, search_mod.problem_space(gqa))
