"""Traced score_mod / mask_mod and block maps in the sm90 family's forward, without a GPU: configuration rules, the
rendered evaluation order and key-tile list, the parameter block, routing, and nvcc builds for sm_90a without spills
or serialized wgmma."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from flashgen import abi, ops
from flashgen.checks import Mods
from flashgen.config import ConfigError, KernelConfig
from flashgen.kernels import serving
from flashgen.kernels.serving import modifier_values, sm90_modifier_config
from flashgen.modifiers import MAX_CAPTURED, MAX_RANK, trace_mask_mod
from flashgen.render import render

torch = pytest.importorskip("torch")
from conftest import compile_sm90a_clean  # noqa: E402
from modifier_examples import FakeCuda, examples, trace  # noqa: E402

EXAMPLES = examples()
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def mods_of(name: str, **extra) -> Mods:
    score, mask = trace(EXAMPLES[name])
    return Mods(score_mod=score, mask_mod=mask, **extra)


def sm90_cfg(name: str, head_dim: int = 128, dtype: str = "bf16", causal: bool = False, block_n: int = 128,
             **knobs) -> KernelConfig:
    score, mask = trace(EXAMPLES[name])
    return KernelConfig(head_dim, dtype, causal, 128, block_n, 12, 2, "sm90", score_mod=score.digest if score else "",
                        mask_mod=mask.digest if mask else "", block_map=mask is not None, **knobs)


def test_config_rules():
    cfg = sm90_cfg("softcap_document")
    assert cfg.modified and cfg.serving and cfg.family == "sm90" and cfg.name.endswith("_bmap")
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    sm90_cfg("document", window=True, sinks=True, pingpong=True)  # window, sinks and pingpong build with them
    sm90_cfg("document", overlap=True, pingpong=True, lazy_rescale=True, persistent=True)
    sm90_cfg("document", overlap=True, persistent=True, overlap_epilogue=True)  # a mask_mod leaves the scale alone
    for knob in ("cluster", "o_tma"):
        with pytest.raises(ConfigError, match=f"dense forward: not with {knob}"):
            sm90_cfg("alibi", **{knob: True})
    with pytest.raises(ConfigError, match="not with overlap_epilogue"):  # its LSE reads the kernel's scale
        sm90_cfg("alibi", overlap=True, persistent=True, overlap_epilogue=True)
    with pytest.raises(ConfigError, match="not with varlen"):
        sm90_cfg("alibi", varlen=True)
    with pytest.raises(ConfigError):
        sm90_cfg("alibi", dtype="fp8_e4m3")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_render_applies_the_modifiers_on_the_accumulator(name):
    score, mask = trace(EXAMPLES[name])
    src = render(sm90_cfg(name))
    assert "struct Sm90ServeModFwdParams" in src and "(const __grid_constant__ Sm90ServeModFwdParams p)" in src
    assert ("apply_score_mod(acc_s, P, sv, head" in src) == (score is not None)
    assert ("apply_mask_mod(acc_s, P, sv, head" in src) == (mask is not None)
    window = src.index("apply_window(acc_s, m0 + warp_row0")
    if score is not None:  # before the masks, on S times the softmax scale; the softmax then in log2 units only
        assert src.index("apply_score_mod(acc_s") < window and (score.narrow_expr or score.expr) in src
        assert "const float to_score = p.scale_log2 * LN2, scale_log2 = LOG2E;" in src
    else:
        assert "const float scale_log2 = p.scale_log2;" in src and "to_score" not in src
    if mask is not None:  # after the masks (nothing turns its -inf back), skipped on FULL tiles
        assert src.index("if (!kt.full(j)) apply_mask_mod(acc_s") > window and (mask.narrow_expr or mask.expr) in src
        assert "inline constexpr bool BLOCK_MAP = true;" in src
    for slot, c in enumerate(c for m in (score, mask) if m for c in m.captured):
        assert f"const ReadOnly<{c.c_type}> {c.arg}{{static_cast<const {c.c_type}*>(P.t{slot}.ptr)}};" in src
        assert c.layout  # the examples' tensors are small: read at 32-bit offsets
    for m in (score, mask):
        assert m is None or not m.captured or m.narrow_expr not in ("", m.expr)
    # producer and consumers walk one list of key tiles
    assert src.count("const int n0 = kt.n0(j);") == 3  # the producer's loads, softmax_tile and softmax_into
    assert "const int n_blocks = kt.count;" in src


@pytest.mark.parametrize("name", ["relative_prefix_lm", "alibi", "document", "sliding_window"])
def test_render_of_the_overlapped_schedule_applies_them_as_the_softmax_reads_s(name):
    """With overlap the score_mod rewrites S in place once S_j has landed (once per score, before either softmax
    pass; ptxas keeps the P V product in flight), and so does a mask_mod alone that loads per score (document ids)
    on the tiles it decides; softmax_pack applies the other masks per score it reads (a mask_mod alone that reads
    tensors otherwise: its verdicts taken once per tile), the masked variant on tiles the mask_mod decides."""
    score, mask = trace(EXAMPLES[name])
    src = render(sm90_cfg(name, overlap=True, pingpong=True))
    assert src.count("softmax_pack<true>(acc_s, a, m_i, l_i, corr, scale_log2, m0 + warp_row0, n0, sv.seqlen_k, "
                     "win_lo, win_hi, lane, P, sv, head, kt.full(j));") == 1
    mask_in_place = mask is not None and score is None and mask.reads_per_score
    assert ("if (!kt.full(j)) apply_mask_mod(acc_s, P, sv, head, m0 + warp_row0, n0, lane);  // in place: its loads "
            "once" in src) == mask_in_place
    assert ("win_lo || !kt.full(j))" in src) == (mask is not None and not mask_in_place)
    in_place = "apply_score_mod(acc_s, P, sv, head, m0 + warp_row0, n0, lane, to_score);  // in place, once per score"
    assert src.count(in_place) == (score is not None)
    assert "score_mod_at(s[0][nt][e] * to_score, P, sv, head, row, col)" not in src  # not again per read
    # a mask_mod alone that reads tensors (not per score) is decided once per element of the tile (its bits), not
    # again by each pass
    bits = mask is not None and score is None and bool(mask.captured) and not mask_in_place
    assert ("if (MASK && !full) mask_mod_bits(verdicts, P, sv, head, row0, col0, lane);" in src) == bits
    assert ("if (!full && !((verdicts[(nt * 4 + e) / 32] >> ((nt * 4 + e) % 32)) & 1u)) return -INFINITY;"
            in src) == bits
    assert ("if (!full && !mask_mod_at(P, sv, head, row, col)) return -INFINITY;" in src) == (
        mask is not None and not bits and not mask_in_place)
    if mask_in_place:  # read by whole tiles (a block-sparse table, no partial tile): the bits, which take fewer registers
        table = torch.zeros(8, 8, dtype=torch.bool)
        sparse = trace_mask_mod(lambda b, h, q_idx, kv_idx: table[q_idx // 128, kv_idx // 128])
        cfg = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", overlap=True, pingpong=True,
                           mask_mod=sparse.digest, block_map=True)
        assert "mask_mod_bits(verdicts, P, sv, head, row0, col0, lane);" in render(cfg)


def test_kernels_without_modifiers_render_without_them():
    for cfg in (KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True),
                KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", window=True, sinks=True)):
        src = render(cfg)
        for word in ("Sm90ServeModFwdParams", "KeyTiles", "BLOCK_MAP", "apply_score_mod", "apply_mask_mod", "kt.",
                     "to_score", "ModTensor"):
            assert word not in src, (cfg.name, word)


def test_parameter_block_is_the_serving_block_then_the_modifier_slots():
    mod, serve = abi.SM90_SERVE_MOD_FWD, abi.SM90_SERVE_FWD
    for f in serve.fields:  # the serving fields keep their offsets: the templates read them as before
        assert mod.offset(f.path) == f.offset
    assert mod.offset("t0.ptr") == serve.offset("sinks") + 8
    assert mod.offset("map_idx.ptr") - mod.offset("t0.ptr") == (MAX_CAPTURED + 1) * abi.MOD_TENSOR.size
    # the launcher packs the serving fields and modifier_values after them: the same slots as ServeModParams'
    tail = mod.tail("cu_seqlens_q")
    values = [1, 2, 3, 4, 5, 6, 7, 8] + list(range(100, 100 + (MAX_CAPTURED + 2) * (1 + MAX_RANK)))
    packed = tail.pack(*values)
    assert len(packed) == mod.size - mod.offset("cu_seqlens_q")
    start = mod.offset("t0.ptr") - mod.offset("cu_seqlens_q")
    mod_tail = abi.SERVE_MOD.tail("t0.ptr")
    assert packed[start:start + mod_tail.size] == mod_tail.pack(*values[8:])


def test_modifier_values_fill_the_slots_in_capture_order():
    score, _ = trace(EXAMPLES["relative_bias"])
    score = dataclasses.replace(score, tensors=(FakeCuda(0x1000, (1,)),))
    cfg = KernelConfig(64, "fp16", False, 128, 128, 12, 2, "sm90", score_mod=score.digest)
    values = modifier_values(cfg, Mods(score_mod=score), 0, 2, 4)
    assert values == [0x1000, 1, 0, 0, 0] + [0] * (3 * 5) + [0] * 10  # no block map: null lists
    assert serving.modifier_tail(cfg, Mods(score_mod=score), 0) == abi.SERVE_MOD.tail("t0.ptr").pack(*values)
    # the kernel reads the table at 32-bit offsets with stride 1: a table of another layout is refused, not misread
    for strides, shape in (((2,), (7,)), ((1,), (2**31 + 1,))):
        other = dataclasses.replace(score, tensors=(FakeCuda(0x1000, strides, shape),))
        with pytest.raises(ValueError, match="traced with"):
            modifier_values(cfg, Mods(score_mod=other), 0, 2, 4)


def test_sm90_config_refuses_what_the_family_does_not_build():
    assert sm90_modifier_config(128, "bf16", False, mods_of("document", softcap=30.0)) is None
    assert sm90_modifier_config(128, "bf16", False, mods_of("document", alibi=object())) is None
    assert sm90_modifier_config(128, "fp8_e4m3", False, mods_of("document")) is None
    assert sm90_modifier_config(80, "bf16", False, mods_of("document")) is None


def test_a_mask_mod_reading_per_score_takes_the_in_order_schedule_beside_a_score_mod_or_at_d64(monkeypatch):
    """A mask_mod that loads per score (document ids by q_idx and kv_idx) goes in order, at the same block_n, beside
    a score_mod (the overlapped schedule holds its bits beside the next tile's S) and at head dims up to 64; alone from
    d96 it keeps the overlapped schedule, which applies it to S in place. A score_mod that loads per score (a bias
    table) keeps the overlapped schedule, as do modifiers that read per head (ALiBi's slopes) or nothing, and a mask
    read by whole tiles (a block-sparse table: its block map has no partial tile, so it is never evaluated); the
    overlapped schedule rescales O lazily."""
    monkeypatch.setattr(serving, "_builds_clean", lambda cfg, spill_slack=0: True)
    serving._sm90_modifier_config.cache_clear()
    table = torch.zeros(64, 64, dtype=torch.bool)
    block_sparse = trace_mask_mod(lambda b, h, q_idx, kv_idx: table[q_idx // 128, kv_idx // 128])
    picked = {name: sm90_modifier_config(128, "bf16", False, mods_of(name))
              for name in ("relative_bias", "alibi", "document", "sliding_window", "softcap_document")}
    picked["block_sparse"] = sm90_modifier_config(128, "bf16", False, Mods(mask_mod=block_sparse))
    picked["document_d64"] = sm90_modifier_config(64, "bf16", False, mods_of("document"))
    picked["document_d256"] = sm90_modifier_config(256, "bf16", False, mods_of("document"))
    assert {n: (c.block_n, c.overlap) for n, c in picked.items()} == {
        "relative_bias": (128, True), "alibi": (128, True), "document": (128, True), "sliding_window": (128, True),
        "softcap_document": (128, False), "block_sparse": (128, True), "document_d64": (128, False),
        "document_d256": (64, True)}
    assert all(c.lazy_rescale == c.overlap and not c.persistent for c in picked.values())
    assert mods_of("document").mask_mod.loads_on_cut_tiles and not block_sparse.loads_on_cut_tiles
    serving._sm90_modifier_config.cache_clear()


@needs_nvcc
def test_routing_takes_the_sm90_forward_on_hopper(monkeypatch):
    """On Hopper a modifier call takes the sm90 forward where it builds the call, without arch or with arch="sm90",
    and the sm80 family's kernel with arch="sm80" or where sm90 does not build it; arch="sm90" refuses on a GPU of
    another family, where the default is the sm80 family's."""
    monkeypatch.setattr(ops, "arch_and_slots", lambda device: ("sm90", 132))
    monkeypatch.setattr(ops, "tuned_modifier", lambda *a: None)
    assert ops.modifier_kernel(0, 128, "bf16", True, 4096, 1, mods_of("softcap_document")).family == "sm90"
    assert ops.modifier_kernel(0, 128, "bf16", True, 4096, 1, mods_of("softcap_document"), "sm80").family == "sm80"
    assert ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, mods_of("document", softcap=30.0)).family == "sm80"
    cfg = ops.modifier_kernel(0, 128, "bf16", True, 4096, 1, mods_of("softcap_document"), "sm90")
    assert cfg.family == "sm90" and cfg.causal and cfg.block_map and not cfg.overlap  # document ids: in order
    windowed = ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, mods_of("document", window=(64, 0)), "sm90")
    assert windowed.family == "sm90" and windowed.window
    assert ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, mods_of("document"), "sm80").family == "sm80"
    assert ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, mods_of("document", softcap=30.0),
                               "sm90").family == "sm80"
    monkeypatch.setattr(ops, "arch_and_slots", lambda device: ("sm80", 108))
    assert ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, mods_of("document")).family == "sm80"
    with pytest.raises(ValueError, match="needs an sm90 GPU"):
        ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, mods_of("document"), "sm90")


