"""The op registry: every ``torch.ops.fastops.*`` op is registered here from its spec (fastops/_specs), which
holds its schema (the one place its arguments are written), its one argument check and its sample inputs.

Backends (``fastops.reference``, ``fastops._C`` for C++ CPU and CUDA, ``fastops.kernels`` for Triton)
implement plain functions taking the op's arguments in the schema's order. This module registers the schemas, the
fake kernels used by ``torch.compile``/``opcheck`` (the spec's check on metadata, so a bad call fails while
tracing), and one dispatcher kernel per device type that runs the op's check once and forwards to the
backend chosen once for that device (see ``fastops._backend``). Backends assume valid input.

Semantics shared by every backend:

``adam_step_``
    One Adam/AdamW step over a list of tensors in one call. ``state_steps`` are float32 0-d tensors on
    the param's device; the op increments them itself, so a skipped step (``found_inf`` != 0) leaves
    params, states *and* step counters untouched, as torch's fused path does. Grads are divided by
    ``grad_scale`` when given and are never written (torch's fused kernels write the unscaled grad
    back; fastops does not, which saves 4 bytes/param). ``master_params`` is empty or one fp32 tensor
    per param: the update runs on the master copy and the rounded value is written to the param in
    the same pass. ``max_exp_avg_sqs`` is empty unless ``amsgrad``. States are fp32 for every param
    dtype. ``lr`` is a 0-d tensor, on the CPU (read on the host) or on the params' device (read in the
    kernel, which is what CUDA-graph capture needs).

``adam_step_lowp_``
    ``adam_step_`` (without amsgrad) on states kept in fewer bytes, their format given by the dtype of
    ``exp_avgs`` (fastops/_quant.py defines both): uint8 codes like the param plus one fp32 absmax per 256
    elements in ``exp_avg_absmax``/``exp_avg_sq_absmax`` ("8bit", bitsandbytes' dynamic maps, nearest
    rounding), or bf16 with stochastic rounding from a counter-based hash of (``seed``, the tensor's index in
    the lists, the element's index), with empty absmax lists. The states are decoded, updated and re-encoded
    in the same pass as the param update, which uses the unrounded fp32 values.

``sgd_step_``
    One SGD step (torch.optim.SGD's update: weight decay, momentum with dampening, nesterov, maximize) over a
    list of tensors in one call. ``momentum_buffers`` is empty when ``momentum == 0``, else one fp32 tensor
    per param; ``is_first_step`` makes the step set ``buf = grad`` (torch's first step) instead of
    ``buf = momentum * buf + (1 - dampening) * grad``. ``master_params``, ``lr``, ``grad_scale`` and
    ``found_inf`` as in ``adam_step_``: a skipped step changes nothing, grads are never written.

``unscale_check_``
    ``grads[i] *= inv_scale`` in place, and ``found_inf`` is set to 1.0 if any element of any grad is
    inf or nan (it is never cleared): the semantics of ``torch._amp_foreach_non_finite_check_and_unscale_``.

``grad_stats``
    One read of all grads. Returns a float32 tensor of shape (3,) on the grads' device:
    ``[sum of (g * inv_scale)^2, max |g| * inv_scale, found_inf]``, accumulated in fp32 (``inv_scale``
    defaults to 1). Grads are unscaled before squaring, so a GradScaler's scale cannot overflow the sum.
    ``found_inf`` comes from the elements as they are, not from the sum overflowing.

``dropout``
    ``F.dropout(x, p, training=True)`` with its mask from a counter-based hash: element k of x's memory is kept when
    the bf16 states' stream under a key of ``seed`` gives it bits >= round(p * 2^32), and is then x times 1/(1-p)
    rounded to x's dtype, else x * 0; the output has x's layout. The same call on the output's gradient is the
    backward (fastops/_specs/dropout.py, fastops/_dropout.py).

``linear_cross_entropy``, ``linear_cross_entropy_backward``
    ``F.cross_entropy(F.linear(x, weight, bias), target)`` and the gradients asked for, without the logits: see
    fastops/_specs/linear_ce.py (fastops/_lce.py adds the autograd rule and the user function).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from . import _backend
from ._specs import SPECS

SCHEMAS = {name: spec.schema for name, spec in SPECS.items()}

# Where the run-time check runs. The float hyperparameters are checked here in Python (a few compares); the tensors,
# where fastops._C loads, by the C++ check (csrc/cpu/checks.cpp: fastops/_checks.py's conditions, order and
# messages): for fastops._C's own backends inside the call that runs the kernel (csrc/generated/op_bindings.h), so
# an op crosses from Python into C++ once; for the Triton and reference backends through fastops._C.checks, then the
# kernel. The Python check runs in the fake kernel (at trace time, once a compile) and at run time only without
# fastops._C. Measured by benchmarks/bench_op_overhead.py (adam_step_, 300 fp32 params, C++ CPU backend, 1 thread,
# thread CPU time, the Xeon of benchmarks/results/op_overhead_cpu*.json): the whole op call took 488 us with 1
# element a param and 820 us with 1000 when the check was a second op (torch.ops.fastops_checks, 246 us a call of
# which ~135 us handing the lists through torch.ops); with the check in the kernel's call, see the after figures
# there. The Python check of the same call: 920-1200 us.
# fastops._C's backends: each op runs its tensor check, its kernel and its version bumps in one C++ call.
_C_BACKENDS = ("cpp", "cuda")


# linear_cross_entropy has no C++ check: its tensor check is the spec's, in Python, for every backend (a few
# compares on four tensors, against a call of milliseconds at least).
def _cpp_check(spec):
    return getattr(_backend._C.checks, spec.name, None) if _backend._C is not None else None


_lib = torch.library.Library("fastops", "DEF")


def _make_kernel(spec, device_type: str):
    name, values, Args, mutated = spec.name, spec.check_values, spec.Args, spec.mutated
    cpp_check = _cpp_check(spec)
    tensors = cpp_check if cpp_check is not None else (lambda *args: spec.check_tensors(Args(*args)))

    def kernel(*args):
        values(Args(*args))
        backend, module = _backend.chosen(device_type)
        if cpp_check is not None and backend in _C_BACKENDS:
            return getattr(module, name)(*args)
        tensors(*args)
        out = getattr(module, name)(*args)
        for i in mutated:
            increment_version(args[i])
        return out

    kernel.__name__ = f"fastops_{name}_{device_type}"
    return kernel


def _make_fallback(spec):
    # Reached with no tensor to dispatch on (grad_stats([])) or a device type no backend serves.
    def fallback(*args):
        spec.check(args)  # a call the op refuses fails with the op's message
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        where = f"{tensors[0].device.type} tensors" if tensors else "a call without tensors"
        raise RuntimeError(f"fastops.{spec.name}: no kernel for {where}; fastops serves {_backend.DEVICE_TYPES}")

    return fallback


for _name, _spec in SPECS.items():
    _lib.define(_spec.schema)
    torch.library.register_fake(f"fastops::{_name}", _spec.fake, lib=_lib)
    for _dev in _backend.DEVICE_TYPES:
        _lib.impl(_name, _make_kernel(_spec, _dev), _dev.upper())
    _lib.impl(_name, _make_fallback(_spec), "CompositeExplicitAutograd")

adam_step_ = torch.ops.fastops.adam_step_.default
adam_step_lowp_ = torch.ops.fastops.adam_step_lowp_.default
sgd_step_ = torch.ops.fastops.sgd_step_.default
unscale_check_ = torch.ops.fastops.unscale_check_.default
grad_stats = torch.ops.fastops.grad_stats.default
