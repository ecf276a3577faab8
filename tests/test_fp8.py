"""FP8 without a GPU: configurations, rendering and ptxas, descale checks, the sm80 family's refusal,
the quantizer and the plain-FP8 emulation."""
from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.config import FP8_HEAD_DIMS, ConfigError, KernelConfig, default_config, space
from flashgen.compile import nvcc_path
from flashgen.launch import FwdParams
from flashgen.render import render

from conftest import compile_sm90a_clean

torch = pytest.importorskip("torch")
DT = "fp8_e4m3"


def test_fp8_configs_are_sm90_only_with_their_own_geometry():
    c = default_config(128, DT, True, "sm90", "sm90")
    assert c.family == "sm90" and c.out_dtype == "bf16" and c.output_dtype == "bf16" and c.elem_bytes == 1
    assert c.smem_w == 128 and c.row_bytes == 128 and c.name.endswith("_obf16")
    assert KernelConfig(64, DT, False, 128, 128, 12, 2, "sm90").row_bytes == 64
    assert KernelConfig(128, DT, False, 128, 128, 12, 2, "sm90", block_quant_p=True, out_dtype="fp16").name.endswith(
        "_ofp16_bq")
    # Q + 3 rings (K, V, VT) of 1-byte elements + 6 barriers per stage + 1 + the alignment slack
    assert c.smem_bytes == 128 * 128 + 3 * 2 * 128 * 128 + 8 * (1 + 6 * 2) + 1024
    with pytest.raises(ConfigError, match="Ampere"):
        KernelConfig(128, DT, False, 128, 64, 8, 2, "sm80")
    with pytest.raises(ConfigError, match="Ampere"):
        default_config(128, DT, False, "sm80", "sm80")
    with pytest.raises(ConfigError, match="head_dim=96"):
        KernelConfig(96, DT, False, 128, 128, 12, 2, "sm90")
    with pytest.raises(ConfigError, match="multiple of 64"):
        KernelConfig(128, DT, False, 128, 96, 12, 2, "sm90")
    with pytest.raises(ConfigError, match="FP8 option"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", block_quant_p=True)
    with pytest.raises(ConfigError, match="writes bf16"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", out_dtype="fp16")
    with pytest.raises(ConfigError, match="multiple of 64.*with v_t also 224"):
        KernelConfig(128, DT, False, 128, 224, 12, 2, "sm90")
    with pytest.raises(ConfigError, match="FP8 tile with v_t"):
        KernelConfig(128, "bf16", False, 128, 224, 12, 2, "sm90")
    sp = space("sm90", 128, DT, False)
    assert sp and all((c.block_n % 64 == 0 or (c.v_t and c.block_n == 224)) and c.fp8 for c in sp)
    assert KernelConfig(128, DT, False, 128, 224, 12, 2, "sm90", v_t=True).vt_w == 32  # VT in boxes of 32 keys
    # a store entry from before FP8 reads back as the same configuration
    old = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90").to_dict()
    old.pop("out_dtype"), old.pop("block_quant_p")
    assert KernelConfig.from_dict(old).name == "fwd_sm90_d128_bf16_causal_bm128_bn128_w12_s2_ov0_pp0"


@pytest.mark.sweep
@pytest.mark.parametrize("d", FP8_HEAD_DIMS)
def test_fp8_kernels_compile_for_sm90a_without_spills_or_serialized_wgmma(d):
    # d256 at 128 keys holds 192 accumulators per thread: its plain schedule fits, ping-pong spills (listed
    # in docs/fp8.md), so d256's variants take 64-key tiles
    bn = 128 if d < 256 else 64
    cfgs = [KernelConfig(d, DT, causal, 128, bn, 12, 2, "sm90", ov, pp, ps, block_quant_p=bq)
            for causal, ov, pp, ps, bq in ((False, False, False, False, False), (True, True, False, True, True),
                                            (True, False, True, False, False), (False, True, True, True, False))]
    cfgs = [c for c in cfgs if c.unfit_reason("sm90") is None] + [KernelConfig(d, DT, True, 64, 64, 8, 2, "sm90")]
    if d == 256:
        cfgs.append(KernelConfig(d, DT, False, 128, 128, 12, 2, "sm90", persistent=True))
    assert len(cfgs) >= 3
    for k in compile_sm90a_clean(cfgs):
        assert f"wgmma.mma_async.sync.aligned.m64n{k.config.block_n}k32.f32.e4m3.e4m3" in k.source


def test_mma_rowsum_is_an_fp8_knob_with_its_own_name_space_and_shared_memory():
    base = KernelConfig(128, DT, False, 128, 256, 12, 2, "sm90", persistent=True)
    rs = KernelConfig(128, DT, False, 128, 256, 12, 2, "sm90", persistent=True, mma_rowsum=True)
    assert rs.name == base.name + "_rs" and rs.smem_bytes == base.smem_bytes + 8 * 256  # the ones tile
    with pytest.raises(ConfigError, match="FP8 knob"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", mma_rowsum=True)
    for causal in (False, True):  # the FP8 space has every tile both ways; 16-bit spaces never have it
        sp = space("sm90", 128, DT, causal)
        on = {dataclasses.replace(c, mma_rowsum=False) for c in sp if c.mma_rowsum}
        assert on == {c for c in sp if not c.mma_rowsum}
        assert not any(c.mma_rowsum for c in space("sm90", 128, "bf16", causal))
    # a store entry (or Optuna trial) from before the knob reads as off: the kernel it measured
    old = base.to_dict()
    old.pop("mma_rowsum")
    assert KernelConfig.from_dict(old) == base


@pytest.mark.sweep
@pytest.mark.parametrize("d", FP8_HEAD_DIMS)
def test_mma_rowsum_kernels_compile_clean_and_sum_on_the_tensor_cores(d):
    bn = 256 if d < 256 else 128  # the tiles the tune stores with it
    cfgs = [KernelConfig(d, DT, causal, 128, bn, 12, 2, "sm90", persistent=True, mma_rowsum=True) for causal in (False, True)]
    cfgs += [KernelConfig(d, DT, False, 128, 128 if d < 256 else 64, 12, 2, "sm90", True, False, True, mma_rowsum=True,
                          block_quant_p=True)]
    cfgs = [c for c in cfgs if not (d == 128 and c.causal)]  # d128 causal bn256 keeps l in local memory: tuned away
    for k in compile_sm90a_clean(cfgs):
        assert "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3" in k.source
        assert "l += pv[nt][2 * h] + pv[nt][2 * h + 1]" not in k.source  # no FADD row sum left
    plain = KernelConfig(d, DT, False, 128, bn, 12, 2, "sm90", persistent=True)
    assert "m64n8k32" not in render(plain) and "l += pv[nt][2 * h] + pv[nt][2 * h + 1]" in render(plain)


def test_sm90_fp8_params_layout_matches_the_host_packing(tmp_path):
    """sizeof and offsets of Sm90Fp8FwdParams, by the host compiler, against what launch packs."""
    from flashgen.abi import SM90_FP8_FWD
    from flashgen.render import template_env

    cfg = default_config(128, DT, False, "sm90", "sm90")
    src = "\n".join(template_env().get_template(t).render(cfg=cfg) for t in ("common/params.cuh.j2", "sm90/params.cuh.j2"))
    (tmp_path / "p.cu").write_text("#include <cstdio>\n#include <cstddef>\n#include <stdint.h>\n" + src + """
int main() { printf("%zu %zu %zu %zu\\n", sizeof(Sm90Fp8FwdParams), offsetof(Sm90Fp8FwdParams, p),
                    offsetof(Sm90Fp8FwdParams, q_descale), offsetof(Sm90Fp8FwdParams, v_descale)); }
""")
    subprocess.run([nvcc_path(), "-o", str(tmp_path / "p"), str(tmp_path / "p.cu")], check=True, capture_output=True)
    size, p_off, q_off, v_off = map(int, subprocess.run([str(tmp_path / "p")], capture_output=True, text=True,
                                                        check=True).stdout.split())
    assert (size, p_off) == (SM90_FP8_FWD.size, 384)
    assert q_off == 384 + ctypes.sizeof(FwdParams) == SM90_FP8_FWD.offset("q_descale.ptr")
    assert v_off == SM90_FP8_FWD.offset("v_descale.ptr")


def test_descale_factors_are_checked_before_any_launch():
    from flashgen.fp8 import descale_bytes

    ok = torch.ones(1)
    with pytest.raises(TypeError, match="q_descale must be float32"):
        descale_bytes(2, 4, 0, q_descale=torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"k_descale must have shape \(1,\) or \(batch, heads_k\) = \(2, 4\)"):
        descale_bytes(2, 4, 0, k_descale=torch.ones(4, 2))
    with pytest.raises(ValueError, match="v_descale is on cpu"):
        descale_bytes(2, 4, 0, v_descale=torch.ones(2, 4))
    with pytest.raises(TypeError, match="float32 CUDA tensor, not float"):
        descale_bytes(2, 4, 0, q_descale=1.0)
    assert ok is not None


def test_quantize_round_trips_and_the_rotation_keeps_the_scores():
    from flashgen.fp8 import DESCALE_NAMES, dequantize, emulate, hadamard, quantize
    from flashgen.verify import attention_ref

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 50, h, 64, generator=g) for h in (6, 2, 2))
    rot = hadamard(64, seed=3).double()
    assert torch.allclose(rot @ rot.T, torch.eye(64, dtype=torch.float64), atol=1e-6)
    for per_head in (False, True):
        for had in (False, True):
            q8, k8, v8, desc = quantize(q, k, v, per_head=per_head, hadamard_rotation=had)
            assert q8.dtype == torch.float8_e4m3fn and set(desc) == set(DESCALE_NAMES)
            assert all(t.shape == ((2, 2) if per_head else (1,)) and t.dtype == torch.float32 for t in desc.values())
            deq = [dequantize(t, desc[n], 2) for t, n in zip((q8, k8, v8), DESCALE_NAMES)]
            # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 of the value (or of the scale's subnormal step)
            assert (deq[2] - v.double()).abs().max() <= v.abs().max() * 2**-4 + 1e-6
            # the rotated q k^T equals the original one up to quantization
            s_ref = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(3, 2))
            s_got = torch.einsum("bqhd,bkhd->bhqk", deq[0], deq[1].repeat_interleave(3, 2))
            assert (s_got - s_ref).abs().max() < 0.15 * s_ref.abs().max()
            ref, _ = attention_ref(*deq, causal=True)
            emu = emulate(q8, k8, v8, desc, causal=True)
            assert 0 < (emu.double() - ref).pow(2).mean().sqrt() < 2e-2


