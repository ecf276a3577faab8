"""Head dims without a kernel of their own on the GPU (flashgen.head_dims: zero-padded to the next built head dim),
and v of another width than q and k (DeepSeek-V3's MLA prefill: 192 and 128), through the public calls: forward of
each family, backward (default and deterministic: the sm90 family on Hopper, at d256 for the dense-only head dims),
varlen forward and backward, the KV cache with an append, a decode-shaped call; odd and unequal lengths, GQA; and
the kernels built at the dense-only head dims (160, 192) launched directly into NaN-poisoned buffers (the sm80
backward there: what Ampere and Ada run). Against float64: the forward's bar is 2 x PyTorch's
error in the input dtype + 1e-5 (flashgen.verify.reference), the gradients' 2 x PyTorch's + 1e-4 (judge_backward).
The outputs and gradients come from torch's caching allocator, which each call first fills with NaN (a block of
the sizes it hands out, freed), so an element the padded path leaves unwritten shows up as NaN."""
from __future__ import annotations

import itertools
import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.compile import compile_kernel, target_for  # noqa: E402
from flashgen.config import (DENSE_ONLY_HEAD_DIMS, HALF_DTYPES, KernelConfig, default_bwd_config,  # noqa: E402
                             default_config)
from flashgen.head_dims import kernel_head_dim  # noqa: E402
from flashgen.verify import judge, judge_backward, packed_ref, reference, verify, verify_backward  # noqa: E402

# (d_qk, d_v): multiples of 8 without a kernel, and MLA's unequal widths.
DIMS = [(8, 8), (72, 72), (80, 80), (112, 112), (160, 160), (192, 192), (200, 200), (248, 248), (192, 128)]
PAIRS = [(1, 1), (17, 17), (113, 211), (211, 113), (1023, 1023)]
LAYOUTS = {"mha": (4, 4), "gqa": (6, 2)}
IDS = [f"d{a}" if a == b else f"d{a}-{b}" for a, b in DIMS]


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def _families() -> list[str]:
    return ["sm80", "sm90"] if torch.cuda.get_device_capability()[0] == 9 else ["sm80"]


def _poison(*shapes, dtype=torch.bfloat16) -> None:
    """Fill cached allocator blocks of these sizes with NaN and free them: the next allocations of those sizes
    (the call's outputs) most likely get them back."""
    held = [torch.full(s, float("nan"), device="cuda", dtype=dtype) for s in shapes]
    del held


def _qkv(b, sq, sk, h, hk, d_qk, d_v, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d_qk, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d_qk, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d_v, device="cuda", dtype=dtype, generator=g)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("d_qk, d_v", DIMS, ids=IDS)
def test_forward(d_qk, d_v, family, causal):
    if family not in _families():
        pytest.skip("family sm90 runs on Hopper only")
    failures = []
    for (sq, sk), (layout, (h, hk)) in itertools.product(PAIRS, LAYOUTS.items()):
        q, k, v = _qkv(2, sq, sk, h, hk, d_qk, d_v, sq * 7 + sk)
        _poison((2, sq, h, d_v), (2, sq, h, kernel_head_dim(d_qk, d_v)))
        out, lse = flashgen.attention(q, k, v, causal=causal, arch=family, return_lse=True)
        assert out.shape == (2, sq, h, d_v) and out.is_contiguous()
        res = judge(out, lse, reference(q, k, v, causal))
        if not res.ok:
            failures.append(f"{sq}x{sk} {layout}: {res.reason}")
    assert not failures, "; ".join(failures)


