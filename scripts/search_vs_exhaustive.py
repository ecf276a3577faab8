"""Whether successive halving stores what an exhaustive search stores: both searches over the same (restricted) space
of each problem, then the two winners timed again side by side (needs a GPU).

    python scripts/search_vs_exhaustive.py --out DIR [--rounds 5] \\
        --problem "--arch sm90 --head-dim 128 --causal no --seqlen 4096 --pass bwd" \\
        --problem "--arch sm90 --head-dim 256 --causal no --seqlen 4096 --block-m 128 --persistent no --cluster no"

Each --problem is `flashgen tune`'s arguments for one problem (one head dim, dtype, mask, seqlen and pass). The script
runs `tune --exhaustive` and `tune --search halving` on it, each with a storage and tuned directory of its own under
DIR (the project's store is not touched), then compiles both stored winners and times them in --rounds interleaved
rounds (the kernel alone, as the tuner times it: inputs rotated past L2, CUDA-event medians), and prints per problem
the two winners, their median times over the rounds, and halving's time over the exhaustive winner's. Running it
again reuses the recorded studies (both searches resume; finished ones measure nothing).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import time_configs  # noqa: E402  (its kernels-alone timing, shared)


def search(tune_args: list[str], how: list[str], where: Path) -> dict:
    """Run one search into `where` (its own SQLite storage and tuned directory); its one stored entry."""
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flashgen", "tune", *tune_args, *how, "--storage", f"sqlite:///{where / 'study.db'}",
           "--tuned-dir", str(where / "tuned")]
    print("$", shlex.join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    entries = [e for f in sorted((where / "tuned").glob("*.json")) for e in json.loads(f.read_text())["entries"].values()]
    if len(entries) != 1:
        raise SystemExit(f"{where}: expected one stored entry (one problem per --problem), found {len(entries)}")
    return entries[0]


def point(who: str, entry: dict) -> "time_configs.Point":
    """The stored entry's kernel on its problem, to time as the tuner does (the search verified it)."""
    from flashgen.store import config_from_entry  # noqa: PLC0415

    cfg, prob = config_from_entry(entry), entry["problem"]
    n = prob["seqlen"]
    b, h = prob["batch_tokens"] // n, prob["heads_dim_total"] // cfg.head_dim
    kern, fwd = time_configs.compiled(cfg, prob["gpu_arch"])
    return time_configs.Point(who, cfg, f"N={n}", (b, n, n, h, h // prob.get("gqa_group", 1)), kern, fwd, float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", action="append", required=True, help="tune's arguments for one problem")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for i, spec in enumerate(args.problem):
        tune_args = shlex.split(spec)
        exhaustive = search(tune_args, ["--exhaustive"], args.out / f"p{i}-exhaustive")
        halving = search(tune_args, ["--search", "halving"], args.out / f"p{i}-halving")
        # both even where they agree: the spread of one kernel's figures
        pts = [point("exhaustive", exhaustive), point("halving", halving)]
        ms = {pt.name: statistics.median(t) for pt, t in zip(pts, time_configs.timed_rounds(pts, args.rounds, 50))}
        rows.append((spec, exhaustive, halving, ms))
    print("\nproblem | exhaustive: winner (trials) | halving: winner (rung-0 trials) | ms exhaustive / halving | halving / "
          "exhaustive")
    for spec, exhaustive, halving, ms in rows:
        print(f"{spec} | {exhaustive['kernel']} ({exhaustive.get('trials')}) | {halving['kernel']} "
              f"({halving.get('trials')}) | {ms['exhaustive']:.4f} / {ms['halving']:.4f} | "
              f"{ms['halving'] / ms['exhaustive']:.4f}")


if __name__ == "__main__":
    main()
