"""fastops.accelerate: one line that adds mixed precision, fused AdamW, clipping, accumulation, DDP/FSDP2 and
prefetching to an unchanged training loop.

    model, optimizer, loader = fastops.accelerate(model, optimizer, loader)
    for batch in loader:                       # the user's loop, as it was
        loss = loss_fn(model(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

How the loop stays unchanged:
- the model's ``forward`` (an instance attribute, so the model object, its ``state_dict`` keys and ``isinstance``
  checks stay the same; under DDP the DDP wrapper's) runs under autocast and returns floating outputs in fp32.
  When the gradient must be scaled (fp16 loss scaling, ``accumulate=k``) each output gets a backward hook that
  multiplies the gradient coming into it by ``scale / k``: ``loss.backward()`` then produces exactly what
  ``scaler.scale(loss / k).backward()`` would, for any loss computed from the outputs.
- the optimizer is fastops' fused AdamW/Adam when it was torch's, with ``step``/``zero_grad`` replaced on the
  instance: they do nothing on the first k-1 micro-steps, and the real ``step`` runs GradScaler step + update
  (fp16) and clipping (folded into the fused step, or fastops.clip_grad_norm_ after unscaling otherwise).
- the loader is sharded across ranks, wrapped in fastops.data.Prefetcher and gets ``set_epoch`` each pass.

Limits: a loss term that does not flow through the model's outputs (say an L2 penalty on the parameters
added to the loss) is neither loss-scaled nor divided by k; ``Accelerator.backward(loss)`` is
``loss.backward()`` and does not change that.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import random
import tempfile
import types
import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import amp, optim
from ._ops import unscale_check_

__all__ = ["accelerate", "Accelerator"]

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
STRATEGIES = ("auto", "ddp", "fsdp", "none")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
_CKPT_VERSION = 1


def accelerate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable | None = None,
    *,
    precision: str = "auto",
    strategy: str = "auto",
    grad_clip: float | None = None,
    accumulate: int = 1,
    compile: bool = False,
    device: torch.device | str | None = None,
):
    """``model, optimizer, loader = fastops.accelerate(model, optimizer, loader)``; see ``Accelerator``.
    The Accelerator is reachable afterwards as ``optimizer.accelerator`` (for ``save``/``load``)."""
    acc = Accelerator(
        precision=precision, strategy=strategy, grad_clip=grad_clip, accumulate=accumulate, compile=compile,
        device=device,
    )
    model, optimizer = acc.prepare(model, optimizer)
    return model, optimizer, (acc.prepare(loader) if loader is not None else None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    if not torch.amp.is_autocast_available(device_type):
        return False
    if device_type == "cuda" and dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported()
    # torch.autocast warns and disables itself for a dtype the device does not support.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast(device_type, dtype=dtype)
    return not caught


def _native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # Without AVX512-BF16/AMX, CPU bf16 matmuls are emulated and slower than fp32.
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _map_tensors(fn, obj):
    from .data import _map_tensors as impl  # the Prefetcher's: same containers, dataclasses, namedtuples

    return impl(fn, obj)


def _blocks(model: nn.Module) -> list[nn.Module]:
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


class _GradFactor:
    """Backward hook: the gradient arriving at a model output times ``factor`` (scale / k)."""

    def __init__(self, factor: torch.Tensor) -> None:
        self.factor = factor

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor.to(grad.device, grad.dtype)


class _ShardedScaler(amp.GradScaler):
    """GradScaler for a non-fastops optimizer on FSDP2 grads: unscales the local shards and takes found_inf
    as the MAX over ranks, so every rank skips the same steps and keeps the same scale."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        grads = [_local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found = found_inf.to(grads[0].device if grads else found_inf.device)
        with torch.no_grad():
            if grads:
                unscale_check_(grads, found, inv_scale.to(found.device))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return {found.device: found}


