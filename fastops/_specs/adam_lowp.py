"""fastops::adam_step_lowp_: adam_step_ on states kept in 8 bits or bf16 (formats: fastops/_quant.py)."""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _checks as C
from .. import _quant
from .._quant import StateFormat
from .adam import check_values
from .spec import BadCall, OpSpec, Sample, device_name, on, step_bad_calls, with_

SCHEMA = (
    "adam_step_lowp_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] exp_avg_absmax, Tensor(e!)[] exp_avg_sq_absmax, Tensor(f!)[] state_steps, "
    "Tensor(g!)[] master_params, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
    "bool maximize, bool decoupled, SymInt seed, Tensor? grad_scale, Tensor? found_inf) -> ()"
)


def inputs(sizes, fmt=StateFormat.EIGHT_BIT, dtype=torch.float32, master=False, weight_decay=0.0, decoupled=True,
           maximize=False, scale=None, found_inf=None, lr=1e-3, seed=5, shapes=None, gen_seed=0,
           device="cpu"):  # fmt: skip
    """adam_step_lowp_'s arguments (``SPEC.Args``) after a few steps' worth of state: states drawn at the magnitudes
    training reaches (|m| ~ 1e-3, v ~ 1e-6 with a spread over decades), stored in ``fmt`` by _quant. A 2-D entry of
    ``shapes`` makes every tensor of that param transposed (dense, not contiguous)."""
    fmt = StateFormat(fmt)
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
        if fmt is StateFormat.EIGHT_BIT:
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
    args = SPEC.Args(params, grads, ms, vs, ams, avs, steps, masters, None, 0.9, 0.999, 1e-8, weight_decay, maximize,
                     decoupled, seed, scale, found_inf)  # fmt: skip
    return on(device, args)._replace(lr=torch.tensor(lr))


def sample_inputs(device="cpu") -> Iterator[Sample]:
    """One list of cases for parity, opcheck, torch.compile and compile-check: both formats, odd sizes around the
    256-element absmax block, every param dtype, masters, L2 and maximize, grad_scale, transposed params, seeds
    above 32 bits and negative."""
    bf16 = StateFormat.BF16
    yield Sample("8bit fp32 odd sizes", inputs([1, 255, 256, 257, 0, 5000], device=device))
    yield Sample("8bit L2 maximize scaled", inputs([3000, 700], weight_decay=0.1, decoupled=False, maximize=True,
                                                   scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0),
                                                   device=device))  # fmt: skip
    yield Sample("8bit bf16 params", inputs([1000, 33], dtype=torch.bfloat16, weight_decay=0.01, device=device))
    yield Sample("8bit bf16 master", inputs([1000, 33], dtype=torch.bfloat16, master=True, weight_decay=0.01,
                                            device=device))  # fmt: skip
    yield Sample("8bit fp16 params", inputs([600, 7], dtype=torch.float16, maximize=True, device=device))
    yield Sample("8bit transposed", inputs([], shapes=[(40, 30), (700,)], device=device))
    yield Sample("bf16 fp32 odd sizes", inputs([1, 255, 0, 5000], bf16, weight_decay=0.1, decoupled=False,
                                               device=device))  # fmt: skip
    yield Sample("bf16 fp16 master scaled", inputs([900, 3], bf16, torch.float16, master=True, scale=torch.tensor(8.0),
                                                   seed=-3, device=device))  # fmt: skip
    yield Sample("bf16 transposed", inputs([], bf16, shapes=[(40, 30)], seed=2**40 + 1, device=device))


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    dev = device_name(device)
    op = "fastops.adam_step_lowp_"

    def bad(case, message, error=RuntimeError, fmt=StateFormat.EIGHT_BIT, master=False, **changes):
        return BadCall(case, with_(inputs([300, 3], fmt, master=master, device=device), **changes), error, message)

    z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)  # noqa: E731
    yield bad("one exp_avg short", f"{op}: expected 2 exp_avgs (one per param), got 1",
              exp_avgs=lambda a: a.exp_avgs[:1])
    yield from step_bad_calls("adam_step_lowp_", bad, device)
    yield bad("fp32 states", f"{op}: exp_avgs[0] has dtype torch.float32; expected uint8 (8-bit states) or bfloat16",
              exp_avgs=lambda a: [z(300), z(3)])
    yield bad("bf16 exp_avg_sq with uint8 exp_avg", f"{op}: exp_avg_sqs[0] has dtype torch.bfloat16 but must be "
              "torch.uint8 (as params[0])", exp_avg_sqs=lambda a: [c.bfloat16() for c in a.exp_avg_sqs])
    yield bad("state shape", f"{op}: exp_avg_sqs[1] has shape (4,) but params[1] has shape (3,)",
              exp_avg_sqs=lambda a: [a.exp_avg_sqs[0], z(4, dtype=torch.uint8)])
    yield bad("int state step", f"{op}: state_steps[0] must be a float32 tensor with one element",
              state_steps=lambda a: [torch.tensor(1, device=device), a.state_steps[1]])
    if torch.device(device).type != "cpu":
        yield bad("step on the CPU", f"{op}: state_steps[0] is on cpu but params[0] is on {dev}; the kernels read "
                  "each step on the params' device", state_steps=lambda a: [a.state_steps[0].cpu(), a.state_steps[1]])
    yield bad("absmax list short", f"{op}: expected 2 exp_avg_absmax (one per param), got 1",
              exp_avg_absmax=lambda a: a.exp_avg_absmax[:1])
    yield bad("absmax too short", f"{op}: exp_avg_sq_absmax[0] must be a contiguous 1-D float32 tensor of 2 elements "
              f"(one per 256 of params[0]) on {dev}, got torch.float32 of shape (1,) on {dev}",
              exp_avg_sq_absmax=lambda a: [z(1), a.exp_avg_sq_absmax[1]])
    yield bad("absmax given with bf16 states", f"{op}: exp_avg_absmax must be empty with bfloat16 states",
              fmt=StateFormat.BF16, exp_avg_absmax=lambda a: [z(2), z(1)])
    yield bad("beta1 = 1", "Invalid beta parameter at index 0: 1.0", ValueError, beta1=1.0)


SPEC = OpSpec(SCHEMA, C.adam_step_lowp_, check_values, None, sample_inputs, bad_inputs)
