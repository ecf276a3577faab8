"""Traced score_mod / mask_mod compiled into the sm80 family's serving forward, without a GPU: configuration
rules, names, rendering, and nvcc builds for sm_80 and sm_90a without spills."""
from __future__ import annotations

import functools
import itertools
import math
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashgen import abi
from flashgen.checks import Mods
from flashgen.compile import compile_kernel
from flashgen.config import ConfigError, KernelConfig
from flashgen.kernels.serving import modifier_config, serve_config
from flashgen.modifiers import Modifier, ModifierError, trace_mask_mod, trace_score_mod
from flashgen.render import render

torch = pytest.importorskip("torch")
from builds import assert_builds_without_spills  # noqa: E402
from modifier_examples import FakeCuda, examples, plans_without_launch, trace  # noqa: E402

EXAMPLES = examples()


def traced(name: str) -> tuple[Modifier | None, Modifier | None]:
    return trace(EXAMPLES[name])


def config_of(name: str, head_dim: int = 128, dtype: str = "bf16", rows: int = 4096, **features: bool) -> KernelConfig:
    """The kernel flashgen.attention takes for the example (with a block map wherever it has a mask_mod)."""
    score, mask = traced(name)
    return modifier_config(head_dim, dtype, False, rows, "sm80", Mods(score_mod=score, mask_mod=mask), **features)


def test_names_carry_the_digests_and_other_names_stay():
    score, mask = traced("alibi_causal")
    plain = KernelConfig(128, "bf16", False, 128, 64, 8, 2)
    assert plain.name == "fwd_sm80_d128_bf16_full_bm128_bn64_w8_s2" and not plain.serving and not plain.modified
    cfg = KernelConfig(128, "bf16", False, 128, 64, 8, 2, score_mod=score.digest, mask_mod=mask.digest)
    assert cfg.name == f"{plain.name}_sm{score.digest[:8]}_mm{mask.digest[:8]}"
    assert cfg.serving and cfg.modified and cfg.features == ()
    only_mask = KernelConfig(128, "bf16", False, 128, 64, 8, 2, varlen=True, mask_mod=mask.digest)
    assert only_mask.name == f"{plain.name}_vl_mm{mask.digest[:8]}"
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg


