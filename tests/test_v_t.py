"""v_t: the FP8 forward with V transposed ahead by the file's own _vt kernel and loaded as VT by TMA. Its rules, name,
tuning space and register split; what the host hands the two launches (VT's tensor map and address); the exported
header; and the kernels built clean, with the same wgmmas as the ones that transpose V themselves."""
import dataclasses
import struct

import pytest

import flashgen.driver as driver
from flashgen import abi
from flashgen.config import SM90_REGS, SM90_REGS_FP8, VT_KEYS, VT_THREADS, ConfigError, KernelConfig, space, vt_keys
from flashgen.kernels.dense import sm90_params, vt_geometry
from flashgen.launch import FwdParams
from flashgen.tensors import Problem, View

D256 = KernelConfig(256, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", persistent=True, out_dtype="bf16")


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


def test_where_it_is_refused():
    with pytest.raises(ConfigError, match="v_t.*FP8.*bf16"):
        dataclasses.replace(D256, v_t=True, dtype="bf16", out_dtype="")


def test_name_dict_registers_and_shared_memory():
    on = dataclasses.replace(D256, v_t=True)
    assert on.name == D256.name + "_vt" and KernelConfig.from_dict(on.to_dict()) == on
    assert "v_t" not in D256.to_dict() and on.to_dict()["v_t"] is True  # entries from before read as off
    assert on.kernel_names == {"vt": on.name + "_vt", "main": on.name}
    # no transposing producer warps: the 16-bit kernels' split, within the 168 x 384 registers the CTA starts with
    assert D256.register_split == SM90_REGS_FP8[2] and on.register_split == SM90_REGS[2]
    for producer, consumer in (D256.register_split, on.register_split):
        assert 128 * producer + 256 * consumer <= 168 * 384
    # the V ring and its two transposer barriers per stage are gone: one V tile a stage
    assert D256.smem_bytes - on.smem_bytes == D256.num_stages * (D256.block_n * D256.v_dim + 2 * 8)
    # FlashAttention-3's d256 FP8 tile, overlapped, fits only with the 240 registers
    ov = dataclasses.replace(D256, overlap=True)
    assert ov.unfit_reason("sm90") and dataclasses.replace(ov, v_t=True).unfit_reason("sm90") is None
    assert on.vt_w == 128 and dataclasses.replace(on, block_n=192).vt_w == 64


def test_space_adds_it_after_the_rest_for_fp8_only():
    for hd, causal in ((64, True), (128, False), (256, False)):
        sp = [c for c in space("sm90", hd, "fp8_e4m3", causal) if not c.pack_gqa]
        off = [c for c in sp if not c.v_t]
        on = sp[len(off):]  # after the rest: the order of the others stays
        assert on and all(c.v_t for c in on)
        twins, own = on[:len(off)], on[len(off):]
        assert [dataclasses.replace(c, v_t=False) for c in twins] == off
        # then v_t's own 224-key tiles, as the 192-key ones
        assert [dataclasses.replace(c, block_n=192) for c in own] == [c for c in twins if c.block_n == 192]
    assert not any(c.v_t or c.block_n == 224 for c in space("sm90", 128, "bf16", False))


def cai_view(ptr, shape, strides):
    return View(None, "cai", ptr, shape, strides, "fp8_e4m3", -1)


@pytest.mark.parametrize("sk, block_n", [(1023, 128), (17, 192), (4096, 256), (300, 224)])
def test_tm_v_maps_vt_and_the_params_carry_its_address(monkeypatch, sk, block_n):
    calls = []
    monkeypatch.setattr(driver, "tensor_map", lambda *a: calls.append(a) or b"\0" * 128)
    b, sq, h, hk, d = 2, 300, 8, 2, 128
    cfg = KernelConfig(d, "fp8_e4m3", True, 128, block_n, 12, 2, "sm90", out_dtype="bf16", v_t=True)
    q = cai_view(0x1000, (b, sq, h, d), (sq * h * d, h * d, d, 1))
    k = cai_view(0x2000, (b, sk, hk, d), (sk * hk * d, hk * d, d, 1))
    prob = Problem(b, sq, sk, h, hk, d, "fp8_e4m3")
    p = FwdParams(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, *([8] * 12), b, h, hk, sq, sk, 0.1, 0.14)
    vt = 0x7000
    tail = struct.Struct("=" + "Qqq" * 3 + "Q").pack(*([0x60, 0, 0] * 3), vt)  # as fp8.descale_bytes lays it out
    blob = sm90_params(p, q, k, k, prob, cfg, tail, vt)
    n = vt_keys(sk)
    assert n % 16 == 0 and n - sk < 16
    # q and k as ever; v's map is VT's: (keys, head dims, heads_k, batch) of the contiguous copy, a column block a box
    assert calls[0][1] == 0x1000 and calls[1][1] == 0x2000
    assert calls[2][1:] == (vt, (n, d, hk, b), (n, n * d, n * d * hk), (cfg.vt_w, d, 1, 1), cfg.vt_w)
    assert calls[2][1:] == (vt, *vt_geometry(prob, cfg))
    assert block_n % cfg.vt_w == 0
    at = abi.SM90_FP8_FWD.offset("vt")
    assert len(blob) == abi.SM90_FP8_FWD.size and struct.unpack_from("=Q", blob, at)[0] == vt
    assert cfg.vt_grid(b, hk, sk) == -(-n // VT_KEYS) * hk * b


def test_vt_is_last_and_keeps_the_struct_as_it_was():
    """vt sits in the tail padding of the 128-byte aligned struct: every other field's offset and the size are those
    of the struct without it, so the kernels that never read it are unchanged."""
    fmt = abi.SM90_FP8_FWD
    before = abi.Block(fmt.name, fmt.guard, fmt.doc, fmt.lines[:-1])
    assert fmt.lines[-1].names == ("vt",) and fmt.size == before.size
    assert [(f.path, f.offset) for f in fmt.fields[:-1]] == [(f.path, f.offset) for f in before.fields]
    assert fmt.offset("vt") == fmt.offset("v_descale.head_stride") + 8


def test_export_header_launches_the_transpose_first(tmp_path):
    from flashgen.export import header

    cfg = dataclasses.replace(D256, v_t=True)
    h = header(cfg, [], "sm_90a")
    vt_launch, main_launch = h.index(f"::{cfg.name}_vt<<<"), h.index(f"::{cfg.name}<<<")
    assert vt_launch < main_launch and f"VT_THREADS = {VT_THREADS}" in h and "tm_v maps p.vt" in h
    assert f"{cfg.name}_vt" not in header(D256, [], "sm_90a")


@pytest.mark.sweep
def test_it_builds_clean_with_the_same_wgmmas():
    """The stored d256 and d128 FP8 tiles (in order, persistent, with and without the row sums), 64-key column blocks
    with ping-pong, three warpgroups, pack_gqa: no spills or wgmma serialization, the same wgmma and WARPGROUP.ARRIVE
    counts as the kernels that transpose V themselves; and the tiles only v_t fits: the overlapped d256 tile, alone and
    with ping-pong, and the d128 128 x 224 tile. The _vt kernel builds without spills."""
    from conftest import assert_same_wgmmas, compile_sm90a_clean

    base = [D256, KernelConfig(128, "fp8_e4m3", False, 128, 256, 12, 2, "sm90", persistent=True, mma_rowsum=True),
            KernelConfig(128, "fp8_e4m3", True, 128, 64, 12, 2, "sm90", True, True, True, lazy_rescale=True),
            KernelConfig(64, "fp8_e4m3", False, 192, 128, 16, 2, "sm90", persistent=True, mma_rowsum=True),
            KernelConfig(128, "fp8_e4m3", True, 128, 128, 12, 2, "sm90", True, pack_gqa=True)]
    # (24 bytes spilled without desc_step), and with ping-pong too: FlashAttention-3's FP8 d256 schedule
    extra = [dataclasses.replace(D256, overlap=True, v_t=True, desc_step=True),
             dataclasses.replace(D256, overlap=True, pingpong=True, v_t=True, desc_step=True),
             # FlashAttention-3's d128 FP8 tile, 128 x 224 (VT in boxes of 32 keys), overlapped with ping-pong
             KernelConfig(128, "fp8_e4m3", False, 128, 224, 12, 2, "sm90", True, True, True, v_t=True, desc_step=True)]
    kernels = compile_sm90a_clean(base + [dataclasses.replace(c, v_t=True) for c in base] + extra)
    for k in kernels[len(base):]:
        assert f"Compiling entry function '{k.name}_vt'" in k.ptxas_log
    assert_same_wgmmas(kernels[:len(base)], kernels[len(base):2 * len(base)])
