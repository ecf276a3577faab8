"""The tuned store: merging, atomic writes, refusing corrupt or foreign files, and load()'s lookup."""
from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

import pytest

import flashgen
from flashgen import store
from flashgen.config import BwdConfig, KernelConfig, default_config
from flashgen.problem import BATCH_TOKENS, HEADS_DIM_TOTAL, TuneProblem
from flashgen.store import StoreError, config_from_entry, lookup, merge, read_store, store_path

GPU, ARCH = "NVIDIA H200", "sm90"


REPO = Path(__file__).resolve().parent.parent


def entry(ms: float, seqlen: int = 4096, head_dim: int = 128, causal: bool = False, stages: int = 2,
          gqa: int = 1, tokens: int = BATCH_TOKENS, width: int = HEADS_DIM_TOTAL, family: str = "sm80") -> dict:
    cfg = KernelConfig(head_dim, "bf16", causal, 128, 64, 8, stages) if family == "sm80" else \
        KernelConfig(head_dim, "bf16", causal, 128, 128, 12, stages, "sm90")
    return {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": ms, "tflops": 1.0 / ms, "trials": 3,
            "problem": {"seqlen": seqlen, "gqa_group": gqa, "head_dim": head_dim, "batch_tokens": tokens,
                        "heads_dim_total": width}, "date": "2025-01-01"}


def key(seqlen: int = 4096, causal: bool = False, gqa: int = 1) -> str:
    return f"sm80_d128_bf16_{'causal' if causal else 'full'}_s{seqlen}_g{gqa}"


@pytest.fixture
def path(tmp_path):
    return store_path(GPU, ARCH, tmp_path)


def test_path_is_named_for_the_gpu(tmp_path):
    assert store_path(GPU, ARCH, tmp_path).name == "nvidia-h200-sm90.json"


def test_merge_adds_keeps_slower_replaces_faster_and_forces(path):
    assert merge(path, GPU, ARCH, {key(): entry(2.0)}) == {key(): "added"}
    assert merge(path, GPU, ARCH, {key(): entry(3.0)}) == {key(): "kept"}
    assert read_store(path)["entries"][key()]["median_ms"] == 2.0
    assert merge(path, GPU, ARCH, {key(): entry(1.5)}) == {key(): "replaced"}
    assert merge(path, GPU, ARCH, {key(): entry(9.0)}, force=True) == {key(): "replaced"}
    merge(path, GPU, ARCH, {key(1024): entry(0.5, 1024)})
    doc = read_store(path, GPU, ARCH)
    assert doc["entries"][key()]["median_ms"] == 9.0 and set(doc["entries"]) == {key(), key(1024)}


def test_file_is_sorted_indented_and_complete(path):
    merge(path, GPU, ARCH, {key(16384): entry(4.0, 16384), key(1024): entry(1.0, 1024)})
    text = path.read_text()
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert list(path.parent.glob("*.tmp")) == []


def test_a_failed_write_leaves_the_old_file(path, monkeypatch):
    merge(path, GPU, ARCH, {key(): entry(2.0)})
    before = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "replace", boom)
    with pytest.raises(OSError):
        merge(path, GPU, ARCH, {key(): entry(1.0)})
    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ('{"format": "something-else/1", "entries": {}}', "not a flashgen tuned store"),
    ("[1, 2]", "not a flashgen tuned store"),
    ('{"format": "flashgen-tuned/1", "gpu": {"name": "NVIDIA A100", "arch": "sm80"}, "entries": {}}', "made for NVIDIA A100"),
    ('{"format": "flashgen-tuned/1", "gpu": {"name": "NVIDIA H200", "arch": "sm90"}, "entries": {"k": {"config": {"head_dim": 7}}}}', "damaged"),
])
def test_corrupt_or_foreign_files_are_refused_by_name(path, text, words):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with pytest.raises(StoreError, match=words) as e:
        merge(path, GPU, ARCH, {key(): entry(1.0)})
    assert str(path) in str(e.value)
    assert path.read_text() == text  # never reset