def test_config_rules():
    score, mask = traced("alibi_causal")
    with pytest.raises(ConfigError, match="sm90's dense forward: not with varlen"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", varlen=True, mask_mod=mask.digest)
    with pytest.raises(ConfigError, match="softcap or alibi"):
        KernelConfig(128, "bf16", False, 128, 64, 8, 2, score_mod=score.digest, softcap=True)
    with pytest.raises(ConfigError, match="digest"):
        KernelConfig(128, "bf16", False, 128, 64, 8, 2, mask_mod="not a digest")
    # a mask_mod goes with softcap, ALiBi and the window: its -inf is applied before theirs
    KernelConfig(128, "bf16", False, 128, 64, 8, 2, mask_mod=mask.digest, softcap=True, window=True)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_render_pastes_the_expressions(name):
    score, mask = traced(name)
    src = render(config_of(name))
    assert "struct ServeModParams" in src
    assert ("apply_score_mod(acc_s, sp, mp, sq" in src) == (score is not None)
    assert ("apply_mask_mod(acc_s, sp, mp, sq" in src) == (mask is not None)
    if mask is not None:  # after modify_scores: softcap's tanh must not turn its -inf back into a score
        assert src.index("apply_mask_mod(acc_s") > src.index("modify_scores(acc_s")
    for mod in (score, mask):
        if mod is not None:
            assert mod.expr in src
            for slot, c in enumerate(c for m in (score, mask) if m for c in m.captured):
                assert f"{c.arg} = static_cast<const {c.c_type}*>(mp.t{slot}.ptr)" in src
    assert ("from_score" in src) == (score is not None)


def test_kernels_without_modifiers_render_without_them():
    src = render(serve_config(128, "bf16", False, 4096, "sm80", softcap=True))
    assert "ServeModParams" not in src and "apply_score_mod" not in src and "apply_mask_mod" not in src


def test_unknown_digest_and_too_many_tensors_are_refused():
    with pytest.raises(ModifierError, match="was traced"):
        render(KernelConfig(64, "fp16", False, 128, 64, 4, 2, mask_mod="0123456789ab"))
    tabs = [torch.zeros(8, dtype=torch.int32) for _ in range(4)]
    mask = trace_mask_mod(lambda b, h, q, k: (tabs[0][q] == tabs[1][k]) & (tabs[2][q] >= tabs[3][k]))
    render(KernelConfig(64, "fp16", False, 128, 64, 4, 2, mask_mod=mask.digest))  # four: the most a kernel takes
    score = trace_score_mod(lambda s, b, h, q, k: s + torch.zeros(8, 8)[q, k])
    with pytest.raises(ModifierError, match="at most 4"):
        render(KernelConfig(64, "fp16", False, 128, 64, 4, 2, score_mod=score.digest, mask_mod=mask.digest))
    deep = trace_score_mod(lambda s, b, h, q, k: s + torch.zeros(2, 2, 2, 2, 2)[b, h, q, k, k])
    with pytest.raises(ModifierError, match="dimensions"):
        render(KernelConfig(64, "fp16", False, 128, 64, 4, 2, score_mod=deep.digest))


def test_abi_slots():
    from flashgen.modifiers import MAX_CAPTURED, MAX_RANK

    assert abi.SERVE_MOD.offset("t0.ptr") == abi.SERVE.size  # ServeParams first: the combine reads that prefix
    assert abi.SERVE_MOD.size == abi.SERVE.size + (MAX_CAPTURED + 2) * abi.MOD_TENSOR.size  # + the block map's lists
    assert abi.SERVE_MOD.offset("map_num.ptr") == abi.SERVE.size + MAX_CAPTURED * abi.MOD_TENSOR.size
    assert abi.MOD_TENSOR.size == 8 * (1 + MAX_RANK)


# Every example in one of a few kernels (a score_mod with a mask_mod where both), at the tiles serve_config gives
# them: the two heaviest combinations at every head dim, short and long queries (one tile choice for both).
BUILDS = [(name, d, dt, rows) for d, dt in ((32, "fp16"), (64, "bf16"), (96, "fp16"), (128, "bf16"), (256, "fp16"))
          for name, rows in (("softcap_document", 4096), ("relative_prefix_lm", 1))] + [
    ("alibi_causal", 128, "fp16", 4096), ("sliding_window", 64, "fp16", 4096), ("relative_bias", 128, "bf16", 4096)]


def test_short_queries_take_the_dense_tiles():
    assert config_of("document", 128, "bf16", rows=1) == config_of("document", 128, "bf16", rows=4096)
    assert config_of("document", 256, "bf16").block_n == 32


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_modifier_kernels_compile_without_spills(target):
    cfgs = [config_of(name, d, dt, rows) for name, d, dt, rows in BUILDS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, target), cfgs))
    assert all(c.block_map == (traced(name)[1] is not None) for c, (name, *_) in zip(cfgs, BUILDS))
    for k in kernels:
        r = k.resources
        assert not r.spills and r.stack_bytes == 0, f"{k.config.name} ({target}) spills: {r}"


# -- the launch's captured-tensor slots and the public call's routing (no GPU: stand-ins and refusals) ----------

def test_modifier_tail_packs_score_then_mask_tensors():
    import dataclasses

    from flashgen.checks import Mods
    from flashgen.kernels.serving import modifier_tail

    score, mask = traced("alibi_causal")
    doc = traced("document")[1]
    score = dataclasses.replace(score, tensors=(FakeCuda(0x1000, (1,)),))
    doc = dataclasses.replace(doc, tensors=(FakeCuda(0x2000, (2048, 1)),))
    cfg = KernelConfig(128, "bf16", False, 128, 64, 8, 2, score_mod=score.digest, mask_mod=doc.digest)
    tail = modifier_tail(cfg, Mods(score_mod=score, mask_mod=doc), 0)
    assert len(tail) == 6 * abi.MOD_TENSOR.size
    values = abi.SERVE_MOD.tail("t0.ptr").unpack(tail)
    assert values == (0x1000, 1, 0, 0, 0, 0x2000, 2048, 1, 0, 0) + (0,) * 10 + (0,) * 10  # no block map
    with pytest.raises(ValueError, match="not the one"):
        modifier_tail(cfg, Mods(score_mod=score, mask_mod=mask), 0)
    with pytest.raises(ValueError, match="must be on cuda:0"):
        modifier_tail(cfg, Mods(score_mod=traced("alibi_causal")[0], mask_mod=doc), 0)  # the CPU slopes


