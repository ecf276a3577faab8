"""Both template families on the GPU against a float64 reference: every head dim, dtype, mask,
length pair (odd, unequal both ways) and head layout, several configurations per case (the
sm90 family where the GPU is sm90)."""
from __future__ import annotations

import itertools
import os

import pytest
from conftest import compile_grouped, named_by_filter, skip_if_narrowed

from flashgen.config import HALF_DTYPES, FAMILIES, HEAD_DIMS, KernelConfig, default_config

pytestmark = pytest.mark.gpu

PAIRS = [(1, 1), (17, 17), (113, 113), (128, 128), (211, 211), (1023, 1023), (1024, 1024), (2048, 2048),
         (1, 1023), (1023, 1), (113, 211), (211, 113), (17, 2048), (2048, 17), (128, 1024), (1024, 128)]
LAYOUTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
# Beside each default: other tile shapes that exercise other code paths (sm80: 2 m-tiles per
# warp, 64-thread blocks, 32- and 128-key tiles, 1 to 3 stages; sm90: 1 to 3 consumer
# warpgroups, 64- and 128-key tiles, 1 to 3 stages, overlap and ping-pong on and off).
OTHER_TILES = {
    "sm80": [(64, 32, 2, 3), (128, 128, 8, 1), (64, 64, 4, 2), (128, 32, 4, 1)],
    "sm90": [(64, 64, 8, 1), (128, 64, 12, 3, True, True), (192, 64, 16, 2, True), (64, 128, 8, 2),
             (128, 128, 12, 2, False, True), (128, 128, 12, 2, True), (128, 64, 12, 2, True, True),
             (128, 176, 12, 2, True), (128, 96, 12, 2, False, True),
             # persistent: plain, with overlap, ping-pong, both, one and three consumer warpgroups
             (128, 128, 12, 2, False, False, True), (128, 64, 12, 2, True, False, True),
             (128, 128, 12, 2, False, True, True), (128, 96, 12, 3, True, True, True),
             (64, 64, 8, 2, False, False, True), (192, 64, 16, 2, True, False, True),
             # persistent with overlap_epilogue: O written while the next tile's first QK^T runs
             (128, 64, 12, 2, True, False, True, True), (128, 96, 12, 3, True, True, True, True),
             (192, 64, 16, 2, True, False, True, True),
             # lazy rescaling (overlap schedule): plain, ping-pong + persistent, with overlap_epilogue, three warpgroups
             (128, 128, 12, 2, True, False, False, False, True), (128, 64, 12, 2, True, True, True, False, True),
             (128, 96, 12, 3, True, True, True, True, True), (192, 64, 16, 2, True, False, False, False, True),
             # three consumer warpgroups at 32 registers of headroom (d64 only): 128-key tiles with overlap
             # (FlashAttention-3's d64 tile), plain and persistent + lazy; 192-key tiles without (both spill a little)
             (192, 128, 16, 2, True), (192, 128, 16, 3, True, False, True, False, True), (192, 192, 16, 2),
             # Q in registers: plain, overlap + lazy, persistent ping-pong (Q's buffer freed at the tile's start),
             # persistent with overlap_epilogue, one consumer warpgroup
             (128, 128, 12, 2, False, False, False, False, False, True),
             (128, 128, 12, 2, True, False, False, False, True, True), (128, 128, 12, 2, False, True, True, False, False, True),
             (128, 96, 12, 3, True, False, True, True, False, True), (64, 128, 8, 2, False, False, False, False, False, True),
             # P from shared memory: plain, overlap + lazy, persistent ping-pong, persistent with overlap_epilogue,
             # one consumer warpgroup; with Q in registers too
             (128, 128, 12, 2, False, False, False, False, False, False, True),
             (128, 64, 12, 2, True, False, False, False, True, False, True),
             (128, 128, 12, 2, False, True, True, False, False, False, True),
             (128, 64, 12, 3, True, False, True, True, False, False, True),
             (64, 128, 8, 2, False, False, False, False, False, False, True),
             (128, 128, 12, 2, True, True, True, False, True, True, True),
             # O through shared memory and bulk copies: plain, persistent + overlap + lazy, persistent ping-pong,
             # persistent with overlap_epilogue (three warpgroups), with Q in registers, one consumer warpgroup
             (128, 128, 12, 2, False, False, False, False, False, False, False, True),
             (128, 128, 12, 2, True, False, True, False, True, False, False, True),
             (128, 64, 12, 2, False, True, True, False, False, False, False, True),
             (192, 64, 16, 2, True, False, True, True, False, False, False, True),
             (128, 128, 12, 2, True, True, True, False, True, True, False, True),
             (64, 128, 8, 2, False, False, True, False, False, False, False, True),
             # 2-CTA clusters sharing K/V by TMA multicast: plain, overlap + ping-pong + lazy, one and three consumer
             # warpgroups, three stages with P from shared memory, ping-pong with Q in registers and O by bulk copies;
             # 64-key tiles (the d256 default's)
             (128, 128, 12, 2, False, False, False, False, False, False, False, False, True),
             (128, 64, 12, 2, False, False, False, False, False, False, False, False, True),
             (128, 128, 12, 2, True, True, False, False, True, False, False, False, True),
             (64, 128, 8, 2, False, False, False, False, False, False, False, False, True),
             (192, 64, 16, 2, True, False, False, False, False, False, False, False, True),
             (128, 64, 12, 3, True, False, False, False, True, False, True, False, True),
             (128, 128, 12, 2, False, True, False, False, False, True, False, True, True),
             # persistent clusters (both CTAs walk the same m-block pairs): plain, overlap + ping-pong + overlap_epilogue,
             # ping-pong with Q in registers (Q's buffer freed early), three warpgroups with overlap_epilogue and o_tma
             (128, 128, 12, 2, False, False, True, False, False, False, False, False, True),
             (128, 96, 12, 3, True, True, True, True, False, False, False, False, True),
             (128, 128, 12, 2, False, True, True, False, False, True, False, False, True),
             (192, 64, 16, 2, True, False, True, True, False, False, False, True, True),
             # the causal persistent order head by head (lpt_by_head; full-mask runs take the tile without it): plain,
             # overlap + ping-pong + overlap_epilogue + lazy + o_tma (the stored d128 N = 4k tile), 64-key tiles, three
             # consumer warpgroups, one
             (128, 128, 12, 2, False, False, True, False, False, False, False, False, False, True),
             (128, 128, 12, 2, True, True, True, True, True, False, False, True, False, True),
             (128, 64, 12, 2, True, True, True, False, True, False, False, False, False, True),
             (192, 192, 16, 2, False, False, True, False, False, False, False, False, False, True),
             (64, 128, 8, 2, False, False, True, False, False, False, False, False, False, True)],
}

