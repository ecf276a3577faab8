"""Fixtures for the fleet tests: a real PostgreSQL server, and storages of each kind on it or on disk.

The server runs from the machine's PostgreSQL binaries (initdb, pg_ctl: on PATH, in
FLASHGEN_PG_BIN, or Debian's /usr/lib/postgresql/<version>/bin) in a temporary directory,
listening on a unix socket only, for the whole session; each test gets a fresh database.
initdb refuses to run as root, so as root the server runs as the unprivileged user `nobody`
(the directory is handed to it). Without binaries, psycopg2, or such a user, the tests that
need the server skip with that reason.
"""
from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

PG_USER = "flashgen"


def pg_bin() -> Path | None:
    """The directory of initdb and pg_ctl."""
    candidates = [os.environ.get("FLASHGEN_PG_BIN")]
    found = shutil.which("pg_ctl")
    candidates.append(str(Path(found).resolve().parent) if found else None)
    candidates += sorted((str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")), reverse=True)
    for c in candidates:
        if c and (Path(c) / "initdb").is_file() and (Path(c) / "pg_ctl").is_file():
            return Path(c)
    return None


def _missing() -> str | None:
    if pg_bin() is None:
        return ("no PostgreSQL server binaries (initdb, pg_ctl) on PATH, in FLASHGEN_PG_BIN or in "
                "/usr/lib/postgresql/*/bin; install the postgresql package to run these tests")
    try:
        import psycopg2  # noqa: F401, PLC0415
    except ImportError:
        return "psycopg2 is not installed (pip install -e '.[fleet]')"
    if os.getuid() == 0:
        try:
            pwd.getpwnam("nobody")
        except KeyError:
            return ("running as root, and there is no unprivileged user 'nobody' to run PostgreSQL as "
                    "(initdb refuses root)")
    return None


class PostgresServer:
    def __init__(self) -> None:
        self.bin = pg_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="flashgen-pg-"))  # not under pytest's root-only tmp: `nobody` reads it
        self.data, self.sock = self.dir / "data", self.dir / "sock"
        self.sock.mkdir()
        self.run_as: dict = {}
        if os.getuid() == 0:
            who = pwd.getpwnam("nobody")
            for p in (self.dir, self.sock):
                os.chown(p, who.pw_uid, who.pw_gid)
            self.run_as = {"user": who.pw_uid, "group": who.pw_gid, "extra_groups": []}
        self._names = itertools.count()

    def _run(self, *cmd: str, timeout: float = 120) -> None:
        env = {**os.environ, "LC_ALL": "C", "HOME": str(self.dir)}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.dir, env=env, **self.run_as)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")

    def start(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", PG_USER, "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        opts = f"-c listen_addresses='' -c unix_socket_directories={self.sock} -c fsync=off -c max_connections=200"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w",
                  "-t", "60", "start")

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, db: str) -> str:
        return f"postgresql+psycopg2://{PG_USER}@/{db}?host={self.sock}"

    def new_database(self) -> str:
        import psycopg2  # noqa: PLC0415

        name = f"studies_{os.getpid()}_{next(self._names)}"
        conn = psycopg2.connect(dbname="postgres", user=PG_USER, host=str(self.sock))
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()
        return self.url(name)


@pytest.fixture(scope="session")
def postgres_server():
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer()
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh database on the session's PostgreSQL server, as an SQLAlchemy URL."""
    return postgres_server.new_database()


@pytest.fixture(params=["postgresql", "journal"])
def shared_storage(request, tmp_path) -> str:
    """A storage several tuners share: a PostgreSQL database, or a journal file (Optuna's JournalStorage)."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_url")
    return str(tmp_path / "studies.journal")
