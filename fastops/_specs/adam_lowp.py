"""fastops::adam_step_lowp_: adam_step_ on states kept in 8 bits or bf16 (formats: fastops/_quant.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .. import _quant
from .adam import hyperparameters
from .spec import BadCall, OpSpec, Sample, check_problem, on, scalars

SCHEMA = (
    "adam_step_lowp_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] exp_avg_absmax, Tensor(e!)[] exp_avg_sq_absmax, Tensor(f!)[] state_steps, "
    "Tensor(g!)[] master_params, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
    "bool maximize, bool decoupled, SymInt seed, Tensor? grad_scale, Tensor? found_inf) -> ()"
)


def _absmax_ok(absmax, params) -> bool:
    f32 = torch.float32
    return all(a.dtype == f32 and a.device == p.device and a.dim() == 1 and a.numel() == (p.numel() + 255) // 256
               and a.is_contiguous() for a, p in zip(absmax, params))  # fmt: skip


def check_tensors(args) -> None:
    (params, grads, exp_avgs, exp_avg_sqs, m_absmax, v_absmax, steps, masters, lr, _beta1, _beta2, _eps, _wd,
     _maximize, _decoupled, _seed, grad_scale, found_inf) = args  # fmt: skip
    n = len(params)
    state = exp_avgs[0].dtype if len(exp_avgs) else torch.uint8
    n_absmax = n if state == torch.uint8 else 0
    ok = (
        len(grads) == n and len(exp_avgs) == n and len(exp_avg_sqs) == n and len(steps) == n
        and len(masters) in (0, n) and len(m_absmax) == n_absmax and len(v_absmax) == n_absmax
        and state in (torch.uint8, torch.bfloat16)
        and C.floats_ok(params) and C.like_ok(grads, params) and C.like_ok(masters, params, torch.float32)
        and C.like_ok(exp_avgs, params, state) and C.like_ok(exp_avg_sqs, params, state) and C.steps_ok(steps)
        and _absmax_ok(m_absmax, params) and _absmax_ok(v_absmax, params)
    )  # fmt: skip
    check_problem(ok, lambda: C.check_adam_lowp_args(params, grads, exp_avgs, exp_avg_sqs, m_absmax, v_absmax, steps,
                                                     masters))  # fmt: skip
    device = params[0].device if n else None
    scalars("adam_step_lowp_", device, (("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)))


def check_values(args) -> None:
    hyperparameters(*args[9:13])


def inputs(sizes, mode="8bit", dtype=torch.float32, master=False, weight_decay=0.0, decoupled=True, maximize=False,
           scale=None, found_inf=None, lr=1e-3, seed=5, shapes=None, gen_seed=0, device="cpu") -> list:  # fmt: skip
    """The 18 positional arguments of adam_step_lowp_ after a few steps' worth of state: states drawn at the
    magnitudes training reaches (|m| ~ 1e-3, v ~ 1e-6 with a spread over decades), quantized by _quant. A 2-D
    entry of ``shapes`` makes every tensor of that param transposed (dense, not contiguous)."""
    g = torch.Generator().manual_seed(gen_seed)
    shapes = shapes or [(n,) for n in sizes]
    params, grads, ms, vs, ams, avs, steps, masters = [], [], [], [], [], [], [], []
    for i, shape in enumerate(shapes):
        transposed = len(shape) == 2
        make = (lambda *s: torch.empty(*reversed(s)).t()) if transposed else (lambda *s: torch.empty(*s))
        p32 = make(*shape).copy_(torch.randn(shape, generator=g))
        grad = make(*shape).copy_(torch.randn(shape, generator=g) * 1e-2).to(dtype)
        m0 = make(*shape).copy_(torch.randn(shape, generator=g) * 1e-3 * torch.rand(shape, generator=g) ** 4)
        v0 = make(*shape).copy_(torch.rand(shape, generator=g) ** 6 * 1e-6)
        if mode == "8bit":
            cm, am = _quant.quantize(m0, True)
            cv, av = _quant.quantize(v0, False)
            ms.append(cm), vs.append(cv), ams.append(am), avs.append(av)
        else:
            ms.append(m0.bfloat16()), vs.append(v0.bfloat16())
        params.append(p32.to(dtype))
        grads.append(grad)
        steps.append(torch.tensor(float(3 + i)))
        if master:
            masters.append(p32.clone())
    # .to(device) keeps a transposed tensor's strides (preserve_format on a dense tensor).
    args = on(device, [params, grads, ms, vs, ams, avs, steps, masters, None, 0.9, 0.999, 1e-8, weight_decay,
                       maximize, decoupled, seed, scale, found_inf])  # fmt: skip
    args[8] = torch.tensor(lr)
    return args


def sample_inputs(device="cpu") -> Iterator[Sample]:
    """One list of cases for parity, opcheck, torch.compile and compile-check: both formats, odd sizes around the
    256-element absmax block, every param dtype, masters, L2 and maximize, grad_scale, transposed params, seeds
    above 32 bits and negative."""
    yield Sample("8bit fp32 odd sizes", inputs([1, 255, 256, 257, 0, 5000], device=device))
    yield Sample("8bit L2 maximize scaled", inputs([3000, 700], weight_decay=0.1, decoupled=False, maximize=True,
                                                   scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0),
                                                   device=device))  # fmt: skip
    yield Sample("8bit bf16 params", inputs([1000, 33], dtype=torch.bfloat16, weight_decay=0.01, device=device))
    yield Sample("8bit bf16 master", inputs([1000, 33], dtype=torch.bfloat16, master=True, weight_decay=0.01,
                                            device=device))  # fmt: skip
    yield Sample("8bit fp16 params", inputs([600, 7], dtype=torch.float16, maximize=True, device=device))
    yield Sample("8bit transposed", inputs([], shapes=[(40, 30), (700,)], device=device))
    yield Sample("bf16 fp32 odd sizes", inputs([1, 255, 0, 5000], mode="bf16", weight_decay=0.1, decoupled=False,
                                               device=device))  # fmt: skip
    yield Sample("bf16 fp16 master scaled", inputs([900, 3], mode="bf16", dtype=torch.float16, master=True,
                                                   scale=torch.tensor(8.0), seed=-3, device=device))  # fmt: skip
    yield Sample("bf16 transposed", inputs([], mode="bf16", shapes=[(40, 30)], seed=2**40 + 1, device=device))


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    dev = str(torch.empty(0, device=device).device)  # "cuda:0", as the messages print it
    op = "fastops.adam_step_lowp_"

    def bad(case, message, i, value, error=RuntimeError, **kw):
        args = inputs([300, 3], device=device, **kw)
        args[i] = value(args) if callable(value) else value
        return BadCall(case, args, error, message)

    z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)  # noqa: E731
    yield bad("one exp_avg short", f"{op}: expected 2 exp_avgs (one per param), got 1", 2, lambda a: a[2][:1])
    yield bad("one master short", f"{op}: expected 2 master_params (one per param), got 1", 7, lambda a: a[7][:1],
              master=True)
    yield bad("fp16 grad for fp32 param", "fastops: grads[0] has dtype torch.float16 but must be torch.float32 "
              "(as params[0])", 1, lambda a: [a[1][0].half(), a[1][1]])
    yield bad("int param", f"{op}: params[0] has dtype torch.int32; expected float32, bfloat16 or float16", 0,
              lambda a: [z(300, dtype=torch.int32), a[0][1]])
    yield bad("gapped param", "fastops: params[0] is not contiguous (its memory is strided with gaps or overlaps); "
              "fused kernels walk the tensor's memory as one block", 0, lambda a: [z(600)[::2], a[0][1]])
    yield bad("fp32 states", f"{op}: exp_avgs[0] has dtype torch.float32; expected uint8 (8-bit states) or bfloat16",
              2, lambda a: [z(300), z(3)])
    yield bad("bf16 exp_avg_sq with uint8 exp_avg", f"{op}: exp_avg_sqs[0] has dtype torch.bfloat16 but must be "
              "torch.uint8 (as params[0])", 3, lambda a: [c.bfloat16() for c in a[3]])
    yield bad("state shape", f"{op}: exp_avg_sqs[1] has shape (4,) but params[1] has shape (3,)", 3,
              lambda a: [a[3][0], z(4, dtype=torch.uint8)])
    yield bad("fp16 master", "fastops: master_params[0] has dtype torch.float16 but must be torch.float32 "
              "(as params[0])", 7, lambda a: [m.half() for m in a[7]], master=True)
    yield bad("int state step", f"{op}: state_steps[0] must be a float32 tensor with one element", 6,
              lambda a: [torch.tensor(1, device=device), a[6][1]])
    yield bad("absmax list short", f"{op}: expected 2 exp_avg_absmax (one per param), got 1", 4, lambda a: a[4][:1])
    yield bad("absmax too short", f"{op}: exp_avg_sq_absmax[0] must be a contiguous 1-D float32 tensor of 2 elements "
              f"(one per 256 of params[0]) on {dev}, got torch.float32 of shape (1,) on {dev}", 5,
              lambda a: [z(1), a[5][1]])
    yield bad("absmax given with bf16 states", f"{op}: exp_avg_absmax must be empty with bfloat16 states", 4,
              lambda a: [z(2), z(1)], mode="bf16")
    yield bad("lr with two elements", f"{op}: lr must be a floating tensor with one element, got torch.float32 of "
              "shape (2,)", 8, torch.tensor([0.1, 0.1]))
    yield bad("integer grad_scale", f"{op}: grad_scale must be a floating tensor with one element, got torch.int64 of "
              "shape ()", 16, torch.tensor(2))
    yield bad("beta1 = 1", "Invalid beta parameter at index 0: 1.0", 9, 1.0, ValueError)


SPEC = OpSpec("adam_step_lowp_", SCHEMA, (0, 2, 3, 4, 5, 6, 7), check_tensors, check_values, None, sample_inputs, bad_inputs)
