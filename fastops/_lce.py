"""``torch.ops.fastops.linear_cross_entropy``: ``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` and its
gradients without ever holding the N x V logits.

Rows whose target is ``ignore_index`` are dropped (index_select) before any matmul. The labeled rows go through
the vocabulary in chunks of rows; a chunk's logits are one matmul (in the inputs' dtype, as ``F.linear`` rounds
them), then one row pass computes in fp32 the log-sum-exp, the loss and, in place, the logits' gradient, which
two more matmuls turn into the chunk's grad_x rows and its share of grad_weight (accumulated in fp32).

When a gradient is wanted and the reduction is mean or sum, the forward computes the gradients in the same chunk
pass (as Liger does) and the backward only scales them by the incoming scalar: three matmuls of N x V x H
instead of four (forward, recompute, two grads), and what is held from forward to backward is grad_x and
grad_weight in the params' dtype, the size of the params themselves. ``reduction="none"`` cannot know each
row's incoming gradient in the forward, so its backward (``linear_cross_entropy_backward``) recomputes the
logits chunk by chunk.

Backends implement one function, ``linear_ce_pass(x, weight, bias, target, label_smoothing, scale, grad_rows,
with_grad, chunk_rows) -> (loss_rows, grad_x, grad_weight, grad_bias)`` on labeled rows only (every target valid): the
reference below, ``fastops._C.cpp`` (csrc/cpu/linear_ce.cpp) and ``fastops.kernels`` (kernels/linear_ce.py).
A row's gradient is that of ``loss_row * scale * grad_rows[row]`` (``grad_rows`` may be None: 1).
"""

from __future__ import annotations

import warnings

import torch

from . import _backend

REDUCTIONS = ("none", "mean", "sum")
# Logit elements per chunk of rows, handed to every backend (chunk_rows). The matmuls want many rows: measured on
# the 2-core Zen 5 machine (1 thread, bf16, N=2048, H=256, V=32000, forward + grads, under load from other jobs):
# 32 rows 1664 ms, 128 rows 1438, 256 rows 1291, 512 rows 1357. Peak extra memory of forward + backward, where
# the fp32 grad_weight accumulator (31 MiB) is fixed: 2^23 elements (262 rows) 43.3 MiB, 12% of eager's 358, at
# 1347 ms; 2^22 (131 rows) 35.4 MiB, 9.9%, at 1437 ms (same process, interleaved). 2^22 keeps to the issue's
# memory target (at most 10% of eager's) for 7% of the time.
CHUNK_ELEMENTS = 1 << 22

_lib = torch.library.Library("fastops", "FRAGMENT")
_lib.define(
    "linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index, str reduction, "
    "float label_smoothing, bool with_grad) -> (Tensor loss, Tensor grad_x, Tensor grad_weight, Tensor grad_bias)"
)
_lib.define(
    "linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight, Tensor target, Tensor? bias, "
    "int ignore_index, str reduction, float label_smoothing) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)"
)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _check_args(x, weight, target, bias, reduction, label_smoothing) -> None:
    """Shape, dtype and device checks (they hold on fake tensors too, so torch.compile raises the same)."""
    op = "fastops.linear_cross_entropy"
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: x, weight and target must be tensors")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected a floating dtype")
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"{op}: x must be (..., H) and weight (V, H); got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: x has hidden size {x.shape[-1]} but weight {tuple(weight.shape)} "
                         f"expects {weight.shape[1]}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight has dtype {weight.dtype} but x has {x.dtype}; cast them to one dtype")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},)")
        if bias.dtype != x.dtype:
            raise TypeError(f"{op}: bias has dtype {bias.dtype} but x has {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: target has dtype {target.dtype}; expected int64 class indices")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"{op}: target has shape {tuple(target.shape)} but x {tuple(x.shape)} "
                         f"needs {tuple(x.shape[:-1])}")
    if target.device != x.device:
        raise ValueError(f"{op}: target is on {target.device} but x is on {x.device}")


def _labeled(x2, target1, ignore_index, vocab):
    """Row indices with a label (None when every row has one), the labeled x rows and their targets; raises on a
    target outside [0, V) like torch (IndexError "Target 7 is out of bounds.")."""
    keep = target1 != ignore_index
    bad = keep & ((target1 < 0) | (target1 >= vocab))
    if bool(bad.any()):
        raise IndexError(f"fastops.linear_cross_entropy: Target {int(target1[bad][0])} is out of bounds "
                         f"(vocabulary {vocab}).")
    if bool(keep.all()):
        return None, x2, target1.long()
    idx = keep.nonzero().squeeze(1)
    return idx, x2.index_select(0, idx), target1.index_select(0, idx).long()


_warned_missing: set[str] = set()