# One kernel per example kind, at the tiles sm90_modifier_config picks: a score_mod over a captured table with a
# mask_mod over another (block map), a score_mod with transcendental arithmetic and a mask over a captured tensor, a
# score_mod over captured slopes with a causal mask_mod at d256, and a mask_mod alone with causal.
BUILDS = [("relative_prefix_lm", 128, "fp16", False), ("softcap_document", 64, "bf16", False),
          ("alibi_causal", 256, "bf16", False), ("sliding_window", 96, "fp16", True)]


@needs_nvcc
def test_sm90_modifier_kernels_compile_without_spills_or_serialized_wgmma():
    cfgs = [sm90_modifier_config(d, dt, causal, mods_of(name)) for name, d, dt, causal in BUILDS]
    # a table read per score beside a mask builds overlapped at 128 keys and ALiBi's slopes at d256 at 64 (the tiles
    # no sequence end cuts share each row's reads and index conversions: emit's split form); document ids beside a
    # score_mod go in order
    assert [(c.block_n, c.overlap) for c in cfgs] == [(128, True), (128, False), (64, True), (128, True)]
    assert all(c.family == "sm90" and c.block_map for c in cfgs)
    overlapped = dataclasses.replace(cfgs[0], block_n=64)
    others = [overlapped, dataclasses.replace(cfgs[1], overlap=True, pingpong=True)]
    # document ids overlapped, their mask applied in place: no verdict bits beside the next S, no spill at 128 keys
    in_place = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", **dict(serving.SM90_OVERLAP),
                            mask_mod=mods_of("document").mask_mod.digest, block_map=True)
    compile_sm90a_clean(cfgs[1:] + others + [dataclasses.replace(overlapped, persistent=True), in_place])
    # the table read beside a mask at 128 keys overlapped: within the spilled bytes the rule takes at d128
    from flashgen.compile import compile_kernel  # noqa: PLC0415
    assert serving.build_fault(compile_kernel(cfgs[0], "sm_90a"), serving.MODIFIER_SPILL_SLACK) is None


