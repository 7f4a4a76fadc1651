"""The processes behind an Accelerator: its device, the process group, ranks and mesh (one frozen
``ProcessState``), the DDP/FSDP2 wrapping of the model, and the all-reduces that keep the grad statistics (clip
norm, fp16 found_inf) global under FSDP2."""

from __future__ import annotations

import atexit
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import amp
from .._ops import unscale_check_
from .._util import resolve_device
from ._state import ProcessState

STRATEGIES = ("auto", "ddp", "fsdp", "tp", "fsdp+tp", "pp", "none")
MODEL_PARALLEL = ("tp", "fsdp+tp", "pp")  # on a device mesh (fastops.accelerate._parallel)
SHARDED = ("fsdp", *MODEL_PARALLEL)


def process_state(device: torch.device | str | None, strategy: str, tp_size: int = 1, pp_size: int = 1,
                  tp_plan=None) -> ProcessState:
    """Where an Accelerator runs. Initializes the process group under a launcher (torchrun) that set RANK and
    WORLD_SIZE when nobody has yet, resolves ``device`` and ``strategy`` ("auto": ddp with several ranks), and
    builds the device mesh under model parallelism. Validates ``tp_size``/``pp_size``/``tp_plan`` against the
    strategy; ``tp_plan`` itself is used by the model's preparation."""
    if strategy not in STRATEGIES:  # before anything starts a process group
        raise ValueError(f"fastops.accelerate: unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    env = os.environ
    launched = "WORLD_SIZE" in env and "RANK" in env
    several = dist.is_available() and (launched or dist.is_initialized())
    local_rank = int(env["LOCAL_RANK"]) if several and "LOCAL_RANK" in env else None
    device = resolve_device(device, local_rank, who="fastops.accelerate")
    if launched and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL creates its communicator
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # The group fastops started, fastops ends, while the interpreter is still whole: left to finalization, gloo's
        # worker threads can free tensors that take the GIL then, and the rank dies with SIGABRT ("terminate called
        # without an active exception"; seen here once at the end of examples/train_one_line.py under torchrun, a
        # loaded machine). A group the user started is the user's to destroy.
        atexit.register(_destroy_process_group)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if device.type == "cuda":
        torch.cuda.set_device(device)
    strategy = _resolve_strategy(strategy, world_size, distributed)
    mesh = _mesh(strategy, world_size, device, tp_size, pp_size, tp_plan)
    dp_rank, dp_size = (rank, world_size) if mesh is None else (mesh["dp"].get_local_rank(), mesh["dp"].size())
    return ProcessState(device=device, distributed=distributed, rank=rank, world_size=world_size,
                        local_rank=local_rank or 0, strategy=strategy, mesh=mesh, dp_rank=dp_rank, dp_size=dp_size)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _resolve_strategy(strategy: str, world_size: int, distributed: bool) -> str:
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "none"
    if strategy != "none" and not distributed:
        raise ValueError(
            f"fastops.accelerate: strategy={strategy!r} needs a process group; launch with torchrun "
            "(which sets RANK, WORLD_SIZE and LOCAL_RANK) or call torch.distributed.init_process_group first"
        )
    return strategy


def _mesh(strategy: str, world_size: int, device: torch.device, tp_size: int, pp_size: int, tp_plan):
    """The device mesh under model parallelism (None otherwise), after checking the sizes fit the strategy."""
    if strategy not in MODEL_PARALLEL:
        if tp_size != 1 or pp_size != 1 or tp_plan is not None:
            raise ValueError(f"fastops.accelerate: tp_size, pp_size and tp_plan need strategy 'tp', 'fsdp+tp' or "
                             f"'pp', not {strategy!r}")
        return None
    if strategy == "pp" and (pp_size < 2 or tp_size != 1):
        raise ValueError(f"fastops.accelerate: strategy='pp' needs pp_size >= 2 (and tp_size=1), got "
                         f"pp_size={pp_size}, tp_size={tp_size}")
    if strategy != "pp" and (tp_size < 2 or pp_size != 1):
        raise ValueError(f"fastops.accelerate: strategy={strategy!r} needs tp_size >= 2 (and pp_size=1), got "
                         f"tp_size={tp_size}, pp_size={pp_size}")
    from . import _parallel

    return _parallel.make_mesh(world_size, tp_size=tp_size, pp_size=pp_size, device_type=device.type)


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
