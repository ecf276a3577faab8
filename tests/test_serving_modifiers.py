"""score_mod / mask_mod in attention_varlen and attention_with_kvcache without a GPU: the argument checks and
refusals (meta tensors), the kernels the calls take (generated with the modifiers, no block map; launches stood in
for), the KV cache's query positions in the rendered source, and nvcc builds of the varlen / paged / split / pack_gqa
kernels with modifiers for sm_80 without spills."""
from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import api, ops  # noqa: E402
from flashgen.checks import Mods  # noqa: E402
from flashgen.kernels.serving import modifier_config, serve_config  # noqa: E402
from flashgen.render import render  # noqa: E402
from builds import assert_builds_without_spills  # noqa: E402
from modifier_examples import examples, trace  # noqa: E402

BF16 = torch.bfloat16
EX = examples()
CAUSAL, ALIBI = EX["causal"].mask_mod, EX["alibi"].score_mod


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def cu(*vals):
    return torch.tensor(vals, dtype=torch.int32, device="meta")


def varlen(q=None, **kw):
    q = meta(8, 8, 64) if q is None else q
    k = meta(8, 2, 64)
    return flashgen.attention_varlen(q, k, k, cu(0, 4, 8), cu(0, 4, 8), 4, 4, **{"validate": False, **kw})


def kvcache(q=None, **kw):
    q = meta(2, 1, 8, 64) if q is None else q
    kc = meta(2, 64, 2, 64)
    kw.setdefault("cache_seqlens", cu(10, 20))
    return flashgen.attention_with_kvcache(q, kc, kc, **kw)


@pytest.mark.parametrize("call", [varlen, kvcache])
@pytest.mark.parametrize("kw, err, match", [
    (dict(block_mask=object()), NotImplementedError, "takes no block_mask"),
    (dict(mask_mod=CAUSAL, block_mask=object()), NotImplementedError, "takes no block_mask"),
    (dict(mask_mod=CAUSAL, learnable_sink=meta(8, dtype=torch.float32)), ValueError,
     "learnable_sink does not combine with score_mod or mask_mod"),
    (dict(score_mod=ALIBI, softcap=10.0), ValueError, "does not combine with softcap or alibi_slopes"),
    (dict(score_mod=ALIBI, alibi_slopes=meta(8, dtype=torch.float32)), ValueError, "does not combine with softcap"),
    (dict(mask_mod=CAUSAL), NotImplementedError, "eagerly only"),  # meta tensors: the fake path has no modifier
])
def test_refusals(call, kw, err, match):
    with pytest.raises(err, match=match):
        call(**kw)


def test_without_modifiers_the_fake_path_still_answers():
    assert varlen().shape == (8, 8, 64)


class Launches:
    """Stands in for the GPU: the calls' kernel choices recorded, nothing launched."""

    def __init__(self, monkeypatch):
        self.cfgs: list = []
        monkeypatch.setattr(api, "traced", lambda q: False)  # meta tensors taken as eager ones
        monkeypatch.setattr(api, "arch_and_slots", lambda device: ("sm80", 108))
        monkeypatch.setattr(ops, "arch_and_slots", lambda device: ("sm80", 108))
        monkeypatch.setattr(api, "kvcache_launch", lambda cfg, splits, *a, **k: self.cfgs.append((cfg, splits)))
        monkeypatch.setattr(ops, "launch_prefill", lambda cfg, *a, **k: self.cfgs.append((cfg, k["num_splits"])))
        monkeypatch.setattr(api, "tuned_decode", lambda *a: pytest.fail("a modifier call read the decode store"))


