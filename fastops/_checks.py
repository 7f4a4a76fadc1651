"""The conditions and messages of the ops' argument checks. Each op's spec (fastops/_specs) runs them once, at the
op boundary (its fake kernel and its dispatcher kernel), so a bad call fails with the same message on every
backend. The ``*_ok`` functions test a whole list at once and say only whether it passes: the fast path of a
valid call; the ``check_*`` functions find the first problem and raise with its message.

csrc/cpu/checks.cpp is the C++ twin (same conditions, order and messages): where fastops._C loads, the dispatcher
kernel runs it instead of these at run time, 5x cheaper at 300 params (fastops/_ops.py has the figures)."""

from __future__ import annotations

import torch

# The param and grad dtypes every fastops kernel takes; optim, amp and the compile check use this one tuple.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def dense_ok(ts) -> bool:
    """Every tensor of ``ts`` strided and dense (check_dense passes; complex is left to the dtype tests)."""
    strided = torch.strided
    return all(t.layout == strided and (t.is_contiguous() or is_dense(t)) for t in ts)


def like_ok(ts, refs, dtype: torch.dtype | None = None) -> bool:
    """check_like(ts[i], refs[i], ..., dtype) passes for every i (the lengths are the caller's to test)."""
    strided = torch.strided
    if dtype is None:
        return all(t.layout == strided and t.shape == r.shape and t.dtype == r.dtype and t.device == r.device
                   and (t.numel() <= 1 or t.stride() == r.stride()) for t, r in zip(ts, refs))  # fmt: skip
    return all(t.layout == strided and t.shape == r.shape and t.dtype == dtype and t.device == r.device
               and (t.numel() <= 1 or t.stride() == r.stride()) for t, r in zip(ts, refs))  # fmt: skip


def floats_ok(ts) -> bool:
    """Every tensor of ``ts`` dense, of a FLOAT_DTYPES dtype, and on ``ts[0]``'s device."""
    if not ts:
        return True
    device = ts[0].device
    return dense_ok(ts) and all(t.dtype in FLOAT_DTYPES and t.device == device for t in ts)


def steps_ok(steps) -> bool:
    f32 = torch.float32
    return all(s.dtype == f32 and s.numel() == 1 for s in steps)


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


def _check_per_param(op: str, params, grads, lists: dict, fp32_states: tuple) -> None:
    """One tensor of each list in ``lists`` per param; params dense floating tensors on one device; grads
    like their params; the lists named in ``fp32_states`` (those present in ``lists``) fp32 tensors like
    their params."""
    n = len(params)
    for name, lst in lists.items():
        if len(lst) != n:
            raise RuntimeError(f"fastops.{op}: expected {n} {name} (one per param), got {len(lst)}")
    for i, p in enumerate(params):
        check_dense(p, f"params[{i}]")
        if p.dtype not in FLOAT_DTYPES:
            raise RuntimeError(f"fastops.{op}: params[{i}] has dtype {p.dtype}; expected float32, bfloat16 or float16")
        if p.device != params[0].device:
            raise RuntimeError(f"fastops.{op}: params[{i}] is on {p.device} but params[0] is on {params[0].device}")
        check_dense(grads[i], f"grads[{i}]")
        check_like(grads[i], p, f"grads[{i}]", f"params[{i}]", None)
        for name in fp32_states:
            if name in lists:
                check_like(lists[name][i], p, f"{name}[{i}]", f"params[{i}]", torch.float32)


