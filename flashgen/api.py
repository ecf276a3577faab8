"""The public API: `load()` a kernel for a problem, or call `attention()` directly.

`attention()` resolves (GPU, head_dim, dtype, causal, seqlen bucket, family) to a compiled
kernel once and keeps it in a dict; the tuned store is looked at again only when its file
changes (checked at most once a second) or after `reload()`.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .compile import CompiledKernel, Resources, compile_kernel, target_for
from .config import FAMILIES, FP8_DTYPES, ConfigError, KernelConfig, arch_limits, default_config
from .launch import STREAM_FOR_TORCH, launch_plan, make_plan, run, run_views, scale_args
from .tensors import Problem, aligned_strides, check_qkv, is_torch, view

STORE_CHECK_S = 1.0  # how often attention() looks whether a store file changed on disk


class Kernel:
    """A compiled forward attention kernel, callable like `flashgen.attention` (its causal is fixed)."""

    def __init__(self, compiled: CompiledKernel):
        self.compiled = compiled
        self._plans: dict[tuple, Any] = {}  # torch call signature -> launch.Plan

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
                 stream: Any = None, *, q_descale: Any = None, k_descale: Any = None, v_descale: Any = None) -> Any:
        """out = softmax(q k^T * scale [+ causal mask]) v; with return_lse, (out, lse) where lse is (batch, heads, seqlen_q) fp32.

        Torch tensors run on torch's current stream of their device; `stream` (a pycuda Stream or
        raw handle) is for GPU arrays. Not traceable by torch.compile: use `flashgen.attention`.
        FP8 kernels take float8_e4m3fn q, k, v and their descale factors (see flashgen.fp8)."""
        descale = _descale(q_descale, k_descale, v_descale)
        if is_torch(q):
            refuse_grad(q, k, v, "a loaded Kernel is forward only: call flashgen.attention, which has the backward")
            if stream is not None:
                raise TypeError(STREAM_FOR_TORCH)
            out, lse = self.run_torch(q, k, v, softmax_scale, return_lse, descale)
        else:
            out, lse, _ = run(self.compiled, q, k, v, softmax_scale, stream, descale=descale)
        return (out, lse) if return_lse else out

    def run_torch(self, q: Any, k: Any, v: Any, softmax_scale: float | None, want_lse: bool = True,
                  descale: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """(out, lse) for torch tensors: checked once per call signature (shapes, strides, dtypes,
        device, scale), then a dict lookup, five pointers packed and a launch. lse is None
        when not wanted (the kernel then skips it)."""
        sig = signature(q, k, v, softmax_scale)
        plan = self._plans.get(sig)
        if plan is None:
            plan = self._plans[sig] = self.plan(q, k, v, softmax_scale)
            if len(self._plans) > 1024:
                self._plans.clear()
        return launch_torch(self, plan, q, k, v, softmax_scale, want_lse, descale)

    def plan(self, q: Any, k: Any, v: Any, softmax_scale: float | None) -> Any:
        """launch.Plan of these inputs, after every check; None when a stride needs `run`'s copy."""
        qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
        prob = check_qkv(qv, kv, vv)
        if not (aligned_strides(qv) and aligned_strides(kv) and aligned_strides(vv)):
            return None
        return make_plan(self.compiled, qv, kv, vv, prob, softmax_scale)

    def __repr__(self) -> str:
        r = self.resources
        return f"Kernel({self.name}, {self.compiled.target}, {r.registers} regs, {r.smem_bytes} B smem, spills={r.spills})"


def refuse_grad(q: Any, k: Any, v: Any, why: str = "") -> None:
    """Raise where an input requires grad and no backward can give its gradient: never a detached output."""
    import torch  # noqa: PLC0415  (q is a torch tensor, so torch is imported)

    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(
            f"flashgen cannot give this input's gradient ({why or 'no backward for this call'}), and the output "
            "would carry none. Run under torch.no_grad()/torch.inference_mode(), detach the inputs, or use "
            "torch.nn.functional.scaled_dot_product_attention for training")


def current_arch(device: int | None = None) -> str:
    """The compute capability of a CUDA device (default: the current one), e.g. "sm90"."""
    from .driver import device_info  # noqa: PLC0415

    return device_info(device).arch


