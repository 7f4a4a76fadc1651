"""The fused loss on real HF transformers models (fastops.accelerate(fused_loss=True), and "auto"): the same loss
and gradients as the model's own head and loss; ``out.logits`` built only when read, then the model's own logits
(values, and gradients through them); heads that do more than a linear map are left alone."""

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastops
from fastops.accelerate import _fused_loss

transformers = pytest.importorskip("transformers")


def _llama(vocab=300, **extra):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)
    return transformers.LlamaForCausalLM(cfg)


def _bert(vocab=300):
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    return transformers.BertForMaskedLM(cfg)


def _batch(vocab, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 16), generator=g)
    labels = ids.clone()
    if masked:  # masked LM: about 15% of the positions carry a label
        labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
    return ids, labels


def _run(model, ids, labels, precision, fused, **kw):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = fastops.accelerate(model, opt, precision=precision, fused_loss=fused, device="cpu", **kw)
    torch.manual_seed(1)  # BERT's dropout draws the same masks in both runs
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


# fp32: the fused op sums a row's exponentials in another order, so the loss agrees to a few fp32 roundings of a
# log-sum-exp over V=300 terms (2e-6 relative is ~16 ulp); a gradient element sums over the 48 rows of the batch
# in another order, so 48 u = 3e-6 of the largest gradient, 4e-6 with rounding of the sum. Measured: 8e-8 and
# 2e-7. bf16: both sides round logits to bf16 (autocast) and compute the loss in fp32; the fused op's matmul
# runs on chunks of rows, whose fp32 accumulation may round a logit to the neighbouring bf16 value: a row's
# loss (lse - z_target) moves by at most two such moves (2^-9 of a logit each, 4e-3 at |logit| <= 2), 8e-3 against
# a loss of about 5.7 (V = 300): 1.4e-3 relative, below the 2.7e-3 a loss rounded to bf16 would be off (a loss
# handed back in bf16 failed here); a softmax term by its relative change, 8e-3 of the largest gradient for two
# such roundings. Measured here: bitwise equal.
TOL = {"fp32": (2e-6, 4e-6), "bf16": (1.4e-3, 8e-3)}


def _assert_grads_close(g_fused, g_plain, tol):
    assert g_fused.keys() == g_plain.keys()
    # Relative to the model's largest gradient: some are zero up to rounding (BERT's key bias: softmax ignores it).
    scale = max(g.abs().max() for g in g_plain.values())
    for name, g in g_plain.items():
        err = (g_fused[name] - g).abs().max() / scale
        assert err <= tol, f"{name}: {err:.2e}"


