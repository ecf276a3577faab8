"""Bad index inputs on the GPU, each case in a fresh process (a fault would leave the CUDA context unusable):
a page id past the cache or negative, cache_seqlens past the capacity, cu_seqlens past the packed length or
decreasing. In each, eager and replayed in a CUDA graph: the bad sequence's output rows and LSE are NaN, every
other row matches the float64 reference (flash-attention's bar: 2x the error of the same math in the input
dtype, + 1e-5), the error is raised naming the input and the sequence, and a later good call in the same
process is right (the context still works). Under compute-sanitizer's memcheck, where it is on PATH, the same
process makes no invalid access. Shapes are small: a few seconds a case once the kernels are compiled."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

# (case, the input the error names, the sequence)
CASES = [
    ("page_past", "block_table", 1),
    ("page_negative", "block_table", 2),
    ("page_past_split", "block_table", 1),
    ("seqlens_past", "cache_seqlens", 0),
    ("seqlens_past_paged_split", "cache_seqlens", 2),
    ("seqlens_past_append", "cache_seqlens", 0),
    ("cu_q_past", "cu_seqlens_q", 2),
    ("cu_k_past", "cu_seqlens_k", 2),
    ("cu_k_decreasing", "cu_seqlens_k", 1),
    ("cu_q_decreasing_split", "cu_seqlens_q", 2),
    # Longer sequences (more query rows than a decode tile): on Hopper the sm90 family's varlen kernel.
    ("cu_q_past_long", "cu_seqlens_q", 2),
    ("cu_k_past_long", "cu_seqlens_k", 2),
    ("cu_k_decreasing_long", "cu_seqlens_k", 1),
    ("cu_q_past_max", "cu_seqlens_q", 1),  # a sequence longer than max_seqlen_q
    ("cu_q_past_max_long", "cu_seqlens_q", 1),
]

# One case of each input under memcheck (slower: the whole process is instrumented), split-KV included.
SANITIZED = [c for c in CASES if c[0] in ("page_past_split", "page_negative", "seqlens_past_append", "cu_q_past",
                                          "cu_k_decreasing", "cu_q_past_long", "cu_k_past_long")]


def _child(case: str, mode: str, sanitizer: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, __file__, case, mode]
    if sanitizer:
        cmd = [shutil.which("compute-sanitizer"), "--tool", "memcheck", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA GPU is visible"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"needs a GPU: {_gpu_reason()}")
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case, name, seq", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_contained_and_reported(case, name, seq, mode):
    res = _child(case, mode)
    assert res.returncode == 0 and f"OK {name} {seq}" in res.stdout, res.stdout + res.stderr


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"needs a GPU: {_gpu_reason()}")
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case, name, seq", SANITIZED, ids=[c[0] for c in SANITIZED])
def test_bad_input_makes_no_invalid_access(case, name, seq, mode):
    res = _child(case, mode, sanitizer=True)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and f"OK {name} {seq}" in res.stdout, out
    assert "ERROR SUMMARY: 0 errors" in out, out


# The backward over bad offsets (both families: short sequences take sm80's kernels, long ones sm90's on Hopper).
BACKWARD = [c for c in CASES if c[0] in ("cu_q_past", "cu_k_decreasing", "cu_q_past_long", "cu_k_decreasing_long")]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"needs a GPU: {_gpu_reason()}")
@pytest.mark.parametrize("case, name, seq", BACKWARD, ids=[c[0] for c in BACKWARD])
def test_backward_over_bad_offsets_is_contained(case, name, seq):
    """The backward raises the forward's report first; run anyway over the bad offsets, its kernels leave the bad
    sequence out (under memcheck where it is on PATH: no invalid access), the other sequences' dq rows are those
    of a good call, and a later good call's gradients are right."""
    res = _child(case, "backward", sanitizer=shutil.which("compute-sanitizer") is not None)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and f"OK {name} {seq}" in res.stdout, out
    assert shutil.which("compute-sanitizer") is None or "ERROR SUMMARY: 0 errors" in out, out


