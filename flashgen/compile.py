"""Step 3: CUDA source to a cubin for one target, with the ptxas resource report.

Compiling needs nvcc, not a GPU. Results are cached on disk keyed by a hash of the
source, target, flags and nvcc version, so a second compile of the same kernel is a
file read.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import KernelConfig
from .paths import cache_dir
from .render import render

NVCC_FLAGS = ("-O3", "-std=c++17", "-Xptxas", "-v", "-lineinfo")


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


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\S+), V(\S+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str, kernel: str, smem_bytes: int) -> Resources:
    """Resources of `kernel` from `nvcc -Xptxas -v` output."""
    # ptxas prints a block per function: "Compiling entry function 'NAME'" ... "Used N registers".
    start = log.find(f"'{kernel}'")
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


def _key(source: str, target: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, target, " ".join(flags), nvcc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def compile_kernel(cfg: KernelConfig, target: str, use_cache: bool = True) -> CompiledKernel:
    """Render and compile `cfg` for `target` ("sm_80", "sm_90", "sm_90a", ...)."""
    source = render(cfg)
    flags = [*arch_flags(target), *NVCC_FLAGS]
    cdir = cache_dir()
    stem = cdir / f"{cfg.name}-{target}-{_key(source, target, flags)}"
    cubin_path, meta_path = stem.with_suffix(".cubin"), stem.with_suffix(".json")
    if use_cache and cubin_path.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            return CompiledKernel(cfg, target, source, cubin_path.read_bytes(), Resources(**meta["resources"]),
                                  meta["ptxas_log"], cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry is rebuilt below
    with tempfile.TemporaryDirectory(prefix="flashgen-") as tmp:
        src, out = Path(tmp) / f"{cfg.name}.cu", Path(tmp) / f"{cfg.name}.cubin"
        src.write_text(source)
        proc = subprocess.run([nvcc_path(), "-cubin", *flags, "-o", str(out), str(src)], capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed for {cfg.name} ({target}):\n{log}")
        cubin = out.read_bytes()
    kernel = CompiledKernel(cfg, target, source, cubin, parse_ptxas(log, cfg.name, cfg.smem_bytes), log)
    if use_cache:
        _store(cubin_path, meta_path, kernel)
    return kernel


def _store(cubin_path: Path, meta_path: Path, kernel: CompiledKernel) -> None:
    # Write to temp names then rename, so concurrent compiles never see half a file.
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": kernel.config.to_dict(), "target": kernel.target,
            "resources": asdict(kernel.resources), "ptxas_log": kernel.ptxas_log}
    for path, data in ((cubin_path, kernel.cubin), (meta_path, json.dumps(meta, indent=1).encode())):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
