"""Which kernel a call runs: the tuned store's choice for every pass and kind, else the family's rule.

One place answers for the dense forward (`Resolver`, `load`), the backward (`backward_kernel`,
`serve_backward_kernel`), the prefill kernels of varlen batches and dense calls with score modifiers
(`prefill_config`, `untuned_prefill_config`) and the decode kernels of KV-cache calls (`tuned_decode`). Each
remembers its answers; all of them ask one `store_stamp` whether a store file changed on disk (looked at
most every STORE_CHECK_S), and the stored entry of a serving kind is found by one `nearest_entry`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import driver, store
from .checks import check_family
from .compile import CompiledKernel, target_for
from .config import (DENSE_ONLY_HEAD_DIMS, FP8_DTYPES, SM90_DENSE_KNOBS, SM90_FEATURES, BwdConfig, ConfigError,
                     KernelConfig, arch_limits, default_bwd_config, default_config, modifier_bwd_config)
from .kernels.backward import load_backward
from .kernels.dense import Kernel, compiled_kernel
from .kernels.serving import DECODE_ROWS, decode_config, serve_config, sm90_modifier_bwd_config

STORE_CHECK_S = 1.0  # how often a store file is looked at again on disk, to see whether it changed


# -- did the store change? -----------------------------------------------------------------

def file_stamp(path: Path) -> tuple | None:
    """(mtime, size, inode) of a file, None where there is none: what changes when a store file is rewritten."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


_looked: dict[Path, tuple[float, tuple | None]] = {}  # store file -> (when looked, its stamp then)


def store_stamp(path: Path, max_age: float | None = None) -> tuple | None:
    """The stamp of a store file, looked at on disk again only when the last look is `max_age` seconds old
    (default STORE_CHECK_S): the one "did the store change?" check of every cached choice here."""
    now = time.monotonic()
    hit = _looked.get(path)
    if hit is None or now - hit[0] >= (STORE_CHECK_S if max_age is None else max_age):
        hit = _looked[path] = (now, file_stamp(path))
    return hit[1]


@functools.lru_cache(maxsize=16)
def gpu(device: int) -> tuple[str, str]:
    """(name, arch) of a CUDA device: the store file it reads."""
    info = driver.device_info(device)
    return info.name, info.arch


_device_stamps: dict[int, tuple[float, tuple[tuple[str, str], tuple | None]]] = {}  # device -> (when, gpu_stamp)


def gpu_stamp(device: int) -> tuple[tuple[str, str], tuple | None]:
    """The device's (name, arch) and the stamp of its store file (store_stamp). Between looks on disk it is one
    dict read: a decode step asks for it on every call, and building the store's path costs more than the step."""
    now = time.monotonic()
    hit = _device_stamps.get(device)
    if hit is None or now - hit[0] >= STORE_CHECK_S:
        name, arch = gpu(device)
        hit = _device_stamps[device] = (now, ((name, arch), store_stamp(store.store_path(name, arch))))
    return hit[1]


# -- the nearest stored problem ------------------------------------------------------------

def nearest_bucket(seqlen: int | None, buckets: tuple[int, ...]) -> int | None:
    """The stored seqlen bucket store.lookup picks for `seqlen` (nearest by ratio, the larger on a tie;
    the largest for None)."""
    if not buckets:
        return None
    if seqlen is None:
        return max(buckets)
    return min(buckets, key=lambda s: (store.log_distance(s, seqlen), -s))


# Fields a serving kind matches on that its store problem holds only implicitly.
DERIVED = {
    "group": lambda p: p["heads"] // p["heads_k"],
    "paged": lambda p: bool(p["page_size"]),
    "windowed": lambda p: p["window"] >= 0,
}
Near = tuple[str, int, int]  # (problem field, the call's value, a shift added to both before their ratio)


def _distance(p: Mapping[str, Any], near: Sequence[Near]) -> float:
    return sum(store.log_distance(p[f] + shift, want + shift) for f, want, shift in near)


