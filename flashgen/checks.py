"""Every check a call's arguments get before any GPU work, one module for every path (dense, varlen, KV cache,
backward, the operators' fake implementations), so bad input raises a clear ValueError or TypeError instead of a
fault, with the same message whichever way in the call took. Torch is imported inside the checks that need it:
GPU arrays and `import flashgen` work without it."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from .config import DENSE_HEAD_DIMS, FAMILIES, HEAD_DIMS, SPLIT_HEAD_DIMS
from .head_dims import built, head_dim_error
from .tensors import TORCH_DTYPES, Problem, View, aligned, view


class Mods(NamedTuple):
    """Score modifiers of one call: window (-1: unbounded), softcap (0: off), ALiBi slopes (None: off), and a traced
    score_mod and mask_mod (flashgen.modifiers.Modifier with its live tensors; None: off), and a block map
    (flashgen.blockmap.BlockMap at any tile size; None: none given), attention sinks (None: off; the caller's
    (heads,) tensor, fp32 or q's dtype)."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Any = None
    score_mod: Any = None
    mask_mod: Any = None
    block_map: Any = None
    sinks: Any = None


# -- dense q, k, v (torch tensors or GPU arrays, as Views) --------------------------------

def check_kv_shapes(k_shape: tuple, v_shape: tuple, split: bool = False) -> None:
    """k and v of one shape, or (`split`: a kernel with a split width takes them) head dims of SPLIT_HEAD_DIMS."""
    if k_shape == v_shape or (split and k_shape[:-1] == v_shape[:-1]
                              and (k_shape[-1], v_shape[-1]) in SPLIT_HEAD_DIMS):
        return
    pairs = ", ".join(f"{a} and {c}" for a, c in SPLIT_HEAD_DIMS)
    raise ValueError(f"k and v must have the same shape{f' (or head dims {pairs})' if split else ''}; got {k_shape} "
                     f"and {v_shape}")


def check_qkv(q: View, k: View, v: View) -> Problem:
    """Validate flash_attn's layout: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, heads_k, head_dim)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim); got shape {t.shape}")
    if len({q.kind, k.kind, v.kind}) != 1:
        raise TypeError("q, k and v must all be torch tensors or all GPU arrays of the same kind")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k and v must be on one device; got cuda:{q.device}, cuda:{k.device}, cuda:{v.device}")
    b, sq, h, d = q.shape
    check_kv_shapes(tuple(k.shape), tuple(v.shape), split=True)
    dv = v.shape[3]
    bk, sk, hk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch differs: q has {b}, k and v have {bk}")
    if dk != d:
        raise ValueError(f"head_dim differs: q has {d}, k and v have {dk}")
    if d not in DENSE_HEAD_DIMS:
        raise ValueError(not_built(d, dense=True))
    if hk == 0 or h % hk:
        raise ValueError(f"heads of q ({h}) must be a multiple of heads of k and v ({hk}) (MQA/GQA)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.strides[3] != 1 and t.shape[3] != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.strides[3]}); call .contiguous()")
    return Problem(b, sq, sk, h, hk, d, q.dtype, None if dv == d else dv)


def not_built(d: int, dense: bool = False) -> str:
    """What a kernel call says of a head dim it has no kernel for (`dense`: the dense forward and backward; the
    public torch calls pad those: flashgen.head_dims)."""
    why = head_dim_error(d)
    if why is not None:
        return why
    return (f"head_dim={d} has no kernel of its own (built: {', '.join(map(str, built(dense)))}); flashgen.attention, "
            "attention_varlen and attention_with_kvcache run it padded for torch tensors, GPU arrays and loaded "
            "kernels take the built head dims")


def check_head_dims(q_shape: tuple, k_shape: tuple, v_shape: tuple, what: str = "") -> tuple[int, int]:
    """(d_qk, d_v) of a public call's q, k, v shapes (any rank, head dim last, the rest alike in k and v): q and k
    share d_qk, v may differ; each a multiple of 8 up to 256. `what`: the names of k and v in messages."""
    kn, vn = (what or "k, v").split(", ")
    if not (len(q_shape) and len(k_shape) and len(v_shape)):
        raise ValueError(f"q, {kn} and {vn} need a head dim (last dim); got shapes {tuple(q_shape)}, "
                         f"{tuple(k_shape)}, {tuple(v_shape)}")
    d_qk, d_v = q_shape[-1], v_shape[-1]
    if k_shape[-1] != d_qk:
        raise ValueError(f"q and {kn} must share head_dim; got {d_qk} and {k_shape[-1]} ({vn} may differ)")
    if tuple(k_shape[:-1]) != tuple(v_shape[:-1]):
        raise ValueError(f"{kn} and {vn} must have the same shape but for the head dim; got {tuple(k_shape)} and "
                         f"{tuple(v_shape)}")
    why = head_dim_error(d_qk, d_v)
    if why is not None:
        raise ValueError(why)
    return d_qk, d_v


def check_family(arch: str | None) -> None:
    """`arch` must be None or a template family."""
    if arch is not None and arch not in FAMILIES:
        raise ValueError(f"arch={arch!r} is not a template family; choose one of {', '.join(FAMILIES)}")


def check_shapes(q: Any, k: Any, v: Any, dtypes: tuple | None = None, split: bool = False) -> None:
    """What the operators can check from torch shapes and dtypes alone (fake tensors; the eager body checks the rest).
    dtypes: the torch dtypes allowed (default fp16 and bf16). split: v may have the other width of a split-width
    kernel (SPLIT_HEAD_DIMS)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    dtypes = dtypes or (torch.float16, torch.bfloat16)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    check_kv_shapes(tuple(k.shape), tuple(v.shape), split)
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[3] not in DENSE_HEAD_DIMS:
        raise ValueError(not_built(q.shape[3], dense=True))
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k and v ({k.shape[2]}) (MQA/GQA)")


def usable(t: Any, name: str) -> Any:
    """`t` itself, or a contiguous copy where the kernels cannot read it (last dim strided, unaligned)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    tv = view(t, name)
    if (tv.strides[3] != 1 and tv.shape[3] != 1) or not aligned(tv):
        return t.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned
    return t


# -- gradients --------------------------------------------------------------------------

def wants_grad(q: Any, k: Any, v: Any, *more: Any) -> bool:
    """Whether autograd wants a gradient of q, k, v or of the optional tensors `more` (None: not given)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or any(t is not None and t.requires_grad for t in more))