def test_lookup_nearest_bucket_and_gqa(tmp_path, path):
    merge(path, GPU, ARCH, {key(1024): entry(1.0, 1024, stages=1), key(16384): entry(1.0, 16384, stages=3),
                            key(4096, gqa=4): entry(0.1, 4096, stages=2, gqa=4),
                            key(4096): entry(1.0, 4096, stages=4)})
    find = lambda s: lookup(GPU, ARCH, 128, "bf16", False, s, tuned_dir=tmp_path).num_stages  # noqa: E731
    assert find(512) == 1 and find(1500) == 1 and find(3000) == 4 and find(9000) == 3
    assert find(None) == 3  # no seqlen: the longest bucket
    assert find(4096) == 4  # GQA group 1 preferred over a faster grouped entry
    assert lookup(GPU, ARCH, 128, "bf16", True, 4096, tuned_dir=tmp_path) is None
    assert lookup(GPU, ARCH, 64, "bf16", False, 4096, tuned_dir=tmp_path) is None
    assert lookup("Other", ARCH, 128, "bf16", False, 4096, tuned_dir=tmp_path) is None


def test_lookup_prefers_the_calls_gqa_group_and_a_packed_kernel_that_holds_it(tmp_path, path):
    """A GQA call (load(gqa_group=...), attention() passes heads // heads_k) takes its group's entry, an sm90
    pack_gqa kernel there; a packed kernel whose tile cannot hold the call's group is never the answer."""
    packed = KernelConfig(128, "bf16", False, 64, 128, 8, 2, "sm90", pack_gqa=True)
    pk = {**entry(0.1, gqa=4, family="sm90"), "config": packed.to_dict(), "kernel": packed.name}
    merge(path, GPU, ARCH, {key(): entry(1.0, stages=3), key(gqa=4) + "_pk": pk})
    find = lambda g: lookup(GPU, ARCH, 128, "bf16", False, 4096, tuned_dir=tmp_path, gqa_group=g)  # noqa: E731
    assert find(4) == packed and find(1).num_stages == 3 and not find(1).pack_gqa
    merge(path, GPU, ARCH, {key(gqa=128): {**pk, "problem": {**pk["problem"], "gqa_group": 128}}})
    assert find(128).num_stages == 3 and not find(128).pack_gqa  # 128 heads a KV head: past its 64-row tile


def test_backward_buckets_prefer_the_calls_gqa_group(tmp_path, path):
    """The backward's buckets (what autograd takes) for a GQA call: its group's tuned entry where the store has one,
    else group 1's; an MHA call never takes a grouped entry."""
    def bwd(ms: float, stages: int, gqa: int, seqlen: int = 4096) -> dict:
        cfg = BwdConfig(128, "bf16", True, 64, 128, 12, False, "sm90", stages, True)
        e = entry(ms, seqlen, causal=True, gqa=gqa)
        return {**e, "config": cfg.to_dict(), "kernel": cfg.name, "problem": {**e["problem"], "pass_": "bwd"}}

    merge(path, GPU, ARCH, {key(causal=True) + "_bwd": bwd(1.0, 3, 1), key(causal=True, gqa=4) + "_bwd": bwd(0.5, 2, 4),
                            key(8192, causal=True) + "_bwd": bwd(2.0, 1, 1, 8192)})
    find = lambda g: {s: c.num_stages for s, c in store.tuned_buckets(  # noqa: E731
        GPU, ARCH, 128, "bf16", True, "bwd", "sm90", tmp_path, gqa_group=g).items()}
    assert find(4) == {4096: 2, 8192: 1} and find(1) == {4096: 3, 8192: 1} and find(8) == find(1)


