"""Head dims without a kernel of their own (flashgen.head_dims), without a GPU: which built head dim serves each
call, the checks, and the public calls' padding: the kernels see only built head dims of one width, the default
scale is the caller's, and the result is exact (a float64 stand-in for the kernel on CPU tensors). The dense-only
head dims (160, 192): their configurations, spill-free builds, the family it takes untuned, and its sm90 backward padding."""
from __future__ import annotations

import itertools
import math

import pytest

from flashgen import head_dims
from flashgen.checks import check_head_dims
from flashgen.compile import target_for
from flashgen.config import (DENSE_HEAD_DIMS, HEAD_DIMS, BwdConfig, ConfigError, KernelConfig, default_bwd_config,
                             default_config)
from flashgen.resolve import choose_config, load

from builds import assert_builds_without_spills
from conftest import compile_sm90a_clean

torch = pytest.importorskip("torch")

from flashgen import api, ops  # noqa: E402
from test_gpu_head_dims import split_width_configs  # noqa: E402
from flashgen.verify import attention_grads, attention_torch  # noqa: E402

EVERY = range(8, 257, 8)


@pytest.mark.parametrize("dense, built, want", [
    (False, HEAD_DIMS, [32, 32, 64, 96, 96, 128, 128, 256, 256, 256, 256, 256]),
    (True, DENSE_HEAD_DIMS, [32, 32, 64, 96, 96, 128, 128, 160, 192, 256, 256, 256]),
])
def test_every_multiple_of_8_is_served_by_the_smallest_built_head_dim_that_holds_it(dense, built, want):
    assert head_dims.built(dense) == built
    got = {d: head_dims.kernel_head_dim(d, dense=dense) for d in EVERY}
    assert got == {d: min(k for k in built if k >= d) for d in EVERY}
    assert [got[d] for d in (8, 32, 40, 72, 80, 112, 128, 160, 192, 200, 248, 256)] == want
    assert all(head_dims.native(d, dense=dense) == (got[d] == d) for d in EVERY)


@pytest.mark.parametrize("d_qk, d_v, want, dense_want", [
    (192, 128, 256, 192), (128, 192, 256, 192), (128, 64, 128, 128), (64, 128, 128, 128), (8, 256, 256, 256),
    (96, 96, 96, 96), (40, 32, 64, 64), (176, 176, 256, 192), (144, 136, 256, 160), (160, 128, 256, 160)])
def test_q_k_and_v_of_different_widths_take_the_head_dim_that_holds_both(d_qk, d_v, want, dense_want):
    assert head_dims.kernel_head_dim(d_qk, d_v) == want
    assert head_dims.kernel_head_dim(d_qk, d_v, dense=True) == dense_want
    assert not head_dims.native(d_qk, d_v) or d_qk == d_v == want
    assert head_dims.padded_fraction(d_qk, d_v) == pytest.approx(2 * want / (d_qk + d_v))


def test_the_sm90_backward_pads_the_dense_only_head_dims_to_its_next():
    for d in (160, 192):
        assert head_dims.backward_head_dim(d, sm90_family=True) == 256
        assert head_dims.backward_head_dim(d, sm90_family=False) == d
    assert all(head_dims.backward_head_dim(d, sm90_family) == d for d in HEAD_DIMS for sm90_family in (False, True))


# -- the dense-only head dims: configurations and builds ----------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: KernelConfig(192, "bf16", False, 128, 32, 8, 2, varlen=True),
    lambda: KernelConfig(192, "bf16", False, 32, 32, 2, 3, varlen=True, paged=True, split=True, pack_gqa=True),
    lambda: KernelConfig(192, "bf16", True, 128, 32, 8, 2, softcap=True),
    lambda: BwdConfig(192, "bf16", False, 64, 32, 8, varlen=True),
    lambda: BwdConfig(192, "bf16", False, 64, 32, 8, window=True),
])
def test_dense_only_head_dims_refuse_serving_features(make):
    with pytest.raises(ConfigError, match="head_dim=192 is built for the dense (forward|backward) only"):
        make()


