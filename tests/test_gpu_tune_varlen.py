"""Varlen / window tuning on the GPU: a few candidates measured through the pipeline on a packed GQA problem and
on a dense window problem (each verified against float64 in the GPU worker first; a kernel with the wrong mask
fails the worker's verification), the winner stored, and attention_varlen / attention(window_size=...) then
launching exactly it, correctly."""
from __future__ import annotations

import itertools
import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from conftest import tune_on_gpu  # noqa: E402
from flashgen import ops, resolve, tune_varlen as tv  # noqa: E402
from flashgen.config import KernelConfig  # noqa: E402


def packed_candidates(causal: bool = True) -> list[KernelConfig]:
    return [KernelConfig(128, "bf16", causal, 128, 128, 12, 2, "sm90", varlen=True),
            KernelConfig(128, "bf16", causal, 128, 64, 12, 2, "sm90", True, True, varlen=True),
            KernelConfig(128, "bf16", causal, 192, 128, 16, 2, "sm90", varlen=True)]


def window_candidates() -> list[KernelConfig]:
    return [KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, window=True),
            KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", window=True),
            KernelConfig(128, "bf16", True, 128, 64, 12, 2, "sm90", False, False, True, window=True)]


def wrong_mask() -> KernelConfig:
    """A non-causal kernel offered for a causal problem: it must fail verification."""
    return packed_candidates(causal=False)[0]


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    resolve.clear()
    yield tmp_path
    resolve.clear()


def _store_and_spy(p: tv.VarlenProblem, e: dict, monkeypatch) -> list:
    from flashgen.store import merge, store_path

    assert merge(store_path(p.gpu_name, p.gpu_arch), p.gpu_name, p.gpu_arch, {p.key: e}) == {p.key: "added"}
    resolve.clear()  # the store changed just now (a running process sees it within resolve.STORE_CHECK_S)
    seen, real = [], ops.launch_prefill
    monkeypatch.setattr(ops, "launch_prefill", lambda cfg, *a, **k: (seen.append(cfg), real(cfg, *a, **k))[1])
    return seen


def _check(out, q, k, v, cu, causal, window):
    from flashgen.verify import packed_ref

    ref = packed_ref(q, k, v, cu, cu, causal, window, torch.float64)
    same = packed_ref(q, k, v, cu, cu, causal, window, torch.bfloat16).double()
    bound = 2 * (same - ref).abs().max().item() + 1e-5
    err = (out.reshape(ref.shape).double() - ref).abs().max().item()
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def test_tuned_varlen_entry_is_verified_stored_and_used(store, monkeypatch):
    from flashgen import attention_varlen
    from flashgen.driver import device_info

    info = device_info(torch.cuda.current_device())
    p = tv.VarlenProblem(128, "bf16", True, 8, 2, True, 12, 1, 700, -1, info.name, info.arch)
    wrong = tv.Inputs(p).trial(wrong_mask(), 1, 3)  # the worker's trial, here: the wrong mask fails verification
    assert wrong["status"] == "verify_failed" and "max error" in wrong["reason"]
    counts = {}
    e = tune_on_gpu(p, packed_candidates(), store, counts)
    # the 192-row tile spills with the varlen feature: pruned at compile time, never timed or stored
    assert counts == {"ok": 2, "pruned": 1}, counts
    assert e is not None and e["trials"] == 2 and e["default"]["status"] == "ok" and e["tflops"] > 0
    assert e["kernel"] in {c.name for c in packed_candidates()}
    seen = _store_and_spy(p, e, monkeypatch)

    torch.manual_seed(3)
    lens = [5, 1, 700, 0, 333, 64]
    cu = [0, *itertools.accumulate(lens)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    q = torch.randn(cu[-1], 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(cu[-1], 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = attention_varlen(q, k, v, cu_t, cu_t, max(lens), max(lens), causal=True)
    assert seen[-1].name == e["kernel"]
    _check(out, q, k, v, cu, True, -1)


def test_tuned_window_entry_is_verified_stored_and_used(store, monkeypatch):
    import flashgen
    from flashgen.driver import device_info

    info = device_info(torch.cuda.current_device())
    p = tv.VarlenProblem(128, "bf16", True, 8, 2, False, 2, 1023, 1023, 100, info.name, info.arch)
    e = tune_on_gpu(p, window_candidates(), store)
    assert e is not None and e["kernel"] in {c.name for c in window_candidates()}
    seen = _store_and_spy(p, e, monkeypatch)

    torch.manual_seed(4)
    q = torch.randn(3, 1500, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 1500, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = flashgen.attention(q, k, v, causal=True, window_size=(120, 0))
    assert seen[-1].name == e["kernel"]
    cu = [0, 1500, 3000, 4500]
    _check(out, *(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu, True, 120)
    assert math.isfinite(e["median_ms"])


def tune_varlen_configs(arch: str) -> set:
    """The kernels this module loads (scripts/fill_kernel_cache.py), beside the untuned rule's (test_gpu_serving)."""
    return {*packed_candidates(), *window_candidates(), wrong_mask()} if arch == "sm90" else set()
