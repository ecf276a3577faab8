"""The bench grid's table, files and errors, driven by the simulated runner (no GPU)."""
import csv
import json

import pytest

from flashgen.compare import SimulatedRunner, grid, run_grid, table, write

PEERS = ["flash", "cudnn", "efficient"]


def rows():
    return run_grid(grid(["bf16"], [64, 128], [False, True], [1024, 4096]), SimulatedRunner(missing=("efficient",)),
                    PEERS, progress=False)


def test_grid_keeps_tokens_and_width_fixed():
    pts = grid(["bf16", "fp16"], [64, 256], [True], [1024, 16384])
    assert len(pts) == 8
    assert all(p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048 for p in pts)
    assert pts[0].tflop == pytest.approx(4 * 16 * 32 * 1024 * 1024 * 64 / 2 / 1e12)


def test_table_has_ratios_and_marks_missing_peers():
    text = table(rows(), PEERS)
    head, _, first = text.splitlines()[:3]
    assert head.split()[4:8] == ["flashgen", "flash", "cudnn", "efficient"] and head.endswith("x efficient")
    # simulated: flashgen 300/0.9 TFLOP/s at d64, flash 300 -> ratio 1.11; efficient unavailable
    assert first.split()[4] == "333.3" and first.split()[8] == "1.11" and first.split()[-1] == "-"


def test_files_json_csv_png(tmp_path):
    paths = write(rows(), PEERS, tmp_path, "NVIDIA H200", meta={"flashgen": "0.1.0"}, date="2026-11-30")
    assert paths["json"].name == "nvidia-h200-2026-11-30.json"
    doc = json.loads(paths["json"].read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["flashgen"] == "0.1.0" and len(doc["results"]) == 8
    r0 = doc["results"][0]
    assert r0["ratio_flash"] == pytest.approx(1 / 0.9) and r0["efficient_ms"] is None
    with paths["csv"].open() as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == 8 and "flashgen_tflops" in recs[0]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_peer_is_an_error():
    with pytest.raises(ValueError, match="unknown peers \\['xformers'\\]"):
        run_grid(grid(["bf16"], [64], [False], [1024]), SimulatedRunner(), ["xformers"], progress=False)


def test_cli_bench_simulated_writes_files(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "cli.py", "bench", "--simulate", "--head-dim", "64,128", "--seqlen", "1024",
                          "--causal", "no", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "x flash" in out.stdout and "bf16    64 full     1024" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir())[0].endswith("-sm80.csv")  # family in the name
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".csv", ".json", ".png"]


def test_cli_bench_errors():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "cli.py", "bench", "--peers", "flash,xformers", "--simulate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--peers xformers: choose from flash,cudnn,efficient" in out.stderr
    out = subprocess.run([sys.executable, "cli.py", "bench", "--head-dim", "80", "--simulate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--head-dim 80" in out.stderr


def test_table_and_json_report_share_of_matmul_ceiling(tmp_path):
    import json

    rs = rows()
    text = table(rs, PEERS, {"bf16": 500.0})
    assert text.splitlines()[0].endswith("% matmul")
    assert text.splitlines()[2].split()[-1] == "66.7"  # 333.3 of 500 TFLOP/s
    doc = json.loads(write(rs, PEERS, tmp_path, "gpu", ceiling={"bf16": 500.0})["json"].read_text())
    assert doc["matmul_tflops"] == {"bf16": 500.0} and round(doc["results"][0]["pct_matmul"], 1) == 66.7
