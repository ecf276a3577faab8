"""Step 2: a KernelConfig becomes one standalone CUDA source file."""
from __future__ import annotations

import functools

import jinja2

from . import abi
from .__version__ import __version__
from .config import BWD_ROW_WARPS, COMBINE_WARPS, MAX_SPLITS, SM90_REGS, VT_KEYS, VT_THREADS, BwdConfig, KernelConfig
from .modifiers import MAX_CAPTURED, MAX_RANK, SPLIT_LENGTH_LIMIT, Modifier, ModifierError, lookup
from .paths import templates_dir

# dtype -> (C++ element type, its 2-vector, the float2 packer, the PTX mma type)
_TYPES = {
    "fp16": ("__half", "__half2", "__floats2half2_rn", "f16"),
    "bf16": ("__nv_bfloat16", "__nv_bfloat162", "__floats2bfloat162_rn", "bf16"),
    "fp8_e4m3": ("__nv_fp8_e4m3", None, None, "e4m3"),  # P and O are packed by pack_e4m3 and as out_dtype
}


@functools.lru_cache(maxsize=None)
def template_env() -> jinja2.Environment:
    """The Jinja2 environment over templates/ (StrictUndefined: a missing variable is an error)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.globals["abi"] = abi  # the argument structs are declared from their one description
    return env


@functools.lru_cache(maxsize=1024)
def render(cfg: KernelConfig | BwdConfig) -> str:
    """The CUDA source of `cfg`'s kernel; its `__global__` function is named `cfg.name` (a BwdConfig's
    file holds several: `cfg.kernel_names`)."""
    if isinstance(cfg, BwdConfig):
        return _render_bwd(cfg)
    elem_t, _, _, ptx_type = _TYPES[cfg.dtype]
    out_t, elem2_t, pack_fn, _ = _TYPES[cfg.output_dtype]  # pack2 packs O (and 16-bit P)
    template = template_env().get_template(f"{cfg.family}/fwd.cu.j2")
    producer_regs, consumer_regs = cfg.register_split if cfg.family == "sm90" else (None, None)
    score_mod, mask_mod, captured = modifiers_of(cfg)
    return template.render(
        cfg=cfg, version=__version__, elem_t=elem_t, out_t=out_t, elem2_t=elem2_t, pack_fn=pack_fn, ptx_type=ptx_type,
        params_t=("Sm90Fp8FwdParams" if cfg.fp8 else "Sm90ServeModFwdParams" if cfg.modified
                  else "Sm90ServeFwdParams" if cfg.serving else "Sm90FwdParams"),
        producer_regs=producer_regs, consumer_regs=consumer_regs, combine_warps=COMBINE_WARPS, max_splits=MAX_SPLITS,
        vt_keys=VT_KEYS, vt_threads=VT_THREADS,
        score_mod=score_mod, mask_mod=mask_mod, captured=captured, split_length_limit=SPLIT_LENGTH_LIMIT,
        # a mask_mod alone that loads per score: the overlapped schedule applies it to S in place (consumer_ops)
        mask_in_place=mask_mod is not None and score_mod is None and mask_mod.loads_on_cut_tiles,
    )


def modifiers_of(cfg: KernelConfig | BwdConfig) -> tuple[Modifier | None, Modifier | None, tuple]:
    """(score_mod, mask_mod, their captured tensors in ModTensor slot order) of `cfg`, from the modifier registry;
    ModifierError where one was not traced in this process or they read more tensors than the kernel takes."""
    score_mod = lookup(cfg.score_mod, "score") if cfg.score_mod else None
    mask_mod = lookup(cfg.mask_mod, "mask") if cfg.mask_mod else None
    captured = tuple(c for m in (score_mod, mask_mod) if m is not None for c in m.captured)
    if len(captured) > MAX_CAPTURED:
        raise ModifierError(f"score_mod and mask_mod read {len(captured)} tensors; a kernel takes at most "
                            f"{MAX_CAPTURED}")
    for c in captured:
        if c.rank > MAX_RANK:
            raise ModifierError(f"captured tensor {c.name!r} has {c.rank} dimensions; a kernel takes at most {MAX_RANK}")
    return score_mod, mask_mod, captured


def _render_bwd(cfg: BwdConfig) -> str:
    """The backward's kernels of `cfg` in one file (templates/{family}/bwd.cu.j2)."""
    elem_t, elem2_t, pack_fn, ptx_type = _TYPES[cfg.dtype]
    producer_regs, consumer_regs = SM90_REGS[cfg.consumers] if cfg.family == "sm90" else (None, None)
    score_mod, mask_mod, captured = modifiers_of(cfg)
    if score_mod is not None and score_mod.grad_expr is None:
        raise ModifierError(f"score_mod {cfg.score_mod[:8]} has no derivative (grad_expr): its backward cannot be built")
    return template_env().get_template(f"{cfg.family}/bwd.cu.j2").render(
        cfg=cfg, version=__version__, elem_t=elem_t, elem2_t=elem2_t, pack_fn=pack_fn, ptx_type=ptx_type,
        row_warps=BWD_ROW_WARPS, producer_regs=producer_regs, consumer_regs=consumer_regs,
        unpack_fn={"fp16": "__half22float2", "bf16": "__bfloat1622float2"}[cfg.dtype],
        cvt_fn={"fp16": "__float2half_rn", "bf16": "__float2bfloat16_rn"}[cfg.dtype],
        score_mod=score_mod, mask_mod=mask_mod, captured=captured,
    )
