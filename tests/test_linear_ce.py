"""fastops.linear_cross_entropy against F.cross_entropy(F.linear(...)) on every CPU backend.

Tolerances. fp32: both sides compute the same sums in other orders (chunked matmuls, another log-sum-exp order),
so each is compared with a float64 run of the same inputs, and fastops must be within FACTOR (4) times torch's own
fp32 error of it, with a floor of 16 ulp (tests/rounding.py; normwise for tensors). bf16: both sides round the
logits to bf16 (F.linear does, so the op does too) and then work in fp32, so what separates them is rounding: a
logit of either side may land on the neighbouring bf16 value (the matmul blocks rows differently), which moves a
row's lse and its target logit by at most one bf16 ulp of the largest |logit| each (2 * 2^-8 |z|max); torch rounds
its log-probabilities to bf16 and the op rounds its loss once (2^-9 |loss| each). A gradient element (normwise)
carries the rounding of its logit's softmax term (p * 2 * 2^-8 |z|max relative) and up to four bf16 roundings
(dlogits, the product, and on fastops' side the per-chunk grad_weight partial sum before its fp32 accumulation).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fastops
from fastops import _backend, _lce
from tests.rounding import FACTOR, FLOOR, rel_err

BACKENDS = ("reference", "cpp", "triton")
FAST_BACKENDS = ("reference", "cpp")  # the hypothesis sweep; Triton (the interpreter) is slow
U_BF16 = 2.0**-8  # bf16's ulp at 1 (8 significant bits: 2^-8 spacing, half of it the rounding error)


# Small chunks, so that every test goes through several of them (the default holds 262 rows of a 32k vocabulary).
SMALL_CHUNK = 1 << 14


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(_lce, "CHUNK_ELEMENTS", SMALL_CHUNK)
    with _backend.use("cpu", request.param):
        if request.param != "reference":  # a backend without the op must fail here, not fall back quietly
            assert _lce._pass_for("cpu") is not _lce.reference_pass
        yield request.param


def _inputs(n, h, v, dtype=torch.float32, labeled=0.5, bias=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=g) * scale).to(dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) >= labeled] = -100
    return x, w, b, t


def _run(fn, x, w, b, t, grad_out_seed=1, **kw):
    """Loss and the grads of (loss * a fixed random weight).sum() for x, w and b."""
    leaves = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
    if b is not None:
        leaves.append(b.detach().clone().requires_grad_())
    loss = fn(leaves[0], leaves[1], t, leaves[2] if b is not None else None, **kw)
    gout = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(loss.dtype)
    (loss * gout).sum().backward()
    return [loss.detach()] + [p.grad for p in leaves]


def _torch(x, w, t, b, **kw):
    return F.cross_entropy(F.linear(x, w, b), t, **kw)


def _fast(x, w, t, b, **kw):
    return fastops.linear_cross_entropy(x, w, t, bias=b, **kw)


def _assert_fp32(x, w, b, t, **kw):
    got = _run(_fast, x, w, b, t, **kw)
    ref = _run(_torch, x, w, b, t, **kw)
    exact = _run(_torch, x.double(), w.double(), None if b is None else b.double(), t, **kw)
    for name, a, r, e in zip(("loss", "grad_x", "grad_w", "grad_b"), got, ref, exact):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        if e.isnan().all():
            assert a.isnan().all(), name
            continue
        tol = max(FACTOR * rel_err(r, e), FLOOR)
        assert rel_err(a, e) <= tol, f"{name}: {rel_err(a, e):.2e} > {tol:.2e} (torch fp32: {rel_err(r, e):.2e})"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_parity(backend, reduction, label_smoothing, bias):
    x, w, b, t = _inputs(300, 24, 997, bias=bias)  # 300 rows: several chunks of a 997-class vocabulary
    _assert_fp32(x, w, b, t, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("vocab", [1, 2, 7, 4099, 256_000])
def test_vocab_sizes(backend, vocab):
    n = 4 if vocab > 10_000 else 40  # keep the 256k one cheap: 4 rows x 256k x 8
    x, w, b, t = _inputs(n, 8, vocab, labeled=0.75)
    _assert_fp32(x, w, b, t, reduction="mean")
    _assert_fp32(x, w, b, t, reduction="none", label_smoothing=0.2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_bf16_parity(backend, reduction, label_smoothing):
    x, w, b, t = _inputs(257, 64, 3001, torch.bfloat16, scale=2.0)
    got = _run(_fast, x, w, b, t, reduction=reduction, label_smoothing=label_smoothing)
    ref = _run(_torch, x, w, b, t, reduction=reduction, label_smoothing=label_smoothing)
    zmax = float(F.linear(x, w, b).float().abs().max())
    row_loss = _run(_torch, x.float(), w.float(), b.float(), t, reduction="none", label_smoothing=label_smoothing)[0]
    row_tol = U_BF16 * row_loss.abs() + 2 * U_BF16 * zmax  # per row (see the module docstring)
    labeled = (t != -100).sum().clamp_min(1)
    loss_tol = {"none": row_tol, "sum": row_tol.sum(), "mean": row_tol.sum() / labeled}[reduction]
    loss_tol = loss_tol + U_BF16 * got[0].float().abs()  # the final rounding of a sum or mean to bf16
    assert ((got[0].float() - ref[0].float()).abs() <= loss_tol).all()
    grad_tol = (4 + 2 * zmax) * U_BF16 / 2
    for name, a, r in zip(("grad_x", "grad_w", "grad_b"), got[1:], ref[1:]):
        assert a.dtype == torch.bfloat16
        err = rel_err(a.float(), r.float())
        assert err <= grad_tol, f"{name}: {err:.2e} > {grad_tol:.2e}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored_match_torch(backend, reduction):
    x, w, b, t = _inputs(10, 8, 30)
    t[:] = -100
    got = _run(_fast, x, w, b, t, reduction=reduction, label_smoothing=0.1)
    ref = _run(_torch, x, w, b, t, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(got[0], ref[0], equal_nan=True)  # mean: nan (0 / 0), as torch
    for a, r in zip(got[1:], ref[1:]):
        assert (a == 0).all() and (r == 0).all()


def test_grad_accumulated_batch_is_the_mean_over_the_whole_batch(backend):
    """Micro-batches with reduction="sum" divided by the labeled count of the whole batch give the gradient of the
    mean over the whole batch (not the mean of per-micro-batch means: Liger #802)."""
    x, w, b, t = _inputs(120, 16, 211, labeled=0.3, seed=3)
    t[:40] = torch.where(torch.arange(40) < 38, -100, t[:40])  # the micro-batches get very different label counts
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    loss = _torch(xr, wr, t, br)
    loss.backward()
    whole = [loss.detach(), xr.grad, wr.grad, br.grad]
    xs = x.clone().requires_grad_()
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    count = (t != -100).sum()
    total = 0.0
    for part in (slice(0, 40), slice(40, 120)):
        loss = fastops.linear_cross_entropy(xs[part], ws, t[part], bias=bs, reduction="sum") / count
        loss.backward()
        total += loss.detach()
    for name, a, r in zip(("loss", "grad_x", "grad_w", "grad_b"), [total, xs.grad, ws.grad, bs.grad], whole):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=name)


