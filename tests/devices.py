"""The (device, backend) pairs every op-level test runs over: the CPU's always, CUDA's as the same tests, each
skipped on its own where no GPU is, and marked ``cuda`` (benchmarks/gpu_check.sh runs ``pytest -m cuda`` on a GPU
machine: every CUDA and compiled-Triton case is one of these pairs). The fixtures over them are conftest.py's."""

from __future__ import annotations

import pytest
import torch

from fastops import _backend
from fastops._specs import SPECS

CPU_BACKENDS = ("cpp", "triton", "reference")
CUDA_BACKENDS = ("triton", "cuda", "reference")
HAS_CUDA = torch.cuda.is_available()

_needs_gpu = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# pytest.param per pair, ids "cpu-cpp", "cuda-triton", ...: parametrize("device,backend", PAIRS).
PAIRS = [pytest.param("cpu", b, id=f"cpu-{b}") for b in CPU_BACKENDS] + [
    pytest.param("cuda", b, id=f"cuda-{b}", marks=_needs_gpu) for b in CUDA_BACKENDS
]
# The pairs a test against fastops.reference runs over: all but the CPU's reference backend, which is that module
# (a comparison with itself could not fail). The reference on CUDA runs torch's CUDA kernels: it stays.
KERNEL_PAIRS = [p for p in PAIRS if p.id != "cpu-reference"]
CUDA_PAIRS = [p for p in PAIRS if p.values[0] == "cuda"]
# The pairs whose kernels never read a device value on the host (the reference does: it is the fallback).
COMPILED_CUDA_PAIRS = [p for p in CUDA_PAIRS if p.values[1] != "reference"]

# The scalar arguments a Triton launcher can be told to read on the host (its host_scalars option).
SCALARS = ("lr", "grad_scale", "found_inf", "inv_scale")


def call(name: str, args, host_scalars: bool = False):
    """``torch.ops.fastops.<name>(*args)``. With ``host_scalars`` the op's scalar tensors are read on the host: on a
    GPU they are moved to the CPU (the op's own path for CPU scalars with CUDA tensors); on CPU tensors the Triton
    launcher reads them there through its ``host_scalars`` option (the same path, reachable no other way without a
    GPU; the op's check runs first, as the op runs it), and the C++ backend reads them there anyway."""
    if host_scalars:
        # unscale_check_ writes its found_inf: it stays on the grads' device.
        scalars = [k for k in SCALARS
                   if getattr(args, k, None) is not None and (k, name) != ("found_inf", "unscale_check_")]
        tensors = args.params if hasattr(args, "params") else args.grads
        if len(tensors) and tensors[0].device.type != "cpu":
            args = args._replace(**{k: getattr(args, k).cpu() for k in scalars})
        elif _backend.active("cpu") == "triton":
            SPECS[name].check(args)
            return getattr(_backend.chosen("cpu")[1], name)(*args, host_scalars=tuple(scalars))
    return getattr(torch.ops.fastops, name)(*args)


def on(device, args):
    """``args`` (an op's ``Args`` record) with every tensor moved to ``device``."""
    from fastops._specs.spec import on as _on

    return _on(device, args)


def cpu(args):
    return type(args)(*[[t.cpu() for t in a] if isinstance(a, list) else a.cpu() if isinstance(a, torch.Tensor) else a
                        for a in args])  # fmt: skip


def clone(args):
    return type(args)(*[[t.clone() for t in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor)
                        else a for a in args])  # fmt: skip
