"""The kernels' argument blocks, written once as data.

Every kernel takes one struct by value. Each struct is described here, field by field, and everything else is
generated from that description: the C++ struct the templates and exported headers declare (with `static_assert`s
of its size and offsets), the `struct` format the launchers pack, the offsets of the fields, and the positions of
the pointer fields that a launcher fills per call. The layout follows the C rules nvcc uses: each field at the
next multiple of its alignment, the struct padded to the largest alignment of its members.
"""
from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass

# C type -> (struct code, size, alignment). Pointers and int64 are 8 bytes on every target the kernels run on.
_SCALARS: dict[str, tuple[str, int, int]] = {
    "ptr": ("Q", 8, 8),
    "int64_t": ("q", 8, 8),
    "int": ("i", 4, 4),
    "float": ("f", 4, 4),
    "CUtensorMap": ("128s", 128, 128),  # opaque; cuda.h aligns it to 128 bytes
}


@dataclass(frozen=True)
class Line:
    """One declaration line: a C++ type, the names it declares, and a comment for the reader."""

    ctype: str  # a C++ pointer type ("const void*"), a scalar of _SCALARS, or a Block's name
    names: tuple[str, ...]
    comment: str = ""

    @property
    def kind(self) -> str:
        return "ptr" if self.ctype.endswith("*") else self.ctype


@dataclass(frozen=True)
class Field:
    """A scalar in the flattened struct: its dotted path, C kind, byte offset and struct code."""

    path: str
    kind: str
    offset: int
    code: str


