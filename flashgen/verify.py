"""Step 5: is a kernel exactly right? Compare with a float64 reference on fresh random data.

The bar is flash_attn's: the kernel's max error against the float64 reference must be at
most twice the error of the same attention computed by PyTorch in the input dtype, plus
1e-5; no NaN; every output element written (outputs are poisoned with NaN first); LSE
within 1e-3 of the reference. FP8's reference is computed from the dequantized inputs and
its bar is plain FP8 attention emulated in PyTorch (flashgen.fp8.emulate): max error at most
twice its, RMS error no worse (within 3 standard errors of an RMS over the output). Needs torch and a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .compile import CompiledKernel
from .fp8 import DESCALE_NAMES, dequantize, emulate_dequantized, quantize
from .kernels.backward import backward
from .kernels.dense import run
from .tensors import torch_dtype

LSE_TOL = 1e-3
# Hopper's FP8 tensor cores add a k-step's products with fewer bits than fp32 (DeepSeek-V3's report,
# section 3.3.2, measures about 14 bits), so FP8 scores, and the LSE, carry an error that an fp32
# emulation does not, proportional to the size of the products summed: at most |scale| |q_i| |k_j|
# times this, sum_c |scale q_ic k_jc| being the size of the products (measured: up to 1.9e-3 of it,
# with outlier channels, H200).
FP8_SCORE_REL_TOL = 2**-7
REF_BUFFERS = 4  # score-sized float64 buffers per row chunk: scores, logsumexp's temporary, softmax, a margin
REF_CPU_BYTES = 2 * 2**30  # the reference's budget on the CPU
REF_FREE_FRACTION = 0.5  # of the GPU memory free (torch's cached blocks included) when the reference starts


def ref_budget_bytes(device: Any) -> int:
    """Bytes the reference's row chunks may use on `device`: a share of what is free on a GPU."""
    import torch  # noqa: PLC0415

    device = torch.device(device)
    if device.type != "cuda":
        return REF_CPU_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free + cached) * REF_FREE_FRACTION)


