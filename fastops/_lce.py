"""``fastops.linear_cross_entropy``: ``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` and its gradients
without the N x V logits (the op's contract: fastops/_specs/linear_ce.py).

How it runs. Rows whose target is ``ignore_index`` are dropped (index_select) before any matmul. The labeled rows
go through the vocabulary in chunks of rows: a chunk's logits are one matmul (in the inputs' dtype, as ``F.linear``
rounds them), one row pass computes in fp32 the log-sum-exp, the loss and, in place, the logits' gradient, and two
more matmuls turn that into the chunk's rows of grad_x and its share of grad_weight. Three matmuls of 2 N V H each,
the least there is: recomputing the logits in the backward would be a fourth.

The chunk. grad_weight's inner dimension is the chunk's rows, so chunks must not be small; one chunk needs no
grad_weight accumulator (grad_weight straight out of one matmul that sums in fp32 and rounds once, as torch's
own), several of bf16/fp16 add it up in a 4VH-byte fp32 one (on the CPU inside MKL's bf16 x bf16 -> fp32 matmul).
So the labeled rows go in equal chunks of at most CHUNK_ROWS, except where the accumulator and one such chunk
would hold more than half of the whole batch's logits: then in one chunk. Measured on the 2-core Xeon (AMX), 1
thread, bf16, every row labeled, load 5-6 (benchmarks/bench_loss_chunks.py, results/loss_chunks.csv): at N=4096,
H=256, V=32000 chunks of 512 rows take 0.87x one chunk's time (1024: 0.81x, 256: 1.13x) and hold 80 MiB instead of
266 (eager 732: 0.11x), frozen head 0.93x the time, 50 MiB instead of 271; at N=1024 the trainable head's one chunk
stays (chunks of 512: 1.12x the time for the same 80 MiB, eager 171). A frozen head has no accumulator and chunks
of FROZEN_CHUNK_ROWS (below). Where N is under about 4H + 1024 with a trainable head the
accumulator alone outweighs what chunking saves, so no chunking meets "15% of eager's memory" there; a caller can
still trade speed for memory with ``chunk_rows``.

When a gradient is wanted and the reduction is mean or sum, the forward computes it in the same chunk pass (as
Liger does) and the backward only scales it by the incoming scalar, or hands it over as it is when that scalar is
1 (a CPU loss.backward(): no copy, no second V x H buffer). Only the gradients asked for are computed: a frozen
head (weight.requires_grad False) skips grad_weight's matmul, a frozen x grad_x's. ``reduction="none"`` cannot
know each row's incoming gradient in the forward, so its backward (``linear_cross_entropy_backward``) recomputes
the logits chunk by chunk.

With a trainable bf16 head and few rows per hidden unit the C++ CPU backend goes through the vocabulary in blocks
instead (``vocab_block`` below): four matmuls, but neither the fp32 V x H accumulator nor the weight's copy.

The C++ backends (CPU, CUDA) run csrc/linear_ce.h's driver; the reference and the Triton backend run ``forward``
and ``backward`` below with their own row pass (``rows``).
"""

from __future__ import annotations

import torch

from . import _ops  # noqa: F401  (registers torch.ops.fastops.linear_cross_entropy* from fastops/_specs)
from ._specs.linear_ce import MEAN, NONE, OP, REDUCTIONS, loss_dtype

# The rows of a chunk where the op chunks (csrc/cpu/linear_ce.cpp's ce_chunk_rows() is the same function). See the
# module docstring and benchmarks/results/loss_chunks.csv.
CHUNK_ROWS = 512


# Without grad_weight (a frozen head, or no gradient at all) no matmul sums over a chunk's rows and nothing
# accumulates across chunks, so smaller chunks cost only their matmuls' shorter M: measured on the 2-core Xeon (AMX),
# 1 thread pinned, bf16, frozen head, every row labeled, N=1024 (median of 7): chunks of 256 rows 1.07x-1.12x the
# time of 512 (H=256 V=128256, H=1024 V=32000), 128 rows 1.27x-1.41x; at N=4096 H=256 V=32000 256 rows took 0.82x.
# 256 rows hold a quarter of N=1024's logits: within 15% of eager's peak memory (about 6 bytes a logit).
FROZEN_CHUNK_ROWS = 256


