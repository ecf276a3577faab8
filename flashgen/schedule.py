"""The persistent sm90 kernel's tile order (templates/sm90/tile_order.cuh.j2 computes the same on the GPU).

A persistent kernel launches one CTA per SM; the tiles of this order go out in waves of one per CTA,
every other wave walked backwards (snake). Non-causal: head-major (the CTAs running together read the K/V
of as few heads as possible). Causal: m-blocks longest first over all heads, so that the snake balances
the CTAs' work (head groups sized for L2 would cut it into saw teeth a static hand-out cannot balance)."""

from __future__ import annotations

from .config import pack_rows, pack_tiles


def tile_at(t: int, m_blocks: int, heads: int, pairs: int, causal: bool) -> tuple[int, int, int]:
    """The t-th tile as (m_block, head, batch); `pairs` = batch * heads."""
    m = m_blocks - 1 - t // pairs if causal else t % m_blocks
    pair = t % pairs if causal else t // m_blocks
    return (m, pair % heads, pair // heads)


def tile_at_chunked(t: int, m_blocks: int, heads: int, pairs: int, chunk: int) -> tuple[int, int, int]:
    """Causal, longest first by chunks of `chunk` m-blocks, each chunk pair by pair, so that one head's m-blocks run
    together and share its K/V in L2: pack_gqa's order (pack_chunk m-blocks of a few query positions each) and
    lpt_by_head's (one chunk of all m-blocks: head by head)."""
    c = t // (pairs * chunk)
    within = t - c * pairs * chunk
    kc = min(chunk, m_blocks - c * chunk)  # the last chunk may be short
    pair, m = within // kc, m_blocks - 1 - (c * chunk + within % kc)
    return (m, pair % heads, pair // heads)


def pack_chunk(block_m: int, block_n: int, group: int) -> int:
    """The chunk of pack_gqa's causal order: as many m-blocks as one key tile spans (the template's `chunk`)."""
    return max(1, block_n // pack_rows(block_m, group))


def tile_order(m_blocks: int, heads: int, batch: int, causal: bool, chunk: int = 0) -> list[tuple[int, int, int]]:
    """Every tile of a problem in the order the persistent kernel hands them out (causal with chunk > 0:
    tile_at_chunked's, pack_gqa's or lpt_by_head's)."""
    pairs = batch * heads
    if causal and chunk:
        return [tile_at_chunked(t, m_blocks, heads, pairs, chunk) for t in range(m_blocks * pairs)]
    return [tile_at(t, m_blocks, heads, pairs, causal) for t in range(m_blocks * pairs)]


def cta_tile(k: int, cta: int, grid: int) -> int:
    """The position in the order of the k-th tile CTA `cta` of `grid` runs (past the end: it is done)."""
    return k * grid + (grid - 1 - cta if k & 1 else cta)


def cta_tiles(order: list, grid: int, cta: int) -> list:
    """The tiles CTA `cta` of `grid` runs, in its order."""
    out, k = [], 0
    while (t := cta_tile(k, cta, grid)) < len(order):
        out.append(order[t])
        k += 1
    return out


def tile_counts(block_m: int, seqlen_q: int, heads: int, heads_k: int, batch: int,
                pack_gqa: bool) -> tuple[int, int, int]:
    """(m_blocks, heads, batch) the kernel's tile order runs over, as the template computes them: pack_gqa tiles
    hold pack_rows whole query positions of one KV head (heads_k of them), else block_m rows of one head."""
    if pack_gqa:
        return (*pack_tiles(block_m, seqlen_q, heads, heads_k), batch)
    return -(-seqlen_q // block_m), heads, batch


def packed_row(row: int, m_block: int, block_m: int, group: int) -> tuple[int, int] | None:
    """pack_gqa: tile row `row` of m-block `m_block` as (query position, head in the group), or None for a row
    past the tile's whole positions (group not dividing block_m: idle, never written)."""
    pos = pack_rows(block_m, group)
    if row >= pos * group:
        return None
    return m_block * pos + row // group, row % group


def cluster_block(x: int, m_blocks: int, heads: int, causal: bool) -> tuple[int, int, int]:
    """The non-persistent cluster kernel's CTA x as (m_block, head, batch) (templates/sm90/fwd.cu.j2 computes the same):
    m-blocks counted in pairs per (batch, head), m_slots = m_blocks rounded up to even, so CTAs 2i and 2i + 1 (one
    2-CTA cluster) get m-blocks {2k, 2k + 1} of one (batch, head); an odd count's extra slot is m_block = m_blocks."""
    m_slots = m_blocks + (m_blocks & 1)
    m_idx = x % m_slots
    return (m_slots - 1 - m_idx if causal else m_idx, (x // m_slots) % heads, x // m_slots // heads)


def cluster_cta_tiles(m_blocks: int, heads: int, batch: int, causal: bool, grid: int, cta: int) -> list:
    """The persistent cluster kernel's tiles of CTA `cta` of `grid` (even), as (m_block, head, batch): cluster cta // 2
    runs tile_order over m-block pairs as cta_tiles hands it out to grid // 2 clusters, and CTA rank cta % 2 takes
    m-block 2 m + rank of pair m (m_blocks odd: the top pair's m_block = m_blocks is past the rows)."""
    order = tile_order((m_blocks + 1) // 2, heads, batch, causal)
    return [(2 * m + cta % 2, h, b) for m, h, b in cta_tiles(order, grid // 2, cta // 2)]