# desc_step (each tile's descriptors stepped per k-step) with every descriptor path: Q and K from shared memory, Q in
# registers, P from shared memory, one and three consumer warpgroups, each schedule, persistent with lazy rescaling.
DESC_STEP_SM90 = [dict(block_m=128, block_n=128, num_warps=12, num_stages=2),
                  dict(block_m=128, block_n=64, num_warps=12, num_stages=3, overlap=True, pingpong=True, persistent=True,
                       lazy_rescale=True),
                  dict(block_m=128, block_n=128, num_warps=12, num_stages=2, pingpong=True, q_regs=True),
                  dict(block_m=128, block_n=64, num_warps=12, num_stages=2, overlap=True, p_smem=True),
                  dict(block_m=192, block_n=64, num_warps=16, num_stages=2, overlap=True),
                  dict(block_m=64, block_n=128, num_warps=8, num_stages=2, persistent=True)]

# diag_cut (causal: each warpgroup's key loop starts at its own first key tile): 64- and 96-key tiles, where the
# tiles warpgroup 0 drops vary with the m-block and the length pair, in each schedule (in order, overlapped ping-pong,
# persistent with lazy rescaling and the epilogue overlap, three warpgroups, a cluster, Q in registers).
DIAG_CUT_SM90 = [dict(block_m=128, block_n=64, num_warps=12, num_stages=2, overlap=True, pingpong=True),
                 dict(block_m=128, block_n=96, num_warps=12, num_stages=2, pingpong=True),
                 dict(block_m=128, block_n=64, num_warps=12, num_stages=3, overlap=True, persistent=True,
                      overlap_epilogue=True, lazy_rescale=True),
                 dict(block_m=192, block_n=64, num_warps=16, num_stages=2, overlap=True),
                 dict(block_m=128, block_n=64, num_warps=12, num_stages=2, cluster=True),
                 dict(block_m=128, block_n=64, num_warps=12, num_stages=2, persistent=True, pingpong=True, q_regs=True)]


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def configs_for(head_dim: int, dtype: str, causal: bool, arch: str) -> list[KernelConfig]:
    cfgs = []
    families = os.environ.get("FLASHGEN_TEST_FAMILIES", ",".join(FAMILIES)).split(",")  # e.g. sm80 alone
    for family in families:
        if family == "sm90" and arch != "sm90":
            continue  # the Hopper family runs only on sm90
        cfgs.append(default_config(head_dim, dtype, causal, arch, family))
        others = []
        for tiles in OTHER_TILES[family]:
            c = KernelConfig(head_dim, dtype, causal, *tiles[:4], family, *tiles[4:7],
                             overlap_epilogue=tiles[7:8] == (True,), lazy_rescale=tiles[8:9] == (True,),
                             q_regs=tiles[9:10] == (True,), p_smem=tiles[10:11] == (True,), o_tma=tiles[11:12] == (True,),
                             cluster=tiles[12:13] == (True,), lpt_by_head=causal and tiles[13:14] == (True,))
            if c.unfit_reason(arch) is None and c not in cfgs + others:
                others.append(c)
        for kw in DESC_STEP_SM90 if family == "sm90" else ():
            c = KernelConfig(head_dim, dtype, causal, family="sm90", desc_step=True, **kw)
            if c.unfit_reason(arch) is None:
                others.append(c)
        for kw in DIAG_CUT_SM90 if family == "sm90" and causal else ():
            c = KernelConfig(head_dim, dtype, causal, family="sm90", diag_cut=True, **kw)
            if c.unfit_reason(arch) is None:
                others.append(c)
        cfgs += named_by_filter(others)
    return cfgs


