"""Decode and varlen problems through the one tuning pipeline, without a GPU: a study per problem in a study
storage, candidates (a decode one with its split count) sampled as Optuna parameters, a faulting candidate isolated
in the worker process, and `tune --kind decode|varlen` with --storage, --gpus and --collect writing the entry format
each kind's lookup reads. The simulated backend stands in for the GPU; the GPU side is tests/test_gpu_tune_*.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import optuna
import pytest

from fleet_fixtures import postgres_server, postgres_url  # noqa: F401 - fixtures
from flashgen import fleet, resolve, tunable, tune_decode as td, tune_varlen as tv
from flashgen.backend import SimulatedBackend
from flashgen.config import KernelConfig
from flashgen.problem import TuneProblem
from flashgen.search import SearchOptions, config_of, params_for, search, study_name
from flashgen.store import entry_error, read_store
from flashgen.worker import IsolatedSimulatedBackend

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import cli  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)

SIM = ("Simulated GPU", "sm90")
# The keys of today's store entries of each kind (tests/test_tune_decode.py, test_tune_varlen.py pin their use).
DECODE_KEYS = {"problem", "kernel", "config", "num_splits", "median_ms", "tflops", "tb_s", "trials", "date", "flashgen",
               "nvcc", "driver", "default"}
VARLEN_KEYS = DECODE_KEYS - {"num_splits", "tb_s"}


def decode_problem(page: int = 16, n: int = 1024) -> td.DecodeProblem:
    return td.DecodeProblem(128, "bf16", 32, 8, 1, n, page, *SIM)


def varlen_problem() -> tv.VarlenProblem:
    return tv.VarlenProblem(128, "bf16", True, 16, 16, True, 64, 64, 8192, -1, *SIM)


def opts(tmp_path: Path, **kw) -> SearchOptions:
    return SearchOptions(**{"exhaustive": True, "storage": f"sqlite:///{tmp_path / 'studies.db'}", "heartbeat_s": 1,
                            "grace_s": 5, **kw})


def test_every_kind_maps_candidates_to_parameters_and_problems_to_records():
    for p in (decode_problem(), varlen_problem(), TuneProblem(*SIM, "sm90", "bf16", 128, True, 4096)):
        space = tunable.space_of(p)
        assert space and len({c.name for c in space}) == len(space)
        assert all(config_of(p, params_for(p, c)) == c for c in space)
        assert tunable.problem_from_dict(json.loads(json.dumps(p.to_dict()))) == p
    names = tunable.kind_of(decode_problem()).names(decode_problem())
    # the split count, the combine's place and the key split are parameters
    assert names[-3:] == ("num_splits", "fused_combine", "key_warps")
    c = td.candidates(decode_problem())[0]
    assert c.name.endswith(f"_x{c.num_splits}") and params_for(decode_problem(), c)[-3:] == (c.num_splits, False, 1)
    with pytest.raises(TypeError):
        tunable.problem_from_dict({"pass_": "nope"})


def test_a_decode_study_per_problem_whose_winner_is_todays_entry(tmp_path):
    backend = SimulatedBackend()
    entries = {}
    for p in (decode_problem(0), decode_problem(16)):
        cands = td.candidates(p)[:6]
        out = search(p, backend, opts(tmp_path), cands)
        assert out.trials == 6 and out.counts["ok"] == 6
        assert out.best_config == min(cands, key=lambda c: backend.cost_ms(c, p))
        assert out.default.ok and out.default.ms == backend.cost_ms(td.RULE, p)  # the rule, measured aside
        entries[p.key] = e = tunable.entry_of(out, {"nvcc": "n", "driver": "d"})
        assert set(e) == DECODE_KEYS and entry_error(e) is None
        assert (e["kernel"], e["num_splits"]) == (out.best_config.config.name, out.best_config.num_splits)
        assert e["tb_s"] == pytest.approx(p.kv_bytes / (e["median_ms"] * 1e-3) / 1e12) and e["tflops"] is None
        assert e["default"]["kernel"] == "rule (flashgen.serving)" and e["default"]["status"] == "ok"
        assert tunable.candidate_of_entry(e) == out.best_config
    studies = optuna.get_all_study_names(f"sqlite:///{tmp_path / 'studies.db'}")
    assert sorted(studies) == sorted(study_name(p, td.candidates(p)[:6]) for p in (decode_problem(0),
                                                                                    decode_problem(16)))
    picked = resolve.decode_entry(list(entries.values()), 128, "bf16", 32, 8, 1, 1024, 16)
    assert picked is entries[decode_problem(16).key]
    # the same search again finds its study finished: nothing evaluated twice
    again = SimulatedBackend()
    assert search(decode_problem(16), again, opts(tmp_path), td.candidates(decode_problem(16))[:6]).trials == 6
    assert again.calls == []


def test_a_faulting_decode_candidate_is_a_failed_trial_and_the_search_goes_on(tmp_path):
    p = decode_problem()
    cands = td.candidates(p)[:4]
    backend = IsolatedSimulatedBackend(crash=(cands[1].name,))
    try:
        out = search(p, backend, opts(tmp_path, retime_top=0), cands)
    finally:
        backend.close()
    assert out.counts == {"ok": 3, "faulted": 1} and out.trials == 4
    assert backend.worker.restarts >= 1  # the fault took its worker down; the next trial had a fresh one
    assert out.best_config in cands and out.best_config != cands[1]
    study = optuna.load_study(study_name=study_name(p, cands), storage=f"sqlite:///{tmp_path / 'studies.db'}")
    faulted = [t for t in study.trials if t.user_attrs.get("status") == "faulted"]
    assert len(faulted) == 1 and "illegal memory access" in faulted[0].user_attrs["reason"]
    assert faulted[0].user_attrs.get("info", {}).get("first_try") is None  # a fault is final, not retried


def test_the_untuned_varlen_choice_is_measured_but_never_stored(tmp_path):
    """A restricted search stays restricted: the untuned choice (the rule) is the fastest here, and its figure is
    the entry's default, but the entry is the fastest candidate's."""
    p = varlen_problem()
    cands = [KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", varlen=True),
             KernelConfig(128, "bf16", True, 128, 64, 12, 2, "sm90", varlen=True)]
    speed = {cands[0].name: 2.0, cands[1].name: 1.5, tv.RULE.name: 1.0}

    class Fixed(SimulatedBackend):
        def cost_ms(self, cand, problem):
            return speed[cand.name]

    backend = Fixed()
    out = search(p, backend, opts(tmp_path), cands)
    assert backend.retimed == [[cands[1].name, cands[0].name, tv.RULE.name]]  # the rule timed beside the leaders
    assert out.default.info["first_ms"] == 1.0
    e = tunable.entry_of(out, {"nvcc": "n", "driver": "d"})
    assert set(e) == VARLEN_KEYS and entry_error(e) is None and e["problem"]["pass_"] == "varlen"
    assert e["kernel"] == cands[1].name and e["median_ms"] == 1.5
    assert e["tflops"] == pytest.approx(p.flops() / 1.5e-3 / 1e12)
    assert e["default"]["median_ms"] == 1.0 and e["default"]["kernel"] == tv.RULE.name


def test_the_gpu_backend_refuses_a_spilling_varlen_kernel_before_timing_it():
    from flashgen.compile import CompileError
    from flashgen.worker import GpuBackend

    class Kern:
        def __init__(self, spills):
            self.resources = type("R", (), {"spills": spills, "registers": 255, "spill_stores": 8 * spills,
                                            "spill_loads": 0, "smem_bytes": 0})()
            self.ptxas_log = ""

    cands = tv.space(varlen_problem())[:2]

    class Compiled:
        def get(self, cfg, target):
            if cfg == cands[1]:
                raise CompileError("ptxas died")
            return Kern(True)

    class NoCalls:
        def call(self, *a, **k):
            raise AssertionError("a refused kernel reached the GPU worker")

    b = object.__new__(GpuBackend)
    b.worker, b.gpu_arch, b.compiler = NoCalls(), "sm90", Compiled()
    b.deadline_s, b.warmup, b.reps = 30, 1, 1
    res = b.evaluate(cands[0], varlen_problem())
    assert res.status == "pruned" and "spills" in res.reason and res.info["spill_bytes"] == 8
    assert b.evaluate(cands[1], varlen_problem()).status == "compile_failed"


def tune(*args: str) -> int:
    return cli.main(["tune", "--simulate", "--heartbeat", "1", "--grace", "5", "--max-configs", "4", *args])


def test_cli_tunes_decode_and_varlen_in_a_storage_and_collects_the_same_store(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    assert tune("--kind", "decode", "--head-dim", "128", "--points", "1x1024", "--pages", "0,16",
                "--storage", storage, "--tuned-dir", str(tmp_path / "tuned")) == 0
    assert tune("--kind", "varlen", "--head-dim", "128", "--points", "8x64-512", "--causal", "yes",
                "--storage", storage, "--tuned-dir", str(tmp_path / "tuned")) == 0
    doc = read_store(tmp_path / "tuned" / "simulated-gpu-sm90.json")
    keys = {decode_problem(0).key, decode_problem(16).key, "varlen_d128_bf16_causal_h16k16_s8_n64-512_w-1"}
    assert set(doc["entries"]) == keys
    for e in doc["entries"].values():
        assert set(e) == (DECODE_KEYS if e["problem"]["pass_"] == "decode" else VARLEN_KEYS)
        assert e["nvcc"] == "simulated" and e["trials"] == 4
    names = optuna.get_all_study_names(storage)
    assert len(names) == 3 and all(n.startswith("simulated-gpu-sm90/") for n in names)
    capsys.readouterr()
    assert cli.main(["tune", "--collect", "--simulate", "--storage", storage, "--tuned-dir",
                     str(tmp_path / "collected")]) == 0
    assert read_store(tmp_path / "collected" / "simulated-gpu-sm90.json")["entries"] == doc["entries"]
    assert "x" in capsys.readouterr().out  # the decode rows show their split count


def test_collect_refuses_a_decode_winner_that_fails_again(tmp_path, monkeypatch, capsys):
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    assert tune("--kind", "decode", "--head-dim", "128", "--points", "1x1024", "--pages", "16",
                "--storage", storage, "--tuned-dir", str(tmp_path / "tuned")) == 0
    (e,) = read_store(tmp_path / "tuned" / "simulated-gpu-sm90.json")["entries"].values()
    winner = tunable.candidate_of_entry(e)
    monkeypatch.setattr(fleet, "collect_backend", lambda simulate: (SimulatedBackend({winner.name: "faulted"}), None))
    assert cli.main(["tune", "--collect", "--simulate", "--storage", storage, "--tuned-dir",
                     str(tmp_path / "collected")]) == 1
    assert f"{winner.name}, the study's winner, does not pass here: faulted" in capsys.readouterr().err
    assert not (tmp_path / "collected" / "simulated-gpu-sm90.json").exists()


def test_decode_on_two_gpus_shares_a_postgresql_storage(postgres_url, tmp_path, capsys):  # noqa: F811
    assert tune("--kind", "decode", "--head-dim", "128", "--points", "1x1024,2x1024", "--pages", "16", "--gpus", "0,1",
                "--storage", postgres_url, "--tuned-dir", str(tmp_path / "tuned")) == 0
    assert "2 tuners" in capsys.readouterr().out
    found = fleet.collect(postgres_url)
    entries = found[SIM]
    assert set(entries) == {decode_problem(16).key, td.DecodeProblem(128, "bf16", 32, 8, 2, 1024, 16, *SIM).key}
    stored = read_store(tmp_path / "tuned" / "simulated-gpu-sm90.json")["entries"]
    assert {k: (e["kernel"], e["num_splits"], e["median_ms"]) for k, e in stored.items()} == \
        {k: (e["kernel"], e["num_splits"], e["median_ms"]) for k, e in entries.items()}
