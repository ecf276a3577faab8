"""The dense forward: run a compiled kernel on q, k, v (torch tensors or GPU arrays), by a plan per call signature.

This is the per-call path of `flashgen.attention` and of a loaded `Kernel`: it checks, packs one argument struct
and launches, and nothing else (no hashing, no store, no context switch unless the tensors live on another device
than the current one). Which kernel runs is flashgen.resolve's choice.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, NamedTuple

from .. import driver
from ..checks import check_family, check_qkv, refuse_grad
from ..compile import CompiledKernel, Resources, compile_kernel
from ..config import VT_THREADS, KernelConfig, vt_keys
from ..launch import (FWD, SM90_BYTES, FwdParams, STREAM_FOR_TORCH, current_stream, descale_args, fill_empty, float32,
                      pack_params, scale_args, tmap_box, tmap_box_packed)
from ..tensors import Problem, View, align_elems, aligned, aligned_strides, is_torch, torch_dtype, view


def tmap_geometry(q: View, k: View, v: View, prob: Problem, cfg: KernelConfig) -> tuple:
    """(dims, byte strides, box, swizzle bytes) of the q, k, v tensor maps: boxes of SMEM_W x block_m (q) or
    kv_box_rows (k, v: block_n, or half of it with cluster) rows (pack_gqa: q's is tmap_box_packed's); v's over its own
    head dim. v_t: v's map is over VT (vt_geometry)."""
    if cfg.pack_gqa and cfg.family == "sm90":
        qmap = tmap_box_packed(q.strides, prob.head_dim, prob.seqlen_q, prob.heads, prob.heads_k, prob.batch,
                               cfg.elem_bytes, cfg.smem_w, cfg.block_m)
        return ((*qmap, cfg.row_bytes), *tmap_geometry(q, k, v, prob, replace(cfg, pack_gqa=False))[1:])
    maps = tuple((*tmap_box(t.strides, d, n, heads, prob.batch, cfg.elem_bytes, cfg.smem_w, rows), cfg.row_bytes)
                 for t, d, n, heads, rows in ((q, prob.head_dim, prob.seqlen_q, prob.heads, cfg.block_m),
                                              (k, prob.head_dim, prob.seqlen_k, prob.heads_k, cfg.kv_box_rows),
                                              (v, prob.v_dim, prob.seqlen_k, prob.heads_k, cfg.kv_box_rows)))
    return maps[:2] + (vt_geometry(prob, cfg),) if cfg.v_t else maps


def vt_geometry(prob: Problem, cfg: KernelConfig) -> tuple:
    """v_t: VT's tensor map, 4-d over (keys, v's head dims, heads_k, batch) of the contiguous (batch, heads_k, head_dim_v,
    vt_keys) copy; a box is one column block of the V ring's tile, vt_w keys x head_dim_v rows, swizzled vt_w bytes."""
    b, hk, d, n = vt_shape(prob)
    return ((n, d, hk, b), (n, n * d, n * d * hk), (cfg.vt_w, d, 1, 1), cfg.vt_w)


def vt_shape(prob: Problem) -> tuple[int, int, int, int]:
    """v_t: the shape of the e4m3 tensor the _vt kernel writes V into, transposed: (batch, heads_k, head_dim_v, vt_keys)."""
    return prob.batch, prob.heads_k, prob.v_dim, vt_keys(prob.seqlen_k)


def sm90_params(p: bytes | FwdParams, q: View, k: View, v: View, prob: Problem, cfg: KernelConfig,
                descale: bytes = b"", vt: int = 0) -> bytes:
    """Bytes of `struct Sm90FwdParams` (templates/sm90/params.cuh.j2): TMA maps of q, k, v (v_t: of VT at `vt`) at 0,
    128, 256, then FwdParams (FP8: Sm90Fp8FwdParams, the descale factors and vt after it)."""
    ptrs = (q.ptr, k.ptr, vt if cfg.v_t else v.ptr)
    maps = b"".join(driver.tensor_map(prob.dtype, ptr, dims, strides, box, swizzle)  # cached by args
                    for ptr, (dims, strides, box, swizzle) in zip(ptrs, tmap_geometry(q, k, v, prob, cfg)))
    return (maps + bytes(p) + descale).ljust(SM90_BYTES, b"\0")


