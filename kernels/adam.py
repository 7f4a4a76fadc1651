"""Triton Adam/AdamW step: every param of one dtype on a device in one launch.

The launch walks a chunk table, as apex's multi_tensor_apply does: each program owns one CHUNK-element
slice of one tensor and finds that tensor's pointers in a per-tensor table. Both tables are int64 tensors
on the params' device, built once per set of (data_ptr, numel) and cached (``TableCache``), so a steady
training loop only hashes pointers on the host.

Nothing here reads a device value on the host: lr, grad_scale and found_inf are read in the kernel when
they are on the params' device, the step counters are bumped by a device op before the launch, and bias
corrections are computed in the kernel from each tensor's own step. That keeps the step free of syncs and
capturable in a CUDA graph.

This module also holds the pieces that ``amp.py`` shares: ``block_sizes``, ``TableCache``, ``build_table``
and ``scalar_source``.
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from fastops._checks import check_adam_args, check_scalar

# Largest finite fp32. |x| <= this is false exactly for inf and nan, and unlike x - x == 0 no compiler
# flag can fold it away.
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)

# op -> (CHUNK, BLOCK, num_warps). One program covers CHUNK elements of one tensor, BLOCK per loop trip.
# BLOCK=1024 over 4 warps is 8 elements a thread a trip: two 16-byte loads per fp32 stream. CHUNK=16384
# makes a 1B-param model 61k programs (a table of 1 MiB) and wastes at most one partial chunk per tensor.
_BLOCK_SIZES = {
    "adam": (16384, 1024, 4),
    "unscale": (16384, 1024, 4),
    "stats": (16384, 1024, 4),
    # The second grad_stats pass is one program over the per-chunk partials.
    "stats_reduce": (0, 1024, 4),
}


def block_sizes(op: str) -> tuple[int, int, int]:
    """(CHUNK, BLOCK, num_warps) for ``op``; the single place block sizes are chosen."""
    return _BLOCK_SIZES[op]


class Table:
    """A per-tensor table (``rows``: n x ncols int64, the last column numel) and a chunk table
    (``chunks``: n_chunks x 2, tensor index and chunk index), both views of one device tensor."""

    __slots__ = ("rows", "chunks", "n_chunks", "aligned", "_host", "_streams")

    def __init__(self, rows, chunks, n_chunks, aligned, host):
        self.rows = rows
        self.chunks = chunks
        self.n_chunks = n_chunks
        self.aligned = aligned
        # The pinned source of the upload. A table first built during graph capture is uploaded by a memcpy
        # node that reads this buffer again on every replay, so it lives as long as the table.
        self._host = host
        self._streams = set()

    def used_on_current_stream(self, device: torch.device) -> None:
        # The caching allocator ties a block to the stream it was allocated on; used from another stream and
        # then evicted, it could be handed out while that stream's kernel still reads it.
        if device.type != "cuda":
            return
        stream = torch.cuda.current_stream(device)
        if stream not in self._streams:
            if self._streams:
                self.rows.record_stream(stream)
            self._streams.add(stream)


def build_table(flat: list[int], ncols: int, chunk: int, device: torch.device) -> Table:
    n = len(flat) // ncols
    rows = torch.tensor(flat, dtype=torch.int64).view(n, ncols)
    counts = (rows[:, ncols - 1] + (chunk - 1)) // chunk
    n_chunks = int(counts.sum())
    tensor_idx = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts
    chunk_idx = torch.arange(n_chunks, dtype=torch.int64) - torch.repeat_interleave(first, counts)
    host = torch.cat([rows.reshape(-1), torch.stack([tensor_idx, chunk_idx], 1).reshape(-1)])
    # Absent pointers are 0, which counts as aligned.
    aligned = bool((rows[:, : ncols - 1] % 16 == 0).all())
    if device.type == "cuda":
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
    else:
        table = host
    return Table(table[: n * ncols], table[n * ncols :], n_chunks, aligned, host)


class TableCache:
    """A small LRU of device tables keyed by everything the table holds (pointers and numels), so an entry
    is valid whenever its key matches, whatever happened to the tensors in between.

    A table used while a CUDA graph is being captured is moved out of the LRU and never freed: the graph
    reads it on every replay."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._lru: OrderedDict = OrderedDict()
        self._pinned: dict = {}
        self._lock = threading.Lock()

    def get(self, key, flat: list[int], ncols: int, chunk: int, device: torch.device) -> Table:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        with self._lock:
            entry = self._pinned.get(key)
            if entry is None:
                entry = self._lru.get(key)
                if entry is not None:
                    if capturing:
                        del self._lru[key]
                        self._pinned[key] = entry
                    else:
                        self._lru.move_to_end(key)
        if entry is None:
            entry = build_table(flat, ncols, chunk, device)
            with self._lock:
                if capturing:
                    self._pinned[key] = entry
                else:
                    self._lru[key] = entry
                    while len(self._lru) > self.capacity:
                        self._lru.popitem(last=False)
        entry.used_on_current_stream(device)
        return entry

    def clear(self) -> None:
        """Drop the LRU (not the tables that captured graphs use)."""
        with self._lock:
            self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)


