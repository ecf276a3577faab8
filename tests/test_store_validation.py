"""Store entries checked by kind (fwd, bwd, decode, varlen) when the store is read: an entry that is valid JSON
but not a usable entry of its kind is dropped with one warning naming the file and the entry, and the lookup
goes on with the rest (or the untuned rule); a merge refuses it."""
from __future__ import annotations

import json
import warnings

import pytest

from flashgen import store
from flashgen import tune_decode as td
from flashgen import tune_varlen as tv
from flashgen import resolve
from flashgen.config import KernelConfig
from flashgen.store import FORMAT, StoreError, merge, store_path

GPU, ARCH = "NVIDIA H200", "sm90"


def fwd_entry(seqlen: int = 4096, stages: int = 2) -> dict:
    cfg = KernelConfig(128, "bf16", False, 128, 64, 8, stages)
    return {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": 1.0, "trials": 3,
            "problem": {"seqlen": seqlen, "gqa_group": 1, "head_dim": 128}}


def decode_entry(splits: int = 8, heads_k: int = 8, batch: int = 32) -> dict:
    p = td.DecodeProblem(128, "bf16", 32, heads_k, batch, 8192, 16, GPU, ARCH)
    cfg = td.decode_config(128, "bf16", (16, 32, 1, 2), True, splits > 1)
    return {"problem": p.to_dict(), "kernel": cfg.name, "config": cfg.to_dict(), "num_splits": splits,
            "median_ms": 0.3, "trials": 10}


VARLEN_CFG = KernelConfig(128, "bf16", True, 128, 64, 12, 2, "sm90", True, varlen=True)


def varlen_entry(max_len: int = 8192) -> dict:
    p = tv.VarlenProblem(128, "bf16", True, 32, 8, True, 16, 64, max_len, -1, GPU, ARCH)
    return {"problem": p.to_dict(), "kernel": VARLEN_CFG.name, "config": VARLEN_CFG.to_dict(), "median_ms": 1.0}


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def with_problem(e: dict, **fields) -> dict:
    return {**e, "problem": {**e["problem"], **fields}}


BAD = {  # name -> (kind, entry, words of the warning)
    "problem_list": ("fwd", {**fwd_entry(), "problem": [4096, 1]}, "problem"),
    "seqlen_text": ("fwd", with_problem(fwd_entry(), seqlen="abc"), "seqlen"),
    "decode_no_splits": ("decode", without(decode_entry(), "num_splits"), "num_splits"),
    "decode_heads_k_0": ("decode", with_problem(decode_entry(), heads_k=0), "heads_k"),
    "decode_splits_past_cap": ("decode", decode_entry(splits=100000), "num_splits"),
    "varlen_no_window": ("varlen", {**varlen_entry(), "problem": without(varlen_entry()["problem"], "window")},
                         "window"),
}


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_warned", set())
    monkeypatch.setattr(store, "_cache", {})
    resolve.clear()
    yield store_path(GPU, ARCH, tmp_path)
    resolve.clear()


def write(path, entries: dict) -> None:
    path.write_text(json.dumps({"format": FORMAT, "gpu": {"name": GPU, "arch": ARCH}, "entries": entries}))


def lookups(path, kind: str):
    """What each kind's consumer answers from the store at `path`."""
    stamp = resolve.file_stamp(path)
    if kind == "fwd":
        return store.tuned_config(128, "bf16", False, ARCH, 4096, gpu=(GPU, ARCH))
    if kind == "decode":
        return resolve._decode(GPU, ARCH, stamp, 128, "bf16", 32, 8, 32, 8192, 16)
    return resolve._prefill(GPU, ARCH, stamp, 128, "bf16", True, 8192, ("varlen",), -1)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_malformed_entry_warns_once_by_name_and_the_rest_is_used(tuned, name):
    kind, bad, words = BAD[name]
    good = {"fwd": ("sm80_d128_bf16_full_s4096_g1", fwd_entry(stages=3)),
            "decode": ("decode_good", decode_entry(splits=4)),
            "varlen": ("varlen_good", varlen_entry())}[kind]
    write(tuned, {good[0]: good[1], "broken": bad})
    with pytest.warns(UserWarning) as rec:
        answers = [lookups(tuned, kind) for _ in range(3)]
    msgs = [str(r.message) for r in rec if "broken" in str(r.message)]
    assert len(msgs) == 1, [str(r.message) for r in rec]
    assert str(tuned) in msgs[0] and words in msgs[0]
    assert all(a == answers[0] for a in answers)
    if kind == "fwd":
        assert answers[0].num_stages == 3
    elif kind == "decode":
        assert answers[0][1] == 4  # the good entry's split count
    else:
        assert answers[0] == VARLEN_CFG


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_malformed_entry_alone_gives_the_untuned_default(tuned, name):
    kind, bad, _ = BAD[name]
    write(tuned, {"broken": bad})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        answer = lookups(tuned, kind)
    assert answer is None


@pytest.mark.parametrize("name", sorted(BAD))
def test_merge_refuses_a_malformed_entry_by_name(tuned, name):
    _, bad, words = BAD[name]
    with pytest.raises(StoreError, match=words) as e:
        merge(tuned, GPU, ARCH, {"broken": bad})
    assert "broken" in str(e.value) and str(tuned) in str(e.value)
    assert not tuned.exists()


def test_a_store_with_a_malformed_entry_refuses_merges_until_fixed(tuned):
    """Never a silent reset: the damaged entry stays in the file, and a merge says which one it is."""
    write(tuned, {"broken": BAD["decode_no_splits"][1]})
    before = tuned.read_text()
    with pytest.raises(StoreError, match="broken"):
        merge(tuned, GPU, ARCH, {"decode_good": decode_entry()})
    assert tuned.read_text() == before


def test_valid_entries_of_every_kind_pass(tuned):
    entries = {"fwd": fwd_entry(), "decode": decode_entry(splits=store.MAX_SPLITS), "varlen": varlen_entry(),
               "decode1": decode_entry(splits=1)}
    assert set(merge(tuned, GPU, ARCH, entries)) == set(entries)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(store.read_store(tuned, GPU, ARCH)["entries"]) == set(entries)


def test_load_for_an_absent_gpu_takes_the_store_of_that_arch(tmp_path, monkeypatch):
    """load(gpu_arch="sm90") with no Hopper GPU here takes the sm90 store's kernel, not a silent sm80 default."""
    import flashgen
    from flashgen.config import default_config

    monkeypatch.setattr(store, "_warned", set())
    monkeypatch.setattr(store, "current_gpu", lambda: None)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True)
    e = {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": 1.0, "trials": 3,
         "problem": {"seqlen": 4096, "gqa_group": 1, "head_dim": 128}}
    write(store_path("NVIDIA H200", "sm90", tmp_path), {"sm90_d128_bf16_causal_s4096_g1": e})
    assert store.tuned_config(128, "bf16", True, "sm90", 4096, tuned_dir=tmp_path) == cfg
    assert flashgen.choose_config(128, "bf16", True, "sm90", 4096, tuned_dir=tmp_path) == cfg
    with pytest.warns(UserWarning, match="no tuned store for an sm80 GPU"):
        assert store.tuned_config(128, "bf16", True, "sm80", 4096, tuned_dir=tmp_path) is None
    assert flashgen.choose_config(128, "bf16", True, "sm80", 4096, tuned_dir=tmp_path) == default_config(
        128, "bf16", True, "sm80")
