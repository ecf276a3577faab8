"""desc_step: the sm90 forward's wgmma descriptors made once per tile and stepped per k-step. Its rules, name and
tuning space, the kernels without it left alone, and the kernels with it: built clean, with fewer uniform-datapath
instructions and the same number of wgmma fences."""
import dataclasses
import re

import pytest

from flashgen.config import ConfigError, KernelConfig, space

D128 = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True)


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


def test_rules_name_and_space():
    with pytest.raises(ConfigError, match="desc_step is an sm90 knob"):
        KernelConfig(64, "bf16", False, 128, 64, 4, 2, desc_step=True)
    with pytest.raises(ConfigError, match="desc_step"):
        dataclasses.replace(D128, desc_step=1)
    on = dataclasses.replace(D128, desc_step=True)
    assert on.name == D128.name + "_dst" and KernelConfig.from_dict(on.to_dict()) == on
    assert "desc_step" not in D128.to_dict() and on.to_dict()["desc_step"] is True  # entries from before read as off
    assert dataclasses.replace(on, persistent=False, varlen=True, window=True).desc_step  # serving kernels take it too
    for hd, dt, g in ((64, "bf16", 1), (128, "fp8_e4m3", 1), (256, "fp16", 4)):  # every sm90 tile comes with it, after
        sp = space("sm90", hd, dt, False, gqa_group=g)
        mha = [c for c in sp if not c.pack_gqa and not c.v_t]  # (FP8's v_t copies come after these)
        off = [c for c in mha if not c.desc_step]
        assert mha[:len(off)] == off and [dataclasses.replace(c, desc_step=False) for c in mha[len(off):]] == off
    assert not any(c.desc_step for c in space("sm80", 64, "bf16", False))


def test_the_kernels_without_it_read_as_before():
    from conftest import assert_only_the_switch_differs

    assert_only_the_switch_differs(D128, "desc_step", "_dst")  # a compile-time switch: nothing else differs


@pytest.mark.sweep
def test_it_builds_clean_with_fewer_uniform_instructions():
    """Every descriptor path (Q and K from shared memory, Q in registers, P from shared memory, FP8's VT and the row
    sums' ones, one and three consumer warpgroups): no spills, no wgmma advisories or silent serialization, the same
    WARPGROUP.ARRIVE count as without the knob, and fewer uniform-datapath instructions (the descriptors' arithmetic)."""
    from conftest import compile_sm90a_clean

    from flashgen.compile import disassemble, disassembler

    base = [D128, KernelConfig(256, "bf16", True, 128, 64, 12, 2, "sm90", True, True, True, lazy_rescale=True),
            KernelConfig(64, "bf16", False, 128, 256, 12, 1, "sm90", persistent=True, q_regs=True),
            KernelConfig(128, "fp16", True, 128, 64, 12, 2, "sm90", True, p_smem=True),
            KernelConfig(128, "bf16", True, 192, 64, 16, 2, "sm90", True),
            KernelConfig(128, "fp8_e4m3", False, 128, 256, 12, 2, "sm90", persistent=True, mma_rowsum=True),
            KernelConfig(256, "fp8_e4m3", True, 128, 128, 12, 2, "sm90", persistent=True, mma_rowsum=True, lazy_rescale=True)]
    kernels = compile_sm90a_clean(base + [dataclasses.replace(c, desc_step=True) for c in base])
    if disassembler() is None:
        pytest.skip("no SASS disassembler for the instruction counts (pip install nvidia-cuda-nvdisasm)")
    for off, on in zip(kernels[:len(base)], kernels[len(base):]):
        a, b = disassemble(off.cubin), disassemble(on.cubin)
        uniform = [len(re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?U[A-Z]", s)) for s in (a, b)]
        assert uniform[1] < uniform[0], f"{on.name}: {uniform[1]} uniform instructions, {uniform[0]} without the knob"
        assert a.count("WARPGROUP.ARRIVE") == b.count("WARPGROUP.ARRIVE"), on.name
