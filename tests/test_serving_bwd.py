"""The serving features' backward without a GPU: configuration rules and names, rendering and
compiling (sm_80 and sm_90a, the host's struct size checked by the kernel's static_assert), the
parameter bytes, the feature check before launch, and the autograd wiring through the operators
(FakeTensorMode: shapes only)."""
from __future__ import annotations

import dataclasses
import re
import struct

import pytest

from flashgen.compile import compile_kernel
from flashgen.config import BWD_FEATURES, BwdConfig, ConfigError, default_bwd_config, mod_features
from flashgen.render import render


def test_features_name_the_backward_and_dense_names_stay():
    dense = BwdConfig(128, "bf16", True, 64, 32, 8)
    assert dense.name == "bwd_sm80_d128_bf16_causal_bm64_bn32_w8_det0" and not dense.serving
    cfg = dataclasses.replace(dense, varlen=True, window=True, softcap=True, alibi=True)
    assert cfg.name == dense.name + "_vl_win_sc_al" and cfg.features == BWD_FEATURES
    assert BwdConfig.from_dict(cfg.to_dict()) == cfg
    assert f"{cfg.name}(const __grid_constant__ BwdServeParams p)" in render(cfg)
    assert "BwdServeParams" not in render(dense)


def test_sm90_backward_has_varlen_and_window_only():
    cfg = BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=3, stagger=True, varlen=True, window=True)
    assert cfg.name == "bwd_sm90_d128_bf16_causal_bm64_bn128_w12_s3_st1_vl_win"
    for f in ("softcap", "alibi"):
        with pytest.raises(ConfigError, match="family sm80"):
            BwdConfig(128, "bf16", False, 64, 128, 12, family="sm90", num_stages=2, **{f: True})


@pytest.mark.parametrize("features", [dict(varlen=True), dict(varlen=True, window=True), dict(window=True)],
                         ids=["varlen", "varlen-window", "window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_serving_backward_compiles_without_spills(head_dim, features, tmp_path, monkeypatch):
    """Each default sm90 backward with the features: no spill, none of ptxas's wgmma advisories (serialized wgmma)."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    cfg = dataclasses.replace(default_bwd_config(head_dim, "bf16", True, "sm90"), **features)
    assert cfg.family == "sm90"
    k = compile_kernel(cfg, "sm_90a")
    assert not k.resources.spills, f"{cfg.name}: {k.resources}"
    assert not re.search(r"C751[239]", k.ptxas_log), f"{cfg.name}: {k.ptxas_log}"


def test_window_feature_only_where_it_bounds_more_than_causal():
    assert mod_features((-1, 0), 0.0, False, True) == {"window": False, "softcap": False, "alibi": False}
    assert mod_features((-1, 0), 0.0, False, False)["window"]
    assert mod_features((8, -1), 0.0, False, True)["window"]
    assert mod_features((-1, -1), 5.0, True, False) == {"window": False, "softcap": True, "alibi": True}


@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("features", [dict(varlen=True), dict(varlen=True, window=True, softcap=True, alibi=True),
                                      dict(window=True, alibi=True)], ids=["varlen", "all", "dense-mods"])
def test_serving_backward_compiles(target, deterministic, features, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    base = default_bwd_config(64, "bf16", True, "sm80", deterministic, family="sm80")
    cfg = dataclasses.replace(base, **features)
    res = compile_kernel(cfg, target).resources  # the kernel's static_assert pins sizeof(BwdServeParams) == 384
    assert res.registers > 0


def test_serve_params_bytes_follow_the_struct():
    torch = pytest.importorskip("torch")
    from flashgen.kernels.backward import _BWD, ServeArgs, _kernel_grid, _serve_params
    from flashgen.tensors import Problem

    cfg = BwdConfig(64, "bf16", True, 64, 64, 8, varlen=True, softcap=True, alibi=True)
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9], dtype=torch.int32)
    slopes = torch.ones(2, 4)
    serve = ServeArgs(cu_q, cu_k, 7, 5, (-1, 0), 20.0, slopes)
    prob = Problem(1, 10, 9, 4, 2, 64, "bf16")
    grid = _kernel_grid(cfg, prob, serve)
    raw = _serve_params(cfg, prob, (0,) * 13, (0,) * 24, None, serve, grid)
    assert len(raw) == 384 and grid == (2, 7, 5)
    tail = struct.unpack("=3Qq2if3i", raw[_BWD.size:])
    assert tail[:4] == (cu_q.data_ptr(), cu_k.data_ptr(), slopes.data_ptr(), 4)
    assert tail[4:6] == (-1, 0) and tail[6] == pytest.approx(0.125 / 20.0) and tail[7:] == (2, 7, 5)
    scale_log2 = struct.unpack_from("=2f", raw, _BWD.size - 12)[1]
    assert scale_log2 == pytest.approx(20.0 * 1.4426950408889634)  # softcap: the exponent's factor


def test_backward_refuses_a_kernel_without_the_calls_features(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    from flashgen.kernels.backward import ServeArgs, backward

    kern = compile_kernel(BwdConfig(64, "bf16", False, 64, 64, 8), "sm_80")
    with pytest.raises(ValueError, match="features"):
        backward(kern, None, None, None, None, None, None, serve=ServeArgs(softcap=2.0))


def test_autograd_wiring_of_varlen_and_dense_modifiers():
    """attention_varlen and attention(..., softcap/window/alibi) with inputs that require grad go through their
    operators, whose backward is flashgen::attention_serve_backward (fake implementations: shapes only)."""
    torch = pytest.importorskip("torch")
    import flashgen

    meta = dict(dtype=torch.bfloat16, device="meta", requires_grad=True)
    q, k = torch.empty(30, 8, 64, **meta), torch.empty(40, 2, 64, **meta)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = flashgen.attention_varlen(q, k, k, cu_q, cu_q, 20, 25, causal=True, window_size=(16, -1),
                                         return_lse=True, validate=False)
    assert out.shape == q.shape and lse.shape == (8, 30) and out.grad_fn is not None
    (out.float().sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    qd, kd = torch.empty(2, 17, 8, 64, **meta), torch.empty(2, 33, 2, 64, **meta)
    out = flashgen.attention(qd, kd, kd, softcap=30.0, alibi_slopes=torch.empty(8, device="meta"))
    assert out.shape == qd.shape and out.grad_fn is not None
    out.float().sum().backward()
    assert qd.grad.shape == qd.shape and kd.grad.shape == kd.shape


def test_dense_modifier_arguments_are_checked():
    torch = pytest.importorskip("torch")
    import flashgen

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="family sm80"):
        flashgen.attention(q, q, q, softcap=5.0, arch="sm90")
    with pytest.raises(TypeError, match="torch tensors"):
        flashgen.attention(object(), q, q, window_size=(4, 4))
    with pytest.raises(ValueError, match="cpu"):  # checked before any launch
        flashgen.attention(q, q, q, window_size=(4, 4))
