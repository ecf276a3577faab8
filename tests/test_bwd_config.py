"""The backward's configuration, rendering, parameter packing and compilation (no GPU needed)."""
import dataclasses
import itertools
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from flashgen.abi import BWD, SM90_BWD
from flashgen.kernels.backward import backward, pack_params
from flashgen.compile import CompiledKernel, Resources, compile_kernel, parse_ptxas, target_for
from flashgen.config import (
    ARCHS, HALF_DTYPES, HEAD_DIMS, LSE_AHEAD_SPACE, SM90_BWD_HEAD_DIMS, BwdConfig, ConfigError, KernelConfig, bwd_space, bwd_warp_grid, default_bwd_config,
)
from flashgen.render import render
from flashgen.tensors import Problem


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


@pytest.mark.parametrize("field,value,allowed", [
    ("head_dim", 48, "32"), ("dtype", "fp32", "'fp16'"), ("block_m", 256, "32, 64, 128"),
    ("block_n", 16, "32, 64, 128"), ("num_warps", 16, "2, 4, 8"), ("deterministic", 1, "False, True"),
    ("causal", "yes", "False, True"), ("family", "sm100", "'sm80', 'sm90'"),
])
def test_bad_field_names_field_and_allowed_values(field, value, allowed):
    kw = dict(head_dim=64, dtype="fp16", causal=False, block_m=64, block_n=64, num_warps=4)
    kw[field] = value
    with pytest.raises(ConfigError, match=f"{field}={value!r} is not allowed.*{allowed}"):
        BwdConfig(**kw)


def test_warps_must_tile_every_product():
    with pytest.raises(ConfigError, match=r"num_warps=8 cannot tile the \[32, 32\] S = Q K\^T"):
        BwdConfig(64, "fp16", False, 32, 32, 8)
    with pytest.raises(ConfigError, match=r"num_warps=8 cannot tile the \[32, 32\] dK, dV"):
        BwdConfig(32, "fp16", False, 64, 32, 8)
    assert bwd_warp_grid(64, 128, 8) == (4, 2) and bwd_warp_grid(32, 64, 4) == (2, 2)
    assert bwd_warp_grid(32, 96, 8) is None  # 96 columns in 4 pieces of 24: not whole 16-wide pieces


def test_name_spells_every_field_and_is_hashable():
    c = BwdConfig(128, "bf16", True, 64, 64, 8)
    assert c.name == "bwd_sm80_d128_bf16_causal_bm64_bn64_w8_det0"
    assert BwdConfig(96, "fp16", False, 64, 32, 4, True).name == "bwd_sm80_d96_fp16_full_bm64_bn32_w4_det1"
    assert c.kernel_names == {"pre": c.name + "_pre", "main": c.name, "convert": c.name + "_convert"}
    d = BwdConfig(128, "bf16", True, 64, 64, 8, deterministic=True)
    assert d.kernel_names == {"pre": d.name + "_pre", "main": d.name, "dq": d.name + "_dq"}
    assert len({c, d, BwdConfig(128, "bf16", True, 64, 64, 8)}) == 2
    assert BwdConfig.from_dict(d.to_dict()) == d
    with pytest.raises(ConfigError, match="unknown config fields"):
        BwdConfig.from_dict({**c.to_dict(), "overlap": True})
    names = {x.name for hd in HEAD_DIMS for dt in HALF_DTYPES for ca in (0, 1) for det in (0, 1)
             for x in bwd_space(hd, dt, bool(ca), bool(det))}
    assert len(names) == sum(len(bwd_space(hd, dt, bool(ca), bool(det)))
                             for hd in HEAD_DIMS for dt in HALF_DTYPES for ca in (0, 1) for det in (0, 1))


def test_derived_figures():
    c = BwdConfig(128, "fp16", False, 64, 32, 4)
    assert c.threads == 128 and c.row_threads == 256
    assert c.smem_bytes == (2 * 32 * 128 + 2 * 64 * 128 + 2 * 64 * 32) * 2 + 2 * 64 * 4
    assert c.grid(2, 3, 100) == (4 * 3 * 2, 1, 1)
    assert c.dq_grid(2, 3, 100) == (2 * 3 * 2, 1, 1)
    assert c.rows_grid(2, 3, 100) == (13 * 3 * 2, 1, 1)
    assert c.grid(30000, 70000, 32) == (30000 * 70000, 1, 1)  # beyond 65535 heads and batch: one flat x
    with pytest.raises(ValueError, match="split the batch"):
        c.grid(2**16, 2**16, 1024)
    # dK + dV (2 * 32 * 128 / 128) + S + dP (2 * 64 * 32 / 128)
    assert c.accum_regs == 64 + 32


def test_unfit_reasons():
    assert "shared memory" in BwdConfig(256, "fp16", False, 64, 32, 8).unfit_reason("sm86")
    assert BwdConfig(256, "fp16", False, 64, 32, 8).unfit_reason("sm80") is None
    assert "accumulator registers" in BwdConfig(128, "fp16", False, 64, 64, 4).unfit_reason("sm90")
    assert "accumulator registers" in BwdConfig(256, "fp16", False, 64, 64, 8).unfit_reason("sm90")
    with pytest.raises(ConfigError, match="arch='sm70'"):
        BwdConfig(64, "fp16", False, 64, 64, 4).unfit_reason("sm70")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_defaults_fit_every_arch_and_are_in_the_space(arch):
    for hd, dt, causal, det in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True), (False, True)):
        c = default_bwd_config(hd, dt, causal, arch, det)
        assert c.unfit_reason(arch) is None and c.deterministic == det
        assert c in bwd_space(hd, dt, causal, det, family=c.family)
        # Hopper takes family sm90 where it has the head dim (its FA3 design; deterministic: with dq_tma), sm80 elsewhere
        assert c.family == ("sm90" if arch == "sm90" and hd in SM90_BWD_HEAD_DIMS else "sm80")
        assert c.dq_tma == (c.family == "sm90" and det)