# -- the child process ---------------------------------------------------------------------------------------------

HEADS, HEADS_K, D = 4, 2, 64


def _kvcache_case(torch, case: str):
    """(setup(bad: bool) writing good or bad index inputs, launch() -> (out, lse), rows(out, lse) -> per-sequence
    (out rows, lse (heads, rows)), float64 references (out, lse, out in the input dtype), the bad sequence)."""
    from flashgen import attention_with_kvcache
    from flashgen.verify import attention_mods_ref

    dev, dt = "cuda", torch.bfloat16
    paged = case.startswith("page") or "paged" in case
    splits = 3 if "split" in case else 1
    append = "append" in case  # one new token per sequence written into the cache first
    batch, seqlen_q, page_size, max_pages = 3, 2, 16, 4
    capacity = max_pages * page_size
    num_pages = batch * max_pages
    lens = torch.tensor([20, 40, 33], dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, seqlen_q, HEADS, D, generator=gen, device=dev, dtype=dt)
    if paged:
        kc = torch.randn(num_pages, page_size, HEADS_K, D, generator=gen, device=dev, dtype=dt)
        vc = torch.randn(num_pages, page_size, HEADS_K, D, generator=gen, device=dev, dtype=dt)
        table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).to(dev, torch.int32)
        table = table.view(batch, max_pages).contiguous()
    else:
        kc = torch.randn(batch, capacity, HEADS_K, D, generator=gen, device=dev, dtype=dt)
        vc = torch.randn(batch, capacity, HEADS_K, D, generator=gen, device=dev, dtype=dt)
        table = None

    k_new = torch.randn(batch, 1, HEADS_K, D, generator=gen, device=dev, dtype=dt) if append else None
    v_new = torch.randn(batch, 1, HEADS_K, D, generator=gen, device=dev, dtype=dt) if append else None

    def keys(cache, b):
        if table is None:
            rows = cache[b, :int(lens[b])]
        else:
            rows = cache[table[b].long()].reshape(-1, HEADS_K, D)[:int(lens[b])]
        if append:
            rows = torch.cat([rows, (k_new if cache is kc else v_new)[b]])
        return rows

    refs = [attention_mods_ref(q[b], keys(kc, b), keys(vc, b), False, D ** -0.5) +
            attention_mods_ref(q[b], keys(kc, b), keys(vc, b), False, D ** -0.5, dtype=dt)[:1] for b in range(batch)]
    good_table = None if table is None else table.clone()
    good_lens = lens.clone()
    bad_seq = {"page_past": 1, "page_negative": 2, "page_past_split": 1, "seqlens_past": 0,
               "seqlens_past_paged_split": 2, "seqlens_past_append": 0}[case]

    def setup(bad: bool) -> None:
        if table is not None:
            table.copy_(good_table)
        lens.copy_(good_lens)
        if bad and case.startswith("page"):
            table[bad_seq, 1] = num_pages + 3 if "past" in case else -1  # a page the sequence's keys use
        elif bad:
            lens[bad_seq] = capacity + 5

    def launch():
        return attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                                      num_splits=splits, return_lse=True)

    def rows(out, lse):
        return [(out[b], lse[b]) for b in range(batch)]

    return setup, launch, rows, refs, bad_seq


