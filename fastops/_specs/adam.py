"""fastops::adam_step_: one Adam/AdamW step over a list of tensors (semantics: fastops/_ops.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .spec import BadCall, OpSpec, Sample, device_name, on, step_bad_calls, with_

SCHEMA = (
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, "
    "bool decoupled, Tensor? grad_scale, Tensor? found_inf) -> ()"
)


def check_values(a) -> None:
    """torch.optim.Adam's constructor rules and wording, shared with adam_step_lowp_."""
    C.beta(a.beta1, 0)
    C.beta(a.beta2, 1)
    C.nonnegative(a.eps, "epsilon value")
    C.nonnegative(a.weight_decay, "weight_decay value")


def inputs(sizes, dtype=torch.float32, amsgrad=False, master=False, seed=0, scale=None, found_inf=None, lr=1e-2,
           device="cpu"):  # fmt: skip
    """adam_step_'s arguments (``SPEC.Args``) a few steps into training: states at magnitudes training reaches,
    step counters 3, 4, ...; amsgrad's max_exp_avg_sqs above exp_avg_sqs for every other param, masters 1e-3 off
    their params. Drawn on the CPU (the same values on every device); lr is a float64 CPU tensor."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    exp_avgs = [torch.randn(n, generator=g).mul_(0.1) for n in sizes]
    exp_avg_sqs = [torch.rand(n, generator=g).mul_(0.01) for n in sizes]
    args = SPEC.Args(
        params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
        max_exp_avg_sqs=[v + 0.001 * (i % 2) for i, v in enumerate(exp_avg_sqs)] if amsgrad else [],
        state_steps=[torch.tensor(float(3 + i), dtype=torch.float32) for i in range(len(sizes))],
        master_params=[p.float() + 1e-3 for p in params] if master else [], lr=None, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=False, decoupled=True, grad_scale=scale,
        found_inf=found_inf,
    )  # fmt: skip
    return on(device, args)._replace(lr=torch.tensor(lr, dtype=torch.float64))


def sample_inputs(device="cpu") -> Iterator[Sample]:
    """The cases opcheck, torch.compile and compile-check run: an empty tensor, one element, every dtype, amsgrad,
    master weights, grad_scale and found_inf; on an accelerator also an lr on the device (read in the kernel)."""
    yield Sample("fp32", inputs([7, 1, 0], device=device))
    yield Sample("bf16-amsgrad-master-scaled", inputs([5, 3], torch.bfloat16, amsgrad=True, master=True,
                                                      scale=torch.tensor(2.0), found_inf=torch.tensor(0.0),
                                                      device=device))  # fmt: skip
    yield Sample("fp16-l2-maximize", with_(inputs([300, 2], torch.float16, device=device), maximize=True,
                                           decoupled=False))  # fmt: skip
    if torch.device(device).type != "cpu":
        yield Sample("device-lr", inputs([4, 1025], device=device)._replace(lr=torch.tensor(1e-2, device=device)))


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    def bad(case, message, error=RuntimeError, master=False, **changes):
        return BadCall(case, with_(inputs([5, 4], master=master, device=device), **changes), error, message)

    z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)  # noqa: E731
    yield from step_bad_calls("adam_step_", bad, device)
    yield bad("grad shape", "fastops: grads[1] has shape (3,) but params[1] has shape (4,)",
              grads=lambda a: [a.grads[0], z(3)])
    yield bad("one exp_avg short", "fastops.adam_step_: expected 2 exp_avgs (one per param), got 1",
              exp_avgs=lambda a: a.exp_avgs[:1])
    yield bad("bf16 exp_avg_sq", "fastops: exp_avg_sqs[1] has dtype torch.bfloat16 but must be torch.float32 (as "
              "params[1])", exp_avg_sqs=lambda a: [a.exp_avg_sqs[0], a.exp_avg_sqs[1].bfloat16()])
    yield bad("max_exp_avg_sqs without amsgrad", "fastops.adam_step_: max_exp_avg_sqs must be empty when "
              "amsgrad=False", max_exp_avg_sqs=lambda a: [t.clone() for t in a.exp_avg_sqs])
    yield bad("transposed grad", "fastops: grads[0] has strides (1, 2) but params[0] has strides (3, 1)",
              params=lambda a: [z(2, 3), a.params[1]], grads=lambda a: [z(3, 2).t(), a.grads[1]],
              exp_avgs=lambda a: [z(2, 3), a.exp_avgs[1]], exp_avg_sqs=lambda a: [z(2, 3), a.exp_avg_sqs[1]])
    yield bad("int step", "fastops.adam_step_: state_steps[1] must be a float32 tensor with one element",
              state_steps=lambda a: [a.state_steps[0], torch.tensor(1, device=device)])
    if torch.device(device).type != "cpu":
        yield bad("step on the CPU", f"fastops.adam_step_: state_steps[1] is on cpu but params[0] is on "
                  f"{device_name(device)}; the kernels read each step on the params' device",
                  state_steps=lambda a: [a.state_steps[0], a.state_steps[1].cpu()])
    yield bad("beta1 = 1", "Invalid beta parameter at index 0: 1.0", ValueError, beta1=1.0)
    yield bad("beta2 = -0.1", "Invalid beta parameter at index 1: -0.1", ValueError, beta2=-0.1)
    yield bad("negative eps", "Invalid epsilon value: -1e-08", ValueError, eps=-1e-8)
    yield bad("negative weight_decay", "Invalid weight_decay value: -0.1", ValueError, weight_decay=-0.1)


SPEC = OpSpec(SCHEMA, C.adam_step_, check_values, None, sample_inputs, bad_inputs)
