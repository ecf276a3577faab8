"""Exported kernels compile with plain nvcc, and a C++ program launching them through the header links."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from flashgen.config import KernelConfig
from flashgen.export import export
from flashgen.store import merge, store_path

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not on PATH")


def compile_cubins(out, names) -> None:
    """Each exported kernel alone, as a cubin for sm_80."""
    for n in names:
        subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-std=c++17", "-o", str(out / f"{n}.cubin"), str(out / f"{n}.cu")],
                       check=True, capture_output=True, text=True)


def link_app(out, main: str, names, arch_flags=("-arch=sm_80",)) -> None:
    """A host program (main) launching the kernels through their headers links against their .cu files."""
    (out / "main.cu").write_text(main)
    proc = subprocess.run([NVCC, *arch_flags, "-std=c++17", "-o", str(out / "app"), str(out / "main.cu"),
                           *(str(out / f"{n}.cu") for n in names)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def assert_plain_cpp(header) -> None:
    """The header is plain C++ outside nvcc too."""
    host = subprocess.run(["g++" if shutil.which("g++") else "c++", "-std=c++17", "-fsyntax-only", "-x", "c++",
                           str(header)], capture_output=True, text=True)
    assert host.returncode == 0, host.stderr

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
    compile_cubins(out, (a.name, b.name))
    link_app(out, MAIN.format(a=a.name, b=b.name), (a.name, b.name))
    assert_plain_cpp(out / f"{a.name}.h")


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


def export_stored_sm90(tmp_path, cfg: KernelConfig) -> tuple[Path, str]:
    """Export a store holding just `cfg` (tuned on an H200): the output directory and cfg's header."""
    merge(store_path("NVIDIA H200", "sm90", tmp_path / "tuned"), "NVIDIA H200", "sm90", {
        "k": {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": 1.0, "tflops": 1.0,
              "problem": {"seqlen": 4096, "gqa_group": 1}}})
    out = tmp_path / "out"
    export("sm90", out, tmp_path / "tuned")
    return out, (out / f"{cfg.name}.h").read_text()


@needs_nvcc
@pytest.mark.parametrize("persistent, lpt_by_head", [(False, False), (True, False), (True, True)])
def test_exported_sm90_kernel_compiles_and_links_for_sm90a(tmp_path, persistent, lpt_by_head):
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, persistent, lpt_by_head=lpt_by_head)
    out, h = export_stored_sm90(tmp_path, cfg)
    assert "struct Sm90FwdParams" in h and "cuTensorMapEncodeTiled" in h and "code=sm_90a" in h
    assert ("cudaDevAttrMultiProcessorCount" in h) == persistent  # a persistent grid is one CTA per SM
    assert ("tile_at_chunked(t, m_blocks, p.heads, pairs, m_blocks)" in (out / f"{cfg.name}.cu").read_text()) == lpt_by_head
    link_app(out, SM90_MAIN.format(a=cfg.name), (cfg.name,), ("-gencode", "arch=compute_90a,code=sm_90a"))


