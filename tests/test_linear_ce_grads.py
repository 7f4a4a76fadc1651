"""fastops.linear_cross_entropy's gradients as autograd sees them: only those wanted (a frozen head, a frozen x),
in the fused forward and in reduction="none"'s backward, eager and under torch.compile (ignored rows included);
gradient accumulation over micro-batches with a whole-batch normalizer; the backward that recomputes the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastops
from fastops._specs import linear_ce as spec
from tests.test_linear_ce import CHUNK, _torch, backend  # noqa: F401  (a fixture)

ops = torch.ops.fastops


def _leaves(x, w, b, wants):
    return [t.detach().clone().requires_grad_(want) if t is not None else None for t, want in zip((x, w, b), wants)]


@pytest.mark.parametrize("wants", [(True, False, False), (False, True, True), (True, True, False),
                                   (False, False, False)], ids=["frozen-head", "frozen-x", "no-bias-grad", "none"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_only_wanted_gradients(backend, wants, reduction):
    """Each tensor gets a .grad exactly when it requires one, equal to torch's; the op computes nothing else: the
    forward's outputs for the unwanted ones are empty, and reduction="none"'s backward op is asked for no more."""
    x, w, b, t = spec.tensors(50, 8, 70, labeled=0.6, seed=1)
    mine, ref = _leaves(x, w, b, wants), _leaves(x, w, b, wants)
    calls = []
    real = ops.linear_cross_entropy_backward

    def spy(*args):
        calls.append(args[-4:-1])
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "linear_cross_entropy_backward", spy)
        got = fastops.linear_cross_entropy(mine[0], mine[1], t, bias=mine[2], reduction=reduction, chunk_rows=CHUNK)
        want = _torch(ref[0], ref[1], t, ref[2], reduction=reduction)
        if not any(wants):
            assert got.grad_fn is None and want.grad_fn is None
            return
        gout = torch.rand(want.shape)
        (got * gout).sum().backward()
        (want * gout).sum().backward()
    for a, r, wanted in zip(mine, ref, wants):
        assert (a.grad is None) == (not wanted)
        if wanted:
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)
    assert calls == ([wants] if reduction == "none" else [])
    out = ops.linear_cross_entropy(x, w, t, b, -100, spec.REDUCTIONS.index(reduction), 0.0, 0.0, *wants, CHUNK)
    for g, wanted, full in zip(out[1:], wants, (x.shape, w.shape, b.shape)):
        assert g.shape == (full if wanted and reduction != "none" else (0,))


def test_the_backward_builds_nothing_the_size_of_the_weight(backend):
    """The fused forward's gradients are handed over by the backward: autograd must not build zero gradients for
    the op's gradient outputs first (a V x H fill of 28.8 ms at H2048 V32000, bf16)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, b, t = spec.tensors(50, 8, 70, labeled=0.6, seed=1)
    x, w = x.requires_grad_(), w.requires_grad_()
    built = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == w.shape:
                storage = out.untyped_storage().data_ptr()
                if not any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == storage for a in args):
                    built.append(str(func))  # a new tensor, not a view of an argument
            return out

    loss = fastops.linear_cross_entropy(x, w, t, chunk_rows=CHUNK)
    with Watch():
        loss.backward()
    assert built == [] and w.grad is not None


def test_a_frozen_heads_own_plan_chunks_and_agrees(backend):
    """With the op's own plan (chunk_rows=0) a frozen head goes in chunks of at most FROZEN_CHUNK_ROWS where a
    trained head of the same shape keeps one (it has no grad_weight to accumulate); x's gradient is torch's."""
    from fastops import _lce

    n, h, v = 700, 8, 70
    assert _lce.chunk_rows(n, h, v, 4, False) <= _lce.FROZEN_CHUNK_ROWS < _lce.chunk_rows(n, h, v, 4, True) == n
    x, w, b, t = spec.tensors(n, h, v, labeled=1.0, seed=3)
    mine, ref = _leaves(x, w, b, (True, False, False)), _leaves(x, w, b, (True, False, False))
    fastops.linear_cross_entropy(mine[0], mine[1], t, bias=mine[2], label_smoothing=0.1).backward()
    _torch(ref[0], ref[1], t, ref[2], label_smoothing=0.1).backward()
    assert mine[1].grad is None
    torch.testing.assert_close(mine[0].grad, ref[0].grad, rtol=1e-5, atol=1e-6)