def choose_config(head_dim: int, dtype: str, causal: bool, arch: str, seqlen: int | None = None,
                  family: str | None = None, tuned_dir: Path | str | None = None,
                  gpu: tuple[str, str] | None = None, gqa_group: int = 1) -> KernelConfig:
    """The configuration `load()` uses on an `arch` GPU: the tuned one for `gpu` (name, arch; default
    the current GPU), nearest seqlen bucket and GQA group `gqa_group` (family None: the fastest family
    tuned), else the family default."""
    from .store import tuned_config  # noqa: PLC0415

    arch_limits(arch)
    return tuned_config(head_dim, dtype, causal, arch, seqlen, family, tuned_dir, gpu, gqa_group=gqa_group) or default_config(
        head_dim, dtype, causal, arch, family or ("sm90" if dtype in FP8_DTYPES else "sm80"))


@functools.lru_cache(maxsize=256)
def _compiled(cfg: KernelConfig, target: str) -> CompiledKernel:
    return compile_kernel(cfg, target)


def load(head_dim: int, dtype: str = "bf16", causal: bool = False, config: KernelConfig | None = None,
         seqlen: int | None = None, arch: str | None = None, gpu_arch: str | None = None,
         tuned_dir: Path | str | None = None, device: int | None = None, gqa_group: int = 1) -> Kernel:
    """A compiled kernel for this problem on a GPU (`device`, an ordinal; default the current one).

    arch forces a template family ("sm80", "sm90"); by default the fastest family tuned for
    this GPU (the store in `tuned_dir`, FLASHGEN_TUNED_DIR or tuned/) is used, else sm80's
    default. `config` pins an exact configuration. `gpu_arch` ("sm80", "sm90", ...) compiles
    for that GPU instead, so no GPU is needed. `gqa_group` (heads // heads_k of the calls it will run) picks the
    store's entry of that group first (sm90's pack_gqa kernels are tuned for GQA problems)."""
    if arch is not None and arch not in FAMILIES:
        raise ValueError(f"arch={arch!r} is not a template family; choose one of {', '.join(FAMILIES)}")
    gpu = None
    if gpu_arch is None:  # the store is looked up for the GPU that will run the kernel
        from .driver import device_info  # noqa: PLC0415

        info = device_info(device)
        gpu = (info.name, info.arch)
    target_arch = gpu_arch or gpu[1]
    if config is None:
        config = choose_config(head_dim, dtype, causal, target_arch, seqlen, arch, tuned_dir, gpu, gqa_group)
    elif (config.head_dim, config.dtype, config.causal) != (head_dim, dtype, causal):
        raise ValueError(f"config {config.name} does not match head_dim={head_dim}, dtype={dtype}, causal={causal}")
    reason = config.unfit_reason(target_arch)
    if reason:
        raise ValueError(f"{config.name} cannot run on {target_arch}: {reason}")
    return Kernel(_compiled(config, target_for(target_arch, config.family)))


# -- the per-call path: resolve once, then a dict lookup ---------------------------------

def nearest_bucket(seqlen: int | None, buckets: tuple[int, ...]) -> int | None:
    """The stored seqlen bucket store.lookup picks for `seqlen` (nearest by ratio, the larger on a tie;
    the largest for None)."""
    if not buckets:
        return None
    if seqlen is None:
        return max(buckets)
    from .store import log_distance  # noqa: PLC0415

    return min(buckets, key=lambda s: (log_distance(s, seqlen), -s))


