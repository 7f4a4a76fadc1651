"""fastops::linear_cross_entropy and its backward: ``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` and
the gradients asked for, without ever holding the N x V logits.

``linear_cross_entropy(x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, grad_x,
grad_weight, grad_bias, chunk_rows) -> (loss, grad_x, grad_weight, grad_bias)``
    x: (..., H), weight: (V, H), bias: (V,) or None, in x's dtype (weight and bias may be fp32 under bf16/fp16 x:
    ``master_weight``), target: (...) int64/int32 class indices, rows whose target is
    ``ignore_index`` dropped; ``reduction`` is torch's Reduction enum (0 none, 1 mean, 2 sum), as aten's
    cross_entropy_loss takes it. The loss is F.cross_entropy's with ``label_smoothing``, kept in fp32 (fp64 for
    fp64 inputs): per row for ``reduction="none"``, else the sum, or the mean over the labeled rows, or, where
    ``normalizer`` > 0, the sum divided by ``normalizer`` (a batch split into micro-batches then normalises over
    the whole batch's labeled count, as one large batch would). For "mean" and "sum" the gradients whose flag is
    set come back with the loss (the loss's own, before any incoming gradient), each in its input's dtype; the others,
    and all of them for "none", are empty (0,) tensors. ``chunk_rows`` > 0 fixes the rows of logits held at once;
    0 lets the op choose (fastops/_lce.py's chunk_rows()).
``linear_cross_entropy_backward(grad_loss, x, weight, target, bias, ignore_index, reduction, label_smoothing,
normalizer, grad_x, grad_weight, grad_bias, chunk_rows) -> (grad_x, grad_weight, grad_bias)``
    The gradients of ``(loss * grad_loss).sum()``, recomputing the logits (what ``reduction="none"`` needs); a
    target outside [0, V) raises IndexError in both (a check of values, so at run time only).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .spec import BadCall, OpSpec, Sample, on

OP = "fastops.linear_cross_entropy"
REDUCTIONS = ("none", "mean", "sum")  # the schema's int reduction indexes this: torch's Reduction enum
NONE, MEAN, SUM = range(3)
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

FORWARD_SCHEMA = (
    "linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index, int reduction, "
    "float label_smoothing, float normalizer, bool grad_x, bool grad_weight, bool grad_bias, int chunk_rows) "
    "-> (Tensor loss, Tensor grad_x, Tensor grad_weight, Tensor grad_bias)"
)
BACKWARD_SCHEMA = (
    "linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight, Tensor target, Tensor? bias, "
    "int ignore_index, int reduction, float label_smoothing, float normalizer, bool grad_x, bool grad_weight, "
    "bool grad_bias, int chunk_rows) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)"
)


def loss_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def master_weight(x, weight) -> bool:
    """An fp32 weight (and bias) under bf16/fp16 x: the matmuls run in x's dtype on its cast, made by the op a block
    at a time where it can, and grad_weight comes back fp32, ready to be the param's .grad (what autocast's cast
    would hand back after its own copy)."""
    return weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)


def check_inputs(x, weight, target, bias) -> None:
    """Shapes, dtypes and devices (metadata only: fake tensors pass through the same checks)."""
    # Not tensors at all: the schema refuses them first ("Expected a value of type 'Tensor' for argument 'x'").
    torch._check_type(x.dtype in FLOATS, lambda: f"{OP}: x has dtype {x.dtype}; expected a floating dtype")
    torch._check_value(x.dim() >= 1 and weight.dim() == 2, lambda: f"{OP}: x must be (..., H) and weight (V, H); got "
                       f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    torch._check_value(weight.shape[1] == x.shape[-1], lambda: f"{OP}: x has hidden size {x.shape[-1]} but weight "
                       f"{tuple(weight.shape)} expects {weight.shape[1]}")
    torch._check_type(weight.dtype == x.dtype or master_weight(x, weight), lambda: f"{OP}: weight has dtype "
                      f"{weight.dtype} but x has {x.dtype}; weight takes x's dtype, or float32 where x is bf16/fp16")
    torch._check_value(weight.device == x.device, lambda: f"{OP}: weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        torch._check_value(tuple(bias.shape) == (weight.shape[0],), lambda: f"{OP}: bias has shape "
                           f"{tuple(bias.shape)}; expected ({weight.shape[0]},)")
        torch._check_type(bias.dtype == weight.dtype, lambda: f"{OP}: bias has dtype {bias.dtype} but weight has "
                          f"{weight.dtype}")
        torch._check_value(bias.device == x.device, lambda: f"{OP}: bias is on {bias.device} but x is on {x.device}")
    torch._check_type(target.dtype in (torch.int64, torch.int32), lambda: f"{OP}: target has dtype {target.dtype}; "
                      "expected int64 class indices")
    torch._check_value(tuple(target.shape) == tuple(x.shape[:-1]), lambda: f"{OP}: target has shape "
                       f"{tuple(target.shape)} but x {tuple(x.shape)} needs {tuple(x.shape[:-1])}")
    torch._check_value(target.device == x.device, lambda: f"{OP}: target is on {target.device} but x is on "
                       f"{x.device}")


def check_options(reduction, label_smoothing, normalizer, chunk_rows) -> None:
    torch._check_value(reduction in (NONE, MEAN, SUM), lambda: f"{OP}: reduction must be 0 (none), 1 (mean) or 2 "
                       f"(sum), got {reduction}")
    torch._check_value(0.0 <= label_smoothing <= 1.0, lambda: f"{OP}: label_smoothing must be in [0, 1], got "
                       f"{label_smoothing}")
    torch._check_value(normalizer >= 0.0 and math.isfinite(normalizer), lambda: f"{OP}: normalizer must be a finite "
                       f"number >= 0 (0: the labeled count), got {normalizer}")
    torch._check_value(normalizer == 0.0 or reduction == MEAN, lambda: f"{OP}: normalizer divides the mean; "
                       f"reduction={REDUCTIONS[reduction]!r} takes none")
    torch._check_value(chunk_rows >= 0, lambda: f"{OP}: chunk_rows must be >= 0 (0: the op chooses), got {chunk_rows}")


def check_forward_tensors(args) -> None:
    check_inputs(*args[:4])


def check_forward_values(args) -> None:
    check_options(args[5], args[6], args[7], args[11])


def check_backward_tensors(args) -> None:
    grad_loss, x, weight, target, bias, _ignore, reduction = args[:7]
    check_inputs(x, weight, target, bias)
    torch._check_type(isinstance(grad_loss, torch.Tensor) and grad_loss.is_floating_point(),
                      lambda: f"{OP}: grad_loss must be a floating tensor")
    want = tuple(target.shape) if reduction == NONE else ()
    torch._check_value(tuple(grad_loss.shape) == want, lambda: f"{OP}: grad_loss has shape {tuple(grad_loss.shape)}; "
                       f"the loss of reduction={REDUCTIONS[reduction]!r} has shape {want}")
    torch._check_value(grad_loss.device == x.device, lambda: f"{OP}: grad_loss is on {grad_loss.device} but x is on "
                       f"{x.device}")


def check_backward_values(args) -> None:
    check_options(args[6], args[7], args[8], args[12])


def fake_forward(x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, grad_x, grad_weight,
                 grad_bias, chunk_rows):  # fmt: skip
    none = reduction == NONE
    loss = x.new_empty(target.shape if none else (), dtype=loss_dtype(x))
    gx = x.new_empty(x.shape if grad_x and not none else (0,))
    gw = weight.new_empty(weight.shape if grad_weight and not none else (0,))
    gb = weight.new_empty((weight.shape[0],) if grad_bias and not none and bias is not None else (0,))
    return loss, gx, gw, gb


def fake_backward(grad_loss, x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, grad_x,
                  grad_weight, grad_bias, chunk_rows):  # fmt: skip
    gx = x.new_empty(x.shape if grad_x else (0,))
    gw = weight.new_empty(weight.shape if grad_weight else (0,))
    gb = weight.new_empty((weight.shape[0],) if grad_bias and bias is not None else (0,))
    return gx, gw, gb


def tensors(n, h, v, dtype=torch.float32, labeled=0.5, bias=True, seed=0, scale=1.0, ignore_index=-100,
            weight_dtype=None):  # fmt: skip
    """x (n, h) ~ scale N(0, 1), weight (v, h) ~ N(0, 1/h), bias ~ 0.1 N(0, 1) or None (in ``weight_dtype``, else
    x's), target with the fraction ``labeled`` of rows labeled (the others ``ignore_index``)."""
    g = torch.Generator().manual_seed(seed)
    wd = weight_dtype or dtype
    x = (torch.randn(n, h, generator=g) * scale).to(dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(wd)
    b = (torch.randn(v, generator=g) * 0.1).to(wd) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) >= labeled] = ignore_index
    return x, w, b, t


