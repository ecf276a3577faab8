"""Side-by-side speed: flashgen's kernels against PyTorch's SDPA backends on the same inputs.

A grid of problems (dtype x head dim x causal x seqlen, batch*seqlen and heads*head_dim
fixed) is timed in one process; each point gets one set of inputs (rotated past L2) that
every kernel reads. Results go to a table, JSON, CSV and a PNG plot.

Two figures for flashgen, side by side: "flashgen" is the loaded kernel alone (the GPU kept
busy ahead of each call, so host cost is hidden: a diagnostic), "api" is what a user gets,
`flashgen.attention()` called back to back with no GPU sleep, host cost included. Apart from
the grid, `host_us` times the host's cost per call on a problem too small for the GPU to matter.
"""
from __future__ import annotations

import csv
import datetime
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from . import api
from .bench import flops, l2_rotation, median_ms, retime_best, time_backward, time_cuda
from .config import FP8_DTYPES
from .fp8 import quantize
from .resolve import backward_kernel
from .tensors import torch_dtype
from .verify import random_qkv

PEERS = ("flash", "cudnn", "efficient")  # SDPA backends: FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION
PEER_FIGURES = Path(__file__).parent / "data" / "peers.json"  # card, date, versions and source of every figure


def peer_figures(name: str, path: Path = PEER_FIGURES) -> dict[tuple[int, int, bool], float]:
    """One peer's figures from the data file: (head_dim, seqlen, causal) -> value."""
    points = json.loads(path.read_text())["peers"][name]["points"]
    return {(p["head_dim"], p["seqlen"], p["causal"]): p["value"] for p in points}


# FlashAttention-4 / cuDNN (SDPA) forward on the H200, bf16, one run: flashgen / cuDNN at or above this is
# FA4's level. (head_dim, seqlen, causal) -> ratio; the same target is used for fp16.
FA4_OVER_CUDNN = peer_figures("fa4_fwd_over_cudnn")
# FlashAttention-4's backward on the H200, bf16, TFLOP/s (2.5x the forward's FLOPs); it cannot be installed on the
# GPU machine, so these stand beside the same-run SDPA peers: flashgen's backward / this is the "x FA4" column.
FA4_BWD_TFLOPS = peer_figures("fa4_bwd_tflops")
HOST_SHAPE = (1, 128, 1)  # batch, seqlen, heads of the host-cost problem: microseconds of GPU work at most


@dataclass(frozen=True)
class Point:
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    pass_: str = "fwd"  # "bwd": the backward (dQ, dK, dV given out, lse and dO), 2.5x the forward's FLOPs

    @property
    def tflop(self) -> float:
        return flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal, self.pass_) / 1e12


