"""score_mod and mask_mod under torch.compile and with fake or meta tensors: the `flashgen::attention_modified`
operator and the modifier tracing that stays outside the graph.

A modifier is a Python function run on flashgen's proxies (flashgen.modifiers), which dynamo cannot trace into a
graph. `graph_modifiers` traces it where dynamo takes the result as a constant (torch.compiler.assume_constant_result:
dynamo calls it on the real function while compiling) and returns, with the digests, where each tensor the modifier
reads lives (a closure cell, a global, a default, then list/tuple/dict items, functions it calls, objects'
attributes). The traced code
fetches those tensors by path, so dynamo sees them as graph inputs (guarded, read at every call, captured by CUDA
graphs) and passes them to the operator, whose body finds the registered modifier by digest. The Python numbers and
strings the function reads are fetched by path too and compared with the values it was traced with: dynamo then
guards them, and a change recompiles instead of running a stale trace.

Imported only where a torch tensor reaches a modifier call (torch stays optional).
"""
from __future__ import annotations

import dataclasses
import numbers
import types
from typing import Any, Callable, Optional

import torch

from .checks import Mods, checked_dtype
from .modifier_grads import captured_grads
from .modifiers import ModifierError, lookup, trace_cached
from .mask_bands import builtin_for
from .ops import attention_mods_op, attention_op, dense_mods_forward, flex_backward

MAX_DEPTH = 5  # functions, containers and objects searched into for a captured tensor, from the modifier


@torch.compiler.assume_constant_result
def graph_modifiers(score_mod: Optional[Callable], mask_mod: Optional[Callable]) -> tuple:
    """(score digest, mask digest, number of the score_mod's tensors, the tensors' paths (the score_mod's, then the
    mask_mod's), ((path, value) of each number, string, bool or None the functions read)), "" for a modifier not
    given. A path is (kind, then steps ("closure", cell index), ("global", name), ("default", position) into a
    function, ("item", key) into a list, tuple or dict, ("attr", name) into an object).
    ModifierError where a tensor a modifier reads is not reachable by such a path (made while the modifier runs)."""
    digests, paths, constants, n_score = [], [], [], 0
    for kind, fn in (("score", score_mod), ("mask", mask_mod)):
        if fn is None:
            digests.append("")
            continue
        mod = trace_cached(fn, kind)
        digests.append(mod.digest)
        found: dict[int, tuple] = {}
        _walk(fn, (kind,), mod.tensors, found, constants, 0, set())
        if len(found) < len(mod.tensors):  # into objects' attributes too (a module's parameters and buffers)
            _walk(fn, (kind,), mod.tensors, found, constants, 0, set(), objects=True)
        for c, t in zip(mod.captured, mod.tensors):
            if id(t) not in found:
                raise ModifierError(f"{kind}_mod reads tensor {c.name!r}, which torch.compile cannot reach: under "
                                    "torch.compile (and with fake tensors) a modifier's tensors must be found from "
                                    "its closure, globals or defaults through lists, tuples, dicts, functions and "
                                    "attributes, not made while it runs")
            paths.append(found[id(t)])
        if kind == "score":
            n_score = len(mod.tensors)
    return digests[0], digests[1], n_score, tuple(paths), tuple(constants)


@torch.compiler.disable
def _graph_break_modifiers(score_mod: Optional[Callable], mask_mod: Optional[Callable]) -> tuple:
    """graph_modifiers behind a graph break: for a modifier function made inside the compiled code, which dynamo
    cannot hand to graph_modifiers as a constant (fullgraph=True refuses the break)."""
    return graph_modifiers(score_mod, mask_mod)


def _outside_graph(fn: Optional[Callable]) -> bool:
    """Whether `fn` (None included) is an object dynamo can pass to graph_modifiers as a constant: always outside
    torch.compile. Inside, dynamo answers hasattr on a function by building the function object, which fails for one
    made inside the compiled code around tensors (its closure cells are traced values): False there, and for callables
    that are not functions."""
    if fn is None or not torch.compiler.is_compiling():
        return True
    return hasattr(fn, "__qualname__")


