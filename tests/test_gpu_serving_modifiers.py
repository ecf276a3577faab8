"""score_mod / mask_mod in attention_varlen and attention_with_kvcache on the GPU, against a float64 reference that
applies the user's own functions (test_gpu_modifiers.flex_reference) sequence by sequence: b the sequence, q_idx and
kv_idx positions within it; for a KV cache q_idx is the query's position in the cache (cache length - seqlen_q + i,
as causal aligns the queries). Odd and empty lengths, keys fewer than queries, MHA and GQA (pack_gqa in the cache),
fp16 and bf16, contiguous and paged caches, an append, split-KV; outputs poisoned with NaN. The bar is
test_gpu_modifiers': max error <= 2x the same computation's in the input dtype (+ 1e-5), LSE within 1e-3 with the
same +inf pattern."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from modifier_examples import examples  # noqa: E402
from test_gpu_modifiers import DT, LAYOUTS, flex_reference, judge  # noqa: E402

NAMES = sorted(examples())
# Packed sequences: one row, odd lengths, an empty q, keys fewer than queries (causal leaves rows without a key).
Q_LENS = (1, 17, 113, 0, 211, 64)
K_LENS = (1, 33, 113, 5, 150, 300)


def at(fn, seq: int, offset: int = 0):
    """The user's modifier seen from one sequence's reference: b is `seq`, q_idx moved by `offset`."""
    if fn is None:
        return None
    if fn.__code__.co_argcount == 5:
        return lambda s, b, h, qi, ki: fn(s, b + seq, h, qi + offset, ki)
    return lambda b, h, qi, ki: fn(b + seq, h, qi + offset, ki)


def poison(shapes, dtypes):
    """NaN into the blocks the caching allocator hands out next (the call's out and lse)."""
    junk = [torch.full(s, math.nan, dtype=dt, device="cuda") for s, dt in zip(shapes, dtypes)]
    del junk


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", sorted(DT))
@pytest.mark.parametrize("name", NAMES)
def test_varlen_against_the_reference(name, dtype, layout):
    heads, heads_k = LAYOUTS[layout]
    ex = examples("cuda", batch=len(Q_LENS), heads=heads)[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    d, scale = 64, 0.125
    q = torch.randn(sum(Q_LENS), heads, d, generator=g, device="cuda").to(DT[dtype])
    k, v = (torch.randn(sum(K_LENS), heads_k, d, generator=g, device="cuda").to(DT[dtype]) for _ in range(2))
    cu_q = [0, *torch.tensor(Q_LENS).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(K_LENS).cumsum(0).tolist()]
    for causal in (False, True):
        poison([q.shape, (heads, q.shape[0])], [q.dtype, torch.float32])
        out, lse = flashgen.attention_varlen(
            q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
            torch.tensor(cu_k, dtype=torch.int32, device="cuda"), max(Q_LENS), max(K_LENS), causal=causal,
            softmax_scale=scale, return_lse=True, score_mod=ex.score_mod, mask_mod=ex.mask_mod)
        refs, pts, lses = [], [], []
        for s in range(len(Q_LENS)):
            qs = q[cu_q[s]:cu_q[s + 1]][None]
            ks, vs = k[cu_k[s]:cu_k[s + 1]][None], v[cu_k[s]:cu_k[s + 1]][None]
            mods = (at(ex.score_mod, s), at(ex.mask_mod, s))
            ref, ref_lse = flex_reference(qs, ks, vs, scale, *mods, causal)
            refs.append(ref[0])
            lses.append(ref_lse[0])
            pts.append(flex_reference(qs, ks, vs, scale, *mods, causal, dtype=q.dtype)[0][0])
        judge(out, lse, torch.cat(refs), torch.cat(pts), torch.cat(lses, dim=1))


def test_varlen_with_modifiers_refuses_a_backward_and_a_block_mask():
    q = torch.randn(10, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(10, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    causal = examples("cuda")["causal"].mask_mod
    with pytest.raises(NotImplementedError, match="forward only"):
        flashgen.attention_varlen(q, k, k, cu, cu, 6, 6, mask_mod=causal)
    with pytest.raises(NotImplementedError, match="takes no block_mask"):
        flashgen.attention_varlen(q.detach(), k, k, cu, cu, 6, 6, block_mask=object())


CACHE_LENS = (17, 200, 511)  # at least seqlen_q: every query has a position in its cache


def cache(batch, capacity, heads_k, d, dtype, page_size, g):
    """(k_cache, v_cache, block_table or None, contiguous view maker): contiguous (batch, capacity, ...) or paged
    (pages, page_size, ...) through a shuffled block table."""
    if not page_size:
        kc, vc = (torch.randn(batch, capacity, heads_k, d, generator=g, device="cuda").to(dtype) for _ in range(2))
        return kc, vc, None, lambda t: t
    per = capacity // page_size
    kc, vc = (torch.randn(batch * per, page_size, heads_k, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    table = torch.randperm(batch * per, generator=torch.Generator().manual_seed(1)).view(batch, per)
    table = table.to(torch.int32).cuda()
    return kc, vc, table, lambda t: t[table.long()].reshape(batch, capacity, heads_k, d)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", sorted(DT))
@pytest.mark.parametrize("name", NAMES)
def test_kvcache_against_the_reference(name, dtype, layout, paged):
    heads, heads_k = LAYOUTS[layout]
    batch, capacity, d, scale = len(CACHE_LENS), 512, 64, 0.125
    ex = examples("cuda", batch=batch, heads=heads)[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    for seqlen_q, append, causal, splits in ((1, 0, False, 0), (4, 0, True, 0), (17, 0, True, 4), (3, 3, True, 0),
                                             (5, 2, False, 3)):
        kc, vc, table, contiguous = cache(batch, capacity, heads_k, d, DT[dtype], 16 if paged else 0, g)
        q = torch.randn(batch, seqlen_q, heads, d, generator=g, device="cuda").to(DT[dtype])
        lens = torch.tensor([n - append for n in CACHE_LENS], dtype=torch.int32, device="cuda")
        new = [torch.randn(batch, append, heads_k, d, generator=g, device="cuda").to(DT[dtype]) for _ in range(2)]
        poison([q.shape, (batch, heads, seqlen_q)], [q.dtype, torch.float32])
        out, lse = flashgen.attention_with_kvcache(
            q, kc, vc, *(new if append else (None, None)), cache_seqlens=lens, block_table=table, causal=causal,
            softmax_scale=scale, num_splits=splits, return_lse=True, score_mod=ex.score_mod, mask_mod=ex.mask_mod)
        keys, values = contiguous(kc), contiguous(vc)  # after the append, as the call attended
        refs, pts, lses = [], [], []
        for b, n in enumerate(CACHE_LENS):
            mods = (at(ex.score_mod, b, n - seqlen_q), at(ex.mask_mod, b, n - seqlen_q))
            args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n], scale, *mods, causal)
            ref, ref_lse = flex_reference(*args)
            refs.append(ref)
            lses.append(ref_lse)
            pts.append(flex_reference(*args, dtype=q.dtype)[0])
        judge(out, lse, torch.cat(refs), torch.cat(pts), torch.cat(lses))


def test_kvcache_query_positions_follow_the_cache_length():
    """A mask on the query's position alone: the rows of a cache of L keys are at L - seqlen_q + i, so a mask
    keeping positions >= 300 empties exactly the rows below it (O = 0, LSE = +inf)."""
    q = torch.randn(2, 4, 4, 64, device="cuda", dtype=torch.float16)
    kc = torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.float16)
    lens = torch.tensor([302, 500], dtype=torch.int32, device="cuda")
    out, lse = flashgen.attention_with_kvcache(q, kc, kc, cache_seqlens=lens, return_lse=True,
                                               mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= 300)
    # sequence 0: positions 298, 299, 300, 301; sequence 1: 496..499
    assert torch.isinf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all() and torch.isfinite(lse[1]).all()
    assert (out[0, :2] == 0).all()
