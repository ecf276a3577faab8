"""Traced score_mod / mask_mod and block maps in the sm90 family's backward, without a GPU: configuration rules and
names, the rendered evaluation on S^T and the Q-tile list that producer, consumers and dQ writers share, the parameter
block, the choice of schedule and family on Hopper, and nvcc builds for sm_90a without spills or serialized wgmma."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from flashgen import abi, resolve
from flashgen.config import ConfigError, BwdConfig, default_bwd_config
from flashgen.kernels.serving import sm90_modifier_bwd_config
from flashgen.modifiers import MAX_RANK
from flashgen.render import render

torch = pytest.importorskip("torch")
from conftest import compile_sm90a_clean  # noqa: E402
from modifier_examples import examples, trace  # noqa: E402

EXAMPLES = examples()
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def digests(name: str) -> dict:
    score, mask = trace(EXAMPLES[name])
    return dict(score_mod=score.digest if score else "", mask_mod=mask.digest if mask else "",
                block_map=mask is not None)


def sm90_bwd(name: str, head_dim: int = 128, causal: bool = False, deterministic: bool = False) -> BwdConfig:
    base = default_bwd_config(head_dim, "bf16", causal, "sm90", deterministic)
    return dataclasses.replace(base, **digests(name))


def test_config_rules_and_names():
    score, mask = trace(EXAMPLES["softcap_document"])
    cfg = sm90_bwd("softcap_document", causal=True)
    assert cfg.family == "sm90" and cfg.modified and cfg.serving and cfg.features == ()
    assert cfg.name.endswith(f"_sm{score.digest[:8]}_mm{mask.digest[:8]}_bmap")
    assert BwdConfig.from_dict(cfg.to_dict()) == cfg
    assert sm90_bwd("relative_bias", deterministic=True).dq_tma  # deterministic without a block map builds
    dataclasses.replace(cfg, window=True)  # so does a window beside the modifiers
    assert sm90_bwd("document", deterministic=True).block_map  # a block map's turns come from the host
    with pytest.raises(ConfigError, match="not 256"):
        sm90_bwd("document", head_dim=256)
    with pytest.raises(ConfigError, match="softcap or ALiBi"):
        dataclasses.replace(sm90_bwd("document"), softcap=True)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_render_evaluates_the_modifiers_on_s_transposed(name):
    score, mask = trace(EXAMPLES[name])
    cfg = sm90_bwd(name, causal=name.endswith("causal"))
    src = render(cfg)
    assert "struct Sm90ModBwdParams" in src and "struct ModTensor" in src
    for kernel in ("_pre", "", "_convert"):
        assert f"{kernel}(const __grid_constant__ Sm90ModBwdParams p)" in src
    assert "_impl::bwd_main(p.b, p);" in src and "_impl::bwd_pre(p.b);" in src
    assert f"constexpr bool HAS_MASK_MOD = {str(mask is not None).lower()};" in src
    assert f"constexpr bool BLOCK_MAP = {str(mask is not None).lower()};" in src
    assert f"constexpr bool HAS_SCORE_MOD = {str(score is not None).lower()};" in src
    if score is not None:
        assert score.expr in src and f"grad = {score.grad_expr};" in src
    # P^T before dP^T's product where the modifiers compute more than index comparisons; else the one-pass softmax
    p_first = score is not None or any(m.captured for m in (score, mask) if m is not None)
    main = src.split("void bwd_main")[1]
    if p_first:  # S^T, P^T and its derivative (P g in S^T's registers), then dP^T
        assert main.index("s_issue(acc_s, k_rows, q_tile);") < main.index("dp_issue(acc_dp, v_rows, do_tile);")
        assert "sdp(acc_s, acc_dp" not in main
        assert "x = score_mod_at(x * to_score, mp, sv, head, query, key, g) * LOG2E;" in main
        assert "acc_s[nt * 4 + 2 * h + c] = keep ? pr[c] * g : 0.f;" in main
    else:
        assert "sdp(acc_s, acc_dp, k_rows, v_rows, q_tile, do_tile);" in main and "s_issue" not in src
    if mask is not None:  # after the built-in masks, skipped on FULL tiles, without a branch per score where it fits
        assert mask.expr in src
        if not p_first:
            keep = "if (!full && !mask_mod_at(mp, sv, head, m0 + col + c, warp_key0 + lane / 4 + 8 * h)) x = 0.f;"
        elif not mask.captured:  # indices alone: tested with every score, not short-circuit
            keep = "keep &= full | mask_mod_at(mp, sv, head, query, key);"
        elif score is None and cfg.block_m <= 64:  # one pass of its loads a tile, into bits
            assert "mask_mod_bits(keep_bits, mp, sv, head, m0, warp_key0 + lane / 4, lane, full);" in main
            keep = "keep &= ((keep_bits[(4 * nt + 2 * h + c) / 32] >> ((4 * nt + 2 * h + c) % 32)) & 1u) != 0;"
        else:  # beside a score_mod, or 128 queries a tile: the bits' registers would spill
            keep = "keep = keep && (full || mask_mod_at(mp, sv, head, query, key));"
        assert keep in main
    for slot, c in enumerate(c for m in (score, mask) if m for c in m.captured):
        assert f"{c.arg} = static_cast<const {c.c_type}*>(mp.t{slot}.ptr)" in src


def test_producer_consumers_and_dq_writers_walk_one_list():
    src = render(dataclasses.replace(sm90_bwd("document"), dq_tma=True))
    assert "const QTiles qt = q_tiles(mp, batch, head, bi.tile, m_begin, max(0, m_end - m_begin));" in src
    assert "const int m_count = qt.count;" in src
    assert src.count("m0 = qt.at(it) * BLOCK_M;") == 2  # the producer's loads and the consumers' loop
    assert "load_tiles(P, sm, sv, n0, head, head_k, batch, m_begin, m_count, stat0, qt);" in src
    assert "dq_writer(P, sm, warp - 1, stat0, m_begin, m_count, bi.tile, seqlen_k, shift, qt);" in src
    assert "const int t = qt.at(j) - m_begin;  // step j's Q tile: m_begin + t" in src
    assert "else return lo + j;" in src  # without a map: upward, as the dense kernel
    assert "mp.map_t_idx.ptr" in src and "mp.map_t_num.ptr" in src  # the transposed lists: Q tiles per key tile
    atomics = render(sm90_bwd("document"))
    assert atomics.count("dq_add(p, acc_dq, sm.bar_ds_free, stat0, qt, cw, wt, lane,") == 2
    assert "(stat0 + qt.at(j) * BLOCK_M) * HEAD_DIM" in atomics


def test_backwards_without_modifiers_render_without_them():
    for cfg in (default_bwd_config(128, "bf16", True, "sm90"), default_bwd_config(64, "fp16", False, "sm90", True),
                dataclasses.replace(default_bwd_config(128, "bf16", False, "sm90"), window=True, varlen=True)):
        src = render(cfg)
        for word in ("Sm90ModBwdParams", "QTiles", "qt.", "HAS_MASK_MOD", "BLOCK_MAP", "ModTensor", "s_issue",
                     "to_score", "mask_mod_at"):
            assert word not in src, (cfg.name, word)


def test_parameter_block_is_the_sm90_block_then_the_modifier_slots():
    mod, base, sm80 = abi.SM90_MOD_BWD, abi.SM90_BWD, abi.BWD_SERVE_MOD
    for f in base.fields:  # Sm90BwdParams at offset 0: the kernels read it as p.b
        assert mod.offset(f"b.{f.path}") == f.offset
    assert mod.offset("t0.ptr") == base.size
    tail = mod.tail("t0.ptr")  # the slots and both lists, packed as the sm80 backward's, then the turns
    values = list(range(1, 1 + 9 * (1 + MAX_RANK)))  # nine slots: pointer and strides each
    assert tail.pack(*values)[:sm80.tail("t0.ptr").size] == sm80.tail("t0.ptr").pack(*values[:8 * (1 + MAX_RANK)])
    assert mod.size % 128 == 0
    # then the deterministic kernels' turns, one more slot beside the transposed lists
    assert mod.offset("map_t_turn.ptr") == mod.offset("map_t_idx.ptr") + 8 * (1 + MAX_RANK)
    assert mod.offset("map_t_turn.ptr") - mod.offset("t0.ptr") == sm80.size - sm80.offset("t0.ptr")


def test_sm90_bwd_config_refuses_what_the_family_does_not_build():
    # no compile needed: each refusal leaves no candidate
    for args in ((128, "bf16", False, ("softcap",), False, "", digests("document")["mask_mod"], True),
                 (128, "bf16", False, ("alibi",), False, "", digests("document")["mask_mod"], True),
                 (256, "bf16", False, (), False, *digests("document").values()),
                 (160, "bf16", False, (), False, *digests("relative_bias").values())):
        assert sm90_modifier_bwd_config(*args) is None, args


@needs_nvcc
def test_routing_takes_the_sm90_backward_on_hopper(monkeypatch):
    """On Hopper the modifier backward is the sm90 family's where it builds the call, without a family or with
    "sm90"; the sm80 family's with family "sm80", for what sm90 does not build, and on other GPUs."""
    monkeypatch.setattr(resolve, "gpu", lambda device: ("NVIDIA H200", "sm90"))
    monkeypatch.setattr(resolve, "_load_backward", lambda d, dt, causal, cfg, arch, det: cfg)
    mask = digests("document")

    def kernel(family=None, features=(), deterministic=False, head_dim=128, **mods):
        mods = mods or mask
        return resolve.modifier_backward_kernel(0, head_dim, "bf16", True, features, deterministic, mods["score_mod"],
                                                mods["mask_mod"], mods["block_map"], family)

    assert kernel().family == "sm90" and kernel("sm90").family == "sm90" and kernel().block_map
    assert kernel(features=("window",)).window and kernel(features=("window",)).family == "sm90"
    assert kernel("sm80").family == "sm80"
    assert kernel(features=("softcap",)).family == "sm80"
    det_map = kernel(deterministic=True)  # a block map's dQ order: the host's turns
    assert det_map.family == "sm90" and det_map.block_map and det_map.dq_tma
    det = kernel(deterministic=True, **digests("relative_bias"))
    assert det.family == "sm90" and det.deterministic and det.dq_tma
    assert kernel(head_dim=256).family == "sm80"
    monkeypatch.setattr(resolve, "gpu", lambda device: ("NVIDIA A100", "sm80"))
    assert kernel().family == "sm80" and kernel("sm90").family == "sm80"


