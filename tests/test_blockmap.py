"""Block maps (flashgen.blockmap) without a GPU: the map built from a traced mask_mod against a brute-force reduction
of the user's own mask over every score, at odd lengths and GQA head counts; torch's BlockMask converted to other
tiles; and the property the kernel relies on: the scores a map keeps (EMPTY tiles: none, FULL: all, PARTIAL: the
mask_mod's) are exactly the mask's, under causal and window bounds too."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from flashgen import blockmap
from flashgen.blockmap import EMPTY, FULL, PARTIAL, BlockMap, from_block_mask, from_mask
from flashgen.modifiers import ModifierError, trace_mask_mod, trace_score_mod

torch = pytest.importorskip("torch")
from modifier_examples import examples  # noqa: E402

LENGTHS = [1, 17, 113, 1023]
TILES = [(128, 32), (64, 32), (128, 64)]


def masks(batch: int, heads: int) -> dict:
    """The examples' masks, a per-head one and a random block-sparse one (read through a captured table)."""
    out = {name: ex.mask_mod for name, ex in examples(batch=batch, heads=heads).items() if ex.mask_mod is not None}
    g = torch.Generator().manual_seed(1)
    sparse = torch.rand(batch, heads, 16, 16, generator=g) < 0.4

    def block_sparse(b, h, q_idx, kv_idx):
        return sparse[b, h, q_idx // 80, kv_idx // 80]

    def per_head(b, h, q_idx, kv_idx):  # the head's own window: h matters, b does not
        return (q_idx - kv_idx <= 16 * (h + 1)) & (kv_idx <= q_idx)

    out["block_sparse"], out["per_head"] = block_sparse, per_head
    return out


def dense_mask(fn, batch, heads, sq, sk):
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    q = torch.arange(sq).view(1, 1, -1, 1)
    k = torch.arange(sk).view(1, 1, 1, -1)
    return fn(b, h, q, k).expand(batch, heads, sq, sk)


def brute_states(keep, bm, bn):
    """Tile states by a loop over tiles: EMPTY where no score is kept, FULL where all are, else PARTIAL."""
    batch, heads, sq, sk = keep.shape
    out = torch.empty(batch, heads, -(-sq // bm), -(-sk // bn), dtype=torch.int8)
    for m in range(out.shape[2]):
        for n in range(out.shape[3]):
            tile = keep[:, :, m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
            out[:, :, m, n] = torch.where(tile.flatten(2).all(-1), FULL, torch.where(tile.flatten(2).any(-1), PARTIAL,
                                                                                     EMPTY))
    return out


def kept_by_map(states, block, keep, causal=False, window=(-1, -1)):
    """The scores a kernel reading `states` keeps: none of an EMPTY tile, all of a FULL one, the mask's in a PARTIAL
    one, then causal and window (flash_attn's bottom-right alignment) as modify_scores applies them."""
    batch, heads, sq, sk = keep.shape
    dense = BlockMap(states, block, (sq, sk)).dense(batch, heads)
    out = (dense == FULL) | ((dense == PARTIAL) & keep)
    return out & bounds(sq, sk, causal, window)


def bounds(sq, sk, causal, window):
    q = torch.arange(sq).view(-1, 1) + sk - sq
    k = torch.arange(sk).view(1, -1)
    left, right = window
    right = 0 if causal else right
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= k <= q + right
    if left >= 0:
        ok &= k >= q - left
    return ok


@pytest.mark.parametrize("sq", LENGTHS)
@pytest.mark.parametrize("layout", [(2, 4), (1, 8)])  # (batch, query heads): GQA's map is the query heads'
def test_map_from_a_mask_is_the_brute_force_reduction(sq, layout):
    batch, heads = layout
    for name, fn in masks(batch, heads).items():
        mod = trace_mask_mod(fn)
        for sk in sorted({sq, 211 if sq < 200 else 97}):
            keep = dense_mask(fn, batch, heads, sq, sk)
            for bm, bn in TILES:
                built = from_mask(mod, batch, heads, sq, sk, bm, bn)
                want = brute_states(keep, bm, bn)
                got = built.states.expand(batch, heads, -1, -1)
                assert torch.equal(got, want), f"{name} {sq}x{sk} at {bm}x{bn}"
                assert torch.equal(kept_by_map(built.states, (bm, bn), keep), keep)


def test_a_mask_reading_neither_batch_nor_head_is_evaluated_once():
    ex = examples(batch=2, heads=4)
    assert from_mask(trace_mask_mod(ex["causal"].mask_mod), 2, 4, 300, 300, 128, 32).states.shape[:2] == (1, 1)
    assert from_mask(trace_mask_mod(ex["document"].mask_mod), 2, 4, 300, 300, 128, 32).states.shape[:2] == (2, 1)
    per_head = masks(2, 4)["per_head"]
    assert from_mask(trace_mask_mod(per_head), 2, 4, 300, 300, 128, 32).states.shape[:2] == (1, 4)


def test_small_passes_give_the_same_map(monkeypatch):
    fn = masks(2, 4)["block_sparse"]
    whole = from_mask(trace_mask_mod(fn), 2, 4, 1023, 517, 64, 32)
    monkeypatch.setattr(blockmap, "CHUNK_ELEMENTS", 1)  # one query tile a pass
    assert torch.equal(from_mask(trace_mask_mod(fn), 2, 4, 1023, 517, 64, 32).states, whole.states)


def test_only_a_traced_mask_builds_a_map():
    score = trace_score_mod(lambda s, b, h, q, k: s * 2)
    with pytest.raises(ModifierError, match="mask_mod"):
        from_mask(score, 1, 1, 8, 8, 64, 32)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (40, 0)), (False, (-1, 5)), (True, (100, -1)),
                                           (False, (-1, 1)), (False, (33, 1))])  # last keys on a tile edge
@pytest.mark.parametrize("sq,sk", [(113, 211), (211, 113), (1023, 1023), (1, 1023)])
def test_restricted_maps_keep_what_causal_and_the_window_keep(causal, window, sq, sk):
    fn = masks(2, 4)["document"]
    keep = dense_mask(fn, 2, 4, sq, sk)
    built = from_mask(trace_mask_mod(fn), 2, 4, sq, sk, 64, 32)
    restricted = built.restrict(causal, window)
    want = keep & bounds(sq, sk, causal, window)
    assert torch.equal(kept_by_map(restricted.states, (64, 32), keep, causal, window), want)
    # whole tiles outside the bounds are gone from the lists
    dropped = (built.states != EMPTY) & (restricted.states == EMPTY)
    if causal and sq == sk == 1023:
        assert dropped.any()


def block_states(bm) -> torch.Tensor:
    """A BlockMask's states, read entry by entry."""
    sq, sk = bm.seq_lengths
    qb, kb = bm.BLOCK_SIZE
    nb, nh = bm.kv_num_blocks.shape[:2]
    out = torch.zeros(nb, nh, -(-sq // qb), -(-sk // kb), dtype=torch.int8)
    for counts, idx, value in ((bm.kv_num_blocks, bm.kv_indices, PARTIAL), (bm.full_kv_num_blocks, bm.full_kv_indices,
                                                                           FULL)):
        for b in range(nb):
            for h in range(nh):
                for m in range(out.shape[2]):
                    for i in range(int(counts[b, h, m])):
                        out[b, h, m, int(idx[b, h, m, i])] = value
    return out


def brute_retile(states, block, tile, sq, sk):
    """Kernel tiles from BlockMask blocks by a loop: EMPTY where every covered block is, FULL where every one is."""
    (qb, kb), (bm, bn) = block, tile
    out = torch.empty(*states.shape[:2], -(-sq // bm), -(-sk // bn), dtype=torch.int8)
    for m in range(out.shape[2]):
        for n in range(out.shape[3]):
            rows = range(m * bm // qb, (min(sq, (m + 1) * bm) - 1) // qb + 1)
            cols = range(n * bn // kb, (min(sk, (n + 1) * bn) - 1) // kb + 1)
            cover = states[:, :, rows.start:rows.stop, cols.start:cols.stop].flatten(2)
            out[:, :, m, n] = torch.where((cover == FULL).all(-1), FULL,
                                          torch.where((cover == EMPTY).all(-1), EMPTY, PARTIAL))
    return out


@pytest.mark.parametrize("block", [(128, 128), (16, 16), (64, 48), (32, 128)])
@pytest.mark.parametrize("sq,sk", [(1, 17), (113, 211), (1023, 1023)])
def test_block_masks_convert_to_the_kernel_tiles(block, sq, sk):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    fn = masks(2, 4)["document"]
    bm = fa.create_block_mask(fn, 2, None, sq, sk, device="cpu", BLOCK_SIZE=block)
    converted = from_block_mask(bm)
    assert converted.block == tuple(block) and converted.seq_lengths == (sq, sk)
    states = block_states(bm)
    assert torch.equal(converted.states, states)
    keep = dense_mask(fn, 2, 4, sq, sk)
    for tile in TILES:
        retiled = converted.retile(*tile)
        assert torch.equal(retiled.states, brute_retile(states, tuple(block), tile, sq, sk)), f"{block} -> {tile}"
        # create_block_mask's blocks agree with its mask_mod, so the kernel keeps exactly the mask's scores
        assert torch.equal(kept_by_map(retiled.states, tile, keep), keep)


def test_block_masks_without_full_blocks_and_broadcast_heads():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    causal = examples()["causal"].mask_mod
    bm = fa.create_block_mask(causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    plain = fa.BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, BLOCK_SIZE=64, mask_mod=causal,
                                        seq_lengths=(300, 300))
    converted = from_block_mask(plain)  # every listed block is partial: the mask_mod runs on each
    assert converted.states.shape == (1, 1, 5, 5)
    assert set(converted.states.unique().tolist()) == {EMPTY, PARTIAL}
    both = from_block_mask(bm)
    assert torch.equal(both.states != EMPTY, (converted.states != EMPTY) | (both.states == FULL))
    with pytest.raises(ValueError, match="queries"):
        blockmap.check_call(both, 2, 4, 301, 300)
    with pytest.raises(ValueError, match="heads"):
        blockmap.check_call(BlockMap(both.states.expand(1, 3, -1, -1), (64, 64), (300, 300)), 2, 4, 300, 300)
    blockmap.check_call(both, 2, 4, 300, 300)


def test_tile_lists_put_partial_tiles_first():
    states = torch.tensor([[[[FULL, EMPTY, PARTIAL, FULL, PARTIAL], [EMPTY] * 5]]], dtype=torch.int8)
    lists = BlockMap(states, (64, 32), (128, 160)).tile_lists
    assert lists.num.tolist() == [[[[2, 2], [0, 0]]]]
    assert lists.idx[0, 0, 0].tolist()[:4] == [2, 4, 0, 3]
    assert lists.num.dtype == lists.idx.dtype == torch.int32 and lists.idx.is_contiguous()


@pytest.mark.parametrize("shape", [(2, 3, 7, 5), (1, 4, 6, 9), (2, 1, 1, 1)])
def test_transposed_turns_count_the_key_tiles_above(shape):
    """Beside each entry of the transposed lists (query tile m listed for key tile n), the count of key tiles above n
    that visit m: turns 0 .. k-1 over m's k key tiles, the last one first, whichever tiles are EMPTY."""
    g = torch.Generator().manual_seed(sum(shape))
    states = torch.randint(0, 3, shape, generator=g, dtype=torch.int8)
    bm = BlockMap(states, (64, 32), (shape[2] * 64, shape[3] * 32))
    turns, (num, idx) = bm.transposed_turns, bm.transposed_lists
    assert turns.shape == idx.shape and turns.stride() == idx.stride() and turns.dtype == torch.int32
    for b, h, m in itertools.product(*(range(n) for n in shape[:3])):
        visiting = [n for n in range(shape[3]) if states[b, h, m, n] != EMPTY]
        got = {}
        for n in visiting:
            listed = idx[b, h, n, :int(num[b, h, n].sum())].tolist()
            got[n] = int(turns[b, h, n, listed.index(m)])
        assert sorted(got, key=got.get) == visiting[::-1], (b, h, m, got)


def test_empty_key_ranges():
    mod = trace_mask_mod(examples()["causal"].mask_mod)
    built = from_mask(mod, 1, 1, 5, 0, 64, 32)
    assert built.states.shape == (1, 1, 1, 0) and built.tile_lists.num.tolist() == [[[[0, 0]]]]
    assert math.prod(BlockMap(built.states, (64, 32), (5, 0)).retile(128, 64).states.shape) == 0


def kept_by_lists(block_map, batch, heads, keep):
    """The scores a kernel keeps reading only tile_lists as templates/sm80/modifiers.cuh.j2 does (KeyTiles): for
    each (batch, head, row block) the first num[..., 0] + num[..., 1] entries of idx, the first num[..., 0] of them
    PARTIAL (the mask decides), the rest FULL; a batch or head dimension of 1 read with stride 0."""
    bm, bn = block_map.block
    sq, sk = block_map.seq_lengths
    num, idx = (t.expand(batch, heads, -1, -1) for t in block_map.tile_lists)
    out = torch.zeros(batch, heads, sq, sk, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for m in range(num.shape[2]):
                partial, full = (int(x) for x in num[b, h, m])
                rows = slice(m * bm, (m + 1) * bm)
                for j in range(partial + full):
                    keys = slice(int(idx[b, h, m, j]) * bn, (int(idx[b, h, m, j]) + 1) * bn)
                    out[b, h, rows, keys] = True if j >= partial else keep[b, h, rows, keys]
    return out


@pytest.mark.parametrize("name", ["document", "block_sparse", "per_head", "causal"])
def test_the_kernels_lists_keep_exactly_the_masks_scores(name):
    fn = masks(2, 4)[name]
    keep = dense_mask(fn, 2, 4, 211, 300)
    for tile in TILES:
        built = from_mask(trace_mask_mod(fn), 2, 4, 211, 300, *tile)
        assert torch.equal(kept_by_lists(built, 2, 4, keep), keep)
        restricted = built.restrict(True, (-1, -1))
        assert torch.equal(kept_by_lists(restricted, 2, 4, keep) & bounds(211, 300, True, (-1, -1)),
                           keep & bounds(211, 300, True, (-1, -1)))


def test_maps_are_reused_until_a_captured_tensor_changes():
    blockmap.clear_cache()
    doc = torch.zeros(2, 300, dtype=torch.int32)
    doc[:, 150:] = 1

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    mod = trace_mask_mod(same_doc)
    first = blockmap.cached_from_mask(mod, 2, 4, 300, 300, 64, 32)
    assert blockmap.cached_from_mask(mod, 2, 4, 300, 300, 64, 32) is first
    assert first.restrict(True, (-1, -1)) is first.restrict(True, (-1, -1))  # and its restriction with it
    assert blockmap.cached_from_mask(mod, 2, 4, 300, 299, 64, 32) is not first  # another shape
    doc[1, 100:] = 2  # in place, through torch: the map follows
    again = blockmap.cached_from_mask(mod, 2, 4, 300, 300, 64, 32)
    assert again is not first and not torch.equal(again.states, first.states)
    keep = dense_mask(same_doc, 2, 4, 300, 300)
    assert torch.equal(kept_by_map(again.states, (64, 32), keep), keep)
    other = dataclasses.replace(mod, tensors=(doc.clone(),))  # another tensor object, same values and digest
    assert other.digest == mod.digest and blockmap.cached_from_mask(other, 2, 4, 300, 300, 64, 32) is not again
    blockmap.clear_cache()
    assert blockmap.cached_from_mask(mod, 2, 4, 300, 300, 64, 32) is not again


def test_block_masks_are_converted_once_per_object_and_version():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    blockmap.clear_cache()
    bm = fa.create_block_mask(masks(2, 4)["document"], 2, None, 300, 300, device="cpu")
    first = blockmap.cached_from_block_mask(bm)
    assert blockmap.cached_from_block_mask(bm) is first
    assert first.retile(128, 32) is first.retile(128, 32) and first.to("cpu") is first
    assert first.retile(128, 32).restrict(True, (-1, -1)).tile_lists is first.retile(128, 32).restrict(
        True, (-1, -1)).tile_lists
    bm.kv_num_blocks.zero_()  # written in place: converted again
    again = blockmap.cached_from_block_mask(bm)
    assert again is not first and torch.equal(again.states, from_block_mask(bm).states)
    other = fa.create_block_mask(masks(2, 4)["document"], 2, None, 300, 300, device="cpu")
    assert blockmap.cached_from_block_mask(other) is not again