def test_an_explicit_scale_is_kept():
    q, k, v = _qkv(1, 113, 211, 4, 2, 72, 72, 3)
    out, lse = flashgen.attention(q, k, v, softmax_scale=0.05, return_lse=True)
    res = judge(out, lse, reference(q, k, v, False, 0.05))
    assert res.ok, res.reason


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d_qk, d_v", DIMS, ids=IDS)
def test_backward(d_qk, d_v, causal, deterministic):
    """Autograd through the padded call: the default backward and the deterministic one."""
    failures = []
    for (sq, sk), (layout, (h, hk)) in itertools.product(PAIRS, LAYOUTS.items()):
        q, k, v = (t.requires_grad_() for t in _qkv(2, sq, sk, h, hk, d_qk, d_v, sq * 5 + sk))
        dout = torch.randn(2, sq, h, d_v, device="cuda", dtype=q.dtype)
        out = flashgen.attention(q, k, v, causal=causal, deterministic=deterministic)
        _poison(q.shape, k.shape, v.shape)
        out.backward(dout)
        got = (q.grad, k.grad, v.grad)
        assert tuple(g.shape for g in got) == (q.shape, k.shape, v.shape)
        res = judge_backward(got, q.detach(), k.detach(), v.detach(), dout, causal, 1 / math.sqrt(d_qk))
        if not res.ok:
            failures.append(f"{sq}x{sk} {layout}: {res.reason}")
    assert not failures, "; ".join(failures)


# -- the dense-only head dims' own kernels, launched directly into NaN-poisoned buffers -------------------------------

def split_width_configs() -> list[KernelConfig]:
    """The split-width kernels (192, 128) this module runs by name: the defaults (both masks and dtypes) and the
    schedules whose O leaves another way (plain: staged in Q's tile; o_tma; the persistent epilogue overlap with
    o_tma; cluster; p_smem)."""
    base = dict(block_m=128, block_n=128, num_warps=12, num_stages=2, family="sm90", head_dim_v=128)
    variants = [{}, dict(block_n=96, o_tma=True), dict(overlap=True, pingpong=True, cluster=True),
                dict(block_n=96, overlap=True, pingpong=True, persistent=True, overlap_epilogue=True, lazy_rescale=True,
                     o_tma=True),
                dict(block_n=64, overlap=True, persistent=True, overlap_epilogue=True, p_smem=True)]
    return ([default_config(192, dt, causal, "sm90", "sm90", head_dim_v=128) for dt in HALF_DTYPES
             for causal in (False, True)]
            + [KernelConfig(192, "bf16", causal, **(base | v)) for v in variants for causal in (False, True)])


def head_dim_configs(arch: str) -> set:
    """The kernels this module compiles by name (scripts/fill_kernel_cache.py --tests head_dims): the dense-only head
    dims' defaults, each family's forward and the sm80 backward, and on Hopper the split-width kernels. The padded
    calls load the built head dims' kernels, which the other suites' lists hold."""
    families = ("sm80", "sm90") if arch == "sm90" else ("sm80",)
    return ({default_config(d, dt, c, arch, f) for d in DENSE_ONLY_HEAD_DIMS for dt in HALF_DTYPES
             for c in (False, True) for f in families}
            | {default_bwd_config(d, dt, c, arch, det, family="sm80") for d in DENSE_ONLY_HEAD_DIMS
               for dt in HALF_DTYPES for c in (False, True) for det in (False, True)}
            | (set(split_width_configs()) if arch == "sm90" else set()))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("head_dim", DENSE_ONLY_HEAD_DIMS)
def test_dense_only_forward_kernels(head_dim, family, dtype, causal):
    if family not in _families():
        pytest.skip("family sm90 runs on Hopper only")
    arch = _arch()
    kern = compile_kernel(default_config(head_dim, dtype, causal, arch, family), target_for(arch, family))
    failures = _forward_failures(kern)
    assert not failures, "; ".join(failures)


def _forward_failures(kern) -> list[str]:
    """A forward kernel launched directly into NaN-poisoned out and lse (flashgen.verify) at every length pair and
    layout, against float64: what failed."""
    failures = []
    for i, ((sq, sk), (layout, (h, hk))) in enumerate(itertools.product(PAIRS, LAYOUTS.items())):
        res = verify(kern, 2, sq, sk, h, hk, seed=i)
        if not res.ok:
            failures.append(f"{kern.name} {sq}x{sk} {layout}: {res.reason}")
    return failures


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("head_dim", DENSE_ONLY_HEAD_DIMS)
def test_dense_only_backward_kernels(head_dim, dtype, causal, deterministic):
    """The sm80 family's backward at its own tiles (what Ampere and Ada run at these head dims)."""
    arch = _arch()
    target = target_for(arch, "sm80")
    bwd = compile_kernel(default_bwd_config(head_dim, dtype, causal, arch, deterministic, family="sm80"), target)
    fwd = compile_kernel(default_config(head_dim, dtype, causal, arch, "sm80"), target)
    failures = []
    for i, ((sq, sk), (layout, (h, hk))) in enumerate(itertools.product(PAIRS, LAYOUTS.items())):
        res = verify_backward(bwd, fwd, 2, sq, sk, h, hk, seed=i)
        if not res.ok:
            failures.append(f"{bwd.name} {sq}x{sk} {layout}: {res.reason}")
    assert not failures, "; ".join(failures)