@needs_nvcc
@pytest.mark.parametrize("arch_flag", ["-arch=sm_90", "-arch=sm_90a"])
def test_an_exported_sm90_kernel_built_without_sm90a_stops_at_an_error_naming_the_flags(tmp_path, arch_flag):
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True)
    out, _ = export_stored_sm90(tmp_path, cfg)
    proc = subprocess.run([NVCC, arch_flag, "-std=c++17", "-c", "-o", str(out / "k.o"), str(out / f"{cfg.name}.cu")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"{cfg.name} needs sm_90a instructions: compile it with -gencode arch=compute_90a,code=sm_90a" in proc.stderr
    assert "not supported on .target" not in proc.stderr  # stopped before ptxas


SM90_PACKED_MAIN = """\
#include "{a}.h"
int main() {{
    Sm90FwdParams p = {{}};
    p.p.batch = 2; p.p.heads = 32; p.p.heads_k = 8; p.p.seqlen_q = 100; p.p.seqlen_k = 4096;
    static_assert(flashgen::{a}_launch::PACK_GQA && flashgen::{a}_launch::pack_rows(4) == 32, "packed rows");
    // 100 positions in tiles of 32: 4 m-blocks x 8 KV heads x 2 batches (persistent: at most the SM count)
    if (flashgen::{a}_launch::grid_x(p.p.seqlen_q, p.p.heads, p.p.heads_k, p.p.batch{sm}) != {want}) return 200;
    return (int)flashgen::{a}_launch::launch(p) == 200;  // no GPU here: the launch fails, its code is not 200
}}
"""


@needs_nvcc
@pytest.mark.parametrize("persistent", [False, True])
def test_exported_sm90_pack_gqa_kernel_compiles_and_links_for_sm90a(tmp_path, persistent):
    """A tune --gqa entry with pack_gqa: the header states q's 5-d map and a grid over KV heads of packed tiles."""
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, persistent, pack_gqa=True)
    out, h = export_stored_sm90(tmp_path, cfg)
    assert "rank 5 over (head_dim, group, heads_k, seqlen_q, batch)" in h
    main = SM90_PACKED_MAIN.format(a=cfg.name, sm=", 40" if persistent else "", want=40 if persistent else 64)
    link_app(out, main, (cfg.name,), ("-gencode", "arch=compute_90a,code=sm_90a"))
    assert subprocess.run([str(out / "app")], capture_output=True, timeout=60).returncode != 200  # the grid's count


SM90_SERVE_MAIN = """\
#include "{a}.h"
int main() {{
    Sm90ServeFwdParams p = {{}};  // tensor maps left empty: this only builds and links
    p.p.batch = 1; p.p.heads = 2; p.p.heads_k = 2; p.p.seqlen_q = 300; p.p.seqlen_k = 300;
    p.num_seqs = 3; p.max_seqlen_q = 200; p.window_left = 64; p.window_right = -1;
    static_assert(flashgen::{a}_launch::VARLEN && flashgen::{a}_launch::WINDOW, "features in the header");
    if (flashgen::{a}_launch::grid_x(p.max_seqlen_q, p.p.heads, p.num_seqs) != 12) return 1;
    return (int)flashgen::{a}_launch::launch(p);  // links against the kernel
}}
"""


@needs_nvcc
def test_exported_sm90_varlen_kernel_compiles_and_links_for_sm90a(tmp_path):
    """A tune --kind varlen entry (sm90 family, varlen + window): the dense sm90 header with Sm90ServeFwdParams, a
    grid over num_seqs sequences of max_seqlen_q rows."""
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, varlen=True, window=True)
    out, h = export_stored_sm90(tmp_path, cfg)
    assert "struct Sm90ServeFwdParams" in h and "cu_seqlens_q" in h and "grid_x(p.max_seqlen_q, f.heads, p.num_seqs)" in h
    manifest = json.loads((out / "manifest.json").read_text())["kernels"][0]
    assert manifest["params"] == "Sm90ServeFwdParams" and manifest["params_bytes"] == 640
    assert manifest["grid"] == "(ceil(max_seqlen_q / 128) * heads * num_seqs, 1, 1)"
    link_app(out, SM90_SERVE_MAIN.format(a=cfg.name), (cfg.name,), ("-gencode", "arch=compute_90a,code=sm_90a"))


SM90_FP8_MAIN = """\
#include "{a}.h"
int main() {{
    Sm90Fp8FwdParams p = {{}};  // descale pointers: device floats (per tensor: strides 0)
    p.p.batch = 1; p.p.heads = 1; p.p.heads_k = 1; p.p.seqlen_q = 128; p.p.seqlen_k = 128;
    static_assert(flashgen::{a}_launch::SWIZZLE_BYTES == flashgen::{a}_launch::SMEM_W, "one-byte elements");
    static_assert(sizeof(Sm90Fp8FwdParams) == 640 && offsetof(Sm90Fp8FwdParams, q_descale) == 552, "host packing");
    return (int)flashgen::{a}_launch::launch(p);
}}
"""


