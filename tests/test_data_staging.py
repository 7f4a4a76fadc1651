"""fastops.data.Prefetcher: loading on the calling thread, attributes, bad input, the transform, overlap and
interrupts, the CUDA staging code run on the CPU with fake streams, and stream safety on a real GPU.

No test asserts on time: overlap is checked through the order of events, and timeouts only keep a broken
Prefetcher from hanging the suite.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastops.data import Prefetcher, _PinnedPool, _Stager
# no_leaked_workers: an autouse fixture, active in this module once imported
from tests.data_helpers import (  # noqa: F401
    Pair, _batches, _prefetch_threads, _wait_no_workers, needs_cuda, no_leaked_workers)


# ---- loading on the calling thread, attributes ----


def test_background_false_loads_on_the_calling_thread_in_loop_order():
    def loader():  # a random augmentation, drawing from the global generator
        for i in range(6):
            yield threading.current_thread().name, torch.rand(2)

    def run(wrap):
        torch.manual_seed(0)
        out = []
        for name, x in wrap(loader()):
            out.append((name, x, torch.rand(2)))  # the step's own draw (dropout)
        return out

    before = _prefetch_threads()
    plain = run(lambda it: it)
    inline = run(lambda it: Prefetcher(it, device="cpu", background=False))
    assert _prefetch_threads() == before
    assert [n for n, _, _ in inline] == [threading.current_thread().name] * 6
    for (_, x, s), (_, x2, s2) in zip(plain, inline):  # the draws in the order of the unwrapped loop
        assert torch.equal(x, x2) and torch.equal(s, s2)


def test_attributes_of_the_wrapped_loader():
    ds = TensorDataset(torch.arange(10.0))
    dl = DataLoader(ds, batch_size=4)
    pf = Prefetcher(dl, device="cpu")
    assert pf.dataset is ds and pf.batch_size == 4 and pf.sampler is dl.sampler and pf.num_workers == 0
    assert pf.depth == 2  # its own attributes come first
    with pytest.raises(AttributeError, match="no_such_thing"):
        pf.no_such_thing
    with pytest.raises(AttributeError, match="_private"):
        pf._private  # private names are not forwarded
    clone = copy.copy(pf)  # copy probes a bare instance for __setstate__: no recursion into __getattr__
    assert clone.dataset is ds


# ---- bad input ----


def test_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        Prefetcher([], depth=0)
    with pytest.raises(TypeError, match="depth"):
        Prefetcher([], depth=2.0)  # type: ignore[arg-type]


def test_bad_device():
    with pytest.raises(ValueError, match="nonsense"):
        Prefetcher([], device="nonsense")
    with pytest.raises(ValueError, match="meta"):
        Prefetcher([], device="meta")
    missing = "cuda:1" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=missing):
        Prefetcher([], device=missing)


def test_not_iterable():
    with pytest.raises(TypeError, match="int"):
        Prefetcher(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="transform"):
        Prefetcher([], transform=3)  # type: ignore[arg-type]


def test_default_device():
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert Prefetcher([]).device == want


# ---- transform, overlap, interrupts ----


def test_transform_on_cpu_runs_in_worker():
    threads = set()

    def normalize(batch):
        threads.add(threading.current_thread().name)
        return {"x": batch["x"].float().div_(255), "y": batch["y"]}

    src = [{"x": torch.full((2, 2), 255, dtype=torch.uint8), "y": i} for i in range(4)]
    out = list(Prefetcher(src, device="cpu", transform=normalize))
    assert [o["y"] for o in out] == [0, 1, 2, 3]
    assert all(o["x"].dtype == torch.float32 and torch.all(o["x"] == 1) for o in out)
    assert threads == {"fastops-prefetch"}


def test_loading_overlaps_with_the_step():
    # While the loop holds batch i the worker must already be loading batch i + 1: each step waits for that.
    # A Prefetcher that loaded on request only would never get there (the timeout just ends the test).
    asked = [threading.Event() for _ in range(6)]

    def loader():
        for i in range(6):
            asked[i].set()
            yield i

    for i in Prefetcher(loader(), device="cpu", depth=1):
        if i + 1 < len(asked):
            assert asked[i + 1].wait(timeout=30), f"batch {i + 1} was not loaded during step {i}"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_while_waiting_for_a_batch_does_not_hang():
    release = threading.Event()

    def stuck_loader():
        yield 0
        release.wait(30)  # a loader that takes forever on batch 1
        yield 1

    def on_alarm(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        it = iter(Prefetcher(stuck_loader(), device="cpu"))
        assert next(it) == 0
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            next(it)  # the loader holds batch 1 for 30 s; the interrupt must not wait for it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()  # let the worker finish the loader's next() and see the stop flag
    del it


def test_exception_in_the_step_stops_the_worker():
    before = _prefetch_threads()
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(Prefetcher(_batches(100), device="cpu")):
            if i == 3:
                raise KeyboardInterrupt
    assert _wait_no_workers(before) == before


# ---- the CUDA staging code, run on the CPU ----


class _FakeStream:
    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _FakeEvent:
    synchronized = 0

    def record(self, stream=None):
        pass

    def synchronize(self):
        _FakeEvent.synchronized += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """Streams and events faked and "cpu:0" standing in for the GPU, so that CPU-only CI runs the CUDA path's
    staging code. Returns a factory of such stagers."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    _FakeEvent.synchronized = 0

    def stager(depth: int = 2) -> _Stager:
        s = _Stager(torch.device("cpu", 0), True, None, depth=depth)
        s.cuda, s.stream, s.pool = True, _FakeStream(), _PinnedPool(depth + 1, pin_memory=False)
        return s

    return stager