def test_a_serving_entry_never_answers_a_dense_lookup(tmp_path, path):
    """A serving kernel takes ServeParams, not FwdParams: even a faster one is not a dense call's kernel."""
    serving = KernelConfig(128, "bf16", False, 128, 64, 8, 3, varlen=True, split=True)
    fast = {**entry(0.01), "config": serving.to_dict(), "kernel": serving.name}
    merge(path, GPU, ARCH, {key(): entry(1.0, stages=2), key() + "_vl_sp": fast})
    assert lookup(GPU, ARCH, 128, "bf16", False, 4096, tuned_dir=tmp_path).num_stages == 2
    assert set(store.tuned_buckets(GPU, ARCH, 128, "bf16", False, tuned_dir=tmp_path).values()) == {
        KernelConfig(128, "bf16", False, 128, 64, 8, 2)}


def test_choose_config_reads_the_store_for_the_current_gpu(tmp_path, path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(store, "current_gpu", lambda: (GPU, ARCH))
    monkeypatch.setattr(store, "_warned", set())
    merge(path, GPU, ARCH, {key(): entry(1.0, stages=3)})
    assert flashgen.choose_config(128, "bf16", False, ARCH, seqlen=4000).num_stages == 3
    assert flashgen.choose_config(128, "bf16", False, ARCH, family="sm80").num_stages == 3
    with pytest.warns(UserWarning, match="no tuned configuration") as rec:
        for _ in range(3):  # one warning per problem, not per call
            cfg = flashgen.choose_config(128, "bf16", True, ARCH)
    assert len(rec) == 1 and cfg == default_config(128, "bf16", True, ARCH)


def test_choose_config_without_a_gpu_takes_the_store_of_that_arch(tmp_path, path, monkeypatch):
    """Compiling for an sm90 GPU that is not here (load(gpu_arch="sm90")) takes the sm90 store's kernel."""
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(store, "current_gpu", lambda: None)
    merge(path, GPU, ARCH, {key(): entry(1.0, stages=3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flashgen.choose_config(128, "bf16", False, ARCH) == config_from_entry(entry(1.0, stages=3))


def test_choose_config_on_another_gpu_arch_does_not_use_this_store(tmp_path, path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(store, "current_gpu", lambda: (GPU, ARCH))
    merge(path, GPU, ARCH, {key(): entry(1.0, stages=3)})
    assert flashgen.choose_config(128, "bf16", False, "sm80") == default_config(128, "bf16", False, "sm80")


@pytest.mark.parametrize("damage", ["corrupt", "unreadable"])
def test_an_unusable_store_warns_once_and_load_uses_the_default(tmp_path, path, monkeypatch, damage):
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(store, "current_gpu", lambda: (GPU, ARCH))
    monkeypatch.setattr(store, "_warned", set())
    merge(path, GPU, ARCH, {key(): entry(1.0, stages=3)})
    if damage == "corrupt":
        path.write_text("{oops")
        words = "not valid JSON"
    else:  # as for another user's file without read permission (root reads anyway: fail the read itself)
        real = Path.read_text

        def read_text(self, *a, **k):
            if self == path:
                raise PermissionError(13, "Permission denied")
            return real(self, *a, **k)

        monkeypatch.setattr(Path, "read_text", read_text)
        words = "cannot be read"
    with pytest.warns(UserWarning, match=words) as rec:
        for _ in range(3):  # one warning, not an error at every call
            cfg = flashgen.choose_config(128, "bf16", False, ARCH)
    assert len([r for r in rec if words in str(r.message)]) == 1 and str(path) in str(rec[0].message)
    assert cfg == default_config(128, "bf16", False, ARCH)
    with pytest.raises(StoreError, match=words):  # merge and show still refuse it
        merge(path, GPU, ARCH, {key(): entry(1.0)})


def test_a_rewrite_keeps_the_file_mode(path):
    old = os.umask(0o022)
    try:
        merge(path, GPU, ARCH, {key(): entry(2.0)})
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a new file: the umask's default
        path.chmod(0o664)  # a store shared by a group
        merge(path, GPU, ARCH, {key(): entry(1.0)})
        assert stat.S_IMODE(path.stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_a_quick_tune_at_another_size_does_not_replace_the_entry(path):
    full = TuneProblem(GPU, ARCH, "sm80", "bf16", 128, False, 4096)
    quick = TuneProblem(GPU, ARCH, "sm80", "bf16", 128, False, 4096, batch_tokens=1024, heads_dim_total=512)
    assert merge(path, GPU, ARCH, {full.key: entry(2.0)}) == {full.key: "added"}
    assert merge(path, GPU, ARCH, {quick.key: entry(0.01, tokens=1024, width=512)}) == {quick.key: "added"}
    assert read_store(path)["entries"][full.key]["median_ms"] == 2.0


def test_lookup_never_compares_milliseconds_across_sizes(tmp_path, path):
    find = lambda: lookup(GPU, ARCH, 128, "bf16", False, 4096, tuned_dir=tmp_path)  # noqa: E731
    merge(path, GPU, ARCH, {"small": entry(0.01, stages=1, tokens=1024), "big": entry(9.0, stages=3, tokens=65536),
                            "wide": entry(5.0, stages=4, width=4096)})
    assert find().num_stages == 3  # no standard size: the largest, not the fastest
    merge(path, GPU, ARCH, {"std": entry(2.0, stages=2), "std90": entry(1.0, stages=2, family="sm90"),
                            "quick90": entry(0.01, stages=1, family="sm90", tokens=1024)})
    cfg = find()
    assert (cfg.family, cfg.num_stages) == ("sm90", 2)  # the standard size, fastest family at that size
    assert lookup(GPU, ARCH, 128, "bf16", False, 4096, family="sm80", tuned_dir=tmp_path).num_stages == 2


def test_the_shipped_stores_are_keyed_by_their_problems():
    files = sorted((REPO / "tuned").glob("*.json"))
    assert files
    for f in files:
        doc = read_store(f)
        for k, e in doc["entries"].items():
            kinds = {"decode": "flashgen.tune_decode:DecodeProblem", "varlen": "flashgen.tune_varlen:VarlenProblem"}
            if e["problem"].get("pass_") in kinds:  # tune --kind decode / varlen's entries
                import importlib

                mod, cls = kinds[e["problem"]["pass_"]].split(":")
                fields = {n: v for n, v in e["problem"].items() if n != "pass_"}
                assert k == getattr(importlib.import_module(mod), cls)(**fields).key, f"{f.name}: {k}"
                continue
            assert k == TuneProblem(**e["problem"]).key, f"{f.name}: {k}"


def test_the_same_winner_from_a_grown_study_updates_its_entry(path):
    """A fleet's tuners merge as they leave a study; one that leaves later has seen more trials."""
    merge(path, GPU, ARCH, {key(): entry(2.0)})
    grown = {**entry(2.0), "trials": 9}
    assert merge(path, GPU, ARCH, {key(): grown}) == {key(): "updated"}
    assert read_store(path)["entries"][key()]["trials"] == 9
    assert merge(path, GPU, ARCH, {key(): entry(2.0)}) == {key(): "kept"}  # fewer trials: the entry stays
    assert read_store(path)["entries"][key()]["trials"] == 9


@pytest.mark.parametrize("gpu, arch, family", [("NVIDIA H200", "sm90", "sm90"), ("NVIDIA A100", "sm80", "sm80"),
                                               ("NVIDIA L40S", "sm89", "sm80")])
def test_the_missing_entry_warning_suggests_the_tune_of_the_gpu_in_hand(tmp_path, monkeypatch, gpu, arch, family):
    monkeypatch.setattr(store, "_warned", set())
    with pytest.warns(UserWarning, match="no tuned configuration") as rec:
        assert store.tuned_config(96, "bf16", True, arch, tuned_dir=tmp_path, gpu=(gpu, arch)) is None
    assert f"tune it: flashgen tune --arch {family} --head-dim 96 --dtype bf16" in str(rec[0].message)
