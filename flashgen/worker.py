"""Step 6b: compile ahead on all cores, time on the GPU in a process the tuner can lose.

A kernel that faults (illegal address, launch failure) poisons its CUDA context, and
one that hangs never returns; either would end a study run in-process. So the GPU work
runs in a spawned worker process: a fault makes it report and exit, a hang past the
deadline gets it killed, and the next trial starts a fresh one. Compiles run in a
process pool, `ahead` of the configuration being timed; one that dies or hangs fails its
trial, not the tune. With several GPUs, each has a worker of its own, pinned to it by
CUDA_VISIBLE_DEVICES, and their backends share one compile pool.
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from . import driver
from .backend import SimulatedBackend, TrialResult, ok_result
from .bench import kernel_timer, retime_best, time_backward, time_cuda, time_kernel
from .compile import CompiledKernel, CompileError, compile_kernel, target_for
from .config import KernelConfig, backward_forward_config
from .launch import FwdParams
from .modifiers import Modifier, ModifierError, register, registered
from .problem import TuneProblem
from .tunable import Candidate, Problem, kind_of
from .verify import verify, verify_backward

FAULT_HOOK_ENV = "FLASHGEN_TEST_FAULT"  # a config name: the worker launches it on an illegal address (tests)
HANG_HOOK_ENV = "FLASHGEN_TEST_HANG"  # a config name: the worker hangs instead of running it (tests)
COMPILE_TIMEOUT_S = 600.0  # one compile (nvcc + ptxas) taking longer is hung
_FAULT_MARKS = ("CUDA_ERROR", "CUDA error", "CudaError", "illegal memory access", "launch failure")


class NoGpuError(RuntimeError):
    """No usable GPU for timing (no driver, no device, or no torch in the worker)."""


def _resolve(task: str) -> Any:
    module, _, name = task.partition(":")
    return getattr(importlib.import_module(module), name)


def _serve(conn: Any, env: dict[str, str] | None = None) -> None:
    """The worker's loop: run `module:function(*args)` tasks and send back (kind, value)."""
    os.environ.update(env or {})  # before any task: CUDA reads CUDA_VISIBLE_DEVICES once, at cuInit
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg is None:
            return
        task, args = msg
        try:
            conn.send(("ok", _resolve(task)(*args)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back as a value
            text = f"{type(e).__name__}: {e}".strip()
            if any(m in text for m in _FAULT_MARKS):
                conn.send(("faulted", text))
                os._exit(3)  # the CUDA context is unusable after a fault: let the tuner start a fresh worker
            conn.send(("error", text))


class Worker:
    """One spawned process running tasks; restarted after it dies, faults or hangs."""

    def __init__(self, hello: str | None = None, start_deadline_s: float = 180.0, env: dict[str, str] | None = None):
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Any = None
        self.hello, self.start_deadline_s, self.env = hello, start_deadline_s, dict(env or {})
        self.info: Any = None  # what the hello task returned
        self.restarts = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.env), daemon=True, name="flashgen-gpu-worker")
        self._proc.start()
        child.close()
        self._conn = parent
        if self.hello:
            kind, value = self._send(self.hello, (), self.start_deadline_s)
            if kind != "ok":
                self._stop()
                raise NoGpuError(f"the GPU worker could not start: {value}")
            self.info = value

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
            self.restarts += 1
        self._proc = self._conn = None

    def _send(self, task: str, args: tuple, deadline_s: float) -> tuple[str, Any]:
        try:
            self._conn.send((task, args))
            if not self._conn.poll(deadline_s):
                self._stop()
                return "timeout", f"no answer within {deadline_s:g} s (hung kernel?); worker restarted"
            kind, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(10)
            code = self._proc.exitcode
            self._stop()
            return "faulted", f"the worker died (exit code {code}); restarted"
        if kind == "faulted":
            self._stop()
        return kind, value

    def call(self, task: str, *args: Any, deadline_s: float = 120.0) -> tuple[str, Any]:
        """Run `module:function(*args)` in the worker: ("ok", value) or ("error"|"faulted"|"timeout", reason)."""
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self._stop()
            self._start()
        return self._send(task, args, deadline_s)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        self._proc = self._conn = None


