"""The training-step benchmark's table and plot (CPU), and its run on a GPU with transformers."""
from __future__ import annotations

import pytest

from flashgen import bench_step

ROWS = [{"impl": "flashgen", "ms": 100.0, "tokens_per_s": 40960.0, "flashgen_speedup": 1.0, "loss": 10.37},
        {"impl": "sdpa flash", "ms": 125.0, "tokens_per_s": 32768.0, "flashgen_speedup": 1.25, "loss": 10.37},
        {"impl": "sdpa cudnn", "ms": None, "error": "No available kernel"}]


def test_table_gives_each_row_its_time_or_its_error():
    lines = bench_step.step_table(ROWS).splitlines()
    assert lines[0].split()[:3] == ["attention", "ms", "/"]
    assert "1.250x" in lines[2] and "32768" in lines[2]
    assert "No available kernel" in lines[3] and "x" not in lines[3].split("No")[0].replace("sdpa", "")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "step.png"
    bench_step.plot_step({"step": ROWS, "shape": {"layers": 4, "tokens": 4096}, "gpu": "GPU", "date": "today",
                          "dtype": "bf16"}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
def test_step_on_the_gpu_agrees_with_sdpa():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = bench_step.step_rows(layers=1, tokens=512, steps=2, progress=lambda s: None)
    got = {r["impl"]: r for r in rows}
    assert got["flashgen"]["ms"] > 0 and got["sdpa flash"]["ms"] > 0
    assert got["flashgen"]["loss"] == pytest.approx(got["sdpa flash"]["loss"], rel=2e-2)