def inputs(n, h, v, dtype=torch.float32, labeled=0.5, bias=True, seed=0, reduction="mean", label_smoothing=0.0,
           normalizer=0.0, grads=(True, True, True), chunk_rows=0, ignore_index=-100, device="cpu",
           weight_dtype=None) -> list:  # fmt: skip
    """The 12 positional arguments of linear_cross_entropy."""
    x, w, b, t = tensors(n, h, v, dtype, labeled, bias, seed, ignore_index=ignore_index, weight_dtype=weight_dtype)
    red = REDUCTIONS.index(reduction)
    return on(device, [x, w, t, b, ignore_index, red, label_smoothing, normalizer, *grads, chunk_rows])


def backward_inputs(n, h, v, dtype=torch.float32, reduction="none", device="cpu", **kw) -> list:
    """The 13 positional arguments of linear_cross_entropy_backward (grad_loss ~ N(0, 1), or 0.5 for a reduced loss)."""
    args = inputs(n, h, v, dtype, reduction=reduction, device=device, **kw)
    g = torch.Generator().manual_seed(7)
    grad = torch.randn(n, generator=g, dtype=loss_dtype(args[0])) if reduction == "none" else torch.tensor(0.5)
    return [grad.to(device), *args]


def sample_inputs(device="cpu") -> Iterator[Sample]:
    # Small: the Triton interpreter runs each sample; chunk_rows 4 puts several chunks in every one.
    yield Sample("fp32-mean-bias-smoothing", inputs(12, 8, 37, label_smoothing=0.1, chunk_rows=4, device=device))
    # A vocabulary over the Triton kernel's block of 1024 (compile-check compiles what the samples launch).
    yield Sample("bf16-sum-no-bias", inputs(10, 16, 1100, torch.bfloat16, bias=False, reduction="sum",
                                            device=device))
    yield Sample("fp16-all-labeled-frozen-head", inputs(9, 8, 30, torch.float16, labeled=1.0,
                                                        grads=(True, False, False), chunk_rows=4, device=device))
    yield Sample("fp32-none", inputs(11, 8, 33, reduction="none", label_smoothing=0.2, device=device))
    yield Sample("fp32-normalizer-frozen-x", inputs(10, 8, 21, normalizer=40.0, grads=(False, True, True),
                                                    device=device))
    yield Sample("fp64-no-grads-ignore-0", inputs(8, 4, 13, torch.float64, grads=(False, False, False),
                                                  ignore_index=0, device=device))
    yield Sample("fp32-all-ignored", inputs(6, 4, 9, labeled=0.0, reduction="sum", device=device))  # mean: nan
    # fp32 master weights under bf16 x, in chunks of rows and (64 x 768 > 3 x 2^15: ce_vocab_block) in blocks.
    yield Sample("bf16-x-fp32-weight-chunks", inputs(12, 8, 37, torch.bfloat16, chunk_rows=5,
                                                     weight_dtype=torch.float32, device=device))
    yield Sample("bf16-x-fp32-weight-all-labeled", inputs(64, 16, 768, torch.bfloat16, labeled=1.0, bias=False,
                                                          weight_dtype=torch.float32, device=device))


