"""fastops::unscale_check_ and fastops::grad_stats: the GradScaler's unscale and the one read of all grads behind
clip_grad_norm_ (semantics: fastops/_ops.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .spec import BadCall, OpSpec, Sample, device_name

UNSCALE_SCHEMA = "unscale_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()"
GRAD_STATS_SCHEMA = "grad_stats(Tensor[] grads, Tensor? inv_scale=None) -> Tensor"


def no_values(a) -> None:
    """inv_scale is any finite or infinite value a GradScaler holds; the AMP ops take no hyperparameters."""


def grads(sizes, dtype=torch.float32, poison=None, where="first", seed=0, device="cpu") -> list:
    """Grads ~ 3 * N(0, 1); ``poison`` (inf, nan) put in the first element of the first non-empty grad or the last
    element of the last one."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g).mul_(3).to(dtype) for n in sizes]
    if poison is not None:
        target = next(t for t in (out if where == "first" else reversed(out)) if t.numel())
        target[0 if where == "first" else -1] = poison
    return [t.to(device) for t in out]


def unscale_samples(device="cpu") -> Iterator[Sample]:
    d, make = torch.device(device), UNSCALE_CHECK.Args
    yield Sample("fp16", make(grads([5, 3], torch.float16, device=device), torch.zeros(1, device=d), torch.tensor(0.5)))
    yield Sample("mixed-inf-device-scale", make(grads([7, 0], torch.float32, float("inf"), device=device) +
                                                grads([4], torch.bfloat16, device=device),
                                                torch.zeros(1, device=d), torch.tensor(0.25, device=d)))  # fmt: skip


def grad_stats_samples(device="cpu") -> Iterator[Sample]:
    make = GRAD_STATS.Args
    yield Sample("bf16-with-empty", make(grads([5, 0, 3], torch.bfloat16, device=device)))
    yield Sample("fp32-inv-scale", make(grads([5, 3], device=device), torch.tensor(0.25)))
    # inf, not nan: opcheck compares outputs without equal_nan.
    yield Sample("fp16-inf", make(grads([300, 2], torch.float16, float("inf"), "last", device=device), None))


def unscale_bad(device="cpu") -> Iterator[BadCall]:
    op, dev = "fastops.unscale_check_", device_name(device)

    def bad(case, message, grads=None, found_inf=None, inv_scale=torch.tensor(0.5)):
        grads = [torch.ones(3, device=device)] if grads is None else grads
        found_inf = torch.zeros(1, device=device) if found_inf is None else found_inf
        return BadCall(case, UNSCALE_CHECK.Args(grads, found_inf, inv_scale), RuntimeError, message)

    yield bad("found_inf with two elements", f"{op}: found_inf must be one float32 element on {dev} (the kernel "
              f"writes it), got torch.float32 of shape (2,) on {dev}", found_inf=torch.zeros(2, device=device))
    yield bad("int found_inf", f"{op}: found_inf must be one float32 element on {dev} (the kernel writes it), got "
              f"torch.int32 of shape (1,) on {dev}", found_inf=torch.zeros(1, dtype=torch.int32, device=device))
    yield bad("inv_scale with two elements", f"{op}: inv_scale must be a floating tensor with one element, got "
              "torch.float32 of shape (2,)", inv_scale=torch.ones(2))
    yield bad("int64 grad", f"{op}: grads[1] has dtype torch.int64; expected float32, bfloat16 or float16",
              grads=[torch.ones(3, device=device), torch.ones(3, dtype=torch.long, device=device)])


def grad_stats_bad(device="cpu") -> Iterator[BadCall]:
    op = "fastops.grad_stats"

    def bad(case, message, grads=None, inv_scale=None):
        grads = [torch.ones(3, device=device)] if grads is None else grads
        return BadCall(case, GRAD_STATS.Args(grads, inv_scale), RuntimeError, message)

    yield bad("no grads", f"{op}: needs at least one tensor", grads=[], inv_scale=torch.ones((), device=device))
    yield bad("inv_scale with two elements", f"{op}: inv_scale must be a floating tensor with one element, got "
              "torch.float32 of shape (2,)", inv_scale=torch.ones(2))
    yield bad("int inv_scale", f"{op}: inv_scale must be a floating tensor with one element, got torch.int64 of "
              "shape ()", inv_scale=torch.tensor(2))
    yield bad("gapped grad", "fastops: grads[0] is not contiguous (its memory is strided with gaps or overlaps); "
              "fused kernels walk the tensor's memory as one block", grads=[torch.ones(6, device=device)[::2]])


def _grad_stats_result(a):
    return a.grads[0].new_empty((3,), dtype=torch.float32)


UNSCALE_CHECK = OpSpec(UNSCALE_SCHEMA, C.unscale_check_, no_values, None, unscale_samples, unscale_bad)
GRAD_STATS = OpSpec(GRAD_STATS_SCHEMA, C.grad_stats, no_values, _grad_stats_result, grad_stats_samples, grad_stats_bad)