def test_gradient_flag_off_but_required_is_recomputed(backend):
    """A direct call of the op with a flag off while the tensor requires grad still gives it its gradient (the
    backward op recomputes it); fastops.linear_cross_entropy always sets the flags from requires_grad."""
    x, w, b, t = spec.tensors(30, 8, 40, seed=2)
    mine, ref = _leaves(x, w, b, (True, True, True)), _leaves(x, w, b, (True, True, True))
    ops.linear_cross_entropy(mine[0], mine[1], t, mine[2], -100, spec.SUM, 0.1, 0.0, True, False, True, 0)[0].backward()
    _torch(ref[0], ref[1], t, ref[2], reduction="sum", label_smoothing=0.1).backward()
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_grad_accumulation_normalizes_over_the_whole_batch(backend):
    """Micro-batches with normalizer= the whole batch's labeled count give the loss and gradient of the mean over
    the whole batch (not the mean of per-micro-batch means: Liger #802)."""
    x, w, b, t = spec.tensors(120, 16, 211, labeled=0.3, seed=3)
    t[:40] = torch.where(torch.arange(40) < 38, -100, t[:40])  # the micro-batches get very different label counts
    whole = _leaves(x, w, b, (True, True, True))
    loss = _torch(whole[0], whole[1], t, whole[2])
    loss.backward()
    mine = _leaves(x, w, b, (True, True, True))
    count = (t != -100).sum()
    total = 0.0
    for part in (slice(0, 40), slice(40, 120)):
        micro = fastops.linear_cross_entropy(mine[0][part], mine[1], t[part], bias=mine[2], normalizer=count)
        micro.backward()
        total += micro.detach()
    torch.testing.assert_close(total, loss.detach(), rtol=1e-5, atol=1e-6)
    for a, r in zip(mine, whole):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_backward_twice_with_retain_graph(backend):
    """The fused forward's gradients handed over as they are (grad_loss == 1) survive a second backward."""
    x, w, b, t = spec.tensors(20, 8, 30, seed=5)
    mine, ref = _leaves(x, w, b, (True, True, True)), _leaves(x, w, b, (True, True, True))
    loss = fastops.linear_cross_entropy(mine[0], mine[1], t, bias=mine[2])
    loss.backward(retain_graph=True)
    loss.backward()
    want = _torch(ref[0], ref[1], t, ref[2])
    want.backward(retain_graph=True)
    want.backward()
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_recompute_backward_equals_fused(backend):
    """The backward op (recompute) on mean gives what the forward's fused gradients give."""
    args = spec.inputs(90, 16, 333, seed=5, label_smoothing=0.1)
    _, gx, gw, gb = ops.linear_cross_entropy(*args)
    rx, rw, rb = ops.linear_cross_entropy_backward(torch.tensor(1.0), *args)
    for a, r in ((gx, rx), (gw, rw), (gb, rb)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("frozen_head", [False, True])
def test_torch_compile_fullgraph_with_ignored_rows(backend, frozen_head):
    x, w, b, t = spec.tensors(64, 16, 100, labeled=0.4)
    wants = (True, not frozen_head, not frozen_head)

    def step(x, w, b, t):
        return fastops.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.1) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    mine, ref = _leaves(x, w, b, wants), _leaves(x, w, b, wants)
    compiled(mine[0], mine[1], mine[2], t).backward()
    step(ref[0], ref[1], ref[2], t).backward()
    for a, r in zip(mine, ref):
        assert (a.grad is None) == (r.grad is None)
        if r.grad is not None:
            torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.slow
