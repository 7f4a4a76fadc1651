"""HF transformers attention on the CPU: ``accelerate`` gives a model whose attention is torch's SDPA
``fastops_sdpa``, registered with HF's ``AttentionInterface``. It is HF's SDPA call except in CPU training calls
where fastops' attention (``_Attention``: HF's eager attention's math, the backward's memory chosen below) runs
faster:

- under torch.compile (regional compilation), keys at most ``SHORT_KEYS`` long: SDPA's CPU flash kernel runs its
  backward at a fraction of the matmuls' rate, where inductor fuses the written-out softmax around the matmuls.
  Forward + backward, bf16, 1024 tokens of 4 query heads on 1 KV head of 64, causal, AMD Zen 5, median of 11 (ms;
  both called eagerly and under torch.compile):

  | keys | flash | flash compiled | fastops | fastops compiled |
  |---|---|---|---|---|
  | 128 | 14.0 | 14.7 | 14.2 | 5.2 |
  | 256 | 16.1 | 17.0 | 26.1 | 11.8 |
  | 512 | 23.9 | 25.0 | 33.3 | 24.0 |

  2 threads, 128 keys: flash 11.0, fastops compiled 4.3; 256 keys: 10.0 and 8.2. Eager, it gains nothing.
- dropped probabilities (``fastops.dropout``), outside torch.compile: SDPA with a dropout takes its math path on
  the CPU anyway, and torch's CPU dropout draws each element serially (fastops/_dropout.py).

FASTOPS_ATTENTION=0 leaves HF's SDPA alone; FASTOPS_DROPOUT=0 leaves it to a model that drops attention
probabilities, so that their dropout stays torch's."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _dropout
from .._checks import FLOAT_DTYPES
from .._util import switched_off

ATTENTION = "fastops_sdpa"
SHORT_KEYS = 256
# Keyword arguments HF passes that fastops' attention does not implement: with any of them set, HF's SDPA call runs
# (with torch's dropout).
_UNSUPPORTED = ("position_bias", "cache", "softcap", "sliding_window", "s_aux", "sinks")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _writes_out(module, query, key, value, attention_mask, dropout, kwargs) -> bool:
    if (not module.training or query.device.type != "cpu" or any(kwargs.get(k) is not None for k in _UNSUPPORTED)
            or query.dtype not in FLOAT_DTYPES or not query.dtype == key.dtype == value.dtype
            or (attention_mask is not None and attention_mask.requires_grad)):  # fmt: skip
        return False
    compiling = torch.compiler.is_compiling()
    if dropout > 0:  # under torch.compile the op's host seed would break the graph: SDPA and inductor's dropout
        return not compiling
    return compiling and torch.is_grad_enabled() and key.shape[-2] <= SHORT_KEYS


def _scores(q, k, mask, scale: float, groups: int, transposed: bool) -> torch.Tensor:
    """fp32 [B, KV, G, L, S] scores of the folded queries ``q`` [B, KV, G * L, D] against ``k`` [B, KV, S, D],
    ``mask`` added (float) or applied (bool, True where a query attends), broadcast over [B, KV, G, L, S].

    ``transposed``: multiplied as k q^T. Under torch.compile the forward takes that form and the backward's
    recomputation q k^T, because the partitioner merges two identical matmuls and keeps their output for the
    backward instead of recomputing it (Llama 4x256: 8 MiB more saved a step). Their sums may round apart in the
    last bit, as flash attention's recomputed scores may."""
    b, kv, rows, _ = q.shape
    qk = torch.matmul(k, q.transpose(2, 3)).transpose(2, 3) if transposed else torch.matmul(q, k.transpose(2, 3))
    s = (qk * scale).reshape(b, kv, groups, rows // groups, k.shape[2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s.float()


def _probs(s: torch.Tensor, mask) -> torch.Tensor:
    p = torch.softmax(s, -1)
    if mask is not None and mask.dtype == torch.bool:  # a row with nothing to attend to: 0, as SDPA's (not nan)
        p = p.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return p


def _drop(p: torch.Tensor, rate: float, seed: int) -> torch.Tensor:
    return p if rate == 0.0 else _dropout._op(p, rate, seed)


class _Attention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) v with the softmax in fp32 and the probabilities in q's dtype (HF's eager
    attention), their dropout on the fused op, whose backward regenerates the mask from its seed.

    For the backward it keeps q, k, v and either

    - (``keep``, eager) the probabilities in q's dtype, once: HF's eager attention keeps them three times (its fp32
      softmax, their cast and their dropout's output), 24 MiB a step more in BertForMaskedLM 4x256 (B16 x L128);
    - (under torch.compile) nothing more, like flash attention: the backward recomputes the probabilities (one more
      q k^T matmul), which inductor fuses. Eager, that recomputation made BERT's step 1.15x slower (235-258 ms
      against 207-209, 1 thread, AMD Zen 5).

    The softmax's backward reads the probabilities in q's dtype, rounded as in the matmul with V they come from,
    where HF's eager attention reads its fp32 softmax output."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, groups: int, rate: float, seed: int, keep: bool):
        p = _probs(_scores(q, k, mask, scale, groups, transposed=not keep), mask).to(q.dtype)
        ctx.save_for_backward(q, k, v, p if keep else mask)
        ctx.scale, ctx.groups, ctx.rate, ctx.seed, ctx.keep = scale, groups, rate, seed, keep
        return torch.matmul(_drop(p, rate, seed).view(q.shape[0], q.shape[1], q.shape[2], k.shape[2]), v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kept = ctx.saved_tensors
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if ctx.keep:
            p_low, p = kept, kept.float()
        else:
            p = _probs(_scores(q, k, kept, ctx.scale, ctx.groups, transposed=False), kept)
            p_low = p.to(q.dtype)
        dout = dout.to(q.dtype)
        dv = torch.matmul(_drop(p_low, ctx.rate, ctx.seed).view(shape).transpose(2, 3), dout)
        dp = _drop(torch.matmul(dout, v.transpose(2, 3)), ctx.rate, ctx.seed).view(p.shape).float()
        ds = ((p * (dp - (p * dp).sum(-1, keepdim=True))) * ctx.scale).to(q.dtype).view(shape)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(2, 3), q), dv, None, None, None, None, None, None


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF's attention-function signature (``AttentionInterface``); returns (output [B, L, H, D], None)."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # What autocast does to SDPA's inputs (HF's rotary embeddings leave q and k in fp32, v in bf16).
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if not _writes_out(module, query, key, value, attention_mask, dropout, kwargs):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)  # fmt: skip
    return fastops_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                             keep=not torch.compiler.is_compiling())  # fmt: skip