def _empty(like: View, shape: tuple[int, ...], dtype: str) -> Any:
    if like.kind == "torch":
        import torch  # noqa: PLC0415

        return like.obj.new_empty(shape, dtype=torch_dtype(dtype))
    import numpy as np  # noqa: PLC0415
    import pycuda.gpuarray as gpuarray  # noqa: PLC0415

    ndt = {"fp16": np.float16, "fp32": np.float32}.get(dtype) or like.obj.dtype
    return gpuarray.empty(shape, ndt)


def _fix_alignment(t: View, name: str) -> View:
    if aligned(t):
        return t
    if t.kind == "torch":  # a sliced or oddly strided tensor: one fresh (aligned) contiguous copy
        import torch  # noqa: PLC0415

        fixed = view(t.obj.clone(memory_format=torch.contiguous_format), name)
        if aligned(fixed):
            return fixed
    raise ValueError(f"{name} needs a 16-byte aligned base and strides that are multiples of {align_elems(t.dtype)} "
                     "elements")


def _out_view(out: Any, like: View, shape: tuple[int, ...], dtype: str) -> View:
    """`out`, given by the caller, checked like q: kind, device, dtype, shape, last dim contiguous, aligned."""
    if like.kind == "torch":
        ov = view(out, "out") if hasattr(out, "data_ptr") else None
        if ov is None or ov.kind != "torch":
            raise TypeError(f"out must be a torch tensor like q, not {type(out).__name__}")
        if ov.device != like.device:
            raise ValueError(f"out is on cuda:{ov.device}, q on cuda:{like.device}")
    else:
        ov = view(out, "out")
    if ov.dtype != dtype:
        raise TypeError(f"out must have the kernel's output dtype {dtype}, not {ov.dtype}")
    if tuple(ov.shape) != shape:
        raise ValueError(f"out must have shape {shape}; got {tuple(ov.shape)}")
    if ov.strides[3] != 1 and shape[3] != 1:
        raise ValueError("out must be contiguous in its last dim")
    if not aligned(ov):
        raise ValueError("out needs a 16-byte aligned base and strides that are multiples of 8 elements")
    return ov


def _lse_ptr(lse: Any, like: View, shape: tuple[int, ...]) -> int:
    """`lse`, given by the caller: fp32, this shape, C-contiguous (the kernel indexes it densely), same device."""
    if like.kind == "torch":
        import torch  # noqa: PLC0415

        if not isinstance(lse, torch.Tensor) or not lse.is_cuda:
            raise TypeError(f"lse must be a torch CUDA tensor like q, not {type(lse).__name__}")
        if lse.get_device() != like.device:
            raise ValueError(f"lse is on cuda:{lse.get_device()}, q on cuda:{like.device}")
        ok_dtype, dims, ptr = lse.dtype == torch.float32, tuple(lse.shape), lse.data_ptr()
        contiguous = lse.is_contiguous()
    else:
        cai = getattr(lse, "__cuda_array_interface__", None)
        if cai is None:
            raise TypeError(f"lse must be a GPU array like q, not {type(lse).__name__}")
        ok_dtype, dims, ptr = cai["typestr"] == "<f4", tuple(cai["shape"]), int(cai["data"][0])
        st, acc, contiguous = cai.get("strides"), 4, True
        for n, s in zip(reversed(dims), reversed(st or ())):
            contiguous &= n == 1 or s == acc
            acc *= n
    if not ok_dtype:
        raise TypeError("lse must be float32")
    if dims != shape:
        raise ValueError(f"lse must have shape {shape}; got {dims}")
    if not contiguous:
        raise ValueError("lse must be contiguous (the kernel writes it as a dense (batch, heads, seqlen_q) array)")
    if ptr % 4:
        raise ValueError("lse must be 4-byte aligned")
    return ptr


