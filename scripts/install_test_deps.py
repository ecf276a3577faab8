#!/usr/bin/env python3
"""Install what the test suite needs, light: flashgen with its `test` and `fleet` extras, and torch where it is
missing, a CPU build on a machine without an NVIDIA GPU (PyPI's Linux torch is a CUDA build that pulls GBs of
nvidia-* wheels the CPU tests never load).

    python scripts/install_test_deps.py && python -m pytest

An installed torch is left alone. Where torch is missing: with a GPU (nvidia-smi lists one) pip's default torch;
without, the newest `+cpu` build offered by PyTorch's CPU index (if it answers) or pip's configured sources
(index, --find-links). Where none is offered it stops with the command to install one, never a CUDA build.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REPO = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def reachable(url: str, timeout_s: float = 10.0) -> bool:
    """Whether `url` answers at all (a DNS failure or a blocked host fails at once, not after pip's retries)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except OSError:  # URLError, HTTP errors, timeouts
        return False


def offered_versions(package: str, sources: list[str]) -> list[str]:
    """The versions of `package` that pip can install here from its configured sources plus `sources`, newest
    first (pip's own listing: it knows find-links, extra indexes and the platform's wheel tags)."""
    out = subprocess.run([*PIP, "index", "versions", package, *sources], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return []


def cpu_torch_requirement() -> tuple[str, list[str]]:
    """`torch==<newest +cpu build>` and the pip options of the sources that offer it; SystemExit where none does."""
    sources = ["--extra-index-url", CPU_INDEX] if reachable(f"{CPU_INDEX}/torch/") else []
    if not sources:
        print(f"install_test_deps: {CPU_INDEX} does not answer; looking for a CPU torch in pip's configured sources",
              flush=True)
    cpu = [v for v in offered_versions("torch", sources) if v.endswith("+cpu")]
    if not cpu:
        sys.exit("install_test_deps: no CPU build of torch (+cpu) is offered here, and this machine has no NVIDIA "
                 f"GPU for a CUDA build. Install one (pip install torch --index-url {CPU_INDEX}, or a torch-*+cpu "
                 "wheel) and run this again.")
    return f"torch=={cpu[0]}", sources


def pip_install(*args: str) -> None:
    print("install_test_deps: pip install " + " ".join(args), flush=True)
    subprocess.run([*PIP, "install", "-q", *args], check=True)


def main() -> int:
    os.chdir(REPO)
    if importlib.util.find_spec("torch") is None:
        if has_nvidia_gpu():
            pip_install("torch")
        else:
            requirement, sources = cpu_torch_requirement()
            pip_install(requirement, *sources)
    pip_install("-e", ".[test,fleet]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
