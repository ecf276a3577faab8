"""The decode bench's table and plot (CPU): a row per page size the bench measures."""
from __future__ import annotations

import pytest

from flashgen import bench_serving as bs


def _rows() -> list[dict]:
    return [{"batch": b, "cache": n, "page": pg, "tb_s": 4.0 - pg / 1000, "sdpa_tb_s": 4.1, "copy_tb_s": 4.2,
             "kernel_us": 10.0, "of_copy": 0.95, "b2b_us": 11.0, "b2b_tb_s": 3.9, "b2b_validated_us": 20.0,
             "attention_b2b_us": None if pg else 12.0, "host_us": None, "splits_us": {1: 1.0, 4: 2.0}}
            for b, n in bs.DECODE_POINTS for pg in bs.PAGE_SIZES]


def test_the_bench_measures_the_judged_page_sizes():
    assert bs.PAGE_SIZES == (0, 16, 128, 256)
    lines = bs.decode_table(_rows()).splitlines()
    assert len(lines) == 1 + len(bs.DECODE_POINTS) * len(bs.PAGE_SIZES)
    assert [line.split()[2] for line in lines[1:5]] == ["-", "16", "128", "256"]


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "decode.png"
    bs.plot_serving({"decode": _rows(), "gpu": "GPU", "date": "today", "dtype": "bf16"}, path)
    assert path.read_bytes()[:4] == b"\x89PNG"
