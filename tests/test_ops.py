"""torch.ops.fastops.* on every CPU backend against the reference, opcheck and torch.compile on every op's sample
inputs (fastops/_specs) over every (device, backend) pair, and the backend choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastops  # (registers the ops)
from fastops import _backend, reference
from fastops._specs import SPECS, adam, sgd
from fastops._specs import amp as amp_spec
from fastops._specs.spec import on
from tests.devices import PAIRS, device_backend  # noqa: F401  (a fixture)
from tests.devices import cpu as _cpu
from tests.adam_helpers import FP32_TOL, STATE_TOL  # the measured tables tests/test_adam.py uses
from tests.rounding import sum_rtol

ops = torch.ops.fastops
BIG = 10**6 + 7


def _sizes(backend, device="cpu"):
    # The Triton interpreter is ~1e5 elements/s: it gets the odd small sizes, the others also 10^6+7.
    return [0, 1, 1023, 5000] if backend == "triton" and device == "cpu" else [0, 1, 1023, BIG]


def _device_args(args, device, lr_index):
    """``args`` on ``device``, with a device lr there (read in the kernel, as a capturable optimizer passes it)."""
    if device == "cpu":
        return args
    args = on(device, args)
    args[lr_index] = args[lr_index].float()
    return args


adam_inputs = adam.inputs  # the 17 positional arguments of adam_step_ (fastops/_specs/adam.py)


def _clone(args):
    return [[t.clone() for t in a] if isinstance(a, list) else (a.clone() if isinstance(a, torch.Tensor) else a) for a in args]


# Tolerance per param dtype against the reference, after one step from the same inputs.
# fp32: both compute in fp32 and differ only in operation order / fused multiply-adds: a few ulps.
# bf16/fp16 params: the update is computed in fp32 and rounded once; a few-ulp fp32 difference can flip the
# final rounding, so one ulp of the param dtype is allowed (bf16 2^-7 relative, fp16 2^-10).
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5)}


def _adam_row(device, backend):
    """The row of tests/test_adam.py's measured tables that bounds ``backend`` on ``device``. On a GPU the CUDA C++
    backend and the reference compute the bias corrections on the host in fp64 with correctly rounded sqrt against
    the CPU oracle's MKL sqrt: the C++ CPU backend's case (1 ulp of sqrt); Triton has its fp32 bias corrections
    on every device."""
    if device == "cpu":
        return backend
    return "triton" if backend == "triton" else "cpp"


def _assert_adam_close(got, want, dtype, row="cpp"):
    """fp32 params to FP32_TOL[row] (its max), states and masters to STATE_TOL[row]; bf16/fp16 params to one ulp
    of their dtype (TOL); step counters exactly; grads untouched."""
    got = [[t.cpu() for t in a] if isinstance(a, list) else a for a in got]
    max_d = FP32_TOL[row][0]
    rtol, atol = (max_d, max_d) if dtype == torch.float32 else TOL[dtype]
    for k in (0, 2, 3, 4, 6):  # params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters
        for a, b in zip(got[k], want[k]):
            r, t = (rtol, atol) if k == 0 and a.dtype == dtype else STATE_TOL[row] if k in (2, 3, 4) else (max_d, max_d)
            torch.testing.assert_close(a, b, rtol=r, atol=t)
    for a, b in zip(got[5], want[5]):
        assert a.item() == b.item()
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), "grads are read-only"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("amsgrad,master", [(False, False), (True, False), (False, True), (True, True)])
def test_adam_step_matches_reference(device_backend, dtype, amsgrad, master):
    device, backend = device_backend
    want = adam_inputs(_sizes(backend, device), dtype, amsgrad, master, scale=torch.tensor(4.0))
    args = _device_args(_clone(want), device, 7)
    ops.adam_step_(*args)
    reference.adam_step_(*want)
    _assert_adam_close(args, want, dtype, _adam_row(device, backend))


@pytest.mark.parametrize("maximize,decoupled,wd", [(True, True, 0.1), (False, False, 0.1), (True, False, 0.0)])
def test_adam_step_flags_and_grad_scale(cpu_backend, maximize, decoupled, wd):
    args = adam_inputs([1023, 7], scale=torch.tensor(64.0))
    args[13], args[14], args[11] = maximize, decoupled, wd
    want = _clone(args)
    ops.adam_step_(*args)
    reference.adam_step_(*want)
    _assert_adam_close(args, want, torch.float32, cpu_backend)


def test_adam_step_mixed_dtypes_in_one_call(cpu_backend):
    a32 = adam_inputs([100], torch.float32, seed=1)
    a16 = adam_inputs([33], torch.bfloat16, seed=2)
    args = [x + y if isinstance(x, list) else x for x, y in zip(a32, a16)]
    want = _clone(args)
    ops.adam_step_(*args)
    reference.adam_step_(*want)
    _assert_adam_close(args, want, torch.bfloat16, cpu_backend)


def test_adam_step_found_inf_changes_nothing(device_backend):
    device, _ = device_backend
    args = adam_inputs([1023, 5], amsgrad=True, master=True, found_inf=torch.tensor([1.0]), scale=torch.tensor(8.0),
                       device=device)  # fmt: skip
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
    _assert_adam_close(args, want, torch.float32, cpu_backend)


sgd_inputs = sgd.inputs


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
    (0.5, 0.0, True, 0.0, True, True, False, 64.0),  # nesterov needs dampening 0 (torch.optim.SGD's rule, checked at the op)
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
    return mine in ("avx2", "avx512", "avx512_vbmi") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=_sgd_config_id)
def test_sgd_step_matches_reference(device_backend, dtype, config):
    device, backend = device_backend
    want = _sgd_args(_sizes(backend, device), dtype, config, found_inf=torch.tensor([0.0]))
    args = _device_args(_clone(want), device, 4)
    ops.sgd_step_(*args)
    reference.sgd_step_(*want)
    args = [[t.cpu() for t in a] if isinstance(a, list) else a for a in args]
    # The C++ kernels place their FMAs where torch's vectorised ops do: bit for bit with FMA on both sides
    # (measured: every config, dtype and size here). The Triton interpreter computes tl.fma unfused.
    _assert_sgd_close(args, want, dtype, exact=backend == "cpp" and _fma_on_both_sides())


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
def test_sgd_step_found_inf_changes_nothing(device_backend, on_device):
    # On CPU tensors both are CPU tensors; the Triton path that reads found_inf in the kernel is the default,
    # the host read is forced through its scalars_on_host in test_triton_kernels.
    device, _ = device_backend
    found_inf = torch.tensor([1.0], device=device) if on_device else torch.tensor(1.0)
    args = on(device, _sgd_args([1023, 5], torch.bfloat16, SGD_CONFIGS[3]))
    args[12] = found_inf
    before = _clone(args)
    ops.sgd_step_(*args)
    for got, want in zip(args[:4], before[:4]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device,backend", [p for p in PAIRS if p.values[0] == "cuda" and p.values[1] != "reference"])
def test_sgd_step_never_syncs_and_replays_in_a_cuda_graph(device, backend):
    """The reference reads lr and found_inf on the host; the compiled backends never sync, so a CUDA graph holds
    the step."""
    with _backend.use(device, backend):
        args = on("cuda", _sgd_args([1000, 33], torch.float32, SGD_CONFIGS[2], found_inf=torch.tensor([0.0])))
        args[4] = torch.tensor(1e-2, device="cuda")
        want = _cpu(args)
        torch.ops.fastops.sgd_step_(*args)  # warm: table built and cached, kernel compiled
        reference.sgd_step_(*want)
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ops.fastops.sgd_step_(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        reference.sgd_step_(*want)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            torch.ops.fastops.sgd_step_(*args)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
            reference.sgd_step_(*want)
        _assert_sgd_close(_cpu(args), want, torch.float32)


def test_sgd_step_under_torch_compile(cpu_backend):
    args = sgd_inputs([7, 300], nesterov=True, weight_decay=0.1)
    want = _clone(args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(*a):
        ops.sgd_step_(*a)

    step(*args)
    reference.sgd_step_(*want)
    _assert_sgd_close(args, want, torch.float32)


_grads_with = amp_spec.grads


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


def _samples():
    for name, spec in SPECS.items():
        for sample in spec.sample_inputs("cpu"):
            yield pytest.param(name, sample.id, id=f"{name}-{sample.id}")


def _sample(name, case, device):
    return next(s.args for s in SPECS[name].sample_inputs(device) if s.id == case)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_opcheck(device, backend):
    """Every op's sample inputs (fastops/_specs), on every (device, backend) pair: schema, fake kernel against the
    real one, autograd registration, AOT dispatch."""
    with _backend.use(device, backend):
        for name, spec in SPECS.items():
            for sample in spec.sample_inputs(device):
                torch.library.opcheck(getattr(ops, name).default, tuple(sample.args))


@pytest.mark.parametrize("name,case", list(_samples()))
def test_sample_inputs_under_torch_compile_match_eager(name, case):
    """fullgraph torch.compile of each op on each sample input writes what the eager op writes (the backend auto
    chose for the CPU; the compiled graph calls the same dispatcher kernel)."""
    args, want = _sample(name, case, "cpu"), _sample(name, case, "cpu")
    op = getattr(ops, name)
    torch._dynamo.reset()  # one code object for every case: without it the recompile limit is reached

    @torch.compile(fullgraph=True, backend="aot_eager")
    def call(*a):
        return op(*a)

    got_out, want_out = call(*args), op(*want)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(args, want, rtol=0, atol=0, equal_nan=True)


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
