"""Where a bench point's kernel waits: ncu's warp-state samples per SASS instruction (needs ncu and a GPU).

    python scripts/profile_stalls.py FAMILY HEAD_DIM SEQLEN CAUSAL(0|1) [DTYPE [PASS]] --out DIR [--top 40]
    python scripts/profile_stalls.py --csv DIR/stalls-...-sass.csv          (summarize a kept profile, no GPU)

Profiles the kernel `load()` picks for the point (scripts/launch_bench_point.py: batch*seqlen = 16384,
heads*head_dim = 2048) with the SourceCounters and WarpStateStats sections, keeps the report and the
per-instruction CSV under DIR, and prints the kernel's stall reasons, where the sm90 consumer warpgroups'
samples fall (GEMM waits, mbarrier waits, MUFU, ... : the region after setmaxnreg.inc) and the instructions
most often sampled, with their SASS: the consumer's critical path shows as the waits it sits on. PASS bwd: the
backward's main kernel (its second call's; a call launches _pre, the main kernel and _convert).
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ncu(*args: str, fatal: bool = True) -> str:
    """ncu's stdout; a failure exits (fatal) or prints a line and gives ""."""
    run = subprocess.run(["ncu", *args], capture_output=True, text=True, check=False)
    if run.returncode != 0 and not fatal:
        print(f"ncu {' '.join(args[:6])} ... failed: {(run.stdout + run.stderr)[-300:]}")
        return ""
    if run.returncode != 0:
        sys.exit(f"ncu {' '.join(args[:3])} ... failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return run.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("point", nargs="*", help="FAMILY HEAD_DIM SEQLEN CAUSAL [DTYPE [PASS]]")
    ap.add_argument("--out", type=Path, help="where the report, details and per-instruction CSV go")
    ap.add_argument("--csv", type=Path, help="summarize this kept per-instruction CSV instead of profiling")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    if args.csv:
        summarize(args.csv.read_text(), args.csv.stem, args.top)
        return
    if not args.point or not args.out:
        ap.error("a point (FAMILY HEAD_DIM SEQLEN CAUSAL [DTYPE]) and --out, or --csv")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "-".join(args.point)
    rep = args.out / f"stalls-{tag}"
    bwd = len(args.point) > 5 and args.point[5] == "bwd"
    ncu("--clock-control", "none", "-k", "regex:bwd_" if bwd else "regex:fwd_", "-s", "4" if bwd else "2", "-c", "1",
        "--section", "SourceCounters", "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis",
        "--section", "MemoryWorkloadAnalysis",
        "--section", "WarpStateStats", "--import-source", "no", "-f", "-o", str(rep),
        sys.executable, str(ROOT / "scripts" / "launch_bench_point.py"), *args.point)
    details = ncu("-i", f"{rep}.ncu-rep", "--page", "details", "--print-details", "all")
    (args.out / f"stalls-{tag}-details.txt").write_text(details)
    source = ncu("-i", f"{rep}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass")
    (args.out / f"stalls-{tag}-sass.csv").write_text(source)

    print(f"== {tag}")
    for line in details.splitlines():  # the kernel's name and its stall breakdown (cycles per issued instruction)
        if re.search(r"fwd_|bwd_|Warp Cycles Per Issued|Stall|stall", line):
            print(line.rstrip()[:150])
    summarize(source, tag, args.top)


def category(op: str, after_wait: bool) -> str:
    """Where a consumer instruction's samples count: the GEMMs' waits and issue, barrier waits, the softmax's units."""
    if "DEPBAR" in op:
        return "gemm wait"
    if "GMMA" in op or op.startswith("WARPGROUP"):
        return "gemm issue"
    if op.startswith("SYNCS") or (op.startswith("BRA") and after_wait):
        return "mbarrier wait"
    if op.startswith(("MUFU", "FMNMX")):
        return op.split(".")[0]
    return "other float" if op.startswith(("FADD", "FFMA", "FMUL", "F2FP", "FSEL", "FSETP")) else "int/move/other"


def num(text: str) -> float:
    """A CSV cell as a number: "1,234" as 1234, empty or not a number as 0."""
    try:
        return float(text.replace(",", "")) if text else 0.0
    except ValueError:
        return 0.0


def sass_rows(source: str) -> list[list[str]]:
    """ncu --page source --csv of one kernel: it opens with a "Kernel Name" row, then the header, then one row per
    SASS instruction; this gives the header and the instruction rows."""
    return [r for r in csv.reader(io.StringIO(source)) if r and r[0] != "Kernel Name"]


def sass_columns(head: list[str]) -> tuple[int, int | None]:
    """The header's instruction-text column and its all-samples column (None: the report has no samples)."""
    text = next((i for i, n in enumerate(head) if n.lower() == "source"), 1)
    return text, next((i for i, n in enumerate(head) if "Sampling (All" in n), None)


def consumer_region(body: list[list[str]], text: int) -> list[list[str]] | None:
    """sm90: the consumers' instructions, from setmaxnreg.inc to the producer's setmaxnreg.dec (None: no such pair)."""
    alloc = [i for i, r in enumerate(body) if "SETMAXREG" in r[text]]
    return body[alloc[0]:alloc[1]] if len(alloc) >= 2 else None


def samples_by_category(rows: list[list[str]], text: int, samples: int) -> dict[str, float]:
    """Samples per category() of the instructions' opcodes (a branch right after an mbarrier try-wait is the wait)."""
    cats: dict[str, float] = {}
    prev = ""
    for r in rows:
        words = r[text].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        key = category(op, "SYNCS" in prev)
        cats[key] = cats.get(key, 0.0) + num(r[samples] if samples < len(r) else "")
        prev = op
    return cats


def summarize(source: str, tag: str, top: int) -> None:
    rows = sass_rows(source)
    if not rows:
        print("no source rows")
        return
    head, body = rows[0], rows[1:]
    text, samples = sass_columns(head)
    if samples is None:
        print("columns:", head)
        return
    extra = [i for i, n in enumerate(head) if n.startswith("stall_") and "Not Issued" not in n]

    def cell(r: list[str], i: int) -> float:
        return num(r[i] if i < len(r) else "")

    total = sum(cell(r, samples) for r in body) or 1.0
    cons = consumer_region(body, text)
    if cons is not None:
        cats = samples_by_category(cons, text, samples)
        n = sum(cats.values()) or 1.0
        print(f"{tag}: consumer warps' samples ({100 * n / total:.0f}% of all): "
              + ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))
    print(f"{len(body)} SASS instructions, {total:.0f} samples; top {top}:")
    for r in sorted(body, key=lambda r: -cell(r, samples))[:top]:
        more = " ".join(f"{head[i]}={cell(r, i):.0f}" for i in extra if cell(r, i))
        print(f"{100 * cell(r, samples) / total:5.1f}%  {r[0]:>6}  {r[text].strip()[:70]:70s} {more[:120]}")


if __name__ == "__main__":
    main()
