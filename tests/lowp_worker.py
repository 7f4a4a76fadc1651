"""2-rank FSDP2 and TP runs for tests/test_lowp_dist.py: ``tests/lowp_worker.py OUT CKPT``, once per rank, with
the environment torchrun would set (gloo). For each state_dtype under FSDP2: 10 uninterrupted steps, and 5 steps
+ DCP save + load into a fresh sharded model/optimizer + 5 steps; under TP (colwise, then rowwise): 10 steps. Rank 0 saves ``{fmt: result}`` to OUT; the checkpoints stay
under CKPT/<fmt> for the one-process load in the test.

Weights of 100 x 50 (over MIN_8BIT_NUMEL = 4096): a shard of 50 rows holds 2500 elements, not a multiple of the 256-element blocks, so the
shards' blocks are not the one-process blocks and a resharded load of raw codes would pair them wrongly."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fastops
from tests.accelerate_helpers import leave_without_shutdown  # noqa: E402

STEPS, SAVE_AT, CLIP, LR = 10, 5, 0.05, 1e-2
FORMATS = ("fp32", "bf16", "8bit")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(50, 100), nn.GELU(), nn.Linear(100, 50))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 50, generator=g), torch.randn(8, 50, generator=g)


def optimizer(model: nn.Module, fmt: str):
    import fastops

    return fastops.optim.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP, state_dtype=fmt, state_seed=3)


def train(model, opt, steps, rank: int = 0, world: int = 1) -> tuple[list[float], list[float]]:
    """Losses (of the global batch) and the optimizer's grad norms; each rank takes its slice of the batch."""
    losses, norms = [], []
    dtype = next(model.parameters()).dtype  # float64: the exact answer of tests/rounding.py
    for s in steps:
        x, y = (t.to(dtype) for t in batch(s))
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        loss = loss.detach().clone()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        norms.append(float(opt.last_grad_norm))
    return losses, norms


def sharded(fmt: str):
    from torch.distributed.fsdp import fully_shard

    model = net()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = optimizer(model, fmt)
    # As fastops.accelerate(strategy="fsdp") does: the clip norm is over both shards, not this rank's.
    from fastops.accelerate._distributed import fsdp_grad_stats

    opt.grad_stats_fn = fsdp_grad_stats
    return model, opt


def tensor_parallel(fmt: str):
    """As fastops.accelerate(strategy="tp") builds it: the first layer split by rows (colwise), the second by
    columns (rowwise), every rank on the whole batch, the clip norm over the mesh with each shard counted once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fastops.accelerate._parallel import global_grad_stats

    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = parallelize_module(net(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = optimizer(model, fmt)
    global_grad_stats(opt, mesh)
    return model, opt


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out, ckpt = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for fmt in FORMATS:
        model, opt = sharded(fmt)
        full, norms = train(model, opt, range(STEPS), rank, world)
        model, opt = sharded(fmt)
        first, _ = train(model, opt, range(SAVE_AT), rank, world)
        msd, osd = get_state_dict(model, opt)
        dtypes = {k: str(v["exp_avg"].dtype) + type(v["exp_avg"]).__name__ for k, v in osd["state"].items()}
        path = os.path.join(ckpt, fmt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        model, opt = sharded(fmt)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        resumed, _ = train(model, opt, range(SAVE_AT, STEPS), rank, world)
        results[fmt] = {"full": full, "norms": norms, "resumed": first + resumed, "saved_dtypes": dtypes}
    for fmt in FORMATS:
        model, opt = tensor_parallel(fmt)
        full, norms = train(model, opt, range(STEPS))
        kinds = {str(opt.state[p]["exp_avg"].dtype) for p in model.parameters()}
        results["tp-" + fmt] = {"full": full, "norms": norms, "state_dtypes": kinds}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    leave_without_shutdown()


if __name__ == "__main__":
    main()
