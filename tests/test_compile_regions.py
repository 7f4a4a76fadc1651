"""fastops.accelerate(compile=True): each repeated block compiled once, the rest eager; a failed compile falls back
to eager with one warning; graph breaks and recompiles reported once. The mechanics run on dynamo's "eager"
backend (no inductor compile time); one test compiles for real."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch._dynamo.utils import counters
from transformers import BertConfig, BertForMaskedLM

import fastops
from fastops.accelerate import _compile


def tiny_bert(layers: int = 4):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForMaskedLM(cfg)


def mlm_batches(n: int):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(5, 128, (4, 16), generator=g) for _ in range(n)]
    return [{"input_ids": i, "labels": i} for i in ids]


class Stack(nn.Module):
    """A user's model: a ModuleList of one block class between two layers of their own."""

    def __init__(self, block=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList((block or Block)() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class BreakingBlock(Block):
    def forward(self, x):
        torch._dynamo.graph_break()
        return x + torch.tanh(self.fc(x))


def test_find_regions():
    bert = tiny_bert(3)
    assert [type(m).__name__ for m in _compile.find_regions(bert)] == ["BertEmbeddings"] + ["BertLayer"] * 3
    resnet = torchvision.models.resnet18()
    regions = _compile.find_regions(resnet)
    assert len(regions) == 8 and {type(m).__name__ for m in regions} == {"BasicBlock"}
    stack = Stack()
    assert _compile.find_regions(stack) == list(stack.blocks)
    assert _compile.find_regions(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []  # no repeated class


def _train(model, batches, compile, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = fastops.accelerate(model, opt, batches, precision="fp32", device="cpu", compile=compile)
    losses = []
    for batch in loader:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _hf_loss(model, batch):
    return model(**batch).loss


def _stack_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _stack_batches(n):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def test_repeated_blocks_compile_once(monkeypatch):
    """Four BertLayers and the embeddings: two graphs, whatever the number of layers; losses as eager."""
    monkeypatch.setattr(_compile, "BACKEND", "eager")
    want = _train(tiny_bert(), mlm_batches(3), False, _hf_loss)
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastops", category=RuntimeWarning)  # no break, no recompile
        got = _train(tiny_bert(), mlm_batches(3), True, _hf_loss)
    assert counters["stats"]["unique_graphs"] - before == 2
    assert got == pytest.approx(want, rel=1e-6)


def test_failed_compile_falls_back_to_eager(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("this backend cannot compile")

    monkeypatch.setattr(_compile, "BACKEND", broken)
    want = _train(Stack(), _stack_batches(3), False, _stack_loss)
    with pytest.warns(RuntimeWarning, match=r"compiling \['Block'\] failed, so the model runs eagerly.*cannot compile"):
        got = _train(Stack(), _stack_batches(3), True, _stack_loss)
    assert got == want  # the eager code itself, from the failed call on


def test_graph_breaks_are_reported_once(monkeypatch):
    monkeypatch.setattr(_compile, "BACKEND", "eager")
    with pytest.warns(RuntimeWarning, match="graph breaks") as record:
        _train(Stack(BreakingBlock), _stack_batches(4), True, _stack_loss)
    assert sum("graph breaks" in str(w.message) for w in record) == 1


def test_inductor_regions_train_like_eager():
    # CI and the dev machines have gcc, so inductor must compile here: any failure is a real one.
    want = _train(Stack(), _stack_batches(3), False, _stack_loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastops", category=RuntimeWarning)
        got = _train(Stack(), _stack_batches(3), True, _stack_loss)
    # Inductor may fuse the block's add and tanh into one loop and round in another order: fp32 rounding.
    assert got == pytest.approx(want, rel=1e-5)


class Width(nn.Module):
    """A block whose width varies between instances, as ResNet's bottlenecks do between stages."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def test_each_block_signature_gets_its_own_static_graph(monkeypatch):
    """Blocks of one class but four shapes: one graph per signature, each with static shapes (a graph dynamo
    made dynamic takes SymInt inputs), none counted against another's recompile limit (2 here; ResNet-50 has 8
    signatures against torch's 8: one more, a guard on grad mode say, and the rest ran eager); losses as eager."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([type(x).__name__ for x in example_inputs])
        return gm.forward

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([Width(6, 8), Width(8, 8), Width(8, 16), Width(16, 16), Width(16, 16)])
            self.out = nn.Linear(16, 3)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    monkeypatch.setattr(_compile, "BACKEND", capture)
    want = _train(Model(), _stack_batches(3), False, _stack_loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastops", category=RuntimeWarning)  # no recompile reported
        got = _train(Model(), _stack_batches(3), True, _stack_loss)
    assert len(graphs) == 4  # (6, 8), (8, 8), (8, 16), (16, 16)
    assert all("SymInt" not in kinds for kinds in graphs), graphs
    assert got == want


class Indexed(Block):
    """A block that reads an int attribute of its own, as HF's layers read layer_idx (their KV cache's update)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) / (1 + self.index)


def test_blocks_that_differ_in_an_int_attribute_all_compile(monkeypatch):
    """Dynamo specializes on the int each block reads, so each compiles a graph of its own, one code object for
    all: past the recompile limit (2 here, torch's 8 against 32 layers of a Llama) the rest would run eagerly.
    Every block gets its graph, nothing is reported, losses as eager."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Model(Stack):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Indexed(i) for i in range(5))

    monkeypatch.setattr(_compile, "BACKEND", capture)
    want = _train(Model(), _stack_batches(3), False, _stack_loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastops", category=RuntimeWarning)
        got = _train(Model(), _stack_batches(3), True, _stack_loss)
    assert len(graphs) == 5
    assert got == want
    assert torch._dynamo.config.recompile_limit == 2  # raised only around the regions' calls


def test_hf_training_calls_skip_the_kv_cache_so_layers_share_a_graph(monkeypatch):
    """A Llama's layers read layer_idx only to update the KV cache its config has training calls build: with the
    regions compiled, training calls run without it and the three layers share one graph; losses as eager. A call
    that asks for the cache, and an eval call, still get one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)  # fmt: skip
        return LlamaForCausalLM(cfg)

    monkeypatch.setattr(_compile, "BACKEND", "eager")
    batches = mlm_batches(3)
    want = _train(llama(), batches, False, _hf_loss)
    before = counters["stats"]["unique_graphs"]
    opt_model = llama()
    got = _train(opt_model, batches, True, _hf_loss)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert got == pytest.approx(want, rel=1e-6)
    assert opt_model(**batches[0]).past_key_values is None
    assert opt_model(**batches[0], use_cache=True).past_key_values is not None
    opt_model.eval()
    with torch.no_grad():
        assert opt_model(**batches[0]).past_key_values is not None


PROBE_SCRIPT = """
import json, sys
import torch._inductor.cpp_builder as builder
from torch._inductor import cpu_vec_isa
from fastops.accelerate import _compile

threads = _compile.probe_vector_isas() if sys.argv[1] == "probe" else []
_compile._await_probes()
builds = []
run = builder._run_compile_cmd
builder._run_compile_cmd = lambda *a, **k: (builds.append(a[0]), run(*a, **k))[1]
picked = cpu_vec_isa.pick_vec_isa()
print(json.dumps({"threads": len(threads), "builds_after": len(builds), "picked": str(picked),
                  "flags": picked.build_arch_flags(), "valid": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]}))
"""


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="inductor's ISA checks are x86's")
def test_vector_isa_probes_give_inductor_its_own_answer(tmp_path):
    """The probes the regions' first compiled call starts are inductor's own checks: after them inductor builds
    nothing more to pick its ISA, and it picks what a process without them picks (each process with a new inductor
    cache)."""
    import json
    import os
    import subprocess
    import sys

    out = {}
    for mode in ("probe", "plain"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / mode))
        done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, mode], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    probe, plain = out["probe"], out["plain"]
    assert probe["threads"] >= len(plain["valid"]) >= 1  # every ISA the CPU flags name; the valid ones among them
    assert probe["builds_after"] == 0 < plain["builds_after"]
    assert (probe["picked"], probe["flags"], probe["valid"]) == (plain["picked"], plain["flags"], plain["valid"])
