"""Varlen batches and KV caches on the GPU against a float64 reference built sequence by sequence:
empty, length-1 and odd lengths, unequal q/k lengths, causal, GQA/MQA, contiguous and paged caches
(appended k/v checked exactly), several num_splits including the automatic choice, and window,
softcap and ALiBi alone and with causal. The bar is flash-attention's: max error <= 2x the error
of the same computation in the input dtype (+ 1e-5); LSE within 1e-3 with the same +inf pattern."""
from __future__ import annotations

import dataclasses
import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from flashgen import attention_varlen, attention_with_kvcache  # noqa: E402
from flashgen.verify import attention_mods_ref  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
LSE_TOL = 1e-3
# (seqlen_q, seqlen_k) per sequence: empty both, no key, length 1, odd and unequal both ways.
VARLEN_SEQS = [(0, 0), (3, 0), (1, 1), (17, 17), (113, 211), (211, 113), (0, 37), (1, 300), (128, 128), (300, 1)]


def _check(outs: list, refs: list, pts: list, lses: list | None = None, ref_lses: list | None = None) -> None:
    """outs[i] vs refs[i] (float64) with the bound from pts[i] (the same math in the input dtype)."""
    got = torch.cat([o.reshape(-1).double() for o in outs])
    ref = torch.cat([r.reshape(-1) for r in refs])
    pt = torch.cat([p.reshape(-1).double() for p in pts])
    assert not torch.isnan(got).any(), "NaN in output (an unwritten or poisoned element)"
    bound = 2 * (pt - ref).abs().max().item() + 1e-5 if ref.numel() else 1e-5
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"
    if lses is not None:
        g = torch.cat([x.reshape(-1).double() for x in lses])
        r = torch.cat([x.reshape(-1) for x in ref_lses])
        assert torch.equal(torch.isfinite(g), torch.isfinite(r)), "LSE +inf pattern differs from the reference"
        fin = torch.isfinite(r)
        if fin.any():
            lerr = (g[fin] - r[fin]).abs().max().item()
            assert lerr <= LSE_TOL, f"LSE error {lerr:.3g}"


def _check_sequences(seqs, causal, scale, dt, window=(-1, -1), softcap=0.0, slopes=None) -> None:
    """_check over sequences given as (q, k, v, out, lse) (q (seqlen_q, heads, d), lse (heads, seqlen_q)): each
    against attention_mods_ref in float64, the bound from the same math in dt."""
    outs, refs, pts, lses, rlses = [], [], [], [], []
    for q, k, v, out, lse in seqs:
        ref, rl = attention_mods_ref(q, k, v, causal, scale, window, softcap, slopes)
        pt, _ = attention_mods_ref(q, k, v, causal, scale, window, softcap, slopes, dtype=dt)
        outs.append(out)
        refs.append(ref)
        pts.append(pt)
        lses.append(lse)
        rlses.append(rl)
    _check(outs, refs, pts, lses, rlses)


def _rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _varlen_case(seqs, hd, dtype, causal, layout, num_splits=1, window=(-1, -1), softcap=0.0, alibi=False):
    torch.manual_seed(hash((tuple(seqs), hd, dtype, causal, layout, num_splits, window, softcap, alibi)) % 2**31)
    h, hk = LAYOUTS[layout]
    dt = DT[dtype]
    lq = [a for a, _ in seqs]
    lk = [b for _, b in seqs]
    cu_q = torch.tensor([0, *itertools_accumulate(lq)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools_accumulate(lk)], dtype=torch.int32, device="cuda")
    q, k, v = _rand(sum(lq), h, hd, dtype=dt), _rand(sum(lk), hk, hd, dtype=dt), _rand(sum(lk), hk, hd, dtype=dt)
    slopes = torch.rand(h, device="cuda", dtype=torch.float32) * 0.5 if alibi else None
    scale = 1 / math.sqrt(hd)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, window_size=window,
                                softcap=softcap, alibi_slopes=slopes, return_lse=True, num_splits=num_splits)
    torch.cuda.synchronize()
    _check_sequences([(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], out[cu_q[b]:cu_q[b + 1]],
                       lse[:, cu_q[b]:cu_q[b + 1]]) for b in range(len(seqs))], causal, scale, dt, window, softcap,
                     slopes)


def itertools_accumulate(xs):
    import itertools

    return list(itertools.accumulate(xs))


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_matches_reference(hd, dtype, causal, layout):
    _varlen_case(VARLEN_SEQS, hd, dtype, causal, layout)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("splits", [3, 0])
