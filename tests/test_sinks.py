"""Attention sinks without a GPU: the feature's configuration, name, rendering and compilation, the host's checks,
and the backward's rule (the sink's gradient from LSE and D; dq, dk, dv from the usual formulas once the LSE holds
the sink) against torch autograd of a float64 reference."""
import math

import pytest
import torch

from flashgen import abi
from flashgen.checks import check_sinks
from flashgen.compile import compile_kernel
from flashgen.config import ConfigError, KernelConfig, mod_features
from flashgen.kernels.serving import call_features, decode_config, has_mods, serve_config
from flashgen.checks import Mods
from flashgen.ops import sinks_grad
from flashgen.render import render

from conftest import compile_sm90a_clean


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


# -- a float64 reference (gpt-oss's: the sink is one more column of the scaled scores, dropped after the softmax) --

def reference(q, k, v, sinks, scale, causal=False, window=(-1, -1)):
    """(out, lse) of dense (batch, seqlen, heads, d) tensors: softmax over [scores, sink], the sink's column dropped.
    A row without keys: out 0, lse = sink."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    s = s.masked_fill(~keep, -math.inf)
    col = sinks.view(1, h, 1, 1).expand(b, h, sq, 1).to(s.dtype)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)  # (b, h, sq)
    p = torch.exp(full - lse[..., None])[..., :-1]
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def _inputs(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, sk, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, sk, hk, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2
    return q, k, v, sinks


def test_reference_matches_the_sink_definition():
    # out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink}); LSE includes the sink; no key: out 0, LSE = sink.
    q, k, v, sinks = _inputs(1, 3, 5, 2, 2, 4)
    out, lse = reference(q, k, v, sinks, 0.5)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.5
    den = torch.exp(s).sum(-1) + torch.exp(sinks).view(1, 2, 1)
    torch.testing.assert_close(out, torch.einsum("bhij,bjhd->bihd", torch.exp(s) / den[..., None], v))
    torch.testing.assert_close(lse, torch.log(den))
    out, lse = reference(q, k[:, :1], v[:, :1], sinks, 0.5, causal=True)  # rows 0 and 1 see no key
    assert torch.all(out[:, :2] == 0)
    torch.testing.assert_close(lse[0, :, :2], sinks.view(2, 1).expand(2, 2))


@pytest.mark.parametrize("causal,window,shape", [
    (False, (-1, -1), (2, 7, 11, 4, 2)),
    (True, (-1, -1), (1, 9, 5, 2, 1)),      # more queries than keys: rows without keys
    (False, (2, 1), (2, 6, 13, 4, 4)),
    (True, (3, -1), (1, 17, 17, 3, 1)),
])
def test_sink_gradient_and_the_usual_backward_match_autograd(causal, window, shape):
    b, sq, sk, h, hk = shape
    d = 8
    q, k, v, sinks = _inputs(b, sq, sk, h, hk, d, seed=sq)
    for t in (q, k, v, sinks):
        t.requires_grad_(True)
    scale = d ** -0.5
    out, lse = reference(q, k, v, sinks, scale, causal, window)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    for with_dlse in (False, True):
        loss = (out * dout).sum() + ((lse * dlse).sum() if with_dlse else 0)
        dq, dk, dv, dsink = torch.autograd.grad(loss, (q, k, v, sinks), retain_graph=True)
        # the host's rule, from the forward's out and LSE alone
        got = sinks_grad(sinks.detach(), out.detach(), dout, lse.detach(), dlse if with_dlse else None)
        torch.testing.assert_close(got, dsink, rtol=1e-10, atol=1e-12)
        # the backward kernels' formulas, unchanged, with the LSE that holds the sink
        rq, rk, rv = _usual_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout,
                                     dlse if with_dlse else None, scale, causal, window)
        torch.testing.assert_close(rq, dq, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(rk, dk, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(rv, dv, rtol=1e-10, atol=1e-12)


def _usual_backward(q, k, v, out, lse, dout, dlse, scale, causal, window):
    """FlashAttention's backward: P = exp(S - LSE), D = rowsum(dO * O) (- dLSE), dS = P (dP - D)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    ke, ve = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, ke) * scale
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window
    right = 0 if causal else right
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    p = torch.exp(s.masked_fill(~keep, -math.inf) - lse[..., None])
    dD = (dout * out).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        dD = dD - dlse
    dp = torch.einsum("bihd,bjhd->bhij", dout, ve)
    ds = p * (dp - dD[..., None])
    dq = torch.einsum("bhij,bjhd->bihd", ds, ke) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, q) * scale
    dv = torch.einsum("bhij,bihd->bjhd", p, dout)
    fold = lambda t: t.view(b, sk, hk, group, d).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def test_sink_gradient_of_the_varlen_layout():
    # varlen: out (total, heads, d), lse (heads, total): the same rule over the packed rows.
    q, k, v, sinks = _inputs(1, 10, 10, 3, 3, 4, seed=5)
    out, lse = reference(q, k, v, sinks, 0.5, causal=True)
    dout = torch.randn(out.shape, dtype=torch.float64)
    packed = sinks_grad(sinks, out[0], dout[0], lse[0], None)
    torch.testing.assert_close(packed, sinks_grad(sinks, out, dout, lse, None))


