"""fastops.linear_cross_entropy against F.cross_entropy(F.linear(...)) on every CPU backend, and on the CUDA row
pass's math compiled for the host ("cuda_math": csrc/cuda/ce_math.cuh run by csrc/cpu/ce_cuda_host.cpp).

Tolerances. fp32: both sides compute the same sums in other orders (chunked matmuls, another log-sum-exp order),
so each is compared with a float64 run of the same inputs. fastops must be within FACTOR (4) times torch's own
fp32 error of it (floor 16 ulp, tests/rounding.py; normwise for tensors), plus what its last reduction may add when
summed in another order than torch's: a length-K fp32 dot product is within sum_rtol(K) * sum_k |a_k b_k| of the
exact one (Higham and Mary's probabilistic bound, tests/rounding.py), K = V for grad_x (dlogits @ W), the labeled
rows for grad_weight, grad_bias and a reduced loss. torch's own error stands for the inputs of that reduction
(the logits, their gradient), which both sides compute alike. bf16: both sides round the logits to bf16 (F.linear
does, so the op does too) and then work in fp32, so what separates them is rounding: a logit of either side may
land on the neighbouring bf16 value (the matmul blocks rows differently), which moves a row's lse and its target
logit by at most one bf16 ulp of the largest |logit| each (2 * 2^-8 |z|max); torch rounds its log-probabilities
to bf16 and the op rounds its loss once (2^-9 |loss| each). A gradient element (normwise) carries the rounding of
its logit's softmax term (p * 2 * 2^-8 |z|max relative) and up to four bf16 roundings (dlogits, the product, and
where grad_weight is added up over chunks from bf16 products, the partial before its fp32 accumulation).
"""

from __future__ import annotations

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
from fastops._specs import linear_ce as spec
from tests.rounding import FACTOR, FLOOR, rel_err, sum_rtol

BACKENDS = ("reference", "cpp", "triton", "cuda_math")
FAST_BACKENDS = ("reference", "cpp", "cuda_math")  # the hypothesis sweep; Triton (the interpreter) is slow
U_BF16 = 2.0**-8  # bf16's ulp at 1 (8 significant bits: 2^-8 spacing, half of it the rounding error)
CHUNK = 64  # rows a chunk in these tests, so that most of them go through several


def serve(name):
    """A context that serves CPU tensors with backend ``name``; "cuda_math" is the shared C++ driver around the CUDA
    row pass's host-compiled math in fastops._C.cuda_math (beside the other CUDA kernels' math)."""
    if name != "cuda_math":
        return _backend.use("cpu", name)
    mp = pytest.MonkeyPatch()
    mp.setitem(_backend._chosen, "cpu", ("cuda_math", _backend._C.cuda_math))
    return _Undo(mp)


class _Undo:
    def __init__(self, mp):
        self.mp = mp

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.mp.undo()


@pytest.fixture(params=BACKENDS)
def backend(request):
    with serve(request.param):
        yield request.param


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


def _fast(x, w, t, b, chunk_rows=CHUNK, **kw):
    return fastops.linear_cross_entropy(x, w, t, bias=b, chunk_rows=chunk_rows, **kw)


def _last_reduction_rtol(x, w, b, t, **kw):
    """sum_rtol(K) * || sum_k |a_k b_k| || / || sum_k a_k b_k || for each output's last reduction, from the float64
    run (see the module docstring); 0 where there is nothing to sum."""
    x64, w64 = x.double(), w.double()
    z = F.linear(x64, w64, None if b is None else b.double()).requires_grad_()
    loss = F.cross_entropy(z, t, **kw)
    gout = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).double()
    (loss * gout).sum().backward()
    dl = z.grad
    m = int((t != kw.get("ignore_index", -100)).sum())

    def ratio(a_abs, exact):
        n = float(exact.norm())
        return float(a_abs.norm()) / n if n > 0 else 0.0

    out = {"loss": sum_rtol(m) if loss.dim() == 0 else 0.0}
    out["grad_x"] = sum_rtol(w.shape[0]) * ratio(dl.abs() @ w64.abs(), dl @ w64)
    out["grad_w"] = sum_rtol(m) * ratio(dl.abs().t() @ x64.abs(), dl.t() @ x64)
    out["grad_b"] = sum_rtol(m) * ratio(dl.abs().sum(0), dl.sum(0))
    return out