def grid(dtypes: Iterable[str], head_dims: Iterable[int], causals: Iterable[bool], seqlens: Iterable[int],
         batch_tokens: int = 16384, heads_dim_total: int = 2048, passes: Iterable[str] = ("fwd",)) -> list[Point]:
    return [Point(dt, d, c, n, max(1, batch_tokens // n), max(1, heads_dim_total // d), p)
            for p in passes for dt in dtypes for d in head_dims for c in causals for n in seqlens]


@dataclass
class Row:
    point: Point
    kernel: str = ""  # flashgen's configuration name
    ms: dict[str, float | None] = field(default_factory=dict)  # "flashgen" (kernel), "api" and each peer; None: n/a
    notes: dict[str, str] = field(default_factory=dict)

    def tflops(self, who: str) -> float | None:
        ms = self.ms.get(who)
        return None if ms is None else self.point.tflop / (ms * 1e-3)

    def ratio(self, peer: str, who: str = "flashgen") -> float | None:
        a, b = self.tflops(who), self.tflops(peer)
        return None if a is None or b is None else a / b


class Runner(Protocol):
    """Times one point: returns the flashgen config name and milliseconds per kernel (None if unavailable);
    and the host's microseconds per call of attention(), Kernel() and SDPA on a tiny problem."""

    def time_point(self, point: Point, peers: list[str]) -> Row: ...

    def host_us(self, dtype: str, head_dim: int, causal: bool) -> dict[str, float]: ...


class SimulatedRunner:
    """A deterministic stand-in for the GPU (tests and dry runs only; its numbers mean nothing)."""

    def __init__(self, missing: tuple[str, ...] = ()):
        self.missing = missing

    def time_point(self, point: Point, peers: list[str]) -> Row:
        base = point.tflop / 300.0 * 1e3  # "300 TFLOP/s"
        row = Row(point, kernel=f"simulated_{'bwd_' * (point.pass_ == 'bwd')}d{point.head_dim}")
        row.ms["flashgen"] = base * (0.9 if point.head_dim == 64 else 1.05)
        row.ms["api"] = row.ms["flashgen"] * 1.25  # "host cost shows"
        row.ms["kernel_b2b"] = row.ms["flashgen"] * 1.1
        for i, p in enumerate(peers):
            row.ms[p] = None if p in self.missing else base * (1.0 - 0.2 * i)
            row.ms[f"{p}_b2b"] = None if p in self.missing else row.ms[p] * 1.1
            if p in self.missing:
                row.notes[p] = "simulated: unavailable"
        return row

    def host_us(self, dtype: str, head_dim: int, causal: bool) -> dict[str, float]:
        return {"attention": 20.0, "kernel": 12.0, "sdpa": 15.0}


class TorchRunner:
    """The real thing: api.load() (tuned store, else default) and SDPA forced per backend."""
    def __init__(self, arch: str | None = None, warmup: int = 10, reps: int = 50, rounds: int = 3):
        self.arch, self.warmup, self.reps = arch, warmup, reps  # arch: template family, None = fastest tuned
        self.rounds = rounds  # interleaved rounds of the kernel-alone timings (flashgen and the peers)

    def time_point(self, point: Point, peers: list[str]) -> Row:
        if point.pass_ == "bwd":
            return self.time_backward_point(point, peers)
        import torch  # noqa: PLC0415
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        b, n, h, d = point.batch, point.seqlen, point.heads, point.head_dim
        fp8 = point.dtype in FP8_DTYPES
        # FP8: flashgen reads e4m3 copies of bf16 inputs (per-tensor descale); the peers read the bf16 ones.
        sets = [random_qkv(b, n, n, h, h, d, "bf16" if fp8 else point.dtype, seed=i)
                for i in range(l2_rotation(2 * 4 * b * n * h * d))]
        ours = [quantize(*s) for s in sets] if fp8 else [(*s, {}) for s in sets]
        sdpa_sets = [tuple(t.transpose(1, 2) for t in s) for s in sets]  # SDPA takes (b, h, n, d)
        kern = api.load(d, point.dtype, point.causal, seqlen=n, arch=self.arch)
        row = Row(point, kernel=kern.name)

        def call(i: int) -> Any:
            q, k, v, descale = ours[i]
            return kern(q, k, v, **descale)

        def public_call(i: int) -> Any:
            q, k, v, descale = ours[i]
            return api.attention(q, k, v, causal=point.causal, arch=self.arch, **descale)

        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}

        def sdpa(i: int) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(*sdpa_sets[i], is_causal=point.causal)

        def peer_call(p: str) -> Callable[[int], Any]:  # the backend forced per call (host time hidden when alone)
            def call_p(i: int) -> Any:
                with sdpa_kernel(backends[p]):
                    return sdpa(i)
            return call_p

        alone: dict[str, Callable[[int], Any]] = {"flashgen": call}
        for p in peers:
            try:
                peer_call(p)(0)
                alone[p] = peer_call(p)
            except RuntimeError as e:  # the backend refuses this shape or dtype
                row.ms[p], row.notes[p] = None, str(e).splitlines()[0][:200]
        # Kernels alone in interleaved rounds (flashgen, each peer, again...): what the GPU's clocks and power
        # state do to one shows in all of them, not in whichever ran after the heaviest.
        timed = retime_best([(0.0, who) for who in alone], lambda who: time_cuda(
            alone[who], self.warmup, self.reps, len(sets)), top=len(alone), rounds=self.rounds)
        row.ms.update({who: ms for ms, who in timed})
        row.ms["api"] = back_to_back_ms(public_call, self.reps, len(sets))
        # The same kernel back to back: api vs this is the host's share; this vs "flashgen" is what
        # sustained running (clocks under a steady power draw) costs the GPU itself.
        row.ms["kernel_b2b"] = back_to_back_ms(call, self.reps, len(sets))
        for p in peers:
            if p in alone:
                with sdpa_kernel(backends[p]):  # forced once, outside the loop: the user's host cost, no more
                    row.ms[f"{p}_b2b"] = back_to_back_ms(sdpa, self.reps, len(sets))
        del sets, sdpa_sets, ours
        torch.cuda.empty_cache()
        return row

    def time_backward_point(self, point: Point, peers: list[str]) -> Row:
        """The backward: "flashgen" its kernels alone (the tuned BwdConfig for this GPU and seqlen, else the
        default; out and lse from the forward, outside the timing), "api" torch.autograd.grad through
        flashgen.attention (the graph kept: the backward alone, host included), each peer SDPA's backward
        timed the same way, its backend forced."""
        import torch  # noqa: PLC0415
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        b, n, h, d = point.batch, point.seqlen, point.heads, point.head_dim
        kern = backward_kernel(torch.cuda.current_device(), d, point.dtype, point.causal, n)
        fwd = api.load(d, point.dtype, point.causal, seqlen=n, arch="sm80").compiled
        row = Row(point, kernel=kern.name)
        row.ms["flashgen"] = time_backward(kern, fwd, b, n, n, h, h, self.warmup, self.reps)
        q, k, v = random_qkv(b, n, n, h, h, d, point.dtype, seed=0)
        dout = torch.randn_like(q)

        def grad_ms(forward: Callable[..., Any], inputs: tuple, grad: Any) -> float:
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            out = forward(*leaves)
            return median_ms(time_cuda(lambda i: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                                       self.warmup, self.reps))

        row.ms["api"] = grad_ms(lambda q, k, v: api.attention(q, k, v, causal=point.causal), (q, k, v), dout)
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for p in peers:
            try:
                with sdpa_kernel(backends[p]):
                    row.ms[p] = grad_ms(lambda q, k, v: sdpa(q, k, v, is_causal=point.causal),
                                        tuple(t.transpose(1, 2) for t in (q, k, v)), dout.transpose(1, 2))
            except RuntimeError as e:  # the backend refuses this shape or dtype
                row.ms[p], row.notes[p] = None, str(e).splitlines()[0][:200]
        del q, k, v, dout
        torch.cuda.empty_cache()
        return row

    def host_us(self, dtype: str, head_dim: int, causal: bool) -> dict[str, float]:
        """Microseconds per call, by wall clock, of each way in on a problem small enough to be host-bound."""
        import torch  # noqa: PLC0415

        b, n, h = HOST_SHAPE
        fp8 = dtype in FP8_DTYPES
        q, k, v = random_qkv(b, n, n, h, h, head_dim, "bf16" if fp8 else dtype, seed=0)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA in bf16 for an FP8 grid
        q8, k8, v8, descale = quantize(q, k, v) if fp8 else (q, k, v, {})
        kern = api.load(head_dim, dtype, causal, seqlen=n, arch=self.arch)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return host_us_per_call({"attention": lambda: api.attention(q8, k8, v8, causal=causal, arch=self.arch,
                                                                         **descale),
                                 "kernel": lambda: kern(q8, k8, v8, **descale),
                                 "sdpa": lambda: sdpa(qt, kt, vt, is_causal=causal)})


def back_to_back_ms(fn: Callable[[int], Any], calls: int = 50, rotate: int = 1, loops: int = 5, warmup: int = 5) -> float:
    """Milliseconds per call of fn(i) issued back to back with no GPU sleep (i cycles over `rotate` input sets):
    CUDA events around each loop of `calls` calls, median over `loops`. Host cost shows wherever it exceeds
    the GPU's time, as in a user's loop (unlike bench.time_cuda, which hides it)."""
    import torch  # noqa: PLC0415

    for i in range(warmup):
        fn(i % rotate)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(loops):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i % rotate)
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return statistics.median(per_call)


