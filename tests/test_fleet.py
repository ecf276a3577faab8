"""Tuning a fleet without a GPU: tuner processes sharing studies through a real PostgreSQL server
or a journal file, a tuner killed mid-trial, `--gpus` tuners in one process, collecting the store
from the storage, and the dashboard. The simulated backend stands in for the GPUs; it logs every
evaluation ("start"/"done" lines) so that the tests can count what the fleet timed."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from fleet_fixtures import postgres_server, postgres_url, shared_storage  # noqa: F401 - fixtures

from flashgen import cli, studies
from flashgen.fleet import collect

REPO = Path(__file__).resolve().parent.parent

optuna.logging.set_verbosity(optuna.logging.WARNING)

PROBLEMS = ["--arch", "sm80", "--head-dim", "64", "--dtype", "bf16", "--causal", "no", "--seqlen", "1024,4096"]


def tune_args(storage: str, tuned: Path, log: Path, trials: int = 10, delay: float = 0.2, grace: int = 30,
              *extra: str) -> list[str]:
    return ["tune", *PROBLEMS, "--trials", str(trials), "--simulate", "--simulate-delay", str(delay),
            "--simulate-log", str(log), "--storage", storage, "--tuned-dir", str(tuned), "--heartbeat", "1",
            "--grace", str(grace), *extra]


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "cli.py"), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> None:
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"tuner {p.pid} failed ({p.returncode}):\n{out[-3000:]}\n{err[-3000:]}"


def evaluations(logs: list[Path]) -> tuple[Counter, Counter]:
    """(study, config) -> how often an evaluation started, and how often one ended."""
    started, done = Counter(), Counter()
    for log in logs:
        for line in log.read_text().splitlines() if log.exists() else []:
            what, study, config, _pid = line.split()
            (started if what == "start" else done)[study, config] += 1
    return started, done


def config_name(t: optuna.trial.FrozenTrial) -> str:
    p = t.params
    return f"fwd_sm80_d64_bf16_full_bm{p['block_m']}_bn{p['block_n']}_w{p['num_warps']}_s{p['num_stages']}"


def all_trials(storage: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    st = studies.make_storage(storage)
    return {s: optuna.load_study(study_name=s, storage=st).get_trials(deepcopy=False)
            for s in optuna.get_all_study_names(st)}


def check_every_trial_evaluated_once(storage: str, logs: list[Path], trials: int, tuners: int) -> dict:
    """Every configuration timed once per study, each timing told to exactly one trial, every trial
    finished, none failed without a status (what a tuner failing another's live trial would leave)."""
    started, done = evaluations(logs)
    assert done and max(done.values()) == 1, [k for k, n in done.items() if n > 1]
    by_study = all_trials(storage)
    assert len(by_study) == 2
    for name, ts in by_study.items():
        problem = name.split("@")[0]
        assert all(t.state.is_finished() for t in ts), [(t.number, t.state) for t in ts if not t.state.is_finished()]
        assert not [t.number for t in ts if t.state == TrialState.FAIL and "status" not in t.user_attrs]
        timed = [t for t in ts if t.user_attrs["status"] != "pruned" and "duplicate_of" not in t.user_attrs]
        assert Counter(config_name(t) for t in timed) == Counter({c: n for (s, c), n in done.items() if s == problem})
        # the budget counts the trials other tuners hold; two asking at the same moment may each take the last one
        assert trials <= len(timed) <= trials + tuners - 1
        for t in ts:
            if "duplicate_of" in t.user_attrs:  # a configuration another trial timed: its result, not a new timing
                src = ts[t.user_attrs["duplicate_of"]]
                assert config_name(src) == config_name(t) and src.user_attrs["status"] == t.user_attrs["status"]
    return by_study


def store_doc(tuned: Path) -> dict:
    (path,) = tuned.glob("*.json")
    return json.loads(path.read_text())


def test_a_storage_is_chosen_by_url_or_path(tmp_path):
    assert studies.resolve("sqlite:///x.db") == "sqlite:///x.db"
    assert studies.resolve("postgresql://u@h/db") == "postgresql://u@h/db"
    assert studies.resolve(str(tmp_path / "s.sqlite3")) == f"sqlite:///{tmp_path / 's.sqlite3'}"
    assert studies.resolve(str(tmp_path / "s.log")) == f"journal://{tmp_path / 's.log'}"
    assert studies.resolve(f"journal://{tmp_path}/j") == f"journal://{tmp_path}/j"
    assert studies.describe("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    journal = studies.make_storage(str(tmp_path / "s.log"), 1, 3)
    assert isinstance(journal, studies.JournalHeartbeatStorage) and journal.get_heartbeat_interval() == 1
    assert isinstance(studies.make_storage(f"sqlite:///{tmp_path / 'r.db'}", 1, 3), optuna.storages.RDBStorage)


def test_tuners_started_together_on_an_empty_database_all_open_it(postgres_url):
    """RDBStorage creates its tables on first use: the tuners that lose that race must try again."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        opened = list(pool.map(lambda _: studies._open(postgres_url, 1, 3), range(6)))
    assert all(isinstance(s, optuna.storages.RDBStorage) for s in opened)


@pytest.mark.parametrize("tuners", [2, 4])
def test_tuner_processes_share_studies_and_time_each_configuration_once(shared_storage, tmp_path, tuners):
    logs = [tmp_path / f"eval{i}.log" for i in range(tuners)]
    procs = [start(tune_args(shared_storage, tmp_path / "tuned", log)) for log in logs]
    finish(procs)
    by_study = check_every_trial_evaluated_once(shared_storage, logs, 10, tuners)
    workers = [{t.user_attrs.get("worker") for t in ts if "worker" in t.user_attrs} for ts in by_study.values()]
    assert max(map(len, workers)) >= 2  # a study was tuned by several processes at once
    assert all(log.exists() for log in logs[:2])
    # the store each host wrote locally is the one collected from the storage
    assert cli.main(["tune", "--collect", "--simulate", "--storage", shared_storage, "--tuned-dir", str(tmp_path / "collected")]) == 0
    assert store_doc(tmp_path / "tuned") == store_doc(tmp_path / "collected")


def test_a_tuner_killed_mid_trial_is_failed_by_heartbeat_and_its_trial_retried(shared_storage, tmp_path):
    logs = [tmp_path / "victim.log", tmp_path / "survivor.log"]
    args = ["--seqlen", "1024"]  # one study: the survivor is there when the victim dies
    victim, survivor = (start(tune_args(shared_storage, tmp_path / "tuned", log, 6, 1.0, 4, *args)) for log in logs)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # until the victim is timing a configuration
            started, done = evaluations(logs[:1])
            held = [k for k in started if started[k] > done[k]]
            if held:
                break
            time.sleep(0.05)
        assert held, "the victim never started a trial"
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=30)
        finish([survivor], timeout=180)
    finally:
        for p in (victim, survivor):
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
    (study, config), = held
    (trials,) = all_trials(shared_storage).values()
    dead = [t for t in trials if t.state == TrialState.FAIL and "status" not in t.user_attrs]
    assert len(dead) == 1 and config_name(dead[0]) == config  # failed by its stale heartbeat, by the survivor
    assert dead[0].user_attrs["worker"].split(":")[1].startswith(f"{victim.pid}/")
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == dead[0].number]
    assert retry.user_attrs["status"] == "ok" and config_name(retry) == config
    assert retry.user_attrs["worker"].split(":")[1].startswith(f"{survivor.pid}/")
    started, done = evaluations(logs)
    assert done[study, config] == 1 and max(done.values()) == 1  # timed once, by the survivor: nothing lost
    timed = [t for t in trials
             if t.user_attrs.get("status") not in (None, "pruned") and "duplicate_of" not in t.user_attrs]
    assert 6 <= len(timed) <= 7 and all(t.state.is_finished() for t in trials)


def test_gpus_run_one_tuner_each_on_shared_studies(tmp_path, capsys):
    log = tmp_path / "eval.log"
    storage = f"sqlite:///{tmp_path / 's.db'}"
    assert cli.main(tune_args(storage, tmp_path / "tuned", log, 8, 0.1, 30, "--gpus", "0,1", "--causal", "both")) == 0
    out = capsys.readouterr().out
    assert "2 tuners" in out and "/gpu0" in out and "/gpu1" in out and out.count("added") == 4
    started, done = evaluations([log])
    assert max(done.values()) == 1 and len({s for s, _ in done}) == 4
    workers = {t.user_attrs["worker"].rsplit("/", 1)[1] for ts in all_trials(storage).values() for t in ts
               if "worker" in t.user_attrs}
    assert workers == {"gpu0", "gpu1"}
    doc = store_doc(tmp_path / "tuned")
    assert len(doc["entries"]) == 4
    assert cli.main(["tune", "--collect", "--simulate", "--storage", storage, "--tuned-dir", str(tmp_path / "collected")]) == 0
    assert store_doc(tmp_path / "collected") == doc


def test_a_gpu_given_twice_gets_two_tuners_with_their_own_names(tmp_path, capsys):
    storage = str(tmp_path / "studies.journal")
    assert cli.main(tune_args(storage, tmp_path / "tuned", tmp_path / "e.log", 6, 0.05, 30, "--gpus", "0,0")) == 0
    assert "/gpu0-2" in capsys.readouterr().out


def test_a_mixed_fleet_tunes_one_study_per_gpu_model_and_collects_a_store_per_model(postgres_url, tmp_path, capsys):
    for arch in ("sm80", "sm90"):  # two hosts with different GPUs, one database
        assert cli.main(tune_args(postgres_url, tmp_path / f"host-{arch}", tmp_path / "e.log", 4, 0.0, 30,
                                  "--gpu-arch", arch)) == 0
    names = optuna.get_all_study_names(studies.make_storage(postgres_url))
    assert len(names) == 4 and {n.split("/")[0] for n in names} == {"simulated-gpu-sm80", "simulated-gpu-sm90"}
    capsys.readouterr()
    assert cli.main(["tune", "--collect", "--simulate", "--storage", postgres_url, "--tuned-dir", str(tmp_path / "all")]) == 0
    assert sorted(p.name for p in (tmp_path / "all").glob("*.json")) == ["simulated-gpu-sm80.json",
                                                                          "simulated-gpu-sm90.json"]
    for arch in ("sm80", "sm90"):
        assert store_doc(tmp_path / f"host-{arch}") == json.loads((tmp_path / "all" / f"simulated-gpu-{arch}.json")
                                                                 .read_text())
    assert cli.main(["show", "--from-storage", postgres_url]) == 0
    out = capsys.readouterr().out
    assert "Simulated GPU (sm80)" in out and "Simulated GPU (sm90)" in out and "sm80_d64_bf16_full_s4096" in out
    found = collect(postgres_url)
    assert set(found) == {("Simulated GPU", "sm80"), ("Simulated GPU", "sm90")}


def test_an_unreachable_storage_is_one_line(tmp_path, capsys):
    pytest.importorskip("psycopg2")
    url = f"postgresql+psycopg2://nobody@/nodb?host={tmp_path}"  # no server listens there
    assert cli.main(["tune", "--simulate", "--head-dim", "64", "--storage", url]) == 2
    err = capsys.readouterr().err
    assert "cannot open" in err and "Traceback" not in err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dashboard_serves_the_studies(tmp_path):
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (pip install -e '.[fleet]')")
    storage = str(tmp_path / "studies.journal")
    assert cli.main(tune_args(storage, tmp_path / "tuned", tmp_path / "e.log", 3, 0.0)) == 0
    port = free_port()
    proc = start(["dashboard", "--storage", storage, "--port", str(port)])
    try:
        deadline, body = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    body = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.3)
        assert body is not None, proc.communicate(timeout=5) if proc.poll() is not None else "no answer"
        names = {s["study_name"] for s in body["study_summaries"]}
        assert names == set(optuna.get_all_study_names(studies.make_storage(storage))) and len(names) == 2
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_the_dashboard_without_its_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)
    assert cli.main(["dashboard"]) == 2
    assert "pip install -e '.[fleet]'" in capsys.readouterr().err


def test_gpus_all_starts_a_pinned_backend_per_gpu_sharing_one_compile_pool(tmp_path, monkeypatch, capsys):
    """The GPU wiring of --gpus without GPUs: a fake GpuBackend records how each tuner's backend is made."""
    import flashgen.compile
    from flashgen import worker
    from flashgen.backend import SimulatedBackend

    made, closed = [], []

    class FakeGpu(SimulatedBackend):
        def __init__(self, jobs, deadline_s, compile_timeout_s=0.0, device=None, compiler=None):
            super().__init__()
            self.device, self.compiler = device, compiler
            self.gpu_name, self.gpu_arch, self.driver_version = "Fake GPU", "sm90", "0.0"
            made.append(self)

        def close(self):
            closed.append(self.device)

    monkeypatch.setattr(worker, "GpuBackend", FakeGpu)
    monkeypatch.setattr(worker, "gpu_devices", lambda: [{"index": i, "name": "Fake GPU", "arch": "sm90"}
                                                        for i in range(3)])
    monkeypatch.setattr(flashgen.compile, "nvcc_version", lambda: "12.9")
    storage = str(tmp_path / "s.journal")
    assert cli.main(["tune", *PROBLEMS, "--trials", "4", "--gpus", "all", "--storage", storage,
                     "--tuned-dir", str(tmp_path / "tuned")]) == 0
    assert [b.device for b in made] == [0, 1, 2] and sorted(closed) == [0, 1, 2]
    assert len({id(b.compiler) for b in made}) == 1 and isinstance(made[0].compiler, worker.CompileAhead)
    assert "3 tuners" in capsys.readouterr().out
    doc = store_doc(tmp_path / "tuned")
    assert doc["gpu"]["name"] == "Fake GPU" and all(e["nvcc"] == "12.9" for e in doc["entries"].values())
    assert sum(len(b.calls) > 0 for b in made) >= 2


def test_a_postgresql_url_without_a_driver_opens_with_psycopg2_from_the_fleet_extra(monkeypatch):
    import sqlalchemy

    opened = []
    monkeypatch.setattr(optuna.storages, "RDBStorage", lambda url, **kw: opened.append(url) or object())
    studies.make_storage("postgresql://tuner@db-host/flashgen-driver-test")
    studies.make_storage("postgresql+psycopg://tuner@db-host/flashgen-driver-test")  # a driver named: kept
    assert [sqlalchemy.engine.make_url(u).get_dialect().driver for u in opened] == ["psycopg2", "psycopg"]


@pytest.mark.parametrize("driver, words", [("psycopg2", "pip install -e '.[fleet]' installs it"),
                                           ("psycopg", "name no driver (postgresql://...) for psycopg2")])
def test_a_missing_database_driver_is_named_with_its_fix(driver, words, monkeypatch, capsys):
    def no_driver(url, **kw):
        raise ModuleNotFoundError(f"No module named '{driver}'", name=driver)

    monkeypatch.setattr(optuna.storages, "RDBStorage", no_driver)
    assert cli.main(["tune", "--simulate", "--head-dim", "64", "--storage",
                     f"postgresql+{driver}://tuner@db-host/flashgen-missing-{driver}"]) == 2
    err = capsys.readouterr().err
    assert f"its driver is missing (No module named '{driver}')" in err and words in err, err
