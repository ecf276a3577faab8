"""The backward of traced score_mod / mask_mod / block maps (sm80 family), without a GPU: configuration rules and
names, rendering, nvcc builds for sm_80 and sm_90a without spills, the argument struct's bytes, the transposed block
map, and flashgen.attention's autograd path end to end with the forward and backward kernels emulated on the host from
what they read (the block map's lists both ways, FULL tiles without the mask_mod, the score_mod's derivative)."""
from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
import struct

import pytest

from flashgen import abi
from flashgen.blockmap import FULL, PARTIAL, BlockMap
from flashgen.checks import Mods
from flashgen.config import BwdConfig, ConfigError, bwd_space, default_bwd_config, modifier_bwd_config
from flashgen.kernels import backward as bwd_kernels
from flashgen.modifiers import Modifier
from flashgen.render import render

torch = pytest.importorskip("torch")
from builds import assert_builds_without_spills  # noqa: E402
from modifier_examples import examples, plans_without_launch, trace  # noqa: E402

EXAMPLES = examples()


def traced(name: str) -> tuple[Modifier | None, Modifier | None]:
    return trace(EXAMPLES[name])


def bwd_config_of(name: str, head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                  deterministic: bool = False, arch: str = "sm80", features: tuple[str, ...] = ()) -> BwdConfig:
    """The backward flashgen.attention takes for the example (a block map wherever it has a mask_mod)."""
    score, mask = traced(name)
    return modifier_bwd_config(head_dim, dtype, causal, arch, deterministic, features,
                               score_mod=score.digest if score else "", mask_mod=mask.digest if mask else "",
                               block_map=mask is not None)


# -- configuration and rendering --------------------------------------------------------------------------------

def test_names_carry_the_digests_and_other_backwards_stay():
    score, mask = traced("softcap_document")
    cfg = bwd_config_of("softcap_document", causal=True)
    assert cfg.family == "sm80" and cfg.serving and cfg.modified and cfg.features == ()
    assert cfg.name.endswith(f"_sm{score.digest[:8]}_mm{mask.digest[:8]}_bmap")
    plain = default_bwd_config(128, "bf16", True, "sm80", family="sm80")
    assert not plain.modified and not plain.serving and plain.name.endswith("_det0")
    assert set(plain.to_dict()) == {f.name for f in dataclasses.fields(BwdConfig)} - {"score_mod", "mask_mod",
                                                                                      "block_map", "lse_ahead", "inner_overlap"}
    assert BwdConfig.from_dict(cfg.to_dict()) == cfg and BwdConfig.from_dict(plain.to_dict()) == plain
    # modifier_bwd_config is family sm80's on Hopper too (the sm90 family's: test_sm90_bwd_modifiers.py)
    assert bwd_config_of("document", arch="sm90").family == "sm80"


def test_config_rules():
    score, mask = traced("alibi_causal")
    base = default_bwd_config(64, "fp16", False, "sm80", family="sm80")
    with pytest.raises(ConfigError, match="digest"):
        dataclasses.replace(base, score_mod="XYZ")
    with pytest.raises(ConfigError, match="not varlen"):
        dataclasses.replace(base, mask_mod=mask.digest, varlen=True)
    with pytest.raises(ConfigError, match="softcap or alibi"):
        dataclasses.replace(base, score_mod=score.digest, softcap=True)
    det = dataclasses.replace(default_bwd_config(128, "bf16", False, "sm90", deterministic=True), block_map=True)
    assert det.deterministic and det.block_map  # family sm90 orders a block map's dQ reduces by the host's turns
    with pytest.raises(ConfigError, match="family sm80 builds it"):  # nor at head dim 256 (kv_split)
        dataclasses.replace(default_bwd_config(256, "bf16", False, "sm90"), mask_mod=mask.digest)
    # a mask_mod combines with the other score modifiers (their backward features)
    assert dataclasses.replace(base, mask_mod=mask.digest, softcap=True, alibi=True, window=True).modified


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_render_pastes_the_expressions_and_the_derivative(name):
    score, mask = traced(name)
    src = render(bwd_config_of(name, deterministic=name.startswith("s")))
    assert "struct BwdServeModParams" in src and "struct ModTensor" in src
    assert f"constexpr bool SCORE_MOD = {str(score is not None).lower()};" in src
    assert f"constexpr bool MASK_MOD = {str(mask is not None).lower()};" in src
    assert f"constexpr bool BLOCK_MAP = {str(mask is not None).lower()};" in src
    if score is not None:
        assert f"return {score.expr};" in src and f"grad = {score.grad_expr};" in src
    if mask is not None:
        assert f"return {mask.expr};" in src
    # both loops visit a list: q tiles of the key tile (transposed map), key tiles of the q tile (_dq)
    assert "tile_list(mp.map_t_num, mp.map_t_idx" in src
    assert ("tile_list(mp.map_num, mp.map_idx" in src) == name.startswith("s")


