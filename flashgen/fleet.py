"""Several tuners over several problems: one per GPU of this host, and any number on others.

Optuna is the scheduler: the tuners of a problem share its study through one storage (see
`studies`) and each asks it for its next trial. This module only decides which study a
tuner turns to next. Tuner i of n on a host starts at problem i·P/n and goes round them
all, so at first each GPU has problems of its own and, as they finish, tuners join the
studies still running. A study whose last trials are held by other tuners (here or on
other hosts) is visited again after the rest until it is finished: if their tuner died,
the trial goes stale and its retry is taken here. Each GPU's tuner is a thread of this
process driving its own spawned GPU worker (fault isolation per GPU); all share the host's
compile pool. `collect` reads the outcome of every study back from the storage; `verify_winners`
compiles and verifies each winner again on this host's GPU before it may be stored: a study is shared
and writable by every tuner, so its record of which trial passed is not proof that one did.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import optuna

from .backend import Backend, SimulatedBackend
from .search import OWNER_WAIT_S, SearchOptions, SearchOutcome, TrialRecord, evaluate, outcome, search
from .store import current_gpu
from .studies import make_storage
from .tunable import Candidate, Problem, candidate_of_entry, entry_of, kind_of, problem_from_dict
from .worker import GpuBackend, NoGpuError

REVISIT_S = 2.0  # how often a tuner with nothing else to do looks at studies other tuners still hold


def worker_names(devices: list) -> list[str]:
    """The tuners' names in the studies: host, process and GPU (and a count for a GPU given twice)."""
    seen: dict[str, int] = {}
    names = []
    for d in devices:
        seen[str(d)] = seen.get(str(d), 0) + 1
        names.append(f"{socket.gethostname()}:{os.getpid()}/gpu{d}" + (f"-{seen[str(d)]}" if seen[str(d)] > 1 else ""))
    return names


@dataclass
class Tuner:
    """One GPU's tuner: its backend, the GPU model it times on, and the versions it records."""

    name: str
    backend: Backend
    gpu_name: str
    gpu_arch: str
    versions: dict[str, str]


@dataclass(frozen=True)
class Job:
    problem: Problem  # any kind (flashgen.tunable): dense, decode, varlen
    space: tuple[Candidate, ...]


def run(tuners: list[Tuner], jobs: list[Job], opts: SearchOptions,
        on_trial: Callable[[Tuner, Job, TrialRecord], Any] | None = None,
        on_done: Callable[[Job, SearchOutcome], Any] | None = None,
        on_start: Callable[[Tuner, Job], Any] | None = None) -> None:
    """Tune every job with the tuners of its GPU model (the model named in its problem). `on_start`
    is called as a tuner turns to a job's study, `on_trial` for each trial it tells, `on_done` with
    each job's outcome once, when the last of this host's tuners has left its study.
    One tuner runs in the calling thread (Ctrl-C stops it as a plain `search` would); several run
    in threads, and Ctrl-C stops each after the trial it is timing."""
    mine = {id(t): [j for j in jobs if (j.problem.gpu_name, j.problem.gpu_arch) == (t.gpu_name, t.gpu_arch)]
            for t in tuners}
    left = {j: sum(j in mine[id(t)] for t in tuners) for j in jobs}  # this host's tuners yet to leave the job
    lock, stop = threading.Lock(), threading.Event()

    def leave(job: Job, out: SearchOutcome) -> None:
        with lock:
            left[job] -= 1
            last = left[job] == 0
        if last and on_done is not None:
            on_done(job, out)

    def work(tuner: Tuner) -> None:
        peers = [t for t in tuners if (t.gpu_name, t.gpu_arch) == (tuner.gpu_name, tuner.gpu_arch)]
        rank = next(i for i, t in enumerate(peers) if t is tuner)
        own = mine[id(tuner)]
        first = rank * len(own) // len(peers)
        _tune(tuner, own[first:] + own[:first], replace(opts, worker=tuner.name, versions=tuner.versions,
                                                         stop=stop if len(tuners) > 1 else opts.stop),
              on_start, on_trial, leave)

    if len(tuners) == 1:
        work(tuners[0])
        return
    errors: list[BaseException] = []

    def guarded(tuner: Tuner) -> None:
        try:
            work(tuner)
        except BaseException as e:  # noqa: BLE001 - stop the others, raise it in the caller
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(t,), name=f"flashgen-tuner-{t.name}", daemon=True)
               for t in tuners]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.5)
    except KeyboardInterrupt:
        stop.set()  # each tuner finishes the trial it is timing and closes those it holds
        for th in threads:
            th.join()
        raise
    if errors:
        raise errors[0]


