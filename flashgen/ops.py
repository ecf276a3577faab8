"""The torch operator `flashgen::attention`: what torch.compile, CUDA graphs and fake tensors see.

Imported only when a torch tensor reaches `flashgen.attention` (torch stays optional). In
eager mode the operator's body is called directly: going through the dispatcher would add
tens of microseconds per call and change nothing a plain CUDA tensor needs. Traced code
(torch.compile, export) and tensor subclasses (FakeTensor, meta) go through the operator,
whose fake implementation gives the output shapes without a GPU.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .api import _descale, forward, forward_fp8, forward_torch, refuse_grad
from .config import HEAD_DIMS


@torch.library.custom_op("flashgen::attention", mutates_args=(), device_types="cuda")
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                 arch: Optional[str], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (batch, seqlen_q, heads, head_dim) like q, contiguous; lse (batch, heads, seqlen_q) fp32.
    `deterministic` is for the backward (the same gradients bit for bit on every run); the forward is always."""
    return forward(q, k, v, causal, softmax_scale, arch)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
      arch: Optional[str], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_shapes(q, k, v)
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_fp8", mutates_args=(), device_types="cuda")
def attention_fp8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: Optional[torch.Tensor],
                     k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], causal: bool,
                     softmax_scale: Optional[float], arch: Optional[str], out_dtype: Optional[str],
                     block_quant_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 (out, lse): out (batch, seqlen_q, heads, head_dim) in out_dtype (bf16 unless "fp16"), contiguous; lse
    (batch, heads, seqlen_q) fp32. Forward only (its inputs are quantized: there is no gradient to give)."""
    return forward_fp8(q, k, v, causal, softmax_scale, arch, _descale(q_descale, k_descale, v_descale), out_dtype,
                       block_quant_p)


@attention_fp8_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: Optional[torch.Tensor],
      k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], causal: bool,
      softmax_scale: Optional[float], arch: Optional[str], out_dtype: Optional[str],
      block_quant_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_shapes(q, k, v, (torch.float8_e4m3fn,))
    b, sq, h, _ = q.shape
    out = q.new_empty(q.shape, dtype=torch.float16 if out_dtype == "fp16" else torch.bfloat16)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                  arch: Optional[str], descale: Optional[dict], out_dtype: Optional[str], block_quant_p: bool,
                  want_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`flashgen.attention` for float8_e4m3fn tensors: the operator when traced (torch.compile, fake and meta
    tensors), its body when eager (lse None unless wanted)."""
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor:
        d = descale or {}
        return attention_fp8_op(q, k, v, d.get("q_descale"), d.get("k_descale"), d.get("v_descale"), causal,
                                softmax_scale, arch, out_dtype, block_quant_p)
    return forward_fp8(q, k, v, causal, softmax_scale, arch, descale, out_dtype, block_quant_p, want_lse)


