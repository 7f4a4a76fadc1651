"""torch.ops.fastops.* on every CPU backend against the reference, opcheck, and the backend choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastops  # (registers the ops)
from fastops import _backend, reference
from tests.rounding import sum_rtol

ops = torch.ops.fastops
BIG = 10**6 + 7


def _sizes(backend):
    # The Triton interpreter is ~1e5 elements/s: it gets the odd small sizes, the others also 10^6+7.
    return [0, 1, 1023, 5000] if backend == "triton" else [0, 1, 1023, BIG]


def adam_inputs(sizes, dtype=torch.float32, amsgrad=False, master=False, seed=0, scale=None, found_inf=None, lr=1e-2):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    exp_avgs = [torch.randn(n, generator=g).mul_(0.1) for n in sizes]
    exp_avg_sqs = [torch.rand(n, generator=g).mul_(0.01) for n in sizes]
    max_sqs = [v + 0.001 * (i % 2) for i, v in enumerate(exp_avg_sqs)] if amsgrad else []
    steps = [torch.tensor(float(3 + i), dtype=torch.float32) for i in range(len(sizes))]
    masters = [p.float() + 1e-3 for p in params] if master else []
    return [params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters, torch.tensor(lr, dtype=torch.float64),
            0.9, 0.999, 1e-8, 0.1, amsgrad, False, True, scale, found_inf]


def _clone(args):
    return [[t.clone() for t in a] if isinstance(a, list) else (a.clone() if isinstance(a, torch.Tensor) else a) for a in args]


# Tolerance per param dtype against the reference, after one step from the same inputs.
# fp32: both compute in fp32 and differ only in operation order / fused multiply-adds: a few ulps.
# bf16/fp16 params: the update is computed in fp32 and rounded once; a few-ulp fp32 difference can flip the
# final rounding, so one ulp of the param dtype is allowed (bf16 2^-7 relative, fp16 2^-10).
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5)}


def _assert_adam_close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for k in (0, 2, 3, 4, 6):  # params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters
        for a, b in zip(got[k], want[k]):
            r, t = (rtol, atol) if k == 0 else TOL[torch.float32]
            torch.testing.assert_close(a, b, rtol=r, atol=t)
    for a, b in zip(got[5], want[5]):
        assert a.item() == b.item()
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), "grads are read-only"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("amsgrad,master", [(False, False), (True, False), (False, True), (True, True)])
def test_adam_step_matches_reference(cpu_backend, dtype, amsgrad, master):
    args = adam_inputs(_sizes(cpu_backend), dtype, amsgrad, master)
    want = _clone(args)
    ops.adam_step_(*args)
    reference.adam_step_(*want)
    _assert_adam_close(args, want, dtype)


@pytest.mark.parametrize("maximize,decoupled,wd", [(True, True, 0.1), (False, False, 0.1), (True, False, 0.0)])
def test_adam_step_flags_and_grad_scale(cpu_backend, maximize, decoupled, wd):
    args = adam_inputs([1023, 7], scale=torch.tensor(64.0))
    args[13], args[14], args[11] = maximize, decoupled, wd
    want = _clone(args)
    ops.adam_step_(*args)
    reference.adam_step_(*want)
    _assert_adam_close(args, want, torch.float32)


def test_adam_step_mixed_dtypes_in_one_call(cpu_backend):
    a32 = adam_inputs([100], torch.float32, seed=1)
    a16 = adam_inputs([33], torch.bfloat16, seed=2)
    args = [x + y if isinstance(x, list) else x for x, y in zip(a32, a16)]
    want = _clone(args)
    ops.adam_step_(*args)
    reference.adam_step_(*want)
    _assert_adam_close(args, want, torch.bfloat16)


def test_adam_step_found_inf_changes_nothing(cpu_backend):
    args = adam_inputs([1023, 5], amsgrad=True, master=True, found_inf=torch.tensor(1.0), scale=torch.tensor(8.0))
    before = _clone(args)
    ops.adam_step_(*args)
    for got, want in zip(args[:7], before[:7]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_adam_step_50_steps_match_reference(cpu_backend):
    args = adam_inputs([1023, 1, 300], amsgrad=True)
    want = _clone(args)
    for step in range(50):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(args[1], want[1]):
            a.copy_(torch.randn(a.shape, generator=g))
            b.copy_(a)
        ops.adam_step_(*args)
        reference.adam_step_(*want)
    _assert_adam_close(args, want, torch.float32)


def sgd_inputs(sizes, dtype=torch.float32, momentum=0.9, master=False, seed=0, lr=None, weight_decay=0.0,
               dampening=0.0, nesterov=False, maximize=False, first=False, scale=None, found_inf=None):
    """Positional arguments of sgd_step_. lr defaults to a float64 CPU tensor (what torch's SGD holds for a
    float lr is a Python float; a Tensor lr can be any floating dtype)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    bufs = [torch.randn(n, generator=g).mul_(0.1) for n in sizes] if momentum else []
    masters = [p.float() + 1e-3 for p in params] if master else []
    lr = torch.tensor(1e-2, dtype=torch.float64) if lr is None else lr
    return [params, grads, bufs, masters, lr, weight_decay, momentum, dampening, nesterov, maximize, first, scale,
            found_inf]  # fmt: skip


