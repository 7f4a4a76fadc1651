"""Model parallelism on torch.distributed: a device mesh, tensor parallel (a model's own HF plan or the user's),
2-D FSDP2 x TP, pipeline stages with torch's schedules, and the global grad statistics the fused optimizers need.

Every collective is torch's: ``parallelize_module`` (TP), ``fully_shard`` (FSDP2), ``torch.distributed.pipelining``
(PP) and ``torch.distributed.all_reduce`` over the mesh's groups (data-parallel grads under "tp", the grad norm).

Mesh dims are named ("pp", "dp", "tp"); "pp" and "tp" are only present when their size is above 1.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .. import _grads

STRATEGIES = ("tp", "fsdp+tp", "pp")

# HF transformers' plan strings (transformers/integrations/tensor_parallel.py) as torch ParallelStyles. "replicate"
# maps to None: a plain param is already a full copy on every TP rank, which is what HF's ReplicateParallel makes.
_HF_STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    "replicate": lambda: None,
}


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_mesh(world: int | None = None, tp_size: int = 1, pp_size: int = 1, device_type: str | None = None) -> DeviceMesh:
    """A mesh ("pp", "dp", "tp") over ``world`` ranks, dp being what is left; pp and tp dims only when above 1.
    TP is the innermost dim: its ranks are neighbours (one node), as torchtitan lays it out."""
    world = dist.get_world_size() if world is None else world
    if tp_size < 1 or pp_size < 1 or world % (tp_size * pp_size):
        raise ValueError(f"tp_size={tp_size} x pp_size={pp_size} must divide the world size {world}")
    shape, names = [], []
    if pp_size > 1:
        shape.append(pp_size), names.append("pp")
    shape.append(world // (tp_size * pp_size)), names.append("dp")
    if tp_size > 1:
        shape.append(tp_size), names.append("tp")
    return init_device_mesh(device_type or _device_type(), tuple(shape), mesh_dim_names=tuple(names))


def _size(mesh: DeviceMesh, dim: str) -> int:
    return mesh[dim].size() if dim in (mesh.mesh_dim_names or ()) else 1


def model_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's own TP plan, keyed from the model's root: HF's ``model._tp_plan``, else the config's
    ``base_model_tp_plan`` prefixed with the base model's attribute (``model.`` for LlamaForCausalLM)."""
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def _style(name: str, value: Any) -> ParallelStyle | None:
    if isinstance(value, ParallelStyle):
        return value
    if isinstance(value, str) and value in _HF_STYLES:
        return _HF_STYLES[value]()
    raise ValueError(f"tp_plan[{name!r}] = {value!r}: expected a torch ParallelStyle or one of {sorted(_HF_STYLES)}")


def resolve_tp_plan(model: nn.Module, tp_plan: dict[str, Any] | None = None) -> dict[str, ParallelStyle]:
    """``tp_plan`` (or the model's own plan) as ``{pattern: ParallelStyle}``; patterns use ``*`` for one name
    level, as in ``"layers.*.mlp.up_proj"``. Every pattern must match a module: a typo would silently leave
    that layer replicated."""
    plan = tp_plan if tp_plan is not None else model_tp_plan(model)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (no HF `_tp_plan` or `config.base_model_tp_plan`): "
            "pass tp_plan={module name pattern: style}, e.g. "
            "tp_plan={'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'}; styles are 'colwise', 'rowwise', "
            "'sequence_parallel', 'replicate' or torch.distributed.tensor.parallel ParallelStyle objects.")
    names = [n for n, _ in model.named_modules() if n]
    out = {}
    for pattern, value in plan.items():
        if not any(_matches(pattern, n) for n in names):
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}")
        style = _style(pattern, value)
        if style is not None:
            out[pattern] = style
    return out


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, Any] | None = None) -> nn.Module:
    """Shards the plan's modules over ``tp_mesh`` in place (torch's parallelize_module). Params outside the plan
    stay plain tensors: a full copy per TP rank, whose grads torch's TP backward leaves equal on every rank."""
    parallelize_module(model, tp_mesh, resolve_tp_plan(model, tp_plan))
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    # FSDP2 units: the entries of every ModuleList (transformer layers), as torchtitan wraps each block.
    return [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]