def host_us_per_call(fns: dict[str, Callable[[], Any]], calls: int = 200, loops: int = 7,
                     warmup: int = 20) -> dict[str, float]:
    """Wall-clock microseconds per call of each fn issued back to back, synchronized after each loop of
    `calls`; median over `loops`. On a tiny problem this is the host's cost of the call."""
    import torch  # noqa: PLC0415

    out = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(loops):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - t0) / calls * 1e6)
        out[name] = statistics.median(per_call)
    return out


def host_problem(point: Point) -> dict[str, Any]:
    """The problem `host_us` times for a grid whose first point is `point`, as stored beside its figures."""
    b, n, h = HOST_SHAPE
    return {"dtype": point.dtype, "head_dim": point.head_dim, "causal": point.causal, "batch": b, "seqlen": n, "heads": h}


def host_line(host: dict[str, float], dtype: str, head_dim: int) -> str:
    b, n, h = HOST_SHAPE
    return (f"host us/call: attention() {host['attention']:.1f}, Kernel() {host['kernel']:.1f}, SDPA {host['sdpa']:.1f} "
            f"({dtype} d{head_dim}, batch {b} x seqlen {n} x heads {h}, back to back)")


def matmul_ceiling(dtype: str, n: int = 8192, reps: int = 20) -> float:
    """TFLOP/s of an n x n x n matrix product through torch on random data: the ceiling attention is held to.
    FP8: torch._scaled_mm, e4m3 in, bf16 out."""
    import torch  # noqa: PLC0415

    if dtype in FP8_DTYPES:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device="cuda")
        ms = median_ms(time_cuda(lambda i: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), warmup=5,
                                 reps=reps))
        return 2 * n**3 / (ms * 1e-3) / 1e12
    tdt = torch_dtype(dtype)
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
    return "-".rjust(int(spec.split(".")[0] or 0)) if x is None else format(x, spec)


