"""Programmable attention: a user's `score_mod(score, b, h, q_idx, kv_idx)` or `mask_mod(b, h, q_idx, kv_idx)`
(the signatures and meaning of torch.nn.attention.flex_attention) traced into a small expression graph, and that
graph written out as a CUDA expression a kernel template pastes in.

The tracer calls the function once on proxies standing for a float score and integer indices. Every operation on
a proxy records a node; the op set is deliberately small so that each node has one exact CUDA spelling, one torch
spelling (`Modifier.evaluate`, the host reference) and one derivative with respect to the score
(`Modifier.grad_expr`, for the backward). Tensors the function closes over and indexes with integer expressions
(bias tables, document ids, per-head slopes) become kernel arguments: a pointer plus one stride per dimension,
described by `Captured`. Python numbers it closes over become constants.

Types in the graph: "float" (CUDA float), "int" (CUDA int or long long: the inputs b, h, q_idx, kv_idx are int,
reads of integer tensors and casts are long long) and "bool".
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import importlib.util
import math
import numbers
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

KINDS = ("score", "mask")
SCORE_INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_INPUTS = ("b", "h", "q_idx", "kv_idx")
SUPPORTED = ("+ - * / (true division), unary -, < <= > >= == !=, & | ^ ~ on booleans, // and % on integers, "
             "torch.where, abs, exp, exp2, log, tanh, torch.minimum/maximum, min/max of two values, clamp, "
             "full_like, casts (.float() .long() .int() .bool() .to(dtype)), "
             "captured tensors indexed by integer expressions")
DIGEST_CHARS = 12
MAX_EXPR_CHARS = 200_000  # far above any real modifier; a DAG written out as a tree can grow exponentially
LN2 = math.log(2.0)

# torch dtype name -> (graph type, CUDA element type of the kernel argument)
DTYPES = {
    "float32": ("float", "float"), "float16": ("float", "__half"), "bfloat16": ("float", "__nv_bfloat16"),
    "float64": ("float", "double"), "int64": ("int", "long long"), "int32": ("int", "int"),
    "int16": ("int", "short"), "int8": ("int", "signed char"), "uint8": ("int", "unsigned char"),
    "bool": ("bool", "bool"),
}


class ModifierError(ValueError):
    """A score_mod or mask_mod that flashgen cannot compile; the message names the construct."""


@dataclass(frozen=True)
class Node:
    """One operation of the graph. `value`: a constant's value, an input's name, a captured tensor's position."""
    op: str
    args: tuple["Node", ...]
    type: str
    value: Any = None

    def __hash__(self) -> int:  # cached: shared subgraphs would otherwise be hashed once per path through them
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.op, self.args, self.type, self.value))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __reduce__(self) -> tuple:  # without the cached hash: string hashes differ from process to process
        return Node, (self.op, self.args, self.type, self.value)


@dataclass(frozen=True)
class Captured:
    """A tensor the modifier reads: one kernel argument `arg` (a pointer) plus `arg_s0`, `arg_s1`, ... (strides in
    elements, long long). `name` is what the user's function called it. `layout` (index_layout): "" where the
    kernel computes an element's offset in 64 bits with the strides it is passed; else every element lies below
    2^31 and the offset is computed in 32 bits, each dimension's stride by its class: "1" (stride 1: no product),
    "0" (stride 0: no term) or "s" (the stride passed)."""
    name: str
    arg: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    layout: str = ""

    def fits(self, t: Any) -> bool:
        """Whether the kernel generated for this tensor reads `t` right (a wide layout reads any)."""
        return not self.layout or index_layout(tuple(t.shape), tuple(t.stride())) == self.layout

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def c_type(self) -> str:
        return DTYPES[self.dtype][1]

    def params(self) -> str:
        """The kernel parameters this tensor takes, as a C parameter list fragment."""
        return ", ".join([f"const {self.c_type}* __restrict__ {self.arg}"]
                         + [f"long long {self.arg}_s{k}" for k in range(self.rank)])


def index_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """Captured.layout of a tensor: its strides' classes where every element's offset is non-negative and below
    2^31 (then a 32-bit offset reaches each one), else "" (64-bit offsets)."""
    if not shape or any(st < 0 for st in strides) or sum((n - 1) * st for n, st in zip(shape, strides)) >= 2**31:
        return ""
    return "".join("0" if st == 0 else "1" if st == 1 else "s" for st in strides)