def test_recompute_backward_equals_fused(backend):
    """The backward op (recompute) on mean gives what the forward's fused gradients give."""
    x, w, b, t = _inputs(90, 16, 333, seed=5)
    loss, gx, gw, gb = torch.ops.fastops.linear_cross_entropy(x, w, t, b, -100, "mean", 0.1, True)
    rx, rw, rb = torch.ops.fastops.linear_cross_entropy_backward(torch.tensor(1.0), x, w, t, b, -100, "mean", 0.1)
    for a, r in ((gx, rx), (gw, rw), (gb, rb)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), h=st.integers(1, 20), v=st.integers(1, 300), labeled=st.floats(0.0, 1.0),
       reduction=st.sampled_from(["mean", "sum", "none"]), eps=st.sampled_from([0.0, 0.05, 1.0]),
       bias=st.booleans(), seed=st.integers(0, 2**16), ignore=st.sampled_from([-100, 0]))
def test_hypothesis_fp32(n, h, v, labeled, reduction, eps, bias, seed, ignore):
    x, w, b, t = _inputs(n, h, v, labeled=labeled, bias=bias, seed=seed)
    t = torch.where(t == -100, torch.full_like(t, ignore), t)
    for name in FAST_BACKENDS:
        with _backend.use("cpu", name), pytest.MonkeyPatch.context() as mp:
            mp.setattr(_lce, "CHUNK_ELEMENTS", SMALL_CHUNK)
            _assert_fp32(x, w, b, t, reduction=reduction, label_smoothing=eps, ignore_index=ignore)


def test_leading_dims_and_no_grad(backend):
    x, w, b, t = _inputs(24, 8, 50)
    x3, t3 = x.view(4, 6, 8), t.view(4, 6)
    got = fastops.linear_cross_entropy(x3, w, t3, bias=b, reduction="none")
    torch.testing.assert_close(got, _torch(x3.reshape(-1, 8), w, t, b, reduction="none").view(4, 6))
    with torch.no_grad():
        out = torch.ops.fastops.linear_cross_entropy(x, w, t, b, -100, "mean", 0.0, torch.is_grad_enabled())
    assert all(o.numel() == 0 for o in out[1:])  # no gradient computed under no_grad


