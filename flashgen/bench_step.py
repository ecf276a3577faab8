"""A training step of a transformers Llama layer stack (forward + backward) with flashgen's attention against the
same model on PyTorch SDPA's flash and cuDNN backends, in one run, with the same weights and tokens.

The step is what a trainer runs: embeddings, every decoder layer (attention, MLP, norms) and a loss, then the
backward into every parameter. Attention's share of it is what differs between the rows; the rest is the same
cuBLAS work in each, so the step's speedup is smaller than the attention kernels' own."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from .compare import back_to_back_ms

# A Llama-3-8B layer (GQA 32 query / 8 KV heads, head_dim 128, hidden 4096, MLP 14336), fewer layers.
STEP_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 32000}
PEER_BACKENDS = {"sdpa flash": "FLASH_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION"}


def step_rows(layers: int = 4, tokens: int = 4096, batch: int = 1, dtype: str = "bf16", steps: int = 10,
              progress: Callable[[str], None] = print) -> list[dict]:
    """One row per attention implementation: ms per training step (forward + backward, back to back, host
    included), tokens/s, and the speedup of flashgen's step over it; a backend that refuses the shapes gets
    its error instead of a time. The losses of the first step agree to bf16's error (checked here)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    from .integrations import transformers as fg_hf  # noqa: PLC0415  (needs transformers, imported above)

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max(tokens, 8192), **STEP_SHAPE)
    torch.manual_seed(0)
    name = fg_hf.register()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=tdt).cuda().train()
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), device="cuda")

    def step() -> Any:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    runs: dict[str, tuple[str, Any]] = {"flashgen": (name, None)}
    runs |= {peer: ("sdpa", getattr(SDPBackend, backend)) for peer, backend in PEER_BACKENDS.items()}
    rows, losses = [], {}
    for label, (impl, backend) in runs.items():
        model.set_attn_implementation(impl)
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        try:
            with ctx:
                losses[label] = step().item()
                ms = back_to_back_ms(lambda i: step(), calls=steps, loops=3, warmup=2)
        except RuntimeError as e:  # a backend without a kernel for these shapes
            rows.append({"impl": label, "ms": None, "error": str(e).splitlines()[0][:200]})
            progress(f"step, {label}: {rows[-1]['error']}")
            continue
        rows.append({"impl": label, "ms": ms, "tokens_per_s": batch * tokens / (ms * 1e-3)})
        progress(f"step, {label}: {ms:.1f} ms ({rows[-1]['tokens_per_s']:.0f} tokens/s)")
    fg = next(r for r in rows if r["impl"] == "flashgen")
    for r in rows:
        r["flashgen_speedup"] = r["ms"] / fg["ms"] if r.get("ms") and fg.get("ms") else None
        r["loss"] = losses.get(r["impl"])
    ref = losses.get("sdpa flash")
    if ref is not None and "flashgen" in losses and abs(losses["flashgen"] - ref) > 2e-2 * abs(ref):
        raise AssertionError(f"flashgen's step loss {losses['flashgen']:.5f} differs from SDPA flash's {ref:.5f}")
    return rows


def step_table(rows: list[dict]) -> str:
    head = ["attention", "ms / step", "tokens/s", "flashgen speedup", "first loss"]
    out = [head]
    for r in rows:
        if r.get("ms") is None:
            out.append([r["impl"], "-", "-", "-", r.get("error", "")])
            continue
        out.append([r["impl"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['flashgen_speedup']:.3f}x",
                    f"{r['loss']:.4f}"])
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in out)


def plot_step(result: dict, path: Any) -> None:
    """Bars of tokens/s per attention implementation, labelled with flashgen's speedup."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in result["step"] if r.get("ms")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([r["impl"] for r in rows], [r["tokens_per_s"] / 1e3 for r in rows],
                  color=["tab:orange" if r["impl"] == "flashgen" else "tab:gray" for r in rows])
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['ms']:.0f} ms" + ("" if r["impl"] == "flashgen" else f"\nflashgen {r['flashgen_speedup']:.2f}x"),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    s = result["shape"]
    ax.set_ylabel("thousand tokens / s")
    ax.set_title(f"{result['gpu']}, {result['date']}: Llama training step\n{s['layers']} layers, GQA 32/8, d128, "
                 f"{s['tokens']} tokens, {result['dtype']}", fontsize=9)
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["STEP_SHAPE", "plot_step", "step_rows", "step_table"]
