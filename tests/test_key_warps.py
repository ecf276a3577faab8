"""key_warps: the sm80 serving kernel's key tiles split between warps, merged through shared memory after the loop.
Its rules, name and dict, registers and shared memory, the decode space and the tuner's parameters, the store's
entries read back with it, the exported header, and the kernels built clean for Ampere and Hopper."""
import dataclasses

import pytest

from flashgen import tunable, tune_decode as td
from flashgen.config import ConfigError, KernelConfig
from flashgen.kernels.serving import decode_config
from flashgen.search import LATE_DECODE_KNOBS

DECODE = decode_config(128, "bf16", (16, 64, 4, 3, 4), False, True)  # one 16-row tile, four warps of 16 keys


def test_where_it_is_refused():
    dense = KernelConfig(128, "bf16", False, 64, 64, 4, 2)
    with pytest.raises(ConfigError, match="key_warps.*serving"):
        dataclasses.replace(dense, key_warps=2)
    with pytest.raises(ConfigError, match="key_warps.*serving"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", varlen=True, key_warps=2)
    with pytest.raises(ConfigError, match="key_warps.*modifiers"):
        KernelConfig(128, "bf16", False, 64, 64, 8, 2, varlen=True, mask_mod="ab", key_warps=2)
    with pytest.raises(ConfigError, match="block_n=32 must be a multiple of 16\\*key_warps=64"):
        dataclasses.replace(DECODE, block_n=32)
    with pytest.raises(ConfigError, match="num_warps=2 must be key_warps=4 times"):
        dataclasses.replace(DECODE, num_warps=2)
    with pytest.raises(ConfigError, match="key_warps=3"):
        dataclasses.replace(DECODE, key_warps=3)


def test_name_dict_registers_and_shared_memory():
    one = dataclasses.replace(DECODE, num_warps=1, key_warps=1)
    assert DECODE.name == one.name.replace("_w1_", "_w4_") + "_kw4"
    assert "key_warps" not in one.to_dict() and DECODE.to_dict()["key_warps"] == 4  # entries from before read as 1
    assert KernelConfig.from_dict(DECODE.to_dict()) == DECODE
    assert (DECODE.row_warps, DECODE.warp_m_tiles, one.warp_m_tiles) == (1, 1, 1)
    # each warp's S holds 16 keys of the 64: a quarter of the one-warp tile's S registers, O's unchanged
    assert one.accum_regs - DECODE.accum_regs == (64 - 16) // 2
    # the three warps past the first hand on O (16 x 128 fp32) and a max and a sum per row and thread, after Q
    assert DECODE.key_merge_bytes == 16 * 128 * 2 + 3 * 4 * 32 * (16 * 4 + 4)
    assert DECODE.smem_bytes == one.smem_bytes  # the three K/V stages hold it
    for hd in (64, 128, 256):  # and so do the stages of every split tile of the decode space
        for bm, bn, w, s, *kw in td.decode_tiles(hd, "bf16", "sm90"):
            cfg = decode_config(hd, "bf16", (bm, bn, w, s, *kw), False, True)
            assert cfg.key_merge_bytes <= cfg.smem_bytes == (bm + 2 * s * bn) * hd * 2


def test_decode_space_has_each_tile_split_two_and_four_ways():
    tiles = td.decode_tiles(128, "bf16", "sm90")
    plain = [t for t in tiles if len(t) == 4]
    assert (32, 64, 2, 3) in plain  # the rule's d128 tile, first, as before
    assert tiles[:len(plain)] == plain
    for bm, bn, w, s, kw in tiles[len(plain):]:
        assert kw in (2, 4) and bn % (16 * kw) == 0 and w // kw in (1, 2) and bm % (16 * (w // kw)) == 0
    assert (16, 64, 4, 3, 4) in tiles and (32, 64, 4, 3, 2) in tiles
    # a warp's share of the keys frees registers: 32 x 128 with one row warp fits split two ways, not whole
    assert (32, 128, 1, 2) not in plain and (32, 128, 2, 2, 2) in tiles
    space = td.space(128, "bf16", "sm90", True, 8192)
    assert {c.key_warps for c, _ in space} == {1, 2, 4}
    assert len({(c.name, s) for c, s in space}) == len(space)


def test_the_tuner_round_trips_it():
    kind = tunable.DecodeKind()
    p = td.DecodeProblem(128, "bf16", 32, 8, 1, 8192, 0, "NVIDIA H200", "sm90")
    for cand in (td.DecodeCandidate(DECODE, 16), td.DecodeCandidate(dataclasses.replace(DECODE, fused_combine=True), 8),
                 td.DecodeCandidate(decode_config(128, "bf16", (32, 64, 2, 3), False, True), 4)):
        params = kind.params_of(p, cand)
        assert len(params) == len(tunable.FAMILY_PARAMS["decode"]) and kind.candidate(p, params) == cand
    assert tunable.FAMILY_PARAMS["decode"][-1] == "key_warps" and LATE_DECODE_KNOBS["key_warps"] == 1  # (older trials)


def test_a_stored_entry_keeps_it(tmp_path, monkeypatch):
    from test_tune_decode import _entry, _use_store

    from flashgen import resolve

    key, e = _entry(1, 8192, 0, tile=(16, 64, 4, 3, 4), splits=16)
    _use_store(tmp_path, monkeypatch, {key: e})
    assert e["config"]["key_warps"] == 4
    assert resolve.tuned_decode(0, 128, "bf16", 32, 8, 1, 8192, 0) == (DECODE, 16)


def test_the_exported_header_launches_every_warp():
    from flashgen.export import header

    h = header(DECODE, [], "sm_90a")
    assert "constexpr int THREADS = 128;" in h and f"::{DECODE.name}<<<dim3(blocks), THREADS, SMEM_BYTES" in h


@pytest.mark.sweep
@pytest.mark.parametrize("target", ["sm_90a", "sm_80"])
def test_it_builds_without_spills(target):
    """Decode tiles split two and four ways (paged and contiguous, split and not, the fused combine, sinks, d64 and
    d256, where every one-warp decode tile spills), and a causal prefill tile with a window, softcap and ALiBi: no
    spills, the shared memory the config says."""
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.compile import compile_kernel

    cfgs = [decode_config(hd, dt, tile, paged, split)
            for hd, dt, tile in ((128, "bf16", (16, 64, 4, 3, 4)), (128, "fp16", (16, 32, 2, 4, 2)),
                                 (64, "bf16", (32, 64, 8, 2, 4)), (256, "bf16", (16, 32, 2, 2, 2)))
            for paged in (False, True) for split in (False, True)]
    cfgs += [dataclasses.replace(DECODE, fused_combine=True), dataclasses.replace(DECODE, sinks=True, paged=True),
             KernelConfig(128, "bf16", True, 32, 64, 4, 2, varlen=True, window=True, softcap=True, alibi=True,
                          key_warps=2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, target), cfgs))
    for k in kernels:
        assert not k.resources.spills, f"{k.name} spills: {k.resources}"
        assert k.resources.smem_bytes == k.config.smem_bytes