def test_sm90_rules_name_fields_and_reasons():
    c = BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=2)
    assert c.name == "bwd_sm90_d128_bf16_causal_bm64_bn128_w12_s2_st0" and c.consumers == 2 and c.dq_parts == 2
    assert BwdConfig(64, "bf16", True, 128, 128, 12, family="sm90", stagger=True).name.endswith("_s2_st1")
    assert c.kernel_names == {"pre": c.name + "_pre", "main": c.name, "convert": c.name + "_convert"}
    assert BwdConfig.from_dict(c.to_dict()) == c and c.threads == 384
    # K, V; two stages of Q, dO [64, 128] bf16 and LSE, D; two dS^T [128, 64]; 9 barriers; 1024 alignment
    assert c.smem_bytes == 1024 + 2 * 128 * 128 * 2 + 2 * (2 * 64 * 128 * 2 + 2 * 64 * 4) + 2 * 128 * 64 * 2 + 8 * 9
    assert c.accum_regs == 128 + 64 and c.unfit_reason("sm90") is None
    assert "runs on sm90 only" in c.unfit_reason("sm80")
    assert c.seqlen_q_pad(65) == 128 and c.convert_grid(2, 3, 65) == (128 * 128 // 4096 * 3 * 2, 1, 1)
    assert c.rows_grid(2, 3, 65) == (2 * 3 * 2, 1, 1)  # 128 padded rows in groups of 64
    with pytest.raises(ConfigError, match="num_warps=8 must be 12 for block_n=128"):
        BwdConfig(128, "bf16", True, 64, 128, 8, family="sm90")
    with pytest.raises(ConfigError, match="deterministic=True in family sm90 needs dq_tma=True"):
        BwdConfig(128, "bf16", True, 64, 128, 12, True, family="sm90")
    with pytest.raises(ConfigError, match="head_dim=48 is not allowed"):
        BwdConfig(48, "bf16", True, 64, 64, 8, family="sm90")
    with pytest.raises(ConfigError, match="cannot split dQ"):  # d96: two 48-column slices
        BwdConfig(96, "bf16", True, 64, 128, 12, family="sm90")
    # head_dim 256: two warpgroups share each 64 keys, each with 128 columns of dK and dV
    wide = BwdConfig(256, "bf16", True, 64, 64, 12, family="sm90")
    assert wide.kv_split == 2 and wide.consumers == 2 and wide.dq_parts == 2 and wide.accum_regs == 128 + 64
    with pytest.raises(ConfigError, match="num_warps=8 must be 12 for block_n=64"):
        BwdConfig(256, "bf16", True, 64, 64, 8, family="sm90")
    with pytest.raises(ConfigError, match="needs 4 consumer warpgroups"):
        BwdConfig(256, "bf16", True, 64, 128, 20, family="sm90")
    with pytest.raises(ConfigError, match="cannot split dQ"):  # d64: two 32-column slices of dQ
        BwdConfig(64, "bf16", True, 64, 128, 12, family="sm90")
    with pytest.raises(ConfigError, match="cannot split dQ"):  # two 64-row chunks, one consumer
        BwdConfig(64, "bf16", True, 128, 64, 8, family="sm90")
    with pytest.raises(ConfigError, match="num_stages=3 is not allowed"):  # sm80 loads one Q tile at a time
        BwdConfig(64, "bf16", True, 64, 64, 4, num_stages=3)
    assert "accumulator registers" in BwdConfig(128, "bf16", True, 128, 128, 12, family="sm90", num_stages=1).unfit_reason("sm90")
    space = bwd_space(128, "bf16", False, family="sm90")
    assert {(x.block_m, x.block_n) for x in space if x.unfit_reason("sm90") is None} == {(64, 64), (64, 128), (80, 128)}
    assert {x.num_stages for x in space} == {1, 2, 3} and {x.stagger for x in space} == {False, True}
    with pytest.raises(ConfigError, match="stagger=True is not allowed"):  # an sm90 schedule
        BwdConfig(64, "bf16", True, 64, 64, 4, stagger=True)


def test_sm90_params_tensor_maps(monkeypatch):
    """The four TMA maps of the sm90 backward: 4-d over (head_dim, seqlen, heads, batch) with byte strides,
    boxes of SMEM_W x block_m (q, dout) or block_n (k, v) rows, swizzled by the config's row bytes."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels import backward as bwd

    maps = []
    monkeypatch.setattr(bwd.driver, "tensor_map", lambda *a: maps.append(a) or bytes(128))
    cfg = BwdConfig(96, "bf16", True, 64, 64, 8, family="sm90")  # 64-byte rows: SMEM_W 32
    q = torch.empty(2, 100, 6, 96, dtype=torch.bfloat16)
    k = torch.empty(2, 300, 3, 96, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    prob = Problem(batch=2, seqlen_q=100, seqlen_k=300, heads=6, heads_k=3, head_dim=96, dtype="bf16")
    raw = bwd._sm90_params(bytes(BWD.size), cfg, prob, (q, k, k, q), 1234, 128, bwd.ServeArgs(window=(5, 7)),
                           (2, 100, 300))
    assert len(raw) == 1024 and struct.unpack_from("=Qi", raw, 512 + BWD.size) == (1234, 128)
    # the varlen, window and semaphore fields where templates/sm90/bwd_params.cuh.j2's static_asserts pin them
    assert struct.unpack_from("=QQ2i3iiQ", raw, 856) == (0, 0, 5, 7, 2, 100, 300, 0, 0)
    assert [m[2:] for m in maps] == [
        ((96, 100, 6, 2), (2 * 6 * 96, 2 * 96, 2 * 100 * 6 * 96), (32, 64, 1, 1), 64),
        ((96, 300, 3, 2), (2 * 96, 2 * 300 * 96, 2 * 300 * 3 * 96), (32, 64, 1, 1), 64),
        ((96, 300, 3, 2), (2 * 96, 2 * 300 * 96, 2 * 300 * 3 * 96), (32, 64, 1, 1), 64),
        ((96, 100, 6, 2), (2 * 6 * 96, 2 * 96, 2 * 100 * 6 * 96), (32, 64, 1, 1), 64)]
    det = bwd._sm90_params(bytes(BWD.size), cfg, prob, (q, k, k, q), 1234, 128, bwd.ServeArgs(), (2, 100, 300), 5678)
    assert struct.unpack_from("=Q", det, 896) == (5678,) and len(det) == 1024
    assert cfg.smem_w == 32 and cfg.row_bytes == 64 and BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90").row_bytes == 128


def test_sm90_params_match_the_struct_layout():
    src = render(BwdConfig(64, "bf16", False, 128, 128, 12, family="sm90"))
    assert "static_assert(sizeof(Sm90BwdParams) == 1024" in src and SM90_BWD.size == 1024
    assert 4 * 128 + BWD.size + SM90_BWD.tail("lse2").size == SM90_BWD.size


def test_render_dispatches_on_the_config_type():
    c = BwdConfig(64, "bf16", True, 64, 64, 4)
    src = render(c)
    for name in c.kernel_names.values():
        assert f"void __launch_bounds__" in src and f" {name}(const __grid_constant__ BwdParams p)" in src
    assert f"{c.name}_dq(" not in src and "struct BwdParams" in src and "__nv_bfloat16" in src
    det = render(BwdConfig(64, "fp16", False, 64, 64, 4, True))
    assert "_dq(const __grid_constant__" in det and "_convert(" not in det and "__half" in det
    fwd = render(KernelConfig(64, "fp16", False, 64, 64, 4, 2))  # the forward is unchanged
    assert "struct FwdParams" in fwd and "BwdParams" not in fwd


def test_pack_params_matches_the_struct_layout():
    prob = Problem(batch=2, seqlen_q=3, seqlen_k=4, heads=6, heads_k=2, head_dim=64, dtype="fp16")
    ptrs = tuple(range(1000, 1013))
    strides = tuple(range(1, 25))
    raw = pack_params(ptrs, strides, prob, 0.125, 0.18)
    assert len(raw) == BWD.size == 328  # static_assert(sizeof(BwdParams) == 328) in the template
    assert struct.unpack_from("=13Q", raw, 0) == ptrs
    assert struct.unpack_from("=24q", raw, 104) == strides
    assert struct.unpack_from("=5i", raw, 296) == (2, 6, 2, 3, 4)
    assert struct.unpack_from("=2f", raw, 316) == pytest.approx((0.125, 0.18))


def test_backward_rejects_before_touching_a_gpu():
    cfg = BwdConfig(64, "fp16", False, 64, 64, 4)
    kern = CompiledKernel(cfg, "sm_80", "", b"", Resources(1, 0, 0, 0, 0), "")
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="softmax_scale > 0"):
        backward(kern, q, q, q, q, q, None, softmax_scale=-0.5)
    with pytest.raises(NotImplementedError, match="softmax_scale > 0"):
        backward(kern, q, q, q, q, q, None, softmax_scale=0.0)
    with pytest.raises(ValueError, match="CUDA tensors"):
        backward(kern, q, q, q, q, q, None)
    fwd = CompiledKernel(KernelConfig(64, "fp16", False, 64, 64, 4, 2), "sm_80", "", b"", Resources(1, 0, 0, 0, 0), "")
    with pytest.raises(TypeError, match="not a backward kernel"):
        backward(fwd, q, q, q, q, q, None)


def _check_no_spills(kernels):
    for k in kernels:
        assert k.cubin[:4] == b"\x7fELF", k.name
        assert k.resources.smem_bytes == k.config.smem_bytes
        for name in k.config.kernel_names.values():  # every __global__ of the file
            r = parse_ptxas(k.ptxas_log, name, 0)
            assert f"'{name}'" in k.ptxas_log, name
            assert 0 < r.registers <= 255, name
            assert not r.spills and r.stack_bytes == 0, f"{name} spills on {k.target}: {r}"


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_defaults_compile_without_spills(arch):
    cfgs = [default_bwd_config(hd, dt, c, arch) for hd, dt, c in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True))]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, target_for(arch, c.family)), cfgs))
    _check_no_spills(kernels)
    assert kernels[0].resources == parse_ptxas(kernels[0].ptxas_log, kernels[0].config.name, kernels[0].config.smem_bytes)


@pytest.mark.sweep
def test_deterministic_defaults_compile_without_spills():
    cfgs = [default_bwd_config(hd, "bf16", True, "sm80", deterministic=True) for hd in HEAD_DIMS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, "sm_80"), cfgs))
    _check_no_spills(kernels)


@pytest.mark.sweep
def test_sm90_kernels_compile_without_spills_or_serialized_wgmma():
    """The sm90 backward's defaults (every head dim, dtype, mask) and each schedule knob at another tile:
    no spills, and none of ptxas's wgmma advisories (C7512/C7513: wgmma serialized for registers; C7519:
    a fence the compiler had to add)."""
    import re

    from conftest import compile_sm90a_clean

    cfgs = [default_bwd_config(hd, dt, c, "sm90") for hd in SM90_BWD_HEAD_DIMS for dt in HALF_DTYPES for c in (False, True)]
    cfgs += [BwdConfig(64, "bf16", True, 64, 64, 8, family="sm90", num_stages=1, stagger=True),
             BwdConfig(128, "bf16", False, 64, 128, 12, family="sm90", num_stages=2, stagger=False),
             BwdConfig(256, "fp16", True, 64, 64, 12, family="sm90", num_stages=1, stagger=False)]
    assert {c.family for c in cfgs} == {"sm90"}
    for k in compile_sm90a_clean(cfgs):
        assert not re.search(r"C751[239]", k.ptxas_log), f"{k.name}: {k.ptxas_log}"


def test_lse_ahead_rules_name_and_dict():
    """lse_ahead: an sm90 knob, off by default (names and dicts of the kernels without it unchanged), spelled `_laN`,
    for the softmax without kv_split or modifiers, not in sm80."""
    c = BwdConfig(128, "bf16", False, 64, 128, 12, family="sm90", num_stages=3, stagger=True)
    on = dataclasses.replace(c, lse_ahead=2)
    assert c.lse_ahead == 0 and "lse_ahead" not in c.to_dict() and on.to_dict()["lse_ahead"] == 2
    assert on.name == c.name + "_la2" and BwdConfig.from_dict(on.to_dict()) == on and on.smem_bytes == c.smem_bytes
    assert "constexpr int LSE_AHEAD = 2;" in render(on) and "constexpr int LSE_AHEAD = 0;" in render(c)
    assert BwdConfig(64, "bf16", True, 64, 64, 8, family="sm90", lse_ahead=4, window=True, varlen=True).lse_ahead == 4
    with pytest.raises(ConfigError, match="lse_ahead=. is not allowed"):
        dataclasses.replace(c, lse_ahead=3)
    with pytest.raises(ConfigError, match="without kv_split or modifiers.*head_dim=256"):
        BwdConfig(256, "bf16", False, 64, 64, 12, family="sm90", num_stages=1, lse_ahead=2)
    with pytest.raises(ConfigError, match="with a score_mod, mask_mod or block map"):
        dataclasses.replace(c, lse_ahead=2, block_map=True)
    with pytest.raises(ConfigError, match="lse_ahead=2 is not allowed"):  # sm80 reads LSE and D its own way
        BwdConfig(64, "bf16", True, 64, 64, 4, lse_ahead=2)
    space = [x for x in bwd_space(128, "bf16", False, family="sm90") if x.block_m != 80]  # (80-row tiles: last)
    # each read distance after the rest, which keep their order
    plain = [x for x in space if not x.lse_ahead]
    assert space[:len(plain)] == plain and {x.lse_ahead for x in space} == set(LSE_AHEAD_SPACE) == {0, 2}
    assert {dataclasses.replace(x, lse_ahead=0) for x in space} == set(plain)
    assert {x.lse_ahead for x in bwd_space(256, "bf16", False, family="sm90")} == {0}


@pytest.mark.sweep
def test_lse_ahead_builds_clean_and_reads_before_the_wait():
    """With lse_ahead, the first n-tiles' LSE and D loads (LDS.64) sit before the main kernel's first wgmma wait (the
    wait for S^T and dP^T); without it, none do. Each read distance at d64's and d128's stored tiles, both masks, a
    window and varlen: no spills, no serialized wgmma."""
    import re

    from conftest import compile_sm90a_clean

    from flashgen.compile import disassemble, disassembler

    cfgs = [BwdConfig(hd, "bf16", causal, bm, 128, 12, family="sm90", num_stages=s, stagger=True, lse_ahead=la)
            for hd, bm, s in ((64, 128, 2), (128, 64, 3)) for causal in (False, True) for la in (0, 1, 2, 4)]
    cfgs += [dataclasses.replace(c, lse_ahead=8) for c in cfgs if c.block_m == 64 and c.lse_ahead == 4 and not c.causal]
    cfgs += [BwdConfig(128, "fp16", True, 64, 128, 12, family="sm90", num_stages=2, stagger=True, lse_ahead=2,
                       window=True, varlen=True),
             BwdConfig(64, "bf16", False, 64, 64, 8, family="sm90", num_stages=2, lse_ahead=2)]
    kernels = compile_sm90a_clean(cfgs)
    if disassembler() is None:
        pytest.skip("no SASS disassembler for the load placement (pip install nvidia-cuda-nvdisasm)")
    section = re.compile(r"(?:^//-+ \.text\.|Function : )(\S+)")
    for k in kernels:
        ops, current = [], None
        for line in disassemble(k.cubin).splitlines():
            m = section.search(line)
            if m:
                current = m.group(1)
            elif current == k.config.name and (op := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)):
                ops.append(op.group(1))
        first_wait = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR"))
        early = sum(op.startswith("LDS.64") for op in ops[:first_wait])
        if k.config.lse_ahead:
            assert early >= 2, f"{k.name}: {early} LSE/D loads before the wait for S^T and dP^T"
        else:
            assert early == 0, f"{k.name}: {early} loads before the wait without lse_ahead"


def test_inner_overlap_rules_name_and_dict():
    """inner_overlap: an sm90 knob outside the space, off by default (the kernels without it render as before),
    spelled `_io`, for the one-pass softmax's kernels where P^T in fp32 fits beside its packed copy."""
    c = BwdConfig(128, "bf16", False, 64, 128, 12, family="sm90", num_stages=3, stagger=True)
    on = dataclasses.replace(c, inner_overlap=True)
    assert on.name == c.name + "_io" and BwdConfig.from_dict(on.to_dict()) == on and "inner_overlap" not in c.to_dict()
    assert "dv_issue(acc_dv, a_p" in render(on) and "dv_issue" not in render(c) and "dk_issue" not in render(c)
    assert not any(x.inner_overlap for x in bwd_space(128, "bf16", False, family="sm90"))
    assert BwdConfig(32, "bf16", True, 128, 128, 12, family="sm90", inner_overlap=True).inner_overlap  # 32 + 192 regs
    with pytest.raises(ConfigError, match="run out of registers.*C7512"):
        BwdConfig(64, "bf16", False, 128, 128, 12, family="sm90", inner_overlap=True)
    with pytest.raises(ConfigError, match="inner_overlap is built for the sm90 backward without kv_split"):
        BwdConfig(256, "bf16", False, 64, 64, 12, family="sm90", num_stages=1, inner_overlap=True)
    with pytest.raises(ConfigError, match="with a score_mod, mask_mod or block map"):
        dataclasses.replace(on, block_map=True)
    with pytest.raises(ConfigError, match="lse_ahead is for the one-pass"):
        dataclasses.replace(on, lse_ahead=2)
    with pytest.raises(ConfigError, match="inner_overlap=True is not allowed"):
        BwdConfig(64, "bf16", True, 64, 64, 4, inner_overlap=True)


