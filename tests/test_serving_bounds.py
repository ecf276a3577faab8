"""The serving kernels' own bounds, without a GPU: the error word's host side (a stub stands in for the mapped
memory and the kernel that writes it), the window clamp, and every serving feature combination rendered and
compiled (sm_80 and sm_90a) with the checks in it, spilling nothing."""
from __future__ import annotations

import ctypes
import itertools

import pytest

import flashgen
from flashgen import abi, checks
from flashgen.checks import Mods, clamp_window
from flashgen.compile import compile_kernel
from flashgen.config import KernelConfig
from flashgen.kernels import bad_inputs
from flashgen.render import render


@pytest.fixture
def word(monkeypatch):
    """A fresh error-word table whose one word (device 0) is a host buffer: returns a setter playing the kernel."""
    buf = ctypes.c_uint64(0)
    allocs = []

    def host_mapped(device, nbytes):
        allocs.append((device, nbytes))
        return ctypes.addressof(buf), 0xD000

    monkeypatch.setattr(bad_inputs, "_words", {})
    monkeypatch.setattr(bad_inputs.driver, "host_mapped", host_mapped)
    assert bad_inputs.error_word(0) == 0xD000 and bad_inputs.error_word(0) == 0xD000
    assert allocs == [(0, 8)]  # once per device

    def kernel_reports(name: str, seq: int) -> None:
        buf.value = ((abi.SERVE_INPUTS.index(name) + 1) << 32) | seq

    kernel_reports.buf = buf
    return kernel_reports


def test_no_error_recorded_raises_nothing(word):
    flashgen.check_errors()
    assert word.buf.value == 0


@pytest.mark.parametrize("name", abi.SERVE_INPUTS)
def test_a_recorded_bad_input_raises_once_naming_input_and_sequence(word, name):
    word(name, 7)
    with pytest.raises(ValueError, match=rf"^{name} of sequence 7 is out of bounds .* cuda:0 .*NaN"):
        flashgen.check_errors()
    assert word.buf.value == 0  # reset: the next check passes
    flashgen.check_errors()


def test_the_next_serving_call_raises_before_its_own_checks(word):
    """A word set by an earlier launch: the next call raises it first (its own inputs, CPU tensors here, would
    be refused otherwise), then the call after goes on to its own checks."""
    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    word("block_table", 1)
    with pytest.raises(ValueError, match=r"^block_table of sequence 1 is out of bounds"):
        flashgen.attention_with_kvcache(q, kc, kc, cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"is on cpu"):
        flashgen.attention_with_kvcache(q, kc, kc, cache_seqlens=lens)
    word("cu_seqlens_k", 0)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k of sequence 0 is out of bounds"):
        flashgen.attention_varlen(q[0], kc[0], kc[0], cu, cu, 1, 1)
    assert word.buf.value == 0


def test_an_unknown_code_is_still_reported():
    assert "code 9" in bad_inputs.describe(1, (9 << 32) | 2) and "sequence 2" in bad_inputs.describe(1, (9 << 32) | 2)


