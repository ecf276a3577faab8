"""exp2_fma on the GPU against a float64 reference: both sm90 schedules' softmax (the stored d64 tiles among them), each
share, d64 and d128, bf16 and fp16, causal and full, odd lengths and fully masked rows; with lazy rescaling, P above 1
(the polynomial's exponent positive) when the row max rises across the key tiles."""
from __future__ import annotations

import itertools

import pytest
from conftest import compile_grouped, ramped_keys
from test_gpu_fwd import float64_failures  # the suite's float64 check, its bounds

from flashgen.config import EXP2_FMA_SHARES, HALF_DTYPES, KernelConfig

pytestmark = pytest.mark.gpu

PAIRS = [(1, 1), (113, 113), (1023, 1023), (113, 211), (211, 113), (1, 1023), (1023, 1), (2048, 17), (4096, 4096)]
# (block_m, block_n, num_warps, num_stages, overlap, pingpong, persistent, lazy_rescale)
TILES = [(128, 128, 12, 2, False, False, False, False), (128, 128, 12, 2, True, False, False, False),
         (128, 128, 12, 4, True, False, True, True),  # the stored d64 N = 1k causal tile
         (192, 192, 16, 1, False, False, True, False),  # the stored d64 N = 4k full tile
         (128, 256, 12, 1, False, False, True, False), (128, 64, 12, 2, True, True, True, True)]


def configs(head_dim: int, dtype: str, causal: bool) -> list[KernelConfig]:
    out = []
    for (bm, bn, w, s, ov, pp, ps, lz), e in itertools.product(TILES, EXP2_FMA_SHARES[1:]):
        c = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, "sm90", ov, pp, ps, lazy_rescale=lz, exp2_fma=e)
        if c.unfit_reason("sm90") is None:
            out.append(c)
    return out


@pytest.fixture(scope="module")
def kernels():
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("exp2_fma is an sm90-family knob")
    wanted = [c for hd, dt, ca in itertools.product((64, 128), HALF_DTYPES, (False, True)) for c in configs(hd, dt, ca)]
    return compile_grouped(wanted, "sm90", lambda c: (c.head_dim, c.dtype, c.causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_exp2_fma_matches_float64_reference(kernels, head_dim, dtype, causal):
    failures = float64_failures(kernels[(head_dim, dtype, causal)], PAIRS, lambda sq, sk: 2 if max(sq, sk) <= 1024 else 1,
                                4, 2, head_dim, dtype, causal, "gqa")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("grow", [True, False], ids=["growing-max", "falling-max"])
def test_exp2_fma_with_lazy_rescale_when_the_row_max_moves(kernels, grow):
    from flashgen.verify import random_qkv, reference, run_and_judge

    failures = []
    for d, dt, causal in itertools.product((64, 128), HALF_DTYPES, (False, True)):
        lazy = [k for k in kernels[(d, dt, causal)] if k.config.lazy_rescale]
        q, k, v = random_qkv(2, 1023, 1023, 4, 2, d, dt)
        k = ramped_keys(k, grow)
        ref = reference(q, k, v, causal)
        for kern in lazy:
            r = run_and_judge(kern, q, k, v, ref)
            if not r.ok:
                failures.append(f"{kern.name} {dt}: {r.reason}")
    assert not failures, "\n".join(failures)

