"""fastops::adam_step_: one Adam/AdamW step over a list of tensors (semantics: fastops/_ops.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .spec import BadCall, OpSpec, Sample, beta, check_problem, nonnegative, on, scalars

SCHEMA = (
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, "
    "bool decoupled, Tensor? grad_scale, Tensor? found_inf) -> ()"
)


def hyperparameters(beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch.optim.Adam's constructor rules and wording, shared with adam_step_lowp_."""
    beta(beta1, 0)
    beta(beta2, 1)
    nonnegative(eps, "epsilon value")
    nonnegative(weight_decay, "weight_decay value")


def check_tensors(args) -> None:
    (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters, lr, _beta1, _beta2, _eps, _weight_decay, amsgrad,
     _maximize, _decoupled, grad_scale, found_inf) = args  # fmt: skip
    n = len(params)
    ok = (
        len(grads) == n and len(exp_avgs) == n and len(exp_avg_sqs) == n and len(steps) == n
        and len(max_sqs) == (n if amsgrad else 0) and len(masters) in (0, n)
        and C.floats_ok(params) and C.like_ok(grads, params)
        and C.like_ok(exp_avgs, params, torch.float32) and C.like_ok(exp_avg_sqs, params, torch.float32)
        and C.like_ok(max_sqs, params, torch.float32) and C.like_ok(masters, params, torch.float32)
        and C.steps_ok(steps)
    )  # fmt: skip
    check_problem(ok, lambda: C.check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters, amsgrad))
    device = params[0].device if n else None
    scalars("adam_step_", device, (("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)))


def check_values(args) -> None:
    hyperparameters(*args[8:12])


def inputs(sizes, dtype=torch.float32, amsgrad=False, master=False, seed=0, scale=None, found_inf=None, lr=1e-2,
           device="cpu") -> list:  # fmt: skip
    """The 17 positional arguments of adam_step_ a few steps into training: states at magnitudes training reaches,
    step counters 3, 4, ...; amsgrad's max_exp_avg_sqs above exp_avg_sqs for every other param, masters 1e-3 off
    their params. Drawn on the CPU (the same values on every device); lr is a float64 CPU tensor."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    exp_avgs = [torch.randn(n, generator=g).mul_(0.1) for n in sizes]
    exp_avg_sqs = [torch.rand(n, generator=g).mul_(0.01) for n in sizes]
    max_sqs = [v + 0.001 * (i % 2) for i, v in enumerate(exp_avg_sqs)] if amsgrad else []
    steps = [torch.tensor(float(3 + i), dtype=torch.float32) for i in range(len(sizes))]
    masters = [p.float() + 1e-3 for p in params] if master else []
    args = on(device, [params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters, None, 0.9, 0.999, 1e-8, 0.1,
                       amsgrad, False, True, scale, found_inf])  # fmt: skip
    args[7] = torch.tensor(lr, dtype=torch.float64)
    return args


def sample_inputs(device="cpu") -> Iterator[Sample]:
    """The cases opcheck, torch.compile and compile-check run: an empty tensor, one element, every dtype, amsgrad,
    master weights, grad_scale and found_inf; on an accelerator also an lr on the device (read in the kernel)."""
    yield Sample("fp32", inputs([7, 1, 0], device=device))
    yield Sample("bf16-amsgrad-master-scaled", inputs([5, 3], torch.bfloat16, amsgrad=True, master=True,
                                                      scale=torch.tensor(2.0), found_inf=torch.tensor(0.0),
                                                      device=device))  # fmt: skip
    yield Sample("fp16-l2-maximize", _with(inputs([300, 2], torch.float16, device=device), {13: True, 14: False}))
    if torch.device(device).type != "cpu":
        yield Sample("device-lr", _with(inputs([4, 1025], device=device), {7: torch.tensor(1e-2, device=device)}))


def _with(args, changes) -> list:
    args = list(args)
    for i, v in changes.items():
        args[i] = v(args) if callable(v) else v
    return args


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    def bad(case, message, changes, error=RuntimeError, **kw):
        return BadCall(case, _with(inputs([5, 4], device=device, **kw), changes), error, message)

    yield bad("fp16 grad", "fastops: grads[1] has dtype torch.float16 but must be torch.float32 (as params[1])",
              {1: lambda a: [a[1][0], a[1][1].half()]})
    yield bad("grad shape", "fastops: grads[1] has shape (3,) but params[1] has shape (4,)",
              {1: lambda a: [a[1][0], torch.zeros(3, device=device)]})
    yield bad("one exp_avg short", "fastops.adam_step_: expected 2 exp_avgs (one per param), got 1", {2: lambda a: a[2][:1]})
    yield bad("bf16 exp_avg_sq", "fastops: exp_avg_sqs[1] has dtype torch.bfloat16 but must be torch.float32 (as params[1])",
              {3: lambda a: [a[3][0], a[3][1].bfloat16()]})
    yield bad("max_exp_avg_sqs without amsgrad", "fastops.adam_step_: max_exp_avg_sqs must be empty when amsgrad=False",
              {4: lambda a: [t.clone() for t in a[3]]})
    yield bad("gapped param", "fastops: params[0] is not contiguous (its memory is strided with gaps or overlaps); "
              "fused kernels walk the tensor's memory as one block",
              {0: lambda a: [torch.zeros(10, device=device)[::2], a[0][1]]})
    yield bad("transposed grad", "fastops: grads[0] has strides (1, 2) but params[0] has strides (3, 1)",
              {0: lambda a: [torch.zeros(2, 3, device=device), a[0][1]], 1: lambda a: [torch.zeros(3, 2, device=device).t(), a[1][1]],
               2: lambda a: [torch.zeros(2, 3, device=device), a[2][1]], 3: lambda a: [torch.zeros(2, 3, device=device), a[3][1]]})
    yield bad("int step", "fastops.adam_step_: state_steps[1] must be a float32 tensor with one element",
              {5: lambda a: [a[5][0], torch.tensor(1, device=device)]})
    yield bad("lr with two elements",
              "fastops.adam_step_: lr must be a floating tensor with one element, got torch.float32 of shape (2,)",
              {7: torch.tensor([0.1, 0.1])})
    yield bad("found_inf with two elements",
              "fastops.adam_step_: found_inf must be a floating tensor with one element, got torch.float32 of shape (2,)",
              {16: torch.zeros(2, device=device)})
    yield bad("beta1 = 1", "Invalid beta parameter at index 0: 1.0", {8: 1.0}, ValueError)
    yield bad("beta2 = -0.1", "Invalid beta parameter at index 1: -0.1", {9: -0.1}, ValueError)
    yield bad("negative eps", "Invalid epsilon value: -1e-08", {10: -1e-8}, ValueError)
    yield bad("negative weight_decay", "Invalid weight_decay value: -0.1", {11: -0.1}, ValueError)


SPEC = OpSpec("adam_step_", SCHEMA, (0, 2, 3, 4, 5, 6), check_tensors, check_values, None, sample_inputs, bad_inputs)
