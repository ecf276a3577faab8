"""The bytes a launch hands the driver, checked without a GPU: FwdParams and sm90's TMA maps."""
import ctypes

import pytest

import flashgen.driver as driver
from flashgen.config import KernelConfig
from flashgen.launch import FwdParams, _fix_alignment, sm90_params
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
