"""Gradients of the float tensors a score_mod reads (a learnable bias table), computed by torch on the host side of
the backward, a block of query rows at a time: the modified scores recomputed as the kernels compute them (the same
traced graph, block map, masks and LSE), dS' = P (dP - D) with respect to them, and torch's autograd of the graph
from dS' back to the tables (a table entry read by many scores sums their contributions). The cost is one more pass
over the scores in torch, so it runs only for tables that require grad."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from .blockmap import FULL, PARTIAL, BlockMap
from .checks import Mods

CHUNK_ELEMENTS = 1 << 24  # scores per pass (fp32: S, s', P, dP and the graph's intermediates of that many)


def _keep(mods: Mods, block_map: BlockMap | None, causal: bool, b: Any, h: Any, qi: Any, ki: Any, shape: tuple,
          sq: int, sk: int) -> Any:
    """The scores the forward kept, (batch, heads, rows, seqlen_k) bool: the block map's FULL tiles and its PARTIAL
    ones where the mask_mod keeps the score (without a map: the mask_mod), then causal and the window, bottom-right
    aligned as the kernels align them."""
    mask = mods.mask_mod.evaluate(b, h, qi, ki) if mods.mask_mod is not None else torch.ones((), dtype=torch.bool,
                                                                                              device=qi.device)
    if block_map is not None:
        bm, bn = block_map.block
        states = block_map.states[:, :, qi[0, 0, :, 0] // bm][:, :, :, ki[0, 0, 0] // bn]
        mask = (states == FULL) | ((states == PARTIAL) & mask)
    left, right = mods.window
    right = 0 if causal else right
    if right >= 0:
        mask = mask & (ki <= qi + (sk - sq) + right)
    if left >= 0:
        mask = mask & (ki >= qi + (sk - sq) - left)
    return mask.expand(shape)


def captured_grads(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any, causal: bool,
                   softmax_scale: float | None, mods: Mods, block_map: BlockMap | None,
                   wanted: tuple[bool, ...], deterministic: bool = False) -> list[Any]:
    """d loss / d each of mods.score_mod's tensors where `wanted` (None elsewhere), in each tensor's dtype and shape.
    `block_map`: the map the backward's kernels read (any tiles), None without one. `deterministic`: the same bits on
    every run (a table entry's contributions are summed by torch's deterministic scatter, not by atomics)."""
    score_mod = mods.score_mod
    # One layout whatever the caller's strides (a compiled graph's dout may differ from eager's): the matmuls below
    # then take the same cuBLAS kernels, and deterministic calls the same bits.
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    leaves = [t.detach().requires_grad_(True) if w else t.detach() for t, w in zip(score_mod.tensors, wanted)]
    batch, sq, heads, d = q.shape
    sk, group = k.shape[1], heads // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    dev = q.device
    kf = k.float().repeat_interleave(group, 2).transpose(1, 2)
    vf = v.float().repeat_interleave(group, 2).transpose(1, 2)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    if dlse is not None:
        delta = delta - dlse.float()
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    ki = torch.arange(sk, device=dev).view(1, 1, 1, -1)
    rows = max(1, CHUNK_ELEMENTS // max(1, batch * heads * sk))
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        qi = torch.arange(r0, r1, device=dev).view(1, 1, -1, 1)
        s = (q[:, r0:r1].float().transpose(1, 2) @ kf.transpose(2, 3)) * scale
        with _recording():
            modified = score_mod.evaluate(s, b, h, qi, ki, tensors=leaves)
        keep = _keep(mods, block_map, causal, b, h, qi, ki, tuple(s.shape), sq, sk)
        p = torch.where(keep, torch.exp(modified.detach() - lse[:, :, r0:r1, None]), 0.0)
        dp = dout[:, r0:r1].float().transpose(1, 2) @ vf.transpose(2, 3)
        ds = torch.where(keep, p * (dp - delta[:, :, r0:r1, None]), 0.0)
        if modified.requires_grad:
            with _deterministic(deterministic), _recording():
                torch.autograd.backward(modified, ds)
    return [t.grad if w and t.grad is not None else (torch.zeros_like(t) if w else None)
            for t, w in zip(leaves, wanted)]


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Autograd records in the block, inside a custom operator's body too (the traced route's backward operator,
    flashgen::attention_modified_backward): the dispatcher runs that body with the autograd keys excluded, where
    torch.enable_grad alone records nothing and every table's gradient would come back zero."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not any(excluded.has(key) for key in _AUTOGRAD_KEYS):
        with torch.enable_grad():
            yield
        return
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """torch's deterministic algorithms for the block (a gathered table's backward is an accumulating index_put,
    atomics otherwise), restored after it."""
    if not on or torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)


__all__ = ["CHUNK_ELEMENTS", "captured_grads"]
