"""Study storages without a server: a storage URL's password never reaches a message (parseable by SQLAlchemy
or not), and the dashboard warns when it serves beyond this machine."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import cli  # noqa: E402

from flashgen import fleet, studies  # noqa: E402

SECRET = "s3cr3t-pw"

URLS = [  # SQLAlchemy parses the first two; the others it cannot
    f"postgresql://tuner:{SECRET}@db-host/flashgen",
    f"mysql+nodriver://tuner:{SECRET}@db-host/flashgen",
    f"postgresql://tuner:{SECRET}@db-host:notaport/flashgen",
    f"postgres ql://tuner:{SECRET}@db-host/flashgen",
    f"postgresql://tuner:{SECRET}@[::1/flashgen",
    f"postgresql://tuner:p@ss/{SECRET}@db-host/flashgen",  # '@' and '/' in an unquoted password
]


@pytest.mark.parametrize("url", URLS)
def test_describe_never_shows_the_password(url):
    shown = studies.describe(url)
    assert SECRET not in shown and "tuner" in shown and "***" in shown


def test_redact_keeps_urls_without_a_password():
    assert studies.redact("postgresql://tuner@db-host/flashgen") == "postgresql://tuner@db-host/flashgen"
    assert studies.redact("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_redact_text_masks_the_password_wherever_an_error_repeats_it():
    url = URLS[2]
    text = f"could not connect to {url} (password {SECRET!r} rejected)"
    out = studies.redact_text(text, url)
    assert SECRET not in out and "could not connect" in out


@pytest.mark.parametrize("url", URLS)
def test_a_storage_that_cannot_be_opened_is_one_line_without_the_password(url, capsys):
    assert cli.main(["tune", "--collect", "--storage", url]) == 2
    err = capsys.readouterr().err
    assert "cannot open" in err and SECRET not in err and "Traceback" not in err


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("::", True),
                                          ("192.168.1.5", True), ("my-host.example", True)])
def test_the_dashboard_warns_when_it_serves_beyond_this_machine(host, warned):
    msg = fleet.dashboard_exposure(host)
    assert (msg is not None) == warned
    if warned:
        assert host in msg and "authentication" in msg


def test_the_dashboard_command_prints_the_warning(monkeypatch, tmp_path, capsys):
    served = []
    fake = type(sys)("optuna_dashboard")
    fake.run_server = lambda storage, host, port: served.append((host, port))
    monkeypatch.setitem(sys.modules, "optuna_dashboard", fake)
    storage = str(tmp_path / "s.journal")
    assert cli.main(["dashboard", "--storage", storage, "--host", "0.0.0.0", "--port", "1"]) == 0
    err = capsys.readouterr().err
    assert served == [("0.0.0.0", 1)] and "0.0.0.0" in err and "authentication" in err
    assert cli.main(["dashboard", "--storage", storage, "--port", "1"]) == 0
    assert "authentication" not in capsys.readouterr().err


# -- tune --collect re-verifies each winner before storing it -----------------------------------------------------

def tampered_study(tmp_path):
    """A sqlite study whose fastest configuration failed verification, then edited to read as the verified best."""
    import sqlite3

    from flashgen.backend import SimulatedBackend
    from flashgen.config import space
    from flashgen.problem import TuneProblem
    from flashgen.search import SearchOptions, search

    p = TuneProblem("Simulated GPU", "sm80", "sm80", "bf16", 64, False, 1024)
    cfgs = [c for c in space("sm80", 64, "bf16", False) if c.num_warps == 4 and c.block_n in (32, 64)][:4]
    bad = cfgs[0]
    failures = {bad.name: "verify_failed"}
    db = tmp_path / "studies.db"
    out = search(p, SimulatedBackend(failures), SearchOptions(storage=f"sqlite:///{db}", exhaustive=True,
                                                               retime_top=0), cfgs)
    assert out.best_config != bad
    with sqlite3.connect(db) as con:
        (trial_id,) = con.execute(
            "SELECT t.trial_id FROM trials t JOIN trial_user_attributes a ON a.trial_id = t.trial_id "
            "WHERE a.key = 'status' AND a.value_json = '\"verify_failed\"'").fetchone()
        con.execute("UPDATE trial_user_attributes SET value_json = '\"ok\"' WHERE trial_id = ? AND key = 'status'",
                    (trial_id,))
        con.execute("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (?, 'ms', '0.0001')",
                    (trial_id,))
    found = fleet.collect(f"sqlite:///{db}")
    assert found[("Simulated GPU", "sm80")][p.key]["kernel"] == bad.name  # the tampered trial reads as the winner
    return f"sqlite:///{db}", p, bad, failures


def test_collect_stores_only_winners_that_verify_again(tmp_path):
    from flashgen.backend import SimulatedBackend

    storage, p, bad, failures = tampered_study(tmp_path)
    found, refused = fleet.verify_winners(fleet.collect(storage), SimulatedBackend(failures))
    assert found == {} and [key for key, _ in refused] == [p.key]
    assert bad.name in refused[0][1] and "verify_failed" in refused[0][1]
    found, refused = fleet.verify_winners(fleet.collect(storage), SimulatedBackend())  # a winner that verifies
    assert refused == [] and found[("Simulated GPU", "sm80")][p.key]["kernel"] == bad.name


def test_collect_refuses_a_winner_of_another_gpu_model(tmp_path):
    from flashgen.backend import SimulatedBackend

    storage, p, _, _ = tampered_study(tmp_path)
    found, refused = fleet.verify_winners(fleet.collect(storage), SimulatedBackend(), gpu=("NVIDIA H200", "sm90"))
    assert found == {} and refused[0][0] == p.key and "Simulated GPU" in refused[0][1]


def test_collect_without_a_gpu_refuses_rather_than_store_unverified(tmp_path, monkeypatch, capsys):

    storage, _, _, _ = tampered_study(tmp_path)
    monkeypatch.setattr(fleet, "current_gpu", lambda: None)
    assert cli.main(["tune", "--collect", "--storage", storage, "--tuned-dir", str(tmp_path / "tuned")]) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "verif" in err and "Traceback" not in err
    assert not (tmp_path / "tuned").exists() or not list((tmp_path / "tuned").iterdir())


def test_collect_names_what_it_refused_and_stores_nothing_of_it(tmp_path, monkeypatch, capsys):
    from flashgen.backend import SimulatedBackend

    storage, p, bad, failures = tampered_study(tmp_path)
    monkeypatch.setattr(fleet, "SimulatedBackend", lambda: SimulatedBackend(failures))  # --simulate's verifier
    assert cli.main(["tune", "--collect", "--simulate", "--storage", storage, "--tuned-dir",
                     str(tmp_path / "tuned")]) == 1
    err = capsys.readouterr().err
    assert p.key in err and bad.name in err and "not stored" in err
    assert not list((tmp_path / "tuned").glob("*.json"))
