"""Where the studies live: the Optuna storage every tuner of a fleet shares.

`--storage` names it, by URL or path:
- an SQLAlchemy URL (`sqlite:///studies.db`, `postgresql://user@host/db`, `mysql://...`): an
  RDBStorage. A server database is what several hosts share; SQLite is for one host.
- `journal:///shared/flashgen.log`, or a path that does not end in .db, .sqlite or .sqlite3: a
  journal file (Optuna's JournalStorage), for a cluster with a shared filesystem and no server.
- a path ending in .db, .sqlite or .sqlite3: that SQLite file.

Both kinds keep a heartbeat of every trial a tuner holds. A trial whose heartbeat is older
than the grace period was held by a tuner that died: `fail_stale_trials` fails it and
RetryHeartbeatStaleTrialCallback queues it once more for any tuner to take. RDBStorage keeps
heartbeats in the database (the server's clock); Optuna's journal has none, so
JournalHeartbeatStorage keeps them in the log as a trial system attribute stamped with the
beating host's clock (hosts sharing a journal need clocks within a few seconds, e.g. NTP).
"""
from __future__ import annotations

import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import optuna
import platformdirs
from optuna.storages import BaseStorage, JournalStorage
from optuna.storages._heartbeat import BaseHeartbeat  # the interface fail_stale_trials works through
from optuna.trial import FrozenTrial, TrialState

SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
JOURNAL_SCHEME = "journal://"
SQLITE_TIMEOUT_S = 60  # several tuners of one host write one SQLite file: wait for its lock, not fail
POSTGRES_DRIVER = "postgresql+psycopg2"  # a bare postgresql:// URL is opened with it: the fleet extra's driver


def default_storage() -> str:
    """SQLite file in the user data dir: the same command finds its study again."""
    path = Path(platformdirs.user_data_dir("flashgen")) / "studies.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def resolve(storage: str | None) -> str:
    """The storage's URL: an SQLAlchemy URL as given, or `journal:///<absolute path>`."""
    if not storage:
        return default_storage()
    if storage.startswith(JOURNAL_SCHEME):
        return JOURNAL_SCHEME + str(Path(storage[len(JOURNAL_SCHEME):]).expanduser().resolve())
    if "://" in storage:
        return storage
    path = Path(storage).expanduser().resolve()
    if path.suffix in SQLITE_SUFFIXES:
        return f"sqlite:///{path}"
    return JOURNAL_SCHEME + str(path)


def journal_path(url: str) -> Path | None:
    return Path(url[len(JOURNAL_SCHEME):]) if url.startswith(JOURNAL_SCHEME) else None


# scheme://user:password@ -> the password, up to the token's last '@' (a password may hold '@' or '/'): masks
# too much rather than too little where SQLAlchemy cannot parse the URL.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.\- ]*://[^:/@\s'\"]*):(?P<password>[^\s'\"]*)@")


def _masked(text: str) -> str:
    return _USERINFO.sub(r"\g<head>:***@", text)


def _at_in_password(url: str) -> bool:
    """Whether the password holds an '@' (unquoted): SQLAlchemy would then split the URL at the first one."""
    return _masked(url).count("@") < url.count("@")


def redact(url: str) -> str:
    """`url` with its password masked (`user:***@`), whether or not SQLAlchemy can parse it."""
    if _at_in_password(url):
        return _masked(url)
    try:
        import sqlalchemy  # noqa: PLC0415  (optuna's dependency, loaded only for a database URL)

        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - any URL SQLAlchemy rejects: mask by pattern
        return _masked(url)


def redact_text(text: str, url: str) -> str:
    """`text` (say an error about opening `url`) with `url`'s password masked wherever it appears."""
    secrets = {m.group("password") for m in _USERINFO.finditer(url)}
    if not _at_in_password(url):
        try:  # the password decoded (%xx), as a driver's error may show it
            import sqlalchemy  # noqa: PLC0415

            secrets.add(sqlalchemy.engine.make_url(url).password or "")
        except Exception:  # noqa: BLE001 - the pattern found what there is
            pass
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    return _masked(text)