def _pass_for(device_type: str, dtype: torch.dtype = torch.float32):
    name = _backend.active(device_type)
    if name == "reference" or dtype == torch.float64:  # the kernels take fp32/bf16/fp16; fp64 is the reference's
        return reference_pass
    fn = getattr(_backend._chosen[device_type][1], "linear_ce_pass", None)
    if fn is not None:
        return fn
    if _backend.requested(device_type) != "auto":
        raise _backend.BackendUnavailable(f"backend {name!r} has no linear_ce_pass (rebuild fastops._C)")
    if device_type not in _warned_missing:  # a _C built before this op: run, but say why it is slow
        _warned_missing.add(device_type)
        warnings.warn(f"fastops: backend {name!r} has no linear_ce_pass; linear_cross_entropy uses the reference",
                      RuntimeWarning, stacklevel=3)
    return reference_pass


def reference_pass(x, weight, bias, target, label_smoothing, scale, grad_rows, with_grad, chunk_rows=0):
    """The oracle and fallback (pure PyTorch, chunked). x: (M, H) labeled rows, target: (M,) valid classes."""
    m, h = x.shape
    v = weight.shape[0]
    loss_rows = torch.empty(m, dtype=torch.float32, device=x.device)
    gx = torch.empty((m, h) if with_grad else (0,), dtype=x.dtype, device=x.device)
    gw = torch.zeros((v, h) if with_grad else (0,), dtype=torch.float32, device=x.device)
    gb = torch.zeros((v,) if with_grad and bias is not None else (0,), dtype=torch.float32, device=x.device)
    eps = label_smoothing
    step = chunk_rows if chunk_rows > 0 else _chunk_rows(v)
    for s in range(0, m, step):
        xc, tc = x[s:s + step], target[s:s + step]
        logits = torch.addmm(bias, xc, weight.t()) if bias is not None else xc @ weight.t()
        z = logits.float()
        lse = torch.logsumexp(z, dim=1)
        zt = z.gather(1, tc[:, None]).squeeze(1)
        # In terms of log-probabilities, as torch: (1 - eps)(lse - z_t) + eps (lse - mean z), exactly 0 at V = 1.
        loss = (1 - eps) * (lse - zt)
        if eps:
            loss = loss + eps * (lse - z.sum(1) / v)
        loss_rows[s:s + step] = loss
        if not with_grad:
            continue
        g = torch.exp(z - lse[:, None])
        if eps:
            g -= eps / v
        g.scatter_add_(1, tc[:, None], torch.full_like(zt[:, None], -(1 - eps)))
        row_scale = torch.full_like(lse, scale) if grad_rows is None else grad_rows[s:s + step].float() * scale
        g *= row_scale[:, None]
        dl = g.to(x.dtype)
        gx[s:s + step] = dl @ weight
        if x.dtype == torch.float32:
            gw.addmm_(dl.t(), xc)
        else:  # no mixed-dtype matmul on the CPU: the chunk's bf16/fp16 product is added in fp32
            gw += (dl.t() @ xc).float()
        if bias is not None:
            gb += g.sum(0)
    return loss_rows, gx, gw.to(weight.dtype), gb.to(weight.dtype)


def _loss_dtype(x):
    # The op's loss stays in its fp32 (or fp64) accumulator: the wrapper rounds it to what the caller asks for, so
    # fused_loss under autocast gives the fp32 loss autocast's cross_entropy gives, not one rounded to bf16.
    return torch.promote_types(x.dtype, torch.float32)


def _forward_impl(x, weight, target, bias, ignore_index, reduction, label_smoothing, with_grad):
    _check_args(x, weight, target, bias, reduction, label_smoothing)
    h, v = x.shape[-1], weight.shape[0]
    x2, t1 = x.reshape(-1, h), target.reshape(-1)
    n = x2.shape[0]
    with_grad = with_grad and reduction != "none"
    idx, xl, tl = _labeled(x2, t1, ignore_index, v)
    m = xl.shape[0]
    scale = 1.0 / m if reduction == "mean" and m else 1.0
    if m:
        b = None if bias is None else bias.contiguous()
        loss_rows, gxl, gw, gb = _pass_for(x.device.type, x.dtype)(
            xl.contiguous(), weight.contiguous(), b, tl, float(label_smoothing), scale, None, with_grad, _chunk_rows(v))
    else:
        loss_rows = x.new_zeros(0, dtype=torch.float32)
        gxl = x.new_zeros((0, h) if with_grad else (0,))
        gw = weight.new_zeros(weight.shape if with_grad else (0,))
        gb = weight.new_zeros((v,) if with_grad and bias is not None else (0,))
    if reduction == "none":
        full = loss_rows.new_zeros(n)
        full = loss_rows if idx is None else full.index_copy_(0, idx, loss_rows)
        loss = full.to(_loss_dtype(x)).reshape(target.shape)
    else:
        total = loss_rows.sum()
        loss = (total / m if reduction == "mean" else total).to(_loss_dtype(x))  # mean of no rows: 0/0 = nan, as torch
    if with_grad:
        gx = gxl if idx is None else x2.new_zeros(n, h).index_copy_(0, idx, gxl)
        gx = gx.reshape(x.shape)
    else:
        gx = x.new_empty(0)
    return loss, gx, gw, gb