def test_attention_with_a_modifier_on_meta_tensors_goes_through_the_operator():
    """Meta tensors (with or without autograd) take flashgen::attention_modified's fake implementation; a forced
    family other than sm80 is refused before anything is traced."""
    import flashgen

    q = torch.randn(1, 8, 2, 64, dtype=torch.float16, requires_grad=True)
    k = v = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    causal = EXAMPLES["causal"].mask_mod
    out = flashgen.attention(q.to("meta"), k.to("meta"), v.to("meta"), mask_mod=causal)
    assert out.shape == q.shape and out.is_meta and out.requires_grad
    with torch.no_grad():
        out, lse = flashgen.attention(q.to("meta"), k.to("meta"), v.to("meta"), mask_mod=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 8) and lse.dtype == torch.float32
    with torch.no_grad(), pytest.raises(ValueError, match="families sm80"):
        flashgen.attention(q, k, v, mask_mod=causal, arch="sm89")


def test_traces_are_reused_while_what_the_function_reads_is_unchanged():
    from flashgen.modifiers import trace_cached

    table = torch.zeros(16)
    scale = 2.0

    def mod(score, b, h, q_idx, kv_idx):
        return score * scale + table[kv_idx]

    first = trace_cached(mod, "score")
    assert trace_cached(mod, "score") is first and first.tensors[0] is table
    table.add_(1.0)  # values change in place: the kernel reads them at launch
    assert trace_cached(mod, "score") is first
    table = torch.zeros(16)  # another tensor: its address goes to the kernel
    again = trace_cached(mod, "score")
    assert again is not first and again.tensors[0] is table and again.digest == first.digest
    scale = 3.0  # a constant of the graph
    assert trace_cached(mod, "score").digest != first.digest


def test_traces_follow_tensors_held_in_containers_and_objects():
    from flashgen.modifiers import trace_cached

    tables = [torch.zeros(16), torch.zeros(16)]

    def mod(score, b, h, q_idx, kv_idx, extra=tables):
        return score + tables[0][kv_idx] + extra[1][q_idx]

    first = trace_cached(mod, "score")
    assert trace_cached(mod, "score") is first
    tables[0] = torch.ones(16)  # replaced inside the list: the kernel must get the new address
    again = trace_cached(mod, "score")
    assert again is not first and again.tensors[0] is tables[0]

    class Holder:
        table = torch.zeros(16)

    holder = Holder()

    def reads_an_attribute(score, b, h, q_idx, kv_idx):
        return score + holder.table[kv_idx]

    one = trace_cached(reads_an_attribute, "score")
    holder.table = torch.ones(16)
    assert trace_cached(reads_an_attribute, "score").tensors[0] is holder.table and one.tensors[0] is not holder.table


# -- block maps: the kernel's skipping of empty key tiles and of the mask_mod on full ones ------------------------

