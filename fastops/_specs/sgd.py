"""fastops::sgd_step_: one step of torch.optim.SGD's update over a list of tensors (semantics: fastops/_ops.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .spec import BadCall, OpSpec, Sample, check_problem, nonnegative, on, scalars

SCHEMA = (
    "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] master_params, "
    "Tensor lr, float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, "
    "bool is_first_step, Tensor? grad_scale, Tensor? found_inf) -> ()"
)


def check_tensors(args) -> None:
    params, grads, bufs, masters, lr, _wd, momentum, _damp, _nesterov, _maximize, _first, grad_scale, found_inf = args
    n = len(params)
    ok = (
        len(grads) == n and len(bufs) == (n if momentum != 0 else 0) and len(masters) in (0, n)
        and C.floats_ok(params) and C.like_ok(grads, params) and C.like_ok(bufs, params, torch.float32)
        and C.like_ok(masters, params, torch.float32)
    )  # fmt: skip
    check_problem(ok, lambda: C.check_sgd_args(params, grads, bufs, masters, momentum))
    device = params[0].device if n else None
    scalars("sgd_step_", device, (("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)))


def check_values(args) -> None:
    weight_decay, momentum, dampening, nesterov = args[5:9]
    # torch.optim.SGD's constructor rules and wording.
    nonnegative(momentum, "momentum value")
    nonnegative(weight_decay, "weight_decay value")
    torch._check_value(not nesterov or (momentum > 0 and dampening == 0),
                       lambda: "Nesterov momentum requires a momentum and zero dampening")


def inputs(sizes, dtype=torch.float32, momentum=0.9, master=False, seed=0, lr=None, weight_decay=0.0, dampening=0.0,
           nesterov=False, maximize=False, first=False, scale=None, found_inf=None, device="cpu") -> list:  # fmt: skip
    """The 13 positional arguments of sgd_step_. lr defaults to a float64 CPU tensor (what torch's SGD holds for a
    float lr is a Python float; a Tensor lr can be any floating dtype)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    bufs = [torch.randn(n, generator=g).mul_(0.1) for n in sizes] if momentum else []
    masters = [p.float() + 1e-3 for p in params] if master else []
    args = on(device, [params, grads, bufs, masters, None, weight_decay, momentum, dampening, nesterov, maximize,
                       first, scale, found_inf])  # fmt: skip
    args[4] = torch.tensor(1e-2, dtype=torch.float64) if lr is None else lr
    return args


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

    def bad(case, message, i, value, error=RuntimeError, **kw):
        args = inputs([4, 3], device=device, **kw)
        args[i] = value(args) if callable(value) else value
        return BadCall(case, args, error, message)

    z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)  # noqa: E731
    yield bad("buffers without momentum", f"{op}: momentum_buffers must be empty when momentum=0", 2,
              lambda a: [z(4), z(3)], momentum=0.0)
    yield bad("one buffer short", f"{op}: expected 2 momentum_buffers (one per param), got 1", 2, lambda a: a[2][:1])
    yield bad("one grad short", f"{op}: expected 2 grads (one per param), got 1", 1, lambda a: a[1][:1])
    yield bad("one master short", f"{op}: expected 2 master_params (one per param), got 1", 3, lambda a: a[3][:1],
              master=True)
    yield bad("bf16 buffer", "fastops: momentum_buffers[0] has dtype torch.bfloat16 but must be torch.float32 "
              "(as params[0])", 2, lambda a: [b.bfloat16() for b in a[2]])
    yield bad("buffer shape", "fastops: momentum_buffers[0] has shape (5,) but params[0] has shape (4,)", 2,
              lambda a: [z(5), a[2][1]])
    yield bad("fp16 grad for fp32 param", "fastops: grads[0] has dtype torch.float16 but must be torch.float32 "
              "(as params[0])", 1, lambda a: [a[1][0].half(), a[1][1]])
    yield bad("int param", f"{op}: params[0] has dtype torch.int32; expected float32, bfloat16 or float16", 0,
              lambda a: [z(4, dtype=torch.int32), a[0][1]])
    yield bad("gapped param", "fastops: params[0] is not contiguous (its memory is strided with gaps or overlaps); "
              "fused kernels walk the tensor's memory as one block", 0, lambda a: [z(8)[::2], a[0][1]])
    yield bad("fp16 master", "fastops: master_params[0] has dtype torch.float16 but must be torch.float32 "
              "(as params[0])", 3, lambda a: [m.half() for m in a[3]], master=True)
    yield bad("lr with two elements", f"{op}: lr must be a floating tensor with one element, got torch.float32 of "
              "shape (2,)", 4, torch.tensor([0.1, 0.1]))
    yield bad("integer grad_scale", f"{op}: grad_scale must be a floating tensor with one element, got torch.int64 of "
              "shape ()", 11, torch.tensor(2))
    yield bad("found_inf with two elements", f"{op}: found_inf must be a floating tensor with one element, got "
              "torch.float32 of shape (2,)", 12, z(2))
    yield bad("negative momentum", "Invalid momentum value: -0.9", 6, -0.9, ValueError)
    yield bad("negative weight_decay", "Invalid weight_decay value: -0.1", 5, -0.1, ValueError)
    yield bad("nesterov with dampening", "Nesterov momentum requires a momentum and zero dampening", 7, 0.5, ValueError,
              nesterov=True)


SPEC = OpSpec("sgd_step_", SCHEMA, (0, 2, 3), check_tensors, check_values, None, sample_inputs, bad_inputs)
