"""The public call on the GPU: edges that once gave NaN, faults or stale state (softmax_scale <= 0,
batch or heads past 65535, no keys, the tensors' device, caller buffers, re-created contexts), and
the torch integration (torch.compile, CUDA graphs, inference mode, host cost per call)."""
from __future__ import annotations

import threading
import time

import pytest

from flashgen.compile import compile_kernel, target_for
from flashgen.config import KernelConfig, default_config

pytestmark = pytest.mark.gpu


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


CASES = [(d, dt, c) for d in (32, 64, 128, 256) for dt in ("fp16", "bf16") for c in (False, True)]


def family_configs(arch: str, head_dim: int | None = None, dtype: str | None = None,
                   causal: bool | None = None) -> list[KernelConfig]:
    """The default of each family that runs on `arch`, plus the overlapped ping-pong sm90 schedule
    (every case of CASES when the problem is not given: scripts/fill_kernel_cache.py compiles them)."""
    if head_dim is None:
        return [c for case in CASES for c in family_configs(arch, *case)]
    cfgs = [default_config(head_dim, dtype, causal, arch, "sm80")]
    if arch == "sm90":
        cfgs.append(default_config(head_dim, dtype, causal, arch, "sm90"))
        ov = KernelConfig(head_dim, dtype, causal, 128, 64, 12, 2, "sm90", True, True)
        if ov.unfit_reason(arch) is None:
            cfgs.append(ov)
    return cfgs


def family_kernels(head_dim: int, dtype: str, causal: bool) -> list:
    arch = _arch()
    return [compile_kernel(c, target_for(arch, c.family)) for c in family_configs(arch, head_dim, dtype, causal)]


def judge(kern, q, k, v, causal, scale=None):
    from flashgen.verify import reference, run_and_judge

    return run_and_judge(kern, q, k, v, reference(q, k, v, causal, scale), scale)


@pytest.mark.parametrize("scale", [0.0, -0.125, -1.0, 1e-46])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_any_finite_softmax_scale(head_dim, causal, scale):
    from flashgen.verify import random_qkv

    failures = []
    for kern in family_kernels(head_dim, "bf16", causal):
        for sq, sk in ((1, 1), (113, 211), (211, 113), (1023, 1023)):
            q, k, v = random_qkv(2, sq, sk, 4, 2, head_dim, "bf16")
            r = judge(kern, q, k, v, causal, scale)
            if not r.ok:
                failures.append(f"{kern.name} scale={scale} {sq}x{sk}: {r.reason}")
    assert not failures, "\n".join(failures)


def test_nan_and_inf_scales_are_refused():
    import torch

    import flashgen

    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale"):
            flashgen.attention(q, q, q, softmax_scale=bad)


@pytest.mark.parametrize("shape", [(70_000, 2, 3, 1, 1), (1, 1, 1, 70_000, 70_000), (3, 5, 7, 70_000, 35_000)],
                         ids=["batch70k", "heads70k", "gqa-heads70k"])
def test_batch_and_heads_past_65535(shape):
    from flashgen.verify import random_qkv

    b, sq, sk, h, hk = shape
    failures = []
    for causal in (False, True):
        for kern in family_kernels(32, "fp16", causal):
            q, k, v = random_qkv(b, sq, sk, h, hk, 32, "fp16")
            r = judge(kern, q, k, v, causal)
            if not r.ok:
                failures.append(f"{kern.name} {shape}: {r.reason}")
    assert not failures, "\n".join(failures)


def test_no_keys_gives_zero_and_infinite_lse_in_both_families():
    import torch

    from flashgen.kernels.dense import run
    from flashgen.verify import poisoned_outputs, random_qkv

    for causal in (False, True):
        for kern in family_kernels(128, "bf16", causal):
            q, k, v = random_qkv(2, 37, 0, 4, 4, 128, "bf16")
            out, lse = poisoned_outputs(q)
            run(kern, q, k, v, out=out, lse=lse)
            torch.cuda.synchronize()
            assert (out == 0).all() and torch.isposinf(lse).all(), kern.name


def test_caller_buffers_are_checked_like_inputs():
    import torch

    from flashgen.kernels.dense import run
    from flashgen.verify import random_qkv

    kern = family_kernels(64, "bf16", False)[-1]
    q, k, v = random_qkv(2, 64, 64, 4, 4, 64, "bf16")
    lse = torch.empty(2, 4, 64, device="cuda")
    with pytest.raises(TypeError, match="out must have the kernel's output dtype"):
        run(kern, q, k, v, out=torch.empty_like(q, dtype=torch.float16), lse=lse)
    with pytest.raises(ValueError, match="out needs a 16-byte aligned base"):
        flat = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
        run(kern, q, k, v, out=flat[1:].view(q.shape), lse=lse)
    with pytest.raises(ValueError, match="out must have shape"):
        run(kern, q, k, v, out=torch.empty(2, 64, 4, 32, device="cuda", dtype=q.dtype), lse=lse)
    with pytest.raises(TypeError, match="lse must be float32"):
        run(kern, q, k, v, out=torch.empty_like(q), lse=lse.half())
    with pytest.raises(ValueError, match="lse must be contiguous"):
        run(kern, q, k, v, out=torch.empty_like(q), lse=torch.empty(2, 64, 4, device="cuda").transpose(1, 2))
    with pytest.raises(ValueError, match="lse must have shape"):
        run(kern, q, k, v, out=torch.empty_like(q), lse=torch.empty(2, 4, 63, device="cuda"))


