"""fastops' HF attention on the CPU (fastops/accelerate/_attention.py): its forward and gradients are HF's SDPA
call's, its dropout the fused op's, what it keeps for the backward (the probabilities once eagerly, no
B x H x L x S tensor compiled), and the rules for where it runs instead of SDPA."""

from __future__ import annotations

import functools

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


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recompute"])
@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_are_sdpas(case, keep):
    module, q, k, v, mask, dout = _inputs(case)
    want, _ = sdpa_attention_forward(module.eval(), q, k, v, mask, dropout=0.0)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    got, _ = _attention.fastops_attention(module.train(), q, k, v, mask, 0.0, None, None, keep=keep)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    # fp32; two orders of summing over 16 (head size) and 9 (keys) terms
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recompute"])
@pytest.mark.parametrize("case", ["causal", "bool-padding"])
def test_the_dropout_is_the_fused_ops_in_both_passes(case, keep, monkeypatch):
    """Against the attention written out with autograd through fastops.dropout drawing the same seed: the backward
    regenerates the forward's mask."""
    module, q, k, v, mask, dout = _inputs(case)
    torch.manual_seed(3)
    got, _ = _attention.fastops_attention(module, q, k, v, mask, 0.3, None, None, keep=keep)
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
    if keep:  # eager training calls with dropout take this path through attention(): the same draw, the same bits
        module.train()
        _sdpa_only(monkeypatch)
        torch.manual_seed(3)
        assert torch.equal(_attention.attention(module, q, k, v, mask, dropout=0.3)[0], got)


def test_bf16_under_autocast_with_hfs_mixed_input_dtypes(monkeypatch):
    """HF's rotary embeddings hand q and k over in fp32 and v in bf16 under autocast; SDPA's autocast casts all to
    bf16, and so does ``attention``, which then takes fastops' path (it did not while it compared the dtypes
    first). Under torch.compile, where that path runs without dropout."""
    module, q, k, v, mask, dout = _inputs("gqa-causal", L=32)
    v16 = v.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = sdpa_attention_forward(module, q, k, v16, None, dropout=0.0)
    want_grads = torch.autograd.grad(want, (q, k, v16), dout.bfloat16())
    _sdpa_only(monkeypatch)

    def attention(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _attention.attention(module, q, k, v, None)[0]

    got = torch.compile(attention, backend="eager", fullgraph=True)(q, k, v16)
    assert got.dtype == torch.bfloat16
    grads = torch.autograd.grad(got, (q, k, v16), dout.bfloat16())
    # bf16 probabilities and products (8 significant bits) against flash attention's own bf16 rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def _saved(fn, *args) -> list[int]:
    """The sizes (elements) of the tensors autograd keeps for the backward of ``fn(*args)``, largest first."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sorted(sizes, reverse=True)


def test_what_is_kept_for_the_backward():
    """Eager (``keep``): q, k, v and the probabilities, once. Compiled (the recomputing form): no B x H x L x S
    tensor, eager or through torch.compile's partitioner (inductor's, without its code generation)."""
    module, q, k, v, _, _ = _inputs("gqa-causal", L=64, dtype=torch.bfloat16)  # as Llama's under autocast
    scores = q.shape[0] * q.shape[1] * 64 * 64

    def attention(q, k, v, keep=False):
        return _attention.fastops_attention(module, q, k, v, None, 0.0, None, None, keep=keep)[0]

    kept = _saved(functools.partial(attention, keep=True), q, k, v)
    assert kept[0] == scores and kept[1] < scores  # the probabilities; q, k, v a quarter of that, the mask
    assert _saved(attention, q, k, v)[0] < scores
    compiled = torch.compile(attention, backend="aot_eager_decomp_partition", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), attention(q, k, v), rtol=0, atol=0)
    assert _saved(compiled, q, k, v)[0] < scores


def test_where_sdpa_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(_attention, "_sdpa", lambda: lambda *a, **kw: calls.append(kw["dropout"]) or (a[1], None))

    def runs_fastops(module, q, k, v, dropout=0.0, compiled=True):
        def call(q):
            return _attention.attention(module, q, k, v, None, dropout=dropout)[0]

        before = len(calls)
        (torch.compile(call, backend="eager") if compiled else call)(q)
        return len(calls) == before

    module, q, k, v, _, _ = _inputs("causal")
    assert runs_fastops(module, q, k, v)  # compiled training call, short keys
    assert runs_fastops(module, q, k, v, dropout=0.1, compiled=False)  # eager, dropped probabilities
    assert not runs_fastops(module, q, k, v, compiled=False)  # eager without dropout: SDPA, as fast there
    assert not runs_fastops(module, q, k, v, dropout=0.1)  # under compile: inductor's dropout, no host seed
    with torch.no_grad():
        assert not runs_fastops(module, q, k, v)
    assert not runs_fastops(module.eval(), q, k, v)
    module, q, k, v, _, _ = _inputs("causal", L=_attention.SHORT_KEYS + 1)
    assert not runs_fastops(module.train(), q, k, v)


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
    """Three bf16 steps of a tiny Llama through ``accelerate`` with its regions compiled (dynamo with the eager
    backend: the graphs inductor would get, without its compile time), with fastops' attention and with SDPA: the
    same losses to bf16's rounding."""
    from fastops.accelerate import _compile

    monkeypatch.setattr(_compile, "BACKEND", "eager")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, sdpa_calls = {}, []
    sdpa = _attention._sdpa()
    monkeypatch.setattr(_attention, "_sdpa", lambda: lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw))
    for env in ("1", "0"):
        monkeypatch.setenv("FASTOPS_ATTENTION", env)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _llama()
        model, opt, _ = fastops.accelerate(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=True)
        assert (model.config._attn_implementation == _attention.ATTENTION) == (env == "1")
        losses[env] = []
        sdpa_calls.clear()
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[env].append(loss.item())
        if env == "1":
            assert not sdpa_calls  # traced through fastops' attention, not SDPA
    # bf16 activations: a relative 2^-8 a step, summed over three steps
    torch.testing.assert_close(torch.tensor(losses["1"]), torch.tensor(losses["0"]), rtol=3 * 2**-8, atol=0)
    assert losses["1"][-1] < losses["1"][0]
