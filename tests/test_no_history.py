"""The project speaks of itself, not of how it was built: no numbered rounds of work, issue numbers, branch
names, note item numbers or dated diary entries in the manual, the docs, the code, the templates, the tests,
the scripts or the tuned store's notes. Development history lives in git."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("README.md", "docs", "flashgen", "templates", "tests", "scripts", "tuned")
SUFFIXES = {".py", ".md", ".j2", ".sh", ".json", ".txt", ".toml", ".cu", ".cuh", ".h", ".yaml", ".yml", ".cfg"}
# Known exceptions: files another change still has to clean (path relative to the repository root).
EXCEPTIONS: frozenset[str] = frozenset()

# Built from pieces so that this file does not match itself.
_SESSION = "ses" + "sion"
HISTORY = re.compile("|".join((
    rf"\b{_SESSION}[s']* ?[0-9]",                 # numbered rounds of work
    rf"this {_SESSION}",
    rf"\b(of|in|since|from) {_SESSION}\b",
    r"\bissue #?[0-9]+(?![0-9.%\-–])",              # issue numbers (not a percentage of issue slots)
    r"(^|[\s(\[])#[0-9]{1,5}\b(?![0-9a-fA-F])",      # #123
    "perf" + r"-notes",                            # the retired lab notebook and its item numbers
    r"\bnotes?,? items? [0-9]",
    r"\bbranch(es)? `",                            # branch names
    r"\bbranch [a-z0-9]+(-[a-z0-9]+)+\b",
    r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}: ",            # dated diary entries: "2026-12-01: did X"
)), re.IGNORECASE)
DIARY_HEADING = re.compile(r"^#+ .*\b20[0-9]{2}-[0-9]{2}-[0-9]{2}")  # markdown headings named by date


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES
                      and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def history_lines(text: str, markdown: bool) -> list[tuple[int, str]]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        if HISTORY.search(line) or (markdown and DIARY_HEADING.search(line)):
            hits.append((n, line.strip()[:160]))
    return hits


@pytest.mark.parametrize("line", [
    "Measured in " + _SESSION + " 10 on the H200.", "Found in this " + _SESSION + ".", "see " + "issue" + " 13",
    "fixed by #42", "docs/perf-notes.md" + " item 22", "the notes item 7", "written on branch " + "`diag-cut`",
    "kept on branch fwd-desc-step", "(2026-12-01: staggered at d64)", "lost since " + _SESSION + " eight",
])
def test_the_pattern_catches_history(line):
    assert history_lines(line, markdown=False), line


@pytest.mark.parametrize("line", [
    "@pytest.fixture(scope=\"" + _SESSION + "\")", "a branch on the warpgroup serializes every wgmma",
    "branch-free 1/l", "\"date\": \"2026-12-01\",", "measured on an H200 (CUDA 13.0, 2026-12-01)",
    "#pragma unroll 1", "color: #1f77b4", "issue slots 44% busy", "gemm issue" + " 10.0%", "issue" + " 50-53%", "issue" + " 50–53%",
    "nvcc's " + _SESSION + ": cicc and ptxas too",
])
def test_the_pattern_leaves_plain_text_alone(line):
    assert not history_lines(line, markdown=False), line


def test_a_dated_markdown_heading_is_a_diary_entry():
    assert history_lines("## 2026-11-30, NVIDIA H200", markdown=True)
    assert not history_lines("## Results on the H200", markdown=True)


def test_no_development_history_in_the_tree():
    found = []
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXCEPTIONS:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{rel}:{n}: {line}" for n, line in history_lines(text, path.suffix == ".md")]
    assert not found, "development history (belongs in git, not the tree):\n" + "\n".join(found)
