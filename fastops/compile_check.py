"""``python -m fastops compile-check``: every kernel compiled for real GPUs, on a machine without one.

Triton kernels: each launcher in ``fastops.kernels`` is called on small CPU tensors with ``JITFunction.run``
patched to record its launches instead of running them; each recorded launch is then specialized by Triton's
own binder (the code ``run`` uses: argument types, 16-byte alignment, ints equal to 1) and compiled for sm_80,
sm_90 and sm_100. So what is compiled is what the launcher passes, and a new kernel argument or constexpr needs
no change here. The launcher options come from ``OPS``: every combination where there are at most
``EXHAUSTIVE_UP_TO``, else every pair of option values (each value of each option next to each value of every
other: an error that needs two flags to show is still hit) plus, for each value of the first option, the
combination with every other option at its last, heaviest, value. ``--exhaustive`` compiles every combination.

CUDA C++ kernels: ``cuobjdump --dump-resource-usage`` of the built ``fastops._C`` (every arch it was built
for), checked against ``CUDA_LAUNCHES``.

One line per kernel, spec and arch, with registers, local memory (where spills go; none of these kernels
has a local array, so any local memory is a spill), shared memory and the warps an SM holds at that usage.
Triton kernels also fail above ``MAX_TRITON_REGS`` registers or with any layout conversion left in their TTGIR
(``converts``). Exits 1 on a compile error, a spill, or a CUDA C++ kernel whose registers or shared memory keep fewer blocks
on an SM than its launch assumes.

Adding a kernel: a Triton launcher is one ``Op`` (a function calling it with one combination, and its
options); a CUDA C++ kernel is one ``CUDA_LAUNCHES`` entry. A ``*_kernel`` in ``fastops.kernels`` that no
``Op`` launches, or a CUDA kernel without an entry, is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from ._checks import FLOAT_DTYPES

ARCHS = (80, 90, 100)
# At most this many registers a thread for a Triton kernel: 128 keeps 16 warps of 8 an SM resident (4 blocks of
# 4 warps), enough loads in flight to stream at the memory roofline. The bf16 Adam at 4 warps took 139-184 (2-3
# blocks an SM).
MAX_TRITON_REGS = 128
EXHAUSTIVE_UP_TO = 64


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    regs: int = 65536  # 32-bit registers per SM
    warps: int = 64
    blocks: int = 32
    smem: int = 228 * 1024  # shared memory per SM, of which 1 KiB per block is reserved


# A100 (sm_80) has 164 KiB of shared memory per SM; H100/H200 (sm_90) and B200 (sm_100) 228 KiB.
LIMITS = {80: ArchLimits(smem=164 * 1024), 90: ArchLimits(), 100: ArchLimits()}


def resident_blocks(arch: int, threads: int, regs: int, smem: int) -> int:
    """Blocks of ``threads`` threads one SM holds at ``regs`` registers a thread and ``smem`` bytes of shared
    memory a block (the CUDA occupancy calculator's rules: registers are allocated per warp, in units of 256)."""
    lim = LIMITS[arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (lim.regs // regs_per_warp) // warps
    by_smem = lim.smem // (smem + 1024)
    return min(lim.blocks, lim.warps // warps, by_regs, by_smem)


# --- CUDA C++ kernels ------------------------------------------------------------------------------------------

# Kernel name (as in csrc/cuda/*.cu) -> (threads a block, blocks an SM the launch assumes resident, or None where
# the launcher sizes its grid with cudaOccupancyMaxActiveBlocksPerMultiprocessor: then only spills are checked).
# The binding sizes every grid-stride grid as multiProcessorCount * (2048 / kThreads) blocks of kThreads = 512
# threads (binding.cpp's launch_context, kernels.cuh): four resident blocks an SM, or the grid runs in waves.
# grad_stats_reduce is one block.
CUDA_LAUNCHES = {
    "adam_kernel": (512, None),
    "adam_lowp_kernel": (512, None),
    "sgd_kernel": (512, None),
    "unscale_check_kernel": (512, 4),
    "grad_stats_partials_kernel": (512, 4),
    "grad_stats_reduce_kernel": (512, 1),
}


@dataclasses.dataclass
class Result:
    kernel: str
    spec: str
    arch: int
    regs: int = 0
    local: int = 0
    smem: int = 0
    warps_per_sm: int = 0
    converts: int = 0
    error: str = ""

    def line(self) -> str:
        head = f"{self.kernel:28s} {self.spec:60s} sm_{self.arch:<4d}"
        if self.error and not self.regs:
            return f"{head} ERROR {self.error}"
        text = (f"{head} regs {self.regs:3d}  local {self.local:4d} B  smem {self.smem:6d} B  "
                f"converts {self.converts:2d}  warps/SM {self.warps_per_sm:2d}")
        return f"{text}  ERROR {self.error}" if self.error else text


def cuobjdump() -> str:
    """The cuobjdump to use: $CUOBJDUMP, the one Triton ships (the version its ptxas matches, which knows every
    arch it compiles for), one on PATH, or the toolkit's."""
    candidates = [os.environ.get("CUOBJDUMP")]
    with contextlib.suppress(Exception):
        import triton

        candidates.append(triton.knobs.nvidia.cuobjdump.path)
    candidates += [shutil.which("cuobjdump"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    raise RuntimeError("compile-check: no cuobjdump (set CUOBJDUMP, install triton or nvidia-cuda-cuobjdump)")


def resource_usage(path: str, arch: int | None = None) -> list[tuple[int, str, dict[str, int]]]:
    """(arch, function, {REG, STACK, SHARED, LOCAL, ...}) for each function in a cubin (of ``arch``) or in every
    ELF of a fatbinary-holding file (a .so built by nvcc names each ELF's arch)."""
    out = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True)
    if out.returncode != 0:
        if "does not contain device code" in out.stderr:
            return []
        raise RuntimeError(f"cuobjdump {path}: {out.stderr.strip()}")
    return parse_resource_usage(out.stdout, arch)


def local_accesses(path: str) -> int:
    """The local-memory loads and stores (STL/LDL: spills, local arrays) in a cubin's SASS."""
    return count_local_accesses(subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True,
                                               check=True).stdout)


def count_local_accesses(sass: str) -> int:
    return len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass))


def parse_resource_usage(text: str, arch: int | None = None) -> list[tuple[int, str, dict[str, int]]]:
    found = []
    function = None
    for line in text.splitlines():
        if m := re.match(r"\s*arch = sm_(\d+)", line):
            arch = int(m.group(1))
        elif m := re.match(r"\s*Function (\S+):\s*$", line):
            function = m.group(1)
        elif function and "REG:" in line:
            fields = {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", line)}
            found.append((arch, function, fields))
            function = None
    return found


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else names


def check_cuda_kernels(ext_path: str) -> list[Result]:
    usage = resource_usage(ext_path)
    results = []
    for (arch, _, f), name in zip(usage, demangle([u[1] for u in usage])):
        # "void fastops::cuda::(anonymous namespace)::adam_kernel<float, false, true>(fastops::cuda::AdamArgs)"
        name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
        kernel = re.split(r"[<(]", name, maxsplit=1)[0].split("::")[-1]
        template = re.search(r"<(.*)>\s*\(", name)
        spec = template.group(1).replace(" ", "") if template else "-"
        r = Result(kernel, spec, arch, f["REG"], f["LOCAL"] + f["STACK"], f["SHARED"])
        launch = CUDA_LAUNCHES.get(kernel)
        if arch not in LIMITS:
            r.error = f"no limits for sm_{arch} in compile_check.LIMITS"
        elif launch is None:
            r.error = f"no launch config for {kernel} in compile_check.CUDA_LAUNCHES"
        else:
            threads, want = launch
            got = resident_blocks(arch, threads, r.regs, r.smem)
            r.warps_per_sm = got * threads // 32
            if want is not None and got < want:
                r.error = (f"{got} resident block(s) of {threads} threads per SM at {r.regs} registers, "
                           f"the launch assumes {want} (at most {65536 // (threads * want)} registers)")
        if r.local:
            r.error = (r.error + "; " if r.error else "") + f"{r.local} bytes of local memory (spills)"
        results.append(r)
    return results


def cuda_extension() -> str | None:
    spec = importlib.util.find_spec("fastops._C")
    return spec.origin if spec is not None else None


# --- Triton kernels --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """A Triton launcher and the options it is checked over. ``call(options)`` calls the launcher once on small
    CPU tensors. Option values for a one-element scalar tensor are None (not passed), ``"host"`` (the launcher
    reads it on the host: what a CPU scalar does with CUDA tensors) or a dtype (on the tensors' device, read in
    the kernel through a pointer); the option's name is the scalar's name in ``scalar_source``. Put each option's
    heaviest value last."""

    name: str
    call: Callable[[dict[str, Any]], None]
    options: dict[str, tuple]


DTYPES = FLOAT_DTYPES
SCALAR = (None, "host", torch.float32)  # an optional scalar
N = 100  # elements of each tensor; the chunk tables only need numel


def _zeros(n: int, dtype: torch.dtype, aligned: bool = True) -> torch.Tensor:
    # One element into a buffer: a data_ptr off 16-byte alignment, as a param sliced out of a flat buffer.
    return torch.zeros(n, dtype=dtype) if aligned else torch.zeros(n + 1, dtype=dtype)[1:]


def _scalar(value, fill: float = 1.0) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.full((), fill, dtype=torch.float32 if value == "host" else value)


def _adam(o: dict[str, Any]) -> None:
    from fastops import kernels

    p = _zeros(N, o["dtype"], o["aligned"])
    g = torch.zeros(N, dtype=o["dtype"])
    m, v, vmax, w = (torch.zeros(N) for _ in range(4))
    wd = 0.0 if o["weight_decay"] == "none" else 0.01
    kernels.adam_step_(
        [p], [g], [m], [v], [vmax] if o["amsgrad"] else [], [torch.zeros(())], [w] if o["master"] else [],
        _scalar(o["lr"], 1e-3), o["beta1"], 0.999, 1e-8, wd, o["amsgrad"], o["maximize"],
        o["weight_decay"] == "decoupled", _scalar(o["grad_scale"]), _scalar(o["found_inf"], 0.0),
    )  # fmt: skip


def _adam_lowp(o: dict[str, Any]) -> None:
    from fastops import _quant, kernels

    n = o["numel"]
    p = _zeros(n, o["dtype"], o["aligned"])
    g = torch.zeros(n, dtype=o["dtype"])
    if o["state"] == "8bit":
        m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        absmax = [[torch.zeros(_quant.n_blocks(n))], [torch.zeros(_quant.n_blocks(n))]]
    else:
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        absmax = [[], []]
    wd = 0.0 if o["weight_decay"] == "none" else 0.01
    kernels.adam_step_lowp_(
        [p], [g], [m], [v], *absmax, [torch.zeros(())], [torch.zeros(n)] if o["master"] else [],
        _scalar(o["lr"], 1e-3), o["beta1"], 0.999, 1e-8, wd, o["maximize"], o["weight_decay"] == "decoupled", 7,
        _scalar(o["grad_scale"]), _scalar(o["found_inf"], 0.0),
    )  # fmt: skip


def _sgd(o: dict[str, Any]) -> None:
    from fastops import kernels

    p, g = _zeros(N, o["dtype"], o["aligned"]), torch.zeros(N, dtype=o["dtype"])
    # The op's invalid combinations (nesterov without momentum, nesterov with dampening) map to valid ones.
    momentum = 0.9 if o["momentum"] or o["nesterov"] else 0.0
    kernels.sgd_step_(
        [p], [g], [torch.zeros(N)] if momentum else [], [torch.zeros(N)] if o["master"] else [],
        _scalar(o["lr"], 1e-3), 0.01 if o["weight_decay"] else 0.0, momentum,
        0.0 if o["nesterov"] else o["dampening"], o["nesterov"], o["maximize"], o["first"],
        _scalar(o["grad_scale"]), _scalar(o["found_inf"], 0.0),
    )  # fmt: skip


def _grads(o: dict[str, Any]) -> list[torch.Tensor]:
    from fastops.kernels._common import block_sizes

    # "chunks" chunks in all: 1 and multiples of 16 are distinct Triton specializations of an int argument.
    n = (o["chunks"] - 1) * block_sizes("stats")[0] + 1
    grads = [_zeros(n, o["dtype"], o["aligned"])]
    if o["mixed"]:  # a second dtype: a second launch, whose partials start past the first's
        grads.append(torch.zeros(N, dtype=torch.float16 if o["dtype"] != torch.float16 else torch.float32))
    return grads


def _unscale(o: dict[str, Any]) -> None:
    from fastops import kernels

    kernels.unscale_check_([_zeros(N, o["dtype"], o["aligned"])], torch.zeros(1), _scalar(o["inv_scale"]))


def _grad_stats(o: dict[str, Any]) -> None:
    from fastops import kernels

    kernels.grad_stats(_grads(o), _scalar(o["inv_scale"]))


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
]  # fmt: skip


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
def _recording(launches: list[Launch], host: set[str]):
    """Kernel launches are recorded instead of run; the scalars named in ``host`` are read on the host."""

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    patched = [(cls, "run", record) for cls in _kernel_classes()]
    importlib.import_module("fastops.kernels")  # and the launcher modules it imports, patched below
    for name, mod in list(sys.modules.items()):
        source = getattr(mod, "scalar_source", None)
        if name.startswith("fastops.kernels") and source is not None:
            def on_host(t, device, op, what, on_host=False, _source=source):
                return _source(t, device, op, what, on_host or what in host)

            patched.append((mod, "scalar_source", on_host))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patched]
    try:
        for obj, attr, new in patched:
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def capture(op: Op, options: dict[str, Any]) -> list[Launch]:
    launches: list[Launch] = []
    with _recording(launches, {k for k, v in options.items() if isinstance(v, str) and v == "host"}):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastops compile-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", type=int, nargs="+", default=list(ARCHS), help="compute capabilities (default: %(default)s)")
    parser.add_argument("--ops", nargs="+", help="only these Triton launchers (default: all)")
    parser.add_argument("--exhaustive", action="store_true", help="every combination of every launcher's options")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: %(default)s)")
    parser.add_argument("--no-cuda-ext", action="store_true", help="skip the CUDA C++ kernels of fastops._C")
    parser.add_argument("--require-cuda-ext", action="store_true", help="fail if fastops._C has no CUDA kernels")
    args = parser.parse_args(argv)
    for a in args.archs:
        if a not in LIMITS:
            parser.error(f"unknown arch {a}; known: {sorted(LIMITS)}")
    os.environ.pop("TRITON_INTERPRET", None)  # only takes effect before triton is first imported
    if _interpreted():
        print("compile-check: fastops.kernels was imported with TRITON_INTERPRET=1; run it in a process without it")
        return 2
    ops = [op for op in OPS if args.ops is None or op.name in args.ops]
    if args.ops and len(ops) != len(args.ops):
        parser.error(f"unknown op in {args.ops}; known: {[op.name for op in OPS]}")

    t0 = time.perf_counter()
    results = run_triton(ops, args.archs, args.exhaustive, args.jobs)
    triton_s = time.perf_counter() - t0
    failed = [r for r in results if r.error]
    for r in sorted(results, key=lambda r: (r.kernel, r.spec, r.arch)):
        print(r.line())
    missing = uncovered_kernels(launch for launch, _ in _JOBS) if args.ops is None else []
    for name in missing:
        print(f"{name}: ERROR launched by no compile_check.OPS entry")
    print(f"compile-check: {len(results)} Triton kernel/spec/arch compiles in {triton_s:.0f} s with {args.jobs} job(s), "
          f"{len(failed)} failed")

    cuda_failed = 0
    if not args.no_cuda_ext:
        path = cuda_extension()
        cuda = sorted(check_cuda_kernels(path) if path else [], key=lambda r: (r.kernel, r.arch, r.spec))
        for r in cuda:
            print(r.line())
        cuda_failed = sum(bool(r.error) for r in cuda)
        if cuda:
            print(f"compile-check: {len(cuda)} CUDA C++ kernel/arch entries in {path}, {cuda_failed} failed")
        else:
            print(f"compile-check: {path or 'fastops._C (not built)'} holds no CUDA kernels")
            cuda_failed += args.require_cuda_ext
    return 1 if failed or missing or cuda_failed else 0


if __name__ == "__main__":
    sys.exit(main())
