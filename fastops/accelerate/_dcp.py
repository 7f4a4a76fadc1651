"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, no rank gathers
the model, and a load reshards onto whatever mesh (or single process) it runs on.

The state is keyed by the model's FQNs (get_state_dict/set_state_dict), so a checkpoint saved under tp 2 x dp 2
loads under tp 2 alone, under FSDP2, or into a plain model in one process. ``full=True`` exports one
consolidated file that plain ``torch.load`` reads: ``{"model": state_dict, "optim": {"state.<fqn>.<key>": ...,
"param_groups.<fqn>.<key>": ...}, "extra", "rng"}`` (the optimizer flattened per param, as
``flatten_optimizer_state_dict`` writes it).

Small state that is neither sharded nor a tensor (LR schedulers, the fp16 scaler, counters, every rank's RNG
states: what fastops.accelerate adds) goes in as ``meta``: rank 0 torch.saves it to ``<dir>.tmp/fastops.pt``
before the rename, so it is part of the same atomic write; ``read_meta`` reads it back.

Atomic: the shards go to ``<dir>.tmp``, which is renamed to ``<dir>`` once every rank has finished. The previous
checkpoint is first moved to ``<dir>.old`` and removed after; a save killed between the two renames leaves
``<dir>.old``, which ``load`` then reads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

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


META = "fastops.pt"


@contextlib.contextmanager
def _one_process_quiet():
    """torch 2.14 warns on every DCP call without a process group, even with ``no_dist=True``; one process is
    a supported case here (a checkpoint loaded outside the launcher), not a mistake to warn about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def on_rank0(fn, what: str) -> None:
    """Runs ``fn`` on rank 0; an error there is raised on every rank (the others would otherwise wait in the
    next collective for a rank that has left): as itself on rank 0, as ``RuntimeError("<what> (rank 0: ...)")``
    on the others. Also the barrier after ``fn``."""
    error = None
    if _rank() == 0:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
            if not _dist():
                raise
            error = e
    if _dist():
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(status, src=0)
        if error is not None:
            raise error
        if status[0] is not None:
            raise RuntimeError(f"{what} (rank 0: {status[0]})")


def _write(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def resolve(path: str) -> str:
    """The directory a load reads: ``path``, or ``<path>.old`` left by a save killed between its two renames."""
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        return path + ".old"
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no sharded checkpoint at {path!r} (nor {path}.old)")
    return path


def read_meta(path: str):
    """What ``save(..., meta=)`` stored, or None for a checkpoint saved without it."""
    file = os.path.join(resolve(path), META)
    return torch.load(file, map_location="cpu", weights_only=True) if os.path.exists(file) else None


# Optimizer state and hyperparameters keyed per param FQN: pipeline stages hold different params, and a
# param_groups list saved by each of them would collide under one key.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model, optimizer, options=_FLAT) -> dict:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model, options=options)}
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd}


def save(path: str, model, optimizer=None, extra: dict | None = None, full: bool = False, meta=None) -> None:
    """Saves the model, the optimizer (state and step counters), ``extra`` (tensors, e.g. the loop's counters),
    each rank's CPU RNG state and rank 0's ``meta`` (plain Python values and CPU tensors, read back with
    ``weights_only=True``). Collective: every rank calls it."""
    if full:
        return _save_full(path, model, optimizer, extra, meta)
    state = _state(model, optimizer)
    state["extra"] = dict(extra or {})
    state["rng"] = {str(_rank()): torch.get_rng_state()}  # one key per rank: each rank's dropout draws resume
    tmp, old = path + ".tmp", path + ".old"
    failed = f"fastops checkpoint: {path} was not saved"
    on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True), failed)  # a save killed earlier
    with _one_process_quiet():
        dcp.save(state, checkpoint_id=tmp, no_dist=not _dist())  # ends with a collective: every rank's shards are written

    def publish():
        if meta is not None:
            _write(meta, os.path.join(tmp, META))
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)

    on_rank0(publish, failed)


def _save_full(path: str, model, optimizer, extra, meta=None) -> None:
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

    def write():
        state["extra"] = dict(extra or {})
        state["rng"] = torch.get_rng_state()
        if meta is not None:
            state["meta"] = meta
        tmp = path + ".tmp"
        _write(state, tmp)
        os.replace(tmp, path)

    on_rank0(write, f"fastops checkpoint: {path} was not saved")


def load(path: str, model, optimizer=None, rng: bool = True) -> dict:
    """Loads a checkpoint written by ``save`` into this rank's shards (resharding as needed); returns ``extra``."""
    path = resolve(path)
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
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not _dist())
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
