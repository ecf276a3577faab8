"""exp2_fma: a share of the sm90 16-bit forward's exponentials of P on the FMA pipe. Its rules, name and tuning space,
the default kernels left alone, the polynomial exp2's error (emulated in numpy from the template's own constants) and
the kernels that compile with it."""
import dataclasses
import re

import numpy as np
import pytest

from flashgen.config import EXP2_FMA_SHARES, ConfigError, KernelConfig, space
from flashgen.render import render

D64 = KernelConfig(64, "bf16", False, 128, 128, 12, 2, "sm90")  # the non-overlapped schedule: softmax_update
D64_OV = KernelConfig(64, "fp16", True, 128, 128, 12, 2, "sm90", True)  # the overlapped one: softmax_pack


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


def test_rules_name_and_space():
    for bad in (dict(family="sm80", num_warps=8, block_n=64), dict(dtype="fp8_e4m3")):
        with pytest.raises(ConfigError, match="exp2_fma is an sm90 knob for 16-bit"):
            dataclasses.replace(D64, exp2_fma=1, **bad)
    for bad in (3, True, -1):
        with pytest.raises(ConfigError, match="exp2_fma"):
            dataclasses.replace(D64, exp2_fma=bad)
    on = dataclasses.replace(D64, persistent=True, exp2_fma=2)
    assert on.name == dataclasses.replace(on, exp2_fma=0).name + "_ef2" and KernelConfig.from_dict(on.to_dict()) == on
    d = D64.to_dict()
    d.pop("exp2_fma")  # a store entry or trial from before the knob reads as off, under its old name
    assert KernelConfig.from_dict(d) == D64 and "_ef" not in D64.name
    for hd, dt, g in ((64, "bf16", 1), (128, "fp16", 4)):  # every 16-bit tile up to d128 comes with each share
        sp = [c for c in space("sm90", hd, dt, True, gqa_group=g) if not c.desc_step and not c.diag_cut]  # (theirs: after)
        off = [c for c in sp if not c.exp2_fma]
        for e in EXP2_FMA_SHARES[1:]:
            assert [dataclasses.replace(c, exp2_fma=0) for c in sp if c.exp2_fma == e] == off
        mha = [c for c in sp if not c.pack_gqa]  # the tiles without the knob first: their order stays
        assert mha[:len(mha) // len(EXP2_FMA_SHARES)] == [c for c in mha if not c.exp2_fma]
    assert not any(c.exp2_fma for c in space("sm90", 256, "bf16", False) + space("sm90", 64, "fp8_e4m3", False)
                   + space("sm80", 64, "bf16", False))


def test_default_render_has_none_of_it():
    for c in (D64, D64_OV, dataclasses.replace(D64, varlen=True), KernelConfig(64, "bf16", True, 128, 64, 4, 2)):
        src = render(c)
        assert "exp2_fma" not in src and "exp2_p" not in src and "max.NaN" not in src
        on = render(dataclasses.replace(c, exp2_fma=1)) if c.family == "sm90" else None
        assert on is None or ("exp2_fma(x)" in on and "i % 4 == 3 ?" in on)


def test_tune_restricts_it_as_on_or_off():
    from types import SimpleNamespace

    from flashgen.cli.tune import restricted_space
    from flashgen.search import LATE_KNOBS

    args = SimpleNamespace(arch="sm90", block_m=[128], block_n=[128], num_warps=None, num_stages=[2], max_configs=None,
                           **{k: None for k in LATE_KNOBS}, overlap=None, pingpong=None, persistent=None)
    shares = lambda v: {c.exp2_fma for c in restricted_space(SimpleNamespace(**{**vars(args), "exp2_fma": v}),
                                                               64, "bf16", False)}
    assert shares("yes") == {1, 2} and shares("no") == {0} and shares(None) == {0, 1, 2}
    assert LATE_KNOBS["exp2_fma"] == 0  # a trial from before the knob ran without it
    dataclasses.replace(D64, exp2_fma=LATE_KNOBS["exp2_fma"])


# ---- the polynomial exp2, emulated step by step in float32 with the template's constants -------------------------

def _source() -> str:
    src = render(dataclasses.replace(D64, exp2_fma=1))
    return src[src.index("float exp2_fma(float x)"):src.index("float exp2_p(")]


def _f32(x):
    return np.asarray(x, np.float64).astype(np.float32)


def _fma(a, b, c):  # a * b is exact in float64 for float32 operands; one rounding of the sum to float32 (double
    return _f32(a.astype(np.float64) * b + c)  # rounding through float64 is below the bounds tested here)


def exp2_fma_numpy(x: np.ndarray) -> np.ndarray:
    src = _source()
    lo, magic_hex = (np.frombuffer(bytes.fromhex(h)[::-1], np.float32)[0]
                     for h in re.findall(r"0f([0-9A-F]{8})", src))
    magic = float(re.search(r"t - ([0-9.]+)f", src).group(1))
    c3, c2, c1, c0 = map(np.float32, re.search(r"fmaf\(fmaf\(fmaf\(([0-9.e-]+)f, f, ([0-9.e-]+)f\), f, ([0-9.e-]+)f\), "
                                              r"f, ([0-9.e-]+)f\)", src).groups())
    assert magic == magic_hex == 1.5 * 2**23 and lo == -127 and c0 == 1
    x = _f32(x)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.where(np.isnan(x) | (x >= lo), x, lo)  # max.NaN
        t = _f32(np.floor(x.astype(np.float64)) + magic)  # add.rm: exact on [-127, 2^22)
        f = _f32(x - _f32(t - np.float32(magic)))
        p = _fma(_fma(_fma(np.full_like(f, c3), f, c2), f, c1), f, c0)
        bits = ((t.view(np.int32).astype(np.int64) + 127) << 23) & 0xFFFFFFFF
        return _f32(p.astype(np.float64) * bits.astype(np.uint32).view(np.float32))


def test_polynomial_exp2_error():
    x = np.concatenate([np.linspace(-126, 8, 2_000_001), -np.arange(127.0), np.float32(1) - np.logspace(-8, 0, 1000)])
    got, want = exp2_fma_numpy(x).astype(np.float64), np.exp2(_f32(x).astype(np.float64))
    rel = np.abs(got / want - 1)
    assert rel.max() < 8.6e-5 < 2.0**-13  # fp16 rounds P to 2^-11 relative, bf16 to 2^-9
    assert (got[x == np.round(x)] == want[x == np.round(x)]).all()  # 2^j exactly: p(0) = 1
    special = exp2_fma_numpy(np.array([-np.inf, -1e30, -127, -126.5, np.nan, 0.0], np.float32))
    assert special[0] == 0 and special[1] == 0 and special[2] == 0 and special[3] == 0  # flushed, as ex2.approx.ftz
    assert np.isnan(special[4]) and special[5] == 1


# ---- compiled ---------------------------------------------------------------------------------------------------

@pytest.mark.sweep
def test_compiles_for_sm90a_and_moves_exponentials_to_the_fma_pipe():
    """Both schedules' softmax (and a serving kernel's) at each share: spill-free, wgmma left asynchronous, and in the
    SASS a quarter of the MUFU.EX2s of P per share gone (each an FFMA chain instead)."""
    from conftest import compile_sm90a_clean

    from flashgen.compile import disassemble, disassembler

    bases = [D64, D64_OV, KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", False, True, True),
             KernelConfig(64, "bf16", True, 128, 128, 12, 2, "sm90", True, window=True)]
    kernels = compile_sm90a_clean([dataclasses.replace(c, exp2_fma=e) for c in bases for e in EXP2_FMA_SHARES])
    if disassembler() is None:
        return
    for i, c in enumerate(bases):
        ex2, ffma = zip(*((s.count("MUFU.EX2"), s.count("FFMA")) for s in
                          (disassemble(k.cubin) for k in kernels[3 * i:3 * i + 3])))
        moved = ex2[0] - ex2[1]
        assert moved > 0 and ex2[1] - ex2[2] == moved and ffma[0] < ffma[1] < ffma[2], (c.name, ex2, ffma)
