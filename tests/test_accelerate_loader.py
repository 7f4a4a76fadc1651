"""fastops.accelerate's loaders: kinds of loaders and set_epoch, loaders that refill one buffer, a DataLoader
read on the loop's thread, its attributes; regional compilation's smoke test."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastops.accelerate import Accelerator, _loader, accelerate
from tests.accelerate_helpers import Noisy, batches, loop, make


class _Epochs:
    """An iterable that records set_epoch calls."""

    def __init__(self, data):
        self.data, self.epochs = data, []

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_loader_kinds_and_set_epoch():
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(5)
    src = _Epochs(data)
    acc = Accelerator(precision="fp32")
    acc.prepare(*make())
    loader = acc.prepare(src)
    for _ in range(3):
        got = list(loader)
    assert src.epochs == [0, 1, 2] and len(loader) == 5
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, data))
    gen = acc.prepare(b for b in data)
    assert len(list(gen)) == 5
    ds = TensorDataset(torch.arange(10.0))
    dl = acc.prepare(DataLoader(ds, batch_size=4))
    assert [b[0].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _refilling(n: int, produced: list | None = None):
    """A loader that refills one buffer for every batch."""
    buf = torch.zeros(8, 6)
    for i in range(n):
        buf.fill_(i)
        if produced is not None:
            produced[i].set()
        yield buf, torch.zeros(8, dtype=torch.long)


def test_a_loader_that_refills_one_buffer_gives_the_plain_loops_batches():
    n = 6
    produced = [threading.Event() for _ in range(n)]
    model, opt = make()
    _, _, loader = accelerate(model, opt, _refilling(n, produced), precision="fp32")
    seen = []
    for i, (x, _) in enumerate(loader):
        if i + 1 < n:
            assert produced[i + 1].wait(timeout=30)  # the loader has refilled its buffer meanwhile
        seen.append(x[0, 0].item())
    assert seen == [float(i) for i in range(n)]
    # With several ranks, each reads a whole round before it yields its own batch of it.
    for rank in (0, 1):
        got = [x[0, 0].item() for x, _ in _loader.RoundRobin(_refilling(7), rank, 2)]
        assert got == [float(i) for i in range(rank, 6, 2)]


def test_dataloader_without_workers_is_read_on_the_loops_thread():
    ds = Noisy()
    acc = Accelerator(precision="fp32")
    model, opt = acc.prepare(*make(dropout=0.3))
    loop(model, opt, acc.prepare(DataLoader(ds, batch_size=4, shuffle=True)))
    # In the Prefetcher's thread, its draws would interleave with dropout's in a different order every run.
    assert ds.threads == {threading.current_thread().name}
    with_workers = acc.prepare(DataLoader(ds, batch_size=4, num_workers=1))
    assert with_workers.prefetcher.background  # worker processes draw from their own generators


def test_prepared_loader_exposes_the_dataloaders_attributes():
    ds = TensorDataset(torch.arange(10.0))
    dl = DataLoader(ds, batch_size=4)
    acc = Accelerator(precision="fp32")
    acc.prepare(*make())
    loader = acc.prepare(dl)
    assert loader.dataset is ds and loader.batch_size == 4 and loader.sampler is dl.sampler
    assert loader.prefetcher.dataset is ds and loader.epoch == 0
    with pytest.raises(AttributeError, match="no_such_thing"):
        loader.no_such_thing
    clone = copy.copy(loader)  # copy probes a bare instance for __setstate__: no recursion into __getattr__
    assert clone.dataset is ds


def test_compile_smoke():
    # CI and the dev machines have gcc, so inductor must compile here: any failure is a real one.
    model, opt = make()
    model, opt, loader = accelerate(model, opt, batches(3), precision="fp32", compile=True)
    losses = loop(model, opt, loader)
    assert all(torch.isfinite(torch.tensor(losses)))
