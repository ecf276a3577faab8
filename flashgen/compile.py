"""Step 3: CUDA source to a cubin for one target, with the ptxas resource report.

Compiling needs nvcc, not a GPU. Results are cached on disk, so a second compile of the
same kernel is a file read: `{name}-{target}-{key}-nvcc{version}.cubin` plus a `.json` with
the ptxas report and the cubin's sha256, where key hashes the source, the flags and
NVCC_PREPEND_FLAGS/NVCC_APPEND_FLAGS. Where nvcc is absent (a GPU machine given a cache
filled elsewhere), the newest entry of any nvcc version is served. Only a private cache is
used: the directory and its entries must be ours and not writable by group or others.
nvcc compiles each source from a path named by its content (paths.source_dir), so that one
source builds byte-identical cubins whichever cache they go to.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import KernelConfig
from .paths import cache_dir, source_dir, unsafe_reason
from .render import render

NVCC_FLAGS = ("-O3", "-std=c++17", "-Xptxas", "-v", "-lineinfo")
NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")  # nvcc reads these itself: they change the cubin
NVCC_TIMEOUT_S = 600.0  # FLASHGEN_NVCC_TIMEOUT overrides: one hung ptxas must not stall a tune
SOURCE_MTIME_NS = 0  # the time every compiled source file carries (see _stable_source)
DISASSEMBLE_TIMEOUT_S = 120.0  # a large cubin takes seconds; a hung disassembler must not stall a profile


class CompileError(RuntimeError):
    """nvcc failed; the message names the configuration and carries nvcc's output."""


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for the kernel, plus the dynamic shared memory it launches with."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass(frozen=True)
class CompiledKernel:
    config: KernelConfig
    target: str  # e.g. "sm_90" or "sm_90a"
    source: str
    cubin: bytes
    resources: Resources
    ptxas_log: str
    cached: bool = False  # True when read from the disk cache

    @property
    def name(self) -> str:
        return self.config.name

    @functools.cached_property
    def digest(self) -> str:
        """Identity of the machine code, computed once: loaded modules are looked up by it on every launch."""
        return hashlib.sha1(self.cubin).hexdigest()


def target_for(arch: str, family: str) -> str:
    """The nvcc target that runs `family` kernels on an `arch` GPU (sm90 family needs sm_90a)."""
    sm = arch.removeprefix("sm")
    return f"sm_{sm}a" if family == "sm90" else f"sm_{sm}"


def arch_flags(target: str) -> list[str]:
    """nvcc flags that build for `target`."""
    if target.endswith("a"):  # arch-specific targets need the -gencode form
        cc = target.removeprefix("sm_")
        return ["-gencode", f"arch=compute_{cc},code={target}"]
    return [f"-arch={target}"]