def test_a_modifier_loading_per_score_takes_the_64_key_tiles_first_at_d64(monkeypatch):
    """At d64 a mask_mod or score_mod that loads per score (document ids, a bias table) tries 64 x 64 first; masks
    of indices alone (prefix LM, a window) keep the 128 x 128 tiles; d128 keeps its order for both."""
    from flashgen.kernels import serving  # noqa: PLC0415

    monkeypatch.setattr(serving, "_builds_clean", lambda cfg, spill_slack=0: True)
    tiles = {(name, d): (lambda c: (c.block_m, c.block_n))(
        sm90_modifier_bwd_config(d, "bf16", False, (), False, *digests(name).values()))
        for name in ("document", "relative_bias", "prefix_lm", "sliding_window") for d in (64, 128)}
    assert tiles == {("document", 64): (64, 64), ("relative_bias", 64): (64, 64), ("prefix_lm", 64): (128, 128),
                     ("sliding_window", 64): (128, 128), ("document", 128): (64, 128),
                     ("relative_bias", 128): (64, 128), ("prefix_lm", 128): (64, 128),
                     ("sliding_window", 128): (64, 128)}


def test_a_d128_mask_mod_backward_adds_dq_by_the_bulk_reduce(monkeypatch):
    """At d128 a backward with a block map and no score_mod takes dq_tma (the tuner's winner on three masks), and the
    same tile without it where dq_tma does not build clean; a score_mod, d64 and deterministic keep their rules."""
    from flashgen.kernels import serving  # noqa: PLC0415

    monkeypatch.setattr(serving, "_builds_clean", lambda cfg, spill_slack=0: True)

    def rule(name, d=128, det=False):
        return sm90_modifier_bwd_config(d, "bf16", False, (), det, *digests(name).values())

    for name in ("document", "prefix_lm", "sliding_window"):
        c = rule(name)
        assert c.dq_tma and not c.deterministic and (c.block_m, c.block_n, c.num_stages) == (64, 128, 3), c.name
        assert not rule(name, 64).dq_tma and rule(name, det=True).dq_tma
    assert not rule("relative_bias").dq_tma and not rule("relative_prefix_lm").dq_tma
    monkeypatch.setattr(serving, "_builds_clean", lambda cfg, spill_slack=0: not cfg.dq_tma)
    c = rule("prefix_lm")
    assert not c.dq_tma and (c.block_m, c.block_n, c.num_stages) == (64, 128, 3)


