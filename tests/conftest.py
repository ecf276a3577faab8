"""GPU tests (marked `gpu`) skip with a stated reason where no CUDA GPU and torch are present."""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def gpu_missing_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (GPU tests use it for inputs and the float64 reference)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def named_by_filter(cfgs: list) -> list:
    """The configurations a GPU suite runs beside its defaults: all, or with FLASHGEN_TEST_NAMES set (comma-separated
    pieces of kernel names, e.g. `_dst,_la`) those whose name holds one of them: after a template change that
    scripts/same_sass.py shows leaves every other kernel's SASS alone, the run covers what changed."""
    pieces = [s for s in os.environ.get("FLASHGEN_TEST_NAMES", "").split(",") if s]
    return [c for c in cfgs if any(s in c.name for s in pieces)] if pieces else cfgs


def skip_if_narrowed(what: str) -> None:
    """Skip a test whose extra configurations FLASHGEN_TEST_NAMES left out (named_by_filter), saying which."""
    if os.environ.get("FLASHGEN_TEST_NAMES"):
        pytest.skip(f"FLASHGEN_TEST_NAMES={os.environ['FLASHGEN_TEST_NAMES']} leaves out {what}")


RAM_TMP = Path("/dev/shm")
RAM_TMP_MIN_FREE = 2 << 30  # what a run writes there at most (kernel caches, studies, a wheel, a venv), with room


@pytest.hookimpl(tryfirst=True)  # before the tmp_path plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    """Without --basetemp, the run's temporary files go to RAM (/dev/shm) where it has room: the simulated tunes
    commit to SQLite studies a thousand times, each commit an fsync, tens of ms on a disk and nothing in RAM.
    xdist workers are given their basetemp below this one."""
    if config.option.basetemp or os.environ.get("PYTEST_XDIST_WORKER") or not os.access(RAM_TMP, os.W_OK):
        return
    st = os.statvfs(RAM_TMP)
    if st.f_bavail * st.f_frsize < RAM_TMP_MIN_FREE:
        return
    config.option.basetemp = config._flashgen_ram_tmp = tempfile.mkdtemp(prefix="flashgen-tests-", dir=RAM_TMP)


def pytest_unconfigure(config: pytest.Config) -> None:
    ram_tmp = getattr(config, "_flashgen_ram_tmp", None)
    if ram_tmp:  # RAM: not left behind as pytest leaves its runs on disk
        shutil.rmtree(ram_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def run_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel cache of this run, one for all its xdist workers (each of which has its own basetemp below the
    run's): a kernel compiled by one worker is loaded by the others. flashgen.compile writes each entry to a temp
    file and renames it, so workers compiling the same kernel at once never read half a file."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "kernel-cache"


def tuner_missing_reason() -> str | None:
    """Why a real tune cannot run here (it also needs pycuda), or None."""
    import importlib.util  # noqa: PLC0415

    for mod in ("torch", "pycuda"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    import torch  # noqa: PLC0415

    return None if torch.cuda.is_available() else "no CUDA GPU visible to torch"


def needs_gpu_tuner() -> list:
    """pytestmark of the tests that run a real tune on the GPU."""
    reason = tuner_missing_reason()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"needs a GPU: {reason}")]


def compile_grouped(cfgs: list, arch: str, key) -> dict:
    """Compile configurations for `arch` on all cores (nvcc runs in subprocesses: threads are enough) and group the
    kernels by key(config), in the order given."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from flashgen.compile import compile_kernel, target_for  # noqa: PLC0415

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        compiled = list(pool.map(lambda c: compile_kernel(c, target_for(arch, c.family)), cfgs))
    out: dict = {}
    for k in compiled:
        out.setdefault(key(k.config), []).append(k)
    return out


def assert_only_the_switch_differs(cfg, knob: str, tag: str) -> None:
    """A bool knob compiled as `inline constexpr bool KNOB`: the source rendered with it on differs from the one with it
    off only in that constant, the kernel's name (`tag` added) and the configuration's repr."""
    import dataclasses  # noqa: PLC0415

    from flashgen.render import render  # noqa: PLC0415

    const = knob.upper()
    src, on = render(cfg), render(dataclasses.replace(cfg, **{knob: True}))
    assert f"inline constexpr bool {const} = false;" in src and f"inline constexpr bool {const} = true;" in on
    named = src.replace(cfg.name, cfg.name + tag).replace(f"{const} = false", f"{const} = true")
    assert named.replace(f"{knob}=False", f"{knob}=True") == on