def test_the_tensors_device_is_used_from_any_thread():
    """A thread that never touched CUDA has no current context: the launch uses the tensors' device."""
    import torch

    import flashgen
    from flashgen.verify import random_qkv, reference

    q, k, v = random_qkv(1, 200, 300, 4, 2, 128, "bf16")
    box = {}

    def work():
        try:
            box["out"] = flashgen.attention(q, k, v, causal=True)
            torch.cuda.synchronize(q.device)
        except Exception as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "err" not in box, box.get("err")
    ref = reference(q, k, v, True)
    assert (box["out"].double() - ref.out).abs().max().item() <= ref.bound


def test_tensors_on_another_device_than_the_current_one():
    import torch

    import flashgen
    from flashgen.driver import device_info
    from flashgen.verify import random_qkv, reference

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with torch.cuda.device(1):
        q, k, v = random_qkv(1, 200, 300, 4, 2, 128, "bf16", device="cuda:1")
    assert torch.cuda.current_device() == 0
    out = flashgen.attention(q, k, v, causal=True)
    assert out.device == q.device
    torch.cuda.synchronize(1)
    ref = reference(q, k, v, True)
    assert (out.double() - ref.out).abs().max().item() <= ref.bound
    assert flashgen.load(128, "bf16", True, device=1).compiled.target.startswith(f"sm_{device_info(1).arch[2:]}")
    with pytest.raises(ValueError, match="one device"):
        flashgen.attention(q, k.to("cuda:0"), v.to("cuda:0"))


def test_a_recreated_context_gets_its_own_module():
    """Contexts made and destroyed in turn may reuse one address: the loaded function must not be reused."""
    pytest.importorskip("pycuda", reason="pycuda (the GPU extra) is not installed")
    import numpy as np
    import pycuda.driver as cuda
    import pycuda.gpuarray as gpuarray

    import flashgen
    from flashgen.driver import context_id, current_context

    cuda.init()
    rng = np.random.default_rng()
    seen = []
    for _ in range(3):
        ctx = cuda.Device(0).make_context()
        try:
            seen.append((current_context(), context_id()))
            qh = rng.standard_normal((1, 64, 2, 64)).astype(np.float16)
            q = gpuarray.to_gpu(qh)
            out = flashgen.attention(q, q, q).get().astype(np.float64)
            s = np.einsum("bqhd,bkhd->bhqk", qh.astype(np.float64), qh.astype(np.float64)) / 8.0
            p = np.exp(s - s.max(-1, keepdims=True))
            ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), qh.astype(np.float64))
            assert np.abs(out - ref).max() < 1e-2
        finally:
            ctx.pop()
            ctx.detach()
    assert len({cid for _, cid in seen}) == 3  # ids are never reused, whatever the addresses did
    print(f"context addresses {[hex(a) for a, _ in seen]} (reused: {len({a for a, _ in seen}) < 3})")


# -- torch integration ------------------------------------------------------------------------

def _qkv(b=2, n=256, h=8, hk=2, d=64, dtype="bf16"):
    from flashgen.verify import random_qkv

    return random_qkv(b, n, n, h, hk, d, dtype)


def test_torch_compile_fullgraph_matches_eager():
    import torch

    import flashgen

    torch.manual_seed(0)
    wq, wo = (torch.randn(512, 512, device="cuda", dtype=torch.bfloat16) / 22 for _ in range(2))

    def block(x, k, v):
        q = (x @ wq).view(x.shape[0], x.shape[1], 8, 64)
        o = flashgen.attention(q, k, v, causal=True)
        return o.reshape(x.shape) @ wo

    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    _, k, v = _qkv()
    with torch.no_grad():
        eager = block(x, k, v)
        compiled = torch.compile(block, fullgraph=True)(x, k, v)
    torch.cuda.synchronize()
    assert (compiled.float() - eager.float()).abs().max().item() <= 2e-2 * eager.float().abs().max().item()


