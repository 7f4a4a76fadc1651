"""Prefetching of batches onto the training device, in the background.

``Prefetcher(loader)`` wraps any iterable of batches (a ``DataLoader`` or not) and yields the same batches,
in the same order, already on the device. A daemon worker thread keeps ``depth`` batches ready, so loading
batch k+1 overlaps with the step on batch k.

On CUDA the worker copies each pageable host tensor into a pinned staging buffer (from a pool that is
reused, so pinned memory stays bounded) and from there to the device on one side stream. The consumer's
stream waits on a per-batch event and each device tensor is ``record_stream``-ed on it, so the caching
allocator cannot hand the memory to a later batch while the step still reads it. Filling the staging
buffers is one ``torch._foreach_copy_`` per batch, which runs without the GIL (measured in
``benchmarks/bench_prefetch.py``), so a C++ copy routine would gain nothing.

On the CPU the worker runs the loader (and ``transform``) ahead of the step. That pays off when loading
releases the GIL (file I/O, decoding in C, torch ops); a loader that is pure Python competes with the step for
the GIL and gains little.

Batches the loader may still own are copied. Run ahead, the worker resumes the loader while the step still
works on the batch before, and a loader that refills one buffer (``buf.fill_(i); yield buf``) would overwrite
it: the step would see later batches' data. So the worker clones each tensor of a batch before it resumes the
loader, unless the loader is a ``DataLoader`` whose batches are new tensors (``_fresh_batches``: worker
processes, or the default collate_fn); ``background=False`` never runs ahead and copies nothing on the CPU. On
CUDA the same rule sends host tensors that were pinned already through the staging pool as well (the
asynchronous copy would read them after the loader resumed) and copies tensors already on the device. The cost
is one more write and read of each batch, in the worker. On the shared 2-core development machine, with a
1-thread step of 17-28 ms, two runs gave: at 1 MiB per batch nothing above the noise (+-5 ms); at 16 MiB +3 to
+12 ms per step; at 64 MiB, where the copy outlasts the step, +20 to +23 ms with fastops' CPU block cache (which
``fastops.accelerate`` installs: it hands the freed blocks of earlier copies back) and +130 ms without it, where
each copy also page-faults fresh memory in.

Random numbers: torch's default generator, ``random`` and ``numpy.random`` are process-wide, with no
per-thread state to give the worker. A loader that draws from them in this process (a dataset with random
augmentations, a RandomSampler without a ``generator``, all under a ``DataLoader(num_workers=0)``) makes
those draws in the worker thread, interleaved with the step's own (dropout) in an order that changes from run
to run, so seeded runs stop being reproducible. ``background=False`` loads on the calling thread instead, in
the order of an unwrapped loop (on CUDA the copy to the device still runs on the side stream). With worker
processes (``num_workers > 0``) the dataset and collate_fn draw in those processes, from generators seeded by
``iter()`` on the calling thread, and a RandomSampler draws its seed there too; only a sampler that keeps
drawing from the global generators during the pass would still draw in the background thread.
"""

from __future__ import annotations

import collections.abc
import queue
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from ._util import forward_attribute, map_tensors, resolve_device

__all__ = ["Prefetcher"]

# Timeout of every blocking queue call. Short enough that the stop flag, a dead worker and Ctrl-C are
# noticed promptly; waking 10 times a second while idle costs nothing measurable.
_POLL_S = 0.1
_OK, _END, _ERR = 0, 1, 2


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, obj)
    return iter(found)


def _fresh_batches(iterable: Any) -> bool:
    """Whether each batch of ``iterable`` is made of new tensors that it keeps no hold of, so the worker may run
    ahead with them uncopied. Known only of what a DataLoader builds: batches from worker processes (they arrive
    through shared memory; a worker that refilled one would change it in the unwrapped loop too), and
    default_collate's, which stacks the samples into new tensors. Any other loader may refill, once resumed, a
    tensor it yielded (``buf.fill_(i); yield buf``), which in the unwrapped loop happens after the step on it.
    A wrapper that copies for itself says so with ``_fresh_batches = True``."""
    from torch.utils.data import DataLoader, default_collate

    if getattr(iterable, "_fresh_batches", False):
        return True
    if not isinstance(iterable, DataLoader):
        return False
    return iterable.num_workers > 0 or (iterable.batch_sampler is not None and iterable.collate_fn is default_collate)


def _dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """The strides a copy of ``t`` gets: its own for contiguous and channels_last layouts (as ``.to()``
    keeps them), contiguous ones for anything else (a strided slice is packed by the host copy)."""
    if (
        t.is_contiguous()
        or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
        or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))
    ):
        return t.stride()
    return torch.empty(t.shape, device="meta").stride()


