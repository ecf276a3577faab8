"""The persistent sm90 kernel's tile order: pure functions (flashgen/schedule.py) that the template's
tile_order.cuh.j2 must compute identically (checked by compiling the header for the host with nvcc)."""
import itertools
import shutil
import subprocess

import pytest

from flashgen.render import template_env
from flashgen.config import KernelConfig
from flashgen.schedule import cluster_block, cluster_cta_tiles, cta_tile, cta_tiles, tile_order

SHAPES = [(1, 1, 1), (8, 16, 16), (32, 16, 4), (128, 8, 1), (3, 5, 7), (9, 3, 2), (2, 40, 1)]  # m_blocks, heads, batch


def _work(m_block: int) -> int:  # causal, equal lengths: key blocks grow with the m-block
    return m_block + 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_every_tile_exactly_once(shape, causal):
    m_blocks, heads, batch = shape
    order = tile_order(m_blocks, heads, batch, causal)
    assert sorted(order) == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
    for grid in (1, 7, 132):  # the CTAs' shares partition the order
        shares = [cta_tiles(order, grid, c) for c in range(grid)]
        assert sorted(t for s in shares for t in s) == sorted(order)


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_longest_first_non_causal_head_major(shape):
    m_blocks, heads, batch = shape
    work = [_work(m) for m, _, _ in tile_order(m_blocks, heads, batch, True)]
    assert work == sorted(work, reverse=True)
    order = tile_order(m_blocks, heads, batch, False)  # a head's m-blocks together, heads then batches in turn
    assert order == [(m, h, b) for b in range(batch) for h in range(heads) for m in range(m_blocks)]


