"""Step 1 of the pipeline: what one kernel is, and whether it can exist on an arch.

A `KernelConfig` names every compile-time choice of one forward kernel. Its `.name`
spells each field and is used as the `__global__` name, the cache key's prefix, the
exported file name and the tuner's trial label.
"""
from __future__ import annotations

import itertools
import math

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from . import grids

FAMILIES = ("sm80", "sm90")
HEAD_DIMS = (32, 64, 96, 128, 256)  # every kernel kind: dense, serving, decode, modifiers, both passes
# Built for the dense 16-bit forward (both families) and the sm80 family's dense backward only: no serving
# feature, modifier or FP8 (their tiles were not fitted there; flashgen.head_dims pads those calls to 256).
DENSE_ONLY_HEAD_DIMS = (160, 192)
DENSE_HEAD_DIMS = tuple(sorted(HEAD_DIMS + DENSE_ONLY_HEAD_DIMS))
# (head_dim, head_dim_v) pairs with a split-width kernel of their own: the sm90 family's 16-bit dense forward
# (KernelConfig.head_dim_v); every other pair, and these in the backward and the sm80 family, run padded.
SPLIT_HEAD_DIMS = ((192, 128),)
HALF_DTYPES = ("fp16", "bf16")
FP8_DTYPES = ("fp8_e4m3",)  # sm90 family only: e4m3 inputs with fp32 descale factors, bf16/fp16 out
DTYPES = HALF_DTYPES + FP8_DTYPES
OUT_DTYPES = HALF_DTYPES
FP8_HEAD_DIMS = (64, 128, 256)  # rows of 64 or 128 bytes: TMA's and wgmma's 64- and 128-byte swizzle
BLOCK_MS = (64, 128, 192, 256)
BLOCK_NS = (32, 64, 96, 128, 160, 176, 192, 256)
NUM_WARPS = (1, 2, 4, 8, 12, 16)
NUM_STAGES = (1, 2, 3, 4)
ELEM_BYTES = 2  # fp16 and bf16


def elem_bytes(dtype: str) -> int:
    return 1 if dtype in FP8_DTYPES else 2
# sm80: warps split block_m into 16-row mma tiles. sm90: one producer warpgroup plus one
# consumer warpgroup per 64 rows of block_m (wgmma is m64), so num_warps follows block_m.
FAMILY_BLOCK_MS = {"sm80": (16, 32, 64, 128, 256), "sm90": (64, 128, 192)}
COMBINE_WARPS = 4  # (row, head) pairs per block of the split-KV combine kernel (a warp each)
MAX_SPLITS = 128  # the most key ranges a split-KV launch splits into
VT_KEYS, VT_THREADS = 64, 256  # v_t's _vt kernel: keys of one (batch, KV head) per block, threads per block
# Row blocks below 64 (and one-warp blocks) serve few query rows (decode); dense spaces keep to 64 and up.
DENSE_MIN_BLOCK_M = 64
# Serving features of a forward kernel (sm80 family): each a compile-time switch, off = not in the code.
FEATURES = ("varlen", "paged", "split", "pack_gqa", "window", "softcap", "alibi", "sinks")
SM90_FEATURES = ("varlen", "window", "sinks")  # the sm90 family's forward has these (its backward: varlen, window)
# The sm90 forward's schedule knobs (KernelConfig fields; tuned beside the tile, `tune --<knob> yes/no` restricts them).
SM90_KNOBS = ("overlap", "pingpong", "persistent", "overlap_epilogue", "mma_rowsum", "lazy_rescale", "q_regs", "p_smem",
              "o_tma", "pack_gqa", "cluster", "lpt_by_head", "exp2_fma", "desc_step", "diag_cut", "v_t")
# The sm90 knobs of the dense forward only: a serving kernel built from a dense configuration drops them.
SM90_DENSE_KNOBS = ("pack_gqa", "o_tma", "cluster", "lpt_by_head", "diag_cut", "v_t")
# exp2_fma's choices: quarters of P's exponentials on the FMA pipe (0: all on the MUFU unit). The tuning space has them
# up to EXP2_FMA_MAX_HEAD_DIM, where the MUFU unit rather than the GEMMs bounds the softmax.
EXP2_FMA_SHARES = (0, 1, 2)
EXP2_FMA_MAX_HEAD_DIM = 128
KEY_WARPS = (1, 2, 4)  # sm80 serving: ways a key tile is split between a block's warps
BWD_FEATURES = ("varlen", "window", "softcap", "alibi")  # the ones a training call uses: the backward has them


def mod_features(window: tuple[int, int], softcap: float, alibi: bool, causal: bool,
                 sinks: bool = False) -> dict[str, bool]:
    """The kernel features a call's score modifiers need: a window only where it bounds more than
    causal does (causal is the window's right edge at the diagonal); sinks only where given (the key is
    absent from calls without them, so their kernels' names and cache keys stay as they were)."""
    left, right = window
    return {"window": left >= 0 or (right >= 0 and not causal), "softcap": softcap != 0.0, "alibi": alibi,
            **({"sinks": True} if sinks else {})}
_FEATURE_TAGS = {"varlen": "vl", "paged": "pg", "split": "sp", "pack_gqa": "pk", "window": "win", "softcap": "sc",
                 "alibi": "al", "sinks": "snk"}
# wgmma takes any N that is a multiple of 8 (16 here, for the P V k-steps); mma.sync tiles stay powers of two.
FAMILY_BLOCK_NS = {"sm80": (32, 64, 128, 256), "sm90": (64, 96, 128, 160, 176, 192, 224, 256)}
# FP8 with v_t only (VT loaded in boxes of 32 keys): FlashAttention-3's d128 FP8 tile.
FP8_VT_BLOCK_NS = (224,)
# sm90 consumers get registers from the producer through setmaxnreg: (producer, consumer)
# per thread for 2 and 3 consumer warpgroups; one consumer keeps the 255 cap at entry.
SM90_REGS = {1: (None, 255), 2: (24, 240), 3: (24, 160)}
# FP8: the producer warpgroup also transposes V in shared memory, so it keeps more (not with v_t, whose V comes
# transposed). A split's sum (x 128 producer, x 128 per consumer) stays at the 168 x 384 a two-consumer CTA starts with.
SM90_REGS_FP8 = {1: (None, 255), 2: (40, 232), 3: (40, 152)}


@dataclass(frozen=True)
class ArchLimits:
    """What one block may use on an architecture (CUDA programming guide, table 'Technical specifications')."""

    arch: str
    smem_per_block: int  # bytes of shared memory one block may opt in to
    max_threads: int = 1024

    @property
    def sm(self) -> int:
        return int(self.arch[2:])


ARCHS: dict[str, ArchLimits] = {
    "sm80": ArchLimits("sm80", 163 * 1024),
    "sm86": ArchLimits("sm86", 99 * 1024),
    "sm89": ArchLimits("sm89", 99 * 1024),
    "sm90": ArchLimits("sm90", 227 * 1024),
}

# Beyond this many fp32 accumulator registers per thread (S tile + O tile), the sm80
# kernel cannot keep its working set in the 255 registers a thread may have.
MAX_ACCUM_REGS = 192


MAX_GRID_X = 2**31 - 1  # CUDA's limit on gridDim.x


class ConfigError(ValueError):
    """A configuration that is impossible; the message names the field."""


