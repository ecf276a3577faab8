"""FlexAttention's example modifiers, built over tables on a given device: shared by the CPU kernel tests (render,
compile) and the GPU tests (against a float64 reference and torch's flex_attention)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from flashgen.modifiers import Modifier, trace_mask_mod, trace_score_mod

WINDOW = 37          # sliding window: a key at most this far behind the row
SOFTCAP = 20.0
MAX_LEN = 2048       # longest sequence the tables cover (positions index them)


class Example(NamedTuple):
    name: str
    score_mod: Callable | None
    mask_mod: Callable | None


def examples(device: str | torch.device = "cpu", batch: int = 2, heads: int = 4, seed: int = 0) -> dict[str, Example]:
    """name -> Example; the tables are fixed by `seed` and cover `batch` sequences of up to MAX_LEN positions."""
    g = torch.Generator().manual_seed(seed)
    slopes = (2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)).to(device)  # ALiBi's per-head slopes
    doc = (torch.rand(batch, MAX_LEN, generator=g) < 0.02).cumsum(1).to(torch.int32).to(device)  # document ids
    prefix = torch.randint(0, 64, (batch,), generator=g).to(device)  # prefix-LM: keys < prefix[b] seen by all
    rel = (0.3 * torch.randn(2 * MAX_LEN - 1, generator=g)).to(device)  # a bias per distance kv_idx - q_idx

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + rel[kv_idx - q_idx + MAX_LEN - 1]

    out = [Example("causal", None, causal), Example("sliding_window", None, sliding_window),
           Example("prefix_lm", None, prefix_lm), Example("document", None, document),
           Example("alibi", alibi, None), Example("softcap", softcap, None),
           Example("relative_bias", relative_bias, None),
           Example("alibi_causal", alibi, causal), Example("softcap_document", softcap, document),
           Example("relative_prefix_lm", relative_bias, prefix_lm)]
    return {e.name: e for e in out}


class FakeCuda:
    """Stands for a CUDA tensor a modifier captures, where only its address and layout are read (a kernel's
    parameter packing, without a GPU)."""

    def __init__(self, ptr: int, strides: tuple[int, ...], shape: tuple[int, ...] | None = None):
        self.ptr, self.strides = ptr, strides
        self.shape = shape if shape is not None else (2,) * len(strides)
        self.device = type("Device", (), {"type": "cuda"})()

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def dim(self) -> int:
        return len(self.strides)

    def get_device(self) -> int:
        return 0


def trace(example: Example) -> tuple[Modifier | None, Modifier | None]:
    """The example's score_mod and mask_mod traced into flashgen Modifiers (None where it has none)."""
    return (trace_score_mod(example.score_mod) if example.score_mod else None,
            trace_mask_mod(example.mask_mod) if example.mask_mod else None)


def plans_without_launch(monkeypatch: Any) -> None:
    """Dense modifier calls' plans (flashgen.kernels.modified) made without a launch, and no call running by one:
    each call launches through ops.launch_prefill, which a test emulating the kernel replaces; the plans' routes,
    checks and choices run as on a GPU."""
    from flashgen import api, ops
    from flashgen.kernels.modified import ModPlan

    monkeypatch.setattr(ops, "make_mod_plan", lambda cfg, q, k, v, mods, *a: ModPlan(cfg, mods, -1, (), (), None))
    monkeypatch.setattr(ops, "run_mod_plan", lambda plan, q, k, v, want_lse=True: None)
    monkeypatch.setattr(api, "run_mod_plan", lambda plan, q, k, v, want_lse=True: None)
    monkeypatch.setattr(ops, "gpu_stamp", lambda device: (("NVIDIA H200", "sm90"), None))
