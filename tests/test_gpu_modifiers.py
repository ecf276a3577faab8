"""score_mod / mask_mod on the GPU: each of FlexAttention's example modifiers through flashgen.attention against a
float64 reference that applies the user's own Python function to the score matrix (score_mod on q.k * scale,
mask_mod to -inf), at odd and unequal lengths, MHA and GQA, fp16 and bf16, head dims 64 to 256, into outputs
poisoned with NaN; and against torch.nn.attention.flex_attention on the same inputs where torch has it. The bar
is flash-attention's: max error <= 2x the error of the same computation in the input dtype (+ 1e-5); LSE within
1e-3 with the same +inf pattern (a row that keeps no key: O = 0, LSE = +inf)."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from modifier_examples import examples  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = {"mha": (4, 4), "gqa": (8, 2)}
LSE_TOL = 1e-3
# (seqlen_q, seqlen_k): length 1, odd, unequal both ways; 1023 x 1023 crosses many key tiles.
SHAPES = [(1, 1), (17, 17), (113, 211), (211, 113), (1, 1023), (1023, 1023)]


def modified_scores(q, k, scale, score_mod=None, mask_mod=None, causal=False):
    """The scaled scores (batch, heads, seqlen_q, seqlen_k) of q (batch, seqlen_q, heads, d) against k (batch,
    seqlen_k, heads_k, d), in q's dtype, with the user's score_mod applied on broadcast index grids and -inf where
    mask_mod or causal drops a key (also the backward tests' reference)."""
    batch, sq, heads, _ = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    qf = q.transpose(1, 2)
    kf = k.repeat_interleave(heads // heads_k, dim=2).transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)) * scale
    dev = q.device
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(sq, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(sk, device=dev).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).to(q.dtype).expand(batch, heads, sq, sk)
    keep = torch.ones(batch, heads, sq, sk, dtype=torch.bool, device=dev)
    if mask_mod is not None:
        keep = keep & mask_mod(b, h, qi, ki)
    if causal:
        keep = keep & (ki <= qi + sk - sq)
    return s.masked_fill(~keep, -math.inf)


def flex_reference(q, k, v, scale, score_mod=None, mask_mod=None, causal=False, dtype=torch.float64):
    """(out (batch, seqlen_q, heads, d), lse (batch, heads, seqlen_q)) computed in `dtype` (float64: the reference;
    the input dtype: PyTorch's own error), the user's functions applied on broadcast index grids."""
    batch, sq, heads, _ = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    s = modified_scores(q.to(dtype), k.to(dtype), scale, score_mod, mask_mod, causal)
    vf = v.to(dtype).repeat_interleave(heads // heads_k, dim=2).transpose(1, 2)
    m = s.amax(-1, keepdim=True) if sk else torch.full((batch, heads, sq, 1), -math.inf, device=q.device, dtype=dtype)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = torch.where(l > 0, (p @ vf) / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(l))
    lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))), torch.full_like(l, math.inf))
    return out.transpose(1, 2), lse.squeeze(-1)


def poison_allocator(q):
    """NaN into the blocks the caching allocator hands out next for out and lse: an element the kernel does not
    write shows up as NaN."""
    b, sq, h, _ = q.shape
    junk = (torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device),
            torch.full((b, h, sq), math.nan, dtype=torch.float32, device=q.device))
    del junk


def check(q, k, v, scale, score_mod, mask_mod, causal=False, ref_mask=None, **kwargs):
    """flashgen.attention against the float64 reference; ref_mask: the reference's mask where the call adds one of
    its own (window_size)."""
    poison_allocator(q)
    out, lse = flashgen.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, score_mod=score_mod,
                                  mask_mod=mask_mod, **kwargs)
    ref_mask = mask_mod if ref_mask is None else ref_mask
    ref, ref_lse = flex_reference(q, k, v, scale, score_mod, ref_mask, causal)
    pt, _ = flex_reference(q, k, v, scale, score_mod, ref_mask, causal, dtype=q.dtype)
    judge(out, lse, ref, pt, ref_lse)
    return out