# -- split widths: (192, 128) in family sm90's kernels of its own -----------------------------------------------------

def _hopper() -> None:
    if "sm90" not in _families():
        pytest.skip("the split-width kernels are family sm90's: Hopper only")


@pytest.mark.parametrize("cfg", split_width_configs(), ids=lambda c: c.name)
def test_split_width_kernels(cfg):
    """Each split-width kernel launched directly (q, k 192 wide, v 128) into NaN-poisoned out and lse, against
    float64: odd and unequal lengths, MHA and GQA."""
    _hopper()
    failures = _forward_failures(compile_kernel(cfg, target_for("sm90", "sm90")))
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_192_128_runs_in_its_own_kernel(monkeypatch, dtype, causal):
    """flashgen.attention at (192, 128) on Hopper (arch None and "sm90"): the split-width kernel, never the padding
    (pad_head_dim would raise), its output at v's width against float64; the padded d192 kernel's result agrees."""
    _hopper()
    from flashgen import ops  # noqa: PLC0415
    from flashgen.resolve import resolver  # noqa: PLC0415

    def no_padding(t, d):
        raise AssertionError(f"padded to {d}")

    for arch in (None, "sm90"):
        q, k, v = _qkv(2, 1023, 1023, 6, 2, 192, 128, 11, dtype)
        _poison((2, 1023, 6, 128), dtype=dtype)
        with monkeypatch.context() as m:
            m.setattr(ops, "pad_head_dim", no_padding)
            resolver.plans.clear()
            out, lse = flashgen.attention(q, k, v, causal=causal, arch=arch, return_lse=True)
        used = {hit[0].config for hit in resolver.plans.values()}
        assert [c.v_dim for c in used] == [128] and all(c.head_dim == 192 and c.family == "sm90" for c in used)
        assert out.shape == (2, 1023, 6, 128) and out.dtype == dtype
        res = judge(out, lse, reference(q, k, v, causal))
        assert res.ok, res.reason
    padded = flashgen.attention(q, k, v, causal=causal, arch="sm80")  # the sm80 family pads to its d192 kernel
    assert (padded.double() - out.double()).abs().max().item() <= 2 * res.bound


# (seqlen_q, seqlen_k) per sequence: length 1, odd and unequal both ways, a long one.
SEQS = [(1, 1), (17, 17), (113, 211), (211, 113), (1023, 1023), (1, 300)]


def _packed(d_qk, d_v, h, hk, seed):
    lq, lk = [a for a, _ in SEQS], [b for _, b in SEQS]
    cu_q, cu_k = [0, *itertools.accumulate(lq)], [0, *itertools.accumulate(lk)]
    q, k, v = _qkv(1, cu_q[-1], cu_k[-1], h, hk, d_qk, d_v, seed)
    return q[0], k[0], v[0], cu_q, cu_k, max(lq), max(lk)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d_qk, d_v", DIMS, ids=IDS)