def _backward_impl(grad_loss, x, weight, target, bias, ignore_index, reduction, label_smoothing):
    _check_args(x, weight, target, bias, reduction, label_smoothing)
    h, v = x.shape[-1], weight.shape[0]
    x2, t1 = x.reshape(-1, h), target.reshape(-1)
    idx, xl, tl = _labeled(x2, t1, ignore_index, v)
    m = xl.shape[0]
    if reduction == "none":
        g = grad_loss.reshape(-1).float()
        grad_rows, scale = (g if idx is None else g.index_select(0, idx)), 1.0
    else:
        grad_rows = None
        scale = float(grad_loss) / (m if reduction == "mean" and m else 1)
    if not m:
        gb = weight.new_zeros((v,) if bias is not None else (0,))
        return x.new_zeros(x.shape), weight.new_zeros(weight.shape), gb
    _, gxl, gw, gb = _pass_for(x.device.type, x.dtype)(xl.contiguous(), weight.contiguous(),
                                              None if bias is None else bias.contiguous(),
                                              tl, float(label_smoothing), scale, grad_rows, True, _chunk_rows(v))
    gx = gxl if idx is None else x2.new_zeros(x2.shape).index_copy_(0, idx, gxl)
    return gx.reshape(x.shape), gw, gb


@torch.library.register_fake("fastops::linear_cross_entropy", lib=_lib)
def _fake_forward(x, weight, target, bias, ignore_index, reduction, label_smoothing, with_grad):
    _check_args(x, weight, target, bias, reduction, label_smoothing)
    with_grad = with_grad and reduction != "none"
    loss = x.new_empty(target.shape if reduction == "none" else (), dtype=_loss_dtype(x))
    gx = x.new_empty(x.shape if with_grad else (0,))
    gw = weight.new_empty(weight.shape if with_grad else (0,))
    gb = weight.new_empty((weight.shape[0],) if with_grad and bias is not None else (0,))
    return loss, gx, gw, gb


@torch.library.register_fake("fastops::linear_cross_entropy_backward", lib=_lib)
def _fake_backward(grad_loss, x, weight, target, bias, ignore_index, reduction, label_smoothing):
    _check_args(x, weight, target, bias, reduction, label_smoothing)
    gb = weight.new_empty((weight.shape[0],) if bias is not None else (0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), gb


for _dev in _backend.DEVICE_TYPES:
    _lib.impl("linear_cross_entropy", _forward_impl, _dev.upper())
    _lib.impl("linear_cross_entropy_backward", _backward_impl, _dev.upper())


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, ignore_index, reduction, label_smoothing, with_grad = inputs
    _, gx, gw, gb = output
    ctx.fused = with_grad and reduction != "none"
    ctx.has_bias = bias is not None
    ctx.args = (ignore_index, reduction, label_smoothing)
    if ctx.fused:
        ctx.save_for_backward(gx, gw, gb)
    else:
        ctx.save_for_backward(x, weight, target, bias)


def _backward(ctx, grad_loss, _gx, _gw, _gb):
    if ctx.fused:  # the forward computed the gradients of the loss; the incoming gradient is a scalar
        gx, gw, gb = ctx.saved_tensors
        g = grad_loss.to(gx.dtype)
        gx, gw, gb = gx * g, gw * g, gb * g
    else:
        x, weight, target, bias = ctx.saved_tensors
        gx, gw, gb = torch.ops.fastops.linear_cross_entropy_backward(grad_loss, x, weight, target, bias, *ctx.args)
    return gx, gw, None, (gb if ctx.has_bias else None), None, None, None, None


torch.library.register_autograd("fastops::linear_cross_entropy", _backward, setup_context=_setup_context, lib=_lib)


def linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         *, out_dtype=None):
    """``F.cross_entropy(F.linear(x, weight, bias), target, ignore_index=, reduction=, label_smoothing=)`` without
    the logits. x: (..., H), weight: (V, H), bias: (V,) or None, target: (...) class indices. The loss has x's dtype
    unless ``out_dtype`` says otherwise (torch.float32: what cross_entropy returns under autocast; the loss is
    accumulated in fp32 either way); a mean over no labeled row is nan, as torch's. For a batch accumulated over micro-batches, take
    ``reduction="sum"`` and divide by the labeled-row count of the whole batch."""
    _check_args(x, weight, target, bias, reduction, label_smoothing)
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))
    loss = torch.ops.fastops.linear_cross_entropy(x, weight, target, bias, int(ignore_index), reduction,
                                                  float(label_smoothing), bool(with_grad))[0]
    return loss.to(x.dtype if out_dtype is None else out_dtype)
