"""Which implementation serves each op on each device type, chosen once per device type.

``FASTOPS_BACKEND`` is ``auto`` (default), one backend name for every device, or a per-device list such
as ``cpu:cpp,cuda:triton`` (a device type left out gets ``auto``; an unknown or repeated one raises).
``auto`` takes the fastest backend that loads and falls back to the reference with one warning that gives
the reason; a backend named explicitly raises instead.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from types import ModuleType
from typing import Iterator

DEVICE_TYPES = ("cpu", "cuda")
BACKENDS = ("cpp", "triton", "cuda", "reference")
# Preference order for auto. The Triton path is the CUDA default because it is the one that can be
# tuned without a rebuild; the CUDA C++ path is the alternative when Triton is missing.
_AUTO = {"cpu": ("cpp", "reference"), "cuda": ("triton", "cuda", "reference")}
_SERVES = {"cpp": ("cpu",), "triton": ("cuda", "cpu"), "cuda": ("cuda",), "reference": DEVICE_TYPES}

_C: ModuleType | None = None
_C_ERROR: str | None = None
try:
    _C = importlib.import_module("fastops._C")
except Exception as e:  # noqa: BLE001 - any load failure (missing file, ABI, symbol) means "no _C"
    _C_ERROR = f"{type(e).__name__}: {e}"
# What fastops calls on it: an extension built from older sources lacks some (a checkout updated, not rebuilt).
_C_SUBMODULES = ("cpp", "checks", "cuda_math")


def _stale(module: ModuleType) -> str | None:
    """Why ``module`` (fastops._C) cannot serve, or None."""
    missing = [name for name in _C_SUBMODULES if not hasattr(module, name)]
    if missing:
        return f"{getattr(module, '__file__', module)} was built from older sources (it has no {missing}); rebuild it"
    return None


if _C is not None and _stale(_C):
    _C, _C_ERROR = None, _stale(_C)

_chosen: dict[str, tuple[str, ModuleType]] = {}
_warned: set[str] = set()


class BackendUnavailable(RuntimeError):
    pass


def requested(device_type: str) -> str:
    """The backend FASTOPS_BACKEND asks for on ``device_type`` ("auto" where it names none).

    The whole variable is checked on every call, not only the part for ``device_type``, so a typo in the
    entry of a device not in use yet (``gpu:cpp``, ``cuda:tirton``) raises at the first op, not later."""
    spec = os.environ.get("FASTOPS_BACKEND", "")
    entries = _parse_backend_spec(spec)
    return entries.get(device_type, entries.get("*", "auto"))


def _parse_backend_spec(spec: str) -> dict[str, str]:
    """Device type (or "*" for all of them) -> backend name.

    Case and spaces around names are ignored ("cpu: cpp, cuda: triton" reads as written), and so are empty
    items, which name nothing: a list assembled in a shell script (``cpu:cpp,$EXTRA``) may leave them."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"FASTOPS_BACKEND={spec!r}: {problem}")

    def backend(name: str) -> str:
        if name not in ("auto", *BACKENDS):
            raise bad(f"unknown backend {name!r}; expected auto or one of {BACKENDS}")
        return name

    items = [item.strip() for item in spec.lower().split(",")]
    items = [item for item in items if item]
    if not items:
        return {}
    if len(items) == 1 and ":" not in items[0]:  # one backend for every device type
        name = items[0]
        if name in DEVICE_TYPES and name not in BACKENDS:
            raise bad(f"{name!r} is a device type, not a backend; write {name}:<backend>")
        return {"*": backend(name)}
    entries: dict[str, str] = {}
    given: dict[str, str] = {}  # device type -> its entry as written, for the error on a repeat
    for item in items:
        device, sep, name = (part.strip() for part in item.partition(":"))
        if not sep:
            raise bad(f"entry {item!r} is not device:backend (a lone backend name must be the whole value)")
        if not device:
            raise bad(f"entry {item!r} names no device type")
        if device not in DEVICE_TYPES:
            raise bad(f"unknown device type {device!r} in entry {item!r}; expected one of {DEVICE_TYPES}")
        if device in given:
            raise bad(f"device type {device!r} is given twice ({given[device]!r} and {item!r})")
        if not name:
            raise bad(f"entry {item!r} names no backend")
        if backend(name) != "auto" and device not in _SERVES[name]:
            raise bad(f"backend {name!r} does not run on {device} tensors (entry {item!r})")
        entries[device], given[device] = name, item
    return entries


def load(name: str, device_type: str) -> ModuleType:
    """Return the module implementing every op for ``name`` on ``device_type``, or raise why not."""
    if device_type not in _SERVES[name]:
        raise BackendUnavailable(f"backend {name!r} does not run on {device_type} tensors")
    if name == "reference":
        from . import reference

        return reference
    if name in ("cpp", "cuda"):
        if _C is None:
            raise BackendUnavailable(f"fastops._C failed to load ({_C_ERROR})")
        if name == "cuda" and not getattr(_C, "WITH_CUDA", False):
            raise BackendUnavailable("fastops._C was built without CUDA kernels (set FASTOPS_CUDA=1 and rebuild)")
        return getattr(_C, name)
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailable("Triton runs on CPU tensors only under TRITON_INTERPRET=1")
    try:
        return importlib.import_module("fastops.kernels")
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"Triton kernels failed to import ({type(e).__name__}: {e})") from e


def choose(device_type: str) -> tuple[str, ModuleType]:
    name = requested(device_type)
    if name != "auto":
        try:
            return name, load(name, device_type)
        except BackendUnavailable as e:
            raise BackendUnavailable(f"FASTOPS_BACKEND asks for {name!r} on {device_type}, but {e}") from None
    reasons = []
    for candidate in _AUTO[device_type]:
        try:
            module = load(candidate, device_type)
        except BackendUnavailable as e:
            reasons.append(f"{candidate}: {e}")
            continue
        if candidate == "reference" and device_type not in _warned:
            _warned.add(device_type)
            warnings.warn(
                f"fastops: using the pure-PyTorch reference on {device_type} ({'; '.join(reasons)})",
                RuntimeWarning,
                stacklevel=3,
            )
        return candidate, module
    raise AssertionError("unreachable: the reference always loads")


def active(device_type: str) -> str:
    if device_type not in _chosen:
        _chosen[device_type] = choose(device_type)
    return _chosen[device_type][0]


def chosen(device_type: str) -> tuple[str, ModuleType]:
    """(name, module) of the backend serving ``device_type``: its ops are the module's functions of the ops' names."""
    entry = _chosen.get(device_type)
    if entry is None:
        active(device_type)
        entry = _chosen[device_type]
    return entry


@contextlib.contextmanager
def use(device_type: str, name: str) -> Iterator[None]:
    """Serve ``device_type`` with backend ``name`` inside the block (tests, benchmarks)."""
    saved = _chosen.get(device_type)
    _chosen[device_type] = (name, load(name, device_type))
    try:
        yield
    finally:
        if saved is None:
            _chosen.pop(device_type, None)
        else:
            _chosen[device_type] = saved


def available(device_type: str) -> dict[str, str]:
    """Backend name -> "ok" or the reason it cannot serve ``device_type``."""
    out = {}
    for name in BACKENDS:
        if device_type not in _SERVES[name]:
            continue
        try:
            load(name, device_type)
            out[name] = "ok"
        except BackendUnavailable as e:
            out[name] = str(e)
    return out
