"""fastops::sgd_step_: one step of torch.optim.SGD's update over a list of tensors (semantics: fastops/_ops.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .spec import BadCall, OpSpec, Sample, on, step_bad_calls, with_

SCHEMA = (
    "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] master_params, "
    "Tensor lr, float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, "
    "bool is_first_step, Tensor? grad_scale, Tensor? found_inf) -> ()"
)


def check_values(a) -> None:
    # torch.optim.SGD's constructor rules and wording.
    C.nonnegative(a.momentum, "momentum value")
    C.nonnegative(a.weight_decay, "weight_decay value")
    if a.nesterov and (a.momentum <= 0 or a.dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def inputs(sizes, dtype=torch.float32, momentum=0.9, master=False, seed=0, lr=None, weight_decay=0.0, dampening=0.0,
           nesterov=False, maximize=False, first=False, scale=None, found_inf=None, device="cpu"):  # fmt: skip
    """sgd_step_'s arguments (``SPEC.Args``). lr defaults to a float64 CPU tensor (what torch's SGD holds for a float
    lr is a Python float; a Tensor lr can be any floating dtype)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    bufs = [torch.randn(n, generator=g).mul_(0.1) for n in sizes] if momentum else []
    masters = [p.float() + 1e-3 for p in params] if master else []
    args = SPEC.Args(params, grads, bufs, masters, None, weight_decay, momentum, dampening, nesterov, maximize, first,
                     scale, found_inf)  # fmt: skip
    return on(device, args)._replace(lr=torch.tensor(1e-2, dtype=torch.float64) if lr is None else lr)


def sample_inputs(device="cpu") -> Iterator[Sample]:
    yield Sample("momentum", inputs([7, 1, 0], device=device))
    yield Sample("no-momentum-wd", inputs([5, 3], momentum=0.0, weight_decay=0.1, device=device))
    yield Sample("bf16-master-nesterov-first-scaled", inputs([5, 3], torch.bfloat16, master=True, nesterov=True,
                                                             first=True, scale=torch.tensor(2.0),
                                                             found_inf=torch.tensor(0.0), device=device))  # fmt: skip
    yield Sample("fp16-dampening-maximize", inputs([300, 2], torch.float16, dampening=0.3, maximize=True,
                                                   device=device))  # fmt: skip
    if torch.device(device).type != "cpu":
        yield Sample("device-lr", inputs([4, 1025], lr=torch.tensor(1e-2, device=device), device=device))


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    op = "fastops.sgd_step_"

    def bad(case, message, error=RuntimeError, momentum=0.9, master=False, nesterov=False, **changes):
        args = inputs([4, 3], momentum=momentum, master=master, nesterov=nesterov, device=device)
        return BadCall(case, with_(args, **changes), error, message)

    z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)  # noqa: E731
    yield bad("buffers without momentum", f"{op}: momentum_buffers must be empty when momentum=0", momentum=0.0,
              momentum_buffers=lambda a: [z(4), z(3)])
    yield bad("one buffer short", f"{op}: expected 2 momentum_buffers (one per param), got 1",
              momentum_buffers=lambda a: a.momentum_buffers[:1])
    yield bad("one grad short", f"{op}: expected 2 grads (one per param), got 1", grads=lambda a: a.grads[:1])
    yield from step_bad_calls("sgd_step_", bad, device)
    yield bad("bf16 buffer", "fastops: momentum_buffers[0] has dtype torch.bfloat16 but must be torch.float32 "
              "(as params[0])", momentum_buffers=lambda a: [b.bfloat16() for b in a.momentum_buffers])
    yield bad("buffer shape", "fastops: momentum_buffers[0] has shape (5,) but params[0] has shape (4,)",
              momentum_buffers=lambda a: [z(5), a.momentum_buffers[1]])
    yield bad("negative momentum", "Invalid momentum value: -0.9", ValueError, momentum=-0.9)
    yield bad("negative weight_decay", "Invalid weight_decay value: -0.1", ValueError, weight_decay=-0.1)
    yield bad("nesterov with dampening", "Nesterov momentum requires a momentum and zero dampening", ValueError,
              nesterov=True, dampening=0.5)


SPEC = OpSpec(SCHEMA, C.sgd_step_, check_values, None, sample_inputs, bad_inputs)
