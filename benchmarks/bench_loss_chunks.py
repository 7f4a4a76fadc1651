"""What fastops.linear_cross_entropy's chunk costs and saves with every row labeled: its time and peak extra memory at
the default (chunk_rows=0: one chunk of all rows while their logits fit 1 GiB) and at smaller row chunks (the fp32
grad_weight accumulator then held beside them), against eager's, head trainable and frozen; bf16, no bias.

Each setting runs in its own process, the settings taking turns for --rounds rounds; at 1 thread the time is the
median of the main thread's CPU time. Peak extra memory as benchmarks/bench_loss.py measures it (peak RSS of one
forward + backward less the RSS before it, in a process where glibc maps every block of 64 KiB and more), the
gradients the call returns included. Columns:
  threads, n, h, v, frozen_head    the case (every row labeled)
  setting                          eager, or fastops:<chunk_rows> (0: the op's own choice)
  ms                               forward + backward
  mem_mib                          peak extra MiB
  x_default_ms                     ms / the default's ms (fastops rows)
  mem_vs_eager                     mem_mib / eager's mem_mib
  load1                            the 1-minute load average when the point started

    python benchmarks/bench_loss_chunks.py --n 4096 --h 256 --v 32000 --chunks 0 2048 1024 512 --out loss_chunks
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_loss  # noqa: E402
import common  # noqa: E402

FIELDS = ["threads", "n", "h", "v", "frozen_head", "setting", "ms", "mem_mib", "x_default_ms", "mem_vs_eager", "load1"]


def worker(a) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    import fastops

    if a.worker == "eager":
        fn = lambda x, w, t: F.cross_entropy(F.linear(x, w), t)  # noqa: E731
    else:
        rows = int(a.worker.split(":")[1])
        fn = lambda x, w, t: fastops.linear_cross_entropy(x, w, t, chunk_rows=rows)  # noqa: E731
    out = {}
    for frozen in (False, True):
        x, w, t = bench_loss._inputs(a.n, a.h, a.v, 100, frozen)

        def step():
            x.grad = w.grad = None
            fn(x, w, t).backward()

        if a.mem:
            step()
            step()
            x.grad = w.grad = None
            out[str(int(frozen))] = round(min(bench_loss._peak_extra_mib(step) for _ in range(2)), 1)
        else:
            out[str(int(frozen))] = bench_loss._samples(step, a.threads, a.repeats, 1)
    common.reply(out)


def run_point(a, n, h, v) -> list[dict]:
    settings = ["eager", *(f"fastops:{c}" for c in a.chunks)]
    base = [sys.argv[0], "--threads", str(a.threads), "--n", str(n), "--h", str(h), "--v", str(v),
            "--repeats", str(a.repeats)]  # fmt: skip
    load1 = round(os.getloadavg()[0], 2)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        mem = {s: common.in_fresh_process(__file__, [*base[1:], "--worker", s, "--mem"]) for s in settings}
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    samples: dict = {}
    for _ in range(a.rounds):
        for s in settings:
            for k, xs in common.in_fresh_process(__file__, [*base[1:], "--worker", s]).items():
                samples.setdefault((s, k), []).extend(xs)
    stat = statistics.median if a.threads == 1 else min
    rows = []
    for k in ("0", "1"):
        default = stat(samples[("fastops:0", k)])
        for s in settings:
            ms = stat(samples[(s, k)])
            rows.append({"threads": a.threads, "n": n, "h": h, "v": v, "frozen_head": int(k), "setting": s,
                         "ms": round(ms, 2), "mem_mib": mem[s][k],
                         "x_default_ms": round(ms / default, 3) if s != "eager" else "",
                         "mem_vs_eager": round(mem[s][k] / mem["eager"][k], 3), "load1": load1})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, nargs="+", default=[4096])
    p.add_argument("--h", type=int, nargs="+", default=[256])
    p.add_argument("--v", type=int, nargs="+", default=[32000])
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 1024, 512])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="loss_chunks")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mem", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.n, a.h, a.v = a.n[0], a.h[0], a.v[0]
        worker(a)
        return
    base = common.result_base(a.out)
    rows, start, started = [], time.time(), time.strftime("%Y-%m-%d %H:%M:%S")
    for n in a.n:
        for h in a.h:
            for v in a.v:
                for r in run_point(a, n, h, v):
                    rows.append(r)
                    print(" ".join(f"{k}={r[k]}" for k in FIELDS), flush=True)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    meta = {"command": "python " + " ".join(sys.argv), "start": started,
            "wall_s": round(time.time() - start), "load_end": round(os.getloadavg()[0], 2),
            "hardware": common.hardware("cpu").rsplit(" x", 1)[0],
            "machine": f"{platform.node()} ({os.cpu_count()} cpus)",
            "columns": __doc__[__doc__.index("  threads,"):__doc__.index("\n\n    python")]}  # fmt: skip
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print("wrote", base + ".csv")


if __name__ == "__main__":
    main()
