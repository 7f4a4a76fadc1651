"""2-rank runs of fastops.accelerate for tests/test_accelerate_dist.py: ``tests/dist_worker.py STRATEGY OUT``, once
per rank, with the environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Each scenario trains a tiny model on a map-style DataLoader with the loop unchanged; rank 0 saves the
mean loss of every step and the full parameters to OUT, and the test compares them with ``reference``:
one process, plain torch, on the same global batches. The model and data live here so both sides share them.
Checkpoint checks (flags agreed on by all ranks) go to OUT as well.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fastops
from tests.accelerate_helpers import leave_without_shutdown  # noqa: E402

N, PER_RANK_BATCH, WORLD = 32, 4, 2
SCENARIOS = {
    # grad_clip 0.05 is below the grad norm of every step here, so clipping is active throughout.
    "adamw_clip": dict(opt="adamw", grad_clip=0.05, accumulate=1, epochs=2, shuffle=True),
    "accumulate": dict(opt="adamw", grad_clip=None, accumulate=2, epochs=1, shuffle=False),
    "sgd_clip": dict(opt="sgd", grad_clip=0.05, accumulate=1, epochs=1, shuffle=False),
}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(2))
        self.head = nn.Linear(8, 1)  # bias of 1 element: rank 1's FSDP2 shard of it is empty

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)


def make(opt_kind: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = Net().to(dtype)
    if opt_kind == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def global_batches(sc):
    """The indices of each global step: DistributedSampler's order (seed 0 + epoch), rank r taking every
    WORLD-th index, both ranks' per-rank batches side by side."""
    out = []
    for epoch in range(sc["epochs"]):
        if sc["shuffle"]:
            idx = torch.randperm(N, generator=torch.Generator().manual_seed(epoch))
        else:
            idx = torch.arange(N)
        per_rank = [idx[r::WORLD] for r in range(WORLD)]
        for i in range(0, N // WORLD, PER_RANK_BATCH):
            out.append(torch.cat([p[i : i + PER_RANK_BATCH] for p in per_rank]))
    return out


def reference(name: str, dtype=torch.float32):
    """Plain torch in one process: losses per global batch and the final parameters. ``dtype=torch.float64``: the
    exact answer of tests/rounding.py."""
    sc = SCENARIOS[name]
    x, y = (t.to(dtype) for t in data())
    model, opt = make(sc["opt"], dtype)
    batches = global_batches(sc)
    k = sc["accumulate"]
    losses = []
    for i in range(0, len(batches), k):
        idx = torch.cat(batches[i : i + k])  # k global micro-batches = one batch of k times the size
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        if sc["grad_clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), sc["grad_clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full(model) -> dict[str, torch.Tensor]:
    inner = model.module if hasattr(model, "no_sync") else model
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in inner.named_parameters()}


def _train(name: str, strategy: str, precision: str = "fp32"):
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from fastops.accelerate import accelerate

    sc = SCENARIOS[name]
    model, opt = make(sc["opt"])
    loader = DataLoader(TensorDataset(*data()), batch_size=PER_RANK_BATCH, shuffle=sc["shuffle"])
    model, opt, loader = accelerate(
        model, opt, loader, precision=precision, strategy=strategy, grad_clip=sc["grad_clip"], accumulate=sc["accumulate"]
    )
    losses = []
    for _ in range(sc["epochs"]):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / WORLD)
    return model, opt, losses


