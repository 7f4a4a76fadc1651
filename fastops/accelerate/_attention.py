"""HF transformers attention on the CPU: ``accelerate`` gives a model whose attention is torch's SDPA
``fastops_sdpa``, registered with HF's ``AttentionInterface``. It is HF's SDPA call except in CPU training calls
where fastops' attention (``_Attention``: HF's eager attention's math, with flash attention's memory) runs faster:

- short keys (at most ``SHORT_KEYS``): torch's CPU flash attention, the kernel SDPA picks there, runs its backward
  at a fraction of the matmuls' rate. Forward + backward, bf16, 1024 tokens of 4 query heads on 1 KV head of 64,
  causal, AMD Zen 5, 1 thread, median of 9 (ms; the attention written out as matmuls and a softmax, eager and under
  torch.compile, the GQA heads folded into the matmuls' rows):

  | keys | flash | written out | compiled |
  |---|---|---|---|
  | 128 | 12.1 | 7.1 | 5.1 |
  | 256 | 13.7 | 16.3 | 10.2 |
  | 512 | 23.3 | 24.8 | 18.5 |
  | 1024 | 27.3 | 44.5 | 45.3 |

  2 threads, 128 keys: 8.1 against 5.7 and 3.6.
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
SHORT_KEYS = 128
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
    if dropout > 0:  # under torch.compile the op's host seed would break the graph: SDPA and inductor's dropout
        return not torch.compiler.is_compiling()
    return torch.is_grad_enabled() and key.shape[-2] <= SHORT_KEYS


def _scores(q, k, mask, scale: float, groups: int, forward: bool) -> torch.Tensor:
    """fp32 [B, KV, G, L, S] scores of the folded queries ``q`` [B, KV, G * L, D] against ``k`` [B, KV, S, D],
    ``mask`` added (float) or applied (bool, True where a query attends), broadcast over [B, KV, G, L, S].

    The forward multiplies k q^T, the backward q k^T: torch.compile's partitioner merges two identical matmuls and
    keeps their output for the backward instead of recomputing it (Llama 4x256: 8 MiB more saved a step). Their
    sums may round apart in the last bit, as flash attention's recomputed scores may."""
    b, kv, rows, _ = q.shape
    qk = torch.matmul(k, q.transpose(2, 3)).transpose(2, 3) if forward else torch.matmul(q, k.transpose(2, 3))
    s = (qk * scale).reshape(b, kv, groups, rows // groups, k.shape[2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s.float()


def _drop(p: torch.Tensor, rate: float, seed: int) -> torch.Tensor:
    return p if rate == 0.0 else _dropout._op(p, rate, seed)


class _Attention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) v with the softmax in fp32 and the probabilities in q's dtype (HF's eager
    attention), their dropout on the fused op. Like flash attention it keeps q, k, v and the rows' logsumexp for
    the backward, which recomputes the probabilities (one more q k^T matmul) and their dropout mask from its seed:
    no B x H x L x S tensor is kept. BertForMaskedLM 4x256 (B16 x L128, dropout 0.1) keeps 100 MiB a step for its
    backward with it, 124 MiB with HF's eager attention (its fp32 softmax, bf16 probabilities and their dropout)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, groups: int, rate: float, seed: int):
        s = _scores(q, k, mask, scale, groups, forward=True)
        lse = torch.logsumexp(s, -1, keepdim=True)
        # A row with nothing to attend to: probabilities 0, as SDPA's (exp(-inf - inf) = 0, not nan).
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        p = _drop(torch.exp(s - lse).to(q.dtype), rate, seed)
        ctx.save_for_backward(q, k, v, mask, lse)
        ctx.scale, ctx.groups, ctx.rate, ctx.seed = scale, groups, rate, seed
        return torch.matmul(p.view(q.shape[0], q.shape[1], q.shape[2], k.shape[2]), v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, lse = ctx.saved_tensors
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        p = torch.exp(_scores(q, k, mask, ctx.scale, ctx.groups, forward=False) - lse)
        dout = dout.to(q.dtype)
        dv = torch.matmul(_drop(p.to(q.dtype), ctx.rate, ctx.seed).view(shape).transpose(2, 3), dout)
        dp = _drop(torch.matmul(dout, v.transpose(2, 3)), ctx.rate, ctx.seed).view(p.shape).float()
        ds = ((p * (dp - (p * dp).sum(-1, keepdim=True))) * ctx.scale).to(q.dtype).view(shape)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(2, 3), q), dv, None, None, None, None, None


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF's attention-function signature (``AttentionInterface``); returns (output [B, L, H, D], None)."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # What autocast does to SDPA's inputs (HF's rotary embeddings leave q and k in fp32, v in bf16).
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if not _writes_out(module, query, key, value, attention_mask, dropout, kwargs):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)  # fmt: skip
    b, h, length, d = query.shape
    kv, keys = key.shape[1], key.shape[2]
    # The query heads sharing a KV head (GQA) are rows of one matmul against it, where HF's eager attention makes
    # a copy of K and V per query head (repeat_kv): under torch.compile 5.1 ms against 6.1 (the table's first row).
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
        out = _Attention.apply(q, key, value, mask, scale, h // kv, float(dropout), seed)
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
    why = f"fastops' own in CPU training calls with at most {SHORT_KEYS} keys (CPU flash attention's backward is slow)"
    return True, why + (", and where probabilities drop, on fastops.dropout" if drops else "")
