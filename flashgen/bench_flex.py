"""FlexAttention's examples on flashgen against torch's compiled flex_attention, in one run, with the same inputs.

Each case is a score_mod and/or mask_mod written as FlexAttention takes them. flex_attention runs compiled, with a
block mask from `create_block_mask` wherever there is a mask; flashgen.attention takes the same functions (its own
block map from the mask_mod). Where flashgen has a built-in kernel for the same attention (causal, a sliding window,
ALiBi, softcap) that runs too, and "identity" (a score_mod that changes nothing) stands beside the plain kernel.

Times are per call back to back (host included, what a user's loop gets), forward and backward
(torch.autograd.grad of the output); TFLOP/s count only the (query, key) pairs the mask keeps, the backward as 2.5x
the forward's FLOPs. Each case's output is compared with flex_attention's first (max |difference|)."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .checks import Mods
from .compare import back_to_back_ms
from .modifiers import trace_cached

CASES = ("full", "identity", "causal", "window", "prefix_lm", "document", "alibi", "softcap", "relative_bias",
         "block_sparse")
DOCUMENTS = 8  # the document mask's documents per sequence
SPARSE_BLOCK = 128  # the random block-sparse mask's tile


@dataclasses.dataclass(frozen=True)
class FlexCase:
    """One attention variant: FlexAttention's functions and, where flashgen has it built in, the same attention as
    flashgen.attention's keyword arguments."""

    name: str
    score_mod: Callable | None
    mask_mod: Callable | None
    builtin: dict | None = None