class Resolver:
    """(device, head_dim, dtype, causal, family, tuned_dir, seqlen) -> Kernel, remembered.

    What is remembered per problem is the set of seqlen buckets the store holds for it and the
    kernel of each bucket, so any seqlen (a decode loop's growing cache too) is one dict lookup
    after its bucket's first call."""

    def __init__(self, check_every_s: float = STORE_CHECK_S):
        self.check_every_s = check_every_s
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self._kernels: dict[tuple, Kernel] = {}
        self._exact: dict[tuple, Kernel] = {}  # (problem key, seqlen) -> kernel, bounded
        self._buckets: dict[tuple, tuple[int, ...]] = {}
        self._by_signature: dict[tuple, tuple] = {}  # forward_torch: call signature -> (kernel, plan)
        self._stamps: dict[Path, tuple | None] = {}
        self._checked = time.monotonic()

    def refresh(self) -> None:
        """Forget everything if a store file read so far changed on disk (looked at most every check_every_s)."""
        if not self._stamps:
            return
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        if any(_stamp(path) != stamp for path, stamp in self._stamps.items()):
            with self._lock:
                self.clear()

    def kernel(self, device: int, head_dim: int, dtype: str, causal: bool, seqlen: int, family: str | None,
               tuned_dir: Path | str | None = None, gqa_group: int = 1) -> Kernel:
        key = (device, head_dim, dtype, causal, family, tuned_dir, gqa_group)
        self.refresh()
        hit = self._exact.get((key, seqlen))
        if hit is not None:
            return hit
        with self._lock:
            buckets = self._buckets.get(key)
            if buckets is None:
                buckets = self._buckets[key] = self._stored_buckets(device, head_dim, dtype, causal, family, tuned_dir)
            bucket = nearest_bucket(seqlen, buckets)
            kern = self._kernels.get((key, bucket))
            if kern is None:
                kern = self._kernels[key, bucket] = load(head_dim, dtype, causal, seqlen=bucket or seqlen, arch=family,
                                                         tuned_dir=tuned_dir, device=device, gqa_group=gqa_group)
            if len(self._exact) > 4096:
                self._exact.clear()
            self._exact[key, seqlen] = kern
        return kern

    def _stored_buckets(self, device: int, head_dim: int, dtype: str, causal: bool, family: str | None,
                        tuned_dir: Path | str | None) -> tuple[int, ...]:
        """The seqlens the store holds for this problem, filtered exactly as store.lookup filters."""
        from .driver import device_info  # noqa: PLC0415
        from .store import StoreError, entry_pass, matches, read_store, store_path  # noqa: PLC0415

        gpu = device_info(device)
        path = store_path(gpu.name, gpu.arch, tuned_dir)
        self._stamps[path] = _stamp(path)
        if not path.exists():
            return ()
        try:
            entries = read_store(path, gpu.name, gpu.arch)["entries"].values()
        except StoreError:
            return ()  # load() -> tuned_config warns once and uses the default
        seqlens = set()
        for e in entries:
            if entry_pass(e) != "fwd":
                continue
            try:
                cfg = KernelConfig.from_dict(e["config"])
            except (ConfigError, KeyError, TypeError):
                continue
            if not matches(cfg, head_dim, dtype, causal, family):
                continue
            if cfg.unfit_reason(gpu.arch) is None:
                seqlens.add(e.get("problem", {}).get("seqlen", 0))
        return tuple(sorted(seqlens))


def _stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


_resolver = Resolver()


def reload() -> None:
    """Forget every resolved kernel: the next call reads the tuned store again (it is also re-read by
    itself when its file changes, checked at most once a second)."""
    from . import store  # noqa: PLC0415

    _resolver.clear()
    store._cache.clear()
    store._warned.clear()
    ops = sys.modules.get("flashgen.ops")  # the autograd path's tuned backwards, if torch brought it in
    if ops is not None:
        ops._stamps.clear()
        ops._tuned_backwards.cache_clear()


def _descale(q_descale: Any, k_descale: Any, v_descale: Any) -> dict[str, Any] | None:
    if q_descale is None and k_descale is None and v_descale is None:
        return None
    return {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}