def run(kernel: CompiledKernel, q: Any, k: Any, v: Any, softmax_scale: float | None = None,
        stream: Any = None, out: Any = None, lse: Any = None, descale: dict[str, Any] | None = None) -> tuple[Any, Any, Problem]:
    """Launch `kernel` on q, k, v; returns (out, lse, problem). `stream`: a pycuda Stream or raw handle.

    `out` and `lse`, if given, are written in place (verification passes poisoned buffers). `descale`:
    FP8 kernels' {"q_descale": ..., "k_descale": ..., "v_descale": ...} (missing factors are 1)."""
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    return run_views(kernel, qv, kv, vv, check_qkv(qv, kv, vv), softmax_scale, stream, out, lse, descale)


def run_views(kernel: CompiledKernel, qv: View, kv: View, vv: View, prob: Problem, softmax_scale: float | None = None,
              stream: Any = None, out: Any = None, lse: Any = None,
              descale: dict[str, Any] | None = None) -> tuple[Any, Any, Problem]:
    """`run` on inputs already viewed and checked (check_qkv)."""
    torch_in = qv.kind == "torch"
    if stream is not None and torch_in:
        raise TypeError(STREAM_FOR_TORCH)
    cfg = _checked_kernel(kernel, prob)
    # v_t: V transposed, by the _vt kernel before the main one (FP8 takes torch tensors: descale_args says so)
    vt = _empty(qv, vt_shape(prob), prob.dtype) if cfg.v_t and prob.seqlen_k and torch_in else None
    scales = descale_args((prob.batch, prob.heads_k) if cfg.fp8 else None, qv.device, descale, cfg.dtype,
                          0 if vt is None else vt.data_ptr())
    scale, scale_log2 = scale_args(softmax_scale, prob.head_dim)
    if not (aligned(qv) and aligned(kv) and aligned(vv)):
        qv, kv, vv = (_fix_alignment(t, n) for t, n in ((qv, "q"), (kv, "k"), (vv, "v")))
    o_shape, lse_shape = (prob.batch, prob.seqlen_q, prob.heads, prob.v_dim), (prob.batch, prob.heads, prob.seqlen_q)
    out_dtype = cfg.output_dtype
    if out is None:
        out = _empty(qv, o_shape, out_dtype)
        ov = view(out, "out") if torch_in else View(out, "cai", int(out.gpudata), o_shape,
                                                     tuple(s // out.dtype.itemsize for s in out.strides), out_dtype, -1)
    else:
        ov = _out_view(out, qv, o_shape, out_dtype)
    if lse is None:
        lse = _empty(qv, lse_shape, "fp32")
        lse_ptr = lse.data_ptr() if torch_in else int(lse.gpudata)
    else:
        lse_ptr = _lse_ptr(lse, qv, lse_shape)
    if prob.batch * prob.heads * prob.seqlen_q == 0:
        return out, lse, prob
    flat = cfg.grid(prob.batch, prob.heads, prob.seqlen_q, 1, prob.heads_k)  # refuses grids CUDA cannot launch, before any work
    if prob.seqlen_k == 0:  # no key at all: O = 0, LSE = +inf in both families, nothing to launch
        fill_empty(out, lse)
        return out, lse, prob
    if torch_in:
        dev = qv.device
        fn, handle = _torch_function(kernel, dev), current_stream(dev)
    else:
        ctx, dev = driver.current_context(), driver.context_device()  # GPU arrays run in the current context
        for name, t in (("q", qv), ("k", kv), ("v", vv), ("out", ov)):
            if driver.pointer_device(t.ptr) != dev:
                raise ValueError(f"{name} is not on the current context's device (cuda:{dev})")
        handle = 0 if stream is None else int(getattr(stream, "handle", stream))
        fn = driver.get_function(kernel.cubin, cfg.name, cfg.smem_bytes, kernel.digest, driver.context_id(ctx))
    grid = _grid(cfg, prob.batch, prob.heads, prob.seqlen_q, dev, prob.heads_k) if cfg.persistent else flat
    params = pack_params(qv, kv, vv, ov, lse_ptr, prob, scale, scale_log2)
    if cfg.family == "sm90":
        params = sm90_params(params, qv, kv, vv, prob, cfg, scales, 0 if vt is None else vt.data_ptr())
    if vt is not None:
        _vt_function(kernel, dev).launch((cfg.vt_grid(prob.batch, prob.heads_k, prob.seqlen_k), 1, 1), VT_THREADS,
                                         params, handle)
    fn.launch(grid, cfg.threads, params, handle)  # (vt, as torch's allocator reuses it, is read in stream order)
    return out, lse, prob


def _grid(cfg: KernelConfig, batch: int, heads: int, seqlen_q: int, device: int, heads_k: int) -> tuple[int, int, int]:
    """The launch grid on `device` (a persistent kernel runs one CTA per SM of it)."""
    return cfg.grid(batch, heads, seqlen_q, driver.device_info(device).sm_count if cfg.persistent else None, heads_k)


def _checked_kernel(kernel: CompiledKernel, prob: Problem) -> KernelConfig:
    cfg = kernel.config
    if prob.head_dim != cfg.head_dim or prob.dtype != cfg.dtype or prob.v_dim != cfg.v_dim:
        widths = f"head_dim={cfg.head_dim}" + (f", v's {cfg.v_dim}" if cfg.v_dim != cfg.head_dim else "")
        got = f"head_dim={prob.head_dim}" + (f", v's {prob.v_dim}" if prob.v_dim != prob.head_dim else "")
        raise ValueError(f"kernel {cfg.name} is for {widths}, dtype={cfg.dtype}; got {got}, dtype={prob.dtype}")
    return cfg


def _vt_function(kernel: CompiledKernel, device: int) -> driver.Function:
    """v_t: the file's _vt kernel (static shared memory only) in `device`'s primary context, which the main kernel
    runs in (_torch_function has made it current)."""
    return driver.get_function(kernel.cubin, kernel.config.kernel_names["vt"], 0, kernel.digest,
                               driver.primary_context_id(device))


def _torch_function(kernel: CompiledKernel, device: int) -> driver.Function:
    """The kernel loaded in `device`'s primary context, made current first (whatever device was current):
    torch tensors run where they live, and tensor maps need that context too."""
    driver.use_device(device)
    cfg = kernel.config
    return driver.get_function(kernel.cubin, cfg.name, cfg.smem_bytes, kernel.digest, driver.primary_context_id(device))


class Plan(NamedTuple):
    """Everything about a torch call that depends only on shapes, strides, dtype, device and scale:
    made once per such signature, after which a call packs five pointers and launches."""

    device: int
    fn: driver.Function | None  # None: nothing to launch (no query row, or no key: O = 0, LSE = +inf)
    threads: int
    grid: tuple[int, int, int]
    o_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    fields: tuple  # FwdParams after its five pointers
    tmaps: tuple | None  # sm90: the (dims, byte strides, box, swizzle) of the q, k, v (v_t: VT) tensor maps
    dtype: str
    maps: dict  # sm90: (q, k, v pointers) -> the three encoded maps, a few kept
    out_dtype: Any  # torch dtype of out when it is not q's (FP8), else None
    batch_heads_k: tuple[int, int] | None  # FP8: (batch, heads_k), which per-head descale factors must match
    vt: tuple | None = None  # v_t: (the _vt kernel, its blocks, VT's shape)


def make_plan(kernel: CompiledKernel, qv: View, kv: View, vv: View, prob: Problem, softmax_scale: float | None) -> Plan:
    """The plan of torch inputs already viewed and checked (check_qkv), with aligned strides."""
    cfg = _checked_kernel(kernel, prob)
    scale, scale_log2 = scale_args(softmax_scale, prob.head_dim)
    b, sq, sk, h, hk, d = prob.batch, prob.seqlen_q, prob.seqlen_k, prob.heads, prob.heads_k, prob.v_dim
    o_strides = (sq * h * d, h * d, d)  # a fresh contiguous out, v's width
    fields = (*qv.strides[:3], *kv.strides[:3], *vv.strides[:3], *o_strides, b, h, hk, sq, sk, scale, scale_log2)
    fn, tmaps, vt = None, None, None
    if b * h * sq and sk:
        fn = _torch_function(kernel, qv.device)
        if cfg.family == "sm90":
            tmaps = tmap_geometry(qv, kv, vv, prob, cfg)
        if cfg.v_t:
            vt = (_vt_function(kernel, qv.device), (cfg.vt_grid(b, hk, sk), 1, 1), vt_shape(prob))
    grid = _grid(cfg, b, h, sq, qv.device, hk) if b * h * sq else (0, 1, 1)
    return Plan(qv.device, fn, cfg.threads, grid, (b, sq, h, d), (b, h, sq),
                fields, tmaps, prob.dtype, {}, torch_dtype(cfg.output_dtype) if cfg.fp8 else None,
                (b, hk) if cfg.fp8 else None, vt)


def launch_plan(plan: Plan, q: Any, k: Any, v: Any, want_lse: bool = True,
                descale: dict[str, Any] | None = None) -> tuple[Any, Any] | None:
    """(out, lse) of one call by its plan (lse None unless wanted: the kernel skips it); None when a
    base pointer is not 16-byte aligned (take `run`). `descale`: FP8's factors (see `run`)."""
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) & 15:
        return None
    vt = None if plan.vt is None else v.new_empty(plan.vt[2])  # v_t: V transposed, by the _vt kernel
    mp = vp if vt is None else vt.data_ptr()  # what tm_v maps
    scales = descale_args(plan.batch_heads_k, plan.device, descale, plan.dtype, 0 if vt is None else mp)
    out = q.new_empty(plan.o_shape) if plan.out_dtype is None else q.new_empty(plan.o_shape, dtype=plan.out_dtype)
    lse = q.new_empty(plan.lse_shape, dtype=float32()) if want_lse else None
    if plan.fn is None:
        fill_empty(out, lse)
        return out, lse
    driver.use_device(plan.device)
    params = FWD.pack(qp, kp, vp, out.data_ptr(), 0 if lse is None else lse.data_ptr(), *plan.fields)
    if plan.tmaps is not None:
        maps = plan.maps.get((qp, kp, mp))
        if maps is None:
            if len(plan.maps) > 64:
                plan.maps.clear()
            maps = plan.maps[qp, kp, mp] = b"".join(
                driver.tensor_map(plan.dtype, p, dims, strides, box, swizzle)
                for p, (dims, strides, box, swizzle) in zip((qp, kp, mp), plan.tmaps))
        params = (maps + params + scales).ljust(SM90_BYTES, b"\0")
    stream = current_stream(plan.device)
    if plan.vt is not None:
        plan.vt[0].launch(plan.vt[1], VT_THREADS, params, stream)
    plan.fn.launch(plan.grid, plan.threads, params, stream)
    return out, lse


@functools.lru_cache(maxsize=256)
def compiled_kernel(cfg: KernelConfig, target: str) -> CompiledKernel:
    """compile_kernel's result, kept per process (the disk cache still costs a hash and a read)."""
    return compile_kernel(cfg, target)


def descale_dict(q_descale: Any, k_descale: Any, v_descale: Any) -> dict[str, Any] | None:
    """FP8's descale factors as `run` and `launch_plan` take them; None when none is given."""
    if q_descale is None and k_descale is None and v_descale is None:
        return None
    return {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}


class Kernel:
    """A compiled forward attention kernel, callable like `flashgen.attention` (its causal is fixed)."""

    def __init__(self, compiled: CompiledKernel):
        self.compiled = compiled
        self._plans: dict[tuple, Any] = {}  # torch call signature -> Plan

    @property
    def config(self) -> KernelConfig:
        return self.compiled.config

    @property
    def source(self) -> str:
        return self.compiled.source

    @property
    def resources(self) -> Resources:
        return self.compiled.resources

    @property
    def name(self) -> str:
        return self.config.name

    def __call__(self, q: Any, k: Any, v: Any, softmax_scale: float | None = None, return_lse: bool = False,
                 stream: Any = None, *, q_descale: Any = None, k_descale: Any = None, v_descale: Any = None) -> Any:
        """out = softmax(q k^T * scale [+ causal mask]) v; with return_lse, (out, lse) where lse is (batch, heads, seqlen_q) fp32.

        Torch tensors run on torch's current stream of their device; `stream` (a pycuda Stream or
        raw handle) is for GPU arrays. Not traceable by torch.compile: use `flashgen.attention`.
        FP8 kernels take float8_e4m3fn q, k, v and their descale factors (see flashgen.fp8)."""
        descale = descale_dict(q_descale, k_descale, v_descale)
        if is_torch(q):
            refuse_grad(q, k, v, "a loaded Kernel is forward only: call flashgen.attention, which has the backward")
            if stream is not None:
                raise TypeError(STREAM_FOR_TORCH)
            out, lse = self.run_torch(q, k, v, softmax_scale, return_lse, descale)
        else:
            out, lse, _ = run(self.compiled, q, k, v, softmax_scale, stream, descale=descale)
        return (out, lse) if return_lse else out

    def run_torch(self, q: Any, k: Any, v: Any, softmax_scale: float | None, want_lse: bool = True,
                  descale: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """(out, lse) for torch tensors: checked once per call signature (shapes, strides, dtypes,
        device, scale), then a dict lookup, five pointers packed and a launch. lse is None
        when not wanted (the kernel then skips it)."""
        sig = signature(q, k, v, softmax_scale)
        plan = self._plans.get(sig)
        if plan is None:
            plan = self._plans[sig] = self.plan(q, k, v, softmax_scale)
            if len(self._plans) > 1024:
                self._plans.clear()
        return launch_torch(self, plan, q, k, v, softmax_scale, want_lse, descale)

    def plan(self, q: Any, k: Any, v: Any, softmax_scale: float | None) -> Any:
        """The Plan of these inputs, after every check; None when a stride needs `run`'s copy."""
        qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
        prob = check_qkv(qv, kv, vv)
        if not (aligned_strides(qv) and aligned_strides(kv) and aligned_strides(vv)):
            return None
        return make_plan(self.compiled, qv, kv, vv, prob, softmax_scale)

    def __repr__(self) -> str:
        r = self.resources
        return f"Kernel({self.name}, {self.compiled.target}, {r.registers} regs, {r.smem_bytes} B smem, spills={r.spills})"


def launch_torch(kern: Kernel, plan: Any, q: Any, k: Any, v: Any, softmax_scale: float | None,
                 want_lse: bool, descale: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """One call by its plan; `run` (which copies what is misaligned) when there is no plan or a base
    pointer is off 16 bytes."""
    res = None if plan is None else launch_plan(plan, q, k, v, want_lse, descale)
    if res is None:
        out, lse, _ = run(kern.compiled, q, k, v, softmax_scale, descale=descale)
        return out, lse
    return res


def signature(q: Any, k: Any, v: Any, softmax_scale: float | None) -> tuple:
    """What a torch call's plan depends on: shapes, strides, dtypes, devices and scale."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), softmax_scale)


def checked(q: Any, k: Any, v: Any, softmax_scale: float | None, arch: str | None) -> tuple:
    """(q, k, v views, problem) after every check a call gets before any GPU work."""
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    prob: Problem = check_qkv(qv, kv, vv)
    check_family(arch)
    scale_args(softmax_scale, prob.head_dim)  # a bad scale is refused here too
    return qv, kv, vv, prob


__all__ = ["Kernel", "Plan", "compiled_kernel", "launch_plan", "launch_torch", "make_plan", "run", "run_views",
           "signature"]