class _PinnedPool:
    """Pinned staging buffers, reused round-robin by batch.

    Slot ``i`` holds one uint8 buffer per tensor leaf and one event recorded after the copies out of it;
    refilling the slot first waits on that event, so a buffer is never overwritten while its copy to the
    device is still queued. Memory is bounded by ``slots`` x the largest batch seen.
    """

    def __init__(self, slots: int, pin_memory: bool = True):
        self.pin_memory = pin_memory  # False only in the CPU tests of this code
        # Per slot and leaf: [uint8 buffer, (dtype, shape, stride), typed view of the buffer].
        self.buffers: list[list[list]] = [[] for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next_slot = 0
        self.allocations = 0  # how many pinned buffers were ever allocated (the CUDA tests read it)

    def take(self) -> int:
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.buffers)
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        return slot

    def staging(self, slot: int, leaf: int, t: torch.Tensor) -> torch.Tensor:
        """A pinned tensor shaped like ``t``. Views are cached: every torch call the worker makes costs a GIL
        re-acquisition, which waits up to 5 ms (sys.getswitchinterval()) when the consumer is busy in Python."""
        entries = self.buffers[slot]
        if leaf == len(entries):
            entries.append([torch.empty(0, dtype=torch.uint8), None, None])
        entry = entries[leaf]
        key = (t.dtype, t.shape, _dense_stride(t))
        if entry[1] != key:
            nbytes = t.numel() * t.element_size()
            if entry[0].numel() < nbytes:
                # Grows to the largest batch seen; the old buffer's copy is complete (take() waited on it).
                entry[0] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
                self.allocations += 1
            entry[1], entry[2] = key, entry[0][:nbytes].view(t.dtype).as_strided(t.shape, key[2])
        return entry[2]

    def done(self, slot: int, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self.events[slot] = event

    @property
    def nbytes(self) -> int:
        return sum(e[0].numel() for entries in self.buffers for e in entries)


class _Stager:
    """What the worker does to a batch, and what the consumer does on receiving it.

    Owned by the Prefetcher and handed to the worker thread instead of the Prefetcher itself, so that the
    thread never keeps the Prefetcher alive.
    """

    def __init__(
        self, device: torch.device, non_blocking: bool, transform: Callable | None, depth: int, copy: bool = False
    ):
        self.device = device
        self.non_blocking = non_blocking
        self.transform = transform
        self.copy = copy  # the loader may still own (and refill) the tensors it yields: take copies of them
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            # depth batches wait in the queue and one is being staged; their copies rarely lag behind,
            # so depth + 1 slots mean the worker almost never waits on a staging event.
            self.pool = _PinnedPool(depth + 1)

    def release(self) -> None:
        """Drops the pinned staging buffers, back to torch's pinned-memory cache where any pinned allocation
        can reuse them. Copies still reading them are safe: torch keeps a pinned block out of reuse until the
        asynchronous copies it recorded on it have finished."""
        if self.cuda:
            self.pool = _PinnedPool(len(self.pool.buffers), self.pool.pin_memory)

    def stage(self, batch: Any) -> Any:
        """Worker side: the batch on the device, with the event the consumer must wait on."""
        if not self.cuda:
            if self.copy:
                batch = map_tensors(torch.Tensor.clone, batch)
            return batch if self.transform is None else self.transform(batch)
        pool = self.pool  # once: release() may swap in a new pool while this batch is being staged
        with torch.cuda.device(self.device):
            producer = torch.cuda.current_stream()  # the worker thread's stream, where a loader ran its ops
            with torch.cuda.stream(self.stream), torch.no_grad():
                slot = pool.take()
                pageable: list[torch.Tensor] = []
                stagings: list[torch.Tensor] = []
                pinned: list[torch.Tensor] = []  # staging buffers, and host tensors that were pinned already
                outs: list[torch.Tensor] = []
                on_device: list[torch.Tensor] = []
                device_copies: list[torch.Tensor] = []

                def to_device(t: torch.Tensor) -> torch.Tensor:
                    if t.device == self.device:
                        on_device.append(t)
                        if not self.copy:
                            return t
                        device_copies.append(torch.empty_like(t))
                        return device_copies[-1]
                    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or not t.numel():
                        return t.to(self.device, non_blocking=self.non_blocking)
                    src = t
                    # A pinned tensor the loader may refill goes through the pool too: an asynchronous copy
                    # straight from it could still be reading it when the loader writes the next batch.
                    if not t.is_pinned() or self.copy:
                        src = pool.staging(slot, len(pageable), t)
                        pageable.append(t)
                        stagings.append(src)
                    out = torch.empty_strided(t.shape, _dense_stride(t), dtype=t.dtype, device=self.device)
                    pinned.append(src)
                    outs.append(out)
                    return out

                batch = map_tensors(to_device, batch)
                # One call each for all leaves: one GIL release and re-acquisition instead of one per tensor.
                # With another thread spinning in Python, 16 host copies of 4 MiB took 14-195 ms as 16
                # copy_ calls (up to 5 ms of GIL wait each) and 13-16 ms as one _foreach_copy_, against
                # 5-8 ms alone (2-core CPU, benchmarks/bench_prefetch.py).
                if pageable:
                    torch._foreach_copy_(stagings, pageable)  # on the CPU
                if outs:
                    # Mixed devices: torch runs this as a loop of copy_ in C++, with non_blocking honoured.
                    torch._foreach_copy_(outs, pinned, non_blocking=self.non_blocking)
                pool.done(slot, self.stream)
                if on_device and (self.transform is not None or self.copy):
                    # The transform or copy reads what the loader wrote on its stream. This also waits for the
                    # step's queued work, so it is only paid when the loader yields tensors already on the device.
                    self.stream.wait_stream(producer)
                if device_copies:
                    torch._foreach_copy_(device_copies, on_device)
                if self.transform is not None:
                    batch = self.transform(batch)
                ready = torch.cuda.Event()
                ready.record(self.stream)
        return batch, ready

    def receive(self, item: Any) -> Any:
        """Consumer side: make the consumer's current stream safe to use the batch."""
        if not self.cuda:
            return item
        batch, ready = item
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        for t in _tensors(batch):
            if t.device == self.device:
                # Without this, once the step drops the tensor the allocator may give its memory to a batch
                # the side stream is copying while the step's kernels are still reading it.
                t.record_stream(consumer)
        return batch


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _work(source: Iterator, q: queue.Queue, stop: threading.Event, stager: _Stager, threads: int) -> None:
    # A new thread starts with OpenMP/MKL's default team size (all cores), not the consumer's
    # torch.set_num_threads: two threads of 512x512 matmuls at 1 thread each took 0.39 s on 2 idle cores
    # without this and 0.24 s with it (1.8 s against 0.6 s while another process kept the cores busy).
    torch.set_num_threads(threads)
    finished = False
    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                finished = _put(q, (_END, None), stop)
                return
            if not _put(q, (_OK, stager.stage(batch)), stop):
                return
    except BaseException as e:  # noqa: BLE001 - everything goes to the consumer, as the same object
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note("(raised in the fastops.data.Prefetcher worker thread)")
        _put(q, (_ERR, e), stop)
    finally:
        if stop.is_set():
            _drain(q)  # a batch put just before the consumer's drain would otherwise wait in the queue
        if not finished:
            # A pass cut short (break, del, error, a new pass): the pinned buffers would otherwise stay with the
            # Prefetcher until close(). Released here, by the pool's only user, once it is done with it. A pass
            # that ran to its end keeps them for the next one.
            stager.release()


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def _shutdown(stop: threading.Event, q: queue.Queue) -> None:
    stop.set()
    _drain(q)  # frees the prefetched batches (device memory, on CUDA) now rather than with the queue


class Prefetcher:
    """Iterates ``iterable`` with the next ``depth`` batches loaded, moved to ``device`` and transformed
    in the background.

    Args:
        iterable: yields batches: tensors, possibly nested in dicts, lists, tuples, namedtuples, dataclasses
            and the containers torch's pytree knows (``fastops._util.map_tensors``). Other leaves pass through
            unchanged.
        device: where the batches go. ``None`` means the current CUDA device if CUDA is available, else
            the CPU. On the CPU the batches are passed through as they are, copied only where the loader may
            still own their tensors (see the module docstring).
        depth: how many batches to keep ready (>= 1).
        non_blocking: copy host to device asynchronously. ``False`` makes the worker wait for each copy;
            only useful for debugging.
        transform: ``transform(batch) -> batch``, run on the device batch (on CUDA, on the copy stream),
            e.g. uint8 to normalized float or channels_last. On the CPU it runs in the worker thread.
        background: load in the worker thread (the default). ``False`` loads each batch on the calling
            thread when the loop asks for it, for loaders that draw from the process-global random number
            generators (see the module docstring); on CUDA the copy still goes through the pinned pool and the
            side stream. ``depth`` is then unused.

    Each ``iter()`` starts a new pass (and stops the previous pass). ``len()`` and ``set_epoch()`` go to the
    wrapped iterable, and so do attributes the Prefetcher lacks (``dataset``, ``batch_size``, ``sampler``,
    ...). An exception raised by the iterable reaches the consumer after the batches before it, as the same
    exception object with its original traceback. Breaking out of the loop, deleting the iterator or garbage
    collection stop the worker and free the pinned staging buffers (a pass that runs to its end keeps them
    for the next pass); ``close()`` does both explicitly.
    """

    def __init__(
        self,
        iterable: Iterable,
        device: torch.device | str | int | None = None,
        depth: int = 2,
        non_blocking: bool = True,
        transform: Callable[[Any], Any] | None = None,
        background: bool = True,
    ):
        if not (isinstance(iterable, collections.abc.Iterable) or hasattr(type(iterable), "__getitem__")):
            raise TypeError(f"fastops.data.Prefetcher: expected an iterable of batches, got {type(iterable).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"fastops.data.Prefetcher: depth must be an int, got {type(depth).__name__}")
        if depth < 1:
            raise ValueError(f"fastops.data.Prefetcher: depth must be >= 1, got depth={depth}")
        if transform is not None and not callable(transform):
            raise TypeError(f"fastops.data.Prefetcher: transform must be callable, got {type(transform).__name__}")
        self.iterable = iterable
        self.device = resolve_device(device, who="fastops.data.Prefetcher")
        self.depth = depth
        self.background = bool(background)
        # Run ahead, the worker would hand the step tensors that the loader, resumed meanwhile, may refill.
        copy = not _fresh_batches(iterable) and (self.background or self.device.type == "cuda")
        self._stager = _Stager(self.device, non_blocking, transform, depth, copy=copy)
        self._worker: tuple[threading.Thread, threading.Event, queue.Queue] | None = None
        self._inline_pass: weakref.ref | None = None

    def __iter__(self) -> Iterator:
        # The previous pass must be over before a new one starts: a DataLoader with persistent_workers
        # hands out the same iterator again, which two passes must not advance at once.
        self._stop_worker()
        if not self.background:
            gen = self._inline(iter(self.iterable))
            self._inline_pass = weakref.ref(gen)
            return gen
        source = iter(self.iterable)
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        args = (source, q, stop, self._stager, torch.get_num_threads())
        thread = threading.Thread(target=_work, args=args, name="fastops-prefetch", daemon=True)
        del source, args  # the worker's references are the only ones: the loader's iterator dies with it
        thread.start()
        self._worker = (thread, stop, q)
        gen = self._consume(thread, stop, q)
        # Also covers an iterator that is never started (its finally clause would never run).
        weakref.finalize(gen, _shutdown, stop, q)
        return gen

    def _consume(self, thread: threading.Thread, stop: threading.Event, q: queue.Queue) -> Iterator:
        try:
            while True:
                try:
                    kind, item = q.get(timeout=_POLL_S)
                except queue.Empty:
                    if not thread.is_alive() and q.empty():
                        if stop.is_set():
                            return  # stopped by close() or a newer pass
                        raise RuntimeError("fastops.data.Prefetcher: the worker thread died") from None
                    continue
                if kind == _END:
                    return
                if kind == _ERR:
                    raise item
                yield self._stager.receive(item)
                del item  # do not keep the batch alive while waiting for the next one
        finally:
            _shutdown(stop, q)

    def _inline(self, source: Iterator) -> Iterator:
        finished = False
        try:
            for batch in source:
                yield self._stager.receive(self._stager.stage(batch))
            finished = True
        finally:
            if not finished:
                self._stager.release()

    def _stop_worker(self) -> None:
        inline = self._inline_pass() if self._inline_pass is not None else None
        self._inline_pass = None
        if inline is not None:
            inline.close()  # runs its finally now, not when it is collected
        if self._worker is None:
            return
        thread, stop, q = self._worker
        self._worker = None
        _shutdown(stop, q)
        if thread is not threading.current_thread():
            thread.join()  # returns once the loader's current next() does

    def close(self) -> None:
        """Stops the worker, waits for it, and frees the pinned staging buffers."""
        self._stop_worker()
        self._stager.release()

    def __getattr__(self, name: str) -> Any:
        return forward_attribute(self, "iterable", name)

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]  # TypeError as the iterable's own when it has none

    def set_epoch(self, epoch: int) -> None:
        """Calls ``set_epoch(epoch)`` on the wrapped loader's sampler (``.sampler``, ``.batch_sampler.sampler``,
        e.g. a ``DistributedSampler``) and on the iterable itself, where they have one; a no-op otherwise,
        so the same training loop works with and without a distributed sampler."""
        it = self.iterable
        candidates = (getattr(it, "sampler", None), getattr(getattr(it, "batch_sampler", None), "sampler", None), it)
        seen: set[int] = set()
        for obj in candidates:
            if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
                seen.add(id(obj))
                obj.set_epoch(epoch)