class CompileAhead:
    """Compiles configurations in a process pool; `get` waits for one (compiling it now if never asked).

    A compile process that dies (killed for memory) breaks the whole pool, and a hung nvcc or
    ptxas never returns: either becomes a CompileError for that configuration and a new pool
    for the rest. Pool processes lead their own process group, so a kill takes nvcc and ptxas too.
    Thread-safe: the tuners of several GPUs share one pool; a pool is replaced only by the first
    thread that finds it broken, not again by the others that waited on it."""

    def __init__(self, jobs: int | None = None, timeout_s: float = COMPILE_TIMEOUT_S):
        self.jobs = jobs or os.cpu_count() or 1
        self.timeout_s = timeout_s  # for one configuration, from `get`
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[tuple[KernelConfig, str], Future] = {}
        self._lock = threading.RLock()

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=mp.get_context("spawn"), initializer=os.setpgrp)
        return self._pool

    def submit(self, cfg: KernelConfig, target: str) -> None:
        with self._lock:
            if (cfg, target) in self._futures:
                return
            args = compile_args(cfg, target)
            try:
                fut = self._executor().submit(*args)
            except BrokenProcessPool:  # a compile process died since the last `get`: a new pool
                self._replace(self._pool)
                fut = self._executor().submit(*args)
            fut.pool = self._pool  # type: ignore[attr-defined] - which pool to replace if this one breaks
            self._futures[cfg, target] = fut

    def get(self, cfg: KernelConfig, target: str) -> CompiledKernel:
        """The compiled kernel; raises CompileError (also for a compile that died twice or hung)."""
        with self._lock:
            self.submit(cfg, target)
            fut = self._futures.pop((cfg, target))
        try:
            return fut.result(timeout=self.timeout_s)
        except BrokenProcessPool:
            self._replace(fut.pool)  # type: ignore[attr-defined]
        except FutureTimeout:
            self._replace(fut.pool)  # type: ignore[attr-defined]
            raise CompileError(f"{cfg.name}: no compile result within {self.timeout_s:g} s (hung nvcc or "
                               "ptxas?); killed") from None
        except subprocess.TimeoutExpired as e:
            raise CompileError(f"{cfg.name}: {e}") from None
        # A dead process breaks the pool for every compile in it (other tuners' too): compile this one
        # again in a process of its own, so that only the one that dies again is blamed.
        alone = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=os.setpgrp)
        try:
            return alone.submit(*compile_args(cfg, target)).result(timeout=self.timeout_s)
        except BrokenProcessPool as e:
            raise CompileError(f"{cfg.name}: the compile process died, twice ({e}); killed for memory?") from None
        except FutureTimeout:
            raise CompileError(f"{cfg.name}: no compile result within {self.timeout_s:g} s (hung nvcc or "
                               "ptxas?); killed") from None
        except subprocess.TimeoutExpired as e:
            raise CompileError(f"{cfg.name}: {e}") from None
        finally:
            _kill(alone)

    def _replace(self, pool: ProcessPoolExecutor | None) -> None:
        with self._lock:
            if pool is not None and pool is self._pool:
                self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """Stop the pool; pending compiles are forgotten. With nothing pending its idle processes exit by
        themselves (a killed pool leaves its wake-up pipe to fail noisily at interpreter exit); with
        compiles pending, or `kill` (a broken or hung pool), what still runs is killed."""
        with self._lock:
            if self._pool is not None:
                if kill or any(not f.done() for f in self._futures.values()):
                    _kill(self._pool)
                else:
                    self._pool.shutdown(wait=True)
            self._pool, self._futures = None, {}


def compile_args(cfg: KernelConfig, target: str) -> tuple:
    """A pool's task compiling `cfg`: compile_kernel itself, or, for a kernel generated with modifiers, `compile_with`
    and the modifiers as data (the pool's processes have not traced them; the render finds them by digest)."""
    digests = (getattr(cfg, "score_mod", ""), getattr(cfg, "mask_mod", ""))
    if not any(digests):
        return compile_kernel, cfg, target
    return compile_with, cfg, target, registered(digests)


def compile_with(cfg: KernelConfig, target: str, mods: tuple[Modifier, ...]) -> CompiledKernel:
    """compile_kernel in a process that registers the kernel's modifiers first."""
    for m in mods:
        register(m)
    return compile_kernel(cfg, target)


def _kill(pool: ProcessPoolExecutor) -> None:
    """Shut a pool down, killing its processes and their groups (nvcc, ptxas) if still running."""
    for pid in list((getattr(pool, "_processes", None) or {}).keys()):
        for kill in (os.killpg, os.kill):  # its group (nvcc, ptxas), then itself
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
    pool.shutdown(wait=False, cancel_futures=True)


def compile_reason(e: Exception, lines: int = 6) -> str:
    text = str(e).strip().splitlines()
    return "\n".join(text[:lines] + (["..."] if len(text) > lines else []))


