"""The prepared loader: sharded across ranks (a DistributedSampler for a map-style DataLoader, round robin for
any other iterable), wrapped in fastops.data.Prefetcher, and given ``set_epoch`` at the start of each pass.

A ``torch.utils.data.DataLoader`` with ``num_workers=0`` is read on the training loop's thread, not in the
Prefetcher's background thread: its dataset, collate_fn and sampler run in this process, and when they draw
random numbers from the process-global generators (torch's default generator, ``random``, ``numpy.random``; a
random augmentation, a RandomSampler without a generator) a background thread would interleave those draws with
the step's (dropout), differently in every run. Any other iterable is read in the background; one that draws
from the global generators makes runs irreproducible, so give it its own ``torch.Generator``."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Iterable

import torch

from .._util import forward_attribute, map_tensors

if TYPE_CHECKING:
    from . import Accelerator


class Loader:
    """What ``prepare(loader)`` returns: the Prefetcher over the (sharded) loader, with ``set_epoch(epoch)``
    called at the start of each pass and ``epoch`` advanced when a pass completes (as HF Accelerate does).
    Other attributes (``dataset``, ``batch_size``, ``sampler``, ...) are the loader's."""

    def __init__(self, prefetcher) -> None:
        self.prefetcher = prefetcher
        self.epoch = 0

    def __iter__(self):
        self.prefetcher.set_epoch(self.epoch)
        yield from self.prefetcher
        self.epoch += 1

    def __len__(self) -> int:
        return len(self.prefetcher)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getattr__(self, name: str) -> Any:
        return forward_attribute(self, "prefetcher", name)


class RoundRobin:
    """Rank r of w takes batches r, r + w, ...; a last incomplete round is dropped, so every rank runs the
    same number of steps (one extra step on one rank would leave the others waiting in its all-reduce)."""

    _fresh_batches = True  # for fastops.data: what it yields is copied where the loader may refill it

    def __init__(self, iterable: Iterable, rank: int, world_size: int) -> None:
        self.iterable, self.rank, self.world_size = iterable, rank, world_size

    def __iter__(self):
        from ..data import _fresh_batches

        copy = not _fresh_batches(self.iterable)
        it = iter(self.iterable)
        while True:
            mine, n = None, 0
            for n, batch in enumerate(itertools.islice(it, self.world_size), 1):
                if n - 1 == self.rank:
                    # The rest of the round is read before this batch is yielded: a loader that refills one
                    # buffer would overwrite it meanwhile.
                    mine = map_tensors(torch.Tensor.clone, batch) if copy else batch
            if n < self.world_size:
                return
            yield mine

    def __len__(self) -> int:
        return len(self.iterable) // self.world_size  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.iterable, "set_epoch", None)):
            self.iterable.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        return forward_attribute(self, "iterable", name)


def prepare_loader(acc: "Accelerator", loader) -> Loader:
    from torch.utils.data import DataLoader, IterableDataset

    from ..data import Prefetcher

    # num_workers=0: the dataset, collate_fn and sampler run in this process, where their draws from the
    # global RNGs must stay in the loop's order (see the module docstring); worker processes draw
    # from their own generators, seeded on this thread when the pass starts.
    background = not (isinstance(loader, DataLoader) and loader.num_workers == 0)
    # By data-parallel rank: under TP and PP the ranks of one dp group (a TP group, a pipeline) see the same batches.
    if acc.dp_size > 1:
        if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
            loader = _shard_dataloader(loader, acc.dp_rank, acc.dp_size)
        else:
            loader = RoundRobin(loader, acc.dp_rank, acc.dp_size)
    wrapped = Loader(Prefetcher(loader, device=acc.device, background=background))
    try:
        batches = len(loader)
    except TypeError:  # an iterable without a length: the run's length is unknown
        batches = None
    if batches is not None:
        from . import _auto

        _auto.short_run(acc, batches)
    return wrapped


def _shard_dataloader(loader, rank: int, world_size: int):
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return loader
    if loader.batch_size is None or not isinstance(sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(
            "fastops.accelerate: cannot shard a DataLoader with a custom sampler or batch_sampler across "
            f"{world_size} ranks; give it a torch.utils.data.DistributedSampler yourself"
        )
    # The per-process batch size is kept (global batch = world_size x batch_size), as in HF Accelerate.
    dsampler = DistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank, shuffle=isinstance(sampler, RandomSampler)
    )
    kwargs = dict(
        batch_size=loader.batch_size, sampler=dsampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers,
    )  # fmt: skip
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
    return DataLoader(loader.dataset, **kwargs)