def launch_torch(kern: Kernel, plan: Any, q: Any, k: Any, v: Any, softmax_scale: float | None,
                 want_lse: bool, descale: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """One call by its plan; `run` (which copies what is misaligned) when there is no plan or a base
    pointer is off 16 bytes."""
    res = None if plan is None else launch_plan(plan, q, k, v, want_lse, descale)
    if res is None:
        out, lse, _ = run(kern.compiled, q, k, v, softmax_scale, descale=descale)
        return out, lse
    return res


def signature(q: Any, k: Any, v: Any, softmax_scale: float | None) -> tuple:
    """What a torch call's plan depends on: shapes, strides, dtypes, devices and scale."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), softmax_scale)


def _checked(q: Any, k: Any, v: Any, softmax_scale: float | None, arch: str | None) -> tuple:
    """(q, k, v views, problem) after every check a call gets before any GPU work."""
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    prob: Problem = check_qkv(qv, kv, vv)
    if arch is not None and arch not in FAMILIES:
        raise ValueError(f"arch={arch!r} is not a template family; choose one of {', '.join(FAMILIES)}")
    scale_args(softmax_scale, prob.head_dim)  # a bad scale is refused here too
    return qv, kv, vv, prob


def forward_torch(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, arch: str | None,
                  want_lse: bool = True) -> tuple[Any, Any]:
    """`forward` for torch tensors: one dict lookup from the call's signature to its kernel and plan."""
    r = _resolver
    r.refresh()
    sig = (*signature(q, k, v, softmax_scale), causal, arch)
    hit = r._by_signature.get(sig)
    if hit is None:
        qv, _, _, prob = _checked(q, k, v, softmax_scale, arch)
        kern = r.kernel(qv.device, prob.head_dim, prob.dtype, causal, prob.seqlen_k, arch,
                        gqa_group=prob.heads // prob.heads_k)
        hit = (kern, kern.plan(q, k, v, softmax_scale))
        if len(r._by_signature) > 4096:
            r._by_signature.clear()
        r._by_signature[sig] = hit
    return launch_torch(hit[0], hit[1], q, k, v, softmax_scale, want_lse)


def forward_fp8(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, arch: str | None,
                descale: dict[str, Any] | None, out_dtype: str | None = None, block_quant_p: bool = False,
                want_lse: bool = True) -> tuple[Any, Any]:
    """`forward_torch` for float8_e4m3fn q, k, v (sm90 family, forward only): the tuned FP8 kernel, or its
    variant writing `out_dtype` ("bf16" default, "fp16") or quantizing P per key tile (block_quant_p)."""
    import dataclasses  # noqa: PLC0415

    refuse_grad(q, k, v, "FP8 attention is forward only")
    if arch is not None and arch != "sm90":
        raise ValueError(f"FP8 attention is built in family sm90 (FP8 wgmma); arch={arch!r} has no FP8 tensor cores")
    r = _resolver
    r.refresh()
    sig = (*signature(q, k, v, softmax_scale), causal, out_dtype, block_quant_p)
    hit = r._by_signature.get(sig)
    if hit is None:
        qv, _, _, prob = _checked(q, k, v, softmax_scale, arch)
        kern = r.kernel(qv.device, prob.head_dim, prob.dtype, causal, prob.seqlen_k, "sm90",
                        gqa_group=prob.heads // prob.heads_k)
        want = dataclasses.replace(kern.config, out_dtype=out_dtype or "bf16", block_quant_p=block_quant_p,
                                   lazy_rescale=kern.config.lazy_rescale and not block_quant_p)  # a per-tile max moves
        if want != kern.config:
            kern = load(want.head_dim, want.dtype, causal, config=want, device=qv.device)
        hit = (kern, kern.plan(q, k, v, softmax_scale))
        if len(r._by_signature) > 4096:
            r._by_signature.clear()
        r._by_signature[sig] = hit
    return launch_torch(hit[0], hit[1], q, k, v, softmax_scale, want_lse, descale)


def forward(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, arch: str | None,
            stream: Any = None) -> tuple[Any, Any]:
    """(out, lse) through the resolved kernel: the eager body of `attention` and of the torch operator.
    GPU arrays run in the current context, on `stream`."""
    if is_torch(q):
        if stream is not None:
            raise TypeError(STREAM_FOR_TORCH)
        return forward_torch(q, k, v, causal, softmax_scale, arch)
    from .driver import context_device  # noqa: PLC0415

    qv, kv, vv, prob = _checked(q, k, v, softmax_scale, arch)
    kern = _resolver.kernel(context_device(), prob.head_dim, prob.dtype, causal, prob.seqlen_k, arch,
                            gqa_group=prob.heads // prob.heads_k)
    out, lse, _ = run_views(kern.compiled, qv, kv, vv, prob, softmax_scale, stream)
    return out, lse


def _attention_mods(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, return_lse: bool,
                    stream: Any, arch: str | None, descale: Any, out_dtype: str | None, block_quant_p: bool,
                    deterministic: bool, window_size: Any, softcap: float, alibi_slopes: Any) -> Any:
    """`attention` with a window, softcap or ALiBi: the serving kernels (flashgen.serving picks the family: sm90 for a
    window on Hopper, sm80 otherwise), torch tensors only."""
    if not is_torch(q):
        raise TypeError("window_size, softcap and alibi_slopes take torch tensors")
    if stream is not None:
        raise TypeError(STREAM_FOR_TORCH)
    if descale is not None or out_dtype is not None or block_quant_p or str(q.dtype) == "torch.float8_e4m3fn":
        raise ValueError("window_size, softcap and alibi_slopes are not built for FP8 inputs")
    if arch not in (None, "sm80"):
        raise ValueError(f"window_size, softcap and alibi_slopes are built in family sm80 (it runs on Hopper too), "
                         f"not arch={arch!r}")
    from . import serving  # noqa: PLC0415

    mods = serving.check_dense(q, k, v, window_size, softcap, alibi_slopes, causal)
    if serving._wants_grad(q, k, v) or serving.traced(q):
        from . import ops  # noqa: PLC0415

        serving._scale_for_grad(softmax_scale, q, k, v)
        out, lse = ops.attention_mods_op(q, k, v, causal, softmax_scale, *mods.window, mods.softcap, mods.alibi,
                                         deterministic)
    else:
        out, lse = serving.dense_mods_forward(q, k, v, causal, softmax_scale, mods, return_lse)
    return (out, lse) if return_lse else out


def attention(q: Any, k: Any, v: Any, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, stream: Any = None, arch: str | None = None, *, q_descale: Any = None,
              k_descale: Any = None, v_descale: Any = None, out_dtype: str | None = None,
              block_quant_p: bool = False, deterministic: bool = False, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, alibi_slopes: Any = None) -> Any:
    """FlashAttention forward with flash_attn's conventions.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim) with
    heads % heads_k == 0 (GQA/MQA). Causal masks align to the bottom right (query i sees
    keys j <= i + seqlen_k - seqlen_q). softmax_scale defaults to 1/sqrt(head_dim); any finite
    value works. Returns out like q, and with return_lse also lse (batch, heads, seqlen_q) fp32.
    arch forces a template family ("sm80", "sm90"), as in `load`.

    Torch tensors go through the `flashgen::attention` operator (torch.compile traces it, CUDA
    graphs capture it) and run on the current stream of their device; pycuda GPU arrays run in
    the current context, on `stream`. With autograd, deterministic=True makes the backward give the
    same gradients bit for bit on every run (dQ per Q tile instead of fp32 atomics; slower).

    Score modifiers (torch tensors, as flash_attn): window_size=(left, right) keys i + shift - left ..
    i + shift + right (-1: unbounded; with causal, right is the diagonal), softcap (scores = softcap *
    tanh(scores / softcap), Gemma 2), alibi_slopes fp32 (heads,) or (batch, heads) (scores -= slope *
    |i + shift - j|). They run in kernels generated with exactly those features (a window on Hopper: the sm90
    family; softcap and ALiBi: sm80's, which runs on Hopper too), forward and backward (through the
    `flashgen::attention_mods` operator under autograd or torch.compile); arch stays None with them.

    FP8 (Hopper): q, k, v in torch.float8_e4m3fn with fp32 descale factors q_descale, k_descale,
    v_descale of shape (1,) or (batch, heads_k) (None: 1; `flashgen.fp8.quantize` makes them);
    out in bf16, or out_dtype="fp16"; block_quant_p quantizes P with a scale per key tile.
    Forward only; through the `flashgen::attention_fp8` operator when traced (torch.compile)."""
    descale = _descale(q_descale, k_descale, v_descale)
    if window_size != (-1, -1) or softcap or alibi_slopes is not None:
        from .serving import has_mods  # noqa: PLC0415

        if has_mods(window_size, softcap, alibi_slopes, causal):
            return _attention_mods(q, k, v, causal, softmax_scale, return_lse, stream, arch, descale, out_dtype,
                                   block_quant_p, deterministic, window_size, softcap, alibi_slopes)
    if is_torch(q) and str(q.dtype) == "torch.float8_e4m3fn":
        if stream is not None:
            raise TypeError(STREAM_FOR_TORCH)
        if out_dtype not in (None, "bf16", "fp16"):
            raise ValueError(f"out_dtype={out_dtype!r}: FP8 attention writes bf16 or fp16")
        from . import ops  # noqa: PLC0415  (the FP8 operator: torch.compile traces it)

        out, lse = ops.attention_fp8(q, k, v, causal, softmax_scale, arch, descale, out_dtype, block_quant_p, return_lse)
        return (out, lse) if return_lse else out
    if descale is not None or out_dtype is not None or block_quant_p:
        raise ValueError("q_descale, k_descale, v_descale, out_dtype and block_quant_p are for FP8 inputs "
                         "(torch.float8_e4m3fn)")
    if is_torch(q):
        from . import ops  # noqa: PLC0415  (registers the operator; needs torch, which q proves is there)

        if stream is not None:
            raise TypeError(STREAM_FOR_TORCH)
        out, lse = ops.attention(q, k, v, causal, softmax_scale, arch, return_lse, deterministic)
    else:
        out, lse = forward(q, k, v, causal, softmax_scale, arch, stream)
    return (out, lse) if return_lse else out
