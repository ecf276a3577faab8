"""Attention sinks (learnable_sink) on the GPU against a float64 reference (gpt-oss's: the sink is one more column of
the scaled scores, dropped after the softmax): forward (out and LSE, a row without keys giving out 0 and LSE = sink)
and backward (dq, dk, dv and the sinks' gradient) of `attention` and `attention_varlen`, and split-KV decode through
`attention_with_kvcache`; odd and unequal lengths, GQA, with and without a sliding window, causal and not, fp16 and
bf16, d64 and d128, in each family (sm80 everywhere; on Hopper also the sm90 family where it has sinks). The output
memory is NaN-poisoned before each call, so a row the kernel skips fails. The bar is flash-attention's: max error
<= 2x the same computation's error in the input dtype (+ 1e-5; gradients + GRAD_ABS_TOL); LSE within 1e-3."""
from __future__ import annotations

import itertools
import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import resolve  # noqa: E402
from flashgen.config import SM90_FEATURES  # noqa: E402
from flashgen.kernels import serving  # noqa: E402
from flashgen.verify import GRAD_ABS_TOL  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = {"mha": (4, 4), "gqa": (8, 2)}
LSE_TOL = 1e-3
# (seqlen_q, seqlen_k): length 1, odd, unequal both ways (rows without keys under causal), two tiles.
DENSE_SHAPES = [(1, 1), (17, 17), (113, 211), (211, 113), (1, 113), (128, 128)]
VARLEN_SEQS = [(0, 0), (3, 0), (1, 1), (17, 17), (113, 211), (211, 113), (0, 37), (1, 300), (128, 128)]
WINDOWS = {"nowin": (-1, -1), "win": (32, 8)}


