"""torch.ops.fastops.sgd_step_ on every (device, backend) pair against fastops.reference (tests/devices.py's
KERNEL_PAIRS) and against torch.optim.SGD's own for-loop, no host sync and CUDA-graph replay on the GPU."""

from __future__ import annotations

import pytest
import torch

import fastops
from fastops import _backend, reference
from fastops._specs import sgd
from tests.devices import COMPILED_CUDA_PAIRS, call, clone, cpu, on
from tests.test_ops_adam import DTYPES, LOWP_PARAM_TOL, sizes

FP32_TOL = (1e-5, 1e-6)  # fp32 params: the same operations, fma placed alike (the interpreter's unfused): a few ulps


def assert_sgd_close(got, want, exact=False):
    """params to one ulp of their dtype (fp32: FP32_TOL), or bit for bit; momentum buffers and masters to FP32_TOL;
    grads untouched."""
    got = cpu(got)
    for name in ("params", "momentum_buffers", "master_params"):
        for a, b in zip(getattr(got, name), getattr(want, name)):
            rtol, atol = (0, 0) if exact else LOWP_PARAM_TOL.get(a.dtype, FP32_TOL)
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    for a, b in zip(got.grads, want.grads):
        assert torch.equal(a, b), "grads are read-only"


# (momentum, dampening, nesterov, weight_decay, maximize, master, grad_scale): each flag on and off at least once with
# the others; nesterov only with dampening 0 (torch.optim.SGD's rule, checked at the op).
CONFIGS = [
    (0.0, 0.0, False, 0.0, False, False, None),
    (0.9, 0.0, False, 0.0, False, False, None),
    (0.9, 0.0, True, 1e-2, False, False, 8.0),
    (0.9, 0.3, False, 1e-2, True, True, None),
    (0.5, 0.0, True, 0.0, True, False, 64.0),
    (0.9, 0.0, False, 1e-2, False, True, 2.0**-3),
    (0.0, 0.0, False, 1e-2, True, True, 1024.0),
]
# (found_inf, scalars read on the host: devices.call), picked by the case's positions as in test_ops_adam.
SCALAR_SETS = [(0.0, False), (None, True), (None, False), (0.0, True)]


def config_id(c):
    return "mom{}-damp{}-nest{}-wd{}-max{}-master{}-scale{}".format(*[int(x) if isinstance(x, bool) else x for x in c])


def sgd_args(sizes_, dtype, config, **kw):
    mom, damp, nest, wd, maximize, master, scale = config
    return sgd.inputs(sizes_, dtype, mom, master, weight_decay=wd, dampening=damp, nesterov=nest, maximize=maximize,
                      scale=None if scale is None else torch.tensor(scale), **kw)  # fmt: skip


def fma_on_both_sides():
    """Whether the C++ kernels and torch's own CPU kernels both run with FMA: only then is fp32 bit-identical."""
    mine = fastops._C.cpu_capability() if _backend._C is not None else "default"
    return mine in ("avx2", "avx512", "avx512_vbmi") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_sgd_step_matches_reference(kernel_backend, dtype, config):
    """torch's first step (is_first_step: buf = grad), then a step that reads the buffer."""
    device, backend = kernel_backend
    found_inf, host = SCALAR_SETS[(CONFIGS.index(config) + DTYPES.index(dtype)) % len(SCALAR_SETS)]
    want = sgd_args(sizes(device, backend), dtype, config,
                    found_inf=None if found_inf is None else torch.tensor([found_inf]))  # fmt: skip
    got = on(device, clone(want))
    if device != "cpu":
        got = got._replace(lr=got.lr.to(device, torch.float32))  # read in the kernel
        want = want._replace(lr=want.lr.float())
    for first in (True, False):
        call("sgd_step_", got._replace(is_first_step=first), host)
        reference.sgd_step_(*want._replace(is_first_step=first))
    # The C++ kernels place their FMAs where torch's vectorised ops do: bit for bit with FMA on both sides
    # (measured: every config, dtype and size here). The Triton interpreter computes tl.fma unfused.
    assert_sgd_close(got, want, exact=backend == "cpp" and fma_on_both_sides())