def test_block_map_kernels_are_named_and_ruled():
    _, mask = traced("document")
    base = KernelConfig(128, "bf16", False, 128, 32, 8, 2, mask_mod=mask.digest)
    cfg = KernelConfig(128, "bf16", False, 128, 32, 8, 2, mask_mod=mask.digest, block_map=True)
    assert cfg.name == base.name + "_bmap" and cfg.modified and KernelConfig.from_dict(cfg.to_dict()) == cfg
    only_map = KernelConfig(128, "bf16", False, 128, 32, 8, 2, block_map=True)  # a BlockMask without a mask_mod
    assert only_map.modified and only_map.serving and only_map.name.endswith("_full_bm128_bn32_w8_s2_bmap")
    for feature in ("split", "pack_gqa"):
        with pytest.raises(ConfigError, match="block map"):
            KernelConfig(128, "bf16", False, 128, 32, 8, 2, varlen=True, block_map=True, **{feature: True})
    with pytest.raises(ConfigError, match="block map"):
        KernelConfig(128, "bf16", False, 128, 32, 8, 2, varlen=True, block_map=True)
    with pytest.raises(ConfigError, match="not with cluster"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", cluster=True, block_map=True)
    # flashgen.attention's kernel: a block map wherever there is a mask_mod (or a BlockMask), none for a score_mod
    assert config_of("document").block_map and not config_of("alibi").block_map
    assert modifier_config(128, "bf16", False, 4096, "sm80", Mods(block_map=object())).block_map


def test_block_map_render_skips_empty_tiles_and_the_mask_on_full_ones():
    cfg = config_of("softcap_document")
    src = render(cfg)
    assert "constexpr bool BLOCK_MAP = true;" in src
    assert "const KeyTiles kt = key_tiles(mp, sq, kr);" in src and "const int n_blocks = kt.count;" in src
    assert "const int n0 = kt.n0(tile);" in src and "const int n0 = kt.n0(j) + key_off;" in src  # loads and scores: the list
    assert "if (!kt.full(j)) apply_mask_mod(acc_s" in src
    assert "if constexpr (BLOCK_MAP) return __ldg(static_cast<const int*>(mp.map_idx.ptr) + base + j) * BLOCK_N;" in src
    without = render(KernelConfig(cfg.head_dim, cfg.dtype, False, cfg.block_m, cfg.block_n, cfg.num_warps,
                                  cfg.num_stages, score_mod=cfg.score_mod, mask_mod=cfg.mask_mod))
    assert "constexpr bool BLOCK_MAP = false;" in without and "if (!kt.full(j)) apply_mask_mod" in without
    only_map = render(KernelConfig(128, "bf16", False, 128, 32, 8, 2, block_map=True))
    assert "apply_mask_mod" not in only_map and "const int n0 = kt.n0(j) + key_off;" in only_map
    plain = render(serve_config(128, "bf16", False, 4096, "sm80", softcap=True))
    assert "KeyTiles" not in plain and "BLOCK_MAP" not in plain and "(kr.hi - 1 - j) * BLOCK_N" in plain


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_block_map_kernels_compile_without_spills_and_keep_the_skip(target):
    cfgs = [KernelConfig(128, "bf16", True, 128, 32, 8, 2, block_map=True),  # a BlockMask alone, causal
            modifier_config(64, "fp16", False, 4096, "sm80", Mods(window=(40, 0), mask_mod=traced("document")[1])),
            config_of("softcap_document", 256, "bf16")]
    assert cfgs[1].window and cfgs[1].block_map
    assert_builds_without_spills(cfgs, target)


class _FakeList:
    """Stands for a CUDA int32 tensor of the block map's lists: its address, shape and the strides expand gives."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.ptr, self.shape = ptr, shape
        self.device = type("Device", (), {"type": "cuda"})()

    def expand(self, *sizes: int) -> "_FakeList":
        out = _FakeList(self.ptr, tuple(s if w == -1 else w for s, w in zip(self.shape, sizes)))
        out.strides = tuple(0 if s == 1 and w != 1 else c for s, w, c in zip(self.shape, out.shape, self._dense()))
        return out

    def _dense(self) -> tuple[int, ...]:
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return getattr(self, "strides", self._dense())

    def get_device(self) -> int:
        return 0


def test_modifier_tail_packs_the_block_map_lists():
    from flashgen.blockmap import TileLists
    from flashgen.kernels.serving import modifier_tail

    _, mask = traced("causal")
    cfg = KernelConfig(128, "bf16", False, 128, 32, 8, 2, mask_mod=mask.digest, block_map=True)
    held = type("Map", (), {"block": (128, 32), "tile_lists": TileLists(_FakeList(0x3000, (1, 4, 3, 2)),
                                                                          _FakeList(0x4000, (1, 4, 3, 9)))})()
    values = abi.SERVE_MOD.tail("t0.ptr").unpack(modifier_tail(cfg, Mods(mask_mod=mask, block_map=held), 0, 2, 4))
    assert values[:20] == (0,) * 20  # the causal mask reads no tensor
    assert values[20:] == (0x3000, 0, 6, 2, 1, 0x4000, 0, 27, 9, 1)  # batch 1 stands for both: stride 0
    with pytest.raises(ValueError, match="128 x 32 tiles"):
        modifier_tail(cfg, Mods(mask_mod=mask), 0, 2, 4)
    held.block = (64, 32)
    with pytest.raises(ValueError, match="128 x 32 tiles"):
        modifier_tail(cfg, Mods(mask_mod=mask, block_map=held), 0, 2, 4)
    plain = KernelConfig(128, "bf16", False, 128, 32, 8, 2, mask_mod=mask.digest)
    with pytest.raises(ValueError, match="without one"):
        modifier_tail(plain, Mods(mask_mod=mask, block_map=held), 0, 2, 4)


def test_the_kernel_map_of_a_call():
    """ops.kernel_block_map: a BlockMask brought to the kernel's tiles and bounded by causal, or a map built from the
    mask_mod; a BlockMask without a mask_mod must not leave a tile to a mask_mod it does not have."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    from flashgen import ops
    from flashgen.blockmap import EMPTY, from_block_mask, from_mask

    fn = EXAMPLES["document"].mask_mod
    mask = trace_mask_mod(fn)
    cfg = config_of("document")
    bm = fa.create_block_mask(fn, 2, None, 1000, 1000, device="cpu")
    given = from_block_mask(bm)
    got = ops.kernel_block_map(cfg, Mods(mask_mod=mask, block_map=given), True, 2, 4, 1000, 1000, "cpu")
    want = given.retile(cfg.block_m, cfg.block_n).restrict(True, (-1, -1))
    assert got.block == (cfg.block_m, cfg.block_n) and torch.equal(got.states, want.states)
    assert (got.states == EMPTY).sum() > (given.retile(cfg.block_m, cfg.block_n).states == EMPTY).sum()  # causal's
    built = ops.kernel_block_map(cfg, Mods(mask_mod=mask), False, 2, 4, 1000, 1000, "cpu")
    assert torch.equal(built.states, from_mask(mask, 2, 4, 1000, 1000, cfg.block_m, cfg.block_n).states)
    small = from_block_mask(fa.create_block_mask(fn, 2, None, 1000, 1000, device="cpu", BLOCK_SIZE=16))
    with pytest.raises(ValueError, match="multiple of the kernel's tiles"):
        ops.kernel_block_map(cfg, Mods(block_map=small), False, 2, 4, 1000, 1000, "cpu")
    ops.kernel_block_map(cfg, Mods(mask_mod=mask, block_map=small), False, 2, 4, 1000, 1000, "cpu")


def test_a_block_masks_mask_mod_is_the_calls():
    import flashgen

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    from flashgen import api

    causal, doc = EXAMPLES["causal"].mask_mod, EXAMPLES["document"].mask_mod
    bm = fa.create_block_mask(causal, 1, 1, 64, 64, device="cpu")
    assert api._block_mask_mod(bm, None) is causal and api._block_mask_mod(bm, causal) is causal
    noop = fa.BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, seq_lengths=(64, 64))
    assert api._block_mask_mod(noop, None) is None and api._block_mask_mod(noop, doc) is doc
    with pytest.raises(ValueError, match="differs from block_mask.mask_mod"):
        api._block_mask_mod(bm, doc)
    q = torch.randn(1, 64, 2, 64, dtype=torch.float16)
    with torch.no_grad(), pytest.raises(ValueError, match="families sm80"):
        flashgen.attention(q, q, q, block_mask=bm, arch="sm89")  # a BlockMask alone takes the modifier path


