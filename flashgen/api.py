"""The public API: `attention()`, `attention_varlen()`, `attention_with_kvcache()`, a `load()`ed `Kernel`.

Each call checks its arguments (flashgen.checks), takes the kernel flashgen.resolve chooses for it (resolved
once, then a dict lookup; the tuned store is looked at again only when its file changes, checked at most once
a second, or after `reload()`) and runs it (flashgen.kernels); torch tensors go through the torch operators
(flashgen.ops), which torch.compile and autograd see.
"""
from __future__ import annotations

import collections
import numbers
import sys
import time
import weakref
from typing import Any, NamedTuple

from . import driver, resolve
from .blockmap import block_mask_stamp, cached_from_block_mask, check_call, generation, mask_stamp
from .checks import (Mods, check_cache, check_dense, check_grad_scale, check_head_dims, check_heads, check_int32,
                     check_mods, check_offsets, check_sinks, checked_dtype, clamp_window, dtype_name, refuse_grad,
                     traced, wants_grad)
from .head_dims import default_scale, kernel_head_dim, native, split_native
from .kernels.bad_inputs import check_errors
from .kernels.dense import Kernel, checked, descale_dict, run_views
from .kernels.modified import ModPlan, run_mod_plan
from .kernels.serving import (NO_BACKWARD, KVPlan, append_kv, arch_and_slots, call_features, has_mods, kvcache_launch,
                              modifier_digests, run_plan, serve_config, serve_grids, want_split)
from .launch import STREAM_FOR_TORCH, capturing
from .mask_bands import builtin_for
from .modifiers import trace_cached
from .resolve import STORE_CHECK_S, choose_config, current_arch, load, tuned_decode
from .tensors import is_torch


_NO_WINDOW = (-1, -1)  # window_size's default: a plan's key tells it by identity


def _ops() -> Any:
    from . import ops  # noqa: PLC0415  (the torch operators need torch: a torch tensor in the call proves it is there)

    return ops


def _traced_modifiers() -> Any:
    from . import traced_modifiers  # noqa: PLC0415  (torch operators: a torch tensor in the call proves torch is there)

    return traced_modifiers


def _check_options(causal: Any, softmax_scale: Any) -> None:
    """The call's flags, before anything else reads them: a string or a tensor there is a caller's mistake that
    would otherwise surface as a wrong mask or an error from deep inside a launch."""
    if not isinstance(causal, (bool, numbers.Integral)) or isinstance(causal, str):
        raise TypeError(f"causal must be a bool, not {type(causal).__name__} ({causal!r})")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"softmax_scale must be a number or None, not {type(softmax_scale).__name__} "
                        f"({softmax_scale!r})")


def reload() -> None:
    """Forget every resolved kernel, and the plans repeated calls keep: the next call reads the tuned store again (it
    is also re-read by itself when its file changes, checked at most once a second) and chooses its kernel anew."""
    resolve.clear()
    _kv_plans.clear()
    _decode_routes.clear()
    _mod_routes.clear()


def _padded(q: Any, k: Any, v: Any, rank: int, dense: bool = False, arch: str | None = None) -> bool:
    """Whether a call's torch tensors run padded to a built head dim (flashgen.head_dims; `dense`: the call takes
    the dense kernels): q, k, v of the call's rank whose widths are not one built head dim nor a split-width kernel's
    of the family that runs the call (`arch`, else its GPU's; other ranks: the call's own checks say what is
    wrong). FP8 keeps to its built head dims (its checks say which)."""
    try:
        d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    except (AttributeError, IndexError, TypeError):
        return False  # not tensors: the call's own checks say what is wrong
    if d_q == d_k and native(d_q, d_v, dense):  # the common case, first: a few attribute reads per call
        return False
    if not all(is_torch(t) and t.dim() == rank for t in (q, k, v)) or str(q.dtype) == "torch.float8_e4m3fn":
        return False
    return not (d_q == d_k and split_native(d_q, d_v, dense, arch or _device_family(q)))


def _device_family(t: Any) -> str | None:
    """The family a call on `t`'s GPU takes untuned (sm90 on Hopper); None for tensors on no GPU (meta)."""
    if not t.is_cuda:
        return None
    return "sm90" if resolve.gpu(t.get_device())[1] == "sm90" else "sm80"


def _cut(result: Any, d_v: int, return_lse: bool) -> Any:
    """A padded call's result at the caller's v width (lse is the same at any width)."""
    if return_lse:
        return _ops().cut_head_dim(result[0], d_v), result[1]
    return _ops().cut_head_dim(result, d_v)


