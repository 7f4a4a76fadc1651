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

from .capture import (MAX_TRITON_REGS, Launch, capture, compile_launch, layout_conversions, run_triton, spec_key,
                      spec_label, specialize, triton_launches, uncovered_kernels)  # fmt: skip
from .cli import main
from .cuda import (ARCHS, CUDA_LAUNCHES, LIMITS, ArchLimits, Result, check_cuda_kernels, count_local_accesses,
                   cuda_extension, cuobjdump, demangle, local_accesses, parse_resource_usage, resident_blocks,
                   resource_usage)  # fmt: skip
from .inputs import DTYPES, EXHAUSTIVE_UP_TO, N, OPS, SCALAR, Op, combinations

__all__ = [
    "ARCHS", "CUDA_LAUNCHES", "DTYPES", "EXHAUSTIVE_UP_TO", "LIMITS", "MAX_TRITON_REGS", "N", "OPS", "SCALAR",
    "ArchLimits", "Launch", "Op", "Result", "capture", "check_cuda_kernels", "combinations", "compile_launch",
    "count_local_accesses", "cuda_extension", "cuobjdump", "demangle", "layout_conversions", "local_accesses",
    "main", "parse_resource_usage", "resident_blocks", "resource_usage", "run_triton", "spec_key", "spec_label",
    "specialize", "triton_launches", "uncovered_kernels",
]  # fmt: skip
