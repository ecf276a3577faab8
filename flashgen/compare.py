"""Side-by-side speed: flashgen's kernels against PyTorch's SDPA backends on the same inputs.

A grid of problems (dtype x head dim x causal x seqlen, batch*seqlen and heads*head_dim
fixed) is timed in one process; each point gets one set of inputs (rotated past L2) that
every kernel reads. Results go to a table, JSON, CSV and a PNG plot.
"""
from __future__ import annotations

import csv
import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from .bench import flops

PEERS = ("flash", "cudnn", "efficient")  # SDPA backends: FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION


@dataclass(frozen=True)
class Point:
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int

    @property
    def tflop(self) -> float:
        return flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal) / 1e12


def grid(dtypes: Iterable[str], head_dims: Iterable[int], causals: Iterable[bool], seqlens: Iterable[int],
         batch_tokens: int = 16384, heads_dim_total: int = 2048) -> list[Point]:
    return [Point(dt, d, c, n, max(1, batch_tokens // n), max(1, heads_dim_total // d))
            for dt in dtypes for d in head_dims for c in causals for n in seqlens]


@dataclass
class Row:
    point: Point
    kernel: str = ""  # flashgen's configuration name
    ms: dict[str, float | None] = field(default_factory=dict)  # "flashgen" and each peer; None: not available
    notes: dict[str, str] = field(default_factory=dict)

    def tflops(self, who: str) -> float | None:
        ms = self.ms.get(who)
        return None if ms is None else self.point.tflop / (ms * 1e-3)

    def ratio(self, peer: str) -> float | None:
        a, b = self.tflops("flashgen"), self.tflops(peer)
        return None if a is None or b is None else a / b


class Runner(Protocol):
    """Times one point: returns the flashgen config name and milliseconds per kernel (None if unavailable)."""

    def time_point(self, point: Point, peers: list[str]) -> Row: ...


class SimulatedRunner:
    """A deterministic stand-in for the GPU (tests and dry runs only; its numbers mean nothing)."""

    def __init__(self, missing: tuple[str, ...] = ()):
        self.missing = missing

    def time_point(self, point: Point, peers: list[str]) -> Row:
        base = point.tflop / 300.0 * 1e3  # "300 TFLOP/s"
        row = Row(point, kernel=f"simulated_d{point.head_dim}")
        row.ms["flashgen"] = base * (0.9 if point.head_dim == 64 else 1.05)
        for i, p in enumerate(peers):
            row.ms[p] = None if p in self.missing else base * (1.0 - 0.2 * i)
            if p in self.missing:
                row.notes[p] = "simulated: unavailable"
        return row


class TorchRunner:
    """The real thing: flashgen.load() (tuned store, else default) and SDPA forced per backend."""

    def __init__(self, arch: str | None = None, warmup: int = 10, reps: int = 50):
        self.arch, self.warmup, self.reps = arch, warmup, reps  # arch: template family, None = fastest tuned

    def time_point(self, point: Point, peers: list[str]) -> Row:
        import torch  # noqa: PLC0415
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        import flashgen  # noqa: PLC0415

        from .bench import l2_rotation, median_ms, time_cuda  # noqa: PLC0415
        from .verify import random_qkv  # noqa: PLC0415

        b, n, h, d = point.batch, point.seqlen, point.heads, point.head_dim
        sets = [random_qkv(b, n, n, h, h, d, point.dtype, seed=i) for i in range(l2_rotation(2 * 4 * b * n * h * d))]
        sdpa_sets = [tuple(t.transpose(1, 2) for t in s) for s in sets]  # SDPA takes (b, h, n, d)
        kern = flashgen.load(d, point.dtype, point.causal, seqlen=n, arch=self.arch)
        row = Row(point, kernel=kern.name)
        row.ms["flashgen"] = median_ms(time_cuda(lambda i: kern(*sets[i]), self.warmup, self.reps, len(sets)))
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}
        for p in peers:
            try:
                with sdpa_kernel(backends[p]):
                    row.ms[p] = median_ms(time_cuda(
                        lambda i: torch.nn.functional.scaled_dot_product_attention(*sdpa_sets[i], is_causal=point.causal),
                        self.warmup, self.reps, len(sets)))
            except RuntimeError as e:  # the backend refuses this shape or dtype
                row.ms[p], row.notes[p] = None, str(e).splitlines()[0][:200]
        del sets, sdpa_sets
        torch.cuda.empty_cache()
        return row


def matmul_ceiling(dtype: str, n: int = 8192, reps: int = 20) -> float:
    """TFLOP/s of an n x n x n matrix product through torch on random data: the ceiling attention is held to."""
    import torch  # noqa: PLC0415

    from .bench import median_ms, time_cuda  # noqa: PLC0415

    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a, b = (torch.randn(n, n, device="cuda", dtype=tdt) for _ in range(2))
    ms = median_ms(time_cuda(lambda i: a @ b, warmup=5, reps=reps))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def run_grid(points: list[Point], runner: Runner, peers: list[str], progress: bool = True) -> list[Row]:
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    from tqdm import tqdm  # noqa: PLC0415

    rows = []
    bar = tqdm(points, desc="bench", unit="point", disable=not progress)
    for pt in bar:
        bar.set_postfix_str(f"{pt.dtype} d{pt.head_dim} {'causal' if pt.causal else 'full'} N={pt.seqlen}")
        rows.append(runner.time_point(pt, peers))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row], peers: list[str], ceiling: dict[str, float] | None = None) -> str:
    """TFLOP/s per kernel, flashgen's ratio to each peer and, given `ceiling` (TFLOP/s of a matrix
    product per dtype), flashgen's share of it."""
    head = f"{'dtype':<5} {'d':>4} {'mask':<6} {'N':>6} {'flashgen':>9} " + " ".join(f"{p:>9}" for p in peers) + " " + \
        " ".join(f"{'x ' + p:>9}" for p in peers) + (f" {'% matmul':>9}" if ceiling else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        pt = r.point
        lines.append(f"{pt.dtype:<5} {pt.head_dim:>4} {'causal' if pt.causal else 'full':<6} {pt.seqlen:>6} "
                     f"{_fmt(r.tflops('flashgen'), '9.1f')} " + " ".join(_fmt(r.tflops(p), '9.1f') for p in peers) + " " +
                     " ".join(_fmt(r.ratio(p), '9.2f') for p in peers) +
                     (f" {_fmt(_share(r, ceiling), '9.1f')}" if ceiling else ""))
    return "\n".join(lines)


def _share(r: Row, ceiling: dict[str, float]) -> float | None:
    t, c = r.tflops("flashgen"), ceiling.get(r.point.dtype)
    return None if t is None or not c else 100 * t / c


def to_records(rows: list[Row], peers: list[str], ceiling: dict[str, float] | None = None) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        rec: dict[str, Any] = {**asdict(r.point), "kernel": r.kernel}
        if ceiling:
            rec["pct_matmul"] = _share(r, ceiling)
        for who in ("flashgen", *peers):
            rec[f"{who}_ms"] = r.ms.get(who)
            rec[f"{who}_tflops"] = r.tflops(who)
        for p in peers:
            rec[f"ratio_{p}"] = r.ratio(p)
        out.append(rec)
    return out


def write(rows: list[Row], peers: list[str], out_dir: Path, gpu: str, meta: dict[str, Any] | None = None,
          date: str | None = None, ceiling: dict[str, float] | None = None, family: str | None = None) -> dict[str, Path]:
    """JSON (with run metadata), CSV and PNG named by GPU, date and template family; returns their paths."""
    import re  # noqa: PLC0415

    date = date or datetime.date.today().isoformat()
    stem = f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{date}" + (f"-{family}" if family else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = to_records(rows, peers, ceiling)
    paths = {"json": out_dir / f"{stem}.json", "csv": out_dir / f"{stem}.csv", "png": out_dir / f"{stem}.png"}
    doc = {"gpu": gpu, "date": date, "peers": peers, **(meta or {}), "results": recs}
    if ceiling:
        doc["matmul_tflops"] = ceiling  # measured in the same run, same process
    paths["json"].write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(recs[0]) if recs else ["dtype"])
        w.writeheader()
        w.writerows(recs)
    plot(rows, peers, paths["png"], title=f"{gpu}, {date}")
    return paths


def plot(rows: list[Row], peers: list[str], path: Path, title: str = "") -> None:
    """TFLOP/s against seqlen: one panel per (head dim, causal), a line per kernel (solid bf16, dashed fp16)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    dims = sorted({r.point.head_dim for r in rows})
    masks = sorted({r.point.causal for r in rows})
    dtypes = sorted({r.point.dtype for r in rows})
    fig, axes = plt.subplots(len(masks), len(dims), figsize=(4.2 * len(dims), 3.4 * len(masks)), squeeze=False)
    colors = {"flashgen": "C3", "flash": "C0", "cudnn": "C2", "efficient": "C7"}
    for (i, causal), (j, d) in ((im, jd) for im in enumerate(masks) for jd in enumerate(dims)):
        ax = axes[i][j]
        for who in ("flashgen", *peers):
            for dt in dtypes:
                pts = sorted((r.point.seqlen, r.tflops(who)) for r in rows
                             if (r.point.head_dim, r.point.causal, r.point.dtype) == (d, causal, dt) and r.tflops(who))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colors.get(who), linestyle="-" if dt == "bf16" else "--",
                            label=f"{who if who == 'flashgen' else 'sdpa-' + who} {dt}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