def _forward_arrays(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None,
                    arch: str | None, stream: Any = None) -> tuple[Any, Any]:
    """(out, lse) of GPU arrays through the resolved kernel, in the current context, on `stream`."""
    qv, kv, vv, prob = checked(q, k, v, softmax_scale, arch)
    kern = resolve.resolver.kernel(driver.context_device(), prob.head_dim, prob.dtype, causal, prob.seqlen_k, arch,
                                   gqa_group=prob.heads // prob.heads_k, head_dim_v=prob.head_dim_v)
    out, lse, _ = run_views(kern.compiled, qv, kv, vv, prob, softmax_scale, stream)
    return out, lse


def _attention_mods(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, return_lse: bool,
                    stream: Any, arch: str | None, descale: Any, out_dtype: str | None, block_quant_p: bool,
                    deterministic: bool, window_size: Any, softcap: float, alibi_slopes: Any, sinks: Any) -> Any:
    """`attention` with a window, softcap, ALiBi or attention sinks: the serving kernels (flashgen.resolve picks the
    family: sm90 for a window on Hopper, sm80 otherwise), torch tensors only."""
    if not is_torch(q):
        raise TypeError("window_size, softcap, alibi_slopes and learnable_sink take torch tensors")
    if stream is not None:
        raise TypeError(STREAM_FOR_TORCH)
    if descale is not None or out_dtype is not None or block_quant_p or str(q.dtype) == "torch.float8_e4m3fn":
        raise ValueError("window_size, softcap, alibi_slopes and learnable_sink are not built for FP8 inputs")
    if arch not in (None, "sm80"):
        raise ValueError(f"window_size, softcap, alibi_slopes and learnable_sink are built in family sm80 (it runs on "
                         f"Hopper too), not arch={arch!r}")
    mods = check_dense(q, k, v, window_size, softcap, alibi_slopes, causal, sinks)
    if wants_grad(q, k, v, mods.sinks) or traced(q):
        check_grad_scale(softmax_scale, q, k, v)
        out, lse = _ops().attention_mods_op(q, k, v, causal, softmax_scale, *mods.window, mods.softcap, mods.alibi,
                                            deterministic, mods.sinks)
    else:
        out, lse = _ops().dense_mods_forward(q, k, v, causal, softmax_scale, mods, return_lse)
    return (out, lse) if return_lse else out


def _attention_flex(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, return_lse: bool,
                    stream: Any, arch: str | None, fp8_args: bool, window_size: Any, softcap: float,
                    alibi_slopes: Any, score_mod: Any, mask_mod: Any, block_mask: Any = None,
                    deterministic: bool = False) -> Any:
    """`attention` with a score_mod, mask_mod or BlockMask: traced (flashgen.modifiers, reused while the function
    and what it reads are the same) into the forward of family `arch` ("sm80": the sm80 family's serving forward,
    which runs on Hopper too; "sm90": the sm90 family's, on Hopper, where it builds the call; None: sm90's where it
    builds the call on Hopper, else sm80's), with a block
    map wherever there is a mask (flashgen.blockmap). Torch tensors; differentiable in q, k, v (the backward
    generated with the same modifiers: on Hopper the sm90 family's where it builds them unless arch="sm80", else
    sm80's) and the float tensors the score_mod reads. Traced calls (torch.compile, fake
    and meta tensors) go through the flashgen::attention_modified operator (flashgen.traced_modifiers), without
    block_mask, in the family the GPU takes by default."""
    if not is_torch(q):
        raise TypeError("score_mod and mask_mod take torch tensors")
    if stream is not None:
        raise TypeError(STREAM_FOR_TORCH)
    if fp8_args or str(q.dtype) == "torch.float8_e4m3fn":
        raise ValueError("score_mod and mask_mod are not built for FP8 inputs")
    if arch not in (None, "sm80", "sm90"):
        raise ValueError(f"score_mod and mask_mod are built in families sm80 (it runs on Hopper too) and sm90, not "
                         f"arch={arch!r}")
    if (block_mask is None and mask_mod is not None and arch is None and not softcap and alibi_slopes is None
            and (window_size is _NO_WINDOW or window_size == _NO_WINDOW) and not traced(q)):
        builtin = _builtin_mask(score_mod, mask_mod, causal, q, k)
        if builtin is not None:  # a band of diagonals (causal, a sliding window): the built-in kernels keep its scores
            return attention(q, k, v, builtin[0], softmax_scale, return_lse, deterministic=deterministic,
                             window_size=builtin[1])
    mods = check_dense(q, k, v, window_size, softcap, alibi_slopes, causal)
    if score_mod is not None and (mods.softcap or mods.alibi is not None):
        raise ValueError("a score_mod does not combine with softcap or alibi_slopes: write them into the score_mod")
    if traced(q):
        if block_mask is not None:
            raise NotImplementedError("block_mask is for eager calls: under torch.compile, or with fake or meta "
                                      "tensors, pass its mask_mod as mask_mod= (flashgen builds the block map from it "
                                      "on the device)")
        check_grad_scale(softmax_scale, q, k, v)
        out, lse = _traced_modifiers().modified_attention(q, k, v, causal, softmax_scale, mods, score_mod, mask_mod,
                                                          deterministic)
        return (out, lse) if return_lse else out
    block_map, given_mask_mod = None, mask_mod
    if block_mask is not None:
        mask_mod = _block_mask_mod(block_mask, mask_mod)
        block_map = cached_from_block_mask(block_mask)
        check_call(block_map, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    score = trace_cached(score_mod, "score") if score_mod is not None else None
    mask = trace_cached(mask_mod, "mask") if mask_mod is not None else None
    _refuse_mask_grad(mask)
    traces = (score, mask)
    if score is not None and score.is_identity:  # dead code: the call is the kernel without it
        if mask is None and block_map is None:
            return attention(q, k, v, causal, softmax_scale, return_lse, arch=arch, deterministic=deterministic,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        score = None
    mods = mods._replace(score_mod=score, mask_mod=mask, block_map=block_map)
    grad = wants_grad(q, k, v) or _tables_want_grad(score)
    if grad:
        check_grad_scale(softmax_scale, q, k, v)
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    plan = _ops().modifier_plan(q, k, v, causal, softmax_scale, mods, arch) if rows else None
    if plan is not None:
        if not softcap and alibi_slopes is None and (window_size is _NO_WINDOW or window_size == _NO_WINDOW):
            key = _mod_key(q, k, v, causal, softmax_scale, return_lse, arch, deterministic, score_mod, given_mask_mod,
                           block_mask)
            if key is not None and not (q.is_cuda and capturing()):  # a capture's block map is the graph's memory
                _mod_routes[key] = _ModRoute(plan, mods, *traces, _weak(block_mask), _map_stamp(mask, block_mask))
                _mod_routes.move_to_end(key)
                while len(_mod_routes) > MOD_ROUTES_KEPT:
                    _mod_routes.popitem(last=False)
    return _run_flex(q, k, v, causal, softmax_scale, return_lse, arch, deterministic, mods, plan, grad)


def _run_flex(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, return_lse: bool, arch: str | None,
              deterministic: bool, mods: Mods, plan: Any, grad: bool) -> Any:
    """A modifier call's result by its plan (None: there is none, the call has no rows), through autograd where
    `grad`."""
    if grad:
        out, lse = _ops().flex_attention(q, k, v, causal, softmax_scale, mods, deterministic, arch, plan)
    else:
        done = None if plan is None else run_mod_plan(plan, q, k, v, return_lse)
        out, lse = done if done is not None else _ops().dense_mods_forward(q, k, v, causal, softmax_scale, mods,
                                                                          return_lse, arch)
    return (out, lse) if return_lse else out


def _builtin_mask(score_mod: Any, mask_mod: Any, causal: bool, q: Any, k: Any) -> tuple[bool, tuple[int, int]] | None:
    """(causal, window_size) of the built-in kernels where the call's mask_mod keeps a band of diagonals
    (flashgen.mask_bands) and its score_mod, if any, changes nothing; else None. Before the call's checks:
    `attention` makes them on the way to the built-in kernels."""
    if q.dim() != 4 or k.dim() != 4:
        return None
    score = trace_cached(score_mod, "score") if score_mod is not None else None
    return builtin_for(trace_cached(mask_mod, "mask"), score, causal, q.shape[1], k.shape[1])


def _tables_want_grad(score: Any) -> bool:
    """Whether a tensor the score_mod reads wants a gradient (a learnable bias: flashgen.modifier_grads)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    return score is not None and torch.is_grad_enabled() and any(t.requires_grad for t in score.tensors)


def _refuse_mask_grad(mask: Any) -> None:
    """NotImplementedError where a tensor the mask_mod reads wants a gradient: a mask's keep/drop has none, and a
    silently missing gradient would train nothing."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    if mask is None or not torch.is_grad_enabled():
        return
    for c, t in zip(mask.captured, mask.tensors):
        if t.requires_grad:
            raise NotImplementedError(f"mask_mod reads tensor {c.name!r}, which requires grad: a mask has no gradient "
                                      "(detach it, or call under torch.no_grad())")


def _serving_modifiers(q: Any, score_mod: Any, mask_mod: Any, block_mask: Any, mods: Mods, call: str) -> Mods:
    """`mods` with the call's score_mod and mask_mod traced (attention_varlen, attention_with_kvcache: the sm80 family's
    serving forward generated with them, without a block map): the dense modifier call's checks, and refusals of what
    these calls do not build."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return mods
    if block_mask is not None:
        raise NotImplementedError(f"{call} takes no block_mask (block maps are built for dense calls, "
                                  "flashgen.attention); pass its mask_mod as mask_mod=, evaluated on every key tile")
    if mods.sinks is not None:
        raise ValueError("learnable_sink does not combine with score_mod or mask_mod (the modifier kernels have no "
                         "sinks)")
    if score_mod is not None and (mods.softcap or mods.alibi is not None):
        raise ValueError("a score_mod does not combine with softcap or alibi_slopes: write them into the score_mod")
    if traced(q):
        raise NotImplementedError(f"{call} takes score_mod and mask_mod eagerly only: not under torch.compile, nor "
                                  "with fake or meta tensors (flashgen.attention's dense calls take them there)")
    score = trace_cached(score_mod, "score") if score_mod is not None else None
    mask = trace_cached(mask_mod, "mask") if mask_mod is not None else None
    _refuse_mask_grad(mask)
    if _tables_want_grad(score):
        raise NotImplementedError(f"{call} with a score_mod is forward only: a tensor it reads requires grad (detach "
                                  "it, or call under torch.no_grad())")
    return mods._replace(score_mod=score, mask_mod=mask)


def _block_mask_mod(block_mask: Any, mask_mod: Any) -> Any:
    """The mask_mod a call with torch's BlockMask evaluates on its partial tiles: the BlockMask's own (None where it
    is flex_attention's noop_mask, which keeps every score), or `mask_mod` where the call gives one, which must then
    be the BlockMask's."""
    own = getattr(block_mask, "mask_mod", None)
    noop = getattr(own, "__name__", "") == "noop_mask" and str(getattr(own, "__module__", "")).startswith("torch")
    own = None if noop else own
    if mask_mod is not None and own is not None and mask_mod is not own:
        raise ValueError("mask_mod differs from block_mask.mask_mod: give the BlockMask alone (its mask_mod is used "
                         "on its partial blocks), or a mask_mod alone (flashgen builds the block map from it)")
    return mask_mod if mask_mod is not None else own


def attention(q: Any, k: Any, v: Any, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, stream: Any = None, arch: str | None = None, *, q_descale: Any = None,
              k_descale: Any = None, v_descale: Any = None, out_dtype: str | None = None,
              block_quant_p: bool = False, deterministic: bool = False, window_size: tuple[int, int] = _NO_WINDOW,
              softcap: float = 0.0, alibi_slopes: Any = None, score_mod: Any = None, mask_mod: Any = None,
              block_mask: Any = None, learnable_sink: Any = None) -> Any:
    """FlashAttention forward with flash_attn's conventions.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim) with
    heads % heads_k == 0 (GQA/MQA). Causal masks align to the bottom right (query i sees
    keys j <= i + seqlen_k - seqlen_q). softmax_scale defaults to 1/sqrt(head_dim); any finite
    value works. Returns out like q, and with return_lse also lse (batch, heads, seqlen_q) fp32.
    arch forces a template family ("sm80", "sm90"), as in `load`.

    Torch tensors go through the `flashgen::attention` operator (torch.compile traces it, CUDA
    graphs capture it) and run on the current stream of their device; pycuda GPU arrays run in
    the current context, on `stream`. With autograd, deterministic=True makes the backward give the
    same gradients bit for bit on every run (dQ per Q tile instead of fp32 atomics; slower).

    Score modifiers (torch tensors, as flash_attn): window_size=(left, right) keys i + shift - left ..
    i + shift + right (-1: unbounded; with causal, right is the diagonal), softcap (scores = softcap *
    tanh(scores / softcap), Gemma 2), alibi_slopes fp32 (heads,) or (batch, heads) (scores -= slope *
    |i + shift - j|). They run in kernels generated with exactly those features (a window on Hopper: the sm90
    family; softcap and ALiBi: sm80's, which runs on Hopper too), forward and backward (through the
    `flashgen::attention_mods` operator under autograd or torch.compile); arch stays None with them.
    learnable_sink (heads,) fp32 or q's dtype: attention sinks (gpt-oss's `sinks`, flash_attn's name), a logit per
    query head in the units of softmax_scale * q.k that joins every row's softmax denominator as a key of value 0
    (out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)), lse_i = log(sum_j exp(s_ij) + exp(sink_h)); a
    row without keys: out 0, lse sink_h); with autograd its gradient comes beside dq, dk, dv.

    FP8 (Hopper): q, k, v in torch.float8_e4m3fn with fp32 descale factors q_descale, k_descale,
    v_descale of shape (1,) or (batch, heads_k) (None: 1; `flashgen.fp8.quantize` makes them);
    out in bf16, or out_dtype="fp16"; block_quant_p quantizes P with a scale per key tile.
    Forward only; through the `flashgen::attention_fp8` operator when traced (torch.compile).

    Programmable attention (torch.nn.attention.flex_attention's signatures): score_mod(score, b, h, q_idx,
    kv_idx) returns the score to use (score = q.k * softmax_scale, before the softmax; h the query head),
    mask_mod(b, h, q_idx, kv_idx) returns true where a key is kept. Each is traced once into a CUDA expression
    (flashgen.modifiers; tensors it indexes are read by the kernel) and compiled into an sm80-family kernel of
    its own. q_idx and kv_idx count from 0 in q and in k (no bottom-right alignment, unlike causal). They combine
    with causal, window_size and (mask_mod) softcap and ALiBi, whose masks apply after them. A row that keeps no
    key gives O = 0 and LSE = +inf. Torch tensors; differentiable in q, k, v and the float tensors a
    score_mod reads (a learnable bias; flashgen.modifier_grads). Under torch.compile (fullgraph=True where the
    modifiers are defined outside the compiled function) and with fake or meta tensors the call goes through the
    `flashgen::attention_modified` operator, the modifier traced outside the graph and the tensors it reads passed
    as the operator's inputs (docs/programmable.md); block_mask is for eager calls.
    block_mask: torch's BlockMask (torch.nn.attention.flex_attention.create_block_mask) for seqlen_q x seqlen_k:
    key tiles it leaves empty are skipped, full ones run without the mask_mod, partial ones with its mask_mod.
    Without one, flashgen builds a mask_mod's block map itself (flashgen.blockmap; kept while the tensors it reads
    are unchanged) with the same effect."""
    if (_decode_routes and score_mod is None and mask_mod is None and block_mask is None and alibi_slopes is None and arch is None and stream is None and out_dtype is None and q_descale is None
            and k_descale is None and v_descale is None and not block_quant_p and not softcap
            and (window_size is _NO_WINDOW or window_size == _NO_WINDOW)):  # first: a decode step seen before
        done = _decode_route(q, k, v, causal, softmax_scale, return_lse, learnable_sink)
        if done is not None:
            return done
    if (_mod_routes and (score_mod is not None or mask_mod is not None or block_mask is not None)
            and learnable_sink is None and alibi_slopes is None and arch in (None, "sm80", "sm90") and stream is None
            and out_dtype is None and q_descale is None and k_descale is None and v_descale is None
            and not block_quant_p and not softcap
            and (window_size is _NO_WINDOW or window_size == _NO_WINDOW)):  # first: a modifier call seen before
        done = _mod_route(q, k, v, causal, softmax_scale, return_lse, arch, deterministic, score_mod, mask_mod,
                          block_mask)
        if done is not None:
            return done
    _check_options(causal, softmax_scale)
    dense = (score_mod is None and mask_mod is None and block_mask is None and learnable_sink is None
             and alibi_slopes is None and not softcap and window_size == (-1, -1))  # no serving or modifier kernel
    if _padded(q, k, v, 4, dense, arch):  # other multiples of 8, v of another width: zero-padded to a built head dim
        d_qk, d_v = check_head_dims(q.shape, k.shape, v.shape)
        pad, d = _ops().pad_head_dim, kernel_head_dim(d_qk, d_v, dense)
        scale = default_scale(d_qk) if softmax_scale is None else softmax_scale
        return _cut(attention(pad(q, d), pad(k, d), pad(v, d), causal, scale, return_lse, stream, arch,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
                              block_quant_p=block_quant_p, deterministic=deterministic, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
                              block_mask=block_mask, learnable_sink=learnable_sink), d_v, return_lse)
    sinks = learnable_sink
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        if sinks is not None:
            raise ValueError("learnable_sink does not combine with score_mod, mask_mod or block_mask (the modifier "
                             "kernels have no sinks)")
        fp8_args = (q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None
                    or block_quant_p)
        return _attention_flex(q, k, v, causal, softmax_scale, return_lse, stream, arch, fp8_args, window_size,
                               softcap, alibi_slopes, score_mod, mask_mod, block_mask, deterministic)
    if (arch is None and stream is None and out_dtype is None and q_descale is None and k_descale is None
            and v_descale is None and not block_quant_p and alibi_slopes is None and not softcap
            and window_size == (-1, -1) and is_torch(q)):  # first: a decode step
        done = _decode_step(q, k, v, causal, softmax_scale, return_lse, sinks)
        if done is not None:
            return done
    descale = descale_dict(q_descale, k_descale, v_descale)
    if window_size != (-1, -1) or softcap or alibi_slopes is not None or sinks is not None:
        if has_mods(window_size, softcap, alibi_slopes, causal, sinks):
            return _attention_mods(q, k, v, causal, softmax_scale, return_lse, stream, arch, descale, out_dtype,
                                   block_quant_p, deterministic, window_size, softcap, alibi_slopes, sinks)
    if is_torch(q) and str(q.dtype) == "torch.float8_e4m3fn":
        if stream is not None:
            raise TypeError(STREAM_FOR_TORCH)
        if out_dtype not in (None, "bf16", "fp16"):
            raise ValueError(f"out_dtype={out_dtype!r}: FP8 attention writes bf16 or fp16")
        out, lse = _ops().attention_fp8(q, k, v, causal, softmax_scale, arch, descale, out_dtype, block_quant_p,
                                        return_lse)
        return (out, lse) if return_lse else out
    if descale is not None or out_dtype is not None or block_quant_p:
        raise ValueError("q_descale, k_descale, v_descale, out_dtype and block_quant_p are for FP8 inputs "
                         "(torch.float8_e4m3fn)")
    if is_torch(q):
        if stream is not None:
            raise TypeError(STREAM_FOR_TORCH)
        out, lse = _ops().attention(q, k, v, causal, softmax_scale, arch, return_lse, deterministic)
    else:
        out, lse = _forward_arrays(q, k, v, causal, softmax_scale, arch, stream)
    return (out, lse) if return_lse else out


# A call with at most this many query tokens against at least DECODE_MIN_KEYS keys is a decode step (or a
# speculative-decoding one): the split-KV decode kernels, which pack a KV head's query heads into one tile and
# split the keys over the GPU, beat a dense kernel's 64-row and larger tiles there.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 512
_lengths: dict[tuple, Any] = {}  # (device, batch, seqlen_k) -> int32 (batch,) filled with seqlen_k


def _decode_shaped(q: Any, k: Any, v: Any, sinks: Any = None) -> bool:
    """Whether a plain attention() call is decode-shaped and can take the decode kernels: few queries, many keys,
    16-bit CUDA tensors of one layout, no gradient wanted (of sinks either) and not traced (the decode path has no
    backward)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] > DECODE_MAX_QUERIES or k.shape[1] < DECODE_MIN_KEYS:
        return False
    dtype = q.dtype  # 16-bit floats: float16 and bfloat16
    if not (q.is_cuda and dtype == k.dtype == v.dtype and dtype.itemsize == 2 and dtype.is_floating_point):
        return False
    if k.shape != v.shape or k.shape[0] != q.shape[0] or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if sinks is not None and not (hasattr(sinks, "device") and sinks.device == q.device):
        return False  # the full path says what is wrong
    return not (wants_grad(q, k, v, sinks) or traced(q))


# attention() calls that took the decode kernels, by _plan_key with a full cache: the cache's lengths and the plan.
# A call that repeats one (same shapes, strides, dtypes, devices and options; no gradient wanted; not traced)
# goes straight to the plan (_decode_route, attention's first step): a one-sequence decode step is bound by the
# host's time.
_decode_routes: dict[tuple, tuple[Any, KVPlan]] = {}


def _decode_route(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, return_lse: Any, sinks: Any) -> Any:
    """attention()'s result by the route of an earlier call with its signature (_decode_routes), or None."""
    route = _decode_routes.get(_plan_key(q, k, v, _FULL, None, causal, softmax_scale, _NO_WINDOW, 0.0, 0, return_lse,
                                         sinks))
    if route is None or not _plan_holds(route[1], q, k, v, sinks) or _compiling():
        return None
    check_errors()
    done = run_plan(route[1], q, k, v, route[0], None, return_lse, sinks)
    if done is None:
        return None
    return done if return_lse else done[0]


def _decode_step(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, return_lse: bool,
                 sinks: Any) -> Any:
    """attention()'s result through the decode kernels (attention_with_kvcache over a full cache), or None where the
    call is not decode-shaped."""
    if not _decode_shaped(q, k, v, sinks):
        return None
    lengths, kept = _full_lengths(q, k)
    out = attention_with_kvcache(q, k, v, causal=causal, softmax_scale=softmax_scale, cache_seqlens=lengths,
                                 return_lse=return_lse, learnable_sink=sinks)
    key = _plan_key(q, k, v, _FULL, None, causal, softmax_scale, _NO_WINDOW, 0.0, 0, return_lse, sinks)
    if key is not None and kept:  # a capture's lengths are the graph's: no route keeps them
        plan = _kv_plans.get(_plan_key(q, k, v, lengths, None, causal, softmax_scale, _NO_WINDOW, 0.0, 0, return_lse,
                                       sinks))
        if plan is not None:
            if len(_decode_routes) > 256:
                _decode_routes.clear()
            _decode_routes[key] = (lengths, plan)
    return out


def _full_lengths(q: Any, k: Any) -> tuple[Any, bool]:
    """cache_seqlens of a cache that is full, and whether it is kept: one tensor per shape, so that back-to-back
    calls repeat a plan (not inside a CUDA-graph capture, whose memory is not for later eager calls)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    key = (q.get_device(), k.shape[0], k.shape[1])
    lengths = _lengths.get(key)
    if lengths is None:
        lengths = torch.full((k.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
        if torch.cuda.is_current_stream_capturing():
            return lengths, False
        _lengths[key] = lengths
    return lengths, True


class _ModRoute(NamedTuple):
    """An attention() call with a score_mod, mask_mod or BlockMask, kept by _mod_key: its plan, its modifiers (what
    autograd's backward takes), the traces and BlockMask the plan was made with, and its block map's sources' stamp."""

    plan: ModPlan
    mods: Mods
    score: Any
    mask: Any
    block_mask: Any  # a weak reference to the BlockMask, or None
    stamp: tuple


# By _mod_key. A call that repeats one's signature, with the same traces (modifiers.trace_cached: the same functions
# reading the same tensors), its BlockMask or mask tensors unwritten since (blockmap's stamps) and the tuned store
# unchanged, goes straight to the plan: checks, traces, kernel choice, block map and parameter packing were most of
# a small call's time. Few are kept: a route holds its block map on the GPU (a few MB at 16k tokens), and a loop that
# defines its mask_mod anew on every step leaves one route per step that no call takes again; the oldest go first.
MOD_ROUTES_KEPT = 16
_mod_routes: "collections.OrderedDict[tuple, _ModRoute]" = collections.OrderedDict()


def _mod_key(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, return_lse: Any, arch: Any, deterministic: Any,
             score_mod: Any, mask_mod: Any, block_mask: Any) -> tuple | None:
    """What a modifier call's checks and choices depend on beyond its modifiers' traces and block map: torch tensors'
    layouts and options of the plain types (None for others: the full path)."""
    tensor = _Tensor if _Tensor is not None else _bind_torch()
    if tensor is None or type(q) is not tensor or type(k) is not tensor or type(v) is not tensor:
        return None
    if (causal.__class__ not in _FLAGS or return_lse.__class__ not in _FLAGS or deterministic.__class__ not in _FLAGS
            or (softmax_scale is not None and softmax_scale.__class__ not in _NUMBERS)):
        return None
    return (id(score_mod), id(mask_mod), id(block_mask), q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(),
            k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device, causal, softmax_scale, return_lse, arch,
            deterministic)


def _mod_route(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, return_lse: Any, arch: Any,
               deterministic: Any, score_mod: Any, mask_mod: Any, block_mask: Any) -> Any:
    """attention()'s result by the plan of an earlier call with this signature (_mod_routes), or None."""
    if (_Tensor is None and _bind_torch() is None) or _compiling():  # torch.compile traces the full path
        return None
    route = _mod_routes.get(_mod_key(q, k, v, causal, softmax_scale, return_lse, arch, deterministic, score_mod,
                                     mask_mod, block_mask))
    if route is None:
        return None
    if block_mask is not None:
        if route.block_mask() is not block_mask:
            return None
        mask_mod = _block_mask_mod(block_mask, mask_mod)
    score = trace_cached(score_mod, "score") if score_mod is not None else None
    mask = trace_cached(mask_mod, "mask") if mask_mod is not None else None
    if score is not route.score or mask is not route.mask or _map_stamp(mask, block_mask) != route.stamp:
        return None
    if route.plan.tracks_store and not _store_holds(route.plan, route.plan.device):
        return None
    _refuse_mask_grad(mask)
    grad = wants_grad(q, k, v) or _tables_want_grad(route.mods.score_mod)
    if grad:
        check_grad_scale(softmax_scale, q, k, v)
    return _run_flex(q, k, v, causal, softmax_scale, return_lse, arch, deterministic, route.mods, route.plan, grad)


def _map_stamp(mask: Any, block_mask: Any) -> tuple:
    """What a modifier call's block map is built from, as blockmap compares it (with clear_cache's count)."""
    if block_mask is not None:
        return generation(), block_mask_stamp(block_mask)
    return (generation(), mask_stamp(mask)) if mask is not None else ()


def _weak(x: Any) -> Any:
    return None if x is None else weakref.ref(x)


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, softmax_scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                     return_lse: bool = False, num_splits: int = 1, validate: bool | None = None,
                     deterministic: bool = False, learnable_sink: Any = None, score_mod: Any = None,
                     mask_mod: Any = None, block_mask: Any = None) -> Any:
    """Attention over a packed batch of sequences of different lengths (flash_attn_varlen_func).

    q: (total_q, heads, head_dim); k, v: (total_k, heads_k, head_dim); cu_seqlens_q/_k: int32
    (batch + 1,) offsets, from 0 to total; sequence b is q[cu_q[b]:cu_q[b+1]] against
    k[cu_k[b]:cu_k[b+1]], each with its own bottom-right causal alignment; empty sequences
    are allowed. Returns out like q, and with return_lse also lse (heads, total_q) fp32. learnable_sink: attention
    sinks, (heads,), as in `attention` (differentiable too).
    Differentiable (packed training): with autograd the call goes through the `flashgen::attention_varlen`
    operator, whose backward has the same features (window, softcap, ALiBi); deterministic=True gives
    bit-identical gradients run to run.

    Bad offsets (decreasing, or past the packed lengths) never make the kernels read or write outside the tensors:
    the forward writes NaN to that sequence's rows of out and lse, the backward leaves the sequence out, and the
    next flashgen call (the backward included, or `flashgen.check_errors()`, e.g. after a CUDA-graph replay) raises
    a ValueError naming cu_seqlens_q or cu_seqlens_k and the sequence; nothing waits for the GPU. validate=True also
    reads the offsets back before any launch (one host sync per call, a debugging aid) and raises there; CUDA-graph
    capture skips it.

    score_mod, mask_mod: as in `attention` (FlexAttention's signatures), with b the sequence and q_idx, kv_idx
    positions within it (from 0); forward only (no gradient), no block_mask (the mask_mod runs on every key tile
    the call visits), not with learnable_sink."""
    import torch  # noqa: PLC0415

    _check_options(causal, softmax_scale)
    if _padded(q, k, v, 3):  # any other multiple of 8, or v of another width: zero-padded to a built head dim
        d_qk, d_v = check_head_dims(q.shape, k.shape, v.shape)
        pad, d = _ops().pad_head_dim, kernel_head_dim(d_qk, d_v)
        scale = default_scale(d_qk) if softmax_scale is None else softmax_scale
        return _cut(attention_varlen(pad(q, d), pad(k, d), pad(v, d), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, scale, window_size, softcap, alibi_slopes, return_lse,
                                     num_splits, validate, deterministic, learnable_sink, score_mod, mask_mod,
                                     block_mask), d_v, return_lse)
    check_errors()
    checked_dtype({"q": q, "k": k, "v": v}, "(total, heads, head_dim)")
    total_q, heads, d = q.shape
    total_k, heads_k, _ = k.shape
    check_heads(q, k, v, d, heads, heads_k)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    batch = cu_seqlens_q.shape[0] - 1 if hasattr(cu_seqlens_q, "shape") and cu_seqlens_q.dim() == 1 else -1
    if batch < 0:
        raise ValueError("cu_seqlens_q must be a 1-d int32 tensor of batch + 1 offsets")
    check_int32(cu_seqlens_q, "cu_seqlens_q", (batch + 1,), q.device)
    check_int32(cu_seqlens_k, "cu_seqlens_k", (batch + 1,), q.device)
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError("max_seqlen_q and max_seqlen_k must be >= 0")
    sinks = check_sinks(learnable_sink, heads, q)
    grad = wants_grad(q, k, v, sinks) or traced(q)
    if validate and not torch.cuda.is_current_stream_capturing():
        # one small copy: offsets sound before any launch (the backward's kernels take them as they are)
        check_offsets(cu_seqlens_q, "cu_seqlens_q", total_q, max_seqlen_q)
        check_offsets(cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k)
    mods = clamp_window(check_mods(window_size, softcap, alibi_slopes, causal, batch, heads, q.device), total_q,
                        total_k)._replace(sinks=sinks)
    mods = _serving_modifiers(q, score_mod, mask_mod, block_mask, mods, "attention_varlen")
    if grad and (mods.score_mod is not None or mods.mask_mod is not None):
        raise NotImplementedError("attention_varlen with a score_mod or mask_mod is forward only (the varlen backward "
                                  "has no modifier hook): call it under torch.no_grad() or detach q, k and v; "
                                  "flashgen.attention's dense calls with modifiers have a backward")
    if grad:
        check_grad_scale(softmax_scale, q, k, v)
        out, lse = _ops().attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal, softmax_scale, *mods.window, mods.softcap, mods.alibi,
                                              deterministic, sinks)
    else:
        out, lse = _ops().varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         softmax_scale, mods, return_lse, num_splits)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                           cache_seqlens: Any = None, block_table: Any = None, causal: bool = False,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = _NO_WINDOW,
                           softcap: float = 0.0, alibi_slopes: Any = None, num_splits: int = 0,
                           return_lse: bool = False, validate: bool = False, learnable_sink: Any = None,
                           score_mod: Any = None, mask_mod: Any = None, block_mask: Any = None) -> Any:
    """Attention of new queries against a KV cache (flash_attn_with_kvcache).

    q: (batch, seqlen_q, heads, head_dim). k_cache, v_cache: (batch, seqlen_cache, heads_k, head_dim),
    or paged (num_pages, page_size, heads_k, head_dim) addressed through block_table (batch, max_pages)
    int32. cache_seqlens: int or int32 (batch,) tokens already in each cache (None: all of a contiguous
    cache). k, v (batch, seqlen_new, heads_k, head_dim), if given, are written into the cache in place
    at cache_seqlens before attending. num_splits: key ranges per query block (split-KV); 0 lets
    flashgen choose. Returns out like q, and with return_lse also lse (batch, heads, seqlen_q) fp32.
    learnable_sink: attention sinks, (heads,), as in `attention` (added once per row, after split-KV's merge;
    inference only, like the rest of this call).
    A page id outside the cache or a cache_seqlens past its capacity never makes the kernel read or write
    outside the cache: that sequence's rows of out and lse become NaN, and the call after (or
    `flashgen.check_errors()`, e.g. after a CUDA-graph replay) raises a ValueError naming block_table or
    cache_seqlens and the sequence; nothing waits for the GPU. validate=True is a debugging aid: it also reads
    cache_seqlens and block_table back before the launch (one host sync per call) and raises there; CUDA-graph
    capture skips it. A call that repeats an earlier one's shapes, strides and options with validate=False (a
    decode loop) reuses its checks and choices (a plan): pointers, then launch. An append (k, v) with bad
    values stays inside the cache too (positions and page ids clamped), but a bad page id can then overwrite
    another sequence's page: validate=True refuses it before anything is written.

    score_mod, mask_mod: as in `attention` (FlexAttention's signatures), with b the sequence, q_idx the query's
    position in its cache (cache_seqlens + seqlen_new - seqlen_q + i for query row i, as causal aligns the queries;
    at least 0) and kv_idx the key's; no block_mask (the mask_mod runs on every key tile the call visits), not with
    learnable_sink; the decode tuned store is not used with them."""
    key = None  # first: a decode step that repeats an earlier call's signature runs its plan
    if (k is None and v is None and not validate and alibi_slopes is None and score_mod is None and mask_mod is None
            and block_mask is None):
        key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, window_size, softcap,
                        num_splits, return_lse, learnable_sink)
        plan = _kv_plans.get(key) if key is not None else None
        if plan is not None and _plan_holds(plan, q, k_cache, v_cache, learnable_sink):
            check_errors()
            done = run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, return_lse, learnable_sink)
            if done is not None:
                return done if return_lse else done[0]
    import torch  # noqa: PLC0415

    _check_options(causal, softmax_scale)
    if _padded(q, k_cache, v_cache, 4):
        return _kvcache_padded(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
                               window_size, softcap, alibi_slopes, num_splits, return_lse, validate, learnable_sink,
                               score_mod, mask_mod, block_mask)
    check_errors()
    sinks = learnable_sink
    dtype = checked_dtype({"q": q, "k_cache": k_cache, "v_cache": v_cache}, "(batch, rows, heads, head_dim)")
    batch, seqlen_q, heads, d = q.shape
    heads_k = k_cache.shape[2]
    check_heads(q, k_cache, v_cache, d, heads, heads_k)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}; got {tuple(v_cache.shape)}")
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 tensor (batch={batch}, max_pages)")
        check_int32(block_table, "block_table", tuple(block_table.shape), q.device)
        page_size = k_cache.shape[1]
        if page_size % 16:
            raise ValueError(f"page_size (k_cache.shape[1]) must be a multiple of 16; got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch {batch} (or pass block_table for a paged cache)")
        page_size, capacity = 0, k_cache.shape[1]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is None:
        if paged:
            raise ValueError("a paged cache needs cache_seqlens (the tokens each sequence holds)")
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    else:
        check_int32(cache_seqlens, "cache_seqlens", (batch,), q.device)
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append, or neither")
    if k is not None:
        if tuple(k.shape) != tuple(v.shape) or k.dim() != 4 or k.shape[0] != batch or tuple(k.shape[2:]) != (heads_k, d):
            raise ValueError(f"k and v to append must both be (batch={batch}, seqlen_new, heads_k={heads_k}, "
                             f"head_dim={d}); got {tuple(k.shape)} and {tuple(v.shape)}")
        if dtype_name(k, "k") != dtype or dtype_name(v, "v") != dtype or k.device != q.device or v.device != q.device:
            raise TypeError("k and v to append must have q's dtype and device")
        seqlen_new = k.shape[1]
    mods = clamp_window(check_mods(window_size, softcap, alibi_slopes, causal, batch, heads, q.device), seqlen_q,
                        capacity)._replace(sinks=check_sinks(sinks, heads, q))
    mods = _serving_modifiers(q, score_mod, mask_mod, block_mask, mods, "attention_with_kvcache")
    traced_mods = modifier_digests(mods)
    longest = capacity  # the most keys a sequence has: bounds the split-KV choice
    if validate and not torch.cuda.is_current_stream_capturing():  # one small copy: no access outside the cache
        longest = check_cache(cache_seqlens, seqlen_new, capacity, block_table, k_cache.shape[0])
    refuse_grad(q, k_cache, v_cache, NO_BACKWARD)
    if sinks is not None:
        refuse_grad(q, k_cache, sinks, NO_BACKWARD)
    if k is not None:
        refuse_grad(q, k, v, NO_BACKWARD)
    if seqlen_new:
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, page_size)
    seqused = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens
    out = q.new_empty(q.shape)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if batch * seqlen_q * heads == 0:
        return (out, lse) if return_lse else out
    arch, sm_count = arch_and_slots(q.get_device())
    stamp = resolve.gpu_stamp(q.get_device())[1] if key is not None and num_splits == 0 else None  # a plan's store
    group = heads // heads_k
    pack = group > 1 and alibi_slopes is None
    rows = seqlen_q * (group if pack else 1)
    features = dict(varlen=True, paged=paged, pack_gqa=pack, **call_features(mods, causal))
    tuned = None
    if num_splits == 0 and seqlen_q == 1 and not any(call_features(mods, causal).values()) and not traced_mods:
        tuned = tuned_decode(q.get_device(), d, dtype, heads, heads_k, batch, capacity, page_size)
    if tuned is not None:  # the tile and split count measured fastest for the nearest decode problem
        cfg, splits = tuned
    else:
        cfg = serve_config(d, dtype, causal, rows, arch, **features, **traced_mods)
        n_blocks = -(-longest // cfg.block_n)
        tiles = serve_grids(cfg, batch, heads, heads_k, seqlen_q, batch * seqlen_q, 1)[0]  # row blocks, one split
        splits = want_split(num_splits, tiles, n_blocks, cfg, sm_count, arch)
        if splits > 1:
            cfg = serve_config(d, dtype, causal, rows, arch, split=True, **features, **traced_mods)
    launched = kvcache_launch(cfg, splits, q, k_cache, v_cache, out, lse, seqused, block_table, mods, softmax_scale)
    if key is not None and launched is not None:  # refuse_grad has passed: no gradient is wanted
        if len(_kv_plans) > 256:
            _kv_plans.clear()
        _kv_plans[key] = KVPlan(launched, None if lse is None else tuple(lse.shape), num_splits == 0, stamp,
                                q.is_contiguous())
    return (out, lse) if return_lse else out


# attention_with_kvcache's plans by _plan_key: a call that repeats one's signature goes straight to run_plan.
_kv_plans: dict[tuple, KVPlan] = {}


def _kvcache_padded(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any,
                    causal: bool, softmax_scale: float | None, window_size: Any, softcap: float, alibi_slopes: Any,
                    num_splits: int, return_lse: bool, validate: bool, learnable_sink: Any, score_mod: Any,
                    mask_mod: Any, block_mask: Any) -> Any:
    """attention_with_kvcache at a head dim without a kernel (flashgen.head_dims): the call on zero-padded copies
    of q and the caches (a copy of the whole cache per call), then k, v appended into the caller's caches too."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    d_qk, d_v = check_head_dims(q.shape, k_cache.shape, v_cache.shape, "k_cache, v_cache")
    if k is not None and v is not None and (getattr(k, "shape", (0,))[-1:] != (d_qk,)
                                            or getattr(v, "shape", (0,))[-1:] != (d_v,)):
        raise ValueError(f"k and v to append must have k_cache's and v_cache's head dims ({d_qk}, {d_v}); got "
                         f"{tuple(getattr(k, 'shape', ()))} and {tuple(getattr(v, 'shape', ()))}")
    pad, d = _ops().pad_head_dim, kernel_head_dim(d_qk, d_v)
    scale = default_scale(d_qk) if softmax_scale is None else softmax_scale
    seqlens = cache_seqlens
    if k is not None and isinstance(cache_seqlens, int):  # one tensor for both appends
        seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    result = attention_with_kvcache(pad(q, d), pad(k_cache, d), pad(v_cache, d), None if k is None else pad(k, d),
                                    None if v is None else pad(v, d), seqlens, block_table, causal, scale,
                                    window_size, softcap, alibi_slopes, num_splits, return_lse, validate,
                                    learnable_sink, score_mod, mask_mod, block_mask)
    if k is not None:  # the padded call checked k, v and the cache; the caller's cache gets them too
        if seqlens is None:
            seqlens = torch.full((q.shape[0],), k_cache.shape[1], dtype=torch.int32, device=q.device)
        append_kv(k_cache, v_cache, k, v, seqlens, block_table, k_cache.shape[1] if block_table is not None else 0)
    return _cut(result, d_v, return_lse)


_FLAGS = frozenset((bool, int))  # the option types a plan's key takes as they are (others: the full path)
_NUMBERS = frozenset((float, int))
_Tensor: Any = None  # torch.Tensor, once a plan exists: a plan's tensors are of that type exactly
_grad_enabled: Any = None  # torch.is_grad_enabled and torch.compiler.is_compiling, the same way
_compiling: Any = None


def _plan_key(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, causal: Any,
              softmax_scale: Any, window_size: Any, softcap: Any, num_splits: Any, return_lse: Any,
              sinks: Any = None) -> tuple | None:
    """What an attention_with_kvcache call's checks and choices depend on, where a plan can repeat them: torch
    tensors (cache_seqlens a tensor, or _FULL), options of the plain types (bool or int flags, float or int numbers, a
    tuple of two ints for the window, sinks a tensor's layout); None for the others, which take the full path. The
    caller leaves out calls with validation, an append, ALiBi or modifiers; whether a gradient is wanted is asked
    apart (_plan_holds), and so is the tuned store's stamp. Built on every decode step: attribute reads and one
    tuple."""
    tensor = _Tensor
    if tensor is None:
        tensor = _bind_torch()
    if type(q) is not tensor or type(k_cache) is not tensor or type(v_cache) is not tensor:
        return None
    if (causal.__class__ not in _FLAGS or return_lse.__class__ not in _FLAGS or num_splits.__class__ is not int
            or softcap.__class__ not in _NUMBERS or (softmax_scale is not None
                                                     and softmax_scale.__class__ not in _NUMBERS)):
        return None
    if window_size is not _NO_WINDOW and (window_size.__class__ is not tuple or len(window_size) != 2
                                          or window_size[0].__class__ is not int
                                          or window_size[1].__class__ is not int):
        return None
    if cache_seqlens is _FULL:
        lengths = _FULL
    elif type(cache_seqlens) is tensor:
        lengths = (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device)
    else:
        return None
    if block_table is None:
        table = None
    elif type(block_table) is tensor:
        table = (block_table.shape, block_table.stride(), block_table.dtype, block_table.device)
    else:
        return None
    if sinks is None:
        sink = None
    elif type(sinks) is tensor:
        sink = (sinks.shape, sinks.stride(), sinks.dtype, sinks.device)
    else:
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, lengths, table, sink, causal, softmax_scale,
            window_size, softcap, num_splits, return_lse)


def _bind_torch() -> Any:
    """torch.Tensor (and torch.is_grad_enabled) for the plan path, where torch is imported; None where not."""
    global _Tensor, _grad_enabled, _compiling
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    _Tensor, _grad_enabled, _compiling = torch.Tensor, torch.is_grad_enabled, torch.compiler.is_compiling
    return _Tensor


def _plan_holds(plan: KVPlan, q: Any, k: Any, v: Any, sinks: Any = None) -> bool:
    """Whether a plan found by its key serves this call: no gradient wanted, of the sinks either (the full path
    refuses it, or attention() takes its differentiable kernels), and, where it was chosen with the tuned store, the
    store unchanged (looked at once a STORE_CHECK_S: resolve.gpu_stamp)."""
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                            or (sinks is not None and sinks.requires_grad)):
        return False
    return not plan.tracks_store or _store_holds(plan, plan.launch.device)


def _store_holds(plan: Any, device: int) -> bool:
    """Whether the tuned store a plan's choice read is unchanged (looked at once a STORE_CHECK_S: resolve.gpu_stamp);
    where not, the full path chooses again and replaces the plan."""
    now = time.monotonic()
    if now >= plan.look_after:
        if resolve.gpu_stamp(device)[1] != plan.stamp:
            return False
        plan.look_after = now + STORE_CHECK_S
    return True


_FULL = object()  # _plan_key's cache_seqlens for attention()'s decode route: every cache full (_full_lengths)


__all__ = ["Kernel", "STORE_CHECK_S", "attention", "attention_varlen", "attention_with_kvcache", "check_errors",
           "choose_config", "current_arch", "load", "reload"]
