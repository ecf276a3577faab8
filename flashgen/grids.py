"""Every kernel's launch grid, written once.

Each grid is one expression over the launch's sizes and the kernel's compile-time constants (BLOCK_M, PACK_GQA,
...), in a syntax both Python and C++ read: integer helpers (cdiv, idiv, imin, imax, even_up, pick) and + - * %.
The launchers evaluate it in Python; exported launch headers get it as an inline C++ function (with CPP_HELPERS
above it). All grids are flat: the kernels unfold blockIdx.x into (tile, head, batch[, split]), so batch and
heads may pass gridDim.y's 65535.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

CPP_HELPERS = """\
// Grid arithmetic in 64 bits: no int32 size overflows it.
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t idiv(int64_t a, int64_t b) { return a / b; }
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t even_up(int64_t a) { return a + (a & 1); }
inline int64_t pick(bool c, int64_t a, int64_t b) { return c ? a : b; }"""

_HELPERS: dict[str, Callable] = {
    "cdiv": lambda a, b: -(-a // b),
    "idiv": lambda a, b: a // b,
    "imin": min,
    "imax": max,
    "even_up": lambda a: a + (a & 1),
    "pick": lambda c, a, b: a if c else b,
}


@dataclass(frozen=True)
class Grid:
    """gridDim.x of one kernel: `expr` over the runtime sizes `args` and the kernel's constants."""

    args: tuple[str, ...]
    expr: str
    doc: str

    def bind(self, **consts: int | bool) -> Callable[..., int]:
        """The grid as a Python function of `args`, with the kernel's constants fixed."""
        return _bound(self, tuple(sorted(consts.items())))

    def cpp(self, name: str) -> str:
        """The grid as an inline C++ function (the header defines the constants and CPP_HELPERS)."""
        params = ", ".join(f"int {a}" for a in self.args)
        return f"// {self.doc}\ninline unsigned {name}({params}) {{ return (unsigned)({self.expr}); }}"


@functools.lru_cache(maxsize=4096)
def _bound(grid: Grid, consts: tuple[tuple[str, int | bool], ...]) -> Callable[..., int]:
    return eval(f"lambda {', '.join(grid.args)}: {grid.expr}", {**_HELPERS, **dict(consts)})  # noqa: S307


def persistent(grid: Grid, cluster: bool = False) -> Grid:
    """One CTA per SM, fewer if fewer tiles (2-CTA clusters: an even count, at least one cluster)."""
    ctas = "imax(2, sm_count - sm_count % 2)" if cluster else "sm_count"
    return Grid(grid.args + ("sm_count",), f"imin({grid.expr}, {ctas})",
                "Persistent: one CTA per SM, fewer if fewer tiles; each CTA walks the tiles. " + grid.doc)


# The forward: m-blocks x heads x batch.
FWD = Grid(("seqlen_q", "heads", "batch"), "cdiv(seqlen_q, BLOCK_M) * heads * batch",
           "m-blocks x heads x batch.")
FWD_CLUSTER = Grid(("seqlen_q", "heads", "batch"), "even_up(cdiv(seqlen_q, BLOCK_M)) * heads * batch",
                   "m-blocks rounded up to pairs (2-CTA clusters on neighbouring m-blocks) x heads x batch.")
FWD_PACKED = Grid(("seqlen_q", "heads", "heads_k", "batch"),
                  "cdiv(seqlen_q, idiv(BLOCK_M, idiv(heads, heads_k))) * heads_k * batch",
                  "pack_gqa: tiles of BLOCK_M / group whole query positions x KV heads x batch.")

# The sm80 serving kernel: m-blocks (packed (row, head) pairs with PACK_GQA) x heads (KV heads) x batch x splits,
# and the split-KV combine: a warp per (row, head).
SERVE = Grid(("seqlen_q", "heads", "heads_k", "batch", "num_splits"),
             "cdiv(seqlen_q * pick(PACK_GQA, idiv(heads, heads_k), 1), BLOCK_M) * pick(PACK_GQA, heads_k, heads)"
             " * batch * pick(SPLIT, num_splits, 1)",
             "m-blocks (PACK_GQA: of (row, head) pairs) x heads (PACK_GQA: KV heads) x batch x splits.")
COMBINE = Grid(("total_rows", "heads"), "pick(SPLIT, cdiv(total_rows * heads, COMBINE_WARPS), 0)",
               "The split-KV combine: one warp per (row, head); 0 without SPLIT.")
# FP8 with v_t: the _vt kernel that transposes V before the forward, VT_KEYS keys (of seqlen_k rounded up to 16) of one
# (batch, KV head) a block.
FWD_VT = Grid(("seqlen_k", "heads_k", "batch"), "cdiv(cdiv(seqlen_k, 16) * 16, VT_KEYS) * heads_k * batch",
              "v_t's _vt: VT_KEYS-key blocks of V (keys rounded up to 16) x KV heads x batch.")

# The backward: its main kernel over key tiles, the deterministic dQ over query tiles, the row kernels (D and the
# dQ conversion) over groups of ROW_WARPS rows; sm90 pads rows to whole Q tiles.
BWD_MAIN = Grid(("seqlen_k", "heads", "batch"), "cdiv(seqlen_k, BLOCK_N) * heads * batch",
                "n-blocks x heads x batch.")
BWD_DQ = Grid(("seqlen_q", "heads", "batch"), "cdiv(seqlen_q, BLOCK_M) * heads * batch",
              "m-blocks x heads x batch.")
BWD_ROWS = Grid(("seqlen_q", "heads", "batch"), "cdiv(seqlen_q, ROW_WARPS) * heads * batch",
                "groups of ROW_WARPS query rows x heads x batch.")
SM90_BWD_ROWS = Grid(("seqlen_q", "heads", "batch"), "idiv(cdiv(seqlen_q, BLOCK_M) * BLOCK_M, PRE_ROWS) * heads * batch",
                     "groups of PRE_ROWS padded query rows (256 threads a block) x heads x batch.")
SM90_BWD_CONVERT = Grid(("seqlen_q", "heads", "batch"), "cdiv(cdiv(seqlen_q, BLOCK_M) * BLOCK_M * HEAD_DIM, 4096) * heads * batch",
                        "two units of 64 rows x 32 columns of the padded dQ accumulator a block (128 threads a unit) x heads x batch.")
SM90_BWD_CONVERT_T = Grid(("seqlen_q", "heads", "batch"), "cdiv(cdiv(seqlen_q, BLOCK_M) * BLOCK_M * HEAD_DIM, 2048) * heads * batch",
                          "dQ^T's accumulator (80-row tiles): two units of 16 rows x 64 columns a block x heads x batch.")

__all__ = ["BWD_DQ", "BWD_MAIN", "BWD_ROWS", "COMBINE", "CPP_HELPERS", "FWD", "FWD_CLUSTER", "FWD_PACKED", "Grid",
           "SERVE", "SM90_BWD_CONVERT", "SM90_BWD_CONVERT_T", "SM90_BWD_ROWS", "persistent"]
