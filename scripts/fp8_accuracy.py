"""FP8 accuracy on the GPU: RMS and max error of flashgen's FP8 forward beside plain FP8 emulated in
PyTorch and the bf16 floor, with and without block quantization of P and incoherent processing.

    python scripts/fp8_accuracy.py --out benchmarks/nvidia-h200-DATE-fp8-accuracy

Inputs: standard normal ("gaussian"), and the same with two channels of q and k scaled by 10
("outliers", as outlier features of real activations). Two references, both float64:
- "vs deq": attention of the dequantized FP8 inputs (the kernel's own error; the bar:
  RMS no worse than plain FP8's, max within 2x),
- "vs exact": attention of the unquantized inputs (what a user loses end to end, input
  quantization included; FlashAttention-3's paper reports this kind).
Plain FP8 = flashgen.fp8.emulate on per-tensor quantized inputs, rounded to bf16 as flashgen's output is; bf16 floor = the same attention
computed in bf16 (PyTorch, explicit) from the bf16 inputs. Writes a table (.txt) and JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def errors(out, ref) -> tuple[float, float]:
    d = out.double() - ref
    return d.pow(2).mean().sqrt().item(), d.abs().max().item()


def main() -> None:
    import torch

    import flashgen
    from flashgen.fp8 import DESCALE_NAMES, dequantize, emulate, quantize
    from flashgen.verify import attention_ref, attention_torch, random_qkv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", default="64,128,256")
    ap.add_argument("--out", type=Path, default=None, help="path stem for .txt and .json")
    args = ap.parse_args()
    b, n, h = args.batch, args.seqlen, args.heads
    rows = []
    for d in (int(x) for x in args.head_dim.split(",")):
        for kind in ("gaussian", "outliers"):
            for causal in (False, True):
                q, k, v = random_qkv(b, n, n, h, h, d, "bf16", seed=d + 7 * causal)
                if kind == "outliers":
                    q, k = q.clone(), k.clone()
                    q[..., :2] *= 10
                    k[..., :2] *= 10
                exact, _ = attention_ref(q, k, v, causal)
                pt16 = attention_torch(q, k, v, causal, d ** -0.5)
                rec = {"head_dim": d, "inputs": kind, "causal": causal, "seqlen": n,
                       "bf16_floor_vs_exact": errors(pt16, exact)}
                for rot in (False, True):
                    q8, k8, v8, desc = quantize(q, k, v, hadamard_rotation=rot)
                    deq = [dequantize(t, desc[nm], h) for t, nm in zip((q8, k8, v8), DESCALE_NAMES)]
                    ref_deq, _ = attention_ref(*deq, causal)
                    emu = emulate(q8, k8, v8, desc, causal).to(torch.bfloat16)  # the kernels' output dtype
                    tag = "rot" if rot else "plain"
                    rec[f"emulated_{tag}_vs_deq"] = errors(emu, ref_deq)
                    rec[f"emulated_{tag}_vs_exact"] = errors(emu, exact)
                    for bq in (False, True):
                        out = flashgen.attention(q8, k8, v8, causal=causal, block_quant_p=bq, **desc)
                        key = f"flashgen_{tag}{'_bq' if bq else ''}"
                        rec[f"{key}_vs_deq"] = errors(out, ref_deq)
                        rec[f"{key}_vs_exact"] = errors(out, exact)
                rows.append(rec)
                torch.cuda.empty_cache()
    cols = ["bf16_floor_vs_exact", "emulated_plain_vs_exact", "flashgen_plain_vs_exact", "flashgen_plain_bq_vs_exact",
            "emulated_rot_vs_exact", "flashgen_rot_vs_exact", "flashgen_rot_bq_vs_exact"]
    head = f"{'d':>4} {'inputs':<9} {'mask':<6} " + " ".join(f"{c.replace('_vs_exact', ''):>22}" for c in cols)
    lines = [f"RMSE / max error vs float64 of the unquantized inputs (b={b}, N={n}, heads={h}; per-tensor scales)",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['head_dim']:>4} {r['inputs']:<9} {'causal' if r['causal'] else 'full':<6} " +
                     " ".join(f"{r[c][0]:>10.2e}/{r[c][1]:<11.2e}" for c in cols))
    lines += ["", "kernel's own error: RMSE / max vs float64 of the dequantized inputs (bar: RMS <= plain, max <= 2x)"]
    cols2 = ["emulated_plain_vs_deq", "flashgen_plain_vs_deq", "flashgen_plain_bq_vs_deq", "emulated_rot_vs_deq",
             "flashgen_rot_vs_deq", "flashgen_rot_bq_vs_deq"]
    head2 = f"{'d':>4} {'inputs':<9} {'mask':<6} " + " ".join(f"{c.replace('_vs_deq', ''):>22}" for c in cols2) + "  bar"
    lines += [head2, "-" * len(head2)]
    for r in rows:
        ok = all(r[f"flashgen_{t}{s}_vs_deq"][0] <= r[f"emulated_{t}_vs_deq"][0] and
                 r[f"flashgen_{t}{s}_vs_deq"][1] <= 2 * r[f"emulated_{t}_vs_deq"][1]
                 for t in ("plain", "rot") for s in ("", "_bq"))
        lines.append(f"{r['head_dim']:>4} {r['inputs']:<9} {'causal' if r['causal'] else 'full':<6} " +
                     " ".join(f"{r[c][0]:>10.2e}/{r[c][1]:<11.2e}" for c in cols2) + f"  {'met' if ok else 'MISSED'}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(text + "\n")
        gpu = torch.cuda.get_device_name()
        args.out.with_suffix(".json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
