"""Builds a batch of kernels on this machine's cores and checks ptxas's report: no spills, no stack frame."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from flashgen.compile import compile_kernel


def assert_builds_without_spills(cfgs: list, target: str) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, target), cfgs))
    for k in kernels:
        r = k.resources
        assert not r.spills and r.stack_bytes == 0, f"{k.config.name} ({target}) spills: {r}"