def test_varlen_split_kv(hd, causal, splits):
    _varlen_case([(1, 1000), (17, 2049), (0, 5), (4, 0), (113, 511)], hd, "bf16", causal, "gqa", num_splits=splits)


# (window, softcap, alibi) alone and together; each with and without causal.
MODS = {"window": ((64, 16), 0.0, False), "window-left": ((100, -1), 0.0, False), "softcap": ((-1, -1), 30.0, False),
        "alibi": ((-1, -1), 0.0, True), "all": ((48, 48), 20.0, True)}


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mod", list(MODS))
def test_score_modifiers(hd, dtype, causal, mod):
    window, softcap, alibi = MODS[mod]
    _varlen_case([(1, 1), (113, 211), (300, 300), (211, 113), (17, 1000)], hd, dtype, causal, "gqa", 1, window,
                 softcap, alibi)


def _kvcache_case(batch, seqlen_q, hd, dtype, layout, page_size, append, num_splits, causal=False, seed=0,
                  window=(-1, -1), softcap=0.0, validate=True):
    torch.manual_seed(seed)
    h, hk = LAYOUTS[layout]
    dt = DT[dtype]
    cap = 1024
    lens = torch.tensor([0, 1, 17, 500, 1023 - append * 7][:batch], dtype=torch.int32, device="cuda")
    new = 7 if append else 0
    q = _rand(batch, seqlen_q, h, hd, dtype=dt)
    kc, vc = _rand(batch, cap, hk, hd, dtype=dt), _rand(batch, cap, hk, hd, dtype=dt)
    kn = _rand(batch, new, hk, hd, dtype=dt) if append else None
    vn = _rand(batch, new, hk, hd, dtype=dt) if append else None
    expect_k, expect_v = kc.clone(), vc.clone()
    for b in range(batch):
        if append:
            expect_k[b, lens[b]:lens[b] + new] = kn[b]
            expect_v[b, lens[b]:lens[b] + new] = vn[b]
    table = None
    if page_size:  # the same contents, scattered over shuffled pages
        pages = cap // page_size
        perm = torch.randperm(batch * pages + 3, device="cuda")[:batch * pages].to(torch.int32)
        table = perm.view(batch, pages)
        k_pool = _rand(batch * pages + 3, page_size, hk, hd, dtype=dt)
        v_pool = _rand(batch * pages + 3, page_size, hk, hd, dtype=dt)
        k_pool[table.long()] = kc.view(batch, pages, page_size, hk, hd)
        v_pool[table.long()] = vc.view(batch, pages, page_size, hk, hd)
        kc_arg, vc_arg = k_pool, v_pool
    else:
        kc_arg, vc_arg = kc, vc
    out = attention_with_kvcache(q, kc_arg, vc_arg, kn, vn, cache_seqlens=lens, block_table=table, causal=causal,
                                 window_size=window, softcap=softcap, num_splits=num_splits, return_lse=True,
                                 validate=validate)
    out, lse = out
    torch.cuda.synchronize()
    got_k = kc_arg[table.long()].view(batch, cap, hk, hd) if page_size else kc_arg
    got_v = vc_arg[table.long()].view(batch, cap, hk, hd) if page_size else vc_arg
    assert torch.equal(got_k, expect_k) and torch.equal(got_v, expect_v), "the cache after the append differs"
    ends = [int(lens[b]) + new for b in range(batch)]
    _check_sequences([(q[b], expect_k[b, :ends[b]], expect_v[b, :ends[b]], out[b], lse[b]) for b in range(batch)],
                     causal, 1 / math.sqrt(hd), dt, window, softcap)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 4, 128])
@pytest.mark.parametrize("page_size", [0, 16, 256], ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_kvcache_matches_reference(hd, seqlen_q, page_size, append, splits):
    _kvcache_case(5, seqlen_q, hd, "bf16", "gqa", page_size, append, splits, causal=seqlen_q > 1)


@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_repeated_calls_take_the_plan_and_stay_right(page_size, splits, seqlen_q, monkeypatch):
    """A decode loop (validate=False, same shapes, new data each step) runs every call after the first by its plan,
    each checked against the reference."""
    from flashgen import api

    ran, real = [], api.run_plan
    monkeypatch.setattr(api, "run_plan", lambda *a: ran.append(1) or real(*a))
    api._kv_plans.clear()
    for seed in (0, 1, 2):
        _kvcache_case(5, seqlen_q, 128, "bf16", "gqa", page_size, False, splits, causal=seqlen_q > 1, seed=seed,
                      validate=False)
    assert len(ran) == 2, "the second and third calls should take the plan"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("hd", [32, 96])
def test_kvcache_layouts_and_dtypes(dtype, layout, hd):
    _kvcache_case(4, 1, hd, dtype, layout, 16, True, 0)


def test_kvcache_window_and_softcap():
    _kvcache_case(5, 4, 128, "bf16", "gqa", 0, True, 0, causal=True, window=(100, -1), softcap=25.0)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (64, 16)], ids=["nowin", "win"])
