"""Where flashgen finds its templates and tuned store, from a checkout or an install."""
from __future__ import annotations

import os
import stat
from importlib import resources
from pathlib import Path

import platformdirs

_REPO = Path(__file__).resolve().parent.parent


def _data_dir(name: str) -> Path:
    # A checkout keeps templates/ and tuned/ at the repo root; an installed wheel carries
    # them inside the package as flashgen/templates and flashgen/tuned (see pyproject.toml).
    in_repo = _REPO / name
    if in_repo.is_dir() and (_REPO / "pyproject.toml").is_file():
        return in_repo
    return Path(str(resources.files("flashgen") / name))


def templates_dir() -> Path:
    return _data_dir("templates")


def tuned_dir() -> Path:
    """The tuned store: FLASHGEN_TUNED_DIR if set, else the shipped tuned/."""
    env = os.environ.get("FLASHGEN_TUNED_DIR")
    return Path(env) if env else _data_dir("tuned")


def cache_dir() -> Path:
    """Compiled kernels: FLASHGEN_CACHE_DIR if set, else the user cache dir."""
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("flashgen")) / "kernels"


def source_dir() -> Path:
    """Kernel sources as nvcc compiled them, by content: FLASHGEN_SOURCE_DIR if set, else the user cache dir.
    Apart from the kernel cache: the path is in the cubin (line info, internal names), so one source builds the
    same bytes whichever cache it goes to."""
    env = os.environ.get("FLASHGEN_SOURCE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("flashgen")) / "sources"


def unsafe_reason(path: Path) -> str | None:
    """Why another user could have put what is at `path` there (not ours, or group/other-writable); else None."""
    if os.name != "posix":
        return None
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None
