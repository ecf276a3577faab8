"""The float64 reference on the CPU: computed over row chunks sized to a memory budget, with the same answer."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flashgen import verify  # noqa: E402
from flashgen.problem import VERIFY_REF_SCORES, TuneProblem  # noqa: E402
from flashgen.verify import REF_BUFFERS, attention_ref, ref_budget_bytes, ref_chunk_rows  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim): odd lengths, unequal both ways, MHA, GQA, MQA
SHAPES = [(2, 37, 53, 6, 2, 32), (1, 53, 37, 4, 4, 64), (2, 1, 17, 4, 1, 32), (1, 17, 1, 3, 3, 32),
          (3, 29, 29, 8, 2, 16)]


def naive_ref(q, k, v, causal, scale=None):
    """The reference as it was before chunking: whole score matrix, k and v repeated per head."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1).nan_to_num(0.0), v)
    return out, torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).float()


def qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, hh, d, generator=g).to(dtype) for s, hh in ((sq, h), (sk, hk), (sk, hk))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("upcast", [True, False])
def test_chunked_reference_equals_unchunked(shape, causal, upcast):
    b, sq, sk, h, hk, d = shape
    q, k, v = qkv(*shape)
    whole = attention_ref(q, k, v, causal, upcast=upcast, budget_bytes=2**40)
    for rows in (1, 3, 7):
        budget = rows * b * h * sk * 8 * REF_BUFFERS
        assert ref_chunk_rows(b, h, sq, sk, budget) == min(rows, sq)
        part = attention_ref(q, k, v, causal, upcast=upcast, budget_bytes=budget)
        assert torch.equal(part[1], whole[1])
        # out: the same up to the dtype's rounding (BLAS sums P V in another order for fewer rows)
        eps = torch.finfo(whole[0].dtype).eps
        torch.testing.assert_close(part[0], whole[0], rtol=0, atol=4 * eps * whole[0].abs().max().item())
    if upcast:
        want = naive_ref(q, k, v, causal)
        torch.testing.assert_close(whole[0], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(whole[1], want[1], rtol=0, atol=0)


def test_rows_that_see_no_key_give_zero_and_infinite_lse():
    q, k, v = qkv(1, 9, 4, 2, 1, 16)  # causal, seqlen_q > seqlen_k: the first 5 rows see nothing
    out, lse = attention_ref(q, k, v, True, budget_bytes=2 * 4 * 8 * REF_BUFFERS)  # two rows a chunk
    assert torch.all(out[:, :5] == 0) and torch.all(torch.isposinf(lse[:, :, :5]))
    assert torch.isfinite(lse[:, :, 5:]).all() and out[:, 5:].abs().sum() > 0


def test_chunks_respect_the_budget(monkeypatch):
    seen = []
    real = verify._ref_rows

    def spy(q, k, v, *a):
        seen.append(q.shape[1])
        return real(q, k, v, *a)

    monkeypatch.setattr(verify, "_ref_rows", spy)
    b, sq, sk, h, hk, d = 2, 100, 64, 4, 2, 16
    budget = 1_000_000
    attention_ref(*qkv(b, sq, sk, h, hk, d), True, budget_bytes=budget)
    rows = budget // (b * h * sk * 8 * REF_BUFFERS)
    assert sum(seen) == sq and max(seen) == rows and len(seen) == math.ceil(sq / rows)
    for budget in (1, 10**4, 10**6, 10**9, 2**40):
        r = ref_chunk_rows(b, h, sq, sk, budget)
        assert 1 <= r <= sq and (r == 1 or r * b * h * sk * 8 * REF_BUFFERS <= budget)


def test_the_budget_comes_from_free_gpu_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * 2**30, 24 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * 2**30)
    gpu = ref_budget_bytes(torch.device("cuda", 0))
    assert 0 < gpu <= 8 * 2**30  # at most what is free, with torch's cached blocks
    assert ref_budget_bytes(torch.device("cpu")) == verify.REF_CPU_BYTES


def test_verify_shape_bounds_the_reference_work():
    p = TuneProblem("G", "sm90", "sm80", "bf16", 64, True, 16384, gqa_group=4)
    b, sq, sk, h, hk = p.verify_shape()
    assert (sq, sk) == (16384, 16384) and h % hk == 0 and h // hk == 4
    assert b * h * sq * sk <= VERIFY_REF_SCORES < p.batch * p.heads * sq * sk
    assert p.shape() == (1, 16384, 16384, 32, 8)


@pytest.mark.parametrize("causal,window", [(True, -1), (False, -1), (True, 5)])
def test_packed_reference_is_attention_mods_ref_per_sequence(causal, window):
    """verify.packed_ref (the tuners' reference): sequence by sequence, in KV-head chunks when the budget is small,
    the same as attention_mods_ref on each sequence whole; unequal q/k lengths and an empty sequence."""
    import math

    from flashgen.verify import attention_mods_ref, packed_ref

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cu_q, cu_k = [0, 3, 3, 20, 21], [0, 5, 5, 22, 31]
    q = torch.randn(21, 8, 32, dtype=torch.float64)
    k, v = torch.randn(31, 4, 32, dtype=torch.float64), torch.randn(31, 4, 32, dtype=torch.float64)
    whole = torch.cat([attention_mods_ref(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                                          causal, 1 / math.sqrt(32), (window, -1))[0] for b in range(4)])
    for budget in (1 << 30, 1):  # one chunk; one KV head per chunk
        got = packed_ref(q, k, v, cu_q, cu_k, causal, window, torch.float64, budget_bytes=budget)
        assert got.shape == (21, 8, 32) and torch.equal(got, whole)


def test_poisoned_error_sees_unwritten_elements():
    """The serving tuners' check: the output is NaN before the run, so a run that skips elements is NaN, which
    no bound accepts; a full write gives the real error."""
    import math

    from flashgen.verify import poisoned_error

    torch = pytest.importorskip("torch")
    ref = torch.randn(4, 8, dtype=torch.float64)
    out = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert poisoned_error(out, ref, lambda: out.copy_(ref)) <= 1e-2
    assert math.isnan(poisoned_error(out, ref, lambda: out[:3].copy_(ref[:3])))