def fa4_target(pt: Point) -> float | None:
    """FlashAttention-4's speed relative to cuDNN at this point on the H200 (None where not measured):
    the ratio flashgen / cuDNN has to reach."""
    if pt.dtype in FP8_DTYPES:  # FA4's figures are 16-bit; FP8's goal is the share of the FP8 matmul
        return None
    return FA4_OVER_CUDNN.get((pt.head_dim, pt.seqlen, pt.causal))


def _fa4_bwd(pt: Point) -> float | None:
    """FlashAttention-4's backward TFLOP/s on the H200 at a backward point (data/peers.json, bf16 only), or None."""
    if pt.pass_ != "bwd" or pt.dtype != "bf16":
        return None
    return FA4_BWD_TFLOPS.get((pt.head_dim, pt.seqlen, pt.causal))


def fa4_goal(r: Row) -> float | None:
    """The ratio to cuDNN that flashgen has to reach at this row: FlashAttention-4's forward over cuDNN (both measured
    on the H200), or for a backward row FlashAttention-4's backward TFLOP/s over this run's cuDNN."""
    if r.point.pass_ == "fwd":
        return fa4_target(r.point)
    fa4, cudnn = _fa4_bwd(r.point), r.tflops("cudnn")
    return fa4 / cudnn if fa4 is not None and cudnn else None


def fa4_bwd_ratio(r: Row) -> float | None:
    """A backward row's kernel TFLOP/s over FlashAttention-4's backward on the H200."""
    t, fa4 = r.tflops("flashgen"), _fa4_bwd(r.point)
    return t / fa4 if t is not None and fa4 is not None else None