@pytest.fixture(scope="session")
def kernels():
    """Every kernel the suite launches, compiled up front on all cores (nvcc runs in subprocesses)."""
    arch = _arch()
    wanted = [c for hd, dt, causal in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True))
              for c in configs_for(hd, dt, causal, arch)]
    return compile_grouped(wanted, arch, lambda c: (c.head_dim, c.dtype, c.causal))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_float64_reference(kernels, head_dim, dtype, causal, layout):
    heads, heads_k = LAYOUTS[layout]
    failures = float64_failures(kernels[(head_dim, dtype, causal)], PAIRS,
                                lambda sq, sk: 2 if max(sq, sk) <= 1024 else 1, heads, heads_k, head_dim, dtype, causal,
                                layout)
    assert not failures, "\n".join(failures)


def float64_failures(kerns: list, pairs: list, batch_of, heads: int, heads_k: int, head_dim: int, dtype: str,
                     causal: bool, tag: str) -> list[str]:
    """Each kernel on fresh inputs (batch_of(seqlen_q, seqlen_k) sequences) of each length pair against float64:
    one line per miss."""
    from flashgen.verify import random_qkv, reference, run_and_judge

    failures = []
    for sq, sk in pairs:
        q, k, v = random_qkv(batch_of(sq, sk), sq, sk, heads, heads_k, head_dim, dtype)  # fresh every case
        ref = reference(q, k, v, causal)
        for kern in kerns:
            r = run_and_judge(kern, q, k, v, ref)
            if not r.ok:
                failures.append(f"{kern.name} sq={sq} sk={sk} {tag}: {r.reason}")
    return failures


