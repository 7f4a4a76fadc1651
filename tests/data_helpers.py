"""What the fastops.data test files share: CUDA's skip condition and the check that no test leaves a prefetch
worker thread running (``no_leaked_workers``, autouse: import it into each test module)."""

from __future__ import annotations

import collections
import gc
import threading
import time

import pytest
import torch


Pair = collections.namedtuple("Pair", "image label")  # a namedtuple leaf of a batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prefetch_threads() -> int:
    return sum(t.name == "fastops-prefetch" and t.is_alive() for t in threading.enumerate())


def _wait_no_workers(before: int, timeout: float = 5.0) -> int:
    """The worker notices the stop flag within one queue timeout (0.1 s); poll instead of sleeping blindly."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while _prefetch_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    return _prefetch_threads()


@pytest.fixture(autouse=True)
def no_leaked_workers():
    before = _prefetch_threads()
    yield
    assert _wait_no_workers(before) == before, "a prefetch worker thread outlived its test"


def _batches(n: int) -> list[torch.Tensor]:
    return [torch.full((4,), float(i)) for i in range(n)]
