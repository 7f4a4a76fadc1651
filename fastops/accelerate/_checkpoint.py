"""Accelerator checkpoints. Under every sharded strategy (fsdp, tp, fsdp+tp, pp) a directory of shards
(_dcp.py: no rank gathers the model, loads on another number of ranks or in one process); under ddp and
none one file written atomically by rank 0 and checked against the prepared objects before a load changes
anything. Both hold the schedulers, the fp16 scaler, the counters and each rank's RNG states. The one-file FSDP
format of earlier versions (the gathered full state) still loads."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import secrets
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ._distributed import SHARDED

if TYPE_CHECKING:
    from . import Accelerator

_CKPT_VERSION = 2  # 2: one RNG state per rank (1 held rank 0's only)
_CKPT_READABLE = (1, 2)


def _small(acc: "Accelerator", rngs: list[dict[str, Any]]) -> dict[str, Any]:
    """What is neither model nor optimizer: the same on every rank (the scaler's found_inf is a MAX over ranks),
    except the RNG states, which are every rank's."""
    return {
        "fastops_checkpoint": _CKPT_VERSION,
        "precision": acc.precision,
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        "schedulers": [_plain(s.scheduler.state_dict()) for s in acc.schedulers],
        "step": acc.step,
        "micro_step": acc.micro_step,
        "loader_epochs": [ld.epoch for ld in acc.loaders],
        "rng": rngs,  # index = rank
    }


def _state(acc: "Accelerator", rngs: list[dict[str, Any]]) -> dict[str, Any]:
    optim_sd = acc.optimizer.state_dict() if acc.optimizer else None
    return {"format": "plain", "model": acc.unwrap().state_dict(), "optimizer": _plain(optim_sd), **_small(acc, rngs)}


def _rngs(acc: "Accelerator") -> list[dict[str, Any]]:
    """Every rank's RNG states, on every rank (collective with several ranks)."""
    if not (acc.distributed and acc.world_size > 1):
        return [_rng_state()]
    rngs = [None] * acc.world_size
    dist.all_gather_object(rngs, _rng_state())
    return rngs


def _extra(acc: "Accelerator") -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(acc.step), "micro_step": torch.tensor(acc.micro_step),
            "loader_epochs": torch.tensor([ld.epoch for ld in acc.loaders], dtype=torch.long)}  # fmt: skip


def _save_sharded(acc: "Accelerator", path: str, full: bool) -> None:
    from . import _dcp

    meta = _small(acc, _rngs(acc))
    with acc._step_state.raw_calls():  # get_state_dict may create the optimizer state with a step
        _dcp.save(path, acc.model, acc.optimizer, extra=_extra(acc), full=full, meta=meta)


def _load_sharded(acc: "Accelerator", path: str) -> None:
    from . import _dcp

    if acc.model is None:
        raise ValueError("fastops.Accelerator.load: nothing is prepared yet; prepare the model (and optimizer) first")
    meta = _dcp.read_meta(path)  # None: saved before schedulers and the scaler were part of sharded checkpoints
    if meta is not None:
        _check_small(acc, meta, path)
    with acc._step_state.raw_calls():
        extra = _dcp.load(path, acc.model, acc.optimizer, rng=meta is None)
    own = None if meta is None else _own_rng(acc, meta["rng"], path, stacklevel=4)
    _restore(acc, int(extra["step"]), int(extra["micro_step"]), extra["loader_epochs"].tolist(), meta, own)


def _restore(acc: "Accelerator", step: int, micro_step: int, epochs, small: dict[str, Any] | None, rng) -> None:
    """What a load sets after the model and optimizer, in both formats: the counters, the loaders' epochs and,
    when the checkpoint has them (``small``, ``rng``: not in sharded ones saved before they held them), the
    scaler, the schedulers and this rank's RNG states."""
    if small is not None:
        if acc.scaler is not None:
            acc.scaler.load_state_dict(small["scaler"])
        for sched, sd in zip(acc.schedulers, small["schedulers"]):
            sched.scheduler.load_state_dict(sd)
    for loader, epoch in zip(acc.loaders, epochs):
        loader.set_epoch(epoch)
    acc.step, acc.micro_step = step, micro_step
    acc._step_state.last_step_real = acc.micro_step % acc.accumulate == 0
    acc._step_state.grads_scaled = False
    if rng is not None:
        _set_rng_state(rng)


