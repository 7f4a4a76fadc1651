import os

# Under pytest-xdist (CI's `-n 2` on 2 cores) two test processes each run torch's OpenMP pool of a thread per
# core, and libgomp's default wait policy spins at each barrier for a thread whose core the other process holds.
# Passive waiting keeps the 2-thread code paths under test: on the 2-core Xeon, test_real_models.py, test_adam.py
# and test_frameworks.py under -n 2 took 229 s spinning and 97-111 s passive (Mask R-CNN's fp32 case 127 s -> 18-23 s).
# libgomp reads it when torch loads it, hence before the import.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# The Triton backend is tested on CPU tensors through the interpreter, which must be switched on before
# triton is first imported. On a GPU machine the real compiler runs instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastops import _backend  # noqa: E402
from tests.devices import CPU_BACKENDS, KERNEL_PAIRS, PAIRS  # noqa: E402
# The claims ledger's hooks (tests/claims.py): what ran on which device, the cuda mark on every GPU case.
from tests.claims import (  # noqa: E402,F401
    pytest_collection_modifyitems, pytest_configure, pytest_deselected, pytest_make_collect_report,
    pytest_runtest_logreport, pytest_sessionfinish)


def _serve(device: str, backend: str):
    """``device``'s tensors served by ``backend`` inside the test. A backend that fails to load fails the test."""
    with _backend.use(device, backend):
        yield device, backend


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request):
    """Serve CPU tensors with each CPU backend in turn."""
    with _backend.use("cpu", request.param):
        yield request.param


@pytest.fixture(params=[pytest.param(tuple(p.values), id=p.id, marks=p.marks) for p in PAIRS])
def device_backend(request):
    """(device, backend) over every pair of tests/devices.py."""
    yield from _serve(*request.param)


@pytest.fixture(params=[pytest.param(tuple(p.values), id=p.id, marks=p.marks) for p in KERNEL_PAIRS])
def kernel_backend(request):
    """(device, backend) over every pair but the CPU reference: for tests against fastops.reference."""
    yield from _serve(*request.param)
