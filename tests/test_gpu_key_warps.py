"""key_warps on the GPU: serving kernels whose key tiles are split between warps and merged after the loop, against a
float64 reference, outputs poisoned with NaN before each launch. Decode tiles split two and four ways (contiguous,
16- and 256-token pages; unsplit, 3 and 16 key ranges, the fused combine; one and four query tokens; sequences of 0,
1, 17, 500 and 1023 keys), keys ramped so that each row's max rises every tile (O's rescale, which a split warp
skips where no max grew), sinks, and varlen prefill tiles with causal, window, softcap and ALiBi (the masks and
biases on each warp's own keys). The bar is flash-attention's (tests/test_gpu_serving.py)."""
from __future__ import annotations

import dataclasses
import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from flashgen.checks import Mods  # noqa: E402
from flashgen.config import KernelConfig, mod_features  # noqa: E402
from flashgen.kernels.serving import arch_and_slots, decode_config, kvcache_launch, launch_prefill  # noqa: E402
from test_gpu_serving import DT, MODS, VARLEN_SEQS, _check_sequences, itertools_accumulate  # noqa: E402
from test_gpu_sinks import _check_seqs, _sinks  # noqa: E402

# (block_m, block_n, warps, stages, key_warps)
DECODE_TILES = [(16, 64, 4, 3, 4), (16, 32, 2, 2, 2), (32, 64, 4, 2, 2), (32, 128, 8, 2, 4)]
DECODE_HEADS = [(64, "fp16"), (128, "bf16"), (256, "bf16")]
PREFILL_TILE = (32, 64, 4, 2)  # two row warps, each tile's keys split two ways


def _mods(mod: str, h: int = 8) -> Mods:
    window, softcap, alibi = MODS.get(mod, ((-1, -1), 0.0, False))
    return Mods(window=window, softcap=softcap,
                alibi=torch.rand(h, device="cuda", dtype=torch.float32) * 0.5 if alibi else None)


def _prefill_config(hd: int, dtype: str, causal: bool, mod: str, split: bool) -> KernelConfig:
    """The prefill tile with the features a call with MODS[mod] takes (none: "none")."""
    window, softcap, alibi = MODS.get(mod, ((-1, -1), 0.0, False))
    features = mod_features(window, softcap, alibi, causal, False)
    return KernelConfig(hd, dtype, causal, *PREFILL_TILE, varlen=True, split=split, key_warps=2, **features)


def key_warps_configs(arch: str) -> set:
    """Every kernel this module launches that fits `arch` (the kernel cache's list)."""
    out = set()
    for tile in DECODE_TILES:
        for hd, dtype in DECODE_HEADS:
            for paged in (False, True):
                for split in (False, True):
                    cfg = decode_config(hd, dtype, tile, paged, split)
                    out |= {cfg, dataclasses.replace(cfg, sinks=True)}
                    if split:
                        out.add(dataclasses.replace(cfg, fused_combine=True))
    for mod in ("none", *MODS):
        for causal in (False, True):
            for split in (False, True):
                out.add(_prefill_config(128, "bf16", causal, mod, split))
    return {c for c in out if c.unfit_reason(arch) is None}


def _cache(batch: int, seqlen_q: int, hd: int, dt, page_size: int, seed: int):
    """q (batch, seqlen_q, 8, hd) against a cache of 2 KV heads (GQA 4), 1024 keys a sequence, paged over shuffled
    pages where page_size > 0: (q, k_arg, v_arg, table, k, v, lens)."""
    torch.manual_seed(seed)
    h, hk, cap = 8, 2, 1024
    lens = torch.tensor([0, 1, 17, 500, 1023][:batch], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, seqlen_q, h, hd, device="cuda", dtype=dt)
    kc, vc = (torch.randn(batch, cap, hk, hd, device="cuda", dtype=dt) for _ in range(2))
    if not page_size:
        return q, kc, vc, None, kc, vc, lens
    pages = cap // page_size
    table = torch.randperm(batch * pages + 3, device="cuda")[:batch * pages].to(torch.int32).view(batch, pages)
    k_arg, v_arg = (torch.randn(batch * pages + 3, page_size, hk, hd, device="cuda", dtype=dt) for _ in range(2))
    k_arg[table.long()] = kc.view(batch, pages, page_size, hk, hd)
    v_arg[table.long()] = vc.view(batch, pages, page_size, hk, hd)
    return q, k_arg, v_arg, table, kc, vc, lens