def test_sink_gradient_keeps_the_sinks_dtype_and_sums_in_fp32():
    sinks = torch.zeros(2, dtype=torch.bfloat16)
    out = torch.ones(1, 4096, 2, 8, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 4096)  # p_sink = 1 on every row
    got = sinks_grad(sinks, out, out, lse, None)
    assert got.dtype == torch.bfloat16
    assert torch.all(got == -8 * 4096)  # a bf16 running sum would stall far below


# -- configuration, name, rendering --------------------------------------------------------------------------

def test_sinks_is_a_serving_feature_with_its_own_name():
    plain = KernelConfig(128, "bf16", True, 128, 64, 8, 2)
    cfg = KernelConfig(128, "bf16", True, 128, 64, 8, 2, sinks=True)
    assert cfg.name == plain.name + "_snk" and cfg.features == ("sinks",) and cfg.serving
    both = KernelConfig(64, "fp16", False, 128, 64, 4, 2, varlen=True, window=True, sinks=True)
    assert both.name.endswith("_vl_win_snk")
    with pytest.raises(ConfigError, match="sinks"):
        KernelConfig(128, "bf16", True, 128, 64, 8, 2, sinks=1)


def test_features_of_a_call():
    assert mod_features((-1, -1), 0.0, False, False) == {"window": False, "softcap": False, "alibi": False}
    assert mod_features((-1, -1), 0.0, False, True, True)["sinks"]
    assert has_mods((-1, -1), 0.0, None, False, torch.zeros(2)) and not has_mods((-1, -1), 0.0, None, False)
    assert call_features(Mods(sinks=torch.zeros(2)), True) == {"window": False, "softcap": False, "alibi": False,
                                                              "sinks": True}


def test_the_sink_pointer_comes_after_the_older_fields():
    # kernels without sinks read every other field where they did (only the fused combine's counters follow it)
    assert abi.SERVE.fields[-2].path == "sinks" and abi.SM90_SERVE_FWD.fields[-1].path == "sinks"
    assert abi.SERVE.offset("error") == 296 and abi.SM90_SERVE_FWD.offset("error") == 584


def test_render_switches_the_fold_on_only_with_the_feature():
    on = render(serve_config(64, "bf16", False, 1000, "sm80", sinks=True))
    off = render(serve_config(64, "bf16", False, 1000, "sm80", softcap=True))
    assert "constexpr bool SINKS = true;" in on and "constexpr bool SINKS = false;" in off
    assert "fold_sink(" in on


@pytest.mark.parametrize("cfg", [
    serve_config(128, "bf16", True, 1000, "sm80", sinks=True),
    serve_config(64, "fp16", False, 1000, "sm80", varlen=True, window=True, sinks=True),
    serve_config(256, "bf16", False, 1000, "sm80", window=True, softcap=True, sinks=True),
    KernelConfig(**{**decode_config(128, "bf16", (32, 64, 2, 3), True, True).to_dict(), "sinks": True}),
    KernelConfig(**{**decode_config(64, "fp16", (32, 128, 2, 3), False, True).to_dict(), "sinks": True}),
], ids=lambda c: c.name)
def test_sm80_sink_kernels_compile_without_spills(cfg):
    for target in ("sm_80", "sm_90"):
        r = compile_kernel(cfg, target).resources
        assert 0 < r.registers <= 255 and not r.spills and r.stack_bytes == 0, (cfg.name, target, r)


