"""The public API: `load()` a kernel for a problem, or call `attention()` directly."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .compile import CompiledKernel, Resources, compile_kernel, target_for
from .config import FAMILIES, KernelConfig, arch_limits, default_config
from .launch import run


class Kernel:
    """A compiled forward attention kernel, callable like `flashgen.attention` (its causal is fixed)."""

    def __init__(self, compiled: CompiledKernel):
        self.compiled = compiled

    @property
    def config(self) -> KernelConfig:
        return self.compiled.config

    @property
    def source(self) -> str:
        return self.compiled.source

    @property
    def resources(self) -> Resources:
        return self.compiled.resources

    @property
    def name(self) -> str:
        return self.config.name

    def __call__(self, q: Any, k: Any, v: Any, softmax_scale: float | None = None, return_lse: bool = False,
                 stream: Any = None) -> Any:
        """out = softmax(q k^T * scale [+ causal mask]) v; with return_lse, (out, lse) where lse is (batch, heads, seqlen_q) fp32.

        Torch tensors run on torch's current stream; `stream` (a pycuda Stream or raw handle) is for GPU arrays."""
        out, lse, _ = run(self.compiled, q, k, v, softmax_scale, stream)
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        r = self.resources
        return f"Kernel({self.name}, {self.compiled.target}, {r.registers} regs, {r.smem_bytes} B smem, spills={r.spills})"


def current_arch() -> str:
    """The compute capability of the current CUDA device, e.g. "sm90"."""
    from .driver import device_info  # noqa: PLC0415

    return device_info().arch


def choose_config(head_dim: int, dtype: str, causal: bool, arch: str, seqlen: int | None = None,
                  family: str | None = None, tuned_dir: Path | str | None = None) -> KernelConfig:
    """The configuration `load()` uses on an `arch` GPU: the tuned one for the current GPU and
    nearest seqlen bucket (family None: the fastest family tuned), else the family default."""
    from .store import tuned_config  # noqa: PLC0415

    arch_limits(arch)
    return tuned_config(head_dim, dtype, causal, arch, seqlen, family, tuned_dir) or default_config(
        head_dim, dtype, causal, arch, family or "sm80")


@functools.lru_cache(maxsize=256)
def _compiled(cfg: KernelConfig, target: str) -> CompiledKernel:
    return compile_kernel(cfg, target)


def load(head_dim: int, dtype: str = "bf16", causal: bool = False, config: KernelConfig | None = None,
         seqlen: int | None = None, arch: str | None = None, gpu_arch: str | None = None,
         tuned_dir: Path | str | None = None) -> Kernel:
    """A compiled kernel for this problem on the current GPU.

    arch forces a template family ("sm80", "sm90"); by default the fastest family tuned for
    this GPU (the store in `tuned_dir`, FLASHGEN_TUNED_DIR or tuned/) is used, else sm80's
    default. `config` pins an exact configuration. `gpu_arch` ("sm80", "sm90", ...) compiles
    for that GPU instead of the current one, so no GPU is needed."""
    if arch is not None and arch not in FAMILIES:
        raise ValueError(f"arch={arch!r} is not a template family; choose one of {', '.join(FAMILIES)}")
    target_arch = gpu_arch or current_arch()
    if config is None:
        config = choose_config(head_dim, dtype, causal, target_arch, seqlen, arch, tuned_dir)
    elif (config.head_dim, config.dtype, config.causal) != (head_dim, dtype, causal):
        raise ValueError(f"config {config.name} does not match head_dim={head_dim}, dtype={dtype}, causal={causal}")
    reason = config.unfit_reason(target_arch)
    if reason:
        raise ValueError(f"{config.name} cannot run on {target_arch}: {reason}")
    return Kernel(_compiled(config, target_for(target_arch, config.family)))


def attention(q: Any, k: Any, v: Any, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, stream: Any = None, arch: str | None = None) -> Any:
    """FlashAttention forward with flash_attn's conventions.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim) with
    heads % heads_k == 0 (GQA/MQA). Causal masks align to the bottom right (query i sees
    keys j <= i + seqlen_k - seqlen_q). softmax_scale defaults to 1/sqrt(head_dim).
    Returns out like q, and with return_lse also lse (batch, heads, seqlen_q) fp32.
    arch forces a template family ("sm80", "sm90"), as in `load`."""
    from .tensors import check_qkv, view  # noqa: PLC0415

    prob = check_qkv(view(q, "q"), view(k, "k"), view(v, "v"))
    kernel = load(prob.head_dim, prob.dtype, causal, seqlen=prob.seqlen_k, arch=arch)
    return kernel(q, k, v, softmax_scale=softmax_scale, return_lse=return_lse, stream=stream)