TABLES = TableCache()


def device_scope(device: torch.device):
    # Triton launches on the current device; params on cuda:1 with cuda:0 current would fault.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def scalar_source(t: torch.Tensor, device: torch.device, op: str, what: str, on_host: bool = False):
    """Where the kernel gets a one-element tensor's value: ``(t, 0.0)`` to read it through a pointer (it is
    on ``device``), or ``(None, value)`` when it is a CPU tensor read here (no device sync)."""
    check_scalar(t, op, what, device)
    if t.device == device and not on_host:
        return t, 0.0
    return None, float(t.item())


def group_by_dtype(tensors) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


# Columns of the Adam tensor table.
_P, _G, _M, _V, _VMAX, _MASTER, _STEP, _NUMEL = range(8)
_ADAM_COLS = 8


@triton.jit
def _one_minus_pow(log_beta, step):
    # 1 - beta**step, as -expm1(step * log(beta)) with log(beta) computed on the host in fp64. The direct
    # fp32 form is off twice: fp32(0.999) = 0.99900001287, so 1 - beta alone is 1.3e-5 too small relative
    # at step 1, and 1 - pow() cancels the leading digits. For |y| <= 0.5 a Taylor series to y**9
    # truncates below 1e-8 relative; beyond, 1 - exp(y) >= 0.39 has no cancellation. Measured for beta in
    # 0.9..0.9999 and steps 1..1e7: at most 2.2e-7 relative off fp64, where fp32 1 - pow() is 2e-5 (0.999)
    # and 2e-4 (0.9999).
    y = step * log_beta
    # Clamped so the unused series stays finite when beta = 0 (log_beta = -inf).
    ys = tl.maximum(y, -0.5)
    t = 1.0 + ys * (1.0 / 9.0)
    t = 1.0 + ys * (1.0 / 8.0) * t
    t = 1.0 + ys * (1.0 / 7.0) * t
    t = 1.0 + ys * (1.0 / 6.0) * t
    t = 1.0 + ys * (1.0 / 5.0) * t
    t = 1.0 + ys * (1.0 / 4.0) * t
    t = 1.0 + ys * (1.0 / 3.0) * t
    t = 1.0 + ys * 0.5 * t
    return tl.where(y > -0.5, -ys * t, 1.0 - tl.exp(y))