def test_backwards_without_modifiers_render_without_them():
    for cfg in bwd_space(64, "bf16", True)[:2] + bwd_space(128, "fp16", False, True)[:2]:
        for f in ({}, {"softcap": True}, {"window": True, "alibi": True}, {"varlen": True}):
            src = render(dataclasses.replace(cfg, **f))
            assert "BwdServeModParams" not in src and "score_mod_value" not in src and "TileList" not in src


def test_a_score_mod_without_a_derivative_is_refused():
    from flashgen.modifiers import ModifierError

    hand = Modifier.from_cuda("(score * 2.0f)", "score")  # no grad_expr: forward only
    cfg = modifier_bwd_config(64, "bf16", False, score_mod=hand.digest)
    with pytest.raises(ModifierError, match="no derivative"):
        render(cfg)


# Each example at the default tiles of one head dim (cycled through), both dtypes, with and without determinism,
# and the heaviest pairs at every head dim.
BUILDS = ([(name, d, dt, det) for (name, d), dt, det in zip(zip(sorted(EXAMPLES), itertools.cycle((32, 64, 96, 128, 256))),
                                                             itertools.cycle(("bf16", "fp16")),
                                                             itertools.cycle((False, True, False)))]
          + [("relative_prefix_lm", d, "bf16", False) for d in (32, 64, 96, 128, 256)]
          + [("softcap_document", d, "fp16", False) for d in (32, 96, 256)])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_modifier_backwards_compile_without_spills(target):
    cfgs = [bwd_config_of(name, d, dt, deterministic=det) for name, d, dt, det in BUILDS]
    cfgs.append(bwd_config_of("document", 64, "bf16", causal=True, features=("window", "softcap", "alibi")))
    assert_builds_without_spills(cfgs, target)


# -- the argument struct --------------------------------------------------------------------------------------

