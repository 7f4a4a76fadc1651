"""Pure-PyTorch implementations of every fastops op: the fallback when no compiled backend loads, and
the oracle the other backends are tested against. Written for clarity, not speed; they read
``found_inf``/``lr`` on the host, so they sync on CUDA.

For fp32 params the Adam step uses the same operations in the same order as torch.optim.Adam's
for-loop implementation (``foreach=False``), so the two agree bit for bit."""

from __future__ import annotations

import math

import torch

from . import _quant
from ._util import round_fp32


def _step_lr(params, lr, grad_scale, found_inf):
    """The step's lr as a float; None when there is nothing to do (no params, or found_inf set: a skipped step
    writes nothing)."""
    if not params:
        return None
    if found_inf is not None and found_inf.item() != 0:
        return None
    return float(lr.item())


def _fp32_param_and_grad(param, master, grad, grad_scale):
    """What the update runs on: the fp32 master (or the param itself, or an fp32 copy written back after) and
    the fp32 grad divided by grad_scale."""
    p = master if master is not None else (param if param.dtype == torch.float32 else param.float())
    g = grad if grad.dtype == torch.float32 else grad.float()
    if grad_scale is not None:
        g = g / grad_scale.to(g.device)
    return p, g


def _adam_update(p, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, maximize,
                 decoupled, inv_bc2=False):  # fmt: skip
    """One Adam step on fp32 tensors, in place: torch.optim.Adam's for-loop operations in its order. Every state
    format runs this update (low-precision states decoded to fp32 before it, encoded after).

    inv_bc2 (bf16 states): sqrt(v) is multiplied by the fp32 reciprocal of the fp32 sqrt(bias_correction2) instead of
    divided by it, one rounding more (a relative 2^-24 in the denominator, far under the state's own 2^-9). It
    takes one of the update's three divider operations away, for the AVX2 step, which is bound by its instructions,
    not memory. Measured on Emerald Rapids, 16M / 24M params, one run each: at the avx2 level 1.16x / 1.14x torch's
    fused=True before, 1.18x / 1.16x after at 1 thread, 1.01x / 1.14x and 1.08x / 1.21x at 2; at AVX-512 no change
    beyond the runs' noise (1.30x / 1.31x, then 1.29x / 1.29x at 1 thread)."""
    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(p, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = math.sqrt(bias_correction2)
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        root = max_exp_avg_sq.sqrt()
    else:
        root = exp_avg_sq.sqrt()
    if inv_bc2:
        # 1 / x in fp64 rounded to fp32 is the fp32 division's result: fp64 holds more than 2 * 24 + 2 bits.
        denom = (root * round_fp32(1 / round_fp32(bias_correction2_sqrt))).add_(eps)
    else:
        denom = (root / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)


def _adam_steps(params, grads, state_steps, master_params, lr, grad_scale, found_inf, states, store, **hyper):
    """The per-tensor loop of both Adam ops: ``states(i)`` gives tensor i's fp32 (exp_avg, exp_avg_sq,
    max_exp_avg_sq or None) to update in place, ``store(i, exp_avg, exp_avg_sq)`` writes them back after."""
    lr = _step_lr(params, lr, grad_scale, found_inf)
    if lr is None:
        return
    for i, param in enumerate(params):
        step_t = state_steps[i]
        step_t += 1
        p, grad = _fp32_param_and_grad(param, master_params[i] if master_params else None, grads[i], grad_scale)
        exp_avg, exp_avg_sq, max_exp_avg_sq = states(i)
        _adam_update(p, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step_t.item(), lr, **hyper)
        if p is not param:
            param.copy_(p)
        store(i, exp_avg, exp_avg_sq)


@torch.no_grad()
def adam_step_(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
):  # fmt: skip
    _adam_steps(
        params, grads, state_steps, master_params, lr, grad_scale, found_inf,
        lambda i: (exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i] if amsgrad else None), lambda *_: None,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize, decoupled=decoupled,
    )  # fmt: skip