def pinned(device: int) -> dict[str, str]:
    """The environment that shows a worker only GPU `device` (an index among those this process sees)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in os.environ and device >= len(visible):
        raise NoGpuError(f"GPU {device} is not among CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
    return {"CUDA_VISIBLE_DEVICES": visible[device] if visible else str(device)}


def gpu_devices() -> list[dict[str, Any]]:
    """The GPUs this process sees (a fresh worker asks the driver, so the tuner never initialises CUDA)."""
    w = Worker(hello="flashgen.worker:gpu_list")
    try:
        w.call("builtins:len", ())
        return list(w.info)
    finally:
        w.close()


def fwd_config_for(problem: TuneProblem) -> KernelConfig:
    """The forward that makes out and lse for a backward trial: the sm80 family's default on the problem's GPU
    (the backward templates are sm80's; its out and lse are exact either way, verification says so)."""
    return backward_forward_config(problem.head_dim, problem.dtype, problem.causal, problem.gpu_arch)


class GpuBackend:
    """Times configurations on one GPU: compile ahead, then verify and time in the worker.

    `device` pins the worker to that GPU (None: the default one); `compiler` is a compile pool
    shared with the backends of the other GPUs (None: one of its own, closed with the backend)."""

    def __init__(self, jobs: int | None = None, deadline_s: float = 120.0, warmup: int = 10, reps: int = 50,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S, device: int | None = None,
                 compiler: CompileAhead | None = None):
        self.device = device
        self.worker = Worker(hello="flashgen.worker:gpu_hello", env=pinned(device) if device is not None else None)
        self.worker.call("builtins:len", ())  # starts the worker, raising NoGpuError without a GPU
        info = self.worker.info
        self.gpu_name, self.gpu_arch, self.driver_version = info["name"], info["arch"], info["driver"]
        self._own_compiler = compiler is None
        self.compiler = compiler or CompileAhead(jobs, compile_timeout_s)
        self.deadline_s, self.warmup, self.reps = deadline_s, warmup, reps

    def target(self, cfg: KernelConfig) -> str:
        return target_for(self.gpu_arch, cfg.family)

    def prefetch(self, configs: list[Candidate], problem: Problem) -> None:
        kind = kind_of(problem)
        if kind.trial_task is not None:  # a serving problem: its candidates' kernels
            configs = [k for c in configs for k in kind.kernels(problem, c)]
        elif problem.pass_ == "bwd":
            configs = [fwd_config_for(problem), *configs]
        for cfg in configs:
            self.compiler.submit(cfg, self.target(cfg))

    def evaluate(self, config: Candidate, problem: Problem, reps: int | None = None) -> TrialResult:
        """A trial: compile (ahead), verify, then time with `reps` calls (None: the backend's `reps`)."""
        if kind_of(problem).trial_task is not None:
            return self.evaluate_serving(config, problem, reps)
        try:
            kernel = self.compiler.get(config, self.target(config))
            fwd = None
            if problem.pass_ == "bwd":  # the forward that makes out and lse (compiled once, cached)
                fwd_cfg = fwd_config_for(problem)
                fwd = self.compiler.get(fwd_cfg, self.target(fwd_cfg))
        except CompileError as e:
            return TrialResult("compile_failed", reason=compile_reason(e))
        r = kernel.resources
        info = {"registers": r.registers, "spill_bytes": r.spill_stores + r.spill_loads, "smem_bytes": r.smem_bytes}
        reps = self.reps if reps is None else reps
        try:
            if fwd is None:
                kind, value = self.worker.call("flashgen.worker:gpu_trial", kernel, problem, self.warmup, reps,
                                               deadline_s=self.deadline_s)
            else:
                kind, value = self.worker.call("flashgen.worker:gpu_trial_bwd", kernel, fwd, problem, self.warmup,
                                               reps, deadline_s=self.deadline_s)
        except NoGpuError as e:  # the worker could not be restarted after a fault: still a value
            return TrialResult("error", reason=str(e), info=info)
        if kind != "ok":  # "error" (an exception in the worker, e.g. out of memory), "faulted" or "timeout"
            return TrialResult(kind, reason=value, info=info)
        info["max_err"] = value["max_err"]
        if value["status"] != "ok":
            return TrialResult(value["status"], reason=value["reason"], info=info)
        return ok_result(problem, value["ms"], **info)

    def evaluate_serving(self, cand: Candidate, problem: Problem, reps: int | None = None) -> TrialResult:
        """A decode or varlen trial: its kernels compiled here (ahead), then the kind's worker task verifies the
        candidate against float64 on the problem's inputs and times it through the launcher the calls use."""
        kind = kind_of(problem)
        info: dict[str, Any] = {}
        try:
            extra = kind.task_args(problem)
        except ModifierError as e:  # a modifier problem whose modifiers this process has not traced
            return TrialResult("error", reason=str(e))
        try:
            for cfg in kind.kernels(problem, cand):
                kernel = self.compiler.get(cfg, self.target(cfg))
                r = kernel.resources
                info = {"registers": r.registers, "spill_bytes": r.spill_stores + r.spill_loads,
                        "smem_bytes": r.smem_bytes}
                why = kind.compile_reason(problem, kernel)
                if why is not None:
                    return TrialResult("pruned", reason=why, info=info)
        except CompileError as e:
            return TrialResult("compile_failed", reason=compile_reason(e))
        try:
            status, value = self.worker.call(kind.trial_task, problem, cand, self.warmup,
                                             self.reps if reps is None else reps, *extra,
                                             deadline_s=self.deadline_s)
        except NoGpuError as e:
            return TrialResult("error", reason=str(e), info=info)
        if status != "ok":
            return TrialResult(status, reason=value, info=info)
        info.update({k: value[k] for k in ("max_err", "kernel") if k in value})
        if value["status"] != "ok":
            return TrialResult(value["status"], reason=value["reason"], info=info)
        return ok_result(problem, value["ms"], **info)

    def retime(self, configs: list[Candidate], problem: Problem, rounds: int) -> list[float | None]:
        """Each configuration's median ms over `rounds` rounds that time them all in turn on one input set
        (None where it cannot be timed: a backward problem, a compile error, a worker error)."""
        kind = kind_of(problem)
        if kind.retime_task is not None and configs:
            try:
                extra = kind.task_args(problem)
            except ModifierError:
                return [None] * len(configs)
            try:
                status, value = self.worker.call(kind.retime_task, problem, configs, rounds, self.warmup, self.reps,
                                                 *extra, deadline_s=self.deadline_s * rounds)
            except NoGpuError:
                return [None] * len(configs)
            return value if status == "ok" else [None] * len(configs)
        if problem.pass_ != "fwd" or not configs:
            return [None] * len(configs)
        try:
            kernels = [self.compiler.get(c, self.target(c)) for c in configs]
        except CompileError:
            return [None] * len(configs)
        try:
            kind, value = self.worker.call("flashgen.worker:gpu_retime", kernels, problem, rounds, self.warmup,
                                           self.reps, deadline_s=self.deadline_s * rounds)
        except NoGpuError:
            return [None] * len(configs)
        return value if kind == "ok" else [None] * len(configs)

    def close(self) -> None:
        if getattr(self, "_own_compiler", True):
            self.compiler.close()
        self.worker.close()


# -- tasks that run inside the worker process ---------------------------------------------

def gpu_hello() -> dict[str, Any]:
    """The worker's GPU: name, arch, driver version. Imports torch now so that trials do not pay for it."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise NoGpuError("torch sees no CUDA device")
    dev = driver.device_info()
    return {"name": dev.name, "arch": dev.arch, "sm_count": dev.sm_count, "driver": driver.version()}


def gpu_list() -> list[dict[str, Any]]:
    """Every visible GPU: index, name, arch."""
    import ctypes  # noqa: PLC0415

    n = ctypes.c_int()
    driver.check(driver.lib().cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    return [{"index": i, "name": driver.device_info(i).name, "arch": driver.device_info(i).arch} for i in range(n.value)]


def _launch_illegal(kernel: CompiledKernel) -> None:
    """Test hook: launch the kernel on pointers no allocation owns, so it faults for real."""
    cfg, bad = kernel.config, 0x10000
    row = cfg.head_dim  # one head: rows are head_dim apart
    strides = [cfg.block_m * row, row, row] * 4
    p = FwdParams(bad, bad, bad, bad, bad, *strides, 1, 1, 1, cfg.block_m, cfg.block_n, 1.0, 1.4426950408889634)
    driver.get_function(kernel.cubin, cfg.name, cfg.smem_bytes).launch(
        cfg.grid(1, 1, cfg.block_m, driver.device_info().sm_count if cfg.persistent else None, 1), cfg.threads, p, 0)
    driver.synchronize()


def gpu_trial(kernel: CompiledKernel, problem: TuneProblem, warmup: int, reps: int) -> dict[str, Any]:
    """Verify on the problem's shape (cut to fit the reference, see TuneProblem.verify_shape), then time."""
    import torch  # noqa: PLC0415

    if os.environ.get(FAULT_HOOK_ENV) == kernel.name:
        _launch_illegal(kernel)
    if os.environ.get(HANG_HOOK_ENV) == kernel.name:
        time.sleep(1e6)
    b, sq, sk, h, hk = problem.verify_shape()
    vr = verify(kernel, b, sq, sk, h, hk)  # fresh random inputs for every trial
    torch.cuda.empty_cache()  # the float64 reference is large; give it back before timing
    if not vr.ok:
        return {"status": "verify_failed", "reason": vr.reason, "max_err": vr.max_err}
    b, sq, sk, h, hk = problem.shape()
    ms = time_kernel(kernel, b, sq, sk, h, hk, warmup=warmup, reps=reps)
    torch.cuda.empty_cache()
    return {"status": "ok", "ms": ms, "max_err": vr.max_err, "reason": ""}


def gpu_retime(kernels: list[CompiledKernel], problem: TuneProblem, rounds: int, warmup: int,
               reps: int) -> list[float]:
    """Median ms of each (already verified) kernel over `rounds` interleaved rounds on the same inputs."""
    import torch  # noqa: PLC0415

    b, sq, sk, h, hk = problem.shape()
    assert len({(k.config.dtype, k.config.output_dtype, k.config.head_dim) for k in kernels}) == 1, "one problem's kernels"
    call, sets = kernel_timer(kernels[0].config, b, sq, sk, h, hk)
    timed = retime_best([(0.0, i) for i in range(len(kernels))], lambda i: time_cuda(
        lambda j: call(kernels[i], j), warmup, reps, rotate=sets), top=len(kernels), rounds=rounds)
    torch.cuda.empty_cache()
    return [ms for ms, _ in sorted(timed, key=lambda r: r[1])]


def gpu_trial_bwd(kernel: CompiledKernel, fwd_kernel: CompiledKernel, problem: TuneProblem, warmup: int,
                  reps: int) -> dict[str, Any]:
    """A backward trial: verify dq, dk, dv against float64 on fresh random inputs (the problem's shape
    cut to fit the reference, see TuneProblem.verify_shape), then time the backward kernels alone."""
    import torch  # noqa: PLC0415

    if os.environ.get(HANG_HOOK_ENV) == kernel.name:
        time.sleep(1e6)
    b, sq, sk, h, hk = problem.verify_shape()
    vr = verify_backward(kernel, fwd_kernel, b, sq, sk, h, hk)
    torch.cuda.empty_cache()
    if not vr.ok:
        return {"status": "verify_failed", "reason": vr.reason, "max_err": vr.max_err}
    b, sq, sk, h, hk = problem.shape()
    ms = time_backward(kernel, fwd_kernel, b, sq, sk, h, hk, warmup=warmup, reps=reps)
    torch.cuda.empty_cache()
    return {"status": "ok", "ms": ms, "max_err": vr.max_err, "reason": ""}


def gpu_check(kernel: CompiledKernel, shapes: list[tuple[int, int, int, int, int]]) -> list[dict[str, Any]]:
    """Verify one kernel on several (batch, seqlen_q, seqlen_k, heads, heads_k) shapes."""
    return [{"shape": s, **verify(kernel, *s).__dict__} for s in shapes]  # fresh random inputs per shape


class IsolatedSimulatedBackend(SimulatedBackend):
    """The simulated backend with each evaluation run in a worker process, as GpuBackend runs its trials (fault
    isolation tested without a GPU): a candidate named in `crash` takes the worker down as a faulting kernel
    does; the tuner gets a "faulted" value and the next trial a fresh worker."""

    def __init__(self, crash: tuple[str, ...] = (), deadline_s: float = 60.0, **kw: Any):
        super().__init__(**kw)
        self.crash, self.deadline_s = set(crash), deadline_s
        self.worker = Worker()

    def evaluate(self, config: Candidate, problem: Problem, reps: int | None = None) -> TrialResult:
        self.calls.append(config.name)
        self.call_reps.append(self.REPS if reps is None else reps)
        status, value = self.worker.call("flashgen.worker:simulated_trial", config, problem, self.failures,
                                         config.name in self.crash, reps, deadline_s=self.deadline_s)
        return value if status == "ok" else TrialResult(status, reason=value)

    def close(self) -> None:
        self.worker.close()


def simulated_trial(config: Candidate, problem: Problem, failures: dict[str, str], crash: bool,
                    reps: int | None = None) -> TrialResult:
    """The worker's task for IsolatedSimulatedBackend: the simulated result, or (`crash`) a fault."""
    if crash:
        raise RuntimeError(f"CUDA error: an illegal memory access was encountered (simulated, {config.name})")
    return SimulatedBackend(failures).evaluate(config, problem, reps)
