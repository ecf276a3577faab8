"""Dense calls with a score_mod, mask_mod or block map, by a plan: the kernel, its block map at the kernel's tiles and
its launch (parameters packed, pointers left out) are made once for a call signature; each call by the plan then
allocates its outputs, fills in four or five pointers and launches. Either family: the sm90 family's launch
(tensor maps, kept per q, k, v base pointers) or the sm80 family's serving launch. flashgen.api keeps the plans and
tells when one still holds (the modifiers' traces, the block map's tensors, the tuned store)."""
from __future__ import annotations

from typing import Any

from ..checks import Mods
from ..config import KernelConfig
from .serving import arch_and_slots, fire_serve, fire_sm90, kernel_sinks, serve_launch, sm90_launch, sm90_maps

_MAPS_KEPT = 16  # tensor-map triples a plan keeps (a few rotating input buffers)


class ModPlan:
    """What a dense modifier call repeats for one signature. `mods`: the call's modifiers with the kernel's block map
    (None without a mask). `tracks_store`, `stamp`, `look_after`: where the choice read the tuned store (tuned
    modifier kernels, either family), the store's stamp then, and when the caller looks at it again."""

    __slots__ = ("config", "mods", "device", "o_shape", "lse_shape", "lse_dtype", "launch", "sm90", "alibi", "sinks",
                 "maps", "tracks_store", "stamp", "look_after")

    def __init__(self, config: KernelConfig, mods: Mods, device: int, o_shape: tuple, lse_shape: tuple, launch: Any,
                 tracks_store: bool = False, stamp: Any = None) -> None:
        import torch  # noqa: PLC0415  (a plan is made from torch tensors: torch is imported)

        self.config, self.mods, self.device = config, mods, device
        self.o_shape, self.lse_shape, self.lse_dtype, self.launch = o_shape, lse_shape, torch.float32, launch
        self.sm90 = config.family == "sm90"
        self.alibi, self.sinks = mods.alibi, kernel_sinks(mods.sinks)  # the sm80 launch's pointers besides q..lse
        self.maps: dict[tuple[int, int, int], bytes] = {}
        self.tracks_store, self.stamp, self.look_after = tracks_store, stamp, 0.0


def make_mod_plan(cfg: KernelConfig, q: Any, k: Any, v: Any, mods: Mods, softmax_scale: float | None,
                  tracks_store: bool = False, stamp: Any = None) -> ModPlan:
    """The plan of dense (batch, seqlen, heads, head_dim) torch q, k, v (checked) for kernel `cfg`, with `mods` holding
    the block map at cfg's tiles where cfg reads one. The output is q's shape, contiguous; lse (batch, heads,
    seqlen_q) fp32."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    out = q.new_empty(q.shape, device="meta")  # a fresh contiguous out's strides, as every call allocates it
    if cfg.family == "sm90":
        launch = sm90_launch(cfg, q, k, v, out, num_seqs=batch, max_seqlen_q=seqlen_q, cu_q=None, cu_k=None,
                             mods=mods, softmax_scale=softmax_scale)
    else:
        launch = serve_launch(cfg, arch_and_slots(q.get_device())[0], q, k, v, out, batch=batch, seqlen_q=seqlen_q,
                              seqlen_k=seqlen_k, total_rows=batch * seqlen_q, cu_q=None, block_table=None,
                              page_size=0, num_splits=1, mods=mods, softmax_scale=softmax_scale,
                              lse_strides=(heads * seqlen_q, seqlen_q),
                              batch_strides=(q.stride(0), k.stride(0), v.stride(0)))
    return ModPlan(cfg, mods, q.get_device(), tuple(q.shape), (batch, heads, seqlen_q), launch, tracks_store, stamp)


def run_mod_plan(plan: ModPlan, q: Any, k: Any, v: Any, want_lse: bool = True) -> tuple[Any, Any] | None:
    """(out, lse or None) of a call by its plan; None where a base pointer is not 16 bytes aligned (the sm90
    family's tensor maps need it: the full path says why)."""
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) & 15:
        return None
    out = q.new_empty(plan.o_shape)
    lse = q.new_empty(plan.lse_shape, dtype=plan.lse_dtype) if want_lse else None
    run = plan.launch
    if run is None:
        return out, lse
    if plan.sm90:
        maps = plan.maps.get((qp, kp, vp))
        if maps is None:
            if len(plan.maps) >= _MAPS_KEPT:
                plan.maps.clear()
            maps = plan.maps[qp, kp, vp] = sm90_maps(run, qp, kp, vp)
        fire_sm90(run, qp, kp, vp, out.data_ptr(), 0 if lse is None else lse.data_ptr(), maps)
    else:
        fire_serve(run, (q, k, v, out, lse, None, None, None, None, plan.alibi, plan.sinks))
    return out, lse


__all__ = ["ModPlan", "make_mod_plan", "run_mod_plan"]