def test_cli_refuses_fp8_outside_sm90():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "cli.py"), "tune", "--arch", "sm80", "--dtype", "fp8",
                        "--head-dim", "128", "--simulate"], capture_output=True, text=True)
    assert r.returncode != 0 and "family sm90" in r.stderr
    r = subprocess.run([sys.executable, str(root / "cli.py"), "bench", "--arch", "sm90", "--dtype", "fp8",
                        "--head-dim", "96", "--simulate"], capture_output=True, text=True)
    assert r.returncode != 0 and "FP8 has head dims 64,128,256" in r.stderr


def test_fp8_goes_through_its_operator_when_traced():
    """flashgen.attention on e4m3 fake or meta tensors runs flashgen::attention_fp8's fake implementation:
    the output in bf16 (or out_dtype), lse fp32, and torch.compile(fullgraph=True) traces through it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flashgen

    f8 = torch.float8_e4m3fn
    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 128, dtype=f8, device="cuda")
        k = torch.empty(2, 300, 2, 128, dtype=f8, device="cuda")
        one = torch.ones(1, device="cuda")
        out, lse = flashgen.attention(q, k, k, causal=True, return_lse=True, q_descale=one, k_descale=one, v_descale=one)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 17)
        assert flashgen.attention(q, k, k, out_dtype="fp16").dtype == torch.float16
        with pytest.raises(TypeError, match="float8_e4m3fn"):  # one FP8 tensor among bf16 ones
            flashgen.attention(q, k.to(torch.bfloat16), k)

    def block(q, k, v, s):
        return flashgen.attention(q, k, v, causal=True, q_descale=s, k_descale=s, v_descale=s).float().sum(-1)

    q = torch.empty(2, 17, 4, 64, dtype=f8, device="meta")
    k = torch.empty(2, 40, 2, 64, dtype=f8, device="meta")
    out = torch.compile(block, fullgraph=True, backend="eager")(q, k, k, torch.ones(1, device="meta"))
    assert out.shape == (2, 17, 4) and out.dtype == torch.float32
