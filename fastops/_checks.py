"""The ops' argument checks: each condition and its message, once in Python. csrc/cpu/checks.cpp is the C++ twin,
the same conditions in the same order with the same messages (tests/test_bad_input.py holds both to the messages
the specs list, the C++ one at run time and this one while tracing).

The per-op checks (``adam_step_``, ``adam_step_lowp_``, ``sgd_step_``, ``unscale_check_``, ``grad_stats``, ``dropout``)
take the op's ``Args`` record (fastops/_specs) and raise RuntimeError with the first problem: list lengths, then per
param its layout, dtype and device, its grad and states, then the tensor scalars. The hyperparameter checks
(``nonnegative``, ``beta``) raise ValueError with torch.optim's constructor wording. Each op's spec says which run.

This is what the fake kernel runs on metadata (paid once per trace) and what runs at each call where fastops._C does
not load; elsewhere the C++ twin runs, in the call that runs the kernel (fastops/_ops.py has the figures)."""

from __future__ import annotations

import torch

from ._quant import BLOCK, StateFormat

# The param and grad dtypes every fastops kernel takes; optim, amp and the compile check use this one tuple.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOATS = "float32, bfloat16 or float16"


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one block of memory, in any dimension order
    (contiguous, channels_last, transposed). The kernels walk that block flat."""
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def check_dense(t: torch.Tensor, what: str) -> None:
    if t.is_sparse or t.layout != torch.strided:
        raise RuntimeError(f"fastops: {what} is sparse; only dense (strided) tensors are supported")
    if t.is_complex():
        raise RuntimeError(f"fastops: {what} is complex; complex tensors are not supported")
    if not is_dense(t):
        raise RuntimeError(
            f"fastops: {what} is not contiguous (its memory is strided with gaps or overlaps); "
            "fused kernels walk the tensor's memory as one block"
        )


def check_like(
    t: torch.Tensor, ref: torch.Tensor, what: str, ref_what: str, dtype: torch.dtype | None,
    *, prefix: str = "fastops: ", strides: bool = True,
) -> None:  # fmt: skip
    """``t`` has ``ref``'s shape, device and dtype (or ``dtype``), and its strides unless ``strides=False``
    (a caller that copies ``t`` into ``ref``'s layout). ``prefix`` starts each message."""
    if t.shape != ref.shape:
        raise RuntimeError(f"{prefix}{what} has shape {tuple(t.shape)} but {ref_what} has shape {tuple(ref.shape)}")
    want = ref.dtype if dtype is None else dtype
    if t.dtype != want:
        raise RuntimeError(f"{prefix}{what} has dtype {t.dtype} but must be {want} (as {ref_what})")
    if t.device != ref.device:
        raise RuntimeError(f"{prefix}{what} is on {t.device} but {ref_what} is on {ref.device}")
    if strides and t.numel() > 1 and t.stride() != ref.stride():
        raise RuntimeError(f"{prefix}{what} has strides {t.stride()} but {ref_what} has strides {ref.stride()}")


def _floats(ts, name: str, op: str) -> None:
    """Every tensor of ``ts`` dense, of a FLOAT_DTYPES dtype, and on ``ts[0]``'s device."""
    for i, t in enumerate(ts):
        check_dense(t, f"{name}[{i}]")
        if t.dtype not in FLOAT_DTYPES:
            raise RuntimeError(f"fastops.{op}: {name}[{i}] has dtype {t.dtype}; expected {_FLOATS}")
        if t.device != ts[0].device:
            raise RuntimeError(f"fastops.{op}: {name}[{i}] is on {t.device} but {name}[0] is on {ts[0].device}")


def _per_param(op: str, params, grads, lists: dict, fp32_states: tuple) -> None:
    """One tensor of each list in ``lists`` per param; params dense floating tensors on one device; grads like their
    params; the lists named in ``fp32_states`` (those present in ``lists``) fp32 tensors like their params."""
    n = len(params)
    for name, lst in lists.items():
        if len(lst) != n:
            raise RuntimeError(f"fastops.{op}: expected {n} {name} (one per param), got {len(lst)}")
    _floats(params, "params", op)
    for i, p in enumerate(params):
        check_dense(grads[i], f"grads[{i}]")
        check_like(grads[i], p, f"grads[{i}]", f"params[{i}]", None)
        for name in fp32_states:
            if name in lists:
                check_like(lists[name][i], p, f"{name}[{i}]", f"params[{i}]", torch.float32)


def _steps(op: str, steps, params) -> None:
    """One float32 element each, on the params' device: the kernels bump and read them there."""
    for i, s in enumerate(steps):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise RuntimeError(f"fastops.{op}: state_steps[{i}] must be a float32 tensor with one element")
        if s.device != params[0].device:
            raise RuntimeError(f"fastops.{op}: state_steps[{i}] is on {s.device} but params[0] is on "
                               f"{params[0].device}; the kernels read each step on the params' device")  # fmt: skip


def check_scalar(t: torch.Tensor | None, op: str, what: str, device: torch.device) -> None:
    """None, or a one-element floating tensor on ``device`` or the CPU (kernels read it through a pointer or on the
    host)."""
    if t is None:
        return
    if t.numel() != 1 or not t.is_floating_point():
        raise RuntimeError(
            f"fastops.{op}: {what} must be a floating tensor with one element, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.device != device and t.device.type != "cpu":
        raise RuntimeError(f"fastops.{op}: {what} is on {t.device} but the tensors are on {device}; pass it on "
                           f"{device} or the CPU")


def _step_scalars(op: str, a) -> None:
    if len(a.params):
        for what in ("lr", "grad_scale", "found_inf"):
            check_scalar(getattr(a, what), op, what, a.params[0].device)


def adam_step_(a) -> None:
    op = "adam_step_"
    if not a.amsgrad and len(a.max_exp_avg_sqs):
        raise RuntimeError("fastops.adam_step_: max_exp_avg_sqs must be empty when amsgrad=False")
    lists = {"grads": a.grads, "exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs, "state_steps": a.state_steps}
    if a.amsgrad:
        lists["max_exp_avg_sqs"] = a.max_exp_avg_sqs
    if len(a.master_params):
        lists["master_params"] = a.master_params
    _per_param(op, a.params, a.grads, lists, ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"))
    _steps(op, a.state_steps, a.params)
    _step_scalars(op, a)


def adam_step_lowp_(a) -> None:
    op, prefix = "adam_step_lowp_", "fastops.adam_step_lowp_: "
    lists = {"grads": a.grads, "exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs, "state_steps": a.state_steps}
    if len(a.master_params):
        lists["master_params"] = a.master_params
    _per_param(op, a.params, a.grads, lists, ("master_params",))
    fmt = StateFormat.of(a.exp_avgs)
    if fmt not in (StateFormat.EIGHT_BIT, StateFormat.BF16):
        raise RuntimeError(f"{prefix}exp_avgs[0] has dtype {a.exp_avgs[0].dtype}; expected uint8 (8-bit states) or "
                           "bfloat16")  # fmt: skip
    for name in ("exp_avgs", "exp_avg_sqs"):
        for i, t in enumerate(lists[name]):
            check_like(t, a.params[i], f"{name}[{i}]", f"params[{i}]", fmt.dtype, prefix=prefix)
    _steps(op, a.state_steps, a.params)
    for name in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        lst = getattr(a, name)
        if fmt is StateFormat.BF16:
            if len(lst):
                raise RuntimeError(f"{prefix}{name} must be empty with bfloat16 states")
            continue
        if len(lst) != len(a.params):
            raise RuntimeError(f"{prefix}expected {len(a.params)} {name} (one per param), got {len(lst)}")
        for i, (t, p) in enumerate(zip(lst, a.params)):
            blocks = (p.numel() + BLOCK - 1) // BLOCK
            if (t.dtype != torch.float32 or t.device != p.device or t.dim() != 1 or t.numel() != blocks
                    or not t.is_contiguous()):  # fmt: skip
                raise RuntimeError(
                    f"{prefix}{name}[{i}] must be a contiguous 1-D float32 tensor of {blocks} elements (one per 256 "
                    f"of params[{i}]) on {p.device}, got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
                )
    _step_scalars(op, a)


def sgd_step_(a) -> None:
    op = "sgd_step_"
    if a.momentum == 0 and len(a.momentum_buffers):
        raise RuntimeError("fastops.sgd_step_: momentum_buffers must be empty when momentum=0")
    lists = {"grads": a.grads}
    if a.momentum != 0:
        lists["momentum_buffers"] = a.momentum_buffers
    if len(a.master_params):
        lists["master_params"] = a.master_params
    _per_param(op, a.params, a.grads, lists, ("momentum_buffers", "master_params"))
    _step_scalars(op, a)


def unscale_check_(a) -> None:
    op = "unscale_check_"
    _floats(a.grads, "grads", op)
    if not len(a.grads):
        return
    device, found_inf = a.grads[0].device, a.found_inf
    if found_inf.numel() != 1 or found_inf.dtype != torch.float32 or found_inf.device != device:
        # The kernels write 1.0 into it.
        raise RuntimeError(
            f"fastops.{op}: found_inf must be one float32 element on {device} (the kernel writes it), "
            f"got {found_inf.dtype} of shape {tuple(found_inf.shape)} on {found_inf.device}"
        )
    check_scalar(a.inv_scale, op, "inv_scale", device)


def grad_stats(a) -> None:
    op = "grad_stats"
    if not len(a.grads):
        raise RuntimeError(f"fastops.{op}: needs at least one tensor")
    _floats(a.grads, "grads", op)
    check_scalar(a.inv_scale, op, "inv_scale", a.grads[0].device)


def dropout(a) -> None:
    check_dense(a.x, "x")
    if a.x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"fastops.dropout: x has dtype {a.x.dtype}; expected {_FLOATS}")


def nonnegative(value: float, what: str) -> None:
    """torch.optim's constructor rule and wording ("Invalid epsilon value: -1e-08"); nan fails."""
    if not 0.0 <= value:
        raise ValueError(f"Invalid {what}: {value}")


def beta(value: float, index: int) -> None:
    # beta = 1 makes the bias correction 1 - 1**t = 0: nan params (torch's constructor rule, [0, 1)).
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid beta parameter at index {index}: {value}")
