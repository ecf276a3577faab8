"""A small tuned store of every pass and kind (fwd, bwd, varlen/window, decode) and the calls asked of it: what
tests/test_resolve.py checks flashgen.resolve's choices on. Only store.merge and the config classes are used to
build it, so the same store can be built for any version of the lookups."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from flashgen import store
from flashgen.config import ConfigError, KernelConfig, bwd_space, space

H200 = ("NVIDIA H200", "sm90")
A100 = ("NVIDIA A100-SXM4-80GB", "sm80")


def _fit(cfgs: list, arch: str) -> list:
    return [c for c in cfgs if c.unfit_reason(arch) is None]


def _with(cfgs: list, arch: str, **features: bool) -> list:
    """The configurations that take these features (a dense-only knob refuses them) and fit `arch`."""
    out = []
    for c in cfgs:
        try:
            out.append(dataclasses.replace(c, **features))
        except ConfigError:
            continue
    return _fit(out, arch)


def _entry(problem: dict, cfg, ms: float, **extra) -> dict:
    return {"problem": problem, "kernel": cfg.name, "config": cfg.to_dict(), "median_ms": ms, "tflops": 1.0,
            "trials": 3, **extra}


def _fwd(gpu: tuple[str, str], family: str, cfg, seqlen: int, ms: float, group: int = 1, pass_: str = "fwd") -> tuple:
    p = {"gpu_name": gpu[0], "gpu_arch": gpu[1], "family": family, "dtype": cfg.dtype, "head_dim": cfg.head_dim,
         "causal": cfg.causal, "seqlen": seqlen, "gqa_group": group, "batch_tokens": 16384, "heads_dim_total": 2048,
         "pass_": pass_}
    return f"{pass_}_{family}_d{cfg.head_dim}_{cfg.dtype}_{cfg.causal}_s{seqlen}_g{group}", _entry(p, cfg, ms)


def _varlen(gpu: tuple[str, str], cfg, packed: bool, max_len: int, window: int, ms: float) -> tuple:
    p = {"head_dim": cfg.head_dim, "dtype": cfg.dtype, "causal": cfg.causal, "heads": 16, "heads_k": 16,
         "packed": packed, "num_seqs": 64 if packed else 1, "min_len": 64 if packed else max_len, "max_len": max_len,
         "window": window, "gpu_name": gpu[0], "gpu_arch": gpu[1], "pass_": "varlen"}
    return f"varlen_{cfg.name}_{packed}_{max_len}_{window}", _entry(p, cfg, ms)


def _decode(gpu: tuple[str, str], tile: tuple, heads: tuple[int, int], batch: int, n: int, page: int, splits: int,
            ms: float) -> tuple:
    bm, bn, w, s = tile
    cfg = KernelConfig(128, "bf16", False, bm, bn, w, s, varlen=True, paged=bool(page), pack_gqa=True, split=splits > 1)
    p = {"head_dim": 128, "dtype": "bf16", "heads": heads[0], "heads_k": heads[1], "batch": batch, "cache_len": n,
         "page_size": page, "gpu_name": gpu[0], "gpu_arch": gpu[1], "pass_": "decode"}
    return f"decode_{tile}_{heads}_{batch}_{n}_{page}", _entry(p, cfg, ms, num_splits=splits)


def build(tuned_dir: Path) -> None:
    """Write the H200 and A100 stores into `tuned_dir`."""
    sm90 = _fit(space("sm90", 128, "bf16", True), "sm90")
    sm80 = _fit(space("sm80", 128, "bf16", True), "sm90")
    gqa = _fit([c for c in space("sm90", 128, "bf16", True, gqa_group=4) if getattr(c, "pack_gqa", False)], "sm90")
    entries = dict([
        _fwd(H200, "sm90", sm90[0], 1024, 1.0), _fwd(H200, "sm90", sm90[3], 4096, 2.0),
        _fwd(H200, "sm90", sm90[5], 16384, 5.0), _fwd(H200, "sm80", sm80[1], 4096, 1.5),
        _fwd(H200, "sm80", sm80[2], 16384, 4.0), _fwd(H200, "sm90", gqa[0], 4096, 1.8, group=4),
        _fwd(H200, "sm90", _fit(space("sm90", 64, "fp16", False), "sm90")[2], 2048, 0.5),
    ])
    bwd90 = _fit(bwd_space(128, "bf16", True, family="sm90"), "sm90")
    bwd80 = _fit(bwd_space(128, "bf16", True, family="sm80"), "sm90")
    entries.update(dict([_fwd(H200, "sm90", bwd90[1], 1024, 1.0, pass_="bwd"),
                         _fwd(H200, "sm90", bwd90[4], 16384, 9.0, pass_="bwd"),
                         _fwd(H200, "sm80", bwd80[0], 4096, 0.1, pass_="bwd")]))
    vl = _with([c for c in sm90 if not c.persistent], "sm90", varlen=True)[:3]
    win = _with(sm90, "sm90", window=True)[:2]
    entries.update(dict([_varlen(H200, vl[0], True, 8192, -1, 1.0), _varlen(H200, vl[1], True, 1024, -1, 0.3),
                         _varlen(H200, vl[2], True, 8192, -1, 0.9), _varlen(H200, win[0], False, 16384, 1024, 2.0),
                         _varlen(H200, win[1], False, 16384, 128, 1.0)]))
    entries.update(dict([
        _decode(H200, (16, 32, 1, 2), (32, 8), 32, 8192, 16, 8, 0.3),
        _decode(H200, (32, 64, 2, 3), (32, 8), 32, 8192, 256, 1, 0.4),
        _decode(H200, (16, 64, 1, 2), (32, 8), 1, 131072, 16, 64, 0.5),
        _decode(H200, (32, 128, 2, 2), (32, 8), 32, 8192, 0, 1, 0.2),
        _decode(H200, (32, 32, 2, 2), (32, 32), 32, 8192, 16, 4, 0.3),
        _decode(H200, (32, 32, 1, 3), (32, 8), 8, 2048, 64, 2, 0.25),
    ]))
    store.merge(store.store_path(*H200, tuned_dir), *H200, entries)
    a100 = _fit(space("sm80", 128, "bf16", True), "sm80")
    store.merge(store.store_path(*A100, tuned_dir), *A100, dict([
        _varlen(A100, _with(a100, "sm80", varlen=True)[1], True, 8192, -1, 1.0),
        _varlen(A100, _with(a100, "sm80", varlen=True)[2], True, 512, -1, 1.0),
        _fwd(A100, "sm80", _fit(bwd_space(128, "bf16", True, family="sm80"), "sm80")[2], 2048, 1.0, pass_="bwd"),
    ]))


# The calls asked of the store: (kind, GPU, arguments).
SEQLENS = (None, 1, 700, 1024, 2048, 2896, 3000, 4096, 8192, 11585, 11586, 16384, 10**6)
FWD = [(gpu, (128, "bf16", True, n, family, group)) for gpu in (H200,) for n in SEQLENS
       for family in (None, "sm80", "sm90") for group in (1, 4)] + \
      [(H200, (64, "fp16", False, n, None, 1)) for n in (1, 2048, 10**5)]
BWD = [(gpu, (128, "bf16", causal, n, det)) for gpu in (H200, A100) for causal in (True, False)
       for n in (None, 1, 900, 1024, 4096, 6000, 10**5) for det in (False, True)]
DECODE = [(H200, (128, "bf16", h, hk, b, n, page)) for h, hk in ((32, 8), (32, 32), (16, 16), (64, 8))
          for b, n in ((1, 1024), (2, 100000), (24, 8192), (32, 8192), (8, 2048), (128, 4096))
          for page in (0, 16, 32, 64, 256, 1024)] + [(H200, (64, "bf16", 32, 8, 32, 8192, 16))]
PREFILL = [(gpu, (128, "bf16", causal, q, n, feats, wl)) for gpu in (H200, A100) for causal in (True, False)
           for q, n in ((4096, 4096), (16, 4096), (700, 900), (16384, 16384), (64, 100000))
           for feats, wl in (({"varlen": True}, -1), ({"window": True}, 1024), ({"window": True}, 100),
                             ({"varlen": True, "window": True}, 256), ({"varlen": True, "softcap": True}, -1))]
SERVE_BWD = [(H200, (128, "bf16", causal, feats, det, n)) for causal in (True, False)
             for feats in (("varlen",), ("window",), ("alibi", "varlen"), ("softcap",)) for det in (False, True)
             for n in (900, 16384)]


def answers(ask: dict, use_gpu) -> dict[str, list]:
    """Every call of the lists above through `ask` (kind -> callable(*args) -> a JSON-able answer), the GPU
    switched by `use_gpu(gpu)` (which also forgets what was resolved): kind -> answers, in order."""
    cases = {"fwd": FWD, "bwd": BWD, "serve_bwd": SERVE_BWD, "decode": DECODE, "prefill": PREFILL,
             "untuned_prefill": PREFILL, "tuned_prefill": PREFILL}
    out: dict[str, list] = {}
    for kind, calls in cases.items():
        got = []
        for gpu, args in calls:
            use_gpu(gpu)
            try:
                got.append(ask[kind](*args))
            except Exception as e:  # noqa: BLE001 - a refusal is an answer too
                got.append(f"{type(e).__name__}")
        out[kind] = got
    return out
