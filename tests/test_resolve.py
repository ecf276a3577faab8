"""flashgen.resolve without a GPU: on a small store of every pass and kind (tests/resolve_cases.py), each lookup
(the dense forward's resolver, the backward, the serving backward, decode, prefill tuned and untuned) picks what
the lookups picked when each kind had its own (tests/resolve_expected.json, recorded from them on these calls);
the one store-stamp check lets every kind see a store change; nearest_entry's rules."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import flashgen.driver as driver
import flashgen.store as store
from flashgen import resolve
from flashgen.config import default_bwd_config

import resolve_cases as rc

EXPECTED = json.loads((Path(__file__).parent / "resolve_expected.json").read_text())


def _fake_compiled(cfg, target):
    return types.SimpleNamespace(config=cfg, resources=types.SimpleNamespace(spills=0), ptxas_log="")


def _fake_load_backward(head_dim, dtype, causal, config=None, gpu_arch=None, deterministic=False):
    return types.SimpleNamespace(config=config or default_bwd_config(head_dim, dtype, causal, gpu_arch, deterministic))


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """The stores of tests/resolve_cases.py in tmp_path; `gpu["now"]` is the GPU every lookup believes it runs on.
    Nothing is compiled: kernels are stand-ins that carry their configuration."""
    rc.build(tmp_path)
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    now = {"now": rc.H200}
    monkeypatch.setattr(driver, "device_info", lambda device=None: driver.DeviceInfo(*now["now"], 132))
    monkeypatch.setattr(store, "current_gpu", lambda: now["now"])
    monkeypatch.setattr(resolve, "gpu", lambda device: now["now"])
    monkeypatch.setattr(resolve, "compiled_kernel", _fake_compiled)
    monkeypatch.setattr(resolve, "load_backward", _fake_load_backward)
    resolve.clear()
    resolve._load_backward.cache_clear()
    resolve._without_spills.cache_clear()
    yield now
    resolve.clear()
    resolve._load_backward.cache_clear()
    resolve._without_spills.cache_clear()


def _ask() -> dict:
    def decode(*a):
        r = resolve.tuned_decode(0, *a)
        return None if r is None else [r[0].name, r[1]]

    def tuned_prefill(hd, dt, causal, q, n, feats, wl):
        r = resolve.tuned_prefill(0, hd, dt, causal, n, feats, wl)
        return None if r is None else r.name

    return {
        "fwd": lambda hd, dt, causal, n, fam, g: resolve.resolver.kernel(0, hd, dt, causal, n, fam,
                                                                          gqa_group=g).config.name,
        "bwd": lambda hd, dt, causal, n, det: resolve.backward_kernel(0, hd, dt, causal, n, det).config.name,
        "serve_bwd": lambda hd, dt, causal, f, det, n: resolve.serve_backward_kernel(0, hd, dt, causal, f, det,
                                                                                     n).config.name,
        "decode": decode,
        "prefill": lambda hd, dt, causal, q, n, feats, wl: resolve.prefill_config(0, hd, dt, causal, q, n, feats,
                                                                                  wl).name,
        "untuned_prefill": lambda hd, dt, causal, q, n, feats, wl: resolve.untuned_prefill_config(
            0, hd, dt, causal, q, n, feats).name,
        "tuned_prefill": tuned_prefill,
    }


@pytest.mark.filterwarnings("ignore:no tuned configuration")
def test_every_kind_picks_what_its_own_lookup_picked(gpu):
    def use_gpu(g):
        if gpu["now"] != g:
            gpu["now"] = g
            resolve.clear()

    got = rc.answers(_ask(), use_gpu)
    assert got.keys() == EXPECTED.keys()
    for kind, want in EXPECTED.items():
        calls = rc.PREFILL if "prefill" in kind else getattr(rc, kind.upper())
        wrong = [(call, g, w) for call, g, w in zip(calls, got[kind], want) if g != w]
        assert not wrong, f"{kind}: {len(wrong)} of {len(want)} differ, first {wrong[:3]}"


def test_one_stamp_check_lets_every_kind_see_a_store_change(gpu, tmp_path, monkeypatch):
    decode = (128, "bf16", 32, 8, 32, 8192, 16)
    assert resolve.tuned_decode(0, *decode) is not None
    assert resolve.tuned_prefill(0, 128, "bf16", True, 8000, {"varlen": True}) is not None
    tuned_bwd = resolve.backward_kernel(0, 128, "bf16", True, 1024).config
    assert tuned_bwd != default_bwd_config(128, "bf16", True, "sm90")
    path = store.store_path(*rc.H200, tmp_path)
    doc = json.loads(path.read_text())
    doc["entries"] = {}
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(resolve, "STORE_CHECK_S", 3600.0)  # not looked at again yet: the cached choices stand
    assert resolve.tuned_decode(0, *decode) is not None
    assert resolve.backward_kernel(0, 128, "bf16", True, 1024).config == tuned_bwd
    monkeypatch.setattr(resolve, "STORE_CHECK_S", 0.0)  # looked at now: every kind sees the empty store
    assert resolve.tuned_decode(0, *decode) is None
    assert resolve.tuned_prefill(0, 128, "bf16", True, 8000, {"varlen": True}) is None
    assert resolve.backward_kernel(0, 128, "bf16", True, 1024).config == default_bwd_config(128, "bf16", True, "sm90")


def _e(pass_: str, ms: float, **problem) -> dict:
    return {"problem": {"pass_": pass_, **problem}, "median_ms": ms}


def test_nearest_entry_matches_then_narrows_then_sums_ratios():
    entries = [_e("decode", 1.0, heads=32, heads_k=8, page_size=16, n=1000, b=1),
               _e("decode", 0.5, heads=32, heads_k=8, page_size=64, n=1000, b=1),
               _e("decode", 2.0, heads=32, heads_k=8, page_size=16, n=8000, b=8),
               _e("varlen", 0.1, heads=32, heads_k=8, page_size=16, n=1000, b=1)]
    near = [("n", 1000, 0), ("b", 1, 0)]
    assert resolve.nearest_entry(entries, "decode", {"group": 4}, near) is entries[1]  # a tie: the faster
    first = [("page_size", 16, 0)]
    assert resolve.nearest_entry(entries, "decode", {"group": 4}, near, first) is entries[0]
    assert resolve.nearest_entry(entries, "decode", {"group": 4}, [("n", 6000, 0), ("b", 8, 0)], first) is entries[2]
    assert resolve.nearest_entry(entries, "decode", {"group": 1}, near) is None
    assert resolve.nearest_entry(entries, "bwd", {}, near) is None
    assert resolve.nearest_bucket(3000, (1024, 4096, 16384)) == 4096
    assert resolve.nearest_bucket(2048, (1024, 4096)) == 4096  # a tie goes to the larger bucket