def nodes(root: Node) -> Iterator[Node]:
    """Each node of the graph under `root` once (a shared subexpression is one node)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            yield node
            stack.extend(node.args)


def inputs_used(root: Node) -> set[str]:
    """The inputs (score, b, h, q_idx, kv_idx) the graph under `root` reads."""
    return {node.value for node in nodes(root) if node.op == "input"}


@dataclass(frozen=True)
class Modifier:
    """A traced (or hand-written) modifier. `expr`: the CUDA expression, in terms of `score` (float; score mods
    only), `b`, `h`, `q_idx`, `kv_idx` (int) and the captured tensors' arguments; a float for a score mod, a bool
    (true: keep) for a mask mod. `grad_expr`: d expr / d score (score mods). `digest`: a short hash of the graph
    and of the captured tensors' dtypes and ranks (not their values), for kernel names and caches."""
    kind: str
    expr: str
    captured: tuple[Captured, ...] = ()
    source: str = ""
    digest: str = ""
    grad_expr: str | None = None
    root: Node | None = field(default=None, compare=False, repr=False)
    grad_root: Node | None = field(default=None, compare=False, repr=False)
    tensors: tuple = field(default=(), compare=False, repr=False)  # the live tensors, in `captured`'s order
    # `expr` with 32-bit offsets into the captured tensors whose layout allows it (Captured.layout), as the sm90
    # forward reads them; "" where it is `expr` (the other kernels read `expr`: the narrow offsets cost them spills)
    narrow_expr: str = ""

    @classmethod
    def from_cuda(cls, expr: str, kind: str, grad_expr: str | None = None,
                  captured: tuple[Captured, ...] = ()) -> "Modifier":
        """A modifier given as CUDA text (for export); it cannot be evaluated on the host."""
        if kind not in KINDS:
            raise ModifierError(f"modifier kind {kind!r} is not one of {KINDS}")
        source = f"cuda {kind}: {expr}" + (f"\ngrad: {grad_expr}" if grad_expr is not None else "")
        return register(cls(kind, expr, tuple(captured), source, _digest(kind, source, captured), grad_expr))

    @property
    def is_identity(self) -> bool:
        """A score_mod that returns the score unchanged: the call needs no modifier kernel."""
        return self.kind == "score" and self.expr == "score" and not self.captured

    @functools.cached_property  # asked on every call of a modified kernel: the graph is walked once
    def reads_per_score(self) -> bool:
        """Whether it reads a captured tensor at an index that depends on q_idx or kv_idx (a bias table, document
        ids): a load per score, not one per head or sequence. A modifier given as CUDA text: whether it reads any."""
        if self.root is None:
            return bool(self.captured)
        return any(node.op == "read" and any(inputs_used(a) & {"q_idx", "kv_idx"} for a in node.args)
                   for node in nodes(self.root))

    def constant_on_tiles(self, block_m: int, block_n: int) -> bool:
        """Whether its value is the same for every score of an aligned tile of block_m rows x block_n keys: q_idx and
        kv_idx appear only as `q_idx // c` with c a multiple of block_m and `kv_idx // c` with c a multiple of block_n
        (a block-sparse table read by tile). A block map at such tiles then has no partial tile: the kernel never
        evaluates it. False without a graph."""
        if self.root is None:
            return False
        steps = {"q_idx": block_m, "kv_idx": block_n}

        def constant(node: Node) -> bool:
            if node.op == "input":
                return node.value not in steps
            if (node.op == "floordiv" and node.args[0].op == "input" and node.args[0].value in steps
                    and node.args[1].op == "const" and node.args[1].value > 0):
                return node.args[1].value % steps[node.args[0].value] == 0
            return all(constant(a) for a in node.args)

        return constant(self.root)

    @functools.cached_property  # asked by the schedule rule and the renderer of every modified kernel
    def loads_on_cut_tiles(self) -> bool:
        """Whether a kernel evaluating this mask_mod loads per score: it reads a captured tensor at an index of q_idx
        or kv_idx (reads_per_score) other than by whole tiles of every sm90 forward schedule (up to 128 x 128, as a
        block-sparse table is read), whose block map then has no partial tile, so the kernel never evaluates it."""
        return self.reads_per_score and not self.constant_on_tiles(128, 128)

    @functools.cached_property
    def split_expr(self) -> str:
        """`expr` with q_idx and kv_idx split into bases and unrolled offsets, unclamped (emit's `split`), for the
        forward's tiles that no sequence end cuts (the sm90 family's, and the sm80 family's dense kernels); "" where it
        reads neither index or has no graph (CUDA text)."""
        if self.root is None or not inputs_used(self.root) & set(SPLIT_INPUTS):
            return ""
        return emit(self.root, self.captured, split=True)

    @property
    def params(self) -> str:
        """The kernel parameters of every captured tensor (empty when none)."""
        return ", ".join(c.params() for c in self.captured)

    def evaluate(self, *inputs: Any, tensors: tuple | None = None, grad: bool = False) -> Any:
        """The graph computed with torch on broadcastable inputs (score, b, h, q_idx, kv_idx for a score mod;
        b, h, q_idx, kv_idx for a mask mod): float32 for a score mod (d/dscore with grad=True), bool for a mask."""
        root = self.grad_root if grad else self.root
        if root is None:
            raise ModifierError("this modifier has no graph to evaluate (given as CUDA text, or no score gradient)")
        names = SCORE_INPUTS if self.kind == "score" else MASK_INPUTS
        if len(inputs) != len(names):
            raise ModifierError(f"{self.kind}_mod takes {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
        return _evaluate(root, dict(zip(names, inputs)), self.tensors if tensors is None else tuple(tensors))


# Every modifier traced or given as CUDA in this process, by digest: a KernelConfig names its modifiers by digest
# only (it stays small, hashable and serializable), and the render finds their text here. The entry keeps the graph
# (the host reference of a process the modifier is sent to, e.g. the tuner's GPU worker) but no live tensors, so the
# registry holds no device memory.
_REGISTRY: dict[str, Modifier] = {}
_REGISTRY_LOCK = threading.Lock()
MAX_CAPTURED = 4  # captured tensors one kernel takes (score_mod's and mask_mod's together): ModTensor slots
MAX_RANK = 4  # dimensions of one captured tensor: a ModTensor's strides


def register(mod: Modifier) -> Modifier:
    """Record `mod` under its digest (for the render) and return it."""
    entry = replace(mod, tensors=())  # the graph and texts, no live tensors
    with _REGISTRY_LOCK:
        _REGISTRY.setdefault(mod.digest, entry)
    return mod


def registered(digests: tuple[str, ...]) -> tuple[Modifier, ...]:
    """The registered modifiers of these digests ("" skipped), without tensors: what another process registers
    (`register`) to render and evaluate them. ModifierError where one was not traced in this process."""
    out = []
    for d in digests:
        if d:
            mod = _REGISTRY.get(d)
            if mod is None:
                raise ModifierError(f"no modifier with digest {d!r} was traced in this process")
            out.append(mod)
    return tuple(out)


def lookup(digest: str, kind: str) -> Modifier:
    """The registered modifier with this digest; ModifierError where this process has not traced it."""
    mod = _REGISTRY.get(digest)
    if mod is None or mod.kind != kind:
        raise ModifierError(f"no {kind}_mod with digest {digest!r} was traced in this process (trace it with "
                            f"trace_{kind}_mod, or give it with Modifier.from_cuda, before rendering its kernel)")
    return mod


def trace_score_mod(fn: Callable, captured: dict[str, Any] | None = None) -> Modifier:
    """Trace `fn(score, b, h, q_idx, kv_idx) -> score`. `captured` optionally names tensors the function reads
    (found otherwise by its closure and globals)."""
    return _trace(fn, "score", captured)


def trace_mask_mod(fn: Callable, captured: dict[str, Any] | None = None) -> Modifier:
    """Trace `fn(b, h, q_idx, kv_idx) -> bool` (true: the score is kept)."""
    return _trace(fn, "mask", captured)


def load_file(spec: str, kind: str) -> Modifier:
    """`FILE.py:FUNC`: the function FUNC of the Python file FILE.py, run as a module (so that the tensors it reads
    exist), traced as a score_mod (kind "score") or mask_mod ("mask"). ModifierError, naming the spec, for a missing
    file or function, an error the file raises, or a function outside the traced op set."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ModifierError(f"{spec!r}: expected FILE.py:FUNCTION")
    if not Path(path).is_file():
        raise ModifierError(f"{spec!r}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"flashgen_{kind}_mod_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error it raises is theirs, shown in one line
        raise ModifierError(f"{spec!r}: running {path} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ModifierError(f"{spec!r}: {path} has no function {name}")
    try:
        return trace_score_mod(fn) if kind == "score" else trace_mask_mod(fn)
    except ModifierError as e:
        raise ModifierError(f"{spec!r}: {e}") from None


# fn -> {kind: (what fn saw when traced, its Modifier)}: a call passing the same function again skips the trace.
_TRACES: "weakref.WeakKeyDictionary[Callable, dict[str, tuple[tuple, Modifier]]]" = weakref.WeakKeyDictionary()


def trace_cached(fn: Callable, kind: str) -> Modifier:
    """`trace_score_mod(fn)` (kind "score") or `trace_mask_mod(fn)` ("mask"), reused while `fn` is the same
    function and what it sees through its closure, defaults and globals is unchanged: the same tensor objects at the
    same addresses, shapes, strides and dtypes, the same numbers (a number is a constant of the graph), lists,
    tuples and dicts of those compared by content. A tensor's values may change in place: the kernel reads them at
    each launch. A function that reads anything else (an object's attributes), or a callable that is not a plain
    function, is traced every time. Functions `fn` calls are not looked into: a helper whose own globals change
    needs a new `fn` (or trace_score_mod / trace_mask_mod each time)."""
    if kind not in KINDS:
        raise ModifierError(f"modifier kind {kind!r} is not one of {KINDS}")
    seen = _seen(fn)
    if seen is None:
        return _trace(fn, kind, None)
    held = _TRACES.get(fn)
    if held is not None and kind in held and held[kind][0] == seen:
        return held[kind][1]
    mod = _trace(fn, kind, None)
    _TRACES.setdefault(fn, {})[kind] = (seen, mod)
    return mod


class _Uncacheable(Exception):
    pass


def _seen(fn: Callable) -> tuple | None:
    """What plain function `fn` reads from outside itself, as comparable values (tensors by identity and layout);
    None where that cannot be told (not a plain function, or it reads an object whose contents may change)."""
    code = getattr(fn, "__code__", None)
    if code is None or not hasattr(fn, "__globals__") or hasattr(fn, "__self__"):
        return None
    values: list[tuple[str, Any]] = [(name, fn.__globals__[name]) for name in code.co_names if name in fn.__globals__]
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            values.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            values.append((name, None))
    values += [("__defaults__", fn.__defaults__), ("__kwdefaults__", fn.__kwdefaults__)]
    try:
        return (code, *((name, _fingerprint(value, 0)) for name, value in values))
    except _Uncacheable:
        return None


def _fingerprint(value: Any, depth: int) -> Any:
    if _is_tensor(value):
        ptr = None if getattr(value, "fake_mode", None) is not None else value.data_ptr()  # a FakeTensor has none
        return ("tensor", id(value), ptr, tuple(value.shape), tuple(value.stride()), str(value.dtype),
                str(value.device))
    if value is None or isinstance(value, (numbers.Number, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return ("id", id(value))  # modules, classes, functions (torch, torch.where): by identity
    if depth < 4 and isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_fingerprint(v, depth + 1) for v in value))
    if depth < 4 and isinstance(value, dict):
        return ("dict", tuple((repr(k), _fingerprint(v, depth + 1)) for k, v in value.items()))
    raise _Uncacheable


# ---------------------------------------------------------------------------------------------- graph building

def _const(value: Any) -> Node:
    if isinstance(value, bool):
        return Node("const", (), "bool", value)
    if isinstance(value, numbers.Integral):
        return Node("const", (), "int", int(value))
    return Node("const", (), "float", float(value))


ZERO, ONE = _const(0.0), _const(1.0)


def _common(*types: str) -> str:
    return "float" if "float" in types else "int"


ARITH = {"add": "+", "sub": "-", "mul": "*"}
COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
LOGIC = {"and": "&&", "or": "||", "xor": "!="}
# tanh as the kernels' numeric header writes it (tanh_approx): one ex2 and one reciprocal, absolute error below 1e-6
FLOAT_FNS = {"exp": "expf", "exp2": "exp2f", "log": "logf", "tanh": "tanh_approx"}
SPELLING = {"and": "&", "or": "|", "xor": "^", "floordiv": "//", "mod": "%", "truediv": "/", "neg": "unary -",
            "not": "~"}


def _binary(kind: str, op: str, a: Node, b: Node) -> Node:
    if op in ARITH or op in ("minimum", "maximum"):
        return Node(op, (a, b), _common(a.type, b.type))
    if op == "truediv":
        return Node(op, (a, b), "float")
    if op in ("floordiv", "mod"):
        if a.type != "int" or b.type != "int":
            what = "float" if "float" in (a.type, b.type) else "bool"
            raise ModifierError(f"{kind}_mod uses {SPELLING[op]} on a {what} value; flashgen compiles {SPELLING[op]} on integer indices only")
        return Node(op, (a, b), "int")
    if op in COMPARE:
        return Node(op, (a, b), "bool")
    if op in LOGIC:
        if a.type != "bool" or b.type != "bool":
            raise ModifierError(f"{kind}_mod uses {SPELLING[op]} on non-boolean values (bitwise integer arithmetic);"
                                f" flashgen compiles {SPELLING[op]} on booleans only")
        return Node(op, (a, b), "bool")
    raise AssertionError(op)


def _unary(kind: str, op: str, a: Node) -> Node:
    if op == "neg":
        if a.type == "bool":
            raise ModifierError(f"{kind}_mod negates a boolean; use ~ for logical not")
        return Node(op, (a,), a.type)
    if op == "not":
        if a.type != "bool":
            raise ModifierError(f"{kind}_mod uses ~ on a non-boolean value; flashgen compiles ~ on booleans only")
        return Node(op, (a,), "bool")
    if op == "abs":
        return Node(op, (a,), _common(a.type))
    if op in FLOAT_FNS:
        return Node(op, (a,), "float")
    if op in ("to_float", "to_int", "to_bool"):
        target = op.removeprefix("to_")
        return a if a.type == target else Node(op, (a,), target)
    raise AssertionError(op)


def _where(kind: str, c: Node, x: Node, y: Node) -> Node:
    if c.type != "bool":
        raise ModifierError(f"{kind}_mod calls torch.where with a non-boolean condition")
    t = "bool" if x.type == y.type == "bool" else _common(x.type, y.type)
    return Node("where", (c, x, y), t)


# ---------------------------------------------------------------------------------------------------- tracing

_TRACE_LOCK = threading.RLock()  # a modifier may trace another inside itself
_BUILTIN_MIN, _BUILTIN_MAX = builtins.min, builtins.max


class _Tracer:
    def __init__(self, kind: str, names: dict[int, str]):
        self.kind, self.names = kind, names
        self.tensors: list[Any] = []

    def capture(self, tensor: Any) -> int:
        for i, t in enumerate(self.tensors):
            if t is tensor:
                return i
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ModifierError(f"{self.kind}_mod reads a captured tensor "
                                f"{self.names.get(id(tensor), '')!r} of dtype {dtype}; supported: {', '.join(DTYPES)}")
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def name(self, tensor: Any) -> str:
        known = self.names.get(id(tensor))
        return known if known is not None else f"tensor{self.capture(tensor)}"

    def lift(self, x: Any) -> Node:
        if isinstance(x, _Proxy):
            return x.node
        if isinstance(x, (bool, numbers.Real)) and not _is_tensor(x):
            return _const(x)
        if _is_tensor(x):
            if x.dim() == 0:
                return self.read(x, ())
            raise ModifierError(f"{self.kind}_mod uses the captured tensor {self.name(x)!r} (shape {tuple(x.shape)})"
                                " as a value; index it with integer expressions of b, h, q_idx, kv_idx")
        if isinstance(x, _View):
            raise ModifierError(f"{self.kind}_mod reads the captured tensor {self.name(x.tensor)!r} with "
                                f"{len(x.index)} of its {x.tensor.dim()} indices")
        raise ModifierError(f"{self.kind}_mod uses a value of type {type(x).__name__}, which flashgen cannot "
                            f"compile; supported: {SUPPORTED}")

    def wrap(self, node: Node) -> "_Proxy":
        return _Proxy(node, self)

    def getitem(self, tensor: Any, index: Any, prefix: tuple[Node, ...] = ()) -> Any:
        items = index if isinstance(index, tuple) else (index,)
        nodes = list(prefix)
        for item in items:
            if item is None or item is Ellipsis or isinstance(item, (slice, list)) or _is_tensor(item):
                raise ModifierError(f"{self.kind}_mod indexes the captured tensor {self.name(tensor)!r} with "
                                    f"{type(item).__name__}; index it with integer expressions only")
            node = self.lift(item)
            if node.type != "int":
                raise ModifierError(f"{self.kind}_mod indexes the captured tensor {self.name(tensor)!r} by a "
                                    f"{node.type} expression; indices must be integer expressions of b, h, q_idx, "
                                    "kv_idx")
            nodes.append(node)
        if len(nodes) > tensor.dim():
            raise ModifierError(f"{self.kind}_mod indexes the captured tensor {self.name(tensor)!r} of rank "
                                f"{tensor.dim()} with {len(nodes)} indices")
        if len(nodes) < tensor.dim():
            return _View(tensor, tuple(nodes), self)
        return self.wrap(self.read(tensor, tuple(nodes)))

    def read(self, tensor: Any, index: tuple[Node, ...]) -> Node:
        i = self.capture(tensor)
        return Node("read", index, DTYPES[str(tensor.dtype).removeprefix("torch.")][0], i)

    def minmax(self, op: str, args: tuple) -> Any:
        values = list(args[0]) if len(args) == 1 else list(args)
        if not values:
            raise ModifierError(f"{self.kind}_mod calls {op[:3]}() with no values")
        node = self.lift(values[0])
        for v in values[1:]:
            node = _binary(self.kind, op, node, self.lift(v))
        return self.wrap(node)


def _is_tensor(x: Any) -> bool:
    t = type(x)
    return any(c.__module__.startswith("torch") and c.__name__ in ("Tensor", "TensorBase") for c in t.__mro__)


class _View:
    """A captured tensor indexed with fewer indices than its rank (`bias[h]` before `[q_idx - kv_idx]`)."""

    def __init__(self, tensor: Any, index: tuple[Node, ...], tracer: _Tracer):
        self.tensor, self.index, self.tracer = tensor, index, tracer

    def __getitem__(self, index: Any) -> Any:
        return self.tracer.getitem(self.tensor, index, self.index)


def _torch_op(tracer: _Tracer, func: Any, args: tuple, kwargs: dict) -> Any:
    """A torch function or Tensor method called with a proxy among its arguments."""
    import torch  # noqa: PLC0415  (torch is optional; only a torch call on a proxy gets here)
    name = getattr(func, "__name__", repr(func))
    owner = "torch" if getattr(func, "__module__", None) == "torch" or func is torch.where else "Tensor"
    kind, lift, wrap = tracer.kind, tracer.lift, tracer.wrap

    def unsupported() -> ModifierError:
        return ModifierError(f"{kind}_mod uses {owner}.{name}"
                             f"{' with ' + ', '.join(kwargs) if kwargs else ''}, which flashgen cannot compile; "
                             f"supported: {SUPPORTED}")

    dunder = name.strip("_")
    reflected = name.startswith("__r") and dunder[1:] in (*ARITH, "truediv", "floordiv", "mod", "and", "or", "xor")
    base = dunder[1:] if reflected else dunder
    aliases = {"subtract": "sub", "multiply": "mul", "div": "truediv", "divide": "truediv", "true_divide": "truediv",
               "floor_divide": "floordiv", "remainder": "mod", "logical_and": "and", "logical_or": "or",
               "logical_xor": "xor", "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
               "invert": "not", "logical_not": "not", "bitwise_not": "not", "negative": "neg", "absolute": "abs",
               "min": "minimum", "max": "maximum", "clip": "clamp", "greater": "gt", "less": "lt",
               "greater_equal": "ge", "less_equal": "le", "not_equal": "ne"}
    base = aliases.get(base, base)
    if name == "__getitem__" and not kwargs:
        return tracer.getitem(args[0], args[1])
    if func is torch.where and len(args) == 3 and not kwargs:
        return wrap(_where(kind, *(lift(a) for a in args)))
    if base == "truediv" and kwargs.get("rounding_mode") == "floor":
        base, kwargs = "floordiv", {}
    if base in (*ARITH, "truediv", "floordiv", "mod", *COMPARE, *LOGIC, "minimum", "maximum") and len(args) == 2 \
            and not kwargs:
        a, b = (args[1], args[0]) if reflected else args
        return wrap(_binary(kind, base, lift(a), lift(b)))
    if base in ("neg", "not", "abs", *FLOAT_FNS) and len(args) == 1 and not kwargs:
        return wrap(_unary(kind, base, lift(args[0])))
    if base == "clamp" and len(args) >= 1 and set(kwargs) <= {"min", "max"}:
        bounds = dict(zip(("min", "max"), args[1:]), **kwargs)
        node = lift(args[0])
        if bounds.get("min") is not None:
            node = _binary(kind, "maximum", node, lift(bounds["min"]))
        if bounds.get("max") is not None:
            node = _binary(kind, "minimum", node, lift(bounds["max"]))
        return wrap(node)
    if base == "full_like" and len(args) == 2 and not kwargs:
        like, value = lift(args[0]), args[1]
        return wrap(_const({"float": float, "int": int, "bool": bool}[like.type](value)))
    if base in ("float", "long", "int", "bool") and len(args) == 1 and not kwargs:
        return wrap(_unary(kind, {"float": "to_float", "bool": "to_bool"}.get(base, "to_int"), lift(args[0])))
    if base == "to" and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        target = DTYPES.get(str(args[1]).removeprefix("torch."), (None,))[0]
        if target is None:
            raise unsupported()
        return wrap(_unary(kind, f"to_{target}", lift(args[0])))
    raise unsupported()


class _Proxy:
    """A traced value: each operation on it records a node."""
    __slots__ = ("node", "tracer")

    def __init__(self, node: Node, tracer: _Tracer):
        self.node, self.tracer = node, tracer

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        tracer = next(a.tracer for a in _walk((args, kwargs or {})) if isinstance(a, (_Proxy, _View)))
        return _torch_op(tracer, func, tuple(args), dict(kwargs or {}))

    def _bin(self, op: str, other: Any, reflected: bool = False) -> "_Proxy":
        a, b = self.node, self.tracer.lift(other)
        return self.tracer.wrap(_binary(self.tracer.kind, op, b, a) if reflected else
                                _binary(self.tracer.kind, op, a, b))

    def _un(self, op: str) -> "_Proxy":
        return self.tracer.wrap(_unary(self.tracer.kind, op, self.node))

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("truediv", o)
    def __rtruediv__(self, o): return self._bin("truediv", o, True)
    def __floordiv__(self, o): return self._bin("floordiv", o)
    def __rfloordiv__(self, o): return self._bin("floordiv", o, True)
    def __mod__(self, o): return self._bin("mod", o)
    def __rmod__(self, o): return self._bin("mod", o, True)
    def __and__(self, o): return self._bin("and", o)
    def __rand__(self, o): return self._bin("and", o, True)
    def __or__(self, o): return self._bin("or", o)
    def __ror__(self, o): return self._bin("or", o, True)
    def __xor__(self, o): return self._bin("xor", o)
    def __rxor__(self, o): return self._bin("xor", o, True)
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __eq__(self, o): return self._bin("eq", o)  # type: ignore[override]
    def __ne__(self, o): return self._bin("ne", o)  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]
    def __neg__(self): return self._un("neg")
    def __pos__(self): return self
    def __invert__(self): return self._un("not")
    def __abs__(self): return self._un("abs")
    def exp(self): return self._un("exp")
    def exp2(self): return self._un("exp2")
    def log(self): return self._un("log")
    def tanh(self): return self._un("tanh")
    def abs(self): return self._un("abs")
    def float(self): return self._un("to_float")
    def long(self): return self._un("to_int")
    def int(self): return self._un("to_int")
    def bool(self): return self._un("to_bool")

    def to(self, dtype: Any) -> "_Proxy":
        target = DTYPES.get(str(dtype).removeprefix("torch."), (None,))[0]
        if target is None:
            raise ModifierError(f"{self.tracer.kind}_mod casts to {dtype}, which flashgen cannot compile")
        return self._un(f"to_{target}")

    def clamp(self, min: Any = None, max: Any = None) -> "_Proxy":  # noqa: A002 (torch's names)
        node = self.node
        if min is not None:
            node = _binary(self.tracer.kind, "maximum", node, self.tracer.lift(min))
        if max is not None:
            node = _binary(self.tracer.kind, "minimum", node, self.tracer.lift(max))
        return self.tracer.wrap(node)

    def __bool__(self):
        raise ModifierError(f"{self.tracer.kind}_mod uses a traced value in Python control flow (an `if`, `while`, "
                            "`and`/`or`/`not`, or a comparison chain): the value is only known inside the kernel; "
                            "use torch.where, & | ~ instead")

    def _number(self, *_):
        raise ModifierError(f"{self.tracer.kind}_mod turns a traced value into a Python number (int(), float(), "
                            "math.*, an index into a list): flashgen compiles torch functions on it instead "
                            "(torch.exp, torch.log, ...)")

    __int__ = __float__ = __index__ = __complex__ = _number

    def __iter__(self):
        raise ModifierError(f"{self.tracer.kind}_mod iterates over a traced value, a scalar")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocol probes (hasattr) must see an ordinary AttributeError
            raise AttributeError(name)
        raise ModifierError(f"{self.tracer.kind}_mod uses Tensor.{name}, which flashgen cannot compile; "
                            f"supported: {SUPPORTED}")


def _walk(x: Any):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _walk(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _walk(y)
    else:
        yield x


def _min(*args: Any, **kwargs: Any) -> Any:
    proxy = _first_proxy(args)
    return proxy.tracer.minmax("minimum", args) if proxy is not None and not kwargs else _BUILTIN_MIN(*args, **kwargs)


def _max(*args: Any, **kwargs: Any) -> Any:
    proxy = _first_proxy(args)
    return proxy.tracer.minmax("maximum", args) if proxy is not None and not kwargs else _BUILTIN_MAX(*args, **kwargs)


def _first_proxy(args: tuple) -> "_Proxy | None":
    values = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return next((v for v in values if isinstance(v, _Proxy)), None)


def _closure_names(fn: Callable, captured: dict[str, Any] | None) -> dict[int, str]:
    """id(tensor) -> the name the function knows it by (explicit names first, then closure, then globals)."""
    names: dict[int, str] = {}
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name in code.co_names:
            if name in getattr(fn, "__globals__", {}) and _is_tensor(fn.__globals__[name]):
                names[id(fn.__globals__[name])] = name
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: a name assigned after the function was made
                continue
            if _is_tensor(value):
                names[id(value)] = name
    for name, value in (captured or {}).items():
        names[id(value)] = name
    return names


_PROXY_MODE: list = []  # the TorchFunctionMode class, made once torch is imported


def _proxy_mode() -> Any:
    """A torch function mode that sends torch calls taking a proxy to the tracer: a tensor subclass whose own
    __torch_function__ is disabled (FakeTensor) would otherwise index itself with the proxy (`fake_table[h]`). A null
    context where torch is not imported (no tensor can be captured then)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return contextlib.nullcontext()
    if not _PROXY_MODE:
        class ProxyCalls(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                kwargs = kwargs or {}
                if any(isinstance(a, (_Proxy, _View)) for a in _walk((args, kwargs))):
                    return _Proxy.__torch_function__(func, types, args, kwargs)
                return func(*args, **kwargs)

        _PROXY_MODE.append(ProxyCalls)
    return _PROXY_MODE[0]()


def _trace(fn: Callable, kind: str, captured: dict[str, Any] | None) -> Modifier:
    tracer = _Tracer(kind, _closure_names(fn, captured))
    inputs = SCORE_INPUTS if kind == "score" else MASK_INPUTS
    proxies = [tracer.wrap(Node("input", (), "float" if n == "score" else "int", n)) for n in inputs]
    with _TRACE_LOCK:  # builtins.min/max take proxies while tracing; the wrappers pass anything else through
        builtins.min, builtins.max = _min, _max
        try:
            with _proxy_mode():
                out = fn(*proxies)
        except ModifierError:
            raise
        except Exception as e:
            raise ModifierError(f"{kind}_mod could not be traced: {type(e).__name__}: {e}") from e
        finally:
            builtins.min, builtins.max = _BUILTIN_MIN, _BUILTIN_MAX
    root = tracer.lift(out)
    if kind == "score":
        if root.type == "bool":
            raise ModifierError("score_mod returns a boolean; a mask belongs in mask_mod")
        root = _unary(kind, "to_float", root)
    elif root.type != "bool":
        raise ModifierError(f"mask_mod returns a {root.type} value; it must return a boolean (true: keep)")
    descs = tuple(Captured(tracer.names.get(id(t), f"tensor{i}"), f"{kind}_mod_t{i}",
                           str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()),
                           index_layout(tuple(t.shape), tuple(t.stride())))
                  for i, t in enumerate(tracer.tensors))
    source = canonical(root)
    grad_root = derivative(root) if kind == "score" else None
    return register(Modifier(kind, emit(root, descs), descs, source, _digest(kind, source, descs),
                             emit(grad_root, descs) if grad_root is not None else None, root, grad_root,
                             tuple(tracer.tensors),
                             emit(root, descs, narrow=True) if any(c.layout for c in descs) else ""))


def _digest(kind: str, source: str, captured: tuple[Captured, ...]) -> str:
    text = "\n".join([kind, source] + [f"{c.dtype}/{c.rank}" + (f"/{c.layout}" if c.layout else "") for c in captured])
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


# ------------------------------------------------------------------------------------------------ canonical text

def canonical(root: Node) -> str:
    """The graph as numbered lines, shared subexpressions once, captured tensors by position (never by name)."""
    ids: dict[Node, int] = {}
    lines: list[str] = []

    def visit(node: Node) -> int:
        if node in ids:
            return ids[node]
        args = [visit(a) for a in node.args]
        if node.op == "const":
            what = f"const {node.value!r}"
        elif node.op == "input":
            what = f"input {node.value}"
        elif node.op == "read":
            what = f"read t{node.value}[{', '.join(f'%{a}' for a in args)}]"
        else:
            what = f"{node.op} {' '.join(f'%{a}' for a in args)}"
        ids[node] = len(lines)
        lines.append(f"%{len(lines)} = {what} : {node.type}")
        return ids[node]

    result = visit(root)
    return "\n".join(lines + [f"return %{result}"])


# ------------------------------------------------------------------------------------------------------ CUDA text

def _float_literal(v: float) -> str:
    if math.isnan(v):
        return "__int_as_float(0x7fffffff)"
    if math.isinf(v):
        return "__int_as_float(0x7f800000)" if v > 0 else "(-__int_as_float(0x7f800000))"
    text = repr(float(v)) + "f"
    return f"({text})" if text.startswith("-") else text


def _int_literal(v: int) -> str:
    text = f"{v}LL" if abs(v) >= 2**31 - 1 else str(v)
    return f"({text})" if v < 0 else text


def _exact_enough_inverse(node: Node) -> float | None:
    """1 / node for a constant divisor whose inverse is a normal float; None otherwise."""
    if node.op != "const" or isinstance(node.value, bool) or not node.value:
        return None
    inverse = 1.0 / float(node.value)
    return inverse if math.isfinite(inverse) and 2.0**-126 <= abs(inverse) <= 2.0**127 else None


def _positive_constant(node: Node) -> bool:
    return node.op == "const" and node.value > 0


# split: a tile's row and key as a runtime base plus an offset the unrolled loop knows (q_idx = qb + qo, kv_idx = kb +
# ko); an index's float as the float of its base part plus that of a constant is exact while both stay below 2^24 (the
# kernel takes the split expression only where its lengths are below SPLIT_LENGTH_LIMIT; _index_affine bounds the rest).
SPLIT_INPUTS = {"q_idx": ("qb", "qo"), "kv_idx": ("kb", "ko")}
SPLIT_LENGTH_LIMIT = 2**22
SPLIT_CONSTANT_LIMIT = 2**22


def _index_affine(node: Node) -> tuple[int, int, int] | None:
    """(a, b, c) where the int node is exactly a * q_idx + b * kv_idx + c with a, b in {-1, 0, 1} and |c| below
    SPLIT_CONSTANT_LIMIT (then |value| < 3 * 2^22 for lengths below SPLIT_LENGTH_LIMIT: exact in a float); else None."""
    if node.type != "int":
        return None
    op, args = node.op, node.args
    out: tuple[int, int, int] | None = None
    if op == "const" and not isinstance(node.value, bool):
        out = (0, 0, int(node.value))
    elif op == "input":
        out = {"q_idx": (1, 0, 0), "kv_idx": (0, 1, 0)}.get(node.value)
    elif op in ("add", "sub") and all(a.type == "int" for a in args):
        x, y = _index_affine(args[0]), _index_affine(args[1])
        if x is not None and y is not None:
            sign = 1 if op == "add" else -1
            out = (x[0] + sign * y[0], x[1] + sign * y[1], x[2] + sign * y[2])
    elif op == "neg":
        x = _index_affine(args[0])
        out = None if x is None else (-x[0], -x[1], -x[2])
    elif op == "to_int":
        out = _index_affine(args[0])
    if out is None or abs(out[0]) > 1 or abs(out[1]) > 1 or abs(out[2]) >= SPLIT_CONSTANT_LIMIT:
        return None
    return out


def _split_float(a: int, b: int, c: int) -> str:
    """float(a * q_idx + b * kv_idx + c) as the float of its runtime part plus that of its unrolled offset."""
    def terms(q: str, kv: str, const: int) -> str:
        signed = sorted(((k, name) for k, name in ((a, q), (b, kv), (const, str(abs(const)))) if k),
                        key=lambda t: t[0] < 0)  # positive terms first
        text = " ".join(f"{'-' if k < 0 else '+'} {name}" for k, name in signed)
        return "0" if not text else text[2:] if text.startswith("+ ") else f"0 {text}"
    return f"(static_cast<float>({terms('qb', 'kb', c)}) + static_cast<float>({terms('qo', 'ko', 0)}))"


def emit(root: Node, captured: tuple[Captured, ...] = (), narrow: bool = False, split: bool = False) -> str:
    """The CUDA expression of the graph, fully parenthesized; `narrow`: reads of captured tensors whose layout
    allows it at 32-bit offsets (Captured.layout), else all offsets in 64 bits. `split`: q_idx and kv_idx as bases
    and unrolled offsets (SPLIT_INPUTS), unclamped: reads at 64-bit offsets whose unit strides are not multiplied, so
    the compiler folds each score's offset into its load, and the float of an index difference (ALiBi's kv_idx - q_idx)
    one conversion per row (_split_float)."""
    memo: dict[tuple[Node, str, bool], str] = {}

    def as_type(node: Node, t: str, wide: bool = False) -> str:
        key = (node, t, wide)
        if key in memo:
            return memo[key]
        if node.op == "const":
            v = node.value
            text = (_float_literal(float(v)) if t == "float" else _int_literal(int(v)) if t == "int"
                    else ("true" if v else "false"))
        elif split and t == "float" and node.type == "int" and (affine := _index_affine(node)) and affine[:2] != (0, 0):
            text = _split_float(*affine)
        else:
            text = raw(node, wide)
            if node.type != t:
                text = (f"static_cast<float>({text})" if t == "float" else f"static_cast<long long>({text})"
                        if t == "int" else f"({text} != 0)")
        if len(text) > MAX_EXPR_CHARS:
            raise ModifierError(f"the modifier's CUDA expression passes {MAX_EXPR_CHARS} characters (each use of a "
                                "shared subexpression is written out in full); simplify the function")
        memo[key] = text
        return text

    def ring(node: Node) -> str:
        """An index's value modulo 2^32, as unsigned: sums, differences and products of ints in 32-bit arithmetic
        (exact modulo 2^32 whatever the intermediate values), anything else computed as a 64-bit int and cut."""
        op, args = node.op, node.args
        if node.type == "int":
            if op == "const":
                return f"{int(node.value) % 2**32}u"
            if op == "input":
                return f"static_cast<unsigned>({node.value})"
            if op in ARITH and all(a.type == "int" for a in args):
                return f"({ring(args[0])} {ARITH[op]} {ring(args[1])})"
            if op == "neg" and args[0].type == "int":
                return f"(0u - {ring(args[0])})"
        return f"static_cast<unsigned>({as_type(node, 'int', True)})"

    def raw(node: Node, wide: bool) -> str:
        op, args = node.op, node.args
        if op == "input":  # inside a captured read's index, all arithmetic is 64-bit
            if split and node.value in SPLIT_INPUTS:
                base, off = SPLIT_INPUTS[node.value]
                return f"(static_cast<long long>({base}) + {off})" if wide else f"({base} + {off})"
            return f"static_cast<long long>({node.value})" if wide and node.type == "int" else node.value
        if op == "read":
            c = captured[node.value]
            if split:  # 64-bit, unit strides unmultiplied: a score's unrolled offset becomes the load's immediate
                classes = c.layout or "s" * len(args)
                offset = " + ".join(as_type(a, "int", True) if cls == "1" else
                                    f"{as_type(a, 'int', True)} * {c.arg}_s{k}"
                                    for k, (a, cls) in enumerate(zip(args, classes)) if cls != "0") or "0LL"
            elif narrow and c.layout:  # every element below 2^31: the offset modulo 2^32 is the offset
                offset = " + ".join(ring(a) if cls == "1" else f"{ring(a)} * static_cast<unsigned>({c.arg}_s{k})"
                                    for k, (a, cls) in enumerate(zip(args, c.layout)) if cls != "0") or "0u"
            else:
                offset = " + ".join(f"{as_type(a, 'int', True)} * {c.arg}_s{k}"
                                    for k, a in enumerate(args)) or "0"
            element = f"{c.arg}[({offset})]" if args else f"{c.arg}[0]"
            return {"float": f"static_cast<float>({element})", "int": f"static_cast<long long>({element})",
                    "bool": f"({element})"}[node.type]
        if op in ARITH:
            t = node.type
            return f"({as_type(args[0], t, wide)} {ARITH[op]} {as_type(args[1], t, wide)})"
        if op == "truediv":
            inverse = _exact_enough_inverse(args[1])
            if inverse is not None:  # an IEEE division costs a subroutine's fast path; a product is within an ulp
                return f"({as_type(args[0], 'float', wide)} * {_float_literal(inverse)})"
            return f"({as_type(args[0], 'float', wide)} / {as_type(args[1], 'float', wide)})"
        if op == "floordiv":  # Python's floor division: C++'s truncates toward zero
            a, b = as_type(args[0], "int", wide), as_type(args[1], "int", wide)
            if _positive_constant(args[1]):
                return f"(({a} - ((({a} % {b}) + {b}) % {b})) / {b})"
            return f"(({a} / {b}) - ((({a} % {b}) != 0) && (({a} < 0) != ({b} < 0))))"
        if op == "mod":  # Python's remainder takes the divisor's sign
            a, b = as_type(args[0], "int", wide), as_type(args[1], "int", wide)
            if _positive_constant(args[1]):
                return f"((({a} % {b}) + {b}) % {b})"
            r = f"({a} % {b})"
            return f"({r} + ((({r} != 0) && (({r} < 0) != ({b} < 0))) ? {b} : 0))"
        if op in COMPARE:
            t = "bool" if args[0].type == args[1].type == "bool" else _common(args[0].type, args[1].type)
            return f"({as_type(args[0], t, wide)} {COMPARE[op]} {as_type(args[1], t, wide)})"
        if op in LOGIC:
            return f"({as_type(args[0], 'bool', wide)} {LOGIC[op]} {as_type(args[1], 'bool', wide)})"
        if op == "not":
            return f"(!{as_type(args[0], 'bool', wide)})"
        if op == "neg":
            return f"(-{as_type(args[0], node.type, wide)})"
        if op == "where":
            t = node.type
            return f"({as_type(args[0], 'bool', wide)} ? {as_type(args[1], t, wide)} : {as_type(args[2], t, wide)})"
        if op in FLOAT_FNS:
            return f"{FLOAT_FNS[op]}({as_type(args[0], 'float', wide)})"
        if op == "abs":
            x = as_type(args[0], node.type, wide)
            return f"fabsf({x})" if node.type == "float" else f"(({x} < 0) ? (-{x}) : {x})"
        if op in ("minimum", "maximum"):
            a, b = as_type(args[0], node.type, wide), as_type(args[1], node.type, wide)
            if node.type == "float":
                return f"{'fminf' if op == 'minimum' else 'fmaxf'}({a}, {b})"
            return f"(({a} {'<' if op == 'minimum' else '>'} {b}) ? {a} : {b})"
        if op in ("to_float", "to_int", "to_bool"):
            return as_type(args[0], node.type, wide)
        raise AssertionError(op)

    return as_type(root, root.type)


# ------------------------------------------------------------------------------------------------ d/d score

def _fold(op: str, *args: Node) -> Node:
    """A float node for the derivative, with the zeros and ones of the chain rule folded away."""
    a = args[0]
    if op == "add":
        return args[1] if a == ZERO else a if args[1] == ZERO else Node("add", args, "float")
    if op == "sub":
        return a if args[1] == ZERO else _fold("neg", args[1]) if a == ZERO else Node("sub", args, "float")
    if op == "mul":
        if ZERO in args:
            return ZERO
        return args[1] if a == ONE else a if args[1] == ONE else Node("mul", args, "float")
    if op == "truediv":
        return ZERO if a == ZERO else Node("truediv", args, "float")
    if op == "neg":
        return ZERO if a == ZERO else Node("neg", args, "float")
    if op == "where":
        return ZERO if args[1] == args[2] == ZERO else Node("where", args, "float")
    raise AssertionError(op)


def derivative(root: Node) -> Node:
    """d root / d score, a float node (ZERO where root does not depend on the score)."""
    memo: dict[Node, Node] = {}

    def d(node: Node) -> Node:
        if node in memo:
            return memo[node]
        memo[node] = out = rule(node)
        return out

    def rule(node: Node) -> Node:
        op, args = node.op, node.args
        if node.type != "float" or op in ("const", "read"):
            return ZERO
        if op == "input":
            return ONE if node.value == "score" else ZERO
        if op in ("add", "sub"):
            return _fold(op, d(args[0]), d(args[1]))
        if op == "mul":
            return _fold("add", _fold("mul", d(args[0]), args[1]), _fold("mul", args[0], d(args[1])))
        if op == "truediv":
            da, db = d(args[0]), d(args[1])
            quotient = _fold("truediv", da, args[1])
            if db == ZERO:
                return quotient
            return _fold("sub", quotient, _fold("truediv", _fold("mul", node, db), args[1]))
        if op == "neg":
            return _fold("neg", d(args[0]))
        if op == "where":
            return _fold("where", args[0], d(args[1]), d(args[2]))
        if op == "to_float":
            return d(args[0])
        dx = d(args[0])
        if dx == ZERO and op not in ("minimum", "maximum"):
            return ZERO
        if op == "exp":
            return _fold("mul", node, dx)
        if op == "exp2":
            return _fold("mul", _fold("mul", node, _const(LN2)), dx)
        if op == "log":
            return _fold("truediv", dx, args[0])
        if op == "tanh":
            return _fold("mul", Node("sub", (ONE, Node("mul", (node, node), "float")), "float"), dx)
        if op == "abs":
            return _fold("where", Node("gt", (args[0], ZERO), "bool"), dx,
                         _fold("where", Node("lt", (args[0], ZERO), "bool"), _fold("neg", dx), ZERO))
        if op in ("minimum", "maximum"):  # torch's rule: a tie splits the gradient in two
            da, db = dx, d(args[1])
            if da == db == ZERO:
                return ZERO
            first = Node("lt" if op == "minimum" else "gt", (args[0], args[1]), "bool")
            second = Node("lt" if op == "minimum" else "gt", (args[1], args[0]), "bool")
            half = _fold("mul", _const(0.5), _fold("add", da, db))
            return _fold("where", first, da, _fold("where", second, db, half))
        raise AssertionError(op)

    return d(root)


# ------------------------------------------------------------------------------------------------ host reference

def _evaluate(root: Node, inputs: dict[str, Any], tensors: tuple) -> Any:
    import torch  # noqa: PLC0415  (torch is optional; only the host reference needs it)
    dtypes = {"float": torch.float32, "int": torch.int64, "bool": torch.bool}
    values = {name: torch.as_tensor(v, dtype=torch.float32 if name == "score" else torch.int64)
              for name, v in inputs.items()}
    device = next(iter(values.values())).device
    values = {name: v.to(device) for name, v in values.items()}
    memo: dict[tuple[Node, str], Any] = {}

    def as_type(node: Node, t: str) -> Any:
        key = (node, t)
        if key not in memo:
            x = torch.tensor(node.value, dtype=dtypes[t], device=device) if node.op == "const" else run(node)
            memo[key] = x if node.op == "const" else (x != 0 if t == "bool" and x.dtype != torch.bool
                                                      else x.to(dtypes[t]))
        return memo[key]

    def run(node: Node) -> Any:
        op, args, t = node.op, node.args, node.type
        if op == "input":
            return values[node.value]
        if op == "read":
            tensor = tensors[node.value]
            index = tuple(as_type(a, "int").to(tensor.device) for a in args)
            x = tensor[index] if index else tensor
            return (x != 0 if t == "bool" and x.dtype != torch.bool else x.to(dtypes[t])).to(device)
        if op in ("add", "sub", "mul"):
            a, b = as_type(args[0], t), as_type(args[1], t)
            return a + b if op == "add" else a - b if op == "sub" else a * b
        if op == "truediv":
            return as_type(args[0], "float") / as_type(args[1], "float")
        if op == "floordiv":
            return torch.div(as_type(args[0], "int"), as_type(args[1], "int"), rounding_mode="floor")
        if op == "mod":
            return torch.remainder(as_type(args[0], "int"), as_type(args[1], "int"))
        if op in COMPARE:
            c = "bool" if args[0].type == args[1].type == "bool" else _common(args[0].type, args[1].type)
            return getattr(torch, op)(as_type(args[0], c), as_type(args[1], c))
        if op in LOGIC:
            return getattr(torch, f"logical_{op}")(as_type(args[0], "bool"), as_type(args[1], "bool"))
        if op == "not":
            return torch.logical_not(as_type(args[0], "bool"))
        if op == "neg":
            return -as_type(args[0], t)
        if op == "where":
            return torch.where(as_type(args[0], "bool"), as_type(args[1], t), as_type(args[2], t))
        if op in FLOAT_FNS:
            return getattr(torch, op)(as_type(args[0], "float"))
        if op == "abs":
            return torch.abs(as_type(args[0], t))
        if op in ("minimum", "maximum"):
            return getattr(torch, op)(as_type(args[0], t), as_type(args[1], t))
        if op in ("to_float", "to_int", "to_bool"):
            return as_type(args[0], t)
        raise AssertionError(op)

    out = as_type(root, root.type)
    shape = torch.broadcast_shapes(*(v.shape for v in values.values()))
    return out.expand(shape) if out.shape != shape else out