def test_sgd_step_mixed_dtypes_and_chunks_in_one_call(kernel_backend):
    # Four full 16384-element Triton chunks and a tail next to tensors of other dtypes; a float32 lr.
    device, backend = kernel_backend
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    parts = [sgd_args([n], dt, CONFIGS[3], seed=k, lr=torch.tensor(3e-2))
             for k, (n, dt) in enumerate(zip([1023, 5000, 1, 70_000, 70_000], dtypes))]  # fmt: skip
    want = parts[0]._make(sum((p[k] for p in parts), []) if isinstance(v, list) else v for k, v in enumerate(parts[0]))
    got = on(device, clone(want))
    call("sgd_step_", got)
    reference.sgd_step_(*want)
    assert_sgd_close(got, want)


@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[3]], ids=config_id)
def test_sgd_step_30_steps_match_torch_sgd(device_backend, config):
    """The op driven as torch.optim.SGD drives its for-loop (is_first_step on the first step), fp32, against that
    for-loop itself on the CPU (the reference backend included: it is another implementation of torch's ops)."""
    device, backend = device_backend
    mom, damp, nest, wd, maximize, _, _ = config
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1023, 1, 300)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    bufs = [torch.zeros(p.shape, device=device) for p in params]
    mine = sgd.SPEC.Args([p.detach().to(device) for p in params], [], bufs, [], torch.tensor(0.05, dtype=torch.float64),
                         wd, mom, damp, nest, maximize, True, None, None)  # fmt: skip
    torch_opt = torch.optim.SGD(ref_params, lr=0.05, momentum=mom, dampening=damp, nesterov=nest, weight_decay=wd,
                                maximize=maximize, foreach=False)  # fmt: skip
    for step in range(30):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(ref_params, grads):
            p.grad = gr.clone()
        torch_opt.step()
        call("sgd_step_", mine._replace(grads=[gr.to(device) for gr in grads], is_first_step=step == 0))
    exact = device == "cpu" and (backend == "reference" or (backend == "cpp" and fma_on_both_sides()))
    tol = {"rtol": 0, "atol": 0} if exact else {}
    for p, q, b in zip(cpu(mine).params, ref_params, cpu(mine).momentum_buffers):
        torch.testing.assert_close(p, q.detach(), **tol)
        torch.testing.assert_close(b, torch_opt.state[q]["momentum_buffer"], **tol)


@pytest.mark.parametrize("host", [False, True], ids=["found_inf_on_device", "found_inf_on_host"])
@pytest.mark.parametrize("first", [False, True])
def test_sgd_step_found_inf_changes_nothing(device_backend, host, first):
    device, _ = device_backend
    args = on(device, sgd_args([1023, 5], torch.bfloat16, CONFIGS[3], first=first, found_inf=torch.tensor([1.0])))
    before = clone(args)
    call("sgd_step_", args, host)
    for name in ("params", "grads", "momentum_buffers", "master_params"):
        for a, b in zip(getattr(args, name), getattr(before, name)):
            assert torch.equal(a, b), name


def test_sgd_step_with_empty_lists(device_backend):
    device, _ = device_backend
    call("sgd_step_", sgd.inputs([], device=device))


def test_sgd_step_under_torch_compile(cpu_backend):
    args = sgd.inputs([7, 300], nesterov=True, weight_decay=0.1)
    want = clone(args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(*a):
        torch.ops.fastops.sgd_step_(*a)

    step(*args)
    torch.ops.fastops.sgd_step_(*want)  # the same backend, eagerly
    assert_sgd_close(args, want, exact=True)


@pytest.mark.parametrize("device,backend", COMPILED_CUDA_PAIRS)
def test_sgd_step_never_syncs_and_replays_in_a_cuda_graph(device, backend):
    """The reference reads lr and found_inf on the host; the compiled backends never sync, so a CUDA graph holds
    the step."""
    with _backend.use(device, backend):
        want = sgd_args([1000, 33], torch.float32, CONFIGS[2], found_inf=torch.tensor([0.0]))
        args = on("cuda", want)._replace(lr=torch.tensor(1e-2, device="cuda"))
        want = cpu(args)
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
        assert_sgd_close(args, want)
