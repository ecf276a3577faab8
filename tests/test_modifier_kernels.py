"""Traced score_mod / mask_mod compiled into the sm80 family's serving forward, without a GPU: configuration
rules, names, rendering, and nvcc builds for sm_80 and sm_90a without spills."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashgen import abi
from flashgen.compile import compile_kernel
from flashgen.config import ConfigError, KernelConfig
from flashgen.kernels.serving import serve_config
from flashgen.modifiers import Modifier, ModifierError, trace_mask_mod, trace_score_mod
from flashgen.render import render

torch = pytest.importorskip("torch")
from modifier_examples import examples  # noqa: E402

EXAMPLES = examples()


def traced(name: str) -> tuple[Modifier | None, Modifier | None]:
    ex = EXAMPLES[name]
    return (trace_score_mod(ex.score_mod) if ex.score_mod else None,
            trace_mask_mod(ex.mask_mod) if ex.mask_mod else None)


def config_of(name: str, head_dim: int = 128, dtype: str = "bf16", rows: int = 4096, **features: bool) -> KernelConfig:
    score, mask = traced(name)
    return serve_config(head_dim, dtype, False, rows, "sm80", score_mod=score.digest if score else "",
                        mask_mod=mask.digest if mask else "", **features)


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
    with pytest.raises(ConfigError, match="family sm80"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", mask_mod=mask.digest)
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
    assert abi.SERVE_MOD.size == abi.SERVE.size + MAX_CAPTURED * abi.MOD_TENSOR.size
    assert abi.MOD_TENSOR.size == 8 * (1 + MAX_RANK)


# Every example in one of a few kernels (a score_mod with a mask_mod where both), at the tiles serve_config gives
# them: the two heaviest combinations at every head dim, short and long queries (one tile choice for both).
BUILDS = [(name, d, dt, rows) for d, dt in ((32, "fp16"), (64, "bf16"), (96, "fp16"), (128, "bf16"), (256, "fp16"))
          for name, rows in (("softcap_document", 4096), ("relative_prefix_lm", 1))] + [
    ("alibi_causal", 128, "fp16", 4096), ("sliding_window", 64, "fp16", 4096)]


def test_short_queries_take_the_dense_tiles():
    assert config_of("document", 128, "bf16", rows=1) == config_of("document", 128, "bf16", rows=4096)
    assert config_of("document", 256, "bf16").block_n == 32


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_modifier_kernels_compile_without_spills(target):
    cfgs = [config_of(name, d, dt, rows) for name, d, dt, rows in BUILDS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, target), cfgs))
    for k in kernels:
        r = k.resources
        assert not r.spills and r.stack_bytes == 0, f"{k.config.name} ({target}) spills: {r}"


# -- the launch's captured-tensor slots and the public call's routing (no GPU: stand-ins and refusals) ----------

class _FakeCuda:
    """Stands for a CUDA tensor where only its address and layout are read."""

    def __init__(self, ptr: int, strides: tuple[int, ...]):
        self.ptr, self.strides = ptr, strides
        self.device = type("Device", (), {"type": "cuda"})()

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def dim(self) -> int:
        return len(self.strides)

    def get_device(self) -> int:
        return 0


def test_modifier_tail_packs_score_then_mask_tensors():
    import dataclasses

    from flashgen.checks import Mods
    from flashgen.kernels.serving import modifier_tail

    score, mask = traced("alibi_causal")
    doc = traced("document")[1]
    score = dataclasses.replace(score, tensors=(_FakeCuda(0x1000, (1,)),))
    doc = dataclasses.replace(doc, tensors=(_FakeCuda(0x2000, (2048, 1)),))
    cfg = KernelConfig(128, "bf16", False, 128, 64, 8, 2, score_mod=score.digest, mask_mod=doc.digest)
    tail = modifier_tail(cfg, Mods(score_mod=score, mask_mod=doc), 0)
    assert len(tail) == 4 * abi.MOD_TENSOR.size
    values = abi.SERVE_MOD.tail("t0.ptr").unpack(tail)
    assert values == (0x1000, 1, 0, 0, 0, 0x2000, 2048, 1, 0, 0) + (0,) * 10
    with pytest.raises(ValueError, match="not the one"):
        modifier_tail(cfg, Mods(score_mod=score, mask_mod=mask), 0)
    with pytest.raises(ValueError, match="must be on cuda:0"):
        modifier_tail(cfg, Mods(score_mod=traced("alibi_causal")[0], mask_mod=doc), 0)  # the CPU slopes


def test_attention_with_a_modifier_is_forward_only_and_eager():
    import flashgen

    q = torch.randn(1, 8, 2, 64, dtype=torch.float16, requires_grad=True)
    k = v = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    causal = EXAMPLES["causal"].mask_mod
    with pytest.raises(NotImplementedError, match="no backward"):
        flashgen.attention(q, k, v, mask_mod=causal)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="eagerly"):
        flashgen.attention(q.to("meta"), k.to("meta"), v.to("meta"), mask_mod=causal)
    with torch.no_grad(), pytest.raises(ValueError, match="family sm80"):
        flashgen.attention(q, k, v, mask_mod=causal, arch="sm90")


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
