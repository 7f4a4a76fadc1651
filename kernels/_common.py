"""What the Triton kernels share: the chunk and tensor tables (built once per set of pointers and cached),
where a scalar argument is read from, the masked/unmasked load and store helpers and the fp32 -> bf16
rounding. Per-op files (``adam.py``, ``sgd.py``, ``amp.py``) import from here and never from each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import torch
import triton
import triton.language as tl


TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Largest finite fp32. |x| <= this is false exactly for inf and nan, and unlike x - x == 0 no compiler
# flag can fold it away.
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)

# op -> (CHUNK, BLOCK, num_warps). One program covers CHUNK elements of one tensor, BLOCK per loop trip.
# Adam runs BLOCK=1024 over 8 warps, 4 elements a thread for every stream: at 4 warps (8 a thread) the bf16/fp16
# specs loaded their 16-bit streams 8 a thread and the fp32 ones 4, and took 139-184 registers and 4-8 layout
# conversions on sm_90; at 8 warps every spec takes 48 registers and none (compile-check). CHUNK=16384
# makes a 1B-param model 61k programs (a table of 1 MiB) and wastes at most one partial chunk per tensor.
# SGD runs 8 warps (4 elements a thread a trip): at 4 its bf16 specs took up to 118 registers on sm_90 and one
# (unaligned, master weights, momentum) spilled 16 bytes; at 8 they take 39-48, none spills (compile-check).
_BLOCK_SIZES = {
    "adam": (16384, 1024, 8),
    "sgd": (16384, 1024, 8),
    # Low-precision Adam: 4 elements a thread for every stream (uint8, bf16, fp32), one layout, no conversion.
    # Two 256-element quantization blocks a trip over 4 warps: at four over 8 warps the 8-bit specs took up to
    # 124 registers on sm_90, and two with master weights kept 16 bytes on the stack across the div.rn/sqrt.rn
    # slow-path calls on sm_100 (STL/LDL in the loop); at two they take at most 72 and none spills.
    "adam_lowp": (16384, 512, 4),
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


def scalar_source(t: torch.Tensor, device: torch.device, on_host: bool = False):
    """Where the kernel gets a one-element tensor's value: ``(t, 0.0)`` to read it through a pointer (it is on
    ``device``), or ``(None, value)`` when it is a CPU tensor read here (no device sync), or ``on_host``. The op
    checked it already."""
    if t.device == device and not on_host:
        return t, 0.0
    return None, float(t.item())


class StepScalars:
    """Where an optimizer step's kernel reads lr, grad_scale and found_inf: through a pointer when the tensor
    is on the params' device (no host read, so the launch can be captured in a CUDA graph), else the value,
    read here from a CPU tensor. ``host_scalars`` names those to read here even on the params' device: the path CPU
    scalars take with CUDA params, which CPU tensors reach only this way (the launchers' option of that name)."""

    __slots__ = ("lr_t", "lr", "scale_t", "scale", "scale_mode", "inf_t", "skip")

    def __init__(self, device: torch.device, lr, grad_scale, found_inf, host_scalars=()):
        self.lr_t, self.lr = scalar_source(lr, device, "lr" in host_scalars)
        self.scale_t, self.scale = None, 1.0
        if grad_scale is not None:
            self.scale_t, self.scale = scalar_source(grad_scale, device, "grad_scale" in host_scalars)
        # The kernels' SCALE constexpr: 0 no grad_scale, 1 its value, 2 its pointer.
        self.scale_mode = 0 if grad_scale is None else (1 if self.scale_t is None else 2)
        self.inf_t, inf = None, 0.0
        if found_inf is not None:
            self.inf_t, inf = scalar_source(found_inf, device, "found_inf" in host_scalars)
        # A CPU found_inf that is set: the step is skipped without a launch.
        self.skip = self.inf_t is None and inf != 0

    def pointers(self, dummy: torch.Tensor) -> tuple:
        """The (lr, grad_scale, found_inf) pointer arguments, ``dummy`` standing in for those read as values."""
        return tuple(dummy if t is None else t for t in (self.lr_t, self.scale_t, self.inf_t))


def step_scalars(a, host_scalars) -> StepScalars | None:
    """The ``StepScalars`` of an optimizer op's arguments ``a`` (its ``Args`` record), or None where there is nothing
    to launch: no params, or a CPU found_inf that is set."""
    if len(a.params) == 0:
        return None
    sc = StepScalars(a.params[0].device, a.lr, a.grad_scale, a.found_inf, host_scalars)
    return None if sc.skip else sc


def tensor_table(op: str, device: torch.device, chunk: int, idx, row, ncols: int) -> Table:
    """The cached table of the tensors ``idx``: ``row(i)`` gives tensor i's ``ncols`` entries (its pointers,
    0 for an absent one, then its numel)."""
    flat: list[int] = []
    for i in idx:
        flat += row(i)
    return TABLES.get((op, device, chunk, tuple(flat)), flat, ncols, chunk, device)


def group_by_dtype(tensors) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


@triton.jit
def ld(ptr, offs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr + offs)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def st(ptr, offs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr + offs, value)
    else:
        tl.store(ptr + offs, value, mask=mask)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
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
def chunk_of(chunks, CHUNK: tl.constexpr):
    """This program's entry of the chunk table: (program id, tensor index, first element of the chunk)."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(chunks + 2 * pid)
    start = tl.multiple_of(tl.load(chunks + 2 * pid + 1) * CHUNK, CHUNK)
    return pid, t, start


@triton.jit
def table_ptr(row, col: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Column ``col`` of a tensor-table row as a pointer to DTYPE. ALIGNED: every pointer of the table is
    16-byte aligned (checked on the host), which is what lets the accesses vectorise."""
    ptr = tl.load(row + col).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def scalar_value(ptr, value, FROM_PTR: tl.constexpr):
    """A scalar argument as ``StepScalars``/``scalar_source`` hand it over: read through ``ptr`` (any floating
    dtype, used as fp32) or ``value``."""
    if FROM_PTR:
        return tl.load(ptr).to(tl.float32)
    else:
        return value