def _own_rng(acc: "Accelerator", rngs: list[dict[str, Any]], path: str, stacklevel: int) -> dict[str, Any]:
    if len(rngs) != acc.world_size:
        warnings.warn(
            f"fastops.Accelerator.load: {path} holds the RNG states of {len(rngs)} rank(s), this run has "
            f"{acc.world_size}; rank r restores saved rank (r mod {len(rngs)})'s, so random draws (dropout, "
            "unseeded shuffling) do not continue those of the saved run",
            stacklevel=stacklevel + 1,  # the caller of Accelerator.load
        )
    return rngs[acc.rank % len(rngs)]


def save(acc: "Accelerator", path: str, full: bool = False) -> None:
    if acc.model is None:
        raise ValueError("fastops.Accelerator.save: nothing prepared yet")
    if acc.micro_step % acc.accumulate:
        warnings.warn(
            "fastops.Accelerator.save: saving in the middle of an accumulation cycle; the gradients "
            "accumulated so far are not saved, so a resumed run does not continue this cycle exactly",
            stacklevel=3,
        )
    if acc.strategy in SHARDED:
        return _save_sharded(acc, path, full)
    if full:
        raise ValueError("fastops.Accelerator.save: full=True is for sharded strategies; this checkpoint is one file")
    from . import _dcp

    rngs = _rngs(acc)
    # Also the barrier that keeps every rank in save until the file is in place.
    _dcp.on_rank0(lambda: _write_atomic(_state(acc, rngs), path), f"fastops.Accelerator.save: {path} was not saved")


def load(acc: "Accelerator", path: str) -> None:
    if acc.mesh is not None or os.path.isdir(path) or os.path.isdir(path + ".old"):
        return _load_sharded(acc, path)
    # A file: ddp/none's format, or the gathered one FSDP wrote before it saved shards.
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            raise RuntimeError(
                f"fastops.Accelerator.load: {path} holds a type that torch.load(weights_only=True) refuses to "
                "unpickle, not damaged data (Accelerator.save converts numpy values; other types in param groups "
                "or scheduler states stay as they are). If you trust the file, allow the type with "
                f"torch.serialization.add_safe_globals. torch says: {e}"
            ) from e
        raise RuntimeError(
            f"fastops.Accelerator.load: {path} is not a readable checkpoint (truncated or corrupt?): {e}"
        ) from e
    _check(acc, ckpt, path)
    rngs = ckpt["rng"] if isinstance(ckpt["rng"], list) else [ckpt["rng"]]  # v1 kept rank 0's only
    own = _own_rng(acc, rngs, path, stacklevel=3)
    model = acc.unwrap()
    if ckpt["format"] == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(acc.model, ckpt["model"], options=options)
        if acc.optimizer is not None:
            with acc._step_state.raw_calls():
                set_optimizer_state_dict(acc.model, acc.optimizer, ckpt["optimizer"], options=options)
    else:
        model.load_state_dict(ckpt["model"])
        if acc.optimizer is not None:
            acc.optimizer.load_state_dict(ckpt["optimizer"])
    _restore(acc, ckpt["step"], ckpt["micro_step"], ckpt["loader_epochs"], ckpt, own)