@pytest.mark.sweep
def test_inner_overlap_builds_clean():
    """With inner_overlap (dV issued apart from dK: one more wgmma group, one more WARPGROUP.ARRIVE) every allowed
    tile kind builds without spills or wgmma advisories, staggered or not, both masks, and with a window and varlen."""
    from conftest import compile_sm90a_clean

    from flashgen.compile import disassemble, disassembler

    base = [BwdConfig(hd, "bf16", causal, bm, bn, 4 * (1 + bn // 64), family="sm90", num_stages=s, stagger=st)
            for hd, bm, bn, s in ((128, 64, 128, 3), (128, 64, 128, 2), (64, 64, 64, 2), (32, 128, 128, 3), (96, 64, 64, 2))
            for causal in (False, True) for st in (True, False)]
    base += [BwdConfig(128, "fp16", True, 64, 128, 12, family="sm90", num_stages=2, stagger=True, window=True,
                       varlen=True)]
    kernels = compile_sm90a_clean(base + [dataclasses.replace(c, inner_overlap=True) for c in base])
    if disassembler() is None:
        pytest.skip("no SASS disassembler for the ARRIVE counts (pip install nvidia-cuda-nvdisasm)")
    for off, on in zip(kernels[:len(base)], kernels[len(base):]):
        arrives = [disassemble(k.cubin).count("WARPGROUP.ARRIVE") for k in (off, on)]
        assert arrives[1] == arrives[0] + 1, f"{on.name}: {arrives}"


def test_dq_transposed_tile_rules_and_figures():
    """block_m 80 (FlashAttention-4's d128 tile): dQ^T = K^T dS^T, one consumer warpgroup per 64 head dims, so d128
    with 128-key tiles; not with modifiers or inner_overlap; last in the space; _pre in 16-row blocks (80 is no
    multiple of 64), _convert in units of 16 rows x 64 columns; three stages fit at d128."""
    c = BwdConfig(128, "bf16", False, 80, 128, 12, family="sm90", num_stages=3, stagger=True)
    assert c.dq_transposed and c.name == "bwd_sm90_d128_bf16_full_bm80_bn128_w12_s3_st1" and c.unfit_reason("sm90") is None
    assert c.dq_parts == 2 and c.pre_rows == 16 and c.seqlen_q_pad(4096) == 4160 and c.smem_bytes <= 227 * 1024
    assert c.convert_grid(2, 16, 4096) == (4160 * 128 // 2048 * 16 * 2, 1, 1)
    assert c.rows_grid(2, 16, 4096) == (4160 // 16 * 16 * 2, 1, 1)
    assert BwdConfig.from_dict(c.to_dict()) == c and not BwdConfig(128, "bf16", False, 64, 128, 12, family="sm90").dq_transposed
    assert BwdConfig(128, "fp16", True, 80, 128, 12, family="sm90", dq_tma=True, deterministic=True).dq_transposed
    assert BwdConfig(128, "bf16", False, 64, 128, 12, family="sm90").pre_rows == 64  # the others' _pre unchanged
    for hd, bn, w in ((128, 64, 8), (64, 128, 12), (64, 64, 8), (96, 64, 8), (32, 128, 12), (256, 64, 12)):
        with pytest.raises(ConfigError, match="one consumer warpgroup per 64 head dims"):
            BwdConfig(hd, "bf16", False, 80, bn, w, family="sm90", num_stages=1)
    with pytest.raises(ConfigError, match="not with inner_overlap"):
        BwdConfig(128, "bf16", False, 80, 128, 12, family="sm90", inner_overlap=True)
    with pytest.raises(ConfigError, match="not with a score_mod, mask_mod or block map"):
        dataclasses.replace(c, block_map=True)
    with pytest.raises(ConfigError, match="block_m=80 is not allowed"):
        BwdConfig(128, "bf16", False, 80, 128, 8)  # sm80
    space = bwd_space(128, "bf16", False, family="sm90")  # the 80-row tiles after the others, which keep their order
    first = next(i for i, x in enumerate(space) if x.block_m == 80)
    assert all(x.block_m == 80 for x in space[first:]) and len(space) - first == 20
    assert not any(x.block_m == 80 for hd in (64, 256) for x in bwd_space(hd, "bf16", True, family="sm90"))
    src = render(c)
    assert "constexpr bool DQ_T = BLOCK_M % 64 != 0;" in src and "m64n80k16" in src and "p, 1, 1, 1, 0;" in src


def _dq_transposed_configs() -> list[BwdConfig]:
    cfgs = [BwdConfig(128, dt, causal, 80, 128, 12, family="sm90", num_stages=s, stagger=st)
            for dt, causal, s, st in (("bf16", False, 3, True), ("bf16", False, 2, False), ("fp16", True, 2, True))]
    cfgs += [BwdConfig(128, "bf16", False, 80, 128, 12, family="sm90", num_stages=2, stagger=True, dq_tma=True),
             BwdConfig(128, "bf16", False, 80, 128, 12, family="sm90", num_stages=2, stagger=True, dq_tma=True,
                       deterministic=True),  # (causal: 16 bytes spill)
             BwdConfig(128, "bf16", False, 80, 128, 12, family="sm90", num_stages=3, stagger=True, lse_ahead=2),
             BwdConfig(128, "bf16", True, 80, 128, 12, family="sm90", num_stages=2, stagger=True, window=True, varlen=True)]
    return cfgs


@pytest.mark.sweep
def test_dq_transposed_builds_clean():
    """The 80-row tiles build without spills or wgmma advisories, and their SASS has what dQ^T takes: S^T, dP^T and
    dQ^T as m64n80 products (8 k-steps each at d128), dS written by transposing stmatrix (one per two n-tiles)."""
    import re

    from conftest import compile_sm90a_clean

    from flashgen.compile import disassemble, disassembler

    kernels = compile_sm90a_clean(_dq_transposed_configs())
    if disassembler() is None:
        pytest.skip("no SASS disassembler for the instruction shapes (pip install nvidia-cuda-nvdisasm)")
    for k in kernels:
        c = k.config
        sass = disassemble(k.cubin)
        parts = re.split(r"^//-+ \.text\.(\S+) -+$", sass, flags=re.M)  # nvdisasm's function headers
        main = dict(zip(parts[1::2], parts[2::2]))[c.name]
        shapes = re.findall(r"HGMMA\.64x(\d+)x16", main)
        dq_steps = c.block_n // 16 * (2 if c.stagger else 1)  # STAGGER: the last tile's dQ^T after the loop too
        assert shapes.count("80") == 2 * c.head_dim // 16 + dq_steps, f"{k.name}: {shapes}"
        assert main.count("STSM.16.MT88.4") == c.block_m // 16, k.name
        assert not re.search(r"\bSTS\s", main), k.name  # no 4-byte dS^T stores


def test_dq_tma_rules_name_shared_memory_and_space():
    """dq_tma: an sm90 knob, off by default (names and shared memory of the kernels without it unchanged), spelled
    `_dqt`, taking a [block_m, head_dim] fp32 tile and two barriers per consumer warpgroup, rejected where that does
    not fit 227 KB, and in the sm90 space wherever it fits."""
    c = BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=3, stagger=True)
    on = BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=3, stagger=True, dq_tma=True)
    assert not c.dq_tma and c.name == "bwd_sm90_d128_bf16_causal_bm64_bn128_w12_s3_st1"
    assert on.name == c.name + "_dqt" and on.kernel_names["main"] == on.name and BwdConfig.from_dict(on.to_dict()) == on
    assert BwdConfig.from_dict({k: v for k, v in c.to_dict().items() if k != "dq_tma"}) == c  # stored before the knob
    assert on.dq_tile_bytes == 64 * 128 * 4 and on.smem_bytes == c.smem_bytes + 64 * 128 * 4 + 8 * 2 * 2
    assert on.smem_bytes <= ARCHS["sm90"].smem_per_block and on.unfit_reason("sm90") is None
    assert BwdConfig(96, "fp16", False, 64, 64, 8, family="sm90", dq_tma=True).consumers == 1
    with pytest.raises(ConfigError, match=r"dq_tma=True needs 65536 more bytes .*\[64, 256\] fp32 dQ tile.*num_stages=2"):
        BwdConfig(256, "bf16", True, 64, 64, 12, family="sm90", num_stages=2, dq_tma=True)
    assert BwdConfig(256, "bf16", True, 64, 64, 12, family="sm90", num_stages=1, dq_tma=True).unfit_reason("sm90") is None
    with pytest.raises(ConfigError, match="dq_tma=True is not allowed"):  # sm80 has no TMA
        BwdConfig(64, "bf16", True, 64, 64, 4, dq_tma=True)
    with pytest.raises(ConfigError, match="dq_tma=1 is not allowed"):
        BwdConfig(64, "bf16", True, 64, 64, 8, family="sm90", dq_tma=1)
    for hd in SM90_BWD_HEAD_DIMS:
        assert not default_bwd_config(hd, "bf16", True, "sm90").dq_tma
        space = bwd_space(hd, "bf16", False, family="sm90")
        with_knob = {x for x in space if x.dq_tma}
        assert with_knob and all(x.smem_bytes <= 227 * 1024 for x in with_knob)
        assert {dataclasses.replace(x, dq_tma=False) for x in with_knob} <= set(space)
    assert not any(x.dq_tma for x in bwd_space(64, "bf16", False))  # family sm80


def _dq_tma_configs() -> list[BwdConfig]:
    """dq_tma on at each head dim's default tiles (d256: one stage, two do not leave room for the dQ tile)."""
    out = []
    for hd, dt, causal in itertools.product((64, 128, 256), HALF_DTYPES, (False, True)):
        c = dataclasses.replace(default_bwd_config(hd, dt, causal, "sm90"), **({"num_stages": 1} if hd == 256 else {}))
        out.append(dataclasses.replace(c, dq_tma=True))
    return out


@pytest.mark.sweep
def test_sm90_dq_tma_compiles_without_spills_or_serialized_wgmma():
    """dq_tma at d64, d128, d256, both dtypes and masks: no spills, no wgmma advisories, and the consumers' global
    atomics replaced by the bulk reduce (REDG gone, UBLKRED there)."""
    import re

    from conftest import compile_sm90a_clean

    from flashgen.compile import disassemble, disassembler

    for k in compile_sm90a_clean(_dq_tma_configs()):
        assert not re.search(r"C751[239]", k.ptxas_log), f"{k.name}: {k.ptxas_log}"
        if disassembler() is not None:
            sass = disassemble(k.cubin)
            assert "UBLKRED.G.S.ADD.F32" in sass and "REDG" not in sass, k.name


def test_sm90_deterministic_rules_name_defaults_and_render():
    """deterministic in family sm90 orders dq_tma's bulk reduces, so it needs dq_tma; spelled `_det` after `_dqt`
    (the kernels without it keep their names); the same three kernels as without it (sm80's has _dq instead of
    _convert) and the same shared memory; the defaults: the same tiles with dq_tma, in as many stages as fit."""
    c = BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=2, stagger=True, dq_tma=True)
    det = dataclasses.replace(c, deterministic=True)
    assert det.name == c.name + "_det" and BwdConfig.from_dict(det.to_dict()) == det
    assert det.kernel_names == {"pre": det.name + "_pre", "main": det.name, "convert": det.name + "_convert"}
    assert det.smem_bytes == c.smem_bytes and det.unfit_reason("sm90") is None
    with pytest.raises(ConfigError, match="deterministic=True in family sm90 needs dq_tma=True"):
        dataclasses.replace(c, deterministic=True, dq_tma=False)
    assert all(x.dq_tma for x in bwd_space(128, "bf16", True, True, family="sm90"))
    for hd, causal in itertools.product(SM90_BWD_HEAD_DIMS, (False, True)):
        d, base = default_bwd_config(hd, "bf16", causal, "sm90", True), default_bwd_config(hd, "bf16", causal, "sm90")
        assert d.family == "sm90" and d.deterministic and d.dq_tma and d.unfit_reason("sm90") is None
        assert dataclasses.replace(d, deterministic=False, dq_tma=False, num_stages=base.num_stages) == base
        assert d.num_stages == (1 if hd == 256 else base.num_stages)  # d256: the dQ tile leaves room for one stage
    assert default_bwd_config(128, "bf16", True, "sm80", True).family == "sm80"

    src = render(det)
    assert "constexpr bool DETERMINISTIC = true;" in src and "constexpr bool DETERMINISTIC = false;" in render(c)
    # the writer's turn: wait (acquire), proxy fence, bulk reduce, wait for its writes, proxy fence, count (release)
    writer = src[src.index("void dq_writer("):]
    steps = ["ld_acquire_gpu(count)", 'fence.proxy.async.global;', "bulk_reduce_add(", "cp.async.bulk.wait_group 0;",
             'fence.proxy.async.global;', "red_release_gpu_add(count, 1)"]
    at = 0
    for step in steps:
        at = writer.index(step, at) + len(step)
    assert "ld.acquire.gpu.global.b32" in src and "red.release.gpu.global.add.s32" in src


def _deterministic_configs() -> list[BwdConfig]:
    """The deterministic defaults of every head dim and mask (bf16; fp16 at d128), and d128 with varlen and window."""
    cfgs = [default_bwd_config(hd, "bf16", causal, "sm90", True) for hd in SM90_BWD_HEAD_DIMS for causal in (False, True)]
    cfgs.append(default_bwd_config(128, "fp16", True, "sm90", True))
    cfgs.append(dataclasses.replace(default_bwd_config(128, "bf16", True, "sm90", True), varlen=True, window=True))
    return cfgs


@pytest.mark.sweep
def test_sm90_deterministic_compiles_without_spills_or_serialized_wgmma():
    """The deterministic sm90 backward: no spills, no wgmma advisories, no serialized wgmma; in the SASS the dQ adds
    are still bulk reduces (no fp32 atomics), and each is preceded by the acquire spin on its Q tile's counter and
    followed by the wait for its writes and the release add of the counter."""
    from conftest import compile_sm90a_clean

    for k in compile_sm90a_clean(_deterministic_configs()):
        _assert_ordered_reduces(k)


def _assert_ordered_reduces(k: CompiledKernel) -> None:
    """A deterministic sm90 kernel's ptxas log has no wgmma advisories, and its SASS (where a disassembler is
    installed) has no fp32 atomics and, around each bulk reduce, the acquire spin, the wait for its writes and the
    release add."""
    import re

    from flashgen.compile import disassemble, disassembler

    assert not re.search(r"C751[239]", k.ptxas_log), f"{k.name}: {k.ptxas_log}"
    if disassembler() is None:
        return
    sass = disassemble(k.cubin)
    assert "REDG.E.ADD.F32" not in sass and sass.count("REDG.E.ADD.S32.STRONG.GPU") == 1, k.name
    at = 0
    # (the wait for the reduce's writes: its DEPBAR then an L1 invalidate; the wait for its reads alone has none)
    for op in ("LDG.E.STRONG.GPU", "FENCE.VIEW.ASYNC.G", "UBLKRED.G.S.ADD.F32", "DEPBAR.LE SB0, 0x0", "CCTL.IVALL",
               "FENCE.VIEW.ASYNC.G", "MEMBAR.ALL.GPU", "REDG.E.ADD.S32.STRONG.GPU"):
        at = sass.index(op, at) + len(op)


def _kv_tile_ranges(seqlen_q: int, seqlen_k: int, bm: int, bn: int, right: int, left: int) -> dict[int, range]:
    """K/V tile -> the Q tiles its CTA adds dQ to, as bwd_main computes them (right/left: -1 unbounded)."""
    shift, m_blocks = seqlen_k - seqlen_q, -(-seqlen_q // bm)
    out = {}
    for n in range(-(-seqlen_k // bn)):
        m_begin = min(m_blocks, max(0, n * bn - shift - right) // bm) if right >= 0 else 0
        m_end = m_blocks
        if left >= 0:
            last = min(n * bn + bn, seqlen_k) - 1 - shift + left
            m_end = 0 if last < 0 else min(m_blocks, last // bm + 1)
        out[n] = range(m_begin, max(m_begin, m_end))
    return out


def _dq_turn(n: int, m: int, seqlen_q: int, seqlen_k: int, bm: int, bn: int, right: int, left: int, spt: bool) -> int:
    """dq_turn in templates/sm90/bwd/dq.cuh.j2."""
    shift = seqlen_k - seqlen_q
    if spt:
        last = -(-seqlen_k // bn) - 1
        return (min(last, ((m + 1) * bm - 1 + shift + right) // bn) if right >= 0 else last) - n
    return n - (max(0, m * bm + shift - left) // bn if left >= 0 else 0)


@pytest.mark.parametrize("bm,bn", [(64, 128), (64, 64), (128, 128), (128, 64)])
def test_sm90_deterministic_turns_are_an_order_no_ctas_wait_on_later_ones(bm, bn):
    """The deterministic backward's turns at each Q tile are 0 .. k-1 over the k K/V tiles that add to it (so the
    counter reaches every turn and the fp32 sums add in one fixed order). With a diagonal (causal, a window's right
    edge) the turns go from the last K/V tile down (SPT): a CTA waits only on higher K/V tiles, which the grid hands
    out first, and each of those reaches the Q tile no later in its upward walk, so none waits on a reduce still to
    be computed. Unequal lengths, partial tiles, windows with and without causal."""
    rng = np.random.default_rng(7)
    cases = [(1, 1), (17, 113), (113, 17), (1023, 1023), (4096, 4096), (300, 1500), (1500, 300)]
    cases += [tuple(int(x) for x in rng.integers(1, 3000, 2)) for _ in range(12)]
    for (sq, sk), (right, left, causal) in itertools.product(cases, [(0, -1, True), (0, 200, True), (-1, -1, False),
                                                                      (150, 90, False), (0, 0, True), (-1, 64, False)]):
        spt = causal or right >= 0 or left >= 0  # SPT = DETERMINISTIC && (IS_CAUSAL || WINDOW)
        ranges = _kv_tile_ranges(sq, sk, bm, bn, right, left)
        adders: dict[int, list[int]] = {}
        for n, ms in ranges.items():
            for m in ms:
                adders.setdefault(m, []).append(n)
        for m, ns in adders.items():
            turns = sorted(_dq_turn(n, m, sq, sk, bm, bn, right, left, spt) for n in ns)
            assert turns == list(range(len(ns))), (sq, sk, right, left, m, ns)
            assert ns == list(range(ns[0], ns[-1] + 1))
            if spt:
                for n in ns:  # the K/V tiles whose turns come first: higher n, first in the grid, no later at m
                    for before in ns:
                        if _dq_turn(before, m, sq, sk, bm, bn, right, left, spt) < _dq_turn(n, m, sq, sk, bm, bn, right, left, spt):
                            assert before > n
                            assert m - ranges[before].start <= m - ranges[n].start


def _block_index(x: int, grid: int, tiles: int, heads: int, last_first: bool, interleave: int) -> tuple[int, int, int]:
    """BlockIndex in templates/sm90/bwd/seq.cuh.j2."""
    if interleave > 1:
        first = x // (tiles * interleave) * interleave
        within = x - first * tiles
        width = min(interleave, grid // tiles - first)
        pair = first + within % width
        return within // width, pair % heads, pair // heads
    tile = tiles - 1 - x % tiles if last_first else x % tiles
    return tile, x // tiles % heads, x // tiles // heads


@pytest.mark.parametrize("tiles,heads,batch", [(8, 32, 16), (1, 3, 5), (7, 5, 3), (32, 4, 1), (3, 1, 17)])
def test_sm90_block_index_covers_the_grid_with_each_pairs_tiles_in_turn(tiles, heads, batch):
    """Every way the backward's main kernel reads its grid (x fastest, tiles counted down, interleaved over 8 (head,
    batch) pairs, the last group narrower) names every (tile, head, batch) once; a pair's tiles come in the order its
    turns need (up, or down when counted down), interleaved ones `width` blocks apart."""
    grid = tiles * heads * batch
    for last_first, interleave in ((False, 1), (True, 1), (False, 8)):
        seen = [_block_index(x, grid, tiles, heads, last_first, interleave) for x in range(grid)]
        assert sorted(seen) == sorted(itertools.product(range(tiles), range(heads), range(batch)))
        at = {coord: x for x, coord in enumerate(seen)}
        for h, b in itertools.product(range(heads), range(batch)):
            order = [at[t, h, b] for t in range(tiles)]
            assert order == sorted(order, reverse=last_first)
            if interleave > 1 and tiles > 1:
                gaps = {y - x for x, y in zip(order, order[1:])}
                assert len(gaps) == 1 and gaps <= set(range(1, interleave + 1)), gaps


def test_sm90_deterministic_with_a_diagonal_runs_shortest_first():
    """Deterministic with causal or a window, the main kernel counts each (batch, head)'s K/V tiles down from the
    last (BlockIndex's last_first) and dq_turn lets the last add first; the preprocess and convert kernels and the
    kernels without the switch keep the upward order. Every CTA walks its Q tiles upward. The kernels compile clean
    for sm_90a with their reduces ordered."""
    import re

    from conftest import compile_sm90a_clean

    det = default_bwd_config(128, "bf16", True, "sm90", True)
    src = render(det)
    assert "constexpr bool SPT = DETERMINISTIC && (IS_CAUSAL || WINDOW);" in src
    assert "min(last, ((m_block + 1) * BLOCK_M - 1 + shift + right) / BLOCK_N) : last) - n_block;" in src  # _dq_turn
    assert "constexpr bool DETERMINISTIC = true;" in src and "constexpr bool IS_CAUSAL = true;" in src
    for upward in (dataclasses.replace(det, causal=False), dataclasses.replace(det, deterministic=False)):
        assert re.search(r"constexpr bool (DETERMINISTIC|IS_CAUSAL) = false;", render(upward)), upward.name
    # _pre, both _convert forms (dQ and dQ^T) and the main kernel; only the main kernel's counts down
    assert src.count("BlockIndex bi(") == 4 and src.count(", p.heads, SPT, DET_INTERLEAVE);") == 1
    assert "constexpr int DET_INTERLEAVE = DETERMINISTIC && !SPT ? 8 : 1;" in src
    assert src.count("m_begin + it)") == 2 and "(m_begin + j)" in src  # the loads, the consumers, dq_add
    writer = src[src.index("void dq_writer("):]
    assert "dq_turn(P, n_block, m_begin + t, seqlen_k, shift)" in writer and "dst + (int64_t)t * BLOCK_M * HEAD_DIM" in writer

    # one consumer unstaggered (d96), two staggered (d128), KV_SPLIT (d256); the sweep compiles the other head dims
    cfgs = [default_bwd_config(hd, "bf16", True, "sm90", True) for hd in (96, 128, 256)]
    cfgs.append(dataclasses.replace(det, varlen=True, window=True))
    for k in compile_sm90a_clean(cfgs):
        _assert_ordered_reduces(k)
