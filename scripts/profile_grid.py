"""ncu on every point of the bench grid at once: what holds each stored forward kernel back (needs ncu and a GPU).

    python scripts/profile_grid.py --out DIR [--dtype bf16,fp16] [--head-dim 64,128,256]
                                   [--seqlen 1024,4096,16384] [--mask full,causal]
    python scripts/profile_grid.py --out DIR --flex document,causal [--seqlen 4096,16384]
    python scripts/profile_grid.py --from DIR            (summarize a kept profile again, no GPU)

One ncu session profiles one launch of the kernel `load()` picks at each point (batch*seqlen = 16384,
heads*head_dim = 2048, as `flashgen bench`), clocks left alone, with the SpeedOfLight, ComputeWorkloadAnalysis,
WarpStateStats and SourceCounters sections. Keeps the report, its raw metrics and per-instruction samples under
DIR, and prints a row per point: duration, SM / memory throughput, the tensor pipe's share of active cycles,
issue slots busy, and where the sm90 consumer warpgroups' samples fall (profile_stalls.category: waiting for a
wgmma, waiting on an mbarrier, the exp unit, other float, integer/moves). --flex: FlexAttention's examples of
`bench --kind flex` instead (d128, bf16, 16 heads, their modifiers through `flashgen.attention`, one call each), TF/s
over the pairs each mask keeps.
"""
from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from profile_stalls import consumer_region, ncu, num, samples_by_category, sass_columns, sass_rows  # noqa: E402

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SourceCounters")
CONSUMER = ("gemm wait", "mbarrier wait", "MUFU", "other float", "int/move/other", "gemm issue", "FMNMX")


def points(args: argparse.Namespace) -> list[tuple[str, int, int, bool]]:
    return [(dt, int(d), int(n), m == "causal") for dt, d, n, m in itertools.product(
        args.dtype.split(","), args.head_dim.split(","), args.seqlen.split(","), args.mask.split(","))]


def launch(pts: list[tuple[str, int, int, bool]]) -> None:
    """The profiled process: one launch of each point's stored kernel, in order (ncu's IDs follow it)."""
    import torch

    import flashgen
    from flashgen.verify import random_qkv

    for dtype, d, n, causal in pts:
        kern = flashgen.load(d, dtype, causal, seqlen=n, arch="sm90")
        q, k, v = random_qkv(16384 // n, n, n, 2048 // d, 2048 // d, d, dtype)
        kern(q, k, v)
        torch.cuda.synchronize()
        print(f"launched {dtype} d{d} N{n} {'causal' if causal else 'full'}: {kern.config.name}", flush=True)


def launch_flex(names: list[str], seqlens: list[int], out: Path) -> None:
    """The profiled process of --flex: one `flashgen.attention` call of each case at each N (bench --kind flex's
    shapes), in order; writes each point's FLOPs over the pairs its mask keeps to out/flops.json."""
    import torch

    import flashgen
    from flashgen import bench_flex
    from flashgen.verify import random_qkv

    counted = []
    for n in seqlens:
        batch = 16384 // n
        for case in bench_flex.cases(n, batch, 16, "cuda", names=tuple(names)):
            q, k, v = random_qkv(batch, n, n, 16, 16, 128, "bf16")
            flashgen.attention(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod)
            torch.cuda.synchronize()
            counted.append(4 * 16 * 128 * bench_flex.kept_pairs(case, batch, n, q.device))
            print(f"launched {case.name} N{n}", flush=True)
    (out / "flops.json").write_text(json.dumps(counted))


def raw_rows(text: str) -> list[dict[str, str]]:
    """ncu --page raw --csv: a header row, a units row, then a row per profiled kernel; adds "us", the duration."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    head, units = rows[0], dict(zip(rows[0], rows[1]))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6}
    out = [dict(zip(head, r)) for r in rows[2:]]
    for row in out:
        unit = units.get("gpu__time_duration.sum", "ns")
        row["us"] = str(num(row.get("gpu__time_duration.sum", "")) * scale.get(unit, 1e-3))
    return out


def stalls(row: dict[str, str], top: int = 3) -> str:
    """The largest warp stall reasons, in warps per issued instruction (ncu's WarpStateStats), 'selected' left out."""
    pre, post = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    got = [(num(v), k[len(pre):-len(post)]) for k, v in row.items()
           if k.startswith(pre) and k.endswith(post) and "selected" not in k]
    return " ".join(f"{name} {val:.2f}" for val, name in sorted(got, reverse=True)[:top])


def consumer_split(rows: list[list[str]]) -> dict[str, float]:
    """% of the consumer warpgroups' samples (profile_stalls.consumer_region; the whole kernel without one) by category."""
    if len(rows) < 2:
        return {}
    head, body = rows[0], rows[1:]
    text, samples = sass_columns(head)
    if samples is None:
        return {}
    region = consumer_region(body, text)
    cats = samples_by_category(body if region is None else region, text, samples)
    total = sum(cats.values()) or 1.0
    return {k: 100 * v / total for k, v in cats.items()}


COLUMNS = (  # raw metric -> column: throughput of the SM and memory, the tensor and exp (XU) pipes, issue slots
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm%"),
    ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "mem%"),
    ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "tc%"),
    ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "xu%"),
    ("sm__issue_active.avg.pct_of_peak_sustained_elapsed", "issue%"),
)


