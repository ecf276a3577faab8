"""Training through the serving features on the GPU: gradients of `attention_varlen` (packed batches
with empty, length-1, odd and unequal lengths, causal, GQA/MQA) and of `attention` with a window,
softcap or ALiBi, each alone and together, with and without causal, against float64 autograd built
sequence by sequence. Gradient buffers come fresh from autograd; NaN anywhere fails. The bar,
flash_attn's: each gradient's max error <= 2 x PyTorch's error in the input dtype + 1e-4."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.verify import GRAD_ABS_TOL, attention_mods_ref  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
# (seqlen_q, seqlen_k) per sequence: empty, no key, no row, length 1, odd and unequal both ways, 2 tiles.
SEQS = [(0, 0), (3, 0), (0, 37), (1, 1), (17, 17), (113, 211), (211, 113), (1, 300), (128, 128)]
# (window, softcap, alibi) alone and together.
MODS = {"window": ((64, 16), 0.0, False), "window-left": ((100, -1), 0.0, False), "softcap": ((-1, -1), 30.0, False),
        "alibi": ((-1, -1), 0.0, True), "all": ((48, 48), 20.0, True)}


def _ref_grads(q, k, v, dout, cu_q, cu_k, causal, scale, window, softcap, slopes, dtype, dlse=None):
    """(dq, dk, dv) of the packed batch by autograd through attention_mods_ref per sequence, in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    total = 0
    for b in range(len(cu_q) - 1):
        qs, ks, vs = (leaves[0][cu_q[b]:cu_q[b + 1]], leaves[1][cu_k[b]:cu_k[b + 1]], leaves[2][cu_k[b]:cu_k[b + 1]])
        if qs.shape[0] == 0:
            continue
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        out, lse = attention_mods_ref(qs, ks, vs, causal, scale, window, softcap, sl, dtype=dtype)
        total = total + (out * dout[cu_q[b]:cu_q[b + 1]].to(dtype)).sum()
        if dlse is not None:
            fin = torch.isfinite(lse)
            total = total + (lse.where(fin, 0.0) * dlse[:, cu_q[b]:cu_q[b + 1]].to(lse.dtype)).sum()
    if not torch.is_tensor(total):
        return tuple(torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    return torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)


def _judge(got, q, k, v, dout, cu_q, cu_k, causal, scale, window=(-1, -1), softcap=0.0, slopes=None, dlse=None):
    ref = _ref_grads(q, k, v, dout, cu_q, cu_k, causal, scale, window, softcap, slopes, torch.float64, dlse)
    pt = _ref_grads(q, k, v, dout, cu_q, cu_k, causal, scale, window, softcap, slopes, q.dtype, dlse)
    failures = []
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        if torch.isnan(g).any():
            failures.append(f"{name}: NaN")
            continue
        err = (g.double() - r).abs().max().item() if r.numel() else 0.0
        bound = 2 * ((p.double() - r).abs().max().item() if r.numel() else 0.0) + GRAD_ABS_TOL
        if err > bound:
            failures.append(f"{name}: max error {err:.3g} > bound {bound:.3g}")
    assert not failures, "; ".join(failures)


def _packed(seqs, h, hk, hd, dt, seed):
    torch.manual_seed(seed)
    lq, lk = [a for a, _ in seqs], [b for _, b in seqs]
    cu_q = [0, *itertools.accumulate(lq)]
    cu_k = [0, *itertools.accumulate(lk)]
    q = torch.randn(cu_q[-1], h, hd, device="cuda", dtype=dt)
    k = torch.randn(cu_k[-1], hk, hd, device="cuda", dtype=dt)
    v = torch.randn(cu_k[-1], hk, hd, device="cuda", dtype=dt)
    return q, k, v, cu_q, cu_k, max(lq), max(lk)


def _varlen_grads(seqs, hd, dtype, causal, layout, window=(-1, -1), softcap=0.0, alibi=False, deterministic=False,
                  with_lse=False, seed=0):
    h, hk = LAYOUTS[layout]
    q, k, v, cu_q, cu_k, mq, mk = _packed(seqs, h, hk, hd, DT[dtype], seed)
    slopes = torch.rand(h, device="cuda") * 0.5 if alibi else None
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    icu_q, icu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    out, lse = flashgen.attention_varlen(*leaves, icu_q, icu_k, mq, mk, causal=causal, window_size=window,
                                         softcap=softcap, alibi_slopes=slopes, return_lse=True,
                                         deterministic=deterministic)
    loss = (out * dout).sum()
    dlse = None
    if with_lse:
        dlse = torch.randn_like(lse)
        loss = loss + (lse.where(torch.isfinite(lse), 0.0) * dlse).sum()
    got = torch.autograd.grad(loss, leaves)
    torch.cuda.synchronize()
    _judge(got, q, k, v, dout, cu_q, cu_k, causal, 1 / math.sqrt(hd), window, softcap, slopes, dlse)
    return got


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_gradients_match_float64(hd, dtype, causal, layout):
    _varlen_grads(SEQS, hd, dtype, causal, layout)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mod", list(MODS))