@needs_nvcc
@pytest.mark.parametrize("mma_rowsum,lazy_rescale", [(False, False), (True, False), (True, True)])  # as stored
def test_exported_fp8_kernel_compiles_and_links_for_sm90a(tmp_path, mma_rowsum, lazy_rescale):
    cfg = KernelConfig(128, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", False, False, True, mma_rowsum=mma_rowsum,
                       lazy_rescale=lazy_rescale)
    out, h = export_stored_sm90(tmp_path, cfg)
    assert f"constexpr int SMEM_BYTES = {cfg.smem_bytes};" in h
    assert "struct Sm90Fp8FwdParams" in h and "CU_TENSOR_MAP_DATA_TYPE_UINT8" in h and 'OUT_DTYPE = "bf16"' in h
    link_app(out, "#include <cstddef>\n" + SM90_FP8_MAIN.format(a=cfg.name), (cfg.name,),
             ("-gencode", "arch=compute_90a,code=sm_90a"))


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
    link_app(out, BWD_MAIN.format(a=a.name, b=b.name), (a.name, b.name))
    assert_plain_cpp(out / f"{a.name}.h")


SM90_BWD_MAIN = """\
#include "{a}.h"
int main() {{
    Sm90BwdParams p = {{}};
    p.p.batch = 1; p.p.heads = 1; p.p.heads_k = 1; p.p.seqlen_q = 100; p.p.seqlen_k = 100;
    static_assert(flashgen::{a}_launch::SWIZZLE_BYTES == 2 * flashgen::{a}_launch::SMEM_W, "TMA box");
    return flashgen::{a}_launch::seqlen_q_pad(100) == 128 ? (int)flashgen::{a}_launch::launch(p) : 1;
}}
"""