def flops(label: str) -> float:
    """4 * batch * heads * N^2 * d (halved for causal) of a grid point's label, e.g. 'bf16 d128 N4096 causal'."""
    _, d, n, mask = label.split()
    d_, n_ = int(d[1:]), int(n[1:])
    return 4 * (16384 // n_) * (2048 // d_) * n_ * n_ * d_ / (2 if mask == "causal" else 1)


def summarize(out: Path) -> None:
    labels = json.loads((out / "points.json").read_text())
    counted = json.loads((out / "flops.json").read_text()) if (out / "flops.json").exists() else None
    rows = raw_rows((out / "grid-raw.csv").read_text())
    if len(rows) != len(labels):
        print(f"warning: {len(rows)} profiled kernels for {len(labels)} points")
    head = (f"{'point':23s} {'kernel':56s} {'us':>7s} {'TF/s':>5s} " + " ".join(f"{c:>6s}" for _, c in COLUMNS)
            + "  consumer samples %: " + " ".join(f"{c.split()[0][:6]:>6s}" for c in CONSUMER)
            + "   top stalls (warps per issue)")
    print(head)
    print("-" * len(head))
    for i, (label, row) in enumerate(zip(labels, rows)):
        sass = out / f"sass-{i:02d}.csv"
        split = consumer_split(sass_rows(sass.read_text())) if sass.exists() else {}
        us = num(row["us"])
        print(f"{label:23s} {row.get('Kernel Name', '?').split('(')[0][4:60]:56s} {us:7.1f} "
              f"{(counted[i] if counted else flops(label)) / us / 1e6 if us else 0:5.0f} "
              + " ".join(f"{num(row.get(m, '')):6.1f}" for m, _ in COLUMNS)
              + "                     " + " ".join(f"{split.get(c, 0.0):6.1f}" for c in CONSUMER)
              + "   " + stalls(row))
    print("us: gpu__time_duration under ncu (clocks free, caches flushed per pass); TF/s from it; "
          + ", ".join(f"{c} {m}" for m, c in COLUMNS)
          + "; consumer columns: profile_stalls.category of each sampled SASS instruction")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where the report and its exports go")
    ap.add_argument("--from", dest="src", type=Path, help="summarize this kept profile directory")
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--head-dim", default="64,128,256")
    ap.add_argument("--seqlen", default="1024,4096,16384")
    ap.add_argument("--mask", default="full,causal")
    ap.add_argument("--flex", help="FlexAttention examples (bench --kind flex's cases, comma-separated) instead")
    ap.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    args = ap.parse_args()
    pts = points(args)
    if args.launch:
        if args.flex:
            launch_flex(args.flex.split(","), [int(n) for n in args.seqlen.split(",")], args.out)
        else:
            launch(pts)
        return
    if args.src:
        summarize(args.src)
        return
    if not args.out:
        ap.error("--out DIR (profile) or --from DIR (summarize)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.flex:
        labels = [f"flex {c} N{n}" for n in args.seqlen.split(",") for c in args.flex.split(",")]
        target = ["--flex", args.flex, "--seqlen", args.seqlen, "--out", str(args.out)]
    else:
        labels = [f"{dt} d{d} N{n} {'causal' if c else 'full'}" for dt, d, n, c in pts]
        target = ["--dtype", args.dtype, "--head-dim", args.head_dim, "--seqlen", args.seqlen, "--mask", args.mask]
    (args.out / "points.json").write_text(json.dumps(labels))
    rep = args.out / "grid"
    sections = [a for s in SECTIONS for a in ("--section", s)]
    log = ncu("--clock-control", "none", "-k", "regex:^fwd_", *sections, "--import-source", "no", "-f", "-o",
              str(rep), sys.executable, __file__, "--launch", *target)
    (args.out / "ncu.log").write_text(log)
    (args.out / "grid-raw.csv").write_text(ncu("-i", f"{rep}.ncu-rep", "--page", "raw", "--csv"))
    (args.out / "grid-details.txt").write_text(ncu("-i", f"{rep}.ncu-rep", "--page", "details",
                                                   "--print-details", "all"))
    seen: dict[str, int] = {}
    for i, row in enumerate(raw_rows((args.out / "grid-raw.csv").read_text())):
        # one kernel's samples at a time: its name, skipping the earlier points that launched the same kernel
        name = row.get("Kernel Name", "").split("(")[0]
        skip, seen[name] = seen.get(name, 0), seen.get(name, 0) + 1
        (args.out / f"sass-{i:02d}.csv").write_text(ncu(
            "-i", f"{rep}.ncu-rep", "-k", f"regex:^{name}$", "-s", str(skip), "-c", "1", "--page", "source",
            "--csv", "--print-source", "sass", fatal=False))
    summarize(args.out)


if __name__ == "__main__":
    main()
