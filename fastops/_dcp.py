"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, no rank gathers
the model, and a load reshards onto whatever mesh (or single process) it runs on.

The state is keyed by the model's FQNs (get_state_dict/set_state_dict), so a checkpoint saved under tp 2 x dp 2
loads under tp 2 alone, under FSDP2, or into a plain model in one process. ``full=True`` exports one
consolidated file that plain ``torch.load`` reads: ``{"model": state_dict, "optim": {"state.<fqn>.<key>": ...,
"param_groups.<fqn>.<key>": ...}, "extra", "rng"}`` (the optimizer flattened per param, as
``flatten_optimizer_state_dict`` writes it).

Atomic: the shards go to ``<dir>.tmp``, which is renamed to ``<dir>`` once every rank has finished. The previous
checkpoint is first moved to ``<dir>.old`` and removed after; a save killed between the two renames leaves
``<dir>.old``, which ``load`` then reads.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


# Optimizer state and hyperparameters keyed per param FQN: pipeline stages hold different params, and a
# param_groups list saved by each of them would collide under one key.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model, optimizer, options=_FLAT) -> dict:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model, options=options)}
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd}


def save(path: str, model, optimizer=None, extra: dict | None = None, full: bool = False) -> None:
    """Saves the model, the optimizer (state and step counters), ``extra`` (tensors, e.g. the loop's counters)
    and each rank's CPU RNG state. Collective: every rank calls it."""
    if full:
        return _save_full(path, model, optimizer, extra)
    state = _state(model, optimizer)
    state["extra"] = dict(extra or {})
    state["rng"] = {str(_rank()): torch.get_rng_state()}  # one key per rank: each rank's dropout draws resume
    tmp, old = path + ".tmp", path + ".old"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
    _barrier()
    dcp.save(state, checkpoint_id=tmp)  # ends with a collective: every rank's shards are written
    if _rank() == 0:
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _save_full(path: str, model, optimizer, extra) -> None:
    # The one place a rank holds everything, as asked: rank 0 on the CPU.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    state = _state(model, optimizer, options)  # rank 0 only (cpu_offload): its own params, DTensors gathered
    if _dist():
        # Plain (non-DTensor) entries are whole on the ranks that hold them; pipeline stages hold different ones,
        # which meet on rank 0 here.
        from torch.distributed.tensor import DTensor

        plain = {k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in d.items()
                     if not isinstance(v, DTensor)} for k, d in _state(model, optimizer).items()}  # fmt: skip
        parts = [None] * dist.get_world_size() if _rank() == 0 else None
        dist.gather_object(plain, parts, dst=0)
        if _rank() == 0:
            state = {k: {**{n: v for part in parts for n, v in part[k].items()}, **state[k]} for k in state}
    if _rank() == 0:
        state["extra"] = dict(extra or {})
        state["rng"] = torch.get_rng_state()
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
    _barrier()


def load(path: str, model, optimizer=None, rng: bool = True) -> dict:
    """Loads a checkpoint written by ``save`` into this rank's shards (resharding as needed); returns ``extra``."""
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path = path + ".old"  # a save was killed between its two renames
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no sharded checkpoint at {path!r} (nor {path}.old)")
    state = _state(model, optimizer)
    state["extra"] = {}
    md = dcp.FileSystemReader(path).read_metadata()
    saved_ranks = sum(1 for key in md.state_dict_metadata if key.startswith("rng."))
    # Rank r resumes saved rank (r mod saved ranks)'s CPU RNG state (all of them when the world is the same).
    own = str(_rank() % saved_ranks)
    state["rng"] = {own: torch.get_rng_state()}
    # Entries of `extra` are only known from the metadata: allocate them before the load fills them.
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("extra."):
            size = getattr(meta, "size", None)
            if size is not None:
                state["extra"][key[len("extra."):]] = torch.empty(size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=path)
    if optimizer is None:
        set_state_dict_model(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_FLAT)
    if rng:
        torch.set_rng_state(state["rng"][own])
    return state["extra"]


def set_state_dict_model(model, msd) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, msd)
