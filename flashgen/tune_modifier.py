"""Tuning a problem with a score_mod or mask_mod (`tune --score-mod FILE.py:FUNC --mask-mod FILE.py:FUNC`, forward or
`--pass bwd`).

Such a call runs a forward generated with its modifiers (a mask_mod with a block map, flashgen.blockmap): on Hopper
the sm90 family's (kernels.serving.sm90_modifier_config's rule when untuned), elsewhere the sm80 family's serving
forward. Its problem (flashgen.problem.TuneProblem of that family, with the modifiers' digests ending its key) is
searched by the pipeline every kind shares (flashgen.tunable's ModifierKind): family sm80 over the dense space with
those fields set, family sm90 over the schedules of its two-warpgroup tile (`modifier_space`). The modifiers reach the compile
pool and the GPU worker as data, never as Python callables: the `Modifier` of each digest, its CUDA text and its traced
graph without tensors (flashgen.modifiers.registered), which the other process registers before it renders or
evaluates anything. A modifier that reads captured tensors also sends the FILE.py:FUNC it came from (`remember`): the
worker runs that file itself (its tensors on the worker's GPU) and checks that the trace has the same digest.

In the worker a candidate is verified on the problem's verification shape (TuneProblem.verify_shape: batch and heads
cut, lengths kept, so captured tensors indexed by position stay in range) against float64 with the modifiers applied
by their graph (`reference`), into a NaN-poisoned output, then timed on the problem's own shape through the launch the
calls use (kernels.serving.launch_prefill, or the sm90 family's tensor-map launch). A backward problem (`BwdInputs`)
is searched over the family's backward space generated with the modifiers: the call's own forward makes out and LSE,
and dq, dk, dv (poisoned) are checked against float64 gradients by autograd through `reference`.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

from .bench import TrialInputs, median_ms, time_cuda
from .checks import Mods
from .config import BwdConfig, ConfigError, KernelConfig, bwd_space, modifier_bwd_config, space as config_space
from .kernels.backward import ServeArgs, backward, load_backward
from .kernels.modified import run_mod_plan
from .kernels.serving import (MODIFIER_SPILL_SLACK, build_fault, fire_sm90, launch_prefill, serve_config, sm90_launch,
                              sm90_maps, sm90_modifier_bwd_config, sm90_modifier_config)
from .modifiers import Modifier, ModifierError, load_file, lookup, register
from .problem import HeldInputs, TuneProblem
from .tensors import torch_dtype
from .verify import poisoned_error, random_qkv, ref_budget_bytes, ref_chunk_rows


def fields(problem: TuneProblem) -> dict[str, Any]:
    """The KernelConfig fields of the problem's modifiers: the digests, and a block map with a mask_mod (as the
    calls' kernels have: kernels.serving.modifier_config)."""
    return {"score_mod": problem.score_mod, "mask_mod": problem.mask_mod, "block_map": bool(problem.mask_mod)}


def with_modifiers(cfgs: list[KernelConfig], score_mod: str, mask_mod: str) -> list[KernelConfig]:
    """The configurations of a dense sm80 space generated with these modifiers (digests); those the rules refuse
    (pack_gqa beside a block map) or that gain other features are left out, as a call never takes them."""
    out: dict[KernelConfig, None] = {}
    for c in cfgs:
        try:
            m = dataclasses.replace(c, score_mod=score_mod, mask_mod=mask_mod, block_map=bool(mask_mod))
        except ConfigError:
            continue
        if not m.features:
            out[m] = None
    return list(out)


def bwd_with_modifiers(cfgs: list[BwdConfig], score_mod: str, mask_mod: str) -> list[BwdConfig]:
    """The backward configurations generated with these modifiers (a mask_mod with its block map), as a call's
    backward is: not deterministic (a deterministic call takes its rule), no features; those the rules refuse are
    left out."""
    out: dict[BwdConfig, None] = {}
    for c in cfgs:
        if c.deterministic or c.features:
            continue
        try:
            out[dataclasses.replace(c, score_mod=score_mod, mask_mod=mask_mod, block_map=bool(mask_mod))] = None
        except ConfigError:
            continue
    return list(out)


