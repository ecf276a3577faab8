"""The bench grid's table, files and errors, driven by the simulated runner (no GPU)."""
import csv
import json

import pytest

from flashgen.compare import SimulatedRunner, back_to_back_ms, grid, host_us_per_call, run_grid, table, write

PEERS = ["flash", "cudnn", "efficient"]


def rows():
    return run_grid(grid(["bf16"], [64, 128], [False, True], [1024, 4096]), SimulatedRunner(missing=("efficient",)),
                    PEERS, progress=False)


def test_grid_keeps_tokens_and_width_fixed():
    pts = grid(["bf16", "fp16"], [64, 256], [True], [1024, 16384])
    assert len(pts) == 8
    assert all(p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048 for p in pts)
    assert pts[0].tflop == pytest.approx(4 * 16 * 32 * 1024 * 1024 * 64 / 2 / 1e12)


def test_table_has_api_beside_kernel_ratios_and_marks_missing_peers():
    text = table(rows(), PEERS)
    head, _, first = text.splitlines()[:3]
    assert head.split()[4:10] == ["flashgen", "api", "api/kern", "flash", "cudnn", "efficient"]
    assert "x efficient" in head and head.endswith("cudnn b2b api x cudnn")  # sustained peers, where measured
    # simulated: kernel 300/0.9 TFLOP/s at d64, api 1.25x its time; flash 300 -> ratio 1.11; efficient unavailable
    cells = first.split()
    assert cells[4:7] == ["333.3", "266.7", "0.80"] and cells[10] == "1.11" and cells[12] == "-"
    assert cells[-4:] == ["272.7", "0.98", "340.9", "0.78"]  # flash b2b, api x flash b2b, cudnn b2b, api x cudnn b2b


def test_files_json_csv_png(tmp_path):
    paths = write(rows(), PEERS, tmp_path, "NVIDIA H200", meta={"flashgen": "0.1.0"}, date="2026-11-30")
    assert paths["json"].name == "nvidia-h200-2026-11-30.json"
    doc = json.loads(paths["json"].read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["flashgen"] == "0.1.0" and len(doc["results"]) == 8
    r0 = doc["results"][0]
    assert r0["ratio_flash"] == pytest.approx(1 / 0.9) and r0["efficient_ms"] is None
    assert r0["api_ms"] == pytest.approx(1.25 * r0["flashgen_ms"]) and r0["ratio_api_kernel"] == pytest.approx(0.8)
    with paths["csv"].open() as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == 8 and {"flashgen_tflops", "api_tflops", "ratio_api_kernel"} <= set(recs[0])
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
    assert "x flash" in out.stdout and "api/kern" in out.stdout and "bf16       64 full     1024" in out.stdout
    assert "host us/call: attention() 20.0, Kernel() 12.0, SDPA 15.0 (bf16 d64" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir())[0].endswith("-sm80.csv")  # family in the name
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".csv", ".json", ".png"]
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["host_us_per_call"] == {"attention": 20.0, "kernel": 12.0, "sdpa": 15.0}
    assert doc["host_problem"] == {"dtype": "bf16", "head_dim": 64, "causal": False, "batch": 1, "seqlen": 128, "heads": 1}


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
    assert "% matmul  flash b2b" in text.splitlines()[0]
    assert text.splitlines()[2].split()[-5] == "66.7"  # 333.3 of 500 TFLOP/s
    doc = json.loads(write(rs, PEERS, tmp_path, "gpu", ceiling={"bf16": 500.0})["json"].read_text())
    assert doc["matmul_tflops"] == {"bf16": 500.0} and round(doc["results"][0]["pct_matmul"], 1) == 66.7


class FakeCuda:
    """torch.cuda's events and synchronize on a clock the test moves: 1 ms of "GPU" per call of the timed fn."""

    def __init__(self):
        self.now, self.syncs = 0.0, 0

    def event(self, enable_timing=False):
        cuda = self

        class Event:
            def record(self):
                self.t = cuda.now

            def synchronize(self):
                cuda.syncs += 1

            def elapsed_time(self, end):
                return end.t - self.t

        return Event()

    def synchronize(self):
        self.syncs += 1


def test_back_to_back_times_loops_of_calls_per_call(monkeypatch):
    torch = pytest.importorskip("torch")
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", cuda.event)
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    seen = []

    def call(i):
        seen.append(i)
        cuda.now += 1.0 + 0.5 * (i == 0)  # the first set is slower: a per-call median, not per-set

    ms = back_to_back_ms(call, calls=4, rotate=2, loops=3, warmup=2)
    assert seen == [0, 1] + [0, 1, 0, 1] * 3  # warm-up, then loops of back-to-back calls over the rotation
    assert ms == pytest.approx(1.25)  # (1.5 + 1 + 1.5 + 1) / 4 per call


def test_host_us_per_call_is_wall_time_per_call_with_a_sync_per_loop(monkeypatch):
    torch = pytest.importorskip("torch")
    import time

    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    counts = {"slow": 0, "fast": 0}

    def slow():
        counts["slow"] += 1
        time.sleep(200e-6)

    def fast():
        counts["fast"] += 1

    us = host_us_per_call({"slow": slow, "fast": fast}, calls=10, loops=3, warmup=2)
    assert counts == {"slow": 32, "fast": 32} and cuda.syncs == 2 * (1 + 3)
    assert 200 <= us["slow"] < 5000 and us["fast"] < us["slow"]


@pytest.mark.gpu
def test_torch_runner_times_kernel_api_and_host():
    from flashgen.compare import Point, TorchRunner

    runner = TorchRunner(reps=5)
    row = runner.time_point(Point("bf16", 64, True, 256, 2, 4), ["flash"])
    assert row.kernel.startswith("fwd_") and all(row.ms[w] > 0 for w in ("flashgen", "api", "flash", "flash_b2b", "kernel_b2b"))
    host = runner.host_us("bf16", 64, True)
    print(f"kernel {row.ms['flashgen'] * 1e3:.1f} us, api {row.ms['api'] * 1e3:.1f} us per call; host us/call {host}")
    assert set(host) == {"attention", "kernel", "sdpa"} and all(0 < t < 10_000 for t in host.values())


def test_each_point_shows_fa4s_ratio_to_cudnn_as_its_goal(tmp_path):
    from flashgen.compare import fa4_target, to_records

    rs = run_grid(grid(["bf16"], [64, 256], [False, True], [1024, 2048]), SimulatedRunner(), ["flash", "cudnn"],
                  progress=False)
    assert fa4_target(rs[0].point) == 0.96 and fa4_target(rs[1].point) is None  # d64 full 1024; 2048 not measured
    lines = table(rs, ["flash", "cudnn"]).splitlines()
    assert "x cudnn  FA4 goal" in lines[0]
    col = 11  # dtype d mask N flashgen api api/kern flash cudnn (x flash) (x cudnn) (FA4 goal)
    assert lines[2].split()[col] == "0.96" and lines[3].split()[col] == "-"
    recs = to_records(rs, ["flash", "cudnn"])
    assert [r["fa4_over_cudnn_target"] for r in recs if r["head_dim"] == 256 and r["seqlen"] == 1024] == [1.06, 1.01]
