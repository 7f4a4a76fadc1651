"""fastops: one line to make PyTorch training faster.

``fastops.patch()`` swaps torch's AdamW/Adam/SGD, GradScalers and clip_grad_norm_ for fused fastops kernels;
``fastops.optim``, ``fastops.amp`` and ``fastops.data`` hold the pieces. Every kernel is a torch op
(``torch.ops.fastops.*``) with C++ CPU, Triton, CUDA C++ and pure-PyTorch implementations, one chosen per device
(``python -m fastops info``).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

from . import _ops, amp, optim  # noqa: F401  (_ops registers torch.ops.fastops.*)
from .amp import clip_grad_norm_
from .accelerate import Accelerator, accelerate

__version__ = "0.1.0"
__all__ = ["optim", "amp", "data", "accelerate", "Accelerator", "clip_grad_norm_", "patch", "unpatch", "patched"]

# (module, attribute, fastops replacement). Both the package attribute and the defining module are
# swapped so `torch.optim.AdamW` and `from torch.optim.adamw import AdamW` both see fastops.
_PATCHES = [
    ("torch.optim", "AdamW", optim.AdamW),
    ("torch.optim.adamw", "AdamW", optim.AdamW),
    ("torch.optim", "Adam", optim.Adam),
    ("torch.optim.adam", "Adam", optim.Adam),
    ("torch.optim", "SGD", optim.SGD),
    ("torch.optim.sgd", "SGD", optim.SGD),
    ("torch", "GradScaler", amp.GradScaler),
    ("torch.amp", "GradScaler", amp.GradScaler),
    ("torch.amp.grad_scaler", "GradScaler", amp.GradScaler),
    # Deprecated in torch but common in older scripts; fastops' versions keep their device-fixed signatures.
    ("torch.cuda.amp", "GradScaler", amp.CudaGradScaler),
    ("torch.cuda.amp.grad_scaler", "GradScaler", amp.CudaGradScaler),
    ("torch.cpu.amp", "GradScaler", amp.CpuGradScaler),
    ("torch.cpu.amp.grad_scaler", "GradScaler", amp.CpuGradScaler),
    ("torch.nn.utils", "clip_grad_norm_", amp.clip_grad_norm_),
    ("torch.nn.utils.clip_grad", "clip_grad_norm_", amp.clip_grad_norm_),
]
_originals: dict[tuple[str, str], object] = {}


def patch() -> None:
    """Swap torch.optim.AdamW/Adam/SGD, torch.amp.GradScaler (also ``torch.GradScaler`` and the deprecated
    ``torch.cuda.amp.GradScaler``/``torch.cpu.amp.GradScaler``) and torch.nn.utils.clip_grad_norm_ for
    fastops'. Idempotent; undo with ``unpatch()``. The optimizers run every script torch's run: param groups
    their kernels do not take (float64, complex, ``differentiable=True``, sparse grads, ...) run torch's own step
    (see ``fastops.optim``)."""
    for mod_name, attr, replacement in _PATCHES:
        mod = importlib.import_module(mod_name)
        _originals.setdefault((mod_name, attr), getattr(mod, attr))
        setattr(mod, attr, replacement)


def unpatch() -> None:
    """Restore what ``patch()`` replaced."""
    for (mod_name, attr), original in _originals.items():
        setattr(importlib.import_module(mod_name), attr, original)
    _originals.clear()


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """``with fastops.patched():`` patches inside the block only."""
    already = bool(_originals)
    patch()
    try:
        yield
    finally:
        if not already:
            unpatch()


def __getattr__(name: str):
    if name == "data":
        return importlib.import_module(".data", __name__)
    raise AttributeError(f"module 'fastops' has no attribute {name!r}")
