"""Step 1 of the pipeline: what one kernel is, and whether it can exist on an arch.

A `KernelConfig` names every compile-time choice of one forward kernel. Its `.name`
spells each field and is used as the `__global__` name, the cache key's prefix, the
exported file name and the tuner's trial label.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

FAMILIES = ("sm80",)
HEAD_DIMS = (32, 64, 96, 128, 256)
DTYPES = ("fp16", "bf16")
BLOCK_MS = (64, 128, 256)
BLOCK_NS = (32, 64, 128, 256)
NUM_WARPS = (2, 4, 8, 16)
NUM_STAGES = (1, 2, 3, 4)
ELEM_BYTES = 2  # fp16 and bf16


@dataclass(frozen=True)
class ArchLimits:
    """What one block may use on an architecture (CUDA programming guide, table 'Technical specifications')."""

    arch: str
    smem_per_block: int  # bytes of shared memory one block may opt in to
    max_threads: int = 1024
    max_regs_per_thread: int = 255

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


class ConfigError(ValueError):
    """A configuration that is impossible; the message names the field."""


def _check_choice(field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")


def arch_limits(arch: str) -> ArchLimits:
    if arch not in ARCHS:
        raise ConfigError(f"arch={arch!r} is not known; choose one of {', '.join(map(repr, ARCHS))}")
    return ARCHS[arch]


@dataclass(frozen=True)
class KernelConfig:
    """One forward attention kernel. Frozen and hashable; validated on construction."""

    head_dim: int
    dtype: str
    causal: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    family: str = "sm80"

    def __post_init__(self) -> None:
        _check_choice("family", self.family, FAMILIES)
        _check_choice("head_dim", self.head_dim, HEAD_DIMS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("causal", self.causal, (False, True))
        _check_choice("block_m", self.block_m, BLOCK_MS)
        _check_choice("block_n", self.block_n, BLOCK_NS)
        _check_choice("num_warps", self.num_warps, NUM_WARPS)
        _check_choice("num_stages", self.num_stages, NUM_STAGES)
        # Each warp owns whole 16-row slices of the Q tile (mma.sync is m16).
        if self.block_m % (16 * self.num_warps):
            raise ConfigError(
                f"block_m={self.block_m} must be a multiple of 16*num_warps={16 * self.num_warps} "
                "(each warp owns whole 16-row mma tiles)"
            )

    # -- derived figures -------------------------------------------------------
    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"fwd_{self.family}_d{self.head_dim}_{self.dtype}_{mask}"
            f"_bm{self.block_m}_bn{self.block_n}_w{self.num_warps}_s{self.num_stages}"
        )

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def warp_m_tiles(self) -> int:
        """16-row mma tiles each warp owns."""
        return self.block_m // (16 * self.num_warps)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the Q tile plus `num_stages` K and V tiles."""
        q = self.block_m * self.head_dim
        kv = 2 * self.num_stages * self.block_n * self.head_dim
        return (q + kv) * ELEM_BYTES

    @property
    def accum_regs(self) -> int:
        """fp32 registers per thread for the S and O accumulators."""
        return self.warp_m_tiles * (self.block_n + self.head_dim) // 2

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.block_m), heads, batch)

    def unfit_reason(self, arch: str) -> str | None:
        """Why this config cannot run on `arch`, or None if it fits."""
        lim = arch_limits(arch)
        if self.threads > lim.max_threads:
            return f"{self.threads} threads per block > {lim.max_threads} on {arch}"
        if self.smem_bytes > lim.smem_per_block:
            return f"shared memory {self.smem_bytes} B > {lim.smem_per_block} B per block on {arch}"
        if self.accum_regs > MAX_ACCUM_REGS:
            return (
                f"{self.accum_regs} accumulator registers per thread > {MAX_ACCUM_REGS} "
                f"(block_n + head_dim too large for {self.warp_m_tiles} m-tiles per warp)"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KernelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes: Any) -> "KernelConfig":
        return KernelConfig(**{**asdict(self), **changes})


def space(family: str, head_dim: int, dtype: str, causal: bool) -> list[KernelConfig]:
    """Every syntactically valid tile configuration of a family for one problem.

    Arch fit is not checked here (see `KernelConfig.unfit_reason`)."""
    _check_choice("family", family, FAMILIES)
    out = []
    for bm in BLOCK_MS:
        for bn in BLOCK_NS:
            for w in NUM_WARPS:
                for s in NUM_STAGES:
                    try:
                        out.append(KernelConfig(head_dim, dtype, causal, bm, bn, w, s, family))
                    except ConfigError:
                        continue
    return out


# Sound starting points before any tuning, best first; the first that fits the arch
# is used. Chosen so that none spills registers (checked by tests/test_compile.py).
# (block_m, block_n, num_warps, num_stages)
_DEFAULT_TILES = {
    32: [(128, 128, 8, 2)],
    64: [(128, 64, 4, 2), (128, 64, 8, 2)],
    96: [(128, 64, 8, 2), (64, 64, 4, 2)],
    128: [(128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2)],
    256: [(128, 64, 8, 2), (128, 64, 8, 1), (64, 32, 4, 2), (64, 32, 4, 1)],
}


def default_config(head_dim: int, dtype: str, causal: bool, arch: str = "sm80", family: str = "sm80") -> KernelConfig:
    """The untuned configuration `load()` uses for a problem on `arch`."""
    _check_choice("head_dim", head_dim, HEAD_DIMS)
    for bm, bn, w, s in _DEFAULT_TILES[head_dim]:
        cfg = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, family)
        if cfg.unfit_reason(arch) is None:
            return cfg
    raise ConfigError(f"no default configuration fits {arch} for head_dim={head_dim}")
