"""The bytes a launch hands the driver, checked without a GPU: FwdParams and sm90's TMA maps."""
import ctypes

import pytest

import flashgen.driver as driver
from flashgen.config import KernelConfig
from flashgen.kernels.dense import _fix_alignment, sm90_params
from flashgen.launch import FwdParams, tmap_box_packed
from flashgen.tensors import Problem, View


def cai_view(ptr, shape, strides, name="q"):
    return View(None, "cai", ptr, shape, strides, "bf16", -1)


def test_fwd_params_matches_the_c_struct_layout():
    # struct FwdParams: 5 pointers, 12 int64 strides, 5 ints, 2 floats -> 164 bytes, padded to 168
    assert ctypes.sizeof(FwdParams) == 168
    assert FwdParams.q_batch_stride.offset == 40 and FwdParams.batch.offset == 136
    assert FwdParams.softmax_scale.offset == 156 and FwdParams.scale_log2.offset == 160


def test_sm90_params_put_three_tensor_maps_before_fwd_params(monkeypatch):
    calls = []

    def fake_tensor_map(dtype, ptr, dims, strides, box, swizzle):
        calls.append((dtype, ptr, dims, strides, box, swizzle))
        return bytes([len(calls)]) * 128

    monkeypatch.setattr(driver, "tensor_map", fake_tensor_map)
    b, sq, sk, h, hk, d = 2, 300, 500, 8, 2, 96
    q = cai_view(0x1000, (b, sq, h, d), (sq * h * d, h * d, d, 1))
    k = cai_view(0x2000, (b, sk, hk, d), (sk * hk * d, hk * d, d, 1))
    v = cai_view(0x3000, (b, sk, hk, d), (sk * hk * d, hk * d, d, 1))
    cfg = KernelConfig(96, "bf16", True, 128, 64, 12, 3, "sm90")
    p = FwdParams(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, *([8] * 12), b, h, hk, sq, sk, 0.1, 0.14)
    blob = bytes(sm90_params(p, q, k, v, Problem(b, sq, sk, h, hk, d, "bf16"), cfg))
    assert len(blob) % 128 == 0 and len(blob) >= 384 + ctypes.sizeof(FwdParams)
    assert blob[0:128] == b"\x01" * 128 and blob[128:256] == b"\x02" * 128 and blob[256:384] == b"\x03" * 128
    assert blob[384:384 + ctypes.sizeof(FwdParams)] == bytes(p)
    # q: (head_dim, seqlen_q, heads, batch), byte strides row/head/batch, box (smem_w, block_m); d=96 -> 64-byte rows
    assert calls[0] == ("bf16", 0x1000, (d, sq, h, b), (2 * h * d, 2 * d, 2 * sq * h * d), (32, 128, 1, 1), 64)
    assert calls[1][2:] == ((d, sk, hk, b), (2 * hk * d, 2 * d, 2 * sk * hk * d), (32, 64, 1, 1), 64)
    assert calls[2][1] == 0x3000


def test_misaligned_gpu_arrays_are_refused_before_launch():
    ok = cai_view(0x1000, (1, 4, 2, 64), (512, 128, 64, 1))
    assert _fix_alignment(ok, "q") is ok
    with pytest.raises(ValueError, match="q needs a 16-byte aligned base"):
        _fix_alignment(cai_view(0x1002, (1, 4, 2, 64), (512, 128, 64, 1)), "q")
    with pytest.raises(ValueError, match="k needs a 16-byte aligned base"):
        _fix_alignment(cai_view(0x1000, (1, 4, 2, 64), (516, 129, 64, 1)), "k")


@pytest.mark.parametrize("h,hk,block_m", [(8, 2, 128), (6, 2, 128), (4, 1, 64), (32, 8, 192), (12, 2, 64)])
def test_pack_gqa_q_map_boxes_hold_one_kv_heads_rows(monkeypatch, h, hk, block_m):
    """q's 5-d map of a pack_gqa kernel: walking a box as TMA lands it (dim 0 innermost) gives tile row r = head
    hk_i * group + r % group of position s0 + r / group, in q's own (batch, seqlen, heads, head_dim) layout."""
    calls = []
    monkeypatch.setattr(driver, "tensor_map", lambda *a: calls.append(a) or b"\0" * 128)
    b, sq, sk, d = 2, 77, 90, 128
    g = h // hk
    strides = (sq * h * d + 64, h * d + 8, d, 1)  # padded batch and row strides: the map must take q's own
    q = cai_view(0x1000, (b, sq, h, d), strides)
    k = cai_view(0x2000, (b, sk, hk, d), (sk * hk * d, hk * d, d, 1))
    cfg = KernelConfig(128, "bf16", True, block_m, 64, 4 * (1 + block_m // 64), 2, "sm90", pack_gqa=True)
    p = FwdParams(0x1000, 0x2000, 0x2000, 0x4000, 0x5000, *([8] * 12), b, h, hk, sq, sk, 0.1, 0.14)
    sm90_params(p, q, k, k, Problem(b, sq, sk, h, hk, d, "bf16"), cfg)
    dims, byte_strides, box = calls[0][2:5]
    assert (dims, byte_strides, box) == tmap_box_packed(strides, d, sq, h, hk, b, 2, 64, block_m)
    assert calls[1][2] == (d, sk, hk, b)  # k and v keep their 4-d maps
    pos = block_m // g
    assert dims == (d, g, hk, sq, b) and box == (64, g, 1, pos, 1) and pos * g <= block_m
    for kvh, s0, bb in ((0, 0, 0), (hk - 1, pos, 1)):
        for r in range(pos * g):
            i, s = r % g, s0 + r // g  # box coordinates (dim 1: i, dim 3: s); dim 0 walks head_dim
            byte = sum(c * st for c, st in zip((i, kvh, s, bb), byte_strides))
            want = 2 * (bb * strides[0] + s * strides[1] + (kvh * g + i) * strides[2])
            assert byte == want, (r, byte, want)


def test_pack_gqa_grid_runs_over_kv_heads():
    cfg = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", pack_gqa=True)
    assert cfg.grid(2, 8, 1023, heads_k=2) == (-(-1023 // 32) * 2 * 2, 1, 1)
    assert cfg.grid(2, 6, 113, heads_k=2) == (-(-113 // 42) * 2 * 2, 1, 1)  # group 3: 42 whole positions a tile
    with pytest.raises(ValueError, match="needs heads_k"):
        cfg.grid(2, 8, 1023)
    with pytest.raises(ValueError, match="does not fit a tile of 128 rows"):
        cfg.grid(1, 256, 10, heads_k=1)
    ps = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", persistent=True, pack_gqa=True)
    assert ps.grid(1, 8, 100, 132, heads_k=2) == (4 * 2, 1, 1)
