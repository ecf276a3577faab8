"""Decode tuning on the GPU: a small space measured on one paged problem through the pipeline (every candidate
verified against float64 in the GPU worker first), the winner stored, and attention_with_kvcache(num_splits=0) then launching exactly it, correctly."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from conftest import tune_on_gpu  # noqa: E402
from flashgen import api, resolve, tune_decode as td  # noqa: E402

TILES = [((16, 32, 1, 2), 1), ((16, 32, 1, 2), 4), ((32, 64, 2, 3), 2)]


def candidates():
    return [td.DecodeCandidate(td.decode_config(128, "bf16", t, True, s > 1), s) for t, s in TILES]


def test_tuned_decode_entry_is_verified_stored_and_used(tmp_path, monkeypatch):
    from flashgen import attention_with_kvcache
    from flashgen.bench_serving import paged
    from flashgen.driver import device_info
    from flashgen.store import merge, read_store, store_path

    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    resolve.clear()
    info = device_info(torch.cuda.current_device())
    p = td.DecodeProblem(128, "bf16", 32, 8, 4, 2048, 16, info.name, info.arch)
    e = tune_on_gpu(p, candidates(), tmp_path)
    assert e is not None and e["trials"] == len(TILES) and e["median_ms"] > 0 and e["default"]["status"] == "ok"
    path = store_path(info.name, info.arch)
    assert merge(path, info.name, info.arch, {p.key: e}) == {p.key: "added"}
    assert read_store(path, info.name, info.arch)["entries"][p.key]["num_splits"] == e["num_splits"]
    resolve.clear()  # the store changed just now (a running process sees it within resolve.STORE_CHECK_S)

    seen, real = [], api.kvcache_launch
    monkeypatch.setattr(api, "kvcache_launch", lambda cfg, splits, *a, **k: (seen.append((cfg, splits)),
                                                                                  real(cfg, splits, *a, **k))[1])
    torch.manual_seed(1)
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(4, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_pool, table = paged(kc, 16)
    v_pool = torch.empty_like(k_pool)
    v_pool[table.view(-1).long()] = vc.view(-1, 16, 8, 128)
    out = attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=2048, block_table=table)
    cfg, splits = seen[-1]
    assert (cfg.name, splits) == (e["kernel"], e["num_splits"])
    ref = td.reference(q, kc, vc, torch.float64)
    bound = 2 * (td.reference(q, kc, vc, torch.bfloat16).double() - ref).abs().max().item() + 1e-5
    assert (out.double() - ref).abs().max().item() <= bound


def tune_decode_configs(arch: str) -> set:
    """The kernels this module loads (scripts/fill_kernel_cache.py), beside the rule's (test_gpu_serving)."""
    return {c.config for c in candidates()} if arch else set()