def sync_dp_grads(params, dp_group) -> None:
    """Averages every grad over the data-parallel group (the local shard of a DTensor grad)."""
    n = dist.get_world_size(dp_group)
    for p in params:
        if p.grad is not None:
            g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=dp_group)
            g.div_(n)


def _dp_grad_hooks(model: nn.Module, dp_group) -> None:
    # The average is linear, so reducing after every backward also serves gradient accumulation.
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: sync_dp_grads([p], dp_group))


def parallelize(model: nn.Module, mesh: DeviceMesh, strategy: str, tp_plan: dict[str, Any] | None = None,
                mp_policy=None) -> nn.Module:
    """``"tp"``: TP over the mesh's "tp" dim, grads averaged over "dp". ``"fsdp+tp"``: TP over "tp", then FSDP2
    over "dp" on the same mesh (each ModuleList entry, then the root). In place; returns the model."""
    if strategy not in ("tp", "fsdp+tp"):
        raise ValueError(f"parallelize: strategy {strategy!r} is not 'tp' or 'fsdp+tp' (use Pipeline for 'pp')")
    if "tp" in (mesh.mesh_dim_names or ()):
        apply_tp(model, mesh["tp"], tp_plan)
    dp = mesh["dp"]
    if strategy == "fsdp+tp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"mesh": dp, "mp_policy": mp_policy or MixedPrecisionPolicy()}
        for block in _blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif dp.size() > 1:
        _dp_grad_hooks(model, dp.get_group())
    return model


def _replicas(p: Tensor, world: int, pp_size: int) -> int:
    """How many ranks of the world hold this param's grad (its local piece): ranks of other pipeline stages
    hold other params; the dims a DTensor is sharded over split it into distinct pieces."""
    shards = 1
    if isinstance(p, DTensor):
        for size, placement in zip(p.device_mesh.shape, p.placements):
            if not placement.is_replicate():  # Shard, or FSDP2's _StridedShard over TP (not a Shard subclass)
                shards *= size
    return world // (pp_size * shards)


def global_grad_stats(optimizer, mesh: DeviceMesh | None = None, group=None):
    """Installs on a fastops fused optimizer, as its ``grad_stats_fn`` (fastops/optim/optimizer.py), the grad
    statistics of the whole mesh: the squared norm sums each local grad weighted by 1/(ranks holding it), so a
    param replicated over TP (or DP) ranks counts once, then sums over all ranks; max |g| and found_inf take the
    max. The clip and the fp16 skip then agree with one process and across ranks."""

    world = dist.get_world_size(group)
    pp_size = _size(mesh, "pp") if mesh is not None else 1

    def stats(grads: list[Tensor], inv_scale: Tensor | None) -> Tensor:
        weight = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                    weight[id(local)] = _replicas(p, world, pp_size)
        by_weight: dict[int, list[Tensor]] = {}
        for t in grads:
            if id(t) not in weight:
                raise RuntimeError("global_grad_stats: a grad handed to the norm is not a param's grad")
            by_weight.setdefault(weight[id(t)], []).append(t)
        parts = [(w, _grads.grad_stats(ts, inv_scale)) for w, ts in by_weight.items()]
        if not parts:
            out = torch.zeros(3)
        else:
            out = torch.stack([sum(s[0] / w for w, s in parts), torch.stack([s[1] for _, s in parts]).max(),
                               torch.stack([s[2] for _, s in parts]).max()])
        sq, mx = out[:1].clone(), out[1:].clone()
        dist.all_reduce(sq, group=group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        return torch.cat([sq, mx])

    optimizer.grad_stats_fn = stats
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: align_grads(opt))
    return optimizer


