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