@functools.lru_cache(maxsize=1)
def nvcc_path() -> str:
    env = os.environ.get("FLASHGEN_NVCC")
    if env and not Path(env).is_file():
        raise CompileError(f"FLASHGEN_NVCC={env} is not a file; point it at nvcc or unset it")
    found = env or shutil.which("nvcc") or next(
        (str(p) for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",) if p.exists()), None
    )
    if not found:
        raise CompileError("nvcc not found: put the CUDA toolkit's bin/ on PATH, or set CUDA_HOME or FLASHGEN_NVCC")
    return found


def disassembler() -> list[str] | None:
    """A SASS disassembler's command (nvdisasm or cuobjdump on PATH, beside nvcc, or from the
    nvidia-cuda-nvdisasm wheel of the sass extra), or None where there is none."""
    import importlib.util

    dirs = [Path(nvcc_path()).parent]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        dirs += sorted(Path(root).glob("cu*/bin"))
    for tool, args in (("nvdisasm", ["-c"]), ("cuobjdump", ["--dump-sass"])):
        for path in (shutil.which(tool), *(str(d / tool) for d in dirs)):
            if path and Path(path).is_file() and os.access(path, os.X_OK):
                return [path, *args]
    return None


def disassemble(cubin: bytes, timeout_s: float = DISASSEMBLE_TIMEOUT_S) -> str:
    """The SASS of a cubin, as text (see disassembler); CompileError past `timeout_s` seconds."""
    tool = disassembler()
    if tool is None:
        raise CompileError("no SASS disassembler: install nvidia-cuda-nvdisasm or put nvdisasm on PATH")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            done = subprocess.run([*tool, f.name], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise CompileError(f"{Path(tool[0]).name} timed out after {timeout_s:g} s disassembling a "
                               f"{len(cubin)}-byte cubin") from None
    if done.returncode:
        raise CompileError(f"{tool[0]} failed: {done.stderr.strip()[:500]}")
    return done.stdout


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    """nvcc's version ("13.0.88"), remembered in the cache per nvcc path and mtime: a cache hit runs no nvcc."""
    nvcc = nvcc_path()
    cdir = _private_cache()
    ident = f"{os.path.realpath(nvcc)}@{os.stat(nvcc).st_mtime_ns}"  # a switched /usr/local/cuda link is a new nvcc
    known = _read_json(cdir / "nvcc-versions.json") if cdir else {}
    if ident not in known:
        code, out = _run([nvcc, "--version"], "nvcc --version")
        if code != 0:
            raise CompileError(f"{nvcc} --version failed:\n{out}")
        m = re.search(r"release (\S+), V(\S+)", out)
        known[ident] = re.sub(r"[^\w.+]", "_", m.group(2) if m else out.strip().splitlines()[-1])
        if cdir:
            _write(cdir / "nvcc-versions.json", json.dumps(known, indent=1).encode())
    return known[ident]


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> tuple[int, str]:
    """Exit code and output of an nvcc command, killed with its children (cicc, ptxas) past the timeout."""
    raw = os.environ.get("FLASHGEN_NVCC_TIMEOUT", str(NVCC_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        raise CompileError(f"FLASHGEN_NVCC_TIMEOUT={raw} is not a number of seconds") from None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # nvcc's session: cicc and ptxas too, or their pipes stay open
            except (AttributeError, ProcessLookupError):  # no process groups (Windows), or all gone already
                proc.kill()
            proc.communicate()
            raise CompileError(f"{what} timed out after {timeout:g} s; set FLASHGEN_NVCC_TIMEOUT (seconds, "
                               f"default {NVCC_TIMEOUT_S:g}) if it needs longer") from None
    return proc.returncode, out + err


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str, kernel: str, smem_bytes: int) -> Resources:
    """Resources of `kernel` from `nvcc -Xptxas -v` output."""
    # ptxas prints a block per function: "Compiling entry function 'NAME'" ... "Used N registers".
    # (its name also appears in advisories such as C7512 before its own block)
    start = log.find(f"entry function '{kernel}'")
    block = log[start:] if start >= 0 else log
    regs, spill = _REGS.search(block), _SPILL.search(block)
    if not regs or not spill:
        raise CompileError(f"could not read the ptxas report for {kernel}:\n{log}")
    return Resources(
        registers=int(regs.group(1)),
        stack_bytes=int(spill.group(1)),
        spill_stores=int(spill.group(2)),
        spill_loads=int(spill.group(3)),
        smem_bytes=smem_bytes,
    )


def _key(source: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(flags), *(f"{v}={os.environ.get(v, '')}" for v in NVCC_ENV_FLAGS)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _prefix(cfg: KernelConfig, target: str, source: str, flags: list[str]) -> str:
    return f"{cfg.name}-{target}-{_key(source, flags)}-nvcc"


def cache_entries(cfg: KernelConfig, target: str) -> list[Path]:
    """The cache files (cubin and its .json) that hold `cfg` built for `target` by any nvcc."""
    cdir = _private_cache()
    if cdir is None:
        return []
    prefix = _prefix(cfg, target, render(cfg), [*arch_flags(target), *NVCC_FLAGS])
    return sorted(p for p in cdir.glob(f"{prefix}*") if p.suffix in (".cubin", ".json"))


def compile_kernel(cfg: KernelConfig, target: str, use_cache: bool = True) -> CompiledKernel:
    """Render and compile `cfg` for `target` ("sm_80", "sm_90", "sm_90a", ...)."""
    source = render(cfg)
    flags = [*arch_flags(target), *NVCC_FLAGS]
    cdir = _private_cache() if use_cache else None
    if cdir is None:
        return _compile(cfg, target, source, flags)
    prefix = _prefix(cfg, target, source, flags)
    try:
        version = nvcc_version()
    except CompileError:  # no nvcc here: serve the newest entry any nvcc built, else say why we cannot build
        for cubin_path in sorted(cdir.glob(f"{prefix}*.cubin"), key=lambda p: p.stat().st_mtime, reverse=True):
            if kernel := _load(cubin_path, cfg, target, source):
                return kernel
        raise
    cubin_path = cdir / f"{prefix}{version}.cubin"
    if kernel := _load(cubin_path, cfg, target, source):
        return kernel
    kernel = _compile(cfg, target, source, flags)
    meta = {"config": cfg.to_dict(), "target": target, "nvcc": version,
            "sha256": hashlib.sha256(kernel.cubin).hexdigest(),
            "resources": asdict(kernel.resources), "ptxas_log": kernel.ptxas_log}
    _write(cubin_path, kernel.cubin)  # the cubin first: a reader between the two writes sees a digest mismatch
    _write(cubin_path.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    return kernel


def _compile(cfg: KernelConfig, target: str, source: str, flags: list[str]) -> CompiledKernel:
    with tempfile.TemporaryDirectory(prefix="flashgen-") as tmp:
        out = Path(tmp) / f"{cfg.name}.cubin"
        src = _stable_source(cfg, source)
        if src is None:  # no private source directory: a one-off path (the cubin then differs build to build)
            src = Path(tmp) / f"{cfg.name}.cu"
            src.write_text(source)
        code, log = _run([nvcc_path(), "-cubin", *flags, "-o", str(out), str(src)], f"nvcc for {cfg.name} ({target})",
                         cwd=src.parent)
        if code != 0:
            raise CompileError(f"nvcc failed for {cfg.name} ({target}):\n{log}")
        cubin = out.read_bytes()
    return CompiledKernel(cfg, target, source, cubin, parse_ptxas(log, cfg.name, cfg.smem_bytes), log)


def _stable_source(cfg: KernelConfig, source: str) -> Path | None:
    """`source` written at a path named by its content (source_dir()/<sha256>/<kernel>.cu), or None where that
    directory is not private. nvcc puts the source's path and time in the cubin (-lineinfo; the path's hash in
    internal names): one path and time per source makes one source build the same bytes, and leaves the file
    that the line info names for a profiler to show."""
    root = source_dir()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if why := unsafe_reason(root):  # another user could swap the source between its write and nvcc's read
            _refuse(root, why, "compile sources in", "FLASHGEN_SOURCE_DIR")
            return None
        d = root / hashlib.sha256(source.encode()).hexdigest()[:32]
        d.mkdir(mode=0o700, exist_ok=True)
        if unsafe_reason(d):
            return None
        path = d / f"{cfg.name}.cu"
        # Every time, so the file is exactly this source, with a fixed time: the line info records it too.
        _write(path, source.encode(), mtime_ns=SOURCE_MTIME_NS)
    except OSError:
        return None
    return path


def _load(cubin_path: Path, cfg: KernelConfig, target: str, source: str) -> CompiledKernel | None:
    """The cached kernel, or None where the entry is missing, damaged (digest mismatch) or not private."""
    cubin, meta = _read_private(cubin_path), _read_json(cubin_path.with_suffix(".json"))
    try:
        if cubin is None or meta["sha256"] != hashlib.sha256(cubin).hexdigest():
            return None
        return CompiledKernel(cfg, target, source, cubin, Resources(**meta["resources"]), meta["ptxas_log"],
                              cached=True)
    except (KeyError, TypeError):
        return None


_warned: set[str] = set()


def _refuse(path: Path, why: str, use: str = "load kernels from", env: str = "FLASHGEN_CACHE_DIR") -> None:
    """Warn once per path that the directory at `path` is not used, and how to fix it."""
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"flashgen does not {use} {path}: it is {why}, so another user could plant code "
                      f"there. Compiling without it; fix: `chmod go-w {path}` (and own it), or set "
                      f"{env} to a private directory.", stacklevel=3)


def _private_cache() -> Path | None:
    """The cache directory, created mode 0700; None (warned once) where another user could write to it."""
    cdir = cache_dir()
    cdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if why := unsafe_reason(cdir):
        _refuse(cdir, why)
        return None
    return cdir


def _read_private(path: Path) -> bytes | None:
    """The file's bytes; None where it is missing or not private (warned once)."""
    try:
        if why := unsafe_reason(path):
            _refuse(path, why)
            return None
        return path.read_bytes()
    except OSError:
        return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(_read_private(path) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: bytes, mtime_ns: int | None = None) -> None:
    # Write a private temp file (mkstemp: mode 0600) then rename, so concurrent compiles never see half a file;
    # a failed write (disk full) leaves no temp file behind. `mtime_ns`: the file's time, set before the rename.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
