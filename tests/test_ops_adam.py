"""torch.ops.fastops.adam_step_ on every (device, backend) pair against fastops.reference (the CPU reference itself is
the oracle: tests/devices.py's KERNEL_PAIRS), and fastops.optim.AdamW on the GPU against torch's fused AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
from fastops import _backend, reference
from fastops._specs import adam
from tests.adam_helpers import FP32_TOL, STATE_TOL  # the measured tables tests/test_adam.py uses
from tests.devices import COMPILED_CUDA_PAIRS, call, clone, cpu, on

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tolerance of bf16/fp16 params against the reference: the update is computed in fp32 and rounded once, and a few-ulp
# fp32 difference can flip that rounding: one ulp of the param dtype (bf16 2^-7 relative, fp16 2^-10).
LOWP_PARAM_TOL = {torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5)}


def sizes(device, backend):
    # The Triton interpreter is ~1e5 elements/s: it gets the odd small sizes, the others also 10^6+7.
    return [0, 1, 1023, 5000] if (device, backend) == ("cpu", "triton") else [0, 1, 1023, 10**6 + 7]


def tolerance_row(device, backend):
    """The row of tests/adam_helpers.py's measured tables that bounds ``backend`` on ``device``. Every backend computes
    the step scalars as the reference does (fp64, rounded once); what is left is the CPU oracle's sqrt (MKL's, not
    correctly rounded; the kernels' and the GPU's are) and, under the Triton interpreter, its emulated fma: on a GPU
    every backend is the C++ CPU backend's case."""
    return backend if device == "cpu" else "cpp"


def assert_adam_close(got, want, row):
    """fp32 params and masters to FP32_TOL[row] (its max), states to STATE_TOL[row], bf16/fp16 params to one ulp of
    their dtype; step counters exactly; grads untouched."""
    got = cpu(got)
    max_d = FP32_TOL[row][0]
    for name in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"):
        for a, b in zip(getattr(got, name), getattr(want, name)):
            if name in ("params", "master_params"):
                rtol, atol = LOWP_PARAM_TOL.get(a.dtype, (max_d, max_d))
            else:
                rtol, atol = STATE_TOL[row]
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert [s.item() for s in got.state_steps] == [s.item() for s in want.state_steps]
    for a, b in zip(got.grads, want.grads):
        assert torch.equal(a, b), "grads are read-only"


# (amsgrad, maximize, weight_decay, decoupled, master): every flag on and off at least once with every other.
FLAG_SETS = [
    (False, False, 0.0, False, False),
    (True, False, 0.0, False, False),
    (False, True, 0.1, False, False),
    (False, False, 0.1, True, False),
    (True, True, 0.1, True, True),
    (False, False, 0.1, False, True),
    (True, False, 0.1, False, True),
    (False, True, 0.0, False, True),
]
# (grad_scale, found_inf, scalars read on the host: devices.call). Each flag set and each dtype meets every scalar set
# across the cases (the set is picked by their positions), and the step counters start fresh (0) for one tensor.
SCALAR_SETS = [(None, None, False), (1024.0, 0.0, False), (1024.0, None, True), (None, 0.0, True)]


def flag_id(f):
    return "ams{}-max{}-wd{}-dec{}-master{}".format(*map(int, f))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", FLAG_SETS, ids=flag_id)
def test_adam_step_matches_reference(kernel_backend, dtype, flags):
    device, backend = kernel_backend
    amsgrad, maximize, wd, decoupled, master = flags
    grad_scale, found_inf, host = SCALAR_SETS[(FLAG_SETS.index(flags) + DTYPES.index(dtype)) % len(SCALAR_SETS)]
    want = adam.inputs(sizes(device, backend), dtype, amsgrad, master, scale=grad_scale and torch.tensor(grad_scale),
                       found_inf=None if found_inf is None else torch.tensor([found_inf]))  # fmt: skip
    want = want._replace(maximize=maximize, weight_decay=wd, decoupled=decoupled,
                         state_steps=[torch.tensor(s) for s in (0.0, 5.0, 100.0, 1.0)])  # fmt: skip
    got = on(device, clone(want))
    if device != "cpu":
        got = got._replace(lr=got.lr.to(device, torch.float32))  # read in the kernel, as a capturable optimizer has it
        want = want._replace(lr=want.lr.float())
    for _ in range(2):
        call("adam_step_", got, host)
        reference.adam_step_(*want)
    assert_adam_close(got, want, tolerance_row(device, backend))


