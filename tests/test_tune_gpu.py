"""A short real tune on the GPU, end to end: one kernel faults, one hangs, the study survives, load() uses the result.

Run on a GPU machine: python -m pytest -q -m gpu tests/test_tune_gpu.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_gpu_tuner

REPO = Path(__file__).resolve().parent.parent


pytestmark = needs_gpu_tuner()


def test_short_tune_survives_a_fault_and_a_hang_and_load_uses_it(tmp_path, monkeypatch):
    import optuna
    import torch

    import flashgen
    from flashgen.config import KernelConfig
    from flashgen.driver import device_info
    from flashgen.problem import TuneProblem
    from flashgen.store import read_store, store_path
    from flashgen.verify import verify
    from flashgen.worker import FAULT_HOOK_ENV, HANG_HOOK_ENV

    faulty = KernelConfig(64, "bf16", False, 64, 32, 4, 1)  # launched on an illegal address by the worker's hook
    hung = KernelConfig(64, "bf16", False, 64, 64, 4, 2)  # hangs until the deadline kills the worker
    storage, tuned = f"sqlite:///{tmp_path / 'studies.db'}", tmp_path / "tuned"
    env = {**os.environ, FAULT_HOOK_ENV: faulty.name, HANG_HOOK_ENV: hung.name,
           "FLASHGEN_CACHE_DIR": str(tmp_path / "cache")}
    # 12 configurations, all evaluated (--exhaustive), the default among them.
    proc = subprocess.run([sys.executable, str(REPO / "cli.py"), "tune", "--arch", "sm80", "--head-dim", "64",
                           "--dtype", "bf16", "--causal", "no", "--seqlen", "1024", "--block-m", "64,128",
                           "--block-n", "32,64,128", "--num-warps", "4", "--num-stages", "1,2", "--exhaustive",
                           "--storage", storage, "--tuned-dir", str(tuned), "--deadline", "20s"],
                          capture_output=True, text=True, env=env, timeout=560, cwd=REPO)
    print(proc.stdout, proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]

    dev = device_info()
    prob = TuneProblem(dev.name, dev.arch, "sm80", "bf16", 64, False, 1024)
    # a restricted space is a study of its own, named after the problem's study
    (name,) = [n for n in optuna.get_all_study_names(storage=storage) if n.startswith(prob.study_name)]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    status = {
        KernelConfig(64, "bf16", False, t.params["block_m"], t.params["block_n"], t.params["num_warps"],
                     t.params["num_stages"]).name: t.user_attrs.get("status") for t in trials}
    assert status[faulty.name] == "faulted"
    assert status[hung.name] == "timeout"
    assert sum(1 for s in status.values() if s == "ok") >= 8  # the study went on after both
    fault_trial = next(t for t in trials if t.user_attrs.get("status") == "faulted")
    assert "ILLEGAL_ADDRESS" in fault_trial.user_attrs["reason"] or "illegal" in fault_trial.user_attrs["reason"]
    assert any(t.number > fault_trial.number and t.user_attrs.get("status") == "ok" for t in trials)
    # the leaders and the default were timed again side by side; the store holds the fastest of those figures
    retimed = optuna.load_study(study_name=name, storage=storage).user_attrs["retimed"]
    assert retimed["verified"] == sum(1 for s in status.values() if s == "ok") and len(retimed["ms"]) >= 5

    doc = read_store(store_path(dev.name, dev.arch, tuned), dev.name, dev.arch)
    entry = doc["entries"][prob.key]
    best = KernelConfig.from_dict(entry["config"])
    assert best not in (faulty, hung) and entry["median_ms"] > 0 and entry["tflops"] > 0
    assert entry["default"]["median_ms"] > 0 and entry["trials"] >= 8 and entry["nvcc"] and entry["driver"]
    assert entry["median_ms"] == pytest.approx(min(retimed["ms"].values())) and entry["first_ms"] > 0

    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tuned))
    kernel = flashgen.load(head_dim=64, dtype="bf16", causal=False, seqlen=1000)
    assert kernel.config == best
    assert verify(kernel.compiled, 2, 300, 300, 4, 2).ok
    torch.cuda.synchronize()