def ref_chunk_rows(batch: int, heads: int, seqlen_q: int, seqlen_k: int, budget_bytes: int) -> int:
    """Query rows per chunk so that the chunk's score buffers fit in `budget_bytes` (at least one row)."""
    per_row = batch * heads * max(seqlen_k, 1) * 8 * REF_BUFFERS
    return max(1, min(seqlen_q, budget_bytes // per_row))


def _ref_rows(q: Any, k: Any, v: Any, causal: bool, first_row: int, seqlen_q: int, upcast: bool) -> tuple[Any, Any]:
    """(out, lse) of query rows first_row.. (q: (b, rows, heads_k, group, d), already scaled)."""
    import torch  # noqa: PLC0415

    sk = k.shape[1]
    s = torch.einsum("bqkgd,bnkd->bkgqn", q, k)  # S = Q K^T, (b, heads_k, group, rows, seqlen_k)
    if causal:
        row = torch.arange(first_row, first_row + q.shape[1], device=q.device)[:, None]
        col = torch.arange(sk, device=q.device)[None, :]
        s.masked_fill_(col > row + (sk - seqlen_q), float("-inf"))
    lse = torch.logsumexp(s if upcast else s.float(), dim=-1)
    p = torch.softmax(s, dim=-1)
    del s
    p.nan_to_num_(0.0)  # a fully masked row is NaN in softmax: it sees nothing
    return torch.einsum("bkgqn,bnkd->bqkgd", p, v), lse  # O = P V


def attention_ref(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None = None,
                  upcast: bool = True, budget_bytes: int | None = None) -> tuple[Any, Any]:
    """(out, lse) by explicit masks: in float64 with upcast, else in the inputs' dtype (PyTorch's error).

    Computed over chunks of query rows whose scores fit `budget_bytes` (default: ref_budget_bytes),
    so a long sequence needs no full score matrix. Rows that see no key give out = 0 and lse = +inf
    (flash_attn's convention)."""
    import torch  # noqa: PLC0415

    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    hk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q = (q * scale).reshape(b, sq, hk, h // hk, d)  # GQA: query heads grouped by their k/v head
    out = torch.empty(b, sq, hk, h // hk, v.shape[-1], dtype=q.dtype, device=q.device)  # v's width may differ
    lse = torch.empty(b, hk, h // hk, sq, dtype=torch.float64 if upcast else torch.float32, device=q.device)
    rows = ref_chunk_rows(b, h, sq, k.shape[1], ref_budget_bytes(q.device) if budget_bytes is None else budget_bytes)
    for r in range(0, sq, rows):
        out[:, r:r + rows], lse[..., r:r + rows] = _ref_rows(q[:, r:r + rows], k, v, causal, r, sq, upcast)
    out, lse = out.view(b, sq, h, v.shape[-1]), lse.view(b, h, sq)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return (out if upcast else out.to(dtype)), lse.float()


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    max_err: float  # kernel vs float64 reference
    bound: float  # 2 * PyTorch-in-dtype error + 1e-5
    lse_err: float
    reason: str = ""
    rms_err: float = math.nan  # FP8: the kernel's RMS error (its bar: Reference.rms_bound)


def random_qkv(batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int, head_dim: int, dtype: str,
               seed: int | None = None, device: str = "cuda", head_dim_v: int | None = None) -> tuple[Any, Any, Any]:
    """Fresh standard-normal q, k, v in flash_attn's layout (never zeros); v of width head_dim_v where given."""
    import torch  # noqa: PLC0415

    tdt = torch_dtype(dtype)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed() % 2**62)

    def rnd(s: int, hh: int, d: int = head_dim) -> Any:
        return torch.randn(batch, s, hh, d, generator=gen, device=device, dtype=torch.float32).to(tdt)

    return rnd(seqlen_q, heads), rnd(seqlen_k, heads_k), rnd(seqlen_k, heads_k, head_dim_v or head_dim)


def random_fp8(batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int, head_dim: int,
               seed: int | None = None, device: str = "cuda", per_head: bool = False, outliers: bool = False,
               hadamard_rotation: bool = False) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(q8, k8, v8, descale): standard-normal inputs quantized by flashgen.fp8.quantize. outliers: two
    channels of q and k scaled by 10 first (outlier features of real activations)."""
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, "bf16", seed, device)
    if outliers:
        q, k = q.float(), k.float()
        q[..., :2] *= 10
        k[..., :2] *= 10
    return quantize(q, k, v, per_head=per_head, hadamard_rotation=hadamard_rotation)


@dataclass(frozen=True)
class Reference:
    """The float64 answer for one set of inputs and the error bar a kernel must meet."""

    out: Any
    lse: Any
    bound: float  # 2 * (PyTorch in the input dtype vs float64) + 1e-5
    rms_bound: float | None = None  # FP8: plain FP8's RMS error, which the kernel's may not exceed
    lse_allow: Any = None  # FP8: per row, what the tensor cores' accumulation may add to LSE_TOL


def reference(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None = None) -> Reference:
    ref, ref_lse = attention_ref(q, k, v, causal, softmax_scale, upcast=True)
    pt, _ = attention_ref(q, k, v, causal, softmax_scale, upcast=False)
    bound = 2 * (pt.double() - ref).abs().max().item() + 1e-5 if ref.numel() else 1e-5
    return Reference(ref, ref_lse, bound)


def _product_sizes(q: Any, k: Any, softmax_scale: float | None) -> Any:
    """(b, h, sq): per query row, max over keys of sum_c |scale q_c k_c| (q, k float64, flash_attn layout)."""
    import torch  # noqa: PLC0415

    b, sq, h, d = q.shape
    hk, sk = k.shape[2], k.shape[1]
    out = torch.zeros(b, h, sq, dtype=torch.float64, device=q.device)
    if not sk:
        return out
    scale = abs(1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale)
    qa = (q.abs() * scale).reshape(b, sq, hk, h // hk, d)
    ka = k.abs()
    rows = ref_chunk_rows(b, h, sq, sk, ref_budget_bytes(q.device))
    for r in range(0, sq, rows):
        m = torch.einsum("bqkgd,bnkd->bkgqn", qa[:, r:r + rows], ka).amax(dim=-1)  # (b, hk, g, rows)
        out[:, :, r:r + rows] = m.reshape(b, h, -1)
    return out


def reference_fp8(q8: Any, k8: Any, v8: Any, descale: dict[str, Any], causal: bool,
                  softmax_scale: float | None = None, out_dtype: Any = None) -> Reference:
    """The float64 answer from the dequantized inputs; the bar from plain FP8 (flashgen.fp8.emulate)
    rounded to the kernel's output dtype (default bf16), as the kernel's output is."""
    import torch  # noqa: PLC0415

    hk = k8.shape[2]
    q, k, v = (dequantize(t, descale[n], hk) for t, n in zip((q8, k8, v8), DESCALE_NAMES))
    ref, ref_lse = attention_ref(q, k, v, causal, softmax_scale, upcast=True)
    allow = FP8_SCORE_REL_TOL * _product_sizes(q, k, softmax_scale)
    if not ref.numel():
        return Reference(ref, ref_lse, 1e-5, 0.0, allow)
    err = emulate_dequantized(q, k, v, causal, softmax_scale).to(out_dtype or torch.bfloat16).double() - ref
    return Reference(ref, ref_lse, 2 * err.abs().max().item() + 1e-5, err.pow(2).mean().sqrt().item(), allow)


def judge(out: Any, lse: Any, ref: Reference) -> VerifyResult:
    """Compare a kernel's (out, lse) with the reference."""
    import torch  # noqa: PLC0415

    bound = ref.bound
    if torch.isnan(out).any():
        return VerifyResult(False, math.nan, bound, math.nan, "NaN in output (unwritten or poisoned element)")
    max_err = (out.double() - ref.out).abs().max().item() if ref.out.numel() else 0.0
    finite = torch.isfinite(ref.lse)
    if not torch.equal(finite, torch.isfinite(lse)) or torch.isnan(lse).any():
        return VerifyResult(False, max_err, bound, math.inf, "LSE finite/infinite pattern differs from the reference")
    lse_diff = (lse[finite].double() - ref.lse[finite].double()).abs()
    if ref.lse_allow is not None:  # judged against LSE_TOL: the part of the error past FP8's allowance
        lse_diff = (lse_diff - ref.lse_allow[finite].double()).clamp_min(0)
    lse_err = lse_diff.max().item() if finite.any() else 0.0
    rms = math.nan
    if ref.rms_bound is not None:
        rms = (out.double() - ref.out).pow(2).mean().sqrt().item() if ref.out.numel() else 0.0
    if max_err > bound:
        return VerifyResult(False, max_err, bound, lse_err, f"max error {max_err:.3g} > bound {bound:.3g}", rms)
    # no worse than plain FP8's, within the sampling noise of an RMS over n elements (3 standard errors)
    if ref.rms_bound is not None and rms > ref.rms_bound * (1 + 3 / math.sqrt(max(1, ref.out.numel()))):
        return VerifyResult(False, max_err, bound, lse_err, f"RMS error {rms:.3g} > plain FP8's {ref.rms_bound:.3g}",
                            rms)
    if lse_err > LSE_TOL:
        return VerifyResult(False, max_err, bound, lse_err, f"LSE error {lse_err:.3g} > {LSE_TOL}", rms)
    return VerifyResult(True, max_err, bound, lse_err, "", rms)


def poisoned_error(out: Any, ref: Any, run: Any) -> float:
    """Max |out - ref| after `run()` writes `out`, which holds NaN before it: an element left unwritten makes
    the result NaN (which no bound accepts)."""
    import torch  # noqa: PLC0415

    out.fill_(float("nan"))
    run()
    if out.is_cuda:
        torch.cuda.synchronize()
    return (out.double() - ref).abs().max().item()


def poisoned_outputs(q: Any, dtype: Any = None, width: int | None = None) -> tuple[Any, Any]:
    """NaN-filled out (q's dtype, or `dtype`; q's head dim, or `width`: v's) and lse buffers for q's problem: any
    element the kernel skips shows up."""
    import torch  # noqa: PLC0415

    b, sq, h, d = q.shape
    return (torch.full((b, sq, h, width or d), float("nan"), device=q.device, dtype=dtype or q.dtype),
            torch.full((b, h, sq), float("nan"), device=q.device, dtype=torch.float32))


def run_and_judge(kernel: CompiledKernel, q: Any, k: Any, v: Any, ref: Reference,
                  softmax_scale: float | None = None, descale: dict[str, Any] | None = None) -> VerifyResult:
    import torch  # noqa: PLC0415

    out, lse = poisoned_outputs(q, torch_dtype(kernel.config.output_dtype), v.shape[3])
    run(kernel, q, k, v, softmax_scale, out=out, lse=lse, descale=descale)
    torch.cuda.synchronize()
    return judge(out, lse, ref)


def verify(kernel: CompiledKernel, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int | None = None,
           seed: int | None = None, softmax_scale: float | None = None) -> VerifyResult:
    """Run `kernel` once on fresh random inputs of this shape into NaN-poisoned outputs and judge it."""
    cfg = kernel.config
    if cfg.fp8:
        q, k, v, descale = random_fp8(batch, seqlen_q, seqlen_k, heads, heads_k or heads, cfg.head_dim, seed)
        ref = reference_fp8(q, k, v, descale, cfg.causal, softmax_scale, torch_dtype(cfg.output_dtype))
        return run_and_judge(kernel, q, k, v, ref, softmax_scale, descale)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k or heads, cfg.head_dim, cfg.dtype, seed,
                         head_dim_v=cfg.head_dim_v)
    return run_and_judge(kernel, q, k, v, reference(q, k, v, cfg.causal, softmax_scale), softmax_scale)


# -- the backward ------------------------------------------------------------------------

GRAD_ABS_TOL = 1e-4  # added to twice PyTorch's error, per gradient


def attention_torch(q: Any, k: Any, v: Any, causal: bool, scale: float) -> Any:
    """Explicit attention in q's dtype, autograd-able (GQA by repeating k, v); a row that sees no key gives 0."""
    import torch  # noqa: PLC0415

    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # S = Q K^T
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)  # keys j > i + sk - sq
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)  # O = P V


def attention_grads(q: Any, k: Any, v: Any, dout: Any, causal: bool, scale: float, dtype: Any) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) by autograd through `attention_torch` computed in `dtype` (float64: the reference)."""
    import torch  # noqa: PLC0415

    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = attention_torch(*leaves, causal, scale)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


@dataclass(frozen=True)
class GradResult:
    """A backward judged against float64: one line per failure; max_err the worst gradient's."""

    ok: bool
    max_err: float
    failures: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        return "; ".join(self.failures)