def test_staging_path_with_fake_cuda(fake_cuda):
    """Staging, slot reuse and layouts of the CUDA path. Stream ordering itself is only covered on CUDA below."""
    stager = fake_cuda(depth=2)
    kept = []
    for i in range(12):
        n = [1000, 5000, 3000, 200][i % 4]
        batch = {
            "x": torch.randn(n),
            "pair": Pair(torch.arange(2 * n)[::2], "label"),  # a strided slice: packed contiguous
            "cl": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
            "u8": torch.randint(0, 255, (n,), dtype=torch.uint8),
            "empty": torch.empty(0),
        }
        out = stager.receive(stager.stage(batch))
        for k in ("x", "cl", "u8"):
            assert torch.equal(out[k], batch[k]) and out[k].data_ptr() != batch[k].data_ptr()
        assert torch.equal(out["pair"].image, batch["pair"].image) and out["pair"].image.is_contiguous()
        assert out["pair"].label == "label" and out["empty"].numel() == 0
        assert out["cl"].is_contiguous(memory_format=torch.channels_last)
        kept.append((out, batch))
    # The outputs are copies, not views of the staging buffers that later batches overwrote.
    assert all(torch.equal(out["x"], batch["x"]) for out, batch in kept)
    assert _FakeEvent.synchronized == 12 - 3  # every refill of a used slot waited on its event
    # Buffers are reused: 21 allocations (12 first fills, then growth to larger batches) for 48 staged tensors.
    assert stager.pool.allocations < 12 * 4


@pytest.mark.parametrize("background", [True, False])
def test_staging_buffers_released_when_a_pass_stops_early(fake_cuda, background):
    before = _prefetch_threads()
    pf = Prefetcher([torch.randn(1000) for _ in range(10)], device="cpu", background=background)
    pf._stager = fake_cuda(depth=2)
    assert len(list(pf)) == 10
    assert pf._stager.pool.nbytes > 0  # a pass that ran to its end keeps them for the next one
    for i, _ in enumerate(pf):
        if i == 2:
            break
    assert _wait_no_workers(before) == before  # the worker releases them on its way out
    assert pf._stager.pool.nbytes == 0
    it = iter(pf)
    next(it)
    del it
    assert _wait_no_workers(before) == before
    assert pf._stager.pool.nbytes == 0


# ---- CUDA ----


