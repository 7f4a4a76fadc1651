"""fp32 master weights of bf16/fp16 params (``master_weights=True``).

The step updates the fp32 master in the optimizer state and writes the rounded param in the same pass. A master
is only right while the param still holds what the step last wrote: torch keeps edits made to a param between
steps (``p.fill_``, ``model.load_state_dict``, ``clamp_``, an EMA swap), and stepping the old master would undo
them. Edits are seen through autograd's version counter, which every in-place op bumps, so a step without edits
costs no extra pass.

The contract this rests on, kept by ``fastops/_ops.py``: every fastops op bumps the version counter of each tensor
it mutates (``_MUTATED`` there, through ``torch.autograd.graph.increment_version``), as torch's own in-place ops do.
The step records the param's ``_version`` right after the op wrote it (``wrote``); a later mismatch then means an
edit by someone else. An op that wrote params without bumping would make the next step's edit by the user look
like the op's own write: that edit would be overwritten from the stale master. (Edits through ``p.data`` bypass the
counter, ``p.data.clamp_()`` is invisible to autograd too, and are not seen: edit under ``torch.no_grad()``.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._fallback import _local


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def fresh_master(p: Tensor) -> Tensor:
    return p.detach().clone(memory_format=torch.preserve_format).float()


def master(written_versions: dict[Tensor, int], p: Tensor, state: dict[str, Any]) -> Tensor:
    """The local fp32 master of a bf16/fp16 param, rebuilt from the param when the param was changed outside the
    optimizer since the step last wrote it. When its version moved, the master is kept if it still rounds to the
    param (an EMA swapped back), else rebuilt (losing the bits below the param's precision, as a fresh master
    would). ``written_versions``: param -> its ``_version`` right after the step last wrote it."""
    lp = _local(p)
    m = state.get("master_param")
    if m is not None and written_versions.get(p) != lp._version:
        if not _same_bits(_local(m).to(p.dtype), lp):
            m = None
    if m is None:
        m = state["master_param"] = fresh_master(p)
    return _local(m)


def wrote(written_versions: dict[Tensor, int], params: list[Tensor]) -> None:
    """Records the version counters the op left on params it wrote from their masters."""
    if torch.compiler.is_compiling():
        # Not traced; the stale entries make the next eager step compare bits once, which finds no edit.
        return
    for p in params:
        written_versions[p] = _local(p)._version


def keep_or_rebuild(state: dict[str, Any], p: Tensor) -> None:
    """On load: torch.optim keeps the unknown master key but never updates it, so a master that no longer rounds
    to the param is from before steps taken elsewhere, and stepping it would undo them: rebuilt from the param."""
    m = state.get("master_param")
    if m is not None and not _same_bits(_local(m).to(p.dtype), _local(p)):
        state["master_param"] = fresh_master(p)
