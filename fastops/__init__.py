"""fastops: one line to make PyTorch training faster.

``fastops.patch()`` swaps torch's AdamW/Adam/SGD, GradScalers and clip_grad_norm_ for fused fastops kernels;
``fastops.optim``, ``fastops.amp`` and ``fastops.data`` hold the pieces. Every kernel is a torch op
(``torch.ops.fastops.*``) with C++ CPU, Triton, CUDA C++ and pure-PyTorch implementations, one chosen per device
(``python -m fastops info``).
"""

from __future__ import annotations

import importlib

from . import _ops, amp, optim  # noqa: F401  (_ops registers torch.ops.fastops.*)
from .amp import clip_grad_norm_
from ._patch import patch, patched, unpatch
from .accelerate import Accelerator, accelerate
from ._lce import linear_cross_entropy  # noqa: F401  (registers torch.ops.fastops.linear_cross_entropy)
from ._dropout import dropout

__version__ = "0.1.0"
__all__ = ["optim", "amp", "data", "accelerate", "Accelerator", "clip_grad_norm_", "patch", "unpatch", "patched",
           "dropout"]


def __getattr__(name: str):
    if name == "data":
        return importlib.import_module(".data", __name__)
    raise AttributeError(f"module 'fastops' has no attribute {name!r}")