@torch.library.custom_op("flashgen::attention_backward", mutates_args=(), device_types="cuda")
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, dlse: Optional[torch.Tensor], causal: bool,
                          softmax_scale: Optional[float], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, like q, k, v: the backward kernels of this GPU (flashgen.backward; sm90 family
    on Hopper, sm80 elsewhere and when deterministic: bit-identical gradients run to run, no atomics)."""
    from .backward import backward  # noqa: PLC0415

    kern = _backward_kernel(q.get_device(), q.shape[3], q.dtype, causal, q.shape[1], deterministic)
    return backward(kern, q, k, v, out, dout.contiguous(), lse, softmax_scale, dlse=dlse)


@attention_backward_op.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      dlse: Optional[torch.Tensor], causal: bool, softmax_scale: Optional[float],
      deterministic: bool) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _backward_kernel(device: int, head_dim: int, dtype: torch.dtype, causal: bool, seqlen: int | None = None,
                     deterministic: bool = False) -> Any:
    """The backward for these tensors' GPU: the tuned BwdConfig of the nearest stored seqlen bucket, else
    the default (deterministic: the default deterministic config, dQ per Q tile without atomics). Cached: the
    store's buckets are read again only when its file changed (looked at most every api.STORE_CHECK_S),
    kernels by configuration."""
    from .api import nearest_bucket  # noqa: PLC0415

    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    gpu_name, arch = _gpu(device)
    if deterministic:
        return _load_backward(head_dim, name, causal, None, arch, True)
    tuned = _tuned_backwards(gpu_name, arch, head_dim, name, causal, _store_stamp(gpu_name, arch))
    bucket = nearest_bucket(seqlen, tuple(sorted(tuned)))
    return _load_backward(head_dim, name, causal, tuned.get(bucket) if bucket is not None else None, arch)


@functools.lru_cache(maxsize=16)
def _gpu(device: int) -> tuple[str, str]:
    from .driver import device_info  # noqa: PLC0415

    info = device_info(device)
    return info.name, info.arch


_stamps: dict[tuple[str, str], tuple[float, tuple | None]] = {}  # GPU -> (when looked, the store file's stamp)


def _store_stamp(gpu_name: str, arch: str) -> tuple | None:
    """The stamp (api._stamp) of the GPU's store file, looked at on disk at most every api.STORE_CHECK_S."""
    import time  # noqa: PLC0415

    from .api import STORE_CHECK_S, _stamp  # noqa: PLC0415
    from .store import store_path  # noqa: PLC0415

    now = time.monotonic()
    hit = _stamps.get((gpu_name, arch))
    if hit is None or now - hit[0] >= STORE_CHECK_S:
        hit = _stamps[gpu_name, arch] = (now, _stamp(store_path(gpu_name, arch)))
    return hit[1]


@functools.lru_cache(maxsize=64)
def _tuned_backwards(gpu_name: str, arch: str, head_dim: int, dtype: str, causal: bool, stamp: tuple | None) -> dict:
    """seqlen bucket -> tuned BwdConfig for this GPU and problem, as the store file with `stamp` holds them,
    of the family the untuned default is in (sm90 where it has the head dim: a tuned sm80 backward there is
    slower than sm90's default)."""
    from .config import default_bwd_config  # noqa: PLC0415
    from .store import tuned_buckets  # noqa: PLC0415

    family = default_bwd_config(head_dim, dtype, causal, arch).family
    return tuned_buckets(gpu_name, arch, head_dim, dtype, causal, pass_="bwd", family=family)


@functools.lru_cache(maxsize=64)
def _load_backward(head_dim: int, dtype: str, causal: bool, config: Any, arch: str, deterministic: bool = False) -> Any:
    from .backward import load_backward  # noqa: PLC0415

    return load_backward(head_dim, dtype, causal, config=config, gpu_arch=arch, deterministic=deterministic)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, softmax_scale, _, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic


def _backward(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# -- training with serving features: varlen batches, and dense calls with window / softcap / ALiBi ------------

@torch.library.custom_op("flashgen::attention_varlen", mutates_args=(), device_types="cuda")
def attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                        softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a packed batch (flashgen.attention_varlen, arguments checked there): out (total_q, heads,
    head_dim) like q, lse (heads, total_q) fp32."""
    from .serving import Mods, varlen_forward  # noqa: PLC0415

    return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          Mods((window_left, window_right), softcap, alibi_slopes))


@attention_varlen_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
      max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], window_left: int,
      window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_mods", mutates_args=(), device_types="cuda")
def attention_mods_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                      window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of dense q, k, v with score modifiers (flashgen.attention with window_size, softcap or
    alibi_slopes, checked there): out like q, lse (batch, heads, seqlen_q) fp32."""
    from .serving import Mods, dense_mods_forward  # noqa: PLC0415

    return dense_mods_forward(q, k, v, causal, softmax_scale, Mods((window_left, window_right), softcap, alibi_slopes))


@attention_mods_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
      window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_shapes(q, k, v)
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_serve_backward", mutates_args=(), device_types="cuda")
def attention_serve_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                                cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                                max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                                window_left: int, window_right: int, softcap: float,
                                alibi_slopes: Optional[torch.Tensor],
                                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of flashgen::attention_varlen (3-d q, k, v and offsets) or flashgen::attention_mods (4-d,
    offsets None): the backward generated with the call's features (_serve_backward_kernel chooses the family)."""
    from .backward import ServeArgs, backward  # noqa: PLC0415

    serve = ServeArgs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (window_left, window_right), softcap,
                      alibi_slopes)
    features = tuple(sorted(f for f, on in serve.features(causal).items() if on))
    kern = _serve_backward_kernel(q.get_device(), q.shape[-1], q.dtype, causal, features, deterministic,
                                  max_seqlen_k if cu_seqlens_q is not None else k.shape[1])
    packed = q.dim() == 3  # varlen: the packed tensors as one batch
    lift = (lambda t: None if t is None else t.unsqueeze(0)) if packed else (lambda t: t)
    grads = backward(kern, *(lift(t) for t in (q, k, v, out, dout.contiguous(), lse)), softmax_scale,
                     dlse=lift(dlse), serve=serve)
    return tuple(g.squeeze(0) for g in grads) if packed else grads


