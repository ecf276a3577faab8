"""FP8 (e4m3) forward of the sm90 family on the GPU, against a float64 reference from the dequantized
inputs, with plain FP8 attention emulated in PyTorch as the bar (max error within 2x of it, RMS error
no worse): every FP8 head dim, mask, odd and unequal lengths, MHA/GQA/MQA, descale factors per tensor
and per KV head, the schedule knobs, block quantization of P, fp16 output, the public call."""
from __future__ import annotations

import itertools

import pytest
from conftest import compile_grouped, named_by_filter, skip_if_narrowed

from flashgen.config import FP8_HEAD_DIMS, KernelConfig

pytestmark = pytest.mark.gpu

DT = "fp8_e4m3"
PAIRS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (1, 1023), (1023, 1), (113, 211), (211, 113), (2048, 2048),
         (128, 1024)]
LAYOUTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
# (block_m, block_n, num_warps, num_stages, overlap, pingpong, persistent, block_quant_p, mma_rowsum, lazy_rescale)
TILES = [(128, 128, 12, 2), (128, 128, 12, 2, True), (128, 128, 12, 2, False, True), (128, 64, 12, 3, True, True),
         (64, 128, 8, 2), (192, 64, 16, 2, True), (128, 128, 12, 2, True, False, True),
         (128, 64, 12, 2, False, True, True), (128, 128, 12, 2, True, False, False, True),
         # P's row sums on the tensor cores: each schedule, 64- and 128-key column blocks of the ones, with block_quant_p
         (128, 256, 12, 2, False, False, True, False, True), (128, 192, 12, 2, True, False, True, False, True),
         (128, 128, 12, 2, False, True, False, False, True), (128, 64, 12, 3, True, True, False, False, True),
         (64, 128, 8, 2, False, False, False, False, True), (128, 128, 12, 2, True, False, True, True, True),
         # three consumer warpgroups, as the d64 tune stores them
         (192, 128, 16, 2, False, False, True, False, True), (192, 128, 16, 2, False, False, True),
         # lazy rescaling: each schedule, with and without the row sums on the tensor cores
         (128, 256, 12, 2, False, False, True, False, True, True), (128, 128, 12, 2, False, False, False, False, False, True),
         (128, 192, 12, 2, True, False, True, False, True, True), (128, 64, 12, 3, True, True, False, False, False, True),
         (192, 128, 16, 2, False, False, True, False, True, True)]


# desc_step (descriptors stepped per k-step: Q, K, VT and the row sums' ones): with and without the row sums on the
# tensor cores, each schedule.
DESC_STEP_TILES = [(128, 256, 12, 2, False, False, True, False, True), (128, 128, 12, 2, True, False, False, False, True),
                   (128, 64, 12, 3, True, True), (192, 128, 16, 2, False, False, True, False, True, True)]
# diag_cut (causal: each warpgroup's key loop from its own first tile): 64-key tiles, where warpgroup 0 drops the
# diagonal's upper half, in order with persistent row sums, overlapped ping-pong, three warpgroups.
DIAG_CUT_TILES = [(128, 64, 12, 2, False, False, True, False, True), (128, 64, 12, 3, True, True),
                  (192, 64, 16, 2, True, False, False, False, False, True)]
# v_t (V transposed ahead by the _vt kernel, loaded as VT by TMA): in order with the row sums (128-key column blocks),
# overlapped (FlashAttention-3's d256 tile), ping-pong at 64-key blocks, three warpgroups, block-quantized P,
# three stages.
V_T_TILES = [(128, 256, 12, 2, False, False, True, False, True), (128, 128, 12, 2, True, False, True, False, False, True),
             (128, 64, 12, 2, False, True, True), (192, 128, 16, 2, False, False, True, False, True, True),
             (128, 128, 12, 2, True, False, False, True), (128, 192, 12, 3, True, False, True, False, True),
             (128, 224, 12, 2, True, True, True), (128, 224, 12, 3, False, False, True, False, True)]  # VT_W 32


def fp8_configs(arch: str = "sm90") -> list[KernelConfig]:
    if arch != "sm90":
        return []
    out = []
    knobs = ([(t, {}) for t in TILES] + [(t, {"desc_step": True}) for t in DESC_STEP_TILES]
             + [(t, {"diag_cut": True}) for t in DIAG_CUT_TILES] + [(t, {"v_t": True}) for t in V_T_TILES])
    for d, causal, (tiles, kw) in itertools.product(FP8_HEAD_DIMS, (False, True), knobs):
        if kw.get("diag_cut") and not causal:
            continue
        c = KernelConfig(d, DT, causal, *tiles[:4], "sm90", *tiles[4:7], block_quant_p=bool(tiles[7:] and tiles[7]),
                         mma_rowsum=bool(tiles[8:] and tiles[8]), lazy_rescale=bool(tiles[9:] and tiles[9]), **kw)
        if c.unfit_reason(arch) is None:
            out.append(c)
    return named_by_filter(out)


