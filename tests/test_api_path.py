"""The per-call path without a GPU: the resolve cache agrees with the full store lookup and sees
store changes; the torch operator's fake implementation, torch.compile tracing, the grad guard,
softmax_scale handling and the packed argument bytes."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

import flashgen
import flashgen.driver as driver
import flashgen.resolve as resolve
import flashgen.store as store
from flashgen.store import config_from_entry
from flashgen.config import FP8_DTYPES, ConfigError, KernelConfig
from flashgen.launch import LOG2E, FwdParams, pack_params, scale_args
from flashgen.tensors import Problem, View

REPO_STORE = Path(__file__).resolve().parent.parent / "tuned" / "nvidia-h200-sm90.json"
H200 = driver.DeviceInfo("NVIDIA H200", "sm90", 132)


class FakeCompiled:
    def __init__(self, cfg: KernelConfig):
        self.config = cfg


@pytest.fixture
def h200(monkeypatch):
    """The resolver and the store believe they run on the H200 the shipped store was tuned on."""
    monkeypatch.setattr(driver, "device_info", lambda device=None: H200)
    monkeypatch.setattr(driver, "use_device", lambda device: 0)
    monkeypatch.setattr(store, "current_gpu", lambda: (H200.name, H200.arch))
    monkeypatch.setattr(resolve, "compiled_kernel", lambda cfg, target: FakeCompiled(cfg))
    flashgen.reload()
    yield
    flashgen.reload()


def stored_problems(path: Path) -> set[tuple]:
    doc = json.loads(path.read_text())
    return {(e["config"]["head_dim"], e["config"]["dtype"], e["config"]["causal"]) for e in doc["entries"].values()}


SEQLENS = [None, 1, 17, 113, 700, 1023, 1024, 1500, 2047, 2048, 2896, 3000, 4096, 6000, 8192, 11585, 11586, 16384, 10**6]


def test_cached_resolve_equals_the_full_lookup_on_every_stored_problem(h200):
    r = resolve.Resolver()
    problems = stored_problems(REPO_STORE)
    assert problems
    for hd, dt, causal in sorted(problems):
        for family in (None, "sm80", "sm90"):
            if dt in FP8_DTYPES and family == "sm80":  # Ampere's family has no FP8: both ways refuse
                with pytest.raises(ConfigError, match="sm90"):
                    flashgen.choose_config(hd, dt, causal, "sm90", family=family)
                with pytest.raises(ConfigError, match="sm90"):
                    r.kernel(0, hd, dt, causal, 1024, family)
                continue
            for n in SEQLENS:
                full = flashgen.choose_config(hd, dt, causal, "sm90", seqlen=n, family=family)
                for _ in range(2):  # a miss, then a hit
                    assert r.kernel(0, hd, dt, causal, n, family).config == full, (hd, dt, causal, family, n)


def test_a_store_change_is_picked_up(h200, tmp_path):
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    path = tuned / REPO_STORE.name
    shutil.copy(REPO_STORE, path)
    r = resolve.Resolver(check_every_s=0.0)
    before = r.kernel(0, 128, "bf16", False, 4096, "sm90", tuned).config
    doc = json.loads(path.read_text())
    other = next(c for c in flashgen.space("sm90", 128, "bf16", False) if c != before and c.unfit_reason("sm90") is None)
    for e in doc["entries"].values():
        if config_from_entry(e) == before:
            e["config"], e["kernel"] = other.to_dict(), other.name
    path.write_text(json.dumps(doc, indent=2))
    assert r.kernel(0, 128, "bf16", False, 4096, "sm90", tuned).config == other
    # the module's resolver checks at most once a second; reload() makes it look now
    assert resolve.resolver.kernel(0, 128, "bf16", False, 4096, "sm90", tuned).config == other
    path.unlink()
    flashgen.reload()
    assert resolve.resolver.kernel(0, 128, "bf16", False, 4096, "sm90", tuned).config == \
        flashgen.default_config(128, "bf16", False, "sm90", "sm90")


def test_nearest_bucket_matches_lookups_rule():
    assert resolve.nearest_bucket(3000, (1024, 4096, 16384)) == 4096
    assert resolve.nearest_bucket(2048, (1024, 4096)) == 4096  # a tie goes to the larger bucket
    assert resolve.nearest_bucket(None, (1024, 4096)) == 4096
    assert resolve.nearest_bucket(5, ()) is None


# -- the torch operator ---------------------------------------------------------------------

torch = pytest.importorskip("torch", reason="the torch operator tests need torch (a CPU build is enough)")


def test_fake_implementation_gives_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dt in (torch.float16, torch.bfloat16):
            q = torch.empty(3, 17, 8, 64, dtype=dt, device="cuda")
            k = torch.empty(3, 1023, 2, 64, dtype=dt, device="cuda")
            out, lse = flashgen.attention(q, k, k, causal=True, return_lse=True)
            assert out.shape == q.shape and out.dtype == dt and out.device == q.device and out.is_contiguous()
            assert lse.shape == (3, 8, 17) and lse.dtype == torch.float32
            assert flashgen.attention(q, k, k).shape == q.shape
        with pytest.raises(ValueError, match="multiple of heads"):
            flashgen.attention(q, torch.empty(3, 9, 3, 64, dtype=q.dtype, device="cuda"),
                               torch.empty(3, 9, 3, 64, dtype=q.dtype, device="cuda"))


def test_torch_compile_fullgraph_traces_through_attention():
    def block(q, k, v):
        return flashgen.attention(q, k, v, causal=True).float().sum(-1)

    q = torch.empty(2, 17, 4, 64, dtype=torch.bfloat16, device="meta")  # meta: the operator's fake runs
    k = torch.empty(2, 40, 2, 64, dtype=torch.bfloat16, device="meta")
    out = torch.compile(block, fullgraph=True, backend="eager")(q, k, k)
    assert out.shape == (2, 17, 4) and out.dtype == torch.float32


def test_gradients_flow_through_the_operators():
    """q, k, v that require grad go through flashgen::attention, whose backward is flashgen::attention_backward
    (meta tensors here, which run the fake implementations: the shapes and the wiring, without a GPU)."""
    q = torch.empty(2, 17, 8, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(2, 33, 2, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(2, 33, 2, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert out.grad_fn is not None and lse.grad_fn is not None
    (out.float().sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.dtype == q.dtype and v.grad.device == v.device
    # deterministic=True reaches the backward operator (its fake here; on a GPU, resolve.backward_kernel's choice)
    from flashgen import ops

    seen, real = [], ops.attention_backward_op
    ops.attention_backward_op = lambda *a: (seen.append(a[-1]), real(*a))[1]
    try:
        flashgen.attention(q, k, v, causal=True, deterministic=True).float().sum().backward()
        flashgen.attention(q, k, v, causal=True).float().sum().backward()
    finally:
        ops.attention_backward_op = real
    assert seen == [True, False]


def test_inputs_that_require_grad_are_refused_where_no_backward_applies():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="softmax_scale > 0"):  # the backward runs s > 0 only
        flashgen.attention(q, k, k, softmax_scale=-1.0)
    kern = flashgen.load(64, "bf16", False, gpu_arch="sm80")
    with pytest.raises(RuntimeError, match="forward only"):  # a loaded Kernel has no autograd
        kern(q, k, k)
    with torch.no_grad(), pytest.raises(ValueError, match="is on cpu"):  # no grad: past the guard, to the checks
        kern(q, k, k)


def test_stream_is_refused_for_torch_tensors():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="stream= is for GPU arrays"):
        flashgen.attention(q, q, q, stream=1)


# -- softmax_scale and the argument bytes -----------------------------------------------------

def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_any_finite_softmax_scale_is_taken_and_others_refused():
    assert scale_args(None, 64) == (0.125, 0.125 * LOG2E)
    assert scale_args(-0.5, 64) == (-0.5, 0.5 * LOG2E)  # the kernel runs |s| on -Q
    assert scale_args(0.0, 64) == (0.0, LOG2E)  # uniform: Q = 0 in the kernel, any positive scale
    assert scale_args(1e-46, 64) == (0.0, LOG2E)  # 0 in float32: treated as 0, never a 0 * -inf
    for bad in (float("nan"), float("inf"), -float("inf"), 1e39):
        with pytest.raises(ValueError, match="softmax_scale"):
            scale_args(bad, 64)
    with pytest.raises(ValueError, match="softmax_scale"):  # refused before any GPU work
        flashgen.attention(*(FakeArray((1, 4, 2, 64)) for _ in range(3)), softmax_scale=float("nan"))


class FakeArray:
    def __init__(self, shape):
        self.shape = shape
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f2", "data": (1 << 20, False),
                                         "strides": None, "version": 3}


def test_packed_params_are_the_c_struct_bytes():
    b, sq, sk, h, hk, d = 3, 100, 200, 8, 2, 64
    v = lambda ptr, s, hh: View(None, "cai", ptr, (b, s, hh, d), (s * hh * d, hh * d, d, 1), "bf16", -1)  # noqa: E731
    q, k, vv, o = v(0x1000, sq, h), v(0x2000, sk, hk), v(0x3000, sk, hk), v(0x4000, sq, h)
    prob = Problem(b, sq, sk, h, hk, d, "bf16")
    ref = FwdParams(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, *q.strides[:3], *k.strides[:3], *vv.strides[:3],
                    *o.strides[:3], b, h, hk, sq, sk, -0.25, f32(0.25 * LOG2E))
    assert pack_params(q, k, vv, o, 0x5000, prob, -0.25, 0.25 * LOG2E) == bytes(ref)


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_a_plan_launches_the_same_bytes_as_the_checked_path(monkeypatch, family):
    """The per-call plan (built once per signature) must hand the driver exactly what the fully
    checked path packs, for strided GQA inputs and a negative scale."""
    import flashgen.kernels.dense as dense
    from flashgen.checks import check_qkv
    from flashgen.compile import CompiledKernel, Resources

    launched = []

    class FakeFn:
        def launch(self, grid, threads, params, stream, programmatic=False):
            launched.append((grid, threads, bytes(params), stream))

    monkeypatch.setattr(driver, "use_device", lambda device: 0)
    monkeypatch.setattr(driver, "primary_context_id", lambda device: 1)
    monkeypatch.setattr(driver, "get_function", lambda *a, **kw: FakeFn())
    monkeypatch.setattr(driver, "tensor_map", lambda dt, ptr, dims, st, box, sw: struct.pack("=Q", ptr) * 16)
    monkeypatch.setattr(dense, "current_stream", lambda device: 7)

    def fake_view(x, name):  # the checks want CUDA tensors: these CPU ones pose as cuda:0
        return View(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), "bf16", 0)

    monkeypatch.setattr(dense, "view", fake_view)
    monkeypatch.setattr(dense, "_out_view", lambda out, like, shape, dtype: fake_view(out, "out"))
    monkeypatch.setattr(dense, "_lse_ptr", lambda lse, like, shape: lse.data_ptr())
    cfg = flashgen.default_config(64, "bf16", True, "sm90", family)
    kern = CompiledKernel(cfg, "sm_90a", "", b"", Resources(1, 0, 0, 0, cfg.smem_bytes), "")
    qkv = torch.randn(2, 100, 3, 8, 64, dtype=torch.bfloat16)  # q, k, v strided out of one packed tensor
    q, k, v = qkv[:, :, 0], qkv[:, :60, 1, :2], qkv[:, :60, 2, :2]
    qv, kv, vv = (fake_view(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    prob = check_qkv(qv, kv, vv)
    plan = dense.make_plan(kern, qv, kv, vv, prob, -0.3)
    out, lse = dense.launch_plan(plan, q, k, v)
    dense.run_views(kern, qv, kv, vv, prob, -0.3, out=out, lse=lse)
    assert len(launched) == 2 and launched[0] == launched[1]
    assert launched[0][0] == cfg.grid(2, 8, 100) and launched[0][3] == 7


def test_loaded_functions_are_keyed_by_context_id_not_address(monkeypatch):
    """A destroyed context's address can come back for a new context: the module loaded in the old one
    must not be reused there (the driver reports a new id for the new context)."""
    loads = []

    class FakeFunction:
        def __init__(self, cubin, name, smem):
            loads.append(name)

    ids = iter([101, 101, 202])  # two calls in one context, then a new context at the same address
    monkeypatch.setattr(driver, "Function", FakeFunction)
    monkeypatch.setattr(driver, "current_context", lambda: 0xABC000)
    monkeypatch.setattr(driver, "context_id", lambda ctx=None: next(ids))
    monkeypatch.setattr(driver, "_functions", {})
    a = driver.get_function(b"cubin", "k", 0, "digest")
    b = driver.get_function(b"cubin", "k", 0, "digest")
    c = driver.get_function(b"cubin", "k", 0, "digest")
    assert a is b and c is not a and len(loads) == 2


def test_each_kernel_of_a_file_is_its_own_function(monkeypatch):
    """A cubin holding several kernels (v_t's _vt and its main kernel) gives each name its own function: a launch of
    _vt runs _vt (else V is never transposed, and the main kernel runs on _vt's grid and block)."""
    loads = []

    class FakeFunction:
        def __init__(self, cubin, name, smem):
            self.name = name
            loads.append(name)

    monkeypatch.setattr(driver, "Function", FakeFunction)
    monkeypatch.setattr(driver, "_functions", {})
    main = driver.get_function(b"cubin", "fwd_x_vt", 1024, "digest", ctx_id=7)
    vt = driver.get_function(b"cubin", "fwd_x_vt_vt", 0, "digest", ctx_id=7)
    assert (main.name, vt.name) == ("fwd_x_vt", "fwd_x_vt_vt") and loads == ["fwd_x_vt", "fwd_x_vt_vt"]
    assert driver.get_function(b"cubin", "fwd_x_vt_vt", 0, "digest", ctx_id=7) is vt and len(loads) == 2


def test_the_tensors_device_decides_arch_store_and_context(monkeypatch):
    """q on cuda:1 while cuda:0 is current: the kernel is chosen for, and launched in, device 1."""
    import flashgen.kernels.dense as dense
    from flashgen.compile import CompiledKernel, Resources
    from flashgen.tensors import Problem

    asked, used = [], []
    monkeypatch.setattr(driver, "device_info", lambda device=None: asked.append(device) or H200)
    monkeypatch.setattr(driver, "use_device", lambda device: used.append(device))
    monkeypatch.setattr(driver, "primary_context_id", lambda device: 10 + device)
    monkeypatch.setattr(driver, "get_function", lambda *a, **kw: used.append(("ctx", a[-1])))
    monkeypatch.setattr(resolve, "compiled_kernel", lambda cfg, target: FakeCompiled(cfg))
    flashgen.reload()
    resolve.resolver.kernel(1, 64, "bf16", False, 1024, None)
    assert asked and all(d == 1 for d in asked)
    cfg = flashgen.default_config(64, "bf16", False, "sm90", "sm80")
    kern = CompiledKernel(cfg, "sm_90", "", b"", Resources(1, 0, 0, 0, cfg.smem_bytes), "")
    v = View(None, "torch", 0x1000, (1, 64, 2, 64), (8192, 128, 64, 1), "bf16", 1)
    dense.make_plan(kern, v, v, v, Problem(1, 64, 64, 2, 2, 64, "bf16"), None)
    assert used == [1, ("ctx", 11)]
    flashgen.reload()
