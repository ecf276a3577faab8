"""Gradients of score_mod / mask_mod / block masks on the GPU: dq, dk, dv of flashgen.attention through autograd
against float64 autograd of a reference that applies the user's own Python functions to the score matrix (score_mod
on q.k * scale, mask_mod to -inf), for FlexAttention's examples (causal, sliding window, prefix-LM and document masks
as mask_mods, with flashgen's own block map and with torch's BlockMask; ALiBi, softcap and a relative bias as
score_mods, alone and with masks), random block-sparse BlockMasks, learnable bias tables, at lengths 1, 17, 113
(odd, unequal both ways), MHA and GQA, fp16 and bf16, into gradient buffers poisoned with NaN. The bar, the backward's: each gradient's max
error <= 2 x PyTorch's error for the same computation in the input dtype + GRAD_ABS_TOL."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.verify import GRAD_ABS_TOL  # noqa: E402
from modifier_examples import examples  # noqa: E402
from test_gpu_modifiers import documents, kv_blocks, modified_scores, qkv  # noqa: E402

LAYOUTS = {"mha": (4, 4), "gqa": (8, 2)}
# (seqlen_q, seqlen_k): length 1, odd, unequal both ways
SHAPES = [(1, 1), (17, 17), (113, 211), (211, 113)]
MASKS = ["causal", "document", "prefix_lm", "sliding_window"]
SCORES = ["alibi", "alibi_causal", "relative_bias", "relative_prefix_lm", "softcap", "softcap_document"]


def ref_grads(q, k, v, dout, scale, score_mod=None, mask_mod=None, causal=False, dtype=torch.float64, dlse=None):
    """(dq, dk, dv) by torch's autograd in `dtype` (float64: the reference; the input dtype: PyTorch's own error) of
    attention with the user's functions on broadcast index grids; a row that keeps no key gives O = 0 (and with
    `dlse`, its +inf LSE contributes nothing)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    qd, kd, vd = leaves
    heads, heads_k = q.shape[2], k.shape[2]
    s = modified_scores(qd, kd, scale, score_mod, mask_mod, causal)
    vf = vd.repeat_interleave(heads // heads_k, dim=2).transpose(1, 2)
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    seen = l > 0
    l1 = torch.where(seen, l, torch.ones_like(l))
    out = torch.where(seen, (p @ vf) / l1, torch.zeros_like(l)).transpose(1, 2)
    total = (out * dout.to(dtype)).sum()
    if dlse is not None:
        lse = torch.where(seen, m + torch.log(l1), torch.zeros_like(l)).squeeze(-1)
        total = total + (lse * dlse.to(dtype)).sum()
    return torch.autograd.grad(total, leaves)


def poison_grads(q, k):
    """NaN into the blocks the caching allocator hands out next for the gradients and the fp32 accumulators: an
    element the backward does not write shows up as NaN."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    junk = [torch.full(t.shape, math.nan, dtype=t.dtype, device=t.device) for t in (q, k, k)]
    junk += [torch.full((b, n, h, d), math.nan, dtype=torch.float32, device=q.device) for n in (sq, sk, sk)]
    del junk


def check_grads(q, k, v, scale, score_mod=None, mask_mod=None, causal=False, ref_score=None, ref_mask=None,
                with_lse=False, **kwargs):
    """flashgen.attention's gradients against ref_grads (ref_score / ref_mask: the reference's functions where the
    call's are not plain score_mod / mask_mod, e.g. a BlockMask's block pattern or the built-in softcap)."""
    g = torch.Generator(device=q.device).manual_seed(q.shape[1] * 7 + k.shape[1])
    dout = torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=g, device=q.device) if with_lse else None
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flashgen.attention(*leaves, causal=causal, softmax_scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                                  return_lse=True, **kwargs)
    total = (out.float() * dout.float()).sum()
    if with_lse:
        total = total + (lse.where(torch.isfinite(lse), 0.0) * dlse).sum()
    poison_grads(q, k)
    total.backward()
    got = [t.grad for t in leaves]
    rs, rm = ref_score or score_mod, ref_mask or mask_mod
    ref = ref_grads(q, k, v, dout, scale, rs, rm, causal, torch.float64, dlse)
    pt = ref_grads(q, k, v, dout, scale, rs, rm, causal, q.dtype, dlse)
    failures = []
    for name, gr, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert gr is not None and gr.shape == r.shape and gr.dtype == q.dtype, name
        if torch.isnan(gr).any():
            failures.append(f"{name}: NaN (an unwritten or poisoned element)")
            continue
        err = (gr.double() - r).abs().max().item() if r.numel() else 0.0
        bound = 2 * ((p.double() - r).abs().max().item() if r.numel() else 0.0) + GRAD_ABS_TOL
        if err > bound:
            failures.append(f"{name}: max error {err:.3g} > bound {bound:.3g}")
    assert not failures, f"{q.shape[1]}x{k.shape[1]}: " + "; ".join(failures)
    return got


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", MASKS)
def test_mask_mods_with_and_without_a_block_mask(name, dtype, layout):
    """The map flashgen builds from the mask_mod (its transpose for dK/dV), and torch's BlockMask of the same function:
    key tiles the forward skipped are skipped in the backward too."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    heads, heads_k = LAYOUTS[layout]
    mask = examples("cuda", batch=2, heads=heads)[name].mask_mod
    for i, (sq, sk) in enumerate(SHAPES):
        q, k, v = qkv(2, sq, sk, heads, heads_k, 64, dtype, seed=i)
        check_grads(q, k, v, 0.125, mask_mod=mask)
        bm = fa.create_block_mask(mask, 2, None, sq, sk, device="cuda")
        check_grads(q, k, v, 0.125, mask_mod=mask, block_mask=bm, causal=i == 2)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", SCORES)