@triton.jit
def _ld(ptr, offs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr + offs)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _st(ptr, offs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr + offs, value)
    else:
        tl.store(ptr + offs, value, mask=mask)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even."""
    if DTYPE == tl.bfloat16:
        # By hand, the way c10::BFloat16 rounds: the interpreter's fp32 -> bf16 cast truncates (a param
        # landed 1 ulp off the reference in 1 of 4 tiny cases), and doing it the same way on the GPU keeps
        # the tested path the one that runs. About 6 integer ops an element against 28 bytes of traffic.
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC00000, bits + (0x7FFF + ((bits >> 16) & 1)))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _max_nan(a, b):
    # torch.maximum: nan if either is nan.
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _adam_block(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, numel,
    scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
    P_DTYPE: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
):  # fmt: skip
    mask = offs < numel
    if MASTER:
        p = _ld(w_ptr, offs, mask, EVEN)
    else:
        p = _ld(p_ptr, offs, mask, EVEN).to(tl.float32)
    g = _ld(g_ptr, offs, mask, EVEN).to(tl.float32)
    m = _ld(m_ptr, offs, mask, EVEN)
    v = _ld(v_ptr, offs, mask, EVEN)
    # The order of operations below is reference.py's (torch.optim.Adam's for-loop path); tl.fma stands
    # where torch's CPU kernels fuse (add with alpha, lerp, addcmul). fp fusion is off at launch so no
    # other product is fused.
    if SCALE:
        g = tl.div_rn(g, scale)
    if MAXIMIZE:
        g = -g
    if WD == 1:
        g = tl.fma(p, weight_decay, g)
    if WD == 2:
        p = p * decay
    if LERP_SMALL:
        m = tl.fma(lerp_weight, g - m, m)
    else:
        m = tl.fma(lerp_weight - 1.0, g - m, g)
    # torch's addcmul compiles to fma((1 - beta2) * g, g, v * beta2); measured: 0 of 5000 differ this way,
    # 376 with a separate add.
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    if AMSGRAD:
        vmax = _max_nan(_ld(vmax_ptr, offs, mask, EVEN), v)
        _st(vmax_ptr, offs, vmax, mask, EVEN)
        denom = tl.div_rn(tl.sqrt_rn(vmax), bc2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    _st(m_ptr, offs, m, mask, EVEN)
    _st(v_ptr, offs, v, mask, EVEN)
    if MASTER:
        _st(w_ptr, offs, p, mask, EVEN)
    _st(p_ptr, offs, _round_to(p, P_DTYPE), mask, EVEN)


@triton.jit
def _adam_kernel(
    rows, chunks, lr_ptr, lr_value, decay_value, scale_ptr, scale_value, found_inf_ptr,
    beta2, one_minus_beta2, lerp_weight, log_beta1, log_beta2, eps, weight_decay,
    P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    LR_PTR: tl.constexpr, SCALE: tl.constexpr, FOUND_INF: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    # SCALE: 0 no grad_scale, 1 value, 2 pointer. WD: 0 none, 1 L2 (Adam), 2 decoupled (AdamW).
    if FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(chunks + 2 * pid)
    start = tl.multiple_of(tl.load(chunks + 2 * pid + 1) * CHUNK, CHUNK)
    row = rows + t * 8
    numel = tl.load(row + 7)
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(P_DTYPE))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    vmax_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    w_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # Every pointer is 16-byte aligned (checked on the host), which is what lets the loads vectorise.
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        vmax_ptr = tl.multiple_of(vmax_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
    step = tl.load(tl.load(row + 6).to(tl.pointer_type(tl.float32)))

    if LR_PTR:
        lr = tl.load(lr_ptr).to(tl.float32)
        decay = tl.fma(-lr, weight_decay, 1.0)
    else:
        lr = lr_value
        decay = decay_value
    if SCALE == 2:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_value
    bc1 = _one_minus_pow(log_beta1, step)
    bc2 = _one_minus_pow(log_beta2, step)
    neg_step_size = -tl.div_rn(lr, bc1)
    bc2_sqrt = tl.sqrt_rn(bc2)

    if start + CHUNK <= numel:
        # Full chunk: no mask, so the accesses can be 16-byte vectors.
        for off in range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            _adam_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, numel,
                scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
                P_DTYPE, True, SCALE, AMSGRAD, MAXIMIZE, WD, MASTER, LERP_SMALL,
            )  # fmt: skip
    else:
        # (Loop names differ from the branch above: Triton merges same-named values of both branches, and
        # this trip count is int64.)
        for tail_off in range(0, numel - start, BLOCK):
            tail_offs = start + tail_off + tl.arange(0, BLOCK)
            _adam_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, tail_offs, numel,
                scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
                P_DTYPE, False, SCALE, AMSGRAD, MAXIMIZE, WD, MASTER, LERP_SMALL,
            )  # fmt: skip


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


@torch.no_grad()
def adam_step_(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
):  # fmt: skip
    _adam_step(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
        lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
    )  # fmt: skip


def _adam_step(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
    scalars_on_host: bool = False,
):  # fmt: skip
    """``scalars_on_host`` reads lr, grad_scale and found_inf on the host even when they are on the params'
    device: the path CPU scalars take with CUDA params, which tests on CPU tensors reach only this way."""
    check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, amsgrad)
    if len(params) == 0:
        return
    device = params[0].device
    for i, s in enumerate(state_steps):
        if s.device != device:
            raise RuntimeError(
                f"fastops.adam_step_: state_steps[{i}] is on {s.device} but params[0] is on {device}; "
                "the kernel reads each step through a pointer"
            )
    lr_t, lr_value = scalar_source(lr, device, "adam_step_", "lr", scalars_on_host)
    scale_t, scale_value = (None, 1.0)
    if grad_scale is not None:
        scale_t, scale_value = scalar_source(grad_scale, device, "adam_step_", "grad_scale", scalars_on_host)
    inf_t = None
    if found_inf is not None:
        inf_t, inf_value = scalar_source(found_inf, device, "adam_step_", "found_inf", scalars_on_host)
        if inf_t is None and inf_value != 0:
            return
    steps = list(state_steps)
    chunk, block, num_warps = block_sizes("adam")
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
    lerp_weight = 1 - beta1
    # torch.lerp picks its formula by |weight| < 0.5 on the fp32 weight.
    lerp_small = abs(struct.unpack("f", struct.pack("f", lerp_weight))[0]) < 0.5
    wd_mode = 0 if weight_decay == 0 else (2 if decoupled else 1)
    with device_scope(device):
        if inf_t is None:
            torch._foreach_add_(steps, 1)
        else:
            # A device op: a skipped step leaves the counters as they were, with no host read.
            torch._foreach_add_(steps, (inf_t.reshape(()) == 0).to(torch.float32))
        for dtype, idx in group_by_dtype(params).items():
            flat: list[int] = []
            for i in idx:
                flat += (
                    params[i].data_ptr(),
                    grads[i].data_ptr(),
                    exp_avgs[i].data_ptr(),
                    exp_avg_sqs[i].data_ptr(),
                    max_exp_avg_sqs[i].data_ptr() if amsgrad else 0,
                    master_params[i].data_ptr() if master_params else 0,
                    steps[i].data_ptr(),
                    params[i].numel(),
                )
            table = TABLES.get(("adam", device, chunk, tuple(flat)), flat, _ADAM_COLS, chunk, device)
            if table.n_chunks == 0:
                continue
            dummy = table.rows
            _adam_kernel[(table.n_chunks,)](
                table.rows, table.chunks,
                dummy if lr_t is None else lr_t, lr_value, 1 - lr_value * weight_decay,
                dummy if scale_t is None else scale_t, scale_value,
                dummy if inf_t is None else inf_t,
                beta2, 1 - beta2, lerp_weight, _log(beta1), _log(beta2), eps, weight_decay,
                P_DTYPE=_TL_DTYPE[dtype], CHUNK=chunk, BLOCK=block,
                LR_PTR=lr_t is not None,
                SCALE=0 if grad_scale is None else (1 if scale_t is None else 2),
                FOUND_INF=inf_t is not None, AMSGRAD=bool(amsgrad), MAXIMIZE=bool(maximize), WD=wd_mode,
                MASTER=bool(master_params), LERP_SMALL=lerp_small, ALIGNED=table.aligned,
                num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