def _varlen_case(torch, case: str, grad: bool = False):
    from flashgen import attention_varlen
    from flashgen.verify import attention_mods_ref

    dev, dt = "cuda", torch.bfloat16
    splits = 2 if "split" in case else 1
    q_lens, k_lens = ([40, 70, 50], [60, 100, 80]) if case.endswith("_long") else ([5, 9, 7], [12, 30, 17])
    total_q, total_k = sum(q_lens), sum(k_lens)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(total_q, HEADS, D, generator=gen, device=dev, dtype=dt)
    k = torch.randn(total_k, HEADS_K, D, generator=gen, device=dev, dtype=dt)
    v = torch.randn(total_k, HEADS_K, D, generator=gen, device=dev, dtype=dt)
    cq = [0, q_lens[0], q_lens[0] + q_lens[1], total_q]
    ck = [0, k_lens[0], k_lens[0] + k_lens[1], total_k]
    kind = case.removesuffix("_long")
    bad_seq = {"cu_q_past": 2, "cu_k_past": 2, "cu_k_decreasing": 1, "cu_q_decreasing_split": 2, "cu_q_past_max": 1}[kind]
    bad_q, bad_k = list(cq), list(ck)
    if kind == "cu_q_past":
        bad_q[3] = total_q + 6  # sequence 2's rows stay in the packed q: they become NaN
    elif kind == "cu_k_past":
        bad_k[3] = total_k + 40
    elif kind == "cu_k_decreasing":
        bad_k[2] = ck[1] - 4  # sequence 1's keys decrease; sequence 2's keys [ck[1] - 4, total_k): its own reference
    elif kind == "cu_q_past_max":
        pass  # the offsets are sound; max_seqlen_q below is one short of sequence 1's rows
    else:
        bad_q[3] = cq[2] - 4  # sequence 2: rows decrease, none to write; the other two unchanged
    cu_q = torch.tensor(cq, dtype=torch.int32, device=dev)
    cu_k = torch.tensor(ck, dtype=torch.int32, device=dev)
    offsets = {False: (cu_q.clone(), cu_k.clone()),
               True: (torch.tensor(bad_q, dtype=torch.int32, device=dev),
                      torch.tensor(bad_k, dtype=torch.int32, device=dev))}

    def ref(b, offsets_k):
        qs, ks = q[cq[b]:cq[b + 1]], slice(offsets_k[b], offsets_k[b + 1])
        return (attention_mods_ref(qs, k[ks], v[ks], False, D ** -0.5) +
                attention_mods_ref(qs, k[ks], v[ks], False, D ** -0.5, dtype=dt)[:1])

    good_refs = [ref(b, ck) for b in range(3)]
    bad_refs = [ref(b, bad_k) if b != bad_seq else None for b in range(3)]

    max_q = [max(q_lens)]  # the call's max_seqlen_q (one short of the longest sequence for cu_q_past_max)

    def setup(bad: bool) -> None:
        cu_q.copy_(offsets[bad][0])
        cu_k.copy_(offsets[bad][1])
        max_q[0] = max(q_lens) - (bad and kind == "cu_q_past_max")

    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def launch():
        return attention_varlen(q, k, v, cu_q, cu_k, max_q[0], max(k_lens), num_splits=splits, return_lse=True,
                                validate=False)

    launch.inputs = (q, k, v)

    def rows(out, lse):
        return [(out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]]) for b in range(3)]

    def rows_bad(out, lse):
        # A decreasing cu_seqlens_q leaves the bad sequence no rows to write; past max_seqlen_q, the rows the grid
        # covers are NaN (the ones past it are not computed).
        keep = {"cu_q_decreasing_split": 0, "cu_q_past_max": max(q_lens) - 1}.get(kind)
        return [(o[:keep], lv[:, :keep]) if b == bad_seq and keep is not None else (o, lv)
                for b, (o, lv) in enumerate(rows(out, lse))]

    return setup, launch, rows, good_refs, bad_refs, bad_seq, rows_bad


def _close(torch, got, lse, ref) -> None:
    r, rl, pt = ref
    got = got.double()
    bound = 2 * (pt.double() - r).abs().max().item() + 1e-5
    err = (got - r).abs().max().item()
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"
    lse, rl = lse.double().reshape(-1), rl.reshape(-1)  # both (heads, rows)
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse[fin] - rl[fin]).abs().max().item() <= 1e-3


