"""fastops.accelerate: one line that adds mixed precision, fused AdamW, clipping, accumulation, DDP/FSDP2 and
prefetching to an unchanged training loop.

    model, optimizer, loader = fastops.accelerate(model, optimizer, loader)
    for batch in loader:                       # the user's loop, as it was
        loss = loss_fn(model(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

How the loop stays unchanged (the modules beside this one tell the details):
- the model's ``forward`` runs under autocast, and its outputs scale the gradient that comes through them
  (``_model``);
- the optimizer keeps its identity: torch's AdamW/Adam/SGD becomes fastops' fused one in place, with ``step``/
  ``zero_grad`` that count micro-steps, scale, clip and step (``_optimizer``);
- the loader is sharded across ranks, wrapped in fastops.data.Prefetcher and gets ``set_epoch`` each pass
  (``_loader``);
- an AMP script that keeps its own GradScaler (``scaler.scale(loss).backward(); scaler.step(optimizer);
  scaler.update()``) runs unchanged under fp16 with accumulate=1: that scaler drives the step (``_model``).

Limits:
- Loss scaling and the 1/k of accumulation reach only gradient that flows through the model's outputs. A loss
  term whose gradient reaches the parameters another way, e.g. ``ce(model(x), y) + 1e-4 * sum(p.square().sum()
  for p in model.parameters())``, gets neither: under fp16 its gradient is divided by the loss scale (65536 at
  the start) without having been multiplied by it, and under accumulate=k it counts k times per step instead
  of once. fastops cannot tell such a term apart from gradient that did pass through the outputs (both end up
  summed in ``p.grad``), so it cannot raise for it. ``Accelerator.backward(loss)`` (``optimizer.accelerator.
  backward(loss)``) is the exact path: it computes ``(loss * scale / k).backward()`` with the output hooks off.
  What fastops does detect is a backward in which no gradient came through the outputs at all (an output
  container it does not look into, say ``SimpleNamespace(logits=...)``, or a loss not computed from the
  outputs): under fp16 or accumulate > 1 the optimizer step then raises instead of training unscaled; a forward
  whose outputs hold no floating tensor fastops recognises also warns once.
- A ``torch.utils.data.DataLoader`` with ``num_workers=0`` is read on the loop's thread, so that its draws from
  the global RNGs stay in the loop's order (``_loader``). Any other iterable is read in a background thread; one
  that draws from the global generators makes runs irreproducible, so give it its own ``torch.Generator``.
- ``save``/``load`` record the loader's epoch, not the position inside it: resume at a pass boundary.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Iterable

import torch
import torch.nn as nn

from .. import amp
from . import _auto, _checkpoint, _cpu_cache, _distributed, _loader, _model, _optimizer
from ._model import PRECISIONS
from ._state import ProcessState, StepState

__all__ = ["accelerate", "Accelerator"]


def accelerate(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable | None = None, **options):
    """``model, optimizer, loader = fastops.accelerate(model, optimizer, loader)``; ``options`` are
    ``Accelerator``'s keywords. The Accelerator is reachable afterwards as ``optimizer.accelerator`` (for
    ``save``/``load``)."""
    acc = Accelerator(**options)
    model, optimizer = acc.prepare(model, optimizer)
    return model, optimizer, (acc.prepare(loader) if loader is not None else None)


_PREPARE = {"model": _model.prepare_model, "optimizer": _optimizer.prepare_optimizer,
            "scheduler": _optimizer.prepare_scheduler, "loader": _loader.prepare_loader}  # fmt: skip


class Accelerator:
    """The object form of ``fastops.accelerate``.

    Args:
        precision: "auto" (bf16 where the device computes it natively, else fp32), "bf16", "fp16" (with loss
            scaling by fastops.amp.GradScaler) or "fp32".
        strategy: "auto" (ddp when WORLD_SIZE > 1), "ddp", "fsdp" (FSDP2 fully_shard per block, then the root),
            "tp" (tensor parallel over ``tp_size`` ranks, data parallel over the rest), "fsdp+tp" (FSDP2 over dp
            and TP over ``tp_size`` on one device mesh), "pp" (``pp_size`` pipeline stages, data parallel over
            the rest) or "none". See fastops.accelerate._parallel.
        tp_size, pp_size: ranks per TP group, pipeline stages.
        tp_plan: ``{module name pattern: "colwise" | "rowwise" | "sequence_parallel" | "replicate" | ParallelStyle}``;
            default: an HF transformers model's own plan (``model._tp_plan`` / ``config.base_model_tp_plan``).
        n_microbatches, pp_schedule: under "pp", microbatches per batch (default pp_size) and "1f1b" or "gpipe".
            The schedule runs forward and backward, so the loop's ``loss = loss_fn(model(x), y);
            loss.backward()`` becomes ``loss = acc.train_step((x, y), loss_fn)``; calling the model raises.
        grad_clip: max global grad norm, or None.
        accumulate: k micro-batches per optimizer step. Micro-steps are counted across loader passes: when a
            pass has a number of batches that is not a multiple of k, its last micro-batches' gradients are
            carried into the first step of the next pass, and those left over when training ends are never
            applied. (HF Accelerate by default steps at the end of every pass instead:
            ``GradientAccumulationPlugin(sync_with_dataloader=True)``.) Make the pass length a multiple of k,
            e.g. with ``drop_last`` and a batch count that divides, to keep steps aligned with epochs.
        compile: True, False or "auto" (the default): torch.compile each repeated block of the model once per
            signature (HF's ``_no_split_modules``, the items of a ``ModuleList``/``Sequential`` of one class), the rest
            eager; blocks where compiling does not pay (convolution blocks on the CPU) stay eager; a failed compile
            falls back to eager with a warning (``_compile``). "auto" compiles where the rules of ``_auto`` say it
            pays.
        fused_loss: True, False or "auto" (the default): an HF transformers model trained with ``labels`` computes
            its cross-entropy loss with ``fastops.linear_cross_entropy`` (the loss and its gradients without the
            logits; rows whose label is ignored cost nothing); ``out.logits`` is built when something reads it.
            "auto" decides at the first labeled call, from its shapes, whether the fused op is the faster one. A
            head that does more than a linear map is left as it is (``_fused_loss``). ``decision`` holds what was
            decided and why, logged in one line (logger ``fastops.accelerate``) at the first training call.
        device: default: cuda:LOCAL_RANK under a launcher that sets LOCAL_RANK (torchrun), the current CUDA
            device otherwise, and the CPU without CUDA. "cuda" without an index means the same device. On the
            CPU, freed blocks of 8 MiB and more are then kept for reuse (``keeps_freed_memory``; see
            ``_cpu_cache.keep_freed_memory``, FASTOPS_KEEP_FREED_MEMORY=0 to opt out).

    Where it runs is ``state``, a frozen ``ProcessState`` made once (HF Accelerate's ``PartialState`` is the model);
    its fields read as attributes: ``device``, ``distributed``, ``rank``, ``world_size``, ``local_rank``,
    ``is_main``, ``strategy`` (resolved: never "auto"), ``mesh``, ``dp_rank``, ``dp_size``.

    ``prepare(*objects)`` takes a model, an optimizer, LR schedulers and loaders (model before optimizer) and
    returns them prepared, in the same order. ``save(path)``/``load(path)`` checkpoint everything.

    ``step`` counts the optimizer steps taken at accumulation boundaries, including fp16 steps that were
    skipped for inf/nan grads: telling those apart takes a host read of the device-side skip flag, which the
    step never does (``optimizer.step_was_skipped`` holds it). ``micro_step`` counts every
    ``optimizer.step()`` call. Prepared LR schedulers do not advance on skipped steps.
    """

    def __init__(
        self,
        precision: str = "auto",
        strategy: str = "auto",
        grad_clip: float | None = None,
        accumulate: int = 1,
        compile: bool | str = "auto",
        fused_loss: bool | str = "auto",
        device: torch.device | str | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        tp_plan: dict | None = None,
        n_microbatches: int | None = None,
        pp_schedule: str = "1f1b",
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"fastops.accelerate: unknown precision {precision!r}; choose one of {PRECISIONS}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"fastops.accelerate: accumulate must be an int >= 1, got {accumulate!r}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"fastops.accelerate: grad_clip must be > 0 or None, got {grad_clip!r}")
        self.grad_clip = None if grad_clip is None else float(grad_clip)
        self.accumulate = accumulate
        _auto.check_option("compile", compile)
        _auto.check_option("fused_loss", fused_loss)
        self.compile, self.fused_loss = compile, fused_loss  # as asked; what was decided: self.decision
        self.decision = _auto.Decision()
        self.fused_head = None

        self.state = _distributed.process_state(device, strategy, tp_size, pp_size, tp_plan)
        self.keeps_freed_memory = self.device.type == "cpu" and _cpu_cache.keep_freed_memory()
        self.tp_plan = tp_plan
        self.n_microbatches, self.pp_schedule = n_microbatches or pp_size, pp_schedule
        self.precision, self.amp_dtype = _model.resolve_precision(precision, self.device)
        self.scaler: amp.GradScaler | None = None
        if self.precision == "fp16":
            self.scaler = (_distributed.ShardedScaler if self.strategy == "fsdp" else amp.GradScaler)(self.device.type)
            self.scaler._lazy_init_scale_growth_tracker(self.device)
            _model.watch_user_scalers(self)

        self.model: nn.Module | None = None
        self._inner: nn.Module | None = None  # the user's module, before DDP/TP wrapping
        self.pipeline = None  # the pipeline schedule under strategy="pp" (_parallel.Pipeline)
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedulers: list[_optimizer.Scheduler] = []
        self.loaders: list[_loader.Loader] = []
        self.step = 0  # optimizer steps at accumulation boundaries, fp16-skipped ones included
        self.micro_step = 0  # optimizer.step() calls, micro-steps included
        self._step_state = StepState()
        self._names: dict[int, str] = {}  # id(param) -> name before wrapping, for FSDP2's re-pointing

    def prepare(self, *objects):
        kinds = [self._kind(o) for o in objects]
        out = list(objects)
        for wanted in ("model", "optimizer", "scheduler", "loader"):
            for i, (kind, obj) in enumerate(zip(kinds, objects)):
                if kind == wanted:
                    out[i] = _PREPARE[kind](self, obj)
                    self._keep(kind, out[i])
        return out[0] if len(out) == 1 else tuple(out)

    def _keep(self, kind: str, prepared) -> None:
        """The prepare helpers return what they make and the Accelerator keeps it here (the model's helper, which
        also records what FSDP2 and pipelines need, sets ``model`` itself)."""
        if kind == "optimizer":
            self.optimizer = prepared
        elif kind == "scheduler":
            self.schedulers.append(prepared)
        elif kind == "loader":
            self.loaders.append(prepared)

    @staticmethod
    def _kind(obj) -> str:
        if isinstance(obj, nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            return "scheduler"
        if isinstance(obj, Iterable) or hasattr(type(obj), "__getitem__"):
            return "loader"
        raise TypeError(f"fastops.Accelerator.prepare: cannot prepare a {type(obj).__name__}")

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``(loss * scale / k).backward(**kwargs)``, with the model's output hooks standing aside: every term of
        the loss is scaled once, including terms whose gradient does not pass through the model's outputs
        (which ``loss.backward()`` leaves unscaled, see the module docstring). Plain ``loss.backward()`` when
        there is nothing to scale (no fp16, accumulate=1)."""
        factor = _model.grad_factor(self)
        if factor is None:
            loss.backward(**kwargs)
            return
        self._step_state.exact_backward = True
        try:
            (loss * factor.to(loss.device)).backward(**kwargs)
        finally:
            self._step_state.exact_backward = False
        self._step_state.grads_scaled = True

    def train_step(self, batch, loss_fn) -> torch.Tensor:
        """Forward and backward of ``batch = (inputs, target)``: ``loss_fn(model(inputs), target)`` then
        ``backward``; under strategy="pp" the pipeline schedule over microbatches. Returns the (detached) loss;
        the optimizer steps as before. The one loop change pipelining needs."""
        if self.pipeline is not None:
            return self.pipeline.train_step(batch, loss_fn)
        inputs, target = batch
        loss = loss_fn(self.model(inputs), target)
        self.backward(loss)
        return loss.detach()

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """The user's module under the DDP wrapper (FSDP2 works in place)."""
        model = self.model if model is None else model
        return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model

    def save(self, path: str | os.PathLike, full: bool = False) -> None:
        """Writes model, optimizer, scaler, schedulers, step counters, each rank's RNG states and loader epochs
        to ``path``.

        With several ranks, every rank must call it at the same point of training: it gathers every rank's RNG
        state, so ``if acc.is_main: acc.save(path)`` hangs.

        Under "fsdp", "tp", "fsdp+tp" and "pp", ``path`` is a directory of shards (torch.distributed.checkpoint,
        see _dcp.py): each rank writes its own, no rank gathers the model, and it loads on another number
        of ranks or in one process. The shards go to ``path.tmp``, which replaces ``path`` once every rank has
        written (a killed save leaves the previous checkpoint loadable); schedulers, scaler, counters and RNG
        states go in the same directory. ``full=True`` writes one consolidated file plain ``torch.load`` reads.

        Under "ddp" and "none" rank 0 writes one file, to a temp file in the same directory that then replaces
        ``path`` (a crash leaves the previous checkpoint whole); the file gets the mode a plain ``open()`` gives
        (0o666 less the umask), and the file and then its directory are fsynced, so the rename survives a power
        loss. ``save`` returns on every rank once the checkpoint is in place, or raises on every rank when a rank
        failed (rank 0 could not write, say).

        The loaders' epochs are saved, not the position inside a pass: a run resumed from a save made in the
        middle of a pass starts that pass again from its first batch. Save at the end of a pass."""
        _checkpoint.save(self, os.fspath(path), full)

    def load(self, path: str | os.PathLike) -> None:
        """Restores what ``save`` wrote; each rank gets back its own RNG state.

        A one-file checkpoint (ddp, none) is read by each rank on its own, with no collective call, so a load
        that only some ranks make (``if acc.is_main: acc.load(path)``) does not hang. A sharded one is loaded
        by every rank together, each reading the pieces of its shards, whatever the number of ranks that saved
        it; the one-file FSDP checkpoints of earlier versions load too. A load right after ``save`` reads the new
        checkpoint: save returns only once it is in place, and a rename swaps it atomically, so a concurrent
        reader sees the old one or the new one, whole. Across machines this relies on the shared filesystem showing the
        rename to every client at once, which NFS's attribute caching does not guarantee.

        The checkpoint is read and checked against the prepared objects before anything is changed: a
        truncated or mismatched file raises and leaves the current state as it was. A checkpoint saved by a
        different number of ranks loads with a warning: rank r then restores saved rank (r mod N)'s RNG state."""
        _checkpoint.load(self, os.fspath(path))


def _state_field(name: str) -> property:
    return property(lambda self: getattr(self.state, name), doc=f"``self.state.{name}`` (read-only)")


for _name in [f.name for f in dataclasses.fields(ProcessState)] + ["is_main"]:
    setattr(Accelerator, _name, _state_field(_name))
del _name

# accelerate's keywords are Accelerator's, written once: this shows them in help() and inspect.signature.
accelerate.__signature__ = inspect.Signature([
    *list(inspect.signature(accelerate).parameters.values())[:3],
    *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
      for p in list(inspect.signature(Accelerator.__init__).parameters.values())[1:]),
])
