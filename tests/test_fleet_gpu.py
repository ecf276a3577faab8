"""A real fleet tune on the GPU: 8 problems with one tuner per GPU against one tuner, same winners.

Run on a GPU machine: python -m pytest -q -s -m gpu tests/test_fleet_gpu.py
With two or more GPUs it runs `--gpus all`; with one it runs two tuners on that GPU (`--gpus 0,0`),
which tests the scheduling but lets their timings overlap on one GPU: only the single tuner's
times are used to judge the winners. Both runs evaluate the same restricted space exhaustively
(4 configurations per problem, the default among them) from a compile cache warmed beforehand,
so the wall times compare the tuners, not nvcc.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import needs_gpu_tuner

REPO = Path(__file__).resolve().parent.parent
SPACE = ["--arch", "sm80", "--head-dim", "64", "--dtype", "bf16,fp16", "--causal", "both", "--seqlen", "1024,4096",
         "--block-m", "64,128", "--block-n", "64,128", "--num-warps", "4", "--num-stages", "2"]


pytestmark = needs_gpu_tuner()


def cli(*args: str, env: dict, timeout: float = 560) -> tuple[float, str]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, str(REPO / "cli.py"), *args], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=REPO)
    wall = time.monotonic() - t
    assert p.returncode == 0, f"cli.py {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return wall, p.stdout


def timed(storage: str) -> dict[str, dict[str, float]]:
    """problem -> config name -> ms of every configuration timed (not repeated) in the storage's studies."""
    import optuna  # noqa: PLC0415

    from flashgen.studies import make_storage  # noqa: PLC0415

    st = make_storage(storage)
    found: dict[str, dict[str, float]] = {}
    for name in optuna.get_all_study_names(st):
        study = optuna.load_study(study_name=name, storage=st)
        p = study.user_attrs["problem"]
        mine = found.setdefault(name.split("/")[1].split("@")[0], {})
        for t in study.trials:
            if t.user_attrs.get("status") == "ok" and "duplicate_of" not in t.user_attrs:
                cfg = (f"fwd_sm80_d64_{p['dtype']}_{'causal' if p['causal'] else 'full'}_bm{t.params['block_m']}"
                       f"_bn{t.params['block_n']}_w{t.params['num_warps']}_s{t.params['num_stages']}")
                assert cfg not in mine, f"{cfg} timed twice in {name}"
                mine[cfg] = t.user_attrs["ms"]
    return found


def test_a_fleet_tune_is_faster_and_stores_the_same_winners(tmp_path):
    import torch

    gpus = torch.cuda.device_count()
    fleet = "all" if gpus >= 2 else "0,0"
    env = {**os.environ, "FLASHGEN_CACHE_DIR": str(tmp_path / "cache")}
    warm, _ = cli("tune", *SPACE, "--compile-only", env=env)  # both runs then take the kernels from the cache
    one = f"sqlite:///{tmp_path / 'one.db'}"
    many = str(tmp_path / "fleet.journal")
    wall_one, out_one = cli("tune", *SPACE, "--exhaustive", "--storage", one, "--tuned-dir", str(tmp_path / "one"),
                            env=env)
    wall_many, out_many = cli("tune", *SPACE, "--exhaustive", "--gpus", fleet, "--storage", many,
                              "--tuned-dir", str(tmp_path / "fleet"), env=env)
    print(f"\n{gpus} GPU(s): compile {warm:.1f} s; one tuner {wall_one:.1f} s; --gpus {fleet} {wall_many:.1f} s "
          f"({wall_one / wall_many:.2f}x)")
    print(out_many[-2500:])

    (store_one,), (store_many,) = (list((tmp_path / d).glob("*.json")) for d in ("one", "fleet"))
    one_entries = json.loads(store_one.read_text())["entries"]
    many_entries = json.loads(store_many.read_text())["entries"]
    assert len(one_entries) == len(many_entries) == 8 and set(one_entries) == set(many_entries)
    times_one, times_many = timed(one), timed(many)
    assert times_many.keys() == times_one.keys()  # every fitting configuration timed, once, by both runs
    assert all(set(times_many[k]) == set(times_one[k]) and len(times_one[k]) >= 3 for k in times_one)
    # Two tuners sharing one GPU time each other's kernels now and then: a 6% pick was seen (H200,
    # d64 bf16 N=4096, bn128 vs bn64); apart, on two GPUs, 5% is the bar.
    tolerance = 1.05 if gpus >= 2 else 1.10
    for key, e in one_entries.items():
        mine, theirs = e["kernel"], many_entries[key]["kernel"]
        # the same winner, or one the single tuner timed within noise of its own best
        ratio = times_one[key][theirs] / times_one[key][mine]
        print(f"{key}: one tuner {mine} {e['median_ms']:.4f} ms; fleet {theirs} ({ratio:.3f}x by the single run)")
        assert ratio <= tolerance, f"{key}: the fleet's winner {theirs} is {ratio:.2f}x the single tuner's {mine}"
    workers = {w.split("/")[1] for w in out_many.split() if "/gpu" in w and ":" in w}
    assert len(workers) >= 2, out_many[-2000:]
    if gpus >= 2:
        assert wall_many < wall_one, f"{gpus} GPUs took {wall_many:.1f} s, one took {wall_one:.1f} s"
    else:  # two tuners on one GPU overlap host work (verify, IPC, storage) with the other's kernels
        assert wall_many < 1.1 * wall_one, f"two tuners on one GPU took {wall_many:.1f} s, one {wall_one:.1f} s"