# The sm90 family's modifier space: the dense space's configurations a modifier kernel builds (no O by TMA, cluster
# or, beside a score_mod, epilogue overlap; kernels.serving's rule tiles) narrowed to the rule's tile, 128 query rows in
# two consumer warpgroups and two stages, with 64 or 128 keys, every schedule (in order, overlapped, ping-pong, lazy
# rescaling) persistent or not, and exp2 on the FMA pipe for a quarter of P or none: 48-64 configurations, where
# the whole space has over 5,000.
SM90_MODIFIER_TILE = {"block_m": 128, "num_stages": 2}
SM90_MODIFIER_BLOCK_NS = (64, 128)
SM90_MODIFIER_OFF = ("q_regs", "p_smem", "mma_rowsum", "lpt_by_head", "desc_step", "diag_cut")
SM90_MODIFIER_EXP2_FMA = (0, 1)


def space(problem: TuneProblem) -> list[KernelConfig | BwdConfig]:
    """The problem's candidates (arch fit not checked): modifier_space of its pass, family and modifiers."""
    return modifier_space(problem.family, problem.head_dim, problem.dtype, problem.causal, problem.gqa_group,
                          problem.score_mod, problem.mask_mod, problem.pass_)


def modifier_space(family: str, head_dim: int, dtype: str, causal: bool, gqa_group: int, score_mod: str,
                   mask_mod: str, pass_: str = "fwd") -> list[KernelConfig | BwdConfig]:
    """Forward: family sm80's dense space with the modifiers (digests; with_modifiers), or family sm90's modifier
    space (SM90_MODIFIER_TILE and the other constants above). Backward: the family's backward space with them
    (bwd_with_modifiers), whole: 26-30 configurations at d128."""
    if pass_ == "bwd":
        return bwd_with_modifiers(bwd_space(head_dim, dtype, causal, family=family), score_mod, mask_mod)
    cfgs = with_modifiers(config_space(family, head_dim, dtype, causal, gqa_group), score_mod, mask_mod)
    if family != "sm90":
        return cfgs
    return [c for c in cfgs if all(getattr(c, f) == v for f, v in SM90_MODIFIER_TILE.items())
            and c.block_n in SM90_MODIFIER_BLOCK_NS and not any(getattr(c, f) for f in SM90_MODIFIER_OFF)
            and c.exp2_fma in SM90_MODIFIER_EXP2_FMA]


def compile_reason(problem: TuneProblem, kernel: Any) -> str | None:
    """Why a compiled candidate leaves the space, as the call's rule would refuse it (kernels.serving.build_fault):
    it serializes its wgmmas, or spills (family sm90's forward at head dims up to 128: more than the
    MODIFIER_SPILL_SLACK bytes the rule allows; the backward's rule allows none); None to keep it."""
    forward = problem.pass_ == "fwd"
    slack = MODIFIER_SPILL_SLACK if forward and problem.family == "sm90" and problem.head_dim <= 128 else 0
    return build_fault(kernel, slack)


def default_config(problem: TuneProblem) -> KernelConfig | BwdConfig:
    """What `flashgen.attention` takes for the problem without a stored entry: family sm90's rule
    (kernels.serving.sm90_modifier_config), else serve_config's modifier tiles; for the backward
    sm90_modifier_bwd_config, else config.modifier_bwd_config."""
    if problem.pass_ == "bwd":
        return default_bwd_config(problem)
    if problem.family == "sm90":
        score, mask = modifiers_of(problem)
        cfg = sm90_modifier_config(problem.head_dim, problem.dtype, problem.causal,
                                   Mods(score_mod=score, mask_mod=mask))
        if cfg is None:
            raise ConfigError(f"{problem.key}: family sm90 builds no kernel with these modifiers at head dim "
                              f"{problem.head_dim}, {problem.dtype}")
        return cfg
    return serve_config(problem.head_dim, problem.dtype, problem.causal, problem.seqlen, problem.gpu_arch,
                        **fields(problem))