@torch.no_grad()
def adam_step_lowp_(
    params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, maximize, decoupled, seed, grad_scale, found_inf,
):  # fmt: skip
    # adam_step_'s update on states decoded to fp32, written back in their low-precision format (fastops/_quant.py).
    eight_bit = _quant.StateFormat.of(exp_avgs) is _quant.StateFormat.EIGHT_BIT

    def decode(i):
        if eight_bit:
            return (_quant.dequantize(exp_avgs[i], exp_avg_absmax[i], signed=True),
                    _quant.dequantize(exp_avg_sqs[i], exp_avg_sq_absmax[i], signed=False), None)  # fmt: skip
        return exp_avgs[i].float(), exp_avg_sqs[i].float(), None

    def encode(i, exp_avg, exp_avg_sq):
        if eight_bit:
            _quant.quantize(exp_avg, True, exp_avgs[i], exp_avg_absmax[i])
            _quant.quantize(exp_avg_sq, False, exp_avg_sqs[i], exp_avg_sq_absmax[i])
        elif params[i].numel():
            bits = _quant.sr_bits(_quant.sr_key(seed, i), params[i].numel(), params[i].device)
            for state, new, rand in ((exp_avgs[i], exp_avg, bits & 0xFFFF), (exp_avg_sqs[i], exp_avg_sq, bits >> 16)):
                _quant.memory_flat(state).copy_(_quant.round_bf16_stochastic(_quant.memory_flat(new), rand))

    _adam_steps(
        params, grads, state_steps, master_params, lr, grad_scale, found_inf, decode, encode,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize, decoupled=decoupled,
        inv_bc2=not eight_bit,
    )  # fmt: skip


@torch.no_grad()
def sgd_step_(
    params, grads, momentum_buffers, master_params, lr, weight_decay, momentum, dampening, nesterov, maximize,
    is_first_step, grad_scale, found_inf,
):  # fmt: skip
    # For fp32 params: the operations of torch.optim.SGD's for-loop implementation, in its order.
    lr = _step_lr(params, lr, grad_scale, found_inf)
    if lr is None:
        return
    for i, param in enumerate(params):
        p, grad = _fp32_param_and_grad(param, master_params[i] if master_params else None, grads[i], grad_scale)
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if is_first_step:
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        p.add_(grad, alpha=-lr)
        if p is not param:
            param.copy_(p)


@torch.no_grad()
def unscale_check_(grads, found_inf, inv_scale):
    if not grads:
        return
    for g in grads:
        if g.numel() and not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        # fp16/bf16 grads are scaled in fp32 and rounded once, as torch's AMP kernel does.
        g.copy_(g.float() * inv_scale.to(g.device))


@torch.no_grad()
def grad_stats(grads, inv_scale=None):
    device = grads[0].device
    if inv_scale is not None:
        inv = inv_scale.to(device=device, dtype=torch.float32).reshape(())
    out = torch.zeros(3, dtype=torch.float32, device=device)
    for g in grads:
        if g.numel() == 0:
            continue
        g32 = g.float()
        finite = torch.isfinite(g32).all()
        # Unscaled before squaring: a scaled fp32 grad above 1.8e19 would square to inf.
        u = g32 if inv_scale is None else g32 * inv
        out[0] += u.square().sum()
        out[1] = torch.maximum(out[1], u.abs().max())
        out[2] = torch.maximum(out[2], (~finite).float())
    return out


def linear_cross_entropy(*args):
    """fastops/_specs/linear_ce.py's op, chunked, its row pass in torch ops (fastops/_lce.py)."""
    from ._lce import reference_forward

    return reference_forward(*args)


def linear_cross_entropy_backward(*args):
    from ._lce import reference_backward

    return reference_backward(*args)


def dropout(x, p, seed):
    """fastops/_specs/dropout.py's op in torch ops: the mask from _quant.sr_bits, x times the scale or 0 in fp32."""
    from ._specs.dropout import constants

    key, threshold, scale = constants(p, seed, x.dtype)
    out = torch.empty_like(x)
    if x.numel():
        keep = _quant.sr_bits(key, x.numel(), x.device) >= threshold
        factor = torch.where(keep, scale, 0.0).to(torch.float32)
        _quant.memory_flat(out).copy_(_quant.memory_flat(x).float() * factor)
    return out
