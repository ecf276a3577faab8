"""What the search asks of whoever evaluates a configuration, and a simulated stand-in.

A backend turns (config, problem) into a `TrialResult`; failures are values, never
exceptions, so one bad kernel cannot end a study. `SimulatedBackend` replaces the GPU
with a deterministic cost function so the search can be tested on any machine.
"""
from __future__ import annotations

import os
import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .problem import Rule
from .tunable import Candidate, Problem, kind_of

STATUSES = ("ok", "pruned", "compile_failed", "verify_failed", "error", "faulted", "timeout")


@dataclass(frozen=True)
class TrialResult:
    status: str  # one of STATUSES
    ms: float | None = None  # median milliseconds (status "ok" only)
    tflops: float | None = None
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # registers, spills, verify error, ...

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}; choose one of {STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tflops(problem: Problem, ms: float) -> float:
    """The figure a time gives for the problem's kind (TFLOP/s; a decode problem's: TB/s of K/V read)."""
    return kind_of(problem).rate(problem, ms)


def ok_result(problem: Problem, ms: float, **info: Any) -> TrialResult:
    return TrialResult("ok", ms, tflops(problem, ms), info=info)


class Backend(Protocol):
    """Evaluates configurations; `prefetch` lets a backend start work (compiles) ahead."""

    def prefetch(self, configs: list[Candidate], problem: Problem) -> None: ...

    def evaluate(self, config: Candidate, problem: Problem, reps: int | None = None) -> TrialResult:
        """Compile, verify and time one configuration; `reps`: timed calls of its median (None: the backend's
        own number, as every search but a halving one asks)."""
        ...

    def retime(self, configs: list[Candidate], problem: Problem, rounds: int) -> list[float | None]:
        """Verified configurations timed again side by side: median ms each (None: not timed)."""
        ...

    def close(self) -> None: ...


class SimulatedBackend:
    """A deterministic cost model in place of a GPU (for tests and dry runs; its numbers mean nothing).

    `failures` maps a config name to the status (and reason) its evaluation returns, to
    play compile failures, wrong kernels, faults and hangs. `delay_s` makes an evaluation take
    that long (tuners then overlap, and one can be killed mid-trial); `log` is a file that gets a
    line "start <problem> <config>" as an evaluation begins and "done ..." as it ends, appended
    by every process that shares it, so a test can count what a fleet evaluated.

    `jitter` plays timing noise that shrinks with the timed calls: a measurement of `reps` calls is the cost
    times 1 + jitter * g / sqrt(reps / reps_default), g a standard normal drawn from `seed`, the configuration
    and how often it was measured before (deterministic; a retime is exact)."""

    REPS = 50  # as GpuBackend's timed calls per trial

    def __init__(self, failures: dict[str, str] | None = None, delay_s: float = 0.0, log: str | Path | None = None,
                 noise: dict[str, float] | None = None, jitter: float = 0.0, seed: int = 0):
        self.failures = dict(failures or {})
        self.noise = dict(noise or {})  # config name -> factor on its first measurement only (plays a lucky run)
        self.jitter, self.seed = jitter, seed
        self.calls: list[str] = []
        self.call_reps: list[int] = []  # the timed calls each evaluation was asked for, as `calls`
        self.retimed: list[list[str]] = []  # the configurations of each retime call
        self.delay_s, self.log = delay_s, Path(log) if log else None

    def _log(self, what: str, config: Candidate, problem: Problem) -> None:
        if self.log is not None:
            with open(self.log, "a") as f:  # one short append per line: whole lines even with several writers
                f.write(f"{what} {problem.study_name} {config.name} {os.getpid()}\n")

    def prefetch(self, configs: list[Candidate], problem: Problem) -> None:
        pass

    def cost_ms(self, cand: Candidate, problem: Problem) -> float:
        # Best at 128x128 tiles, 4-8 warps, 3 stages (not the default, so tuning has something to find); a decode
        # candidate best at 32x64 tiles, 2 warps, split 8 ways; an untuned choice (Rule) 1.2 times the work.
        if hasattr(problem, "shape"):
            b, s, _, h, _ = problem.shape()
            work = b * h * s * s * problem.head_dim * (0.5 if problem.causal else 1.0) * 1e-12
        elif hasattr(problem, "kv_bytes"):
            work = problem.kv_bytes * 1e-9
        else:
            work = problem.flops() * 1e-15
        if isinstance(cand, Rule):
            return work * 1.2
        cfg, splits = getattr(cand, "config", cand), getattr(cand, "num_splits", None)
        if splits is not None:
            tile = abs(cfg.block_m - 32) / 16 + abs(cfg.block_n - 64) / 32 + abs(splits.bit_length() - 4) / 2
            return work * (1.0 + 0.3 * tile + 0.1 * abs(cfg.num_warps - 2) + 0.15 * abs(cfg.num_stages - 3))
        tile = abs(cfg.block_m - 128) / 64 + abs(cfg.block_n - 128) / 64
        return work * (1.0 + 0.3 * tile + 0.1 * abs(cfg.num_warps - 6) / 2 + 0.15 * abs(getattr(cfg, "num_stages", 3) - 3))
        # a BwdConfig has no stages: its cost is the tiles' and warps' alone

    def evaluate(self, config: Candidate, problem: Problem, reps: int | None = None) -> TrialResult:
        reps = self.REPS if reps is None else reps
        before = self.calls.count(config.name)
        self.calls.append(config.name)
        self.call_reps.append(reps)
        self._log("start", config, problem)
        time.sleep(self.delay_s)
        if config.name in self.failures:
            status = self.failures[config.name]
            res = TrialResult(status, reason=f"simulated {status}")
        else:
            ms = self.cost_ms(config, problem) * self.noise.get(config.name, 1.0) * self._jitter(config, before, reps)
            res = ok_result(problem, ms, simulated=True)
        self._log("done", config, problem)
        return res

    def _jitter(self, config: Candidate, before: int, reps: int) -> float:
        if not self.jitter:
            return 1.0
        g = random.Random(zlib.crc32(f"{self.seed}/{config.name}/{before}".encode())).gauss(0.0, 1.0)
        return max(0.1, 1.0 + self.jitter * g / (reps / self.REPS) ** 0.5)

    def retime(self, configs: list[Candidate], problem: Problem, rounds: int) -> list[float | None]:
        self.retimed.append([c.name for c in configs])
        return [None if c.name in self.failures else self.cost_ms(c, problem) for c in configs]

    def close(self) -> None:
        pass