# -- export: a modifier kernel as a standalone .cu (its expressions pasted in) and its launch header -------------

MOD_FILE = """\
import torch
doc = torch.zeros(4096, dtype=torch.int32)
slopes = torch.ones(8)


def same_doc(b, h, q_idx, kv_idx):
    return doc[q_idx] == doc[kv_idx]


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def not_traceable(b, h, q_idx, kv_idx):
    return torch.sin(q_idx) > 0
"""

MOD_MAIN = """\
#include "{a}.h"
int main() {{
    ServeModParams p = {{}};
    p.s.f.batch = 1; p.s.f.heads = 1; p.s.f.heads_k = 1; p.s.f.seqlen_q = 128; p.s.f.seqlen_k = 128;
    flashgen::{a}_launch::set_scales(p.s, 0.125);
    static_assert(flashgen::{a}_launch::MOD_PARAMS_BYTES == sizeof(ServeModParams), "the struct's size");
    return (int)flashgen::{a}_launch::launch(p);
}}
"""


def test_export_cli_writes_a_modifier_kernel(tmp_path, capsys):
    import json

    from flashgen import cli

    mods = tmp_path / "mods.py"
    mods.write_text(MOD_FILE)
    out = tmp_path / "out"
    assert cli.main(["export", "--out", str(out), "--score-mod", f"{mods}:alibi", "--mask-mod", f"{mods}:same_doc",
                     "--head-dim", "64", "--causal", "no"]) == 0
    (entry,) = json.loads((out / "manifest.json").read_text())["kernels"]
    cfg = KernelConfig.from_dict(entry["config"])
    assert cfg.score_mod and cfg.mask_mod and cfg.block_map and entry["params"] == "ServeModParams"
    assert entry["params_bytes"] == abi.SERVE_MOD.size and entry["block_map"]
    # names are those of the first function traced to a digest (another test's may come first): dtypes and args
    assert [(c["arg"], c["dtype"], c["rank"]) for c in entry["captured"]] == [("score_mod_t0", "float32", 1),
                                                                              ("mask_mod_t0", "int32", 1)]
    source = (out / f"{cfg.name}.cu").read_text()
    assert entry["modifiers"]["score_mod"]["expr"] in source and entry["modifiers"]["mask_mod"]["expr"] in source
    header = (out / f"{cfg.name}.h").read_text()
    assert "struct ServeModParams" in header and f"launch(const ServeModParams& p" in header
    assert "t0: score_mod_t0 (" in header and "float32, rank 1" in header and "map_idx int32" in header
    assert cli.main(["export", "--out", str(out), "--mask-mod", f"{mods}:same_doc", "--block-map", "no",
                     "--features", "window", "--head-dim", "128", "--dtype", "fp16", "--causal", "yes"]) == 0
    names = [k["kernel"] for k in json.loads((out / "manifest.json").read_text())["kernels"]]
    assert len(names) == 1 and names[0].endswith(f"_win_mm{cfg.mask_mod[:8]}")
    assert cli.main(["export", "--out", str(out), "--mask-mod", f"{mods}:not_traceable"]) == 2
    assert "torch.sin" in capsys.readouterr().err
    assert cli.main(["export", "--out", str(out), "--mask-mod", f"{mods}"]) == 2  # no :FUNC


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the schedule rule asks ptxas)")
def test_export_cli_writes_the_hopper_modifier_kernel(tmp_path, capsys):
    """--arch sm90 with a modifier: the sm90 family's kernel flashgen.attention takes on Hopper (its schedule rule),
    with --features window / sinks where given; features the family does not build are refused."""
    import json

    from flashgen import cli
    from flashgen.kernels.serving import sm90_modifier_config

    mods = tmp_path / "mods.py"
    mods.write_text(MOD_FILE)
    out = tmp_path / "out"
    assert cli.main(["export", "--arch", "sm90", "--out", str(out), "--mask-mod", f"{mods}:same_doc",
                     "--head-dim", "128", "--causal", "no"]) == 0
    (entry,) = json.loads((out / "manifest.json").read_text())["kernels"]
    cfg = KernelConfig.from_dict(entry["config"])
    assert cfg == sm90_modifier_config(128, "bf16", False, Mods(mask_mod=traced_file(mods, "same_doc")))
    assert cfg.family == "sm90" and cfg.block_map and entry["params"] == "Sm90ServeModFwdParams"
    assert entry["targets"] == ["sm_90a"] and "wrote 1 serving kernels" in capsys.readouterr().out
    assert cli.main(["export", "--arch", "sm90", "--out", str(out), "--score-mod", f"{mods}:alibi",
                     "--features", "window,sinks", "--head-dim", "64", "--causal", "yes"]) == 0
    (entry,) = json.loads((out / "manifest.json").read_text())["kernels"]
    assert KernelConfig.from_dict(entry["config"]).features == ("window", "sinks")
    assert cli.main(["export", "--arch", "sm90", "--out", str(out), "--mask-mod", f"{mods}:same_doc",
                     "--features", "varlen"]) == 2
    assert "--features varlen: choose from window,sinks" in capsys.readouterr().err
    assert cli.main(["export", "--arch", "sm90", "--out", str(out), "--mask-mod", f"{mods}:same_doc",
                     "--dtype", "fp8_e4m3"]) == 2
    assert "export --arch sm80" in capsys.readouterr().err


