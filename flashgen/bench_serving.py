"""Bench of the serving paths on a GPU (`flashgen bench --kind decode|varlen|window|train`), each point beside
its same-run reference: decode reads K/V against a device-to-device copy of as many bytes and SDPA;
varlen and window count useful FLOPs against flashgen's dense kernels at the same work; train times
the backward of a packed batch and of a window against the dense backward kernels.

Figures per point: `kernel` (CUDA events with L2 flushed and the GPU kept busy ahead of each call: device time),
`b2b` (the public call back to back, host cost included) and, for decode, host microseconds per call.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable

from . import api
from .bench import median_ms, time_cuda
from .compare import back_to_back_ms, host_us_per_call
from .config import default_bwd_config
from .kernels.backward import backward, load_backward
from .resolve import backward_kernel
from .tensors import torch_dtype

DECODE_POINTS = [(1, 1024), (1, 8192), (1, 131072), (8, 32768), (32, 8192), (128, 4096)]  # (batch, cache length)
DECODE_HEADS = (32, 8)
PAGE_SIZES = (0, 16, 128, 256)  # 0: contiguous


def copy_tb_s(nbytes: int) -> float:
    """TB/s of a device-to-device copy of nbytes (bytes read + bytes written over the time)."""
    import torch  # noqa: PLC0415

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(time_cuda(lambda i: dst.copy_(src), warmup=5, reps=30))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def paged(cache: Any, page_size: int) -> tuple[Any, Any]:
    """The same cache as shuffled pages: (pool, block_table)."""
    import torch  # noqa: PLC0415

    b, n, hk, d = cache.shape
    pages = n // page_size
    perm = torch.randperm(b * pages, device=cache.device)
    pool = torch.empty((b * pages, page_size, hk, d), dtype=cache.dtype, device=cache.device)
    pool[perm] = cache.view(b * pages, page_size, hk, d)
    return pool, perm.view(b, pages).to(torch.int32)


def decode_rows(head_dim: int = 128, dtype: str = "bf16", points: list[tuple[int, int]] | None = None,
                splits_sweep: tuple[int, ...] = (1, 4, 16, 64), progress: Callable[[str], None] = print) -> list[dict]:
    """One row per (batch, cache length, page size): flashgen's K/V read rate (device time and back to
    back) against a copy of the same bytes and SDPA on the same (contiguous) cache."""
    import torch  # noqa: PLC0415

    tdt = torch_dtype(dtype)
    h, hk = DECODE_HEADS
    rows = []
    for batch, n in points or DECODE_POINTS:
        kv_bytes = 2 * batch * n * hk * head_dim * 2
        copy = copy_tb_s(kv_bytes)
        q = torch.randn(batch, 1, h, head_dim, device="cuda", dtype=tdt)
        kc = torch.randn(batch, n, hk, head_dim, device="cuda", dtype=tdt)
        vc = torch.randn_like(kc)
        lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        sdpa = torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        sdpa_ms = median_ms(time_cuda(lambda i: sdpa(qt, kt, vt, enable_gqa=True), warmup=3, reps=20))
        for page in PAGE_SIZES:
            if page and n % page:
                continue
            k_arg, v_arg, table = kc, vc, None
            if page:  # the same cache as shuffled pages, one table for K and V
                k_arg, table = paged(kc, page)
                v_arg = torch.empty_like(k_arg)
                v_arg[table.view(-1).long()] = vc.view(-1, page, hk, head_dim)

            def call(splits: int = 0, validate: bool = False) -> Any:
                return api.attention_with_kvcache(q, k_arg, v_arg, cache_seqlens=lens, block_table=table,
                                              num_splits=splits, validate=validate)

            kern_ms = median_ms(time_cuda(lambda i: call(), warmup=5, reps=30))
            b2b = back_to_back_ms(lambda i: call(), calls=50)
            b2b_checked = back_to_back_ms(lambda i: call(validate=True), calls=20)
            sweep = {s: median_ms(time_cuda(lambda i, s=s: call(s), warmup=3, reps=15)) for s in splits_sweep}
            host = host_us_per_call({"call": lambda: call()}, calls=50, loops=3)["call"] if batch * n <= 8192 else None
            # the plain call on the same contiguous cache: flashgen.attention takes the decode kernels too
            attn = None if page else back_to_back_ms(lambda i: api.attention(q, kc, vc), calls=50)
            row = {"batch": batch, "cache": n, "page": page, "kv_bytes": kv_bytes, "copy_tb_s": copy,
                   "kernel_us": kern_ms * 1e3, "b2b_us": b2b * 1e3, "b2b_validated_us": b2b_checked * 1e3,
                   "tb_s": kv_bytes / (kern_ms * 1e-3) / 1e12, "b2b_tb_s": kv_bytes / (b2b * 1e-3) / 1e12,
                   "sdpa_us": sdpa_ms * 1e3, "sdpa_tb_s": kv_bytes / (sdpa_ms * 1e-3) / 1e12,
                   "splits_us": {s: t * 1e3 for s, t in sweep.items()}, "host_us": host,
                   "attention_b2b_us": None if attn is None else attn * 1e3}
            row["of_copy"] = row["tb_s"] / copy
            rows.append(row)
            progress(f"decode b{batch} n{n} page{page}: {row['tb_s']:.2f} TB/s ({row['of_copy']:.0%} of copy "
                     f"{copy:.2f}), b2b {row['b2b_tb_s']:.2f}, SDPA {row['sdpa_tb_s']:.2f}")
    return rows


def seen_pairs(lq: int, lk: int, left: int, right: int) -> int:
    """(query, key) pairs seen when row i sees keys i + shift - left .. i + shift + right (shift = lk - lq,
    bottom-right aligned; -1: unbounded): causal is right = 0."""
    shift, total = lk - lq, 0
    for i in range(lq):
        hi = min(lk, i + shift + right + 1) if right >= 0 else lk
        lo = max(0, i + shift - left) if left >= 0 else 0
        total += max(0, hi - lo)
    return total


def _causal_flops(lq: int, lk: int, d: int, h: int, window: int = -1) -> float:
    """4 * d * h * (query, key) pairs seen under a bottom-right causal mask (and a left window)."""
    return 4.0 * d * h * seen_pairs(lq, lk, window, 0)


def varlen_rows(head_dim: int = 128, dtype: str = "bf16", n_seqs: int = 64, lo: int = 64, hi: int = 8192,
                seed: int = 0, progress: Callable[[str], None] = print) -> list[dict]:
    """A packed causal batch of n_seqs lengths drawn log-uniformly from [lo, hi], against flashgen's dense
    causal kernels (each family) at the mean length with the same token count."""
    import torch  # noqa: PLC0415

    tdt = torch_dtype(dtype)
    h = 2048 // head_dim
    lens = lengths(n_seqs, lo, hi, seed)
    total = sum(lens)
    cu = torch.tensor([0, *__import__("itertools").accumulate(lens)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, head_dim, device="cuda", dtype=tdt) for _ in range(3))
    flops = sum(_causal_flops(n, n, head_dim, h) for n in lens)
    ms = median_ms(time_cuda(lambda i: api.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                                 validate=False), warmup=3, reps=20))
    b2b = back_to_back_ms(lambda i: api.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True),
                          calls=10)
    mean = total // n_seqs
    batch = max(1, total // mean)
    qd, kd, vd = (torch.randn(batch, mean, h, head_dim, device="cuda", dtype=tdt) for _ in range(3))
    dense = {}
    for fam in ("sm80", "sm90"):
        if fam == "sm90" and torch.cuda.get_device_capability() != (9, 0):
            continue
        d_ms = median_ms(time_cuda(lambda i: api.attention(qd, kd, vd, causal=True, arch=fam), warmup=3, reps=20))
        dense[fam] = batch * _causal_flops(mean, mean, head_dim, h) / (d_ms * 1e-3) / 1e12
    row = {"n_seqs": n_seqs, "lens": lens, "total": total, "mean": mean, "tflops": flops / (ms * 1e-3) / 1e12,
           "b2b_tflops": flops / (b2b * 1e-3) / 1e12, "dense_tflops": dense}
    progress(f"varlen {n_seqs} seqs ({lo}-{hi}, mean {mean}): {row['tflops']:.0f} TFLOP/s useful; dense at the mean: "
             + ", ".join(f"{f} {t:.0f}" for f, t in dense.items()))
    return [row]


def window_rows(head_dim: int = 128, dtype: str = "bf16", n: int = 16384, window: int = 1024,
                progress: Callable[[str], None] = print) -> list[dict]:
    """Causal sliding window at one long sequence: useful TFLOP/s through attention_varlen and through the dense
    call (attention(window_size=...)), against the same serving kernel without the window and flashgen's dense
    causal kernels, all at N."""
    import torch  # noqa: PLC0415

    tdt = torch_dtype(dtype)
    h = 2048 // head_dim
    q, k, v = (torch.randn(n, h, head_dim, device="cuda", dtype=tdt) for _ in range(3))
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = {}
    for name, win in (("window", (window, -1)), ("causal_varlen", (-1, -1))):
        ms = median_ms(time_cuda(lambda i, w=win: api.attention_varlen(q, k, v, cu, cu, n, n, causal=True,
                                                                           window_size=w, validate=False),
                                 warmup=3, reps=20))
        out[name] = _causal_flops(n, n, head_dim, h, window if name == "window" else -1) / (ms * 1e-3) / 1e12
    qd, kd, vd = (t.unsqueeze(0) for t in (q, k, v))
    # The same window through the dense call (attention(window_size=...)): no varlen, so on Hopper the
    # persistent schedule and what `tune --kind varlen` stored for window problems.
    ms = median_ms(time_cuda(lambda i: api.attention(qd, kd, vd, causal=True, window_size=(window, 0)), warmup=3,
                             reps=20))
    out["window_dense"] = _causal_flops(n, n, head_dim, h, window) / (ms * 1e-3) / 1e12
    for fam in ("sm80", "sm90"):
        if fam == "sm90" and torch.cuda.get_device_capability() != (9, 0):
            continue
        ms = median_ms(time_cuda(lambda i: api.attention(qd, kd, vd, causal=True, arch=fam), warmup=3, reps=20))
        out[f"dense_{fam}"] = _causal_flops(n, n, head_dim, h) / (ms * 1e-3) / 1e12
    row = {"n": n, "window": window, "tflops": out}
    progress(f"window {window} at N={n}: " + ", ".join(f"{k} {t:.0f}" for k, t in out.items()) + " TFLOP/s (useful)")
    return [row]


def lengths(n_seqs: int, lo: int, hi: int, seed: int) -> list[int]:
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n_seqs)]


def train_rows(head_dim: int = 128, dtype: str = "bf16", n_seqs: int = 64, lo: int = 64, hi: int = 8192,
               n: int = 16384, window: int = 1024, seed: int = 0,
               progress: Callable[[str], None] = print) -> list[dict]:
    """Backward kernels (device time; FLOPs 2.5x the forward's useful ones) of the varlen batch of varlen_rows
    against the dense backward at its mean length (the sm80 family's, the same template, and the default
    of this GPU), and of a causal window at N against the same kernel without the window; plus autograd
    (forward + backward through the public call, back to back) for the varlen batch."""
    import itertools  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from . import ops  # noqa: PLC0415  (the backward operator: needs torch, imported above)

    tdt = torch_dtype(dtype)
    h = 2048 // head_dim
    rows = []

    def serve_bwd_ms(q, k, v, cu, mx, win):
        out, lse = api.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True, window_size=win, return_lse=True)
        dout = torch.randn_like(q)
        return median_ms(time_cuda(lambda i: ops.attention_serve_backward_op(
            dout, q, k, v, out, lse, None, cu, cu, mx, mx, True, None, win[0], win[1], 0.0, None, False),
            warmup=3, reps=20))

    def dense_bwd_ms(batch, length):
        q, k, v = (torch.randn(batch, length, h, head_dim, device="cuda", dtype=tdt) for _ in range(3))
        out, lse = api.attention(q, k, v, causal=True, return_lse=True)
        dout = torch.randn_like(q)
        fams = {"sm80": load_backward(head_dim, dtype, True, default_bwd_config(head_dim, dtype, True, "sm80"))}
        fams["default"] = backward_kernel(q.get_device(), head_dim, dtype, True, length)
        return {f"dense_{name}" if name == "sm80" else f"dense_{kern.config.family}": median_ms(time_cuda(
            lambda i, kern=kern: backward(kern, q, k, v, out, dout, lse), warmup=3, reps=20)) for name, kern in fams.items()}

    lens = lengths(n_seqs, lo, hi, seed)
    total, mean = sum(lens), sum(lens) // n_seqs
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, head_dim, device="cuda", dtype=tdt) for _ in range(3))
    flops = 2.5 * sum(_causal_flops(x, x, head_dim, h) for x in lens)
    ms = {"varlen": serve_bwd_ms(q, k, v, cu, max(lens), (-1, -1))}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def step() -> None:
        out = api.attention_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True, validate=False)
        out.backward(dout)

    ms["autograd_b2b"] = back_to_back_ms(lambda i: step(), calls=10)
    batch = max(1, total // mean)
    dense_flops = 2.5 * batch * _causal_flops(mean, mean, head_dim, h)
    tf = {"varlen": flops / (ms["varlen"] * 1e-3) / 1e12,
          "autograd_b2b (fwd+bwd)": 3.5 / 2.5 * flops / (ms["autograd_b2b"] * 1e-3) / 1e12}
    tf |= {name: dense_flops / (t * 1e-3) / 1e12 for name, t in dense_bwd_ms(batch, mean).items()}
    rows.append({"case": f"varlen {n_seqs} seqs {lo}-{hi} (mean {mean}) causal", "tflops": tf})
    progress(f"backward, varlen {n_seqs} seqs ({lo}-{hi}, mean {mean}): " + ", ".join(f"{a} {b:.0f}" for a, b in tf.items()))

    q, k, v = (torch.randn(n, h, head_dim, device="cuda", dtype=tdt) for _ in range(3))
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    tf = {}
    for name, win in (("window", (window, -1)), ("causal_varlen", (-1, -1))):
        t = serve_bwd_ms(q, k, v, cu, n, win)
        tf[name] = 2.5 * _causal_flops(n, n, head_dim, h, window if name == "window" else -1) / (t * 1e-3) / 1e12
    tf |= {name: 2.5 * _causal_flops(n, n, head_dim, h) / (t * 1e-3) / 1e12 for name, t in dense_bwd_ms(1, n).items()}
    rows.append({"case": f"window {window} causal at N={n}", "tflops": tf})
    progress(f"backward, window {window} at N={n}: " + ", ".join(f"{a} {b:.0f}" for a, b in tf.items()))
    return rows


def decode_table(rows: list[dict]) -> str:
    head = ["batch", "cache", "page", "kernel us", "TB/s", "% copy", "b2b us", "b2b TB/s", "validated b2b us",
            "attention() b2b us", "SDPA TB/s", "host us", "splits sweep us"]
    lines = [head]
    for r in rows:
        lines.append([r["batch"], r["cache"], r["page"] or "-", f"{r['kernel_us']:.1f}", f"{r['tb_s']:.2f}",
                      f"{r['of_copy']:.0%}", f"{r['b2b_us']:.1f}", f"{r['b2b_tb_s']:.2f}", f"{r['b2b_validated_us']:.1f}",
                      "-" if r.get("attention_b2b_us") is None else f"{r['attention_b2b_us']:.1f}", f"{r['sdpa_tb_s']:.2f}", "-" if r["host_us"] is None else f"{r['host_us']:.1f}",
                      " ".join(f"{s}:{t:.0f}" for s, t in r["splits_us"].items())])
    w = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w[i]) for i, c in enumerate(x)).rstrip() for x in lines)


def plot_serving(result: dict, path: Any) -> None:
    """One figure of what `bench --kind ...` measured: decode read rates (beside SDPA and the copy rate) and the
    varlen / window TFLOP/s (beside the dense kernels they are judged against, with the 90% goal)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = [k for k in ("decode", "prefill") if k in result or (k == "prefill" and ("varlen" in result
                                                                                      or "window" in result))]
    fig, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "decode":
            _decode_panel(ax, result["decode"])
        else:
            _prefill_panel(ax, result.get("varlen", []), result.get("window", []))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _decode_panel(ax: Any, rows: list[dict]) -> None:
    labels = sorted({(r["batch"], r["cache"]) for r in rows})
    x = range(len(labels))
    width = 0.8 / (len(PAGE_SIZES) + 1)  # a bar per page size, then SDPA's
    for i, page in enumerate(PAGE_SIZES):
        vals = [next((r["tb_s"] for r in rows if (r["batch"], r["cache"]) == lab and r["page"] == page), 0) for lab in labels]
        ax.bar([j + width * i for j in x], vals, width, label=f"flashgen {'contiguous' if not page else f'page {page}'}")
    sd = [next(r["sdpa_tb_s"] for r in rows if (r["batch"], r["cache"]) == lab) for lab in labels]
    ax.bar([j + width * len(PAGE_SIZES) for j in x], sd, width, label="SDPA (contiguous)")
    cp = statistics.median(r["copy_tb_s"] for r in rows)
    ax.axhline(cp, color="k", ls="--", lw=1, label=f"copy {cp:.2f} TB/s")
    ax.set_xticks([j + width * len(PAGE_SIZES) / 2 for j in x], [f"b{b} x {n // 1024}k" for b, n in labels])
    ax.set_ylabel("K/V read, TB/s (device time)")
    ax.set_title("decode, 32/8 heads, d128, seqlen_q 1")
    ax.legend(fontsize=8)


def _prefill_panel(ax: Any, varlen: list[dict], window: list[dict]) -> None:
    bars: list[tuple[str, float, str]] = []  # (label, TFLOP/s, colour)
    for r in varlen:
        bars += [(f"varlen {r['n_seqs']} seqs", r["tflops"], "C0"), ("varlen b2b", r["b2b_tflops"], "C0")]
        bars += [(f"dense {f} @ mean {r['mean']}", t, "C7") for f, t in r["dense_tflops"].items()]
    for r in window:
        t = r["tflops"]
        bars += [(f"window {r['window']} (dense call)", t.get("window_dense", 0), "C1"),
                 (f"window {r['window']} (varlen call)", t["window"], "C1")]
        bars += [(f"{k.replace('_', ' ')} N={r['n']}", v, "C7") for k, v in t.items() if k.startswith("dense")]
    ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    for r in window:
        if "dense_sm90" in r["tflops"]:
            ax.axhline(0.9 * r["tflops"]["dense_sm90"], color="C1", ls="--", lw=1, label="goal: 90% of dense causal")
    for r in varlen:
        if "sm90" in r["dense_tflops"]:
            ax.axhline(0.9 * r["dense_tflops"]["sm90"], color="C0", ls=":", lw=1, label="goal: 90% of dense at the mean")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s, useful FLOPs")
    ax.set_title("packed batch and sliding window, causal, d128 (kernel device time; b2b: public call)")
    ax.legend(fontsize=8)


__all__ = ["decode_rows", "varlen_rows", "window_rows", "train_rows", "decode_table", "plot_serving", "copy_tb_s"]