@pytest.mark.parametrize("d,n", [(64, 1024), (128, 4096), (256, 4096), (128, 16384), (256, 16384)])
def test_causal_work_is_balanced_over_the_ctas(d, n):
    """The bench shapes on 132 SMs: the busiest CTA has at most 4% more key blocks than the mean
    (plain striding of the same order: up to 13% at d256; of head groups sized for L2: 70%)."""
    batch, heads, m_blocks = max(1, 16384 // n), 2048 // d, n // 128
    order = tile_order(m_blocks, heads, batch, True)
    loads = [sum(_work(m) for m, _, _ in cta_tiles(order, 132, c)) for c in range(132)]
    assert max(loads) <= 1.04 * sum(loads) / 132


@pytest.mark.parametrize("seqlen_q", [1, 128, 129, 300, 1023, 1024])
@pytest.mark.parametrize("causal", [False, True])
def test_cluster_pairs_neighbouring_m_blocks(seqlen_q, causal):
    """cluster: the grid is whole 2-CTA clusters, each on m-blocks {2k, 2k + 1} of one (batch, head); every m-block
    is run once, and an odd count's extra CTA (m_block = m_blocks) is its last pair's partner."""
    heads, batch = 3, 2
    cfg = KernelConfig(64, "bf16", causal, 128, 128, 12, 2, "sm90", cluster=True)
    grid, m_blocks = cfg.grid(batch, heads, seqlen_q)[0], -(-seqlen_q // 128)
    assert grid % 2 == 0 and grid == cfg.m_slots(seqlen_q) * heads * batch
    blocks = [cluster_block(x, m_blocks, heads, causal) for x in range(grid)]
    for (m0, h0, b0), (m1, h1, b1) in zip(blocks[::2], blocks[1::2]):
        assert (h0, b0) == (h1, b1) and m0 // 2 == m1 // 2 and m0 != m1
    real = sorted(t for t in blocks if t[0] < m_blocks)
    assert real == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
    assert len(blocks) - len(real) == (m_blocks & 1) * heads * batch and all(m <= m_blocks for m, _, _ in blocks)
    if causal:  # the bottom pair first, as without clusters
        assert [m for m, _, _ in blocks[:2]] == [cfg.m_slots(seqlen_q) - 1, cfg.m_slots(seqlen_q) - 2]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_clusters_run_pairs_of_m_blocks(shape, causal):
    """Persistent cluster: the two CTAs of a cluster run the same tiles, m-blocks {2k, 2k + 1} of one (batch, head);
    every m-block runs once over the grid (an even SM count: the host rounds it down)."""
    m_blocks, heads, batch = shape
    cfg = KernelConfig(64, "bf16", causal, 128, 128, 12, 2, "sm90", persistent=True, cluster=True)
    for sm_count in (1, 7, 132):
        grid = cfg.grid(batch, heads, m_blocks * 128, sm_count)[0]
        assert grid % 2 == 0 and grid <= max(2, sm_count)
        shares = [cluster_cta_tiles(m_blocks, heads, batch, causal, grid, c) for c in range(grid)]
        for lo, hi in zip(shares[::2], shares[1::2]):
            assert [(m // 2, h, b) for m, h, b in lo] == [(m // 2, h, b) for m, h, b in hi]
            assert all(m % 2 == 0 for m, _, _ in lo) and all(m % 2 == 1 for m, _, _ in hi)
        real = sorted(t for s in shares for t in s if t[0] < m_blocks)
        assert real == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
        assert all(m <= m_blocks for s in shares for m, _, _ in s)


def test_snake_hand_out():
    assert [cta_tile(k, 0, 4) for k in range(4)] == [0, 7, 8, 15]
    assert [cta_tile(k, 3, 4) for k in range(4)] == [3, 4, 11, 12]


def test_the_template_computes_the_same_order(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the template's tile order is compiled for the host with it")
    header = template_env().get_template("sm90/tile_order.cuh.j2").render()
    src = tmp_path / "order.cu"
    src.write_text(header + """
#include <cstdio>
int main() {
    int m_blocks, heads, batch, causal, chunk;
    while (scanf("%d %d %d %d %d", &m_blocks, &heads, &batch, &causal, &chunk) == 5) {
        const int pairs = heads * batch, tiles = m_blocks * pairs, grid = 7;
        for (int cta = 0; cta < grid; ++cta)  // each CTA's tiles, as the kernel's loop walks them
            for (int k = 0, t = cta; t < tiles; t = cta_tile(++k, cta, grid)) {
                const TileCoord c = causal && chunk ? tile_at_chunked(t, m_blocks, heads, pairs, chunk)
                                                    : tile_at(t, m_blocks, heads, pairs, causal != 0);
                printf("%d %d %d\\n", c.m_block, c.head, c.batch);
            }
    }
}
""")
    exe = tmp_path / "order"
    subprocess.run([nvcc, "-std=c++17", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=300)
    cases = [(*s, c, k) for s in SHAPES for c, k in ((False, 0), (True, 0), (True, 1), (True, 3), (True, 8), (True, s[0]))]
    stdin = "".join(f"{m} {h} {b} {int(c)} {k}\n" for m, h, b, c, k in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True, timeout=60).stdout
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    want = [t for m, h, b, c, k in cases for cta in range(7) for t in cta_tiles(tile_order(m, h, b, c, k), 7, cta)]
    assert got == want


@pytest.mark.parametrize("shape", SHAPES)
def test_lpt_by_head_order(shape):
    """lpt_by_head (the kernel's tile_at_chunked with chunk = m_blocks): every tile once, head by head in the plain
    order's pair order, each head's m-blocks longest first."""
    m_blocks, heads, batch = shape
    order = tile_order(m_blocks, heads, batch, True, m_blocks)
    assert sorted(order) == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
    want = [(m, pair % heads, pair // heads) for pair in range(heads * batch) for m in reversed(range(m_blocks))]
    assert order == want


# ---- pack_gqa: a tile's rows are (query position, head of the group) pairs of one KV head ----------------------
from flashgen.config import pack_rows, pack_tiles  # noqa: E402
from flashgen.schedule import packed_row, tile_counts  # noqa: E402


def test_pack_rows_whole_positions_per_tile():
    assert [pack_rows(128, g) for g in (1, 2, 3, 4, 6, 8, 128)] == [128, 64, 42, 32, 21, 16, 1]
    assert pack_rows(192, 6) == 32 and pack_rows(64, 3) == 21
    for bad in (0, 65):
        with pytest.raises(ValueError, match="does not fit a tile of 64 rows"):
            pack_rows(64, bad)
    with pytest.raises(ValueError, match="multiple of heads_k"):
        pack_tiles(128, 100, 6, 4)


@pytest.mark.parametrize("block_m,seqlen_q,heads,heads_k", [(128, 1023, 8, 2), (128, 113, 6, 2), (64, 17, 4, 1),
                                                           (192, 1, 32, 8), (128, 1024, 4, 4), (64, 211, 12, 2)])
def test_packed_rows_cover_every_position_and_head_once(block_m, seqlen_q, heads, heads_k):
    group = heads // heads_k
    m_blocks, grid_heads, batch = tile_counts(block_m, seqlen_q, heads, heads_k, 3, True)
    assert (m_blocks, grid_heads) == pack_tiles(block_m, seqlen_q, heads, heads_k) and batch == 3 and grid_heads == heads_k
    if block_m % group == 0:  # packed rows: ceil(seqlen_q * group / block_m)
        assert m_blocks == -(-seqlen_q * group // block_m)
    seen = []
    for m in range(m_blocks):
        rows = min(pack_rows(block_m, group), seqlen_q - m * pack_rows(block_m, group)) * group  # the kernel's `rows`
        for r in range(block_m):
            pr = packed_row(r, m, block_m, group)
            assert (pr is not None and pr[0] < seqlen_q) == (r < rows)  # rows past `rows` are never written
            if r < rows:
                seen.append(pr)
    assert sorted(seen) == sorted(itertools.product(range(seqlen_q), range(group)))
    assert tile_counts(block_m, seqlen_q, heads, heads_k, 3, False) == (-(-seqlen_q // block_m), heads, 3)


def test_packed_tile_order_runs_over_kv_heads():
    m_blocks, heads_k, batch = tile_counts(128, 1000, 32, 8, 2, True)
    order = tile_order(m_blocks, heads_k, batch, True)
    assert sorted(order) == sorted(itertools.product(range(m_blocks), range(heads_k), range(batch)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_pack_gqa_causal_order_by_chunks(shape, chunk):
    """pack_gqa's causal order: every tile once, chunk 1 is the plain longest-first order, longest first from
    chunk to chunk, and within a chunk one pair's m-blocks together."""
    m_blocks, heads, batch = shape
    order = tile_order(m_blocks, heads, batch, True, chunk)
    assert sorted(order) == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
    if chunk == 1:
        assert order == tile_order(m_blocks, heads, batch, True)
    chunks = [(m_blocks - 1 - m) // chunk for m, _, _ in order]
    assert chunks == sorted(chunks)
    for c in set(chunks):
        pairs = [(h, b) for (m, h, b), cc in zip(order, chunks) if cc == c]
        runs = [p for i, p in enumerate(pairs) if i == 0 or pairs[i - 1] != p]
        assert len(runs) == len(set(runs))  # each pair's m-blocks adjacent


def test_pack_chunk_spans_one_key_tile():
    from flashgen.schedule import pack_chunk

    assert pack_chunk(128, 128, 4) == 4 and pack_chunk(64, 128, 4) == 8 and pack_chunk(128, 64, 1) == 1