def nearest_entry(entries: list[dict[str, Any]], pass_: str, same: Mapping[str, Any], near: Sequence[Near],
                  first: Sequence[Near] = ()) -> dict[str, Any] | None:
    """The entry of pass `pass_` for a call: its problem equal to `same` on each field (a problem field or a
    DERIVED one); then, for each of `first` in turn, the stored value nearest the call's by ratio; then the
    smallest summed ratio distance over `near`, the faster entry on a tie."""
    def field(p: Mapping[str, Any], f: str) -> Any:
        return DERIVED[f](p) if f in DERIVED else p[f]

    cands = [e for e in entries if e.get("problem", {}).get("pass_") == pass_]
    cands = [e for e in cands if all(field(e["problem"], f) == want for f, want in same.items())]
    if not cands:
        return None
    for f, want, shift in first:
        best = min({e["problem"][f] for e in cands}, key=lambda s: _distance({f: s}, [(f, want, shift)]))
        cands = [e for e in cands if e["problem"][f] == best]
    return min(cands, key=lambda e: (_distance(e["problem"], near), e["median_ms"]))


def decode_entry(entries: list[dict[str, Any]], head_dim: int, dtype: str, heads: int, heads_k: int, batch: int,
                 cache_len: int, page_size: int) -> dict[str, Any] | None:
    """The decode entry for this call: same head dim, dtype and GQA group, contiguous or paged as the call; then the
    nearest page size, then the nearest (cache length, batch) by ratio."""
    return nearest_entry(entries, "decode",
                         {"head_dim": head_dim, "dtype": dtype, "group": heads // heads_k, "paged": bool(page_size)},
                         [("cache_len", cache_len, 0), ("batch", batch, 0)],
                         first=[("page_size", page_size, 0)] if page_size else [])


def prefill_entry(entries: list[dict[str, Any]], head_dim: int, dtype: str, causal: bool, features: dict[str, bool],
                  seqlen_k: int, window_left: int) -> dict[str, Any] | None:
    """The varlen / window entry for a call: same head dim, dtype, mask and features (varlen or not, window or not;
    others: none, but sinks, which leave the key loop as it is: the tile tuned without them serves); then the
    nearest window and the nearest longest sequence (a packed problem's max_len) by ratio."""
    wanted = {f for f, on in features.items() if on and f != "sinks"}
    if not wanted <= {"varlen", "window"}:
        return None
    return nearest_entry(entries, "varlen",
                         {"head_dim": head_dim, "dtype": dtype, "causal": causal, "packed": "varlen" in wanted,
                          "windowed": "window" in wanted},
                         [("window", window_left, 1), ("max_len", seqlen_k, 0)])


# -- the dense forward -----------------------------------------------------------------------

def current_arch(device: int | None = None) -> str:
    """The compute capability of a CUDA device (default: the current one), e.g. "sm90"."""
    return driver.device_info(device).arch


def choose_config(head_dim: int, dtype: str, causal: bool, arch: str, seqlen: int | None = None,
                  family: str | None = None, tuned_dir: Path | str | None = None,
                  gpu: tuple[str, str] | None = None, gqa_group: int = 1,
                  head_dim_v: int | None = None) -> KernelConfig:
    """The configuration `load()` uses on an `arch` GPU: the tuned one for `gpu` (name, arch; default
    the current GPU), nearest seqlen bucket and GQA group `gqa_group` (family None: the fastest family
    tuned), else the family default. head_dim_v (v narrower than q and k): the split-width default, family sm90
    (nothing is tuned for it)."""
    arch_limits(arch)
    if head_dim_v is not None and head_dim_v != head_dim:
        return default_config(head_dim, dtype, causal, arch, family or "sm90", head_dim_v)
    # A dense-only head dim has no store entries to pick a family by: on Hopper the sm90 family, which the H200's
    # store picks over sm80 at every point where it holds both.
    untuned = "sm90" if dtype in FP8_DTYPES or (head_dim in DENSE_ONLY_HEAD_DIMS and arch == "sm90") else "sm80"
    return store.tuned_config(head_dim, dtype, causal, arch, seqlen, family, tuned_dir, gpu,
                              gqa_group=gqa_group) or default_config(head_dim, dtype, causal, arch, family or untuned)


def load(head_dim: int, dtype: str = "bf16", causal: bool = False, config: KernelConfig | None = None,
         seqlen: int | None = None, arch: str | None = None, gpu_arch: str | None = None,
         tuned_dir: Path | str | None = None, device: int | None = None, gqa_group: int = 1,
         head_dim_v: int | None = None) -> Kernel:
    """A compiled kernel for this problem on a GPU (`device`, an ordinal; default the current one).

    arch forces a template family ("sm80", "sm90"); by default the fastest family tuned for
    this GPU (the store in `tuned_dir`, FLASHGEN_TUNED_DIR or tuned/) is used, else sm80's
    default. `config` pins an exact configuration. `gpu_arch` ("sm80", "sm90", ...) compiles
    for that GPU instead, so no GPU is needed. `gqa_group` (heads // heads_k of the calls it will run) picks the
    store's entry of that group first (sm90's pack_gqa kernels are tuned for GQA problems). `head_dim_v`: v's (and
    the output's) head dim where it is narrower than q and k's, a split-width kernel (config.SPLIT_HEAD_DIMS)."""
    check_family(arch)
    on = None
    if gpu_arch is None:  # the store is looked up for the GPU that will run the kernel
        info = driver.device_info(device)
        on = (info.name, info.arch)
    target_arch = gpu_arch or on[1]
    if config is None:
        config = choose_config(head_dim, dtype, causal, target_arch, seqlen, arch, tuned_dir, on, gqa_group,
                               head_dim_v)
    elif (config.head_dim, config.dtype, config.causal) != (head_dim, dtype, causal) or (
            head_dim_v is not None and config.v_dim != head_dim_v):
        raise ValueError(f"config {config.name} does not match head_dim={head_dim}, dtype={dtype}, causal={causal}"
                         + (f", head_dim_v={head_dim_v}" if head_dim_v is not None else ""))
    reason = config.unfit_reason(target_arch)
    if reason:
        raise ValueError(f"{config.name} cannot run on {target_arch}: {reason}")
    return Kernel(compiled_kernel(config, target_for(target_arch, config.family)))


class Resolver:
    """(device, head_dim, dtype, causal, family, tuned_dir, seqlen, head_dim_v) -> Kernel, remembered.

    What is remembered per problem is the set of seqlen buckets the store holds for it and the
    kernel of each bucket, so any seqlen (a decode loop's growing cache too) is one dict lookup
    after its bucket's first call. `plans` is the torch path's call signature -> (kernel, plan)."""
    def __init__(self, check_every_s: float = STORE_CHECK_S):
        self.check_every_s = check_every_s
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self._kernels: dict[tuple, Kernel] = {}
        self._exact: dict[tuple, Kernel] = {}  # (problem key, seqlen) -> kernel, bounded
        self._buckets: dict[tuple, tuple[int, ...]] = {}
        self.plans: dict[tuple, tuple] = {}  # the torch path: call signature -> (kernel, plan)
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
        if any(store_stamp(path, self.check_every_s) != stamp for path, stamp in self._stamps.items()):
            with self._lock:
                self.clear()

    def remember(self, sig: tuple, hit: tuple) -> tuple:
        """Keep a call signature's (kernel, plan), a bounded number of them."""
        if len(self.plans) > 4096:
            self.plans.clear()
        self.plans[sig] = hit
        return hit

    def kernel(self, device: int, head_dim: int, dtype: str, causal: bool, seqlen: int, family: str | None,
               tuned_dir: Path | str | None = None, gqa_group: int = 1, head_dim_v: int | None = None) -> Kernel:
        key = (device, head_dim, dtype, causal, family, tuned_dir, gqa_group, head_dim_v)
        self.refresh()
        hit = self._exact.get((key, seqlen))
        if hit is not None:
            return hit
        with self._lock:
            buckets = self._buckets.get(key)
            if buckets is None:  # a split width has nothing stored: its default
                buckets = self._buckets[key] = () if head_dim_v is not None else self._stored_buckets(
                    device, head_dim, dtype, causal, family, tuned_dir)
            bucket = nearest_bucket(seqlen, buckets)
            kern = self._kernels.get((key, bucket))
            if kern is None:
                kern = self._kernels[key, bucket] = load(head_dim, dtype, causal, seqlen=bucket or seqlen, arch=family,
                                                         tuned_dir=tuned_dir, device=device, gqa_group=gqa_group,
                                                         head_dim_v=head_dim_v)
            if len(self._exact) > 4096:
                self._exact.clear()
            self._exact[key, seqlen] = kern
        return kern

    def _stored_buckets(self, device: int, head_dim: int, dtype: str, causal: bool, family: str | None,
                        tuned_dir: Path | str | None) -> tuple[int, ...]:
        """The seqlens the store holds for this problem, filtered exactly as store.lookup filters."""
        info = driver.device_info(device)
        path = store.store_path(info.name, info.arch, tuned_dir)
        self._stamps[path] = store_stamp(path, 0.0)  # as read now
        if not path.exists():
            return ()
        try:
            entries = store.read_store(path, info.name, info.arch)["entries"].values()
        except store.StoreError:
            return ()  # load() -> tuned_config warns once and uses the default
        seqlens = set()
        for e in entries:
            if store.entry_pass(e) != "fwd":
                continue
            try:
                cfg = KernelConfig.from_dict(e["config"])
            except (ConfigError, KeyError, TypeError):
                continue
            if not store.matches(cfg, head_dim, dtype, causal, family):
                continue
            if cfg.unfit_reason(info.arch) is None:
                seqlens.add(e.get("problem", {}).get("seqlen", 0))
        return tuple(sorted(seqlens))


resolver = Resolver()


# -- the backward ----------------------------------------------------------------------------

def backward_kernel(device: int, head_dim: int, dtype: str, causal: bool, seqlen: int | None = None,
                    deterministic: bool = False, gqa_group: int = 1) -> CompiledKernel:
    """The backward for these tensors' GPU: the tuned BwdConfig of the nearest stored seqlen bucket (the call's GQA
    group `gqa_group` preferred, then group 1), else the default (deterministic: the default deterministic config:
    on Hopper the sm90 backward whose dQ reduces take turns, elsewhere sm80's dQ per Q tile without atomics).
    Cached: the store's buckets are read again only when its file changed (store_stamp), kernels by configuration."""
    (gpu_name, arch), stamp = gpu_stamp(device)
    if deterministic:
        return _load_backward(head_dim, dtype, causal, None, arch, True)
    tuned = _tuned_backwards(gpu_name, arch, head_dim, dtype, causal, stamp, gqa_group)
    bucket = nearest_bucket(seqlen, tuple(sorted(tuned)))
    return _load_backward(head_dim, dtype, causal, tuned.get(bucket) if bucket is not None else None, arch)


@functools.lru_cache(maxsize=64)
def _tuned_backwards(gpu_name: str, arch: str, head_dim: int, dtype: str, causal: bool, stamp: tuple | None,
                     gqa_group: int = 1) -> dict:
    """seqlen bucket -> tuned BwdConfig for this GPU and problem (GQA group `gqa_group` first), as the store file
    with `stamp` holds them, of the family the untuned default is in (sm90 where it has the head dim: a tuned sm80
    backward there is slower than sm90's default)."""
    family = default_bwd_config(head_dim, dtype, causal, arch).family
    return store.tuned_buckets(gpu_name, arch, head_dim, dtype, causal, pass_="bwd", family=family,
                               gqa_group=gqa_group)


@functools.lru_cache(maxsize=64)
def _load_backward(head_dim: int, dtype: str, causal: bool, config: BwdConfig | None, arch: str,
                   deterministic: bool = False) -> CompiledKernel:
    return load_backward(head_dim, dtype, causal, config=config, gpu_arch=arch, deterministic=deterministic)


def serve_backward_kernel(device: int, head_dim: int, dtype: str, causal: bool, features: tuple[str, ...],
                          deterministic: bool, seqlen: int) -> CompiledKernel:
    """The backward for a call with serving features: the dense backward autograd would take (tuned for the
    nearest seqlen bucket; sm90 family on Hopper), generated with `features`; the sm80 family's default tiles
    where the sm90 backward lacks a feature (softcap, ALiBi); deterministic: the default deterministic config."""
    arch = gpu(device)[1]
    if "softcap" in features or "alibi" in features:
        base = default_bwd_config(head_dim, dtype, causal, arch, deterministic, family="sm80")
    elif deterministic:
        base = default_bwd_config(head_dim, dtype, causal, arch, deterministic)
    else:
        base = backward_kernel(device, head_dim, dtype, causal, seqlen).config
    return _load_backward(head_dim, dtype, causal, dataclasses.replace(base, **dict.fromkeys(features, True)), arch,
                          deterministic)


def modifier_backward_kernel(device: int, head_dim: int, dtype: str, causal: bool, features: tuple[str, ...],
                             deterministic: bool, score_mod: str, mask_mod: str, block_map: bool,
                             family: str | None = None, seqlen: int | None = None,
                             gqa_group: int = 1) -> CompiledKernel:
    """The backward of a call with a score_mod, mask_mod or block map (digests and block_map as the forward kernel's
    KernelConfig). On Hopper (family None or "sm90") the sm90 family's where it builds the call clean
    (kernels.serving.sm90_modifier_bwd_config); else, and with family "sm80", family sm80's at modifier_bwd_config's
    tiles. Either is the one tuned for exactly these modifiers (tuned_modifier, pass_ "bwd", nearest to `seqlen`)
    where the call is not deterministic and has no window, softcap or ALiBi."""
    arch = gpu(device)[1]
    cfg = None
    if arch == "sm90" and family in (None, "sm90"):
        cfg = sm90_modifier_bwd_config(head_dim, dtype, causal, features, deterministic, score_mod, mask_mod,
                                       block_map)
    if cfg is None:
        cfg = modifier_bwd_config(head_dim, dtype, causal, arch, deterministic, features, score_mod=score_mod,
                                  mask_mod=mask_mod, block_map=block_map)
    if not deterministic and not features and (score_mod or mask_mod):
        tuned = tuned_modifier(device, head_dim, dtype, causal, seqlen, gqa_group, score_mod, mask_mod,
                               cfg.family, "bwd")
        cfg = tuned if tuned is not None and tuned.block_map == block_map else cfg
    return _load_backward(head_dim, dtype, causal, cfg, arch, deterministic)


# -- serving: decode and prefill --------------------------------------------------------------

def tuned_decode(device: int, head_dim: int, dtype: str, heads: int, heads_k: int, batch: int, cache_len: int,
                 page_size: int) -> tuple[KernelConfig, int] | None:
    """(kernel, num_splits) of the nearest tuned decode problem in this GPU's store, or None. Cached per call
    shape; the store file is looked at again when it changed (store_stamp)."""
    (gpu_name, arch), stamp = gpu_stamp(device)
    return _decode(gpu_name, arch, stamp, head_dim, dtype, heads, heads_k, batch, cache_len, page_size)


@functools.lru_cache(maxsize=1024)
def _decode(gpu_name: str, arch: str, stamp: tuple | None, head_dim: int, dtype: str, heads: int, heads_k: int,
            batch: int, cache_len: int, page_size: int) -> tuple[KernelConfig, int] | None:
    if stamp is None:
        return None
    e = decode_entry(store.pass_entries(gpu_name, arch, "decode"), head_dim, dtype, heads, heads_k, batch, cache_len,
                     page_size)
    if e is None:
        return None
    cfg = KernelConfig.from_dict(e["config"])
    if cfg.unfit_reason(arch) is not None:
        return None
    cfg = decode_config(head_dim, dtype, (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.key_warps),
                        bool(page_size), e["num_splits"] > 1, cfg.fused_combine and e["num_splits"] > 1)
    return cfg, int(e["num_splits"])


def tuned_prefill(device: int, head_dim: int, dtype: str, causal: bool, seqlen_k: int, features: dict[str, bool],
                  window_left: int = -1) -> KernelConfig | None:
    """The kernel of the nearest tuned varlen / window problem in this GPU's store, with the call's features, or
    None. Cached per call shape; the store file is looked at again when it changed (store_stamp)."""
    (gpu_name, arch), stamp = gpu_stamp(device)
    key = tuple(sorted(f for f, on in features.items() if on))
    return _prefill(gpu_name, arch, stamp, head_dim, dtype, causal, seqlen_k, key, window_left)


@functools.lru_cache(maxsize=1024)
def _prefill(gpu_name: str, arch: str, stamp: tuple | None, head_dim: int, dtype: str, causal: bool, seqlen_k: int,
             features: tuple[str, ...], window_left: int) -> KernelConfig | None:
    if stamp is None:
        return None
    e = prefill_entry(store.pass_entries(gpu_name, arch, "varlen"), head_dim, dtype, causal,
                      dict.fromkeys(features, True), seqlen_k, window_left)
    if e is None:
        return None
    cfg = KernelConfig.from_dict(e["config"])
    if "sinks" in features:
        cfg = dataclasses.replace(cfg, sinks=True)
    return cfg if cfg.unfit_reason(arch) is None else None


def tuned_modifier(device: int, head_dim: int, dtype: str, causal: bool, seqlen: int | None, gqa_group: int,
                   score_mod: str, mask_mod: str, family: str = "sm80",
                   pass_: str = "fwd") -> KernelConfig | BwdConfig | None:
    """The kernel of `family` tuned for a dense call with these modifiers (digests; `tune --score-mod/--mask-mod`
    stores them under keys that end in them), its forward or (pass_ "bwd") backward, nearest seqlen bucket, or None
    (quietly: most modifiers are never tuned). Cached per call shape; the store file is looked at again when it
    changed (store_stamp)."""
    (gpu_name, arch), stamp = gpu_stamp(device)
    return _modifier(gpu_name, arch, stamp, head_dim, dtype, causal, seqlen, gqa_group, score_mod, mask_mod, family,
                     pass_)


@functools.lru_cache(maxsize=1024)
def _modifier(gpu_name: str, arch: str, stamp: tuple | None, head_dim: int, dtype: str, causal: bool,
              seqlen: int | None, gqa_group: int, score_mod: str, mask_mod: str, family: str,
              pass_: str) -> KernelConfig | BwdConfig | None:
    if stamp is None:
        return None
    try:  # of `family` and `pass_`, fitting `arch` (store.lookup keeps to those)
        return store.lookup(gpu_name, arch, head_dim, dtype, causal, seqlen, family, pass_=pass_,
                            gqa_group=gqa_group, score_mod=score_mod, mask_mod=mask_mod)
    except store.StoreError:  # load()'s path warns about a damaged store; a modifier call takes the default
        return None


def sm90_config(device: int, head_dim: int, dtype: str, causal: bool, rows: int, seqlen_k: int,
                features: dict[str, bool], window_left: int = -1) -> KernelConfig | None:
    """The sm90 family's kernel for a varlen or window call on Hopper: the tuned one of the nearest problem
    `tune --kind varlen` stored with these features, else the dense kernel `flashgen.attention` would take for
    seqlen_k (tuned, else the default) with the features (varlen: non-persistent; a window alone keeps the
    persistent schedule, which short per-block key loops gain most from); None where the sm80 family's serving
    kernel applies (not Hopper, other features, decode-sized row blocks)."""
    wanted = tuple(f for f, on in features.items() if on)
    if gpu(device)[1] != "sm90" or not set(wanted) <= set(SM90_FEATURES) or rows <= DECODE_ROWS:
        return None
    tuned = tuned_prefill(device, head_dim, dtype, causal, seqlen_k, features, window_left)
    if tuned is not None and tuned.family == "sm90":
        return _without_spills(tuned) if tuned.sinks else tuned  # a tile tuned without sinks: checked with them
    return _sm90_rule(device, head_dim, dtype, causal, seqlen_k, wanted)


def _sm90_rule(device: int, head_dim: int, dtype: str, causal: bool, seqlen_k: int,
               wanted: tuple[str, ...]) -> KernelConfig:
    """Untuned: the dense kernel for seqlen_k with the features `wanted`."""
    base = dataclasses.replace(resolver.kernel(device, head_dim, dtype, causal, seqlen_k, "sm90").config,
                               **dict.fromkeys(SM90_DENSE_KNOBS, False))
    if "varlen" in wanted:  # built non-persistent (so without the persistent-only epilogue overlap)
        base = dataclasses.replace(base, persistent=False, overlap_epilogue=False)
    return _without_spills(dataclasses.replace(base, **dict.fromkeys(wanted, True)))


@functools.lru_cache(maxsize=256)
def _without_spills(cfg: KernelConfig) -> KernelConfig:
    """`cfg`, or the family's default tiles with its features where the features' registers make `cfg`
    spill or serialize its wgmmas (ptxas's report; some tuned tiles with large block_n)."""
    kern = compiled_kernel(cfg, target_for("sm90", cfg.family))
    if not kern.resources.spills and not re.search(r"C751[239]", kern.ptxas_log):
        return cfg
    base = default_config(cfg.head_dim, cfg.dtype, cfg.causal, "sm90", "sm90")
    if cfg.varlen:
        base = dataclasses.replace(base, persistent=False, overlap_epilogue=False)
    return dataclasses.replace(base, **dict.fromkeys(cfg.features, True))


def untuned_prefill_config(device: int, head_dim: int, dtype: str, causal: bool, max_seqlen_q: int,
                           max_seqlen_k: int, features: dict[str, bool]) -> KernelConfig:
    """What prefill_config takes where nothing is stored for the problem (tune --kind varlen measures it beside
    its winner)."""
    wanted = tuple(f for f, on in features.items() if on)
    arch = gpu(device)[1]
    if arch == "sm90" and set(wanted) <= set(SM90_FEATURES) and max_seqlen_q > DECODE_ROWS:
        return _sm90_rule(device, head_dim, dtype, causal, max_seqlen_k, wanted)
    return serve_config(head_dim, dtype, causal, max_seqlen_q, arch, **features)


def prefill_config(device: int, head_dim: int, dtype: str, causal: bool, max_seqlen_q: int, max_seqlen_k: int,
                   features: dict[str, bool], window_left: int = -1) -> KernelConfig:
    """The kernel of an unsplit varlen call or a dense call with score modifiers: sm90_config's on Hopper, else
    the tuned sm80-family one of the nearest stored problem, else serve_config's tiles."""
    cfg = sm90_config(device, head_dim, dtype, causal, max_seqlen_q, max_seqlen_k, features, window_left)
    if cfg is None and max_seqlen_q > DECODE_ROWS:
        cfg = tuned_prefill(device, head_dim, dtype, causal, max_seqlen_k, features, window_left)
        cfg = cfg if cfg is not None and cfg.family == "sm80" else None
    return cfg or serve_config(head_dim, dtype, causal, max_seqlen_q, gpu(device)[1], **features)


# -- forgetting ---------------------------------------------------------------------------------

def clear() -> None:
    """Forget every remembered choice and store look: the next call reads the tuned store again."""
    resolver.clear()
    store.forget()
    _looked.clear()
    _device_stamps.clear()
    _tuned_backwards.cache_clear()
    _decode.cache_clear()
    _prefill.cache_clear()
    _modifier.cache_clear()


__all__ = ["STORE_CHECK_S", "Resolver", "backward_kernel", "choose_config", "clear", "current_arch", "decode_entry",
           "file_stamp", "gpu", "load", "nearest_bucket", "nearest_entry", "prefill_entry", "prefill_config",
           "modifier_backward_kernel", "resolver", "serve_backward_kernel", "sm90_config", "store_stamp", "tuned_decode", "tuned_modifier", "tuned_prefill",
           "untuned_prefill_config"]