@needs_cuda
@pytest.mark.parametrize("own_stream", [False, True])
def test_cuda_contents_intact_with_a_slow_step_and_buffer_reuse(own_stream):
    # 4 MiB per batch, 24 batches, depth 2: the staging pool is reused 8 times over and the allocator
    # would happily hand a freed batch's memory to the next copy. The step sleeps on the GPU before
    # reading its batch, so a missing event wait or record_stream shows up as a wrong sum.
    n, numel = 24, 1 << 20
    src = [{"x": torch.full((numel,), i, dtype=torch.int32), "i": i} for i in range(n)]
    pf = Prefetcher(src, device="cuda", depth=2)
    stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
    sums = []
    with torch.cuda.stream(stream):
        for b in pf:
            torch.cuda._sleep(20_000_000)  # ~10 ms at 2 GHz, much longer than the copy
            sums.append(b["x"].sum())
            del b
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [i * numel for i in range(n)]
    pool = pf._stager.pool
    assert pool.allocations <= len(pool.buffers)  # one leaf per batch: at most one buffer per slot


@needs_cuda
def test_cuda_consumer_waits_for_copy_and_transform():
    # The transform's output is written only after a GPU sleep on the side stream: a consumer that did not
    # wait on the batch's event would read it before it exists.
    def slow_transform(x):
        torch.cuda._sleep(20_000_000)
        return x + 1

    src = [torch.full((1 << 18,), float(i)) for i in range(8)]
    got = [b.sum() for b in Prefetcher(src, device="cuda", transform=slow_transform)]
    torch.cuda.synchronize()
    assert [float(s) for s in got] == [(i + 1.0) * (1 << 18) for i in range(8)]


@needs_cuda
def test_cuda_pinned_pool_is_bounded():
    sizes = [1000, 5000, 3000, 5000, 200] * 6  # varying batch sizes, two leaves each
    src = [(torch.randn(s), torch.randint(0, 9, (s, 2))) for s in sizes]
    pf = Prefetcher(src, device="cuda", depth=2)
    for (x, y), (a, b) in zip(pf, src):
        assert torch.equal(x.cpu(), a) and torch.equal(y.cpu(), b)
    pool = pf._stager.pool
    slots = len(pool.buffers)
    # Each (slot, leaf) buffer grows at most twice, then is reused; without a pool it would be 60.
    assert pool.allocations <= slots * 2 * 2
    assert pool.nbytes <= slots * (5000 * 4 + 5000 * 2 * 8)
    pf.close()
    assert pf._stager.pool.nbytes == 0


@needs_cuda
def test_cuda_pinned_and_device_tensors_are_not_staged():
    pinned = [torch.full((1000,), float(i)).pin_memory() for i in range(5)]
    pf = Prefetcher(pinned, device="cuda")
    assert [b[0].item() for b in pf] == [float(i) for i in range(5)]
    assert pf._stager.pool.allocations == 0
    on_gpu = [torch.full((10,), float(i), device="cuda") for i in range(3)]
    assert all(y is x for x, y in zip(on_gpu, Prefetcher(on_gpu, device="cuda")))


@needs_cuda
def test_cuda_transform_runs_on_the_side_stream():
    streams = []

    def transform(b):
        streams.append(torch.cuda.current_stream())
        return b.float().div(255).contiguous(memory_format=torch.channels_last)

    src = [torch.full((2, 3, 8, 8), 255, dtype=torch.uint8) for _ in range(4)]
    pf = Prefetcher(src, device="cuda", transform=transform)
    out = list(pf)
    assert all(o.is_cuda and o.dtype == torch.float32 and torch.all(o == 1) for o in out)
    assert all(o.is_contiguous(memory_format=torch.channels_last) for o in out)
    assert all(s == pf._stager.stream for s in streams)
    assert pf._stager.stream != torch.cuda.current_stream()


@needs_cuda
def test_cuda_layouts_kept_and_strided_slices_packed():
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    sliced = torch.randn(8, 8)[:, ::2]
    (a, b), = list(Prefetcher([(cl, sliced)], device="cuda"))
    assert a.is_contiguous(memory_format=torch.channels_last) and torch.equal(a.cpu(), cl)
    assert b.is_contiguous() and torch.equal(b.cpu(), sliced)