def test_cuda_graph_capture_and_replay():
    import torch

    import flashgen
    from flashgen.verify import reference

    q, k, v = _qkv()
    static = [t.clone() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flashgen.attention(*static, causal=True)  # warm-up: resolve, load the module
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flashgen.attention(*static, causal=True)
    for _ in range(2):  # new inputs copied into the captured buffers, then replayed
        fresh = _qkv()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        ref = reference(*fresh, True)
        assert (out.double() - ref.out).abs().max().item() <= ref.bound


def test_inference_mode():
    import torch

    import flashgen
    from flashgen.verify import reference

    q, k, v = _qkv()
    with torch.inference_mode():
        out = flashgen.attention(q, k, v, causal=True)
    ref = reference(q, k, v, True)
    assert (out.double() - ref.out).abs().max().item() <= ref.bound


def test_host_time_per_call_is_printed():
    """Back-to-back calls on a problem too small to be GPU-bound: the host cost of each path (printed,
    not asserted: the figure belongs in the bench)."""
    import torch
    import torch.nn.functional as F

    import flashgen

    q, k, v = _qkv(1, 128, 1, 1, 64)
    kern = flashgen.load(64, "bf16", False, seqlen=128)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    paths = {"attention()": lambda: flashgen.attention(q, k, v), "Kernel()": lambda: kern(q, k, v),
             "SDPA": lambda: F.scaled_dot_product_attention(qt, kt, vt)}
    us = {}
    for name, fn in paths.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            runs.append((time.perf_counter() - t0) / 1000 * 1e6)
            torch.cuda.synchronize()
        us[name] = sorted(runs)[2]
    print("host us/call: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()))


# -- training: autograd through flashgen::attention ------------------------------------------

def _sdpa_ref(q, k, v, causal, scale=None):
    """softmax(q k^T * scale, bottom-right causal) v and its lse, by explicit ops (autograd in any dtype)."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if causal:
        mask = torch.arange(sk, device=q.device)[None] > torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    s = s.float() if s.dtype != torch.float64 else s
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row that sees no key: P = 0, no NaN
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    return torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), v), (torch.log(l) + m).squeeze(-1)


def autograd_grads(fn, inputs, dout, dlse=None) -> tuple[list, object, object]:
    """([dq, dk, dv] as float64, out, lse) of loss = sum(out * dout) (+ sum(lse * dlse) over the rows that see a key,
    when dlse is given) through fn(q, k, v) -> (out, lse), on fresh leaves of `inputs`."""
    import torch

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    seen = torch.isfinite(lse)  # rows that see no key: lse is +inf (flashgen) or -inf (the reference)
    loss = (out.float() * dout.float()).sum() + ((torch.where(seen, lse, 0) * dlse).sum() if dlse is not None else 0)
    loss.backward()
    return [t.grad.double() for t in leaves], out.detach(), lse.detach()


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 113, 211, 4, 4, 64), (1, 211, 113, 6, 2, 128), (1, 1023, 1023, 4, 1, 256),
                                   (2, 17, 2048, 2, 2, 32)], ids=["mha-d64", "gqa-d128", "mqa-d256", "d32-long-k"])
def test_autograd_gradients_match_float64(shape, causal, with_lse):
    """loss.backward() through flashgen.attention: dq, dk, dv against float64, with flash_attn's bar
    (2x the error of the same computation in the input dtype + 1e-4)."""
    import torch

    import flashgen
    from flashgen.verify import random_qkv

    b, sq, sk, h, hk, d = shape
    q, k, v = (t.requires_grad_() for t in random_qkv(b, sq, sk, h, hk, d, "bf16"))
    dout = torch.randn_like(q)
    dlse = torch.randn(b, h, sq, device="cuda")

    def grads(fn, *inputs):
        return autograd_grads(fn, inputs, dout, dlse if with_lse else None)[0]

    got = grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, return_lse=True), q, k, v)
    ref = grads(lambda q, k, v: _sdpa_ref(q, k, v, causal), q.double(), k.double(), v.double())
    low = grads(lambda q, k, v: _sdpa_ref(q, k, v, causal), q, k, v)
    for name, g, r, lo in zip("qkv", got, ref, low):
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        err, bar = (g - r).abs().max().item(), 2 * (lo - r).abs().max().item() + 1e-4
        assert err <= bar, f"d{name}: max error {err:.3g} > {bar:.3g}"


def test_torch_compile_trains_through_attention():
    """torch.compile(fullgraph=True) over forward and backward gives eager's gradients."""
    import torch

    import flashgen
    from flashgen.verify import random_qkv

    def loss(q, k, v):
        return flashgen.attention(q, k, v, causal=True).float().square().sum()

    base = random_qkv(2, 256, 256, 8, 2, 64, "bf16")
    eager = [t.detach().clone().requires_grad_() for t in base]
    comp = [t.detach().clone().requires_grad_() for t in base]
    loss(*eager).backward()
    torch.compile(loss, fullgraph=True)(*comp).backward()
    for a, c in zip(eager, comp):
        assert (a.grad.float() - c.grad.float()).abs().max().item() <= 1e-2 * a.grad.float().abs().max().item()


def test_deterministic_autograd_gives_identical_gradients():
    """flashgen.attention(..., deterministic=True): autograd's gradients bit-identical on two runs and within
    flash_attn's bar of float64 (GQA, causal, odd lengths)."""
    import math

    import torch

    import flashgen
    from flashgen.verify import judge_backward, random_qkv

    q, k, v = random_qkv(2, 333, 517, 8, 2, 128, "bf16")
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flashgen.attention(*leaves, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, leaves, dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    res = judge_backward(runs[0], q, k, v, dout, True, 1 / math.sqrt(128))
    assert not res.failures, res.failures