SM90_MOD_MAIN = """\
#include "{a}.h"
int main() {{
    Sm90ServeModFwdParams p = {{}};  // tensor maps and slots left empty: this only builds and links
    p.p.batch = 1; p.p.heads = 2; p.p.heads_k = 2; p.p.seqlen_q = 300; p.p.seqlen_k = 300;
    p.num_seqs = 1; p.max_seqlen_q = 300; p.window_left = -1; p.window_right = -1;
    static_assert(flashgen::{a}_launch::MOD_PARAMS_BYTES == sizeof(Sm90ServeModFwdParams), "the struct's size");
    if (flashgen::{a}_launch::grid_x(p.max_seqlen_q, p.p.heads, p.num_seqs) != 6) return 1;
    return (int)flashgen::{a}_launch::launch(p);  // links against the kernel
}}
"""


def test_export_writes_the_rules_kernel_with_its_slots(tmp_path):
    """The kernel flashgen.attention takes on Hopper for a score_mod over a table beside a document mask: its .cu
    (the expressions pasted in) and a header with Sm90ServeModFwdParams, the slots and the block map's lists."""
    import json

    from flashgen.export import export_configs

    cfg = sm90_modifier_config(128, "bf16", False, mods_of("relative_prefix_lm"))
    export_configs([cfg], tmp_path, "sm90")
    (entry,) = json.loads((tmp_path / "manifest.json").read_text())["kernels"]
    assert entry["params"] == "Sm90ServeModFwdParams" and entry["params_bytes"] == abi.SM90_SERVE_MOD_FWD.size
    assert entry["block_map"] and set(entry["modifiers"]) == {"score_mod", "mask_mod"} and entry["targets"] == ["sm_90a"]
    source = (tmp_path / f"{cfg.name}.cu").read_text()  # the expressions as this family emits them (narrowed indices)
    assert "float score_mod_at(" in source and "bool mask_mod_at(" in source and "score_mod_t0[" in source
    header = (tmp_path / f"{cfg.name}.h").read_text()
    assert "struct Sm90ServeModFwdParams" in header and "launch(const Sm90ServeModFwdParams& p" in header
    assert "t0: " in header and "map_idx int32" in header and "cuTensorMapEncodeTiled" in header
    assert "grid_x(p.max_seqlen_q, f.heads, p.num_seqs)" in header


@needs_nvcc
def test_an_exported_sm90_modifier_kernel_compiles_and_links_for_sm90a(tmp_path):
    from test_export import link_app

    from flashgen.export import export_configs

    cfg = sm90_modifier_config(64, "bf16", False, mods_of("softcap_document"))
    export_configs([cfg], tmp_path, "sm90")
    link_app(tmp_path, SM90_MOD_MAIN.format(a=cfg.name), (cfg.name,), ("-gencode", "arch=compute_90a,code=sm_90a"))


def test_persistent_kernels_find_each_tiles_list_in_producer_and_consumers():
    src = render(sm90_cfg("relative_prefix_lm", block_n=64, overlap=True, pingpong=True, persistent=True))
    assert src.count("const KeyTiles kt = key_tiles(P, batch, head, m_block, n_end, n_range);") == 2
    assert src.count("const int n0 = kt.n0(j);") == 3 and src.count("kv_it += n_blocks;") == 2