def test_varlen_score_modifier_gradients(hd, dtype, causal, mod):
    window, softcap, alibi = MODS[mod]
    _varlen_grads([(1, 1), (113, 211), (300, 300), (211, 113), (17, 1000)], hd, dtype, causal, "gqa", window,
                  softcap, alibi)


def test_varlen_lse_gradient_and_deterministic():
    """The gradient of lse enters as D - dlse; deterministic=True: the same bits twice, and right."""
    _varlen_grads(SEQS, 128, "bf16", True, "gqa", with_lse=True)
    a = _varlen_grads(SEQS, 64, "bf16", True, "gqa", window=(32, -1), deterministic=True, seed=3)
    b = _varlen_grads(SEQS, 64, "bf16", True, "gqa", window=(32, -1), deterministic=True, seed=3)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic gradients differ between two runs"


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mod", list(MODS))
def test_dense_score_modifier_gradients(hd, causal, mod):
    """flashgen.attention(..., window_size, softcap, alibi_slopes) with autograd, batch 2, unequal lengths, GQA,
    slopes per (batch, head)."""
    window, softcap, alibi = MODS[mod]
    torch.manual_seed(7)
    b, sq, sk, h, hk = 2, 211, 300, 6, 2
    q = torch.randn(b, sq, h, hd, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.rand(b, h, device="cuda") * 0.5 if alibi else None
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    got = torch.autograd.grad((out * dout).sum(), leaves)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731  (the batch as packed sequences)
    cu_q, cu_k = [0, sq, 2 * sq], [0, sk, 2 * sk]
    _judge([flat(g) for g in got], flat(q), flat(k), flat(v), flat(dout), cu_q, cu_k, causal, 1 / math.sqrt(hd),
           window, softcap, slopes)


def test_the_bar_catches_a_wrong_feature():
    """The judge fails gradients computed with another mask or softcap than the reference's (the bar can fail)."""
    q, k, v, cu_q, cu_k, mq, mk = _packed([(17, 17), (113, 211)], 4, 2, 64, torch.bfloat16, 11)
    dout = torch.randn_like(q)
    icu_q, icu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashgen.attention_varlen(*leaves, icu_q, icu_k, mq, mk, causal=True, softcap=5.0)
    got = torch.autograd.grad((out * dout).sum(), leaves)
    _judge(got, q, k, v, dout, cu_q, cu_k, True, 0.125, softcap=5.0)
    for wrong in (dict(causal=False, softcap=5.0), dict(causal=True, softcap=0.0)):
        with pytest.raises(AssertionError, match="max error"):
            _judge(got, q, k, v, dout, cu_q, cu_k, scale=0.125, **wrong)


def test_dense_modifiers_off_take_the_plain_kernels():
    """window_size=(-1, 0) with causal is causal itself: the tuned dense path, not the serving kernels."""
    from flashgen.kernels import serving

    assert not serving.has_mods((-1, 0), 0.0, None, True)
    assert serving.has_mods((-1, 0), 0.0, None, False)
    assert serving.has_mods((-1, -1), 1.0, None, False)


@pytest.mark.parametrize("family", ["sm80", "sm90", "sm90-det"])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (40, 8), (100, -1)], ids=["nowin", "win", "left"])
def test_each_family_varlen_backward(family, hd, causal, window):
    """The varlen (and window) backward of each family through flashgen.kernels.backward directly (autograd takes the
    sm90 family on Hopper), against the same per-sequence float64 reference; sm90-det (the sm90 family's
    deterministic backward, whose K/V tiles take turns by the window's first visible tile): also the same bits on a
    second run."""
    det = family == "sm90-det"
    family = "sm90" if det else family
    from flashgen.kernels.backward import ServeArgs, backward, load_backward
    from flashgen.config import default_bwd_config, mod_features

    major = torch.cuda.get_device_capability()[0]
    if family == "sm90" and major != 9:
        pytest.skip("family sm90 runs on Hopper (sm90) only")
    seqs = [(0, 5), (1, 1), (113, 211), (211, 113), (65, 64), (128, 300), (700, 900)]  # the last: many tiles each way
    q, k, v, cu_q, cu_k, mq, mk = _packed(seqs, 6, 2, hd, torch.bfloat16, 5)
    icu_q, icu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    out, lse = flashgen.attention_varlen(q, k, v, icu_q, icu_k, mq, mk, causal=causal, window_size=window,
                                         return_lse=True)
    dout = torch.randn_like(q)
    feats = {f: on for f, on in dict(varlen=True, **mod_features(window, 0.0, False, causal)).items() if on}
    cfg = dataclasses.replace(default_bwd_config(hd, "bf16", causal, f"sm{major}{torch.cuda.get_device_capability()[1]}",
                                                 deterministic=det, family=family), **feats)
    serve = ServeArgs(icu_q, icu_k, mq, mk, (window[0], 0 if causal else window[1]))
    kern = load_backward(hd, "bf16", causal, cfg)
    runs = []
    for _ in range(2 if det else 1):
        bufs = tuple(torch.full_like(t, float("nan")).unsqueeze(0) for t in (q, k, v))
        runs.append(backward(kern, *(t.unsqueeze(0) for t in (q, k, v, out, dout)), lse.unsqueeze(0), None, *bufs,
                             serve=serve))
    torch.cuda.synchronize()
    _judge([g.squeeze(0) for g in runs[0]], q, k, v, dout, cu_q, cu_k, causal, 1 / math.sqrt(hd), window)
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], runs[-1]):
        assert torch.equal(a, b), f"{cfg.name}: {name} differs between two runs"


