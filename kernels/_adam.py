"""The Adam/AdamW update every Triton Adam kernel runs (adam.py on fp32 states, adam_lowp.py on 8-bit or bf16 states
decoded to fp32 before it and encoded after), the per-tensor step scalars, and the launcher both share.

The launch walks a chunk table, as apex's multi_tensor_apply does: each program owns one CHUNK-element slice of one
tensor and finds that tensor's pointers in a per-tensor table. Both tables are int64 tensors on the params' device,
built once per set of (data_ptr, numel) and cached (``_common.TableCache``), so a steady training loop only hashes
pointers on the host.

Nothing here reads a device value on the host: lr, grad_scale and found_inf are read in the kernel when they are on
the params' device, the step counters are bumped by a device op before the launch, and bias corrections are computed
in the kernel from each tensor's own step. That keeps the step free of syncs and capturable in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Float arguments go to the kernels rounded to fp32: compiled they are fp32 anyway, but the interpreter keeps
# Python floats and adds them in fp64 (x + eps rounded once from fp64 put 2 of 5000 params 1 ulp off).
from fastops._util import round_fp32 as _f32

from ._common import (
    TL_DTYPE, block_sizes, chunk_of, device_scope, group_by_dtype, ld, round_to, scalar_value, st,
    step_scalars, table_ptr, tensor_table,
)

# The columns every Adam tensor table starts with; an op's own pointer columns follow, and numel is last (where
# build_table reads it).
P = tl.constexpr(0)
G = tl.constexpr(1)
M = tl.constexpr(2)
V = tl.constexpr(3)
MASTER = tl.constexpr(4)
STEP = tl.constexpr(5)
FIRST_OWN = tl.constexpr(6)

# Under the interpreter tl.fma is a * b + c with two roundings; compiled it is one.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fma(a, b, c, EMULATE_FMA: tl.constexpr):
    # The interpreter computes tl.fma as a * b + c, two roundings. Under it, the product in fp64 is exact
    # (24 + 24 bits) and the sum rounds twice (fp64, then fp32), which differs from one rounding only when the
    # fp64 sum lands on an fp32 midpoint: what makes the states bit-exact with torch's fused CPU kernels.
    if EMULATE_FMA:
        return (tl.cast(a, tl.float64) * tl.cast(b, tl.float64) + tl.cast(c, tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _max_nan(a, b):
    # torch.maximum: nan if either is nan.
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _pow_int(beta, step):
    """beta ** n in fp64 for the integral fp32 ``step`` n, by squaring."""
    n = step.to(tl.int64)
    r = tl.cast(1.0, tl.float64)
    b = beta
    while n > 0:
        r = tl.where((n & 1) != 0, r * b, r)
        b = b * b
        n = n >> 1
    return r


@triton.jit
def program_scalars(
    common, COLS: tl.constexpr, CHUNK: tl.constexpr, LR_PTR: tl.constexpr, SCALE: tl.constexpr,
    FOUND_INF: tl.constexpr,
):  # fmt: skip
    """This program's (table row, first element, numel), its step's (scale, decay, neg_step_size, bc2_sqrt), and the
    launch's (beta2, one_minus_beta2, lerp_weight, eps, weight_decay), from the arguments every Adam kernel takes
    first (``common``, as ``launch`` passes them; ``consts``: fp64 (beta1, beta2, weight_decay)). With found_inf set
    numel is 0: the program's loops make no trip and nothing is written.

    The bias corrections and the decay are computed in fp64 and rounded once to fp32, as the reference's Python
    floats reach torch's fp32 kernels, beta**step by squaring over the integral step. Measured against the
    reference's scalars over steps 1..10000 (betas (0.9, 0.999), (0.95, 0.9999), (0.9, 0.95), (0.5, 0.99)): fp64
    differs in none; fp32 -expm1(step * log(beta)) (a degree-9 series or expm1f, log(beta) from the host) gives
    another -lr / bc1 in 0-80 steps and another sqrt(bc2) in 66-2545. Over 10k sampled steps up to 1.6e7, fp64
    squaring still differs in none. With lr read in the kernel, 1 - lr * weight_decay from an fp32 weight_decay
    (fp64 or fp32 fma) differs in 7 of 10k lrs at weight_decay 0.1 and 29 at 0.3, from the fp64 one in none. fp64
    exp() here kept 8 bytes on the stack in 3 of the 8-bit specs on sm_90 (compile-check); the squarings do not.
    """
    (rows, chunks, consts, lr_ptr, lr_value, decay_value, scale_ptr, scale_value, found_inf_ptr,
     beta2, one_minus_beta2, lerp_weight, eps, weight_decay) = common  # fmt: skip
    _, t, start = chunk_of(chunks, CHUNK)
    row = rows + t * COLS
    numel = tl.load(row + COLS - 1)
    if FOUND_INF:
        numel = tl.where(tl.load(found_inf_ptr) != 0, 0, numel)
    step = tl.load(tl.load(row + STEP).to(tl.pointer_type(tl.float32)))
    lr = scalar_value(lr_ptr, lr_value, LR_PTR)
    if LR_PTR:
        decay = (1.0 - tl.cast(lr, tl.float64) * tl.load(consts + 2)).to(tl.float32)
    else:
        decay = decay_value
    scale = scalar_value(scale_ptr, scale_value, SCALE == 2)
    bc1 = 1.0 - _pow_int(tl.load(consts), step)
    bc2 = 1.0 - _pow_int(tl.load(consts + 1), step)
    neg_step_size = (-(tl.cast(lr, tl.float64) / bc1)).to(tl.float32)
    bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
    return row, start, numel, (scale, decay, neg_step_size, bc2_sqrt), (beta2, one_minus_beta2, lerp_weight, eps,
                                                                        weight_decay)


@triton.jit
def load_param_grad(p_ptr, g_ptr, w_ptr, offs, numel, MASTER_: tl.constexpr, EVEN: tl.constexpr):
    """The fp32 param (the master copy where there is one), the fp32 grad, and the mask of offs below numel."""
    mask = offs < numel
    if MASTER_:
        p = ld(w_ptr, offs, mask, EVEN)
    else:
        p = ld(p_ptr, offs, mask, EVEN).to(tl.float32)
    return p, ld(g_ptr, offs, mask, EVEN).to(tl.float32), mask


@triton.jit
def store_param(p, p_ptr, w_ptr, offs, mask, P_DTYPE: tl.constexpr, MASTER_: tl.constexpr, EVEN: tl.constexpr):
    if MASTER_:
        st(w_ptr, offs, p, mask, EVEN)
    st(p_ptr, offs, round_to(p, P_DTYPE), mask, EVEN)


@triton.jit
def update(
    p, g, m, v, vmax_ptr, offs, mask, hyper, step_scalars,
    SCALE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
    LERP_SMALL: tl.constexpr, EMULATE_FMA: tl.constexpr, EVEN: tl.constexpr, INV_BC2: tl.constexpr = False,
):  # fmt: skip
    """One Adam step on fp32 values -> (p, m, v). With AMSGRAD it also steps the fp32 max_exp_avg_sq at
    vmax_ptr + offs, loaded only once v is known (loaded before the update, 5 of the 21 AMSGRAD spec/arch
    compiles took 2-5 more registers and 32 warps an SM instead of 40 on sm_90/sm_100).
    hyper: the launch's (beta2, one_minus_beta2, lerp_weight, eps, weight_decay); step_scalars: program_scalars'.
    SCALE: 0 no grad_scale, 1 value, 2 pointer. WD: 0 none, 1 L2 (Adam), 2 decoupled (AdamW).

    The order of operations is reference.py's (torch.optim.Adam's for-loop path); an fma stands where torch's CPU
    kernels fuse (add with alpha, lerp, addcmul). fp fusion is off at launch so no other product is fused."""
    beta2, one_minus_beta2, lerp_weight, eps, weight_decay = hyper
    scale, decay, neg_step_size, bc2_sqrt = step_scalars
    if SCALE:
        g = tl.div_rn(g, scale)
    if MAXIMIZE:
        g = -g
    if WD == 1:
        g = _fma(p, weight_decay, g, EMULATE_FMA)
    if WD == 2:
        p = p * decay
    if LERP_SMALL:
        m = _fma(lerp_weight, g - m, m, EMULATE_FMA)
    else:
        m = _fma(lerp_weight - 1.0, g - m, g, EMULATE_FMA)
    # torch's addcmul compiles to fma((1 - beta2) * g, g, v * beta2); measured: 0 of 5000 differ this way,
    # 376 with a separate add.
    v = _fma(one_minus_beta2 * g, g, v * beta2, EMULATE_FMA)
    if AMSGRAD:
        vmax = _max_nan(ld(vmax_ptr, offs, mask, EVEN), v)
        st(vmax_ptr, offs, vmax, mask, EVEN)
        root = tl.sqrt_rn(vmax)
    else:
        root = tl.sqrt_rn(v)
    if INV_BC2:  # bf16 states: reference.py's inv_bc2
        denom = root * tl.div_rn(tl.full([], 1.0, tl.float32), bc2_sqrt) + eps
    else:
        denom = tl.div_rn(root, bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    return p, m, v


_CONSTS: dict = {}
# op -> its block sizes' and table cache's name.
_KIND = {"adam_step_": "adam", "adam_step_lowp_": "adam_lowp"}


def _consts(beta1: float, beta2: float, weight_decay: float, device: torch.device) -> torch.Tensor:
    """(beta1, beta2, weight_decay) as fp64 on ``device`` (float arguments reach a kernel as fp32), one upload per
    set of values."""
    key = (beta1, beta2, weight_decay, device)
    if key not in _CONSTS:
        if len(_CONSTS) > 64:
            _CONSTS.clear()
        _CONSTS[key] = torch.tensor([beta1, beta2, weight_decay], dtype=torch.float64, device=device)
    return _CONSTS[key]


def launch(op: str, kernel, a, host_scalars, own_cols, own_args: tuple = (), **constexprs):
    """Bumps the step counters and launches ``kernel`` once per param dtype, for the op's arguments ``a`` (its
    ``Args`` record: adam_step_'s and adam_step_lowp_'s share these fields). The kernel's arguments are the common
    ones as one tuple (below; ``program_scalars`` reads them), then ``own_args``, then the constexprs; its table rows
    are the common columns, then ``own_cols(i)`` (tensor i's own pointers), then numel. ``op`` picks the block sizes
    (``_common.block_sizes``); ``host_scalars``: see ``_common.StepScalars``."""
    sc = step_scalars(a, host_scalars)
    if sc is None:
        return
    params, master_params, steps = a.params, a.master_params, list(a.state_steps)
    device = params[0].device
    kind = _KIND[op]
    chunk, block, num_warps = block_sizes(kind)
    beta1, beta2, eps, weight_decay = float(a.beta1), float(a.beta2), float(a.eps), float(a.weight_decay)
    lerp_weight = 1 - beta1
    # torch.lerp picks its formula by |weight| < 0.5 on the fp32 weight.
    lerp_small = abs(_f32(lerp_weight)) < 0.5
    wd_mode = 0 if weight_decay == 0 else (2 if a.decoupled else 1)
    consts = _consts(beta1, beta2, weight_decay, device)
    ncols = FIRST_OWN.value + len(own_cols(0)) + 1
    with device_scope(device):
        if sc.inf_t is None:
            torch._foreach_add_(steps, 1)
        else:
            # A device op: a skipped step leaves the counters as they were, with no host read.
            torch._foreach_add_(steps, (sc.inf_t.reshape(()) == 0).to(torch.float32))
        for dtype, idx in group_by_dtype(params).items():
            table = tensor_table(kind, device, chunk, idx, lambda i: (
                params[i].data_ptr(),
                a.grads[i].data_ptr(),
                a.exp_avgs[i].data_ptr(),
                a.exp_avg_sqs[i].data_ptr(),
                master_params[i].data_ptr() if master_params else 0,
                steps[i].data_ptr(),
                *own_cols(i),
                params[i].numel(),
            ), ncols)  # fmt: skip
            if table.n_chunks == 0:
                continue
            lr_ptr, scale_ptr, inf_ptr = sc.pointers(table.rows)
            kernel[(table.n_chunks,)](
                (table.rows, table.chunks, consts, lr_ptr, _f32(sc.lr), _f32(1 - sc.lr * weight_decay), scale_ptr,
                 _f32(sc.scale), inf_ptr, _f32(beta2), _f32(1 - beta2), _f32(lerp_weight), _f32(eps),
                 _f32(weight_decay)), *own_args,
                P_DTYPE=TL_DTYPE[dtype], CHUNK=chunk, COLS=ncols, LR_PTR=sc.lr_t is not None, SCALE=sc.scale_mode,
                FOUND_INF=sc.inf_t is not None, MAXIMIZE=bool(a.maximize), WD=wd_mode, MASTER=bool(master_params),
                LERP_SMALL=lerp_small, ALIGNED=table.aligned, EMULATE_FMA=_INTERPRETED, **constexprs,
                num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip


@triton.jit
def table_ptrs(row, P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """(param, grad, exp_avg, exp_avg_sq, master) pointers of a table row; S_DTYPE: the states' storage type."""
    return (table_ptr(row, P, P_DTYPE, ALIGNED), table_ptr(row, G, P_DTYPE, ALIGNED),
            table_ptr(row, M, S_DTYPE, ALIGNED), table_ptr(row, V, S_DTYPE, ALIGNED),
            table_ptr(row, MASTER, tl.float32, ALIGNED))  # fmt: skip
