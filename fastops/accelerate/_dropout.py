"""Dropout on the CPU through ``fastops.dropout`` (fastops/_dropout.py says why): ``accelerate`` turns a model's
``nn.Dropout`` modules into ``fastops._dropout.Dropout``, and an HF transformers model whose attention is torch's
SDPA with an attention dropout gets ``fastops_sdpa``: HF's SDPA call where no probability is dropped, else the
attention written out (HF's eager attention, softmax in fp32) with the probabilities' dropout on the fused op.
FASTOPS_DROPOUT=0 leaves dropout to torch."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _dropout
from .._util import switched_off

ATTENTION = "fastops_sdpa"
# Keyword arguments HF passes that the written-out attention does not implement: with any of them set, HF's SDPA
# call runs (with torch's dropout).
_UNSUPPORTED = ("position_bias", "cache", "softcap", "sliding_window", "s_aux", "sinks")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF's attention-function signature (``AttentionInterface``); returns (output [B, L, H, D], None)."""
    if (dropout == 0.0 or not module.training or query.device.type != "cpu"
            or any(kwargs.get(k) is not None for k in _UNSUPPORTED)):  # fmt: skip
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)  # fmt: skip
    from transformers.integrations.sdpa_attention import repeat_kv

    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    # HF's SDPA call's rule: causal where the module says so, the query is longer than one token and no mask is given.
    causal = (getattr(module, "is_causal", True) if is_causal is None else is_causal) and attention_mask is None
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
    elif causal and query.shape[2] > 1:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
    masked_out = ~mask if mask is not None and mask.dtype == torch.bool else None
    if masked_out is not None:
        scores = scores.masked_fill(masked_out, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if masked_out is not None:
        probs = probs.masked_fill(masked_out.all(-1, keepdim=True), 0.0)  # a row with nothing to attend to: 0, as SDPA
    probs = _dropout.dropout(probs.to(query.dtype), dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def install(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """Swaps the model's dropout on ``device`` where it pays; returns (on, why) for the decision line."""
    if switched_off("FASTOPS_DROPOUT"):
        return False, "FASTOPS_DROPOUT=0"
    if device.type != "cpu":
        return False, "torch's own dropout off the CPU"
    n = _dropout.swap_dropouts(model)
    hf = 0
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation"):
        # attention_dropout (Llama, Qwen), attention_probs_dropout_prob (BERT), attn_pdrop (GPT-2), ...
        rates = [v for k, v in vars(config).items() if "att" in k and "drop" in k and isinstance(v, float)]
        if any(r > 0 for r in rates):
            _register()
            model.set_attn_implementation(ATTENTION)
            hf = 1
    if not n and not hf:
        return False, "no dropout in the model"
    where = f"{n} nn.Dropout" + (" and HF's attention dropout" if hf else "")
    return True, f"{where} on the fused op: torch's CPU dropout draws each element serially (bernoulli_)"