def check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, amsgrad) -> None:
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "state_steps": state_steps}
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    elif len(max_exp_avg_sqs):
        raise RuntimeError("fastops.adam_step_: max_exp_avg_sqs must be empty when amsgrad=False")
    if len(master_params):
        lists["master_params"] = master_params
    _check_per_param("adam_step_", params, grads, lists, ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"))
    for i, s in enumerate(state_steps):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise RuntimeError(f"fastops.adam_step_: state_steps[{i}] must be a float32 tensor with one element")


def check_adam_lowp_args(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps,
                         master_params) -> str:
    """The checks of ``adam_step_lowp_``; returns its mode, "8bit" (uint8 states) or "bf16"."""
    op = "fastops.adam_step_lowp_"
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "state_steps": state_steps}
    if len(master_params):
        lists["master_params"] = master_params
    _check_per_param("adam_step_lowp_", params, grads, lists, ("master_params",))
    state_dtype = exp_avgs[0].dtype if len(exp_avgs) else torch.uint8
    if state_dtype not in (torch.uint8, torch.bfloat16):
        raise RuntimeError(f"{op}: exp_avgs[0] has dtype {state_dtype}; expected uint8 (8-bit states) or bfloat16")
    mode = "8bit" if state_dtype == torch.uint8 else "bf16"
    for name in ("exp_avgs", "exp_avg_sqs"):
        for i, t in enumerate(lists[name]):
            check_like(t, params[i], f"{name}[{i}]", f"params[{i}]", state_dtype, prefix=f"{op}: ")
    for i, s in enumerate(state_steps):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise RuntimeError(f"{op}: state_steps[{i}] must be a float32 tensor with one element")
    for name, lst in (("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
        if mode == "bf16":
            if len(lst):
                raise RuntimeError(f"{op}: {name} must be empty with bfloat16 states")
            continue
        if len(lst) != len(params):
            raise RuntimeError(f"{op}: expected {len(params)} {name} (one per param), got {len(lst)}")
        for i, a in enumerate(lst):
            blocks = (params[i].numel() + 255) // 256
            if a.dtype != torch.float32 or a.device != params[i].device or a.dim() != 1 or a.numel() != blocks or not a.is_contiguous():
                raise RuntimeError(
                    f"{op}: {name}[{i}] must be a contiguous 1-D float32 tensor of {blocks} elements (one per 256 "
                    f"of params[{i}]) on {params[i].device}, got {a.dtype} of shape {tuple(a.shape)} on {a.device}"
                )
    return mode


def check_sgd_args(params, grads, momentum_buffers, master_params, momentum) -> None:
    lists = {"grads": grads}
    if momentum != 0:
        lists["momentum_buffers"] = momentum_buffers
    elif len(momentum_buffers):
        raise RuntimeError("fastops.sgd_step_: momentum_buffers must be empty when momentum=0")
    if len(master_params):
        lists["master_params"] = master_params
    _check_per_param("sgd_step_", params, grads, lists, ("momentum_buffers", "master_params"))


def check_grads(grads, op: str) -> None:
    for i, g in enumerate(grads):
        check_dense(g, f"grads[{i}]")
        if g.dtype not in FLOAT_DTYPES:
            raise RuntimeError(f"fastops.{op}: grads[{i}] has dtype {g.dtype}; expected float32, bfloat16 or float16")
        if g.device != grads[0].device:
            raise RuntimeError(f"fastops.{op}: grads[{i}] is on {g.device} but grads[0] is on {grads[0].device}")


def check_scalar(t: torch.Tensor, op: str, what: str, device: torch.device) -> None:
    """A one-element floating tensor on ``device`` or the CPU (kernels read it through a pointer or on the host)."""
    if t.numel() != 1 or not t.is_floating_point():
        raise RuntimeError(
            f"fastops.{op}: {what} must be a floating tensor with one element, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.device != device and t.device.type != "cpu":
        raise RuntimeError(f"fastops.{op}: {what} is on {t.device} but the tensors are on {device}; pass it on {device} or the CPU")


def check_found_inf(found_inf: torch.Tensor, op: str, device: torch.device) -> None:
    """One float32 element on ``device``: the kernels write 1.0 into it."""
    if found_inf.numel() != 1 or found_inf.dtype != torch.float32 or found_inf.device != device:
        raise RuntimeError(
            f"fastops.{op}: found_inf must be one float32 element on {device} (the kernel writes it), "
            f"got {found_inf.dtype} of shape {tuple(found_inf.shape)} on {found_inf.device}"
        )