@pytest.mark.parametrize("name", ["alibi_causal", "softcap_document", "relative_bias", "sliding_window"])
def test_the_calls_take_kernels_generated_with_their_modifiers(monkeypatch, name):
    got = Launches(monkeypatch)
    ex = EX[name]
    score, mask = trace(ex)
    digests = (score.digest if score else "", mask.digest if mask else "")
    plans = dict(api._kv_plans)
    with torch.no_grad():
        varlen(score_mod=ex.score_mod, mask_mod=ex.mask_mod, causal=True)
        kvcache(score_mod=ex.score_mod, mask_mod=ex.mask_mod, num_splits=0)  # decode step, GQA: pack_gqa
        kvcache(q=meta(2, 5, 8, 64), score_mod=ex.score_mod, mask_mod=ex.mask_mod, num_splits=3,
                block_table=torch.zeros(2, 4, dtype=torch.int32, device="meta"),
                cache_seqlens=cu(30, 40))
    (vl, _), (kv, _), (paged, splits) = got.cfgs
    for cfg in (vl, kv, paged):
        assert (cfg.score_mod, cfg.mask_mod) == digests and not cfg.block_map and cfg.varlen and cfg.family == "sm80"
    assert vl.causal and not vl.paged and kv.pack_gqa and paged.paged and paged.split and splits == 3
    assert api._kv_plans == plans  # a modifier call makes no plan (its tensors are the call's)


def test_varlen_with_modifiers_has_no_backward(monkeypatch):
    Launches(monkeypatch)
    with pytest.raises(NotImplementedError, match="forward only"):
        varlen(q=meta(8, 8, 64).requires_grad_(), mask_mod=CAUSAL)
    with torch.no_grad():
        varlen(q=meta(8, 8, 64).requires_grad_(), mask_mod=CAUSAL)  # no gradient wanted: runs
    bias = torch.zeros(64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="forward only: a tensor it reads requires grad"):
        kvcache(score_mod=lambda s, b, h, qi, ki: s + bias[ki])
    keep = torch.ones(64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="a mask has no gradient"):
        varlen(mask_mod=lambda b, h, qi, ki: keep[ki] > 0)
    with pytest.raises(RuntimeError, match="no backward for KV-cache attention"):
        kvcache(q=meta(2, 1, 8, 64).requires_grad_(), mask_mod=CAUSAL)


def kernels(name: str, d: int, dtype: str = "bf16", **features: bool):
    score, mask = trace(EX[name])
    fields = dict(score_mod=score.digest if score else "", mask_mod=mask.digest if mask else "")
    return serve_config(d, dtype, features.pop("causal", False), features.pop("rows", 1024), "sm80", varlen=True,
                        **features, **fields)


def test_a_kv_cache_kernel_places_its_queries_at_the_cache_end():
    """Varlen and KV-cache kernels (VARLEN) take q_idx = row + seqlen_k - seqlen_q where seqused_k is given (a
    cache), the row where not (a packed batch); dense modifier kernels keep the row alone."""
    kv = render(kernels("softcap_document", 128, paged=True, pack_gqa=True, rows=4))
    assert "sp.seqused_k != nullptr ? sq.seqlen_k - sq.seqlen_q : 0" in kv
    assert "const int q_idx = max(min(sq.qi(r), sq.seqlen_q - 1) + q_pos0, 0);" in kv
    score, mask = trace(EX["softcap_document"])
    dense = render(modifier_config(128, "bf16", False, 1024, "sm80", Mods(score_mod=score, mask_mod=mask)))
    assert "q_pos0" not in dense and "const int q_idx = min(sq.qi(r), sq.seqlen_q - 1);" in dense


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_varlen_and_kvcache_modifier_kernels_build_without_spills():
    cfgs = [kernels("softcap_document", 64, "fp16", causal=True),
            kernels("relative_prefix_lm", 128),
            kernels("softcap_document", 256, "fp16"),
            kernels("relative_prefix_lm", 128, paged=True, pack_gqa=True, split=True, rows=4),
            kernels("alibi_causal", 64, "bf16", paged=True, split=True, rows=1),
            kernels("softcap_document", 256, "bf16", pack_gqa=True, rows=8),
            kernels("relative_prefix_lm", 256, "fp16", paged=True, pack_gqa=True, split=True, rows=4),
            kernels("softcap_document", 32, "fp16", paged=True, split=True, rows=1),
            kernels("relative_prefix_lm", 96, "bf16", pack_gqa=True, split=True, rows=4)]
    assert all(c.modified and not c.block_map for c in cfgs)
    assert_builds_without_spills(cfgs, "sm_80")