def fastops_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, keep: bool):
    """``_Attention`` on HF's arguments (q [B, H, L, D], k and v [B, KV, S, D], HF's mask); ``keep``: the
    probabilities kept for the backward (``_Attention``)."""
    b, h, length, d = query.shape
    kv, keys = key.shape[1], key.shape[2]
    # The query heads sharing a KV head (GQA) are rows of one matmul against it, where HF's eager attention makes
    # a copy of K and V per query head (repeat_kv): compiled, 4.1 ms against 5.5 with the copies at 128 keys.
    q = query.reshape(b, kv, h // kv * length, d)
    # HF's SDPA call's rule: causal where the module says so, the query is longer than one token and no mask is given.
    causal = (getattr(module, "is_causal", True) if is_causal is None else is_causal) and attention_mask is None
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :keys]
        # [B, 1 or H, L, S] against the scores' [B, KV, H / KV, L, S]
        mask = mask.unsqueeze(1) if mask.shape[1] == 1 else mask.unflatten(1, (kv, h // kv))
    elif causal and length > 1:
        mask = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril()
    scale = d**-0.5 if scaling is None else scaling
    seed = _dropout._seed() if dropout > 0 else 0
    with torch.autocast("cpu", enabled=False):
        out = _Attention.apply(q, key, value, mask, scale, h // kv, float(dropout), seed, keep)
    return out.view(b, h, length, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def install(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """Gives an HF model with SDPA attention ``fastops_sdpa`` on the CPU; returns (on, why) for the decision line."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False, "not an HF model with SDPA attention"
    if device.type != "cpu":
        return False, "HF's SDPA off the CPU"
    if switched_off("FASTOPS_ATTENTION"):
        return False, "FASTOPS_ATTENTION=0"
    # attention_dropout (Llama, Qwen), attention_probs_dropout_prob (BERT), attn_pdrop (GPT-2), ...
    drops = any(v > 0 for k, v in vars(config).items() if "att" in k and "drop" in k and isinstance(v, float))
    if drops and switched_off("FASTOPS_DROPOUT"):
        return False, "FASTOPS_DROPOUT=0: the attention's dropout stays torch's"
    _register()
    model.set_attn_implementation(ATTENTION)
    why = f"fastops' own under torch.compile for at most {SHORT_KEYS} keys (CPU flash attention's backward is slow)"
    return True, why + (", and where probabilities drop, on fastops.dropout" if drops else "")
