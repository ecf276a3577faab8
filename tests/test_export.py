"""Exported kernels compile with plain nvcc, and a C++ program launching them through the header links."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from flashgen.config import KernelConfig
from flashgen.export import export
from flashgen.store import merge, store_path

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not on PATH")

MAIN = """\
#include "{a}.h"
#include "{b}.h"
int main() {{
    FwdParams p = {{}};
    p.batch = 1; p.heads = 1; p.heads_k = 1; p.seqlen_q = 128; p.seqlen_k = 128;
    static_assert(flashgen::{a}_launch::SMEM_BYTES > 0, "launch parameters are constants");
    cudaError_t e1 = flashgen::{a}_launch::launch(p);
    cudaError_t e2 = flashgen::{b}_launch::launch(p, 0);
    return (int)e1 + (int)e2;
}}
"""


def fill_store(tmp_path) -> list[KernelConfig]:
    cfgs = [KernelConfig(64, "bf16", False, 128, 64, 4, 2), KernelConfig(128, "fp16", True, 128, 32, 8, 1)]
    for gpu, arch in (("NVIDIA A100-SXM4-80GB", "sm80"), ("NVIDIA H200", "sm90")):
        merge(store_path(gpu, arch, tmp_path), gpu, arch, {
            f"k{i}": {"config": c.to_dict(), "kernel": c.name, "median_ms": 1.0 + i, "tflops": 1.0,
                      "problem": {"seqlen": 4096, "gqa_group": 1}} for i, c in enumerate(cfgs)})
    return cfgs


def test_export_writes_cu_header_and_manifest(tmp_path):
    cfgs = fill_store(tmp_path / "tuned")
    files = export("sm80", tmp_path / "out", tmp_path / "tuned")
    names = sorted(f.name for f in files)
    assert names == sorted([f"{c.name}.cu" for c in cfgs] + [f"{c.name}.h" for c in cfgs] + ["manifest.json"])
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    k = {m["kernel"]: m for m in man["kernels"]}[cfgs[0].name]
    assert k["targets"] == ["sm_80", "sm_90"] and k["threads"] == 128 and k["smem_bytes"] == cfgs[0].smem_bytes
    h = (tmp_path / "out" / f"{cfgs[0].name}.h").read_text()
    assert "struct FwdParams" in h and f"SMEM_BYTES = {cfgs[0].smem_bytes}" in h and "NVIDIA H200" in h
    only = export("sm80", tmp_path / "one", tmp_path / "tuned", gpu="NVIDIA H200")
    assert len(only) == 5


def test_export_of_an_empty_store(tmp_path):
    assert [f.name for f in export("sm80", tmp_path / "out", tmp_path / "none")] == ["manifest.json"]


@needs_nvcc
def test_exported_files_compile_and_link_with_plain_nvcc(tmp_path):
    a, b = fill_store(tmp_path / "tuned")
    out = tmp_path / "out"
    export("sm80", out, tmp_path / "tuned")
    for c in (a, b):  # each kernel alone, as a cubin
        subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-std=c++17", "-o", str(out / f"{c.name}.cubin"),
                        str(out / f"{c.name}.cu")], check=True, capture_output=True, text=True)
    (out / "main.cu").write_text(MAIN.format(a=a.name, b=b.name))
    proc = subprocess.run([NVCC, "-arch=sm_80", "-std=c++17", "-o", str(out / "app"), str(out / "main.cu"),
                           str(out / f"{a.name}.cu"), str(out / f"{b.name}.cu")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    host = subprocess.run(["g++" if shutil.which("g++") else "c++", "-std=c++17", "-fsyntax-only", "-x", "c++",
                           str(out / f"{a.name}.h")], capture_output=True, text=True)
    assert host.returncode == 0, host.stderr  # the header is plain C++ outside nvcc too


SM90_MAIN = """\
#include "{a}.h"
int main() {{
    Sm90FwdParams p = {{}};  // tensor maps would come from cuTensorMapEncodeTiled (see the header)
    p.p.batch = 1; p.p.heads = 1; p.p.heads_k = 1; p.p.seqlen_q = 128; p.p.seqlen_k = 128;
    static_assert(flashgen::{a}_launch::SWIZZLE_BYTES == 2 * flashgen::{a}_launch::SMEM_W, "box geometry");
    static_assert(sizeof(CUtensorMap) == 128, "three maps, then FwdParams at offset 384");
    return (int)flashgen::{a}_launch::launch(p);
}}
"""


@needs_nvcc
def test_exported_sm90_kernel_compiles_and_links_for_sm90a(tmp_path):
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False)
    merge(store_path("NVIDIA H200", "sm90", tmp_path / "tuned"), "NVIDIA H200", "sm90", {
        "k": {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": 1.0, "tflops": 1.0,
              "problem": {"seqlen": 4096, "gqa_group": 1}}})
    out = tmp_path / "out"
    export("sm90", out, tmp_path / "tuned")
    h = (out / f"{cfg.name}.h").read_text()
    assert "struct Sm90FwdParams" in h and "cuTensorMapEncodeTiled" in h and "code=sm_90a" in h
    (out / "main.cu").write_text(SM90_MAIN.format(a=cfg.name))
    proc = subprocess.run([NVCC, "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17", "-o", str(out / "app"),
                           str(out / "main.cu"), str(out / f"{cfg.name}.cu")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


BWD_MAIN = """\
#include "{a}.h"
#include "{b}.h"
int main() {{
    BwdParams p = {{}};
    p.batch = 1; p.heads = 1; p.heads_k = 1; p.seqlen_q = 128; p.seqlen_k = 128;
    static_assert(flashgen::{a}_launch::ROW_THREADS == 32 * flashgen::{a}_launch::ROW_WARPS, "row kernels");
    static_assert(flashgen::{b}_launch::DETERMINISTIC, "the _dq kernel");
    return (int)flashgen::{a}_launch::launch(p) + (int)flashgen::{b}_launch::launch(p, 0);
}}
"""


def fill_bwd_store(tmp_path) -> list:
    from flashgen.config import BwdConfig
    from flashgen.problem import TuneProblem

    cfgs = [BwdConfig(64, "bf16", True, 64, 64, 4), BwdConfig(128, "fp16", False, 64, 32, 8, deterministic=True)]
    gpu, arch = "NVIDIA A100-SXM4-80GB", "sm80"
    entries = {}
    for c in cfgs:
        p = TuneProblem(gpu, arch, "sm80", c.dtype, c.head_dim, c.causal, 4096, pass_="bwd")
        entries[p.key] = {"config": c.to_dict(), "kernel": c.name, "median_ms": 1.0, "tflops": 1.0,
                          "problem": p.to_dict()}
    merge(store_path(gpu, arch, tmp_path), gpu, arch, entries)
    return cfgs


def test_export_writes_tuned_backwards(tmp_path):
    cfgs = fill_bwd_store(tmp_path / "tuned")
    files = export("sm80", tmp_path / "out", tmp_path / "tuned")
    assert sorted(f.name for f in files) == sorted([f"{c.name}.cu" for c in cfgs] + [f"{c.name}.h" for c in cfgs]
                                                   + ["manifest.json"])
    man = {m["kernel"]: m for m in json.loads((tmp_path / "out" / "manifest.json").read_text())["kernels"]}
    assert man[cfgs[0].name]["kernels"] == cfgs[0].kernel_names and man[cfgs[0].name]["threads"] == 128
    h = (tmp_path / "out" / f"{cfgs[0].name}.h").read_text()
    assert "struct BwdParams" in h and f"SMEM_BYTES = {cfgs[0].smem_bytes}" in h and f"{cfgs[0].name}_convert" in h
    assert f"{cfgs[1].name}_dq<<<" in (tmp_path / "out" / f"{cfgs[1].name}.h").read_text()


@needs_nvcc
def test_exported_backward_compiles_and_links_with_plain_nvcc(tmp_path):
    a, b = fill_bwd_store(tmp_path / "tuned")
    out = tmp_path / "out"
    export("sm80", out, tmp_path / "tuned")
    (out / "main.cu").write_text(BWD_MAIN.format(a=a.name, b=b.name))
    proc = subprocess.run([NVCC, "-arch=sm_80", "-std=c++17", "-o", str(out / "app"), str(out / "main.cu"),
                           str(out / f"{a.name}.cu"), str(out / f"{b.name}.cu")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    host = subprocess.run(["g++" if shutil.which("g++") else "c++", "-std=c++17", "-fsyntax-only", "-x", "c++",
                           str(out / f"{a.name}.h")], capture_output=True, text=True)
    assert host.returncode == 0, host.stderr
