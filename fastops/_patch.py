"""``fastops.patch()``: torch's AdamW/Adam/SGD, GradScalers and clip_grad_norm_ replaced by fastops'.

Two mechanisms, because scripts reach torch's objects two ways:
- by name at call time (``torch.optim.AdamW(...)``): the module attributes are rebound, in the package and in the
  defining module, so ``torch.optim.AdamW`` and ``from torch.optim.adamw import AdamW`` both give fastops' class;
- through a reference taken before ``patch()`` (``from torch.optim import AdamW`` at the top of a script, timm's
  optimizer table built at import): torch's classes get a ``__new__`` that builds fastops' class instead. Python
  then runs fastops' ``__init__`` (it initializes whatever ``__new__`` returned, when that is an instance of the
  class called, which fastops' subclasses are), so every AdamW/Adam/SGD/GradScaler made after ``patch()`` is
  fastops', however its class was reached. Subclasses of torch's classes (a user's ``class MyAdam(Adam)``) are
  left alone, as ``fastops.optim.fuse_`` leaves them.

A function has no such hook: a ``clip_grad_norm_`` imported by name before ``patch()`` still calls torch's, and
``patch()`` warns once, naming the modules that hold such a reference.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from typing import Iterator

import torch

from . import amp, optim

# (module, attribute, fastops replacement): both the package attribute and the defining module are swapped.
_NAMES = [
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
# torch's class (exactly) -> the fastops class its constructor builds while patched.
_CLASSES = {
    torch.optim.AdamW: optim.AdamW,
    torch.optim.Adam: optim.Adam,
    torch.optim.SGD: optim.SGD,
    amp._TorchGradScaler: amp.GradScaler,
    amp._TorchCudaGradScaler: amp.CudaGradScaler,
    amp._TorchCpuGradScaler: amp.CpuGradScaler,
}
_FUNCTIONS = {amp._torch_clip_grad_norm_: "torch.nn.utils.clip_grad_norm_"}

_originals: dict[tuple[str, str], object] = {}
# The classes' __new__ is installed at the first patch() and stays: unpatch() only turns it off. Deleting a
# __new__ set on a class leaves CPython's slot wrapper behind, which then passes the constructor's arguments to
# object.__new__ and fails ("object.__new__() takes exactly one argument") on every later construction.
_new_installed = False
_new_active = False


def _fastops_new(cls, *args, **kwargs):
    # object.__new__ takes no constructor arguments; __init__ (fastops' while patched) gets them.
    return object.__new__(_CLASSES.get(cls, cls) if _new_active else cls)


def _unreached() -> list[str]:
    """'module.name' of each global, outside torch and fastops, that holds a torch function patch() replaces: a
    script's ``from torch.nn.utils import clip_grad_norm_`` run before ``patch()``. (28 ms over 4,500 modules
    with transformers, timm, lightning and accelerate imported.)"""
    by_id = {id(f): name for f, name in _FUNCTIONS.items()}  # by identity: a module may hold unhashable values
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod_name == "__mp_main__" or mod_name.split(".")[0] in ("torch", "fastops"):
            continue
        names = getattr(mod, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for attr, value in list(names.items()):
            torch_name = by_id.get(id(value))
            if torch_name is not None:
                found.append(f"{mod_name}.{attr} ({torch_name})")
    return found


def patch(models: bool = True) -> None:
    """Swap torch.optim.AdamW/Adam/SGD, torch.amp.GradScaler (also ``torch.GradScaler`` and the deprecated
    ``torch.cuda.amp.GradScaler``/``torch.cpu.amp.GradScaler``) and torch.nn.utils.clip_grad_norm_ for fastops'.
    Every optimizer and scaler of those classes made afterwards is fastops', also through a reference to the class
    taken before the call; a ``clip_grad_norm_`` imported by name before it is not reached, and a warning names
    where. Call it first, before the script builds its optimizer. Idempotent; undo with ``unpatch()``. The
    optimizers run every script torch's run: param groups their kernels do not take (float64, complex,
    ``differentiable=True``, sparse grads, ...) run torch's own step (see ``fastops.optim``).

    ``models=True`` (the default): an HF transformers model (``PreTrainedModel``) gets, at its first training call
    with ``labels``, what ``fastops.accelerate``'s rules give it: the fused loss with lazy logits, regional
    compilation where it pays (``fastops.accelerate._auto``); so inside HF's Trainer, Lightning or an HF
    Accelerate loop too. ``models=False`` patches the optimizers, scalers and clipping only."""
    from .accelerate import _patch_models

    if models:
        _patch_models.enable()
    else:
        _patch_models.disable()
    first = not _originals
    for mod_name, attr, replacement in _NAMES:
        mod = importlib.import_module(mod_name)
        _originals.setdefault((mod_name, attr), getattr(mod, attr))
        setattr(mod, attr, replacement)
    global _new_installed, _new_active
    if not _new_installed:
        assert not any("__new__" in cls.__dict__ for cls in _CLASSES), "torch's classes define __new__ now"
        for cls in _CLASSES:
            cls.__new__ = staticmethod(_fastops_new)
        _new_installed = True
    _new_active = True
    if first:
        unreached = _unreached()
        if unreached:
            warnings.warn(
                "fastops.patch(): these names were imported from torch before patch() and still call torch's "
                f"functions: {', '.join(unreached)}. Call fastops.patch() before importing them, or call the "
                "function through its module (torch.nn.utils.clip_grad_norm_).",
                RuntimeWarning,
                stacklevel=2,
            )


def unpatch() -> None:
    """Restore what ``patch()`` replaced. Models that have already been given the fused loss or compiled regions
    keep them."""
    from .accelerate import _patch_models

    _patch_models.disable()
    for (mod_name, attr), original in _originals.items():
        setattr(importlib.import_module(mod_name), attr, original)
    _originals.clear()
    global _new_active
    _new_active = False


@contextlib.contextmanager
def patched(models: bool = True) -> Iterator[None]:
    """``with fastops.patched():`` patches inside the block only."""
    already = bool(_originals)
    patch(models)
    try:
        yield
    finally:
        if not already:
            unpatch()