def _check(acc: "Accelerator", ckpt: Any, path: str) -> None:
    def fail(why: str):
        raise ValueError(f"fastops.Accelerator.load: {path} does not match what this Accelerator prepared: {why}")

    if not isinstance(ckpt, dict) or ckpt.get("fastops_checkpoint") not in _CKPT_READABLE:
        raise RuntimeError(
            f"fastops.Accelerator.load: {path} is not a fastops checkpoint (versions {_CKPT_READABLE} are read)"
        )
    if acc.model is None:
        fail("nothing is prepared yet; prepare the model (and optimizer) first")
    expected = "fsdp" if acc.strategy == "fsdp" else "plain"
    if ckpt["format"] != expected:
        fail(f"it was saved with {'FSDP' if ckpt['format'] == 'fsdp' else 'no FSDP'} and is loaded with "
             f"strategy={acc.strategy!r}")  # fmt: skip
    current = {k: tuple(v.shape) for k, v in acc.unwrap().state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in ckpt["model"].items()}
    if current != saved:
        missing, unexpected = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
        common = sorted(current.keys() & saved.keys())
        shapes = [f"{k}: {saved[k]} vs {current[k]}" for k in common if saved[k] != current[k]]
        fail(f"model missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, shape mismatches {shapes[:5]}")
    if acc.optimizer is not None:
        if ckpt["optimizer"] is None:
            fail("it has no optimizer state")
        if expected == "plain":
            sizes = [len(g["params"]) for g in ckpt["optimizer"]["param_groups"]]
            ours = [len(g["params"]) for g in acc.optimizer.param_groups]
            if sizes != ours:
                fail(f"optimizer param groups of sizes {sizes} vs {ours}")
    _check_small(acc, ckpt, path)


def _check_small(acc: "Accelerator", ckpt: dict[str, Any], path: str) -> None:
    def fail(why: str):
        raise ValueError(f"fastops.Accelerator.load: {path} does not match what this Accelerator prepared: {why}")

    if ckpt.get("fastops_checkpoint") not in _CKPT_READABLE:
        raise RuntimeError(f"fastops.Accelerator.load: {path} is not a fastops checkpoint (versions "
                           f"{_CKPT_READABLE} are read)")  # fmt: skip
    if (acc.scaler is None) != (ckpt["scaler"] is None):
        fail(f"it was saved with precision={ckpt['precision']!r}, loaded with {acc.precision!r} (loss scaler)")
    if len(ckpt["schedulers"]) < len(acc.schedulers):
        fail(f"it has {len(ckpt['schedulers'])} scheduler(s), {len(acc.schedulers)} prepared")


def _write_atomic(obj: Any, path: str) -> None:
    """torch.save to a temp file next to ``path`` that then replaces it. A symlink at ``path`` is written
    through, as torch.save does: its target is replaced and the link stays a link."""
    directory, base = os.path.split(os.path.realpath(path))
    # Only rank 0 writes and one run's saves follow each other, so a temp file of this target that is there now
    # was left by a save that was killed (20 kills left 246 MiB of them): removed before it piles up.
    stale = re.compile(re.escape(base) + r"\.[0-9a-f]{12}\.tmp")
    for name in os.listdir(directory):
        if stale.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    path = os.path.join(directory, base)
    tmp = os.path.join(directory, f"{base}.{secrets.token_hex(6)}.tmp")
    # Created by os.open with 0o666 so the kernel applies the umask (and a default ACL) as for open(path, "wb");
    # tempfile.mkstemp's 0o600 would make the checkpoint unreadable to the group.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # POSIX; Windows cannot open a directory
        # The rename is a change to the directory: until the directory is synced a power loss can bring
        # back the previous file.
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _plain(tree: Any) -> Any:
    """``tree`` with numpy values (``lr=np.float64(3e-4)`` in a param group, a scheduler's ``base_lrs`` copied
    from it) as Python numbers and lists, which ``torch.load(weights_only=True)`` reads and numpy's types are not.
    Not for a model's state_dict: rebuilt, its OrderedDict would lose the ``_metadata`` that module versions use."""

    def plain(v: Any) -> Any:
        return v.tolist() if type(v).__module__ == "numpy" and hasattr(v, "tolist") else v  # not np.dtype

    return pytree.tree_map(plain, tree)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    with contextlib.suppress(ImportError):
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        # As tensors and numbers, so the checkpoint loads with weights_only=True.
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        with contextlib.suppress(ImportError):
            import numpy as np

            s = state["numpy"]
            np.random.set_state((s["name"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
