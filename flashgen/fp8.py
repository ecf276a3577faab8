"""FP8 (e4m3) inputs: the caller-side quantizer, the descale factors a kernel takes, and the plain-FP8
emulation the kernels' accuracy is judged against.

`quantize(q, k, v)` turns bf16/fp16/fp32 q, k, v into `torch.float8_e4m3fn` with fp32 descale
factors (one per tensor, or one per (batch, KV head)), optionally after FlashAttention-3's
incoherent processing: q and k of every head multiplied by one random orthogonal matrix (a
Hadamard matrix with random signs), which leaves Q K^T unchanged and spreads outlier channels
over all of them, so one scale fits every channel better. Then

    q8, k8, v8, descale = flashgen.fp8.quantize(q, k, v, per_head=True, hadamard=True)
    out = flashgen.attention(q8, k8, v8, causal=True, **descale)   # out in bf16
"""
from __future__ import annotations

import functools
import math
from typing import Any

from . import abi

E4M3_MAX = 448.0
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
_DESCALE = abi.SM90_FP8_FWD.tail("q_descale.ptr")  # q's, k's and v's Fp8Descale and vt, after FwdParams


def hadamard(d: int, seed: int = 0, device: Any = "cpu") -> Any:
    """A random orthogonal d x d matrix: Sylvester's Hadamard matrix with random column signs, / sqrt(d)."""
    import torch  # noqa: PLC0415

    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim={d}: the Hadamard rotation needs a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen, dtype=torch.float64) * 2 - 1
    return (h * signs / math.sqrt(d)).to(device=device, dtype=torch.float32)


def _amax(t: Any, per_head: bool, heads_k: int) -> Any:
    """Max |t| per tensor (shape (1,)) or per (batch, KV head) (shape (batch, heads_k)); q's query heads
    are grouped by the KV head they attend with."""
    b, s, h, d = t.shape
    a = t.abs().float()
    if not per_head:
        return a.amax().reshape(1)
    return a.reshape(b, s, heads_k, h // heads_k, d).amax(dim=(1, 3, 4))


def quantize(q: Any, k: Any, v: Any, per_head: bool = False, hadamard_rotation: bool = False,
             seed: int = 0) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(q8, k8, v8, descale): e4m3 copies of q, k, v (flash_attn layout) and the fp32 factors that undo
    their scaling, as keyword arguments of `flashgen.attention` ({"q_descale": ..., ...}).

    per_head: one factor per (batch, KV head) instead of per tensor. hadamard_rotation: rotate q and
    k first (incoherent processing; Q K^T is unchanged, so the attention is the same)."""
    import torch  # noqa: PLC0415

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d torch tensor (batch, seqlen, heads, head_dim)")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} has dtype {t.dtype}; quantize takes float16, bfloat16 or float32")
    hk = k.shape[2]
    if hadamard_rotation:
        rot = hadamard(q.shape[3], seed, q.device)
        q, k = (t.float() @ rot for t in (q, k))
    out, descale = [], {}
    for name, t in zip(DESCALE_NAMES, (q, k, v)):
        amax = _amax(t, per_head, hk).clamp_min(1e-12)
        scale = E4M3_MAX / amax  # t * scale fills e4m3's range
        shape = (1, 1, 1, 1) if not per_head else (t.shape[0], 1, hk, 1)
        tf = t.float().reshape(t.shape[0], t.shape[1], hk, -1) if per_head else t.float()
        t8 = (tf * scale.reshape(shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(t.shape)
        out.append(t8)
        descale[name] = (1.0 / scale).float().contiguous()
    return out[0], out[1], out[2], descale


def dequantize(t8: Any, descale: Any, heads_k: int) -> Any:
    """float64 values of an e4m3 tensor quantized by `quantize` (descale (1,) or (batch, heads_k))."""
    b, s, h, d = t8.shape
    x = t8.double()
    if descale.numel() == 1:
        return x * descale.double().reshape(())
    return (x.reshape(b, s, heads_k, h // heads_k, d) * descale.double().reshape(b, 1, heads_k, 1, 1)).reshape(b, s, h, d)


def emulate(q8: Any, k8: Any, v8: Any, descale: dict[str, Any], causal: bool, softmax_scale: float | None = None) -> Any:
    """Plain FP8 attention in PyTorch, the bar the kernels are judged by: S and the softmax in fp32 from
    the dequantized inputs, P quantized to e4m3 with one per-tensor scale, P V in fp32 (V dequantized)."""
    hk = k8.shape[2]
    return emulate_dequantized(*(dequantize(t, descale[n], hk) for t, n in zip((q8, k8, v8), DESCALE_NAMES)),
                               causal, softmax_scale)


def emulate_dequantized(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None = None) -> Any:
    """`emulate` on inputs already dequantized (flashgen.fp8.dequantize): what verify's reference shares."""
    import torch  # noqa: PLC0415

    q, k, v = q.float(), k.float(), v.float()
    hk = k.shape[2]
    b, sq, h, d = q.shape
    sk, group = k.shape[1], h // hk
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if not p.numel():
        return torch.einsum("bhqk,bkhd->bqhd", p, v)
    p_scale = E4M3_MAX / p.amax().clamp_min(1e-30)
    p8 = (p * p_scale).to(torch.float8_e4m3fn).float() / p_scale
    return torch.einsum("bhqk,bkhd->bqhd", p8, v)


# -- descale factors as a kernel takes them ------------------------------------------------

@functools.lru_cache(maxsize=16)
def _ones(device: int) -> Any:
    import torch  # noqa: PLC0415

    return torch.ones(1, dtype=torch.float32, device=f"cuda:{device}")


def descale_bytes(batch: int, heads_k: int, device: int, q_descale: Any = None, k_descale: Any = None,
                  v_descale: Any = None, vt: int = 0) -> bytes:
    """The bytes of Sm90Fp8FwdParams after FwdParams: the three `struct Fp8Descale` after checking each factor (a
    float32 CUDA tensor on q's device of shape (1,) (per tensor) or (batch, heads_k) (per KV head); None means 1),
    then `vt`, the address of a v_t kernel's transposed V (0 for the others)."""
    import torch  # noqa: PLC0415

    given = dict(zip(DESCALE_NAMES, (q_descale, k_descale, v_descale)))
    for name, t in given.items():  # every factor given is checked before any default is made
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32 CUDA tensor, not {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, not {t.dtype}")
        if tuple(t.shape) not in ((1,), (), (batch, heads_k)):
            raise ValueError(f"{name} must have shape (1,) or (batch, heads_k) = ({batch}, {heads_k}); "
                             f"got {tuple(t.shape)}")
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; it must be on q's device, cuda:{device}")
        if t.get_device() != device:
            raise ValueError(f"{name} is on cuda:{t.get_device()}, q on cuda:{device}")
    fields: list[int] = []
    for t in given.values():
        if t is None:
            t = _ones(device)
        per_head = tuple(t.shape) == (batch, heads_k) and batch * heads_k > 1
        fields += (t.data_ptr(), t.stride(0), t.stride(1)) if per_head else (t.data_ptr(), 0, 0)
    return _DESCALE.pack(*fields, vt)


__all__ = ["E4M3_MAX", "dequantize", "descale_bytes", "emulate", "emulate_dequantized", "hadamard", "quantize"]
