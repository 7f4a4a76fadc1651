"""The fused loss's exact fp32 sums of partial products on the CPU: c (fp32) += a @ b with a and b bf16, each way the
C++ backend can take (csrc/cpu/linear_ce.cpp's ce_accumulate: "mkl", "avx512bf16", "onednn", where this machine
and torch have it), against ATen's own bf16 matmul (whose output rounds to bf16: the rate of a bf16 GEMM here, not a
way to sum exactly). Two shapes, as the op calls them: grad_x over one vocabulary block (1024 x 4096 @ 4096 x 256)
and one chunk of rows' grad_weight (the transposed 512 x 32000 logits' gradient @ 512 x 256). Each thread count in
a process of its own; in it the ways take turns round by round; GFLOP/s of the median.

    python benchmarks/bench_accumulate.py --out accumulate_zen5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fastops import _backend  # noqa: E402

SHAPES = {"grad_x 1024x4096@4096x256": (1024, 256, 4096, False),
          "grad_w (512x32000)^T@512x256": (32000, 256, 512, True)}  # fmt: skip
WAYS = ("mkl", "avx512bf16", "onednn")


def _worker(threads: int, rounds: int) -> None:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    measure, flops = {}, {}
    for label, (m, n, k, transposed) in SHAPES.items():
        a = torch.randn(k, m, generator=g).bfloat16().t() if transposed else torch.randn(m, k, generator=g).bfloat16()
        b = torch.randn(k, n, generator=g).bfloat16()
        acc = torch.zeros(m, n)
        for way in WAYS:
            try:
                _backend._C.cpp.linear_ce_accumulate_with(way, acc, a, b, True)
            except RuntimeError:
                continue  # not on this machine or torch
            measure[(way, label)] = (lambda w=way, a=a, b=b, acc=acc:
                                     common.time_samples(lambda: _backend._C.cpp.linear_ce_accumulate_with(
                                         w, acc, a, b, False), "cpu", repeats=1, warmup=1))  # fmt: skip
        out = torch.empty(m, n, dtype=torch.bfloat16)
        measure[("aten_bf16", label)] = (lambda a=a, b=b, out=out: common.time_samples(
            lambda: torch.mm(a, b, out=out), "cpu", repeats=1, warmup=1))
        flops[label] = 2 * m * n * k
    samples = common.interleaved(measure, rounds)
    common.reply({"rows": [[way, label, s, flops[label]] for (way, label), s in samples.items()]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="accumulate")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return _worker(args.worker, args.rounds)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)  # so that the rows' hardware names the worker's thread count
        got = common.in_fresh_process(__file__, ["--worker", str(threads), "--rounds", str(args.rounds)])
        for way, label, samples, flop in got["rows"]:
            r = common.row("accumulate", way, label, samples, "cpu", size_unit="config")
            r["gflops"] = round(flop / r["ms"] / 1e6)
            rows.append(r)
            print(f"{threads} thread(s)  {label:30s} {way:11s} {r['ms']:8.2f} ms  {r['gflops']:5d} GFLOP/s")
    base = common.write_results(args.out, rows, {"command": " ".join(sys.argv), "threads": args.threads})
    print(f"wrote {base}.json/.csv")


if __name__ == "__main__":
    main()
