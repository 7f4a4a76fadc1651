"""The Triton launchers compile-check calls and the options it calls them over. The tensors come from the ops'
specs (fastops/_specs): each option row changes one spec input, and every spec sample input is launched too,
so what is compiled includes what the parity, opcheck and compile tests run."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import torch

from .._checks import FLOAT_DTYPES

EXHAUSTIVE_UP_TO = 64


@dataclasses.dataclass(frozen=True)
class Op:
    """A Triton launcher and the options it is checked over. ``call(options)`` calls the launcher once on small
    CPU tensors. Option values for a one-element scalar tensor are None (not passed), ``"host"`` (the launcher
    reads it on the host, its ``host_scalars`` option: what a CPU scalar does with CUDA tensors) or a dtype (on the
    tensors' device, read in the kernel through a pointer); the option's name is the scalar argument's. Put each
    option's heaviest value last."""

    name: str
    call: Callable[[dict[str, Any]], None]
    options: dict[str, tuple]


DTYPES = FLOAT_DTYPES
SCALAR = (None, "host", torch.float32)  # an optional scalar
N = 100  # elements of each tensor; the chunk tables only need numel


def _zeros(n: int, dtype: torch.dtype, aligned: bool = True) -> torch.Tensor:
    # One element into a buffer: a data_ptr off 16-byte alignment, as a param sliced out of a flat buffer.
    return torch.zeros(n, dtype=dtype) if aligned else torch.zeros(n + 1, dtype=dtype)[1:]


def _placed(t: torch.Tensor, aligned: bool) -> torch.Tensor:
    """``t``'s values, its data_ptr 16-byte aligned or one element off."""
    return t if aligned else _zeros(t.numel(), t.dtype, False).copy_(t.reshape(-1)).view(t.shape)


def _scalar(value, fill: float = 1.0) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.full((), fill, dtype=torch.float32 if value == "host" else value)


def _host(o: dict[str, Any]) -> tuple[str, ...]:
    """The launcher's ``host_scalars``: the scalar options set to "host"."""
    return tuple(k for k, v in o.items() if isinstance(v, str) and v == "host")


def _wd(o: dict[str, Any]) -> dict[str, Any]:
    return {"weight_decay": 0.0 if o["weight_decay"] == "none" else 0.01, "decoupled": o["weight_decay"] == "decoupled"}


def _adam(o: dict[str, Any]) -> None:
    from fastops import kernels
    from fastops._specs import adam

    args = adam.inputs([N], o["dtype"], amsgrad=o["amsgrad"], master=o["master"])
    args = args._replace(params=[_placed(args.params[0], o["aligned"])], lr=_scalar(o["lr"], 1e-3), beta1=o["beta1"],
                         maximize=o["maximize"], grad_scale=_scalar(o["grad_scale"]),
                         found_inf=_scalar(o["found_inf"], 0.0), **_wd(o))  # fmt: skip
    kernels.adam_step_(*args, host_scalars=_host(o))


def _adam_lowp(o: dict[str, Any]) -> None:
    from fastops import kernels
    from fastops._specs import adam_lowp

    args = adam_lowp.inputs([o["numel"]], o["state"], o["dtype"], o["master"], maximize=o["maximize"], seed=7, **_wd(o))
    args = args._replace(params=[_placed(args.params[0], o["aligned"])], lr=_scalar(o["lr"], 1e-3), beta1=o["beta1"],
                         grad_scale=_scalar(o["grad_scale"]), found_inf=_scalar(o["found_inf"], 0.0))  # fmt: skip
    kernels.adam_step_lowp_(*args, host_scalars=_host(o))


def _sgd(o: dict[str, Any]) -> None:
    from fastops import kernels
    from fastops._specs import sgd

    # The op's invalid combinations (nesterov without momentum, nesterov with dampening) map to valid ones.
    momentum = 0.9 if o["momentum"] or o["nesterov"] else 0.0
    args = sgd.inputs([N], o["dtype"], momentum, o["master"], lr=_scalar(o["lr"], 1e-3),
                      weight_decay=0.01 if o["weight_decay"] else 0.0,
                      dampening=0.0 if o["nesterov"] else o["dampening"],
                      nesterov=o["nesterov"], maximize=o["maximize"], first=o["first"],
                      scale=_scalar(o["grad_scale"]), found_inf=_scalar(o["found_inf"], 0.0))  # fmt: skip
    kernels.sgd_step_(*args._replace(params=[_placed(args.params[0], o["aligned"])]), host_scalars=_host(o))


def _grads(o: dict[str, Any]) -> list[torch.Tensor]:
    from fastops._specs import amp
    from fastops.kernels._common import block_sizes

    # "chunks" chunks in all: 1 and multiples of 16 are distinct Triton specializations of an int argument.
    n = (o["chunks"] - 1) * block_sizes("stats")[0] + 1
    grads = [_placed(amp.grads([n], o["dtype"])[0], o["aligned"])]
    if o["mixed"]:  # a second dtype: a second launch, whose partials start past the first's
        grads += amp.grads([N], torch.float16 if o["dtype"] != torch.float16 else torch.float32)
    return grads


def _unscale(o: dict[str, Any]) -> None:
    from fastops import kernels
    from fastops._specs import amp

    grads = [_placed(amp.grads([N], o["dtype"])[0], o["aligned"])]
    kernels.unscale_check_(grads, torch.zeros(1), _scalar(o["inv_scale"]), host_scalars=_host(o))


def _grad_stats(o: dict[str, Any]) -> None:
    from fastops import kernels

    kernels.grad_stats(_grads(o), _scalar(o["inv_scale"]), host_scalars=_host(o))


def _spec_sample(name: str) -> Callable[[dict[str, Any]], None]:
    """Calls the Triton launcher of ``name`` on the spec sample input named by the option "sample"."""

    def call(o: dict[str, Any]) -> None:
        from fastops import kernels
        from fastops._specs import SPECS

        sample = next(s for s in SPECS[name].sample_inputs("cpu") if s.id == o["sample"])
        getattr(kernels, name)(*sample.args)

    return call


def _sample_ops() -> list[Op]:
    from fastops._specs import SPECS

    return [Op(f"{name}:samples", _spec_sample(name), {"sample": tuple(s.id for s in spec.sample_inputs("cpu"))})
            for name, spec in SPECS.items()]  # fmt: skip


OPS = [
    Op("adam_step_", _adam, {
        "dtype": DTYPES, "aligned": (False, True), "lr": ("host", torch.float64, torch.float32),
        "grad_scale": SCALAR, "found_inf": (None, torch.float32), "weight_decay": ("none", "l2", "decoupled"),
        "beta1": (0.1, 0.9), "maximize": (False, True), "amsgrad": (False, True), "master": (False, True),
    }),
    Op("adam_step_lowp_", _adam_lowp, {
        "state": ("bf16", "8bit"), "dtype": DTYPES, "aligned": (False, True), "numel": (N, 4096),
        "lr": ("host", torch.float64, torch.float32), "grad_scale": SCALAR, "found_inf": (None, torch.float32),
        "weight_decay": ("none", "l2", "decoupled"), "beta1": (0.1, 0.9), "maximize": (False, True),
        "master": (False, True),
    }),
    Op("sgd_step_", _sgd, {
        "dtype": DTYPES, "aligned": (False, True), "lr": ("host", torch.float64, torch.float32),
        "grad_scale": SCALAR, "found_inf": (None, torch.float32), "weight_decay": (False, True),
        "momentum": (False, True), "dampening": (0.0, 0.1), "nesterov": (False, True), "maximize": (False, True),
        "first": (False, True), "master": (False, True),
    }),
    Op("unscale_check_", _unscale, {"dtype": DTYPES, "aligned": (False, True), "inv_scale": ("host", torch.float32)}),
    Op("grad_stats", _grad_stats, {
        "dtype": DTYPES, "aligned": (False, True), "inv_scale": SCALAR, "chunks": (1, 3, 16), "mixed": (False, True),
    }),
] + _sample_ops()  # fmt: skip


def combinations(options: dict[str, tuple], exhaustive: bool = False) -> list[dict[str, Any]]:
    """Every combination of ``options`` when there are at most EXHAUSTIVE_UP_TO (or ``exhaustive``), else a set
    that holds every pair of values of two options, plus, for each value of the first option, every other
    option at its last value. Deterministic."""
    names = list(options)
    full = [dict(zip(names, vals)) for vals in itertools.product(*options.values())]
    if exhaustive or len(full) <= EXHAUSTIVE_UP_TO:
        return full

    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2) if a in row and b in row}

    uncovered = set().union(*(pairs(r) for r in full))
    rows = [{names[0]: v, **{n: options[n][-1] for n in names[1:]}} for v in options[names[0]]]
    for r in rows:
        uncovered -= pairs(r)
    while uncovered:
        a, va, b, vb = min(uncovered, key=repr)
        row = {a: va, b: vb}
        for n in names:
            if n not in row:
                row[n] = max(options[n], key=lambda v: len(pairs({**row, n: v}) & uncovered))
        rows.append({n: row[n] for n in names})
        uncovered -= pairs(row)
    return rows