def test_dense_only_head_dims_have_no_fp8_or_sm90_backward():
    with pytest.raises(ConfigError, match="head_dim=192 is not built for fp8_e4m3"):
        KernelConfig(192, "fp8_e4m3", False, 128, 128, 12, 2, "sm90")
    with pytest.raises(ConfigError, match="head_dim=192 is not allowed"):
        BwdConfig(192, "bf16", False, 64, 64, 12, family="sm90", num_stages=2)
    assert default_bwd_config(192, "bf16", False, "sm90").family == "sm80"


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_dense_only_head_dims_build_without_spills(family):
    """Each default configuration at a dense-only head dim (forward, and the sm80 backward with and without
    deterministic) on each arch the family runs on (default_config raises where none fits), one mask and dtype (the
    tiles' registers do not depend on them), for sm_80 and sm_90a (where no wgmma may be serialized either)."""
    archs = ("sm90",) if family == "sm90" else ("sm80", "sm86", "sm89", "sm90")
    cfgs = set()
    for d, arch in itertools.product(sorted(set(DENSE_HEAD_DIMS) - set(HEAD_DIMS)), archs):
        cfgs.add(default_config(d, "bf16", True, arch, family))
        if family == "sm80":
            cfgs |= {default_bwd_config(d, "bf16", True, arch, deterministic, "sm80") for deterministic in (False, True)}
    if family == "sm90":  # and no serialized wgmma either
        compile_sm90a_clean(sorted(cfgs, key=lambda c: c.name))
    else:
        assert_builds_without_spills(sorted(cfgs, key=lambda c: c.name), target_for(archs[0], family))


@pytest.mark.filterwarnings("ignore:no tuned")
@pytest.mark.parametrize("arch, gpu, family", [("sm90", "NVIDIA H200", "sm90"), ("sm80", "NVIDIA A100", "sm80")])
def test_an_untuned_dense_only_head_dim_takes_the_gpus_own_family(tmp_path, arch, gpu, family):
    """Nothing is stored at 192: on Hopper the sm90 family (which the store picks wherever it holds both), else
    sm80; the stored head dims keep the store's choice and, untuned, sm80's default."""
    assert choose_config(192, "bf16", True, arch, 4096, None, tmp_path, (gpu, arch)).family == family
    assert choose_config(128, "bf16", True, arch, 4096, None, tmp_path, (gpu, arch)).family == "sm80"


@pytest.mark.parametrize("d", [0, 4, 12, 100, 257, 264, 512, -8, 8.0])
def test_other_head_dims_are_refused_naming_what_is_supported(d):
    assert not head_dims.supported(d)
    with pytest.raises(ValueError, match=rf"head_dim={d} is not supported: a head dim must be a multiple of 8 from 8 "
                                         rf"to 256 \(built natively: 32, 64, 96, 128, 256, and 160, 192 for the dense "
                                         rf"forward and backward"):
        head_dims.kernel_head_dim(d)
    with pytest.raises(ValueError, match=rf"v's head_dim={d} is not supported"):
        head_dims.kernel_head_dim(64, d)


def test_the_default_scale_is_the_callers_head_dim():
    assert head_dims.default_scale(72) == 1 / math.sqrt(72)


@pytest.mark.parametrize("shapes, match", [
    (((2, 8, 4, 72), (2, 8, 4, 64), (2, 8, 4, 72)), r"q and k must share head_dim; got 72 and 64 \(v may differ\)"),
    (((2, 8, 4, 72), (2, 8, 4, 72), (2, 9, 4, 72)), r"k and v must have the same shape but for the head dim"),
    (((2, 8, 4, 72), (2, 8, 4, 72), (2, 8, 2, 72)), r"k and v must have the same shape but for the head dim"),
    (((2, 8, 4, 20), (2, 8, 4, 20), (2, 8, 4, 64)), r"head_dim=20 is not supported"),
    (((2, 8, 4), (), (2, 8, 4)), r"need a head dim"),
])
def test_check_head_dims(shapes, match):
    with pytest.raises(ValueError, match=match):
        check_head_dims(*shapes)


def test_check_head_dims_gives_both_widths():
    assert check_head_dims((2, 8, 4, 192), (2, 8, 1, 192), (2, 8, 1, 128)) == (192, 128)


# -- the public calls ----------------------------------------------------------------------------------------------

def meta(*shape, grad=False):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta").requires_grad_(grad)


CU = torch.tensor([0, 4, 8], dtype=torch.int32).to("meta")