def test_varlen_forward_and_backward(d_qk, d_v, causal):
    h, hk = LAYOUTS["gqa"]
    q, k, v, cu_q, cu_k, mq, mk = _packed(d_qk, d_v, h, hk, d_qk + d_v)
    icu_q, icu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    _poison((q.shape[0], h, d_v))
    out = flashgen.attention_varlen(q, k, v, icu_q, icu_k, mq, mk, causal=causal)
    assert out.shape == (q.shape[0], h, d_v)
    ref = packed_ref(q, k, v, cu_q, cu_k, causal)
    pt = packed_ref(q, k, v, cu_q, cu_k, causal, dtype=q.dtype)
    err, bound = (out.double() - ref).abs().max().item(), 2 * (pt.double() - ref).abs().max().item() + 1e-5
    assert err <= bound, f"forward: max error {err:.3g} > bound {bound:.3g}"

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(out)
    out = flashgen.attention_varlen(q, k, v, icu_q, icu_k, mq, mk, causal=causal)
    _poison(q.shape, k.shape, v.shape)
    out.backward(dout)
    failures = []
    for b, (a0, a1, k0, k1) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):  # each sequence on its own
        got = (q.grad[a0:a1][None], k.grad[k0:k1][None], v.grad[k0:k1][None])
        res = judge_backward(got, q.detach()[a0:a1][None], k.detach()[k0:k1][None], v.detach()[k0:k1][None],
                             dout[a0:a1][None], causal, 1 / math.sqrt(d_qk))
        if not res.ok:
            failures.append(f"sequence {b} {SEQS[b]}: {res.reason}")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d_qk, d_v", [(72, 72), (192, 128), (200, 200)], ids=["d72", "d192-128", "d200"])
def test_kvcache_appends_into_the_callers_cache(d_qk, d_v, paged):
    """attention_with_kvcache: k, v appended into the caller's (unpadded) cache in place, and the new queries
    attend to the cache as it is after the append (bottom-right causal)."""
    batch, cap, h, hk, new = 3, 256, 6, 2, 5
    lens = [0, 100, 250]
    q, _, _ = _qkv(batch, new, 1, h, hk, d_qk, d_v, 11)
    kc = torch.randn(batch, cap, hk, d_qk, device="cuda", dtype=q.dtype)
    vc = torch.randn(batch, cap, hk, d_v, device="cuda", dtype=q.dtype)
    k_new = torch.randn(batch, new, hk, d_qk, device="cuda", dtype=q.dtype)
    v_new = torch.randn(batch, new, hk, d_v, device="cuda", dtype=q.dtype)
    want_k, want_v = kc.clone(), vc.clone()
    for b, n in enumerate(lens):
        want_k[b, n:n + new], want_v[b, n:n + new] = k_new[b], v_new[b]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if paged:  # pages of 64 rows, shuffled
        page, per = 64, cap // 64
        perm = torch.randperm(batch * per, device="cuda")
        table = perm.view(batch, per).to(torch.int32)
        k_pages = torch.empty(batch * per, page, hk, d_qk, device="cuda", dtype=q.dtype)
        v_pages = torch.empty(batch * per, page, hk, d_v, device="cuda", dtype=q.dtype)
        k_pages[perm] = kc.view(batch * per, page, hk, d_qk)
        v_pages[perm] = vc.view(batch * per, page, hk, d_v)
        out, lse = flashgen.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                                                   block_table=table, causal=True, return_lse=True)
        got_k = k_pages[perm].view(batch, cap, hk, d_qk)
        got_v = v_pages[perm].view(batch, cap, hk, d_v)
    else:
        out, lse = flashgen.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                                   return_lse=True)
        got_k, got_v = kc, vc
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), "the caller's cache does not hold the append"
    assert out.shape == (batch, new, h, d_v)
    for b, n in enumerate(lens):
        ks, vs = want_k[b:b + 1, :n + new], want_v[b:b + 1, :n + new]
        res = judge(out[b:b + 1], lse[b:b + 1], reference(q[b:b + 1], ks, vs, True))
        assert res.ok, f"sequence {b}: {res.reason}"


@pytest.mark.parametrize("d_qk, d_v", [(80, 80), (192, 128)], ids=["d80", "d192-128"])
def test_a_decode_shaped_call(d_qk, d_v):
    """Few queries against many keys: attention() takes the decode kernels, padded the same way."""
    q, k, v = _qkv(2, 4, 2048, 8, 2, d_qk, d_v, 7)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    res = judge(out, lse, reference(q, k, v, True))
    assert res.ok, res.reason