def traced_file(path, func: str):
    from flashgen.modifiers import load_file

    return load_file(f"{path}:{func}", "mask")


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="needs nvcc and g++")
def test_an_exported_modifier_kernel_compiles_and_links(tmp_path):
    from test_export import assert_plain_cpp, compile_cubins, link_app

    from flashgen.export import export_configs

    cfg = config_of("softcap_document", 64, "bf16")
    export_configs([cfg], tmp_path)
    compile_cubins(tmp_path, (cfg.name,))
    link_app(tmp_path, MOD_MAIN.format(a=cfg.name), (cfg.name,))
    assert_plain_cpp(tmp_path / f"{cfg.name}.h")


# -- the tuned store: a kernel tuned for a modifier answers only calls with that modifier ------------------------

def test_problem_keys_carry_the_modifier_digests():
    from flashgen.problem import TuneProblem

    _, mask = traced("document")
    score, _ = traced("alibi")
    plain = TuneProblem("NVIDIA H200", "sm90", "sm80", "bf16", 128, False, 4096)
    modded = TuneProblem("NVIDIA H200", "sm90", "sm80", "bf16", 128, False, 4096, score_mod=score.digest,
                         mask_mod=mask.digest)
    assert modded.key == f"{plain.key}_sm{score.digest}_mm{mask.digest}" and "_sm" not in plain.key
    assert TuneProblem(**modded.to_dict()) == modded
    sm90 = TuneProblem("NVIDIA H200", "sm90", "sm90", "bf16", 128, False, 4096, mask_mod=mask.digest)
    assert sm90.key.startswith("sm90_") and sm90.key.endswith(f"_mm{mask.digest}")
    with pytest.raises(ValueError, match="of family sm80 or sm90"):
        TuneProblem("NVIDIA H200", "sm90", "fp8", "bf16", 128, False, 4096, mask_mod=mask.digest)
    bwd = TuneProblem("NVIDIA H200", "sm90", "sm90", "bf16", 128, False, 4096, pass_="bwd", score_mod=score.digest)
    assert bwd.key.endswith(f"_bwd_sm{score.digest}")