@needs_nvcc
@pytest.mark.parametrize("tile", [(64, True, 128, 2), (128, False, 80, 3)], ids=["d64", "d128-80-row"])
def test_exported_sm90_backward_documents_its_buffers_and_links(tmp_path, tile):
    from flashgen.config import BwdConfig
    from flashgen.problem import TuneProblem

    d, causal, bm, stages = tile  # (the 80-row tile: its own _convert grid, dQ^T's)
    cfg = BwdConfig(d, "bf16", causal, bm, 128, 12, family="sm90", num_stages=stages, stagger=True)
    gpu, arch = "NVIDIA H200", "sm90"
    p = TuneProblem(gpu, arch, "sm90", "bf16", d, causal, 4096, pass_="bwd")
    merge(store_path(gpu, arch, tmp_path / "tuned"), gpu, arch, {
        p.key: {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": 1.0, "tflops": 1.0, "problem": p.to_dict()}})
    out = tmp_path / "out"
    export("sm90", out, tmp_path / "tuned")
    h = (out / f"{cfg.name}.h").read_text()
    assert "struct Sm90BwdParams" in h and "struct BwdParams" in h and "code=sm_90a" in h
    for words in ("seqlen_q_pad", "lse2", "cuTensorMapEncodeTiled", f"SMEM_BYTES = {cfg.smem_bytes};",
                  f"{cfg.name}_convert<<<", f"PRE_ROWS = {cfg.pre_rows};", "* HEAD_DIM, 2048)" if bm == 80 else ", 4096)"):
        assert words in h, words
    link_app(out, SM90_BWD_MAIN.format(a=cfg.name), (cfg.name,), ("-gencode", "arch=compute_90a,code=sm_90a"))


def test_sm90_deterministic_backward_header_asks_for_the_zeroed_semaphores():
    """Only the deterministic sm90 backward's header names dq_semaphore (the other headers are as they were)."""
    import dataclasses

    from flashgen.config import BwdConfig
    from flashgen.export import bwd_header

    cfg = BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=2, stagger=True, dq_tma=True)
    det = dataclasses.replace(cfg, deterministic=True)
    h, hdet = bwd_header(cfg, [], "sm_90a"), bwd_header(det, [], "sm_90a")
    assert "zeroed before every launch()" in hdet and "zeroed before every launch()" not in h
    added = [line for line in hdet.replace(det.name, cfg.name).splitlines() if line not in h.splitlines()]
    assert len(added) == 2 and added[0].startswith("// Deterministic: p.dq_semaphore is")


# ---- Serving kernels (any of config.FEATURES): not tuned, exported by export_configs / cli.py export --features.

SERVE_SETS = [dict(varlen=True, paged=True, split=True, pack_gqa=True),  # decode: a paged cache, GQA packed, split-KV
              dict(varlen=True, window=True, softcap=True, alibi=True)]  # a varlen prefill with score modifiers


def serving_cfgs() -> list[KernelConfig]:
    from flashgen.kernels.serving import serve_config

    return [serve_config(128, "bf16", False, 4, "sm80", **SERVE_SETS[0]),
            serve_config(128, "bf16", True, 1024, "sm80", **SERVE_SETS[1])]


def test_serving_export_documents_serve_params_grids_and_features(tmp_path):
    from flashgen.export import export_configs
    from flashgen.kernels.serving import SERVE_PARAMS

    dec, mods = serving_cfgs()
    files = export_configs([dec, mods], tmp_path)
    assert sorted(f.name for f in files) == sorted([f"{c.name}{x}" for c in (dec, mods) for x in (".cu", ".h")]
                                                   + ["manifest.json"])
    man = {m["kernel"]: m for m in json.loads((tmp_path / "manifest.json").read_text())["kernels"]}
    assert man[dec.name]["kernels"] == dec.kernel_names and man[dec.name]["params_bytes"] == SERVE_PARAMS.size
    assert man[dec.name]["grid"] == "(ceil(seqlen_q * (heads / heads_k) / 32) * heads_k * batch * num_splits, 1, 1)"
    assert man[dec.name]["combine_threads"] == 128 and "combine_grid" not in man[mods.name]
    assert man[mods.name]["features"] == ["varlen", "window", "softcap", "alibi"]
    assert f"{dec.name}_combine(" in (tmp_path / f"{dec.name}.cu").read_text()
    h = (tmp_path / f"{dec.name}.h").read_text()
    assert "struct ServeParams" in h and "struct FwdParams" in h and f"PARAMS_BYTES = {SERVE_PARAMS.size};" in h
    assert f"SMEM_BYTES = {dec.smem_bytes};" in h and f"THREADS = {dec.threads};" in h
    assert f"{dec.name}_combine<<<" in h and "constexpr bool PACK_GQA = true;" in h
    for words in ("cu_seqlens_q, cu_seqlens_k: int32 (batch + 1) offsets", "seqused_k", "block_table: int32",
                  "PAGE_SIZE_MULTIPLE", "o_accum_floats", "lse_accum", "num_splits",
                  "leave them 0 / null): window_left, window_right, softcap_pre, alibi_slopes"):
        assert words in h, words
    h = (tmp_path / f"{mods.name}.h").read_text()
    assert "_combine" not in h and "window_left, window_right: query i sees keys" in h
    assert "softcap_pre = softmax_scale / softcap" in h and "alibi_slopes: fp32 (heads)" in h


def test_a_serving_config_in_the_store_gets_the_serving_header(tmp_path):
    dec = serving_cfgs()[0]
    merge(store_path("NVIDIA H200", "sm90", tmp_path / "tuned"), "NVIDIA H200", "sm90", {
        "k": {"config": dec.to_dict(), "kernel": dec.name, "median_ms": 1.0, "tflops": 1.0,
              "problem": {"seqlen": 4096, "gqa_group": 1}}})
    export("sm80", tmp_path / "out", tmp_path / "tuned")
    h = (tmp_path / "out" / f"{dec.name}.h").read_text()
    assert "struct ServeParams" in h and "NVIDIA H200 (sm90)" in h and "-arch=sm_90" in h


def test_a_tuned_decode_entry_exports_with_its_split_count(tmp_path):
    """tune --kind decode's entries: the kernel with the serving header, each tuned problem's num_splits in the manifest."""
    import json

    from flashgen.tune_decode import DecodeProblem, decode_config

    cfg = decode_config(128, "bf16", (16, 32, 1, 2), True, True)
    p = DecodeProblem(128, "bf16", 32, 8, 32, 8192, 16, "NVIDIA H200", "sm90")
    merge(store_path("NVIDIA H200", "sm90", tmp_path / "tuned"), "NVIDIA H200", "sm90", {
        p.key: {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": 0.26, "tflops": None, "tb_s": 4.0,
                "num_splits": 8, "problem": p.to_dict()}})
    export("sm80", tmp_path / "out", tmp_path / "tuned")
    assert "struct ServeParams" in (tmp_path / "out" / f"{cfg.name}.h").read_text()
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["kernels"][0]
    assert entry["kernel"] == cfg.name and entry["problems"][0]["num_splits"] == 8 and entry["problems"][0]["key"] == p.key


SERVE_MAIN = """\
#include "{a}.h"
#include "{b}.h"
namespace A = flashgen::{a}_launch;
namespace B = flashgen::{b}_launch;
static_assert(A::SPLIT && A::PAGED && A::PACK_GQA && !A::ALIBI, "decode features");
static_assert(B::WINDOW && B::SOFTCAP && B::ALIBI && !B::SPLIT, "modifier features");
static_assert(sizeof(ServeParams) == A::PARAMS_BYTES, "the struct flashgen.kernels.serving packs");
int main() {{
    ServeParams p = {{}};  // a decode step: 2 sequences, 8 query heads on 2 KV heads, 4 splits over 256-key pages
    p.f.batch = 2; p.f.heads = 8; p.f.heads_k = 2; p.f.seqlen_q = 1; p.f.seqlen_k = 4096;
    p.total_rows = 2; p.page_size = 256; p.num_splits = 4;
    A::set_scales(p, 0.08838834764831845);
    cudaError_t e1 = A::launch(p);
    p.num_splits = 1; p.window_left = 512; p.window_right = -1;
    B::set_scales(p, 0.08838834764831845, 30.0);
    cudaError_t e2 = B::launch(p, 0);
    return (int)e1 + (int)e2;
}}
"""


@needs_nvcc
def test_exported_serving_kernels_compile_and_link_with_plain_nvcc(tmp_path):
    from flashgen.export import export_configs

    a, b = serving_cfgs()
    export_configs([a, b], tmp_path)
    compile_cubins(tmp_path, (a.name, b.name))
    link_app(tmp_path, SERVE_MAIN.format(a=a.name, b=b.name), (a.name, b.name))
    for c in (a, b):
        assert_plain_cpp(tmp_path / f"{c.name}.h")


GRID_MAIN = """\
#include <stdio.h>
#include "{a}.h"
namespace L = flashgen::{a}_launch;
int main() {{
    int b, h, hk, sq, rows, sp; double scale, cap;
    printf("%d\\n", (int)sizeof(ServeParams));
    while (scanf("%d %d %d %d %d %d %lf %lf", &b, &h, &hk, &sq, &rows, &sp, &scale, &cap) == 8) {{
        ServeParams p = {{}};
        L::set_scales(p, scale, cap);
        printf("%u %u %a %a %a\\n", L::grid_x(sq, h, hk, b, sp), L::combine_grid_x(rows, h), p.f.softmax_scale,
               p.f.scale_log2, p.softcap_pre);
    }}
    return 0;
}}
"""
CXX = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
@pytest.mark.parametrize("which", [0, 1], ids=["decode", "mods"])
def test_header_grids_and_scales_are_serving_py_s(which, tmp_path):
    """The header's C++ grid_x, combine_grid_x and set_scales give what flashgen.kernels.serving launches with."""
    import struct

    from flashgen.export import export_configs
    from flashgen.kernels.serving import SERVE_PARAMS, _scales, serve_grids

    cfg = serving_cfgs()[which]
    export_configs([cfg], tmp_path)
    (tmp_path / "grid.cpp").write_text(GRID_MAIN.format(a=cfg.name))
    subprocess.run([CXX, "-std=c++17", "-o", str(tmp_path / "grid"), str(tmp_path / "grid.cpp")], check=True,
                   capture_output=True, text=True)
    cases = [(b, h, hk, sq, b * sq, sp, scale, cap)
             for b, h, hk, sq, sp in [(1, 32, 8, 1, 37), (3, 8, 8, 17, 1), (64, 16, 1, 4, 2), (2, 4, 2, 1000, 128),
                                      (0, 8, 2, 1, 4), (5, 12, 4, 0, 3)]
             for scale, cap in [(0.08838834764831845, 0.0), (-0.3, 0.0), (1e-50, 0.0), (0.125, 50.0)]]
    out = subprocess.run([str(tmp_path / "grid")], input="".join(" ".join(map(str, c)) + "\n" for c in cases),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert int(out[0]) == SERVE_PARAMS.size

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    for case, line in zip(cases, out[1:]):
        b, h, hk, sq, rows, sp, scale, cap = case
        main, comb, s, s_log2, pre = line.split()
        assert (int(main), int(comb)) == serve_grids(cfg, b, h, hk, sq, rows, sp), case
        want = tuple(f32(x) for x in _scales(scale, cfg.head_dim, cap))
        assert (float.fromhex(s), float.fromhex(s_log2), float.fromhex(pre)) == want, case
