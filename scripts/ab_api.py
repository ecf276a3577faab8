"""Same-run A/B of what a user gets: `flashgen.attention` called back to back (host cost included) in several
checkouts, alternated round by round on one GPU.

    mkdir .ab-base && git archive REV | tar -x -C .ab-base
    python scripts/ab_api.py base=.ab-base new=. [--rounds 3] [--points 128:4096:1,...]
    python scripts/ab_api.py base=.ab-base new=. --flex alibi,document [--seqlen 4096,16384] [--pass bwd] [--arch sm80]

Each round runs every checkout in its own process (its own `flashgen` package, the same kernel cache), times
each point as CUDA events around loops of calls issued back to back over input sets larger than L2, and keeps
the median loop. The checkouts' order turns from round to round, so that neither always runs first. The table
gives the best round per point and checkout, and each checkout's ratio to the first. --flex: FlexAttention's
examples of `bench --kind flex` instead (d128, 16 heads, bf16, their score_mod / mask_mod through
`flashgen.attention`, TFLOP/s over the pairs each mask keeps; --pass bwd: autograd's backward alone, 2.5x the
forward's FLOPs); the table then also says whether every checkout's output (its sum of |values|) agrees.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BATCH_TOKENS, HEADS_DIM = 16384, 2048  # batch * seqlen and heads * head_dim of every point
DEFAULT_POINTS = "64:4096:0,128:1024:0,128:4096:1,128:16384:0,256:4096:1,256:16384:1"


def parse_points(text: str) -> list[tuple[int, int, bool]]:
    """"d:N:causal,..." -> [(head_dim, seqlen, causal), ...]"""
    out = []
    for item in text.split(","):
        d, n, c = item.split(":")
        out.append((int(d), int(n), c in ("1", "true", "causal")))
    return out


def flops(head_dim: int, seqlen: int, causal: bool) -> float:
    batch, heads = BATCH_TOKENS // seqlen, HEADS_DIM // head_dim
    return 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


def worker(points: list[tuple[int, int, bool]], calls: int, loops: int) -> dict[str, float]:
    """TFLOP/s of each point through flashgen.attention in this process's checkout."""
    import torch  # noqa: PLC0415  (the GPU side only)

    import flashgen  # noqa: PLC0415  (the checkout on sys.path, chosen by the caller)
    from flashgen.bench import l2_rotation  # noqa: PLC0415  (the same checkout's)
    from flashgen.compare import back_to_back_ms  # noqa: PLC0415

    out = {}
    for head_dim, seqlen, causal in points:
        batch, heads = BATCH_TOKENS // seqlen, HEADS_DIM // head_dim
        sets = l2_rotation(4 * batch * seqlen * heads * head_dim * 2)
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = [tuple(torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(3)) for _ in range(sets)]
        ms = back_to_back_ms(lambda i: flashgen.attention(*inputs[i], causal=causal), calls, sets, loops)
        out[f"d{head_dim} N{seqlen} {'causal' if causal else 'full'}"] = flops(head_dim, seqlen, causal) / ms / 1e9
    return out


def flex_worker(names: tuple[str, ...], seqlens: list[int], backward: bool, arch: str, calls: int,
                loops: int) -> dict[str, list[float]]:
    """[TFLOP/s, sum of |output|] of each FlexAttention example through flashgen.attention in this checkout."""
    import torch  # noqa: PLC0415  (the GPU side only)

    import flashgen  # noqa: PLC0415  (the checkout on sys.path, chosen by the caller)
    from flashgen.bench_flex import cases, kept_pairs  # noqa: PLC0415  (the same checkout's)
    from flashgen.compare import back_to_back_ms  # noqa: PLC0415

    out = {}
    for n in seqlens:
        batch, heads, head_dim = max(1, BATCH_TOKENS // n), 16, 128
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, n, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen,
                               requires_grad=backward) for _ in range(3))
        dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        for case in cases(n, batch, heads, q.device, names=names):
            def call(_i: int, case=case) -> Any:
                return flashgen.attention(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod, arch=arch)
            result = call(0)

            def backward_of(_i: int, held: Any = result) -> Any:  # the backward alone, of one forward's graph
                return torch.autograd.grad(held, (q, k, v), dout, retain_graph=True)
            fn = backward_of if backward else call
            if backward:
                result = torch.stack([g.float().abs().sum() for g in fn(0)])
            fwd_flops = 4 * head_dim * heads * kept_pairs(case, batch, n, q.device)
            ms = back_to_back_ms(fn, calls, 1, loops)
            out[f"{case.name} N{n} {'bwd' if backward else 'fwd'}"] = [
                (2.5 if backward else 1.0) * fwd_flops / ms / 1e9, float(result.detach().float().abs().sum())]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revs", nargs="*", help="LABEL=DIR of each checkout, the first is the reference")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--points", default=DEFAULT_POINTS)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--loops", type=int, default=7)
    ap.add_argument("--flex", help="FlexAttention examples (bench --kind flex's cases, comma-separated) instead")
    ap.add_argument("--seqlen", default="4096,16384", help="--flex: sequence lengths")
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd", help="--flex: which pass")
    ap.add_argument("--arch", default="sm90", help="--flex: the template family flashgen.attention takes")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    points = parse_points(args.points)
    if args.worker:
        sys.path.insert(0, str(args.worker.resolve()))
        if args.flex:
            got = flex_worker(tuple(args.flex.split(",")), [int(n) for n in args.seqlen.split(",")],
                              args.pass_ == "bwd", args.arch, args.calls, args.loops)
        else:
            got = {key: [tf, float("nan")] for key, tf in worker(points, args.calls, args.loops).items()}
        print(json.dumps(got))
        return
    revs = [r.split("=", 1) for r in args.revs]
    best: dict[str, dict[str, float]] = {label: {} for label, _ in revs}
    sums: dict[str, set[float]] = {}
    options = ["--points", args.points, "--calls", str(args.calls), "--loops", str(args.loops)]
    if args.flex:
        options += ["--flex", args.flex, "--seqlen", args.seqlen, "--pass", args.pass_, "--arch", args.arch]
    for rnd in range(args.rounds):
        # The order turns every round: on the H200 the first process of a round ran the longest point (d256
        # N16384 causal) about 3% faster than the second, whichever checkout it was.
        for label, path in revs[rnd % len(revs):] + revs[:rnd % len(revs)]:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # the checkout first, then what the caller had
                [str(Path(path).resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]))
            res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", path, *options],
                                 capture_output=True, text=True, env=env, cwd=path)
            if res.returncode:
                raise SystemExit(f"{label} failed:\n{res.stderr[-3000:]}")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            for key, (tf, total) in got.items():
                print(f"round {rnd + 1} {label:>8} {key:<18} {tf:7.1f} TFLOP/s", flush=True)
                best[label][key] = max(best[label].get(key, 0.0), tf)
                if total == total:  # NaN: not recorded
                    sums.setdefault(key, set()).add(total)
    first = revs[0][0]
    print(f"\nbest of {args.rounds} rounds, TFLOP/s through flashgen.attention, back to back (ratio to {first})")
    print(f"{'point':<18}" + "".join(f"{label:>18}" for label, _ in revs))
    for key in best[first]:
        cells = [f"{best[label][key]:7.1f}" + ("" if label == first else
                                                f" ({best[label][key] / best[first][key]:.3f})")
                 for label, _ in revs]
        agree = "" if key not in sums else "  outputs agree" if len(sums[key]) == 1 else "  OUTPUTS DIFFER"
        print(f"{key:<18}" + "".join(f"{c:>18}" for c in cells) + agree)


if __name__ == "__main__":
    main()
