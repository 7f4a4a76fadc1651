"""fastops' HF attention on the CPU (fastops/accelerate/_attention.py): its forward and gradients are HF's SDPA
call's, its dropout the fused op's, it keeps no B x H x L x S tensor for the backward (eager or compiled), and the
rules for where it runs instead of SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fastops

transformers = pytest.importorskip("transformers")  # the torch 2.13 CI leg has none
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from fastops import _dropout  # noqa: E402
from fastops.accelerate import _attention  # noqa: E402

CASES = ["none", "bool-padding", "causal", "gqa-causal", "float-mask"]


def _inputs(case, L=9, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    kv_heads = 2 if case.startswith("gqa") else 4
    q = torch.randn(2, 4, L, 16, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(2, kv_heads, L, 16, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    module = nn.Module().train()
    module.is_causal = "causal" in case
    module.num_key_value_groups = q.shape[1] // k.shape[1]  # what HF's attention modules hold
    mask = None
    if case == "bool-padding":
        mask = torch.ones(2, 1, L, L, dtype=torch.bool)
        mask[1, :, :, 6:] = False
        mask[1, :, 8, :] = False  # a row with nothing to attend to
    elif case == "float-mask":
        mask = torch.randn(2, 1, L, L, generator=g)
    return module, q, k, v, mask, torch.randn(2, L, 4, 16, generator=g, dtype=dtype)


def _sdpa_only(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("HF's SDPA ran")

    monkeypatch.setattr(_attention, "_sdpa", lambda: fail)


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_are_sdpas(case, monkeypatch):
    module, q, k, v, mask, dout = _inputs(case)
    want, _ = sdpa_attention_forward(module.eval(), q, k, v, mask, dropout=0.0)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    _sdpa_only(monkeypatch)
    got, _ = _attention.attention(module.train(), q, k, v, mask)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    # fp32; two orders of summing over 16 (head size) and 9 (keys) terms, the softmax's exp against flash's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["causal", "bool-padding"])
def test_the_dropout_is_the_fused_ops_in_both_passes(case, monkeypatch):
    """Against the attention written out with autograd through fastops.dropout drawing the same seed: the backward
    regenerates the forward's mask."""
    module, q, k, v, mask, dout = _inputs(case)
    _sdpa_only(monkeypatch)
    torch.manual_seed(3)
    got, _ = _attention.attention(module, q, k, v, mask, dropout=0.3)
    grads = torch.autograd.grad(got, (q, k, v), dout)

    scores = q @ k.transpose(2, 3) * 16**-0.5
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() if mask is None else mask
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num()
    torch.manual_seed(3)
    want = (_dropout.dropout(probs, 0.3) @ v).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert (got - sdpa_attention_forward(module.eval(), q, k, v, mask)[0]).abs().max() > 0.01  # it dropped some


def test_bf16_under_autocast_with_hfs_mixed_input_dtypes(monkeypatch):
    """HF's rotary embeddings hand q and k over in fp32 and v in bf16 under autocast; SDPA's autocast casts all to
    bf16, and so does fastops' attention, which then runs (it did not while it compared the dtypes first)."""
    module, q, k, v, mask, dout = _inputs("gqa-causal", L=32)
    v16 = v.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = sdpa_attention_forward(module, q, k, v16, None, dropout=0.0)
    want_grads = torch.autograd.grad(want, (q, k, v16), dout.bfloat16())
    _sdpa_only(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = _attention.attention(module, q, k, v16, None)
    assert got.dtype == torch.bfloat16
    grads = torch.autograd.grad(got, (q, k, v16), dout.bfloat16())
    # bf16 probabilities and products (8 significant bits) against flash attention's own bf16 rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def _largest_saved(fn, *args) -> int:
    """The largest tensor autograd keeps for the backward of ``fn(*args)``, in elements."""
    largest = 0

    def pack(t):
        nonlocal largest
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return largest


@pytest.mark.parametrize("compiled", [False, True])
def test_no_scores_are_kept_for_the_backward(compiled):
    """Under torch.compile's partitioner (inductor's, without its code generation) as in eager mode: with the same
    matmul in the forward and the backward, the partitioner kept its B x H x L x S output."""
    module, q, k, v, _, dout = _inputs("causal", L=64)

    def attention(q, k, v):
        return _attention.attention(module, q, k, v, None)[0]

    fn = torch.compile(attention, backend="aot_eager_decomp_partition", fullgraph=True) if compiled else attention
    got = fn(q, k, v)
    torch.testing.assert_close(got, attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert _largest_saved(fn, q, k, v) < q.shape[0] * q.shape[1] * 64 * 64  # q, k, v (a quarter of it), the mask, lse


def test_where_sdpa_runs(monkeypatch):
    module, q, k, v, mask, _ = _inputs("causal", L=_attention.SHORT_KEYS + 1)
    # longer keys without dropout
    assert torch.equal(_attention.attention(module, q, k, v, mask)[0], sdpa_attention_forward(module, q, k, v, mask)[0])
    module, q, k, v, mask, _ = _inputs("causal")
    with torch.no_grad():
        assert torch.equal(_attention.attention(module, q, k, v, mask)[0], sdpa_attention_forward(module, q, k, v, mask)[0])
    module.eval()
    assert torch.equal(_attention.attention(module, q, k, v, mask)[0], sdpa_attention_forward(module, q, k, v, mask)[0])
    module.train()
    calls = []
    monkeypatch.setattr(_attention, "_sdpa", lambda: lambda *a, **kw: calls.append(kw["dropout"]) or (None, None))
    torch.compile(lambda q: _attention.attention(module, q, k, v, None, dropout=0.1)[0], backend="eager")(q)
    assert calls == [0.1]  # dropout under compile: SDPA with inductor's dropout, no host seed in the graph


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def test_install_rules(monkeypatch, tmp_path):
    cpu = torch.device("cpu")
    model = _llama()
    on, why = _attention.install(model, cpu)
    assert on and model.config._attn_implementation == _attention.ATTENTION and "dropout" not in why
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path).config._attn_implementation == "sdpa"  # not written to the config
    monkeypatch.setenv("FASTOPS_ATTENTION", "0")
    assert _attention.install(_llama(), cpu) == (False, "FASTOPS_ATTENTION=0")
    monkeypatch.delenv("FASTOPS_ATTENTION")
    assert not _attention.install(_llama(), torch.device("cuda"))[0]
    dropping = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        attention_dropout=0.1))  # fmt: skip
    monkeypatch.setenv("FASTOPS_DROPOUT", "0")
    assert not _attention.install(dropping, cpu)[0] and dropping.config._attn_implementation == "sdpa"


def test_llama_trains_through_accelerate_as_with_sdpa(monkeypatch):
    """Two bf16 steps of a tiny Llama through ``accelerate``, with fastops' attention and with SDPA: the same losses
    to bf16's rounding."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for env in ("1", "0"):
        monkeypatch.setenv("FASTOPS_ATTENTION", env)
        torch.manual_seed(0)
        model = _llama()
        model, opt, _ = fastops.accelerate(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=False)
        assert (model.config._attn_implementation == _attention.ATTENTION) == (env == "1")
        losses[env] = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[env].append(loss.item())
    # bf16 activations: a relative 2^-8 a step, summed over three steps
    torch.testing.assert_close(torch.tensor(losses["1"]), torch.tensor(losses["0"]), rtol=3 * 2**-8, atol=0)
    assert losses["1"][-1] < losses["1"][0]
