"""The persistent sm90 kernel's tile order: a pure function (flashgen/schedule.py) that the template's
tile_order.cuh.j2 must compute identically (checked by compiling the header for the host with nvcc)."""
import itertools
import shutil
import subprocess

import pytest

from flashgen.render import template_env
from flashgen.schedule import L2_KV_BUDGET, cta_tiles, section_pairs, tile_order

SHAPES = [  # (m_blocks, heads, batch, seqlen_k, head_dim)
    (1, 1, 1, 1, 64), (8, 16, 16, 1024, 128), (32, 16, 4, 4096, 128), (128, 8, 1, 16384, 256),
    (3, 5, 7, 300, 64), (9, 3, 2, 70000, 256), (2, 40, 1, 0, 128),
]


def _work(m_block: int) -> int:  # causal: key blocks grow with the m-block (equal lengths)
    return m_block + 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_every_tile_exactly_once(shape, causal):
    m_blocks, heads, batch, seqlen_k, d = shape
    order = tile_order(m_blocks, heads, batch, seqlen_k, d, 2, causal)
    assert sorted(order) == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
    for grid in (1, 7, 132):  # the CTAs' shares partition the order
        shares = [cta_tiles(order, grid, c) for c in range(grid)]
        assert sorted(t for s in shares for t in s) == sorted(order)


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_longest_first_within_a_section(shape):
    m_blocks, heads, batch, seqlen_k, d = shape
    order = tile_order(m_blocks, heads, batch, seqlen_k, d, 2, True)
    section = section_pairs(seqlen_k, d, 2)
    per_section = section * m_blocks
    for start in range(0, len(order), per_section):
        work = [_work(m) for m, _, _ in order[start:start + per_section]]
        assert work == sorted(work, reverse=True)
    for grid in (7, 132):  # so every CTA's own sequence is longest first too
        for c in range(grid):
            ws = [_work(m) for m, _, _ in cta_tiles(order, grid, c)]
            if len(order) <= per_section:
                assert ws == sorted(ws, reverse=True)


def test_sections_keep_kv_within_the_l2_budget():
    assert section_pairs(1024, 128, 2) == L2_KV_BUDGET // (2 * 1024 * 128 * 2) == 64
    assert section_pairs(16384, 128, 2) == 4
    assert section_pairs(10**7, 256, 2) == 1  # one head's K/V past the budget still gets a section
    assert section_pairs(0, 128, 2) == 1
    order = tile_order(4, 8, 2, 16384, 128, 2, False)  # sections of 4 pairs: a head's m-blocks come together
    first = order[:4 * 4]
    assert {(h, b) for _, h, b in first} == {(0, 0), (1, 0), (2, 0), (3, 0)}
    assert [m for m, _, _ in first] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_the_template_computes_the_same_order(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the template's tile order is compiled for the host with it")
    header = template_env().get_template("sm90/tile_order.cuh.j2").render()
    src = tmp_path / "order.cu"
    src.write_text(header + """
#include <cstdio>
int main() {
    int m_blocks, heads, batch, seqlen_k, head_dim, causal;
    while (scanf("%d %d %d %d %d %d", &m_blocks, &heads, &batch, &seqlen_k, &head_dim, &causal) == 6) {
        const int pairs = heads * batch, section = section_pairs(seqlen_k, head_dim, 2);
        for (int t = 0; t < m_blocks * pairs; ++t) {
            const TileCoord c = tile_at(t, m_blocks, heads, pairs, section, causal != 0);
            printf("%d %d %d\\n", c.m_block, c.head, c.batch);
        }
    }
}
""")
    exe = tmp_path / "order"
    subprocess.run([nvcc, "-std=c++17", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=300)
    cases = [(*s, c) for s in SHAPES for c in (False, True)]
    stdin = "".join(f"{m} {h} {b} {sk} {d} {int(c)}\n" for m, h, b, sk, d, c in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True, timeout=60).stdout
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    want = [t for m, h, b, sk, d, c in cases for t in tile_order(m, h, b, sk, d, 2, c)]
    assert got == want
