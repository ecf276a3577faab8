"""The halving search on a real GPU: on three small sm90 problems its winner is within 1% of the exhaustive search's.

Run on an sm90 GPU machine: python -m pytest -q -m gpu tests/test_halving_gpu.py
"""
from __future__ import annotations

import pytest
from conftest import needs_gpu_tuner

from flashgen.config import space
from flashgen.problem import TuneProblem
from flashgen.search import SearchOptions, search

pytestmark = needs_gpu_tuner()

# Tiles of 64 and 128 rows, two widths of keys, two stages, seven knobs off: 48 configurations each, a short tune.
OFF = ("exp2_fma", "cluster", "lpt_by_head", "pack_gqa", "o_tma", "p_smem", "q_regs")
# (head_dim, dtype, causal, seqlen, block_n values)
PROBLEMS = [(64, "bf16", False, 1024, (128, 192)), (128, "bf16", True, 4096, (64, 128)),
            (256, "fp16", False, 1024, (64, 128))]


def problem_space(head_dim: int, dtype: str, causal: bool, block_ns: tuple[int, ...]) -> list:
    return [c for c in space("sm90", head_dim, dtype, causal) if c.block_m in (64, 128) and c.block_n in block_ns
            and c.num_stages == 2 and not any(getattr(c, k) for k in OFF)]


@pytest.mark.parametrize("head_dim,dtype,causal,seqlen,block_ns", PROBLEMS,
                         ids=[f"d{p[0]}-{p[1]}-{'causal' if p[2] else 'full'}-{p[3]}" for p in PROBLEMS])
def test_halving_winner_is_within_one_percent_of_the_exhaustive_best(tmp_path, head_dim, dtype, causal, seqlen,
                                                                     block_ns):
    from flashgen.worker import GpuBackend  # noqa: PLC0415 - starts a worker that imports torch

    backend = GpuBackend()
    try:
        if backend.gpu_arch != "sm90":
            pytest.skip(f"an sm90 problem: this GPU is {backend.gpu_arch}")
        p = TuneProblem(backend.gpu_name, backend.gpu_arch, "sm90", dtype, head_dim, causal, seqlen)
        cfgs = problem_space(head_dim, dtype, causal, block_ns)
        assert 24 <= len(cfgs) <= 96
        storage = f"sqlite:///{tmp_path / 'studies.db'}"
        full = search(p, backend, SearchOptions(exhaustive=True, storage=storage), cfgs)
        halved = search(p, backend, SearchOptions(storage=storage, halving_eta=3), cfgs)
        assert full.best_config is not None and halved.best_config is not None
        assert halved.trials == full.trials  # every fitting configuration was measured at rung 0
        if halved.best_config == full.best_config:
            print(f"{p.key}: both searches chose {full.best_config.name}")
            return
        exh_ms, halv_ms = backend.retime([full.best_config, halved.best_config], p, 5)  # side by side
        print(f"{p.key}: exhaustive {full.best_config.name} {exh_ms:.4f} ms, halving {halved.best_config.name} "
              f"{halv_ms:.4f} ms")
        assert halv_ms <= exh_ms * 1.01
    finally:
        backend.close()
