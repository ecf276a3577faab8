"""flashgen.integrations.transformers on CPU: a tiny random Llama (GQA) whose attention goes through the
integration to a float64 stand-in for flashgen.attention (same layout and arguments), against the same
model on SDPA; and each mask or option flashgen cannot express refused by name."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install 'flashgen[transformers]')")

import flashgen  # noqa: E402
from flashgen.integrations import transformers as fg_hf  # noqa: E402
from flashgen.verify import attention_ref  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 32


@pytest.fixture(scope="module")
def name() -> str:
    return fg_hf.register()


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Replace flashgen.attention by a float64 reference in its own layout; record each call."""
    seen: list[dict] = []

    def fake_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, arch=None):
        seen.append({"q": tuple(q.shape), "k": tuple(k.shape), "causal": causal, "scale": softmax_scale,
                     "views": all(t._is_view() for t in (q, k, v))})
        return attention_ref(q, k, v, causal, softmax_scale, upcast=True)[0].to(q.dtype)

    monkeypatch.setattr(flashgen, "attention", fake_attention)
    return seen


def tiny_config(cls=transformers.LlamaConfig, **kw):
    return cls(vocab_size=256, hidden_size=HEADS * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, **kw)


def tiny_model(attn: str, cfg=None, seed: int = 0):
    torch.manual_seed(seed)  # same seed, same weights; a config each (from_config records the attention in it)
    cfg = copy.deepcopy(cfg) if cfg is not None else tiny_config()
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def ids(batch: int = 2, n: int = 13):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(1))


def test_logits_match_sdpa_and_every_layer_goes_through_flashgen(name, calls):
    ref, model = tiny_model("sdpa"), tiny_model(name)  # same seed: same weights
    assert model.config._attn_implementation == name
    with torch.no_grad():
        want, got = ref(ids()).logits, model(ids(), attention_mask=torch.ones(2, 13, dtype=torch.long)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == LAYERS
    for c in calls:  # flash_attn's layout, GQA kept (no repeat_kv), causal, the layer's scaling
        assert c["q"] == (2, 13, HEADS, HEAD_DIM) and c["k"] == (2, 13, KV_HEADS, HEAD_DIM)
        assert c["causal"] is True and c["scale"] == pytest.approx(HEAD_DIM**-0.5)
        assert c["views"]  # transposed views of transformers' (batch, heads, seqlen, head_dim), not copies


def test_set_attn_implementation_switches_a_loaded_model(name, calls):
    model = tiny_model("sdpa")
    with torch.no_grad():
        want = model(ids()).logits
        model.set_attn_implementation(name)
        got = model(ids()).logits
    assert len(calls) == LAYERS
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_generate_with_a_kv_cache_is_bottom_right_causal(name, calls):
    prompt = ids(batch=1, n=9)
    with torch.no_grad():
        want = tiny_model("sdpa").generate(prompt, max_new_tokens=4, do_sample=False)
        got = tiny_model(name).generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    # prefill, then one query against the growing cache, each layer every step
    decode = [(1, n) for n in (10, 11, 12) for _ in range(LAYERS)]
    assert [(c["q"][1], c["k"][1]) for c in calls] == [(9, 9)] * LAYERS + decode


def test_padding_mask_is_refused_with_the_way_round(name, calls):
    mask = torch.tensor([[1] * 13, [0] * 4 + [1] * 9])
    with pytest.raises(ValueError, match="padding .* needs varlen .* pass the sequences separately .*'sdpa'"):
        tiny_model(name)(ids(), attention_mask=mask)
    assert not calls


def test_static_cache_is_refused(name, calls):
    with pytest.raises(ValueError, match="pre-allocated cache .* DynamicCache"):
        tiny_model(name).generate(ids(batch=1), max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_sliding_window_only_where_it_cuts_nothing(name, calls):
    cfg = tiny_config(transformers.MistralConfig, sliding_window=8)
    short = ids(batch=1, n=8)
    with torch.no_grad():
        want = tiny_model("sdpa", cfg)(short).logits
        got = tiny_model(name, cfg)(short).logits  # 8 keys within a window of 8: plain causal
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sliding window or chunk of 8 tokens that cuts into the 13 keys"):
        tiny_model(name, cfg)(ids(batch=1))


@pytest.mark.parametrize("what, kwargs, words", [
    ("4-D mask", {"attention_mask": torch.ones(2, 1, 13, 13, dtype=torch.bool)}, "takes no attention mask tensor"),
    ("output_attentions", {"output_attentions": True}, "output_attentions=True is not supported"),
    ("packed sequences", {"position_ids": torch.cat([torch.arange(7), torch.arange(6)]).repeat(2, 1),
                          "use_cache": False}, "neither causal nor full .*packed"),
])
def test_other_unsupported_requests_are_named(name, calls, what, kwargs, words):
    with pytest.raises(ValueError, match=words):
        tiny_model(name)(ids(), **kwargs)


def test_dropout_is_refused(name, calls):
    model = tiny_model(name, tiny_config(attention_dropout=0.1)).train()
    with pytest.raises(ValueError, match="attention dropout .* model.eval()"):
        model(ids())


@pytest.mark.parametrize("bad", ["flashgen", "my_sdpa", "org/repo", "paged|fgen", ""])
def test_reserved_names_are_refused(bad):
    with pytest.raises(ValueError, match="transformers reserves names"):
        fg_hf.register(bad)


def test_a_name_with_flash_is_what_transformers_takes_for_its_own():
    """Why the default is not "flashgen": transformers looks for a flash-attention kernel by that name."""
    transformers.AttentionInterface.register("flashgen", fg_hf.attention_forward)
    try:
        with pytest.raises((ValueError, ImportError), match="flash"):
            tiny_model("flashgen")
    finally:
        del transformers.AttentionInterface._global_mapping["flashgen"]


def test_import_flashgen_does_not_import_transformers():
    code = "import sys, flashgen; assert 'transformers' not in sys.modules and 'flashgen.integrations' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