class _Fake:
    """Stands for a CUDA tensor where only its address, layout and device are read."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.ptr, self.shape = ptr, shape
        self.device = torch.device("cuda", 0)

    def expand(self, *sizes: int) -> "_Fake":
        out = _Fake(self.ptr, tuple(s if s != -1 else n for s, n in zip(sizes, self.shape)))
        out.strides = tuple(0 if n == 1 and s != 1 else st for n, s, st in zip(self.shape, out.shape, self.stride()))
        return out

    def stride(self) -> tuple[int, ...]:
        if hasattr(self, "strides"):
            return self.strides
        out, acc = [], 1
        for n in reversed(self.shape):
            out.insert(0, acc)
            acc *= n
        return tuple(out)

    def data_ptr(self) -> int:
        return self.ptr

    def dim(self) -> int:
        return len(self.shape)

    def get_device(self) -> int:
        return 0


def test_bwd_serve_mod_params_layout_and_packing():
    assert abi.BWD_SERVE_MOD.offset("t0.ptr") == abi.BWD_SERVE.size
    assert abi.BWD_SERVE_MOD.offset("map_t_num.ptr") == abi.BWD_SERVE.size + 6 * abi.MOD_TENSOR.size
    assert abi.BWD_SERVE_MOD.size == abi.BWD_SERVE.size + 8 * abi.MOD_TENSOR.size
    score, mask = traced("relative_prefix_lm")
    cfg = bwd_config_of("relative_prefix_lm", 64)
    rel, prefix = _Fake(0x1000, (4095,)), _Fake(0x2000, (2,))
    lists = ((_Fake(0x3000, (1, 1, 5, 2)), _Fake(0x4000, (1, 1, 5, 7))),
             (_Fake(0x5000, (1, 1, 7, 2)), _Fake(0x6000, (1, 1, 7, 5))))

    class Map:
        block = (cfg.block_m, cfg.block_n)
        tile_lists, transposed_lists = lists

    mods = Mods(score_mod=dataclasses.replace(score, tensors=(rel,)),
                mask_mod=dataclasses.replace(mask, tensors=(prefix,)), block_map=Map())
    tail = bwd_kernels._mod_tail(cfg, mods, 0, 2, 3)
    assert len(tail) == abi.BWD_SERVE_MOD.size - abi.BWD_SERVE.size
    words = struct.unpack(f"={len(tail) // 8}q", tail)
    slot = [words[i * 5:(i + 1) * 5] for i in range(8)]
    assert slot[0] == (0x1000, 1, 0, 0, 0) and slot[1] == (0x2000, 1, 0, 0, 0) and slot[2] == slot[3] == (0,) * 5
    assert slot[4] == (0x3000, 0, 0, 2, 1) and slot[5] == (0x4000, 0, 0, 7, 1)  # batch, heads 1: stride 0
    assert slot[6] == (0x5000, 0, 0, 2, 1) and slot[7] == (0x6000, 0, 0, 5, 1)
    plain = dataclasses.replace(cfg, mask_mod="", block_map=False)
    with pytest.raises(ValueError, match="mask_mod"):
        bwd_kernels._mod_tail(plain, mods, 0, 2, 3)
    # a modifier kernel wants the modifiers, another kernel none
    with pytest.raises(ValueError, match="pass them as serve.mods"):
        bwd_kernels.backward(FakeCompiled(cfg), *(None,) * 6)
    with pytest.raises(ValueError, match="serve.mods must be None"):
        bwd_kernels.backward(FakeCompiled(default_bwd_config(64, "bf16", False)), *(None,) * 6,
                             serve=bwd_kernels.ServeArgs(mods=mods))


def test_transposed_lists_are_the_key_tiles_lists_turned_around():
    g = torch.Generator().manual_seed(3)
    states = torch.randint(0, 3, (2, 1, 5, 7), generator=g).to(torch.int8)
    bm = BlockMap(states, (64, 32), (300, 211))
    num, idx = bm.transposed_lists
    assert tuple(num.shape) == (2, 1, 7, 2) and tuple(idx.shape) == (2, 1, 7, 5)
    for b, n in itertools.product(range(2), range(7)):
        partial, full = (int(x) for x in num[b, 0, n])
        col = states[b, 0, :, n]
        assert [int(m) for m in idx[b, 0, n, :partial]] == [m for m in range(5) if col[m] == PARTIAL]
        assert [int(m) for m in idx[b, 0, n, partial:partial + full]] == [m for m in range(5) if col[m] == FULL]


# -- autograd end to end, the kernels emulated ----------------------------------------------------------------

class FakeCompiled:
    def __init__(self, cfg):
        self.config = cfg


def _grids(batch, heads, sq, sk):
    b, h = torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1)
    qi, ki = torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1)
    return b, h, qi, ki


def _builtin_keep(causal, window, sq, sk):
    """causal and the window, bottom-right aligned (the kernels' masks)."""
    _, _, qi, ki = _grids(1, 1, sq, sk)
    keep = torch.ones(1, 1, sq, sk, dtype=torch.bool)
    left, right = window
    right = 0 if causal else right
    if right >= 0:
        keep = keep & (ki <= qi + sk - sq + right)
    if left >= 0:
        keep = keep & (ki >= qi + sk - sq - left)
    return keep


def _builtin_scores(s, mods, b, h, qi, ki, sq, sk):
    """The built-in softcap (softcap * tanh(s / softcap)) and ALiBi (- slope * |i + sk - sq - j|) after the
    score_mod, as the kernels apply them, and their derivative."""
    g = torch.ones_like(s)
    if mods.softcap:
        t = torch.tanh(s / mods.softcap)
        s, g = mods.softcap * t, 1 - t * t
    if getattr(mods, "alibi", None) is not None or getattr(mods, "alibi_slopes", None) is not None:
        slopes = mods.alibi if isinstance(mods, Mods) else mods.alibi_slopes
        s = s - slopes.double()[h] * (qi + sk - sq - ki).abs()
    return s, g


def _scores(q, k, scale):
    heads, heads_k = q.shape[2], k.shape[2]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    return (q.double().transpose(1, 2) @ k.double().repeat_interleave(heads // heads_k, 2).permute(0, 2, 3, 1)) * scale


def _visited(lists, batch, heads, rows, cols, block_r, block_c, sr, sc):
    """(visited, full) at score granularity (B, H, sr, sc) from a map's lists over tiles of block_r x block_c."""
    num, idx = (t.expand(batch, heads, -1, -1) for t in lists)
    visited = torch.zeros(batch, heads, rows * block_r, cols * block_c, dtype=torch.bool)
    full = torch.zeros_like(visited)
    for bb, hh, r in itertools.product(range(batch), range(heads), range(num.shape[2])):
        partial, nfull = (int(x) for x in num[bb, hh, r])
        for j in range(partial + nfull):
            c = int(idx[bb, hh, r, j])
            cells = (bb, hh, slice(r * block_r, (r + 1) * block_r), slice(c * block_c, (c + 1) * block_c))
            visited[cells] = True
            full[cells] = j >= partial
    return visited[..., :sr, :sc], full[..., :sr, :sc]


def emulated_forward(cfg, q, k, v, out, lse, *, cu_q, cu_k, max_seqlen_q, max_seqlen_k, num_splits, mods,
                     softmax_scale):
    """launch_prefill's kernel in float64 from what it reads: the block map's key tiles, the mask_mod on PARTIAL
    ones, the score_mod on every visited score; out and LSE (+inf where a row keeps no key)."""
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]
    b, h, qi, ki = _grids(batch, heads, sq, sk)
    s = _scores(q, k, softmax_scale)
    if mods.score_mod is not None:
        s = mods.score_mod.evaluate(s, b, h, qi, ki).double()
    s, _ = _builtin_scores(s, mods, b, h, qi, ki, sq, sk)
    mask = (mods.mask_mod.evaluate(b, h, qi, ki).expand(batch, heads, sq, sk) if mods.mask_mod is not None
            else torch.ones(batch, heads, sq, sk, dtype=torch.bool))
    keep = mask
    if cfg.block_map:
        tiles_q, tiles_k = -(-sq // cfg.block_m), -(-sk // cfg.block_n)
        visited, full = _visited(mods.block_map.tile_lists, batch, heads, tiles_q, tiles_k, cfg.block_m, cfg.block_n,
                                 sq, sk)
        keep = visited & (full | mask)
    keep = keep & _builtin_keep(cfg.causal, mods.window, sq, sk)
    s = s.masked_fill(~keep, -math.inf)
    row_lse = torch.logsumexp(s, -1)
    p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
    o = p @ v.double().repeat_interleave(heads // v.shape[2], 2).transpose(1, 2)
    out.copy_(o.transpose(1, 2).to(out.dtype))
    if lse is not None:
        lse.copy_(torch.where(torch.isinf(row_lse), math.inf, row_lse).float())


SEEN: list = []


def emulated_backward(kern, q, k, v, out, dout, lse, softmax_scale=None, dq=None, dk=None, dv=None, dlse=None,
                      serve=None):
    """The sm80 backward in float64 from what it reads: per key tile the q tiles of the transposed block map (FULL
    ones without the mask_mod), S recomputed, the score_mod and its derivative (the traced derivative's graph, whose
    CUDA text the kernel pastes), P = exp(s' - LSE), dS = P (dP - D) d s'/d s. Deterministic: dQ over
    the key tiles of the forward-direction lists instead, which must reach the same scores."""
    cfg, mods = kern.config, serve.mods
    SEEN.append(cfg)
    assert cfg.modified and (mods.score_mod.digest if mods.score_mod else "") == cfg.score_mod
    assert (mods.mask_mod.digest if mods.mask_mod else "") == cfg.mask_mod
    batch, sq, heads, d = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    b, h, qi, ki = _grids(batch, heads, sq, sk)
    s = _scores(q, k, softmax_scale)
    g = torch.ones_like(s)
    if mods.score_mod is not None:  # the derivative's graph: the host's grad_expr
        s, g = (mods.score_mod.evaluate(s, b, h, qi, ki, grad=grad).double() * g for grad in (False, True))
    s, g_builtin = _builtin_scores(s, serve, b, h, qi, ki, sq, sk)
    g = g * g_builtin
    mask = (mods.mask_mod.evaluate(b, h, qi, ki).expand(batch, heads, sq, sk) if mods.mask_mod is not None
            else torch.ones(batch, heads, sq, sk, dtype=torch.bool))
    builtin = _builtin_keep(cfg.causal, serve.window, sq, sk)

    def keep_of(lists, transposed):
        if not cfg.block_map:
            return mask & builtin
        assert mods.block_map.block == (cfg.block_m, cfg.block_n)
        tm, tn = -(-sq // cfg.block_m), -(-sk // cfg.block_n)
        if transposed:
            visited, full = _visited(lists, batch, heads, tn, tm, cfg.block_n, cfg.block_m, sk, sq)
            visited, full = visited.transpose(2, 3), full.transpose(2, 3)
        else:
            visited, full = _visited(lists, batch, heads, tm, tn, cfg.block_m, cfg.block_n, sq, sk)
        return visited & (full | mask) & builtin

    vv = v.double().repeat_interleave(heads // heads_k, 2).transpose(1, 2)
    kk = k.double().repeat_interleave(heads // heads_k, 2).transpose(1, 2)
    qq, do = q.double().transpose(1, 2), dout.double().transpose(1, 2)
    delta = (do * out.double().transpose(1, 2)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.double()

    def grads(keep):
        p = torch.where(keep, torch.exp(s - lse.double()[..., None]), 0.0)
        ds = torch.where(keep, p * (do @ vv.transpose(2, 3) - delta[..., None]) * g, 0.0)
        return p, ds

    p, ds = grads(keep_of(mods.block_map.transposed_lists if cfg.block_map else None, True))
    dv_h = p.transpose(2, 3) @ do
    softmax_scale = d ** -0.5 if softmax_scale is None else softmax_scale
    dk_h = ds.transpose(2, 3) @ qq * softmax_scale
    if cfg.deterministic:
        _, ds = grads(keep_of(mods.block_map.tile_lists if cfg.block_map else None, False))
    dq_h = ds @ kk * softmax_scale
    group = heads // heads_k
    dk_ = dk_h.view(batch, heads_k, group, sk, d).sum(2).transpose(1, 2)
    dv_ = dv_h.view(batch, heads_k, group, sk, d).sum(2).transpose(1, 2)
    return dq_h.transpose(1, 2).to(q.dtype), dk_.to(k.dtype), dv_.to(v.dtype)


@pytest.fixture
def emulated(monkeypatch):
    from flashgen import api, checks, ops

    monkeypatch.setattr(ops, "launch_prefill", emulated_forward)
    plans_without_launch(monkeypatch)
    monkeypatch.setattr(ops, "arch_and_slots", lambda device: ("sm90", 132))
    monkeypatch.setattr(ops, "tuned_modifier", lambda *a: None)
    monkeypatch.setattr(ops, "backward", emulated_backward)
    monkeypatch.setattr(ops, "modifier_backward_kernel", lambda device, d, dt, causal, features, det, sm, mm, bmap,
                        family=None, seqlen=None, gqa_group=1:
                        FakeCompiled(modifier_bwd_config(d, dt, causal, "sm90", det, features, score_mod=sm,
                                                         mask_mod=mm, block_map=bmap)))
    monkeypatch.setattr(api, "check_dense", lambda q, k, v, window, softcap, alibi, causal: checks.clamp_window(
        checks.check_mods(window, softcap, alibi, causal, q.shape[0], q.shape[2], q.device), q.shape[1], k.shape[1]))
    SEEN.clear()


def reference_grads(q, k, v, dout, scale, score_mod, keep):
    """dq, dk, dv of attention in float64 by torch's autograd: the user's score_mod on q.k * scale, then `keep`
    (B, H, sq, sk); a row that keeps no key gives O = 0."""
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]
    b, h, qi, ki = _grids(batch, heads, sq, sk)
    s = _scores(qd, kd, scale)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = (p @ vd.repeat_interleave(heads // v.shape[2], 2).transpose(1, 2)).transpose(1, 2)
    return torch.autograd.grad(o, (qd, kd, vd), dout.double())


@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 211), (300, 300)])
def test_gradients_through_the_emulated_kernels(emulated, sq, sk):
    import flashgen

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(2, n, hh, 64, generator=g).half() for n, hh in ((sq, 8), (sk, 2), (sk, 2)))
    dout = torch.randn(2, sq, 8, 64, generator=g).half()
    doc = (torch.rand(2, max(sq, sk), generator=g) < 0.02).cumsum(1).to(torch.int32)
    slopes = torch.rand(8, generator=g)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 5.0 * torch.tanh(score / 5.0)

    b, h, qi, ki = _grids(2, 8, sq, sk)
    keep = same_doc(b, h, qi, ki).expand(2, 8, sq, sk)
    causal = ki <= qi + sk - sq
    blocks = torch.rand(2, 8, -(-sq // 128), -(-sk // 128), generator=g) < 0.5
    sparse = blocks[b, h, qi // 128, ki // 128]
    num = blocks.sum(-1).to(torch.int32)
    idx = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    everything = torch.ones(2, 8, sq, sk, dtype=torch.bool)

    def capped_alibi(score, b, h, q_idx, kv_idx):  # the built-in softcap and ALiBi as the reference applies them
        return 5.0 * torch.tanh(score / 5.0) - slopes.double()[h] * (q_idx + sk - sq - kv_idx).abs()

    window = (ki >= qi + sk - sq - 40) & (ki <= qi + sk - sq + 3)
    cases = [
        (dict(mask_mod=same_doc), None, keep),
        (dict(mask_mod=same_doc, causal=True, deterministic=True), None, keep & causal),
        (dict(mask_mod=same_doc, window_size=(40, 3)), None, keep & (ki >= qi + sk - sq - 40) & (ki <= qi + sk - sq + 3)),
        (dict(score_mod=alibi), alibi, everything),
        (dict(mask_mod=same_doc, softcap=5.0, alibi_slopes=slopes, window_size=(40, 3)), capped_alibi, keep & window),
        (dict(score_mod=softcap, mask_mod=same_doc, deterministic=True), softcap, keep),
        (dict(block_mask=fa.create_block_mask(same_doc, 2, None, sq, sk, device="cpu", BLOCK_SIZE=(64, 256))),
         None, keep),
        (dict(block_mask=fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(sq, sk))), None, sparse),
        (dict(block_mask=fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, mask_mod=same_doc,
                                                     seq_lengths=(sq, sk)), causal=True, score_mod=alibi),
         alibi, sparse & keep & causal),
    ]
    for kwargs, score_mod, kept in cases:
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = flashgen.attention(qg, kg, vg, softmax_scale=0.125, **kwargs)
        assert out.grad_fn is not None
        out.backward(dout)
        cfg = SEEN[-1]
        assert cfg.deterministic == kwargs.get("deterministic", False) and cfg.block_map == (kwargs.keys() != {"score_mod"})
        assert cfg.softcap == ("softcap" in kwargs) and cfg.alibi == ("alibi_slopes" in kwargs)
        want = reference_grads(q, k, v, dout, 0.125, score_mod, kept)
        for name, got, ref in zip("qkv", (qg.grad, kg.grad, vg.grad), want):
            err = (got.double() - ref).abs().max().item()
            assert err < 2e-2 * max(1.0, ref.abs().max().item()), (sorted(kwargs), name, err)


def test_a_repeated_modifier_call_takes_its_plan_while_what_it_was_made_from_holds(emulated, monkeypatch):
    """The second call of a signature skips the full path (checks, traces, kernel choice, block map) and gives the
    same result, gradients included (a learnable bias's too); a write to the mask's tensor, clear_cache(), a new
    function or a new BlockMask each take the full path again. Against float64 references."""
    import flashgen
    from flashgen import api, blockmap

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    full_paths = []
    full = api._attention_flex
    monkeypatch.setattr(api, "_attention_flex", lambda *a, **kw: full_paths.append(1) or full(*a, **kw))
    api._mod_routes.clear()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 113, h, 64, generator=g).half() for h in (4, 2, 2))
    doc = (torch.rand(2, 113, generator=g) < 0.05).cumsum(1).to(torch.int32)
    bias = torch.randn(113, generator=g)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    b, h, qi, ki = _grids(2, 4, 113, 113)

    def reference(score_mod=None):
        s = _scores(q, k, 0.125)
        s = s if score_mod is None else score_mod(s, b, h, qi, ki)
        s = s.masked_fill(~same_doc(b, h, qi, ki).expand(2, 4, 113, 113), -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        return (p @ v.double().repeat_interleave(2, 2).transpose(1, 2)).transpose(1, 2)

    def check(out, score_mod=None, paths=None):
        assert (out.double() - reference(score_mod)).abs().max().item() < 2e-3
        if paths is not None:
            assert len(full_paths) == paths, full_paths

    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=same_doc), paths=1)
    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=same_doc), paths=1)  # by the plan
    doc[:, 60:] += 1  # a write torch sees: the block map is built again
    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=same_doc), paths=2)
    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=same_doc), paths=2)
    blockmap.clear_cache()
    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=same_doc), paths=3)

    def same_doc_again(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=same_doc_again), paths=4)
    check(flashgen.attention(q, k, v, softmax_scale=0.125, score_mod=biased, mask_mod=same_doc), biased, paths=5)
    check(flashgen.attention(q, k, v, softmax_scale=0.125, score_mod=biased, mask_mod=same_doc), biased, paths=5)
    bias.requires_grad_(True)  # now a learnable bias: the same plan, through autograd, with the bias's gradient
    qg = q.clone().requires_grad_(True)
    out = flashgen.attention(qg, k, v, softmax_scale=0.125, score_mod=biased, mask_mod=same_doc)
    check(out, biased, paths=5)
    out.float().sum().backward()
    q64, bias64 = q.double().requires_grad_(True), bias.detach().double().requires_grad_(True)
    s = (_scores(q64, k, 0.125) + bias64[ki]).masked_fill(~same_doc(b, h, qi, ki).expand(2, 4, 113, 113), -math.inf)
    ref = (torch.softmax(s, -1).nan_to_num(0.0) @ v.double().repeat_interleave(2, 2).transpose(1, 2)).transpose(1, 2)
    ref.sum().backward()
    for got, want in ((qg.grad, q64.grad), (bias.grad, bias64.grad)):
        assert (got.double() - want).abs().max().item() < 2e-2 * max(1.0, want.abs().max().item())
    bias.requires_grad_(False)
    masks = [fa.create_block_mask(same_doc, 2, None, 113, 113, device="cpu", BLOCK_SIZE=128) for _ in range(2)]
    for block_mask, paths in ((masks[0], 6), (masks[0], 6), (masks[1], 7)):
        check(flashgen.attention(q, k, v, softmax_scale=0.125, block_mask=block_mask), paths=paths)
    for step in range(api.MOD_ROUTES_KEPT + 4):  # a mask_mod defined anew each step: few routes kept, the newest
        def fresh(b, h, q_idx, kv_idx):
            return doc[b, q_idx] == doc[b, kv_idx]

        flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=fresh)
        assert len(api._mod_routes) <= api.MOD_ROUTES_KEPT and id(fresh) in next(reversed(api._mod_routes))
    check(flashgen.attention(q, k, v, softmax_scale=0.125, mask_mod=fresh), paths=7 + api.MOD_ROUTES_KEPT + 4)