def judge(out, lse, ref, pt, ref_lse):
    """out and lse against the float64 reference `ref`, `ref_lse`: no NaN, out within 2x the error of the same math
    in the input dtype (`pt`) + 1e-5, the same +inf pattern of LSE and its finite values within LSE_TOL."""
    assert not torch.isnan(out).any(), "NaN in output (an unwritten or poisoned element)"
    bound = 2 * (pt.double() - ref).abs().max().item() + 1e-5
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), "LSE +inf pattern differs from the reference"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        lerr = (lse.double()[fin] - ref_lse[fin]).abs().max().item()
        assert lerr <= LSE_TOL, f"LSE error {lerr:.3g}"


def qkv(batch, sq, sk, heads, heads_k, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(batch, n, hh, d, generator=g, device="cuda").to(DT[dtype])
                 for n, hh in ((sq, heads), (sk, heads_k), (sk, heads_k)))


NAMES = sorted(examples())
# The forward's template family (attention's arch=): sm80's serving kernel everywhere; sm90's own on Hopper.
FAMILIES = ["sm80", "sm90"]


def needs_family(family):
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on Hopper only")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", sorted(DT))
@pytest.mark.parametrize("name", NAMES)
def test_examples_against_the_reference(name, dtype, layout, family):
    needs_family(family)
    heads, heads_k = LAYOUTS[layout]
    ex = examples("cuda", batch=2, heads=heads)[name]
    for i, (sq, sk) in enumerate(SHAPES):
        q, k, v = qkv(2, sq, sk, heads, heads_k, 64, dtype, seed=i)
        check(q, k, v, 64 ** -0.5, ex.score_mod, ex.mask_mod, arch=family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head_dim", [96, 128, 256])
@pytest.mark.parametrize("name", ["alibi_causal", "softcap_document", "relative_bias", "prefix_lm"])
def test_head_dims(name, head_dim, family):
    needs_family(family)
    ex = examples("cuda", batch=2, heads=4)[name]
    for i, (sq, sk) in enumerate([(17, 113), (1023, 1023)]):
        q, k, v = qkv(2, sq, sk, 4, 2, head_dim, "bf16", seed=i)
        check(q, k, v, head_dim ** -0.5, ex.score_mod, ex.mask_mod, arch=family)


# The sm90 modifier kernel's schedules (kernels.serving.SM90_MODIFIER_SCHEDULES): the rule's choice, and each one
# forced (S rewritten in place after its wgmma, or read by the softmax beside the previous tile's P V).
SCHEDULES = {"chosen": None, "in_order": (), "overlap": (("overlap", True), ("pingpong", True)),
             "persistent": (("overlap", True), ("pingpong", True), ("persistent", True))}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("dtype", sorted(DT))
def test_sm90_forward_is_taken_and_agrees(dtype, schedule, monkeypatch):
    """On Hopper a dense modifier call with arch="sm90" takes the sm90 family's forward; it agrees with the reference at
    softmax scales the score_mod sees signed (negative, zero), causal and a window beside a mask_mod, a BlockMask,
    and captured tables, in either schedule; without arch too (arch="sm80" keeps the sm80 family)."""
    from flashgen import ops
    from flashgen.checks import Mods
    from flashgen.kernels import serving
    from flashgen.modifiers import trace_mask_mod, trace_score_mod

    needs_family("sm90")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    if SCHEDULES[schedule] is not None:  # 64 keys: every example builds without spills in both schedules
        monkeypatch.setattr(serving, "SM90_MODIFIER_SCHEDULES", {d: ((64, SCHEDULES[schedule]),) for d in (64, 128)})
    ex = examples("cuda", batch=2, heads=8)
    mods = Mods(score_mod=trace_score_mod(ex["relative_bias"].score_mod),
                mask_mod=trace_mask_mod(ex["document"].mask_mod))
    cfg = ops.modifier_kernel(0, 128, dtype, False, 1023, 4, mods, "sm90")
    assert cfg.family == "sm90" and (SCHEDULES[schedule] is None or cfg.overlap == bool(SCHEDULES[schedule]))
    assert cfg.persistent == (schedule == "persistent")
    assert ops.modifier_kernel(0, 128, dtype, False, 1023, 4, mods).family == "sm90"
    assert ops.modifier_kernel(0, 128, dtype, False, 1023, 4, mods, "sm80").family == "sm80"
    for i, (sq, sk) in enumerate([(1, 1023), (113, 211), (1023, 1023), (1023, 517)]):
        for d in (64, 128):
            q, k, v = qkv(2, sq, sk, 8, 2, d, dtype, seed=i)
            for scale in (0.1, -0.1, 0.0):
                check(q, k, v, scale, ex["alibi"].score_mod, None, arch="sm90")
            check(q, k, v, 0.1, ex["relative_bias"].score_mod, ex["document"].mask_mod, causal=True, arch="sm90")
            prefix = ex["prefix_lm"].mask_mod

            def windowed_prefix(b, h, q_idx, kv_idx, shift=sk - sq):  # window_size=(300, 0), bottom-right aligned
                return prefix(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + shift) & (kv_idx >= q_idx + shift - 300)

            check(q, k, v, 0.1, ex["softcap"].score_mod, prefix, window_size=(300, 0), ref_mask=windowed_prefix,
                  arch="sm90")
            check(q, k, v, 0.1, None, ex["sliding_window"].mask_mod, arch="sm90")
            bm = fa.create_block_mask(ex["prefix_lm"].mask_mod, 2, None, sq, sk, device="cuda")
            check(q, k, v, 0.1, ex["relative_bias"].score_mod, ex["prefix_lm"].mask_mod, block_mask=bm, arch="sm90")


def test_scales_and_other_modifiers_combine():
    ex = examples("cuda", batch=2, heads=4)
    q, k, v = qkv(2, 113, 211, 4, 4, 64, "fp16")
    for scale in (0.3, 0.0, -0.2):  # the score the modifier sees is q.k * scale, sign included
        check(q, k, v, scale, ex["alibi"].score_mod, ex["document"].mask_mod)
    check(q, k, v, 0.125, ex["relative_bias"].score_mod, ex["prefix_lm"].mask_mod, causal=True)  # bottom-right causal
    # a mask_mod with the built-in softcap and window (bottom-right aligned, as flash_attn's): checked against the
    # same written as a score_mod and a mask_mod; softcap's tanh must not undo the mask_mod's -inf
    doc, shift = ex["document"].mask_mod, 211 - 113
    out, lse = flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=doc, window_size=(50, 10), softcap=15.0,
                                  return_lse=True)
    ref, ref_lse = flex_reference(q, k, v, 0.125, lambda s, b, h, qi, ki: 15.0 * torch.tanh(s / 15.0),
                                  lambda b, h, qi, ki: doc(b, h, qi, ki) & (ki >= qi + shift - 50) & (ki <= qi + shift + 10))
    assert (out.double() - ref).abs().max().item() < 2e-2 and not torch.isnan(out).any()
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    with pytest.raises(ValueError, match="does not combine"):
        flashgen.attention(q, k, v, score_mod=ex["alibi"].score_mod, softcap=30.0)