@pytest.mark.parametrize("with_grad", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(backend, reduction, with_grad):
    x, w, b, t = _inputs(20, 8, 40)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    torch.library.opcheck(torch.ops.fastops.linear_cross_entropy.default, (x, w, t, b, -100, reduction, 0.1, with_grad))
    grad_loss = torch.rand(20 if reduction == "none" else ())
    torch.library.opcheck(torch.ops.fastops.linear_cross_entropy_backward.default,
                          (grad_loss, x.detach(), w.detach(), t, None, -100, reduction, 0.0))


def test_torch_compile_fullgraph(backend):
    x, w, b, t = _inputs(64, 16, 100)

    def step(x, w, b, t):
        return fastops.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.1) * 2.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = _run(lambda x, w, t, b: compiled(x, w, b, t), x, w, b, t)
    ref = _run(lambda x, w, t, b: step(x, w, b, t), x, w, b, t)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)


BAD = [
    ("weight_dtype", lambda x, w, b, t: (x, w.double(), b, t), TypeError, "weight has dtype"),
    ("hidden", lambda x, w, b, t: (x, w[:, :7], b, t), ValueError, "hidden size"),
    ("bias_shape", lambda x, w, b, t: (x, w, b[:3], t), ValueError, "bias has shape"),
    ("target_shape", lambda x, w, b, t: (x, w, b, t[:5]), ValueError, "target has shape"),
    ("target_dtype", lambda x, w, b, t: (x, w, b, t.float()), TypeError, "target has dtype"),
    ("x_dtype", lambda x, w, b, t: (x.long(), w, b, t), TypeError, "x has dtype"),
    ("device", lambda x, w, b, t: (x, w.to("meta"), b, t), ValueError, "weight is on meta"),
    ("out_of_range", lambda x, w, b, t: (x, w, b, torch.full_like(t, 30)), IndexError, "Target 30 is out of bounds"),
    ("negative", lambda x, w, b, t: (x, w, b, torch.full_like(t, -3)), IndexError, "Target -3 is out of bounds"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_clearly(backend, case):
    _, make, exc, msg = case
    args = make(*_inputs(10, 8, 30))
    with pytest.raises(exc, match=msg):
        fastops.linear_cross_entropy(args[0], args[1], args[3], bias=args[2])
    with pytest.raises(exc, match=msg):  # the op itself checks too
        torch.ops.fastops.linear_cross_entropy(args[0], args[1], args[3], args[2], -100, "mean", 0.0, False)


def test_bad_options_raise():
    x, w, b, t = _inputs(10, 8, 30)
    with pytest.raises(ValueError, match="reduction must be one of"):
        fastops.linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        fastops.linear_cross_entropy(x, w, t, label_smoothing=1.5)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_cpp_row_pass_of_every_isa(capability):
    """The C++ row pass is compiled once per ISA and picked at load time: the narrower copies, in a fresh process
    (FASTOPS_CPU_CAPABILITY lowers the pick), pass the fp32 and bf16 parity checks too."""
    code = (
        "import torch, tests.test_linear_ce as T; from fastops import _backend, _C\n"
        f"assert _C.cpu_capability() in ({capability!r}, 'default'), _C.cpu_capability()\n"
        "T._lce.CHUNK_ELEMENTS = T.SMALL_CHUNK\n"
        "with _backend.use('cpu', 'cpp'):\n"
        "    T._assert_fp32(*T._inputs(70, 24, 997), reduction='mean', label_smoothing=0.1)\n"
        "    T._assert_fp32(*T._inputs(70, 24, 997), reduction='none')\n"
        "    T.test_bf16_parity('cpp', 'mean', 0.1)\n"
    )
    env = {**os.environ, "FASTOPS_CPU_CAPABILITY": capability}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_fp16_sums_in_fp32_where_torch_overflows(backend):
    """fp16 logits as F.linear rounds them, then fp32 (the op's contract). torch's own fp16 cross_entropy with label
    smoothing sums 3001 log-probabilities in fp16 and returns inf here; the op matches torch run on the fp16 logits
    cast to fp32. Tolerances: the loss rounds once to fp16 (2^-11 relative) after fp32 sums (~1e-6 here); a gradient
    carries four fp16 roundings (the logits' gradient, the matmul output, the per-chunk grad_weight partial, the
    final cast) on fastops' side and two on torch's: normwise 6 * 2^-11."""
    x, w, b, t = _inputs(257, 64, 3001, torch.float16, scale=2.0)
    assert torch.isinf(_torch(x, w, t, b, label_smoothing=0.1))  # torch's fp16 path, for the record
    got = _run(_fast, x, w, b, t, label_smoothing=0.1)
    ref = _run(lambda x, w, t, b, **kw: F.cross_entropy(F.linear(x, w, b).float(), t, **kw), x, w, b, t,
               label_smoothing=0.1)
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2.0**-10, atol=0)
    for name, a, r in zip(("grad_x", "grad_w", "grad_b"), got[1:], ref[1:]):
        assert a.dtype == torch.float16
        err = rel_err(a.float(), r.float())
        assert err <= 6 * 2.0**-11, f"{name}: {err:.2e}"
