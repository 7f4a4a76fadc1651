"""fastops.data.Prefetcher's CUDA path (side stream, events, pinned staging pool, record_stream) on fakes.

torch.cuda's Stream, Event, current_stream, stream(), device() and the device tensors are replaced by objects that
log what the Prefetcher asks for, in order, so the ordering a GPU relies on is checked on a CPU machine:
- the host-to-device copy is enqueued on the side stream, never on the consumer's;
- the consumer's stream waits on an event recorded on the side stream after the batch's copy, before the
  consumer gets the batch;
- every device tensor of a batch is record_stream-ed on the consumer's stream;
- a staging buffer is written again only after the event recorded after its last copy was synchronized.
Device tensors are CPU tensors of a subclass that reports device cuda:0, so the copies really run and the
batches' values are checked too.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fastops import data

CUDA = torch.device("cuda", 0)


class Log:
    def __init__(self):
        self.entries: list[tuple] = []
        self._lock = threading.Lock()

    def add(self, *entry) -> None:
        with self._lock:
            self.entries.append(entry)

    def index(self, entry) -> int:
        return self.entries.index(entry)


class FakeStream:
    def __init__(self, log: Log, name: str):
        self.log, self.name, self.device = log, name, CUDA

    def wait_event(self, event) -> None:
        self.log.add("wait_event", self, event)

    def wait_stream(self, stream) -> None:
        self.log.add("wait_stream", self, stream)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    count = 0

    def __init__(self, log: Log):
        FakeEvent.count += 1
        self.log, self.id, self.stream = log, FakeEvent.count, None

    def record(self, stream=None) -> None:
        self.stream = stream
        self.log.add("record", self, stream)

    def synchronize(self) -> None:
        self.log.add("synchronize", self)

    def __repr__(self) -> str:
        return f"<event {self.id}>"


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on cuda:0; record_stream is logged."""

    log: Log

    @property
    def device(self):
        return CUDA

    def record_stream(self, stream) -> None:
        OnDevice.log.add("record_stream", self.untyped_storage().data_ptr(), stream)


def _buffer(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture
def fake_cuda(monkeypatch):
    log = Log()
    OnDevice.log = log
    default = FakeStream(log, "default")
    local = threading.local()

    def current_stream(device=None):
        return getattr(local, "stream", default)

    class stream_ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev = current_stream()
            local.stream = self.s

        def __exit__(self, *exc):
            local.stream = self.prev

    class device_ctx:
        def __init__(self, device):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    empty_strided = torch.empty_strided

    def empty_strided_on(size, stride, *, dtype=None, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            return empty_strided(size, stride, dtype=dtype).as_subclass(OnDevice)
        return empty_strided(size, stride, dtype=dtype, device=device, **kwargs)

    foreach_copy = torch._foreach_copy_

    def logged_copy(dsts, srcs, non_blocking=False):
        kind = "h2d" if isinstance(dsts[0], OnDevice) else "stage"
        log.add(kind, current_stream(), tuple(_buffer(d if kind == "stage" else s) for d, s in zip(dsts, srcs)))
        return foreach_copy(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "device", device_ctx)
    monkeypatch.setattr(torch, "empty_strided", empty_strided_on)
    monkeypatch.setattr(torch, "_foreach_copy_", logged_copy)
    log.default = default
    return log


def _batches(n: int):
    return [{"x": torch.full((4, 8), float(i)), "y": torch.arange(6) + i} for i in range(n)]


@pytest.mark.parametrize("background", [True, False], ids=["worker-thread", "inline"])
def test_copy_wait_record_stream_and_buffer_reuse_order(fake_cuda, background):
    log = fake_cuda
    n, depth = 7, 2
    pf = data.Prefetcher(_batches(n), device="cuda:0", depth=depth, background=background)
    pf._stager.pool.pin_memory = False  # the pool's switch for CPU tests: no pinned memory without a GPU
    got = []
    for i, batch in enumerate(pf):
        log.add("consumer_uses", i)
        assert isinstance(batch["x"], OnDevice) and batch["x"].device == CUDA
        torch.testing.assert_close(batch["x"].as_subclass(torch.Tensor), torch.full((4, 8), float(i)))
        torch.testing.assert_close(batch["y"].as_subclass(torch.Tensor), torch.arange(6) + i)
        got.append(i)
    assert got == list(range(n))

    entries = log.entries
    h2d = [k for k, e in enumerate(entries) if e[0] == "h2d"]
    stages = [k for k, e in enumerate(entries) if e[0] == "stage"]
    assert len(h2d) == len(stages) == n
    side = entries[h2d[0]][1]
    assert side.name == "side"
    for b, k in enumerate(h2d):
        assert entries[k][1] is side, f"batch {b}: copy enqueued on {entries[k][1]}, not the side stream"
        assert stages[b] < k, f"batch {b}: copied to the device before its staging buffer was filled"
        # The event the consumer waits on: recorded on the side stream after this copy (and before the next).
        end = h2d[b + 1] if b + 1 < n else len(entries)
        ready = [e[1] for e in entries[k:end] if e[0] == "record" and e[2] is side]
        assert ready, f"batch {b}: no event recorded on the side stream after its copy"
        used = log.index(("consumer_uses", b))
        waits = [j for j, e in enumerate(entries[:used]) if e[0] == "wait_event" and e[2] in ready]
        assert waits, f"batch {b}: the consumer used it without waiting on an event recorded after its copy"
        assert entries[waits[-1]][1] is log.default, "the wait must be on the consumer's stream"
        recorded = {e[1] for e in entries[waits[-1]:used] if e[0] == "record_stream" and e[2] is log.default}
        assert len(recorded) == 2, f"batch {b}: record_stream on the consumer's stream for {len(recorded)} of 2 tensors"

    # A staging buffer written again: the event recorded after the copy that last read it was synchronized first.
    last_reader: dict[int, int] = {}  # buffer -> index of the h2d copy that last read it
    reused = 0
    for b, k in enumerate(stages):
        for buf in entries[k][2]:
            if buf in last_reader:
                reused += 1
                copy = last_reader[buf]
                after_copy = [e[1] for e in entries[copy:k] if e[0] == "record" and e[2] is side]
                synced = {e[1] for e in entries[copy:k] if e[0] == "synchronize"}
                assert synced & set(after_copy), f"batch {b}: staging buffer refilled before its last copy was known done"
        for buf in entries[h2d[b]][2]:
            last_reader[buf] = h2d[b]
    # depth + 1 slots of two buffers each, reused by every batch after the first depth + 1.
    assert reused == 2 * (n - (depth + 1))
    pf.close()
