"""What an op spec holds, and the checks every spec shares.

A spec's ``check(args)`` is the op's one argument check: its tensors' metadata (shapes, dtypes, devices, strides),
then its float hyperparameters. The fake kernel runs it, so a bad call fails while torch.compile traces, and so
does the dispatcher kernel (fastops/_ops.py), before any backend; backends assume what it passed. No tensor's
value is read, not even lr's: for a device lr that is a host sync a step, and the kernels read it themselves
(fastops.optim checks lr >= 0 when a group is added, and a host lr at each step; tests/test_amp.py holds the step
to no host read at all). Conditions and messages are fastops/_checks.py's: a check first tests every condition
in bulk and builds a message (one ``torch._check``) only when one fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch


class Sample(NamedTuple):
    """One call of an op: ``id`` names the case in test ids, ``args`` are the op's positional arguments."""

    id: str
    args: list


class BadCall(NamedTuple):
    """A call the op must refuse with ``error`` and exactly ``message`` before writing anything; while tracing
    too (the fake kernel), unless ``traced`` is False (a check that needs a value only the run has)."""

    id: str
    args: list
    error: type
    message: str
    traced: bool = True


@dataclass(frozen=True)
class OpSpec:
    name: str
    schema: str
    # Positions of the mutated arguments: the dispatcher kernel bumps their autograd version counters the way
    # torch's in-place ops do (15 us for 300 tensors, against 200 us for custom_op's wrapper). fastops.optim's
    # master weights rely on it: a param written through its master must look modified to autograd.
    mutated: tuple[int, ...]
    # The tensor checks (lists, shapes, dtypes, devices, strides, the tensor scalars' metadata) and the value
    # checks (the float hyperparameters, a CPU lr): the dispatcher kernel runs the C++ twin of the first where
    # fastops._C loads (see fastops/_ops.py for the measurement).
    check_tensors: Callable[[tuple], None]
    check_values: Callable[[tuple], None]
    # What the op returns, from its (checked) fake arguments; None for the in-place ops.
    fake_result: Callable[..., Any] | None
    sample_inputs: Callable[..., Iterator[Sample]]
    bad_inputs: Callable[[str], Iterator[BadCall]]

    def check(self, args: tuple) -> None:
        self.check_tensors(args)
        self.check_values(args)

    def fake(self, *args):
        self.check(args)
        return None if self.fake_result is None else self.fake_result(*args)


def check_problem(ok: bool, problem: Callable[[], str | None]) -> None:
    """Raise RuntimeError(problem()) when not ``ok``. ``problem`` runs the detailed checks of fastops/_checks.py,
    which raise with the message; the bulk test that gave ``ok`` is at least as strict, so when it finds nothing
    the call is valid after all (a bulk test that also rejects a valid layout only costs the slow path)."""
    if ok:
        return
    try:
        problem()
    except RuntimeError as e:
        msg = str(e)
        torch._check(False, lambda: msg)


def nonnegative(value: float, what: str) -> None:
    """torch.optim's constructor rule and wording ("Invalid epsilon value: -1e-08"); nan fails."""
    torch._check_value(0.0 <= value, lambda: f"Invalid {what}: {value}")


def beta(value: float, index: int) -> None:
    # beta = 1 makes the bias correction 1 - 1**t = 0: nan params (torch's constructor rule, [0, 1)).
    torch._check_value(0.0 <= value < 1.0, lambda: f"Invalid beta parameter at index {index}: {value}")


def scalars(op: str, device: torch.device | None, named: tuple[tuple[str, torch.Tensor | None], ...]) -> None:
    from .._checks import check_scalar

    if device is None:
        return
    for what, t in named:
        if t is not None and (t.numel() != 1 or not t.is_floating_point() or t.device != device and t.device.type != "cpu"):
            check_problem(False, lambda: check_scalar(t, op, what, device))


def on(device: str | torch.device, args: list) -> list:
    """``args`` with every tensor (in lists too) moved to ``device``."""
    if torch.device(device).type == "cpu":
        return args
    return [[t.to(device) for t in a] if isinstance(a, list) else a.to(device) if isinstance(a, torch.Tensor) else a
            for a in args]  # fmt: skip
