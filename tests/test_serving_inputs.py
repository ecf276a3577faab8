"""Every argument check of attention_varlen and attention_with_kvcache, without a GPU: the checks run before
anything is launched, on meta tensors (shapes, dtypes, strides and devices without data). The checks that
read values back (offsets, cache lengths, page numbers) take CPU tensors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen import api, checks  # noqa: E402
from flashgen import attention_varlen, attention_with_kvcache  # noqa: E402

BF16 = torch.bfloat16


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def offsets(*vals, device="meta"):
    return torch.tensor(vals, dtype=torch.int32).to(device)


def varlen(q=None, k=None, v=None, cu_q=None, cu_k=None, max_q=4, max_k=4, **kw):
    """attention_varlen on a valid packed batch of two sequences (4 + 4 rows, GQA 8:2), with the given
    arguments replaced; validate=False unless given (the offsets of meta tensors cannot be read back)."""
    q = meta(8, 8, 64) if q is None else q
    k = meta(8, 2, 64) if k is None else k
    v = k if v is None else v
    cu_q = offsets(0, 4, 8) if cu_q is None else cu_q
    cu_k = offsets(0, 4, 8) if cu_k is None else cu_k
    return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **{"validate": False, **kw})


def kvcache(q=None, kc=None, vc=None, **kw):
    """attention_with_kvcache of a valid decode step (batch 2, cache of 64, GQA 8:2), with arguments replaced."""
    q = meta(2, 1, 8, 64) if q is None else q
    kc = meta(2, 64, 2, 64) if kc is None else kc
    vc = kc if vc is None else vc
    kw.setdefault("cache_seqlens", offsets(10, 20))
    return attention_with_kvcache(q, kc, vc, **{"validate": False, **kw})


def test_a_valid_meta_varlen_call_passes_the_checks():
    """The baseline every case below breaks one argument of: the checks pass and the fake operator answers."""
    out = varlen()
    assert out.shape == (8, 8, 64) and out.is_meta


# -- tensors: rank, dtype, device, layout -------------------------------------------------------------------------

@pytest.mark.parametrize("call, err, match", [
    (lambda: varlen(q=meta(8, 64)), ValueError,
     r"q must be a 3-d torch tensor \(total, heads, head_dim\); got \(8, 64\)"),
    (lambda: varlen(k=[[1.0]]), ValueError, r"k must be a 3-d torch tensor"),
    (lambda: varlen(q=meta(8, 8, 64, dtype=torch.float32)), TypeError, r"q has dtype torch.float32; supported"),
    (lambda: varlen(k=meta(8, 2, 64, dtype=torch.float16)), TypeError, r"k has dtype torch.float16; q has bf16"),
    (lambda: varlen(k=torch.empty(8, 2, 64, dtype=BF16)), ValueError, r"^k is on cpu; flashgen runs on CUDA tensors"),
    (lambda: varlen(q=meta(8, 64, 8).transpose(1, 2)), ValueError, r"q must be contiguous in its last dim"),
    (lambda: varlen(k=meta(8, 2, 66)[..., :64]), ValueError, r"k needs a 16-byte aligned base and strides that are "
                                                             r"multiples of 8 elements"),
    (lambda: kvcache(q=meta(2, 1, 8)), ValueError, r"q must be a 4-d torch tensor \(batch, rows, heads, head_dim\)"),
    (lambda: kvcache(vc=meta(2, 64, 2, 64, dtype=torch.float16)), TypeError, r"v_cache has dtype torch.float16"),
])
def test_tensor_checks(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("fn", ["varlen", "kvcache"])
def test_cpu_tensors_are_refused_once_naming_the_device(fn):
    """CPU tensors: one clause naming the device and what is needed, not 'q is on cpu; q is on cpu'."""
    with pytest.raises(ValueError) as e:
        if fn == "varlen":
            attention_varlen(torch.zeros(8, 8, 64, dtype=BF16), torch.zeros(8, 2, 64, dtype=BF16),
                             torch.zeros(8, 2, 64, dtype=BF16), offsets(0, 4, 8, device="cpu"),
                             offsets(0, 4, 8, device="cpu"), 4, 4)
        else:
            attention_with_kvcache(torch.zeros(2, 1, 8, 64, dtype=BF16), torch.zeros(2, 64, 2, 64, dtype=BF16),
                                   torch.zeros(2, 64, 2, 64, dtype=BF16), cache_seqlens=5)
    msg = str(e.value)
    assert msg.startswith("q is on cpu") and msg.count("cpu") == 1 and "CUDA" in msg


# -- heads and head dims ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: varlen(q=meta(8, 8, 44), k=meta(8, 2, 44)), r"head_dim=44 is not supported: a head dim must be a "
                                                         r"multiple of 8 from 8 to 256"),
    (lambda: varlen(v=meta(8, 2, 264)), r"v's head_dim=264 is not supported: a head dim must be a multiple of 8"),
    (lambda: varlen(k=meta(8, 2, 128)), r"q and k must share head_dim; got 64 and 128 \(v may differ\)"),
    (lambda: kvcache(kc=meta(2, 64, 2, 72), vc=meta(2, 64, 2, 72)), r"q and k_cache must share head_dim; got 64 "
                                                                    r"and 72 \(v_cache may differ\)"),
    (lambda: kvcache(q=meta(2, 1, 8, 72), kc=meta(2, 64, 2, 72), vc=meta(2, 32, 2, 72)),
     r"k_cache and v_cache must have the same shape but for the head dim"),
    (lambda: varlen(k=meta(8, 3, 64)), r"heads=8 must be a multiple of heads_k=3"),
    (lambda: varlen(k=meta(8, 0, 64)), r"heads=8 must be a multiple of heads_k=0"),
    (lambda: varlen(v=meta(6, 2, 64)), r"v must have k's shape \(8, 2, 64\); got \(6, 2, 64\)"),
    (lambda: kvcache(kc=meta(2, 64, 3, 64)), r"heads=8 must be a multiple of heads_k=3"),
    (lambda: kvcache(vc=meta(2, 32, 2, 64)), r"v_cache must have k_cache's shape \(2, 64, 2, 64\)"),
])
def test_head_checks(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- varlen offsets -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, err, match", [
    (lambda: varlen(cu_q=offsets(0, 4, 8).view(3, 1)), ValueError, r"cu_seqlens_q must be a 1-d int32 tensor"),
    (lambda: varlen(cu_q=[0, 4, 8]), ValueError, r"cu_seqlens_q must be a 1-d int32 tensor"),
    (lambda: varlen(cu_q=offsets(0, 4, 8).long()), TypeError, r"cu_seqlens_q must be a torch.int32 tensor, not "
                                                              r"torch.int64"),
    (lambda: varlen(cu_k=[0, 4, 8]), TypeError, r"cu_seqlens_k must be a torch.int32 tensor, not list"),
    (lambda: varlen(cu_k=offsets(0, 4, 8, device="cpu")), ValueError, r"cu_seqlens_k is on cpu; q is on meta"),
    (lambda: varlen(cu_k=offsets(0, 8)), ValueError, r"cu_seqlens_k must have shape \(3,\); got \(2,\)"),
    (lambda: varlen(cu_k=offsets(0, 9, 4, 9, 8, 9)[::2]), ValueError, r"cu_seqlens_k must be contiguous"),
    (lambda: varlen(max_q=-1), ValueError, r"max_seqlen_q and max_seqlen_k must be >= 0"),
    (lambda: varlen(max_k=-1), ValueError, r"max_seqlen_q and max_seqlen_k must be >= 0"),
])
def test_offset_argument_checks(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("vals, total, max_len, match", [
    ((1, 4, 8), 8, 4, r"cu_seqlens_q must run from 0 to 8 \(the packed length\); got 1 \.\. 8"),
    ((0, 4, 7), 8, 4, r"must run from 0 to 8 \(the packed length\); got 0 \.\. 7"),
    ((0, 6, 4, 8), 8, 6, r"cu_seqlens_q must be non-decreasing"),
    ((0, 5, 8), 8, 4, r"a sequence of 5 tokens is longer than max_seqlen \(4\) for cu_seqlens_q"),
])
def test_offset_values_are_read_back_and_checked(vals, total, max_len, match):
    """validate=True reads the offsets back (one small copy) before any launch."""
    with pytest.raises(ValueError, match=match):
        checks.check_offsets(offsets(*vals, device="cpu"), "cu_seqlens_q", total, max_len)
    checks.check_offsets(offsets(0, 4, 8, device="cpu"), "cu_seqlens_q", 8, 4)  # sound offsets pass


# -- score modifiers ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, err, match", [
    (dict(window_size=5), ValueError, r"window_size must be a pair \(left, right\) of ints, -1 for unbounded; got 5"),
    (dict(window_size=("a", 1)), ValueError, r"window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size entries are >= 0, or -1 for unbounded; got \(-2, 0\)"),
    (dict(softcap=-1.0), ValueError, r"softcap must be >= 0 \(0: off\); got -1.0"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be >= 0"),
    (dict(alibi_slopes=meta(8, dtype=BF16)), TypeError, r"alibi_slopes must be a torch.float32 tensor"),
    (dict(alibi_slopes=[0.5] * 8), TypeError, r"alibi_slopes must be a torch.float32 tensor"),
    (dict(alibi_slopes=meta(4, dtype=torch.float32)), ValueError, r"alibi_slopes must have shape \(8,\) or \(2, 8\); "
                                                                  r"got \(4,\)"),
    (dict(alibi_slopes=torch.ones(8)), ValueError, r"alibi_slopes must be on q's device and contiguous"),
    (dict(alibi_slopes=meta(8, 2, dtype=torch.float32).t()), ValueError, r"alibi_slopes must be on q's device and "
                                                                         r"contiguous in its last dim"),
])
@pytest.mark.parametrize("fn", [varlen, kvcache])
def test_modifier_checks(fn, kw, err, match):
    with pytest.raises(err, match=match):
        fn(**kw)


# -- KV caches ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, err, match", [
    (lambda: kvcache(kc=meta(3, 64, 2, 64)), ValueError, r"k_cache must have q's batch 2 \(or pass block_table"),
    (lambda: kvcache(cache_seqlens=offsets(1, 2, 3)), ValueError, r"cache_seqlens must have shape \(2,\); got \(3,\)"),
    (lambda: kvcache(cache_seqlens=offsets(1, 2).long()), TypeError, r"cache_seqlens must be a torch.int32 tensor"),
    (lambda: kvcache(cache_seqlens=offsets(1, 2, device="cpu")), ValueError, r"cache_seqlens is on cpu; q is on meta"),
    (lambda: kvcache(k=meta(2, 1, 2, 64)), ValueError, r"pass both k and v to append, or neither"),
    (lambda: kvcache(v=meta(2, 1, 2, 64)), ValueError, r"pass both k and v to append, or neither"),
    (lambda: kvcache(k=meta(2, 1, 2, 64), v=meta(2, 2, 2, 64)), ValueError,
     r"k and v to append must both be \(batch=2, seqlen_new, heads_k=2, head_dim=64\); got \(2, 1, 2, 64\) and "
     r"\(2, 2, 2, 64\)"),
    (lambda: kvcache(k=meta(2, 1, 4, 64), v=meta(2, 1, 4, 64)), ValueError, r"k and v to append must both be"),
    (lambda: kvcache(k=meta(2, 1, 2, 64, dtype=torch.float16), v=meta(2, 1, 2, 64, dtype=torch.float16)), TypeError,
     r"k and v to append must have q's dtype and device"),
    (lambda: kvcache(k=torch.empty(2, 1, 2, 64, dtype=BF16), v=torch.empty(2, 1, 2, 64, dtype=BF16)), TypeError,
     r"k and v to append must have q's dtype and device"),
])
def test_cache_argument_checks(call, err, match):
    with pytest.raises(err, match=match):
        call()


PAGES = meta(8, 16, 2, 64)  # 8 pages of 16 rows


@pytest.mark.parametrize("kw, err, match", [
    (dict(block_table=[[0, 1], [2, 3]]), ValueError, r"block_table must be an int32 tensor \(batch=2, max_pages\)"),
    (dict(block_table=offsets(0, 1, 2, 3)), ValueError, r"block_table must be an int32 tensor \(batch=2, max_pages\)"),
    (dict(block_table=offsets(0, 1, 2, 3, 4, 5).view(3, 2)), ValueError, r"block_table must be an int32 tensor "
                                                                         r"\(batch=2, max_pages\)"),
    (dict(block_table=offsets(0, 1, 2, 3).view(2, 2).long()), TypeError, r"block_table must be a torch.int32 tensor"),
    (dict(block_table=offsets(0, 1, 2, 3, device="cpu").view(2, 2)), ValueError, r"block_table is on cpu; q is on "
                                                                                  r"meta"),
    (dict(block_table=offsets(0, 1, 2, 3, 4, 5, 6, 7).view(2, 4)[:, ::2]), ValueError, r"block_table must be "
                                                                                       r"contiguous"),
    (dict(block_table=offsets(0, 1, 2, 3).view(2, 2), kc=meta(8, 24, 2, 64)), ValueError,
     r"page_size \(k_cache.shape\[1\]\) must be a multiple of 16; got 24"),
    (dict(block_table=offsets(0, 1, 2, 3).view(2, 2), cache_seqlens=None), ValueError,
     r"a paged cache needs cache_seqlens"),
])
def test_paged_cache_checks(kw, err, match):
    kw.setdefault("kc", PAGES)
    with pytest.raises(err, match=match):
        kvcache(**kw)


@pytest.mark.parametrize("lens, new, table, match", [
    ((-1, 3), 0, None, r"cache_seqlens has a negative entry \(-1\)"),
    ((60, 3), 8, None, r"the cache holds 64 tokens per sequence; cache_seqlens up to 60 plus 8 appended do not fit"),
    ((65, 3), 0, None, r"cache_seqlens up to 65 plus 0 appended do not fit"),
    ((20, 3), 0, [[0, 9], [1, 2]], r"block_table entries must lie in \[0, 8\); got 0 \.\. 9"),
    ((20, 3), 0, [[0, -1], [1, 2]], r"block_table entries must lie in \[0, 8\); got -1 \.\. 1"),
])
def test_cache_values_are_read_back_and_checked(lens, new, table, match):
    """validate=True reads cache_seqlens and the used pages back before any launch or append."""
    bt = None if table is None else torch.tensor(table, dtype=torch.int32)
    capacity = 64 if bt is None else bt.shape[1] * 16
    with pytest.raises(ValueError, match=match):
        checks.check_cache(torch.tensor(lens, dtype=torch.int32), new, capacity, bt, 8)


def test_unused_pages_are_not_checked():
    """Only the pages a sequence reaches are read: a table padded with garbage past them is valid."""
    bt = torch.tensor([[0, 99], [1, -5]], dtype=torch.int32)
    assert checks.check_cache(torch.tensor([16, 3], dtype=torch.int32), 0, 32, bt, 8) == 16


def test_a_negative_split_count_is_refused(monkeypatch):
    monkeypatch.setattr(api, "arch_and_slots", lambda device: ("sm90", 132))
    with pytest.raises(ValueError, match=r"num_splits must be >= 0 \(0: flashgen chooses\); got -1"):
        kvcache(num_splits=-1)
