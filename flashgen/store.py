"""Step 8: the tuned store, `tuned/<gpu-slug>.json`, one entry per problem.

Files are written atomically (temp file + rename, under a lock), merged with what is
there (an entry is replaced only by a faster one, or when forced; the same winner from a
study that has grown since updates it), and kept diff-friendly (indented, sorted keys),
keeping the file's mode so a shared store stays readable. A file that is not valid JSON,
not a flashgen store, or made for another GPU raises `StoreError` naming the file: never
a reset. load()'s path (`tuned_config`) warns once instead and uses the defaults. An entry
that is not usable for its kind (fwd, bwd, decode, varlen: `entry_error`) is left out with one
warning naming the file and the entry when the store is read; a merge refuses it by name.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import math
import os
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

from . import driver
from .__version__ import __version__
from .config import MAX_SPLITS, BwdConfig, ConfigError, KernelConfig, native_family
from .paths import tuned_dir as default_tuned_dir
from .problem import BATCH_TOKENS, HEADS_DIM_TOTAL, gpu_slug

FORMAT = "flashgen-tuned/1"


class StoreError(ValueError):
    """A tuned store file that cannot be used; the message names the file."""


def store_path(gpu_name: str, arch: str, tuned_dir: Path | str | None = None) -> Path:
    return Path(tuned_dir or default_tuned_dir()) / f"{gpu_slug(gpu_name, arch)}.json"


def entry_pass(e: dict[str, Any]) -> str:
    """"fwd" or "bwd": the pass a store entry was tuned for (entries from before the backward: fwd)."""
    p = e.get("problem")
    return p.get("pass_", "fwd") if isinstance(p, dict) else "fwd"


def config_from_entry(e: dict[str, Any]) -> KernelConfig | BwdConfig:
    """The configuration of a store entry: a BwdConfig for a backward entry, else a KernelConfig."""
    return (BwdConfig if entry_pass(e) == "bwd" else KernelConfig).from_dict(e["config"])


# The problem fields each kind's lookup reads: name -> (type, least value or None). Decode and varlen entries
# must have them all; fwd and bwd entries from before a field existed may lack it (the lookup's default applies).
_PROBLEM_FIELDS: dict[str, dict[str, tuple[type, int | None]]] = {
    "fwd": {"seqlen": (int, 1), "gqa_group": (int, 1), "batch_tokens": (int, 1), "heads_dim_total": (int, 1)},
    "decode": {"head_dim": (int, 1), "dtype": (str, None), "heads": (int, 1), "heads_k": (int, 1), "batch": (int, 1),
               "cache_len": (int, 1), "page_size": (int, 0)},
    "varlen": {"head_dim": (int, 1), "dtype": (str, None), "causal": (bool, None), "packed": (bool, None),
               "heads": (int, 1), "heads_k": (int, 1), "max_len": (int, 1), "window": (int, -1)},
}
_PROBLEM_FIELDS["bwd"] = _PROBLEM_FIELDS["fwd"]


def _field_error(where: str, value: Any, kind: type, least: int | None) -> str | None:
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{where} is {value!r}, not an int"
    if not isinstance(value, kind):
        return f"{where} is {value!r}, not a {kind.__name__}"
    if least is not None and value < least:
        return f"{where} is {value}, below {least}"
    return None


def entry_error(e: Any) -> str | None:
    """Why `e` is not a usable store entry of its kind (fwd, bwd, decode, varlen), or None: what the lookups of
    that kind read from it must be there and of the right type, so that a damaged entry is found by name when the
    store is read rather than failing every call that consults it."""
    if not isinstance(e, dict):
        return f"is a {type(e).__name__}, not an object"
    p = e.get("problem", {})
    if not isinstance(p, dict):
        return f"has a problem that is a {type(p).__name__}, not an object"
    kind = p.get("pass_", "fwd")
    if kind not in _PROBLEM_FIELDS:
        return f"has problem.pass_ {kind!r}; expected one of {', '.join(_PROBLEM_FIELDS)}"
    try:
        config_from_entry(e)
        ms = float(e["median_ms"])
    except (KeyError, TypeError, ValueError, ConfigError) as err:
        return f"is damaged ({type(err).__name__}: {err})"
    if not (ms > 0 and math.isfinite(ms)):
        return f"has median_ms={ms}"
    required = kind in ("decode", "varlen")
    for name, (typ, least) in _PROBLEM_FIELDS[kind].items():
        if name not in p:
            if required:
                return f"is damaged: its {kind} problem has no {name}"
            continue
        why = _field_error(f"problem.{name}", p[name], typ, least)
        if why:
            return f"is damaged: {why}"
    if kind == "decode":
        if "num_splits" not in e:
            return "is damaged: a decode entry without num_splits"
        splits = e["num_splits"]
        why = _field_error("num_splits", splits, int, 1)
        if why is None and splits > MAX_SPLITS:
            why = f"num_splits is {splits}, above {MAX_SPLITS}"
        if why:
            return f"is damaged: {why}"
    return None


def _check_entry(path: Path, key: str, e: Any) -> None:
    why = entry_error(e)
    if why is not None:
        raise StoreError(f"{path}: entry {key!r} {why}; fix or delete it")


def read_store(path: Path, gpu_name: str | None = None, arch: str | None = None,
               strict: bool = False) -> dict[str, Any]:
    """The store document at `path` (an empty one if missing), checked to be ours and for this GPU.

    An entry that is not usable (entry_error) raises StoreError with `strict` (a merge must not drop it);
    otherwise it is left out of the document with one warning naming the file and the entry, and the rest
    of the store is used."""
    path = Path(path)
    if not path.exists():
        return {"format": FORMAT, "gpu": {"name": gpu_name, "arch": arch}, "entries": {}}
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON ({e}); fix or delete the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: cannot be read ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise StoreError(f"{path}: not a flashgen tuned store (format {found!r}, expected {FORMAT!r})")
    gpu = doc.get("gpu")
    if not isinstance(gpu, dict) or not isinstance(doc.get("entries"), dict):
        raise StoreError(f"{path}: a flashgen store without 'gpu' or 'entries'; fix or delete the file")
    if gpu_name is not None and (gpu.get("name"), gpu.get("arch")) != (gpu_name, arch):
        raise StoreError(f"{path}: made for {gpu.get('name')} ({gpu.get('arch')}), not {gpu_name} ({arch})")
    for key, e in list(doc["entries"].items()):
        why = entry_error(e)
        if why is None:
            continue
        if strict:
            raise StoreError(f"{path}: entry {key!r} {why}; fix or delete it")
        del doc["entries"][key]
        _warn_once(f"{path}\0{key}\0{why}", f"{path}: entry {key!r} {why}; ignored (the untuned choice stands in "
                                             "for it) until it is fixed or deleted")
    return doc


def _mode(path: Path) -> int:
    """The file's mode, or the umask's default for a new file: mkstemp's 0600 would lock out the
    other users of a shared store."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        pass
    try:  # Linux: read the umask without setting it (os.umask would change it for every thread)
        umask = int(next(x for x in Path("/proc/self/status").read_text().splitlines()
                         if x.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Two tuners on one machine (one per GPU) may merge into the same file.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def merge(path: Path, gpu_name: str, arch: str, entries: dict[str, dict[str, Any]],
          force: bool = False) -> dict[str, str]:
    """Merge entries into the store at `path`; returns key -> "added" | "replaced" | "updated" | "kept"."""
    actions: dict[str, str] = {}
    with _locked(path):
        doc = read_store(path, gpu_name, arch, strict=True)
        doc["gpu"] = {"name": gpu_name, "arch": arch}
        for key, new in entries.items():
            _check_entry(path, key, new)
            old = doc["entries"].get(key)
            if old is None:
                actions[key] = "added"
            elif force or new["median_ms"] < old["median_ms"]:
                actions[key] = "replaced"
            elif (new["median_ms"], new.get("kernel")) == (old["median_ms"], old.get("kernel")) and \
                    new.get("trials", 0) > old.get("trials", 0):
                actions[key] = "updated"  # the same winner, from a study that has grown since (a fleet's)
            else:
                actions[key] = "kept"
                continue
            doc["entries"][key] = new
        _write(path, doc)
    return actions


def make_entry(outcome: Any, versions: dict[str, str]) -> dict[str, Any] | None:
    """The store entry of a search outcome (`search.SearchOutcome`); None without a verified result."""
    if outcome.best is None:
        return None
    d = outcome.default
    return {
        "problem": outcome.problem.to_dict(),
        "kernel": outcome.best_config.name,
        "config": outcome.best_config.to_dict(),
        "median_ms": outcome.best.ms,
        "tflops": outcome.best.tflops,
        "trials": outcome.trials,
        # re-timed beside the other leaders (search.retime_leaders): the search's own first figure
        **({"first_ms": outcome.best.info["first_ms"]} if "first_ms" in outcome.best.info else {}),
        "date": datetime.date.today().isoformat(),
        "flashgen": __version__,
        **versions,  # nvcc, driver
        "default": {
            "kernel": outcome.default_config.name,
            "config": outcome.default_config.to_dict(),
            "status": d.status if d else "not measured",
            "median_ms": d.ms if d else None,
            "tflops": d.tflops if d else None,
        },
    }


# -- lookup, for load() -----------------------------------------------------------------

_cache: dict[Path, tuple[tuple[int, int], dict[str, Any] | str]] = {}  # a str: why the file is unusable
_warned: set[str] = set()


def _cached_read(path: Path, gpu_name: str, arch: str) -> dict[str, Any]:
    # attention() looks the store up on every call: read the file again only when it changed.
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _cache.get(path)
    if hit is None or hit[0] != stamp:
        try:
            doc: dict[str, Any] | str = read_store(path, gpu_name, arch)
        except StoreError as e:
            doc = str(e)
        hit = _cache[path] = (stamp, doc)
    if isinstance(hit[1], str):
        raise StoreError(hit[1])
    return hit[1]


def forget() -> None:
    """Forget the files read and the warnings given: the next lookup reads the store again (flashgen.reload)."""
    _cache.clear()
    _warned.clear()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=5)


def pass_entries(gpu_name: str, arch: str, pass_: str) -> list[dict[str, Any]]:
    """The entries of one pass ("decode", "varlen", ...) in this GPU's store; [] where there is no store, or it
    is unreadable (warned once: the caller's untuned rule applies until it is fixed)."""
    path = store_path(gpu_name, arch)
    if not path.exists():
        return []
    try:
        entries = _cached_read(path, gpu_name, arch)["entries"].values()
    except StoreError as e:
        _warn_once(str(e), f"{e}; using the untuned {pass_} rule until it is fixed")
        return []
    return [e for e in entries if entry_pass(e) == pass_]


def log_distance(a: int, b: int) -> float:
    """How far apart two sizes are by ratio (sizes below 1 count as 1): the nearest stored problem's measure."""
    return abs(math.log(max(a, 1)) - math.log(max(b, 1)))


def matches(cfg: KernelConfig | BwdConfig, head_dim: int, dtype: str, causal: bool, family: str | None,
            score_mod: str = "", mask_mod: str = "") -> bool:
    """Whether a stored configuration answers this problem: its head dim, dtype, mask and family (any when
    None). A serving kernel (varlen, paged, split, ...) takes other arguments: never the answer to a dense call.
    With modifiers (digests): a dense kernel (forward or backward) generated with exactly those (and, with a
    mask_mod, a block map)."""
    if (cfg.head_dim, cfg.dtype, cfg.causal) != (head_dim, dtype, causal) or (family and cfg.family != family):
        return False
    if getattr(cfg, "head_dim_v", None) is not None:  # a split width's output is narrower than the call's v
        return False
    if score_mod or mask_mod:
        return ((cfg.score_mod, cfg.mask_mod) == (score_mod, mask_mod) and cfg.block_map == bool(mask_mod)
                and not cfg.features)
    return not getattr(cfg, "serving", False)


def lookup(gpu_name: str, arch: str, head_dim: int, dtype: str, causal: bool, seqlen: int | None = None,
           family: str | None = None, tuned_dir: Path | str | None = None,
           pass_: str = "fwd", gqa_group: int = 1, score_mod: str = "",
           mask_mod: str = "") -> KernelConfig | BwdConfig | None:
    """The tuned configuration for this problem on this GPU, or None.

    Nearest seqlen bucket (by ratio; the largest when seqlen is None), the call's GQA group `gqa_group` preferred,
    then group 1 (a pack_gqa kernel only where its tile holds the call's group),
    then the standard size (BATCH_TOKENS, HEADS_DIM_TOTAL), else the largest: milliseconds
    are compared only within one size. Family None picks the fastest family at that size.
    `pass_` "bwd": the tuned backward (a BwdConfig), chosen by the same rules. score_mod / mask_mod (digests):
    only entries tuned with exactly those modifiers (none: only entries without)."""
    path = store_path(gpu_name, arch, tuned_dir)
    if not path.exists():
        return None
    cands = []
    for e in _cached_read(path, gpu_name, arch)["entries"].values():
        if entry_pass(e) != pass_:
            continue
        cfg, p = config_from_entry(e), e.get("problem", {})
        if not matches(cfg, head_dim, dtype, causal, family, score_mod, mask_mod):
            continue
        if cfg.unfit_reason(arch) is None and not (getattr(cfg, "pack_gqa", False) and cfg.block_m < gqa_group):
            size = (p.get("batch_tokens", BATCH_TOKENS), p.get("heads_dim_total", HEADS_DIM_TOTAL))
            cands.append((p.get("seqlen", 0), p.get("gqa_group", 1), size, e["median_ms"], cfg))
    if not cands:
        return None
    target = seqlen or max(c[0] for c in cands)
    bucket = min({c[0] for c in cands}, key=lambda s: (log_distance(s, target), -s))
    cands = [c for c in cands if c[0] == bucket]
    group = min({c[1] for c in cands}, key=lambda g: (g != gqa_group, g != 1, g))
    cands = [c for c in cands if c[1] == group]
    size = max({c[2] for c in cands}, key=lambda z: (z == (BATCH_TOKENS, HEADS_DIM_TOTAL), z[0] * z[1], z))
    return min((c for c in cands if c[2] == size), key=lambda c: c[3])[4]


def tuned_buckets(gpu_name: str, arch: str, head_dim: int, dtype: str, causal: bool, pass_: str = "fwd",
                  family: str | None = None, tuned_dir: Path | str | None = None,
                  gqa_group: int = 1) -> dict[int, KernelConfig | BwdConfig]:
    """seqlen bucket -> the configuration `lookup` gives for it (GQA group `gqa_group` preferred), for every bucket
    the store holds for this problem; {} (with one warning) when the store is unusable. What a caller caches instead
    of looking up per call."""
    path = store_path(gpu_name, arch, tuned_dir)
    if not path.exists():
        return {}
    try:
        entries = _cached_read(path, gpu_name, arch)["entries"].values()
        seqlens = set()
        for e in entries:
            if entry_pass(e) != pass_:
                continue
            cfg = config_from_entry(e)
            if matches(cfg, head_dim, dtype, causal, family) and cfg.unfit_reason(arch) is None:
                seqlens.add(e.get("problem", {}).get("seqlen", 0))
        found = {s: lookup(gpu_name, arch, head_dim, dtype, causal, s, family, tuned_dir, pass_, gqa_group)
                 for s in seqlens}
    except StoreError as e:
        _warn_once(str(e), f"{e}; using the family defaults until it is fixed")
        return {}
    return {s: c for s, c in found.items() if c is not None}


def current_gpu() -> tuple[str, str] | None:
    """(name, arch) of the current GPU, or None when there is no driver or device."""
    try:
        info = driver.device_info()
    except (OSError, RuntimeError):  # driver.CudaError is a RuntimeError
        return None
    return info.name, info.arch


def stored_gpu(arch: str, tuned_dir: Path | str | None = None) -> tuple[str, str] | None:
    """(name, arch) of the GPU whose store a kernel for an `arch` GPU that is not here comes from: the only store
    of that arch, else the first by name (one warning naming the others); None, with one warning, when the store
    holds no GPU of that arch."""
    found = []
    for path in sorted(Path(tuned_dir or default_tuned_dir()).glob("*.json")):
        try:
            gpu = json.loads(path.read_text()).get("gpu", {})
        except (OSError, ValueError, AttributeError):
            continue  # read_store warns about a broken file where it is used
        if gpu.get("arch") == arch and gpu.get("name"):
            found.append((gpu["name"], arch))
    if not found:
        _warn_once(f"no store {arch}", f"no tuned store for an {arch} GPU in {tuned_dir or default_tuned_dir()}; "
                                       f"using the family default (tune on one: flashgen tune --arch "
                                       f"{native_family(arch)})")
        return None
    if len(found) > 1:
        _warn_once(f"stores {arch}", f"several {arch} GPUs have tuned stores ({', '.join(n for n, _ in found)}); "
                                     f"using {found[0][0]}'s")
    return found[0]


def tuned_config(head_dim: int, dtype: str, causal: bool, arch: str, seqlen: int | None = None,
                 family: str | None = None, tuned_dir: Path | str | None = None,
                 gpu: tuple[str, str] | None = None, pass_: str = "fwd",
                 gqa_group: int = 1) -> KernelConfig | BwdConfig | None:
    """What load() uses before the family default: the stored result for `gpu` (name, arch;
    default the current GPU) for a call of GQA group `gqa_group` (heads // heads_k).

    Without `gpu` and with no `arch` GPU here (compiling for another GPU), the store of an `arch` GPU
    (stored_gpu); None with one warning per problem when the store has nothing for it."""
    gpu = gpu or current_gpu()
    if gpu is None or gpu[1] != arch:  # compiling for a GPU that is not here: the store of a GPU of that arch
        gpu = stored_gpu(arch, tuned_dir)
        if gpu is None:
            return None
    try:
        cfg = lookup(gpu[0], arch, head_dim, dtype, causal, seqlen, family, tuned_dir, pass_, gqa_group)
    except StoreError as e:  # one warning, not an error in every attention() call
        _warn_once(str(e), f"{e}; using the family defaults until it is fixed")
        return None
    if cfg is None:
        what = (f"{gpu_slug(*gpu)} d{head_dim} {dtype} {'causal' if causal else 'full'} family {family or 'any'}"
                + (" backward" if pass_ == "bwd" else ""))
        _warn_once(what, f"no tuned configuration for {what} in {store_path(*gpu, tuned_dir)}; using the family "
                         f"default (tune it: flashgen tune --arch {family or native_family(gpu[1])} --head-dim {head_dim} "
                         f"--dtype {dtype}{' --pass bwd' if pass_ == 'bwd' else ''})")
    return cfg
