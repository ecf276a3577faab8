"""Tuning the backward on the CPU: problem keys and study names, the search over BwdConfig, the
exhaustive-by-default rule, `flashgen tune --pass bwd --simulate` into the store, the store lookup of a
tuned backward, and resolve.backward_kernel choosing it (the GPU parts faked)."""
from __future__ import annotations

import json

import pytest

from flashgen import bench, cli, search, store
from flashgen.backend import SimulatedBackend
from flashgen.config import BwdConfig, KernelConfig, default_bwd_config
from flashgen.problem import EXHAUSTIVE_MAX, TuneProblem
from flashgen.search import SearchOptions

GPU = ("Simulated GPU", "sm90")


def problem(pass_: str = "bwd", head_dim: int = 128, seqlen: int = 1024) -> TuneProblem:
    return TuneProblem(*GPU, "sm80", "bf16", head_dim, True, seqlen, pass_=pass_)


def test_keys_name_the_backward_and_leave_forward_keys_alone():
    fwd, bwd = problem("fwd"), problem("bwd")
    assert fwd.key == "sm80_d128_bf16_causal_s1024_g1_bt16384_hdt2048"  # as before the backward existed
    assert bwd.key == fwd.key + "_bwd"
    assert bwd.study_name == "simulated-gpu-sm90/" + bwd.key
    assert search.study_name(bwd, search.problem_space(bwd)).startswith(bwd.study_name + "@space-")
    assert isinstance(bwd.default_config(), BwdConfig) and isinstance(fwd.default_config(), KernelConfig)
    assert TuneProblem(**bwd.to_dict()) == bwd and TuneProblem(**{k: v for k, v in fwd.to_dict().items()
                                                                  if k != "pass_"}) == fwd
    with pytest.raises(ValueError, match="pass_"):
        TuneProblem(*GPU, "sm80", "bf16", 128, True, 1024, pass_="sideways")
    b, s, _, h, _ = bwd.verify_shape()
    assert b * h * s * s <= 2**26


def test_params_round_trip_and_flops_of_the_backward():
    p = problem()
    for cfg in search.problem_space(p):
        assert search.config_of(p, search.params_of(cfg)) == cfg
    assert search.FAMILY_PARAMS[search.params_key(p)] == ("block_m", "block_n", "num_warps")
    assert bench.flops(2, 4, 128, 128, 64, True, "bwd") == 2.5 * bench.flops(2, 4, 128, 128, 64, True)
    with pytest.raises(ValueError):
        bench.flops(1, 1, 1, 1, 64, False, "sideways")


def test_simulated_backward_search_is_exhaustive_by_default(tmp_path):
    p = problem()
    viable = search.viable_count(p)
    assert 0 < viable <= EXHAUSTIVE_MAX
    opts = SearchOptions(exhaustive=None, storage=f"sqlite:///{tmp_path / 's.db'}")
    assert search.exhaustive_for(p, opts)
    backend = SimulatedBackend(failures={default_bwd_config(128, "bf16", True, "sm90", family="sm80").name: "verify_failed"})
    out = search.search(p, backend, opts)
    assert isinstance(out.best_config, BwdConfig) and out.best.ok
    assert out.trials == viable  # every fitting configuration evaluated, none twice
    assert out.default.status == "verify_failed"  # failures stay values
    assert out.best.tflops == pytest.approx(bench.flops(*_fb(p), "bwd") / (out.best.ms * 1e-3) / 1e12)


def _fb(p: TuneProblem) -> tuple:
    b, sq, sk, h, _ = p.shape()
    return b, h, sq, sk, p.head_dim, p.causal


def test_a_large_space_is_sampled(monkeypatch, tmp_path):
    p = problem()
    monkeypatch.setattr(search, "EXHAUSTIVE_MAX", 3)
    opts = SearchOptions(trials=4, exhaustive=None, storage=f"sqlite:///{tmp_path / 's.db'}")
    assert not search.exhaustive_for(p, opts)
    assert search.exhaustive_for(p, SearchOptions(exhaustive=True))
    assert search.search(p, SimulatedBackend(), opts).trials == 4