def traced(q: Any) -> bool:
    """Whether the call goes through the operator for its fake implementation: torch.compile, fake or meta tensors."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    return torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta


def refuse_grad(q: Any, k: Any, v: Any, why: str = "") -> None:
    """Raise where an input requires grad and no backward can give its gradient: never a detached output."""
    import torch  # noqa: PLC0415  (q is a torch tensor, so torch is imported)

    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(
            f"flashgen cannot give this input's gradient ({why or 'no backward for this call'}), and the output "
            "would carry none. Run under torch.no_grad()/torch.inference_mode(), detach the inputs, or use "
            "torch.nn.functional.scaled_dot_product_attention for training")


def check_grad_scale(softmax_scale: float | None, q: Any, k: Any, v: Any) -> None:
    """The backward needs softmax_scale > 0: refused where a gradient is wanted."""
    if softmax_scale is not None and not softmax_scale > 0:
        refuse_grad(q, k, v, f"the backward needs softmax_scale > 0, not {softmax_scale!r}")


# -- serving calls (torch tensors): varlen batches, KV caches, score modifiers -------------------

def dtype_name(t: Any, name: str) -> str:
    dt = TORCH_DTYPES.get(str(t.dtype))
    if dt is None:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.float16, torch.bfloat16")
    return dt


def misaligned(t: Any) -> bool:
    """Whether a torch tensor's data starts off a 16-byte boundary. Fake and meta tensors, and tensors seen while
    torch.compile traces (their data pointer is symbolic), have none to check: the compiled call's operator checks
    the real one."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    if torch.compiler.is_compiling() or type(t) is not torch.Tensor or t.is_meta:
        return False
    return t.data_ptr() % 16 != 0


def check_same(tensors: dict[str, Any], dtype: str, device: Any) -> None:
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    for name, t in tensors.items():
        if not (t.is_cuda or t.is_meta):  # meta: shapes only, through the fake operators
            raise ValueError(f"{name} is on {t.device}; flashgen runs on CUDA tensors (move it with .cuda())")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; q is on {device}")
        if dtype_name(t, name) != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; q has {dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
        if misaligned(t) or any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(f"{name} needs a 16-byte aligned base and strides that are multiples of 8 elements")


def checked_dtype(tensors: dict[str, Any], layout: str) -> str:
    """The dtype of tensors that must be torch tensors of `layout`'s rank, on q's device, of one dtype."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != layout.count(",") + 1:
            raise ValueError(f"{name} must be a {layout.count(',') + 1}-d torch tensor {layout}; got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    first = next(iter(tensors.values()))
    dtype = dtype_name(first, next(iter(tensors)))
    check_same(tensors, dtype, first.device)
    return dtype


def check_int32(t: Any, name: str, shape: tuple[int, ...], device: Any) -> None:
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be a torch.int32 tensor, not {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; q is on {device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_heads(q: Any, k: Any, v: Any, d: int, heads: int, heads_k: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(not_built(d))
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k and v must share head_dim; got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"heads={heads} must be a multiple of heads_k={heads_k} (GQA/MQA)")


def check_offsets(cu: Any, name: str, total: int, max_len: int) -> None:
    vals = cu.tolist()
    if vals[0] != 0 or vals[-1] != total:
        raise ValueError(f"{name} must run from 0 to {total} (the packed length); got {vals[0]} .. {vals[-1]}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing")
    if lens and max(lens) > max_len:
        raise ValueError(f"a sequence of {max(lens)} tokens is longer than max_seqlen ({max_len}) for {name}")


def check_mods(window_size: Any, softcap: float, alibi_slopes: Any, causal: bool, batch: int, heads: int,
               device: Any) -> Mods:
    """The call's score modifiers, checked (causal: the window's right edge is the diagonal)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, -1 for unbounded; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries are >= 0, or -1 for unbounded; got {(left, right)}")
    if causal:
        right = 0  # flash_attn: causal is the window's right edge at the diagonal
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: off); got {softcap}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a torch.float32 tensor of shape (heads,) or (batch, heads)")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}); got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != device or alibi_slopes.stride(-1) != 1:
            raise ValueError("alibi_slopes must be on q's device and contiguous in its last dim")
    return Mods((left, right), softcap, alibi_slopes)