def _check_choice(field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")


def arch_limits(arch: str) -> ArchLimits:
    if arch not in ARCHS:
        raise ConfigError(f"arch={arch!r} is not known; choose one of {', '.join(map(repr, ARCHS))}")
    return ARCHS[arch]


class _AsDict:
    """to_dict / from_dict of a config dataclass: the store, cache metadata and studies keep them as JSON."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class KernelConfig(_AsDict):
    """One forward attention kernel. Frozen and hashable; validated on construction."""

    head_dim: int
    dtype: str
    causal: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    family: str = "sm80"
    overlap: bool = False  # sm90: issue the next S = QK^T alongside this tile's P V
    pingpong: bool = False  # sm90: the two consumer warpgroups take turns issuing GEMMs
    persistent: bool = False  # sm90: one CTA per SM loops over tiles (next Q and K/V load during this epilogue)
    # Serving features (sm80 family, see FEATURES and templates/sm80/serve.cuh.j2; sm90: SM90_FEATURES):
    varlen: bool = False  # per-sequence offsets (cu_seqlens) and key counts (seqused_k: KV cache lengths)
    paged: bool = False  # K/V pages through a block table
    split: bool = False  # split-KV: partial results per key range, merged by the _combine kernel
    pack_gqa: bool = False  # the query heads of one KV head share a tile (K/V read once per KV head)
    window: bool = False  # sliding window
    softcap: bool = False  # scores = softcap * tanh(scores / softcap)
    alibi: bool = False  # scores -= slope * |i + seqlen_k - seqlen_q - j|
    # Attention sinks (gpt-oss): a learnable logit per head joins every row's softmax denominator as a key whose
    # value is zero; folded in once at the row's end (split-KV: in the combine), the key loop is the same.
    sinks: bool = False
    # Programmable attention (sm80 family's serving kernels; sm90's dense forward): the digests of a traced
    # score_mod and mask_mod (flashgen.modifiers; "" = none). The render finds their CUDA text by digest.
    score_mod: str = ""
    mask_mod: str = ""
    # The key tiles each row block visits come from a block map (flashgen.blockmap): empty tiles are never loaded,
    # full ones skip the mask_mod. Dense serving kernels without split or pack_gqa.
    block_map: bool = False
    # FP8 (dtype fp8_e4m3, sm90 family): the output's dtype ("" = bf16), and P quantized with a
    # scale per row and key tile (its own max) instead of the running max's.
    out_dtype: str = ""
    block_quant_p: bool = False
    # sm90 persistent with overlap: a finished tile's O is written while the next tile's first S = QK^T runs.
    overlap_epilogue: bool = False
    # FP8: P's row sums by a wgmma against a tile of ones beside each P V k-step, instead of an FADD per
    # probability (the sums of P as quantized, one per tile, added in fp32).
    mma_rowsum: bool = False
    # sm90: FlashAttention-4's lazy rescaling, O's rescale skipped by a warp whose rows' max stays put: 16-bit in
    # the overlapped schedule (the max kept while none grows by more than 2^8), FP8 in every schedule (only when
    # no row's max grew: a stale max costs FP8's P accuracy, docs/fp8.md).
    lazy_rescale: bool = False
    # sm90, 16-bit: Q read into registers once per tile (ldmatrix) and fed to S = QK^T as wgmma's A operand from
    # registers (RS) instead of shared memory; the persistent kernel then frees Q's buffer at the tile's start,
    # so the next tile's Q loads while this one runs.
    q_regs: bool = False
    # sm90, 16-bit: P goes to the second GEMM from shared memory (wgmma SS) instead of registers (RS): each consumer
    # warpgroup writes its 64 rows of P to a tile of its own, and the overlapped schedule keeps no second P in registers.
    p_smem: bool = False
    # sm90, 16-bit dense: O leaves through shared memory: each warp stages its 16 rows (stmatrix) and the TMA unit
    # copies them out (cp.async.bulk, a row each) while the warp goes on to its next tile; 16 rows x (head_dim + 8)
    # 16-bit elements of shared memory per warp (rows padded against bank conflicts).
    o_tma: bool = False
    # sm90, 16-bit dense: CTAs run in clusters of two on neighbouring m-blocks of one (batch, head) and share each K/V
    # tile: each CTA's producer loads half its rows, multicast by TMA into both CTAs' shared memory. Persistent: both
    # CTAs of a cluster walk the same tiles of m-block pairs.
    cluster: bool = False
    # sm90, persistent causal: the tile order goes head by head (each head's m-blocks longest first) instead of
    # m-block by m-block over all heads: the CTAs running together read the K/V of a few heads, which stay in L2,
    # where the all-heads order reads one head's K/V from HBM once per m-block when all heads' K/V exceed L2.
    lpt_by_head: bool = False
    # sm90, 16-bit: this many quarters of each thread's exponentials of P (EXP2_FMA_SHARES) are computed on the FMA pipe
    # by a polynomial (exp2_fma, templates/common/softmax.cuh.j2) instead of the MUFU unit's ex2, which bounds the
    # softmax at small head dims (FlashAttention-4's exp2 emulation). Picked by each element's column in the thread's
    # fragment, fixed at compile time.
    exp2_fma: int = 0
    # sm80 split-KV: no _combine kernel. The last of a row block's splits to finish (an arrival counter per row
    # block) merges the partial results: one launch per call instead of two, and no gap between them.
    fused_combine: bool = False
    # sm90 16-bit dense forward: v (and O) of this head dim, narrower than q and k's head_dim (None: head_dim). The
    # P V product, O's accumulator, epilogue and V's tiles take it; Q K^T keeps head_dim (DeepSeek-V3's MLA prefill:
    # 192 and 128). See SPLIT_HEAD_DIMS.
    head_dim_v: int | None = None
    # sm90: each tile's wgmma descriptors are made once and stepped per k-step by a constant added to their start
    # address (fewer uniform-datapath instructions in the consumers), instead of one made whole per k-step.
    desc_step: bool = False
    # sm90 causal dense forward with two or three consumer warpgroups: each warpgroup starts its key loop at the first
    # key tile its own rows see. The tiles past its last row (the loop's first, last key block first; warpgroup 0's
    # half of the diagonal at 64-key tiles) are waited for and released but never multiplied, where otherwise the
    # warpgroup computes them fully masked.
    diag_cut: bool = False
    # FP8 forward: V arrives transposed. A small kernel of the same file (`_vt`) first writes V as VT, (batch,
    # heads_k, head_dim_v, keys padded to 16) with each 16 keys in P's register order, and TMA loads VT's tiles as they
    # are used: no V ring, no transposing producer warps (the consumers then get FP8's 16-bit register split).
    v_t: bool = False
    # sm80 serving kernels without modifiers: the block's warps split each key tile as well as its rows, key_warps
    # ways (each warp takes block_n / key_warps keys of every tile with its own running max and sums), and merge their
    # partial results through shared memory before the epilogue. A decode block of one 16-row tile then has 2-4 warps
    # issuing its loads and products instead of one (num_warps counts them all).
    key_warps: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if d["head_dim_v"] is None:  # left out when q, k and v share a head dim: those dicts stay as they were
            del d["head_dim_v"]
        for knob in ("desc_step", "diag_cut", "v_t"):  # left out when off, the same way
            if not d[knob]:
                del d[knob]
        if d["key_warps"] == 1:
            del d["key_warps"]
        return d

    def __post_init__(self) -> None:
        _check_choice("family", self.family, FAMILIES)
        _check_choice("head_dim", self.head_dim, DENSE_HEAD_DIMS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("out_dtype", self.out_dtype, ("",) + OUT_DTYPES)
        _check_choice("block_quant_p", self.block_quant_p, (False, True))
        if self.fp8:
            if self.family != "sm90":
                raise ConfigError(f"dtype={self.dtype} needs family sm90 (FP8 wgmma); family {self.family} has no FP8 "
                                  "tensor cores (Ampere) ")
            if self.out_dtype == "":
                object.__setattr__(self, "out_dtype", "bf16")
            if self.head_dim not in FP8_HEAD_DIMS:
                raise ConfigError(f"head_dim={self.head_dim} is not built for {self.dtype}; choose one of "
                                  f"{', '.join(map(str, FP8_HEAD_DIMS))}")
            if self.block_n % 64 and not (self.v_t and self.block_n in FP8_VT_BLOCK_NS):
                raise ConfigError(f"block_n={self.block_n} must be a multiple of 64 for {self.dtype} (V is transposed "
                                  f"into 64- or 128-byte rows of keys; with v_t also {', '.join(map(str, FP8_VT_BLOCK_NS))})")
        else:
            if self.block_n in FP8_VT_BLOCK_NS:
                raise ConfigError(f"block_n={self.block_n} is an FP8 tile with v_t (VT in boxes of 32 keys), not "
                                  f"{self.dtype}")
            if self.out_dtype not in ("", self.dtype):
                raise ConfigError(f"out_dtype={self.out_dtype!r}: a {self.dtype} kernel writes {self.dtype}")
            object.__setattr__(self, "out_dtype", "")
            if self.block_quant_p:
                raise ConfigError("block_quant_p is an FP8 option (dtype fp8_e4m3)")
        _check_choice("causal", self.causal, (False, True))
        if self.head_dim in DENSE_ONLY_HEAD_DIMS and self.serving:
            raise ConfigError(f"head_dim={self.head_dim} is built for the dense forward only, without serving "
                              f"features or modifiers; those are built at {', '.join(map(str, HEAD_DIMS))}")
        _check_choice("block_m", self.block_m, FAMILY_BLOCK_MS[self.family])
        _check_choice("block_n", self.block_n, FAMILY_BLOCK_NS[self.family])
        _check_choice("num_warps", self.num_warps, NUM_WARPS)
        _check_choice("num_stages", self.num_stages, NUM_STAGES)
        _check_choice("overlap", self.overlap, (False, True))
        _check_choice("pingpong", self.pingpong, (False, True))
        _check_choice("persistent", self.persistent, (False, True))
        _check_choice("overlap_epilogue", self.overlap_epilogue, (False, True))
        if self.overlap_epilogue and (not (self.persistent and self.overlap) or self.fp8):
            raise ConfigError("overlap_epilogue needs persistent=True and overlap=True (the next tile's first QK^T "
                              "runs beside the epilogue) and 16-bit inputs")
        _check_choice("mma_rowsum", self.mma_rowsum, (False, True))
        if self.mma_rowsum and not self.fp8:
            raise ConfigError("mma_rowsum is an FP8 knob (the 16-bit P V has no spare k-step layout for it)")
        _check_choice("lazy_rescale", self.lazy_rescale, (False, True))
        if self.lazy_rescale and (self.family != "sm90" or self.block_quant_p or not (self.fp8 or self.overlap)):
            raise ConfigError("lazy_rescale is an sm90 knob for FP8 (not with block_quant_p, whose P takes each "
                              "tile's own max) and for 16-bit inputs with overlap=True (the overlapped schedule's "
                              "softmax)")
        _check_choice("q_regs", self.q_regs, (False, True))
        if self.q_regs and (self.family != "sm90" or self.fp8):
            raise ConfigError("q_regs is an sm90 knob for 16-bit inputs (FP8's Q stays in shared memory)")
        _check_choice("p_smem", self.p_smem, (False, True))
        if self.p_smem and (self.family != "sm90" or self.fp8 or self.block_n % self.smem_w):
            raise ConfigError(f"p_smem is an sm90 knob for 16-bit inputs with block_n a multiple of {self.smem_w} "
                              "(P is stored in Q's swizzled layout), not "
                              f"{self.dtype} / block_n={self.block_n} / family {self.family}")
        _check_choice("o_tma", self.o_tma, (False, True))
        if self.o_tma and (self.family != "sm90" or self.fp8 or self.features):
            raise ConfigError("o_tma is an sm90 knob for the dense 16-bit forward without pack_gqa, not "
                              f"{self.dtype} / family {self.family} / {'+'.join(self.features) or 'dense'}")
        _check_choice("cluster", self.cluster, (False, True))
        if self.cluster and (self.family != "sm90" or self.fp8 or self.features):
            raise ConfigError("cluster is an sm90 knob for the dense 16-bit forward, not "
                              f"{self.dtype} / family {self.family} / {'+'.join(self.features) or 'dense'}")
        _check_choice("lpt_by_head", self.lpt_by_head, (False, True))
        if self.lpt_by_head and (self.family != "sm90" or not self.persistent or not self.causal or self.pack_gqa
                                 or self.cluster or self.serving or self.fp8):
            kind = "+".join(self.features + ("pack_gqa",) * self.pack_gqa + ("cluster",) * self.cluster) or "dense"
            raise ConfigError("lpt_by_head is an sm90 knob of the persistent causal 16-bit dense forward without "
                              f"pack_gqa or cluster (they order their own tiles), not {self.dtype} "
                              f"{'persistent' if self.persistent else 'plain'} "
                              f"{'causal' if self.causal else 'full'} / family {self.family} / {kind}")
        _check_choice("desc_step", self.desc_step, (False, True))
        if self.desc_step and self.family != "sm90":
            raise ConfigError(f"desc_step is an sm90 knob (wgmma's shared-memory descriptors), not family {self.family}")
        _check_choice("diag_cut", self.diag_cut, (False, True))
        if self.diag_cut and (self.family != "sm90" or not self.causal or self.block_m < 128 or self.serving
                              or self.modified):
            raise ConfigError("diag_cut is a knob of the sm90 causal dense forward with block_m >= 128 (a warpgroup's "
                              "own first key tile, below its CTA's), not "
                              f"{'causal' if self.causal else 'full'} block_m={self.block_m} / family {self.family} / "
                              f"{'+'.join(self.features) or ('modifiers' if self.modified else 'dense')}")
        _check_choice("v_t", self.v_t, (False, True))
        if self.v_t and not self.fp8:
            raise ConfigError(f"v_t is a knob of the FP8 forward (V transposed ahead by the _vt kernel), not {self.dtype}")
        _check_choice("key_warps", self.key_warps, KEY_WARPS)
        if self.key_warps > 1:
            self._check_key_warps()
        _check_choice("exp2_fma", self.exp2_fma, EXP2_FMA_SHARES)
        if self.exp2_fma and (self.family != "sm90" or self.fp8):
            raise ConfigError(f"exp2_fma is an sm90 knob for 16-bit inputs (their softmax), not {self.dtype} / family "
                              f"{self.family}")
        for f in FEATURES:
            _check_choice(f, getattr(self, f), (False, True))
        if self.pack_gqa and self.family == "sm90" and self.serving:
            raise ConfigError("pack_gqa in family sm90 is a dense-forward knob: not with varlen or window (the sm80 "
                              "family's serving kernels pack GQA with them)")
        if self.serving and self.family != "sm80":
            if not set(self.features) <= set(SM90_FEATURES):
                raise ConfigError(f"serving features ({', '.join(self.features)}) are built in family sm80 (it runs on "
                                  f"Hopper too); family {self.family} has {', '.join(SM90_FEATURES)}")
            if self.fp8:
                raise ConfigError("varlen and window are built in the sm90 family's 16-bit kernels")
            if self.persistent and self.varlen:
                raise ConfigError("varlen is built in the sm90 family's non-persistent kernels (a window alone may be "
                                  "persistent)")
        if self.paged and not self.varlen:
            raise ConfigError("paged=True needs varlen=True (a paged cache has per-sequence lengths)")
        for kind in ("score_mod", "mask_mod"):
            digest = getattr(self, kind)
            if not isinstance(digest, str) or (digest and not all(c in "0123456789abcdef" for c in digest)):
                raise ConfigError(f"{kind} must be a modifier's digest (lowercase hex) or empty, not {digest!r}")
        _check_choice("block_map", self.block_map, (False, True))
        if self.modified and self.family == "sm90":
            # Producer and consumers walk one key-tile list per tile (flashgen.blockmap's, with a map); the epilogue
            # overlap's LSE reads the kernel's scale where a score_mod's softmax runs on log2(e) alone.
            knobs = [k for k in ("o_tma", "cluster", "varlen") if getattr(self, k)]
            knobs += ["overlap_epilogue"] if self.overlap_epilogue and self.score_mod else []
            if knobs:
                raise ConfigError(f"score_mod, mask_mod and block maps are built in family sm90's dense forward: not "
                                  f"with {', '.join(knobs)}")
        elif self.modified and self.family != "sm80":
            raise ConfigError(f"score_mod, mask_mod and block maps are built in families sm80 and sm90, not "
                              f"{self.family}")
        _check_choice("fused_combine", self.fused_combine, (False, True))
        if self.fused_combine and (self.family != "sm80" or not self.split or self.modified):
            raise ConfigError("fused_combine merges split-KV partial results in the sm80 family's serving kernel: it "
                              "needs split=True, family sm80 and no score_mod, mask_mod or block map")
        if self.block_map and (self.varlen or self.split or self.pack_gqa):
            raise ConfigError("a block map is built in the dense serving kernel (one row block of one head per CTA, all "
                              "its keys): not with varlen, split or pack_gqa")
        if self.score_mod and (self.softcap or self.alibi):
            raise ConfigError("a score_mod does not combine with softcap or alibi (write them into the score_mod)")
        if self.pack_gqa and self.alibi:
            raise ConfigError("pack_gqa and alibi do not combine (ALiBi slopes differ between the packed heads)")
        if self.family != "sm90" and (self.overlap or self.pingpong or self.persistent):
            raise ConfigError(f"overlap, pingpong and persistent are sm90-family knobs; family {self.family} has none")
        if self.pingpong and self.consumers != 2:
            raise ConfigError(f"pingpong=True needs block_m=128 (two consumer warpgroups), not {self.block_m}")
        if self.overlap and self.num_stages < 2:
            raise ConfigError("overlap=True needs num_stages >= 2 (K of the next tile loads while V of this one is read)")
        if self.family == "sm90":
            if self.num_warps != 4 * (1 + self.consumers):
                raise ConfigError(
                    f"num_warps={self.num_warps} must be {4 * (1 + self.consumers)} for block_m={self.block_m} in "
                    "family sm90 (a producer warpgroup plus one consumer warpgroup per 64 rows)"
                )
        # Each warp owns whole 16-row slices of the Q tile (mma.sync is m16).
        elif self.num_warps % self.key_warps or self.block_m % (16 * self.row_warps):
            raise ConfigError(
                f"block_m={self.block_m} must be a multiple of 16*num_warps={16 * self.num_warps} "
                "(each warp owns whole 16-row mma tiles)" if self.key_warps == 1 else
                f"num_warps={self.num_warps} must be key_warps={self.key_warps} times a number of warps whose 16-row "
                f"mma tiles make block_m={self.block_m}"
            )
        if self.head_dim_v is not None:
            self._check_head_dim_v()

    def _check_key_warps(self) -> None:
        """Key tiles split between warps: the sm80 family's serving kernel (not with a modifier), whole 16-key
        k-steps of P V per warp."""
        if self.family != "sm80" or not self.serving or self.modified:
            raise ConfigError(f"key_warps is a knob of the sm80 family's serving kernels without modifiers, not family "
                              f"{self.family} / {'+'.join(self.features) or ('modifiers' if self.modified else 'dense')}")
        if self.block_n % (16 * self.key_warps):
            raise ConfigError(f"block_n={self.block_n} must be a multiple of 16*key_warps={16 * self.key_warps} (each "
                              "warp's keys are whole 16-key k-steps of P V)")

    def _check_head_dim_v(self) -> None:
        """A v narrower than q and k: the sm90 16-bit dense forward, v's tiles in q's swizzled column blocks."""
        dv = self.head_dim_v
        if isinstance(dv, bool) or not isinstance(dv, int):
            raise ConfigError(f"head_dim_v={dv!r} must be an int or None (None: v has q and k's head_dim)")
        kind = "+".join(self.features) or ("modifiers" if self.modified else "")
        if self.family != "sm90" or self.fp8 or kind:
            raise ConfigError(f"head_dim_v is built in family sm90's 16-bit dense forward, not {self.dtype} / family "
                              f"{self.family}{' / ' + kind if kind else ''}")
        if not self.smem_w <= dv < self.head_dim or dv % self.smem_w:
            raise ConfigError(f"head_dim_v={dv} must be a multiple of {self.smem_w} below head_dim={self.head_dim}: V "
                              f"loads in TMA boxes of {self.smem_w} columns (head_dim's swizzle), and O is staged in "
                              "Q's tile (use head_dim_v=None where v is as wide as q and k)")

    # -- derived figures -------------------------------------------------------
    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        name = (
            f"fwd_{self.family}_d{self.head_dim}_{self.dtype}_{mask}"
            f"_bm{self.block_m}_bn{self.block_n}_w{self.num_warps}_s{self.num_stages}"
        )
        if self.family == "sm90":
            name += f"_ov{int(self.overlap)}_pp{int(self.pingpong)}" + ("_ps" if self.persistent else "")
            name += "_oe" if self.overlap_epilogue else ""
            if self.fp8:
                name += f"_o{self.out_dtype}" + ("_bq" if self.block_quant_p else "") + ("_rs" if self.mma_rowsum else "")
            name += "_lz" if self.lazy_rescale else ""
            name += "_qr" if self.q_regs else ""
            name += "_psm" if self.p_smem else ""
            name += "_ot" if self.o_tma else ""
            name += "_cl" if self.cluster else ""
            name += "_hl" if self.lpt_by_head else ""
            name += f"_ef{self.exp2_fma}" if self.exp2_fma else ""
            name += "_dst" if self.desc_step else ""
            name += "_dc" if self.diag_cut else ""
            name += "_vt" if self.v_t else ""
        name += "".join(f"_{_FEATURE_TAGS[f]}" for f in self.features)
        name += "_fc" if self.fused_combine else ""
        name += f"_kw{self.key_warps}" if self.key_warps > 1 else ""
        name += f"_sm{self.score_mod[:8]}" if self.score_mod else ""
        name += f"_mm{self.mask_mod[:8]}" if self.mask_mod else ""
        name += "_bmap" if self.block_map else ""
        return name + (f"_dv{self.head_dim_v}" if self.head_dim_v is not None else "")

    @property
    def v_dim(self) -> int:
        """The head dim of v and O: head_dim_v, or head_dim where it is None."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def modified(self) -> bool:
        """Generated with a score_mod, a mask_mod (flashgen.modifiers) or a block map (flashgen.blockmap): takes
        ServeModParams."""
        return bool(self.score_mod or self.mask_mod or self.block_map)

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def output_dtype(self) -> str:
        """The dtype of O: the inputs' (fp16, bf16) or out_dtype (FP8)."""
        return self.out_dtype or self.dtype

    @property
    def elem_bytes(self) -> int:
        return elem_bytes(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one swizzled shared-memory row (128, or 64): TMA's and wgmma's swizzle width."""
        return self.smem_w * self.elem_bytes

    @property
    def features(self) -> tuple[str, ...]:
        """The serving features this kernel was generated with, in FEATURES order."""
        return tuple(f for f in FEATURES if getattr(self, f))

    @property
    def serving(self) -> bool:
        """Takes ServeParams (templates/common/serve_params.cuh.j2) rather than FwdParams. In family sm90
        pack_gqa is a knob of the dense forward (Sm90FwdParams), not a serving feature."""
        return self.modified or any(getattr(self, f) for f in FEATURES if not (f == "pack_gqa" and self.family == "sm90"))

    @property
    def kernel_names(self) -> dict[str, str]:
        """Role -> `__global__` name of every kernel in the rendered file (split-KV adds its combine, unless fused;
        v_t the transpose of V that runs before the main kernel)."""
        if self.split and not self.fused_combine:
            return {"main": self.name, "combine": f"{self.name}_combine"}
        if self.v_t:
            return {"vt": f"{self.name}_vt", "main": self.name}
        return {"main": self.name}

    def vt_grid(self, batch: int, heads_k: int, seqlen_k: int) -> int:
        """v_t: blocks of the _vt kernel (VT_THREADS threads each), grids.FWD_VT."""
        return grids.FWD_VT.bind(VT_KEYS=VT_KEYS)(seqlen_k, heads_k, batch)

    @property
    def transposes_v(self) -> bool:
        """FP8 without v_t: the producer warpgroup transposes each V tile into a VT ring of its own."""
        return self.fp8 and not self.v_t

    @property
    def vt_w(self) -> int:
        """FP8: keys per column block of VT in shared memory (VT_W; its bytes, the 128-, 64- or (v_t's 224-key tile)
        32-byte swizzle)."""
        return 128 if self.block_n % 128 == 0 else 64 if self.block_n % 64 == 0 else 32

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_w(self) -> int:
        """Elements per swizzled shared-memory row (128 or 64 bytes): SMEM_W in the templates and
        the inner box of sm90's TMA descriptors."""
        if self.fp8:
            return 128 if self.head_dim % 128 == 0 else 64
        return 64 if self.head_dim % 64 == 0 else 32

    @property
    def consumers(self) -> int:
        """sm90: consumer warpgroups, 64 Q rows each."""
        return self.block_m // 64

    @property
    def row_warps(self) -> int:
        """sm80: warps along the Q tile's rows (the others split its keys, key_warps ways)."""
        return self.num_warps // self.key_warps

    @property
    def warp_m_tiles(self) -> int:
        """16-row mma tiles each math warp owns."""
        return 1 if self.family == "sm90" else self.block_m // (16 * self.row_warps)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the Q tile plus `num_stages` K and V tiles (sm90: plus its
        mbarriers and 1024 bytes to align the swizzled tiles). FP8 adds a ring of transposed V tiles and its two barriers per
        stage (v_t: VT's ring alone, loaded as it is), and with mma_rowsum 8 x block_n bytes of e4m3 ones (the B operand
        that sums P's rows)."""
        q = self.block_m * self.head_dim
        v_tiles = (2 if self.transposes_v else 1) * self.v_dim  # V (FP8: and its transpose VT)
        kv = self.num_stages * self.block_n * (self.head_dim + v_tiles) + 8 * self.block_n * self.mma_rowsum
        bars = 1 + self.persistent + (6 if self.transposes_v else 4) * self.num_stages
        extra = 8 * bars + 1024 if self.family == "sm90" else 0
        p = self.consumers * 64 * self.block_n if self.p_smem else 0  # a P tile per consumer warpgroup
        o = self.block_m * (self.v_dim + 8) if self.o_tma else 0  # O's staging rows, padded by 16 bytes
        return max((q + kv + p + o) * self.elem_bytes + extra, self.key_merge_bytes)

    @property
    def key_merge_bytes(self) -> int:
        """key_warps: the shared memory through which the warps of the key split hand their partial results to the
        first (fp32 O fragments, each row's max and partial sum per thread), in the K/V stages' place after the loop."""
        if self.key_warps == 1:
            return 0
        per_warp = 32 * self.warp_m_tiles * (self.v_dim // 8 * 4 + 4)
        return (self.key_warps - 1) * self.row_warps * per_warp * 4 + self.block_m * self.head_dim * self.elem_bytes

    @property
    def accum_regs(self) -> int:
        """fp32 registers per math thread for the S and O accumulators."""
        # a second P in flight: block_n / 2 values a thread, packed two (16-bit) or four (FP8) to a register
        extra_p = self.block_n // (8 if self.fp8 else 4) if self.overlap and not self.p_smem else 0
        q = self.head_dim // 4 if self.q_regs else 0  # Q's 16-bit A fragments, held through the tile
        return self.warp_m_tiles * (self.block_n // self.key_warps + self.v_dim) // 2 + extra_p + q

    @property
    def max_accum_regs(self) -> int:
        if self.family == "sm90":  # what setmaxnreg leaves a consumer, less room for softmax state and addressing
            # Three 16-bit consumers get 32: ptxas fits d64's 192 x 128 tile with overlap (FlashAttention-3's d64
            # tile) in 160 registers at 128 accumulator registers, spill-free without a mask (causal's row and column
            # registers: 12-36 B spilled per thread); 192 x 192 without overlap spills 16-24 B and was still the
            # fastest d64 tile at N >= 4k on the H200 (docs/kernels-sm90.md): spills are timed, not excluded.
            if self.v_t:  # FP8 at 240 without the transposer: d256's 128 x 128 overlapped tile (208) builds spill-free
                return self.register_split[1] - 32
            room = 32 if self.consumers == 3 and not self.fp8 else 40
            return min(200, self.register_split[1] - room)
        return MAX_ACCUM_REGS

    @property
    def register_split(self) -> tuple[int | None, int]:
        """sm90: (producer, consumer) registers per thread after setmaxnreg (producer None: one consumer, no change).
        FP8's producer keeps more for its V transpose; with v_t it has none."""
        return (SM90_REGS_FP8 if self.transposes_v else SM90_REGS)[self.consumers]

    @property
    def kv_box_rows(self) -> int:
        """sm90: rows of the K and V tensor maps' TMA box: a tile, or half of one (cluster: each CTA loads half)."""
        return self.block_n // 2 if self.cluster else self.block_n

    def m_slots(self, seqlen_q: int) -> int:
        """Grid slots per (batch, head): its m-blocks, rounded up to pairs with cluster (an odd count leaves the last
        pair's second CTA past the rows: it only shares its partner's K/V loads)."""
        m_blocks = -(-seqlen_q // self.block_m)
        return m_blocks + (m_blocks & 1) if self.cluster else m_blocks

    def grid(self, batch: int, heads: int, seqlen_q: int, sm_count: int | None = None,
             heads_k: int | None = None) -> tuple[int, int, int]:
        """One flat grid of m-blocks x heads x batch (the kernel unfolds blockIdx.x): gridDim.y and
        .z stop at 65535, x at 2^31 - 1. Persistent: one CTA per SM (`sm_count`), fewer if fewer tiles.
        sm90 pack_gqa: m-blocks of packed rows x KV heads x batch (`heads_k` needed; see pack_tiles).
        Cluster: m-blocks rounded up to pairs (m_slots), so x is even, a whole number of 2-CTA clusters (persistent: at
        most the SM count rounded down to even)."""
        base = self._grid_base()
        if base is grids.FWD_PACKED:
            if heads_k is None:
                raise ValueError(f"{self.name} packs GQA: its grid needs heads_k")
            pack_tiles(self.block_m, seqlen_q, heads, heads_k)  # refuses a group the tile cannot hold
            args, what = (seqlen_q, heads, heads_k, batch), f"ceil(seqlen_q / ({self.block_m} // group)) * heads_k * batch"
        else:
            args, what = (seqlen_q, heads, batch), f"ceil(seqlen_q / {self.block_m}) * heads * batch"
        grid = _flat_grid(base.bind(BLOCK_M=self.block_m)(*args), what)
        if not self.persistent:
            return grid
        if not sm_count or sm_count < 1:
            raise ValueError(f"{self.name} is persistent: its grid needs the GPU's SM count")
        return (grids.persistent(base, self.cluster).bind(BLOCK_M=self.block_m)(*args, sm_count), 1, 1)

    def _grid_base(self) -> grids.Grid:
        if self.pack_gqa and self.family == "sm90":
            return grids.FWD_PACKED
        return grids.FWD_CLUSTER if self.cluster else grids.FWD

    def grid_formula(self) -> grids.Grid:
        """The grid as launch headers compute it (flashgen.grids): what `grid` evaluates."""
        return grids.persistent(self._grid_base(), self.cluster) if self.persistent else self._grid_base()

    def unfit_reason(self, arch: str) -> str | None:
        """Why this config cannot run on `arch`, or None if it fits."""
        lim = arch_limits(arch)
        if self.family == "sm90" and arch != "sm90":
            return f"family sm90 (wgmma, TMA, setmaxnreg) needs an sm90 GPU, not {arch}"
        if self.threads > lim.max_threads:
            return f"{self.threads} threads per block > {lim.max_threads} on {arch}"
        if self.smem_bytes > lim.smem_per_block:
            return f"shared memory {self.smem_bytes} B > {lim.smem_per_block} B per block on {arch}"
        if self.accum_regs > self.max_accum_regs:
            return (
                f"{self.accum_regs} accumulator registers per thread > {self.max_accum_regs} "
                f"(block_n + head_dim too large for {self.warp_m_tiles} m-tiles per warp)"
            )
        return None



def pack_rows(block_m: int, group: int) -> int:
    """sm90 pack_gqa: the query positions one tile holds, block_m // group, each with the `group` query heads of
    its KV head as consecutive rows (tile row l: position m0 + l // group, head head_k * group + l % group). Whole
    positions only, so Q loads as one TMA box (group heads x positions); when group does not divide block_m, the
    last block_m % group rows are idle (zeros, never written)."""
    if group < 1 or group > block_m:
        raise ValueError(f"pack_gqa: a group of {group} query heads per KV head does not fit a tile of {block_m} rows "
                         "(take a kernel without pack_gqa)")
    return block_m // group


def pack_tiles(block_m: int, seqlen_q: int, heads: int, heads_k: int) -> tuple[int, int]:
    """sm90 pack_gqa: (m-blocks, KV heads) of the grid: ceil(seqlen_q / pack_rows) tiles per KV head
    (= ceil(seqlen_q * group / block_m) when group divides block_m)."""
    if heads_k < 1 or heads % heads_k:
        raise ValueError(f"pack_gqa needs heads ({heads}) a multiple of heads_k ({heads_k})")
    return -(-seqlen_q // pack_rows(block_m, heads // heads_k)), heads_k


def vt_keys(seqlen_k: int) -> int:
    """v_t: the keys of VT's rows, seqlen_k rounded up to 16 (whole 16-key blocks of P's register order)."""
    return -(-seqlen_k // 16) * 16


def space(family: str, head_dim: int, dtype: str, causal: bool, gqa_group: int = 1) -> list[KernelConfig]:
    """Every syntactically valid tile configuration of a family for one problem.

    Arch fit is not checked here (see `KernelConfig.unfit_reason`). Family sm90 with gqa_group > 1 (GQA) adds
    each configuration again with pack_gqa, where the tile holds the group's heads (pack_rows > 0)."""
    _check_choice("family", family, FAMILIES)
    out = []
    for bm in (b for b in FAMILY_BLOCK_MS[family] if b >= DENSE_MIN_BLOCK_M):
        for bn in FAMILY_BLOCK_NS[family]:
            for w in ([w for w in NUM_WARPS if w > 1] if family == "sm80" else (4 * (1 + bm // 64),)):
                for s in NUM_STAGES:
                    for ov, pp, ps in ([(False, False, False)] if family == "sm80" else
                                       [(ov, pp, ps) for ov, pp in ((False, False), (True, False), (False, True),
                                                                    (True, True)) for ps in (False, True)]):
                        for oe, rs in ([(False, False), (False, True)] if dtype in FP8_DTYPES else
                                       [(False, False), (True, False)] if ov and ps else [(False, False)]):
                            sm90_16 = (False, True) if family == "sm90" and dtype not in FP8_DTYPES else (False,)
                            for lz, qr, psm, ot in itertools.product(
                                    (False, True) if family == "sm90" and (ov or dtype in FP8_DTYPES) else (False,),
                                    sm90_16, sm90_16, sm90_16):
                                for cl, hl in itertools.product(sm90_16, sm90_16 if causal and ps else (False,)):
                                    try:
                                        out.append(KernelConfig(head_dim, dtype, causal, bm, bn, w, s, family, ov, pp, ps,
                                                                overlap_epilogue=oe, mma_rowsum=rs, lazy_rescale=lz,
                                                                q_regs=qr, p_smem=psm, o_tma=ot, cluster=cl,
                                                                lpt_by_head=hl))
                                    except ConfigError:
                                        continue
    if family == "sm90" and dtype not in FP8_DTYPES and head_dim <= EXP2_FMA_MAX_HEAD_DIM:
        out += [replace(c, exp2_fma=e) for e in EXP2_FMA_SHARES[1:] for c in out]  # after the rest: its order stays
    if family == "sm90":
        out += [replace(c, desc_step=True) for c in out]  # after the rest, the same way
    if family == "sm90" and causal:  # where a warpgroup's rows end a key tile before its CTA's (block_n < block_m)
        out += [replace(c, diag_cut=True) for c in out if c.block_m >= 128 and c.block_n < c.block_m]
    if family == "sm90" and dtype in FP8_DTYPES:  # after the rest, the same way; then v_t's own tiles, as at 192 keys
        vt = [replace(c, v_t=True) for c in out]
        out += vt + [replace(c, block_n=bn) for c in vt if c.block_n == 192 for bn in FP8_VT_BLOCK_NS]
    if family == "sm90" and gqa_group > 1:
        out += [replace(c, pack_gqa=True) for c in out
                if gqa_group <= c.block_m and not c.o_tma and not c.cluster and not c.lpt_by_head]
    return out


def around(cfg: KernelConfig | BwdConfig, cfgs: list, free: list[str]) -> list:
    """The configurations of `cfgs` equal to `cfg` but in the `free` fields (a re-tune of a stored tile over a
    new knob: `tune --around-store`; forward or backward, as `cfg` is)."""
    fixed = [f.name for f in fields(cfg) if f.name not in free]
    return [c for c in cfgs if all(getattr(c, f) == getattr(cfg, f) for f in fixed)]


# Sound starting points before any tuning, best first; the first that fits the arch
# is used. Chosen so that none spills registers (checked by tests/test_compile.py).
# (block_m, block_n, num_warps, num_stages)
_DEFAULT_TILES_SM90 = {  # FlashAttention-3's choices, roughly: two consumer warpgroups
    32: [(128, 128, 12, 2)],
    64: [(128, 128, 12, 2)],
    96: [(128, 128, 12, 2)],
    128: [(128, 128, 12, 2)],
    160: [(128, 128, 12, 2)],  # 64-byte swizzled rows, as d96's
    192: [(128, 96, 12, 2)],  # Q 48 KB + two stages of K and V at 96 keys: 193 KB
    256: [(128, 64, 12, 2)],
}
_DEFAULT_TILES_FP8 = {d: [(128, 128, 12, 2)] for d in FP8_HEAD_DIMS}
DEFAULT_TILES = {
    32: [(128, 128, 8, 2)],
    64: [(128, 64, 4, 2), (128, 64, 8, 2)],
    96: [(128, 64, 8, 2), (64, 64, 4, 2)],
    128: [(128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2)],
    160: [(128, 64, 8, 2), (64, 32, 4, 2)],  # sm86/sm89 (99 KB): 64 x 32 (64 x 64 spills 68 B)
    192: [(128, 32, 8, 2)],  # 128 x 64 spills 32 B (nvcc 13.0); 96 KB fits sm86/sm89 too
    256: [(128, 64, 8, 2), (128, 64, 8, 1), (64, 32, 4, 2), (64, 32, 4, 1)],
}


# Split widths' defaults (family sm90), best first: FlashAttention-3's tile for (192, 128), 128 x 128 with the
# intra-warpgroup overlap, and the schedule the H200's store picks for d128, whose S and O registers these have.
# Q 48 KB + two stages of K (48 KB) and V (32 KB): 209 KB. Then the same tile without the schedule knobs.
_DEFAULT_SPLIT_SM90: dict[tuple[int, int], list[dict[str, Any]]] = {
    (192, 128): [dict(block_m=128, block_n=128, num_warps=12, num_stages=2, overlap=True, pingpong=True,
                      persistent=True, lazy_rescale=True),
                 dict(block_m=128, block_n=128, num_warps=12, num_stages=2)],
}


def native_family(arch: str) -> str:
    """The template family built for an `arch` GPU: sm90 on Hopper (its kernels need sm_90a), else sm80."""
    return "sm90" if arch == "sm90" else "sm80"


def default_config(head_dim: int, dtype: str, causal: bool, arch: str = "sm80", family: str = "sm80",
                   head_dim_v: int | None = None) -> KernelConfig:
    """The untuned configuration `load()` uses for a problem on `arch` (FP8 only exists in family sm90); with
    head_dim_v, the split-width kernel of a pair of SPLIT_HEAD_DIMS (family sm90, 16-bit)."""
    _check_choice("head_dim", head_dim, DENSE_HEAD_DIMS)
    reason = ""
    if head_dim_v is not None and head_dim_v != head_dim:
        if (head_dim, head_dim_v) not in SPLIT_HEAD_DIMS or family != "sm90" or dtype not in HALF_DTYPES:
            raise ConfigError(f"no default split-width kernel for head_dim={head_dim}, head_dim_v={head_dim_v}, "
                              f"{dtype}, family {family}: built for {', '.join(map(str, SPLIT_HEAD_DIMS))} in family "
                              "sm90's 16-bit dense forward (other pairs run padded)")
        for knobs in _DEFAULT_SPLIT_SM90[head_dim, head_dim_v]:
            cfg = KernelConfig(head_dim, dtype, causal, family=family, head_dim_v=head_dim_v, **knobs)
            reason = cfg.unfit_reason(arch)
            if reason is None:
                return cfg
        raise ConfigError(f"no default split-width configuration fits {arch} for head_dim={head_dim}, "
                          f"head_dim_v={head_dim_v}: {reason}")
    tiles = _DEFAULT_TILES_FP8 if dtype in FP8_DTYPES else _DEFAULT_TILES_SM90 if family == "sm90" else DEFAULT_TILES
    for bm, bn, w, s in tiles.get(head_dim, ()):
        cfg = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, family)
        reason = cfg.unfit_reason(arch)
        if reason is None:
            return cfg
    raise ConfigError(f"no default configuration of family {family} fits {arch} for head_dim={head_dim}: {reason}")


def backward_forward_config(head_dim: int, dtype: str, causal: bool, arch: str) -> KernelConfig:
    """The forward that makes out and lse for verifying or timing a backward on `arch`: family sm80's default (its
    out and lse are exact either way; one rule, so the tuner and the timing scripts feed a backward the same)."""
    return default_config(head_dim, dtype, causal, arch, "sm80")


# ---- Backward ------------------------------------------------------------------------
# FlashAttention-2's backward, sm80 family (mma.sync; runs on sm80..sm90). One BwdConfig
# renders one .cu with three kernels: `{name}_pre` (D = rowsum(dO * O), zero the fp32 dQ
# accumulator), `{name}` (the main kernel: one block per K/V tile, dK and dV in registers,
# dQ by fp32 atomics) and `{name}_convert` (fp32 dQ to q's dtype); deterministic configs
# have `{name}_dq` instead of _convert (one block per Q tile, dQ in registers, no atomics).
# The main kernel carries the bare name, so compile_kernel's ptxas report is its own.
BWD_BLOCK_MS = (32, 64, 128)
BWD_BLOCK_NS = (32, 64, 128)
BWD_NUM_WARPS = (2, 4, 8)
BWD_ROW_WARPS = 8  # rows per block of the _pre and _convert kernels (one warp per row)
# fp32 accumulator registers per thread the bwd kernels may hold (main: dK + dV + S + dP;
# _dq: S + dP + dQ). A pre-filter, not a guarantee: with nvcc 13.0 every config at 160 spills
# (d96 and d128 64x64 w4, d256 64x64 w8), while at 128-144 some fit in 255 registers (d64
# 64x64 w4) and some spill a little (d128 128x64 w8: 32-44 bytes; d256 32x32 w4: 4 bytes).
# The defaults are checked against ptxas (tests/test_bwd_config.py).
BWD_MAX_ACCUM_REGS = 144
# sm90 family (FlashAttention-3's design): one producer warpgroup (TMA) plus one consumer warpgroup
# per 64 keys of block_n; each consumer keeps its keys' dK and dV in registers and computes S^T and
# dP^T (keys as wgmma's M), so P^T and dS^T feed dV and dK from registers. dQ goes by fp32 atomics (dq_tma: by
# bulk reduces, which deterministic configs order by n-block).
# dK + dV of 64 keys take head_dim registers per consumer thread: at 256, two warpgroups share the keys (kv_split);
# at 96 only one consumer warpgroup fits (block_m 64, block_n 64: dQ cannot split 96 columns into 64-wide slices).
SM90_BWD_HEAD_DIMS = (32, 64, 96, 128, 256)
SM90_BWD_BLOCK_MS = (64, 128)
# FlashAttention-4's Hopper tile for d128 without a mask: 80 queries per K/V barrier, stage and dS hand-off, 25% more
# than 64 at the same registers' reach. dQ's 80 rows are no multiple of wgmma's 64-row M, so dQ^T = K^T dS^T is
# computed instead (BwdConfig.dq_transposed), one warpgroup per 64 head dims: d128 with 128-key tiles. In the space
# after the other tiles.
SM90_BWD_DQ_T_BLOCK_M = 80
SM90_BWD_BLOCK_NS = (64, 128)
SM90_BWD_STAGES = (1, 2, 3)  # Q/dO tiles in flight
LSE_AHEADS = (0, 1, 2, 4, 8)  # BwdConfig.lse_ahead's choices (8 at block_m 64: the whole tile's)
LSE_AHEAD_SPACE = (0, 2)  # those in the tuning space (the others: scripts/time_configs.py +lse_ahead=N)


def sm90_bwd_kv_split(head_dim: int) -> int:
    """Consumer warpgroups of the sm90 backward that share 64 keys, each holding a slice of their dK and dV."""
    return 2 if head_dim == 256 else 1


def bwd_warp_grid(rows: int, cols: int, warps: int) -> tuple[int, int] | None:
    """How `warps` warps tile a [rows, cols] product: (warps along rows, warps along cols), each
    warp owning whole 16x16 pieces; None if they cannot. Same rule as the template's warp_grid."""
    wm = min(warps, rows // 16)
    if wm == 0 or warps % wm:
        return None
    wn = warps // wm
    if rows % (16 * wm) or cols % (16 * wn):
        return None
    return wm, wn


@dataclass(frozen=True)
class BwdConfig(_AsDict):
    """One FlashAttention-2 backward (all its kernels). Frozen and hashable; validated on construction."""

    head_dim: int
    dtype: str
    causal: bool
    block_m: int  # query rows per tile
    block_n: int  # keys per tile (one main-kernel block each)
    num_warps: int
    # Bit-identical gradients run to run. sm80: dQ by a separate kernel, no atomics. sm90 (needs dq_tma): the K/V
    # tiles' bulk reduces into each Q tile's rows of dq_accum take turns in n-block order (a counter per Q tile).
    deterministic: bool = False
    family: str = "sm80"
    num_stages: int = 2  # sm90: Q/dO tiles in flight (sm80 loads one at a time: stays 2)
    stagger: bool = False  # sm90: consumer warpgroups half a Q tile apart, each tile's dQ one iteration later
    # The forward's serving features that have a backward (BWD_FEATURES; sm90: varlen and window):
    varlen: bool = False  # packed sequences (cu_seqlens_q/_k), each with its own lengths and causal alignment
    window: bool = False  # sliding window
    softcap: bool = False  # scores = softcap * tanh(scores / softcap): dS gains the factor 1 - tanh^2
    alibi: bool = False  # scores -= slope * |i + seqlen_k - seqlen_q - j|
    # sm90: each consumer warpgroup writes its fp32 part of a Q tile's dQ to a shared-memory buffer of its own and a
    # warp of the producer warpgroup adds it to dq_accum by one TMA bulk reduce-add (FlashAttention-3's dQ), instead
    # of the consumers' per-thread vector atomics. Takes BLOCK_M x head_dim fp32 of shared memory (dq_tile_bytes).
    dq_tma: bool = False
    # Programmable attention (dense): the forward's score_mod and mask_mod digests (KernelConfig's; the gradient
    # recomputes the modified score and applies d score_mod / d score), and a block map (the q tiles of each K/V tile
    # for the main kernel, the K/V tiles of each q tile for sm80's _dq: empty pairs skipped, full ones unmasked).
    # Family sm90: head dims without kv_split.
    score_mod: str = ""
    mask_mod: str = ""
    block_map: bool = False
    # sm90, without kv_split or modifiers: the softmax reads each n-tile's LSE and D this many n-tiles (of 8 queries)
    # ahead of their first use, the first ones before the wait for S^T and dP^T (0: each just before its use, where
    # the dS^T stores pin it). LSE_AHEADS.
    lse_ahead: int = 0
    # sm90, without kv_split or modifiers: each consumer warpgroup overlaps its own work, forming P^T while dP^T's
    # product runs and dS^T while dV's does (FlashAttention-4's order), beside or instead of the staggered warpgroups.
    inner_overlap: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for f in ("score_mod", "mask_mod", "block_map", "lse_ahead", "inner_overlap"):  # left out when off
            if not d[f]:
                del d[f]
        return d

    def __post_init__(self) -> None:
        _check_choice("family", self.family, FAMILIES)
        _check_choice("dtype", self.dtype, HALF_DTYPES)
        _check_choice("causal", self.causal, (False, True))
        _check_choice("deterministic", self.deterministic, (False, True))
        _check_choice("dq_tma", self.dq_tma, (False, True))
        _check_choice("lse_ahead", self.lse_ahead, LSE_AHEADS)
        _check_choice("inner_overlap", self.inner_overlap, (False, True))
        for f in BWD_FEATURES:
            _check_choice(f, getattr(self, f), (False, True))
        self._check_modifiers()
        if self.family == "sm90" and (self.softcap or self.alibi):
            raise ConfigError("the backward with softcap or ALiBi is built in family sm80 (it runs on Hopper too); "
                              "family sm90 has varlen and window")
        if self.family == "sm90":
            self._check_sm90()
            return
        _check_choice("num_stages", self.num_stages, (2,))
        _check_choice("stagger", self.stagger, (False,))
        _check_choice("dq_tma", self.dq_tma, (False,))
        _check_choice("lse_ahead", self.lse_ahead, (0,))
        _check_choice("inner_overlap", self.inner_overlap, (False,))
        _check_choice("head_dim", self.head_dim, DENSE_HEAD_DIMS)
        if self.head_dim in DENSE_ONLY_HEAD_DIMS and (self.features or self.modified):
            raise ConfigError(f"head_dim={self.head_dim} is built for the dense backward only, without serving "
                              f"features or modifiers; those are built at {', '.join(map(str, HEAD_DIMS))}")
        _check_choice("block_m", self.block_m, BWD_BLOCK_MS)
        _check_choice("block_n", self.block_n, BWD_BLOCK_NS)
        _check_choice("num_warps", self.num_warps, BWD_NUM_WARPS)
        for what, rows, cols in (("S = Q K^T", self.block_m, self.block_n), ("dK, dV", self.block_n, self.head_dim),
                                 ("dQ", self.block_m, self.head_dim)):
            if bwd_warp_grid(rows, cols, self.num_warps) is None:
                raise ConfigError(
                    f"num_warps={self.num_warps} cannot tile the [{rows}, {cols}] {what} product in whole 16x16 "
                    f"pieces (block_m={self.block_m}, block_n={self.block_n}, head_dim={self.head_dim})")

    def _check_modifiers(self) -> None:
        for kind in ("score_mod", "mask_mod"):
            digest = getattr(self, kind)
            if not isinstance(digest, str) or (digest and not all(c in "0123456789abcdef" for c in digest)):
                raise ConfigError(f"{kind} must be a modifier's digest (lowercase hex) or empty, not {digest!r}")
        _check_choice("block_map", self.block_map, (False, True))
        if not self.modified:
            return
        if self.family == "sm90" and sm90_bwd_kv_split(self.head_dim) > 1:
            raise ConfigError(f"family sm90's backward of score_mod, mask_mod and block maps is built at head dims "
                              f"{', '.join(str(d) for d in SM90_BWD_HEAD_DIMS if sm90_bwd_kv_split(d) == 1)}, not "
                              f"{self.head_dim} (two warpgroups share each key's P^T and dS^T there); family sm80 "
                              "builds it")
        if self.varlen:
            raise ConfigError("score_mod, mask_mod and block maps have a dense backward (not varlen)")
        if self.score_mod and (self.softcap or self.alibi):
            raise ConfigError("a score_mod does not combine with softcap or alibi (write them into the score_mod)")

    def _check_sm90(self) -> None:
        _check_choice("head_dim", self.head_dim, SM90_BWD_HEAD_DIMS)
        _check_choice("block_m", self.block_m, SM90_BWD_BLOCK_MS + (SM90_BWD_DQ_T_BLOCK_M,))
        _check_choice("block_n", self.block_n, SM90_BWD_BLOCK_NS)
        _check_choice("num_stages", self.num_stages, SM90_BWD_STAGES)
        _check_choice("stagger", self.stagger, (False, True))
        if self.dq_transposed:
            self._check_dq_transposed()
        for knob in ("lse_ahead", "inner_overlap"):
            if getattr(self, knob) and (self.kv_split > 1 or self.modified):
                raise ConfigError(f"{knob} is built for the sm90 backward without kv_split or modifiers (its softmax), "
                                  f"not head_dim={self.head_dim}"
                                  f"{' with a score_mod, mask_mod or block map' if self.modified else ''}")
        if self.inner_overlap and self.head_dim + 3 * self.block_m // 2 > 224:
            raise ConfigError(f"inner_overlap keeps P^T in fp32 beside its packed copy: at head_dim={self.head_dim} with "
                              f"block_m={self.block_m} the consumers run out of registers (ptxas serializes the wgmmas, "
                              "C7512); 64-row tiles up to d128, 128-row ones at d32")
        if self.inner_overlap and self.lse_ahead:
            raise ConfigError("inner_overlap reads each n-tile's LSE and D in its own pass (lse_ahead is for the one-pass "
                              "softmax)")
        if self.deterministic and not self.dq_tma:
            raise ConfigError("deterministic=True in family sm90 needs dq_tma=True (dQ's bulk reduces are what it orders; "
                              "the consumers' per-thread atomics have no order)")
        if self.consumers > 2:
            raise ConfigError(f"block_n={self.block_n} at head_dim={self.head_dim} needs {self.consumers} consumer "
                              "warpgroups; family sm90's backward has registers for two")
        if self.num_warps != 4 * (1 + self.consumers):
            raise ConfigError(f"num_warps={self.num_warps} must be {4 * (1 + self.consumers)} for block_n={self.block_n} "
                              "in family sm90 (a producer warpgroup plus one consumer warpgroup per 64 keys, "
                              f"{self.kv_split} at head_dim={self.head_dim})")
        if self.dq_parts < 1 or (self.dq_parts > 1 and (self.head_dim // self.dq_parts) % 64):
            raise ConfigError(
                f"block_m={self.block_m} with block_n={self.block_n} cannot split dQ = dS K over {self.consumers} "
                "consumer warpgroup(s): each takes 64 rows of block_m, or 64-column slices of head_dim")
        limit = ARCHS["sm90"].smem_per_block
        if self.dq_tma and self.smem_bytes > limit:
            raise ConfigError(f"dq_tma=True needs {self.dq_tile_bytes} more bytes of shared memory (the [{self.block_m}, "
                              f"{self.head_dim}] fp32 dQ tile): {self.smem_bytes} B > {limit} B per block at "
                              f"block_m={self.block_m}, block_n={self.block_n}, num_stages={self.num_stages}")

    def _check_dq_transposed(self) -> None:
        if (self.head_dim, self.block_n) != (128, 128):  # (d64's one warpgroup: _pre's rows would not divide 80)
            raise ConfigError(f"block_m={self.block_m} computes dQ^T = K^T dS^T, one consumer warpgroup per 64 head dims: "
                              f"built for head_dim 128 with block_n 128, not head_dim={self.head_dim} with "
                              f"block_n={self.block_n}")
        if self.modified or self.inner_overlap:
            raise ConfigError(f"block_m={self.block_m} (dQ^T) is built for the one-pass softmax without modifiers: not with "
                              f"{'a score_mod, mask_mod or block map' if self.modified else 'inner_overlap'}")

    @property
    def dq_transposed(self) -> bool:
        """sm90: dQ computed as dQ^T = K^T dS^T (block_m no multiple of wgmma's 64-row M): dS goes to shared memory
        with keys contiguous, each consumer warpgroup adds 64 head dims of it, and _convert undoes that order."""
        return self.family == "sm90" and self.block_m % 64 != 0

    @property
    def kv_split(self) -> int:
        """sm90: consumer warpgroups sharing one group of 64 keys, each with a slice of dK and dV's columns
        (2 at head_dim 256, whose dK + dV would take 256 registers per thread)."""
        return sm90_bwd_kv_split(self.head_dim)

    @property
    def consumers(self) -> int:
        """sm90: consumer warpgroups, kv_split per 64 keys of the K/V tile."""
        return self.block_n // 64 * self.kv_split

    @property
    def smem_w(self) -> int:
        """sm90: elements per swizzled shared-memory row (128 or 64 bytes), the TMA boxes' inner size."""
        return 64 if self.head_dim % 64 == 0 else 32

    @property
    def row_bytes(self) -> int:
        """sm90: bytes of one swizzled shared-memory row: TMA's and wgmma's swizzle width."""
        return self.smem_w * ELEM_BYTES

    @property
    def dq_parts(self) -> int:
        """sm90: column slices of dQ = dS K, one per consumer warpgroup and 64-row chunk of block_m
        (0 if block_m has more 64-row chunks than there are consumer warpgroups)."""
        return self.consumers if self.dq_transposed else self.consumers // (self.block_m // 64)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        name = (f"bwd_{self.family}_d{self.head_dim}_{self.dtype}_{mask}_bm{self.block_m}_bn{self.block_n}"
                f"_w{self.num_warps}")
        name += f"_s{self.num_stages}_st{int(self.stagger)}" if self.family == "sm90" else f"_det{int(self.deterministic)}"
        name += "_dqt" if self.dq_tma else ""
        name += "_det" if self.deterministic and self.family == "sm90" else ""
        name += f"_la{self.lse_ahead}" if self.lse_ahead else ""
        name += "_io" if self.inner_overlap else ""
        name += "".join(f"_{_FEATURE_TAGS[f]}" for f in self.features)
        name += f"_sm{self.score_mod[:8]}" if self.score_mod else ""
        name += f"_mm{self.mask_mod[:8]}" if self.mask_mod else ""
        return name + ("_bmap" if self.block_map else "")

    @property
    def features(self) -> tuple[str, ...]:
        """The serving features this backward was generated with, in BWD_FEATURES order."""
        return tuple(f for f in BWD_FEATURES if getattr(self, f))

    @property
    def modified(self) -> bool:
        """Generated with a score_mod, mask_mod or block map: takes BwdServeModParams."""
        return bool(self.score_mod or self.mask_mod or self.block_map)

    @property
    def serving(self) -> bool:
        """Takes BwdServeParams (templates/common/bwd_serve_params.cuh.j2) rather than BwdParams (with modifiers:
        inside BwdServeModParams)."""
        return bool(self.features) or self.modified

    @property
    def kernel_names(self) -> dict[str, str]:
        """Role -> `__global__` name of every kernel in the rendered file."""
        last = "dq" if self.deterministic and self.family == "sm80" else "convert"
        return {"pre": f"{self.name}_pre", "main": self.name, last: f"{self.name}_{last}"}

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def row_threads(self) -> int:
        """Threads of the _pre and _convert kernels."""
        return 32 * BWD_ROW_WARPS

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main kernel (the _dq kernel needs less and gets the same):
        K, V [block_n, d]; Q, dO [block_m, d]; P, dS [block_m, block_n]; LSE and D [block_m] fp32.
        sm90: K, V; num_stages of (Q, dO, LSE, D); two dS^T buffers (kv_split: and two P^T buffers); dq_tma: the
        fp32 dQ tile; barriers (K/V, two per stage, two per dS^T and P^T buffer, dq_tma: two per consumer
        warpgroup's part of the dQ tile); 1024 bytes of alignment."""
        if self.family == "sm90":
            kv = 2 * self.block_n * self.head_dim * ELEM_BYTES
            stage = 2 * self.block_m * self.head_dim * ELEM_BYTES + 2 * self.block_m * 4
            ds = 2 * self.block_m * self.block_n * ELEM_BYTES * (2 if self.kv_split > 1 else 1)  # (+ P^T buffers)
            bars = 1 + 2 * self.num_stages + (8 if self.kv_split > 1 else 4) + (2 * self.consumers if self.dq_tma else 0)
            return 1024 + kv + self.num_stages * stage + ds + (self.dq_tile_bytes if self.dq_tma else 0) + 8 * bars
        elems = 2 * self.block_n * self.head_dim + 2 * self.block_m * self.head_dim + 2 * self.block_m * self.block_n
        return elems * ELEM_BYTES + 2 * self.block_m * 4

    @property
    def dq_tile_bytes(self) -> int:
        """sm90 dq_tma: the shared-memory dQ tile, [block_m, head_dim] fp32."""
        return self.block_m * self.head_dim * 4

    @property
    def accum_regs(self) -> int:
        """fp32 accumulator registers per thread: the main kernel's dK + dV + S + dP, or the _dq
        kernel's S + dP + dQ, whichever is more. sm90: per consumer thread, its keys' dK + dV and S^T + dP^T."""
        if self.family == "sm90":
            return self.head_dim // self.kv_split + self.block_m
        kv = 2 * self.block_n * self.head_dim // self.threads
        s = 2 * self.block_m * self.block_n // self.threads
        dq = self.block_m * self.head_dim // self.threads if self.deterministic else 0
        return max(kv + s, s + dq)

    def grid(self, batch: int, heads: int, seqlen_k: int) -> tuple[int, int, int]:
        """Main kernel: one flat grid of n-blocks x heads x batch."""
        return _flat_grid(grids.BWD_MAIN.bind(BLOCK_N=self.block_n)(seqlen_k, heads, batch),
                          f"ceil(seqlen_k / {self.block_n}) * heads * batch")

    def dq_grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        """_dq kernel (deterministic): m-blocks x heads x batch."""
        return _flat_grid(grids.BWD_DQ.bind(BLOCK_M=self.block_m)(seqlen_q, heads, batch),
                          f"ceil(seqlen_q / {self.block_m}) * heads * batch")

    def rows_grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        """_pre and _convert kernels: groups of BWD_ROW_WARPS query rows x heads x batch (sm90: _pre over groups of
        pre_rows of the seqlen_q_pad rows, and _convert takes convert_grid)."""
        sm90 = self.family == "sm90"
        g = grids.SM90_BWD_ROWS if sm90 else grids.BWD_ROWS
        what = (f"ceil(seqlen_q / {self.block_m}) * {self.block_m} / {self.pre_rows} * heads * batch" if sm90
                else f"ceil(seqlen_q / {BWD_ROW_WARPS}) * heads * batch")
        return _flat_grid(g.bind(BLOCK_M=self.block_m, ROW_WARPS=BWD_ROW_WARPS, PRE_ROWS=self.pre_rows)(
            seqlen_q, heads, batch), what)

    @property
    def pre_rows(self) -> int:
        """sm90 _pre: padded query rows per block of row_threads, each row read by 4 threads (8 from d256), 16 bytes
        of O and of dO at a time (one warp a row, 4 bytes at a time, left the d64 kernel latency-bound)."""
        rows = self.row_threads // (8 if self.head_dim >= 256 else 4)
        return math.gcd(rows, self.block_m)  # a block's rows lie in one Q tile (16 of 80-row ones: 16 lanes a row)

    def seqlen_q_pad(self, seqlen_q: int) -> int:
        """sm90: the row count of the padded LSE, D and dQ-accumulator buffers (whole Q tiles)."""
        return -(-seqlen_q // self.block_m) * self.block_m

    def convert_grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        """sm90 _convert: 256 threads a block, 128 per unit of 64 rows x 32 columns of the accumulator (dq_transposed:
        of 16 rows x 64 columns)."""
        g = self.convert_grid_rule.bind(BLOCK_M=self.block_m, HEAD_DIM=self.head_dim)
        floats = 2048 if self.dq_transposed else 4096  # of the accumulator a block
        return _flat_grid(g(seqlen_q, heads, batch), f"ceil(seqlen_q * head_dim / {floats}) * heads * batch")

    @property
    def convert_grid_rule(self) -> grids.Grid:
        """sm90 _convert's grid (launch and exported header): dQ's units, or dQ^T's."""
        return grids.SM90_BWD_CONVERT_T if self.dq_transposed else grids.SM90_BWD_CONVERT

    def unfit_reason(self, arch: str) -> str | None:
        """Why this config cannot run on `arch`, or None if it fits."""
        lim = arch_limits(arch)
        if self.family == "sm90" and lim.sm != 90:
            return f"family sm90 (TMA, wgmma) runs on sm90 only, not {arch}"
        if self.threads > lim.max_threads:
            return f"{self.threads} threads per block > {lim.max_threads} on {arch}"
        if self.smem_bytes > lim.smem_per_block:
            return f"shared memory {self.smem_bytes} B > {lim.smem_per_block} B per block on {arch}"
        if self.family == "sm90":
            limit = SM90_REGS[self.consumers][1] - 32  # addresses, descriptors, loop state (d128's 80-row tile: 208)
            if self.accum_regs > limit:
                return (f"{self.accum_regs} accumulator registers per consumer thread (dK + dV + S^T + dP^T) > {limit} "
                        f"(head_dim={self.head_dim}, block_m={self.block_m})")
            return None
        if self.accum_regs > BWD_MAX_ACCUM_REGS:
            return (f"{self.accum_regs} accumulator registers per thread > {BWD_MAX_ACCUM_REGS} "
                    f"(tiles too large for {self.num_warps} warps at head_dim={self.head_dim})")
        return None



def _flat_grid(blocks: int, what: str) -> tuple[int, int, int]:
    if blocks > MAX_GRID_X:
        raise ValueError(f"{blocks} blocks ({what}) exceed the {MAX_GRID_X} a launch may have; split the batch")
    return (blocks, 1, 1)


def bwd_space(head_dim: int, dtype: str, causal: bool, deterministic: bool = False,
              family: str = "sm80") -> list[BwdConfig]:
    """Every valid backward configuration of one family for one problem (arch fit not checked: see unfit_reason)."""
    if family == "sm90":
        # the later knobs outermost (lse_ahead, then dq_tma): the configurations without them keep their order
        las = LSE_AHEAD_SPACE if sm90_bwd_kv_split(head_dim) == 1 else (0,)
        grid = [(bm, bn, 4 * (1 + bn // 64 * sm90_bwd_kv_split(head_dim)), s, st, dqt, la) for la in las
                for dqt in (False, True) for bm in SM90_BWD_BLOCK_MS for bn in SM90_BWD_BLOCK_NS
                for s in SM90_BWD_STAGES for st in (False, True)]
        # then the 80-row tiles (d128 with 128-key tiles; the others refuse them)
        grid += [(SM90_BWD_DQ_T_BLOCK_M, 128, 12, s, st, dqt, la) for la in las for dqt in (False, True)
                 for s in SM90_BWD_STAGES for st in (False, True)]
    else:
        grid = [(bm, bn, w, 2, False, False, 0) for bm in BWD_BLOCK_MS for bn in BWD_BLOCK_NS for w in BWD_NUM_WARPS]
    out = []
    for bm, bn, w, s, st, dqt, la in grid:
        try:
            out.append(BwdConfig(head_dim, dtype, causal, bm, bn, w, deterministic, family, s, st, dq_tma=dqt,
                                 lse_ahead=la))
        except ConfigError:
            continue
    return out


# (block_m, block_n, num_warps), best first; the first that fits the arch is used. None spills
# on sm_80 or sm_90 (tests/test_bwd_config.py); main-kernel registers from ptxas (nvcc 13.0,
# sm_80/sm_90): d32 215/216, d64 154/128, d96 229/229, d128 126/121, d256 209/213. (d128 at
# 64 x 64 x 8 warps reaches 251 and d64 at 64 x 128 spills: kept out for now.)
_DEFAULT_BWD_TILES = {
    32: [(64, 128, 8), (64, 64, 4)],
    64: [(64, 64, 8), (64, 64, 4)],
    96: [(64, 64, 8), (64, 32, 4)],
    128: [(64, 32, 8), (64, 32, 4)],
    160: [(32, 32, 4)],  # 64 x 64 x 8 warps spills 32-36 B, 64 x 32 x 4 24 B (8 warps cannot tile 32 x 160)
    192: [(64, 32, 8)],  # 217 registers, 175 deterministic (sm_80); 81 KB of shared memory
    256: [(64, 32, 8), (32, 32, 4)],  # 64 x 64 needs 160 accumulators; sm86/sm89 (99 KB): 32 x 32
}


# sm90: (block_m, block_n, num_warps, num_stages, stagger): FlashAttention-3's tile shapes for these head dims,
# with what the H200 tune picked at most points (staggered at d64/d128, d128 with 3 stages as the
# staggered consumers hold two Q tiles at once; not staggered at d256, whose two warpgroups hand P^T and dS^T
# to each other every tile).
_DEFAULT_BWD_TILES_SM90 = {32: [(128, 128, 12, 2, True)], 64: [(128, 128, 12, 2, True)], 96: [(64, 64, 8, 2, False)],
                           128: [(64, 128, 12, 3, True)], 256: [(64, 64, 12, 2, False)]}


def default_bwd_config(head_dim: int, dtype: str, causal: bool, arch: str = "sm80",
                       deterministic: bool = False, family: str | None = None) -> BwdConfig:
    """The untuned backward configuration for a problem on `arch`: family sm90 where it has one
    (sm90, its head dims) unless `family` says otherwise, else sm80. Deterministic in family sm90: the same
    tiles with dq_tma, in as many of their stages as leave room for the fp32 dQ tile."""
    _check_choice("head_dim", head_dim, DENSE_HEAD_DIMS)
    if family is None:
        family = "sm90" if arch_limits(arch).sm == 90 and head_dim in SM90_BWD_HEAD_DIMS else "sm80"
    reason = ""
    tiles = (_DEFAULT_BWD_TILES_SM90.get(head_dim, []) if family == "sm90"
             else [(bm, bn, w, 2, False) for bm, bn, w in _DEFAULT_BWD_TILES[head_dim]])
    sm90_det = family == "sm90" and deterministic
    for bm, bn, w, stages, st in tiles:
        for s in range(stages, 0, -1) if sm90_det else (stages,):
            try:
                cfg = BwdConfig(head_dim, dtype, causal, bm, bn, w, deterministic, family, s, st, dq_tma=sm90_det)
            except ConfigError as e:  # sm90 deterministic: the dQ tile does not fit beside this many stages
                if not sm90_det:
                    raise
                reason = str(e)
                continue
            reason = cfg.unfit_reason(arch)
            if reason is None:
                return cfg
    raise ConfigError(f"no default backward configuration fits {arch} for head_dim={head_dim}: {reason}")


def modifier_bwd_config(head_dim: int, dtype: str, causal: bool, arch: str = "sm80", deterministic: bool = False,
                        features: tuple[str, ...] = (), *, score_mod: str = "", mask_mod: str = "",
                        block_map: bool = False) -> BwdConfig:
    """The sm80 family's backward of a call with a score_mod, mask_mod or block map: its default tiles for `arch`,
    generated with `features` and the forward's modifiers (Hopper's own: kernels.serving.sm90_modifier_bwd_config)."""
    base = default_bwd_config(head_dim, dtype, causal, arch, deterministic, family="sm80")
    return replace(base, **dict.fromkeys(features, True), score_mod=score_mod, mask_mod=mask_mod, block_map=block_map)