@pytest.mark.parametrize("d_qk, d_v", [(72, 72), (8, 8), (192, 128), (128, 64), (200, 200)])
def test_varlen_and_dense_give_the_callers_widths_and_gradients(d_qk, d_v):
    """Through the operators' fake implementations (meta tensors): out at v's width, gradients at the inputs'."""
    q, k, v = meta(8, 8, d_qk, grad=True), meta(8, 2, d_qk, grad=True), meta(8, 2, d_v, grad=True)
    out, lse = api.attention_varlen(q, k, v, CU, CU, 4, 4, causal=True, validate=False, return_lse=True)
    assert out.shape == (8, 8, d_v) and lse.shape == (8, 8)
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    q, k, v = meta(2, 16, 4, d_qk, grad=True), meta(2, 16, 2, d_qk, grad=True), meta(2, 16, 2, d_v, grad=True)
    out = api.attention(q, k, v, causal=True)
    assert out.shape == (2, 16, 4, d_v) and out.is_contiguous()
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_kernels_see_a_built_head_dim_and_the_callers_scale(monkeypatch, scale):
    seen = {}

    def fake_op(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, *rest):
        seen.update(dims=(q.shape[-1], k.shape[-1], v.shape[-1]), scale=softmax_scale)
        return q.new_empty(q.shape), None

    monkeypatch.setattr(ops, "attention_varlen_op", fake_op)  # meta tensors take the operator
    out = api.attention_varlen(meta(8, 8, 80), meta(8, 2, 80), meta(8, 2, 80), CU, CU, 4, 4, softmax_scale=scale,
                               validate=False)
    assert seen == {"dims": (96, 96, 96), "scale": 1 / math.sqrt(80) if scale is None else scale}
    assert out.shape == (8, 8, 80)


@pytest.mark.parametrize("d_qk, d_v", [(72, 72), (8, 8), (192, 128), (112, 112), (64, 128), (248, 248)])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_is_exact(monkeypatch, d_qk, d_v, causal):
    """The dense call with a float64 stand-in for the kernel (it checks that it is given a built head dim of one
    width): the padded call's output equals attention at the caller's widths, with its default scale."""
    def fake_kernel(q, k, v, causal, softmax_scale, arch, want_lse=True):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] in DENSE_HEAD_DIMS
        seen.append(q.shape[-1])
        scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale  # the kernels' default
        return attention_torch(q, k, v, causal, scale), None

    seen = []
    monkeypatch.setattr(ops, "forward_torch", fake_kernel)
    g = torch.Generator().manual_seed(d_qk + d_v)
    q = torch.randn(2, 17, 4, d_qk, dtype=torch.float64, generator=g)
    k = torch.randn(2, 23, 2, d_qk, dtype=torch.float64, generator=g)
    v = torch.randn(2, 23, 2, d_v, dtype=torch.float64, generator=g)
    out = api.attention(q, k, v, causal=causal)
    ref = attention_torch(q, k, v, causal, 1 / math.sqrt(d_qk))
    assert out.shape == ref.shape and (out - ref).abs().max().item() < 1e-12
    assert seen == [head_dims.kernel_head_dim(d_qk, d_v, dense=True)]


def test_a_call_with_serving_features_pads_a_dense_only_head_dim(monkeypatch):
    """softcap takes the serving kernels, which are not built at 192: padded to 256 (meta tensors take the
    operator); without it the dense kernels run at 192 as it is."""
    seen = []

    def fake_op(q, k, v, causal, softmax_scale, *rest):
        seen.append((q.shape[-1], softmax_scale))
        return q.new_empty(q.shape), q.new_empty(q.shape[:3])

    monkeypatch.setattr(ops, "attention_mods_op", fake_op)
    monkeypatch.setattr(ops, "attention", fake_op)
    q, k, v = meta(2, 16, 4, 192), meta(2, 16, 2, 192), meta(2, 16, 2, 128)
    assert api.attention(q, k, v, softcap=30.0).shape == (2, 16, 4, 128)
    assert api.attention(q, k, v).shape == (2, 16, 4, 128)
    assert api.attention(q, k, k).shape == (2, 16, 4, 192)
    assert seen == [(256, 1 / math.sqrt(192)), (192, 1 / math.sqrt(192)), (192, None)]