def compiled_on_sm90(cfgs: list) -> dict:
    """The FP8 kernels compiled and grouped by (head_dim, causal); the test skips without an sm90 GPU."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 wgmma needs an sm90 GPU")
    return compile_grouped(cfgs, "sm90", lambda c: (c.head_dim, c.causal))


@pytest.fixture(scope="module")
def kernels():
    return compiled_on_sm90(fp8_configs())


def failures(kernels: list, q, k, v, descale: dict, causal: bool, case: str) -> list[str]:
    """One line per kernel that misses the FP8 bar on these inputs (reference from their dequantized values)."""
    from flashgen.verify import reference_fp8, run_and_judge

    ref = reference_fp8(q, k, v, descale, causal)
    return [f"{kern.name} {case}: {r.reason}" for kern in kernels
            if not (r := run_and_judge(kern, q, k, v, ref, descale=descale)).ok]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
def test_matches_float64_reference_within_plain_fp8(kernels, head_dim, causal, layout):
    from flashgen.verify import random_fp8

    heads, heads_k = LAYOUTS[layout]
    missed = []
    for i, (sq, sk) in enumerate(PAIRS):
        batch = 2 if max(sq, sk) <= 1024 else 1
        per_head = i % 2 == 1  # descale factors per (batch, KV head) on every other case
        q, k, v, descale = random_fp8(batch, sq, sk, heads, heads_k, head_dim, per_head=per_head)
        missed += failures(kernels[(head_dim, causal)], q, k, v, descale, causal,
                           f"sq={sq} sk={sk} {layout} per_head={per_head}")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
def test_accuracy_bar_with_rotation_and_outliers(kernels, outliers):
    """Incoherent processing (Hadamard rotation of q and k) keeps the same answer and the same bar."""
    from flashgen.verify import random_fp8

    missed = []
    for d in FP8_HEAD_DIMS:
        for rot in (False, True):
            q, k, v, descale = random_fp8(2, 1000, 1000, 4, 2, d, outliers=outliers, hadamard_rotation=rot,
                                          per_head=True)
            missed += failures(kernels[(d, False)], q, k, v, descale, False, f"rotation={rot}")
    assert not missed, "\n".join(missed)


def test_public_call_descale_and_out_dtype(kernels):
    """flashgen.attention on e4m3 inputs: descale factors scale exactly as dequantizing would; fp16 output
    on request; bad descale factors are refused with a clear error."""
    import torch

    import flashgen
    from flashgen.fp8 import quantize
    from flashgen.verify import random_qkv, reference

    q, k, v = random_qkv(2, 300, 500, 8, 2, 128, "bf16")
    q8, k8, v8, descale = quantize(q, k, v, per_head=True)
    out, lse = flashgen.attention(q8, k8, v8, causal=True, return_lse=True, **descale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 8, 300)
    ref = reference(q, k, v, True)
    assert (out.double() - ref.out).pow(2).mean().sqrt().item() < 0.05  # FP8 inputs against the bf16 answer
    out16 = flashgen.attention(q8, k8, v8, causal=True, out_dtype="fp16", **descale)
    assert out16.dtype == torch.float16
    assert (out16.double() - out.double()).abs().max().item() < 1e-2
    # per-tensor descale of 2 on v doubles the output
    one = torch.ones(1, device="cuda")
    o1 = flashgen.attention(q8, k8, v8, q_descale=one, k_descale=one, v_descale=one)
    o2 = flashgen.attention(q8, k8, v8, q_descale=one, k_descale=one, v_descale=2 * one)
    assert torch.equal(o2.float(), 2 * o1.float())
    for d in FP8_HEAD_DIMS:  # block_quant_p on the stored kernels, some with lazy rescaling (which it turns off)
        q, k, v = random_qkv(1, 1024, 1024, 4, 4, d, "bf16")
        q8b, k8b, v8b, desc = quantize(q, k, v)
        for causal in (False, True):
            outb = flashgen.attention(q8b, k8b, v8b, causal=causal, block_quant_p=True, **desc)
            assert (outb.double() - reference(q, k, v, causal).out).pow(2).mean().sqrt().item() < 0.05
    with pytest.raises(ValueError, match="shape"):
        flashgen.attention(q8, k8, v8, q_descale=torch.ones(3, device="cuda"))
    with pytest.raises(TypeError, match="float32"):
        flashgen.attention(q8, k8, v8, q_descale=torch.ones(1, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="sm90"):
        flashgen.attention(q8, k8, v8, arch="sm80")
    with pytest.raises(ValueError, match="FP8"):
        flashgen.attention(q, k, v, q_descale=one)


def test_torch_compile_and_cuda_graph_run_the_fp8_kernel():
    """torch.compile(fullgraph=True) and a captured CUDA graph give eager's FP8 output bit for bit."""
    import torch

    import flashgen
    from flashgen.fp8 import quantize
    from flashgen.verify import random_qkv

    q8, k8, v8, descale = quantize(*random_qkv(2, 257, 300, 8, 2, 128, "bf16"), per_head=True)

    def block(q, k, v, qs, ks, vs):
        return flashgen.attention(q, k, v, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)

    args = (q8, k8, v8, descale["q_descale"], descale["k_descale"], descale["v_descale"])
    eager = block(*args)
    assert torch.equal(torch.compile(block, fullgraph=True)(*args), eager)
    block(*args)  # warm: plans and kernels loaded before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = block(*args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("grow", [True, False], ids=["growing-max", "falling-max"])
