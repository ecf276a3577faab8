"""flashgen as an attention implementation of Hugging Face transformers.

    import flashgen.integrations.transformers as fg_hf
    name = fg_hf.register()                                   # "fgen"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=name)
    model.set_attn_implementation(name)                       # or switch a loaded model

Every attention layer then calls `flashgen.attention` on transposed views of its query, key
and value (no copies, no repeat_kv: GQA/MQA go through as fewer key/value heads), with the
layer's `scaling` as softmax_scale, and causal from the layer (`is_causal`).

flashgen computes softmax(q k^T * scale [+ a causal mask aligned bottom-right]) v per
sequence, with a layer's sliding window (window_size), logit softcapping (softcap, Gemma 2) and
attention sinks (s_aux, gpt-oss: learnable_sink), so a layer gets only what that expresses
exactly: no mask (full attention), a plain causal mask without padding, or a causal sliding
window, also while generating with a KV cache (1 query against n cached keys is bottom-right
causal). The mask function registered with the same name sees how transformers would build
the mask and returns None for those; anything else (padding, a chunk that cuts into the keys,
packed sequences, a pre-allocated static cache, an explicit 4-D mask, dropout,
output_attentions) raises a ValueError that names it and the way round it. Training works:
flashgen.attention has a backward (through autograd), sinks included.

The name: transformers treats every attn_implementation containing "flash" as one of its own
flash-attention paths (it tries to import flash_attn or fetch a hub kernel of that name, and
changes mask and generation behaviour), and names containing "sdpa", "flex", "eager" or
"paged" or shaped like "org/repo" are special too; hence "fgen".
"""
from __future__ import annotations

import re
from typing import Any

import flashgen

NAME = "fgen"
RESERVED = ("flash", "sdpa", "flex", "eager", "paged")  # substrings transformers gives a meaning of its own
SDPA = "or use attn_implementation='sdpa'"


def register(name: str = NAME) -> str:
    """Register flashgen's attention and mask functions with transformers under `name`; returns it.

    Then `from_pretrained(..., attn_implementation=name)`, `from_config(cfg, attn_implementation=name)`
    or `model.set_attn_implementation(name)` route every attention layer through flashgen."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) or any(w in name.lower() for w in RESERVED):
        raise ValueError(f"name={name!r}: transformers reserves names containing {', '.join(RESERVED)} (a name with "
                         f"'flash' is taken for its own flash-attention paths) or shaped like a hub kernel; "
                         f"use letters, digits and '_' without those, e.g. {NAME!r}")
    try:
        from transformers import AttentionInterface  # noqa: PLC0415
        from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("flashgen.integrations.transformers needs transformers: "
                          "pip install 'flashgen[transformers]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    return name


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, s_aux: Any = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention signature: query (batch, heads, seqlen_q, head_dim), key and value
    (batch, heads_k, seqlen_k, head_dim) -> (output (batch, seqlen_q, heads, head_dim), None). sliding_window: a
    query sees itself and the sliding_window - 1 keys before it (transformers' sliding_window_overlay, the mask
    build_mask accepted); softcap: scores = softcap * tanh(scores / softcap); s_aux: gpt-oss's sinks, (heads,)."""
    refuse_unsupported(attention_mask, dropout, kwargs)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    options: dict[str, Any] = {}
    if sliding_window is not None and key.shape[2] > sliding_window:  # it cuts keys (none are cut otherwise)
        if not causal:
            raise ValueError(f"a sliding window ({sliding_window}) without a causal mask is not supported by "
                             f"flashgen; {SDPA}")
        options["window_size"] = (int(sliding_window) - 1, 0)
    if softcap:
        options["softcap"] = float(softcap)
    if s_aux is not None:
        options["learnable_sink"] = s_aux
    out = flashgen.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                             softmax_scale=scaling, **options)
    return out, None