def test_store_lookups_keep_modifier_kernels_to_their_modifiers(tmp_path, monkeypatch):
    from flashgen import ops, resolve, store
    from flashgen.problem import TuneProblem

    gpu, arch = "NVIDIA H200", "sm90"
    _, doc = traced("document")
    _, causal = traced("causal")
    score, _ = traced("alibi")

    def entry(cfg, ms, **mods):
        p = TuneProblem(gpu, arch, "sm80", "bf16", 128, False, 4096, **mods)
        return p.key, {"config": cfg.to_dict(), "kernel": cfg.name, "median_ms": ms, "tflops": 1.0, "trials": 3,
                       "problem": p.to_dict(), "date": "2025-01-01"}

    plain = KernelConfig(128, "bf16", False, 128, 64, 8, 2)
    tuned_doc = KernelConfig(128, "bf16", False, 64, 32, 4, 2, mask_mod=doc.digest, block_map=True)
    tuned_score = KernelConfig(128, "bf16", False, 64, 64, 4, 2, score_mod=score.digest)
    path = store.store_path(gpu, arch, tmp_path)
    store.merge(path, gpu, arch, dict([entry(plain, 1.0), entry(tuned_doc, 0.5, mask_mod=doc.digest),
                                       entry(tuned_score, 0.2, score_mod=score.digest)]))
    look = functools.partial(store.lookup, gpu, arch, 128, "bf16", False, 4096, "sm80", tmp_path)
    assert look() == plain  # the faster modifier kernels never answer a plain call
    assert look(mask_mod=doc.digest) == tuned_doc and look(score_mod=score.digest) == tuned_score
    assert look(mask_mod=causal.digest) is None and look(score_mod=score.digest, mask_mod=doc.digest) is None
    # the dense modifier call takes it (the same call with a window: serve_config's tiles)
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(resolve, "gpu", lambda device: (gpu, arch))
    monkeypatch.setattr(ops, "arch_and_slots", lambda device: (arch, 132))
    resolve.clear()
    try:
        assert ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, Mods(mask_mod=doc), "sm80") == tuned_doc
        assert ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, Mods(mask_mod=causal), "sm80") == config_of("causal")
        windowed = ops.modifier_kernel(0, 128, "bf16", False, 4096, 1, Mods(mask_mod=doc, window=(64, 0)), "sm80")
        assert windowed.window and windowed.block_m == 128
    finally:
        resolve.clear()


# -- the host path end to end, the kernel emulated: what flashgen.attention hands the launch ----------------------