def test_sm80_family_varlen_where_hopper_takes_sm90(hd, causal, window, monkeypatch):
    """On Hopper varlen and window calls take the sm90 family; the sm80 family's serving kernel, which other GPUs
    take, is checked here too (sm90_config forced to decline)."""
    from flashgen import resolve

    monkeypatch.setattr(resolve, "sm90_config", lambda *a: None)
    _varlen_case(VARLEN_SEQS, hd, "bf16", causal, "gqa", window=window)


def sm90_persistent_window_configs() -> list:
    """Persistent sm90 kernels with a window (a window alone keeps the tuned persistent schedule): each head dim's
    default tiles, with overlap, and with ping-pong (d128), causal and not."""
    import dataclasses

    from flashgen.config import default_config

    out = []
    for hd in (64, 128, 256):
        for causal in (False, True):
            base = dataclasses.replace(default_config(hd, "bf16", causal, "sm90", "sm90"), persistent=True, window=True)
            out += [base, dataclasses.replace(base, overlap=True)]
            if hd == 128:
                out.append(dataclasses.replace(base, overlap=True, pingpong=True))
    return out


# (batch, seqlen_q, seqlen_k, window): odd and unequal lengths, one row, and 5 x 16 x 8 = 640 tiles (> 4 x 132 SMs).
WINDOW_SHAPES = [(2, 113, 211, (64, 16)), (1, 1023, 1023, (100, -1)), (1, 17, 1000, (300, -1)), (1, 1, 300, (50, -1)),
                 (5, 2048, 2048, (256, 0))]


@pytest.mark.parametrize("cfg", sm90_persistent_window_configs(), ids=lambda c: c.name)
def test_sm90_persistent_window(cfg):
    from flashgen.checks import check_dense
    from flashgen.kernels import serving

    dt = DT[cfg.dtype]
    for b, sq, sk, window in WINDOW_SHAPES:
        torch.manual_seed(sq * 7 + sk)
        q, k, v = _rand(b, sq, 8, cfg.head_dim, dtype=dt), _rand(b, sk, 2, cfg.head_dim, dtype=dt), _rand(
            b, sk, 2, cfg.head_dim, dtype=dt)
        mods = check_dense(q, k, v, window, 0.0, None, cfg.causal)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, 8, sq), float("nan"), device="cuda")
        serving._launch_sm90(cfg, q, k, v, out, lse, num_seqs=b, max_seqlen_q=sq, cu_q=None, cu_k=None, mods=mods,
                             softmax_scale=None)
        torch.cuda.synchronize()
        _check_sequences([(q[i], k[i], v[i], out[i], lse[i]) for i in range(b)], cfg.causal,
                         1 / math.sqrt(cfg.head_dim), dt, window)