def backward_samples(device="cpu") -> Iterator[Sample]:
    yield Sample("fp32-none", backward_inputs(12, 8, 37, label_smoothing=0.1, chunk_rows=5, device=device))
    yield Sample("bf16-mean-frozen-head", backward_inputs(10, 16, 40, torch.bfloat16, reduction="mean",
                                                          grads=(True, False, True), device=device))
    yield Sample("fp32-sum-no-bias", backward_inputs(9, 8, 30, reduction="sum", bias=False, device=device))
    yield Sample("fp16-x-fp32-weight-none", backward_inputs(10, 8, 33, torch.float16, weight_dtype=torch.float32,
                                                            device=device))


def _bad_cases(device):
    """(case, message, error, change) for the checks both ops share; ``change`` rewrites the forward's arguments."""
    d = inputs(1, 1, 1, device=device)[0].device  # "cuda:0" where the argument says "cuda"
    return [
        ("weight dtype", f"{OP}: weight has dtype torch.float64 but x has torch.float32; weight takes x's dtype, or "
         "float32 where x is bf16/fp16", TypeError, lambda a: a.__setitem__(1, a[1].double())),
        ("fp32 x, bf16 weight", f"{OP}: weight has dtype torch.bfloat16 but x has torch.float32; weight takes x's "
         "dtype, or float32 where x is bf16/fp16", TypeError,
         lambda a: (a.__setitem__(1, a[1].bfloat16()), a.__setitem__(3, a[3].bfloat16()))),
        ("hidden size", f"{OP}: x has hidden size 8 but weight (30, 7) expects 7", ValueError,
         lambda a: a.__setitem__(1, a[1][:, :7])),
        ("bias shape", f"{OP}: bias has shape (3,); expected (30,)", ValueError, lambda a: a.__setitem__(3, a[3][:3])),
        ("bias dtype", f"{OP}: bias has dtype torch.float16 but weight has torch.float32", TypeError,
         lambda a: a.__setitem__(3, a[3].half())),
        ("target shape", f"{OP}: target has shape (5,) but x (10, 8) needs (10,)", ValueError,
         lambda a: a.__setitem__(2, a[2][:5])),
        ("target dtype", f"{OP}: target has dtype torch.float32; expected int64 class indices", TypeError,
         lambda a: a.__setitem__(2, a[2].float())),
        ("integer x", f"{OP}: x has dtype torch.int64; expected a floating dtype", TypeError,
         lambda a: a.__setitem__(0, a[0].long())),
        ("weight not 2-d", f"{OP}: x must be (..., H) and weight (V, H); got x (10, 8), weight (240,)", ValueError,
         lambda a: a.__setitem__(1, a[1].reshape(-1))),
        ("weight on meta", f"{OP}: weight is on meta but x is on {d}", ValueError,
         lambda a: a.__setitem__(1, a[1].to("meta"))),
        ("reduction", f"{OP}: reduction must be 0 (none), 1 (mean) or 2 (sum), got 3", ValueError,
         lambda a: a.__setitem__(5, 3)),
        ("label smoothing", f"{OP}: label_smoothing must be in [0, 1], got 1.5", ValueError,
         lambda a: a.__setitem__(6, 1.5)),
        ("negative normalizer", f"{OP}: normalizer must be a finite number >= 0 (0: the labeled count), got -2.0",
         ValueError, lambda a: a.__setitem__(7, -2.0)),
        ("normalizer with sum", f"{OP}: normalizer divides the mean; reduction='sum' takes none", ValueError,
         lambda a: (a.__setitem__(5, SUM), a.__setitem__(7, 8.0))),
        ("negative chunk_rows", f"{OP}: chunk_rows must be >= 0 (0: the op chooses), got -1", ValueError,
         lambda a: a.__setitem__(11, -1)),
        ("target out of range", f"{OP}: Target 30 is out of bounds (vocabulary 30).", IndexError,
         lambda a: a.__setitem__(2, torch.full_like(a[2], 30))),
        ("negative target", f"{OP}: Target -3 is out of bounds (vocabulary 30).", IndexError,
         lambda a: a.__setitem__(2, torch.full_like(a[2], -3))),
    ]


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    for case, message, error, change in _bad_cases(device):
        args = inputs(10, 8, 30, labeled=0.7, device=device)
        change(args)
        yield BadCall(case, args, error, message, traced=error is not IndexError)


def bad_backward_inputs(device="cpu") -> Iterator[BadCall]:
    for case, message, error, change in _bad_cases(device):
        args = inputs(10, 8, 30, labeled=0.7, reduction="mean", device=device)
        change(args)
        grad = torch.ones(10, device=device) if args[5] == NONE else torch.tensor(1.0, device=device)
        yield BadCall(case, [grad, *args], error, message, traced=error is not IndexError)
    args = inputs(10, 8, 30, reduction="none", device=device)
    yield BadCall("grad_loss shape", [torch.ones(3, device=device), *args], ValueError,
                  f"{OP}: grad_loss has shape (3,); the loss of reduction='none' has shape (10,)")
    yield BadCall("integer grad_loss", [torch.ones(10, dtype=torch.int64, device=device), *args], TypeError,
                  f"{OP}: grad_loss must be a floating tensor")


FORWARD = OpSpec(FORWARD_SCHEMA, check_forward_tensors, check_forward_values, lambda a: fake_forward(*a), sample_inputs,
                 bad_inputs, generated=False)
BACKWARD = OpSpec(BACKWARD_SCHEMA, check_backward_tensors, check_backward_values, lambda a: fake_backward(*a),
                  backward_samples, bad_backward_inputs, generated=False)
