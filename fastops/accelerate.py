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
  ``scaler.scale(loss / k).backward()`` would, for any loss computed from the outputs. This holds for
  ``model(x)`` and ``model.forward(x)`` alike, and for outputs that are tensors, possibly nested in lists,
  tuples, dicts (HF ``ModelOutput``), namedtuples and dataclasses.
- the optimizer keeps its identity: torch's AdamW/Adam/SGD becomes fastops' fused one in place
  (``fastops.optim.fuse_``: same object, param_groups, state and step hooks, so every LR scheduler built on it
  keeps driving it), with ``step``/
  ``zero_grad`` replaced on the instance: they do nothing on the first k-1 micro-steps, and the real ``step``
  runs GradScaler step + update (fp16) and clipping (folded into the fused step, or fastops.clip_grad_norm_
  after unscaling otherwise). A scheduler that is not prepared still advances on every ``step()`` call;
  ``Accelerator.prepare(scheduler)`` makes it advance once per real step (not on micro-steps, not after a
  skipped fp16 step).
- the loader is sharded across ranks, wrapped in fastops.data.Prefetcher and gets ``set_epoch`` each pass.
- an AMP script that keeps its own GradScaler (``scaler.scale(loss).backward(); scaler.step(optimizer);
  scaler.update()``, torch's or fastops') runs unchanged under fp16: that scaler's ``scale()`` of a loss computed
  from the model's outputs makes it drive that step (its scale, its skip decision, its update), and fastops
  neither scales the gradient again nor steps its own scaler (``Accelerator._give_way_to``). This needs
  accumulate=1 (otherwise that ``scale()`` raises) and a scaler that inherits torch's ``scale`` (FSDP's
  ShardedGradScaler does not: its step raises). A step the user's scaler skips for an optimizer fastops does
  not fuse never reaches ``optimizer.step()``, so ``Accelerator.step`` does not count it.

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
- A ``torch.utils.data.DataLoader`` with ``num_workers=0`` is read on the training loop's thread, not in the
  Prefetcher's background thread: its dataset, collate_fn and sampler run in this process, and when they draw
  random numbers from the process-global generators (torch's default generator, ``random``, ``numpy.random``;
  a random augmentation, a RandomSampler without a generator) a background thread would interleave those draws
  with the step's (dropout), differently in every run. Any other iterable is read in the background; one that
  draws from the global generators makes runs irreproducible, so give it its own ``torch.Generator``.
- ``save``/``load`` record the loader's epoch, not the position inside it: resume at a pass boundary.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import random
import re
import secrets
import types
import warnings
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from . import amp, optim
from ._ops import unscale_check_
from ._util import forward_attribute, map_tensors, resolve_device

__all__ = ["accelerate", "Accelerator"]

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
STRATEGIES = ("auto", "ddp", "fsdp", "none")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
_CKPT_VERSION = 2  # 2: one RNG state per rank (1 held rank 0's only)
_CKPT_READABLE = (1, 2)
_OUTPUT_MARK = "fastops.accelerate"  # key in the grad_fn metadata of each hooked output: its Accelerator
_WATCHING: weakref.WeakSet = weakref.WeakSet()  # fp16 Accelerators, told of every other GradScaler's scale()
_FLAGS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}
_CLOSURE_UNSUPPORTED = "Closure use is not currently supported if GradScaler is enabled."  # torch's message


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


def _keep_freed_memory() -> bool:
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
    from ._backend import _C

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
    """Backward hook: the gradient arriving at a model output times ``factor`` (scale / k). It records that it
    ran, for the check in the optimizer step, and stands aside inside ``Accelerator.backward``, which has
    scaled the whole loss already."""

    def __init__(self, factor: torch.Tensor, acc: "Accelerator") -> None:
        self.factor = factor
        self.acc = acc

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.acc._grads_scaled = True
        if self.acc._exact_backward or self.acc._user_scaler is not None:
            return None
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
    called at the start of each pass and ``epoch`` advanced when a pass completes (as HF Accelerate does).
    Other attributes (``dataset``, ``batch_size``, ``sampler``, ...) are the loader's."""

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

    def __getattr__(self, name: str) -> Any:
        return forward_attribute(self, "prefetcher", name)