def sink_ref(q, k, v, sinks, causal, scale, window=(-1, -1), dtype=None):
    """One sequence, q (seqlen_q, heads, d) against k, v (seqlen_k, heads_k, d), computed in `dtype` (float64: the
    reference; q's dtype: PyTorch's own error): (out, lse (heads, seqlen_q)). Differentiable in q, k, v, sinks."""
    dtype = dtype or torch.float64
    sq, h, _ = q.shape
    sk, hk = k.shape[:2]
    qf = q.to(dtype).transpose(0, 1)
    kf = k.to(dtype).repeat_interleave(h // hk, dim=1).transpose(0, 1)
    vf = v.to(dtype).repeat_interleave(h // hk, dim=1).transpose(0, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    mask = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        mask |= j > i + right
    if left >= 0:
        mask |= j < i - left
    s = s.masked_fill(mask, float("-inf"))
    col = sinks.to(dtype).view(h, 1, 1).expand(h, sq, 1)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)  # (h, sq): finite, the sink is always seen
    p = torch.exp(full - lse[..., None])[..., :-1]
    return (p @ vf).transpose(0, 1), lse


def _poison(nbytes: int) -> None:
    """NaN into the caching allocator's next blocks: outputs the call allocates start as NaN, so an unwritten
    element shows up (the block is freed to the cache, not the device)."""
    torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda", dtype=torch.float32)


def _check(outs, refs, pts, lses, ref_lses):
    got = torch.cat([o.reshape(-1).double() for o in outs])
    ref = torch.cat([r.reshape(-1).detach() for r in refs])
    pt = torch.cat([p.reshape(-1).detach().double() for p in pts])
    assert not torch.isnan(got).any(), "NaN in output (an unwritten or poisoned element)"
    bound = 2 * (pt - ref).abs().max().item() + 1e-5 if ref.numel() else 1e-5
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"
    g = torch.cat([x.reshape(-1).double() for x in lses])
    r = torch.cat([x.reshape(-1).detach() for x in ref_lses])
    assert not torch.isnan(g).any() and torch.isfinite(g).all(), "LSE not finite (the sink is always seen)"
    if r.numel():
        lerr = (g - r).abs().max().item()
        assert lerr <= LSE_TOL, f"LSE error {lerr:.3g}"


def _check_seqs(seqs, sinks, causal, scale, dt, window):
    """seqs: (q, k, v, out, lse) per sequence (q (seqlen_q, heads, d), lse (heads, seqlen_q))."""
    outs, refs, pts, lses, rlses = [], [], [], [], []
    for q, k, v, out, lse in seqs:
        ref, rl = sink_ref(q, k, v, sinks, causal, scale, window)
        pt, _ = sink_ref(q, k, v, sinks, causal, scale, window, dtype=dt)
        outs += [out]
        refs += [ref]
        pts += [pt]
        lses += [lse]
        rlses += [rl]
    _check(outs, refs, pts, lses, rlses)


@pytest.fixture(params=["sm80", "sm90"])
def family(request, monkeypatch):
    """The family the sink calls take: sm80 (on Hopper by making sm90_config decline, as other GPUs do), or sm90 (on
    Hopper, where that family has sinks). Every serving launch is recorded to check which family ran."""
    fam = request.param
    if fam == "sm90":
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("family sm90 runs on Hopper only")
        if "sinks" not in SM90_FEATURES:
            pytest.skip("family sm90 has no sinks")
    else:
        monkeypatch.setattr(resolve, "sm90_config", lambda *a: None)
    launched = []
    real = serving.launch_prefill

    def spy(cfg, *a, **kw):
        launched.append(cfg)
        return real(cfg, *a, **kw)

    monkeypatch.setattr(serving, "launch_prefill", spy)
    import flashgen.ops as ops  # noqa: PLC0415  (the operators' module holds its own reference)

    monkeypatch.setattr(ops, "launch_prefill", spy)
    yield fam
    # Prefill launches of sinks calls ran in the family asked for (decode-sized and split-KV ones take sm80 in both).
    assert all(c.sinks for c in launched)
    big = [c for c in launched if c.block_m > serving.DECODE_ROWS and not c.split]
    assert all(c.family == fam for c in big), [c.name for c in big]


def _sinks(h, dtype=torch.float32):
    # around the scores' scale, some well above it (the sink dominates) and one far below (no effect)
    s = torch.randn(h, device="cuda") * 2
    s[0] = 6.0
    s[-1] = -30.0
    return s.to(dtype)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("win", list(WINDOWS))
def test_dense_forward(family, hd, dtype, causal, win):
    dt, window = DT[dtype], WINDOWS[win]
    for (sq, sk), (layout, (h, hk)) in itertools.product(DENSE_SHAPES, LAYOUTS.items()):
        torch.manual_seed(sq * 1000 + sk + hk)
        b = 2
        q = torch.randn(b, sq, h, hd, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hk, hd, device="cuda", dtype=dt)
        v = torch.randn(b, sk, hk, hd, device="cuda", dtype=dt)
        sinks = _sinks(h)
        scale = 1 / math.sqrt(hd)
        _poison(q.numel() * 2)
        out, lse = flashgen.attention(q, k, v, causal=causal, window_size=window, return_lse=True,
                                      learnable_sink=sinks)
        torch.cuda.synchronize()
        _check_seqs([(q[i], k[i], v[i], out[i], lse[i]) for i in range(b)], sinks, causal, scale, dt, window)


def test_sinks_in_the_inputs_dtype_and_extremes(family):
    """bf16 sinks; sinks of +-1e4 (the sink alone, or nothing of it) stay finite: the max taken includes the sink."""
    q = torch.randn(1, 113, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 211, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for sinks in (_sinks(4, torch.bfloat16), torch.tensor([1e4, -1e4, 0.0, 30.0], device="cuda")):
        out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True, learnable_sink=sinks)
        torch.cuda.synchronize()
        _check_seqs([(q[0], k[0], v[0], out[0], lse[0])], sinks.float(), True, 1 / math.sqrt(128), torch.bfloat16,
                    (-1, -1))


def _varlen_inputs(seqs, h, hk, hd, dt, seed=0):
    torch.manual_seed(seed)
    lq, lk = [a for a, _ in seqs], [b for _, b in seqs]
    cu_q, cu_k = [0, *itertools.accumulate(lq)], [0, *itertools.accumulate(lk)]
    q = torch.randn(cu_q[-1], h, hd, device="cuda", dtype=dt)
    k = torch.randn(cu_k[-1], hk, hd, device="cuda", dtype=dt)
    v = torch.randn(cu_k[-1], hk, hd, device="cuda", dtype=dt)
    return q, k, v, cu_q, cu_k, max(lq), max(lk)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("win", list(WINDOWS))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_varlen_forward(family, hd, dtype, causal, win, num_splits):
    """Packed sequences, empty and keyless ones included; num_splits 3: split-KV, the sink added once in the
    combine (the sm80 family's split kernels, in both families' runs)."""
    dt, window = DT[dtype], WINDOWS[win]
    h, hk = LAYOUTS["gqa"]
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs(VARLEN_SEQS, h, hk, hd, dt, seed=hd + num_splits)
    sinks = _sinks(h)
    icu_q, icu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    _poison(q.numel() * 2)
    out, lse = flashgen.attention_varlen(q, k, v, icu_q, icu_k, mq, mk, causal=causal, window_size=window,
                                         return_lse=True, num_splits=num_splits, learnable_sink=sinks)
    torch.cuda.synchronize()
    _check_seqs([(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], out[cu_q[b]:cu_q[b + 1]],
                  lse[:, cu_q[b]:cu_q[b + 1]]) for b in range(len(VARLEN_SEQS))], sinks, causal, 1 / math.sqrt(hd),
                dt, window)