def test_lazy_rescale_when_the_row_max_moves(kernels, grow):
    """Keys scaled from 1 to 6 along the sequence: the row max moves from tile to tile (rising in the kernel's
    order when grow), so O and l are rescaled often; every kernel stays within the FP8 bar."""
    from flashgen.fp8 import quantize
    from flashgen.verify import random_qkv
    from conftest import ramped_keys

    missed = []
    for d, causal, (sq, sk) in itertools.product(FP8_HEAD_DIMS, (False, True), ((1023, 1023), (113, 2048))):
        q, k, v = random_qkv(2, sq, sk, 4, 2, d, "bf16")
        q, k, v, descale = quantize(q, ramped_keys(k, grow), v, per_head=True)
        missed += failures(kernels[(d, causal)], q, k, v, descale, causal, f"sq={sq} sk={sk}")
    assert not missed, "\n".join(missed)


# pack_gqa: the query heads of one KV head share a tile (groups of 4, and of 3, which leaves idle rows in 64- and
# 128-row tiles); plain, overlap, persistent ping-pong with the row sums on the tensor cores, three warpgroups; v_t
# (its tenth field) overlapped and persistent with the row sums.
PACK_LAYOUTS = {"8-2": (8, 2), "6-2": (6, 2), "4-1": (4, 1)}
PACK_TILES = [(128, 128, 12, 2), (128, 128, 12, 2, True), (128, 64, 12, 2, False, True, True, False, True),
              (64, 128, 8, 2), (192, 128, 16, 2, False, False, True), (128, 128, 12, 2, True, False, True, False, True, True)]


def pack_fp8_configs(arch: str = "sm90") -> list[KernelConfig]:
    """The pack_gqa FP8 kernels test_pack_gqa_within_plain_fp8 runs (scripts/fill_kernel_cache.py --tests fp8)."""
    if arch != "sm90":
        return []
    out = []
    for d, causal, t in itertools.product(FP8_HEAD_DIMS, (False, True), PACK_TILES):
        c = KernelConfig(d, DT, causal, *t[:4], "sm90", *t[4:7], mma_rowsum=bool(t[8:] and t[8]), pack_gqa=True,
                         v_t=bool(t[9:] and t[9]))
        if c.unfit_reason(arch) is None:
            out.append(c)
    return named_by_filter(out)


@pytest.fixture(scope="module")
def pack_kernels():
    return compiled_on_sm90(pack_fp8_configs())


@pytest.mark.parametrize("layout", list(PACK_LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
def test_pack_gqa_within_plain_fp8(pack_kernels, head_dim, causal, layout):
    from flashgen.verify import random_fp8

    heads, heads_k = PACK_LAYOUTS[layout]
    if (head_dim, causal) not in pack_kernels:
        skip_if_narrowed(f"the pack_gqa kernels of d{head_dim} {'causal' if causal else 'full'}")
    missed = []
    for i, (sq, sk) in enumerate([(1, 1), (17, 17), (113, 113), (1023, 1023), (1, 1023), (113, 211), (211, 113)]):
        per_head = i % 2 == 1  # descale factors per (batch, KV head) on every other case
        q, k, v, descale = random_fp8(2, sq, sk, heads, heads_k, head_dim, per_head=per_head)
        missed += failures(pack_kernels[(head_dim, causal)], q, k, v, descale, causal,
                           f"sq={sq} sk={sk} {layout} per_head={per_head}")
    assert not missed, "\n".join(missed)
