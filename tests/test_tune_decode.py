"""Decode tuning without a GPU: the problem keys, the space, the store entries (read back, ignored by the dense
lookup) and the nearest-entry choice attention_with_kvcache makes from them; the CLI's argument checks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flashgen import resolve, tune_decode as td
from flashgen.store import FORMAT, lookup, read_store

ROOT = Path(__file__).resolve().parent.parent


def _entry(batch: int, n: int, page: int, tile=(16, 32, 1, 2), splits: int = 8, ms: float = 0.3, heads=(32, 8),
           fused: bool = False):
    p = td.DecodeProblem(128, "bf16", *heads, batch, n, page, "NVIDIA H200", "sm90")
    cfg = td.decode_config(128, "bf16", tile, bool(page), splits > 1, fused)
    return p.key, {"problem": p.to_dict(), "kernel": cfg.name, "config": cfg.to_dict(), "num_splits": splits,
                   "median_ms": ms, "tflops": None, "tb_s": p.kv_bytes / (ms * 1e-3) / 1e12, "trials": 10,
                   "default": {"kernel": "rule (flashgen.serving)", "status": "ok", "median_ms": 2 * ms}}


def _write_store(tmp_path, entries: dict):
    """An H200 store file holding `entries`; its path."""
    path = tmp_path / "nvidia-h200-sm90.json"
    path.write_text(json.dumps({"format": FORMAT, "gpu": {"name": "NVIDIA H200", "arch": "sm90"}, "entries": entries}))
    return path


def _use_store(tmp_path, monkeypatch, entries: dict) -> None:
    """Lookups read a store of `entries` as the H200's."""
    _write_store(tmp_path, entries)
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(resolve, "gpu", lambda device: ("NVIDIA H200", "sm90"))
    resolve.clear()


def test_problem_key_and_space():
    p = td.DecodeProblem(128, "bf16", 32, 8, 32, 8192, 16, "NVIDIA H200", "sm90")
    assert p.key == "decode_d128_bf16_h32k8_b32_n8192_p16" and p.to_dict()["pass_"] == "decode"
    sp = td.space(128, "bf16", "sm90", True, 1024)
    assert sp and all(c.paged and c.pack_gqa and c.varlen and c.split == (s > 1) for c, s in sp)
    assert all(s <= -(-1024 // c.block_n) for c, s in sp if s > 1)  # no more ways than key blocks
    assert (32, 64, 2, 3) in td.decode_tiles(128, "bf16", "sm90")  # the rule's d128 tile is in the space
    # every split candidate comes with its combine kernel and with the combine fused; an unsplit one has none
    split = [(c, s) for c, s in sp if s > 1]
    assert {c.fused_combine for c, _ in split} == {False, True} and len(split) % 2 == 0
    assert not any(c.fused_combine for c, s in sp if s == 1)
    assert len({(c.name, s) for c, s in sp}) == len(sp)


def test_store_holds_decode_entries_that_dense_lookups_ignore(tmp_path):
    entries = dict([_entry(32, 8192, 16), _entry(8, 32768, 0, tile=(32, 32, 2, 3), splits=4)])
    path = _write_store(tmp_path, entries)
    assert set(read_store(path, "NVIDIA H200", "sm90")["entries"]) == set(entries)
    assert lookup("NVIDIA H200", "sm90", 128, "bf16", False, 8192, tuned_dir=tmp_path) is None


def test_nearest_entry_matches_layout_group_then_size():
    entries = [e for _, e in (_entry(32, 8192, 16), _entry(32, 8192, 256, splits=1), _entry(1, 131072, 16, splits=64),
                              _entry(32, 8192, 0, splits=1), _entry(32, 8192, 16, heads=(32, 32)))]
    pick = lambda **kw: resolve.decode_entry(entries, **{"head_dim": 128, "dtype": "bf16", "heads": 32, "heads_k": 8,  # noqa: E731
                                                    **kw})
    assert pick(batch=32, cache_len=8192, page_size=16)["problem"]["page_size"] == 16
    assert pick(batch=32, cache_len=8192, page_size=32)["problem"]["page_size"] == 16  # nearest page size
    assert pick(batch=24, cache_len=8192, page_size=0)["problem"]["page_size"] == 0  # contiguous only from contiguous
    assert pick(batch=2, cache_len=100000, page_size=16)["num_splits"] == 64  # nearest size: 1 x 128k
    assert pick(batch=32, cache_len=8192, page_size=16, heads=16, heads_k=16)["problem"]["heads_k"] == 32  # group 1
    assert pick(batch=32, cache_len=8192, page_size=16, head_dim=64) is None


def test_tuned_decode_gives_the_calls_layout(tmp_path, monkeypatch):
    """The stored tile, rebuilt with the call's paged / split flags, and the stored split count."""
    entries = dict([_entry(32, 8192, 16, tile=(16, 32, 1, 2), splits=8)])
    _use_store(tmp_path, monkeypatch, entries)
    cfg, splits = resolve.tuned_decode(0, 128, "bf16", 32, 8, 16, 4096, 16)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, splits) == (16, 32, 1, 2, 8)
    assert cfg.paged and cfg.split and cfg.pack_gqa
    assert resolve.tuned_decode(0, 128, "bf16", 32, 8, 16, 4096, 0) is None  # none contiguous
    resolve.clear()


def test_a_fused_combine_entry_gives_a_fused_kernel(tmp_path, monkeypatch):
    entries = dict([_entry(1, 8192, 0, tile=(32, 64, 2, 2), splits=32, fused=True),
                    _entry(32, 8192, 0, tile=(16, 32, 1, 3), splits=1)])
    _use_store(tmp_path, monkeypatch, entries)
    cfg, splits = resolve.tuned_decode(0, 128, "bf16", 32, 8, 1, 8192, 0)
    assert splits == 32 and cfg.split and cfg.fused_combine and "combine" not in cfg.kernel_names
    cfg, splits = resolve.tuned_decode(0, 128, "bf16", 32, 8, 32, 8192, 0)
    assert splits == 1 and not cfg.split and not cfg.fused_combine
    resolve.clear()


def test_decode_parameters_round_trip_and_an_older_trial_reads_unfused():
    """The tuner's parameters of a decode candidate name its fused combine and key split; a trial stored before the
    knobs (five parameters) ran with the combine kernel and whole key tiles per warp."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    from flashgen import search, tunable

    p = td.DecodeProblem(128, "bf16", 32, 8, 1, 8192, 0, "NVIDIA H200", "sm90")
    kind = tunable.KINDS["decode"]
    for cand in td.candidates(p)[:40]:
        params = kind.params_of(p, cand)
        assert kind.candidate(p, params) == cand
    values = dict(zip(("block_m", "block_n", "num_warps", "num_stages", "num_splits"), (32, 64, 2, 2, 16)))
    t = optuna.trial.create_trial(params=values, value=1.0, user_attrs={"status": "ok"},
                                  distributions={n: CategoricalDistribution([v]) for n, v in values.items()})
    assert search._params(t, "decode") == (32, 64, 2, 2, 16, False, 1)


def test_cli_decode_arguments_are_checked():
    def run(*a):
        return subprocess.run([sys.executable, str(ROOT / "cli.py"), "tune", "--kind", "decode", *a],
                              capture_output=True, text=True, cwd=ROOT)

    r = run("--points", "32", "--compile-only")
    assert r.returncode != 0 and "BATCHxCACHE_LEN" in r.stderr + r.stdout
    r = run("--points", "32x8192", "--pages", "10", "--compile-only")
    assert r.returncode != 0 and "multiples of 16" in r.stderr + r.stdout
