"""Bad input raises a clear error before anything is launched (no GPU needed)."""
import pytest

import flashgen


class FakeGpuArray:
    """Just enough of __cuda_array_interface__ to reach input checking."""

    def __init__(self, shape, typestr="<f2", strides=None, ptr=1 << 20):
        self.shape = shape
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


def arr(*shape, **kw):
    return FakeGpuArray(shape, **kw)


@pytest.mark.parametrize("q,k,v,err,match", [
    (arr(2, 16, 4), arr(2, 16, 4, 64), arr(2, 16, 4, 64), ValueError, "q must have 4 dims"),
    (arr(2, 16, 4, 64), arr(2, 16, 4, 64), arr(2, 17, 4, 64), ValueError, "k and v must have the same shape"),
    (arr(2, 16, 4, 64), arr(3, 16, 4, 64), arr(3, 16, 4, 64), ValueError, "batch differs"),
    (arr(2, 16, 4, 64), arr(2, 16, 4, 128), arr(2, 16, 4, 128), ValueError, "head_dim differs"),
    (arr(2, 16, 4, 80), arr(2, 16, 4, 80), arr(2, 16, 4, 80), ValueError,
     "head_dim=80 has no kernel of its own .* run it padded for torch tensors"),
    (arr(2, 16, 4, 12), arr(2, 16, 4, 12), arr(2, 16, 4, 12), ValueError,
     "head_dim=12 is not supported: a head dim must be a multiple of 8 from 8 to 256"),
    (arr(2, 16, 6, 64), arr(2, 16, 4, 64), arr(2, 16, 4, 64), ValueError, "multiple of heads"),
    (arr(2, 16, 4, 64, typestr="<f4"), arr(2, 16, 4, 64), arr(2, 16, 4, 64), TypeError, "dtype"),
    (arr(2, 16, 4, 64, strides=(16384, 1024, 256, 4)), arr(2, 16, 4, 64), arr(2, 16, 4, 64), ValueError,
     "contiguous in its last dim"),
    ([[1.0]], arr(2, 16, 4, 64), arr(2, 16, 4, 64), TypeError, "q is a list"),
])
def test_bad_input(q, k, v, err, match):
    with pytest.raises(err, match=match):
        flashgen.attention(q, k, v)


def test_mixed_dtypes_rejected():
    import numpy as np

    class Bf16(FakeGpuArray):
        dtype = "bfloat16"

    with pytest.raises(TypeError, match="share one dtype"):
        flashgen.attention(arr(1, 8, 2, 64), Bf16((1, 8, 2, 64), typestr="<V2"), arr(1, 8, 2, 64))
    assert np  # numpy is a core dependency


def test_load_compiles_without_a_gpu_and_checks_families():
    k = flashgen.load(64, "bf16", True, gpu_arch="sm90", arch="sm90")
    assert k.config.family == "sm90" and k.compiled.target == "sm_90a"
    assert flashgen.load(64, "bf16", True, gpu_arch="sm80").config.family == "sm80"
    with pytest.raises(ValueError, match="needs an sm90 GPU"):
        flashgen.load(64, "bf16", True, gpu_arch="sm80", arch="sm90")
    with pytest.raises(ValueError, match="arch='sm75' is not a template family"):
        flashgen.load(64, "bf16", True, gpu_arch="sm80", arch="sm75")


def test_load_checks_config_matches_problem():
    cfg = flashgen.default_config(64, "fp16", False, "sm80")
    with pytest.raises(ValueError, match="does not match"):
        flashgen.load(128, "fp16", False, config=cfg, gpu_arch="sm80")
    big = flashgen.KernelConfig(256, "bf16", False, 128, 64, 8, 2)
    with pytest.raises(ValueError, match="cannot run on sm86"):
        flashgen.load(256, "bf16", False, config=big, gpu_arch="sm86")


@pytest.mark.parametrize("call", ["attention", "attention_varlen", "attention_with_kvcache"])
def test_flags_of_the_wrong_type_are_refused_first(call):
    """softmax_scale="0.1" or causal="yes" is refused by name before any tensor is looked at."""
    import flashgen

    fn = getattr(flashgen, call)
    args = (None,) * (7 if call == "attention_varlen" else 3)
    with pytest.raises(TypeError, match=r"causal must be a bool, not str \('yes'\)"):
        fn(*args, causal="yes")
    with pytest.raises(TypeError, match=r"softmax_scale must be a number or None, not str \('0.1'\)"):
        fn(*args, softmax_scale="0.1")
