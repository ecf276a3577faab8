"""The torch operators: what torch.compile, CUDA graphs, fake tensors and autograd see.

Imported only when a torch tensor reaches flashgen's public calls (torch stays optional). In
eager mode an operator's body is called directly: going through the dispatcher would add
tens of microseconds per call and change nothing a plain CUDA tensor needs. Traced code
(torch.compile, export) and tensor subclasses (FakeTensor, meta) go through the operators,
whose fake implementations give the output shapes without a GPU. The bodies run the kernels
(flashgen.kernels) that flashgen.resolve chooses.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from . import blockmap
from .checks import Mods, check_grad_scale, check_shapes, dtype_name, refuse_grad
from .head_dims import backward_head_dim, default_scale, kernel_head_dim
from .modifier_grads import captured_grads
from .kernels.backward import ServeArgs, backward
from .kernels.bad_inputs import check_errors
from .kernels.dense import checked, descale_dict, launch_torch, signature
from .kernels.modified import ModPlan, make_mod_plan, run_mod_plan
from .kernels.serving import (arch_and_slots, call_features, launch_prefill, modifier_config, modifier_digests,
                              serve_config, serve_grids, sm90_modifier_config, want_split)
from .resolve import (backward_kernel, gpu_stamp, load, modifier_backward_kernel, prefill_config, resolver,
                      serve_backward_kernel, tuned_modifier)

_HALF = {torch.float16: "fp16", torch.bfloat16: "bf16"}  # the dtypes with a backward


def forward_torch(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, arch: str | None,
                  want_lse: bool = True) -> tuple[Any, Any]:
    """`forward` for torch tensors: one dict lookup from the call's signature to its kernel and plan."""
    r = resolver
    r.refresh()
    sig = (*signature(q, k, v, softmax_scale), causal, arch)
    hit = r.plans.get(sig)
    if hit is None:
        qv, _, _, prob = checked(q, k, v, softmax_scale, arch)
        kern = r.kernel(qv.device, prob.head_dim, prob.dtype, causal, prob.seqlen_k, arch,
                        gqa_group=prob.heads // prob.heads_k, head_dim_v=prob.head_dim_v)
        hit = r.remember(sig, (kern, kern.plan(q, k, v, softmax_scale)))
    return launch_torch(hit[0], hit[1], q, k, v, softmax_scale, want_lse)


def forward_fp8(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, arch: str | None,
                descale: dict[str, Any] | None, out_dtype: str | None = None, block_quant_p: bool = False,
                want_lse: bool = True) -> tuple[Any, Any]:
    """`forward_torch` for float8_e4m3fn q, k, v (sm90 family, forward only): the tuned FP8 kernel, or its
    variant writing `out_dtype` ("bf16" default, "fp16") or quantizing P per key tile (block_quant_p)."""
    refuse_grad(q, k, v, "FP8 attention is forward only")
    if arch is not None and arch != "sm90":
        raise ValueError(f"FP8 attention is built in family sm90 (FP8 wgmma); arch={arch!r} has no FP8 tensor cores")
    r = resolver
    r.refresh()
    sig = (*signature(q, k, v, softmax_scale), causal, out_dtype, block_quant_p)
    hit = r.plans.get(sig)
    if hit is None:
        qv, _, _, prob = checked(q, k, v, softmax_scale, arch)
        kern = r.kernel(qv.device, prob.head_dim, prob.dtype, causal, prob.seqlen_k, "sm90",
                        gqa_group=prob.heads // prob.heads_k)
        want = dataclasses.replace(kern.config, out_dtype=out_dtype or "bf16", block_quant_p=block_quant_p,
                                   lazy_rescale=kern.config.lazy_rescale and not block_quant_p)  # a per-tile max moves
        if want != kern.config:
            kern = load(want.head_dim, want.dtype, causal, config=want, device=qv.device)
        hit = r.remember(sig, (kern, kern.plan(q, k, v, softmax_scale)))
    return launch_torch(hit[0], hit[1], q, k, v, softmax_scale, want_lse, descale)


@torch.library.custom_op("flashgen::attention", mutates_args=(), device_types="cuda")
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                 arch: Optional[str], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (batch, seqlen_q, heads, v's head_dim) like q, contiguous; lse (batch, heads, seqlen_q) fp32.
    `deterministic` is for the backward (the same gradients bit for bit on every run); the forward is always."""
    return forward_torch(q, k, v, causal, softmax_scale, arch)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
      arch: Optional[str], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_shapes(q, k, v, split=True)
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v.shape[3])), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_fp8", mutates_args=(), device_types="cuda")
def attention_fp8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: Optional[torch.Tensor],
                     k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], causal: bool,
                     softmax_scale: Optional[float], arch: Optional[str], out_dtype: Optional[str],
                     block_quant_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 (out, lse): out (batch, seqlen_q, heads, head_dim) in out_dtype (bf16 unless "fp16"), contiguous; lse
    (batch, heads, seqlen_q) fp32. Forward only (its inputs are quantized: there is no gradient to give)."""
    return forward_fp8(q, k, v, causal, softmax_scale, arch, descale_dict(q_descale, k_descale, v_descale), out_dtype,
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
    """(dq, dk, dv), contiguous, like q, k, v: the backward kernels of this GPU (flashgen.kernels.backward; sm90 family
    on Hopper, sm80 elsewhere; deterministic: bit-identical gradients run to run, the sm90 family's dQ reduces in a
    fixed order, sm80's dQ without atomics)."""
    return dense_backward(dout, q, k, v, out, lse, dlse, causal, softmax_scale, deterministic)


def dense_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any, causal: bool,
                   softmax_scale: float | None, deterministic: bool) -> tuple[Any, Any, Any]:
    """The body of flashgen::attention_backward. A head dim the sm90 backward has no kernel for (a dense-only one:
    flashgen.head_dims), and v narrower than q and k (a split-width forward's), run at the head dim that holds both
    (the sm90 family: its next), on zero-padded copies, with the forward's scale."""
    d, d_v = q.shape[3], v.shape[3]
    bd = backward_head_dim(kernel_head_dim(d, d_v, dense=True), arch_and_slots(q.get_device())[0] == "sm90")
    if bd != d or d_v != d:
        scale = default_scale(d) if softmax_scale is None else softmax_scale  # the forward's, not the padded dim's
        dq, dk, dv = dense_backward(*(pad_head_dim(t, bd) for t in (dout, q, k, v, out)), lse, dlse, causal, scale,
                                    deterministic)
        return cut_head_dim(dq, d), cut_head_dim(dk, d), cut_head_dim(dv, d_v)
    kern = backward_kernel(q.get_device(), d, _HALF[q.dtype], causal, q.shape[1], deterministic,
                           q.shape[2] // k.shape[2])
    return backward(kern, q, k, v, out, dout.contiguous(), lse, softmax_scale, dlse=dlse)


@attention_backward_op.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      dlse: Optional[torch.Tensor], causal: bool, softmax_scale: Optional[float],
      deterministic: bool) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


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


@torch.library.custom_op("flashgen::attention_varlen", mutates_args=(), device_types="cuda")
def attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                        softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                        sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a packed batch (flashgen.attention_varlen, arguments checked there): out (total_q, heads,
    head_dim) like q, lse (heads, total_q) fp32."""
    return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          Mods((window_left, window_right), softcap, alibi_slopes, sinks=sinks))


@attention_varlen_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
      max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], window_left: int,
      window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
      sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_mods", mutates_args=(), device_types="cuda")
def attention_mods_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                      window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                      deterministic: bool, sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of dense q, k, v with score modifiers (flashgen.attention with window_size, softcap,
    alibi_slopes or sinks, checked there): out like q, lse (batch, heads, seqlen_q) fp32."""
    return dense_mods_forward(q, k, v, causal, softmax_scale,
                              Mods((window_left, window_right), softcap, alibi_slopes, sinks=sinks))


@attention_mods_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
      window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
      deterministic: bool, sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    offsets None): the backward generated with the call's features (resolve.serve_backward_kernel chooses the
    family)."""
    serve = ServeArgs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (window_left, window_right), softcap,
                      alibi_slopes)
    features = tuple(sorted(f for f, on in serve.features(causal).items() if on))
    kern = serve_backward_kernel(q.get_device(), q.shape[-1], _HALF[q.dtype], causal, features, deterministic,
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


def sinks_grad(sinks: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
               dlse: Optional[torch.Tensor]) -> torch.Tensor:
    """d loss / d sinks, in sinks' dtype (summed in fp32). The sink is a key of score sink_h and value 0 in every
    row of head h, so its probability is p_i = exp(sink_h - LSE_i) and, with D_i = rowsum(dO_i * O_i),
    d sink_h = -sum_i p_i (D_i - dLSE_i) over all rows of head h (dq, dk, dv need nothing more: the forward's LSE
    holds the sink). out, dout: (..., rows, heads, head_dim); lse, dlse: (..., heads, rows) (dense (batch, ...),
    varlen without)."""
    acc = torch.promote_types(sinks.dtype, torch.float32)  # fp32 at least (a float64 reference keeps its own)
    d = (dout.to(acc) * out.to(acc)).sum(-1).transpose(-1, -2)  # (..., heads, rows): lse's layout
    if dlse is not None:
        d = d - dlse.to(acc)
    p = torch.exp(sinks.to(acc)[:, None] - lse.to(acc))  # an LSE of +inf (a row without keys or sink): 0
    return (-(p * d).sum(-1)).reshape(-1, sinks.shape[0]).sum(0).to(sinks.dtype)


def _setup_varlen(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, alibi, deterministic, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, alibi, sinks)
    ctx.args = (max_q, max_k, causal, scale, left, right, softcap, deterministic)


def _backward_varlen(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> tuple:
    check_errors()  # bad offsets the forward found: raised here, before gradients that leave that sequence out
    q, k, v, out, lse, cu_q, cu_k, alibi, sinks = ctx.saved_tensors
    max_q, max_k, causal, scale, left, right, softcap, deterministic = ctx.args
    dq, dk, dv = attention_serve_backward_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale,
                                             left, right, softcap, alibi, deterministic)
    dsinks = sinks_grad(sinks, out, dout, lse, dlse) if sinks is not None and ctx.needs_input_grad[14] else None
    return (dq, dk, dv) + (None,) * 11 + (dsinks,)


attention_varlen_op.register_autograd(_backward_varlen, setup_context=_setup_varlen)


def _setup_mods(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, scale, left, right, softcap, alibi, deterministic, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, alibi, sinks)
    ctx.args = (causal, scale, left, right, softcap, deterministic)


def _backward_mods(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, alibi, sinks = ctx.saved_tensors
    causal, scale, left, right, softcap, deterministic = ctx.args
    dq, dk, dv = attention_serve_backward_op(dout, q, k, v, out, lse, dlse, None, None, 0, 0, causal, scale,
                                             left, right, softcap, alibi, deterministic)
    dsinks = sinks_grad(sinks, out, dout, lse, dlse) if sinks is not None and ctx.needs_input_grad[10] else None
    return (dq, dk, dv) + (None,) * 7 + (dsinks,)


attention_mods_op.register_autograd(_backward_mods, setup_context=_setup_mods)


def pad_head_dim(t: Any, d: int) -> Any:
    """`t` with zero columns appended to its last dim up to `d` (`t` itself where it is that wide already): a copy,
    differentiable (the gradient of the zero columns is dropped). flashgen.head_dims says why zeros are exact."""
    n = d - t.shape[-1]
    return t if n == 0 else torch.nn.functional.pad(t, (0, n))


def cut_head_dim(t: Any, d: int) -> Any:
    """The first `d` columns of `t`'s last dim, contiguous (`t` itself where it is that wide): a padded call's output
    back at the caller's width; autograd gives its gradient zero columns, a padded dO."""
    return t if t.shape[-1] == d else t[..., :d].contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
              arch: Optional[str], want_lse: bool = True,
              deterministic: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`flashgen.attention` for torch tensors: the operator when traced, its body when eager
    (where lse is None unless wanted: the kernel then neither allocates nor writes it)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        check_grad_scale(softmax_scale, q, k, v)
        return attention_op(q, k, v, causal, softmax_scale, arch, deterministic)  # autograd: through the operator
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor:
        return attention_op(q, k, v, causal, softmax_scale, arch, deterministic)
    return forward_torch(q, k, v, causal, softmax_scale, arch, want_lse)


def varlen_forward(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, softmax_scale: float | None, mods: Mods, want_lse: bool = True,
                   num_splits: int = 1) -> tuple[Any, Any]:
    """(out, lse or None) of checked varlen arguments: the body of `attention_varlen` and of its operator."""
    total_q, heads, d = q.shape
    heads_k = k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    dtype = dtype_name(q, "q")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device) if want_lse else None
    if total_q and heads and batch:
        arch, sm_count = arch_and_slots(q.get_device())
        features = dict(varlen=True, **call_features(mods, causal))
        traced_mods = modifier_digests(mods)  # a score_mod / mask_mod: serve_config's tiles, generated with them
        cfg = serve_config(d, dtype, causal, max_seqlen_q, arch, **features, **traced_mods)
        tiles = serve_grids(cfg, batch, heads, heads_k, max_seqlen_q, total_q, 1)[0]  # row blocks, one split
        splits = want_split(num_splits, tiles, -(-max_seqlen_k // cfg.block_n), cfg, sm_count, arch)
        if splits > 1:
            cfg = serve_config(d, dtype, causal, max_seqlen_q, arch, split=True, **features, **traced_mods)
        elif not traced_mods:
            cfg = prefill_config(q.get_device(), d, dtype, causal, max_seqlen_q, max_seqlen_k, features, mods.window[0])
        launch_prefill(cfg, q, k, v, out, lse, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, num_splits=splits, mods=mods, softmax_scale=softmax_scale)
    elif lse is not None and mods.sinks is not None:  # rows that see no key: their sink's LSE
        lse.copy_(mods.sinks.float()[:, None].expand_as(lse))
    elif lse is not None:
        lse.fill_(math.inf)  # rows that see no key
    return out, lse


def dense_mods_forward(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, mods: Mods,
                       want_lse: bool = True, family: str | None = None) -> tuple[Any, Any]:
    """(out, lse or None) of dense (batch, seqlen, heads, head_dim) q, k, v with score modifiers (window,
    softcap, ALiBi, a traced score_mod or mask_mod): the serving kernel without varlen; `flashgen.attention`'s
    body for such calls. family: the template family of a score_mod / mask_mod kernel (None: the GPU's own; sm90
    where it builds the call, see modifier_kernel)."""
    batch, seqlen_q, heads, d = q.shape
    seqlen_k = k.shape[1]
    modified = mods.score_mod is not None or mods.mask_mod is not None or mods.block_map is not None
    cfg = None
    if modified and batch * seqlen_q * heads:
        plan = modifier_plan(q, k, v, causal, softmax_scale, mods, family)
        done = run_mod_plan(plan, q, k, v, want_lse)
        if done is not None:
            return done
        cfg, mods = plan.config, plan.mods  # a base pointer off 16 bytes: the launch below says why
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if want_lse else None
    if batch * seqlen_q * heads == 0:
        return out, lse
    if cfg is None:
        cfg = prefill_config(q.get_device(), d, dtype_name(q, "q"), causal, seqlen_q, seqlen_k,
                             call_features(mods, causal), mods.window[0])
    launch_prefill(cfg, q, k, v, out, lse, cu_q=None, cu_k=None, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
                   num_splits=1, mods=mods, softmax_scale=softmax_scale)
    return out, lse


def modifier_plan(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, mods: Mods,
                  family: str | None = None) -> ModPlan:
    """The plan (flashgen.kernels.modified) of a dense call with a score_mod, mask_mod or block map, on checked
    (batch, seqlen, heads, head_dim) torch tensors: its kernel (modifier_kernel), the block map at the kernel's
    tiles, its launch. Where the choice may have read the tuned store, the plan carries the store's stamp."""
    batch, seqlen_q, heads, d = q.shape
    device = q.get_device()
    cfg = modifier_kernel(device, d, dtype_name(q, "q"), causal, seqlen_q, heads // k.shape[2], mods, family)
    if cfg.block_map:
        mods = mods._replace(block_map=kernel_block_map(cfg, mods, causal, batch, heads, seqlen_q, k.shape[1],
                                                        q.device))
    # Where tuned_modifier read the store: every sm80 choice, and the sm90 family's without a window or sinks.
    tracks_store = cfg.family == "sm80" or (bool(cfg.score_mod or cfg.mask_mod) and not cfg.features)
    return make_mod_plan(cfg, q, k, v, mods, softmax_scale, tracks_store,
                         gpu_stamp(device)[1] if tracks_store else None)


class _FlexAttention(torch.autograd.Function):
    """Autograd of `flashgen.attention` with a traced score_mod, mask_mod or BlockMask (eager only: no torch operator
    takes a Python modifier): the serving forward, then the backward generated with the same modifiers (flex_backward:
    on Hopper the sm90 family's where it builds them, else sm80's). The score_mod's tensors are inputs too: those that
    require grad get theirs from modifier_grads.captured_grads."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                softmax_scale: Optional[float], mods: Mods, deterministic: bool, family: Optional[str],
                plan: Optional[ModPlan], *tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Either family's forward: its LSE (natural log, +inf for a row that sees no key) is what either family's
        # backward generated with the same modifiers reads.
        done = None if plan is None else run_mod_plan(plan, q, k, v)
        out, lse = done if done is not None else dense_mods_forward(q, k, v, causal, softmax_scale, mods, family=family)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, softmax_scale, mods, deterministic)
        ctx.family = family
        ctx.set_materialize_grads(False)  # lse's gradient stays None where lse is not used
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor]) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        wanted = tuple(ctx.needs_input_grad[9:])
        dq, dk, dv, bmap = flex_backward(dout, q, k, v, out, lse, dlse, *ctx.args, family=ctx.family)
        tables = [None] * len(wanted)
        if any(wanted):
            causal, scale, mods, deterministic = ctx.args
            tables = captured_grads(dout, q, k, v, out, lse, dlse, causal, scale, mods, bmap, wanted, deterministic)
        return (dq, dk, dv, None, None, None, None, None, None, *tables)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                   mods: Mods, deterministic: bool, family: Optional[str] = None,
                   plan: Optional[ModPlan] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `flashgen.attention` with modifiers where a gradient is wanted: differentiable in q, k, v and in
    the float tensors the score_mod reads. `plan`: the forward's (modifier_plan of the same call), where the caller
    holds one."""
    tables = mods.score_mod.tensors if mods.score_mod is not None else ()
    return _FlexAttention.apply(q, k, v, causal, softmax_scale, mods, deterministic, family, plan, *tables)


def flex_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: Optional[torch.Tensor], causal: bool, softmax_scale: Optional[float],
                  mods: Mods, deterministic: bool,
                  family: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(dq, dk, dv, block map or None) of dense_mods_forward with a score_mod, mask_mod or block map: the backward
    generated with the forward's modifiers (resolve.modifier_backward_kernel: on Hopper the sm90 family's where it
    builds them, unless family is "sm80"), its block map built from the same mask_mod or BlockMask at the backward's
    tiles (kernel_block_map), read both ways (q tiles per key tile, key tiles per q tile)."""
    batch, seqlen_q, heads, d = q.shape
    seqlen_k = k.shape[1]
    serve = ServeArgs(window=mods.window, softcap=mods.softcap, alibi_slopes=mods.alibi)
    features = tuple(sorted(f for f, on in serve.features(causal).items() if on))
    args = (q.get_device(), d, _HALF[q.dtype], causal, features, deterministic,
            mods.score_mod.digest if mods.score_mod is not None else "",
            mods.mask_mod.digest if mods.mask_mod is not None else "",
            mods.mask_mod is not None or mods.block_map is not None)
    kern = modifier_backward_kernel(*args, family, seqlen_q, heads // k.shape[2])
    given = mods.block_map
    if (kern.config.family == "sm90" and mods.mask_mod is None and given is not None
            and (given.block[0] % kern.config.block_m or given.block[1] % kern.config.block_n)):
        # a BlockMask alone whose blocks do not tile sm90's tiles
        kern = modifier_backward_kernel(*args, "sm80", seqlen_q, heads // k.shape[2])
    bmap = None
    if kern.config.block_map:
        bmap = kernel_block_map(kern.config, mods, causal, batch, heads, seqlen_q, seqlen_k, q.device)
    serve = serve._replace(mods=mods._replace(block_map=bmap))
    return (*backward(kern, q, k, v, out, dout.contiguous(), lse, softmax_scale, dlse=dlse, serve=serve), bmap)


def modifier_kernel(device: int, head_dim: int, dtype: str, causal: bool, seqlen: int, gqa_group: int,
                    mods: Mods, family: str | None = None) -> Any:
    """The kernel of a dense call with a score_mod, mask_mod or BlockMask. On Hopper (family None or "sm90") the
    sm90 family's forward where it builds the call (2-3x the sm80 kernel's speed there): the one tuned for exactly
    its modifiers (flashgen.resolve.tuned_modifier) where the call has no window or sinks, else the rule
    (sm90_modifier_config); family "sm90" elsewhere is an error. Else, and with family "sm80", the sm80 family's:
    likewise tuned where the call has no other score modifier, else serve_config's tiles."""
    arch = arch_and_slots(device)[0]
    if family == "sm90" or (family is None and arch == "sm90"):
        sm90 = sm90_modifier_config(head_dim, dtype, causal, mods)
        if sm90 is not None and not sm90.features and (sm90.score_mod or sm90.mask_mod):
            tuned = tuned_modifier(device, head_dim, dtype, causal, seqlen, gqa_group, sm90.score_mod, sm90.mask_mod,
                                   "sm90")
            sm90 = tuned if tuned is not None and tuned.block_map == sm90.block_map else sm90
        why = sm90.unfit_reason(arch) if sm90 is not None else None
        if family == "sm90" and why is not None:
            raise ValueError(f"arch='sm90': {why}")
        if sm90 is not None and why is None:
            return sm90
    cfg = modifier_config(head_dim, dtype, causal, seqlen, arch, mods)
    if cfg.features or mods.score_mod is None and mods.mask_mod is None:
        return cfg
    tuned = tuned_modifier(device, head_dim, dtype, causal, seqlen, gqa_group, cfg.score_mod, cfg.mask_mod)
    return tuned if tuned is not None and tuned.block_map == cfg.block_map else cfg


def kernel_block_map(cfg: Any, mods: Mods, causal: bool, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                     device: Any) -> blockmap.BlockMap:
    """The block map `cfg`'s kernel reads: the call's (a BlockMask's) brought to the kernel's tiles, or one built
    from the mask_mod on the call's device (again where a captured tensor changed: blockmap.cached_from_mask), then
    without the key tiles causal or the window leave out."""
    given = mods.block_map
    if given is None:
        built = blockmap.cached_from_mask(mods.mask_mod, batch, heads, seqlen_q, seqlen_k, cfg.block_m, cfg.block_n,
                                          device)
    else:
        if mods.mask_mod is None and (given.block[0] % cfg.block_m or given.block[1] % cfg.block_n):
            raise ValueError(f"a BlockMask without a mask_mod needs BLOCK_SIZE a multiple of the kernel's tiles "
                             f"({cfg.block_m}, {cfg.block_n}), not {given.block}: a tile covering blocks of different "
                             "states would evaluate the mask_mod, and there is none")
        built = given.to(device).retile(cfg.block_m, cfg.block_n)
    return built.restrict(causal, mods.window)


__all__ = ["attention", "attention_backward_op", "attention_fp8", "attention_fp8_op", "attention_mods_op",
           "attention_op", "attention_serve_backward_op", "attention_varlen_op", "cut_head_dim", "dense_backward",
           "dense_mods_forward",
           "flex_attention", "flex_backward", "forward_fp8", "forward_torch", "kernel_block_map", "modifier_kernel",
           "modifier_plan",
           "pad_head_dim", "sinks_grad", "varlen_forward"]