class _HeadCalls(TorchDispatchMode):
    """Counts the matmuls that build logits (a vocabulary-wide output), at the aten level."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.calls = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default) \
                and out.shape[-1] == self.vocab:
            self.calls += 1
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_same_loss_and_grads_as_the_models_own(kind, precision):
    torch.manual_seed(0)
    model = _llama() if kind == "llama" else _bert()
    model.train()
    ids, labels = _batch(300, masked=(kind == "bert"))
    plain, g_plain = _run(model, ids, labels, precision, fused=False)
    fused, g_fused = _run(model, ids, labels, precision, fused=True)
    assert type(plain.logits) is torch.Tensor and _fused_loss.is_lazy(fused.logits)
    loss_tol, grad_tol = TOL[precision]
    torch.testing.assert_close(fused.loss, plain.loss, rtol=loss_tol, atol=0)
    _assert_grads_close(g_fused, g_plain, grad_tol)
    # Read after the backward: the head's own casts and matmul on the same hidden states, so the same bits.
    assert fused.logits.dtype == plain.logits.dtype == torch.float32 and fused.logits.shape == plain.logits.shape
    torch.testing.assert_close(fused.logits, plain.logits, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_logits_are_built_once_when_read_and_never_otherwise(precision):
    torch.manual_seed(0)
    model = _llama()
    ids, labels = _batch(300, masked=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = copy.deepcopy(model)
    model, opt, _ = fastops.accelerate(model, opt, precision=precision, fused_loss=True, device="cpu")
    with _HeadCalls(300) as calls:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    assert calls.calls == 0  # nothing read them: no logits built
    with _HeadCalls(300) as calls:
        predicted = out.logits.argmax(-1)  # an accuracy metric, say
        accuracy = (predicted[:, :-1] == labels[:, 1:]).float().mean()
        shown = repr(out.logits)  # logging
    assert calls.calls == 1 and "tensor(" in shown and 0 <= float(accuracy) <= 1
    ref.set_attn_implementation(model.config._attn_implementation)  # the same attention: the same hidden states
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        want = ref(input_ids=ids).logits.float()
    torch.testing.assert_close(out.logits, want, rtol=0, atol=0)
    assert torch.equal(predicted, want.argmax(-1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_logits_read_after_the_optimizer_step_are_those_of_their_forward(precision):
    """Accuracy logged after optimizer.step(): the step changed the head's weights in place, the logits are still
    the forward's (bf16: the cast the fused op used; fp32: a copy taken before the step)."""
    torch.manual_seed(0)
    model = _llama()
    ids, labels = _batch(300, masked=False)
    plain_model = copy.deepcopy(model)
    got = []
    for m, fused in ((plain_model, False), (model, True)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-1)
        m, opt, _ = fastops.accelerate(m, opt, precision=precision, fused_loss=fused, device="cpu")
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        before = m.lm_head.weight.detach().clone()
        opt.step()
        assert not torch.equal(before, m.lm_head.weight)  # the step moved the head: logits from it now differ
        got.append(out.logits)
    assert _fused_loss.is_lazy(got[1])
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)
    # The process-wide hook that took the copy does not count step calls: fastops' scaler still hands skipped
    # steps to the optimizer (a watched step would make it read the grads' finiteness on the host every step).
    from fastops import amp as famp

    assert not famp._step_is_watched(fastops.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_loss_term_on_the_logits_gets_the_models_gradients(accumulate):
    """Distillation-style: a second term computed from out.logits in the training step. Its gradient flows
    through the built logits, and under accumulate=k through fastops' 1/k as the loss's does."""
    torch.manual_seed(0)
    model = _llama()
    ids, labels = _batch(300, masked=False)
    grads = []
    for fused in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m, opt, _ = fastops.accelerate(m, opt, precision="fp32", fused_loss=fused, accumulate=accumulate,
                                       device="cpu")
        out = m(input_ids=ids, labels=labels)
        (out.loss + 0.1 * out.logits.logsumexp(-1).mean()).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    _assert_grads_close(grads[1], grads[0], TOL["fp32"][1])


def test_tied_embeddings_get_both_gradients():
    torch.manual_seed(0)
    model = _llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = _batch(300, masked=False)
    plain, g_plain = _run(model, ids, labels, "fp32", fused=False)
    fused, g_fused = _run(model, ids, labels, "fp32", fused=True)
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(g_fused[name], g_plain[name], rtol=1e-5, atol=1e-5 * g_plain[name].abs().max())


def test_grad_accumulation_takes_hf_num_items_in_batch():
    """HF's loss with num_items_in_batch sums and divides by the whole accumulated batch's label count: the
    fused path must give that, not a mean per micro-batch."""
    torch.manual_seed(0)
    model = _llama().train()
    ids, labels = _batch(300, masked=True)
    n = (labels[:, 1:] != -100).sum()
    plain = copy.deepcopy(model)(input_ids=ids, labels=labels, num_items_in_batch=n * 3).loss
    opt = torch.optim.AdamW(model.parameters())
    fused_model, _, _ = fastops.accelerate(model, opt, precision="fp32", fused_loss=True, device="cpu")
    fused = fused_model(input_ids=ids, labels=labels, num_items_in_batch=n * 3).loss
    torch.testing.assert_close(fused, plain, rtol=2e-6, atol=0)


def test_without_labels_or_in_eval_the_model_runs_as_before():
    torch.manual_seed(0)
    model = _llama()
    ids, labels = _batch(300, masked=False)
    opt = torch.optim.AdamW(model.parameters())
    ref = copy.deepcopy(model)
    model, _, _ = fastops.accelerate(model, opt, precision="fp32", fused_loss=True, device="cpu")
    out = model(input_ids=ids)
    assert type(out.logits) is torch.Tensor
    torch.testing.assert_close(out.logits, ref(input_ids=ids).logits)
    model.eval()
    out = model(input_ids=ids, labels=labels)
    assert type(out.logits) is torch.Tensor and out.loss is not None


def test_other_uses_of_the_logits_get_the_real_ones():
    x = torch.randn(4, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    stand = _fused_loss._Logits(x, w, None, torch.float32)
    assert stand.shape == (4, 5, 11) and stand.dtype == torch.float32 and stand.requires_grad
    capped = torch.tanh(stand / 30.0) * 30.0  # Gemma 2's soft-capping, say: computed on the real logits
    torch.testing.assert_close(capped, torch.tanh(x @ w.T / 30.0) * 30.0)
    assert type(capped) is torch.Tensor
    t = torch.randint(0, 11, (20,))
    weighted = torch.nn.functional.cross_entropy(stand.view(-1, 11), t, weight=torch.rand(11))
    assert type(weighted) is torch.Tensor and weighted.requires_grad


def test_heads_that_do_more_than_a_linear_map_are_left_alone():
    torch.manual_seed(0)
    model = _llama()
    model.config.final_logit_softcapping = 30.0
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _, _ = fastops.accelerate(model, opt, precision="fp32", fused_loss=True, device="cpu")
    assert any("final_logit_softcapping" in str(w.message) for w in caught)
    ids, labels = _batch(300, masked=False)
    assert type(model(input_ids=ids, labels=labels).logits) is torch.Tensor


@pytest.mark.parametrize("value", ["on", 1, None])
def test_fused_loss_takes_true_false_or_auto(value):
    with pytest.raises(ValueError, match="fused_loss must be True, False or 'auto'"):
        fastops.Accelerator(fused_loss=value)
