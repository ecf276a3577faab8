"""The persistent sm90 kernel's tile order (templates/sm90/tile_order.cuh.j2 computes the same on the GPU).

A persistent kernel launches one CTA per SM; CTA c runs tiles c, c + grid, c + 2 grid, ... of this order.
(batch, head) pairs are cut into sections whose K and V fit in L2 together; inside a section the m-block
steps outermost and the pairs innermost (the CTAs running together share the K/V of few heads); causal
m-blocks run longest first."""

from __future__ import annotations

L2_KV_BUDGET = 32 << 20  # bytes; the template's constant of the same name


def section_pairs(seqlen_k: int, head_dim: int, elem_bytes: int) -> int:
    """How many (batch, head) pairs share one section: as many whose K and V fit the L2 budget, at least one."""
    kv_bytes = 2 * seqlen_k * head_dim * elem_bytes
    return max(1, min(1 << 30, L2_KV_BUDGET // kv_bytes)) if kv_bytes > 0 else 1


def tile_at(t: int, m_blocks: int, heads: int, pairs: int, section: int, causal: bool) -> tuple[int, int, int]:
    """The t-th tile as (m_block, head, batch); `pairs` = batch * heads."""
    pair0 = t // (section * m_blocks) * section
    width = min(section, pairs - pair0)
    mi, pair = divmod(t - pair0 * m_blocks, width)
    pair += pair0
    return (m_blocks - 1 - mi if causal else mi, pair % heads, pair // heads)


def tile_order(m_blocks: int, heads: int, batch: int, seqlen_k: int, head_dim: int, elem_bytes: int,
               causal: bool) -> list[tuple[int, int, int]]:
    """Every tile of a problem in the order the persistent kernel hands them out."""
    pairs = batch * heads
    section = section_pairs(seqlen_k, head_dim, elem_bytes)
    return [tile_at(t, m_blocks, heads, pairs, section, causal) for t in range(m_blocks * pairs)]


def cta_tiles(order: list, grid: int, cta: int) -> list:
    """The tiles CTA `cta` of `grid` runs, in its order."""
    return order[cta::grid]
