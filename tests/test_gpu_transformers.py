"""On a GPU: a small random-weight Llama (GQA 8/2 heads, head_dim 64, bf16) with attn_implementation set to
flashgen's, against the same weights on SDPA, every layer spied on. The yardstick is PyTorch's own error:
SDPA in bf16 against the model in float32."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install 'flashgen[transformers]')")

import flashgen  # noqa: E402
from flashgen.integrations import transformers as fg_hf  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 8, 2, 64
LENGTHS = (37, 300)  # unequal: run one at a time (padding masks are refused)


@pytest.fixture(scope="module")
def models():
    def build(attn: str, dtype=torch.float32):  # a config each: from_config records the attention in it
        cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=HEADS * HEAD_DIM, intermediate_size=1024,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                       head_dim=HEAD_DIM, max_position_embeddings=1024)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
        model.generation_config.pad_token_id = cfg.eos_token_id
        return model.cuda().eval()

    fp32, sdpa, fg = build("sdpa"), build("sdpa", torch.bfloat16), build(fg_hf.register(), torch.bfloat16)
    for m in (sdpa, fg):
        m.load_state_dict(fp32.state_dict())
    assert (sdpa.config._attn_implementation, fg.config._attn_implementation) == ("sdpa", fg_hf.NAME)
    return fp32, sdpa, fg


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    seen, real = [], flashgen.attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], k.shape[2], kwargs.get("causal")))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(flashgen, "attention", spy)
    return seen


def prompt(n: int, seed: int):
    return torch.randint(0, 2048, (1, n), generator=torch.Generator().manual_seed(seed)).cuda()


@torch.no_grad()
def test_llama_logits_match_sdpa_every_layer_through_flashgen(models, calls):
    fp32, sdpa, fg = models
    for i, n in enumerate(LENGTHS):
        ids = prompt(n, i)
        want = fp32(ids).logits
        ours, theirs = fg(ids).logits.float(), sdpa(ids).logits.float()
        err, yardstick = (ours - want).abs().max().item(), (theirs - want).abs().max().item()
        print(f"seqlen {n}: max |logits flashgen - sdpa| (bf16) {(ours - theirs).abs().max().item():.3e}; "
              f"vs float32: flashgen {err:.3e}, sdpa {yardstick:.3e}")
        assert err <= 2 * yardstick + 1e-3
        assert calls[-LAYERS:] == [(n, n, KV_HEADS, True)] * LAYERS  # every layer, GQA as is, causal
    assert len(calls) == LAYERS * len(LENGTHS)


@torch.no_grad()
def test_greedy_generate_decodes_bottom_right_causal(models, calls):
    fp32, sdpa, fg = models
    ids, new = prompt(LENGTHS[0], 7), 6
    out = fg.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
    n = ids.shape[1]
    decode = [(1, n + s) for s in range(1, new) for _ in range(LAYERS)]
    assert [(q, k) for q, k, _, _ in calls] == [(n, n)] * LAYERS + decode
    # each step's logits (one query against the cache) against a full forward over the same tokens
    seq = out.sequences[:, :-1]
    steps = torch.stack(out.logits, dim=1).float()
    want = fp32(seq).logits[:, n - 1:]
    theirs = sdpa(seq).logits[:, n - 1:].float()
    err, yardstick = (steps - want).abs().max().item(), (theirs - want).abs().max().item()
    same = torch.equal(out.sequences, sdpa.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                    do_sample=False))
    print(f"generate {new} tokens: max |step logits - float32| flashgen {err:.3e}, sdpa forward {yardstick:.3e}; "
          f"same tokens as sdpa: {same}")
    assert err <= 3 * yardstick + 1e-3


@torch.no_grad()
def test_padded_batch_is_refused(models):
    _, _, fg = models
    ids = prompt(16, 3).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="padding .* needs varlen"):
        fg(ids, attention_mask=mask)


def test_training_loss_curves_agree_with_sdpa(calls):
    """A few hundred AdamW steps of a small random-weight Llama on random tokens, once through flashgen
    (forward and backward kernels) and once through SDPA, from the same weights and batches: the two
    loss curves agree within bf16 noise."""
    def build(attn: str):
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       max_position_embeddings=256)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                                             dtype=torch.bfloat16).cuda().train()

    steps, curves = 200, {}
    for attn in ("sdpa", fg_hf.register()):
        model = build(attn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(steps):
            tokens = torch.randint(0, 64, (8, 128), device="cuda", generator=gen)  # a small vocabulary: learnable
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[attn] = torch.tensor(losses)
        if attn != "sdpa":
            assert len(calls) == steps * 2  # every step's forward went through flashgen in both layers
    sdpa, fg = curves["sdpa"], curves[fg_hf.NAME]
    gap = (sdpa - fg).abs()
    print(f"loss: sdpa {sdpa[0]:.3f} -> {sdpa[-1]:.3f}, flashgen {fg[0]:.3f} -> {fg[-1]:.3f}; "
          f"max |gap| {gap.max():.3f}, mean over the last 50 steps {gap[-50:].mean():.4f}")
    assert sdpa[-1] < sdpa[0] - 0.5 and fg[-1] < fg[0] - 0.5  # both learned
    assert gap[-50:].mean() < 0.05 and gap.max() < 0.2


def _variant(family: str, attn: str, dtype):
    """A small random-weight model of `family` with its attention variant: Mistral's sliding window, Gemma 2's
    logit softcapping beside a window on alternate layers, gpt-oss's attention sinks beside a window (MoE MLP)."""
    kinds = {"mistral": (transformers.MistralConfig, dict(sliding_window=64)),
             "gemma2": (transformers.Gemma2Config, dict(sliding_window=64, attn_logit_softcapping=20.0)),
             "gpt_oss": (transformers.GptOssConfig, dict(sliding_window=64, num_local_experts=4, num_experts_per_tok=2,
                                                         layer_types=["sliding_attention", "full_attention"]))}
    cls, extra = kinds[family]
    cfg = cls(vocab_size=2048, hidden_size=HEADS * HEAD_DIM, intermediate_size=1024, num_hidden_layers=2,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).cuda().eval()


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_windows_softcap_and_sinks_match_eager(family, calls):
    """Each layer through flashgen (window_size, softcap, learnable_sink as the layer asks) against the same weights
    on transformers' eager attention; 300 tokens, so the 64-token windows cut. The yardstick is eager in bf16 against
    float32. gpt-oss's sinks get their gradient through flashgen's backward."""
    fp32 = _variant(family, "eager", torch.float32)
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in fp32.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)  # large enough to move the softmax
    eager, fg = _variant(family, "eager", torch.bfloat16), _variant(family, fg_hf.register(), torch.bfloat16)
    for m in (eager, fg):
        m.load_state_dict(fp32.state_dict())
    ids = prompt(300, 11)
    with torch.no_grad():
        want = fp32(ids).logits
        ours, theirs = fg(ids).logits.float(), eager(ids).logits.float()
    err, yardstick = (ours - want).abs().max().item(), (theirs - want).abs().max().item()
    print(f"{family}: max |logits - float32| flashgen {err:.3e}, eager bf16 {yardstick:.3e}")
    assert err <= 2 * yardstick + 1e-3 and len(calls) == 2
    if family == "gpt_oss":
        fg.train()
        fg(ids).logits.float().logsumexp(-1).mean().backward()
        grads = [layer.self_attn.sinks.grad for layer in fg.model.layers]
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