def _assert_sgd_close(got, want, dtype, exact=False):
    """params to TOL[dtype] (or bit for bit), momentum buffers and masters to the fp32 tolerance; grads untouched."""
    for k in (0, 2, 3):  # params, momentum_buffers, master_params
        for a, b in zip(got[k], want[k]):
            r, t = TOL[dtype] if k == 0 else TOL[torch.float32]
            if exact:
                r = t = 0
            torch.testing.assert_close(a, b, rtol=r, atol=t)
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), "grads are read-only"


# (momentum, dampening, nesterov, weight_decay, maximize, is_first_step, master, grad_scale): each flag on and
# off at least once with the others.
SGD_CONFIGS = [
    (0.0, 0.0, False, 0.0, False, False, False, None),
    (0.9, 0.0, False, 0.0, False, False, False, None),
    (0.9, 0.0, True, 1e-2, False, False, False, 8.0),
    (0.9, 0.3, False, 1e-2, True, False, True, None),
    (0.5, 0.1, True, 0.0, True, True, False, 64.0),
    (0.9, 0.0, False, 1e-2, False, True, True, 2.0**-3),
    (0.0, 0.0, False, 1e-2, True, False, True, 1024.0),
]


def _sgd_config_id(c):
    return "mom{}-damp{}-nest{}-wd{}-max{}-first{}-master{}-scale{}".format(*[int(x) if isinstance(x, bool) else x for x in c])


def _sgd_args(sizes, dtype, config, **kw):
    mom, damp, nest, wd, maximize, first, master, scale = config
    return sgd_inputs(sizes, dtype, mom, master, weight_decay=wd, dampening=damp, nesterov=nest, maximize=maximize,
                      first=first, scale=None if scale is None else torch.tensor(scale), **kw)  # fmt: skip


def _fma_on_both_sides():
    """Whether the C++ kernels and torch's own CPU kernels both run with FMA: only then is fp32 bit-identical."""
    mine = fastops._C.cpu_capability() if _backend._C is not None else "default"
    return mine in ("avx2", "avx512") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=_sgd_config_id)
def test_sgd_step_matches_reference(cpu_backend, dtype, config):
    args = _sgd_args(_sizes(cpu_backend), dtype, config)
    want = _clone(args)
    ops.sgd_step_(*args)
    reference.sgd_step_(*want)
    # The C++ kernels place their FMAs where torch's vectorised ops do: bit for bit with FMA on both sides
    # (measured: every config, dtype and size here). The Triton interpreter computes tl.fma unfused.
    _assert_sgd_close(args, want, dtype, exact=cpu_backend == "cpp" and _fma_on_both_sides())


def test_sgd_step_mixed_dtypes_and_float32_lr(cpu_backend):
    parts = [_sgd_args([100, 3], dt, SGD_CONFIGS[3], seed=k, lr=torch.tensor(3e-2))
             for k, dt in enumerate((torch.float32, torch.bfloat16, torch.float16))]  # fmt: skip
    args = [sum((p[k] for p in parts), []) if isinstance(parts[0][k], list) else parts[0][k] for k in range(13)]
    want = _clone(args)
    ops.sgd_step_(*args)
    reference.sgd_step_(*want)
    _assert_sgd_close(args, want, torch.float16)