def _fits(cfg: KernelConfig) -> None:
    reason = cfg.unfit_reason(arch_and_slots(0)[0])
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("tile", DECODE_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("hd,dtype", DECODE_HEADS)
@pytest.mark.parametrize("page_size", [0, 16, 256], ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("splits", [1, 3, 16, -16], ids=["unsplit", "split3", "split16", "fused16"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_decode_matches_reference(tile, hd, dtype, page_size, splits, seqlen_q):
    cfg = decode_config(hd, dtype, tile, bool(page_size), abs(splits) > 1, splits < 0)
    _fits(cfg)
    dt = DT[dtype]
    q, k_arg, v_arg, table, kc, vc, lens = _cache(5, seqlen_q, hd, dt, page_size, hd + seqlen_q + page_size + splits)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((5, q.shape[2], seqlen_q), float("nan"), device="cuda")
    kvcache_launch(cfg, abs(splits), q, k_arg, v_arg, out, lse, lens, table)
    torch.cuda.synchronize()
    _check_sequences([(q[b], kc[b, :lens[b]], vc[b, :lens[b]], out[b], lse[b]) for b in range(5)], False,
                     1 / math.sqrt(hd), dt)


@pytest.mark.parametrize("tile", DECODE_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("grow", [True, False], ids=["max-rises", "max-settles"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_where_the_max_rises_every_tile(tile, grow, splits):
    """Keys scaled along the sequence so that each row's max grows tile after tile (the kernel visits the last key
    tile first) or settles at once: a split warp's skipped rescale, and the one it must not skip."""
    from conftest import ramped_keys

    cfg = decode_config(128, "bf16", tile, False, splits > 1)
    _fits(cfg)
    q, k, v, _, _, _, lens = _cache(5, 1, 128, torch.bfloat16, 0, splits + 10 * grow)
    k = ramped_keys(k, grow)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((5, q.shape[2], 1), float("nan"), device="cuda")
    kvcache_launch(cfg, splits, q, k, v, out, lse, lens, None)
    torch.cuda.synchronize()
    _check_sequences([(q[b], k[b, :lens[b]], v[b, :lens[b]], out[b], lse[b]) for b in range(5)], False,
                     1 / math.sqrt(128), torch.bfloat16)


@pytest.mark.parametrize("tile", DECODE_TILES[:2], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "page16"])
def test_decode_with_sinks(tile, splits, page_size):
    cfg = dataclasses.replace(decode_config(128, "bf16", tile, bool(page_size), splits > 1), sinks=True)
    _fits(cfg)
    q, k_arg, v_arg, table, kc, vc, lens = _cache(4, 1, 128, torch.bfloat16, page_size, splits + page_size)
    sinks = _sinks(q.shape[2])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[2], 1), float("nan"), device="cuda")
    kvcache_launch(cfg, splits, q, k_arg, v_arg, out, lse, lens, table, Mods(sinks=sinks))
    torch.cuda.synchronize()
    _check_seqs([(q[b], kc[b, :lens[b]], vc[b, :lens[b]], out[b], lse[b]) for b in range(4)], sinks, False,
                1 / math.sqrt(128), torch.bfloat16, (-1, -1))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mod", ["none", *MODS])
@pytest.mark.parametrize("splits", [1, 3])
def test_varlen_prefill_matches_reference(causal, mod, splits):
    """Packed sequences (empty, no keys, length 1, odd and unequal both ways), GQA 8/2, masks and biases."""
    cfg = _prefill_config(128, "bf16", causal, mod, splits > 1)
    torch.manual_seed(splits + 2 * causal)
    mods = _mods(mod)
    dt, h, hk = torch.bfloat16, 8, 2
    lq, lk = [a for a, _ in VARLEN_SEQS], [b for _, b in VARLEN_SEQS]
    cu_q = torch.tensor([0, *itertools_accumulate(lq)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools_accumulate(lk)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lq), h, 128, device="cuda", dtype=dt)
    k, v = (torch.randn(sum(lk), hk, 128, device="cuda", dtype=dt) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, sum(lq)), float("nan"), device="cuda")
    launch_prefill(cfg, q, k, v, out, lse, cu_q=cu_q, cu_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                   num_splits=splits, mods=mods, softmax_scale=None)
    torch.cuda.synchronize()
    _check_sequences([(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], out[cu_q[b]:cu_q[b + 1]],
                       lse[:, cu_q[b]:cu_q[b + 1]]) for b in range(len(VARLEN_SEQS))], causal, 1 / math.sqrt(128), dt,
                     mods.window, mods.softcap, mods.alibi)
