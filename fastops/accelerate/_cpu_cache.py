"""On the CPU, freed blocks of 8 MiB and more kept for reuse instead of unmapped: fastops._C's caching layer over
torch's CPU allocator (csrc/cpu/cache.cpp), which ``Accelerator`` turns on for a CPU device."""

from __future__ import annotations

import os

_FLAGS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def keep_freed_memory() -> bool:
    """Turns the cache on unless FASTOPS_KEEP_FREED_MEMORY says not to; returns whether it is in place.

    glibc maps large blocks afresh and unmaps them on free, so each training step page-faults its large
    activations back in: with the cache the BERT-like benchmark step went from about 300 to 245 ms, for the
    cached blocks' memory (240 MiB there), at most FASTOPS_CPU_CACHE_MB (default 1024) MiB. Process-wide and
    kept after training; FASTOPS_KEEP_FREED_MEMORY=0 (false, off, no) leaves torch's allocator as it is, and
    ``fastops._backend._C.cpp.cpu_cache_empty()`` hands the blocks back."""
    raw = os.environ.get("FASTOPS_KEEP_FREED_MEMORY", "1")
    keep = _FLAGS.get(raw.strip().lower())
    if keep is None:
        raise ValueError(
            f"FASTOPS_KEEP_FREED_MEMORY must be 1, true, on, yes or 0, false, off, no (any case), got {raw!r}"
        )
    from .._backend import _C

    if not keep or _C is None:  # _C is None in the reference backend's world: no compiled parts, no cache
        return False
    raw = os.environ.get("FASTOPS_CPU_CACHE_MB", "1024")
    largest = (2**63 - 1) >> 20  # the C++ side takes the limit in bytes as an int64
    try:
        limit_mb = int(raw)
    except ValueError:
        limit_mb = -1
    if not 0 <= limit_mb <= largest:
        raise ValueError(f"FASTOPS_CPU_CACHE_MB must be a whole number of MiB from 0 to {largest}, got {raw!r}")
    return bool(_C.cpp.cpu_cache_enable(limit_mb << 20))