def test_sm90_family_has_sinks_in_its_serving_forward():
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", sinks=True)
    assert cfg.serving and cfg.name.endswith("_snk")
    src = render(cfg)
    assert "inline constexpr bool SINKS = true;" in src and "struct Sm90ServeFwdParams" in src
    assert "inline constexpr bool SINKS = false;" in render(KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90",
                                                                         window=True))
    with pytest.raises(ConfigError, match="16-bit"):
        KernelConfig(128, "fp8_e4m3", True, 128, 128, 12, 2, "sm90", sinks=True)


def test_sm90_sink_kernels_compile_clean():
    # each epilogue the sink joins: the plain kernel's (O staged through Q's buffer), the persistent one's (from
    # registers) and the overlapped epilogue's (under the next tile's first wgmma: branch-free)
    compile_sm90a_clean([
        KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", varlen=True, window=True, sinks=True),
        KernelConfig(64, "fp16", False, 128, 128, 12, 2, "sm90", overlap=True, persistent=True,
                     overlap_epilogue=True, sinks=True),
        KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", overlap=True, persistent=True, window=True,
                     sinks=True),
    ])


def test_a_tuned_prefill_tile_serves_calls_with_sinks():
    # the stored varlen / window tiles match a call with sinks too (its key loop is theirs); the sink is added after
    import flashgen.tune_varlen as tv
    from flashgen import resolve

    a = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", varlen=True)
    p = tv.VarlenProblem(128, "bf16", True, 16, 16, True, 64, 64, 8192, -1, "NVIDIA H200", "sm90")
    e = {"problem": p.to_dict(), "config": a.to_dict(), "kernel": a.name, "median_ms": 1.0, "tflops": 1.0}
    got = resolve.prefill_entry([e], 128, "bf16", True, {"varlen": True, "sinks": True}, p.max_len, -1)
    assert got is not None and got["kernel"] == a.name
    assert resolve.prefill_entry([e], 128, "bf16", True, {"varlen": True, "softcap": True}, p.max_len, -1) is None


# -- host checks ----------------------------------------------------------------------------------------------

def test_check_sinks_refuses_bad_tensors():
    q = torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16)
    assert check_sinks(None, 3, q) is None
    ok = torch.zeros(3)
    assert check_sinks(ok, 3, q) is ok and check_sinks(ok.bfloat16(), 3, q) is not None
    with pytest.raises(TypeError, match="learnable_sink must be a torch tensor"):
        check_sinks([0.0, 0.0, 0.0], 3, q)
    with pytest.raises(TypeError, match="torch.float32 or q's dtype"):
        check_sinks(torch.zeros(3, dtype=torch.float16), 3, q)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        check_sinks(torch.zeros(1, 3), 3, q)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        check_sinks(torch.zeros(2), 3, q)
    with pytest.raises(ValueError, match="q's device"):
        check_sinks(torch.zeros(3, device="meta"), 3, q)


def test_public_calls_check_the_sinks_before_any_launch():
    import flashgen

    meta = dict(device="meta")  # shapes only: the checks run, nothing launches
    q = torch.zeros(1, 4, 4, 64, dtype=torch.float16, **meta)
    k = torch.zeros(1, 8, 2, 64, dtype=torch.float16, **meta)
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        flashgen.attention(q, k, k, learnable_sink=torch.zeros(2, **meta))
    with pytest.raises(TypeError, match="learnable_sink must be torch.float32"):
        flashgen.attention(q, k, k, causal=True, learnable_sink=torch.zeros(4, dtype=torch.float64, **meta))
    with pytest.raises(ValueError, match="q's device"):
        flashgen.attention(q, k, k, learnable_sink=torch.zeros(4))
    with pytest.raises(ValueError, match="built in family sm80"):
        flashgen.attention(q, k, k, arch="sm90", learnable_sink=torch.zeros(4, **meta))
    with pytest.raises(ValueError, match="does not combine with score_mod"):
        flashgen.attention(q, k, k, score_mod=lambda s, b, h, i, j: s, learnable_sink=torch.zeros(4, **meta))
    cu = torch.tensor([0, 4], dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        flashgen.attention_varlen(q[0], k[0], k[0], cu, cu, 4, 8, learnable_sink=torch.zeros(3, **meta))
    # traced (meta): the operators' fake implementations give the shapes, the sink's gradient included
    sinks = torch.zeros(4, **meta).requires_grad_()
    out, lse = flashgen.attention(q, k, k, causal=True, return_lse=True, learnable_sink=sinks)
    assert out.shape == q.shape and lse.shape == (1, 4, 4) and out.requires_grad