def _assert_fp32(x, w, b, t, chunk_rows=CHUNK, **kw):
    got = _run(_fast, x, w, b, t, chunk_rows=chunk_rows, **kw)
    ref = _run(_torch, x, w, b, t, **kw)
    exact = _run(_torch, x.double(), w.double(), None if b is None else b.double(), t, **kw)
    extra = _last_reduction_rtol(x, w, b, t, **kw)
    for name, a, r, e in zip(("loss", "grad_x", "grad_w", "grad_b"), got, ref, exact):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        if e.isnan().all():
            assert a.isnan().all(), name
            continue
        tol = max(FACTOR * rel_err(r, e), FLOOR) + extra[name]
        assert rel_err(a, e) <= tol, f"{name}: {rel_err(a, e):.2e} > {tol:.2e} (torch fp32: {rel_err(r, e):.2e})"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_parity(backend, reduction, label_smoothing, bias):
    x, w, b, t = spec.tensors(300, 24, 997, bias=bias)  # 300 rows: several chunks of 64
    _assert_fp32(x, w, b, t, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("chunk_rows", [0, 1, 7, 1000])
def test_chunkings_agree(backend, chunk_rows):
    """Chunks of one row, of an odd count, the op's own choice and one chunk for all rows."""
    x, w, b, t = spec.tensors(61, 16, 300, labeled=0.8, seed=2)
    _assert_fp32(x, w, b, t, chunk_rows=chunk_rows, reduction="mean", label_smoothing=0.05)


@pytest.mark.parametrize("vocab", [1, 2, 7, 4099, 256_000])
def test_vocab_sizes(backend, vocab):
    n = 4 if vocab > 10_000 else 40  # keep the 256k one cheap: 4 rows x 256k x 8
    x, w, b, t = spec.tensors(n, 8, vocab, labeled=0.75)
    # 1: dlogits @ W is a 1 x V @ V x H product, summed unlike torch's 3 x V one. The Triton backend shares the
    # reference's chunk loop (fastops/_lce.py): one chunking is enough for its row pass.
    for rows in (1, CHUNK) if backend != "triton" else (CHUNK,):
        _assert_fp32(x, w, b, t, chunk_rows=rows, reduction="mean")
        _assert_fp32(x, w, b, t, chunk_rows=rows, reduction="none", label_smoothing=0.2)


def _assert_bf16(got, ref, x, w, b, t, reduction, label_smoothing):
    zmax = float(F.linear(x, w, b).float().abs().max())
    row_loss = _run(_torch, x.float(), w.float(), None if b is None else b.float(), t, reduction="none",
                    label_smoothing=label_smoothing)[0]  # fmt: skip
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
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_bf16_parity(backend, reduction, label_smoothing, chunk_rows=CHUNK, labeled=0.5):
    """Chunks of 64 rows: grad_weight added up over them in fp32 (on the C++ CPU backend inside MKL's matmul or over
    bf16 products: test_partial_products_each_way)."""
    x, w, b, t = spec.tensors(130, 32, 1500, torch.bfloat16, scale=2.0, labeled=labeled)
    got = _run(_fast, x, w, b, t, chunk_rows=chunk_rows, reduction=reduction, label_smoothing=label_smoothing)
    ref = _run(_torch, x, w, b, t, reduction=reduction, label_smoothing=label_smoothing)
    _assert_bf16(got, ref, x, w, b, t, reduction, label_smoothing)


@pytest.mark.parametrize("name", FAST_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_parity_one_chunk(name, reduction):
    """The op's own choice here: one chunk, grad_weight straight out of one matmul (and the weight read through its
    contiguous H x V copy on the C++ CPU backend: 130 labeled rows >= 4 H)."""
    with serve(name):
        test_bf16_parity(name, reduction, 0.1, chunk_rows=0, labeled=1.0)


def _matmuls(fn) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_bf16_vocabulary_blocks(reduction, label_smoothing):
    """A trainable bf16 head at few rows per hidden unit: the C++ CPU backend's own plan goes through the vocabulary
    in blocks (the last one short; the logits twice, grad_weight a block at a time over all rows, grad_x summed in
    fp32) and agrees with torch within the bounds the chunks of rows meet."""
    x, w, b, t = spec.tensors(300, 64, 9000, torch.bfloat16, scale=2.0, labeled=0.8)
    m = int((t != -100).sum())
    cols = _lce.vocab_block(m, 64, 9000, 2, True)
    assert 0 < cols < 9000 and 9000 % cols, cols
    with serve("cpp"):
        got = _run(_fast, x, w, b, t, chunk_rows=0, reduction=reduction, label_smoothing=label_smoothing)
        # The blocks ran: 2 logits matmuls and a grad_weight one a block (and grad_x's where bf16 products are
        # summed: the exact ways are not ATen matmuls), but one logits matmul for the last block, whose logits the
        # second pass takes from the first. reduction="none" computes its losses first without gradients, in one
        # chunk of rows: one logits matmul more.
        blocks = -(-9000 // cols)
        ran = _matmuls(lambda: _run(_fast, x, w, b, t, chunk_rows=0, reduction=reduction)) - (reduction == "none")
        assert ran in (3 * blocks - 1, 4 * blocks - 1), (ran, blocks)
    ref = _run(_torch, x, w, b, t, reduction=reduction, label_smoothing=label_smoothing)
    _assert_bf16(got, ref, x, w, b, t, reduction, label_smoothing)


def test_bf16_vocabulary_blocks_with_x_frozen():
    """Blocks without grad_x (a frozen x): grad_weight and grad_bias only, still torch's."""
    x, w, b, t = spec.tensors(300, 64, 9000, torch.bfloat16, scale=2.0, labeled=1.0, seed=5)
    mine = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    ref = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    with serve("cpp"):
        fastops.linear_cross_entropy(x, mine[0], t, bias=mine[1], label_smoothing=0.1).backward()
    _torch(x, ref[0], t, ref[1], label_smoothing=0.1).backward()
    zmax = float(F.linear(x, w, b).float().abs().max())
    for a, r in zip(mine, ref):
        assert rel_err(a.grad.float(), r.grad.float()) <= (4 + 2 * zmax) * U_BF16 / 2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored_match_torch(backend, reduction):
    x, w, b, t = spec.tensors(10, 8, 30)
    t[:] = -100
    got = _run(_fast, x, w, b, t, reduction=reduction, label_smoothing=0.1)
    ref = _run(_torch, x, w, b, t, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(got[0], ref[0], equal_nan=True)  # mean: nan (0 / 0), as torch
    for a, r in zip(got[1:], ref[1:]):
        assert (a == 0).all() and (r == 0).all()


def test_banned_classes_with_minus_inf_bias(backend):
    """A bias of -inf bans classes (never a target): their probability is 0, their gradients 0, as torch's."""
    x, w, b, t = spec.tensors(40, 8, 50, labeled=1.0, seed=4)
    b[::3] = float("-inf")
    t = torch.where(t % 3 == 0, (t + 1) % 50, t)
    got = _run(_fast, x, w, b, t, label_smoothing=0.0)
    ref = _run(_torch, x, w, b, t, label_smoothing=0.0)
    for name, a, r in zip(("loss", "grad_x", "grad_w", "grad_b"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=name)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), h=st.integers(1, 20), v=st.integers(1, 300), labeled=st.floats(0.0, 1.0),
       reduction=st.sampled_from(["mean", "sum", "none"]), eps=st.sampled_from([0.0, 0.05, 1.0]),
       bias=st.booleans(), seed=st.integers(0, 2**16), ignore=st.sampled_from([-100, 0]),
       chunk_rows=st.sampled_from([0, 1, 5, 64]))
def test_hypothesis_fp32(n, h, v, labeled, reduction, eps, bias, seed, ignore, chunk_rows):
    x, w, b, t = spec.tensors(n, h, v, labeled=labeled, bias=bias, seed=seed)
    t = torch.where(t == -100, torch.full_like(t, ignore), t)
    for name in FAST_BACKENDS:
        with serve(name):
            _assert_fp32(x, w, b, t, chunk_rows=chunk_rows, reduction=reduction, label_smoothing=eps,
                         ignore_index=ignore)


def test_leading_dims_and_no_grad(backend):
    x, w, b, t = spec.tensors(24, 8, 50)
    x3, t3 = x.view(4, 6, 8), t.view(4, 6)
    got = fastops.linear_cross_entropy(x3, w, t3, bias=b, reduction="none")
    torch.testing.assert_close(got, _torch(x3.reshape(-1, 8), w, t, b, reduction="none").view(4, 6))
    args = spec.inputs(24, 8, 50)
    with torch.no_grad():
        out = fastops.linear_cross_entropy(*args[:4], chunk_rows=5)
    assert out.dim() == 0 and out.grad_fn is None


def test_fp16_sums_in_fp32_where_torch_overflows(backend):
    """fp16 logits as F.linear rounds them, then fp32 (the op's contract). torch's own fp16 cross_entropy with label
    smoothing sums 3001 log-probabilities in fp16 and returns inf here; the op matches torch run on the fp16 logits
    cast to fp32. Tolerances: the loss rounds once to fp16 (2^-11 relative) after fp32 sums (~1e-6 here); a gradient
    carries four fp16 roundings (the logits' gradient, the matmul output, the per-chunk grad_weight partial, the
    final cast) on fastops' side and two on torch's: normwise 6 * 2^-11."""
    x, w, b, t = spec.tensors(257, 64, 3001, torch.float16, scale=2.0)
    assert torch.isinf(_torch(x, w, t, b, label_smoothing=0.1))  # torch's fp16 path, for the record
    got = _run(_fast, x, w, b, t, label_smoothing=0.1)
    ref = _run(lambda x, w, t, b, **kw: F.cross_entropy(F.linear(x, w, b).float(), t, **kw), x, w, b, t,
               label_smoothing=0.1)
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2.0**-10, atol=0)
    for name, a, r in zip(("grad_x", "grad_w", "grad_b"), got[1:], ref[1:]):
        assert a.dtype == torch.float16
        err = rel_err(a.float(), r.float())
        assert err <= 6 * 2.0**-11, f"{name}: {err:.2e}"


def test_chunk_plan_is_one_function():
    """fastops/_lce.py's chunk_rows() and vocab_block() and csrc/cpu/linear_ce.cpp's ce_chunk_rows() and
    ce_vocab_block() choose alike."""
    plan, blocks = _backend._C.cpp.linear_ce_chunk_rows, _backend._C.cpp.linear_ce_vocab_block
    for m in (1, 7, 1024, 4096, 16384, 100_000):
        for h in (8, 256, 2048):
            for v in (1, 2, 32000, 151_936, 262_144):
                for itemsize in (2, 4, 8):
                    for gw in (False, True):
                        assert plan(m, h, v, itemsize, gw) == _lce.chunk_rows(m, h, v, itemsize, gw), (m, h, v)
                        assert blocks(m, h, v, itemsize, gw) == _lce.vocab_block(m, h, v, itemsize, gw), (m, h, v)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_cpp_row_pass_of_every_isa(capability):
    """The C++ row pass is compiled once per ISA and picked at load time: the narrower copies, in a fresh process
    (FASTOPS_CPU_CAPABILITY lowers the pick), pass the fp32 and bf16 parity checks too."""
    code = (
        "import torch, tests.test_linear_ce as T; from fastops import _backend, _C\n"
        f"assert _C.cpu_capability() in ({capability!r}, 'default'), _C.cpu_capability()\n"
        "x, w, b, t = T.spec.tensors(70, 24, 997)\n"
        "with _backend.use('cpu', 'cpp'):\n"
        "    T._assert_fp32(x, w, b, t, reduction='mean', label_smoothing=0.1)\n"
        "    T._assert_fp32(x, w, b, t, reduction='none')\n"
        "    T.test_bf16_parity('cpp', 'mean', 0.1)\n"
        "T.test_bf16_vocabulary_blocks('none', 0.1)\n"
    )
    _in_fresh_process(code, FASTOPS_CPU_CAPABILITY=capability)


_EXACT_WAYS = ["mkl", "avx512bf16", "onednn"]


def _cpu_flags() -> set:
    return set(open("/proc/cpuinfo").read().split())


@pytest.mark.parametrize("how", [*_EXACT_WAYS, "product"])
def test_partial_products_each_way(how):
    """Where partial products add up in fp32 (chunks of rows' grad_weight, the vocabulary blocks' grad_x) the C++ CPU
    backend sums them inside MKL's bf16 GEMM on Intel CPUs, fastops' own AVX-512 BF16 one (csrc/cpu/gemm_bf16.cpp) on
    others that have it and oneDNN's fp32 one on the rest with AVX-512 (MKL's is 4-5x slower off Intel CPUs), or adds
    bf16 products (a torch and CPU with none of these); each way, forced in a fresh process, stays within torch's
    bounds. The exact ones differ from torch's grad_x (softmax in fp32) only by the order of their fp32 sums: within
    an eighth of U_BF16 in norm (measured: 0), where rounding each of 4 blocks' products first gives 2.6e-3, the error
    that moved a BERT's grad norms 9% from torch's under HF Trainer (tests/test_patch_models.py)."""
    if how == "onednn" and not {"avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags():
        pytest.skip("oneDNN's fp32 matmul is reached here only on a CPU with AVX-512 BW, VL and DQ")
    if how == "avx512bf16" and "avx512_bf16" not in _cpu_flags():
        pytest.skip("this CPU has no AVX-512 BF16")
    code = (
        "import torch, torch.nn.functional as F, fastops, tests.test_linear_ce as T; from fastops import _backend\n"
        f"assert _backend._C.cpp.linear_ce_accumulate() == {how!r}\n"
        "with _backend.use('cpu', 'cpp'):\n"
        "    T.test_bf16_parity('cpp', 'sum', 0.1)\n"
        "T.test_bf16_vocabulary_blocks('mean', 0.1)\n"
        "T.test_bf16_vocabulary_blocks_with_x_frozen()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(20, 64, generator=g).bfloat16().requires_grad_()\n"
        "w = (torch.randn(1000, 64, generator=g) * 0.5).bfloat16().requires_grad_()  # trained: 4 blocks\n"
        "b, t = (torch.randn(1000, generator=g) * 0.1).bfloat16(), torch.randint(0, 1000, (20,), generator=g)\n"
        "with _backend.use('cpu', 'cpp'):\n"
        "    fastops.linear_cross_entropy(x, w, t, bias=b).backward()\n"
        "got, x.grad = x.grad, None\n"
        "F.cross_entropy(F.linear(x, w, b).float(), t).backward()  # the softmax in fp32, as the op's row pass\n"
        "err = T.rel_err(got.float(), x.grad.float())\n"
        f"assert (err <= T.U_BF16 / 8) == ({how!r} != 'product'), err\n"
    )
    _in_fresh_process(code, FASTOPS_CE_ACCUMULATE=how)


@pytest.mark.parametrize("how", _EXACT_WAYS)
def test_each_exact_way_sums_products_in_fp32(how):
    """Each exact way against fp64, at shapes that leave tails everywhere (rows not a multiple of gemm_bf16.cpp's tile
    of 6, columns not of its 64 or of 16, odd depth and a depth past the 1024 it packs at a time, a transposed a as grad_weight's
    chunks pass it) and accumulating or not: every product of two bf16 is exact in fp32, so the only error is the
    fp32 sums', which whatever their order is at most k u / (1 - k u) of the sum of the terms' magnitudes
    (u = 2^-24, k terms: Higham's bound for any summation order, so it holds on any machine)."""
    g = torch.Generator().manual_seed(0)
    u = 2.0**-24
    for m, n, k, transposed in ((1, 1, 1, False), (7, 17, 3, False), (13, 70, 4097, False), (100, 130, 33, True),
                                (6, 64, 2, True), (50, 20, 2051, True), (40, 256, 600, False)):
        a = torch.randn(m, k, generator=g).bfloat16() if not transposed else torch.randn(k, m, generator=g).bfloat16().t()
        b = torch.randn(k, n, generator=g).bfloat16()
        before = torch.randn(m, n, generator=g)
        for first in (True, False):
            acc = before.clone()
            try:
                served = _backend._C.cpp.linear_ce_accumulate_with(how, acc, a, b, first)
            except RuntimeError as e:  # only a way this CPU or torch lacks (mkl, onednn, avx512bf16) is skipped
                if "does not serve" not in str(e):
                    raise
                pytest.skip(str(e).splitlines()[0])
            assert served, (how, m, n, k, transposed)
            exact = a.double() @ b.double() + (0 if first else before.double())
            terms = a.double().abs() @ b.double().abs() + (0 if first else before.double().abs())
            gamma = (k + 1) * u / (1 - (k + 1) * u)
            assert ((acc.double() - exact).abs() <= gamma * terms).all(), (how, m, n, k, transposed, first)
            assert torch.isfinite(acc).all()
    # The bound can fail: bf16 products rounded before their sum break it.
    acc = torch.empty(m, n)
    assert not _backend._C.cpp.linear_ce_accumulate_with("product", acc, a, b, True)
    assert not ((acc.double() - a.double() @ b.double()).abs() <= gamma * (a.double().abs() @ b.double().abs())).all()
    with pytest.raises(RuntimeError, match="no partial-product way named"):
        _backend._C.cpp.linear_ce_accumulate_with("fast", acc, a, b, True)


def _in_fresh_process(code: str, **env):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=root, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