@attention_serve_backward_op.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      dlse: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
      max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], window_left: int,
      window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
      deterministic: bool) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _serve_backward_kernel(device: int, head_dim: int, dtype: torch.dtype, causal: bool, features: tuple[str, ...],
                           deterministic: bool, seqlen: int) -> Any:
    """The backward for a call with serving features: the dense backward autograd would take (tuned for the
    nearest seqlen bucket; sm90 family on Hopper), generated with `features`; the sm80 family's default tiles
    where the sm90 backward lacks a feature (softcap, ALiBi) or the call is deterministic."""
    import dataclasses  # noqa: PLC0415

    from .config import default_bwd_config  # noqa: PLC0415

    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    arch = _gpu(device)[1]
    if deterministic or "softcap" in features or "alibi" in features:
        base = default_bwd_config(head_dim, name, causal, arch, deterministic, family="sm80")
    else:
        base = _backward_kernel(device, head_dim, dtype, causal, seqlen).config
    return _load_backward(head_dim, name, causal, dataclasses.replace(base, **dict.fromkeys(features, True)), arch,
                          deterministic)


def _setup_varlen(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, alibi, deterministic = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, alibi)
    ctx.args = (max_q, max_k, causal, scale, left, right, softcap, deterministic)


def _backward_varlen(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, cu_q, cu_k, alibi = ctx.saved_tensors
    max_q, max_k, causal, scale, left, right, softcap, deterministic = ctx.args
    dq, dk, dv = attention_serve_backward_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale,
                                             left, right, softcap, alibi, deterministic)
    return (dq, dk, dv) + (None,) * 11


attention_varlen_op.register_autograd(_backward_varlen, setup_context=_setup_varlen)


def _setup_mods(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, scale, left, right, softcap, alibi, deterministic = inputs
    ctx.save_for_backward(q, k, v, *output, alibi)
    ctx.args = (causal, scale, left, right, softcap, deterministic)


def _backward_mods(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, alibi = ctx.saved_tensors
    causal, scale, left, right, softcap, deterministic = ctx.args
    dq, dk, dv = attention_serve_backward_op(dout, q, k, v, out, lse, dlse, None, None, 0, 0, causal, scale,
                                             left, right, softcap, alibi, deterministic)
    return (dq, dk, dv) + (None,) * 7


attention_mods_op.register_autograd(_backward_mods, setup_context=_setup_mods)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dtypes: tuple = (torch.float16, torch.bfloat16)) -> None:
    """What the operator can check from shapes and dtypes alone (the eager body checks the rest)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim={q.shape[3]} is not supported; supported: {', '.join(map(str, HEAD_DIMS))}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k and v ({k.shape[2]}) (MQA/GQA)")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
              arch: Optional[str], want_lse: bool = True,
              deterministic: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`flashgen.attention` for torch tensors: the operator when traced, its body when eager
    (where lse is None unless wanted: the kernel then neither allocates nor writes it)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if softmax_scale is not None and not softmax_scale > 0:
            refuse_grad(q, k, v, f"the backward needs softmax_scale > 0, not {softmax_scale!r}")
        return attention_op(q, k, v, causal, softmax_scale, arch, deterministic)  # autograd: through the operator
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor:
        return attention_op(q, k, v, causal, softmax_scale, arch, deterministic)
    return forward_torch(q, k, v, causal, softmax_scale, arch, want_lse)