def backward_main(case: str) -> None:
    """mode "backward": gradients through attention_varlen with bad offsets."""
    import torch

    import flashgen

    setup, launch, rows, good_refs, bad_refs, bad_seq, bad_rows = _varlen_case(torch, case, grad=True)
    name = "cu_seqlens_q" if case.startswith("cu_q") else "cu_seqlens_k"
    q, k, v = launch.inputs
    dout = torch.randn_like(q)

    def grads():
        out, _ = launch()
        return torch.autograd.grad(out, (q, k, v), dout)

    setup(False)
    good = grads()
    torch.cuda.synchronize()
    setup(True)
    out, _ = launch()
    try:
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    except ValueError as e:  # the forward's report, raised before the backward launches anything
        assert str(e).startswith(f"{name} of sequence {bad_seq} is out of bounds"), str(e)
    else:
        raise AssertionError("the backward did not raise the forward's report")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)  # its kernels over the bad offsets
    torch.cuda.synchronize()
    flashgen.check_errors()  # the backward reports nothing of its own
    for b, ((g, _), (h, _)) in enumerate(zip(rows(good[0], good[0][:, :, 0].T), rows(dq, dq[:, :, 0].T))):
        if b != bad_seq and case.startswith("cu_q"):  # keys unchanged: the same dq as the good call's
            assert torch.allclose(h.float(), g.float(), rtol=2e-2, atol=2e-2), f"sequence {b}: dq differs"
    setup(False)
    again = grads()
    torch.cuda.synchronize()
    for a, b_ in zip(again, good):
        assert torch.allclose(a.float(), b_.float(), rtol=2e-2, atol=2e-2), "a later good call's gradients differ"
    flashgen.check_errors()
    print(f"OK {name} {bad_seq}")


def main(case: str, mode: str) -> None:
    import torch

    import flashgen

    if mode == "backward":
        return backward_main(case)

    if case.startswith("cu_"):
        setup, launch, rows, good_refs, bad_refs, bad_seq, bad_rows = _varlen_case(torch, case)
        name = "cu_seqlens_q" if case.startswith("cu_q") else "cu_seqlens_k"
    else:
        setup, launch, rows, good_refs, bad_seq = _kvcache_case(torch, case)
        bad_refs, bad_rows = [r if b != bad_seq else None for b, r in enumerate(good_refs)], rows
        name = "block_table" if case.startswith("page") else "cache_seqlens"

    def check(out, lse, refs, split_rows) -> None:
        for b, ((o, lv), ref) in enumerate(zip(split_rows(out, lse), refs)):
            if ref is None:
                assert torch.isnan(o.float()).all() and torch.isnan(lv).all(), f"sequence {b}: rows not all NaN"
            else:
                assert not torch.isnan(o.float()).any(), f"sequence {b}: NaN in a good sequence"
                _close(torch, o, lv, ref)

    setup(False)
    out, lse = launch()  # compile, load, warm up; a good call raises nothing
    torch.cuda.synchronize()
    check(out, lse, good_refs, rows)
    if mode == "eager":
        setup(True)
        out, lse = launch()
        torch.cuda.synchronize()
    else:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            launch()  # warm-up on the capture stream
        torch.cuda.synchronize()
        setup(True)  # the values the replay reads; the capture itself runs nothing
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out, lse = launch()
        flashgen.check_errors()  # nothing ran yet
        graph.replay()
        torch.cuda.synchronize()
    check(out.clone(), lse.clone(), bad_refs, bad_rows)
    setup(False)
    try:
        flashgen.check_errors() if mode == "graph" else launch()
    except ValueError as e:
        assert str(e).startswith(f"{name} of sequence {bad_seq} is out of bounds"), str(e)
    else:
        raise AssertionError("the bad input was not reported")
    flashgen.check_errors()  # reported once
    out, lse = launch()  # the context still works
    torch.cuda.synchronize()
    check(out, lse, good_refs, rows)
    flashgen.check_errors()
    print(f"OK {name} {bad_seq}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
