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


def reference(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, sinks=None):
    """flashgen.attention's meaning in float64 (its layout, GQA, bottom-right causal and window, softcap on the scaled
    scores, a sink logit per head in the softmax's denominator): the stand-in for its options."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf = q.double().transpose(1, 2)
    kf, vf = (t.double().repeat_interleave(h // hk, 2).transpose(1, 2) for t in (k, v))
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    s = s.masked_fill(~keep, -float("inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, h, 1, 1).expand(b, h, sq, 1)], -1)
    p = torch.softmax(s, -1)[..., :sk]
    return (p @ vf).transpose(1, 2)


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Replace flashgen.attention by a float64 reference in its own layout; record each call."""
    seen: list[dict] = []

    def fake_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, arch=None, *,
                       window_size=(-1, -1), softcap=0.0, learnable_sink=None):
        seen.append({"q": tuple(q.shape), "k": tuple(k.shape), "causal": causal, "scale": softmax_scale,
                     "views": all(t._is_view() for t in (q, k, v)), "window": window_size, "softcap": softcap,
                     "sinks": learnable_sink is not None})
        if window_size == (-1, -1) and not softcap and learnable_sink is None:
            return attention_ref(q, k, v, causal, softmax_scale, upcast=True)[0].to(q.dtype)
        return reference(q, k, v, causal, softmax_scale, window_size, softcap, learnable_sink).to(q.dtype)

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


def test_a_sliding_window_matches_sdpa_prefill_and_generate(name, calls):
    """Mistral's causal sliding window: flashgen's window_size (sliding_window - 1 keys before each query) where it
    cuts into the keys, none where it covers them all; prefill and decode steps agree with SDPA's masks."""
    cfg = tiny_config(transformers.MistralConfig, sliding_window=8)
    for n, window in ((8, (-1, -1)), (13, (7, 0))):
        with torch.no_grad():
            want = tiny_model("sdpa", cfg)(ids(batch=1, n=n)).logits
            got = tiny_model(name, cfg)(ids(batch=1, n=n)).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert [c["window"] for c in calls] == [window] * LAYERS
        calls.clear()
    prompt = ids(batch=1, n=13)
    with torch.no_grad():
        want = tiny_model("sdpa", cfg).generate(prompt, max_new_tokens=6, do_sample=False)
        got = tiny_model(name, cfg).generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    # the prefill's 13 keys are cut; each decode step sees the sliding cache's last keys, all inside the window
    assert [(c["q"][1], c["k"][1], c["window"]) for c in calls[:LAYERS]] == [(13, 13, (7, 0))] * LAYERS
    assert all(c["q"][1] == 1 and c["k"][1] <= 8 and c["window"] == (-1, -1) for c in calls[LAYERS:])


def test_gemma2_softcap_and_window_match_eager(name, calls):
    """Gemma 2: logit softcapping on every layer and a sliding window on alternate ones, against transformers'
    eager attention."""
    cfg = tiny_config(transformers.Gemma2Config, sliding_window=8, attn_logit_softcapping=2.0)
    with torch.no_grad():
        want = tiny_model("eager", cfg)(ids(n=13)).logits
        got = tiny_model(name, cfg)(ids(n=13)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [(c["window"], c["softcap"]) for c in calls] == [((7, 0), 2.0), ((-1, -1), 2.0)]


def test_gpt_oss_sinks_match_eager_and_train(name, calls):
    """gpt-oss: attention sinks (s_aux, a logit per head in the softmax) with a sliding window on alternate layers,
    against transformers' eager attention; the sinks are passed as learnable_sink, so they get their gradient."""
    cfg = tiny_config(transformers.GptOssConfig, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                      layer_types=["sliding_attention", "full_attention"])
    ref, model = tiny_model("eager", cfg), tiny_model(name, cfg)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # large enough to move the softmax
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want, got = ref(ids(n=13)).logits, model(ids(n=13)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [(c["window"], c["sinks"]) for c in calls] == [((7, 0), True), ((-1, -1), True)]
    model(ids(n=13)).logits.sum().backward()
    assert all(layer.self_attn.sinks.grad is not None for layer in model.model.layers)


def test_a_chunked_mask_is_refused(name, calls):
    """Chunked attention (Llama 4's) is not a window aligned to the last key: refused by name."""
    from transformers import masking_utils as mu

    chunked = mu.and_masks(mu.causal_mask_function, mu.chunked_overlay(8, torch.zeros(1, dtype=torch.long)))
    with pytest.raises(ValueError, match="chunk of 8 tokens"):
        fg_hf.build_mask(1, 13, 13, mask_function=chunked, local_size=8)
    assert fg_hf.build_mask(1, 8, 8, mask_function=chunked, local_size=8) is None  # one chunk: causal


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
