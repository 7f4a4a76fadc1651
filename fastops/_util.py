"""What fastops.data and fastops.accelerate share: the walk over batches and model outputs, the choice of
device, and attribute forwarding for their wrappers."""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import os
import struct
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns a default-on choice off (0, false, off or no, any case)."""
    return os.environ.get(name, "1").lower() in ("0", "false", "off", "no")


def round_fp32(x: float) -> float:
    """The Python float ``x`` rounded to fp32 (round to nearest even), as a kernel's fp32 argument holds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor leaf replaced by ``fn(leaf)``, rebuilt with the same container types.

    torch's pytree walks the types registered with it: tuples, lists, dicts, namedtuples, OrderedDict,
    defaultdict, deque, torch.return_types, and HF transformers' ``ModelOutput`` (transformers registers every
    subclass, for DDP), which is rebuilt through its constructor, so ``out.loss`` and ``out["logits"]`` work on
    the result. pytree takes the other types for leaves; of those, dataclasses (frozen ones too) and
    subclasses of list, tuple and dict (any Mapping) are looked into here. Every other object (a transformers
    ``Cache`` in ``past_key_values``, a ``SimpleNamespace``, strings, numbers) is returned as it is: the same
    object, never copied, changed or looked into."""
    return pytree.tree_map(lambda leaf: _map_leaf(fn, leaf), tree)


def _map_leaf(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # copy + object.__setattr__ instead of dataclasses.replace: works for frozen dataclasses and does not
        # run __init__/__post_init__ again.
        clone = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(clone, f.name, map_tensors(fn, getattr(obj, f.name)))
        return clone
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, v) for v in obj]
        try:
            return type(obj)(items)
        except TypeError:  # a subclass whose constructor takes other arguments
            return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, collections.abc.Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        if isinstance(obj, collections.abc.MutableMapping):
            clone = copy.copy(obj)  # keeps the mapping's type and extra state
            for k, v in items.items():
                clone[k] = v
            return clone
        try:
            return type(obj)(items)
        except TypeError:
            return items
    return obj


def forward_attribute(obj: Any, inner: str, name: str) -> Any:
    """``getattr(obj.<inner>, name)``, for a wrapper's ``__getattr__``. Private and dunder names are not
    forwarded, nor is anything while ``inner`` is unset (copy and pickle probe an instance before its
    ``__dict__`` is filled), so those lookups fail as usual instead of recursing."""
    wrapped = obj.__dict__.get(inner)
    if name.startswith("_") or wrapped is None:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    return getattr(wrapped, name)


def resolve_device(device: Any, local_rank: int | None = None, who: str = "fastops") -> torch.device:
    """The device to train or load on, with an index. ``local_rank`` is LOCAL_RANK when this is one of several
    launched processes (None otherwise): a CUDA device given without an index, or no device at all, then means
    cuda:LOCAL_RANK, so that ranks do not all share the current device (cuda:0 in every fresh process); without
    it, the current CUDA device. No device means the CPU where CUDA is not available. Only 'cpu' and 'cuda' are
    taken: fastops' kernels and the Prefetcher's copies run there, and meta holds no data. ``who`` names the
    caller in the errors."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{who}: unknown device {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{who}: device {device!r} is not supported; use 'cpu' or 'cuda'")
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"{who}: device {device!r} requested but CUDA is not available")
    count = torch.cuda.device_count()
    if dev.index is None:
        if local_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        if local_rank >= count:
            raise ValueError(
                f"{who}: LOCAL_RANK={local_rank} but this process sees {count} CUDA device(s); pass "
                "device='cuda:N' for the device this rank should use"
            )
        return torch.device("cuda", local_rank)
    if dev.index >= count:
        raise ValueError(f"{who}: device {device!r} does not exist ({count} CUDA device(s) visible)")
    return dev