def compile_sm90a_clean(cfgs: list) -> list:
    """Compile sm90-family configurations for sm_90a (two at a time) and assert what every one must show in
    ptxas's report: no spills, no serialized wgmma (C7513: registers an in-flight wgmma reads were
    redefined; C7511: too few registers for the wgmma pipeline), no wgmma wait ptxas injected (C7517: registers a
    wgmma may still define were read), the shared memory its config says, and in the SASS (where a disassembler is
    installed) no wgmma serialized silently: ptxas 13.0 fences every wgmma of a kernel with wgmmas in runtime
    branches (WARPGROUP.ARRIVE 3 -> 80) without C7513 (docs/design-notes.md); the stored kernels have at most 3.
    Returns the compiled kernels."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from flashgen.compile import compile_kernel, disassemble, disassembler  # noqa: PLC0415

    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, "sm_90a"), cfgs))
    for k in kernels:
        assert not k.resources.spills, f"{k.name} spills: {k.resources}"
        assert "C7513" not in k.ptxas_log and "C7511" not in k.ptxas_log, f"{k.name}: {k.ptxas_log}"
        assert "C7517" not in k.ptxas_log, f"{k.name}: a wgmma wait injected by ptxas: {k.ptxas_log}"
        assert k.resources.smem_bytes == k.config.smem_bytes <= 227 * 1024
        if disassembler() is not None:
            arrives = disassemble(k.cubin).count("WARPGROUP.ARRIVE")
            assert arrives <= 4, f"{k.name}: {arrives} WARPGROUP.ARRIVE, its wgmmas serialized"
    return kernels


def assert_same_wgmmas(offs: list, ons: list, ops: tuple = ("GMMA", "WARPGROUP.ARRIVE")) -> None:
    """Each kernel of `ons` (a knob on) has its twin's of `offs` count of every SASS op in `ops` (skips without a
    disassembler)."""
    import pytest  # noqa: PLC0415

    from flashgen.compile import disassemble, disassembler  # noqa: PLC0415

    if disassembler() is None:
        pytest.skip("no SASS disassembler for the instruction counts (pip install nvidia-cuda-nvdisasm)")
    for off, on in zip(offs, ons, strict=True):
        a, b = disassemble(off.cubin), disassemble(on.cubin)
        for op in ops:
            assert a.count(op) == b.count(op), f"{on.name}: {b.count(op)} {op}, {a.count(op)} without the knob"


def ramped_keys(k, grow: bool):
    """k scaled along the keys by 1 to 6. grow: the first keys scaled most; the sm90 kernels read the key tiles last
    to first, so a row's max then rises tile after tile, by more than any lazy-rescale slack. Else the last keys."""
    import torch

    ramp = torch.linspace(6.0, 1.0, k.shape[1], device=k.device) if grow else torch.linspace(1.0, 6.0, k.shape[1],
                                                                                                device=k.device)
    return (k.float() * ramp[None, :, None, None]).to(k.dtype)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_missing_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tune_on_gpu(p, cands, tmp_path, counts: dict | None = None) -> dict | None:
    """The tuning pipeline on this GPU: a study in a SQLite file, every candidate verified and timed in the GPU
    worker; the store entry of the winner (`counts`, a dict, receives the study's trial statuses)."""
    from flashgen.search import SearchOptions, search  # noqa: PLC0415
    from flashgen.tunable import entry_of  # noqa: PLC0415
    from flashgen.worker import GpuBackend  # noqa: PLC0415

    backend = GpuBackend()
    try:
        out = search(p, backend, SearchOptions(exhaustive=True, storage=f"sqlite:///{tmp_path / 'studies.db'}"),
                     cands)
    finally:
        backend.close()
    if counts is not None:
        counts.update(out.counts)
    return entry_of(out, {"nvcc": "test", "driver": backend.driver_version})