def serving_bwd_configs(arch: str) -> set:
    """Every kernel this module loads on `arch` (scripts/fill_kernel_cache.py): the serving forwards, the sm80
    family's default backward tiles with each feature set used here, and on Hopper each sm90 backward autograd
    may take (the default and every tuned one in the repository's store) with varlen and window."""
    import json
    from pathlib import Path

    from flashgen.config import HALF_DTYPES, HEAD_DIMS, default_bwd_config, mod_features
    from flashgen.kernels.serving import serve_config
    from flashgen.store import config_from_entry

    out = set()
    sm90 = []
    if arch == "sm90":
        sm90 = [default_bwd_config(hd, dt, c, arch) for hd, dt, c in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True))]
        for path in (Path(__file__).resolve().parent.parent / "tuned").glob("*.json"):
            sm90 += [config_from_entry(e) for e in json.loads(path.read_text())["entries"].values()]
        sm90 = [c for c in sm90 if getattr(c, "family", "") == "sm90" and hasattr(c, "deterministic")]

    def add(hd, dtype, causal, rows, det=False, varlen=True, window=(-1, -1), softcap=0.0, alibi=False):
        feats = dict(varlen=varlen, **mod_features(window, softcap, alibi, causal))
        feats = {f: on for f, on in feats.items() if on}
        out.add(serve_config(hd, dtype, causal, rows, arch, **feats))
        out.add(dataclasses.replace(default_bwd_config(hd, dtype, causal, arch, det, family="sm80"), **feats))
        if det and not (softcap or alibi):  # Hopper: family sm90's deterministic backward
            out.add(dataclasses.replace(default_bwd_config(hd, dtype, causal, arch, det), **feats))
        if not (det or softcap or alibi):
            out.update(dataclasses.replace(c, **feats) for c in sm90
                       if (c.head_dim, c.dtype, c.causal) == (hd, dtype, causal))

    rows = max(a for a, _ in SEQS)
    for hd, dt, causal in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True)):
        add(hd, dt, causal, rows)
    for hd, dt, causal, (window, softcap, alibi) in itertools.product((64, 128), HALF_DTYPES, (False, True),
                                                                      [*MODS.values(), ((40, 8), 0.0, False)]):
        add(hd, dt, causal, 300, window=window, softcap=softcap, alibi=alibi)
    add(64, "bf16", True, rows, det=True, window=(32, -1))
    for hd, causal, window in itertools.product((64, 128), (False, True), ((-1, -1), (40, 8), (100, -1))):
        add(hd, "bf16", causal, 700, det=True, window=window)  # test_each_family_varlen_backward's sm90-det
    add(64, "bf16", True, 113, softcap=5.0)
    add(128, "bf16", True, 8192)  # the bench (cli.py bench --kind train)
    add(128, "bf16", True, 16384, window=(1024, -1))
    for hd, causal, (window, softcap, alibi) in itertools.product((64, 128, 256), (False, True), MODS.values()):
        add(hd, "bf16", causal, 211, varlen=False, window=window, softcap=softcap, alibi=alibi)
    return out
