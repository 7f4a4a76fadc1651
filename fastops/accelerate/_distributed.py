"""The processes behind an Accelerator: its device, the process group and ranks, the DDP/FSDP2 wrapping of the
model, and the all-reduces that keep the grad statistics (clip norm, fp16 found_inf) global under FSDP2."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import amp
from .._ops import unscale_check_
from .._util import resolve_device

if TYPE_CHECKING:
    from . import Accelerator

STRATEGIES = ("auto", "ddp", "fsdp", "tp", "fsdp+tp", "pp", "none")
MODEL_PARALLEL = ("tp", "fsdp+tp", "pp")  # on a device mesh (fastops._parallel)
SHARDED = ("fsdp", *MODEL_PARALLEL)
_FLAGS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def init_processes(acc: "Accelerator", device: torch.device | str | None) -> None:
    """Sets ``acc``'s device, ``distributed``, ``rank``, ``world_size``, ``local_rank``, ``is_main`` and
    ``keeps_freed_memory``, and initializes the process group under a launcher (torchrun) that set RANK and
    WORLD_SIZE when nobody has yet."""
    env = os.environ
    launched = "WORLD_SIZE" in env and "RANK" in env
    several = dist.is_available() and (launched or dist.is_initialized())
    local_rank = int(env["LOCAL_RANK"]) if several and "LOCAL_RANK" in env else None
    acc.device = resolve_device(device, local_rank, who="fastops.accelerate")
    if launched and not dist.is_initialized():
        if acc.device.type == "cuda":
            torch.cuda.set_device(acc.device)  # before NCCL creates its communicator
        dist.init_process_group("nccl" if acc.device.type == "cuda" else "gloo")
    acc.distributed = dist.is_available() and dist.is_initialized()
    acc.rank = dist.get_rank() if acc.distributed else 0
    acc.world_size = dist.get_world_size() if acc.distributed else 1
    acc.local_rank = local_rank or 0
    acc.is_main = acc.rank == 0
    if acc.device.type == "cuda":
        torch.cuda.set_device(acc.device)
    acc.keeps_freed_memory = acc.device.type == "cpu" and keep_freed_memory()


def resolve_strategy(strategy: str, world_size: int, distributed: bool) -> str:
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "none"
    if strategy != "none" and not distributed:
        raise ValueError(
            f"fastops.accelerate: strategy={strategy!r} needs a process group; launch with torchrun "
            "(which sets RANK, WORLD_SIZE and LOCAL_RANK) or call torch.distributed.init_process_group first"
        )
    return strategy


def init_mesh(acc: "Accelerator", tp_size: int, pp_size: int, tp_plan) -> None:
    """Sets ``acc.mesh`` (None outside model parallelism) and the data-parallel ``dp_rank``/``dp_size`` the
    loader shards by: under TP or PP, ranks of one dp group see the same batches."""
    acc.mesh, acc.tp_plan, acc.pipeline = None, tp_plan, None
    acc.dp_rank, acc.dp_size = acc.rank, acc.world_size
    if acc.strategy not in MODEL_PARALLEL:
        if tp_size != 1 or pp_size != 1 or tp_plan is not None:
            raise ValueError(f"fastops.accelerate: tp_size, pp_size and tp_plan need strategy 'tp', 'fsdp+tp' or "
                             f"'pp', not {acc.strategy!r}")
        return
    from .. import _parallel

    if acc.strategy == "pp" and (pp_size < 2 or tp_size != 1):
        raise ValueError(f"fastops.accelerate: strategy='pp' needs pp_size >= 2 (and tp_size=1), got "
                         f"pp_size={pp_size}, tp_size={tp_size}")
    if acc.strategy != "pp" and (tp_size < 2 or pp_size != 1):
        raise ValueError(f"fastops.accelerate: strategy={acc.strategy!r} needs tp_size >= 2 (and pp_size=1), got "
                         f"tp_size={tp_size}, pp_size={pp_size}")
    acc.mesh = _parallel.make_mesh(acc.world_size, tp_size=tp_size, pp_size=pp_size, device_type=acc.device.type)
    acc.dp_rank, acc.dp_size = acc.mesh["dp"].get_local_rank(), acc.mesh["dp"].size()


def keep_freed_memory() -> bool:
    """On the CPU, keep freed blocks of 8 MiB and more for reuse instead of unmapping them (fastops._C's
    caching layer over torch's CPU allocator, csrc/cpu/cache.cpp). Returns whether it is in place.

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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameter or grad), a plain tensor as it is."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def blocks(model: nn.Module) -> list[nn.Module]:
    """FSDP2 units: transformer layers (torch's, or ``*Block``/``*Layer`` classes in a ModuleList), else the
    model's children that hold parameters."""
    torch_layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    found = [m for m in model.modules() if isinstance(m, torch_layers)]
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            found += [c for c in m if type(c).__name__.endswith(("Block", "Layer")) and c not in found]
    if not found:
        found = [c for c in model.children() if any(True for _ in c.parameters())]
    return found


def wrap(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """``model`` under DDP, or sharded in place by FSDP2 (per block, then the root), or as it is."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
    return model


def grad_sync_context(module: nn.Module, strategy: str, sync: bool):
    """The context a forward under accumulate > 1 runs in: DDP's ``no_sync()`` when the gradients of this
    micro-step must not be all-reduced yet; FSDP2 is told through ``set_requires_gradient_sync`` instead."""
    if strategy == "ddp" and not sync:
        return module.no_sync()
    if strategy in ("fsdp", "fsdp+tp"):
        module.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def all_reduce_stats(stats: torch.Tensor) -> torch.Tensor:
    """[sum of squares, max |g|, found_inf] of the local FSDP2 shards -> the global ones (device-side)."""
    squares, maxes = stats[:1].clone(), stats[1:].clone()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return torch.cat([squares, maxes])


def fsdp_grad_stats(grads: list[torch.Tensor], inv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The global [sum of squares, max |g|, found_inf] of FSDP2 grads from this rank's local shards (each element
    of a param is on one rank only, so the sums add up): what prepare sets as the optimizer's ``grad_stats_fn``
    under strategy="fsdp" (see fastops/optim/optimizer.py)."""
    return all_reduce_stats(amp.grad_stats(grads, inv_scale))


class ShardedScaler(amp.GradScaler):
    """GradScaler for a non-fastops optimizer on FSDP2 grads: unscales the local shards and takes found_inf
    as the MAX over ranks, so every rank skips the same steps and keeps the same scale."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        grads = [local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found = found_inf.to(grads[0].device if grads else found_inf.device)
        with torch.no_grad():
            if grads:
                unscale_check_(grads, found, inv_scale.to(found.device))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return {found.device: found}
