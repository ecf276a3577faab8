"""bench --kind flex without a GPU: the cases are FlexAttention's functions with the meaning they name (checked
against dense masks on CPU), the kept-pair count the TFLOP/s rest on, and the table and plot from given rows."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen import bench_flex as bf  # noqa: E402


def _dense_mask(case, batch, n):
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    return torch.stack([case.mask_mod(torch.tensor(b), torch.tensor(0), q, kv).expand(n, n) for b in range(batch)])


def test_cases_mean_what_they_name():
    n, batch = 256, 2
    cs = {c.name: c for c in bf.cases(n, batch, 4, "cpu")}
    assert set(cs) == set(bf.CASES)
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(_dense_mask(cs["causal"], 1, n)[0], q >= kv)
    window = _dense_mask(cs["window"], 1, n)[0]
    assert torch.equal(window, (q >= kv) & (q - kv < n // 4)) and cs["window"].builtin["window_size"] == (n // 4 - 1, 0)
    doc = _dense_mask(cs["document"], batch, n)
    assert doc[0].tril().equal(doc[0]) and doc[0].sum() < (q >= kv).sum()  # causal, and blocks on the diagonal
    runs = (doc[0].diagonal(-1) == 0).sum().item()  # a row that cannot see its predecessor starts a document
    assert runs == bf.DOCUMENTS - 1
    score = torch.randn(n, n)
    h = torch.tensor(1)
    assert torch.equal(cs["identity"].score_mod(score, 0, h, q, kv), score)
    capped = cs["softcap"].score_mod(score * 100, 0, h, q, kv)
    assert capped.abs().max() <= 20.0 and cs["softcap"].builtin == {"softcap": 20.0}
    slopes = cs["alibi"].builtin["alibi_slopes"]
    assert torch.allclose(cs["alibi"].score_mod(score, 0, h, q, kv) - score, slopes[1] * (kv - q).float())
    sparse = _dense_mask(bf.cases(1024, 1, 4, "cpu", names=("block_sparse",))[0], 1, 1024)[0]
    tiles = sparse[::bf.SPARSE_BLOCK, ::bf.SPARSE_BLOCK]
    assert sparse.diagonal().all() and 0.2 < tiles.float().mean() < 0.6  # a tile is kept or dropped whole
    assert torch.equal(sparse, tiles.repeat_interleave(bf.SPARSE_BLOCK, 0).repeat_interleave(bf.SPARSE_BLOCK, 1))


def test_kept_pairs_counts_the_mask():
    n, batch = 300, 2
    for case in bf.cases(n, batch, 2, "cpu"):
        expected = batch * n * n if case.mask_mod is None else int(_dense_mask(case, batch, n).sum())
        assert bf.kept_pairs(case, batch, n, "cpu", rows=64) == expected, case.name


def test_kept_tiles_counts_the_blocks_a_sparse_kernel_computes():
    n, batch, tile = 300, 2, 64
    for case in bf.cases(n, batch, 2, "cpu"):
        m = torch.nn.functional.pad(_dense_mask(case, batch, n) if case.mask_mod is not None
                                    else torch.ones(batch, n, n, dtype=torch.bool), (0, 20, 0, 20))
        blocks = m.view(batch, 5, tile, 5, tile).any(4).any(2)
        assert bf.kept_tiles(case, batch, n, "cpu", tile=tile) == pytest.approx(blocks.float().mean().item()), case.name
    causal = bf.cases(1024, 1, 2, "cpu", names=("causal",))[0]
    assert bf.kept_tiles(causal, 1, 1024, "cpu") == pytest.approx(36 / 64)  # 8 tiles a side: the lower triangle


def test_table_and_plot_from_rows(tmp_path):
    pytest.importorskip("matplotlib")
    row = lambda case, impl, f, b: {"case": case, "impl": impl, "n": 4096, "batch": 4, "heads": 16,  # noqa: E731
                                    "head_dim": 128, "kept": 0.5, "fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_tflops": f,
                                    "bwd_tflops": b, "max_diff": 1e-3}
    rows = [row("causal", "flex_attention", 380, 364), row("causal", "flashgen", 532, 400),
            row("causal", "flashgen built-in", 549, 383), row("document", "flex_attention", 300, 200),
            {"case": "document", "impl": "flashgen", "error": "no kernel"}]
    text = bf.flex_table(rows)
    assert "1.40 / 1.10" in text and "0.97 / 1.04" in text and "flashgen: no kernel" in text
    doc, causal = row("document", "flashgen", 400, 300), row("causal", "flashgen built-in", 500, 380)
    doc.update(kept=0.06, tiles=0.08)
    causal.update(kept=0.5, tiles=0.56)
    tiles_row = next(line for line in bf.flex_table([doc, causal]).splitlines() if "over tiles" in line).split()
    assert tiles_row[-3:-1] == ["446", "0.67"]  # 400 * 0.06 / 0.08 = 300 over tiles; 500 * 0.5 / 0.56 = 446
    bf.plot_flex({"gpu": "test", "date": "today", "head_dim": 128, "dtype": "bf16", "flex": rows}, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
