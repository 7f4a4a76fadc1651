"""The command line: ``python -m fastops compile-check [--archs ..] [--ops ..] [--exhaustive] [-j N]``."""

from __future__ import annotations

import argparse
import os
import time

from . import __doc__ as _DOC
from .capture import _interpreted, last_launches, run_triton, uncovered_kernels
from .cuda import ARCHS, LIMITS, check_cuda_kernels, cuda_extension
from .inputs import OPS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastops compile-check", description=_DOC.split("\n\n")[0])
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
    missing = uncovered_kernels(last_launches()) if args.ops is None else []
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