def test_adam_step_50_steps_match_reference(kernel_backend):
    device, backend = kernel_backend
    want = adam.inputs([1023, 1, 300], amsgrad=True)
    got = on(device, clone(want))
    for step in range(50):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(got.grads, want.grads):
            b.copy_(torch.randn(b.shape, generator=g))
            a.copy_(b)
        call("adam_step_", got)
        reference.adam_step_(*want)
    assert_adam_close(got, want, tolerance_row(device, backend))


@pytest.mark.parametrize("amsgrad_master", [True, False])
def test_adam_step_mixed_dtypes_and_chunks_in_one_call(kernel_backend, amsgrad_master):
    # 70_000 elements: four full 16384-element Triton chunks (one full CUDA chunk of 65536) and a tail, next to
    # tensors of other dtypes, in one call.
    device, backend = kernel_backend
    on_ = amsgrad_master
    parts = [adam.inputs([n], dt, amsgrad=on_, master=on_, seed=k, scale=torch.tensor(512.0), lr=3e-3)
             for k, (n, dt) in enumerate([(1023, torch.float32), (5000, torch.bfloat16), (1, torch.float16),
                                          (70_000, torch.bfloat16), (70_000, torch.float32)])]  # fmt: skip
    want = parts[0]._make(sum((p[k] for p in parts), []) if isinstance(v, list) else v for k, v in enumerate(parts[0]))
    want = want._replace(beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.3, decoupled=on_)
    got = on(device, clone(want))
    for _ in range(2):
        call("adam_step_", got)
        reference.adam_step_(*want)
    assert_adam_close(got, want, tolerance_row(device, backend))


@pytest.mark.parametrize("host", [False, True], ids=["scalars_on_device", "scalars_on_host"])
def test_adam_step_found_inf_changes_nothing(device_backend, host):
    device, _ = device_backend
    args = adam.inputs([1023, 5], amsgrad=True, master=True, found_inf=torch.tensor([1.0]), scale=torch.tensor(8.0),
                       device=device)  # fmt: skip
    before = clone(args)
    call("adam_step_", args, host)
    for name in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "master_params"):
        for a, b in zip(getattr(args, name), getattr(before, name)):
            assert torch.equal(a, b), name


def test_adam_step_with_empty_lists(device_backend):
    device, _ = device_backend
    call("adam_step_", adam.inputs([], device=device))


@pytest.mark.parametrize("device,backend", COMPILED_CUDA_PAIRS)
def test_optimizer_parity_with_torch_fused_on_cuda(device, backend):
    with _backend.use(device, backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
        ref_model = copy.deepcopy(model)
        opt = fastops.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, amsgrad=True, fused=True)
        for step in range(50):
            x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
    max_d = FP32_TOL["cpp"][0]  # see tolerance_row
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=max_d, atol=max_d)


@pytest.mark.parametrize("device,backend", COMPILED_CUDA_PAIRS)
def test_capturable_step_replays_in_a_cuda_graph(device, backend):
    with _backend.use(device, backend):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1000, 33)]
        ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        lr = torch.tensor(1e-2, device="cuda")
        opt = fastops.optim.AdamW(params, lr=lr, capturable=True)
        ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
        for p in params + ref_params:
            p.grad = torch.ones_like(p)
        opt.step()  # state initialisation happens outside the capture
        ref.step()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(5):
            graph.replay()
            ref.step()
    max_d = FP32_TOL["cpp"][0]
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=max_d, atol=max_d)
