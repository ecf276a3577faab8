"""On a GPU: the backward's tuning trial (gradients verified against float64, then the kernels timed
alone) through the crash-proof worker, and verify_backward catching a wrong backward."""
from __future__ import annotations

import pytest

from flashgen.config import BwdConfig, default_bwd_config
from flashgen.problem import TuneProblem

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    from flashgen.worker import GpuBackend

    b = GpuBackend(jobs=4)
    yield b
    b.close()


def small(backend, causal: bool, head_dim: int = 64, family: str = "sm80") -> TuneProblem:
    return TuneProblem(backend.gpu_name, backend.gpu_arch, family, "bf16", head_dim, causal, 1024,
                       batch_tokens=2048, heads_dim_total=512, pass_="bwd")


@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_trial_verifies_then_times(backend, causal, family):
    from flashgen.backend import tflops

    if family == "sm90" and backend.gpu_arch != "sm90":
        pytest.skip(f"family sm90 needs a Hopper GPU, not {backend.gpu_arch}")
    p = small(backend, causal, family=family)
    cfg = p.default_config()
    backend.prefetch([cfg], p)
    res = backend.evaluate(cfg, p)
    assert res.ok, res.reason
    assert res.ms > 0 and res.info["max_err"] < 0.1 and res.tflops == pytest.approx(tflops(p, res.ms))


def test_simulated_search_then_real_trials_of_a_small_space(backend, tmp_path):
    from flashgen import search

    p = small(backend, True)
    space = [c for c in search.problem_space(p) if c.num_warps == 4][:4]
    out = search.search(p, backend, search.SearchOptions(exhaustive=None, storage=f"sqlite:///{tmp_path / 's.db'}"),
                        space)
    assert isinstance(out.best_config, BwdConfig) and out.best.ok
    assert out.counts["ok"] >= 1 and not out.counts["verify_failed"]


def test_verify_backward_catches_a_mismatched_forward():
    """out and lse from a forward of the other mask: the gradients cannot match float64."""
    import torch

    from flashgen.compile import compile_kernel, target_for
    from flashgen.config import default_config
    from flashgen.verify import verify_backward

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm{major}{minor}"
    bwd_cfg = default_bwd_config(64, "bf16", True, arch)
    bwd = compile_kernel(bwd_cfg, target_for(arch, bwd_cfg.family))
    good = compile_kernel(default_config(64, "bf16", True, arch, "sm80"), target_for(arch, "sm80"))
    wrong = compile_kernel(default_config(64, "bf16", False, arch, "sm80"), target_for(arch, "sm80"))
    assert verify_backward(bwd, good, 2, 257, 257, 4, 2).ok
    res = verify_backward(bwd, wrong, 2, 257, 257, 4, 2)
    assert not res.ok and "max error" in res.reason