def test_inductor_with_ignored_rows_and_frozen_head():
    """The default torch.compile backend (inductor), rows ignored, head frozen: torch's loss and gradients."""
    x, w, b, t = spec.tensors(48, 16, 90, labeled=0.5, seed=6)

    def step(x, w, b, t):
        return fastops.linear_cross_entropy(x, w, t, bias=b, reduction="none").sum() / 7

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    mine, ref = _leaves(x, w, b, (True, False, False)), _leaves(x, w, b, (True, False, False))
    got = compiled(mine[0], mine[1], mine[2], t)
    want = F.cross_entropy(F.linear(ref[0], ref[1], ref[2]), t, reduction="none").sum() / 7
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine[0].grad, ref[0].grad, rtol=1e-5, atol=1e-6)
    assert mine[1].grad is None


def test_bad_options_raise_through_the_wrapper():
    x, w, b, t = spec.tensors(10, 8, 30)
    with pytest.raises(ValueError, match="reduction must be one of"):
        fastops.linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        fastops.linear_cross_entropy(x, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="normalizer divides the mean"):
        fastops.linear_cross_entropy(x, w, t, reduction="sum", normalizer=4)
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'x'"):
        fastops.linear_cross_entropy(x.tolist(), w, t)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("shape", [(64, 16, 768, 0, 1.0), (40, 8, 70, 7, 0.6), (20, 8, 70, 0, 0.6)],
                         ids=["all-labeled", "chunks", "one-chunk"])
def test_fp32_master_weight_is_the_cast_weight_with_an_fp32_grad(backend, shape, reduction):
    """An fp32 weight and bias under bf16 x compute what their bf16 cast computes (the C++ backend casts a
    vocabulary block at a time where all rows are labeled), and grad_weight and grad_bias come back in fp32: rounded
    to bf16 they are the cast call's bit for bit (rounded once from the same fp32 sums)."""
    n, h, v, chunk, labeled = shape
    x, w, b, t = spec.tensors(n, h, v, torch.bfloat16, labeled=labeled, seed=3, weight_dtype=torch.float32)
    master = _leaves(x, w, b, (True, True, True))
    cast = [master[0].detach().clone().requires_grad_(), *(p.detach().bfloat16().requires_grad_() for p in master[1:])]
    losses = [fastops.linear_cross_entropy(a, wt, t, bias=bt, reduction=reduction, chunk_rows=chunk)
              for a, wt, bt in (master, cast)]
    # A reduced loss's gradient scales the fused forward's gradients in their dtype, rounding the bf16 ones again:
    # loss.backward()'s 1 leaves them as they are.
    g = torch.rand(losses[0].shape) if reduction == "none" else torch.ones(())
    for loss in losses:
        (loss * g).sum().backward()
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(master[0].grad, cast[0].grad)
    for p, q in zip(master[1:], cast[1:]):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad.bfloat16(), q.grad)


GRAD_IS_TORCHS = """
import torch, fastops
from fastops._specs import linear_ce as spec
x, w, b, t = spec.tensors(64, 128, 8192, torch.bfloat16, labeled=0.6, seed=3, weight_dtype=torch.float32)
w.requires_grad_()
fastops.linear_cross_entropy(x, w, t, chunk_rows=8).backward()
assert w.grad.dtype == torch.float32 and w.grad.untyped_storage().resizable(), "a fixed-size storage"
w.grad.resize_(0)
"""


def test_an_fp32_grad_weight_over_chunks_is_torchs_own_tensor():
    """Outside accelerate (no CPU cache: a fresh process), over several chunks, grad_weight is the C++ backend's fp32
    accumulator itself (4 MiB here) and becomes .grad: a tensor of torch's allocator, resizable like any grad."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FASTOPS_BACKEND="cpu:cpp", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", GRAD_IS_TORCHS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