def test_validate_is_an_opt_in_where_the_kernels_check(monkeypatch):
    """The kernels check their index inputs (the backward's leave a bad sequence out), so neither serving call reads
    them back by default (no host sync), a packed call that wants gradients included; validate=True does."""
    import inspect

    torch = pytest.importorskip("torch")
    from flashgen import api, ops

    assert inspect.signature(flashgen.attention_with_kvcache).parameters["validate"].default is False
    read_back = []
    monkeypatch.setattr(api, "check_offsets", lambda *a: read_back.append(a[1]))
    monkeypatch.setattr(api, "checked_dtype", lambda *a: "bf16")  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "varlen_forward", lambda q, *a: (q, None))
    monkeypatch.setattr(ops, "attention_varlen_op", lambda q, *a: (q, None))
    q, k = torch.zeros(6, 2, 64, dtype=torch.bfloat16), torch.zeros(6, 1, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    both = ["cu_seqlens_q", "cu_seqlens_k"]
    for want_grad, validate, expected in ((False, None, []), (True, None, []), (False, True, both), (True, True, both),
                                          (True, False, [])):
        read_back.clear()
        flashgen.attention_varlen(q.clone().requires_grad_(want_grad), k, k, cu, cu, 4, 4, validate=validate)
        assert read_back == expected, (want_grad, validate)


# -- the append --------------------------------------------------------------------------------------------------

def test_append_with_bad_lengths_or_pages_stays_inside_the_cache():
    """Out-of-range positions or page ids (an IndexError on the CPU, a context-ending device assert on the GPU)
    are clamped into the cache: the good sequences' appends are exact, a bad contiguous sequence writes only its
    own row."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels.serving import append_kv

    kc = torch.zeros(3, 8, 1, 16)
    new = torch.arange(3 * 2 * 16, dtype=torch.float32).view(3, 2, 1, 16) + 1
    append_kv(kc, kc.clone(), new, new, torch.tensor([2, 7, -5], dtype=torch.int32), None, 0)
    assert torch.equal(kc[0, 2:4], new[0]) and kc[0, :2].abs().sum() == 0 and kc[0, 4:].abs().sum() == 0
    assert kc[1, :7].abs().sum() == 0  # sequence 1 ran past its 8 rows: only its own row 7 was written
    assert kc[2, 1:].abs().sum() == 0  # sequence 2's negative length: its own row 0
    pages = torch.zeros(4, 4, 1, 16)
    table = torch.tensor([[0, 1], [2, -1], [3, 2]], dtype=torch.int32)  # sequence 1's second page is bad
    append_kv(pages, pages.clone(), new, new, torch.tensor([3, 5, 0], dtype=torch.int32), table, 4)
    assert torch.equal(pages[0, 3], new[0, 0]) and torch.equal(pages[1, 0], new[0, 1])
    assert torch.equal(pages[3, :2], new[2])
    table[1, 1] = 99
    append_kv(pages, pages.clone(), new, new, torch.tensor([3, 5, 40], dtype=torch.int32), table, 4)  # no IndexError


# -- window clamp ---------------------------------------------------------------------------------------------------

def _seen(sq: int, sk: int, left: int, right: int) -> list[list[bool]]:
    """Which keys each row sees under a window aligned bottom-right (-1: unbounded), as the kernels mask."""
    shift = sk - sq
    return [[(right < 0 or j <= i + shift + right) and (left < 0 or j >= i + shift - left) for j in range(sk)]
            for i in range(sq)]


def test_window_clamp_keeps_the_keys_seen():
    big = 2**31 + 5
    for sq, sk in [(1, 1), (3, 7), (7, 3), (5, 5), (0, 4), (4, 0)]:
        for left, right in itertools.product((-1, 0, 2, sq + sk - 1, sq + sk, sq + sk + 1, big), repeat=2):
            clamped = clamp_window(Mods((left, right)), sq, sk).window
            assert all(-1 <= w <= sq + sk for w in clamped)
            assert _seen(sq, sk, *clamped) == _seen(sq, sk, left, right), (sq, sk, left, right)


def test_window_clamp_keeps_edge_sums_in_int32():
    """A right edge near 2^31: i + shift + right + 1 in the kernel wrapped negative (no key seen) before the clamp."""
    mods = clamp_window(Mods((2**31 - 1, 2**31 - 1), 0.0, None), 4096, 1 << 20)
    assert mods.window == (4096 + (1 << 20),) * 2
    assert 4096 - 1 + ((1 << 20) - 4096) + mods.window[1] + 1 < 2**31
    assert clamp_window(Mods((-1, -1)), 10, 10).window == (-1, -1)
    m = Mods((3, 0), 2.0, None)
    assert clamp_window(m, 10, 10) is m


def test_dense_window_calls_are_clamped():
    torch = pytest.importorskip("torch")
    q = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 9, 2, 64, dtype=torch.bfloat16, device="meta")
    assert checks.check_dense(q, k, k, (2**40, 2**35), 0.0, None, False).window == (13, 13)


# -- every serving feature combination, compiled -----------------------------------------------------------------

def _combinations() -> list[KernelConfig]:
    """Every combination of the features the bounds touch (varlen, paged, split, pack_gqa; causal where split),
    and the score modifiers with and without varlen: decode tiles (pages smaller than the tile at runtime) and
    the prefill tiles, and the widest and narrowest decode tiles."""
    out = []
    for varlen, paged, split, pack in itertools.product((False, True), repeat=4):
        if paged and not varlen or (not varlen and (split or pack)):
            continue
        causal = split
        tile = (32, 64, 2, 3) if pack or paged else (64, 64, 4, 2)
        out.append(KernelConfig(128, "bf16", causal, *tile, varlen=varlen, paged=paged, split=split, pack_gqa=pack,
                                window=not varlen))
    out.append(KernelConfig(128, "bf16", False, 64, 64, 4, 2, varlen=True, window=True, softcap=True, alibi=True))
    out.append(KernelConfig(128, "fp16", True, 64, 64, 4, 2, varlen=True, split=True, softcap=True, alibi=True))
    out.append(KernelConfig(256, "bf16", False, 32, 32, 2, 3, varlen=True, paged=True, split=True, pack_gqa=True))
    out.append(KernelConfig(64, "bf16", False, 32, 128, 2, 3, varlen=True, paged=True, pack_gqa=True, window=True))
    return out


COMBOS = _combinations()
# The widest decode tile (d256, paged, split) is at the register limit: it runs with the quick tests, the rest
# with the nvcc sweeps (-m sweep).
QUICK = COMBOS[-2]


def test_the_checks_are_in_the_serving_source_only():
    src = render(COMBOS[-1])
    for needle in ("BAD_BLOCK_TABLE = 1", "BAD_CU_SEQLENS_K = 4", "(unsigned)id < (unsigned)sp.num_pages",
                   "record_bad(sp.error", "atomicCAS(error", "if constexpr (VARLEN)", "if constexpr (PAGED)"):
        assert needle in src, needle
    assert "sp.error" not in render(KernelConfig(128, "bf16", False, 128, 64, 4, 2))


SM90_VARLEN = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", overlap=True, varlen=True)


def test_the_sm90_varlen_forward_checks_its_offsets():
    """The sm90 family's varlen kernel checks each sequence's offsets against the packed lengths (seq_view); a
    bad one records the error and writes NaN rows. The dense sm90 kernels carry none of it."""
    src = render(SM90_VARLEN)
    for needle in ("BAD_CU_SEQLENS_Q", "q_end > total_q", "k_end > total_k", "record_bad(P.error", "pack2(NAN, NAN)",
                   "unsigned long long* error;"):
        assert needle in src, needle
    dense = render(KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", overlap=True))
    assert "record_bad" not in dense and "BAD_CU_SEQLENS_Q" not in dense


def test_the_sm90_varlen_forward_compiles_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    res = compile_kernel(SM90_VARLEN, "sm_90a").resources
    assert not res.spills and not res.stack_bytes, res


@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("cfg", [pytest.param(c, marks=() if c is QUICK else pytest.mark.sweep) for c in COMBOS],
                         ids=[c.name.split("_", 2)[2] for c in COMBOS])
def test_serving_combinations_compile_without_spills(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    res = compile_kernel(cfg, target).resources
    assert not res.spills and not res.stack_bytes, f"{cfg.name} on {target}: {res}"


def test_the_backward_leaves_out_a_sequence_with_bad_offsets():
    """Both backward families bound each sequence's offsets by the packed rows before anything is read: a
    sequence whose offsets decrease or leave [0, total] becomes empty (no rows, no keys)."""
    import dataclasses

    from flashgen.config import default_bwd_config
    from flashgen.render import render

    for family, base in (("sm80", "p.b"), ("sm90", "P.p")):  # the packed rows: the one batch BwdParams describes
        cfg = default_bwd_config(64, "bf16", False, family, family=family)
        src = render(dataclasses.replace(cfg, varlen=True))
        view = src[src.index("seq_view("):]
        view = view[:view.index("\n}\n")]
        for bound in ("0 <= q_start", "q_start <= q_end", f"q_end <= {base}.seqlen_q", "0 <= k_start",
                      "k_start <= k_end", f"k_end <= {base}.seqlen_k"):
            assert bound in view, (family, bound)


def test_the_backwards_padded_rows_take_any_offsets():
    """sm90 varlen's padded row of each packed row (where D and dLSE meet): the sequence's padded start plus the
    row's place in it for sound offsets, empty sequences included; rows inside the padded buffer, and no error,
    for offsets that decrease or leave the packed rows (a device-side assert would end the CUDA context)."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels.backward import _padded_rows

    bm = 64
    lens = [5, 0, 130, 1, 64]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    total = int(cu[-1])
    padded = total + len(lens) * bm
    expected = [(int(cu[b]) + b * bm) // bm * bm + i for b, n in enumerate(lens) for i in range(n)]
    assert _padded_rows(cu, total, bm, padded).tolist() == expected
    for bad in ([0, 5, 3, 140, 141, 200], [0, 5, 5, 135, 136, total + 40], [-7, 5, 5, 135, 136, total]):
        rows = _padded_rows(torch.tensor(bad, dtype=torch.int32), total, bm, padded)
        assert rows.shape == (total,) and int(rows.min()) >= 0 and int(rows.max()) < padded


def _group_pages(n0: int, page_size: int, block_n: int) -> list[tuple[int, int]]:
    """load_keys (templates/sm80/serve.cuh.j2) with pages smaller than the tile: (block_table index, row in that
    page) of each 16-key group, stepped from the first group's one division."""
    at, row, out = n0 // page_size, n0 % page_size, []
    for _ in range(block_n // 16):
        out.append((at, row))
        row += 16
        if row == page_size:
            row, at = 0, at + 1
    return out


@pytest.mark.parametrize("block_n", [32, 64, 128])
@pytest.mark.parametrize("page_size", [16, 32, 48, 80, 112])
def test_paged_groups_step_to_the_page_each_key_is_in(page_size, block_n):
    """Each 16-key group of a key tile is read from the page and row that key n0 + 16 g is at, for every tile of a
    4k cache (pages of any multiple of 16 keys smaller than the tile, or not dividing it)."""
    if page_size % block_n == 0:
        pytest.skip("a page holds the whole tile: one lookup")
    for n0 in range(0, 4096, block_n):
        assert _group_pages(n0, page_size, block_n) == [divmod(n0 + 16 * g, page_size) for g in range(block_n // 16)]
    src = render(KernelConfig(128, "bf16", False, 16, block_n, 1, 2, varlen=True, paged=True, pack_gqa=True))
    assert "int at = n0 / sp.page_size, row = n0 % sp.page_size;" in src
    assert "row += 16;\n        if (row == sp.page_size) row = 0, ++at;" in src