def default_bwd_config(problem: TuneProblem) -> BwdConfig:
    """The backward a modifier call takes without a stored entry (its family's rule)."""
    block_map = bool(problem.mask_mod)
    if problem.family == "sm90":
        cfg = sm90_modifier_bwd_config(problem.head_dim, problem.dtype, problem.causal, (), False, problem.score_mod,
                                       problem.mask_mod, block_map)
        if cfg is None:
            raise ConfigError(f"{problem.key}: family sm90 builds no backward with these modifiers at head dim "
                              f"{problem.head_dim}, {problem.dtype} (tune it with --arch sm80)")
        return cfg
    return modifier_bwd_config(problem.head_dim, problem.dtype, problem.causal, problem.gpu_arch, False, (),
                               score_mod=problem.score_mod, mask_mod=problem.mask_mod, block_map=block_map)


# digest -> (kind, FILE.py:FUNC) of the modifiers this process loaded that read captured tensors (the CLI's
# `remember`): what the worker loads to have the tensors (a registered Modifier carries none).
_SOURCES: dict[str, tuple[str, str]] = {}
# digest -> the Modifier with its tensors, loaded in this process from its source.
_LOADED: dict[str, Modifier] = {}


def remember(mod: Modifier, spec: str) -> None:
    """Note that `mod` (traced from FILE.py:FUNC `spec`) reads tensors: workers load `spec` (its file's absolute
    path: a worker's working directory may differ) to get them."""
    if mod.captured:
        path, _, name = spec.rpartition(":")
        _SOURCES[mod.digest] = (mod.kind, f"{Path(path).resolve()}:{name}")


def sources(problem: TuneProblem) -> dict[str, tuple[str, str]]:
    """{digest: (kind, FILE.py:FUNC)} of the problem's modifiers that read tensors (what its tasks send the
    worker)."""
    return {d: _SOURCES[d] for d in (problem.score_mod, problem.mask_mod) if d in _SOURCES}


def load_sources(given: dict[str, tuple[str, str]]) -> None:
    """In the worker: load each (kind, FILE.py:FUNC) of `given` (by digest) once, so that modifiers_of returns the
    modifier with its tensors; ModifierError where the file now traces to another digest (it changed)."""
    for digest, (kind, spec) in given.items():
        if digest not in _LOADED:
            mod = load_file(spec, kind)
            if mod.digest != digest:
                raise ModifierError(f"{spec}: traces to {mod.digest}, not the modifier {digest} the problem was "
                                    "tuned with (the file or its tensors' shapes changed)")
            _LOADED[digest] = mod


def modifiers_of(problem: TuneProblem) -> tuple[Modifier | None, Modifier | None]:
    """The problem's (score_mod, mask_mod), with their tensors where loaded here (load_sources), else as registered
    in this process (ModifierError where not)."""
    return tuple(_LOADED.get(d) or lookup(d, kind) if d else None  # type: ignore[return-value]
                 for d, kind in ((problem.score_mod, "score"), (problem.mask_mod, "mask")))