@pytest.mark.parametrize("arch, deterministic, runs_at", [("sm90", False, 256), ("sm90", True, 256),
                                                            ("sm80", False, 192), ("sm80", True, 192)])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_the_backward_of_a_dense_only_head_dim(monkeypatch, arch, deterministic, runs_at, scale):
    """flashgen::attention_backward's body with a float64 stand-in for the kernels: on Hopper (deterministic too) it
    runs the sm90 family's next head dim on zero-padded copies with the forward's scale; the gradients are the
    unpadded attention's."""
    seen = []

    def fake_kernel(device, head_dim, dtype, causal, seqlen, deterministic, gqa_group=1):
        seen.append(head_dim)
        return head_dim

    def fake_backward(kern, q, k, v, out, dout, lse, softmax_scale, dlse=None):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == out.shape[-1] == dout.shape[-1] == kern
        s = 1 / math.sqrt(kern) if softmax_scale is None else softmax_scale  # the kernels' default
        return attention_grads(q, k, v, dout, True, s, torch.float64)

    monkeypatch.setattr(ops, "arch_and_slots", lambda device: (arch, 132))
    monkeypatch.setattr(ops, "backward_kernel", fake_kernel)
    monkeypatch.setattr(ops, "backward", fake_backward)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 17, 4, 192, generator=g).bfloat16()
    k, v = (torch.randn(2, 23, 2, 192, generator=g).bfloat16() for _ in range(2))
    dout = torch.randn(2, 17, 4, 192, generator=g).bfloat16()
    out = attention_torch(q, k, v, True, 0.1)  # its values are the stand-in's to ignore; its width is checked
    got = ops.dense_backward(dout, q, k, v, out, None, None, True, scale, deterministic)
    want = attention_grads(q, k, v, dout, True, 1 / math.sqrt(192) if scale is None else scale, torch.float64)
    assert seen == [runs_at]
    for g_, w in zip(got, want):
        assert g_.shape == w.shape and (g_ - w).abs().max().item() < 1e-12


def test_the_padded_call_traces_whole_under_torch_compile(monkeypatch):
    """fullgraph torch.compile (dynamic shapes) through the padding, with a float64 stand-in for the kernel's
    operator: one graph, the unpadded attention's result."""
    monkeypatch.setattr(ops, "attention", lambda q, k, v, causal, scale, *rest: (attention_torch(q, k, v, causal,
                                                                                                   scale), None))
    f = torch.compile(lambda q, k, v: api.attention(q, k, v, causal=True), backend="eager", dynamic=True,
                      fullgraph=True)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 17, 4, 72, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 23, 2, 72, dtype=torch.float64, generator=g) for _ in range(2))
    out = f(q, k, v)
    assert out.shape == q.shape
    assert (out - attention_torch(q, k, v, True, 1 / math.sqrt(72))).abs().max().item() < 1e-12


# -- split widths: v narrower than q and k in a kernel of its own (family sm90's dense 16-bit forward) ---------------

def test_a_split_width_config_is_named_and_stored_only_where_set():
    cfg = default_config(192, "bf16", True, "sm90", "sm90", head_dim_v=128)
    assert (cfg.head_dim, cfg.head_dim_v, cfg.v_dim, cfg.family) == (192, 128, 128, "sm90")
    assert cfg.name.endswith("_dv128") and cfg.name.startswith("fwd_sm90_d192_bf16_causal_bm128_bn128_w12_s2")
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["head_dim_v"] == 128
    plain = default_config(192, "bf16", True, "sm90", "sm90")
    assert plain.head_dim_v is None and plain.v_dim == 192 and "head_dim_v" not in plain.to_dict()
    assert "_dv" not in plain.name and KernelConfig.from_dict(plain.to_dict()) == plain
    # V's tiles and O's accumulator at v's width: Q 48 KB, two stages of K (48 KB) and V (32 KB); S and O as d128's
    assert cfg.smem_bytes == 2 * (128 * 192 + 2 * 128 * (192 + 128)) + 8 * (1 + 1 + 4 * 2) + 1024
    assert cfg.accum_regs == (128 + 128) // 2 + 128 // 4 and cfg.unfit_reason("sm90") is None