# -- backward ------------------------------------------------------------------------------------------------------

def _judge_grads(got, ref, pt, names=("dq", "dk", "dv", "dsinks")):
    failures = []
    for name, g, r, p in zip(names, got, ref, pt):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        if torch.isnan(g).any():
            failures.append(f"{name}: NaN")
            continue
        err = (g.double() - r).abs().max().item() if r.numel() else 0.0
        bound = 2 * ((p.double() - r).abs().max().item() if r.numel() else 0.0) + GRAD_ABS_TOL
        if name == "dsinks":  # a sum over every row of a head: the bound grows with the rows, as PyTorch's does
            bound += GRAD_ABS_TOL * r.abs().max().item()
        if err > bound:
            failures.append(f"{name}: max error {err:.3g} > bound {bound:.3g}")
    assert not failures, "; ".join(failures)


def _ref_grads(q, k, v, sinks, dout, dlse, spans, causal, scale, window, dtype):
    """(dq, dk, dv, dsinks) by autograd through sink_ref per sequence (spans: (q rows, k rows) slices of the packed
    q and k, lse columns = q rows), in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    total = 0
    for qs, ks in spans:
        out, lse = sink_ref(leaves[0][qs], leaves[1][ks], leaves[2][ks], leaves[3], causal, scale, window, dtype)
        total = total + (out * dout[qs].to(dtype)).sum()
        if dlse is not None:
            total = total + (lse * dlse[:, qs].to(dtype)).sum()
    return torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("win", list(WINDOWS))
def test_dense_backward(family, hd, dtype, causal, win):
    """attention(..., learnable_sink) under autograd: dq, dk, dv and dsinks, batch 2, GQA, unequal lengths, with
    the gradient of lse too."""
    dt, window = DT[dtype], WINDOWS[win]
    h, hk = LAYOUTS["gqa"]
    for sq, sk in ((17, 17), (113, 211), (211, 113)):
        torch.manual_seed(sq + sk)
        b = 2
        q = torch.randn(b, sq, h, hd, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hk, hd, device="cuda", dtype=dt)
        v = torch.randn(b, sk, hk, hd, device="cuda", dtype=dt)
        sinks = _sinks(h)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out, lse = flashgen.attention(*leaves[:3], causal=causal, window_size=window, return_lse=True,
                                      learnable_sink=leaves[3])
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
        torch.cuda.synchronize()
        # the batch as packed sequences: (b * sq, h, d), lse (h, b * sq)
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        spans = [(slice(i * sq, (i + 1) * sq), slice(i * sk, (i + 1) * sk)) for i in range(b)]
        args = (flat(q), flat(k), flat(v), sinks, flat(dout), dlse.transpose(0, 1).reshape(h, -1), spans, causal,
                1 / math.sqrt(hd), window)
        ref = _ref_grads(*args, torch.float64)
        pt = _ref_grads(*args, dt)
        shape = lambda r: [r[0].view_as(q), r[1].view_as(k), r[2].view_as(v), r[3]]  # noqa: E731
        _judge_grads(got, shape(ref), shape(pt))


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("win", list(WINDOWS))
def test_varlen_backward(family, hd, dtype, causal, win):
    dt, window = DT[dtype], WINDOWS[win]
    h, hk = LAYOUTS["gqa"]
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs(VARLEN_SEQS, h, hk, hd, dt, seed=7)
    sinks = _sinks(h)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    icu_q, icu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    out, lse = flashgen.attention_varlen(*leaves[:3], icu_q, icu_k, mq, mk, causal=causal, window_size=window,
                                         return_lse=True, learnable_sink=leaves[3])
    dout = torch.randn_like(out)
    got = torch.autograd.grad((out * dout).sum(), leaves)
    torch.cuda.synchronize()
    spans = [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(VARLEN_SEQS))]
    args = (q, k, v, sinks, dout, None, spans, causal, 1 / math.sqrt(hd), window)
    _judge_grads(got, _ref_grads(*args, torch.float64), _ref_grads(*args, dt))


def test_only_the_sinks_want_a_gradient(family):
    """Frozen q, k, v and trained sinks: the call still goes through autograd and gives dsinks alone."""
    h, hk = LAYOUTS["gqa"]
    q = torch.randn(2, 113, h, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 211, hk, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sinks = _sinks(h).requires_grad_()
    out = flashgen.attention(q, k, v, causal=True, learnable_sink=sinks)
    (dsinks,) = torch.autograd.grad(out.float().square().sum(), [sinks])
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    spans = [(slice(i * 113, (i + 1) * 113), slice(i * 211, (i + 1) * 211)) for i in range(2)]
    dout = 2 * out.detach().float()
    args = (flat(q), flat(k), flat(v), sinks.detach(), flat(dout), None, spans, True, 1 / math.sqrt(64), (-1, -1))
    ref, pt = _ref_grads(*args, torch.float64)[3], _ref_grads(*args, torch.bfloat16)[3]
    _judge_grads([dsinks], [ref], [pt], names=("dsinks",))


# -- KV cache, split-KV decode ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("page_size", [0, 64], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_kvcache_decode(hd, dtype, seqlen_q, page_size, num_splits):
    """Decode against a cache (GQA packed), an empty sequence included (out 0, LSE = sink), split-KV by flashgen's
    choice, none, and 5 key ranges: the sink is added once, after the splits are merged."""
    torch.manual_seed(hd + seqlen_q + page_size + num_splits)
    dt = DT[dtype]
    h, hk = LAYOUTS["gqa"]
    batch, cap = 4, 1024
    lens = torch.tensor([0, 1, 113, 1023], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, seqlen_q, h, hd, device="cuda", dtype=dt)
    kc = torch.randn(batch, cap, hk, hd, device="cuda", dtype=dt)
    vc = torch.randn(batch, cap, hk, hd, device="cuda", dtype=dt)
    table = None
    k_arg, v_arg = kc, vc
    if page_size:
        pages = cap // page_size
        table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
        k_arg = torch.empty(batch * pages, page_size, hk, hd, device="cuda", dtype=dt)
        v_arg = torch.empty_like(k_arg)
        k_arg[table.long()] = kc.view(batch, pages, page_size, hk, hd)
        v_arg[table.long()] = vc.view(batch, pages, page_size, hk, hd)
    sinks = _sinks(h)
    _poison(q.numel() * 2)
    out, lse = flashgen.attention_with_kvcache(q, k_arg, v_arg, cache_seqlens=lens, block_table=table,
                                               num_splits=num_splits, return_lse=True, learnable_sink=sinks)
    torch.cuda.synchronize()
    _check_seqs([(q[b], kc[b, :lens[b]], vc[b, :lens[b]], out[b], lse[b]) for b in range(batch)], sinks, False,
                1 / math.sqrt(hd), dt, (-1, -1))
    assert torch.all(out[0] == 0) and torch.allclose(lse[0], sinks[:, None].expand(h, seqlen_q))


def test_decode_shaped_attention_takes_the_sinks_along():
    """A plain attention() call shaped like a decode step goes to the split-KV decode kernels, sinks included."""
    h, hk = LAYOUTS["gqa"]
    q = torch.randn(3, 1, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2048, hk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sinks = _sinks(h)
    out, lse = flashgen.attention(q, k, v, return_lse=True, learnable_sink=sinks)
    torch.cuda.synchronize()
    _check_seqs([(q[b], k[b], v[b], out[b], lse[b]) for b in range(3)], sinks, False, 1 / math.sqrt(128),
                torch.bfloat16, (-1, -1))


def sinks_configs(arch: str) -> set:
    """Every forward kernel this module loads on `arch` (scripts/fill_kernel_cache.py): the sm80 family's serving
    kernels with sinks (dense, varlen, split, decode), and on Hopper the sm90 family's (when it has sinks), which
    resolve.sm90_config derives from the stored dense kernels."""
    import dataclasses

    from flashgen.config import BwdConfig, KernelConfig, default_bwd_config, mod_features
    from flashgen.kernels.serving import serve_config

    out = set()
    for hd, dtype, causal, win in itertools.product((64, 128), DT, (False, True), WINDOWS.values()):
        feats = {f: on for f, on in mod_features(win, 0.0, False, causal, True).items() if on}
        for rows in (1, 3, 17, 113, 128, 211, 300):
            out.add(serve_config(hd, dtype, causal, rows, arch, **feats))
            out.add(serve_config(hd, dtype, causal, rows, arch, varlen=True, **feats))
            out.add(serve_config(hd, dtype, causal, rows, arch, varlen=True, split=True, **feats))
    for hd, dtype, rows in itertools.product((64, 128), DT, (1, 4, 8, 16, 32)):
        for paged, split in itertools.product((False, True), (False, True)):
            out.add(serve_config(hd, dtype, False, rows, arch, varlen=True, paged=paged, split=split,
                                 pack_gqa=True, sinks=True))
    # the backward kernels autograd takes (no sink in them): as the serving features' tests load them
    import test_gpu_serving_bwd  # noqa: PLC0415

    out |= {c for c in test_gpu_serving_bwd.serving_bwd_configs(arch)
            if isinstance(c, BwdConfig) and not (c.softcap or c.alibi or c.deterministic)}
    out |= {default_bwd_config(hd, dt, c, arch) for hd, dt, c in itertools.product((64, 128), DT, (False, True))}
    if arch == "sm90" and "sinks" in SM90_FEATURES:
        import test_gpu_serving  # noqa: PLC0415  (the sm90 kernels a varlen or window call may take)

        base = {c for c in test_gpu_serving.sm90_serving_configs(arch) if c.family == "sm90"}
        out |= {dataclasses.replace(c, sinks=True) for c in base if isinstance(c, KernelConfig)}
        out |= {dataclasses.replace(c, window=False, sinks=True) for c in base if c.window and not c.varlen}
    return out