# Persistent kernels with many more tiles than SMs (each CTA runs several, stage and Q phases carried
# across tiles), with tiles whose rows see no key between others (causal, seqlen_q > seqlen_k), and
# with a negative scale (Q negated in shared memory once per tile).
PERSISTENT_CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k, causal, softmax_scale)
    (4, 2048, 2048, 16, 16, False, None), (4, 2048, 2048, 16, 4, True, None), (3, 1500, 700, 12, 3, True, None),
    (2, 777, 1900, 8, 8, True, -0.2), (1, 64, 64, 1, 1, False, None),
]


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_persistent_kernels_across_many_tiles(kernels, case):
    from flashgen.driver import device_info
    from flashgen.verify import random_qkv, reference, run_and_judge

    if _arch() != "sm90" or "sm90" not in os.environ.get("FLASHGEN_TEST_FAMILIES", "sm90"):
        pytest.skip("the persistent kernels are sm90-family")
    batch, sq, sk, heads, heads_k, causal, scale = case
    sms, failures = device_info().sm_count, []
    for d in (64, 128, 256):
        q, k, v = random_qkv(batch, sq, sk, heads, heads_k, d, "bf16")
        ref = reference(q, k, v, causal, scale)
        persistent = [k_ for k_ in kernels[(d, "bf16", causal)] if k_.config.persistent]
        if not persistent:
            skip_if_narrowed(f"the persistent kernels of d{d}")
        assert persistent, f"no persistent kernel fits d{d}"
        for kern in persistent:
            tiles = -(-sq // kern.config.block_m) * heads * batch
            r = run_and_judge(kern, q, k, v, ref, scale)
            if not r.ok:
                failures.append(f"{kern.name} ({tiles} tiles on {sms} SMs): {r.reason}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("grow", [True, False], ids=["growing-max", "falling-max"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_lazy_rescale_when_the_row_max_moves(kernels, dtype, grow):
    """Lazy rescaling keeps a stale max while it is within the slack and rescales when it is not: scores whose max
    rises across the key tiles in the kernel's order must give the reference answer, as must falling ones."""
    from conftest import ramped_keys
    from flashgen.verify import random_qkv, reference, run_and_judge

    if _arch() != "sm90":
        pytest.skip("lazy rescaling is an sm90-family knob")
    failures = []
    for d, causal, (sq, sk) in itertools.product((64, 128, 256), (False, True), ((1023, 1023), (113, 2048))):
        lazy = [k_ for k_ in kernels[(d, dtype, causal)] if k_.config.lazy_rescale]
        if not lazy:
            continue
        q, k, v = random_qkv(2, sq, sk, 4, 2, d, dtype)
        k = ramped_keys(k, grow)
        ref = reference(q, k, v, causal)
        for kern in lazy + [k_ for k_ in kernels[(d, dtype, causal)] if k_.config.overlap and not k_.config.lazy_rescale]:
            r = run_and_judge(kern, q, k, v, ref)
            if not r.ok:
                failures.append(f"{kern.name} sq={sq} sk={sk}: {r.reason}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_diag_cut_changes_no_bit(kernels, dtype):
    """The key tiles diag_cut drops held only masked scores for the warpgroup that drops them: in the in-order
    schedule (where a tile's softmax is the same code first or later) the output and LSE are the same bit for bit with
    and without it, at length pairs that move the diagonal across the key tiles (equal, unequal both ways, rows that
    see no key). The overlapped schedule's first tile takes the prologue's softmax, whose rounding differs: those
    kernels are held to the float64 reference above."""
    import dataclasses

    import torch

    from flashgen.compile import compile_kernel
    from flashgen.kernels.dense import run
    from flashgen.verify import poisoned_outputs, random_qkv

    if _arch() != "sm90":
        pytest.skip("diag_cut is an sm90-family knob")
    cut = [k_ for d in (64, 128, 256) for k_ in kernels[(d, dtype, True)] if k_.config.diag_cut and not k_.config.overlap]
    if not cut:
        skip_if_narrowed("the diag_cut kernels")
    assert cut, "no diag_cut kernel fits"
    failures = []
    for kern in cut:
        twin = compile_kernel(dataclasses.replace(kern.config, diag_cut=False), "sm_90a")
        for sq, sk in ((1023, 1023), (113, 211), (211, 113), (1, 1023), (2048, 17), (777, 1900)):
            q, k, v = random_qkv(2, sq, sk, 6, 2, kern.config.head_dim, dtype)
            got = []
            for kk in (kern, twin):
                out, lse = poisoned_outputs(q)
                run(kk, q, k, v, out=out, lse=lse)
                got.append((out, lse))
            torch.cuda.synchronize()
            if not (torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])):
                failures.append(f"{kern.name} sq={sq} sk={sk}: differs from {twin.name}")
    assert not failures, "\n".join(failures)


def test_softmax_scale_and_strided_inputs(kernels):
    """q, k, v sliced out of one packed qkv tensor (non-contiguous heads), with a custom scale."""
    import torch

    import flashgen
    from flashgen.verify import reference

    qkv = torch.randn(2, 300, 3, 8, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out, lse = flashgen.attention(q, k, v, causal=True, softmax_scale=0.3, return_lse=True)
    ref = reference(q, k, v, True, 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 300)
    assert (out.double() - ref.out).abs().max().item() <= ref.bound
    assert (lse - ref.lse).abs().max().item() <= 1e-3


def test_runs_on_current_stream():
    """Queued behind a sleep on the caller's stream, the output is not written until the sleep ends:
    a launch on any other stream would have written it already."""
    import torch

    import flashgen
    from flashgen.kernels.dense import run
    from flashgen.verify import poisoned_outputs, random_qkv, reference

    q, k, v = random_qkv(1, 512, 512, 4, 4, 128, "fp16")
    kern = flashgen.load(128, "fp16", False)
    run(kern.compiled, q, k, v)  # the first launch in a context loads the module, which waits for the GPU
    flashgen.attention(q, k, v)
    out, lse = poisoned_outputs(q)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~100 ms of a busy stream
        run(kern.compiled, q, k, v, out=out, lse=lse)
    early = out.clone()  # on the default stream, which does not wait for s
    torch.cuda.current_stream().synchronize()
    assert not s.query(), "the sleep ended before the check: lengthen it"
    assert torch.isnan(early).all(), "the kernel did not wait for the work queued ahead of it on the caller's stream"
    s.synchronize()
    ref = reference(q, k, v, False)
    assert (out.double() - ref.out).abs().max().item() <= ref.bound
    with torch.cuda.stream(s):  # the public call takes the same stream
        torch.cuda._sleep(200_000_000)
        out2 = flashgen.attention(q, k, v)
    assert not s.query()
    s.synchronize()
    assert (out2.double() - ref.out).abs().max().item() <= ref.bound


def test_sm90_family_on_hopper(kernels):
    """On an sm90 GPU the Hopper family is among the kernels checked above, and its SASS uses wgmma."""
    import subprocess
    import tempfile

    if _arch() != "sm90":
        pytest.skip("the sm90 family needs an sm90 GPU")
    k = next(k for k in kernels[(128, "bf16", True)] if k.config.family == "sm90")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.cubin)
        f.flush()
        sass = subprocess.run(["cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout
    assert "HGMMA" in sass and "UTMALDG" in sass, sass[:2000]


def test_load_returns_kernel_with_report():
    import flashgen

    kern = flashgen.load(head_dim=128, dtype="bf16", causal=True)
    assert kern.config.head_dim == 128 and kern.config.causal
    assert "__global__" in kern.source and kern.name in kern.source
    assert kern.resources.registers > 0 and kern.resources.smem_bytes == kern.config.smem_bytes
    # A tuned configuration may spill a little and still win; the untuned default must not.
    default = flashgen.load(head_dim=128, dtype="bf16", causal=True, config=default_config(128, "bf16", True, _arch()))
    assert not default.resources.spills


def test_pycuda_gpuarray_in_and_out():
    pycuda = pytest.importorskip("pycuda", reason="pycuda (the GPU extra) is not installed")
    import numpy as np
    import torch

    torch.cuda.init()
    import pycuda.autoprimaryctx  # noqa: F401  (shares torch's primary context)
    import pycuda.gpuarray as gpuarray

    import flashgen
    from flashgen.verify import reference

    rng = np.random.default_rng()
    qh, kh, vh = (rng.standard_normal((1, n, 2, 64)).astype(np.float16) for n in (77, 130, 130))
    q, k, v = (gpuarray.to_gpu(x) for x in (qh, kh, vh))
    out = flashgen.attention(q, k, v, causal=True)
    assert isinstance(out, gpuarray.GPUArray) and out.shape == q.shape
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (qh, kh, vh))
    ref = reference(tq, tk, tv, True)
    assert np.abs(out.get().astype(np.float64) - ref.out.cpu().numpy()).max() <= ref.bound


def test_bad_inputs_raise_before_launch():
    import torch

    import flashgen

    q = torch.randn(1, 8, 4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        flashgen.attention(q.cpu(), q.cpu(), q.cpu())
    with pytest.raises(TypeError, match="dtype"):
        flashgen.attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="multiple of heads"):
        flashgen.attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match="head_dim=60 is not supported"):  # not a multiple of 8 (48 runs padded)
        flashgen.attention(q[..., :60], q[..., :60], q[..., :60])
    wide = torch.randn(1, 8, 4, 264, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim=264 is not supported"):
        flashgen.attention(wide, wide, wide)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        t = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.float16)[..., ::2]
        flashgen.attention(t, t, t)


# ---- pack_gqa (sm90): the query heads of one KV head share a tile --------------------------------------------
# GQA layouts (heads, heads_k): groups of 4 (dividing every block_m), 3 (not dividing 64 or 128: idle rows in the tile)
# and 4 of 8 KV heads; lengths odd, short and unequal both ways.
PACK_LAYOUTS = {"8-2": (8, 2), "6-2": (6, 2), "4-1": (4, 1), "32-8": (32, 8)}
PACK_PAIRS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (1, 1023), (1023, 1), (113, 211), (211, 113), (17, 300)]
# (block_m, block_n, num_warps, num_stages, overlap, pingpong, persistent, overlap_epilogue, lazy_rescale, q_regs, p_smem):
# plain, overlap, ping-pong, one and three consumer warpgroups, persistent (plain, overlap + ping-pong, with
# overlap_epilogue + lazy), Q in registers, P from shared memory. (ptxas, nvcc 13.0: all 58 spill-free but three d256
# causal persistent ones with overlap, 48-100 B, where their unpacked twins spill 0-24 B: row_q and group held.)
PACK_TILES = [(128, 128, 12, 2), (128, 64, 12, 2), (128, 128, 12, 2, True), (128, 128, 12, 2, False, True),
              (64, 128, 8, 2), (192, 64, 16, 2, True), (128, 128, 12, 2, False, False, True),
              (128, 64, 12, 2, True, True, True), (128, 64, 12, 2, True, False, True, True, True),
              (128, 128, 12, 2, False, False, False, False, False, True),
              (128, 64, 12, 2, True, False, True, False, False, False, True)]
