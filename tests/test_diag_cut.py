"""diag_cut: each consumer warpgroup of the sm90 causal forward starts its key loop at the first key tile its own rows
see. Its rules, name and tuning space, the kernels without it left alone, and the kernels with it built clean with
the same wgmma fences (the tiles it drops are skipped by the loop's start, not by a branch around a wgmma)."""
import dataclasses

import pytest

from flashgen.config import ConfigError, KernelConfig, space
from flashgen.tune_modifier import modifier_space

D256 = KernelConfig(256, "bf16", True, 128, 64, 12, 2, "sm90", True, True)


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


@pytest.mark.parametrize("change, why", [
    (dict(causal=False), "full"), (dict(block_m=64, num_warps=8), "block_m=64"),
    (dict(varlen=True), "varlen"), (dict(window=True), "window"),
    (dict(family="sm80", overlap=False, pingpong=False, num_warps=8), "family sm80"),
    (dict(mask_mod="ab12"), "modifiers")])
def test_where_it_is_refused(change, why):
    with pytest.raises(ConfigError, match=f"diag_cut.*{why}"):
        dataclasses.replace(D256, diag_cut=True, **change)


def test_name_dict_and_space():
    on = dataclasses.replace(D256, diag_cut=True)
    assert on.name == D256.name + "_dc" and KernelConfig.from_dict(on.to_dict()) == on
    assert "diag_cut" not in D256.to_dict() and on.to_dict()["diag_cut"] is True  # entries from before read as off
    with pytest.raises(ConfigError, match="diag_cut"):
        dataclasses.replace(D256, diag_cut=1)
    for hd, dt, g in ((64, "bf16", 1), (256, "fp16", 4), (128, "fp8_e4m3", 1)):
        sp = space("sm90", hd, dt, True, gqa_group=g)
        mha = [c for c in sp if not c.pack_gqa and not c.v_t]  # (FP8's v_t copies come after these)
        off = [c for c in mha if not c.diag_cut]
        cut = mha[len(off):]  # after the rest: the order of the others stays
        assert cut and all(c.diag_cut for c in cut)
        assert [dataclasses.replace(c, diag_cut=False) for c in cut] == [
            c for c in off if c.block_m >= 128 and c.block_n < c.block_m]
        assert any(c.diag_cut for c in sp if c.pack_gqa) == (g > 1)
        assert not any(c.diag_cut for c in space("sm90", hd, dt, False, gqa_group=g))
    assert not any(c.diag_cut for c in modifier_space("sm90", 128, "bf16", True, 1, "", "", "fwd"))


def test_the_kernels_without_it_read_as_before():
    from conftest import assert_only_the_switch_differs

    assert_only_the_switch_differs(D256, "diag_cut", "_dc")  # a compile-time switch: nothing else differs


@pytest.mark.sweep
def test_it_builds_clean_with_the_same_wgmmas():
    """Every schedule it meets (overlapped ping-pong, persistent with lazy rescaling, in order, three consumer
    warpgroups, FP8, clusters, pack_gqa with the epilogue overlap and Q in registers): no spills, no wgmma advisories or
    silent serialization, and the same wgmma and WARPGROUP.ARRIVE counts as without the knob."""
    from conftest import assert_same_wgmmas, compile_sm90a_clean

    base = [D256, KernelConfig(256, "bf16", True, 128, 64, 12, 2, "sm90", True, True, True, lazy_rescale=True),
            KernelConfig(128, "fp16", True, 128, 64, 12, 2, "sm90", False, True),
            KernelConfig(64, "bf16", True, 192, 64, 16, 2, "sm90", True),
            KernelConfig(128, "fp8_e4m3", True, 128, 64, 12, 2, "sm90", persistent=True, mma_rowsum=True),
            KernelConfig(128, "bf16", True, 128, 64, 12, 2, "sm90", cluster=True),
            KernelConfig(128, "bf16", True, 128, 64, 12, 2, "sm90", True, True, True, overlap_epilogue=True,
                         q_regs=True, pack_gqa=True)]
    kernels = compile_sm90a_clean(base + [dataclasses.replace(c, diag_cut=True) for c in base])
    assert_same_wgmmas(kernels[:len(base)], kernels[len(base):])
