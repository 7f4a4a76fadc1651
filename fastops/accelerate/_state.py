"""An Accelerator's state, in two objects.

``ProcessState`` is where it runs (device, ranks, strategy, mesh): made once by ``_distributed.process_state``
and frozen, as HF Accelerate's ``PartialState``; the Accelerator stores it as ``state`` and shows its fields as
read-only attributes (``acc.device``, ``acc.rank``, ...).

``StepState`` is what the forward, the output hooks, ``backward`` and the patched optimizer step tell each other
between two optimizer steps: one object per Accelerator, so every module reads and sets the same fields under
the same names."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class ProcessState:
    device: torch.device  # with its index for CUDA (fastops._util.resolve_device)
    distributed: bool  # a torch.distributed process group is initialized
    rank: int
    world_size: int
    local_rank: int  # LOCAL_RANK under a launcher, else 0
    strategy: str  # one of STRATEGIES less "auto"
    mesh: Any  # the DeviceMesh with "dp" and "tp"/"pp" dims under tp, fsdp+tp and pp; else None
    dp_rank: int  # the data-parallel rank and size the loader shards by: under TP or PP, the ranks of one dp
    dp_size: int  # group see the same batches

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass
class StepState:
    last_step_real: bool = True  # the last optimizer.step() call was a real step, not a micro-step
    raw: bool = False  # inside our own step: optimizer.step/zero_grad run as the class's
    via_call: bool = False  # set by the forward pre-hook: forward runs inside model(...), hooks and all
    grads_scaled: bool = False  # gradient came through scaled outputs (or backward()) since the last step
    exact_backward: bool = False  # inside Accelerator.backward(): the output hooks leave the gradient alone
    hooked: bool = False  # outputs got grad hooks since the last step
    user_scaler: Any = None  # a GradScaler of the user's scaled this step's loss: it drives (_model.give_way_to)
    warned_outputs: bool = False  # the warning about outputs with no floating tensor was given
    regions: Any = None  # compile=True: the compiled regions (_compile._Regions), which report after a few steps
    real_steps: int = 0  # real optimizer steps taken in this process

    def end_step(self) -> None:
        """After a real optimizer step: the next step's gradients start unscaled and unhooked."""
        self.grads_scaled = self.hooked = False
        self.user_scaler = None
        self.real_steps += 1
        if self.regions is not None:
            self.regions.report(self.real_steps)

    @contextlib.contextmanager
    def raw_calls(self):
        """optimizer.step()/zero_grad() inside run as the class's and do not count as training steps (our own
        step, and torch.distributed.checkpoint creating the optimizer state)."""
        self.raw = True
        try:
            yield
        finally:
            self.raw = False