def cases(n: int, batch: int, heads: int, device: Any, seed: int = 0, names: tuple[str, ...] = CASES) -> list[FlexCase]:
    """The cases for `batch` sequences of `n` tokens and `heads` heads; tables made on `device` from `seed`."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    window = n // 4
    slopes = (2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)).to(device)
    prefix = torch.randint(n // 8, n // 4, (batch,), generator=g).to(device)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:DOCUMENTS - 1] + 1).values
    doc = torch.zeros(n, dtype=torch.int32)
    doc[cuts] = 1
    doc = doc.cumsum(0).to(torch.int32).expand(batch, n).contiguous().to(device)
    rel = (0.3 * torch.randn(2 * n - 1, generator=g)).to(device)
    tiles = -(-n // SPARSE_BLOCK)
    sparse = (torch.rand(tiles, tiles, generator=g) < 0.3) | torch.eye(tiles, dtype=torch.bool)
    sparse = sparse.to(device)
    cap = 20.0

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def block_sparse(b, h, q_idx, kv_idx):
        return sparse[q_idx // SPARSE_BLOCK, kv_idx // SPARSE_BLOCK]

    def identity(score, b, h, q_idx, kv_idx):
        return score

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + rel[kv_idx - q_idx + n - 1]

    table = {
        "full": FlexCase("full", None, None, {}),
        "identity": FlexCase("identity", identity, None, {}),
        "causal": FlexCase("causal", None, causal, {"causal": True}),
        "window": FlexCase("window", None, sliding, {"causal": True, "window_size": (window - 1, 0)}),
        "prefix_lm": FlexCase("prefix_lm", None, prefix_lm),
        "document": FlexCase("document", None, document),
        "alibi": FlexCase("alibi", alibi, causal, {"causal": True, "alibi_slopes": slopes.float()}),
        "softcap": FlexCase("softcap", softcap, None, {"softcap": cap}),
        "relative_bias": FlexCase("relative_bias", relative_bias, None),
        "block_sparse": FlexCase("block_sparse", None, block_sparse),
    }
    return [table[c] for c in names]


def case_mods(case: FlexCase) -> Mods | None:
    """The case's traced modifiers as flashgen compiles them (checks.Mods), or None where the plain kernel runs (no
    modifier, or a score_mod that changes nothing alone)."""
    score = trace_cached(case.score_mod, "score") if case.score_mod is not None else None
    mask = trace_cached(case.mask_mod, "mask") if case.mask_mod is not None else None
    score = None if score is not None and score.is_identity else score
    return None if score is None and mask is None else Mods(score_mod=score, mask_mod=mask)


def kept_pairs(case: FlexCase, batch: int, n: int, device: Any, rows: int = 1024) -> int:
    """(query, key) pairs the case's mask keeps, over the batch, for one head (the cases' masks are the same for
    every head)."""
    import torch  # noqa: PLC0415

    if case.mask_mod is None:
        return batch * n * n
    kv = torch.arange(n, device=device)[None, :]
    total = 0
    for b in range(batch):
        bt = torch.tensor(b, device=device)
        for r0 in range(0, n, rows):
            q = torch.arange(r0, min(r0 + rows, n), device=device)[:, None]
            total += int(case.mask_mod(bt, torch.tensor(0, device=device), q, kv).expand(q.shape[0], n).sum())
    return total


def kept_tiles(case: FlexCase, batch: int, n: int, device: Any, tile: int = SPARSE_BLOCK) -> float:
    """The share of (tile x tile) blocks of the score matrix, over the batch, where the case's mask keeps any pair:
    the blocks a block-sparse kernel computes (at that tile size)."""
    import torch  # noqa: PLC0415

    if case.mask_mod is None:
        return 1.0
    tiles = -(-n // tile)
    kv = torch.arange(n, device=device)[None, :]
    pad = tiles * tile - n
    kept = 0
    for b in range(batch):
        bt = torch.tensor(b, device=device)
        for r0 in range(0, n, tile):
            q = torch.arange(r0, min(r0 + tile, n), device=device)[:, None]
            rows = case.mask_mod(bt, torch.tensor(0, device=device), q, kv).expand(q.shape[0], n).any(0)
            kept += int(torch.nn.functional.pad(rows, (0, pad)).view(tiles, tile).any(1).sum())
    return kept / (batch * tiles * tiles)


def flex_rows(n: int, head_dim: int = 128, heads: int = 16, batch_tokens: int = 16384, dtype: str = "bf16",
              names: tuple[str, ...] = CASES, calls: int = 10, sm80: bool = True,
              progress: Callable[[str], None] = print) -> list[dict]:
    """One row per (case, implementation): forward and backward ms per call back to back, their TFLOP/s over the
    kept pairs, and the output's max |difference| from flex_attention's. `sm80`: the modifier cases also with
    arch="sm80" (the sm80 family's forward and backward, the default off Hopper)."""
    import torch  # noqa: PLC0415
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415

    from .api import attention  # noqa: PLC0415  (the public call: what a user runs)

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    batch = max(1, batch_tokens // n)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, n, heads, head_dim, device="cuda", dtype=tdt, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    # Each case's functions are a recompile of flex_attention: above dynamo's default limit (8) it would fall back
    # to the unfused eager implementation, and the table would time that instead of the compiled kernel.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(names) + 8)
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))  # (b, h, n, d)
    doutt = dout.transpose(1, 2).contiguous()
    all_cases = cases(n, batch, heads, q.device, names=names)

    def impls(case: FlexCase) -> dict[str, Callable[[], Any]]:
        mask = (create_block_mask(case.mask_mod, batch, None, n, n, device=q.device)
                if case.mask_mod is not None else None)
        out = {"flex_attention": lambda: flex(qt, kt, vt, score_mod=case.score_mod, block_mask=mask).transpose(1, 2),
               "flashgen": lambda: attention(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod)}
        if sm80 and (case.score_mod is not None or case.mask_mod is not None):
            out["flashgen sm80"] = lambda: attention(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod,
                                                     arch="sm80")
        if case.builtin is not None:
            out["flashgen built-in"] = lambda: attention(q, k, v, **case.builtin)
        return out

    def warm(case: FlexCase) -> None:  # flashgen's kernels compile here, the cases side by side (nvcc in subprocesses)
        fns = impls(case)
        for name in ("flashgen", "flashgen sm80", "flashgen built-in"):
            try:
                if name in fns:
                    torch.autograd.grad(fns[name](), (q, k, v), dout)
            except (RuntimeError, ValueError, NotImplementedError):
                pass  # reported where the case is timed

    with ThreadPoolExecutor(len(all_cases)) as pool:
        list(pool.map(warm, [c for c in all_cases if c.name != "full"]))
    torch.cuda.synchronize()
    rows = []
    for case in all_cases:
        pairs = kept_pairs(case, batch, n, q.device) * heads
        tiles = kept_tiles(case, batch, n, q.device)
        fwd_flops = 4 * head_dim * pairs
        ref = None
        for impl, fn in impls(case).items():
            inputs = (qt, kt, vt) if impl == "flex_attention" else (q, k, v)
            grad_out = doutt.transpose(1, 2) if impl == "flex_attention" else dout
            try:
                out = fn()
                ref = out.detach().float() if impl == "flex_attention" else ref
                diff = None if ref is None else float((out.detach().float() - ref).abs().max())
                fwd = back_to_back_ms(lambda i: fn(), calls=calls, loops=3, warmup=2)
                held = fn()
                bwd = back_to_back_ms(lambda i: torch.autograd.grad(held, inputs, grad_out, retain_graph=True),
                                      calls=calls, loops=3, warmup=2)
            except (RuntimeError, ValueError, NotImplementedError) as e:  # a case one implementation cannot run
                rows.append({"case": case.name, "impl": impl, "error": str(e).splitlines()[0][:200]})
                progress(f"flex {case.name}, {impl}: {rows[-1]['error']}")
                continue
            rows.append({"case": case.name, "impl": impl, "n": n, "batch": batch, "heads": heads, "head_dim": head_dim,
                         "kept": pairs / (batch * heads * n * n), "tiles": tiles, "fwd_ms": fwd, "bwd_ms": bwd,
                         "fwd_tflops": fwd_flops / (fwd * 1e-3) / 1e12, "bwd_tflops": 2.5 * fwd_flops / (bwd * 1e-3) / 1e12,
                         "max_diff": diff})
            progress(f"flex {case.name} N={n}, {impl}: {rows[-1]['fwd_tflops']:.0f} / {rows[-1]['bwd_tflops']:.0f} TFLOP/s")
    return rows