def _roots(fn: Callable) -> list[tuple[tuple, Any]]:
    """(step, value) of what function `fn` reads from outside itself: the globals its code names, its closure cells,
    its defaults (what modifiers.trace_cached fingerprints)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    glob = getattr(fn, "__globals__", {})
    out = [(("global", name), glob[name]) for name in code.co_names if name in glob]
    for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
        try:
            out.append((("closure", i), cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    out += [(("default", i), v) for i, v in enumerate(getattr(fn, "__defaults__", None) or ())]
    return out


def _walk(value: Any, path: tuple, tensors: tuple, found: dict[int, tuple], constants: list, depth: int,
          seen: set[int], objects: bool = False) -> None:
    """Record in `found` the path of each of `tensors` reachable from `value` (through list/tuple/dict items, the
    functions it names: a helper the modifier calls, and with `objects` attributes: a module's parameters, buffers,
    submodules and plain attributes, another object's instance attributes), in `constants` the numbers, strings,
    bools and Nones on the way."""
    if isinstance(value, torch.Tensor):
        if any(value is t for t in tensors):
            found.setdefault(id(value), path)
        return
    if value is None or isinstance(value, (bool, numbers.Number, str)):
        if value == value and (path, value) not in constants:  # not NaN, which equals nothing
            constants.append((path, value))
        return
    if depth >= MAX_DEPTH or id(value) in seen or isinstance(value, (type, types.ModuleType)):
        return
    seen.add(id(value))
    if isinstance(value, types.FunctionType):
        children = [(step, v) for step, v in _roots(value)]
    elif isinstance(value, (list, tuple)):
        children = [(("item", i), v) for i, v in enumerate(value)]
    elif isinstance(value, dict):
        children = [(("item", k), v) for k, v in value.items() if isinstance(k, (str, int))]
    elif objects and isinstance(value, torch.nn.Module):
        members = {**value._parameters, **value._buffers, **value._modules}
        members.update((k, v) for k, v in vars(value).items() if not k.startswith("_") and k != "training")
        children = [(("attr", k), v) for k, v in members.items()]
    elif objects and hasattr(value, "__dict__") and not callable(value):
        children = [(("attr", k), v) for k, v in vars(value).items() if not k.startswith("__")]
    else:
        return
    for step, v in children:
        _walk(v, path + (step,), tensors, found, constants, depth + 1, seen, objects)


def fetch(score_mod: Optional[Callable], mask_mod: Optional[Callable], path: tuple) -> Any:
    """The value at `path` (graph_modifiers) of the modifier functions: plain attribute and item reads, which
    dynamo traces (and guards)."""
    value: Any = score_mod if path[0] == "score" else mask_mod
    for where, key in path[1:]:
        if where == "closure":
            value = value.__closure__[key].cell_contents
        elif where == "global":
            value = value.__globals__[key]
        elif where == "default":
            value = value.__defaults__[key]
        elif where == "attr":
            value = getattr(value, key)
        else:
            value = value[key]
    return value


def modified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       softmax_scale: Optional[float], mods: Mods, score_mod: Optional[Callable],
                       mask_mod: Optional[Callable], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `flashgen.attention` with a score_mod or mask_mod (and the window, softcap and ALiBi of `mods`)
    through flashgen::attention_modified: the route of traced calls (torch.compile, fake and meta tensors)."""
    if _outside_graph(score_mod) and _outside_graph(mask_mod):
        score_digest, mask_digest, n_score, paths, constants = graph_modifiers(score_mod, mask_mod)
    else:
        score_digest, mask_digest, n_score, paths, constants = _graph_break_modifiers(score_mod, mask_mod)
    for path, value in constants:
        if fetch(score_mod, mask_mod, path) != value:  # dynamo guards the read: a changed value recompiles
            raise ModifierError(f"a value {path[0]}_mod reads ({path[1:]}) changed while it was traced")
    builtin = _band(score_digest, mask_digest, causal, mods, q.shape[1], k.shape[1])
    if builtin is not None:  # a band of diagonals (causal, a sliding window): the built-in kernels' operators
        if builtin[1] == (-1, -1):
            return attention_op(q, k, v, builtin[0], softmax_scale, None, deterministic)
        return attention_mods_op(q, k, v, builtin[0], softmax_scale, *builtin[1], 0.0, None, deterministic)
    tensors = [fetch(score_mod, mask_mod, p) for p in paths]
    if torch.is_grad_enabled():
        for p, t in zip(paths[n_score:], tensors[n_score:]):
            if t.requires_grad:
                raise NotImplementedError(f"mask_mod reads a tensor ({p[1:]}) which requires grad: a mask has no "
                                          "gradient (detach it, or call under torch.no_grad())")
    # Which tables get a gradient is decided here, where dynamo sees the real tensors' requires_grad (the operator's
    # autograd context sees traced stand-ins): float tensors of the score_mod that require grad (a learnable bias).
    wanted = [t.requires_grad and t.is_floating_point() for t in tensors[:n_score]] + [False] * (len(tensors) - n_score)
    return attention_modified_op(q, k, v, tensors, score_digest, mask_digest, causal, softmax_scale, *mods.window,
                                 mods.softcap, mods.alibi, deterministic, wanted)


def _band(score_digest: str, mask_digest: str, causal: bool, mods: Mods, seqlen_q: Any,
          seqlen_k: Any) -> tuple[bool, tuple[int, int]] | None:
    """(causal, window_size) of the built-in kernels where the traced mask_mod keeps a band of diagonals and the call
    has nothing else that needs a generated kernel (as flashgen.attention's eager route); else None."""
    if not mask_digest or mods.softcap or mods.alibi is not None or mods.window != (-1, -1):
        return None
    score = lookup(score_digest, "score") if score_digest else None
    return builtin_for(lookup(mask_digest, "mask"), score, causal, seqlen_q, seqlen_k)


def _mods(tensors: list[torch.Tensor], score_digest: str, mask_digest: str, window_left: int, window_right: int,
          softcap: float, alibi_slopes: Optional[torch.Tensor]) -> Mods:
    """The call's Mods: the registered modifiers of these digests, each given its tensors (the score_mod's first)."""
    score = lookup(score_digest, "score") if score_digest else None
    mask = lookup(mask_digest, "mask") if mask_digest else None
    n = len(score.captured) if score is not None else 0
    if n + (len(mask.captured) if mask is not None else 0) != len(tensors):
        raise ValueError(f"flashgen::attention_modified got {len(tensors)} tensors; its modifiers read "
                         f"{n} + {len(tensors) - n}")
    if score is not None:
        score = dataclasses.replace(score, tensors=tuple(tensors[:n]))
    if mask is not None:
        mask = dataclasses.replace(mask, tensors=tuple(tensors[n:]))
    return Mods((window_left, window_right), softcap, alibi_slopes, score_mod=score, mask_mod=mask)


@torch.library.custom_op("flashgen::attention_modified", mutates_args=(), device_types="cuda")
def attention_modified_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                          score_digest: str, mask_digest: str, causal: bool, softmax_scale: Optional[float],
                          window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                          deterministic: bool, wanted: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of dense q, k, v with the score_mod and mask_mod of these digests (traced in this process; ""
    for none) reading `tensors` (the score_mod's, then the mask_mod's), and a window, softcap or ALiBi: out like q,
    lse (batch, heads, seqlen_q) fp32. The block map of a mask_mod is built on the device at the first call and
    kept while its tensors are unchanged (flashgen.blockmap.cached_from_mask)."""
    # The real tensors' alignment: the traced call had no data pointers to check.
    checked_dtype({"q": q, "k": k, "v": v}, "(batch, seqlen, heads, head_dim)")
    mods = _mods(tensors, score_digest, mask_digest, window_left, window_right, softcap, alibi_slopes)
    return dense_mods_forward(q, k, v, causal, softmax_scale, mods)


@attention_modified_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor], score_digest: str,
      mask_digest: str, causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
      softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
      wanted: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_modified_backward", mutates_args=(), device_types="cuda")
def attention_modified_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                                   tensors: list[torch.Tensor], score_digest: str, mask_digest: str, causal: bool,
                                   softmax_scale: Optional[float], window_left: int, window_right: int,
                                   softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                                   wanted: list[bool]) -> list[torch.Tensor]:
    """[dq, dk, dv, then d loss / d each of the score_mod's tensors where `wanted`]: the backward generated with
    the forward's modifiers (ops.flex_backward) and modifier_grads.captured_grads."""
    mods = _mods(tensors, score_digest, mask_digest, window_left, window_right, softcap, alibi_slopes)
    dq, dk, dv, bmap = flex_backward(dout, q, k, v, out, lse, dlse, causal, softmax_scale, mods, deterministic)
    if not any(wanted):
        return [dq, dk, dv]
    tables = captured_grads(dout, q, k, v, out, lse, dlse, causal, softmax_scale, mods, bmap, tuple(wanted),
                            deterministic)
    return [dq, dk, dv, *(g for g, w in zip(tables, wanted) if w)]


@attention_modified_backward_op.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      dlse: Optional[torch.Tensor], tensors: list[torch.Tensor], score_digest: str, mask_digest: str, causal: bool,
      softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
      alibi_slopes: Optional[torch.Tensor], deterministic: bool, wanted: list[bool]) -> list[torch.Tensor]:
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return grads + [torch.empty_like(t) for t, w in zip(tensors, wanted) if w]


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, tensors, score_digest, mask_digest, causal, scale, left, right, softcap, alibi, deterministic, wanted = inputs
    ctx.wanted = list(wanted)  # decided by the caller (modified_attention); a mask_mod's tables never get one
    ctx.save_for_backward(q, k, v, *output, alibi, *tensors)
    ctx.args = (score_digest, mask_digest, causal, scale, left, right, softcap)
    ctx.deterministic = deterministic


def _backward(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, alibi, *tensors = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    score_digest, mask_digest, causal, scale, left, right, softcap = ctx.args
    grads = attention_modified_backward_op(dout, q, k, v, out, lse, dlse, tensors, score_digest, mask_digest, causal,
                                           scale, left, right, softcap, alibi, ctx.deterministic, ctx.wanted)
    it = iter(grads[3:])
    tables = [next(it) if w else None for w in ctx.wanted]
    return (grads[0], grads[1], grads[2], tables) + (None,) * 10


attention_modified_op.register_autograd(_backward, setup_context=_setup)


__all__ = ["attention_modified_backward_op", "attention_modified_op", "fetch", "graph_modifiers",
           "modified_attention"]