def chunk_rows(m: int, h: int, v: int, itemsize: int, grad_weight: bool) -> int:
    """Rows of logits held at once for ``m`` labeled rows of a (V=v, H=h) head (the op's choice for chunk_rows=0):
    equal chunks of at most CHUNK_ROWS (FROZEN_CHUNK_ROWS without grad_weight), or all rows in one where chunks
    would not hold at most half of their logits (several chunks of bf16/fp16 add grad_weight up in a 4VH-byte fp32
    accumulator)."""
    cap = CHUNK_ROWS if grad_weight else FROZEN_CHUNK_ROWS
    if m <= cap:
        return max(m, 1)
    row_bytes = max(v, 1) * itemsize
    acc = 4 * v * h if grad_weight and itemsize < 4 else 0
    if 2 * (acc + cap * row_bytes) > m * row_bytes:
        return m
    chunks = -(-m // cap)
    return -(-m // chunks)  # chunks of equal size: no short last one


# Vocabulary blocks (the C++ CPU backend: csrc/cpu/linear_ce.cpp's ce_vocab_block() is this function). With a
# trainable head at few rows per hidden unit, chunks of rows cannot hold little: their fp32 grad_weight accumulator
# (4VH bytes) alone is a fifth of eager's peak at N = 1024, H = 256 (eager holds about 5 bytes a logit), and the
# weight's copy and a chunk's logits come on top: 0.46x-0.48x eager's at V 8000-151936 (results/loss_frozen256.md).
# Going through the vocabulary instead holds N x cols logits and an fp32 N x H grad_x, and writes grad_weight block
# by block with all N rows as its inner dimension, at the price of a fourth matmul (the logits again, for the
# gradients once each row's log-sum-exp is known). A block holds at most 2^20 logits (2 MiB) and a sixteenth of the
# vocabulary (at V = 8000 blocks of 1024 columns left the call at 0.158x eager's memory, of 448 at 0.133x). Blocks
# are taken where chunks of rows would hold more than 3/8 of the batch's bf16 logits (about 15% of eager's peak),
# up to VOCAB_BLOCK_MAX_HIDDEN. Measured on the 2-core Xeon (AMX), bf16, every row labeled, forward + backward:
# against chunks of 512 rows in one process, N = 1024, H = 256: 0.93x-1.09x their time at V = 32000 (1 and 2
# threads), 1.07x at V = 8000, 0.72x at V = 128256; N = 2048, H = 256: 1.25x (1 thread) and 1.08x (2 threads); at
# H = 512 1.05x-1.30x, where the fourth matmul is a larger share: not taken there. Against the peers
# (results/loss_blocks.md, N = 1024, H = 256): extra memory 0.087x-0.133x eager's at 1 thread, V 8000-151936 (chunks
# of rows: 0.46x-0.48x), 1.07x-1.72x the best compiled peer.
VOCAB_BLOCK_MAX_HIDDEN = 256
VOCAB_BLOCK_ELEMS = 1 << 20
VOCAB_BLOCK_COLS = (256, 4096)


def rows_held(m: int, h: int, v: int, itemsize: int, grad_weight: bool) -> int:
    """Bytes chunks of rows hold besides the inputs and the gradients returned: a chunk's logits, the fp32
    grad_weight accumulator where there are several chunks, and the weight's copy (csrc/cpu/linear_ce.cpp: where the
    head is trained and rows >= 4 H, on CPUs with AMX; counted on every CPU, so elsewhere an upper bound)."""
    rows = chunk_rows(m, h, v, itemsize, grad_weight)
    acc = 4 * v * h if grad_weight and itemsize < 4 and rows < m else 0
    return rows * v * itemsize + acc + (2 * v * h if grad_weight and m >= 4 * h else 0)


def vocab_block(m: int, h: int, v: int, itemsize: int, grad_weight: bool) -> int:
    """Columns of a vocabulary block where the C++ CPU backend goes through the vocabulary (bf16, a trainable head,
    the op's own plan), or 0 for chunks of rows (``chunk_rows``)."""
    if not grad_weight or itemsize != 2 or h > VOCAB_BLOCK_MAX_HIDDEN or m < 1:
        return 0
    if 8 * rows_held(m, h, v, itemsize, True) <= 3 * m * v * itemsize:
        return 0
    lo, hi = VOCAB_BLOCK_COLS
    cols = min(max(min(VOCAB_BLOCK_ELEMS // m, v // 16) // 64 * 64, lo), hi)
    return cols if cols < v else 0


def held(m: int, h: int, v: int, itemsize: int, grad_weight: bool) -> int:
    """Bytes the C++ CPU backend's plan holds for ``m`` labeled rows besides the inputs and the gradients returned:
    ``rows_held``, or in vocabulary blocks a block's logits and the fp32 m x H grad_x."""
    cols = vocab_block(m, h, v, itemsize, grad_weight)
    return itemsize * m * cols + 4 * m * h if cols else rows_held(m, h, v, itemsize, grad_weight)


def reference_rows(buf, target, row_grad, scale, eps, with_grad, loss):
    """The row pass in torch ops (the oracle; fp64 for every backend): loss per row into ``loss`` and, with
    ``with_grad``, ``buf`` overwritten by the gradient of loss * scale * row_grad (None: 1)."""
    z = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
    v = z.shape[1]
    lse = torch.logsumexp(z, dim=1)
    zt = z.gather(1, target[:, None]).squeeze(1)
    # In terms of log-probabilities, as torch: (1 - eps)(lse - z_t) + eps (lse - mean z), exactly 0 at V = 1.
    out = (1 - eps) * (lse - zt)
    if eps:
        out = out + eps * (lse - z.sum(1) / v)
    loss.copy_(out)
    if not with_grad:
        return
    g = torch.exp(z - lse[:, None])
    if eps:
        g -= eps / v
    g.scatter_add_(1, target[:, None], torch.full_like(zt[:, None], -(1 - eps)))
    c = torch.full_like(lse, scale) if row_grad is None else row_grad.to(z.dtype) * scale
    buf.copy_(g * c[:, None])


def _labeled(x2, t1, ignore_index, v):
    """Row indices with a label (None when every row has one), the labeled x rows and their int64 targets; a target
    outside [0, V) raises as torch's IndexError does."""
    keep = t1 != ignore_index
    bad = keep & ((t1 < 0) | (t1 >= v))
    if bool(bad.any()):
        raise IndexError(f"{OP}: Target {int(t1[bad][0])} is out of bounds (vocabulary {v}).")
    if bool(keep.all()):
        return None, x2.contiguous(), t1.long()
    idx = keep.nonzero().squeeze(1)
    return idx, x2.index_select(0, idx), t1.index_select(0, idx).long()


def _accumulate(gw, dl, xs):
    """gw (fp32) += dl^T @ xs for bf16/fp16 dl and xs, summed in fp32 inside the matmul where torch has one
    (aten::addmm.dtype_out, on CUDA), else through a product in their dtype."""
    mixed = getattr(torch.ops.aten.addmm, "dtype_out", None)  # from torch 2.14 on; CUDA kernels only
    if gw.device.type == "cuda" and mixed is not None:
        return mixed(gw, dl.t(), xs, torch.float32, out=gw)
    return gw.add_((dl.t() @ xs).float())


def _pass(x, w, bias, target, row_grad, scale, eps, want_gx, want_gw, want_gb, rows_asked, rows, rows_take_half):
    m, h = x.shape
    v = w.shape[0]
    dtype = x.dtype
    out_t = w.dtype  # grad_weight's and grad_bias's: fp32 for master weights (master_weight), left unrounded
    if out_t != dtype:
        w, bias = w.to(dtype), None if bias is None else bias.to(dtype)
    widen = dtype == torch.float16 and not rows_take_half
    acc_t = loss_dtype(x)
    with_grad = want_gx or want_gw or want_gb
    step = min(m, rows_asked if rows_asked > 0 else chunk_rows(m, h, v, dtype.itemsize, want_gw))
    native = dtype in (torch.float32, torch.float64)
    loss = torch.empty(m, dtype=acc_t, device=x.device)
    gx = torch.empty((m, h) if want_gx else (0,), dtype=dtype, device=x.device)
    gw = None
    gb = torch.zeros(v, dtype=acc_t, device=x.device) if want_gb else None
    for s in range(0, m, step):
        xs = x[s:s + step]
        z = torch.addmm(bias, xs, w.t()) if bias is not None else xs @ w.t()
        buf = z.float() if widen else z
        rows(buf, target[s:s + step], None if row_grad is None else row_grad[s:s + step], scale, eps, with_grad,
             loss[s:s + step])
        if not with_grad:
            continue
        dl = buf.to(dtype) if widen else buf
        if want_gx:
            torch.mm(dl, w, out=gx[s:s + step])
        if want_gw:
            if gw is None:  # one chunk: the matmul's own output, summed in fp32 and rounded once, as torch's
                gw = dl.t() @ xs if step >= m or native else (dl.t() @ xs).float()
            elif native:
                gw.addmm_(dl.t(), xs)
            else:
                gw = _accumulate(gw, dl, xs)
        if want_gb:
            gb += buf.sum(0, dtype=acc_t)
    gw = w.new_empty(0, dtype=out_t) if gw is None else gw.to(out_t)
    return loss, gx, gw, w.new_empty(0, dtype=out_t) if gb is None else gb.to(out_t)


def forward(x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, grad_x, grad_weight,
            grad_bias, chunk_rows_, *, rows, rows_take_half=False):  # fmt: skip
    """The op (fastops/_specs/linear_ce.py) on checked arguments, with the row pass ``rows`` (``reference_rows``'s
    signature); ``rows_take_half``: ``rows`` reads fp16 chunks itself (else they are widened to fp32 first)."""
    h, v = x.shape[-1], weight.shape[0]
    x2, t1 = x.reshape(-1, h), target.reshape(-1)
    n = x2.shape[0]
    none = reduction == NONE
    grad_x, grad_weight = grad_x and not none, grad_weight and not none
    grad_bias = grad_bias and not none and bias is not None
    idx, xl, tl = _labeled(x2, t1, ignore_index, v)
    m = xl.shape[0]
    denom = (normalizer if normalizer > 0 else m) if reduction == MEAN else 1
    if m:
        b = None if bias is None else bias.contiguous()
        loss_rows, gxl, gw, gb = _pass(xl, weight.contiguous(), b, tl, None, 1.0 / denom, label_smoothing, grad_x,
                                       grad_weight, grad_bias, chunk_rows_, rows, rows_take_half)
    else:
        loss_rows, gxl = x.new_zeros(0, dtype=loss_dtype(x)), x.new_zeros(0, h)
        gw = torch.zeros_like(weight) if grad_weight else weight.new_empty(0)
        gb = weight.new_zeros(v) if grad_bias else weight.new_empty(0)
    if none:
        loss = loss_rows if idx is None else loss_rows.new_zeros(n).index_copy_(0, idx, loss_rows)
        loss = loss.reshape(target.shape)
    else:
        loss = loss_rows.sum() / denom  # a mean over no labeled row: 0 / 0 = nan, as torch's
    gx = x.new_empty(0)
    if grad_x:
        gx = (gxl if idx is None else x2.new_zeros(n, h).index_copy_(0, idx, gxl)).reshape(x.shape)
    return loss, gx, gw, gb


def backward(grad_loss, x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, grad_x,
             grad_weight, grad_bias, chunk_rows_, *, rows, rows_take_half=False):  # fmt: skip
    """linear_cross_entropy_backward on checked arguments (see ``forward``)."""
    h, v = x.shape[-1], weight.shape[0]
    x2, t1 = x.reshape(-1, h), target.reshape(-1)
    grad_bias = grad_bias and bias is not None
    idx, xl, tl = _labeled(x2, t1, ignore_index, v)
    m = xl.shape[0]
    if m:
        # The incoming gradient stays on its device (no host read): one factor per row.
        if reduction == NONE:
            g = grad_loss.reshape(-1).to(loss_dtype(x))
            row_grad = (g if idx is None else g.index_select(0, idx)).contiguous()
        else:
            denom = (normalizer if normalizer > 0 else m) if reduction == MEAN else 1
            row_grad = (grad_loss.to(loss_dtype(x)).reshape(1) / denom).expand(m).contiguous()
        b = None if bias is None else bias.contiguous()
        _, gxl, gw, gb = _pass(xl, weight.contiguous(), b, tl, row_grad, 1.0, label_smoothing, grad_x, grad_weight,
                               grad_bias, chunk_rows_, rows, rows_take_half)
    else:
        gxl = x.new_zeros(0, h)
        gw = torch.zeros_like(weight) if grad_weight else weight.new_empty(0)
        gb = weight.new_zeros(v) if grad_bias else weight.new_empty(0)
    gx = x.new_empty(0)
    if grad_x:
        gx = (gxl if idx is None else x2.new_zeros(x2.shape).index_copy_(0, idx, gxl)).reshape(x.shape)
    return gx, gw, gb


def reference_forward(*args):
    return forward(*args, rows=reference_rows)


def reference_backward(*args):
    return backward(*args, rows=reference_rows)


# ---- autograd ---------------------------------------------------------------------------------------------------

_lib = torch.library.Library("fastops", "FRAGMENT")
_X, _W, _B = 0, 1, 3  # positions of x, weight and bias among the op's arguments


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, fx, fw, fb, rows_ = inputs
    need = ctx.needs_input_grad
    ctx.fused = reduction != NONE
    ctx.has_bias = bias is not None
    ctx.args = (ignore_index, reduction, label_smoothing, normalizer)
    ctx.rows = rows_
    # A gradient needed that the forward was not asked for (a direct call of the op with its flag off) is
    # recomputed by the backward op; fastops.linear_cross_entropy sets the flags from requires_grad.
    ctx.missing = (need[_X] and not fx, need[_W] and not fw, ctx.has_bias and need[_B] and not fb)
    _, gx, gw, gb = output
    # gx, gw and gb are only ever read by this backward: without this autograd would hand it zeros for them, a fill
    # of V x H for gw (28.8 ms of a 360 ms call at N1024 H2048 V32000 bf16, 2 threads).
    ctx.set_materialize_grads(False)
    ctx.recompute = not ctx.fused or any(ctx.missing)
    saved = (gx, gw, gb) if ctx.fused else ()
    if ctx.recompute:
        saved += (x, weight, target, bias)
    ctx.save_for_backward(*saved)


def _backward(ctx, grad_loss, _gx, _gw, _gb):
    need = ctx.needs_input_grad
    # No grad_loss (grads are not materialized): the loss itself was not used, so nothing flows back.
    want = (need[_X], need[_W], ctx.has_bias and need[_B]) if grad_loss is not None else (False, False, False)
    saved = ctx.saved_tensors
    out = [None, None, None]
    if ctx.fused and any(want):
        # grad_loss == 1 (a CPU loss.backward()) hands the forward's gradients over as they are: autograd then
        # keeps them as .grad without a copy. Not while tracing (a value test) nor on a GPU (a host sync).
        unit = not torch.compiler.is_compiling() and grad_loss.device.type == "cpu" and bool(grad_loss == 1)
        for i, g in enumerate(saved[:3]):
            if want[i] and not ctx.missing[i]:
                out[i] = g if unit else g * grad_loss.to(g.dtype)
    if ctx.recompute:
        x, weight, target, bias = saved[-4:]
        redo = tuple(w and (not ctx.fused or m) for w, m in zip(want, ctx.missing))
        if any(redo):
            got = torch.ops.fastops.linear_cross_entropy_backward(grad_loss, x, weight, target, bias, *ctx.args, *redo,
                                                                  ctx.rows)
            out = [g if r else o for g, r, o in zip(got, redo, out)]
    return out[0], out[1], None, out[2], None, None, None, None, None, None, None, None


torch.library.register_autograd("fastops::linear_cross_entropy", _backward, setup_context=_setup_context, lib=_lib)


def linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         *, out_dtype=None, normalizer=None, chunk_rows=0):  # fmt: skip
    """``F.cross_entropy(F.linear(x, weight, bias), target, ignore_index=, reduction=, label_smoothing=)`` without
    the logits. x: (..., H), weight: (V, H), bias: (V,) or None, target: (...) class indices. weight and bias
    have x's dtype, or are fp32 where x is bf16/fp16 (master weights: the matmuls run in x's dtype on a cast the op
    makes a block at a time, and grad_weight comes back fp32).

    The loss has x's dtype unless ``out_dtype`` says otherwise (torch.float32: what cross_entropy returns under
    autocast; it is accumulated in fp32 either way); a mean over no labeled row is nan, as torch's. Gradients are
    computed only for the tensors that require them (a frozen head skips grad_weight's matmul).

    ``normalizer`` (reduction="mean" only): divide the sum by it instead of this call's labeled count. Gradient
    accumulation over micro-batches passes the whole batch's labeled count, so every token weighs the same as in
    one large batch (a float, or a tensor: read on the host). ``chunk_rows``: rows of logits held at once (0: the
    op chooses from the shape; fewer rows hold less memory and run slower)."""
    grad = torch.is_grad_enabled()
    fx = grad and bool(getattr(x, "requires_grad", False))
    fw = grad and bool(getattr(weight, "requires_grad", False))
    fb = grad and bias is not None and bool(getattr(bias, "requires_grad", False))
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    norm = 0.0 if normalizer is None else float(normalizer)
    loss = torch.ops.fastops.linear_cross_entropy(x, weight, target, bias, int(ignore_index),
                                                  REDUCTIONS.index(reduction),
                                                  float(label_smoothing), norm, fx, fw, fb, int(chunk_rows))[0]
    return loss.to(x.dtype if out_dtype is None else out_dtype)
