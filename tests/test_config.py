import pytest

from flashgen.config import ARCHS, HALF_DTYPES, HEAD_DIMS, ConfigError, KernelConfig, default_config, space

GOOD = dict(head_dim=128, dtype="bf16", causal=True, block_m=128, block_n=64, num_warps=4, num_stages=2)


@pytest.mark.parametrize("field,value,allowed", [
    ("head_dim", 80, "32, 64, 96, 128, 160, 192, 256"),
    ("dtype", "fp32", "'fp16', 'bf16'"),
    ("causal", 1, "False, True"),
    ("block_m", 96, "64, 128, 256"),
    ("block_n", 48, "32, 64, 128, 256"),
    ("num_warps", 3, "2, 4, 8, 12, 16"),
    ("num_stages", 0, "1, 2, 3, 4"),
    ("family", "sm70", "'sm80', 'sm90'"),
])
def test_bad_field_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ConfigError, match=f"{field}={value!r}.*{allowed}".replace("(", r"\(")):
        KernelConfig(**{**GOOD, field: value})


def test_warps_must_tile_block_m():
    with pytest.raises(ConfigError, match="block_m=64 must be a multiple of 16\\*num_warps=128"):
        KernelConfig(**{**GOOD, "block_m": 64, "num_warps": 8})


def test_name_spells_every_field_and_is_hashable():
    c = KernelConfig(**GOOD)
    assert c.name == "fwd_sm80_d128_bf16_causal_bm128_bn64_w4_s2"
    assert len({c, KernelConfig(**GOOD)}) == 1
    assert KernelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="unknown config fields"):
        KernelConfig.from_dict({**c.to_dict(), "tile": 3})


def test_derived_figures():
    c = KernelConfig(**GOOD)
    assert c.threads == 128 and c.warp_m_tiles == 2
    assert c.smem_bytes == (128 + 2 * 2 * 64) * 128 * 2
    assert c.grid(batch=3, heads=5, seqlen_q=129) == (2 * 5 * 3, 1, 1)
    assert c.grid(batch=70000, heads=30000, seqlen_q=1) == (70000 * 30000, 1, 1)  # past 65535 in y and z
    with pytest.raises(ValueError, match="exceed"):
        c.grid(batch=2**16, heads=2**16, seqlen_q=1)


def test_persistent_sm90_config():
    base = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90")
    ps = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", persistent=True)
    assert ps.name == base.name + "_ps" and base.name.endswith("_ov0_pp0")  # stored names of the others unchanged
    assert ps.smem_bytes == base.smem_bytes + 8  # one more mbarrier: the next tile's Q may land
    assert KernelConfig.from_dict(ps.to_dict()) == ps
    assert KernelConfig.from_dict({k: v for k, v in base.to_dict().items() if k != "persistent"}) == base
    # one CTA per SM, fewer when there are fewer tiles; the tile count itself is still checked
    assert ps.grid(batch=4, heads=16, seqlen_q=4096, sm_count=132) == (132, 1, 1)
    assert ps.grid(batch=1, heads=2, seqlen_q=200, sm_count=132) == (2 * 2, 1, 1)
    with pytest.raises(ValueError, match="SM count"):
        ps.grid(batch=1, heads=2, seqlen_q=200)
    with pytest.raises(ValueError, match="exceed"):
        ps.grid(batch=2**16, heads=2**16, seqlen_q=1024, sm_count=132)
    with pytest.raises(ConfigError, match="sm90-family knobs"):
        KernelConfig(128, "bf16", True, 128, 64, 8, 2, persistent=True)
    sp = space("sm90", 128, "bf16", True)
    # the epilogue-overlap and per-head causal order twins come on top (test_compile)
    plain = [c for c in sp if not c.overlap_epilogue and not c.lpt_by_head]
    assert sum(c.persistent for c in plain) * 2 == len(plain)


def test_unfit_reasons_per_arch():
    big = KernelConfig(256, "bf16", False, 128, 64, 8, 2)  # 192 KB of shared memory
    assert big.unfit_reason("sm90") is None
    assert "shared memory" in big.unfit_reason("sm80") and "sm80" in big.unfit_reason("sm80")
    assert "shared memory" in big.unfit_reason("sm86")
    regs = KernelConfig(256, "bf16", False, 128, 128, 4, 1)  # 2 m-tiles per warp of 384 columns
    assert "accumulator registers" in regs.unfit_reason("sm90")
    with pytest.raises(ConfigError, match="arch='sm70'"):
        big.unfit_reason("sm70")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_defaults_fit_every_arch(arch):
    for hd in HEAD_DIMS:
        for dt in HALF_DTYPES:
            for causal in (False, True):
                c = default_config(hd, dt, causal, arch)
                assert c.unfit_reason(arch) is None and (c.head_dim, c.dtype, c.causal) == (hd, dt, causal)


def test_space_is_valid_and_nonempty():
    s = space("sm80", 64, "fp16", False)
    assert len(s) > 50 and len(set(s)) == len(s)
    assert all(c.block_m % (16 * c.num_warps) == 0 for c in s)
