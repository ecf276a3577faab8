"""Short real tunes of problems with a score_mod and a mask_mod on the GPU, end to end: the stored entry's key ends in
their digests, and `flashgen.attention(..., score_mod=, mask_mod=)` takes the stored kernel and is right: family sm80
with arch="sm80", and family sm90 on Hopper without arch, there with modifiers that read tensors, forward and
backward (through autograd).

Run on a GPU machine: python -m pytest -q -m gpu tests/test_tune_modifier_gpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import needs_gpu_tuner

REPO = Path(__file__).resolve().parent.parent

pytestmark = needs_gpu_tuner()

MODS = textwrap.dedent("""
    import torch

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0) + 0.01 * (kv_idx - q_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 300)
""")

CHECK = textwrap.dedent("""
    import json, math, sys
    import torch
    import flashgen
    from flashgen import ops
    from flashgen.checks import Mods
    from flashgen.modifiers import trace_mask_mod, trace_score_mod
    from flashgen.tune_modifier import reference

    ns = {}
    exec(open(sys.argv[1]).read(), ns)
    s, m = trace_score_mod(ns["softcap"]), trace_mask_mod(ns["window"])
    cfg = ops.modifier_kernel(0, 64, "bf16", False, 1024, 1, Mods(score_mod=s, mask_mod=m), "sm80")
    q, k, v = (torch.randn(2, 1000, 32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = flashgen.attention(q, k, v, score_mod=ns["softcap"], mask_mod=ns["window"], arch="sm80")
    ref, _ = reference(q, k, v, False, 64 ** -0.5, s, m)
    same, _ = reference(q, k, v, False, 64 ** -0.5, s, m, dtype=torch.bfloat16)
    err, bound = (out.double() - ref).abs().max().item(), 2 * (same.double() - ref).abs().max().item() + 1e-5
    print(json.dumps({"kernel": cfg.name, "err": err, "bound": bound}))
""")


def tune_then_call(tmp_path, mods_text: str, check_text: str, tune_args: list[str]) -> tuple[str, dict, dict]:
    """A real `tune` of the modifiers of `mods_text` (the file mods.py: FUNC names in tune_args) into a fresh store,
    then `check_text` run with that store: (the entry's key, the entry, the JSON the check prints last)."""
    mods = tmp_path / "mods.py"
    mods.write_text(mods_text)
    storage, tuned = f"sqlite:///{tmp_path / 'studies.db'}", tmp_path / "tuned"
    env = {**os.environ, "FLASHGEN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(REPO / "cli.py"), "tune", "--head-dim", "64", "--dtype", "bf16",
                           "--causal", "no", "--seqlen", "1024", "--trials", "4", "--retime", "2",
                           *(a.format(mods=mods) for a in tune_args), "--storage", storage, "--tuned-dir", str(tuned)],
                          capture_output=True, text=True, env=env, timeout=560, cwd=REPO)
    print(proc.stdout, proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    (store_file,) = tuned.glob("*.json")
    (key, entry), = json.loads(store_file.read_text())["entries"].items()
    assert "_sm" in key and "_mm" in key and entry["config"]["block_map"]
    assert entry["median_ms"] > 0 and entry["trials"] >= 1
    check = tmp_path / "check.py"
    check.write_text(check_text)
    proc = subprocess.run([sys.executable, str(check), str(mods)], capture_output=True, text=True, timeout=560,
                          env={**env, "FLASHGEN_TUNED_DIR": str(tuned)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return key, entry, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_short_modifier_tune_is_stored_and_taken_by_attention(tmp_path):
    key, entry, got = tune_then_call(tmp_path, MODS, CHECK, [
        "--arch", "sm80", "--block-m", "64,128", "--block-n", "32,64", "--num-warps", "4,8",
        "--score-mod", "{mods}:softcap", "--mask-mod", "{mods}:window"])
    assert key.startswith("sm80_")
    assert got["kernel"] == entry["kernel"]  # the call took the tuned kernel
    assert got["err"] <= got["bound"], got


MODS_READING = textwrap.dedent("""
    import torch

    g = torch.Generator().manual_seed(3)
    doc = torch.randint(0, 4, (16, 1024), generator=g).sort(dim=1).values.to(torch.int32).cuda()
    rel = (0.3 * torch.randn(2047, generator=g)).cuda()

    def bias(score, b, h, q_idx, kv_idx):
        return score + rel[kv_idx - q_idx + 1023]

    def document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]
""")

CHECK_SM90 = textwrap.dedent("""
    import json, sys
    import torch
    import flashgen
    from flashgen import ops
    from flashgen.checks import Mods
    from flashgen.modifiers import trace_mask_mod, trace_score_mod
    from flashgen.tune_modifier import reference

    ns = {}
    exec(open(sys.argv[1]).read(), ns)
    s, m = trace_score_mod(ns["bias"]), trace_mask_mod(ns["document"])
    cfg = ops.modifier_kernel(0, 64, "bf16", False, 1024, 1, Mods(score_mod=s, mask_mod=m))
    q, k, v = (torch.randn(3, 1000, 32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = flashgen.attention(q, k, v, score_mod=ns["bias"], mask_mod=ns["document"])
    ref, _ = reference(q, k, v, False, 64 ** -0.5, s, m)
    same, _ = reference(q, k, v, False, 64 ** -0.5, s, m, dtype=torch.bfloat16)
    err, bound = (out.double() - ref).abs().max().item(), 2 * (same.double() - ref).abs().max().item() + 1e-5
    print(json.dumps({"kernel": cfg.name, "family": cfg.family, "err": err, "bound": bound}))
""")


def test_a_short_sm90_tune_of_modifiers_reading_tensors_is_taken_by_attention(tmp_path):
    """--arch sm90 with a score_mod and a mask_mod that read tensors (the worker runs the file for them): the entry
    is stored under the sm90 family, a call without arch takes it on Hopper, and its output is right."""
    key, entry, got = tune_then_call(tmp_path, MODS_READING, CHECK_SM90, [
        "--arch", "sm90", "--persistent", "no", "--exp2-fma", "no",
        "--score-mod", "{mods}:bias", "--mask-mod", "{mods}:document"])
    assert key.startswith("sm90_")
    assert got["kernel"] == entry["kernel"] and got["family"] == "sm90"  # the call took the tuned kernel
    assert got["err"] <= got["bound"], got


CHECK_SM90_BWD = textwrap.dedent("""
    import json, sys
    import torch
    import flashgen
    from flashgen import resolve
    from flashgen.modifiers import trace_mask_mod, trace_score_mod
    from flashgen.tune_modifier import reference_grads

    ns = {}
    exec(open(sys.argv[1]).read(), ns)
    s, m = trace_score_mod(ns["bias"]), trace_mask_mod(ns["document"])
    kern = resolve.modifier_backward_kernel(0, 64, "bf16", False, (), False, s.digest, m.digest, True, seqlen=1000)
    q, k, v = (torch.randn(3, 1000, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    out = flashgen.attention(q, k, v, score_mod=ns["bias"], mask_mod=ns["document"])
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_grads(q, k, v, dout, False, 64 ** -0.5, s, m)
    same = reference_grads(q, k, v, dout, False, 64 ** -0.5, s, m, dtype=torch.bfloat16)
    errs = [(g.double() - r).abs().max().item() for g, r in zip(got, ref)]
    bounds = [2 * (x.double() - r).abs().max().item() + 1e-5 for x, r in zip(same, ref)]
    print(json.dumps({"kernel": kern.config.name, "family": kern.config.family, "errs": errs, "bounds": bounds}))
""")


def test_a_short_sm90_backward_tune_of_modifiers_reading_tensors_is_taken_by_autograd(tmp_path):
    """--pass bwd --arch sm90 with the same modifiers: the backward entry is stored under the sm90 family, the
    backward of a call without arch takes it, and dq, dk, dv are within the bar of float64."""
    key, entry, got = tune_then_call(tmp_path, MODS_READING, CHECK_SM90_BWD, [
        "--arch", "sm90", "--pass", "bwd", "--score-mod", "{mods}:bias", "--mask-mod", "{mods}:document"])
    assert key.startswith("sm90_") and "_bwd_sm" in key
    assert got["kernel"] == entry["kernel"] and got["family"] == "sm90"  # autograd took the tuned backward
    assert all(e <= b for e, b in zip(got["errs"], got["bounds"])), got