def test_lse_gradient_and_refusals(emulated):
    import flashgen

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 64, generator=g).half().requires_grad_(True) for _ in range(3))
    causal = EXAMPLES["prefix_lm"].mask_mod  # causal with a prefix: not a band, so the modifier kernels run
    out, lse = flashgen.attention(q, k, v, mask_mod=causal, return_lse=True)
    (out.float().sum() + lse.sum()).backward()  # dlse reaches the backward as D - dlse
    assert q.grad is not None and k.grad is not None and v.grad is not None
    table = torch.ones(37, dtype=torch.bool, requires_grad=False).float().requires_grad_(True)

    def learned_mask(b, h, q_idx, kv_idx):
        return table[kv_idx] > 0

    with pytest.raises(NotImplementedError, match="a mask has no gradient"):
        flashgen.attention(q, k, v, mask_mod=learned_mask)
    with torch.no_grad():
        flashgen.attention(q, k, v, mask_mod=learned_mask)  # no gradient wanted: fine
    with pytest.raises(RuntimeError, match="softmax_scale > 0"):
        flashgen.attention(q, k, v, mask_mod=causal, softmax_scale=-0.1)


@pytest.mark.parametrize("chunk", [1 << 24, 1])
def test_gradients_of_a_learnable_bias(emulated, monkeypatch, chunk):
    """A score_mod reading a float table that requires grad: the table's gradient (flashgen.modifier_grads, torch on
    the host: it runs here for real) against float64 autograd, with a document mask_mod's block map and GQA; one
    query row a pass too. The same call with only the table requiring grad gives the same table gradient."""
    import flashgen
    from flashgen import modifier_grads

    monkeypatch.setattr(modifier_grads, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(1)
    sq, sk = 113, 211
    q, k, v = (torch.randn(2, n, hh, 64, generator=g).half() for n, hh in ((sq, 8), (sk, 2), (sk, 2)))
    dout = torch.randn(2, sq, 8, 64, generator=g).half()
    doc = (torch.rand(2, sk, generator=g) < 0.03).cumsum(1).to(torch.int32)
    bias = (0.5 * torch.randn(8, sq + sk, generator=g)).requires_grad_(True)
    scale_h = torch.rand(8, generator=g).requires_grad_(True)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx + sk - sq] == doc[b, kv_idx]

    def biased(score, b, h, q_idx, kv_idx):
        return score * scale_h[h] + bias[h, kv_idx - q_idx + sq]

    b, h, qi, ki = _grids(2, 8, sq, sk)
    keep = same_doc(b, h, qi, ki).expand(2, 8, sq, sk) & (ki <= qi + sk - sq)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flashgen.attention(qg, kg, vg, softmax_scale=0.125, score_mod=biased, mask_mod=same_doc, causal=True,
                                  return_lse=True)
    dlse = torch.randn(lse.shape, generator=g)
    (out.float() * dout.float()).sum().add((lse.where(torch.isfinite(lse), 0.0) * dlse).sum()).backward()

    def reference(with_lse):
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias, scale_h)]
        qd, kd, vd, bd, sd = leaves
        s = (_scores(qd, kd, 0.125) * sd.view(1, -1, 1, 1) + bd[h, ki - qi + sq]).masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        o = (p @ vd.repeat_interleave(4, 2).transpose(1, 2)).transpose(1, 2)
        total = (o * dout.double()).sum()
        if with_lse:
            total = total + (row_lse.where(torch.isfinite(row_lse), 0.0) * dlse.double()).sum()
        return torch.autograd.grad(total, leaves)

    def close(got, ref, name):
        err = (got.double() - ref).abs().max().item()
        assert err < 2e-2 * max(1.0, ref.abs().max().item()), (name, err)

    for name, got, ref in zip(("dq", "dk", "dv", "dbias", "dscale"), (qg.grad, kg.grad, vg.grad, bias.grad,
                                                                    scale_h.grad), reference(True)):
        close(got, ref, name)
    assert bias.grad.abs().sum() > 0 and scale_h.grad.abs().sum() > 0
    bias.grad = scale_h.grad = None
    out = flashgen.attention(q, k, v, softmax_scale=0.125, score_mod=biased, mask_mod=same_doc, causal=True)
    (out.float() * dout.float()).sum().backward()  # only the tables want grad
    want = reference(False)
    close(bias.grad, want[3], "dbias")
    close(scale_h.grad, want[4], "dscale")
