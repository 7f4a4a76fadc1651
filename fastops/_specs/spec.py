"""What an op spec holds: its schema, the one place the op's arguments are written, and what reads it.

From the schema (parsed by torch's own parser) come the op's name, the positions of the arguments it writes, and
``Args``, a NamedTuple of the op's arguments by name with the schema's defaults: the record the checks, the sample
and bad inputs, the Triton launchers and the tests address arguments through. The C++ argument structs and the
pybind11 bindings are generated from the same schema into csrc/generated/ (fastops/_specs/codegen.py).

A spec's ``check(args)`` is the op's one argument check: its float hyperparameters (``check_values``), then its
tensors' metadata (``check_tensors``: list lengths, shapes, dtypes, devices, strides, the tensor scalars). The fake
kernel runs it, so a bad call fails while torch.compile traces; at run time the dispatcher kernel (fastops/_ops.py)
runs the values in Python and the tensors in C++ (csrc/cpu/checks.cpp, the same conditions, order and messages as
fastops/_checks.py), in the same call as the kernel where the backend is C++. Backends assume what it passed. No
tensor's value is read, not even lr's: for a device lr that is a host sync a step, and the kernels read it
themselves (fastops.optim checks lr >= 0 when a group is added, and a host lr at each step; tests/test_amp.py holds
the step to no host read at all).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterator, NamedTuple

import torch


class Sample(NamedTuple):
    """One call of an op: ``id`` names the case in test ids, ``args`` is the op's ``Args`` record."""

    id: str
    args: tuple


class BadCall(NamedTuple):
    """A call the op must refuse with ``error`` and exactly ``message`` before writing anything; while tracing
    too (the fake kernel), unless ``traced`` is False (a check that needs a value only the run has)."""

    id: str
    args: tuple
    error: type
    message: str
    traced: bool = True


def camel(name: str) -> str:
    """adam_step_lowp_ -> AdamStepLowp: the name of an op's argument record, in Python and in C++ (+ "Args")."""
    return "".join(part.capitalize() for part in name.split("_"))


@dataclasses.dataclass(frozen=True)
class OpSpec:
    schema: str
    check_tensors: Callable[[Any], None]
    check_values: Callable[[Any], None]
    # What the op returns, from its (checked) fake arguments; None for the in-place ops.
    fake_result: Callable[..., Any] | None
    sample_inputs: Callable[..., Iterator[Sample]]
    bad_inputs: Callable[[str], Iterator[BadCall]]
    # Whether csrc/generated/ holds the op's C++ argument struct, binding and check (fastops/_specs/codegen.py).
    # linear_cross_entropy's C++ entry points take the schema's positional arguments (csrc/linear_ce.h) and its
    # check is the spec's alone, in Python: a few compares on four tensors, against calls of milliseconds.
    generated: bool = True
    # Derived from the schema:
    name: str = dataclasses.field(init=False)
    arguments: tuple = dataclasses.field(init=False)  # torch._C.Argument, in order
    # Positions of the arguments the schema marks written (Tensor(a!)): the dispatcher kernel bumps their autograd
    # version counters the way torch's in-place ops do (15 us for 300 tensors, against 200 us for custom_op's
    # wrapper). fastops.optim's master weights rely on it: a param written through its master must look modified.
    mutated: tuple = dataclasses.field(init=False)
    Args: type = dataclasses.field(init=False)

    def __post_init__(self):
        parsed = torch._C.parse_schema(self.schema)
        args = tuple(parsed.arguments)
        set_ = object.__setattr__
        set_(self, "name", parsed.name)
        set_(self, "arguments", args)
        set_(self, "mutated", tuple(i for i, a in enumerate(args) if a.alias_info and a.alias_info.is_write))
        defaults = [a.default_value for a in args if a.has_default_value()]
        set_(self, "Args", collections.namedtuple(camel(parsed.name) + "Args", [a.name for a in args],
                                                  defaults=defaults))  # fmt: skip

    def check(self, args: tuple) -> None:
        a = self.Args(*args)
        self.check_values(a)
        self.check_tensors(a)

    def fake(self, *args):
        self.check(args)
        return None if self.fake_result is None else self.fake_result(self.Args(*args))


def on(device: str | torch.device, args: tuple) -> tuple:
    """``args`` with every tensor (in lists too) moved to ``device`` (its strides kept: preserve_format)."""
    if torch.device(device).type == "cpu":
        return args
    moved = [[t.to(device) for t in a] if isinstance(a, list) else a.to(device) if isinstance(a, torch.Tensor) else a
             for a in args]  # fmt: skip
    return type(args)(*moved)


def with_(args: tuple, **changes) -> tuple:
    """``args`` (an ``Args`` record) with the named arguments replaced; a callable value is called with ``args``."""
    return args._replace(**{k: v(args) if callable(v) else v for k, v in changes.items()})


def step_bad_calls(op: str, bad: Callable[..., BadCall], device) -> Iterator[BadCall]:
    """The bad calls every optimizer op refuses alike (its params' and grads' dtype and layout, its master weights, its
    tensor scalars), each made by ``bad(case, message, master=False, **changes)`` from the op's inputs (two params)."""
    z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)  # noqa: E731
    gaps = ("is not contiguous (its memory is strided with gaps or overlaps); fused kernels walk the tensor's memory "
            "as one block")
    yield bad("one master short", f"fastops.{op}: expected 2 master_params (one per param), got 1", master=True,
              master_params=lambda a: a.master_params[:1])
    yield bad("fp16 master", "fastops: master_params[0] has dtype torch.float16 but must be torch.float32 (as "
              "params[0])", master=True, master_params=lambda a: [m.half() for m in a.master_params])
    yield bad("fp16 grad for fp32 param", "fastops: grads[0] has dtype torch.float16 but must be torch.float32 "
              "(as params[0])", grads=lambda a: [a.grads[0].half(), a.grads[1]])
    yield bad("int param", f"fastops.{op}: params[0] has dtype torch.int32; expected float32, bfloat16 or float16",
              params=lambda a: [z(a.params[0].shape, dtype=torch.int32), a.params[1]])
    yield bad("gapped param", f"fastops: params[0] {gaps}",
              params=lambda a: [z(2 * a.params[0].numel())[::2], a.params[1]])
    for what, value in (("lr", torch.tensor([0.1, 0.1])), ("grad_scale", torch.tensor(2)), ("found_inf", z(2))):
        yield bad(f"{what} {value.dtype} {tuple(value.shape)}", f"fastops.{op}: {what} must be a floating tensor with "
                  f"one element, got {value.dtype} of shape {tuple(value.shape)}", **{what: value})


def device_name(device) -> str:
    """``device`` as messages print it ("cuda:0" for "cuda")."""
    return str(torch.empty(0, device=device).device)