def test_captured_tensors_are_read_at_each_call():
    q, k, v = qkv(1, 64, 64, 2, 2, 64, "bf16")
    bias = torch.zeros(64, device="cuda")

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    first = flashgen.attention(q, k, v, score_mod=mod)
    bias[:32] = -1e4  # in place: the same kernel and slot, new values
    second = check(q, k, v, 64 ** -0.5, mod, None)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", sorted(DT))
def test_against_flex_attention(dtype):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    ex = examples("cuda", batch=2, heads=8)
    for name in NAMES:
        for sq, sk in ((113, 113), (128, 256)):
            q, k, v = qkv(2, sq, sk, 8, 2, 64, dtype)
            e = ex[name]
            scale = 0.125
            ours = flashgen.attention(q, k, v, softmax_scale=scale, score_mod=e.score_mod, mask_mod=e.mask_mod)
            block_mask = (fa.create_block_mask(e.mask_mod, 2, 8, sq, sk, device="cuda")
                          if e.mask_mod is not None else None)
            theirs = fa.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=e.score_mod,
                                       block_mask=block_mask, scale=scale, enable_gqa=True).transpose(1, 2)
            ref, _ = flex_reference(q, k, v, scale, e.score_mod, e.mask_mod)
            kept = ref.abs().sum(-1) > 0  # flex_attention's rows with no key are 0 too, or NaN in older torch
            diff = (ours.double() - theirs.double()).abs()[kept].max().item()
            bound = 2 * ((theirs.double() - ref).abs()[kept].max().item() + (ours.double() - ref).abs().max().item())
            assert diff <= bound + 1e-5, f"{name} {sq}x{sk}: flashgen vs flex_attention {diff:.3g} > {bound:.3g}"