def _tune(tuner: Tuner, order: list[Job], opts: SearchOptions, on_start: Callable[[Tuner, Job], Any] | None,
          on_trial: Callable[[Tuner, Job, TrialRecord], Any] | None,
          leave: Callable[[Job, SearchOutcome], None]) -> None:
    todo = list(order)
    last: dict[Job, tuple[tuple[int, int], float]] = {}  # the study's progress, and since when it is unchanged
    patience = max(OWNER_WAIT_S, 2 * opts.grace_s)
    while todo and not (opts.stop is not None and opts.stop.is_set()):
        for job in list(todo):
            if opts.stop is not None and opts.stop.is_set():
                return
            if on_start is not None:
                on_start(tuner, job)
            report = (lambda rec, job=job: on_trial(tuner, job, rec)) if on_trial else None
            out = search(job.problem, tuner.backend, opts, list(job.space), report)
            progress = (out.trials, sum(out.counts.values()))
            if progress != last.get(job, (None, 0.0))[0]:
                last[job] = (progress, time.monotonic())
            stuck = time.monotonic() - last[job][1] > patience
            if stuck:
                warnings.warn(f"{job.problem.key}: {out.in_flight} trials held by other tuners made no progress "
                              f"in {patience:.0f} s; leaving the study to them", stacklevel=1)
            if out.in_flight == 0 or stuck:
                todo.remove(job)
                leave(job, out)
        if todo and opts.stop is not None:
            opts.stop.wait(REVISIT_S)
        elif todo:
            time.sleep(REVISIT_S)


def studies(storage: str | None) -> Iterator[tuple[str, Problem, optuna.Study]]:
    """Every flashgen study in the storage (those that record their problem, of any kind), by name."""
    st = make_storage(storage)
    for name in sorted(optuna.get_all_study_names(st)):
        study = optuna.load_study(study_name=name, storage=st)
        p = study.user_attrs.get("problem")
        try:
            problem = problem_from_dict(p) if isinstance(p, dict) else None
        except TypeError:  # another version's problem record
            problem = None
        if problem is not None:
            yield name, problem, study


def collect(storage: str | None) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """The store entries the storage's studies hold: (GPU name, arch) -> problem key -> entry. Of
    several studies of one problem (restricted spaces), the fastest verified result."""
    found: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for _, problem, study in studies(storage):
        out = outcome(study, problem, kind_of(problem).default(problem))
        entry = entry_of(out, out.versions or {"nvcc": "unknown", "driver": "unknown"})
        if entry is None:
            continue
        entries = found.setdefault((problem.gpu_name, problem.gpu_arch), {})
        old = entries.get(problem.key)
        if old is None or entry["median_ms"] < old["median_ms"]:
            entries[problem.key] = entry
    return found


Found = dict[tuple[str, str], dict[str, dict[str, Any]]]


class NoVerifier(RuntimeError):
    """tune --collect has no GPU here to verify the winners on."""


def collect_backend(simulate: bool = False) -> tuple[Backend, tuple[str, str] | None]:
    """The backend that verifies collected winners and the (GPU name, arch) it runs on: this host's GPU, or
    (`simulate`, for tests) the simulated backend, for any GPU model. NoVerifier without a GPU: storing a
    winner unverified would trust whatever the study says."""
    why = "no GPU here"
    if simulate:
        return SimulatedBackend(), None
    if current_gpu() is not None:
        try:
            gpu = GpuBackend()
        except NoGpuError as e:
            why = f"no GPU here ({e})"
        else:
            return gpu, (gpu.gpu_name, gpu.gpu_arch)
    raise NoVerifier(f"tune --collect compiles and verifies each study's winner on this host's GPU before storing it, "
                     f"and there is {why}: run it on a host with the studies' GPU model")


def verify_winners(found: Found, backend: Backend,
                   gpu: tuple[str, str] | None = None) -> tuple[Found, list[tuple[str, str]]]:
    """The entries of `found` (collect's) whose configuration compiles and verifies again on `backend` (the
    search's evaluate: compile, verify against the float64 reference, time), and (problem key, why) for each
    refused one. `gpu`: the (name, arch) the backend runs on; a winner of another GPU model is refused (None:
    any, the simulated backend)."""
    kept: Found = {}
    refused: list[tuple[str, str]] = []
    for model, entries in sorted(found.items()):
        for key, e in sorted(entries.items()):
            problem = problem_from_dict(e["problem"])
            cfg = candidate_of_entry(e)
            if gpu is not None and model != gpu:
                refused.append((key, f"tuned on {model[0]} ({model[1]}), cannot be verified on this {gpu[0]} "
                                     f"({gpu[1]}): collect it on a {model[0]} host"))
                continue
            res = evaluate(backend, cfg, problem)
            if not res.ok:
                refused.append((key, f"{cfg.name}, the study's winner, does not pass here: {res.status}: "
                                     f"{res.reason}"))
                continue
            kept.setdefault(model, {})[key] = e
    return kept, refused


def dashboard_exposure(host: str) -> str | None:
    """A warning when optuna-dashboard would serve on `host` beyond this machine (not localhost, 127.0.0.0/8 or
    ::1): it has no authentication, and its routes can change or delete the studies. None for a loopback host."""
    name = host.strip().strip("[]")
    if name.lower() in ("localhost", "localhost."):
        return None
    try:
        if ipaddress.ip_address(name).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to any interface
        pass
    return (f"warning: the dashboard serves on {host}, beyond this machine, without authentication: anyone who can "
            "reach the port can change or delete the studies (and so what tune --collect stores). Serve on "
            "127.0.0.1 and reach it through an SSH tunnel (ssh -L 8080:127.0.0.1:8080 host) instead.")