def test_score_mods(name, dtype):
    """The score_mod recomputed on q.k * scale and its derivative on dS (ALiBi: 1, softcap: 1 - tanh^2), alone and
    with a mask_mod; MHA for bf16, GQA for fp16."""
    heads, heads_k = LAYOUTS["mha" if dtype == "bf16" else "gqa"]
    ex = examples("cuda", batch=2, heads=heads)[name]
    for i, (sq, sk) in enumerate(SHAPES):
        q, k, v = qkv(2, sq, sk, heads, heads_k, 64, dtype, seed=10 + i)
        check_grads(q, k, v, 0.125, ex.score_mod, ex.mask_mod)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_random_block_sparse_block_masks(layout):
    """Random block-sparse BlockMasks without a mask_mod (listed blocks kept whole), rows whose every block is empty
    included (their dQ and the keys nobody sees: zero), and the same pattern as a mask_mod over a captured table."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    heads, heads_k = LAYOUTS[layout]
    g = torch.Generator().manual_seed(5)
    for i, (sq, sk) in enumerate([(113, 211), (300, 257), (256, 256)]):
        blocks = (torch.rand(2, heads, -(-sq // 128), -(-sk // 128), generator=g) < 0.45).cuda()
        blocks[0, 0, 0] = False  # a row block that sees nothing

        def sparse(b, h, q_idx, kv_idx):
            return blocks[b, h, q_idx // 128, kv_idx // 128]

        q, k, v = qkv(2, sq, sk, heads, heads_k, 64, "bf16", seed=20 + i)
        bm = fa.BlockMask.from_kv_blocks(*kv_blocks(blocks), BLOCK_SIZE=128, seq_lengths=(sq, sk))
        check_grads(q, k, v, 0.125, block_mask=bm, ref_mask=sparse)
        check_grads(q, k, v, 0.125, mask_mod=sparse)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
def test_head_dims(head_dim):
    ex = examples("cuda", batch=2, heads=8)
    for name in ("softcap_document", "alibi_causal"):
        q, k, v = qkv(2, 113, 211, 8, 2, head_dim, "bf16", seed=head_dim)
        check_grads(q, k, v, head_dim ** -0.5, ex[name].score_mod, ex[name].mask_mod)


def test_deterministic_is_bit_identical_and_agrees():
    """deterministic=True: dQ per q tile over the key tiles of the forward's map (no atomics): the same bits twice."""
    ex = examples("cuda", batch=2, heads=8)["relative_prefix_lm"]
    q, k, v = qkv(2, 211, 113, 8, 2, 64, "fp16", seed=3)
    first = check_grads(q, k, v, 0.125, ex.score_mod, ex.mask_mod, deterministic=True)
    again = check_grads(q, k, v, 0.125, ex.score_mod, ex.mask_mod, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    doc = documents(2, 300, seed=1)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    q, k, v = qkv(2, 300, 300, 8, 2, 64, "bf16", seed=4)
    check_grads(q, k, v, 0.125, mask_mod=same_doc, causal=True, deterministic=True)


def test_lse_gradient_and_built_in_modifiers():
    """lse's gradient (D - dlse in dS), and a mask_mod beside the built-in softcap, ALiBi and window, whose
    reference is the same arithmetic as a score_mod and masks."""
    doc = documents(2, 300, seed=2)
    slopes = torch.rand(8, device="cuda") * 0.3

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    q, k, v = qkv(2, 113, 211, 8, 2, 64, "bf16", seed=6)
    check_grads(q, k, v, 0.125, mask_mod=same_doc, with_lse=True)
    shift = 211 - 113

    def capped_alibi(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0) - slopes[h] * (q_idx + shift - kv_idx).abs()

    def windowed_doc(b, h, q_idx, kv_idx):
        return same_doc(b, h, q_idx, kv_idx) & (kv_idx >= q_idx + shift - 50) & (kv_idx <= q_idx + shift + 10)

    check_grads(q, k, v, 0.125, mask_mod=same_doc, softcap=20.0, alibi_slopes=slopes, window_size=(50, 10),
                ref_score=capped_alibi, ref_mask=windowed_doc)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_learnable_bias_tables(dtype):
    """A score_mod reading fp32 tables that require grad (a per-head scale and a relative-position bias), beside a
    document mask_mod, GQA: dq, dk, dv and both tables' gradients (flashgen.modifier_grads) against float64 autograd;
    with only the tables requiring grad too."""
    sq, sk = 113, 211
    g = torch.Generator(device="cuda").manual_seed(9)
    bias = (0.5 * torch.randn(8, sq + sk, generator=g, device="cuda")).requires_grad_(True)
    scale_h = (0.5 + torch.rand(8, generator=g, device="cuda")).requires_grad_(True)
    doc = documents(2, sk, seed=3, mean=60)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx + sk - sq] == doc[b, kv_idx]

    def biased(score, b, h, q_idx, kv_idx):
        return score * scale_h[h] + bias[h, kv_idx - q_idx + sq]

    q, k, v = qkv(2, sq, sk, 8, 2, 64, dtype, seed=7)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(q.dtype)

    def grads(dtype_, tables_only=False):
        """Gradients of (q, k, v, bias, scale_h): flashgen's (dtype_ None) or the reference's in dtype_."""
        if dtype_ is None:
            leaves = [t.detach().clone().requires_grad_(not tables_only) for t in (q, k, v)]
            out = flashgen.attention(*leaves, softmax_scale=0.125, score_mod=biased, mask_mod=same_doc, causal=True)
            bias.grad = scale_h.grad = None
            (out.float() * dout.float()).sum().backward()
            return [t.grad for t in leaves] + [bias.grad, scale_h.grad]
        leaves = [t.detach().to(dtype_).requires_grad_(True) for t in (q, k, v, bias, scale_h)]

        def mod(score, b, h, q_idx, kv_idx):
            return score * leaves[4][h] + leaves[3][h, kv_idx - q_idx + sq]

        qd, kd, vd = leaves[:3]
        heads = q.shape[2]
        s = (qd.transpose(1, 2) @ kd.repeat_interleave(4, 2).permute(0, 2, 3, 1)) * 0.125
        b = torch.arange(2, device="cuda").view(-1, 1, 1, 1)
        h = torch.arange(heads, device="cuda").view(1, -1, 1, 1)
        qi = torch.arange(sq, device="cuda").view(1, 1, -1, 1)
        ki = torch.arange(sk, device="cuda").view(1, 1, 1, -1)
        keep = same_doc(b, h, qi, ki) & (ki <= qi + sk - sq)
        s = mod(s, b, h, qi, ki).masked_fill(~keep, -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        o = (p @ vd.repeat_interleave(4, 2).transpose(1, 2)).transpose(1, 2)
        return list(torch.autograd.grad((o * dout.to(dtype_)).sum(), leaves))

    ref, pt = grads(torch.float64), grads(q.dtype)
    for tables_only in (False, True):
        got = grads(None, tables_only)
        for name, gr, r, p in list(zip(("dq", "dk", "dv", "dbias", "dscale"), got, ref, pt))[3 * tables_only:]:
            assert gr is not None and not torch.isnan(gr).any(), name
            err = (gr.double() - r).abs().max().item()
            bound = 2 * (p.double() - r).abs().max().item() + GRAD_ABS_TOL
            assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def test_a_mask_mods_tensor_that_requires_grad_is_refused():
    table = torch.ones(64, device="cuda", requires_grad=True)

    def learned(b, h, q_idx, kv_idx):
        return table[kv_idx] > 0

    q, k, v = (t.requires_grad_(True) for t in qkv(1, 17, 17, 4, 4, 64, "bf16"))
    with pytest.raises(NotImplementedError, match="a mask has no gradient"):
        flashgen.attention(q, k, v, mask_mod=learned)


# -- both template families: the sm90 family's backward on Hopper ------------------------------------------------------

FAMILIES = ["sm80", "sm90"]
# (seqlen_q, seqlen_k): length 1, odd, unequal both ways, and 1023 x 1023 across many tiles
FAMILY_SHAPES = [(1, 1), (17, 17), (113, 211), (211, 113), (1023, 1023)]


def needs_family(family):
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on Hopper only")


class BackwardSpy:
    """Records the config of every backward kernel ops.backward launches."""

    def __init__(self, monkeypatch):
        from flashgen import ops

        self.configs = []
        original = ops.backward

        def spy(kern, *args, **kwargs):
            self.configs.append(kern.config)
            return original(kern, *args, **kwargs)

        monkeypatch.setattr(ops, "backward", spy)


# (layout, head dim, dtype): MHA at d64 in bf16, GQA at d128 in fp16
FAMILY_CASES = {"mha": (64, "bf16"), "gqa": (128, "fp16")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(examples()))
def test_examples_backward_in_both_families(name, layout, family, monkeypatch):
    """Every example's dq, dk, dv with arch= each family (forward and backward of that family; sm90: the sm90
    backward where it builds the call, which it does for every example here) against float64 autograd, into
    NaN-poisoned buffers."""
    needs_family(family)
    heads, heads_k = LAYOUTS[layout]
    head_dim, dtype = FAMILY_CASES[layout]
    ex = examples("cuda", batch=2, heads=heads)[name]
    spy = BackwardSpy(monkeypatch)
    for i, (sq, sk) in enumerate(FAMILY_SHAPES):
        q, k, v = qkv(2, sq, sk, heads, heads_k, head_dim, dtype, seed=30 + i)
        check_grads(q, k, v, head_dim ** -0.5, ex.score_mod, ex.mask_mod, arch=family)
    assert {c.family for c in spy.configs} == {family}


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_the_sm90_backward_is_taken_on_hopper(head_dim, monkeypatch):
    """On Hopper the modifier backward is the sm90 family's without arch= (head dims 32 to 128; 256 is sm80's),
    deterministic with a block map too, and the sm80 family's with arch="sm80"."""
    needs_family("sm90")
    ex = examples("cuda", batch=2, heads=4)
    spy = BackwardSpy(monkeypatch)
    q, k, v = qkv(2, 113, 211, 4, 2, head_dim, "bf16", seed=head_dim)
    for name in ("relative_bias", "softcap_document", "causal"):
        check_grads(q, k, v, head_dim ** -0.5, ex[name].score_mod, ex[name].mask_mod)
    assert {c.family for c in spy.configs} == {"sm90" if head_dim != 256 else "sm80"}
    spy.configs.clear()
    check_grads(q, k, v, head_dim ** -0.5, ex["document"].score_mod, ex["document"].mask_mod, arch="sm80")
    check_grads(q, k, v, head_dim ** -0.5, mask_mod=ex["document"].mask_mod, deterministic=True)
    assert [c.family for c in spy.configs] == ["sm80", "sm90" if head_dim != 256 else "sm80"]


@pytest.mark.parametrize("name, head_dim, family", [("alibi", 128, "sm90"), ("relative_bias", 64, "sm90"),
                                                    ("relative_bias", 128, "sm80")])
def test_sm90_deterministic_score_mod_is_bit_identical(name, head_dim, family, monkeypatch):
    """deterministic=True with a score_mod and no block map: the sm90 backward, its dQ reduces in key-tile order,
    where a schedule with dQ's TMA tile builds clean (a table read per score at d128 does not: sm80's backward)."""
    needs_family("sm90")
    ex = examples("cuda", batch=2, heads=8)[name]
    spy = BackwardSpy(monkeypatch)
    q, k, v = qkv(2, 1023, 517, 8, 2, head_dim, "bf16", seed=8)
    first = check_grads(q, k, v, head_dim ** -0.5, ex.score_mod, deterministic=True)
    again = check_grads(q, k, v, head_dim ** -0.5, ex.score_mod, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert {(c.family, c.deterministic) for c in spy.configs} == {(family, True)}


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_deterministic_block_maps_are_bit_identical(head_dim, monkeypatch):
    """deterministic=True with a block map in the sm90 backward (its dQ reduces take the host's turns, the map's key
    tiles not consecutive): a document mask_mod with causal, torch's random block-sparse BlockMask with rows that see
    nothing, a sliding window beside a mask_mod; GQA, odd lengths; the same bits twice and float64's gradients."""
    needs_family("sm90")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    spy = BackwardSpy(monkeypatch)
    doc = documents(2, 1023, seed=9)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    g = torch.Generator().manual_seed(11)
    blocks = (torch.rand(2, 8, -(-517 // 128), -(-1023 // 128), generator=g) < 0.4).cuda()
    blocks[1, 3, 2] = False

    def sparse(b, h, q_idx, kv_idx):
        return blocks[b, h, q_idx // 128, kv_idx // 128]

    bm = fa.BlockMask.from_kv_blocks(*kv_blocks(blocks), BLOCK_SIZE=128, seq_lengths=(517, 1023))
    def windowed(b, h, q_idx, kv_idx):  # window (200, 0) at 1023 x 517: bottom-right, so key j <= i - 506
        return same_doc(b, h, q_idx, kv_idx) & (kv_idx >= q_idx - 506 - 200) & (kv_idx <= q_idx - 506)

    calls = [((1023, 1023), dict(mask_mod=same_doc, causal=True)),
             ((517, 1023), dict(block_mask=bm, ref_mask=sparse)),
             ((1023, 517), dict(mask_mod=same_doc, window_size=(200, 0), ref_mask=windowed))]
    for i, ((sq, sk), kwargs) in enumerate(calls):
        q, k, v = qkv(2, sq, sk, 8, 2, head_dim, "bf16", seed=40 + i)
        first = check_grads(q, k, v, head_dim ** -0.5, deterministic=True, **kwargs)
        again = check_grads(q, k, v, head_dim ** -0.5, deterministic=True, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), (sq, sk, sorted(kwargs))
    assert {(c.family, c.deterministic, c.block_map) for c in spy.configs} == {("sm90", True, True)}


def test_sm90_backward_with_a_window_lse_gradient_and_tables():
    """The sm90 backward with a window beside a mask_mod and with torch's BlockMask beside a score_mod, lse's gradient
    in both (test_learnable_bias_tables runs the tables' gradients beside it on Hopper)."""
    needs_family("sm90")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    ex = examples("cuda", batch=2, heads=8)
    q, k, v = qkv(2, 211, 211, 8, 2, 128, "bf16", seed=12)
    mask = ex["document"].mask_mod

    def windowed(b, h, q_idx, kv_idx):
        return mask(b, h, q_idx, kv_idx) & (kv_idx >= q_idx - 64) & (kv_idx <= q_idx + 16)

    check_grads(q, k, v, 0.1, mask_mod=mask, window_size=(64, 16), ref_mask=windowed, with_lse=True)
    bm = fa.create_block_mask(mask, 2, None, 211, 211, device="cuda")
    check_grads(q, k, v, 0.1, ex["softcap"].score_mod, mask_mod=mask, block_mask=bm, causal=True, with_lse=True)