def reference(q: Any, k: Any, v: Any, causal: bool, scale: float, score_mod: Modifier | None,
              mask_mod: Modifier | None, dtype: Any = None) -> tuple[Any, Any]:
    """(out (batch, seqlen_q, heads, d), lse (batch, heads, seqlen_q)) of q (batch, seqlen_q, heads, d) against k, v
    (batch, seqlen_k, heads_k, d) in `dtype` (float64 by default: the reference), with the modifiers applied by their
    graphs (Modifier.evaluate: FlexAttention's units and indices, q_idx and kv_idx from 0) and causal aligned
    bottom-right, as the kernels do; a few query rows at a time so that the scores fit. A row with no key: O = 0,
    LSE = +inf."""
    import torch  # noqa: PLC0415  (the host reference needs torch; the search does not)

    dtype = dtype or torch.float64
    batch, sq, heads, d = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    dev = q.device
    qf = q.to(dtype).transpose(1, 2)
    kf = k.to(dtype).repeat_interleave(heads // heads_k, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(heads // heads_k, dim=2).transpose(1, 2)
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    ki = torch.arange(sk, device=dev).view(1, 1, 1, -1)
    rows = ref_chunk_rows(batch, heads, sq, sk, ref_budget_bytes(dev) // 4)  # the graphs' temporaries too
    outs, lses = [], []
    for r0 in range(0, sq, rows):
        qi = torch.arange(r0, min(sq, r0 + rows), device=dev).view(1, 1, -1, 1)
        s = (qf[:, :, r0:r0 + rows] @ kf.transpose(-1, -2)) * scale
        if score_mod is not None:
            s = score_mod.evaluate(s, b, h, qi, ki).to(dtype).expand(s.shape)
        keep = torch.ones(s.shape, dtype=torch.bool, device=dev)
        if mask_mod is not None:
            keep = keep & mask_mod.evaluate(b, h, qi, ki)
        if causal:
            keep = keep & (ki <= qi + sk - sq)
        s = s.masked_fill(~keep, -math.inf)
        m = s.amax(-1, keepdim=True) if sk else torch.full((*s.shape[:3], 1), -math.inf, device=dev, dtype=dtype)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l_ = p.sum(-1, keepdim=True)
        seen = l_ > 0
        safe = torch.where(seen, l_, torch.ones_like(l_))
        outs.append(torch.where(seen, (p @ vf) / safe, torch.zeros_like(l_)))
        lses.append(torch.where(seen, m + torch.log(safe), torch.full_like(l_, math.inf)).squeeze(-1))
        del s, p, keep
    return torch.cat(outs, dim=2).transpose(1, 2), torch.cat(lses, dim=2)


class Inputs(TrialInputs):
    """A modifier problem's inputs in the GPU worker: a verification set (the problem's verify_shape) with its
    float64 reference and the bar a candidate must meet (twice PyTorch's own error in the dtype), and a timing set
    of the problem's shape. Built once per problem (HeldInputs)."""

    def __init__(self, problem: TuneProblem):
        import torch  # noqa: PLC0415

        self.problem = problem
        self.score_mod, self.mask_mod = modifiers_of(problem)
        self.lse_dtype = torch.float32
        d = problem.head_dim
        self.scale = 1.0 / math.sqrt(d)
        b, sq, sk, h, hk = problem.verify_shape()
        self.check = random_qkv(b, sq, sk, h, hk, d, problem.dtype, 0)
        self.ref = reference(*self.check, problem.causal, self.scale, self.score_mod, self.mask_mod)[0]
        same = reference(*self.check, problem.causal, self.scale, self.score_mod, self.mask_mod,
                         dtype=torch_dtype(problem.dtype))[0].double()
        self.bound = 2 * (same - self.ref).abs().max().item() + 1e-5
        del same
        self.out = torch.empty_like(self.check[0])
        b, sq, sk, h, hk = problem.shape()
        self.timed = random_qkv(b, sq, sk, h, hk, d, problem.dtype, 1)
        self.timed_out = torch.empty_like(self.timed[0])
        torch.cuda.empty_cache()

    def call(self, cfg: KernelConfig, qkv: tuple, out: Any) -> Callable[[], None]:
        """One launch of `cfg` on `qkv` into `out`, its block map (with a mask_mod) built for that shape first."""
        from .ops import kernel_block_map  # noqa: PLC0415  (torch operators: imported in the GPU worker only)

        q, k, v = qkv
        mods = Mods(score_mod=self.score_mod, mask_mod=self.mask_mod)
        if cfg.block_map:
            mods = mods._replace(block_map=kernel_block_map(cfg, mods, cfg.causal, q.shape[0], q.shape[2],
                                                            q.shape[1], k.shape[1], q.device))
        if cfg.family == "sm90":  # the launch a call's plan makes (kernels.modified), into `out`
            run = sm90_launch(cfg, q, k, v, out, num_seqs=q.shape[0], max_seqlen_q=q.shape[1], cu_q=None, cu_k=None,
                              mods=mods, softmax_scale=self.scale)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=self.lse_dtype)
            ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            maps = sm90_maps(run, *ptrs)
            return lambda: fire_sm90(run, *ptrs, out.data_ptr(), lse.data_ptr(), maps)
        return lambda: launch_prefill(cfg, q, k, v, out, None, cu_q=None, cu_k=None, max_seqlen_q=q.shape[1],
                                      max_seqlen_k=k.shape[1], num_splits=1, mods=mods, softmax_scale=self.scale)

    def runner(self, cand: KernelConfig) -> tuple[Callable[[], Any], dict[str, Any]]:
        """One launch on the timing set (what retime times)."""
        return self.call(cand, self.timed, self.timed_out), {"kernel": cand.name}

    def trial(self, cand: KernelConfig, warmup: int, reps: int) -> dict[str, Any]:
        """Verify on the verification set (poisoned output against float64), then time on the problem's shape."""
        err = poisoned_error(self.out, self.ref, self.call(cand, self.check, self.out))
        if not err <= self.bound:  # NaN (an unwritten element) fails too
            return {"status": "verify_failed", "reason": f"max error {err:.3g} > {self.bound:.3g}", "max_err": err,
                    "kernel": cand.name}
        call, info = self.runner(cand)
        return {"status": "ok", "ms": median_ms(time_cuda(lambda i: call(), warmup=warmup, reps=reps)), "max_err": err,
                "reason": "", **info}


def reference_grads(q: Any, k: Any, v: Any, dout: Any, causal: bool, scale: float, score_mod: Modifier | None,
                    mask_mod: Modifier | None, dtype: Any = None) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of `reference` in `dtype` (float64 by default) by autograd through it."""
    import torch  # noqa: PLC0415

    dtype = dtype or torch.float64
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = reference(qq, kk, vv, causal, scale, score_mod, mask_mod, dtype=dtype)[0]
    return torch.autograd.grad(out, (qq, kk, vv), dout.to(dtype))


class BwdInputs(TrialInputs):
    """A modifier problem's backward in the GPU worker: a verification set (verify_shape) with the forward's out
    and LSE made by the call's own forward (ops.modifier_plan of the problem's family), the float64 gradients and
    the bars (twice PyTorch's own error in the dtype per gradient), and a timing set of the problem's shape. A
    candidate writes dq, dk, dv into NaN-poisoned buffers through kernels.backward.backward, as a call's backward
    does (its block map at the candidate's tiles)."""

    def __init__(self, problem: TuneProblem):
        import torch  # noqa: PLC0415

        self.problem = problem
        self.score_mod, self.mask_mod = modifiers_of(problem)
        self.scale = 1.0 / math.sqrt(problem.head_dim)
        self.check = self.inputs(*problem.verify_shape(), seed=0)
        q, k, v, _, _, dout = self.check
        args = (q, k, v, dout, problem.causal, self.scale, self.score_mod, self.mask_mod)
        self.ref = reference_grads(*args)
        same = reference_grads(*args, dtype=torch_dtype(problem.dtype))
        self.bounds = [2 * (s.double() - r).abs().max().item() + 1e-5 for s, r in zip(same, self.ref)]
        del same
        self.grads = tuple(torch.empty_like(t) for t in (q, k, v))
        self.timed = self.inputs(*problem.shape(), seed=1)
        self.timed_grads = tuple(torch.empty_like(t) for t in self.timed[:3])
        torch.cuda.empty_cache()

    def inputs(self, b: int, sq: int, sk: int, h: int, hk: int, seed: int) -> tuple:
        """(q, k, v, out, lse, dout): random q, k, v, dout and the forward's out and LSE."""
        import torch  # noqa: PLC0415

        from .ops import modifier_plan  # noqa: PLC0415  (torch operators: imported in the GPU worker only)

        p = self.problem
        q, k, v = random_qkv(b, sq, sk, h, hk, p.head_dim, p.dtype, seed)
        plan = modifier_plan(q, k, v, p.causal, self.scale, Mods(score_mod=self.score_mod, mask_mod=self.mask_mod),
                             p.family)
        out, lse = run_mod_plan(plan, q, k, v)
        return q, k, v, out, lse, torch.randn_like(q)

    def call(self, cand: BwdConfig, data: tuple, grads: tuple) -> Callable[[], None]:
        """One backward of `cand` on `data` into `grads` (dq, dk, dv)."""
        from .ops import kernel_block_map  # noqa: PLC0415  (torch operators: imported in the GPU worker only)

        q, k, v, out, lse, dout = data
        p = self.problem
        kern = load_backward(p.head_dim, p.dtype, p.causal, config=cand, gpu_arch=p.gpu_arch)
        mods = Mods(score_mod=self.score_mod, mask_mod=self.mask_mod)
        if cand.block_map:
            mods = mods._replace(block_map=kernel_block_map(cand, mods, p.causal, q.shape[0], q.shape[2], q.shape[1],
                                                            k.shape[1], q.device))
        serve = ServeArgs(mods=mods)
        dq, dk, dv = grads
        return lambda: backward(kern, q, k, v, out, dout, lse, self.scale, dq=dq, dk=dk, dv=dv, serve=serve)

    def runner(self, cand: BwdConfig) -> tuple[Callable[[], Any], dict[str, Any]]:
        return self.call(cand, self.timed, self.timed_grads), {"kernel": cand.name}

    def trial(self, cand: BwdConfig, warmup: int, reps: int) -> dict[str, Any]:
        """Verify dq, dk, dv (poisoned) against float64, then time on the problem's shape."""
        import torch  # noqa: PLC0415

        for g in self.grads:
            g.fill_(float("nan"))
        self.call(cand, self.check, self.grads)()
        torch.cuda.synchronize()
        errs = [(g.double() - r).abs().max().item() for g, r in zip(self.grads, self.ref)]
        for name, err, bound in zip(("dq", "dk", "dv"), errs, self.bounds):
            if not err <= bound:  # NaN (an unwritten element) fails too
                return {"status": "verify_failed", "reason": f"{name}: max error {err:.3g} > {bound:.3g}",
                        "max_err": err, "kernel": cand.name}
        call, info = self.runner(cand)
        return {"status": "ok", "ms": median_ms(time_cuda(lambda i: call(), warmup=warmup, reps=reps)),
                "max_err": max(errs), "reason": "", **info}


# The GPU worker's, of the problem it is tuning (forward or backward).
inputs = HeldInputs(lambda problem: BwdInputs(problem) if problem.pass_ == "bwd" else Inputs(problem))


def gpu_trial(problem: TuneProblem, cand: KernelConfig, warmup: int, reps: int,
              mods: tuple[Modifier, ...], given: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """The GPU worker's trial (flashgen.tunable.ModifierKind): the modifiers registered here (those that read
    tensors loaded from their files, `given`), then verify and time."""
    for m in mods:
        register(m)
    load_sources(given or {})
    return inputs.trial(problem, cand, warmup, reps)


def gpu_retime(problem: TuneProblem, cands: list[KernelConfig], rounds: int, warmup: int, reps: int,
               mods: tuple[Modifier, ...], given: dict[str, tuple[str, str]] | None = None) -> list[float]:
    """The GPU worker's side-by-side timing of the leaders."""
    for m in mods:
        register(m)
    load_sources(given or {})
    return inputs.retime(problem, cands, rounds, warmup, reps)


__all__ = ["BwdInputs", "Inputs", "bwd_with_modifiers", "compile_reason", "default_bwd_config", "default_config",
           "fields", "gpu_retime", "gpu_trial", "load_sources", "modifier_space", "modifiers_of", "reference",
           "reference_grads", "remember", "sources", "space", "with_modifiers"]