def test_bad_arguments_raise_before_launch():
    # validate=True: the host checks (one sync) refuse these before anything is launched or written
    q = _rand(2, 1, 8, 128, dtype=torch.bfloat16)
    kc = _rand(2, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        attention_with_kvcache(q, kc, kc.clone(), _rand(2, 8, 2, 128, dtype=torch.bfloat16),
                               _rand(2, 8, 2, 128, dtype=torch.bfloat16), cache_seqlens=60, validate=True)
    with pytest.raises(TypeError, match="int32"):
        attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=torch.tensor([1, 2], device="cuda"))
    pool = _rand(4, 16, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_table entries"):
        attention_with_kvcache(q, pool, pool.clone(), cache_seqlens=torch.tensor([20, 3], dtype=torch.int32,
                                                                                  device="cuda"),
                               block_table=torch.tensor([[0, 9], [1, 2]], dtype=torch.int32, device="cuda"),
                               validate=True)
    qv = _rand(10, 8, 128, dtype=torch.bfloat16)
    kv = _rand(10, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="non-decreasing"):
        attention_varlen(qv, kv, kv, torch.tensor([0, 6, 4, 10], dtype=torch.int32, device="cuda"),
                         torch.tensor([0, 3, 6, 10], dtype=torch.int32, device="cuda"), 6, 4, validate=True)
    with pytest.raises(ValueError, match="longer than max_seqlen"):
        attention_varlen(qv, kv, kv, torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda"),
                         torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda"), 4, 5, validate=True)
    import flashgen

    torch.cuda.synchronize()
    flashgen.check_errors()  # nothing was launched, so no kernel recorded a bad input


def serving_configs(arch: str) -> set:
    """Every kernel this module can launch (split-KV both ways where flashgen chooses), for
    scripts/fill_kernel_cache.py: compile here, run there."""
    from flashgen.kernels.serving import serve_config

    out = set()

    def add(hd, dtype, causal, rows, **features):
        for split in (False, True):
            out.add(serve_config(hd, dtype, causal, rows, arch, split=split, **features))

    for hd in (32, 64, 96, 128, 256):
        for dtype in DT:
            for causal in (False, True):
                add(hd, dtype, causal, 300, varlen=True)
                add(hd, dtype, causal, 113, varlen=True)
    for hd in (64, 128):
        for dtype in DT:
            for causal in (False, True):
                for window, softcap, alibi in MODS.values():
                    right = 0 if causal else window[1]
                    add(hd, dtype, causal, 300, varlen=True, window=window[0] >= 0 or (right >= 0 and not causal),
                        softcap=bool(softcap), alibi=alibi)
    for hd in (64, 128, 256):
        for seqlen_q in (1, 4, 128):
            for paged in (False, True):
                add(hd, "bf16", seqlen_q > 1, seqlen_q * 4, varlen=True, paged=paged, pack_gqa=True)
    for dtype in DT:
        for hd in (32, 96):
            for layout, (h, hk) in LAYOUTS.items():
                add(hd, dtype, False, h // hk if h > hk else 1, varlen=True, paged=True, pack_gqa=h > hk)
    add(128, "bf16", True, 16, varlen=True, pack_gqa=True, window=True, softcap=True)
    from flashgen.kernels.serving import decode_config  # the fused-combine test's kernels, both ways

    for hd, dtype in ((128, "bf16"), (64, "fp16")):
        for tile in ((16, 32, 1, 2), (32, 64, 2, 2)):
            for paged in (False, True):
                cfg = decode_config(hd, dtype, tile, paged, True)
                out |= {cfg, dataclasses.replace(cfg, fused_combine=True)}
    return out | sm90_serving_configs(arch)


def sm90_serving_configs(arch: str) -> set:
    """On Hopper, every sm90-family kernel a varlen or window call may take (flashgen.resolve.sm90_config): each
    dense sm90 kernel of the repository's store and each default with varlen (non-persistent) and window (as
    stored and non-persistent), and the persistent window kernels tested here."""
    import dataclasses
    import json
    from pathlib import Path

    from flashgen.config import HEAD_DIMS, SM90_DENSE_KNOBS, KernelConfig, default_config
    from flashgen.store import config_from_entry

    if arch != "sm90":
        return set()
    base = {default_config(hd, dt, c, arch, "sm90") for hd in HEAD_DIMS for dt in DT for c in (False, True)}
    for path in (Path(__file__).resolve().parent.parent / "tuned").glob("*.json"):
        base |= {config_from_entry(e) for e in json.loads(path.read_text())["entries"].values()}
    base = {dataclasses.replace(c, **dict.fromkeys(SM90_DENSE_KNOBS, False))  # as resolve._sm90_rule
            for c in base if isinstance(c, KernelConfig) and c.family == "sm90" and not c.fp8 and not c.serving}
    flat = {dataclasses.replace(c, persistent=False, overlap_epilogue=False) for c in base}
    varlen = {dataclasses.replace(c, **f) for c in flat for f in ({"varlen": True}, {"varlen": True, "window": True})}
    return varlen | {dataclasses.replace(c, window=True) for c in base | flat} | set(sm90_persistent_window_configs())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_loop_captured_in_a_cuda_graph(paged):
    """A decode step captured once and replayed: each replay appends the token in the static k/v buffers at
    cache_seqlens, attends (split-KV: the accumulators are the graph's own) and advances cache_seqlens in the
    graph. Every step equals the same step run eagerly on a copy of the cache."""
    batch, heads, heads_k, d, page = 3, 8, 2, 128, 64
    capacity = 1024
    start = torch.tensor([700, 31, 999 - 8], dtype=torch.int32, device="cuda")

    def cache():
        if paged:
            kc = _rand(batch * capacity // page, page, heads_k, d, dtype=torch.bfloat16)
            table = torch.randperm(batch * capacity // page, device="cuda").to(torch.int32).view(batch, -1)
            return kc, kc.clone().normal_(), table
        kc = _rand(batch, capacity, heads_k, d, dtype=torch.bfloat16)
        return kc, kc.clone().normal_(), None

    kc, vc, table = cache()
    kc_e, vc_e, lens_e = kc.clone(), vc.clone(), start.clone()
    lens = start.clone()
    q = _rand(batch, 1, heads, d, dtype=torch.bfloat16)
    k_new = _rand(batch, 1, heads_k, d, dtype=torch.bfloat16)
    v_new = _rand(batch, 1, heads_k, d, dtype=torch.bfloat16)

    def step():
        out = attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table)
        lens.add_(1)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compile, load) on a scratch cache
        attention_with_kvcache(q, kc.clone(), vc.clone(), k=k_new, v=v_new, cache_seqlens=lens.clone(),
                               block_table=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(8):
        for t in (q, k_new, v_new):
            t.normal_()
        graph.replay()
        want = attention_with_kvcache(q, kc_e, vc_e, k=k_new, v=v_new, cache_seqlens=lens_e, block_table=table)
        lens_e.add_(1)
        torch.cuda.synchronize()
        assert torch.equal(lens, lens_e)
        assert torch.equal(out, want), "a replayed decode step differs from the eager one"
    assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e), "the replays appended other keys than the eager steps"
    import flashgen

    flashgen.check_errors()  # nothing out of bounds was recorded


def test_decode_on_two_streams_at_once():
    """Split-KV accumulators are held per stream: decode calls alternating between two streams with no sync
    between them each give their own sequence's result."""
    batch, heads, heads_k, d, n = 1, 32, 8, 128, 8192
    qs = [_rand(batch, 1, heads, d, dtype=torch.bfloat16) for _ in range(2)]
    ks = [_rand(batch, n, heads_k, d, dtype=torch.bfloat16) for _ in range(2)]
    vs = [_rand(batch, n, heads_k, d, dtype=torch.bfloat16) for _ in range(2)]
    want = [attention_with_kvcache(qs[i], ks[i], vs[i], num_splits=16) for i in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(20):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(attention_with_kvcache(qs[i], ks[i], vs[i], num_splits=16))
    torch.cuda.synchronize()
    for i in range(2):
        for o in outs[i]:
            assert torch.equal(o, want[i])


@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("hd,dtype", [(128, "bf16"), (64, "fp16")])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_fused_combine_equals_the_combine_kernel(page_size, hd, dtype, seqlen_q):
    """fused_combine (the last split of a row block merges the partials) against the same kernel with the
    _combine launch: the same bits in out and lse, at several split counts and cache lengths (an empty cache and
    splits that see no key included), again on a second call (the arrival counters are back at zero) and when
    replayed from a CUDA graph."""
    from flashgen.kernels.serving import decode_config, kvcache_launch

    dt = DT[dtype]
    batch, heads, heads_k = 5, 32, 8
    lens = torch.tensor([0, 1, 17, 300, 1023], dtype=torch.int32, device="cuda")
    cap = 1024
    q = _rand(batch, seqlen_q, heads, hd, dtype=dt)
    if page_size:
        pages = batch * cap // page_size
        k, v = (_rand(pages, page_size, heads_k, hd, dtype=dt) for _ in range(2))
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, -1)
    else:
        k, v = (_rand(batch, cap, heads_k, hd, dtype=dt) for _ in range(2))
        table = None
    for tile in ((16, 32, 1, 2), (32, 64, 2, 2)):
        cfg = decode_config(hd, dtype, tile, bool(page_size), True)
        fused = dataclasses.replace(cfg, fused_combine=True)
        for splits in (2, 3, 7, 16, 64):
            results = []
            for c in (cfg, fused, fused):
                out = torch.full_like(q, float("nan"))
                lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda")
                kvcache_launch(c, splits, q, k, v, out, lse, lens, table)
                results.append((out, lse))
            torch.cuda.synchronize()
            for out, lse in results[1:]:
                assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1]), (fused.name, splits)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                kvcache_launch(fused, splits, q, k, v, out, lse, lens, table)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                kvcache_launch(fused, splits, q, k, v, out, lse, lens, table)
            out.fill_(float("nan"))
            for _ in range(2):
                g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1]), (fused.name, splits, "graph")