SPLIT_ONLY = "head_dim_v is built in family sm90's 16-bit dense forward"


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim_v=96), "head_dim_v=96 must be a multiple of 64 below head_dim=192"),
    (dict(head_dim_v=192), "head_dim_v=192 must be a multiple of 64 below head_dim=192"),
    (dict(head_dim_v=256), "head_dim_v=256 must be a multiple of 64"),
    (dict(head_dim_v=0), "head_dim_v=0 must be a multiple of 64"),
    (dict(head_dim_v="128"), "head_dim_v='128' must be an int or None"),
    (dict(head_dim_v=128, family="sm80", num_warps=8), SPLIT_ONLY),
    (dict(head_dim=256, head_dim_v=128, varlen=True), SPLIT_ONLY + ".*varlen"),
    (dict(head_dim=256, head_dim_v=128, pack_gqa=True), SPLIT_ONLY + ".*pack_gqa"),
    (dict(head_dim=256, head_dim_v=128, score_mod="ab12"), SPLIT_ONLY + ".*modifiers"),
])
def test_a_split_width_is_refused_where_no_kernel_can_have_it(kw, match):
    args = dict(head_dim=192, block_m=128, block_n=64, num_warps=12, num_stages=2, family="sm90") | kw
    with pytest.raises(ConfigError, match=match):
        KernelConfig(dtype="bf16", causal=False, **args)


def test_only_the_built_pairs_have_a_default():
    with pytest.raises(ConfigError, match="no default split-width kernel for head_dim=192, head_dim_v=64"):
        default_config(192, "bf16", False, "sm90", "sm90", head_dim_v=64)
    with pytest.raises(ConfigError, match="family sm80"):
        default_config(192, "bf16", False, "sm80", "sm80", head_dim_v=128)
    with pytest.raises(ConfigError, match="no default split-width configuration fits sm80"):
        default_config(192, "bf16", False, "sm80", "sm90", head_dim_v=128)
    assert default_config(192, "bf16", False, "sm90", "sm90", head_dim_v=192) == default_config(192, "bf16", False,
                                                                                                "sm90", "sm90")


def test_a_split_width_renders_v_at_its_own_width():
    """HEAD_DIM stays q and k's (Q K^T's k-dim); HEAD_DIM_V drives P V's n-dim, O and V's tiles; a config without
    head_dim_v renders both at head_dim."""
    from flashgen.render import render

    src = render(default_config(192, "bf16", False, "sm90", "sm90", head_dim_v=128))
    assert "inline constexpr int HEAD_DIM = 192;" in src and "inline constexpr int HEAD_DIM_V = 128;" in src
    assert "m64n128k16.f32.bf16.bf16" in src  # P V: n = v's width (S = Q K^T is m64n128 too: block_n)
    assert "m64n192k16" not in src
    plain = render(default_config(192, "bf16", False, "sm90", "sm90"))
    assert "inline constexpr int HEAD_DIM_V = 192;" in plain and "m64n192k16.f32.bf16.bf16" in plain


def test_split_width_kernels_build_clean_for_sm90a():
    """The defaults (both masks and dtypes) and the schedules whose O leaves another way (plain: staged in Q's tile;
    o_tma; the persistent epilogue overlap; cluster; p_smem): no spills, no serialized wgmma."""
    compile_sm90a_clean(sorted(set(split_width_configs()), key=lambda c: c.name))


@pytest.mark.filterwarnings("ignore:no tuned")
def test_resolve_picks_the_split_width_kernel_on_hopper_only(tmp_path):
    cfg = choose_config(192, "bf16", True, "sm90", 4096, None, tmp_path, ("NVIDIA H200", "sm90"), head_dim_v=128)
    assert cfg == default_config(192, "bf16", True, "sm90", "sm90", head_dim_v=128)
    with pytest.raises(ConfigError, match="sm80"):
        choose_config(192, "bf16", True, "sm80", 4096, None, tmp_path, ("NVIDIA A100", "sm80"), head_dim_v=128)
    kern = load(192, "bf16", True, gpu_arch="sm90", head_dim_v=128)
    assert kern.config.head_dim_v == 128 and kern.config.family == "sm90"
    with pytest.raises(ValueError, match="does not match.*head_dim_v=64"):
        load(192, "bf16", True, config=kern.config, gpu_arch="sm90", head_dim_v=64)


