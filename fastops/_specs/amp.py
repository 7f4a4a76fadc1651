"""fastops::unscale_check_ and fastops::grad_stats: the GradScaler's unscale and the one read of all grads behind
clip_grad_norm_ (semantics: fastops/_ops.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .spec import BadCall, OpSpec, Sample, check_problem, scalars

UNSCALE_SCHEMA = "unscale_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()"
GRAD_STATS_SCHEMA = "grad_stats(Tensor[] grads, Tensor? inv_scale=None) -> Tensor"


def _grads_ok(grads) -> bool:
    return C.floats_ok(grads)


def check_unscale(args) -> None:
    grads, found_inf, inv_scale = args
    check_problem(_grads_ok(grads), lambda: C.check_grads(grads, "unscale_check_"))
    if not len(grads):
        return
    device = grads[0].device
    if found_inf.numel() != 1 or found_inf.dtype != torch.float32 or found_inf.device != device:
        check_problem(False, lambda: C.check_found_inf(found_inf, "unscale_check_", device))
    scalars("unscale_check_", device, (("inv_scale", inv_scale),))


def check_grad_stats(args) -> None:
    grads, inv_scale = args if len(args) == 2 else (args[0], None)
    torch._check(len(grads) > 0, lambda: "fastops.grad_stats: needs at least one tensor")
    check_problem(_grads_ok(grads), lambda: C.check_grads(grads, "grad_stats"))
    scalars("grad_stats", grads[0].device, (("inv_scale", inv_scale),))


def no_values(args) -> None:
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
    d = torch.device(device)
    yield Sample("fp16", [grads([5, 3], torch.float16, device=device), torch.zeros(1, device=d), torch.tensor(0.5)])
    yield Sample("mixed-inf-device-scale", [grads([7, 0], torch.float32, float("inf"), device=device) +
                                            grads([4], torch.bfloat16, device=device),
                                            torch.zeros(1, device=d), torch.tensor(0.25, device=d)])  # fmt: skip


def grad_stats_samples(device="cpu") -> Iterator[Sample]:
    yield Sample("bf16-with-empty", [grads([5, 0, 3], torch.bfloat16, device=device)])
    yield Sample("fp32-inv-scale", [grads([5, 3], device=device), torch.tensor(0.25)])
    # inf, not nan: opcheck compares outputs without equal_nan.
    yield Sample("fp16-inf", [grads([300, 2], torch.float16, float("inf"), "last", device=device), None])


def unscale_bad(device="cpu") -> Iterator[BadCall]:
    op = "fastops.unscale_check_"
    dev = str(torch.empty(0, device=device).device)
    g = lambda: [torch.ones(3, device=device)]  # noqa: E731
    yield BadCall("found_inf with two elements", [g(), torch.zeros(2, device=device), torch.tensor(0.5)], RuntimeError,
                  f"{op}: found_inf must be one float32 element on {dev} (the kernel writes it), got torch.float32 of "
                  f"shape (2,) on {dev}")  # fmt: skip
    yield BadCall("int found_inf", [g(), torch.zeros(1, dtype=torch.int32, device=device), torch.tensor(0.5)],
                  RuntimeError, f"{op}: found_inf must be one float32 element on {dev} (the kernel writes it), got "
                  f"torch.int32 of shape (1,) on {dev}")  # fmt: skip
    yield BadCall("inv_scale with two elements", [g(), torch.zeros(1, device=device), torch.ones(2)], RuntimeError,
                  f"{op}: inv_scale must be a floating tensor with one element, got torch.float32 of shape (2,)")
    yield BadCall("int64 grad", [g() + [torch.ones(3, dtype=torch.long, device=device)], torch.zeros(1, device=device),
                                 torch.tensor(1.0)], RuntimeError,
                  f"{op}: grads[1] has dtype torch.int64; expected float32, bfloat16 or float16")  # fmt: skip


def grad_stats_bad(device="cpu") -> Iterator[BadCall]:
    op = "fastops.grad_stats"
    g = lambda: [torch.ones(3, device=device)]  # noqa: E731
    yield BadCall("inv_scale with two elements", [g(), torch.ones(2)], RuntimeError,
                  f"{op}: inv_scale must be a floating tensor with one element, got torch.float32 of shape (2,)")
    yield BadCall("int inv_scale", [g(), torch.tensor(2)], RuntimeError,
                  f"{op}: inv_scale must be a floating tensor with one element, got torch.int64 of shape ()")
    yield BadCall("gapped grad", [[torch.ones(6, device=device)[::2]], None], RuntimeError,
                  "fastops: grads[0] is not contiguous (its memory is strided with gaps or overlaps); fused kernels "
                  "walk the tensor's memory as one block")  # fmt: skip


def _grad_stats_result(grads, inv_scale=None):
    return grads[0].new_empty((3,), dtype=torch.float32)


UNSCALE_CHECK = OpSpec("unscale_check_", UNSCALE_SCHEMA, (0, 1), check_unscale, no_values, None, unscale_samples, unscale_bad)
GRAD_STATS = OpSpec("grad_stats", GRAD_STATS_SCHEMA, (), check_grad_stats, no_values, _grad_stats_result, grad_stats_samples,
                    grad_stats_bad)  # fmt: skip
