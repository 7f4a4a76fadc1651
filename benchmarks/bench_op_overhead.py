"""What one call of ``torch.ops.fastops.adam_step_`` costs beyond its kernel: the op boundary (the dispatcher, the
argument check, the hand-over to the C++ backend), at 300 fp32 params, 1 thread, the C++ CPU backend.

Providers, each timed as CPU time of the calling thread (``time.thread_time``: steadier than wall time on a shared
machine) over a batch of calls, median per call in ms:
- ``op``: the whole op as optimizers call it (the dispatcher, fastops/_ops.py's kernel, the check, the kernel);
- ``cpp_entry``: ``fastops._C.cpp.adam_step_`` called from Python (the check and the kernel in one C++ call; in a
  tree from before that, the kernel alone);
- ``check_cpp``: the C++ argument check alone as Python reaches it (``fastops._C.checks``; in a tree from before it,
  the second op ``torch.ops.fastops_checks``);
- ``check_python``: the spec's Python check (what the fake kernel runs while tracing, and the run without _C).

Sizes: elements per param (1: the boundary alone; 1000: a small model's step). ``--compare TREE`` also measures the
fastops of another checkout (built in place), each tree in its own process, the processes alternating round by
round, so a before/after comes from one run on one machine load.

    python benchmarks/bench_op_overhead.py                                # benchmarks/results/op_overhead_cpu.*
    python benchmarks/bench_op_overhead.py --compare ../before --out op_overhead_cpu_vs_before
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

N_TENSORS = 300


def measure(tree: str | None, elements: list[int], rounds: int, calls: int) -> dict[str, list[float]]:
    """{"<provider> <n>": ms samples} for the fastops of ``tree`` (this checkout's when None)."""
    if tree:
        sys.path.insert(0, os.path.abspath(tree))
    import torch

    import fastops  # noqa: F401  (registers the ops)
    from fastops import _backend
    from fastops._specs import SPECS, adam

    torch.set_num_threads(1)
    C, spec = _backend._C, SPECS["adam_step_"]

    def providers(args) -> dict:
        out = {"op": lambda: torch.ops.fastops.adam_step_(*args)}
        if C is not None:
            out["cpp_entry"] = lambda: C.cpp.adam_step_(*args)
            checks = getattr(C, "checks", None) or torch.ops.fastops_checks
            out["check_cpp"] = lambda: checks.adam_step_(*args)
        out["check_python"] = lambda: spec.check(args)
        return out

    def per_call_ms(fn) -> float:
        start = time.thread_time()
        for _ in range(calls):
            fn()
        return 1e3 * (time.thread_time() - start) / calls

    samples = {}
    with _backend.use("cpu", "cpp"):
        for n in elements:
            fns = providers(adam.inputs([n] * N_TENSORS))
            for fn in fns.values():  # warm-up
                fn()
            got = common.interleaved({name: (lambda fn=fn: per_call_ms(fn)) for name, fn in fns.items()}, rounds)
            samples.update({f"{name} {n}": s for name, s in got.items()})
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, nargs="+", default=[1, 1000], help="elements per param")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="calls per sample")
    p.add_argument("--compare", metavar="TREE", help="another checkout to measure alongside (e.g. the one before)")
    p.add_argument("--alternations", type=int, default=3, help="with --compare: processes per tree, alternating")
    p.add_argument("--worker", metavar="TREE", nargs="?", const="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="op_overhead_cpu")
    a = p.parse_args()
    if a.worker is not None:
        common.reply(measure(a.worker or None, a.elements, a.rounds, a.calls))
        return
    trees = {"": None} if not a.compare else {"before ": a.compare, "": None}
    samples: dict[str, list[float]] = {}
    for _ in range(a.alternations if a.compare else 1):
        for label, tree in trees.items():
            args = ["--worker", *([tree] if tree else []), "--elements", *map(str, a.elements), "--rounds",
                    str(a.rounds // (a.alternations if a.compare else 1) or 1), "--calls", str(a.calls)]  # fmt: skip
            for key, s in common.in_fresh_process(__file__, args).items():
                samples.setdefault(label + key, []).extend(s)
    rows = []
    for key, s in samples.items():
        provider, n = key.rsplit(" ", 1)
        rows.append(common.row("op_overhead", provider, f"{N_TENSORS}x{n}", s, "cpu", size_unit="config",
                               tensors=N_TENSORS, dtype="float32"))  # fmt: skip
        print(f"{N_TENSORS} x {n:>5s}  {provider:20s} {1e3 * statistics.median(s):8.1f} us")
    meta = {"command": " ".join([sys.executable, *sys.argv]), "load": os.getloadavg(), "threads": 1,
            "compare": a.compare, "hardware": common.hardware("cpu")}  # fmt: skip
    print(common.write_results(a.out, rows, meta))


if __name__ == "__main__":
    main()