def describe(url: str) -> str:
    """The storage for messages, without a password."""
    if journal_path(url):
        return f"journal file {journal_path(url)}"
    return redact(url)


class JournalHeartbeatStorage(JournalStorage, BaseHeartbeat):
    """A journal file with heartbeats: a held trial's last beat is its system attribute `BEAT`."""

    BEAT = "flashgen:heartbeat"

    def __init__(self, path: Path, heartbeat_interval: int, grace_period: int,
                 stale_callback: Callable[[optuna.Study, FrozenTrial], None] | None):
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(optuna.storages.journal.JournalFileBackend(str(path)))
        self._interval, self._grace, self._stale_callback = heartbeat_interval, grace_period, stale_callback

    def record_heartbeat(self, trial_id: int) -> None:
        self.set_trial_system_attr(trial_id, self.BEAT, time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now = time.time()
        return [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
                if self.BEAT in t.system_attrs and now - t.system_attrs[self.BEAT] > self._grace]

    def get_heartbeat_interval(self) -> int | None:
        return self._interval

    def get_heartbeat_stale_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        if self._stale_callback is None:
            return None

        def retry(study: optuna.Study, trial: FrozenTrial) -> None:
            trial.system_attrs.pop(self.BEAT, None)  # the retry starts unbeaten, not already stale
            self._stale_callback(study, trial)  # type: ignore[misc]

        return retry


def _retry_callback() -> dict[str, Any]:
    stale = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)  # Optuna >= 4.9
    if stale is not None:
        return {"heartbeat_stale_trial_callback": stale(max_retry=1)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}


_opened: dict[tuple[str, int | None, int | None], BaseStorage] = {}
_opened_lock = threading.Lock()


def with_driver(url: str) -> str:
    """`url` with PostgreSQL's driver named where it names none: psycopg2, the one the fleet extra installs
    (SQLAlchemy 2.1 takes a bare postgresql:// to mean psycopg 3)."""
    return POSTGRES_DRIVER + url[len("postgresql"):] if url.startswith("postgresql://") else url


def make_storage(storage: str | None, heartbeat_s: int | None = None, grace_s: int | None = None) -> BaseStorage:
    """The storage named by `storage` (see the module doc), with heartbeats when `heartbeat_s` is
    given; a trial without one for `grace_s` is failed and queued again once. One object per
    storage and settings in a process, shared by its threads (both kinds are thread-safe)."""
    url = with_driver(resolve(storage))
    key = (url, heartbeat_s, grace_s)
    with _opened_lock:
        if key not in _opened:
            _opened[key] = _open(url, heartbeat_s, grace_s)
        return _opened[key]


def _open(url: str, heartbeat_s: int | None, grace_s: int | None) -> BaseStorage:
    with warnings.catch_warnings():  # heartbeats and the journal's locks are "experimental"
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        path = journal_path(url)
        if path is not None:
            callback = next(iter(_retry_callback().values())) if heartbeat_s else None
            if heartbeat_s:
                return JournalHeartbeatStorage(path, heartbeat_s, grace_s or 2 * heartbeat_s, callback)
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
        kw: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kw["engine_kwargs"] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        if url.startswith(("postgresql", "mysql")):
            kw["engine_kwargs"] = {"pool_pre_ping": True}  # a server restart must not kill a long tune
        if heartbeat_s:
            kw.update(heartbeat_interval=heartbeat_s, grace_period=grace_s, **_retry_callback())
        return _rdb(url, kw)


def _rdb(url: str, kw: dict[str, Any], attempts: int = 6) -> optuna.storages.RDBStorage:
    """RDBStorage creates its tables on first use: tuners of a fleet started together on an empty
    database race to create them, and the losers' CREATE fails. They try again and find them."""
    import sqlalchemy.exc  # noqa: PLC0415

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, **kw)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")