# -- block maps: empty key tiles skipped, full ones unmasked (flashgen.blockmap) ---------------------------------

BLOCK_SHAPES = [(1, 1), (17, 17), (113, 211), (211, 113), (1023, 1023), (1, 1023)]


def documents(batch, length, seed, mean=150):
    """Document ids (batch, length) int32 on the GPU: runs of random lengths around `mean`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, length, generator=g) < 1.0 / mean).cumsum(1).to(torch.int32).cuda()


def kv_blocks(dense_blocks):
    """BlockMask.from_kv_blocks' (kv_num_blocks, kv_indices) of a dense (B, H, QB, KB) bool block pattern."""
    num = dense_blocks.sum(-1).to(torch.int32)
    idx = torch.argsort((~dense_blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", sorted(DT))
def test_document_mask_with_and_without_a_block_mask(dtype, layout):
    """A captured document-id tensor: the map flashgen builds from the mask_mod, and torch's BlockMask of it (at its
    default 128 blocks and at 64 x 256), causal or not: every key tile outside a row block's documents is skipped."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    heads, heads_k = LAYOUTS[layout]
    for i, (sq, sk) in enumerate(BLOCK_SHAPES):
        doc = documents(2, max(sq, sk), seed=i)

        def same_doc(b, h, q_idx, kv_idx):
            return doc[b, q_idx] == doc[b, kv_idx]

        q, k, v = qkv(2, sq, sk, heads, heads_k, 64, dtype, seed=i)
        check(q, k, v, 0.125, None, same_doc)  # flashgen's own map
        check(q, k, v, 0.125, None, same_doc, causal=True)
        for block in (128, (64, 256)):
            bm = fa.create_block_mask(same_doc, 2, None, sq, sk, device="cuda", BLOCK_SIZE=block)
            check(q, k, v, 0.125, None, same_doc, block_mask=bm)
            check(q, k, v, 0.125, None, same_doc, causal=True, block_mask=bm)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_random_block_sparse_masks(layout):
    """Random block-sparse patterns, rows whose every block is empty included (O = 0, LSE = +inf): as a mask_mod over
    a captured block table, and as a BlockMask of kv blocks with no mask_mod at all (flex_attention's noop_mask:
    its listed blocks are kept whole, the others skipped)."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    heads, heads_k = LAYOUTS[layout]
    g = torch.Generator().manual_seed(5)
    for i, (sq, sk) in enumerate(BLOCK_SHAPES):
        qb, kb = -(-sq // 128), -(-sk // 128)
        blocks = (torch.rand(2, heads, qb, kb, generator=g) < 0.45).cuda()
        blocks[0, 0, 0] = False  # a row block that sees nothing

        def sparse(b, h, q_idx, kv_idx):
            return blocks[b, h, q_idx // 128, kv_idx // 128]

        q, k, v = qkv(2, sq, sk, heads, heads_k, 64, "bf16", seed=i)
        check(q, k, v, 0.125, None, sparse)
        num, idx = kv_blocks(blocks)
        bm = fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(sq, sk))
        poison_allocator(q)
        out, lse = flashgen.attention(q, k, v, softmax_scale=0.125, block_mask=bm, return_lse=True)
        ref, ref_lse = flex_reference(q, k, v, 0.125, None, sparse)
        pt, _ = flex_reference(q, k, v, 0.125, None, sparse, dtype=q.dtype)
        assert not torch.isnan(out).any()
        assert (out.double() - ref).abs().max().item() <= 2 * (pt.double() - ref).abs().max().item() + 1e-5
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
        fin = torch.isfinite(ref_lse)
        if fin.any():
            assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= LSE_TOL


def test_block_mask_with_a_score_mod_and_head_dims():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    ex = examples("cuda", batch=2, heads=4)
    for d in (96, 128, 256):
        q, k, v = qkv(2, 1023, 517, 4, 2, d, "fp16", seed=d)
        mask = ex["prefix_lm"].mask_mod
        bm = fa.create_block_mask(mask, 2, 4, 1023, 517, device="cuda")
        check(q, k, v, d ** -0.5, ex["alibi"].score_mod, mask, block_mask=bm)


def test_block_mask_refusals():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    ex = examples("cuda", batch=2, heads=4)
    q, k, v = qkv(2, 113, 211, 4, 2, 64, "bf16")
    bm = fa.create_block_mask(ex["causal"].mask_mod, 2, 4, 113, 200, device="cuda")
    with pytest.raises(ValueError, match="113 queries x 200 keys"):
        flashgen.attention(q, k, v, block_mask=bm)
    bm = fa.create_block_mask(ex["causal"].mask_mod, 2, 4, 113, 211, device="cuda")
    with pytest.raises(ValueError, match="differs"):
        flashgen.attention(q, k, v, block_mask=bm, mask_mod=ex["document"].mask_mod)


@pytest.mark.parametrize("dtype", sorted(DT))
def test_block_masks_against_flex_attention(dtype):
    """The same BlockMask given to flashgen.attention and to flex_attention: a document mask (captured ids) and a
    random block-sparse BlockMask without a mask_mod, GQA."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(7)
    for sq, sk in ((113, 113), (256, 384), (1023, 1023)):
        doc = documents(2, max(sq, sk), seed=sq)

        def same_doc(b, h, q_idx, kv_idx):
            return doc[b, q_idx] == doc[b, kv_idx]

        blocks = (torch.rand(2, 8, -(-sq // 128), -(-sk // 128), generator=g) < 0.5).cuda()
        blocks[..., 0] = True  # flex_attention's rows with no key are NaN in some versions: keep one block a row
        num, idx = kv_blocks(blocks)

        def sparse(b, h, q_idx, kv_idx):
            return blocks[b, h, q_idx // 128, kv_idx // 128]

        cases = [(fa.create_block_mask(same_doc, 2, None, sq, sk, device="cuda"), same_doc),
                 (fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(sq, sk)), sparse)]
        q, k, v = qkv(2, sq, sk, 8, 2, 64, dtype)
        for bm, mask in cases:
            ours = flashgen.attention(q, k, v, softmax_scale=0.125, block_mask=bm)
            theirs = fa.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                                       scale=0.125, enable_gqa=True).transpose(1, 2)
            ref, _ = flex_reference(q, k, v, 0.125, None, mask)
            kept = ref.abs().sum(-1) > 0
            diff = (ours.double() - theirs.double()).abs()[kept].max().item()
            bound = 2 * ((theirs.double() - ref).abs()[kept].max().item() + (ours.double() - ref).abs().max().item())
            assert diff <= bound + 1e-5, f"{sq}x{sk}: flashgen vs flex_attention {diff:.3g} > {bound:.3g}"


def test_empty_tiles_are_skipped_even_where_the_mask_mod_keeps_scores():
    """A BlockMask listing only the diagonal blocks of a causal mask_mod: the keys of the unlisted blocks, which the
    mask_mod would keep, are not attended to (flex_attention's semantics): the kernel never visits those tiles."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    causal = examples("cuda")["causal"].mask_mod
    for sq in (113, 1023):
        nb = -(-sq // 128)
        diagonal = torch.eye(nb, dtype=torch.bool, device="cuda").expand(2, 4, nb, nb).contiguous()
        num, idx = kv_blocks(diagonal)
        bm = fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, mask_mod=causal, seq_lengths=(sq, sq))
        q, k, v = qkv(2, sq, sq, 4, 2, 64, "fp16", seed=sq)

        def banded(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx // 128 == kv_idx // 128)

        poison_allocator(q)
        out, lse = flashgen.attention(q, k, v, softmax_scale=0.125, block_mask=bm, return_lse=True)
        ref, ref_lse = flex_reference(q, k, v, 0.125, None, banded)
        pt, _ = flex_reference(q, k, v, 0.125, None, banded, dtype=q.dtype)
        assert (out.double() - ref).abs().max().item() <= 2 * (pt.double() - ref).abs().max().item() + 1e-5
        assert (lse.double() - ref_lse).abs().max().item() <= LSE_TOL


def test_a_mask_mods_map_follows_its_tensors():
    """The map built from a mask_mod is reused between calls and rebuilt when its captured tensor is written in
    place: the second call sees the new documents."""
    q, k, v = qkv(2, 700, 700, 4, 2, 64, "bf16")
    doc = documents(2, 700, seed=3, mean=300)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    check(q, k, v, 0.125, None, same_doc)
    check(q, k, v, 0.125, None, same_doc)  # the cached map
    doc.copy_(documents(2, 700, seed=4, mean=40))  # many more, shorter documents: tiles the old map kept go empty
    check(q, k, v, 0.125, None, same_doc)


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_the_lse_of_a_long_row_does_not_drift(family):
    """Five queries against 262,144 keys (2,048 key tiles walked by one row block), plain and with a score_mod whose
    largest scores come first: the LSE stays within 1e-4 of float64. A rescale factor that is not exactly 1 for a max
    that did not move (the rounding of m * scale_log2 fused away) drifts l by it tile after tile: 2e-3 here."""
    needs_family(family)
    n = 1 << 18
    q, k, v = qkv(1, 5, n, 2, 2, 64, "bf16", seed=3)
    late = lambda s, b, h, q_idx, kv_idx: s + torch.where(kv_idx >= n - 25, 20.0, 0.0)  # noqa: E731
    for mod in (None, late, lambda s, b, h, q_idx, kv_idx: s * 1.0):
        out, lse = flashgen.attention(q, k, v, softmax_scale=0.125, return_lse=True, score_mod=mod, arch=family)
        ref, ref_lse = flex_reference(q, k, v, 0.125, mod)
        pt, _ = flex_reference(q, k, v, 0.125, mod, dtype=q.dtype)
        judge(out, lse, ref, pt, ref_lse)
        assert (lse.double() - ref_lse).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_calls_by_their_plan_agree(family):
    """A call that repeats a signature runs by its plan (api's routes): into poisoned outputs, the same bits as the
    first call's full path, each within the reference's bar; with a gradient wanted too."""
    from flashgen import api

    needs_family(family)
    q, k, v = qkv(2, 1023, 1023, 8, 2, 128, "bf16", seed=9)
    doc = documents(2, 1023, seed=5, mean=200)
    bias = torch.randn(1023, device="cuda")

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    api._mod_routes.clear()
    first = check(q, k, v, 0.1, biased, same_doc, arch=family)
    assert len(api._mod_routes) == 1 and next(iter(api._mod_routes.values())).plan.config.family == family
    for _ in range(2):
        assert torch.equal(check(q, k, v, 0.1, biased, same_doc, arch=family), first)
    assert len(api._mod_routes) == 1
    qg = q.clone().requires_grad_(True)
    grads = []
    for _ in range(2):  # the full path, then the plan, through autograd
        out = flashgen.attention(qg, k, v, softmax_scale=0.1, score_mod=biased, mask_mod=same_doc, arch=family)
        assert torch.equal(out.detach(), first)
        grads.append(torch.autograd.grad(out, qg, torch.ones_like(out))[0])
    assert torch.isfinite(grads[0]).all()  # dQ is summed by atomics: the same up to their order
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-2 * grads[0].abs().max().item()