def judge_backward(got: tuple[Any, Any, Any], q: Any, k: Any, v: Any, dout: Any, causal: bool, scale: float,
                   buffers: tuple[Any, Any, Any] | None = None) -> GradResult:
    """Each gradient: no NaN, written into its buffer (if given), max error vs float64 <= 2 x PyTorch's
    error in the input dtype + GRAD_ABS_TOL (flash_attn's bar)."""
    import torch  # noqa: PLC0415

    ref = attention_grads(q, k, v, dout, causal, scale, torch.float64)
    pt = attention_grads(q, k, v, dout, causal, scale, q.dtype)
    failures, worst = [], 0.0
    for i, (name, g, r, p) in enumerate(zip(("dq", "dk", "dv"), got, ref, pt)):
        if buffers is not None and g.data_ptr() != buffers[i].data_ptr():
            failures.append(f"{name}: not written into the buffer given")
        if torch.isnan(g).any():
            failures.append(f"{name}: NaN (unwritten or poisoned element)")
            worst = math.nan
            continue
        err = (g.double() - r).abs().max().item() if r.numel() else 0.0
        bound = 2 * ((p.double() - r).abs().max().item() if r.numel() else 0.0) + GRAD_ABS_TOL
        worst = max(worst, err) if not math.isnan(worst) else worst
        if err > bound:
            failures.append(f"{name}: max error {err:.3g} > bound {bound:.3g}")
    return GradResult(not failures, worst, tuple(failures))