@pytest.mark.parametrize("config", [SGD_CONFIGS[2], SGD_CONFIGS[3]], ids=_sgd_config_id)
def test_sgd_step_30_steps_match_torch_sgd(cpu_backend, config):
    """The op driven as torch.optim.SGD drives its for-loop (is_first_step on the first step), fp32, against
    that for-loop itself."""
    mom, damp, nest, wd, maximize, _, _, _ = config
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1023, 1, 300)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    torch_opt = torch.optim.SGD(ref_params, lr=0.05, momentum=mom, dampening=damp, nesterov=nest, weight_decay=wd,
                                maximize=maximize, foreach=False)  # fmt: skip
    for step in range(30):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(ref_params, grads):
            p.grad = gr.clone()
        torch_opt.step()
        ops.sgd_step_(params, grads, bufs, [], torch.tensor(0.05, dtype=torch.float64), wd, mom, damp, nest, maximize,
                      step == 0, None, None)  # fmt: skip
    exact = cpu_backend != "triton" and (cpu_backend == "reference" or _fma_on_both_sides())
    for p, q, b in zip(params, ref_params, bufs):
        tol = {} if not exact else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(p.detach(), q.detach(), **tol)
        torch.testing.assert_close(b, torch_opt.state[q]["momentum_buffer"], **tol)