# The brief's examples at d64 and d128: a score_mod over a captured table (relative bias), one with transcendental
# arithmetic (softcap), a mask over a captured tensor with its block map (document), a causal mask_mod.
BUILDS = [("relative_bias", False), ("softcap", False), ("document", False), ("causal", True)]


@needs_nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_modifier_backwards_compile_without_spills_or_serialized_wgmma(head_dim):
    cfgs = [sm90_modifier_bwd_config(head_dim, "bf16", causal, (), False, *digests(name).values())
            for name, causal in BUILDS]
    assert all(c is not None and c.family == "sm90" for c in cfgs), cfgs
    kernels = compile_sm90a_clean(cfgs)
    for k in kernels:
        for code in ("C7512", "C7519", "C7520"):
            assert code not in k.ptxas_log, (k.name, k.ptxas_log)


@needs_nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_deterministic_block_map_backwards_build_clean_with_ordered_reduces(head_dim):
    """deterministic=True with a block map (a mask_mod's map, causal or not) in the sm90 family: the turns read from
    the host's table beside the map's lists, the grid counted down, no spills or serialized wgmma, and each reduce
    waits for its turn and counts after its writes."""
    from test_bwd_config import _assert_ordered_reduces

    cfgs = [sm90_modifier_bwd_config(head_dim, "bf16", causal, (), True, *digests(name).values())
            for name, causal in (("document", False), ("causal", True), ("prefix_lm", False))]
    assert all(c is not None and c.family == "sm90" and c.block_map and c.dq_tma for c in cfgs), cfgs
    src = render(cfgs[0])
    assert "constexpr bool SPT = DETERMINISTIC && (IS_CAUSAL || WINDOW || BLOCK_MAP);" in src
    assert "(BLOCK_MAP ? qt.turn(j) : dq_turn(P, n_block, m_begin + t, seqlen_k, shift)) * CONSUMERS;" in src
    assert "mp.map_t_turn.ptr) + base + j" in src
    for k in compile_sm90a_clean(cfgs):
        _assert_ordered_reduces(k)