class _RoundRobin:
    """Rank r of w takes batches r, r + w, ...; a last incomplete round is dropped, so every rank runs the
    same number of steps (one extra step on one rank would leave the others waiting in its all-reduce)."""

    _fresh_batches = True  # for fastops.data: what it yields is copied where the loader may refill it

    def __init__(self, iterable: Iterable, rank: int, world_size: int) -> None:
        self.iterable, self.rank, self.world_size = iterable, rank, world_size

    def __iter__(self):
        from .data import _fresh_batches

        copy = not _fresh_batches(self.iterable)
        it = iter(self.iterable)
        while True:
            mine, n = None, 0
            for n, batch in enumerate(itertools.islice(it, self.world_size), 1):
                if n - 1 == self.rank:
                    # The rest of the round is read before this batch is yielded: a loader that refills one
                    # buffer would overwrite it meanwhile.
                    mine = map_tensors(torch.Tensor.clone, batch) if copy else batch
            if n < self.world_size:
                return
            yield mine

    def __len__(self) -> int:
        return len(self.iterable) // self.world_size  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.iterable, "set_epoch", None)):
            self.iterable.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        return forward_attribute(self, "iterable", name)


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
        accumulate: k micro-batches per optimizer step. Micro-steps are counted across loader passes: when a
            pass has a number of batches that is not a multiple of k, its last micro-batches' gradients are
            carried into the first step of the next pass, and those left over when training ends are never
            applied. (HF Accelerate by default steps at the end of every pass instead:
            ``GradientAccumulationPlugin(sync_with_dataloader=True)``.) Make the pass length a multiple of k,
            e.g. with ``drop_last`` and a batch count that divides, to keep steps aligned with epochs.
        compile: torch.compile the model's forward.
        device: default: cuda:LOCAL_RANK under a launcher that sets LOCAL_RANK (torchrun), the current CUDA
            device otherwise, and the CPU without CUDA. "cuda" without an index means the same device. On the
            CPU, freed blocks of 8 MiB and more are then kept for reuse (``keeps_freed_memory``; see
            ``_keep_freed_memory``, FASTOPS_KEEP_FREED_MEMORY=0 to opt out).

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
        several = dist.is_available() and (launched or dist.is_initialized())
        local_rank = int(env["LOCAL_RANK"]) if several and "LOCAL_RANK" in env else None
        self.device = resolve_device(device, local_rank, who="fastops.accelerate")
        if launched and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # before NCCL creates its communicator
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.local_rank = local_rank or 0
        self.is_main = self.rank == 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.keeps_freed_memory = self.device.type == "cpu" and _keep_freed_memory()

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
            _watch_user_scalers(self)

        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedulers: list[_Scheduler] = []
        self.loaders: list[_Loader] = []
        self.step = 0  # optimizer steps at accumulation boundaries, fp16-skipped ones included
        self.micro_step = 0  # optimizer.step() calls, micro-steps included
        self._last_step_real = True
        self._raw = False  # inside our own step: optimizer.step/zero_grad run as the class's
        self._names: dict[int, str] = {}
        self._via_call = False  # set by the forward pre-hook: forward runs inside model(...), hooks and all
        self._grads_scaled = False  # gradient came through scaled outputs (or backward()) since the last step
        self._exact_backward = False  # inside backward(): the output hooks leave the gradient alone
        self._hooked = False  # outputs got grad hooks since the last step
        self._user_scaler = None  # a GradScaler of the user's scaled this step's loss: it drives (_give_way_to)
        self._warned_outputs = False

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
            via_call, acc._via_call = acc._via_call, False
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
                out = inner_forward(*args, **kwargs)
            # model.forward(x) runs no module hooks: its outputs are cast and hooked here instead.
            return out if via_call else acc._outputs(out)

        module.forward = types.MethodType(forward, module)
        module.register_forward_pre_hook(lambda _mod, _args: setattr(acc, "_via_call", True))
        # A forward hook registered last runs after DDP's and FSDP2's own output handling (FSDP2 warns when
        # its module returns a view, which the grad hooks below may create).
        module.register_forward_hook(lambda _mod, _args, out: acc._outputs(out))

    def _factor(self) -> torch.Tensor | None:
        """``scale / k``, what the gradient of the loss is multiplied by; None when that is 1."""
        if self.scaler is None and self.accumulate == 1:
            return None
        # The scaler's own tensor when k == 1: GradScaler.update changes it in place, so a backward run after
        # an update (in the next step) uses the scale that step unscales by.
        factor = self.scaler._scale if self.scaler is not None else torch.ones((), device=self.device)
        return factor / self.accumulate if self.accumulate > 1 else factor

    def _outputs(self, out):
        low = self.amp_dtype is not None
        factor = self._factor()
        floating = False

        def fix(t: torch.Tensor) -> torch.Tensor:
            nonlocal floating
            if not t.is_floating_point():
                return t
            floating = True
            if low and t.dtype in (torch.bfloat16, torch.float16):
                t = t.float()
            elif factor is not None and t.requires_grad:
                # A new node: a hook on the model's own tensor would also scale gradient that reached it
                # through another, already hooked, output.
                t = t.view_as(t)
            if factor is not None and t.requires_grad:
                t.register_hook(_GradFactor(factor, self))
                t.grad_fn.metadata[_OUTPUT_MARK] = self
                self._hooked = True
            return t

        out = map_tensors(fix, out)
        if not floating and (low or factor is not None) and not self._warned_outputs:
            self._warned_outputs = True
            scaled = ""
            if factor is not None:
                scaled = (
                    ", and gradient through them is not scaled (fp16 loss scale, 1/k of accumulate=k): call "
                    "Accelerator.backward(loss) (optimizer.accelerator.backward(loss)) instead of loss.backward(), "
                    "or optimizer.step() will raise"
                )
            warnings.warn(
                f"fastops.accelerate: the model returned a {type(out).__name__} with no floating-point tensor that "
                "fastops can see (it looks inside lists, tuples, dicts, namedtuples, dataclasses and what torch's "
                f"pytree knows, such as HF ModelOutput), so its outputs stay as autocast ({self.precision}) made "
                f"them{scaled}",
                stacklevel=3,
            )
        return out

    def _prepare_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            raise ValueError("fastops.Accelerator: one optimizer per Accelerator; this one already has an optimizer")
        if self.model is None:
            raise ValueError("fastops.Accelerator.prepare: prepare the model before (or together with) the optimizer")
        if self.strategy == "fsdp":
            self._repoint(opt)
        # torch's Adam/AdamW/SGD become fastops' in place (same object, so schedulers keep driving it); others
        # (and torch optimizers fastops cannot take) stay as they are.
        optim.fuse_(opt)
        if isinstance(opt, optim._Fused):
            if self.grad_clip is not None:
                opt.defaults["max_grad_norm"] = self.grad_clip
                for group in opt.param_groups:
                    group["max_grad_norm"] = self.grad_clip
            if self.strategy == "fsdp":
                opt.reduce_grad_stats = self._all_reduce_stats
        opt.step = types.MethodType(_step, opt)
        opt.zero_grad = types.MethodType(_zero_grad, opt)
        opt.accelerator = self
        self.optimizer = opt
        return opt

    def _repoint(self, opt: torch.optim.Optimizer) -> None:
        """FSDP2 replaced the model's parameters with sharded ones: the optimizer's param lists are pointed at
        them in place, so the optimizer (and every scheduler built on it) stays the same object. An optimizer
        that keeps references to its parameters outside ``param_groups`` is not supported."""
        if opt.state:
            raise ValueError(
                "fastops.accelerate: the optimizer already has state, which cannot be carried over to FSDP2's "
                "sharded parameters; prepare it before training, and resume with Accelerator.load"
            )
        params = dict(self._inner.named_parameters())
        current = {id(p) for p in params.values()}
        for group in opt.param_groups:
            plist = group["params"]
            for i, p in enumerate(plist):
                if id(p) in current:
                    continue
                name = self._names.get(id(p))
                if name not in params:
                    raise ValueError(
                        "fastops.accelerate: the optimizer holds a parameter that is not in the model, which "
                        "FSDP cannot shard; create the optimizer from model.parameters()"
                    )
                plist[i] = params[name]

    def _prepare_scheduler(self, scheduler):
        if self.optimizer is None:
            raise ValueError("fastops.Accelerator.prepare: prepare the optimizer before (or with) the scheduler")
        if scheduler.optimizer is not self.optimizer:
            raise ValueError(
                "fastops.Accelerator.prepare: the scheduler drives an optimizer that was not prepared here"
            )
        wrapped = _Scheduler(scheduler, self.optimizer, self)
        self.schedulers.append(wrapped)
        return wrapped

    def _prepare_loader(self, loader):
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

        from .data import Prefetcher

        # num_workers=0: the dataset, collate_fn and sampler run in this process, where their draws from the
        # global RNGs must stay in the loop's order (see the module docstring); worker processes draw from
        # their own generators, seeded on this thread when the pass starts.
        background = not (isinstance(loader, DataLoader) and loader.num_workers == 0)
        if self.world_size > 1:
            if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
                loader = self._shard_dataloader(loader, DataLoader, DistributedSampler, RandomSampler, SequentialSampler)
            else:
                loader = _RoundRobin(loader, self.rank, self.world_size)
        wrapped = _Loader(Prefetcher(loader, device=self.device, background=background))
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
        """``(loss * scale / k).backward(**kwargs)``, with the model's output hooks standing aside: every term of
        the loss is scaled once, including terms whose gradient does not pass through the model's outputs
        (which ``loss.backward()`` leaves unscaled, see the module docstring). Plain ``loss.backward()`` when
        there is nothing to scale (no fp16, accumulate=1)."""
        factor = self._factor()
        if factor is None:
            loss.backward(**kwargs)
            return
        self._exact_backward = True
        try:
            (loss * factor.to(loss.device)).backward(**kwargs)
        finally:
            self._exact_backward = False
        self._grads_scaled = True

    def _give_way_to(self, scaler: amp._TorchGradScaler, outputs: Any) -> None:
        """``scaler``, a GradScaler that is not this Accelerator's, is scaling ``outputs``. When they were
        computed from this model's hooked outputs, that scaler drives loss scaling until the next real step: the
        output hooks leave the gradient alone (the user's scale is its only one), and ``optimizer.step()``, which
        that scaler calls with its scale and inf flag set on the optimizer (or after unscaling the grads itself),
        runs the optimizer's own step without this Accelerator's scaler. It is decided here, before the backward:
        seen only at the step, the doubly scaled fp16 backward would have overflowed and that step been lost."""
        if not self._hooked:
            return
        tensors: list[torch.Tensor] = []
        if isinstance(outputs, (torch.Tensor, list, tuple)):  # not a one-pass iterable, which scale() consumes
            map_tensors(tensors.append, outputs)
        if not any(self._from_outputs(t) for t in tensors):
            return
        if self.accumulate > 1:
            raise RuntimeError(
                f"fastops.accelerate: your {type(scaler).__name__} scales a loss from the prepared model, with "
                f"accumulate={self.accumulate}: its step() and update() at every optimizer.step() call would change "
                "the scale (and unscale the gradients of optimizers fastops does not fuse) in the middle of an "
                "accumulation cycle. Use accumulate=1 with your GradScaler, or drop it: precision='fp16' scales the "
                "loss itself (loss.backward(); optimizer.step())"
            )
        self._user_scaler = scaler

    def _from_outputs(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s autograd graph reaches an output hooked since the last step. The walk stops there: a
        loss computed from the outputs gets there within a few nodes (at once for an HF ``out.loss``)."""
        stack, seen = [t.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            if node.metadata.get(_OUTPUT_MARK) is self:
                return True
            seen.add(node)
            stack.extend(fn for fn, _ in node.next_functions)
        return False

    def _check_scaled(self, opt: torch.optim.Optimizer) -> None:
        """Before a real step: gradients that all bypassed the scaling would be divided by the loss scale (or
        summed over k micro-batches) without having been multiplied by it, which must not train silently."""
        if self._grads_scaled or self._factor() is None:
            return
        if not any(p.grad is not None for g in opt.param_groups for p in g["params"]):
            return
        missing = []
        if self.scaler is not None:
            missing.append(f"the fp16 loss scale ({self.scaler.get_scale():g}) the step divides by")
        if self.accumulate > 1:
            missing.append(f"the 1/{self.accumulate} of accumulate={self.accumulate}")
        what = " and ".join(missing)
        raise RuntimeError(
            "fastops.accelerate: optimizer.step() found gradients, but none came through the prepared model's "
            f"outputs since the last step, so they lack {what}. The loss was not computed from what model(...) "
            "returned as fastops sees it (an output container it does not look into, such as a SimpleNamespace, "
            "or a forward run outside the prepared model). Call optimizer.accelerator.backward(loss) "
            "(Accelerator.backward) instead of loss.backward(): it scales the whole loss."
        )

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

    def _state(self, rngs: list[dict[str, Any]]) -> dict[str, Any]:
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
            "optimizer": _plain(optim_sd),  # empty on FSDP ranks other than 0
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "schedulers": [_plain(s.scheduler.state_dict()) for s in self.schedulers],
            "step": self.step,
            "micro_step": self.micro_step,
            "loader_epochs": [ld.epoch for ld in self.loaders],
            "rng": rngs,  # index = rank
        }

    def save(self, path: str | os.PathLike) -> None:
        """Writes model, optimizer, scaler, schedulers, step counters, each rank's RNG states and loader epochs
        to ``path``.

        With several ranks, every rank must call it at the same point of training: it gathers every rank's RNG
        state (and under FSDP the full model and optimizer state), so ``if acc.is_main: acc.save(path)`` hangs.
        Rank 0 writes, to a temp file in the same directory that then replaces ``path`` (a crash leaves the
        previous checkpoint whole); the file gets the mode a plain ``open()`` gives (0o666 less the umask), and
        the file and then its directory are fsynced, so the rename survives a power loss. ``save`` returns on
        every rank once the file is in place, or raises on every rank when a rank failed (rank 0 could not
        write, say).

        The loaders' epochs are saved, not the position inside a pass: a run resumed from a save made in the
        middle of a pass starts that pass again from its first batch. Save at the end of a pass."""
        path = os.fspath(path)
        if self.model is None:
            raise ValueError("fastops.Accelerator.save: nothing prepared yet")
        if self.micro_step % self.accumulate:
            warnings.warn(
                "fastops.Accelerator.save: saving in the middle of an accumulation cycle; the gradients "
                "accumulated so far are not saved, so a resumed run does not continue this cycle exactly",
                stacklevel=2,
            )
        collective = self.distributed and self.world_size > 1
        rngs = [_rng_state()]
        if collective:
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, _rng_state())
        error = None
        try:
            state = self._state(rngs) if self.is_main or self.strategy == "fsdp" else None
            if self.is_main:
                _write_atomic(state, path)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below, then re-raised
            if not collective:
                raise
            error = e
        if collective:
            # Also the barrier that keeps every rank in save until the file is in place.
            statuses = [None] * self.world_size
            dist.all_gather_object(statuses, None if error is None else f"{type(error).__name__}: {error}")
            failed = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s is not None]
            if error is not None:
                raise error
            if failed:
                raise RuntimeError(f"fastops.Accelerator.save: {path} was not saved ({'; '.join(failed)})")

    def load(self, path: str | os.PathLike) -> None:
        """Restores what ``save`` wrote; each rank gets back its own RNG state.

        Outside FSDP it makes no collective call: each rank reads the file on its own, so a load that only
        some ranks make (``if acc.is_main: acc.load(path)``) does not hang. Under FSDP every rank must call it
        (the full state is scattered into the shards). A load right after ``save`` reads the new file: save
        returns only once it is in place, and ``os.replace`` swaps it atomically, so a concurrent reader sees
        the old file or the new one, whole. Across machines this relies on the shared filesystem showing the
        rename to every client at once, which NFS's attribute caching does not guarantee.

        The checkpoint is read and checked against the prepared objects before anything is changed: a
        truncated or mismatched file raises and leaves the current state as it was. A checkpoint saved by a
        different number of ranks loads with a warning: rank r then restores saved rank (r mod N)'s RNG state."""
        path = os.fspath(path)
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
        self._check(ckpt, path)
        rngs = ckpt["rng"] if isinstance(ckpt["rng"], list) else [ckpt["rng"]]  # v1 kept rank 0's only
        if len(rngs) != self.world_size:
            warnings.warn(
                f"fastops.Accelerator.load: {path} holds the RNG states of {len(rngs)} rank(s), this run has "
                f"{self.world_size}; rank r restores saved rank (r mod {len(rngs)})'s, so random draws (dropout, "
                "unseeded shuffling) do not continue those of the saved run",
                stacklevel=2,
            )
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
        self._grads_scaled = False
        _set_rng_state(rngs[self.rank % len(rngs)])

    def _check(self, ckpt: Any, path: str) -> None:
        def fail(why: str):
            raise ValueError(f"fastops.Accelerator.load: {path} does not match what this Accelerator prepared: {why}")

        if not isinstance(ckpt, dict) or ckpt.get("fastops_checkpoint") not in _CKPT_READABLE:
            raise RuntimeError(
                f"fastops.Accelerator.load: {path} is not a fastops checkpoint (versions {_CKPT_READABLE} are read)"
            )
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


def _watch_user_scalers(acc: Accelerator) -> None:
    """Has every ``GradScaler.scale`` call (torch's, its deprecated device classes' and fastops', which all
    inherit it) first tell the live fp16 Accelerators, so that a user's own scaler can drive loss scaling
    (``Accelerator._give_way_to``). Installed once per process; a scale call costs a look at each live fp16
    Accelerator's ``_hooked`` flag, and a walk up the scaled loss's graph while one has hooked outputs."""
    _WATCHING.add(acc)
    base = amp._TorchGradScaler
    if hasattr(base.scale, "_fastops_original"):
        return
    original = base.scale

    @functools.wraps(original)
    def scale(self, outputs):
        if self._enabled:
            for watcher in list(_WATCHING):
                if self is not watcher.scaler:
                    watcher._give_way_to(self, outputs)
        return original(self, outputs)

    scale._fastops_original = original
    base.scale = scale


def _step(opt: torch.optim.Optimizer, closure=None):
    """``optimizer.step()`` of a prepared optimizer (bound to the instance)."""
    acc: Accelerator = opt.accelerator
    cls = type(opt)
    if acc._raw:
        return cls.step(opt, closure)
    driven = acc._user_scaler is not None  # by the user's GradScaler (see Accelerator._give_way_to)
    fused = isinstance(opt, optim._Fused)
    if driven and acc.grad_clip is not None and not fused and getattr(opt, "grad_scale", None) is not None:
        raise RuntimeError(
            f"fastops.accelerate: grad_clip with your {type(acc._user_scaler).__name__} and a {type(opt).__name__}, "
            "which unscales inside its step: the gradients are still scaled when fastops clips them. Call "
            "scaler.unscale_(optimizer) before scaler.step(optimizer)"
        )
    if acc.scaler is not None and not driven:
        if closure is not None:
            # As torch's GradScaler.step: the closure's backward would run unscaled, after the inf check.
            raise RuntimeError(_CLOSURE_UNSUPPORTED)
        if "grad_scale" in opt.__dict__ or "found_inf" in opt.__dict__:
            raise RuntimeError(
                "fastops.accelerate: optimizer.step() was called by a GradScaler that is not fastops' (it set "
                "optimizer.grad_scale), but no scale() of that scaler was seen on a loss computed from the prepared "
                "model's outputs, so the gradients carry fastops' own loss scale. Scale the loss with that scaler "
                "(scaler.scale(loss).backward()), or drop it: precision='fp16' scales the loss itself"
            )
    if closure is None and not driven and (acc.micro_step + 1) % acc.accumulate == 0:
        acc._check_scaled(opt)  # before anything changes, so a raise leaves the run as it was
    opt._opt_called = True  # for torch's LRScheduler order check
    acc.micro_step += 1
    acc._last_step_real = acc.micro_step % acc.accumulate == 0
    if not acc._last_step_real:
        return None
    acc._raw = True
    try:
        if acc.scaler is not None and not driven:
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
    acc._grads_scaled = acc._hooked = False
    acc._user_scaler = None
    return result


# torch's LRScheduler warns unless optimizer.step looks wrapped by it (it then reads opt._opt_called, which
# _step sets); with this it also leaves the prepared step as it is.
_step._wrapped_by_lr_sched = True


def _zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad()``: only at an accumulation boundary, so it works before backward or after step."""
    acc: Accelerator = opt.accelerator
    if acc._raw or acc.micro_step % acc.accumulate == 0:
        type(opt).zero_grad(opt, set_to_none)


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