PACK_HEAD_DIMS = (64, 128, 256)


def pack_configs(arch: str) -> list[KernelConfig]:
    """The pack_gqa kernels test_pack_gqa_matches_float64_reference runs (scripts/fill_kernel_cache.py --tests fwd)."""
    if arch != "sm90":
        return []
    out = []
    for d, dt, causal, t in itertools.product(PACK_HEAD_DIMS, HALF_DTYPES, (False, True), PACK_TILES):
        c = KernelConfig(d, dt, causal, *t[:4], "sm90", *t[4:7], overlap_epilogue=t[7:8] == (True,),
                         lazy_rescale=t[8:9] == (True,), q_regs=t[9:10] == (True,), p_smem=t[10:11] == (True,),
                         pack_gqa=True)
        if c.unfit_reason(arch) is None and (dt == "bf16" or not any(o.dtype == dt and o.head_dim == d  # fp16: the
                                                                     and o.causal == causal for o in out)):  # first that fits
            out.append(c)
    return out


@pytest.fixture(scope="session")
def pack_kernels():
    if _arch() != "sm90" or "sm90" not in os.environ.get("FLASHGEN_TEST_FAMILIES", "sm90"):
        pytest.skip("pack_gqa is built in the sm90 family's dense forward")
    return compile_grouped(pack_configs("sm90"), "sm90", lambda c: (c.head_dim, c.dtype, c.causal))


