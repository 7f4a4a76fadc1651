import os

import torch

# The Triton backend is tested on CPU tensors through the interpreter, which must be switched on before
# triton is first imported. On a GPU machine the real compiler runs instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastops import _backend  # noqa: E402
# The claims ledger's hooks (tests/claims.py): what ran on which device, the cuda mark on every GPU case.
from tests.claims import (  # noqa: E402,F401
    pytest_collection_modifyitems, pytest_configure, pytest_deselected, pytest_make_collect_report,
    pytest_runtest_logreport)

CPU_BACKENDS = ("cpp", "triton", "reference")


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request):
    """Serve CPU tensors with each CPU backend in turn. A backend that fails to load fails the test."""
    with _backend.use("cpu", request.param):
        yield request.param