class _Loader:
    """What ``prepare(loader)`` returns: the Prefetcher over the (sharded) loader, with ``set_epoch(epoch)``
    called at the start of each pass and ``epoch`` advanced when a pass completes (as HF Accelerate does)."""

    def __init__(self, prefetcher) -> None:
        self.prefetcher = prefetcher
        self.epoch = 0

    def __iter__(self):
        self.prefetcher.set_epoch(self.epoch)
        yield from self.prefetcher
        self.epoch += 1

    def __len__(self) -> int:
        return len(self.prefetcher)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _RoundRobin:
    """Rank r of w takes batches r, r + w, ...; a last incomplete round is dropped, so every rank runs the
    same number of steps (one extra step on one rank would leave the others waiting in its all-reduce)."""

    def __init__(self, iterable: Iterable, rank: int, world_size: int) -> None:
        self.iterable, self.rank, self.world_size = iterable, rank, world_size

    def __iter__(self):
        it = iter(self.iterable)
        while len(chunk := list(itertools.islice(it, self.world_size))) == self.world_size:
            yield chunk[self.rank]

    def __len__(self) -> int:
        return len(self.iterable) // self.world_size  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.iterable, "set_epoch", None)):
            self.iterable.set_epoch(epoch)


class _Scheduler(amp.SkipAwareScheduler):
    """An LR scheduler that advances once per real optimizer step: not on accumulation micro-steps, not
    after a step skipped for inf/nan grads."""

    def __init__(self, scheduler, optimizer, acc: "Accelerator") -> None:
        super().__init__(scheduler, optimizer)
        self.accelerator = acc

    def step(self, *args, **kwargs):
        if not self.accelerator._last_step_real:
            return None
        return super().step(*args, **kwargs)