def refuse_unsupported(attention_mask: Any, dropout: float, kwargs: dict[str, Any]) -> None:
    """What a layer may ask beyond softmax(q k^T * scale [+ causal]) v, refused by name."""
    if attention_mask is not None:
        raise ValueError(
            f"flashgen takes no attention mask tensor (got shape {tuple(attention_mask.shape)}): it applies no mask or "
            "a causal one. An explicit 4-D mask or padding cannot be expressed: pass no attention_mask (or a 2-D mask of "
            f"ones) for sequences of one length, {SDPA}")
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported (flashgen has no dropout): "
                         f"call model.eval() for inference, {SDPA} for training")
    unsupported = {
        "sinks": "attention sinks other than gpt-oss's s_aux", "position_bias": "an additive position bias",
        "cu_seq_lens_q": "packed sequences (cu_seq_lens, varlen)",
        "cu_seq_lens_k": "packed sequences (cu_seq_lens, varlen)"}
    for arg, what in unsupported.items():
        if kwargs.get(arg) is not None:
            raise ValueError(f"{what} ({arg}=...) is not supported by flashgen; {SDPA}")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported: flashgen never forms the attention matrix; "
                         "use attn_implementation='eager' to get attention weights")


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                mask_function: Any = None, attention_mask: Any = None, local_size: int | None = None,
                use_vmap: bool = False, device: Any = "cpu", **kwargs: Any) -> None:
    """transformers' mask-interface signature. Returns None where flashgen's own masking (none, or causal
    aligned bottom-right) is exactly the mask transformers would build; raises ValueError otherwise."""
    import torch  # noqa: PLC0415
    from transformers import masking_utils as mu  # noqa: PLC0415

    q_end, kv_end = int(q_offset) + q_length, int(kv_offset) + kv_length  # one past the last query / key position
    padding = mu.prepare_padding_mask(attention_mask, kv_length, int(kv_offset))
    if padding is not None and not bool(padding[:, int(kv_offset):kv_end].all()):
        if bool(padding[:, int(kv_offset):q_end].all()):  # only slots after the last query: a pre-allocated cache
            raise ValueError(static_cache_message(q_end, kv_end))
        raise ValueError("padding in the attention mask (sequences of different lengths in one batch) needs varlen "
                         "attention, which flashgen does not have yet: pass the sequences separately (or batch only "
                         f"sequences of one length, without padding), {SDPA}")
    mask_function = mask_function or mu.causal_mask_function
    if mask_function is mu.bidirectional_mask_function:
        return None
    if mask_function is mu.causal_mask_function:
        if kv_end != q_end:
            raise ValueError(static_cache_message(q_end, kv_end))
        return None
    # Sliding window, chunked attention, packed sequences, overlays: fine only where they cut nothing away.
    full = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=None,
                        allow_is_causal_skip=False, use_vmap=use_vmap, device=device)
    if bool(full.all()):
        return None
    q_pos = torch.arange(q_length, device=full.device) + int(q_offset)
    kv_pos = torch.arange(kv_length, device=full.device) + int(kv_offset)
    causal = kv_pos[None, :] <= q_pos[:, None]
    if kv_end == q_end and torch.equal(full, causal.expand_as(full)):
        return None
    if (kv_end == q_end and local_size
            and torch.equal(full, (causal & (kv_pos[None, :] > q_pos[:, None] - int(local_size))).expand_as(full))):
        return None  # a causal sliding window: the layer passes it (sliding_window), attention_forward applies it
    what = (f"a chunk of {local_size} tokens (or a window not aligned to the last key) that cuts into the "
            f"{kv_length} keys" if local_size
            else "sequences packed into one row (position_ids that restart) or a custom mask overlay")
    raise ValueError(f"this attention mask is neither causal nor full ({what}); flashgen applies no other mask: "
                     f"keep sequences within the window and unpacked, {SDPA}")


def static_cache_message(q_end: int, kv_end: int) -> str:
    return (f"keys beyond the last query position ({kv_end} key slots for queries ending at {q_end}: a pre-allocated "
            "cache such as StaticCache / cache_implementation='static') would need a mask, and flashgen aligns causal "
            f"masks to the last key: use the default DynamicCache, {SDPA}")
