"""Step 4: run a compiled kernel on q, k, v (torch tensors or GPU arrays).

This is the per-call path of `flashgen.attention`: it checks, packs one argument struct
and launches, and nothing else (no hashing, no store, no context switch unless the tensors
live on another device than the current one).
"""
from __future__ import annotations

import ctypes
import functools
import math
import struct
from dataclasses import replace
from typing import Any, NamedTuple

from . import driver
from .compile import CompiledKernel
from .config import KernelConfig, pack_rows
from .tensors import Problem, View, align_elems, aligned, check_qkv, torch_dtype, view

LOG2E = 1.4426950408889634
_F32_MAX = 3.4028234663852886e38


class FwdParams(ctypes.Structure):
    """Mirror of `struct FwdParams` in templates/common/params.cuh.j2 (same order and types)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        *[(f"{t}_{s}_stride", ctypes.c_int64) for t in "qkvo" for s in ("batch", "row", "head")],
        ("batch", ctypes.c_int), ("heads", ctypes.c_int), ("heads_k", ctypes.c_int),
        ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int),
        ("softmax_scale", ctypes.c_float), ("scale_log2", ctypes.c_float),
    ]


# The same bytes as FwdParams, packed in one call (a ctypes Structure costs several microseconds).
_FWD = struct.Struct("=5Q12q5i2f4x")
assert _FWD.size == ctypes.sizeof(FwdParams)
_SM90_BYTES = -(-(3 * 128 + _FWD.size) // 128) * 128  # sizeof(Sm90FwdParams): CUtensorMap's alignment pads the tail
STREAM_FOR_TORCH = ("stream= is for GPU arrays; torch tensors run on torch's current stream "
                    "(use `with torch.cuda.stream(s):`)")


def scale_args(softmax_scale: float | None, head_dim: int) -> tuple[float, float]:
    """(softmax_scale, scale_log2) for FwdParams. Any finite scale works: s <= 0 runs as |s| on -Q
    or Q = 0 inside the kernel, so scale_log2 is |s| log2(e) (log2(e) for s = 0)."""
    s = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(s) or abs(s) * LOG2E > _F32_MAX:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite float32 number")
    log2 = abs(s) * LOG2E
    if struct.unpack("f", struct.pack("f", log2))[0] == 0.0:  # so small it is 0 in float32: uniform attention
        s, log2 = 0.0, LOG2E
    return s, log2


def softcap_args(softmax_scale: float | None, head_dim: int, softcap: float) -> tuple[float, float, float]:
    """(scale, scale_log2, softcap_pre) of a call with softcap (0: off, scale_args' pair and 0). With softcap the
    kernels take t = tanh(S * softcap_pre), softcap_pre = scale / softcap, into exponents at softcap * log2(e)."""
    scale, scale_log2 = scale_args(softmax_scale, head_dim)
    if softcap == 0.0:
        return scale, scale_log2, 0.0
    s = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    return s, softcap * LOG2E, s / softcap


def pack_params(q: View, k: View, v: View, o: View, lse_ptr: int, prob: Problem, scale: float, scale_log2: float) -> bytes:
    """The bytes of `struct FwdParams`."""
    qs, ks, vs, os_ = q.strides, k.strides, v.strides, o.strides
    return _FWD.pack(q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr,
                     qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2],
                     prob.batch, prob.heads, prob.heads_k, prob.seqlen_q, prob.seqlen_k, scale, scale_log2)


def tmap_box(strides: tuple[int, ...], head_dim: int, seqlen: int, heads: int, batch: int, elem_bytes: int,
             smem_w: int, rows: int) -> tuple:
    """(dims, byte strides, box) of one tensor map over a (batch, seqlen, heads, head_dim) tensor with element
    `strides`: 4-d over (head_dim, seqlen, heads, batch), boxes of smem_w x `rows` rows."""
    return ((head_dim, seqlen, heads, batch), (elem_bytes * strides[1], elem_bytes * strides[2], elem_bytes * strides[0]),
            (smem_w, rows, 1, 1))


def tmap_box_packed(strides: tuple[int, ...], head_dim: int, seqlen: int, heads: int, heads_k: int, batch: int,
                    elem_bytes: int, smem_w: int, block_m: int) -> tuple:
    """pack_gqa (sm90): (dims, byte strides, box) of q's 5-d map over (head_dim, group, heads_k, seqlen, batch), q's heads
    split into (head of the group, KV head). A box of smem_w x group x 1 x pack_rows positions lands as group * pos rows,
    row r = head r % group of position r / group: the tile's packed rows, none of another KV head."""
    group = heads // heads_k
    return ((head_dim, group, heads_k, seqlen, batch),
            (elem_bytes * strides[2], elem_bytes * strides[2] * group, elem_bytes * strides[1], elem_bytes * strides[0]),
            (smem_w, group, 1, pack_rows(block_m, group), 1))


def tmap_geometry(q: View, k: View, v: View, prob: Problem, cfg: KernelConfig) -> tuple:
    """(dims, byte strides, box) of the q, k, v tensor maps: boxes of SMEM_W x block_m (q) or kv_box_rows (k, v:
    block_n, or half of it with cluster) rows (pack_gqa: q's is tmap_box_packed's)."""
    if cfg.pack_gqa and cfg.family == "sm90":
        qmap = tmap_box_packed(q.strides, prob.head_dim, prob.seqlen_q, prob.heads, prob.heads_k, prob.batch,
                               cfg.elem_bytes, cfg.smem_w, cfg.block_m)
        return (qmap, *tmap_geometry(q, k, v, prob, replace(cfg, pack_gqa=False))[1:])
    return tuple(tmap_box(t.strides, prob.head_dim, n, heads, prob.batch, cfg.elem_bytes, cfg.smem_w, rows)
                 for t, n, heads, rows in ((q, prob.seqlen_q, prob.heads, cfg.block_m),
                                           (k, prob.seqlen_k, prob.heads_k, cfg.kv_box_rows),
                                           (v, prob.seqlen_k, prob.heads_k, cfg.kv_box_rows)))


def sm90_params(p: bytes | FwdParams, q: View, k: View, v: View, prob: Problem, cfg: KernelConfig,
                descale: bytes = b"") -> bytes:
    """Bytes of `struct Sm90FwdParams` (templates/sm90/params.cuh.j2): TMA maps of q, k, v at 0, 128, 256, then
    FwdParams (FP8: Sm90Fp8FwdParams, the descale factors after it)."""
    maps = b"".join(driver.tensor_map(prob.dtype, t.ptr, dims, strides, box, cfg.row_bytes)  # cached by args
                    for t, (dims, strides, box) in zip((q, k, v), tmap_geometry(q, k, v, prob, cfg)))
    return (maps + bytes(p) + descale).ljust(_SM90_BYTES, b"\0")


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


def descale_args(batch_heads_k: tuple[int, int] | None, device: int, descale: dict[str, Any] | None,
                 dtype: str) -> bytes:
    """The packed descale factors (fp8.descale_bytes) of an FP8 kernel on (batch, heads_k) KV heads; a kernel
    of another `dtype` (batch_heads_k None) refuses any."""
    if batch_heads_k is None:
        if descale and any(t is not None for t in descale.values()):
            raise ValueError(f"descale factors are for FP8 inputs, not {dtype}")
        return b""
    if device < 0:
        raise TypeError("FP8 inputs must be torch tensors (float8_e4m3fn)")
    from .fp8 import descale_bytes  # noqa: PLC0415

    return descale_bytes(*batch_heads_k, device, **(descale or {}))


def run_views(kernel: CompiledKernel, qv: View, kv: View, vv: View, prob: Problem, softmax_scale: float | None = None,
              stream: Any = None, out: Any = None, lse: Any = None,
              descale: dict[str, Any] | None = None) -> tuple[Any, Any, Problem]:
    """`run` on inputs already viewed and checked (check_qkv)."""
    torch_in = qv.kind == "torch"
    if stream is not None and torch_in:
        raise TypeError(STREAM_FOR_TORCH)
    cfg = _checked_kernel(kernel, prob)
    scales = descale_args((prob.batch, prob.heads_k) if cfg.fp8 else None, qv.device, descale, cfg.dtype)
    scale, scale_log2 = scale_args(softmax_scale, prob.head_dim)
    if not (aligned(qv) and aligned(kv) and aligned(vv)):
        qv, kv, vv = (_fix_alignment(t, n) for t, n in ((qv, "q"), (kv, "k"), (vv, "v")))
    o_shape, lse_shape = (prob.batch, prob.seqlen_q, prob.heads, prob.head_dim), (prob.batch, prob.heads, prob.seqlen_q)
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
        _fill_empty(out, lse)
        return out, lse, prob
    if torch_in:
        dev = qv.device
        fn, handle = _torch_function(kernel, dev), _current_stream(dev)
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
        params = sm90_params(params, qv, kv, vv, prob, cfg, scales)
    fn.launch(grid, cfg.threads, params, handle)
    return out, lse, prob


def _grid(cfg: KernelConfig, batch: int, heads: int, seqlen_q: int, device: int, heads_k: int) -> tuple[int, int, int]:
    """The launch grid on `device` (a persistent kernel runs one CTA per SM of it)."""
    return cfg.grid(batch, heads, seqlen_q, driver.device_info(device).sm_count if cfg.persistent else None, heads_k)


def _checked_kernel(kernel: CompiledKernel, prob: Problem) -> KernelConfig:
    cfg = kernel.config
    if prob.head_dim != cfg.head_dim or prob.dtype != cfg.dtype:
        raise ValueError(f"kernel {cfg.name} is for head_dim={cfg.head_dim}, dtype={cfg.dtype}; "
                         f"got head_dim={prob.head_dim}, dtype={prob.dtype}")
    return cfg


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
    tmaps: tuple | None  # sm90: the (dims, byte strides, box) of the q, k, v tensor maps
    dtype: str
    swizzle: int
    maps: dict  # sm90: (q, k, v pointers) -> the three encoded maps, a few kept
    out_dtype: Any  # torch dtype of out when it is not q's (FP8), else None
    batch_heads_k: tuple[int, int] | None  # FP8: (batch, heads_k), which per-head descale factors must match


def make_plan(kernel: CompiledKernel, qv: View, kv: View, vv: View, prob: Problem, softmax_scale: float | None) -> Plan:
    """The plan of torch inputs already viewed and checked (check_qkv), with aligned strides."""
    cfg = _checked_kernel(kernel, prob)
    scale, scale_log2 = scale_args(softmax_scale, prob.head_dim)
    b, sq, sk, h, hk, d = prob.batch, prob.seqlen_q, prob.seqlen_k, prob.heads, prob.heads_k, prob.head_dim
    o_strides = (sq * h * d, h * d, d)  # a fresh contiguous out
    fields = (*qv.strides[:3], *kv.strides[:3], *vv.strides[:3], *o_strides, b, h, hk, sq, sk, scale, scale_log2)
    fn, tmaps = None, None
    if b * h * sq and sk:
        fn = _torch_function(kernel, qv.device)
        if cfg.family == "sm90":
            tmaps = tmap_geometry(qv, kv, vv, prob, cfg)
    grid = _grid(cfg, b, h, sq, qv.device, hk) if b * h * sq else (0, 1, 1)
    return Plan(qv.device, fn, cfg.threads, grid, (b, sq, h, d), (b, h, sq),
                fields, tmaps, prob.dtype, cfg.row_bytes, {}, torch_dtype(cfg.output_dtype) if cfg.fp8 else None,
                (b, hk) if cfg.fp8 else None)


def launch_plan(plan: Plan, q: Any, k: Any, v: Any, want_lse: bool = True,
                descale: dict[str, Any] | None = None) -> tuple[Any, Any] | None:
    """(out, lse) of one call by its plan (lse None unless wanted: the kernel skips it); None when a
    base pointer is not 16-byte aligned (take `run`). `descale`: FP8's factors (see `run`)."""
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) & 15:
        return None
    scales = descale_args(plan.batch_heads_k, plan.device, descale, plan.dtype)
    out = q.new_empty(plan.o_shape) if plan.out_dtype is None else q.new_empty(plan.o_shape, dtype=plan.out_dtype)
    lse = q.new_empty(plan.lse_shape, dtype=_float32()) if want_lse else None
    if plan.fn is None:
        _fill_empty(out, lse)
        return out, lse
    driver.use_device(plan.device)
    params = _FWD.pack(qp, kp, vp, out.data_ptr(), 0 if lse is None else lse.data_ptr(), *plan.fields)
    if plan.tmaps is not None:
        maps = plan.maps.get((qp, kp, vp))
        if maps is None:
            if len(plan.maps) > 64:
                plan.maps.clear()
            maps = plan.maps[qp, kp, vp] = b"".join(
                driver.tensor_map(plan.dtype, p, dims, strides, box, plan.swizzle)
                for p, (dims, strides, box) in zip((qp, kp, vp), plan.tmaps))
        params = (maps + params + scales).ljust(_SM90_BYTES, b"\0")
    plan.fn.launch(plan.grid, plan.threads, params, _current_stream(plan.device))
    return out, lse


@functools.lru_cache(maxsize=1)
def _float32() -> Any:
    import torch  # noqa: PLC0415

    return torch.float32


def _current_stream(device: int) -> int:
    """The raw handle of torch's current stream on `device` (capture streams of CUDA graphs included)."""
    import torch  # noqa: PLC0415

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, without making a Stream object
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _fill_empty(out: Any, lse: Any) -> None:
    """No key at all: O = 0 and LSE = +inf (lse may be None: not wanted)."""
    if hasattr(out, "zero_"):
        out.zero_()
        if lse is not None:
            lse.fill_(math.inf)
    else:
        out.fill(0)
        if lse is not None:
            lse.fill(math.inf)


__all__ = ["FwdParams", "pack_params", "run", "run_views", "scale_args"]
