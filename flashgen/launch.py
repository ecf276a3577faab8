"""Step 4: run a compiled kernel on q, k, v (torch tensors or GPU arrays)."""
from __future__ import annotations

import ctypes
import math
from typing import Any

from .compile import CompiledKernel
from .config import KernelConfig
from .driver import get_function
from .tensors import Problem, View, aligned, check_qkv, view

LOG2E = 1.4426950408889634


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


def sm90_params(p: FwdParams, q: View, k: View, v: View, prob: Problem, cfg: KernelConfig) -> ctypes.Array:
    """Bytes of `struct Sm90FwdParams` (templates/sm90/params.cuh.j2): TMA maps of q, k, v at 0, 128, 256, then FwdParams."""
    from .driver import tensor_map  # noqa: PLC0415

    d, width, block_m, block_n = prob.head_dim, cfg.smem_w, cfg.block_m, cfg.block_n

    def tmap(t: View, seqlen: int, heads: int, rows: int) -> bytes:
        dims = (d, seqlen, heads, prob.batch)
        strides = tuple(2 * s for s in (t.strides[1], t.strides[2], t.strides[0]))
        return tensor_map(prob.dtype, t.ptr, dims, strides, (width, rows, 1, 1), 2 * width)

    blob = (tmap(q, prob.seqlen_q, prob.heads, block_m) + tmap(k, prob.seqlen_k, prob.heads_k, block_n)
            + tmap(v, prob.seqlen_k, prob.heads_k, block_n) + bytes(p))
    size = -(-len(blob) // 128) * 128  # sizeof(Sm90FwdParams): CUtensorMap's alignment pads the tail
    return (ctypes.c_uint8 * size).from_buffer_copy(blob.ljust(size, b"\0"))


def _empty_like_problem(like: View, shape: tuple[int, ...], dtype: str) -> Any:
    if like.kind == "torch":
        import torch  # noqa: PLC0415

        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        return torch.empty(shape, dtype=tdt, device=like.obj.device)
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
    raise ValueError(f"{name} needs a 16-byte aligned base and strides that are multiples of 8 elements")


def run(kernel: CompiledKernel, q: Any, k: Any, v: Any, softmax_scale: float | None = None,
        stream: Any = None, out: Any = None, lse: Any = None) -> tuple[Any, Any, Problem]:
    """Launch `kernel` on q, k, v; returns (out, lse, problem). `stream`: a pycuda Stream or raw handle.

    `out` and `lse`, if given, are written in place (verification passes poisoned buffers)."""
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    prob = check_qkv(qv, kv, vv)
    if stream is not None and qv.kind == "torch":
        raise TypeError("stream= is for GPU arrays; torch tensors run on torch's current stream "
                        "(use `with torch.cuda.stream(s):`)")
    cfg = kernel.config
    if prob.head_dim != cfg.head_dim or prob.dtype != cfg.dtype:
        raise ValueError(
            f"kernel {cfg.name} is for head_dim={cfg.head_dim}, dtype={cfg.dtype}; "
            f"got head_dim={prob.head_dim}, dtype={prob.dtype}"
        )
    qv, kv, vv = (_fix_alignment(t, n) for t, n in ((qv, "q"), (kv, "k"), (vv, "v")))
    o_shape, lse_shape = (prob.batch, prob.seqlen_q, prob.heads, prob.head_dim), (prob.batch, prob.heads, prob.seqlen_q)
    if out is None:
        out = _empty_like_problem(qv, o_shape, prob.dtype)
    if lse is None:
        lse = _empty_like_problem(qv, lse_shape, "fp32")
    if tuple(out.shape) != o_shape or tuple(lse.shape) != lse_shape:
        raise ValueError(f"out must have shape {o_shape} and lse {lse_shape}; got {tuple(out.shape)}, {tuple(lse.shape)}")
    if prob.batch * prob.heads * prob.seqlen_q == 0:
        return out, lse, prob
    ov = view(out, "out") if qv.kind == "torch" else View(out, "cai", int(out.gpudata), out.shape,
                                                            tuple(s // out.dtype.itemsize for s in out.strides),
                                                            prob.dtype, -1)
    lse_ptr = lse.data_ptr() if qv.kind == "torch" else int(lse.gpudata)
    scale = 1.0 / math.sqrt(prob.head_dim) if softmax_scale is None else float(softmax_scale)
    p = FwdParams(
        qv.ptr, kv.ptr, vv.ptr, ov.ptr, lse_ptr,
        *(s for t in (qv, kv, vv, ov) for s in (t.strides[0], t.strides[1], t.strides[2])),
        prob.batch, prob.heads, prob.heads_k, prob.seqlen_q, prob.seqlen_k, scale, scale * LOG2E,
    )
    if cfg.family == "sm90":
        p = sm90_params(p, qv, kv, vv, prob, cfg)
    if qv.kind == "torch":
        import torch  # noqa: PLC0415

        with torch.cuda.device(qv.obj.device):
            handle = torch.cuda.current_stream().cuda_stream
            fn = get_function(kernel.cubin, cfg.name, cfg.smem_bytes, kernel.digest)
            fn.launch(cfg.grid(prob.batch, prob.heads, prob.seqlen_q), cfg.threads, p, handle)
    else:
        handle = 0 if stream is None else int(getattr(stream, "handle", stream))
        fn = get_function(kernel.cubin, cfg.name, cfg.smem_bytes, kernel.digest)
        fn.launch(cfg.grid(prob.batch, prob.heads, prob.seqlen_q), cfg.threads, p, handle)
    return out, lse, prob


__all__ = ["FwdParams", "run"]
