"""The compile pool and the GPU backend when their processes die or hang: failed trials, never a stopped tune.

The fake compile functions and hello task below run in spawned processes, which import this module by name.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashgen import worker
from flashgen.compile import CompileError
from flashgen.config import KernelConfig
from flashgen.problem import TuneProblem
from flashgen.worker import CompileAhead, GpuBackend, Worker

MAIN_PID = os.getpid()  # a spawned child re-imports this module: its MAIN_PID is its own pid
PIDS_ENV = "FLASHGEN_TEST_PIDS"  # where a hanging fake compile writes the pids to be killed
HELLO_ENV = "FLASHGEN_TEST_HELLO"  # the fake hello's marker file: it fails once the file exists

DIES = KernelConfig(64, "bf16", False, 64, 64, 4, 3)  # its compile process is killed, as by the OOM killer
HANGS = KernelConfig(64, "bf16", False, 64, 64, 4, 1)  # its "ptxas" never returns
FINE = [KernelConfig(64, "bf16", False, 128, bn, 4, 2) for bn in (32, 64, 128)]


def fake_compile(cfg: KernelConfig, target: str) -> str:
    if cfg == DIES:
        if os.environ.get("FLASHGEN_TEST_MAIN") == str(os.getpid()):
            raise RuntimeError("compiled in the tuner's own process, where a kill would end the tune")
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg == HANGS:
        child = subprocess.Popen(["sleep", "600"])  # stands for nvcc's ptxas, a grandchild of the pool
        Path(os.environ[PIDS_ENV]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    return f"{cfg.name} for {target}"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(worker, "compile_kernel", fake_compile)
    monkeypatch.setenv("FLASHGEN_TEST_MAIN", str(os.getpid()))
    monkeypatch.setenv(PIDS_ENV, str(tmp_path / "pids"))
    return tmp_path / "pids"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:  # reaped between the signal and the read
        return False


def test_a_killed_compile_process_fails_that_compile_and_the_pool_goes_on(fake):
    pool = CompileAhead(jobs=2)
    try:
        pool.submit(DIES, "sm_80")
        deadline = time.monotonic() + 60
        while not all(f.done() for f in pool._futures.values()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the pool is broken now, nobody has asked yet
        for c in FINE:
            pool.submit(c, "sm_80")  # prefetching into a broken pool starts a new one
        assert [pool.get(c, "sm_80") for c in FINE] == [f"{c.name} for sm_80" for c in FINE]
        with pytest.raises(CompileError, match="compile process died"):
            pool.get(DIES, "sm_80")
        assert pool.get(FINE[0], "sm_80") == f"{FINE[0].name} for sm_80"
    finally:
        pool.close()


def test_a_hung_compile_times_out_and_is_killed_with_its_children(fake):
    pool = CompileAhead(jobs=2, timeout_s=3)
    pids: list[int] = []
    try:
        pool.submit(HANGS, "sm_80")
        pool.submit(FINE[0], "sm_80")
        t = time.monotonic()
        with pytest.raises(CompileError, match="within 3 s"):
            pool.get(HANGS, "sm_80")
        assert time.monotonic() - t < 30
        pids = [int(p) for p in fake.read_text().split()]
        deadline = time.monotonic() + 10
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, pids))  # the pool process and its "ptxas"
        assert pool.get(FINE[0], "sm_80") == f"{FINE[0].name} for sm_80"  # a new pool for the rest
    finally:
        pool.close()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def fake_resources() -> SimpleNamespace:
    return SimpleNamespace(resources=SimpleNamespace(registers=64, spill_stores=0, spill_loads=0, smem_bytes=0))


def test_gpu_backend_reports_a_hung_compile_as_compile_failed(fake):
    b = object.__new__(GpuBackend)  # no GPU here: only the compile step is exercised
    b.worker, b.gpu_arch, b.compiler = None, "sm80", CompileAhead(1, timeout_s=2)
    p = TuneProblem("G", "sm80", "sm80", "bf16", 64, False, 1024)
    try:
        res = b.evaluate(HANGS, p)
        assert res.status == "compile_failed" and "within 2 s" in res.reason
    finally:
        b.compiler.close()
        pids = [int(x) for x in fake.read_text().split()] if fake.exists() else []
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def hello_once() -> dict:
    """A GPU that is gone after the first start (e.g. the driver fell over with the faulting kernel)."""
    mark = Path(os.environ[HELLO_ENV])
    if mark.exists():
        raise RuntimeError("no CUDA device any more")
    mark.write_text("started")
    return {"name": "Fake GPU", "arch": "sm80", "driver": "0.0"}


def test_a_worker_that_cannot_restart_is_an_error_value(monkeypatch, tmp_path):
    monkeypatch.setenv(HELLO_ENV, str(tmp_path / "hello"))

    class Compiled:
        def get(self, cfg, target):
            return fake_resources()

        def close(self):
            pass

    b = object.__new__(GpuBackend)
    b.worker, b.gpu_arch, b.compiler = Worker(hello=f"{__name__}:hello_once"), "sm80", Compiled()
    b.deadline_s, b.warmup, b.reps = 30, 1, 1
    p = TuneProblem("G", "sm80", "sm80", "bf16", 64, False, 1024)
    try:
        assert b.worker.call("builtins:len", ()) == ("ok", 0)
        assert b.worker.call("os:_exit", 3)[0] == "faulted"  # the kernel took the worker down
        res = b.evaluate(p.default_config(), p)  # the restart's hello fails
        assert res.status == "error" and "no CUDA device any more" in res.reason
        assert res.info["registers"] == 64
    finally:
        b.worker.close()


def test_a_pinned_worker_sees_only_its_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker.pinned(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the tuner's own view: indices are into it
    assert worker.pinned(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(worker.NoGpuError, match="not among"):
        worker.pinned(2)
    w = Worker(env=worker.pinned(0))
    try:
        assert w.call("os:getenv", "CUDA_VISIBLE_DEVICES") == ("ok", "2")
        w.call("os:_exit", 3)  # a restarted worker is pinned again
        assert w.call("os:getenv", "CUDA_VISIBLE_DEVICES") == ("ok", "2")
    finally:
        w.close()


def test_one_compile_pool_serves_the_tuners_of_several_gpus(fake):
    """Threads share the pool; one compile that kills its process breaks the pool for all of them:
    the pool is replaced once, the others' compiles are retried, and only the culprit fails."""
    from concurrent.futures import ThreadPoolExecutor

    pool = CompileAhead(jobs=2)
    cfgs = [KernelConfig(64, "bf16", False, bm, bn, 4, st) for bm in (64, 128) for bn in (32, 64) for st in (1, 2)]
    cfgs = [c for c in cfgs if c not in (DIES, HANGS)]

    def get(c):
        try:
            return pool.get(c, "sm_80")
        except CompileError as e:
            return e

    try:
        with ThreadPoolExecutor(4) as threads:
            results = list(threads.map(get, [DIES, *cfgs]))
        assert isinstance(results[0], CompileError) and "died" in str(results[0])
        assert results[1:] == [f"{c.name} for sm_80" for c in cfgs]
    finally:
        pool.close()