@pytest.mark.parametrize("layout", list(PACK_LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("head_dim", PACK_HEAD_DIMS)
def test_pack_gqa_matches_float64_reference(pack_kernels, head_dim, dtype, causal, layout):
    """Tile rows (position, head of the group): Q by the 5-d TMA box, the causal mask by position, O and LSE
    written to (position, head); the persistent kernels run many tiles per CTA over KV heads."""
    heads, heads_k = PACK_LAYOUTS[layout]
    failures = float64_failures(pack_kernels[(head_dim, dtype, causal)], PACK_PAIRS,
                                lambda sq, sk: 3 if max(sq, sk) <= 256 else 2, heads, heads_k, head_dim, dtype, causal,
                                layout)
    assert not failures, "\n".join(failures)


def test_pack_gqa_mha_and_negative_scale(pack_kernels):
    """A pack_gqa kernel on MHA (group 1: plain tiles) and with softmax_scale < 0 (Q negated in shared memory,
    the idle rows of group 3 included)."""
    from flashgen.verify import random_qkv, reference, run_and_judge

    failures = []
    for (heads, heads_k), scale, causal in (((4, 4), None, True), ((6, 2), -0.3, True), ((6, 2), -0.3, False)):
        q, k, v = random_qkv(2, 211, 333, heads, heads_k, 128, "bf16")
        ref = reference(q, k, v, causal, scale)
        for kern in pack_kernels[(128, "bf16", causal)]:
            r = run_and_judge(kern, q, k, v, ref, scale)
            if not r.ok:
                failures.append(f"{kern.name} {heads}/{heads_k} scale={scale}: {r.reason}")
    assert not failures, "\n".join(failures)