def align_grads(optimizer) -> None:
    """Gives every DTensor grad its param's placements: torch's TP backward can leave one differently laid out
    (an embedding sharded by rows gets a replicated or partial grad), and the fused step reads local shards."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                p.grad = grad.redistribute(p.device_mesh, p.placements)


# ---------------------------------------------------------------------------------------------------- pipeline


def split_stages(model: nn.Module, pp_size: int, split: list[int] | None = None) -> list[nn.Module]:
    """An nn.Sequential cut into ``pp_size`` consecutive stages: at the child indices ``split`` (``pp_size - 1``
    of them), else into near-equal counts. Any other model: pass the stages yourself (a list of modules)."""
    if isinstance(model, (list, tuple)):
        if len(model) != pp_size:
            raise ValueError(f"{len(model)} stage modules given for pp_size={pp_size}")
        return list(model)
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"pipeline: cannot split a {type(model).__name__} automatically; pass an nn.Sequential, or the stages "
            "as a list of pp_size modules whose outputs feed the next one")
    n = len(model)
    if split is None:
        split = [round(n * i / pp_size) for i in range(1, pp_size)]
    bounds = [0, *split, n]
    if len(bounds) != pp_size + 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split={split} does not cut {n} children into {pp_size} non-empty stages")
    children = list(model.children())
    names = [k for k, _ in model.named_children()]
    stages = []
    for a, b in zip(bounds, bounds[1:]):
        s = nn.Sequential()
        for k, m in zip(names[a:b], children[a:b]):
            s.add_module(k, m)  # the original names, so the stages' FQNs are the model's
        stages.append(s)
    return stages


class Pipeline:
    """This rank's stage of a pipeline over the mesh's "pp" dim, data parallel over "dp".

    The schedule runs forward and backward itself, so the loop's ``loss = loss_fn(model(x), y); loss.backward()``
    becomes ``loss = pipe.train_step((x, y), loss_fn)``; the optimizer steps as before on ``pipe.module``.
    The returned loss is the batch's mean of the microbatch losses, on every rank."""

    def __init__(self, model, mesh: DeviceMesh, n_microbatches: int, schedule: str = "1f1b",
                 split: list[int] | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        if schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule {schedule!r}: expected 'gpipe' or '1f1b'")
        self.mesh, self.n_microbatches, self.schedule_name = mesh, n_microbatches, schedule
        self.pp_size = _size(mesh, "pp")
        self.pp_group = mesh["pp"].get_group() if self.pp_size > 1 else None
        self.stage_index = mesh["pp"].get_local_rank() if self.pp_size > 1 else 0
        self.module = split_stages(model, self.pp_size, split)[self.stage_index]
        device = torch.device(_device_type(), torch.cuda.current_device()) if _device_type() == "cuda" else torch.device("cpu")
        self.module.to(device)
        self.stage = PipelineStage(self.module, self.stage_index, self.pp_size, device, group=self.pp_group)
        self.dp_group = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
        self._schedules: dict[Any, Any] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.pp_size - 1

    def parameters(self):
        return self.module.parameters()

    def _schedule(self, loss_fn):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if loss_fn not in self._schedules:
            cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            # scale_grads (torch's default): grads are the mean over microbatches, as one full-batch backward.
            self._schedules[loss_fn] = cls(self.stage, self.n_microbatches, loss_fn=loss_fn)
        return self._schedules[loss_fn]

    def train_step(self, batch, loss_fn) -> Tensor:
        inputs, target = batch
        if inputs.shape[0] % self.n_microbatches:
            raise ValueError(f"batch of {inputs.shape[0]} does not split into {self.n_microbatches} microbatches")
        sched = self._schedule(loss_fn)
        losses: list[Tensor] = []
        if self.is_first and self.is_last:
            sched.step(inputs, target=target, losses=losses)
        elif self.is_first:
            sched.step(inputs)
        elif self.is_last:
            sched.step(target=target, losses=losses)
        else:
            sched.step()
        loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros(())
        if self.pp_size > 1:
            # The last stage's loss to every stage: the loop logs the same number on all ranks.
            dist.broadcast(loss, group_src=self.pp_size - 1, group=self.pp_group)
        if self.dp_group is not None:
            sync_dp_grads(self.module.parameters(), self.dp_group)
            dist.all_reduce(loss, group=self.dp_group)
            loss /= dist.get_world_size(self.dp_group)
        return loss

    def __call__(self, *args, **kwargs):
        raise RuntimeError("under pipeline parallelism the schedule runs forward and backward: replace "
                           "`loss = loss_fn(model(x), y); loss.backward()` with `loss = train_step((x, y), loss_fn)`")
