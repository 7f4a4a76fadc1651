"""fastops.data.Prefetcher on the CPU: order and structure, errors from the loader, cleanup, re-iteration, len and
set_epoch. Loading on the calling thread, bad input, overlap and CUDA stream safety: test_data_staging.py.

No test asserts on time: overlap is checked through the order of events, and timeouts only keep a broken
Prefetcher from hanging the suite. The benchmark is where the speedup is measured.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from fastops.data import Prefetcher
# no_leaked_workers: an autouse fixture, active in this module once imported
from tests.data_helpers import Pair, no_leaked_workers, _prefetch_threads, _wait_no_workers, _batches  # noqa: F401


# ---- order, structure ----


def test_order_is_preserved():
    src = _batches(50)
    out = list(Prefetcher(src, device="cpu"))
    assert len(out) == 50
    for i, b in enumerate(out):
        assert b[0].item() == i


def test_generator_source():
    out = [b[0].item() for b in Prefetcher((torch.tensor([i]) for i in range(10)), device="cpu", depth=3)]
    assert out == list(range(10))




@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    meta: dict
    name: str = "s"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    k: int


class Record(dict):
    """A dict subclass torch's pytree does not know."""


class Items(list):
    pass


def test_structure_and_non_tensor_leaves_pass_through():
    a, b, c = torch.randn(2, 3), torch.arange(5), torch.zeros(1)
    batch = {
        "pair": Pair(a, 7),
        "list": [b, "text", None, 3.5],
        "tuple": (c, (a,)),
        "sample": Sample(a, {"ids": b, "k": "v"}),
        "frozen": Frozen(c, 2),
        "od": collections.OrderedDict(z=a, y=1),
        "dd": collections.defaultdict(list, {"t": b}),
        "record": Record(x=a, tag="r"),
        "items": Items([b, Frozen(c, 3)]),
        "opaque": types.SimpleNamespace(x=a),
    }
    (out,) = list(Prefetcher([batch], device="cpu", background=False))  # the path that copies no tensor
    assert type(out["pair"]) is Pair and out["pair"].image is a and out["pair"].label == 7
    assert out["list"][0] is b and out["list"][1:] == ["text", None, 3.5]
    assert type(out["tuple"]) is tuple and out["tuple"][0] is c and out["tuple"][1][0] is a
    assert type(out["sample"]) is Sample and out["sample"].x is a and out["sample"].meta["ids"] is b
    assert out["sample"].name == "s" and out["sample"].meta["k"] == "v"
    assert type(out["frozen"]) is Frozen and out["frozen"].x is c and out["frozen"].k == 2
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["z", "y"]
    assert type(out["dd"]) is collections.defaultdict and out["dd"]["missing"] == []
    assert type(out["record"]) is Record and out["record"]["tag"] == "r"
    assert type(out["items"]) is Items and type(out["items"][1]) is Frozen
    assert out["opaque"] is batch["opaque"]  # a container fastops does not look into is the same object


def test_cpu_copies_only_what_the_loader_may_still_own():
    src = _batches(5)
    for x, y in zip(src, Prefetcher(src, device="cpu", background=False)):
        assert y is x  # not run ahead: nothing to copy
    for x, y in zip(src, Prefetcher(src, device="cpu")):
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    # DataLoaders whose batches are new tensors: worker processes, or the default collate_fn.
    ds = TensorDataset(torch.arange(8.0))
    assert not Prefetcher(DataLoader(ds, batch_size=2), device="cpu")._stager.copy
    workers = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=lambda b: b)
    assert not Prefetcher(workers, device="cpu")._stager.copy
    assert Prefetcher(DataLoader(ds, batch_size=2, collate_fn=lambda b: b), device="cpu")._stager.copy
    assert Prefetcher(DataLoader(ds, batch_size=None), device="cpu")._stager.copy  # samples as the dataset has them


def _refilling_loader(n: int, produced: list[threading.Event]):
    """Refills one buffer for every batch, as loaders that avoid allocations do."""
    buf = {"x": torch.zeros(4), "ids": [torch.zeros(2, dtype=torch.long)]}
    for i in range(n):
        buf["x"].fill_(i)
        buf["ids"][0].fill_(i)
        produced[i].set()
        yield buf


@pytest.mark.parametrize("background", [True, False])
def test_a_loader_that_refills_one_buffer_gives_the_plain_loops_batches(background):
    n = 8
    produced = [threading.Event() for _ in range(n)]
    seen = []
    for i, batch in enumerate(Prefetcher(_refilling_loader(n, produced), device="cpu", depth=2, background=background)):
        if background and i + 1 < n:
            # The worker has resumed the loader, which refilled its buffer, before the step reads the batch.
            assert produced[i + 1].wait(timeout=30)
        seen.append((batch["x"][0].item(), batch["ids"][0][0].item()))
    assert seen == [(float(i), i) for i in range(n)]


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 4), min_size=0, max_size=12), depth=st.integers(1, 4))
def test_any_sequence_round_trips(sizes, depth):
    src = [[torch.full((s,), float(i)), {"i": i}] for i, s in enumerate(sizes)]
    out = list(Prefetcher(src, device="cpu", depth=depth))
    assert [o[1]["i"] for o in out] == list(range(len(sizes)))
    assert all(torch.equal(o[0], s[0]) for o, s in zip(out, src))


# ---- errors from the loader ----


class LoaderError(Exception):
    pass