def table(rows: list[Row], peers: list[str], ceiling: dict[str, float] | None = None) -> str:
    """TFLOP/s per kernel (flashgen's kernel alone, then through attention() back to back, and their
    ratio), flashgen's kernel's ratio to each peer and, given `ceiling` (TFLOP/s of a matrix product
    per dtype), its share of it."""
    b2b = [p for p in peers if any(r.ms.get(f"{p}_b2b") for r in rows)]  # sustained peer figures, where measured
    passes = any(r.point.pass_ != "fwd" for r in rows)  # a pass column only where a backward is in the table
    head = f"{'pass ' if passes else ''}{'dtype':<8} {'d':>4} {'mask':<6} {'N':>6} {'flashgen':>9} {'api':>9} {'api/kern':>9} " + \
        " ".join(f"{p:>9}" for p in peers) + " " + \
        " ".join(f"{'x ' + p:>9}" for p in peers) + (f" {'FA4 goal':>9}" if "cudnn" in peers else "") + \
        (f" {'x FA4 bwd':>9}" if passes else "") + (f" {'% matmul':>9}" if ceiling else "") + \
        "".join(f" {p + ' b2b':>10} {'api x ' + p:>10}" for p in b2b)
    lines = [head, "-" * len(head)]
    for r in rows:
        pt = r.point
        lines.append(f"{pt.pass_ + ' ' if passes else ''}{pt.dtype:<8} {pt.head_dim:>4} {'causal' if pt.causal else 'full':<6} {pt.seqlen:>6} "
                     f"{_fmt(r.tflops('flashgen'), '9.1f')} {_fmt(r.tflops('api'), '9.1f')} "
                     f"{_fmt(r.ratio('flashgen', who='api'), '9.2f')} " +
                     " ".join(_fmt(r.tflops(p), '9.1f') for p in peers) + " " +
                     " ".join(_fmt(r.ratio(p), '9.2f') for p in peers) +
                     (f" {_fmt(fa4_goal(r), '9.2f')}" if "cudnn" in peers else "") +
                     (f" {_fmt(fa4_bwd_ratio(r), '9.2f')}" if passes else "") +
                     (f" {_fmt(_share(r, ceiling), '9.1f')}" if ceiling else "") +
                     "".join(f" {_fmt(r.tflops(p + '_b2b'), '10.1f')} {_fmt(r.ratio(p + '_b2b', who='api'), '10.2f')}"
                             for p in b2b))
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
        rec["fa4_over_cudnn_target"] = fa4_goal(r)
        rec["ratio_fa4_bwd"] = fa4_bwd_ratio(r)
        for who in ("flashgen", "api", "kernel_b2b", *peers, *(f"{p}_b2b" for p in peers)):
            rec[f"{who}_ms"] = r.ms.get(who)
            rec[f"{who}_tflops"] = r.tflops(who)
        rec["ratio_api_kernel"] = r.ratio("flashgen", who="api")
        rec["ratio_api_kernel_b2b"] = r.ratio("kernel_b2b", who="api")
        for p in peers:
            rec[f"ratio_{p}"] = r.ratio(p)
            rec[f"ratio_api_{p}_b2b"] = r.ratio(f"{p}_b2b", who="api")
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
    plot(rows, peers, paths["png"], title=f"{gpu}, {date}", ceiling=ceiling)
    return paths


def plot(rows: list[Row], peers: list[str], path: Path, title: str = "", ceiling: dict[str, float] | None = None) -> None:
    """TFLOP/s against seqlen: one panel per (head dim, causal), a line per kernel (solid bf16, dashed fp16,
    dotted FP8). An FP8 point's SDPA peers ran in bf16 (its lines would repeat the bf16 ones: left out); with
    the FP8 matmul `ceiling`, FP8's goal (75% of it non-causal, 65% causal) is a grey line."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    dims = sorted({r.point.head_dim for r in rows})
    masks = sorted({r.point.causal for r in rows})
    dtypes = sorted({r.point.dtype for r in rows})
    fig, axes = plt.subplots(len(masks), len(dims), figsize=(4.2 * len(dims), 3.4 * len(masks)), squeeze=False)
    colors = {"flashgen": "C3", "api": "C1", "flash": "C0", "cudnn": "C2", "efficient": "C7"}
    labels = {"flashgen": "flashgen kernel", "api": "flashgen attention()"}
    styles = {"bf16": "-", "fp16": "--", "fp8_e4m3": ":"}
    for (i, causal), (j, d) in ((im, jd) for im in enumerate(masks) for jd in enumerate(dims)):
        ax = axes[i][j]
        fp8_ceiling = next((c for dt, c in (ceiling or {}).items() if dt in FP8_DTYPES), None)
        if fp8_ceiling and any(dt in FP8_DTYPES for dt in dtypes):
            ax.axhline((0.65 if causal else 0.75) * fp8_ceiling, color="0.6", linestyle=":", label="FP8 goal")
        for who in ("flashgen", "api", *peers):
            for dt in dtypes:
                if who in peers and dt in FP8_DTYPES:
                    continue
                pts = sorted((r.point.seqlen, r.tflops(who)) for r in rows
                             if (r.point.head_dim, r.point.causal, r.point.dtype) == (d, causal, dt) and r.tflops(who))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colors.get(who), linestyle=styles.get(dt, "-"),
                            label=f"{labels.get(who, 'sdpa-' + who)} {dt}")
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
