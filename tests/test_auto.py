"""compile="auto" and fused_loss="auto", fastops.accelerate's defaults: what the rules decide for which model, the
one log line that says so, and that the defaults train as the explicit settings they pick."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torchvision

import fastops
from fastops.accelerate import _auto, _fused_loss

transformers = pytest.importorskip("transformers")


def _bert(hidden=32, layers=2, vocab=300, dropout=0.0):
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=64,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


def _llama(vocab=300):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _batch(vocab=300, masked=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 16), generator=g)
    labels = ids.clone()
    if masked:
        labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
    return {"input_ids": ids, "labels": labels}


def _prepare(model, loader=None, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = fastops.accelerate(model, opt, loader, device="cpu", **kw)
    return model, opt, loader, opt.accelerator


@pytest.mark.parametrize("name", ["compile", "fused_loss"])
@pytest.mark.parametrize("value", ["on", 1, None, "Auto"])
def test_options_take_true_false_or_auto(name, value):
    with pytest.raises(ValueError, match=f"{name} must be True, False or 'auto'"):
        fastops.Accelerator(**{name: value})


def test_compile_rules():
    """Off for tiny blocks, blocks with convolutions or dropout on the CPU and models without a repeated block; on for
    transformer layers of a real size (BERT 4x256 without dropout); forced either way by True/False, except that
    blocks with convolutions or dropout stay eager on the CPU even then (compiled, they measured slower). Nothing
    compiles here: the regions compile at their first call."""
    torch.manual_seed(0)
    cases = [(_bert(), "auto", False, "blocks of at most"),
             (torchvision.models.resnet18(), "auto", False, "convolution blocks"),
             (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), "auto", False, "no repeated block"),
             (_bert(hidden=256, layers=4), "auto", True, "regions BertEmbeddings, 4 x BertLayer"),
             (_bert(), True, True, "compile=True"), (_bert(hidden=256, layers=4), False, False, "compile=False"),
             (torchvision.models.resnet18(), True, False, "compile=True, but every region stays eager: convolution"),
             (_bert(hidden=256, layers=4, dropout=0.1), "auto", False, "blocks with dropout on the CPU"),
             (_bert(dropout=0.1), True, False, "compile=True, but every region stays eager: blocks with dropout"),
             (_llama(), True, True, "compile=True")]
    for model, asked, on, why in cases:
        _, _, _, acc = _prepare(model, compile=asked)
        assert acc.decision.compile is on and why in acc.decision.compile_why, (asked, acc.decision)
        assert (acc._step_state.regions is not None) is on


def test_a_short_loader_leaves_auto_compile_off():
    torch.manual_seed(0)
    batches = [_batch(masked=True)] * 3
    model, _, _, acc = _prepare(_bert(hidden=256, layers=2), batches)
    assert not acc.decision.compile and "3 batches a pass" in acc.decision.compile_why
    assert acc._step_state.regions is None
    assert all(m._compiled_call_impl is None for m in model.modules())
    _, _, _, forced = _prepare(_bert(hidden=256, layers=2), batches, compile=True)
    assert forced.decision.compile and forced._step_state.regions is not None


def test_fused_rule():
    cpu = torch.device("cpu")
    limit = _auto.ALL_ROWS_MAX_VOCAB
    assert _auto.fused_rule(rows=2048, labeled=307, vocab=8192, hidden=256, device=cpu)[0] == "fused"
    assert _auto.fused_rule(rows=2048, labeled=307, vocab=128000, hidden=256, device=cpu)[0] == "fused"
    assert _auto.fused_rule(rows=1016, labeled=1016, vocab=limit, hidden=256, device=cpu)[0] == "fused"
    mode, why = _auto.fused_rule(rows=1016, labeled=1016, vocab=limit + 1, hidden=256, device=cpu)
    assert mode == "eager" and "1016 of 1016 rows labeled" in why
    assert _auto.fused_rule(rows=1016, labeled=1016, vocab=limit + 1, hidden=256, device=cpu, compiled=True)[0] \
        == "compiled"
    # fp16 (a loss scaler's skipped steps must follow the run without fastops: test_frameworks' fp16 tests)
    mode, why = _auto.fused_rule(rows=2048, labeled=307, vocab=8192, hidden=256, device=cpu, dtype=torch.float16)
    assert mode == "eager" and why.startswith("fp16")
    assert _auto.fused_rule(rows=2048, labeled=307, vocab=8192, hidden=256, device=cpu, dtype=torch.bfloat16)[0] \
        == "fused"


def _loss_and_grads(model, batch, **kw):
    model, _, _, acc = _prepare(copy.deepcopy(model), precision="fp32", **kw)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}, acc


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_the_defaults_fuse_the_loss_with_the_models_values(kind):
    """fused_loss="auto" decides at the first labeled call (the masked LM: 15% of the rows labeled; the causal
    LM: all rows at a small vocabulary) and gives the unfused model's loss and gradients (fp32 tolerances of
    tests/test_fused_loss.py: another summation order over V = 300 and over the 48 rows)."""
    torch.manual_seed(0)
    model = _bert() if kind == "bert" else _llama()
    batch = _batch(masked=kind == "bert")
    plain, g_plain, _ = _loss_and_grads(model, batch, fused_loss=False)
    auto, g_auto, acc = _loss_and_grads(model, batch)
    assert acc.decision.fused_loss is True and "rows labeled, vocabulary 300" in acc.decision.fused_why
    assert _fused_loss.is_lazy(auto.logits)
    torch.testing.assert_close(auto.loss, plain.loss, rtol=2e-6, atol=0)
    scale = max(g.abs().max() for g in g_plain.values())
    for name, g in g_plain.items():
        assert (g_auto[name] - g).abs().max() / scale <= 4e-6, name


def test_auto_keeps_the_heads_own_loss_where_the_rule_says_it_is_faster(monkeypatch):
    monkeypatch.setattr(_auto, "ALL_ROWS_MAX_VOCAB", 200)  # the rule's all-rows limit below this vocabulary
    torch.manual_seed(0)
    model = _llama()
    batch = _batch()
    plain, g_plain, _ = _loss_and_grads(model, batch, fused_loss=False)
    auto, g_auto, acc = _loss_and_grads(model, batch)
    assert acc.decision.fused_loss is False and "the head's own loss runs" in acc.decision.fused_why
    assert type(auto.logits) is torch.Tensor
    assert torch.equal(auto.loss, plain.loss)  # the same code: the head's logits and F.cross_entropy
    for name, g in g_plain.items():
        assert torch.equal(g_auto[name], g), name
    # Later calls skip the stand-in: the head runs as it is.
    assert type(acc.model(**batch).logits) is torch.Tensor


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_where_the_blocks_compile_the_heads_own_loss_runs_compiled(monkeypatch, backend):
    """All rows labeled above the rule's vocabulary, compile on: the model's own loss (matmul, fp32 upcast,
    cross_entropy) through torch.compile, out.logits still built only when read. The "eager" backend runs the
    same code as the model: equal bits; inductor (the regions too, here) fuses and rounds in another order (fp32,
    a row of V = 300: the tolerances of tests/test_fused_loss.py)."""
    from fastops.accelerate import _compile

    monkeypatch.setattr(_auto, "ALL_ROWS_MAX_VOCAB", 200)
    monkeypatch.setattr(_compile, "BACKEND", "eager")  # the regions: their mechanics only
    torch.manual_seed(0)
    model = _llama()
    batch = _batch()
    plain, g_plain, _ = _loss_and_grads(model, batch, fused_loss=False, compile=True)
    monkeypatch.setattr(_compile, "BACKEND", backend)
    got, g_got, acc = _loss_and_grads(model, batch, compile=True)
    assert acc.decision.fused_loss is False and "runs compiled" in acc.decision.fused_why
    assert acc.fused_head.mode == "compiled" and _fused_loss.is_lazy(got.logits)
    rtol, gtol = (0, 0) if backend == "eager" else (2e-6, 4e-6)
    torch.testing.assert_close(got.loss, plain.loss, rtol=rtol, atol=0)
    scale = max(g.abs().max() for g in g_plain.values())
    for name, g in g_plain.items():
        assert (g_got[name] - g).abs().max() / scale <= gtol, name
    # Under inductor the blocks' fused elementwise code rounds the hidden states in another order too: a logit
    # (|z| < 1, a sum of 32 products) moves by a few fp32 ulps.
    torch.testing.assert_close(got.logits, plain.logits, rtol=0, atol=0 if backend == "eager" else 1e-6)


def test_the_decision_is_one_log_line_at_the_first_training_call(caplog):
    torch.manual_seed(0)
    model, opt, _, acc = _prepare(_bert(), precision="fp32")
    with caplog.at_level(logging.INFO, logger="fastops.accelerate"):
        model.eval()
        with torch.no_grad():
            model(**_batch(masked=True))
        assert not caplog.records  # eval calls decide nothing
        model.train()
        for _ in range(2):
            model(**_batch(masked=True)).loss.backward()
            opt.step()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0] == acc.decision.line()
    assert lines[0].startswith("fastops.accelerate: compile=off (blocks of at most")
    assert "fused_loss=on (" in lines[0] and "rows labeled, vocabulary 300" in lines[0]


def test_models_that_cannot_fuse_say_why():
    torch.manual_seed(0)
    _, _, _, acc = _prepare(torchvision.models.resnet18(), precision="fp32")
    assert acc.decision.fused_loss is False and "not an HF transformers model" in acc.decision.fused_why
    capped = _llama()
    capped.config.final_logit_softcapping = 30.0
    _, _, _, acc = _prepare(capped, precision="fp32")
    assert acc.decision.fused_loss is False and "final_logit_softcapping" in acc.decision.fused_why


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_channels_last_for_bf16_conv_nets_on_a_cpu_with_native_bf16(precision, monkeypatch):
    want = precision == "bf16" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.manual_seed(0)
    model, _, _, acc = _prepare(torchvision.models.resnet18(), precision=precision)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last) == want
    assert acc.decision.channels_last == want and "channels_last=" in acc.decision.line()
    monkeypatch.setenv("FASTOPS_CHANNELS_LAST", "0")
    model, _, _, acc = _prepare(torchvision.models.resnet18(), precision=precision)
    assert not model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