@pytest.mark.parametrize("on_device", [False, True], ids=["found_inf_cpu_tensor", "found_inf_on_device"])
def test_sgd_step_found_inf_changes_nothing(cpu_backend, on_device):
    # On CPU tensors both are CPU tensors; the Triton path that reads found_inf in the kernel is the default,
    # the host read is forced through its scalars_on_host in test_triton_kernels.
    args = _sgd_args([1023, 5], torch.bfloat16, SGD_CONFIGS[3], found_inf=torch.tensor([1.0] if on_device else 1.0))
    before = _clone(args)
    ops.sgd_step_(*args)
    for got, want in zip(args[:4], before[:4]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def _sgd_bad_calls():
    def with_(i, value, **kw):
        args = sgd_inputs([4, 3], **kw)
        args[i] = value(args) if callable(value) else value
        return args

    return {
        "buffers without momentum": with_(2, [torch.zeros(4), torch.zeros(3)], momentum=0.0),
        "one buffer short": with_(2, lambda a: a[2][:1]),
        "one grad short": with_(1, lambda a: a[1][:1]),
        "one master short": with_(3, lambda a: a[3][:1], master=True),
        "bf16 buffer": with_(2, lambda a: [b.bfloat16() for b in a[2]]),
        "buffer shape": with_(2, lambda a: [torch.zeros(5), a[2][1]]),
        "buffer strides": [[torch.zeros(3, 2).t()], [torch.zeros(3, 2).t()], [torch.zeros(2, 3)]] + sgd_inputs([6])[3:],
        "fp16 grad for fp32 param": with_(1, lambda a: [a[1][0].half(), a[1][1]]),
        "int param": with_(0, lambda a: [torch.zeros(4, dtype=torch.int32), a[0][1]]),
        "gapped param": with_(0, lambda a: [torch.zeros(8)[::2], a[0][1]]),
        "fp16 master": with_(3, lambda a: [m.half() for m in a[3]], master=True),
        "lr with two elements": with_(4, torch.tensor([0.1, 0.1])),
        "integer grad_scale": with_(11, torch.tensor(2)),
        "found_inf with two elements": with_(12, torch.zeros(2)),
    }


@pytest.mark.parametrize("case", list(_sgd_bad_calls()))
def test_sgd_step_bad_input_fails_alike(cpu_backend, case):
    """The same message on every backend, word for word, and nothing written."""
    with pytest.raises(RuntimeError) as ref_err:
        reference.sgd_step_(*_sgd_bad_calls()[case])  # a fresh copy: clone() would make a gapped tensor dense
    args = _sgd_bad_calls()[case]
    before = _clone(args)
    with pytest.raises(RuntimeError) as err:
        ops.sgd_step_(*args)
    assert str(err.value) == str(ref_err.value) and str(err.value).startswith("fastops")
    for got, want in zip(args[:4], before[:4]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_sgd_step_under_torch_compile(cpu_backend):
    args = sgd_inputs([7, 300], nesterov=True, weight_decay=0.1)
    want = _clone(args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(*a):
        ops.sgd_step_(*a)

    step(*args)
    reference.sgd_step_(*want)
    _assert_sgd_close(args, want, torch.float32)


def _grads_with(sizes, dtype, poison=None, where="first", seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=g).mul_(3).to(dtype) for n in sizes]
    if poison is not None:
        target = next(t for t in (grads if where == "first" else reversed(grads)) if t.numel())
        target[0 if where == "first" else -1] = poison
    return grads


POISONS = [None, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("where", ["first", "last"])
def test_unscale_check_matches_reference(cpu_backend, dtype, poison, where):
    grads = _grads_with(_sizes(cpu_backend), dtype, poison, where)
    want = [t.clone() for t in grads]
    found, found_ref = torch.zeros(1), torch.zeros(1)
    inv = torch.tensor(1 / 1024.0)
    ops.unscale_check_(grads, found, inv)
    reference.unscale_check_(want, found_ref, inv)
    assert found.item() == found_ref.item() == (0.0 if poison is None else 1.0)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    # found_inf is only ever set, never cleared
    ops.unscale_check_(_grads_with([5], dtype), found, inv)
    assert found.item() == found_ref.item()


def test_unscale_check_matches_torch_amp_kernel(cpu_backend):
    # The semantics fastops promises: torch._amp_foreach_non_finite_check_and_unscale_'s, bit for bit on
    # finite values (nan payloads may differ). Both scale directions, so values really change.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for inv_value in (2.0**-16, 3.0):
            grads = _grads_with([1023, 1, 77], dtype, float("nan"), "last")
            want = [t.clone() for t in grads]
            found, found_torch = torch.zeros(1), torch.zeros(1)
            ops.unscale_check_(grads, found, torch.tensor(inv_value))
            torch._amp_foreach_non_finite_check_and_unscale_(want, found_torch, torch.tensor([inv_value]))
            assert found.item() == found_torch.item() == 1.0
            for a, b in zip(grads, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _exact_stats(grads, inv):
    """fp64 oracle: [sum of (g*inv)^2, max |g|*inv, any non-finite]."""
    flat = torch.cat([t.double().flatten() for t in grads]) * (1.0 if inv is None else inv)
    if flat.numel() == 0:
        return [0.0, 0.0, 0.0]
    return [flat.square().sum().item(), flat.abs().max().item(), float(not flat.isfinite().all())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("inv", [None, 2.0**-16])
def test_grad_stats_matches_reference(cpu_backend, dtype, poison, where, inv):
    grads = _grads_with(_sizes(cpu_backend), dtype, poison, where)
    inv_t = None if inv is None else torch.tensor(inv)
    got, want = ops.grad_stats(grads, inv_t), reference.grad_stats(grads, inv_t)
    exact = _exact_stats(grads, inv)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert got[2].item() == want[2].item() == exact[2] == (0.0 if poison is None else 1.0)
    if poison is None:
        # fp32 sums of n squares, each in its own order (tests/rounding.py): each within sum_rtol(n) of exact.
        n = sum(g.numel() for g in grads)
        torch.testing.assert_close(got[:1], want[:1], rtol=2 * sum_rtol(n), atol=0)
        assert got[0].item() == pytest.approx(exact[0], rel=sum_rtol(n))
        assert got[1].item() == want[1].item()
        assert got[1].item() == pytest.approx(exact[1], rel=1e-7)  # max is exact up to the fp32 multiply
    else:
        # inf/nan reach the sum and the max as torch's norm would: inf^2 = inf, nan anywhere gives nan.
        expect = torch.tensor(exact[:2], dtype=torch.float32)
        torch.testing.assert_close(got[:2], expect, equal_nan=True)
        torch.testing.assert_close(want[:2], expect, equal_nan=True)


def test_grad_stats_no_overflow_for_large_finite_fp16(cpu_backend):
    grads = [torch.full((4096,), 60000.0, dtype=torch.float16)]
    out = ops.grad_stats(grads)
    assert out[2].item() == 0 and torch.isfinite(out[0])
    assert out[0].item() == pytest.approx(4096 * 60000.0**2, rel=1e-6)


def test_grad_stats_unscales_before_squaring(cpu_backend):
    # fp32 grads behind a 2^70 loss scale (a GradScaler reaches it after enough clean steps): the scaled
    # squares overflow fp32, the unscaled ones do not.
    grads = [torch.full((1000,), 3.9e20), torch.full((5,), -1e21)]
    inv = torch.tensor(2.0**-70)
    assert ops.grad_stats(grads)[0].item() == float("inf")
    got = ops.grad_stats(grads, inv)
    exact = _exact_stats(grads, 2.0**-70)
    assert got[2].item() == 0.0
    assert got[0].item() == pytest.approx(exact[0], rel=1e-6)
    assert got[1].item() == pytest.approx(exact[1], rel=1e-7)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.unscale_check_([torch.ones(3)], torch.zeros(2), torch.tensor(0.5)), "found_inf must be one float32 element"),
        (lambda: ops.unscale_check_([torch.ones(3)], torch.zeros(1, dtype=torch.int32), torch.tensor(0.5)), "found_inf must be one float32"),
        (lambda: ops.unscale_check_([torch.ones(3)], torch.zeros(1), torch.ones(2)), "inv_scale must be a floating tensor with one element"),
        (lambda: ops.grad_stats([torch.ones(3)], torch.ones(2)), "inv_scale must be a floating tensor with one element"),
        (lambda: ops.grad_stats([torch.ones(3)], torch.tensor(2)), "inv_scale must be a floating tensor with one element"),
        (lambda: ops.adam_step_(*adam_inputs([3], found_inf=torch.zeros(2))), "found_inf must be a floating tensor with one element"),
        (lambda: ops.adam_step_(*adam_inputs([3], scale=torch.ones(2))), "grad_scale must be a floating tensor with one element"),
    ],
)
def test_scalar_arguments_are_checked_alike(cpu_backend, call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


def _adam_sample_inputs():
    yield adam_inputs([7, 1, 0])
    yield adam_inputs([5, 3], torch.bfloat16, amsgrad=True, master=True, scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))


def _sgd_sample_inputs():
    yield sgd_inputs([7, 1, 0])
    yield sgd_inputs([5, 3], momentum=0.0, weight_decay=0.1)
    yield sgd_inputs([5, 3], torch.bfloat16, master=True, nesterov=True, first=True, scale=torch.tensor(2.0),
                     found_inf=torch.tensor(0.0))


@pytest.mark.parametrize("backend", ["cpp", "triton", "reference"])
def test_opcheck(backend):
    with _backend.use("cpu", backend):
        for args in _adam_sample_inputs():
            torch.library.opcheck(ops.adam_step_.default, tuple(args))
        for args in _sgd_sample_inputs():
            torch.library.opcheck(ops.sgd_step_.default, tuple(args))
        torch.library.opcheck(ops.unscale_check_.default, (_grads_with([5, 3], torch.float16), torch.zeros(1), torch.tensor(0.5)))
        torch.library.opcheck(ops.grad_stats.default, (_grads_with([5, 0, 3], torch.bfloat16),))
        torch.library.opcheck(ops.grad_stats.default, (_grads_with([5, 3], torch.float32), torch.tensor(0.25)))


def test_schemas_live_in_the_registry():
    from fastops import _ops

    for name, schema in _ops.SCHEMAS.items():
        assert str(getattr(ops, name).default._schema) == f"fastops::{schema}"


def _run_python(code: str, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


BLOCK_C = "import sys; sys.modules['fastops._C'] = None\n"


def test_fallback_when_extension_is_missing_warns_once():
    code = BLOCK_C + (
        "import warnings, torch\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    import fastops\n"
        "    p = torch.nn.Parameter(torch.ones(3)); opt = fastops.optim.AdamW([p])\n"
        "    for _ in range(3):\n"
        "        p.grad = torch.ones(3); opt.step()\n"
        "msgs = [str(x.message) for x in w if 'fastops' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert 'reference' in msgs[0] and 'fastops._C' in msgs[0], msgs\n"
        "assert fastops._backend.active('cpu') == 'reference'\n"
        "assert (p < 1).all()\n"
    )
    r = _run_python(code, FASTOPS_BACKEND="auto")
    assert r.returncode == 0, r.stderr


def test_explicit_backend_that_is_unavailable_raises():
    code = BLOCK_C + (
        "import torch, fastops\n"
        "p = torch.nn.Parameter(torch.ones(3)); opt = fastops.optim.AdamW([p]); p.grad = torch.ones(3)\n"
        "try:\n"
        "    opt.step()\n"
        "except RuntimeError as e:\n"
        "    assert 'cpp' in str(e) and 'fastops._C' in str(e), e\n"
        "    print('raised')\n"
    )
    r = _run_python(code, FASTOPS_BACKEND="cpp")
    assert r.returncode == 0 and "raised" in r.stdout, r.stderr


def test_backend_env_parsing(monkeypatch):
    monkeypatch.setenv("FASTOPS_BACKEND", "cpu:reference,cuda:triton")
    assert _backend.requested("cpu") == "reference" and _backend.requested("cuda") == "triton"
    monkeypatch.setenv("FASTOPS_BACKEND", "cuda")
    with pytest.raises(_backend.BackendUnavailable, match="does not run on cpu"):
        _backend.choose("cpu")
    monkeypatch.setenv("FASTOPS_BACKEND", "fast")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        _backend.requested("cpu")


def test_info_command_lists_every_op():
    r = subprocess.run([sys.executable, "-m", "fastops", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"torch {torch.__version__}" in r.stdout and "triton" in r.stdout
    served = {tuple(line.split()) for line in r.stdout.splitlines() if "fastops::" in line}
    for name in ("adam_step_", "sgd_step_", "unscale_check_", "grad_stats"):
        assert ("cpu", f"fastops::{name}", _backend.active("cpu")) in served, r.stdout