@pytest.mark.parametrize("arch, padded", [("sm90", False), ("sm80", True), (None, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_192_128_runs_unpadded_in_the_sm90_family(monkeypatch, arch, padded, causal):
    """The dense call with a float64 stand-in for the kernel: (192, 128) reaches it at its own widths in family sm90
    (CPU tensors have no GPU: arch None pads, as on a GPU that is not Hopper), padded to 192 elsewhere; other pairs
    pad in every family."""
    seen = []

    def fake_kernel(q, k, v, causal, softmax_scale, arch, want_lse=True):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], softmax_scale))
        scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        return attention_torch(q, k, v, causal, scale), None

    monkeypatch.setattr(ops, "forward_torch", fake_kernel)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 17, 4, 192, dtype=torch.float64, generator=g)
    k = torch.randn(2, 23, 2, 192, dtype=torch.float64, generator=g)
    v = torch.randn(2, 23, 2, 128, dtype=torch.float64, generator=g)
    out = api.attention(q, k, v, causal=causal, arch=arch)
    ref = attention_torch(q, k, v, causal, 1 / math.sqrt(192))
    assert out.shape == ref.shape and (out - ref).abs().max().item() < 1e-12
    assert seen == [(192, 192, 192, 1 / math.sqrt(192)) if padded else (192, 192, 128, None)]
    seen.clear()
    api.attention(q, k, v[..., :64], causal=causal, arch=arch)  # (192, 64): no kernel of its own
    assert seen == [(192, 192, 192, 1 / math.sqrt(192))]


def test_a_hopper_tensor_takes_the_sm90_family(monkeypatch):
    class OnGpu:
        is_cuda = True

        def get_device(self):
            return 0

    monkeypatch.setattr(api.resolve, "gpu", lambda device: ("NVIDIA H200", "sm90"))
    assert api._device_family(OnGpu()) == "sm90"
    monkeypatch.setattr(api.resolve, "gpu", lambda device: ("NVIDIA A100", "sm80"))
    assert api._device_family(OnGpu()) == "sm80"
    assert api._device_family(meta(1)) is None


def test_the_split_width_operator_gives_v_width_out_and_every_gradient():
    """Through the operator's fake implementation (meta tensors, family sm90): out at v's width, the gradients at
    the inputs' widths."""
    q, k, v = meta(2, 16, 4, 192, grad=True), meta(2, 16, 2, 192, grad=True), meta(2, 16, 2, 128, grad=True)
    out, lse = api.attention(q, k, v, causal=True, arch="sm90", return_lse=True)
    assert out.shape == (2, 16, 4, 128) and lse.shape == (2, 4, 16)
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("arch, runs_at", [("sm90", 256), ("sm80", 192)])
def test_the_backward_of_a_split_width_forward_pads(monkeypatch, arch, runs_at):
    """flashgen::attention_backward's body given the split forward's tensors (v and out 128 wide): the backward runs
    at the head dim that holds both (Hopper: the sm90 family's next, 256) on zero-padded copies, with the forward's
    scale; dq, dk at 192 and dv at 128 are the unpadded attention's gradients."""
    seen = []

    def fake_backward(kern, q, k, v, out, dout, lse, softmax_scale, dlse=None):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == out.shape[-1] == dout.shape[-1] == kern
        return attention_grads(q, k, v, dout, True, softmax_scale, torch.float64)

    monkeypatch.setattr(ops, "arch_and_slots", lambda device: (arch, 132))
    monkeypatch.setattr(ops, "backward_kernel", lambda device, d, *rest: seen.append(d) or d)
    monkeypatch.setattr(ops, "backward", fake_backward)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 17, 4, 192, generator=g).bfloat16()
    k = torch.randn(2, 23, 2, 192, generator=g).bfloat16()
    v = torch.randn(2, 23, 2, 128, generator=g).bfloat16()
    dout = torch.randn(2, 17, 4, 128, generator=g).bfloat16()
    out = attention_torch(q, k, v, True, 0.1)
    got = ops.dense_backward(dout, q, k, v, out, None, None, True, None, False)
    want = attention_grads(q, k, v, dout, True, 1 / math.sqrt(192), torch.float64)
    assert seen == [runs_at]
    for g_, w in zip(got, want):
        assert g_.shape == w.shape and (g_ - w).abs().max().item() < 1e-12