class Accelerator:
    """The object form of ``fastops.accelerate``.

    Args:
        precision: "auto" (bf16 where the device computes it natively, else fp32), "bf16", "fp16" (with loss
            scaling by fastops.amp.GradScaler) or "fp32".
        strategy: "auto" (ddp when WORLD_SIZE > 1), "ddp", "fsdp" (FSDP2 fully_shard per block, then the root)
            or "none".
        grad_clip: max global grad norm, or None.
        accumulate: k micro-batches per optimizer step.
        compile: torch.compile the model's forward.
        device: default: cuda:LOCAL_RANK when CUDA is available, else the CPU.

    ``prepare(*objects)`` takes a model, an optimizer, LR schedulers and loaders (model before optimizer) and
    returns them prepared, in the same order. ``save(path)``/``load(path)`` checkpoint everything.
    """

    def __init__(
        self,
        precision: str = "auto",
        strategy: str = "auto",
        grad_clip: float | None = None,
        accumulate: int = 1,
        compile: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"fastops.accelerate: unknown precision {precision!r}; choose one of {PRECISIONS}")
        if strategy not in STRATEGIES:
            raise ValueError(f"fastops.accelerate: unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"fastops.accelerate: accumulate must be an int >= 1, got {accumulate!r}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"fastops.accelerate: grad_clip must be > 0 or None, got {grad_clip!r}")
        self.grad_clip = None if grad_clip is None else float(grad_clip)
        self.accumulate = accumulate
        self.compile = compile

        env = os.environ
        launched = "WORLD_SIZE" in env and "RANK" in env
        if launched and not dist.is_initialized():
            cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
            if cuda and device is None:
                torch.cuda.set_device(int(env.get("LOCAL_RANK", 0)))  # before NCCL creates its communicator
            dist.init_process_group("nccl" if cuda else "gloo")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.local_rank = int(env.get("LOCAL_RANK", 0)) if self.distributed else 0
        self.is_main = self.rank == 0

        if device is None:
            device = f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"fastops.accelerate: device {device!r} requested but CUDA is not available")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)

        if strategy == "auto":
            strategy = "ddp" if self.world_size > 1 else "none"
        if strategy in ("ddp", "fsdp") and not self.distributed:
            raise ValueError(
                f"fastops.accelerate: strategy={strategy!r} needs a process group; launch with torchrun "
                "(which sets RANK, WORLD_SIZE and LOCAL_RANK) or call torch.distributed.init_process_group first"
            )
        self.strategy = strategy

        if precision == "auto":
            native = _native_bf16(self.device) and _autocast_supported(self.device.type, torch.bfloat16)
            precision = "bf16" if native else "fp32"
        self.precision = precision
        self.amp_dtype = _DTYPES[precision]
        if self.amp_dtype is not None and not _autocast_supported(self.device.type, self.amp_dtype):
            raise ValueError(
                f"fastops.accelerate: precision={precision!r} is not supported by autocast on device "
                f"{self.device}; use 'bf16', 'fp32' or 'auto'"
            )
        self.scaler: amp.GradScaler | None = None
        if precision == "fp16":
            self.scaler = (_ShardedScaler if strategy == "fsdp" else amp.GradScaler)(self.device.type)
            self.scaler._lazy_init_scale_growth_tracker(self.device)

        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedulers: list[_Scheduler] = []
        self.loaders: list[_Loader] = []
        self.step = 0  # real optimizer steps taken
        self.micro_step = 0  # optimizer.step() calls, micro-steps included
        self._last_step_real = True
        self._raw = False  # inside our own step: optimizer.step/zero_grad run as the class's
        self._names: dict[int, str] = {}
        self._old_optimizers: dict[int, torch.optim.Optimizer] = {}

    # ---- prepare ---------------------------------------------------------------------------------------

    def prepare(self, *objects):
        kinds = [self._kind(o) for o in objects]
        out = list(objects)
        for wanted in ("model", "optimizer", "scheduler", "loader"):
            for i, (kind, obj) in enumerate(zip(kinds, objects)):
                if kind == wanted:
                    out[i] = getattr(self, f"_prepare_{kind}")(obj)
        return out[0] if len(out) == 1 else tuple(out)

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

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        if self.model is not None:
            raise ValueError("fastops.Accelerator: one model per Accelerator; this one already has a model")
        if not any(True for _ in model.parameters()):
            raise ValueError(f"fastops.accelerate: the model ({type(model).__name__}) has no parameters to train")
        model.to(self.device)
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._inner = model
        if self.compile:
            model.forward = torch.compile(model.forward)
        wrapped = model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids)
        elif self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in _blocks(model):
                fully_shard(block)
            fully_shard(model)
        self._wrap_forward(wrapped)
        self.model = wrapped
        return wrapped

    def _wrap_forward(self, module: nn.Module) -> None:
        inner_forward = module.forward
        acc = self

        def forward(mod, *args, **kwargs):
            sync = acc.micro_step % acc.accumulate == acc.accumulate - 1
            ctx = contextlib.nullcontext()
            if acc.accumulate > 1 and acc.strategy == "ddp" and not sync:
                ctx = mod.no_sync()
            elif acc.accumulate > 1 and acc.strategy == "fsdp":
                mod.set_requires_gradient_sync(sync)
            # No autocast(enabled=False) for fp32: it would switch off an autocast region the caller opened.
            amp_ctx = contextlib.nullcontext()
            if acc.amp_dtype is not None:
                amp_ctx = torch.autocast(acc.device.type, dtype=acc.amp_dtype)
            with ctx, amp_ctx:
                return inner_forward(*args, **kwargs)

        module.forward = types.MethodType(forward, module)
        # A forward hook registered last runs after DDP's and FSDP2's own output handling (FSDP2 warns when
        # its module returns a view, which the grad hooks below may create).
        module.register_forward_hook(lambda _mod, _args, out: acc._outputs(out))

    def _outputs(self, out):
        low = self.amp_dtype is not None
        factor = None
        if self.scaler is not None or self.accumulate > 1:
            factor = self.scaler._scale.float() if self.scaler is not None else torch.ones((), device=self.device)
            factor = factor / self.accumulate if self.accumulate > 1 else factor

        def fix(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            if low and t.dtype in (torch.bfloat16, torch.float16):
                t = t.float()
            elif factor is not None and t.requires_grad:
                # A new node: a hook on the model's own tensor would also scale gradient that reached it
                # through another, already hooked, output.
                t = t.view_as(t)
            if factor is not None and t.requires_grad:
                t.register_hook(_GradFactor(factor))
            return t

        return _map_tensors(fix, out)

    def _prepare_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            raise ValueError("fastops.Accelerator: one optimizer per Accelerator; this one already has an optimizer")
        if self.model is None:
            raise ValueError("fastops.Accelerator.prepare: prepare the model before (or together with) the optimizer")
        new = self._convert(opt)
        if isinstance(new, optim._FusedAdamMixin):
            if self.grad_clip is not None:
                new.defaults["max_grad_norm"] = self.grad_clip
                for group in new.param_groups:
                    group["max_grad_norm"] = self.grad_clip
            if self.strategy == "fsdp":
                new.reduce_grad_stats = self._all_reduce_stats
        new.step = types.MethodType(_step, new)
        new.zero_grad = types.MethodType(_zero_grad, new)
        new.accelerator = self
        self.optimizer = new
        self._old_optimizers[id(opt)] = new
        return new

    def _convert(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """torch's AdamW/Adam become fastops' with the same groups and state; under FSDP2 (new DTensor
        params) every optimizer is rebuilt on the new params."""
        cls = {torch.optim.AdamW: optim.AdamW, torch.optim.Adam: optim.Adam}.get(type(opt))
        if cls is None and self.strategy != "fsdp":
            return opt
        cls = cls or type(opt)
        params = dict(self._inner.named_parameters())
        groups = []
        for group in opt.param_groups:
            mapped = []
            for p in group["params"]:
                name = self._names.get(id(p))
                if name in params:
                    mapped.append(params[name])
                elif self.strategy != "fsdp":
                    mapped.append(p)
                else:
                    raise ValueError(
                        "fastops.accelerate: the optimizer holds a parameter that is not in the model, which "
                        "FSDP cannot shard; create the optimizer from model.parameters()"
                    )
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mapped})
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k not in ("params", "differentiable")}
        try:
            new = cls(groups, **defaults)
        except TypeError as e:
            raise ValueError(
                f"fastops.accelerate: could not rebuild {type(opt).__name__} on the sharded parameters ({e}); "
                "create the optimizer after fastops.accelerate(model) from the returned model's parameters"
            ) from e
        if opt.state:
            if self.strategy == "fsdp":
                raise ValueError(
                    "fastops.accelerate: the optimizer already has state, which cannot be carried over to FSDP2's "
                    "sharded parameters; prepare it before training, and resume with Accelerator.load"
                )
            new.load_state_dict(opt.state_dict())
        return new

    def _prepare_scheduler(self, scheduler):
        if self.optimizer is None:
            raise ValueError("fastops.Accelerator.prepare: prepare the optimizer before (or with) the scheduler")
        if scheduler.optimizer is not self.optimizer:
            if self._old_optimizers.get(id(scheduler.optimizer)) is not self.optimizer:
                raise ValueError("fastops.Accelerator.prepare: the scheduler's optimizer was not prepared here")
            scheduler.optimizer = self.optimizer
        wrapped = _Scheduler(scheduler, self.optimizer, self)
        self.schedulers.append(wrapped)
        return wrapped

    def _prepare_loader(self, loader):
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

        from .data import Prefetcher

        if self.world_size > 1:
            if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
                loader = self._shard_dataloader(loader, DataLoader, DistributedSampler, RandomSampler, SequentialSampler)
            else:
                loader = _RoundRobin(loader, self.rank, self.world_size)
        wrapped = _Loader(Prefetcher(loader, device=self.device))
        self.loaders.append(wrapped)
        return wrapped

    def _shard_dataloader(self, loader, DataLoader, DistributedSampler, RandomSampler, SequentialSampler):
        sampler = loader.sampler
        if isinstance(sampler, DistributedSampler):
            return loader
        if loader.batch_size is None or not isinstance(sampler, (RandomSampler, SequentialSampler)):
            raise ValueError(
                "fastops.accelerate: cannot shard a DataLoader with a custom sampler or batch_sampler across "
                f"{self.world_size} ranks; give it a torch.utils.data.DistributedSampler yourself"
            )
        # The per-process batch size is kept (global batch = world_size x batch_size), as in HF Accelerate.
        dsampler = DistributedSampler(
            loader.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=isinstance(sampler, RandomSampler)
        )
        kwargs = dict(
            batch_size=loader.batch_size, sampler=dsampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
        )  # fmt: skip
        if loader.num_workers > 0:
            kwargs.update(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
        return DataLoader(loader.dataset, **kwargs)

    # ---- the step ----------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``: loss scaling and the 1/k of accumulation are applied by the model's output hooks."""
        loss.backward(**kwargs)

    def _all_reduce_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """[sum of squares, max |g|, found_inf] of the local FSDP2 shards -> the global ones (device-side)."""
        squares, maxes = stats[:1].clone(), stats[1:].clone()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return torch.cat([squares, maxes])

    def _clip(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        """Clip for an optimizer that is not fastops' (grads already unscaled)."""
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if self.strategy != "fsdp":
            return amp.clip_grad_norm_(params, self.grad_clip)
        grads = [_local(p.grad) for p in params]
        norm = self._all_reduce_stats(amp.grad_stats(grads))[0].sqrt()
        if grads:
            torch._foreach_mul_(grads, amp.clip_coef(norm, self.grad_clip).to(grads[0].device))
        return norm

    # ---- checkpoints -------------------------------------------------------------------------------------

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """The user's module under the DDP wrapper (FSDP2 works in place)."""
        model = self.model if model is None else model
        return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model

    def _barrier(self) -> None:
        if self.distributed and self.world_size > 1:
            dist.barrier()

    def _state(self) -> dict[str, Any]:
        if self.model is None:
            raise ValueError("fastops.Accelerator.save: nothing prepared yet")
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

            # Collective: every rank gathers, rank 0 receives the full (CPU) tensors.
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = get_model_state_dict(self.model, options=options)
            with self._raw_calls():
                optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=options) if self.optimizer else None
        else:
            model_sd = self.unwrap().state_dict()
            optim_sd = self.optimizer.state_dict() if self.optimizer else None
        return {
            "fastops_checkpoint": _CKPT_VERSION,
            "format": "fsdp" if self.strategy == "fsdp" else "plain",
            "precision": self.precision,
            "model": model_sd,
            "optimizer": optim_sd,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "schedulers": [s.scheduler.state_dict() for s in self.schedulers],
            "step": self.step,
            "micro_step": self.micro_step,
            "loader_epochs": [ld.epoch for ld in self.loaders],
            "rng": _rng_state(),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Writes model, optimizer, scaler, schedulers, step counters, RNG states and loader epochs to ``path``.

        Rank 0 writes, to a temp file in the same directory that then replaces ``path`` (a crash leaves the
        previous checkpoint whole). Under FSDP every rank must call it (the full state is gathered); otherwise
        the other ranks return at once, so a save that only rank 0 calls cannot hang them. RNG states are rank
        0's."""
        path = os.fspath(path)
        if self.micro_step % self.accumulate:
            warnings.warn(
                "fastops.Accelerator.save: saving in the middle of an accumulation cycle; the gradients "
                "accumulated so far are not saved, so a resumed run does not continue this cycle exactly",
                stacklevel=2,
            )
        if self.strategy != "fsdp" and not self.is_main:
            return
        state = self._state()
        if not self.is_main:
            return
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Restores what ``save`` wrote. Every rank calls it (it starts with a barrier, so rank 0's save is
        complete). The checkpoint is read and checked against the prepared objects before anything is
        changed: a truncated or mismatched file raises and leaves the current state as it was."""
        path = os.fspath(path)
        self._barrier()
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise RuntimeError(
                f"fastops.Accelerator.load: {path} is not a readable checkpoint (truncated or corrupt?): {e}"
            ) from e
        self._check(ckpt, path)
        model = self.unwrap()
        if ckpt["format"] == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, ckpt["model"], options=options)
            if self.optimizer is not None:
                with self._raw_calls():
                    set_optimizer_state_dict(self.model, self.optimizer, ckpt["optimizer"], options=options)
        else:
            model.load_state_dict(ckpt["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
        for sched, sd in zip(self.schedulers, ckpt["schedulers"]):
            sched.scheduler.load_state_dict(sd)
        for loader, epoch in zip(self.loaders, ckpt["loader_epochs"]):
            loader.set_epoch(epoch)
        self.step, self.micro_step = ckpt["step"], ckpt["micro_step"]
        self._last_step_real = self.micro_step % self.accumulate == 0
        _set_rng_state(ckpt["rng"])

    def _check(self, ckpt: Any, path: str) -> None:
        def fail(why: str):
            raise ValueError(f"fastops.Accelerator.load: {path} does not match what this Accelerator prepared: {why}")

        if not isinstance(ckpt, dict) or ckpt.get("fastops_checkpoint") != _CKPT_VERSION:
            raise RuntimeError(f"fastops.Accelerator.load: {path} is not a fastops checkpoint (v{_CKPT_VERSION})")
        if self.model is None:
            fail("nothing is prepared yet; prepare the model (and optimizer) first")
        expected = "fsdp" if self.strategy == "fsdp" else "plain"
        if ckpt["format"] != expected:
            fail(f"it was saved with {'FSDP' if ckpt['format'] == 'fsdp' else 'no FSDP'} and is loaded with "
                 f"strategy={self.strategy!r}")  # fmt: skip
        current = {k: tuple(v.shape) for k, v in self.unwrap().state_dict().items()}
        saved = {k: tuple(v.shape) for k, v in ckpt["model"].items()}
        if current != saved:
            missing, unexpected = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
            common = sorted(current.keys() & saved.keys())
            shapes = [f"{k}: {saved[k]} vs {current[k]}" for k in common if saved[k] != current[k]]
            fail(f"model missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, shape mismatches {shapes[:5]}")
        if self.optimizer is not None:
            if ckpt["optimizer"] is None:
                fail("it has no optimizer state")
            if expected == "plain":
                sizes = [len(g["params"]) for g in ckpt["optimizer"]["param_groups"]]
                ours = [len(g["params"]) for g in self.optimizer.param_groups]
                if sizes != ours:
                    fail(f"optimizer param groups of sizes {sizes} vs {ours}")
        if (self.scaler is None) != (ckpt["scaler"] is None):
            fail(f"it was saved with precision={ckpt['precision']!r}, loaded with {self.precision!r} (loss scaler)")
        if len(ckpt["schedulers"]) < len(self.schedulers):
            fail(f"it has {len(ckpt['schedulers'])} scheduler(s), {len(self.schedulers)} prepared")

    @contextlib.contextmanager
    def _raw_calls(self):
        # torch.distributed.checkpoint may call optimizer.step()/zero_grad() to create the state; those must
        # not count as training steps.
        self._raw = True
        try:
            yield
        finally:
            self._raw = False


def _step(opt: torch.optim.Optimizer, closure=None):
    """``optimizer.step()`` of a prepared optimizer (bound to the instance)."""
    acc: Accelerator = opt.accelerator
    cls = type(opt)
    if acc._raw:
        return cls.step(opt, closure)
    opt._opt_called = True  # for torch's LRScheduler order check
    acc.micro_step += 1
    acc._last_step_real = acc.micro_step % acc.accumulate == 0
    if not acc._last_step_real:
        return None
    fused = isinstance(opt, optim._FusedAdamMixin)
    acc._raw = True
    try:
        if acc.scaler is not None:
            if acc.grad_clip is not None and not fused:
                acc.scaler.unscale_(opt)
                opt.last_grad_norm = acc._clip(opt)
            # With a fastops optimizer the scaler hands it the scale: unscale, inf check, clip and step are
            # one pass over the grads after the grad_stats read.
            result = acc.scaler.step(opt)
            acc.scaler.update()
        else:
            if acc.grad_clip is not None and not fused:
                opt.last_grad_norm = acc._clip(opt)
            result = cls.step(opt, closure)
    finally:
        acc._raw = False
    acc.step += 1
    return result


# torch's LRScheduler warns unless optimizer.step looks wrapped by it (it then reads opt._opt_called, which
# _step sets); with this it also leaves the prepared step as it is.
_step._wrapped_by_lr_sched = True


def _zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad()``: only at an accumulation boundary, so it works before backward or after step."""
    acc: Accelerator = opt.accelerator
    if acc._raw or acc.micro_step % acc.accumulate == 0:
        type(opt).zero_grad(opt, set_to_none)


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