def flex_table(rows: list[dict]) -> str:
    """Per case and N: forward / backward TFLOP/s of each implementation, flashgen's ratio to flex_attention and to
    its built-in kernel, and the largest difference from flex_attention's output."""
    head = ["case", "N", "kept", "flex fwd/bwd", "flashgen fwd/bwd", "x flex", "sm80 fwd/bwd", "x flex",
            "built-in fwd/bwd", "x built-in", "max diff"]
    out = [head]
    by = {(r["case"], r.get("n"), r["impl"]): r for r in rows if "error" not in r}
    keys = list(dict.fromkeys((r["case"], r.get("n")) for r in rows if "error" not in r))
    for case, n in keys:
        fl, fg, f8, bi = (by.get((case, n, i)) for i in ("flex_attention", "flashgen", "flashgen sm80",
                                                          "flashgen built-in"))
        pair = lambda r: f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}" if r else "-"  # noqa: E731
        ratio = lambda a, b: (f"{a['fwd_tflops'] / b['fwd_tflops']:.2f} / {a['bwd_tflops'] / b['bwd_tflops']:.2f}"  # noqa: E731
                              if a and b else "-")
        kept = next(r for r in (fg, fl, f8, bi) if r)["kept"]
        out.append([case, str(n), f"{kept:.2f}", pair(fl), pair(fg), ratio(fg, fl), pair(f8), ratio(f8, fl), pair(bi),
                    ratio(fg, bi),
                    f"{fg['max_diff']:.2e}" if fg and fg.get("max_diff") is not None else "-"])
    for n in dict.fromkeys(n for _, n in keys):  # block sparsity: TFLOP/s over the computed 128-key tiles
        doc, causal = by.get(("document", n, "flashgen")), by.get(("causal", n, "flashgen built-in"))
        if doc and causal and doc.get("tiles") and causal.get("tiles"):
            per_tile = lambda r: r["fwd_tflops"] * r["kept"] / r["tiles"]  # noqa: E731
            out.append(["document/causal over tiles", str(n), f"{doc['tiles']:.2f}", "-",
                        f"{per_tile(doc):.0f}", "-", "-", "-", f"{per_tile(causal):.0f}",
                        f"{per_tile(doc) / per_tile(causal):.2f}", "-"])
    for r in rows:
        if "error" in r:
            out.append([r["case"], "-", "-", "-", "-", "-", "-", "-", "-", "-", f"{r['impl']}: {r['error'][:60]}"])
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in out)


def plot_flex(result: dict, path: Any) -> None:
    """Forward and backward TFLOP/s per case, one bar per implementation, a panel per direction and N."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in result["flex"] if "error" not in r]
    ns = sorted({r["n"] for r in rows})
    impls = ["flex_attention", "flashgen", "flashgen sm80", "flashgen built-in"]
    colors = {"flex_attention": "tab:gray", "flashgen": "tab:orange", "flashgen sm80": "tab:olive",
              "flashgen built-in": "tab:blue"}
    fig, axes = plt.subplots(2 * len(ns), 1, figsize=(9, 3.2 * 2 * len(ns)), squeeze=False)
    for j, n in enumerate(ns):
        names = list(dict.fromkeys(r["case"] for r in rows if r["n"] == n))
        for d, key in enumerate(("fwd_tflops", "bwd_tflops")):
            ax = axes[2 * j + d][0]
            for i, impl in enumerate(impls):
                xs = [c + (i - 1.5) * 0.2 for c in range(len(names))]
                ys = [next((r[key] for r in rows if r["n"] == n and r["case"] == c and r["impl"] == impl), 0)
                      for c in names]
                ax.bar(xs, ys, width=0.2, label=impl, color=colors[impl])
            ax.set_xticks(range(len(names)), names, fontsize=8)
            ax.set_ylabel("TFLOP/s (kept pairs)")
            ax.set_title(f"{result['gpu']}, {result['date']}: {'forward' if d == 0 else 'backward'}, N={n}, "
                         f"d{result['head_dim']}, {result['dtype']}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["CASES", "FlexCase", "case_mods", "cases", "flex_rows", "flex_table", "kept_pairs", "kept_tiles", "plot_flex"]