def verify_backward(kernel: CompiledKernel, fwd_kernel: CompiledKernel, batch: int, seqlen_q: int, seqlen_k: int,
                    heads: int, heads_k: int | None = None, seed: int | None = None,
                    softmax_scale: float | None = None) -> GradResult:
    """Run the backward `kernel` once on fresh random q, k, v, dO of this shape (out and lse from
    `fwd_kernel`) into NaN-poisoned gradient buffers, and judge dq, dk, dv against float64."""
    import torch  # noqa: PLC0415

    cfg = kernel.config
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k or heads, cfg.head_dim, cfg.dtype, seed)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(cfg.head_dim) if softmax_scale is None else softmax_scale
    out, lse, _ = run(fwd_kernel, q, k, v, softmax_scale)
    buffers = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    got = backward(kernel, q, k, v, out, dout, lse, softmax_scale, *buffers)
    torch.cuda.synchronize()
    return judge_backward(got, q, k, v, dout, cfg.causal, scale, buffers)


def attention_mods_ref(q: Any, k: Any, v: Any, causal: bool, scale: float, window: tuple[int, int] = (-1, -1),
                       softcap: float = 0.0, slopes: Any = None, dtype: Any = None) -> tuple[Any, Any]:
    """One sequence, q (seqlen_q, heads, d) against k, v (seqlen_k, heads_k, d), computed in `dtype`
    (float64: the reference; q's dtype: what PyTorch's own error is): (out, lse (heads, seqlen_q)),
    with the serving score modifiers (window aligned like causal, softcap, ALiBi slopes (heads,)).
    A row that sees no key gives O = 0, LSE = +inf."""
    import torch  # noqa: PLC0415

    dtype = dtype or torch.float64
    sq, h, _ = q.shape
    sk, hk = k.shape[:2]
    qf = q.to(dtype).transpose(0, 1)
    kf = k.to(dtype).repeat_interleave(h // hk, dim=1).transpose(0, 1)
    vf = v.to(dtype).repeat_interleave(h // hk, dim=1).transpose(0, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # the row's diagonal key
    j = torch.arange(sk, device=q.device)[None, :]
    if slopes is not None:
        s = s - slopes.to(s.dtype)[:, None, None] * (i - j).abs().to(s.dtype)
    left, right = window
    right = 0 if causal else right
    mask = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        mask |= j > i + right
    if left >= 0:
        mask |= j < i - left
    s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s.double(), dim=-1)  # (h, sq)
    p = torch.exp(s.double() - lse[..., None]).nan_to_num(0.0).to(vf.dtype)
    out = (p @ vf).transpose(0, 1)
    return out, lse.nan_to_num(nan=math.inf, neginf=math.inf)


def packed_ref(q: Any, k: Any, v: Any, cu_q: list[int], cu_k: list[int], causal: bool, window_left: int = -1,
               dtype: Any = None, budget_bytes: int = 1 << 30) -> Any:
    """Outputs of packed sequences (q (total_q, heads, d), k, v (total_k, heads_k, d); sequence b is rows
    cu_q[b]..cu_q[b+1] against keys cu_k[b]..cu_k[b+1]), computed in `dtype` (float64: the reference) by
    attention_mods_ref, a few KV heads at a time so that a long sequence's float64 scores fit (budget_bytes per
    chunk); returns (total_q, heads, d). Scale 1/sqrt(d); window (window_left, right unbounded or causal)."""
    import torch  # noqa: PLC0415

    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    group = h // hk
    outs = []
    for b in range(len(cu_q) - 1):
        nq, nk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        per = max(1, min(hk, budget_bytes // max(1, (nq * nk + nk * d) * 8 * group)))  # KV heads per chunk
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        outs.append(torch.cat([attention_mods_ref(qs[:, j * group:(j + per) * group], ks[:, j:j + per],
                                                  vs[:, j:j + per], causal, 1 / math.sqrt(d), (window_left, -1),
                                                  dtype=dtype)[0] for j in range(0, hk, per)], dim=1))
    return torch.cat(outs)
