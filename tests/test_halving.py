"""The successive-halving search (flashgen.halving, search's halving mode, `tune --search halving`), driven by the
simulated backend with timing noise that shrinks with the timed calls."""
from __future__ import annotations

import json
import threading

import optuna
import pytest

from flashgen import cli
from flashgen.backend import SimulatedBackend
from flashgen.config import space
from flashgen.fleet import collect
from flashgen.halving import Schedule
from flashgen.problem import TuneProblem
from flashgen.search import SearchOptions, halving_study_name, search
from flashgen.tunable import entry_of, kind_of

optuna.logging.set_verbosity(optuna.logging.WARNING)

JITTER, SEED = 0.04, 0  # a rung-0 measurement (5 calls) off by 13% (one sigma), a full trial's by 4%


def problem() -> TuneProblem:
    return TuneProblem("Test GPU", "sm90", "sm90", "bf16", 128, False, 4096)


def tile_space(p: TuneProblem) -> list:
    """One fitting configuration per tile and stage count (the simulated cost's terms), the default among them."""
    default = kind_of(p).default(p)
    seen, out = set(), [default]
    for c in space("sm90", p.head_dim, p.dtype, p.causal):
        key = (c.block_m, c.block_n, c.num_stages)
        if c.unfit_reason(p.gpu_arch) is None and key not in seen and c != default:
            seen.add(key)
            out.append(c)
    return out


def opts(tmp_path, **kw) -> SearchOptions:
    return SearchOptions(storage=f"sqlite:///{tmp_path / 'studies.db'}", halving_eta=3, **kw)


def cost(c, p: TuneProblem) -> float:
    return SimulatedBackend().cost_ms(c, p)


def test_schedule_rungs_reps_and_promotion():
    s = Schedule(eta=3, reps0=5, keep=5)
    assert s.sizes(1500) == [1500, 500, 167, 56, 19, 7, 3]
    assert sum(s.sizes(1500)) < 1500 * 3 / 2 + len(s.sizes(1500))  # n * eta / (eta - 1), not n * rungs
    assert [s.reps(r) for r in range(6)] == [5, 15, 45, 135, 400, 400]
    assert s.promoted([("a", 3.0), ("b", 1.0), ("c", 1.0), ("d", 2.0)]) == ["b", "c"]  # in rung order
    assert s.promoted([("a", 1.0)] * 0) == []
    assert Schedule(eta=2, keep=1).sizes(5) == [5, 3, 2, 1]
    with pytest.raises(ValueError):
        Schedule(eta=1)


def test_halving_finds_the_simulated_best_with_few_measurements(tmp_path):
    p = problem()
    cfgs = tile_space(p)
    n, best = len(cfgs), min(cost(c, p) for c in cfgs)
    # The noise matters: the fastest single rung-0 figure is not the best configuration.
    noisy = SimulatedBackend(jitter=JITTER, seed=SEED)
    first = min(cfgs, key=lambda c: noisy.evaluate(c, p, reps=5).ms)
    assert cost(first, p) > best
    backend = SimulatedBackend(jitter=JITTER, seed=SEED)
    rungs = []
    out = search(p, backend, opts(tmp_path), cfgs, on_trial=lambda rec: rungs.append((rec.rung, rec.rung_size)))
    assert cost(out.best_config, p) == best
    sizes = Schedule(3, 5, 5).sizes(n)
    assert len(sizes) >= 4 and len(backend.calls) == sum(sizes)  # n * (1 + 1/3 + 1/9 ...), not n * rungs
    assert [backend.call_reps.count(5 * 3 ** r) for r in range(len(sizes))] == sizes
    assert [rungs.count((r, size)) for r, size in enumerate(sizes)] == sizes
    assert len(backend.retimed) == 1 and len(backend.retimed[0]) <= 5  # the last rung (and the default) re-timed
    assert out.trials == n and out.counts == {"ok": n}  # re-measurements are no trials of their own
    assert out.best.info["first_ms"] and out.default.ms == cost(kind_of(p).default(p), p)  # both re-timed
    study = optuna.load_study(study_name=halving_study_name(p, cfgs), storage=opts(tmp_path).storage)
    assert sorted(t.user_attrs["rung"] for t in study.trials) == sorted(r for r, s in enumerate(sizes) for _ in range(s))
    assert {t.user_attrs["reps"] for t in study.trials if t.user_attrs["rung"] == 1} == {15}


