"""The (device, backend) pairs every op-level suite runs over: the CPU's always, CUDA's as the same tests, each
skipped on its own where no GPU is (pytest -m cuda selects them on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from fastops import _backend

CPU_BACKENDS = ("cpp", "triton", "reference")
CUDA_BACKENDS = ("triton", "cuda", "reference")
HAS_CUDA = torch.cuda.is_available()

_needs_gpu = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# pytest.param per pair, ids "cpu-cpp", "cuda-triton", ...: parametrize("device,backend", PAIRS).
PAIRS = [pytest.param("cpu", b, id=f"cpu-{b}") for b in CPU_BACKENDS] + [
    pytest.param("cuda", b, id=f"cuda-{b}", marks=_needs_gpu) for b in CUDA_BACKENDS
]


@pytest.fixture(params=[pytest.param(tuple(p.values), id=p.id, marks=p.marks) for p in PAIRS])
def device_backend(request):
    """(device, backend): ``device``'s tensors served by ``backend`` inside the test. A backend that fails to load
    fails the test."""
    device, backend = request.param
    with _backend.use(device, backend):
        yield device, backend


def on(device, args):
    """``args`` (an op's positional arguments) with every tensor moved to ``device``."""
    from fastops._specs.spec import on as _on

    return _on(device, args)


def cpu(args):
    return [[t.cpu() for t in a] if isinstance(a, list) else a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def clone(args):
    return [[t.clone() for t in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor) else a
            for a in args]  # fmt: skip