@dataclass(frozen=True)
class Block:
    """A kernel argument struct: its C++ name, include guard, leading comment lines and declaration lines."""

    name: str
    guard: str
    doc: tuple[str, ...]
    lines: tuple[Line, ...]

    def _member(self, line: Line) -> Block | None:
        return BLOCKS.get(line.ctype)

    @functools.cached_property
    def align(self) -> int:
        return max(b.align if (b := self._member(ln)) else _SCALARS[ln.kind][2] for ln in self.lines)

    @functools.cached_property
    def fields(self) -> tuple[Field, ...]:
        """Every scalar, nested blocks flattened, in memory order."""
        out: list[Field] = []
        offset = 0
        for ln in self.lines:
            for name in ln.names:
                nested = self._member(ln)
                if nested is not None:
                    offset = _round_up(offset, nested.align)
                    out += [Field(f"{name}.{f.path}", f.kind, offset + f.offset, f.code) for f in nested.fields]
                    offset += nested.size
                    continue
                code, size, align = _SCALARS[ln.kind]
                offset = _round_up(offset, align)
                out.append(Field(name, ln.kind, offset, code))
                offset += size
        return tuple(out)

    @functools.cached_property
    def size(self) -> int:
        last = self.fields[-1]
        return _round_up(last.offset + _SCALARS[last.kind][1], self.align)

    def offset(self, path: str) -> int:
        """Byte offset of a field ("cu_seqlens_q", or "p.batch" inside a nested block)."""
        return self._by_path[path].offset

    def index(self, path: str) -> int:
        """Position of a field among the values `struct` packs."""
        return self._positions[path]

    @functools.cached_property
    def _by_path(self) -> dict[str, Field]:
        return {f.path: f for f in self.fields}

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        return {f.path: i for i, f in enumerate(self.fields)}

    @functools.cached_property
    def pointers(self) -> tuple[int, ...]:
        """Positions of the pointer fields among the packed values."""
        return tuple(i for i, f in enumerate(self.fields) if f.kind == "ptr")

    def format(self, start: str | None = None) -> str:
        """The `struct` format of the fields from `start` (default: the first) to the end, padding included."""
        fields = self.fields[self.index(start):] if start else self.fields
        codes: list[str] = []
        at = fields[0].offset
        for f in fields:
            if f.offset > at:
                codes.append(f"{f.offset - at}x")
            codes.append(f.code)
            at = f.offset + _SCALARS[f.kind][1]
        if self.size > at:
            codes.append(f"{self.size - at}x")
        return "=" + _run_length(codes)

    @functools.cached_property
    def struct(self) -> struct.Struct:
        """Packs the whole block from its flattened values (CUtensorMaps as 128 bytes each)."""
        return struct.Struct(self.format())

    def tail(self, start: str) -> struct.Struct:
        """Packs the fields from `start` to the end: for a launcher that joins bytes it already holds (tensor
        maps, a nested block) with the rest."""
        return struct.Struct(self.format(start))

    def ctypes_type(self) -> type[ctypes.Structure]:
        """A ctypes mirror (for code that builds a block field by field; the launchers pack `struct`)."""
        kinds = {"ptr": ctypes.c_void_p, "int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
        return type(self.name, (ctypes.Structure,), {"_fields_": [(f.path, kinds[f.kind]) for f in self.fields]})

    def cpp(self) -> str:
        """The C++ declaration, guarded, with static_asserts that keep it equal to this description."""
        width = min(40, max((len(_decl(ln)) for ln in self.lines if ln.comment), default=0))
        body = [f"    {_decl(ln):<{width}}  // {ln.comment}" if ln.comment else f"    {_decl(ln)}" for ln in self.lines]
        checks = [f"sizeof({self.name}) == {self.size}"] + [  # the first field of each line places the rest
            f"__builtin_offsetof({self.name}, {ln.names[0]}) == {self.offset(ln.names[0])}"
            for ln in self.lines if self._member(ln) is None and ln.kind != "CUtensorMap"]
        return "\n".join([
            f"#ifndef {self.guard}", f"#define {self.guard}", *(f"// {d}" for d in self.doc),
            f"struct {self.name} {{", *body, "};",
            "static_assert(" + " &&\n              ".join(checks) + ",",
            f'              "{self.name} disagrees with flashgen/abi.py");',
            "#endif"])


def _decl(ln: Line) -> str:
    return f"{ln.ctype} {', '.join(ln.names)};"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _run_length(codes: list[str]) -> str:
    """["Q", "Q", "i"] -> "2Qi"; counted codes ("4x", "128s") stand alone."""
    out: list[str] = []
    run, count = "", 0
    for code in codes + [""]:
        if code == run and len(code) == 1:
            count += 1
            continue
        if run:
            out.append(f"{count if count > 1 else ''}{run}")
        run, count = code, 1
    return "".join(out)


def _strides(*tensors: str) -> tuple[Line, ...]:
    return tuple(Line("int64_t", tuple(f"{t}_{s}_stride" for s in ("batch", "row", "head"))) for t in tensors)


_WINDOW = Line("int", ("window_left", "window_right"),
               "keys i + shift - left .. i + shift + right are seen; -1: unbounded")
_SOFTCAP = "softcap: S = tanh(S * softcap_pre); scale_log2 is then softcap * log2(e)"
_MAPS = Line("CUtensorMap", ("tm_q", "tm_k", "tm_v"))
# Last in its blocks: the fields before it keep their offsets, so kernels without sinks are unchanged.
_SINKS = Line("const float*", ("sinks",), "(heads) fp32 attention-sink logits (score units); read only with sinks")

FWD = Block("FwdParams", "FLASHGEN_FWD_PARAMS", (
    "Runtime arguments of every forward kernel, passed by value. Strides are in elements;",
    "the last dimension of q, k, v and o is contiguous. lse is (batch, heads, seqlen_q) fp32."), (
    Line("const void*", ("q",)), Line("const void*", ("k",)), Line("const void*", ("v",)),
    Line("void*", ("o",)),
    Line("float*", ("lse",), "may be null: no LSE is written"),
    *_strides("q", "k", "v", "o"),
    Line("int", ("batch", "heads", "heads_k", "seqlen_q", "seqlen_k")),
    Line("float", ("softmax_scale",), "applied to q.k; any finite value (<= 0 included)"),
    Line("float", ("scale_log2",),
         "|softmax_scale| * log2(e) (log2(e) when softmax_scale is 0): softmax runs on exp2"),
))

SERVE = Block("ServeParams", "FLASHGEN_SERVE_PARAMS", (
    "Runtime arguments of forward kernels with serving features: FwdParams, then what varlen",
    "batches, KV caches, split-KV and score modifiers add. A feature the kernel was not generated",
    "with leaves its fields unread. In FwdParams, seqlen_q and seqlen_k are the longest sequence",
    "(varlen) or the cache length (paged: unused)."), (
    Line("FwdParams", ("f",)),
    Line("const int*", ("cu_seqlens_q",), "(batch + 1) offsets into the packed q and o; null: q is (batch, seqlen_q, ...)"),
    Line("const int*", ("cu_seqlens_k",), "(batch + 1) offsets into the packed k and v; null: per-batch strides"),
    Line("const int*", ("seqused_k",), "(batch) keys each sequence uses (KV cache lengths); null: all of them"),
    Line("const int*", ("block_table",), "paged K/V: (batch, max_pages) page indices; k_batch_stride is the page stride"),
    Line("const float*", ("alibi_slopes",), "(heads) or (batch, heads) fp32"),
    Line("float*", ("o_accum",), "split-KV partial outputs: (num_splits, total_rows, heads, head_dim) fp32"),
    Line("float*", ("lse_accum",), "split-KV partial LSEs: (num_splits, total_rows, heads) fp32"),
    Line("int64_t", ("block_table_stride",), "elements between rows of block_table"),
    Line("int64_t", ("alibi_batch_stride",), "0: one slope per head for every sequence"),
    Line("int64_t", ("lse_batch_stride", "lse_head_stride"),
         "lse[batch * bs + head * hs + row]; varlen: bs = 0, row counts from cu_seqlens_q[batch]"),
    Line("int", ("total_rows",), "rows of o_accum: total_q (varlen) or batch * seqlen_q"),
    Line("int", ("page_size",), "keys per page"),
    Line("int", ("num_splits",), "key ranges per row block (split-KV)"),
    _WINDOW,
    Line("float", ("softcap_pre",), _SOFTCAP),
    # Bounds of the index inputs: a sequence whose offsets, length or pages fall outside them reads and
    # writes nothing outside the buffers; its rows become NaN and the error word names it.
    Line("int", ("num_pages",), "paged: pages in the cache (block_table entries lie in [0, num_pages))"),
    Line("int", ("k_capacity",), "keys a sequence can hold: seqused_k <= k_capacity (contiguous or paged cache)"),
    Line("int", ("total_q", "total_k"), "varlen: rows of the packed q and k (cu_seqlens_q/_k end at or below them)"),
    Line("unsigned long long*", ("error",),
         "null, or a word set once to (code << 32) | sequence at the first bad input (SERVE_INPUTS)"),
    _SINKS,
    # Last: the fields before it keep their offsets, so kernels without a fused combine are unchanged.
    Line("int*", ("tile_counts",),
         "split-KV with the combine fused in: one arrival counter per row block, zero between launches"),
))

MOD_TENSOR = Block("ModTensor", "FLASHGEN_MOD_TENSOR", (
    "A tensor a score_mod or mask_mod reads (flashgen/modifiers.py): its data and strides in",
    "elements (a dimension past the tensor's rank: 0)."), (
    Line("const void*", ("ptr",)), Line("int64_t", ("s0", "s1", "s2", "s3")),
))

SERVE_MOD = Block("ServeModParams", "FLASHGEN_SERVE_MOD_PARAMS", (
    "Runtime arguments of a serving forward kernel generated with a score_mod, mask_mod or block map: ServeParams,",
    "then the tensors the modifiers read, score_mod's first, in the order they were captured (unused: null),",
    "then a kernel with a block map's lists (flashgen/blockmap.py; without one: null)."), (
    Line("ServeParams", ("s",)), Line("ModTensor", ("t0", "t1", "t2", "t3")),
    Line("ModTensor", ("map_num",), "int32 (batch, heads, m-blocks, 2): partial and full key tiles of a row block"),
    Line("ModTensor", ("map_idx",), "int32 (batch, heads, m-blocks, key tiles): their indices, partial first"),
))

# The index inputs the serving kernels check, by code (1-based; 0 in the error word: no error).
SERVE_INPUTS = ("block_table", "cache_seqlens", "cu_seqlens_q", "cu_seqlens_k")

BWD = Block("BwdParams", "FLASHGEN_BWD_PARAMS", (
    "Runtime arguments of every backward kernel, passed by value. Strides are in elements; the last",
    "dimension of every tensor is contiguous. q, o, dout, dq: (batch, seqlen_q, heads, head_dim);",
    "k, v, dk, dv: (batch, seqlen_k, heads_k, head_dim)."), (
    Line("const void*", ("q",)), Line("const void*", ("k",)), Line("const void*", ("v",)),
    Line("const void*", ("o",)), Line("const void*", ("dout",)),
    Line("const float*", ("lse",), "(batch, heads, seqlen_q) fp32, the forward's (+inf: the row saw no key)"),
    Line("float*", ("delta",), "(batch, heads, seqlen_q) fp32: D = rowsum(dO * O), written by _pre"),
    Line("float*", ("dq_accum",),
         "(batch, seqlen_q, heads, head_dim) fp32, contiguous: dQ summed by atomics (null if deterministic)"),
    Line("void*", ("dq",)), Line("void*", ("dk",)), Line("void*", ("dv",)),
    Line("float*", ("dk_accum",), "GQA/MQA: (batch, seqlen_k, heads, head_dim) fp32 per query head, contiguous,"),
    Line("float*", ("dv_accum",), "summed over each group by the host; null: dk, dv are written directly"),
    *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
    Line("int", ("batch", "heads", "heads_k", "seqlen_q", "seqlen_k")),
    Line("float", ("softmax_scale",), "> 0"),
    Line("float", ("scale_log2",), "softmax_scale * log2(e): P = exp2(S * scale_log2 - LSE * log2(e))"),
))

BWD_SERVE = Block("BwdServeParams", "FLASHGEN_BWD_SERVE_PARAMS", (
    "Runtime arguments of backward kernels with serving features: BwdParams, then what varlen",
    "batches and score modifiers add. Varlen: BwdParams describes one packed \"sequence\" of total_q",
    "rows and total_k keys (batch 1: its strides, the LSE, D and accumulator layouts), and the main",
    "kernels find each sequence through the offsets."), (
    Line("BwdParams", ("b",)),
    Line("const int*", ("cu_seqlens_q",), "(num_seqs + 1) offsets into the packed rows; null: b's batch strides"),
    Line("const int*", ("cu_seqlens_k",)),
    Line("const float*", ("alibi_slopes",), "(heads) or (num_seqs, heads) fp32"),
    Line("int64_t", ("alibi_batch_stride",), "0: one slope per head for every sequence"),
    _WINDOW,
    Line("float", ("softcap_pre",), "softcap: S = tanh(S * softcap_pre); b.scale_log2 is then softcap * log2(e)"),
    Line("int", ("num_seqs",), "sequences (blocks of the grids: tiles x heads x num_seqs)"),
    Line("int", ("max_seqlen_q", "max_seqlen_k"), "the longest sequence: tiles per (head, sequence)"),
))

BWD_SERVE_MOD = Block("BwdServeModParams", "FLASHGEN_BWD_SERVE_MOD_PARAMS", (
    "Runtime arguments of a backward generated with a score_mod, mask_mod or block map: BwdServeParams, then the",
    "forward's ModTensor slots (the same tensors in the same order), then with a block map its lists both ways."), (
    Line("BwdServeParams", ("s",)), Line("ModTensor", ("t0", "t1", "t2", "t3")),
    Line("ModTensor", ("map_num",), "int32 (batch, heads, m-blocks, 2): partial and full key tiles of a q tile (_dq)"),
    Line("ModTensor", ("map_idx",), "int32 (batch, heads, m-blocks, n-blocks): their indices, partial first"),
    Line("ModTensor", ("map_t_num",), "int32 (batch, heads, n-blocks, 2): partial and full q tiles of a key tile"),
    Line("ModTensor", ("map_t_idx",), "int32 (batch, heads, n-blocks, m-blocks): their indices, partial first"),
))

SM90_FWD = Block("Sm90FwdParams", "FLASHGEN_SM90_PARAMS", (
    "Hopper kernels also take TMA descriptors of q, k and v, each a 4-d map over",
    "(head_dim, seqlen, heads, batch) made on the host by cuTensorMapEncodeTiled."), (
    _MAPS, Line("FwdParams", ("p",)),
))

SM90_SERVE_FWD = Block("Sm90ServeFwdParams", "FLASHGEN_SM90_SERVE_FWD_PARAMS", (
    "Varlen and window. Varlen: FwdParams describes the packed tensors as one batch of total_q",
    "rows (its LSE (heads, total_q)); sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]."), (
    _MAPS, Line("FwdParams", ("p",)),
    Line("const int*", ("cu_seqlens_q",), "(num_seqs + 1) offsets into the packed q and o; null without varlen"),
    Line("const int*", ("cu_seqlens_k",)),
    _WINDOW,
    Line("int", ("num_seqs", "max_seqlen_q"), "the grid: m-blocks of the longest sequence x heads x num_seqs"),
    Line("unsigned long long*", ("error",),
         "null, or the word a sequence with offsets out of bounds is recorded in (as ServeParams.error)"),
    _SINKS,
))

SM90_SERVE_MOD_FWD = Block("Sm90ServeModFwdParams", "FLASHGEN_SM90_SERVE_MOD_FWD_PARAMS", (
    "Sm90ServeFwdParams's fields, then those of a kernel generated with a score_mod, mask_mod or block map: the",
    "tensors the modifiers read and the block map's lists, as in ServeModParams."), (
    *SM90_SERVE_FWD.lines, *SERVE_MOD.lines[1:],
))

FP8_DESCALE = Block("Fp8Descale", "FLASHGEN_FP8_DESCALE", (
    "FP8 descale factors (fp32) of one tensor: the factor of (batch, KV head) is",
    "ptr[batch * batch_stride + head_k * head_stride]; strides 0 give one factor per tensor."), (
    Line("const float*", ("ptr",)), Line("int64_t", ("batch_stride", "head_stride")),
))

SM90_FP8_FWD = Block("Sm90Fp8FwdParams", "FLASHGEN_SM90_FP8_PARAMS", (
    "Sm90FwdParams, then the descale factors of q, k and v. Kernels generated with v_t take tm_v over vt,",
    "(batch, heads_k, v's head_dim, keys rounded up to 16) e4m3, which their _vt kernel writes from v first."), (
    _MAPS, Line("FwdParams", ("p",)), Line("Fp8Descale", ("q_descale", "k_descale", "v_descale")),
    Line("void*", ("vt",), "v_t: V transposed, each 16 keys in P's register order (else null); last: offsets kept"),
))

SM90_BWD = Block("Sm90BwdParams", "FLASHGEN_SM90_BWD_PARAMS", (
    "Hopper's backward also takes TMA maps of q, k, v and dout (4-d over head_dim, seqlen, heads,",
    "batch) and LSE * log2(e) padded like D. Here delta is (batch, heads, seqlen_q_pad) and dq_accum",
    "(batch, heads, seqlen_q_pad, head_dim) fp32, each Q tile's part in the main kernel's register order.",
    "Varlen and window fields are read only by kernels generated with them. Varlen: BwdParams describes",
    "the packed tensors as one batch of total_q rows; sequence b's padded rows (LSE, D, dq_accum) start",
    "at (cu_seqlens_q[b] + b * BLOCK_M) rounded down to BLOCK_M, whole Q tiles apart from its neighbours'.",
    "Deterministic kernels: dq_semaphore has an int32 per BLOCK_M rows of delta (index: flat row / BLOCK_M),",
    "zeroed before the main kernel, which counts there the dQ parts added to that Q tile."), (
    Line("CUtensorMap", ("tm_q", "tm_k", "tm_v", "tm_do")), Line("BwdParams", ("p",)),
    Line("float*", ("lse2",), "(batch, heads, seqlen_q_pad): LSE * log2(e), +inf on padded rows"),
    Line("int", ("seqlen_q_pad",)),
    Line("const int*", ("cu_seqlens_q",), "(num_seqs + 1) offsets into the packed rows"),
    Line("const int*", ("cu_seqlens_k",)),
    _WINDOW,
    Line("int", ("num_seqs", "max_seqlen_q", "max_seqlen_k"),
         "the grids: tiles of the longest sequence x heads x num_seqs"),
    Line("int*", ("dq_semaphore",), "deterministic: int32 zeros, one per BLOCK_M rows of delta (else null)"),
))

SM90_MOD_BWD = Block("Sm90ModBwdParams", "FLASHGEN_SM90_MOD_BWD_PARAMS", (
    "Hopper's backward generated with a score_mod, mask_mod or block map: Sm90BwdParams, then the forward's",
    "ModTensor slots and lists, then the transposed lists, as in BwdServeModParams (the main kernel reads the",
    "transposed ones: the q tiles of each key tile), then the deterministic kernels' turns beside those."), (
    Line("Sm90BwdParams", ("b",)), *BWD_SERVE_MOD.lines[1:],
    Line("ModTensor", ("map_t_turn",), "int32 like map_t_idx: deterministic, each listed q tile's turn (blockmap.py)"),
))
BLOCKS: dict[str, Block] = {b.name: b for b in (FWD, SERVE, MOD_TENSOR, SERVE_MOD, BWD, BWD_SERVE, BWD_SERVE_MOD, SM90_FWD,
                                                 SM90_SERVE_FWD, SM90_SERVE_MOD_FWD, FP8_DESCALE, SM90_FP8_FWD,
                                                 SM90_BWD, SM90_MOD_BWD)}

__all__ = ["BLOCKS", "BWD", "BWD_SERVE", "BWD_SERVE_MOD", "Block", "FP8_DESCALE", "FWD", "Field", "Line", "MOD_TENSOR", "SERVE",
           "SERVE_INPUTS", "SERVE_MOD",
           "SM90_BWD", "SM90_FP8_FWD", "SM90_MOD_BWD", "SM90_FWD", "SM90_SERVE_FWD", "SM90_SERVE_MOD_FWD"]