def _failing_loader(k: int, raised: list):
    for i in range(10):
        if i == k:
            err = LoaderError(f"bad batch {i}")
            raised.append(err)
            raise err
        yield torch.tensor([i])


@pytest.mark.parametrize("k", [0, 3])
def test_loader_error_reaches_consumer_after_earlier_batches(k):
    raised: list = []
    got = []
    with pytest.raises(LoaderError) as info:
        for b in Prefetcher(_failing_loader(k, raised), device="cpu"):
            got.append(b.item())
    assert got == list(range(k))
    assert info.value is raised[0]  # the original object, not a copy or a wrapper
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_loader" in frames


def test_transform_error_reaches_consumer():
    def transform(b):
        if b.item() == 2:
            raise ZeroDivisionError("in transform")
        return b

    got = []
    with pytest.raises(ZeroDivisionError, match="in transform"):
        for b in Prefetcher([torch.tensor([i]) for i in range(5)], device="cpu", transform=transform):
            got.append(b.item())
    assert got == [0, 1]


# ---- cleanup ----


def test_early_break_stops_worker():
    before, total = _prefetch_threads(), len(threading.enumerate())
    pf = Prefetcher(_batches(100), device="cpu")
    for i, _ in enumerate(pf):
        if i == 2:
            break
    assert _wait_no_workers(before) == before
    assert len(threading.enumerate()) == total


def test_del_and_gc_stop_worker_and_free_the_prefetcher():
    import weakref

    before = _prefetch_threads()
    pf = Prefetcher(_batches(100), device="cpu")
    it = iter(pf)
    next(it)
    ref = weakref.ref(pf)
    del pf, it
    assert _wait_no_workers(before) == before
    assert ref() is None, "something (the worker?) still holds the Prefetcher"


def test_never_started_iterator_is_cleaned_up():
    before = _prefetch_threads()
    it = iter(Prefetcher(_batches(100), device="cpu"))
    time.sleep(0.05)
    del it
    assert _wait_no_workers(before) == before


def test_close_stops_worker():
    before = _prefetch_threads()
    pf = Prefetcher(_batches(100), device="cpu")
    it = iter(pf)
    next(it)
    pf.close()
    assert _prefetch_threads() == before  # close() joins
    assert list(it) == []  # the stopped iterator ends instead of hanging


def test_worker_stays_depth_ahead():
    produced = []

    def loader():
        for i in range(100):
            produced.append(i)
            yield i

    it = iter(Prefetcher(loader(), device="cpu", depth=3))
    time.sleep(0.3)
    # depth in the queue plus the one the worker holds while it waits to put it.
    assert len(produced) <= 3 + 1
    assert next(it) == 0
    del it


# ---- re-iteration ----


def test_reiteration_starts_a_new_pass():
    pf = Prefetcher(_batches(6), device="cpu")
    first = [b[0].item() for b in pf]
    second = [b[0].item() for b in pf]
    assert first == second == list(range(6))


def test_new_pass_stops_the_previous_worker():
    before = _prefetch_threads()
    pf = Prefetcher(_batches(100), device="cpu")
    old = iter(pf)
    next(old)
    new = iter(pf)
    assert _prefetch_threads() <= before + 1
    assert [b[0].item() for b in new][:3] == [0, 1, 2]
    assert list(old) == []  # the old pass ends; it never yields batches of the new one
    del old, new


def test_dataloader_with_workers_and_early_break():
    ds = [torch.full((3,), float(i)) for i in range(40)]
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    pf = Prefetcher(loader, device="cpu")
    assert [b[:, 0].tolist() for b in pf] == [[float(4 * j + i) for i in range(4)] for j in range(10)]
    for i, _ in enumerate(pf):
        if i == 1:
            break


# ---- len, set_epoch ----


def test_len_passes_through():
    assert len(Prefetcher(_batches(7), device="cpu")) == 7
    assert len(Prefetcher(DataLoader(list(range(10)), batch_size=3), device="cpu")) == 4
    gen = (i for i in range(3))
    with pytest.raises(TypeError) as info:
        len(Prefetcher(gen, device="cpu"))
    with pytest.raises(TypeError) as native:
        len(gen)  # type: ignore[arg-type]
    assert str(info.value) == str(native.value)


def test_set_epoch_reaches_distributed_sampler():
    ds = list(range(20))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True)
    pf = Prefetcher(DataLoader(ds, batch_size=2, sampler=sampler), device="cpu")
    pf.set_epoch(5)
    assert sampler.epoch == 5

    # Orders differ between epochs, and match what the sampler gives for that epoch.
    epochs = []
    for e in (0, 1):
        pf.set_epoch(e)
        epochs.append(torch.cat(list(pf)).tolist())
        sampler.set_epoch(e)
        assert epochs[-1] == list(iter(sampler))
    assert epochs[0] != epochs[1]


def test_set_epoch_through_batch_sampler_and_on_the_iterable():
    ds = list(range(20))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0)
    pf = Prefetcher(DataLoader(ds, batch_sampler=BatchSampler(sampler, 2, False)), device="cpu")
    pf.set_epoch(3)
    assert sampler.epoch == 3

    class Stream:
        epoch = None

        def __iter__(self):
            return iter(range(3))

        def set_epoch(self, e):
            self.epoch = e

    s = Stream()
    Prefetcher(s, device="cpu").set_epoch(9)
    assert s.epoch == 9
    Prefetcher([1, 2], device="cpu").set_epoch(1)  # nothing to reach: a no-op