def test_cli_tune_pass_bwd_stores_a_backward_entry(tmp_path, capsys):
    tuned = tmp_path / "tuned"
    args = ["tune", "--pass", "bwd", "--head-dim", "128", "--causal", "yes", "--seqlen", "1024", "--simulate",
            "--storage", f"sqlite:///{tmp_path / 's.db'}", "--tuned-dir", str(tuned)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    key = problem().key
    assert f"{key}: exhaustive: all {search.viable_count(problem())} fitting configurations" in out
    assert key in out and "added" in out
    doc = json.loads(store.store_path(*GPU, tuned).read_text())
    e = doc["entries"][key]
    assert e["kernel"].startswith("bwd_sm80_d128_bf16_causal_") and e["problem"]["pass_"] == "bwd"
    cfg = store.lookup(*GPU, 128, "bf16", True, 1000, tuned_dir=tuned, pass_="bwd")
    assert isinstance(cfg, BwdConfig) and cfg.name == e["kernel"]
    assert store.lookup(*GPU, 128, "bf16", True, 1000, tuned_dir=tuned) is None  # no forward tuned
    # --pass both with a budget: sampled; the forward entry goes beside the backward one
    assert cli.main([*args[:2], "both", *args[3:], "--trials", "3"]) == 0
    out = capsys.readouterr().out
    assert "tpe: 3 trials of" in out
    doc = json.loads(store.store_path(*GPU, tuned).read_text())
    assert {problem("fwd").key, key} <= set(doc["entries"])
    assert isinstance(store.lookup(*GPU, 128, "bf16", True, 1000, tuned_dir=tuned), KernelConfig)
    # the studies' winners collected into another store: the backward's too, under the same key
    assert cli.main(["tune", "--collect", "--simulate", "--storage", f"sqlite:///{tmp_path / 's.db'}",
                     "--tuned-dir", str(tmp_path / "collected")]) == 0
    collected = json.loads(store.store_path(*GPU, tmp_path / "collected").read_text())["entries"]
    assert collected[key]["kernel"] == doc["entries"][key]["kernel"]


def test_cli_rejects_trials_with_exhaustive_and_bad_bwd_tiles(capsys):
    assert cli.main(["tune", "--simulate", "--trials", "5", "--exhaustive"]) == 2
    assert "conflict" in capsys.readouterr().err
    assert cli.main(["tune", "--simulate", "--pass", "bwd", "--block-m", "256"]) == 2
    assert "block-m" in capsys.readouterr().err


def test_resolve_backward_kernel_uses_the_tuned_backward(tmp_path, monkeypatch):
    from flashgen import resolve

    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(resolve, "gpu", lambda device: GPU)
    loads = []

    def fake_load_backward(head_dim, dtype, causal, config=None, gpu_arch=None, deterministic=False):
        loads.append(config)
        return config or default_bwd_config(head_dim, dtype, causal, gpu_arch, deterministic)

    monkeypatch.setattr(resolve, "load_backward", fake_load_backward)
    resolve.clear()
    resolve._load_backward.cache_clear()
    default = default_bwd_config(128, "bf16", True, "sm90")
    assert resolve.backward_kernel(0, 128, "bf16", True, 1024) == default  # nothing tuned: the default

    tuned = {1024: BwdConfig(128, "bf16", True, 64, 64, 8, family="sm90", num_stages=1, stagger=True),
             16384: BwdConfig(128, "bf16", True, 64, 128, 12, family="sm90", num_stages=3)}
    slower = BwdConfig(128, "bf16", True, 64, 64, 8)  # a tuned sm80 backward: Hopper takes sm90's family here
    for s, cfg in [*tuned.items(), (1024, slower)]:
        p = TuneProblem(*GPU, cfg.family, "bf16", 128, True, s, pass_="bwd")
        e = {"problem": p.to_dict(), "kernel": cfg.name, "config": cfg.to_dict(), "median_ms": 1.0, "tflops": 1.0,
             "trials": 1}
        store.merge(store.store_path(*GPU), *GPU, {p.key: e})
    monkeypatch.setattr(resolve, "STORE_CHECK_S", 0.0)  # look at the file now, not a second later
    assert resolve.backward_kernel(0, 128, "bf16", True, 900) == tuned[1024]
    assert resolve.backward_kernel(0, 128, "bf16", True, 10000) == tuned[16384]
    assert resolve.backward_kernel(0, 128, "bf16", False, 1024) == default_bwd_config(128, "bf16", False, "sm90")
    det = resolve.backward_kernel(0, 128, "bf16", True, 900, deterministic=True)  # never the tuned atomics one
    assert det == default_bwd_config(128, "bf16", True, "sm90", deterministic=True)
    assert det.deterministic and det.family == "sm90" and det.dq_tma
    n = len(loads)
    monkeypatch.setattr(store, "lookup", lambda *a, **k: pytest.fail("the store was read again"))
    monkeypatch.setattr(resolve, "STORE_CHECK_S", 3600.0)
    for _ in range(3):  # cached: neither the store nor the compiler is asked again
        assert resolve.backward_kernel(0, 128, "bf16", True, 900) == tuned[1024]
    assert len(loads) == n
    resolve.clear()
    resolve._load_backward.cache_clear()


def test_cli_bench_pass_bwd_simulated_table_and_files(tmp_path, capsys):
    assert cli.main(["bench", "--pass", "both", "--simulate", "--head-dim", "128", "--seqlen", "1024",
                     "--causal", "yes", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("pass", "fwd ", "bwd "))]
    assert lines[0].startswith("pass dtype") and "x flash" in lines[0] and "x cudnn" in lines[0]
    assert any(line.startswith("fwd ") for line in lines) and any(line.startswith("bwd ") for line in lines)
    assert "2.5x the forward's FLOPs" in out
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    recs = {r["pass_"]: r for r in doc["results"]}
    assert recs["bwd"]["kernel"].startswith("simulated_bwd")
    # backward rows stand beside FlashAttention-4's backward on the H200 (flashgen/data/peers.json: d128 causal N=1024, 279):
    # their goal is its ratio to this run's cuDNN, the ratio flashgen's backward has to reach
    assert recs["bwd"]["fa4_over_cudnn_target"] == pytest.approx(279 / recs["bwd"]["cudnn_tflops"])
    bwd_cols = next(line for line in lines if line.startswith("bwd ")).split()
    # pass dtype d mask N flashgen api api/kern flash cudnn (x flash) (x cudnn) (FA4 goal) (x FA4 bwd)
    assert bwd_cols[12] == f"{279 / recs['bwd']['cudnn_tflops']:.2f}"
    assert "x FA4 bwd" in lines[0] and recs["fwd"]["ratio_fa4_bwd"] is None
    assert recs["bwd"]["ratio_fa4_bwd"] == pytest.approx(recs["bwd"]["flashgen_tflops"] / 279)
    # a backward point counts 2.5x the forward's FLOPs (the simulated runner's times follow the FLOPs)
    assert recs["bwd"]["flash_ms"] == pytest.approx(2.5 * recs["fwd"]["flash_ms"])
    assert list(tmp_path.glob("*.csv")) and list(tmp_path.glob("*.png"))