def emulated_launch(cfg, q, k, v, out, lse, *, cu_q, cu_k, max_seqlen_q, max_seqlen_k, num_splits, mods,
                    softmax_scale):
    """launch_prefill's kernel on the host in float64, reading what the kernel reads: the key tiles of the block
    map's lists (templates/sm80/modifiers.cuh.j2, KeyTiles), the mask_mod on PARTIAL tiles only, then causal and
    the window; without a block map every key and the mask_mod on each."""
    batch, sq, heads, d = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    s = q.double().transpose(1, 2) @ k.double().repeat_interleave(heads // heads_k, 2).permute(0, 2, 3, 1)
    s = s * softmax_scale
    b, h = torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1)
    qi, ki = torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1)
    mask = (mods.mask_mod.evaluate(b, h, qi, ki).expand(batch, heads, sq, sk) if mods.mask_mod is not None
            else torch.ones(batch, heads, sq, sk, dtype=torch.bool))
    keep = mask
    if cfg.block_map:
        assert mods.block_map.block == (cfg.block_m, cfg.block_n)
        num, idx = (t.expand(batch, heads, -1, -1) for t in mods.block_map.tile_lists)
        keep = torch.zeros_like(mask)
        for bb, hh, m in itertools.product(range(batch), range(heads), range(num.shape[2])):
            partial, full = (int(x) for x in num[bb, hh, m])
            rows = slice(m * cfg.block_m, (m + 1) * cfg.block_m)
            for j in range(partial + full):
                keys = slice(int(idx[bb, hh, m, j]) * cfg.block_n, (int(idx[bb, hh, m, j]) + 1) * cfg.block_n)
                keep[bb, hh, rows, keys] = True if j >= partial else mask[bb, hh, rows, keys]
    left, right = mods.window
    right = 0 if cfg.causal else right
    if right >= 0:
        keep = keep & (ki <= qi + sk - sq + right)
    if left >= 0:
        keep = keep & (ki >= qi + sk - sq - left)
    out.copy_(softmax_out(s, keep, v, heads).to(out.dtype))


def softmax_out(s, keep, v, heads):
    s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)
    p = torch.exp(s - m) * keep
    l = p.sum(-1, keepdim=True)
    o = (p @ v.double().repeat_interleave(heads // v.shape[2], 2).transpose(1, 2)) / l.clamp_min(1e-300)
    return o.transpose(1, 2)


def reference(q, k, v, keep):
    """Attention in float64 over the scores `keep` (B, H, sq, sk) keeps (no key: O = 0)."""
    s = q.double().transpose(1, 2) @ k.double().repeat_interleave(q.shape[2] // k.shape[2], 2).permute(0, 2, 3, 1)
    return softmax_out(s * 0.125, keep, v, q.shape[2])


@pytest.fixture
def emulated(monkeypatch):
    from flashgen import api, checks, ops

    monkeypatch.setattr(ops, "launch_prefill", emulated_launch)
    plans_without_launch(monkeypatch)
    monkeypatch.setattr(ops, "arch_and_slots", lambda device: ("sm90", 132))
    monkeypatch.setattr(ops, "tuned_modifier", lambda *a: None)
    monkeypatch.setattr(api, "check_dense", lambda q, k, v, window, softcap, alibi, causal: checks.clamp_window(
        checks.check_mods(window, softcap, alibi, causal, q.shape[0], q.shape[2], q.device), q.shape[1], k.shape[1]))


@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 211), (300, 300)])
def test_attention_hands_the_kernel_a_map_that_keeps_the_masks_scores(emulated, sq, sk):
    import flashgen

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(2, n, hh, 64, generator=g).half() for n, hh in ((sq, 8), (sk, 2), (sk, 2)))
    doc = (torch.rand(2, max(sq, sk), generator=g) < 0.02).cumsum(1).to(torch.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(8).view(1, -1, 1, 1)
    qi, ki = torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1)
    keep = same_doc(b, h, qi, ki).expand(2, 8, sq, sk)
    causal = ki <= qi + sk - sq
    blocks = torch.rand(2, 8, -(-sq // 128), -(-sk // 128), generator=g) < 0.5
    sparse = blocks[b, h, qi // 128, ki // 128]
    num = blocks.sum(-1).to(torch.int32)
    idx = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    cases = [
        (dict(mask_mod=same_doc), keep),
        (dict(mask_mod=same_doc, causal=True), keep & causal),
        (dict(mask_mod=same_doc, window_size=(40, 3)), keep & (ki >= qi + sk - sq - 40) & (ki <= qi + sk - sq + 3)),
        (dict(block_mask=fa.create_block_mask(same_doc, 2, None, sq, sk, device="cpu", BLOCK_SIZE=(64, 256))), keep),
        (dict(block_mask=fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(sq, sk))), sparse),
        (dict(block_mask=fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, mask_mod=same_doc,
                                                     seq_lengths=(sq, sk)), causal=True), sparse & keep & causal),
    ]
    for kwargs, kept in cases:
        out = flashgen.attention(q, k, v, softmax_scale=0.125, **kwargs)
        want = reference(q, k, v, kept)
        assert (out.double() - want).abs().max().item() < 2e-3, sorted(kwargs)