class Interrupt(SimulatedBackend):
    """Ctrl-C during the measurement after `after` of them."""

    def __init__(self, after: int, **kw):
        super().__init__(**kw)
        self.after = after

    def evaluate(self, config, problem, reps=None):
        if len(self.calls) == self.after:
            raise KeyboardInterrupt
        return super().evaluate(config, problem, reps)


def test_an_interrupted_halving_resumes_without_measuring_again(tmp_path):
    p = problem()
    cfgs = tile_space(p)
    n, sizes = len(cfgs), Schedule(3, 5, 5).sizes(len(cfgs))
    with pytest.raises(KeyboardInterrupt):
        search(p, Interrupt(10, jitter=JITTER, seed=SEED), opts(tmp_path), cfgs)
    # stopped (a fleet's Ctrl-C) once rung 0 is complete
    stop = threading.Event()
    second = SimulatedBackend(jitter=JITTER, seed=SEED)

    def on_trial(rec):
        if rec.rung == 0 and rec.rung_done == rec.rung_size:
            stop.set()

    out = search(p, second, opts(tmp_path, stop=stop), cfgs, on_trial=on_trial)
    assert len(second.calls) == n - 10 and set(second.call_reps) == {5}  # the first 10 were kept
    assert out.trials == n and not second.retimed
    third = SimulatedBackend(jitter=JITTER, seed=SEED)
    out = search(p, third, opts(tmp_path), cfgs)
    assert len(third.calls) == sum(sizes) - n and 5 not in third.call_reps  # rung 0 is never measured again
    assert cost(out.best_config, p) == min(cost(c, p) for c in cfgs)
    again = SimulatedBackend(jitter=JITTER, seed=SEED)
    assert search(p, again, opts(tmp_path), cfgs).best_config == out.best_config and not again.calls


def test_a_configuration_failing_verification_never_enters_a_later_rung_nor_the_store(tmp_path):
    p = problem()
    cfgs = tile_space(p)
    ranked = sorted(cfgs, key=lambda c: cost(c, p))
    wrong, broken = ranked[0], ranked[1]  # the two fastest: both would survive every rung
    backend = SimulatedBackend({wrong.name: "verify_failed", broken.name: "compile_failed"}, jitter=JITTER, seed=SEED)
    out = search(p, backend, opts(tmp_path), cfgs)
    assert backend.calls.count(wrong.name) == 1 and backend.calls.count(broken.name) == 1
    assert all(wrong.name not in r and broken.name not in r for r in backend.retimed)
    assert cost(out.best_config, p) == cost(ranked[2], p)  # the fastest that passed (ties: any of them)
    assert out.counts["verify_failed"] == 1 and out.counts["compile_failed"] == 1
    assert entry_of(out, {})["kernel"] == out.best_config.name
    (entries,) = collect(opts(tmp_path).storage).values()  # tune --collect's choice
    assert entries[p.key]["kernel"] == out.best_config.name


SMALL = ["--arch", "sm90", "--head-dim", "64", "--dtype", "bf16", "--causal", "no", "--seqlen", "1024", "--block-m",
         "64,128", "--block-n", "128,192", "--num-stages", "2", "--exp2-fma", "no", "--cluster", "no", "--lpt-by-head",
         "no", "--pack-gqa", "no", "--o-tma", "no", "--p-smem", "no", "--q-regs", "no", "--desc-step", "no"]


def test_cli_tunes_with_halving(tmp_path, capsys):
    args = ["tune", *SMALL, "--simulate", "--search", "halving", "--halving-eta", "3", "--storage",
            f"sqlite:///{tmp_path / 's.db'}", "--tuned-dir", str(tmp_path / "tuned")]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    assert "halving (eta 3): all 48 fitting configurations at 5 timed calls, rungs of 48/16/6/2" in out.out
    assert "rung 3 (135 calls)" in out.err  # a progress bar per rung
    doc = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())
    assert [e["trials"] for e in doc["entries"].values()] == [48]


@pytest.mark.parametrize("extra, words", [
    (["--halving-eta", "1"], "--halving-eta 1"),
    (["--halving-reps", "0"], "--halving-reps must be at least 1"),
    (["--trials", "10"], "--search halving and --trials conflict"),
    (["--exhaustive"], "--search halving and --exhaustive conflict"),
    (["--gpus", "0,1"], "--search halving runs on one GPU"),
])
def test_cli_halving_errors(extra, words, capsys):
    assert cli.main(["tune", *SMALL, "--simulate", "--search", "halving", *extra]) == 2
    assert words in capsys.readouterr().err
