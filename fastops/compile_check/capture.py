"""Triton launches recorded instead of run (``JITFunction.run`` patched), specialized by Triton's own binder and
compiled for a GPU arch with no GPU present; each compile's registers, spills, shared memory and layout
conversions. The binder and ``_pack_args`` are Triton internals (3.x): a Triton upgrade that moves them breaks
this module, and tests/test_compile_check.py says so."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing
import re
import sys
import tempfile
from typing import Any

from .cuda import Result, local_accesses, resident_blocks, resource_usage
from .inputs import Op, combinations

# At most this many registers a thread for a Triton kernel: 128 keeps 16 warps of 8 an SM resident (4 blocks of
# 4 warps), enough loads in flight to stream at the memory roofline. The bf16 Adam at 4 warps took 139-184 (2-3
# blocks an SM).
MAX_TRITON_REGS = 128


@dataclasses.dataclass
class Launch:
    fn: Any  # triton JITFunction
    args: tuple
    kwargs: dict


def _kernel_classes() -> tuple[type, ...]:
    # InterpretedFunction under TRITON_INTERPRET=1: launches can be recorded (the tests do) but not compiled.
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


@contextlib.contextmanager
def _recording(launches: list[Launch]):
    """Kernel launches are recorded instead of run."""

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    classes = _kernel_classes()
    saved = [(cls, cls.run) for cls in classes]
    try:
        for cls in classes:
            cls.run = record
        yield
    finally:
        for cls, run in saved:
            cls.run = run


def capture(op: Op, options: dict[str, Any]) -> list[Launch]:
    launches: list[Launch] = []
    with _recording(launches):
        op.call(options)
    return launches


def _target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def specialize(launch: Launch, arch: int):
    """(options, signature, constexprs, attrs) as JITFunction.run derives them for ``arch``."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(_target(arch))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, options)


def spec_key(launch: Launch, arch: int) -> str:
    options, signature, constexprs, attrs = specialize(launch, arch)
    return repr((launch.fn.fn.__qualname__, signature, sorted(constexprs.items()), sorted(attrs.items()), options))


def spec_label(launch: Launch) -> str:
    """The constexpr and int arguments of the launch (pointers and floats do not change the code)."""
    parts = []
    for param, value in zip(launch.fn.params, launch.args):
        if isinstance(value, int) and not isinstance(value, bool):
            parts.append(f"{param.name}={value}")
    for k, v in launch.kwargs.items():
        if k in launch.fn.arg_names and k not in ("CHUNK", "BLOCK"):
            text = str(v).replace("triton.language.", "")
            parts.append(f"{k}={int(v) if isinstance(v, bool) else text}")
    return " ".join(parts)


def compile_launch(launch: Launch, arch: int) -> Result:
    """Compiles one launch for ``arch`` and reads its resources from the cubin."""
    import triton
    from triton.compiler import ASTSource

    name = launch.fn.fn.__name__.lstrip("_")
    result = Result(name, spec_label(launch), arch)
    try:
        options, signature, constexprs, attrs = specialize(launch, arch)
        kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=_target(arch),
                                options=options.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            ((_, _, usage),) = resource_usage(f.name, arch)
            if usage["STACK"] and not usage["LOCAL"] and not local_accesses(f.name):
                # A stack frame that no instruction loads or stores: the ABI frame of the div.rn/sqrt.rn slow-path
                # subroutines (8 B in three 8-bit adam_lowp specs on sm_90, no STL/LDL in their SASS), not a spill.
                usage["STACK"] = 0
    except Exception as e:  # noqa: BLE001 - the error is the result
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # Triton's CompilationError: "at 2:11:", the source line, a caret, then the message.
        text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
        result.error = f"{type(e).__name__}: {text}"[:300]
        return result
    result.regs, result.local, result.smem = usage["REG"], usage["LOCAL"] + usage["STACK"], kernel.metadata.shared
    result.converts = layout_conversions(kernel.asm["ttgir"])
    threads = 32 * kernel.metadata.num_warps
    result.warps_per_sm = resident_blocks(arch, threads, result.regs, result.smem) * threads // 32
    errors = []
    if result.local:
        errors.append(f"{result.local} bytes of local memory (spills)")
    if result.regs > MAX_TRITON_REGS:
        errors.append(f"{result.regs} registers (at most {MAX_TRITON_REGS}: "
                      f"{resident_blocks(arch, threads, MAX_TRITON_REGS, 0) * threads // 32} warps an SM)")
    if result.converts:
        errors.append(f"{result.converts} layout conversion(s) (a shared-memory round trip and barriers each)")
    result.error = "; ".join(errors)
    return result


def layout_conversions(ttgir: str) -> int:
    """``ttg.convert_layout`` ops in a kernel's TritonGPU IR that stay after Triton's own passes: each moves a
    tensor between per-thread layouts, through shared memory unless the two layouts happen to agree in registers.
    A kernel whose streams load in different layouts (8 bf16 elements a thread next to 4 fp32) needs them; one
    layout for every stream needs none."""
    return len(re.findall(r"\bttg\.convert_layout\b", ttgir))


_JOBS: list[tuple[Launch, int]] = []


def _compile_job(i: int) -> Result:
    return compile_launch(*_JOBS[i])


def triton_launches(ops: list[Op], archs, exhaustive: bool) -> list[tuple[Launch, int]]:
    """The distinct (launch, arch) pairs the options of ``ops`` give."""
    jobs, seen = [], set()
    for op in ops:
        for options in combinations(op.options, exhaustive):
            for launch in capture(op, options):
                for arch in archs:
                    key = spec_key(launch, arch)
                    if key not in seen:
                        seen.add(key)
                        jobs.append((launch, arch))
    return jobs


def uncovered_kernels(launches) -> list[str]:
    """``*_kernel`` functions in fastops.kernels that none of ``launches`` runs."""
    launched = {id(launch.fn) for launch in launches}
    missing = []
    for name, mod in sorted(sys.modules.items()):
        if name.startswith("fastops.kernels."):
            for attr, obj in vars(mod).items():
                if isinstance(obj, _kernel_classes()) and attr.endswith("_kernel") and id(obj) not in launched:
                    missing.append(f"{name}.{attr}")
    return missing


def last_launches() -> list[Launch]:
    """The launches the last run_triton compiled (what uncovered_kernels needs to see)."""
    return [launch for launch, _ in _JOBS]


def run_triton(ops: list[Op], archs, exhaustive: bool, jobs: int) -> list[Result]:
    global _JOBS
    _JOBS = triton_launches(ops, archs, exhaustive)
    if jobs > 1 and len(_JOBS) > 1:
        # fork: the workers inherit the recorded launches (their tensors and JITFunctions) instead of pickling them.
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return pool.map(_compile_job, range(len(_JOBS)), chunksize=1)
    return [_compile_job(i) for i in range(len(_JOBS))]


def _interpreted() -> bool:
    from triton.runtime.jit import JITFunction

    kernels = importlib.import_module("fastops.kernels")
    return not isinstance(kernels.adam._adam_kernel, JITFunction)
