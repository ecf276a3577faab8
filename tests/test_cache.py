"""The disk cache of compiled kernels: serves only intact entries of this user, keys what changes the cubin,
and serves a warm entry where nvcc is absent. Compiles a one-line kernel, so each test takes a second."""
import json
import os
import shutil
import stat

import pytest

import flashgen.compile as comp
from flashgen.compile import CompileError, compile_kernel
from flashgen.config import KernelConfig

CFG = KernelConfig(64, "fp16", False, 64, 64, 4, 1)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(comp, "render", lambda cfg: f'extern "C" __global__ void {cfg.name}(int *p) {{ *p = 1; }}\n')
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASHGEN_SOURCE_DIR", str(tmp_path / "sources"))
    for var in ("FLASHGEN_NVCC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS"):
        monkeypatch.delenv(var, raising=False)
    forget_nvcc()
    yield tmp_path / "cache"
    forget_nvcc()


def forget_nvcc():
    """What a new process knows about nvcc: nothing."""
    comp.nvcc_path.cache_clear()
    comp.nvcc_version.cache_clear()


def entry(cache, suffix):
    [path] = cache.glob(f"{CFG.name}-*{suffix}")
    return path


def test_a_new_cache_directory_is_private(cache):
    compile_kernel(CFG, "sm_80")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.parametrize("damage", ["truncate", "flip", "no digest"])
def test_a_damaged_cubin_is_rebuilt_not_served(cache, damage):
    first = compile_kernel(CFG, "sm_80")
    cubin, meta = entry(cache, ".cubin"), entry(cache, ".json")
    if damage == "truncate":
        cubin.write_bytes(first.cubin[: len(first.cubin) // 2])
    elif damage == "flip":
        cubin.write_bytes(first.cubin[:-1] + bytes([first.cubin[-1] ^ 1]))
    else:
        m = json.loads(meta.read_text())
        m.pop("sha256", None)
        meta.write_text(json.dumps(m))
    again = compile_kernel(CFG, "sm_80")
    assert not again.cached and again.cubin[:4] == b"\x7fELF" and len(again.cubin) == len(first.cubin)
    assert compile_kernel(CFG, "sm_80").cached  # the rebuilt entry is served


@pytest.mark.parametrize("var", ["NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS"])
def test_nvcc_flags_from_the_environment_are_part_of_the_key(monkeypatch, var):
    compile_kernel(CFG, "sm_80")
    monkeypatch.setenv(var, "-DFLASHGEN_TEST=1")
    assert not compile_kernel(CFG, "sm_80").cached
    assert compile_kernel(CFG, "sm_80").cached


def test_a_warm_cache_needs_no_nvcc(monkeypatch, tmp_path):
    first = compile_kernel(CFG, "sm_80")
    forget_nvcc()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    hit = compile_kernel(CFG, "sm_80")
    assert hit.cached and hit.cubin == first.cubin
    with pytest.raises(CompileError, match="nvcc not found"):  # a miss needs nvcc
        compile_kernel(KernelConfig(64, "fp16", True, 64, 64, 4, 1), "sm_80")


def test_without_nvcc_the_newest_entry_of_any_nvcc_is_served(cache, monkeypatch, tmp_path):
    compile_kernel(CFG, "sm_80")
    cubin, meta = entry(cache, ".cubin"), entry(cache, ".json")
    other = cubin.name.split("-nvcc")[0] + "-nvcc99.9"  # the same kernel from another nvcc, marked by its log
    shutil.copy(cubin, cache / f"{other}.cubin")
    (cache / f"{other}.json").write_text(json.dumps({**json.loads(meta.read_text()), "ptxas_log": "nvcc 99.9"}))
    forget_nvcc()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    for newest, older in ((cubin, cache / f"{other}.cubin"), (cache / f"{other}.cubin", cubin)):
        os.utime(older, (1e9, 1e9))
        os.utime(newest, (2e9, 2e9))
        assert (compile_kernel(CFG, "sm_80").ptxas_log == "nvcc 99.9") == (newest.name.startswith(other))


def test_a_cache_hit_does_not_run_nvcc(monkeypatch, tmp_path):
    calls = tmp_path / "calls"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("nvcc")} "$@"\n')
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    compile_kernel(CFG, "sm_80")
    forget_nvcc()
    before = calls.read_text()
    assert compile_kernel(CFG, "sm_80").cached
    assert calls.read_text() == before  # the version was remembered for this nvcc, by path and mtime


@pytest.mark.parametrize("why", ["world-writable", "another owner"])
def test_an_unsafe_cache_directory_is_not_used(cache, monkeypatch, why):
    compile_kernel(CFG, "sm_80")
    files = sorted(cache.iterdir())
    if why == "world-writable":
        cache.chmod(0o777)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(cache).st_uid + 1)
    with pytest.warns(UserWarning, match=f"(?s){cache}.*FLASHGEN_CACHE_DIR"):
        k = compile_kernel(CFG, "sm_80")
    assert not k.cached and sorted(cache.iterdir()) == files  # neither read nor written


@pytest.mark.parametrize("suffix", [".cubin", ".json"])
def test_a_writable_entry_is_not_served(cache, suffix):
    compile_kernel(CFG, "sm_80")
    entry(cache, suffix).chmod(0o666)
    with pytest.warns(UserWarning, match="writable"):
        assert not compile_kernel(CFG, "sm_80").cached
    assert compile_kernel(CFG, "sm_80").cached  # replaced by a private entry


def test_a_failed_cache_write_leaves_no_temp_file(cache, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(comp.os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        compile_kernel(CFG, "sm_80")
    assert [p.name for p in cache.iterdir() if p.name.endswith(".tmp")] == []


def test_a_hung_disassembler_times_out_with_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setattr(comp, "disassembler", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(CompileError, match=r"timed out after 0.5 s"):
        comp.disassemble(b"\x7fELF", timeout_s=0.5)


SOURCE_WITH_INTERNAL_NAMES = ('static __device__ int twice(int x) {{ return 2 * x; }}\n'
                              'extern "C" __global__ void {name}(int *p) {{ *p = twice(p[1]); }}\n')


@pytest.mark.parametrize("real", [False, True])
def test_one_source_builds_byte_identical_cubins_in_two_fresh_caches(monkeypatch, tmp_path, real):
    """-lineinfo records the source's path and the internal names hash it: built from a random temp path, no two
    builds of one source were the same bytes. Each build here starts from an empty cache."""
    if real:
        from flashgen.render import render

        monkeypatch.setattr(comp, "render", render)
    else:
        monkeypatch.setattr(comp, "render", lambda cfg: SOURCE_WITH_INTERNAL_NAMES.format(name=cfg.name))
    cubins = []
    for name in ("a", "b"):
        monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / name))
        k = compile_kernel(CFG, "sm_80")
        assert not k.cached
        cubins.append(k.cubin)
    assert cubins[0] == cubins[1]