def main(strategy: str, out: str) -> None:
    import torch.distributed as dist

    from fastops.accelerate import accelerate

    results = {}
    for name in SCENARIOS:
        model, opt, losses = _train(name, strategy)
        results[name] = {"losses": losses, "params": _full(model)}

    # Checkpoint: every rank calls save and load; new objects must get the saved parameters and state.
    ckpt = os.path.join(os.path.dirname(out), f"ckpt_{strategy}.pt")
    model, opt, _ = _train("adamw_clip", strategy)
    acc = opt.accelerator
    acc.save(ckpt)
    saved = _full(model)
    saved_state = [v.clone() for s in opt.state.values() for k, v in sorted(s.items()) if torch.is_tensor(v) and v.dim()]
    model2, opt2 = make("adamw")
    model2, opt2, _ = accelerate(model2, opt2, precision="fp32", strategy=strategy)
    opt2.accelerator.load(ckpt)
    state2 = [v for s in opt2.state.values() for k, v in sorted(s.items()) if torch.is_tensor(v) and v.dim()]
    same = all(torch.equal(saved[n], p) for n, p in _full(model2).items()) and len(state2) == len(saved_state)
    same = same and all(torch.equal(_local(a), _local(b)) for a, b in zip(saved_state, state2))
    flag = torch.tensor([float(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    results["checkpoint_ok"] = bool(flag.item())

    # fp16 under the strategy: every rank must skip the same steps and keep the same scale.
    # fp16 under the strategy, with fastops' AdamW and with SGD: every rank must skip the same steps.
    for name in ("adamw_clip", "sgd_clip"):
        model, opt, losses = _train(name, strategy, precision="fp16")
        scales = [None] * WORLD
        dist.all_gather_object(scales, opt.accelerator.scaler.get_scale())
        results[f"fp16_{name}"] = {"losses": losses, "scales": scales}

    results.update(_checkpoint_checks(strategy, os.path.dirname(out)))
    if strategy == "fsdp":
        for precision in ("fp32", "fp16"):
            results[f"sharded_{precision}"] = _sharded_resume(precision, os.path.dirname(out))

    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    leave_without_shutdown()


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _all(flag: bool) -> bool:
    import torch.distributed as dist

    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _prepared(strategy: str):
    from torch.utils.data import DataLoader, TensorDataset

    from fastops.accelerate import accelerate

    model, opt = make("adamw")
    loader = DataLoader(TensorDataset(*data()), batch_size=PER_RANK_BATCH, shuffle=True)
    return accelerate(model, opt, loader, precision="fp32", strategy=strategy)


def _noisy_epoch(model, opt, loader) -> None:
    for x, y in loader:
        # Different on each rank (seeded per rank): a rank resumed with another rank's RNG state adds other
        # noise than it did in the uninterrupted run, and the averaged gradient changes.
        loss = F.mse_loss(model(x + 0.1 * torch.randn_like(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _checkpoint_checks(strategy: str, directory: str) -> dict[str, bool]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.utils.data import DistributedSampler

    rank = dist.get_rank()
    ckpt = os.path.join(directory, f"resume_{strategy}.pt")
    model, opt, loader = _prepared(strategy)
    out = {"sharded_sampler": _all(isinstance(loader.sampler, DistributedSampler) and len(loader.dataset) == N)}
    torch.manual_seed(100 + rank)
    for _ in range(2):
        _noisy_epoch(model, opt, loader)
    uninterrupted = _full(model)

    model, opt, loader = _prepared(strategy)
    torch.manual_seed(100 + rank)
    _noisy_epoch(model, opt, loader)
    opt.accelerator.save(ckpt)
    model, opt, loader = _prepared(strategy)
    torch.manual_seed(7)  # the same on both ranks, unlike what was saved
    opt.accelerator.load(ckpt)
    _noisy_epoch(model, opt, loader)
    resumed = _full(model)
    out["resume_bitwise"] = _all(all(torch.equal(uninterrupted[n], p) for n, p in resumed.items()))

    # Nothing can be written there: save must raise on both ranks, not leave rank 1 waiting or believing it saved.
    # Below a regular file, as DCP creates missing directories.
    blocker = os.path.join(directory, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    try:
        opt.accelerator.save(os.path.join(blocker, "ckpt.pt"))
        raised = False
    except (OSError, RuntimeError, CheckpointException):
        raised = True
    out["save_error_on_every_rank"] = _all(raised)

    if strategy == "ddp":
        # A load that only rank 0 makes must not wait for rank 1, which meanwhile waits (up to 30 s) for a file
        # rank 0 writes after its load.
        done = os.path.join(directory, "rank0_loaded")
        if rank == 0:
            opt.accelerator.load(ckpt)
            open(done, "w").close()
            seen = True
        else:
            for _ in range(3000):
                if os.path.exists(done):
                    break
                time.sleep(0.01)
            seen = os.path.exists(done)
        dist.barrier()
        out["rank0_only_load"] = _all(seen)
    return out


# ---- FSDP's sharded checkpoints: a scheduler and the fp16 scaler, resumed at 2 ranks here, in 1 process by the test

SHARDED_EPOCHS = 2  # saved after the first


def sharded_setup(strategy: str, precision: str, batch_size: int = PER_RANK_BATCH, dtype=torch.float32):
    """Model, fused AdamW with clipping, a StepLR that decays inside the first epoch, an unshuffled loader."""
    from torch.utils.data import DataLoader, TensorDataset

    from fastops.accelerate import Accelerator

    model, opt = make("adamw", dtype)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = DataLoader(TensorDataset(*(t.to(dtype) for t in data())), batch_size=batch_size)
    acc = Accelerator(strategy=strategy, precision=precision, grad_clip=0.05)
    return (acc, *acc.prepare(model, opt, sched, loader))


def sharded_reference(dtype) -> list[float]:
    """The uninterrupted fp32 run of the sharded-checkpoint scenario in one process (global batches: both ranks'
    halves side by side), in ``dtype`` (float64: the exact answer of tests/rounding.py)."""
    acc, model, opt, sched, _ = sharded_setup("none", "fp32", dtype=dtype)
    x, y = (t.to(dtype) for t in data())
    batches = [(x[i], y[i]) for i in global_batches(dict(epochs=SHARDED_EPOCHS, shuffle=False))]
    return sharded_epoch(model, opt, sched, batches)


def sharded_epoch(model, opt, sched, batches) -> list[float]:
    import torch.distributed as dist

    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
    return losses


def _legacy_fsdp_file(acc, path: str) -> None:
    """The one gathered file strategy="fsdp" saved before its checkpoints were sharded (fastops 8f3ed5f)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from fastops.accelerate import _checkpoint

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(acc.model, options=options)
    with acc._step_state.raw_calls():
        optim_sd = get_optimizer_state_dict(acc.model, acc.optimizer, options=options)
    state = {"format": "fsdp", "model": model_sd, "optimizer": optim_sd, **_checkpoint._small(acc, _checkpoint._rngs(acc))}
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


def _sharded_resume(precision: str, directory: str) -> dict:
    """Two epochs straight, and one epoch, save (a directory), load into fresh objects, one more: the losses
    after the save, the scheduler's and scaler's states at it, and (fp32) the same from the old one-file format."""
    acc, model, opt, sched, loader = sharded_setup("fsdp", precision)
    straight = []
    for _ in range(SHARDED_EPOCHS):
        straight += sharded_epoch(model, opt, sched, loader)

    acc, model, opt, sched, loader = sharded_setup("fsdp", precision)
    first = sharded_epoch(model, opt, sched, loader)
    path = os.path.join(directory, f"sharded_{precision}")
    acc.save(path)
    saved = {"sched": sched.state_dict(), "scaler": acc.scaler.state_dict() if acc.scaler else None}
    if precision == "fp32":
        _legacy_fsdp_file(acc, path + ".legacy.pt")
    out = {"straight": straight, "first": first, "path": path, "saved": saved, "files": sorted(os.listdir(path))}
    for source in [path] + ([path + ".legacy.pt"] if precision == "fp32" else []):
        acc, model, opt, sched, loader = sharded_setup("fsdp", precision)
        acc.load(source)
        loaded = {"sched": sched.state_dict(), "scaler": acc.scaler.state_dict() if acc.scaler else None}
        key = "legacy" if source.endswith(".pt") else "resumed"
        out[key] = {"losses": sharded_epoch(model, opt, sched, loader), "state": loaded, "step": acc.step,
                    "epoch": loader.epoch}  # fmt: skip
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