def check_sinks(sinks: Any, heads: int, q: Any) -> Any:
    """Attention sinks (the public calls' `learnable_sink`, flash_attn's name; gpt-oss's `sinks`): a (heads,) tensor
    of logits, fp32 or q's dtype, on q's device; returned as given (its gradient is the caller's dtype)."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch tensor of shape ({heads},), not {type(sinks).__name__}")
    if sinks.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"learnable_sink must be torch.float32 or q's dtype {q.dtype}; got {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape ({heads},) (one logit per query head); got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"learnable_sink must be on q's device {q.device}; got {sinks.device}")
    return sinks


def clamp_window(mods: Mods, seqlen_q: int, seqlen_k: int) -> Mods:
    """`mods` with window edges past seqlen_q + seqlen_k (bounds of every sequence's lengths) lowered to that sum:
    the same keys are seen (a row's diagonal key i + seqlen_k - seqlen_q lies in (-seqlen_q, seqlen_k)), and the
    kernels' edge sums (i + shift + right) stay far from int32's end."""
    bound = max(0, seqlen_q) + max(0, seqlen_k)
    window = (min(mods.window[0], bound), min(mods.window[1], bound))
    return mods if window == mods.window else mods._replace(window=window)


def check_cache(cache_seqlens: Any, seqlen_new: int, capacity: int, block_table: Any, num_pages: int) -> int:
    """Raise if a sequence would read or write outside its cache; returns the longest sequence after the append."""
    import torch  # noqa: PLC0415  (torch tensors: torch is imported)

    parts = [cache_seqlens.min().view(1), cache_seqlens.max().view(1)]
    if block_table is not None and block_table.numel():  # only the pages the sequences use are read
        page_size = capacity // block_table.shape[1]
        used = (cache_seqlens.long() + seqlen_new + page_size - 1) // page_size
        live = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < used[:, None]
        used_pages = block_table.masked_fill(~live, 0)
        parts += [used_pages.min().view(1).to(torch.int32), used_pages.max().view(1).to(torch.int32)]
    vals = torch.cat(parts).tolist()
    if vals[0] < 0:
        raise ValueError(f"cache_seqlens has a negative entry ({vals[0]})")
    if vals[1] + seqlen_new > capacity:
        raise ValueError(f"the cache holds {capacity} tokens per sequence; cache_seqlens up to {vals[1]} plus "
                         f"{seqlen_new} appended do not fit")
    if len(vals) > 2 and vals[1] + seqlen_new > 0 and (vals[2] < 0 or vals[3] >= num_pages):
        raise ValueError(f"block_table entries must lie in [0, {num_pages}); got {vals[2]} .. {vals[3]}")
    return vals[1] + seqlen_new


def check_dense(q: Any, k: Any, v: Any, window_size: Any, softcap: float, alibi_slopes: Any,
                causal: bool, sinks: Any = None) -> Mods:
    """`flashgen.attention`'s checks for a call with score modifiers; returns them."""
    checked_dtype({"q": q, "k": k, "v": v}, "(batch, seqlen, heads, head_dim)")
    batch, _, heads, d = q.shape
    check_heads(q, k, v, d, heads, k.shape[2])
    if tuple(v.shape) != tuple(k.shape) or k.shape[0] != batch:
        raise ValueError(f"k and v must have one shape (batch={batch}, seqlen_k, heads_k, head_dim={d}); got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    mods = check_mods(window_size, softcap, alibi_slopes, causal, batch, heads, q.device)
    return clamp_window(mods._replace(sinks=check_sinks(sinks, heads, q)), q.shape[1], k.shape[1])
