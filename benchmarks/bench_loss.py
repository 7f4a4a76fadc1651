"""The LM-head loss alone, forward + backward, over a grid of shapes: ``F.cross_entropy(F.linear(x, W), target)``
eager, the same two lines under ``torch.compile``, under ``torch.compile`` with inductor's auto-chunker
(``torch._inductor.config.auto_chunker.enable``), and ``fastops.linear_cross_entropy``; bf16, no bias.

A point is (threads, N, H, V); each point runs four cases: 15% or all of the rows labeled (masked / causal LM),
the head trainable or frozen (weight.requires_grad False: LoRA, a frozen tied embedding). The four providers are
timed in one process, the sixteen (case, provider) calls taking turns call by call (the order rotating), in
``--rounds`` such processes (two at 1 thread, four at more); at 1 thread the time is the main thread's CPU time, at
more the wall time. One process for all, where
each had had its own: this 2-core VM has stretches of seconds to minutes in which one of its two vCPUs runs 2x
slower (a 2048 x 1024 @ 1024 x 4096 bf16 matmul pinned to one with taskset took 15-17 ms or 35-37 ms by turns, on
either), so a provider's own process could land on the slow one for its whole life, at 1 thread as at 2. Timed
that way, three points read 0.54x-0.96x the best peer with every row labeled and 1.06x-1.46x in one process (2
threads N1024 H2048 V8000, 0.54x -> 1.06x; 1 thread N4096 H1024 V8000, 0.86x -> 1.28x; 2 threads N1024 H256
V32000, 0.96x -> 1.46x). The cases take turns too: one after another, a slow stretch over the frozen-head case had
the frozen head 0.91x the trained one's speed (1 thread N4096 H1024 V8000). A "gemm" process times ATen's bf16
matmul of the three shapes the loss needs (logits N x H @ H x V, grad_x N x V @ V x H, grad_W V x N @ N x H) and
of 2048 x 1024 @ 1024 x 4096 (the machine's bf16 GEMM peak) in the same rounds. Peak extra memory: the process's peak RSS during one forward +
backward less its RSS before it, after warm-up, in a process of its own where glibc maps every block of 64 KiB
and more (MALLOC_MMAP_THRESHOLD_), so freed buffers leave the RSS (the timing processes keep glibc's default, as
training runs it); the gradients the call returns are part of every provider's figure.

One CSV row per (point, case), appended as each point finishes: a run can be stopped and resumed (points already
in the file are skipped) and any subset of the grid run (--n/--h/--v/--threads lists). Columns:
  threads, n, h, v, labeled_pct, frozen_head     the case
  ms_<provider>                                  ms of forward + backward, the least of the samples (CPU time at
                                                 1 thread, wall time at more)
  speedup_best_peer                              min(ms_compile, ms_chunker) / ms_fastops
  speedup_eager                                  ms_eager / ms_fastops
  frozen_speedup                                 (frozen rows) fastops' ms with the head trainable / frozen
  mem_<provider>_mib                             peak extra MiB (empty where not measured: --mem-threads)
  mem_vs_eager                                   mem_fastops_mib / mem_eager_mib
  mem_floor_mib                                  the gradients the call returns (2VH unless frozen, + 2NH bytes)
  gemm_<shape>_gflops, peak_gflops               ATen's rate of each shape, and of the peak matmul
  floor_ms                                       the case's matmuls over all N rows (3, or 2 with a frozen head,
                                                 of 2NHV) at the best of the three shapes' rates: eager's floor
  fastops_floor_ms                               the same for the rows fastops computes (the labeled ones)
  fastops_pct_peak                               100 * fastops' matmul FLOPs / ms / peak_gflops
  load1                                          the 1-minute load average when the point started

    python benchmarks/bench_loss.py --n 1024 --h 256 --v 32000 --threads 1 --out loss_dev   # one point
    python benchmarks/bench_loss.py --out loss_grid --lock /tmp/fastops-bench.lock          # the whole grid
    python benchmarks/bench_loss.py --out loss_grid --report    # per-target summary (.md) and the plot (.png)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import gc
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GRID = {"n": (1024, 4096), "h": (256, 1024, 2048), "v": (8000, 32000, 128256, 151936), "threads": (1, 2)}
PROVIDERS = ("eager", "compile", "chunker", "fastops")
PEERS = ("compile", "chunker")
CASES = [(labeled, frozen) for labeled in (15, 100) for frozen in (False, True)]
SHAPES = ("logits", "grad_x", "grad_w")
FIELDS = ["threads", "n", "h", "v", "labeled_pct", "frozen_head", *(f"ms_{p}" for p in PROVIDERS),
          "speedup_best_peer", "speedup_eager", "frozen_speedup", *(f"mem_{p}_mib" for p in PROVIDERS), "mem_vs_eager",
          "mem_floor_mib", *(f"gemm_{s}_gflops" for s in SHAPES), "peak_gflops", "floor_ms", "fastops_floor_ms",
          "fastops_pct_peak", "load1"]  # fmt: skip
SECONDS_PER_CASE = 12.0  # timed seconds a provider spends on one case per round (at least one call)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_extra_mib(fn) -> float:
    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def _clock(threads: int):
    return time.thread_time if threads == 1 else time.perf_counter


def _samples(fn, threads: int, repeats: int, warmup: int) -> list[float]:
    clock, out = _clock(threads), []
    for i in range(warmup + repeats):
        start = clock()
        fn()
        if i >= warmup:
            out.append(1e3 * (clock() - start))
    return out


def _inputs(n, h, v, labeled_pct, frozen):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.5).bfloat16().requires_grad_(not frozen)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) >= labeled_pct / 100] = -100
    return x, w, t


def worker(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    out = {}
    if a.worker == "gemm":
        x, w, _ = _inputs(a.n, a.h, a.v, 100, True)
        x, dl = x.detach(), torch.randn(a.n, a.v).bfloat16()
        p, q = torch.randn(2048, 1024).bfloat16(), torch.randn(1024, 4096).bfloat16()
        calls = {"logits": lambda: x @ w.t(), "grad_x": lambda: dl @ w, "grad_w": lambda: dl.t() @ x,
                 "peak": lambda: p @ q}
        for name, fn in calls.items():
            out[name] = _samples(fn, a.threads, a.repeats if name != "peak" else 5, 1)
        common.reply(out)
        return
    if a.worker == "together":
        common.reply(_together(a))
        return
    # A provider of its own: its peak memory.
    if a.worker == "chunker":
        torch._inductor.config.auto_chunker.enable = True
    fn = _providers()[a.worker]
    for labeled, frozen in CASES:
        x, w, t = _inputs(a.n, a.h, a.v, labeled, frozen)

        def step():
            x.grad = w.grad = None
            fn(x, w, t).backward()

        big = 6 * a.n * a.h * a.v > 2e12  # seconds a call: one measured call after one warm-up
        step()
        if a.worker in PEERS or not big:
            step()
        def measured():
            # The last call's gradients freed first: held while the next call runs, the new ones would take their
            # place and the call's own gradients (the floor) would not count.
            x.grad = w.grad = None
            return _peak_extra_mib(step)

        out[f"{labeled}:{int(frozen)}"] = round(min(measured() for _ in range(1 if big else 2)), 1)
    common.reply(out)


def _providers() -> dict:
    """Each provider's loss(x, W, target). The chunker is torch.compile of the same two lines, compiled under the
    auto-chunker's config."""
    import torch
    import torch.nn.functional as F

    import fastops

    def loss_fn(x, w, t):
        return F.cross_entropy(F.linear(x, w), t)

    def chunked(x, w, t):  # its own code object: dynamo caches compiled code per code object, not per wrapper
        return F.cross_entropy(F.linear(x, w), t)

    return {"eager": loss_fn, "compile": torch.compile(loss_fn), "chunker": torch.compile(chunked),
            "fastops": lambda x, w, t: fastops.linear_cross_entropy(x, w, t)}


def _together(a) -> dict:
    """Every provider and case in this one process, taking turns call by call (the order rotating), so a slow
    stretch of a vCPU lands on all of them alike, the frozen-head cases included: {case: {provider: samples}}.
    Memory is measured in a process per provider (``worker``)."""
    import torch

    fns = _providers()
    # One x and W for every case (_inputs draws the same values whatever the case): a frozen case turns W's
    # requires_grad off for its call, and the compiled providers keep a graph for each setting.
    targets = {}
    for labeled in sorted({lab for lab, _ in CASES}):
        x, w, targets[labeled] = _inputs(a.n, a.h, a.v, labeled, False)
    steps = {}
    for labeled, frozen in CASES:
        for p, fn in fns.items():
            def step(fn=fn, t=targets[labeled], frozen=frozen):
                w.requires_grad_(not frozen)
                x.grad = w.grad = None
                fn(x, w, t).backward()

            steps[(f"{labeled}:{int(frozen)}", p)] = step
            # The chunker's graphs are compiled in these warm-up calls, the only ones under its config.
            with torch._inductor.config.patch({"auto_chunker.enable": p == "chunker"}):
                for _ in range(2 if p in PEERS else 1):
                    step()
    order, out = list(steps), {}
    for i in range(a.repeats):
        k = i * 5 % len(order)  # 5 is prime to the 16 calls: each starts a repetition in turn
        for key, p in order[k:] + order[:k]:
            out.setdefault(key, {}).setdefault(p, []).extend(_samples(steps[(key, p)], a.threads, 1, 0))
    return out


def _point_args(threads, n, h, v, repeats) -> list[str]:
    return ["--threads", str(threads), "--n", str(n), "--h", str(h), "--v", str(v), "--repeats", str(repeats)]


def run_point(threads, n, h, v, rounds, mem) -> list[dict]:
    flop = 6 * n * h * v
    repeats = max(1 if threads == 1 else 2, min(4, int(SECONDS_PER_CASE / (flop / 300e9))))  # ~300 GFLOP/s
    load1 = round(os.getloadavg()[0], 2)
    base = _point_args(threads, n, h, v, repeats)
    mib: dict[str, dict] = {}
    if mem:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        try:
            for p in PROVIDERS:
                mib[p] = common.in_fresh_process(__file__, [*base, "--worker", p])
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
    samples: dict = {}
    for _ in range(rounds):
        for p in ("gemm", "together"):
            res = common.in_fresh_process(__file__, [*base, "--worker", p])
            for key, s in res.items():
                for provider, got in (s.items() if p == "together" else [(p, s)]):
                    samples.setdefault((provider, key), []).extend(got)
    # The least of the samples: a slow stretch of a vCPU or another job only ever adds. The median (once taken at 1
    # thread) mixed the two processes' stretches: fast in one, slow in the other, half the samples each, it fell
    # between them as it pleased (1 thread N1024 H2048 V8000, trained head: fastops 278 ms and the chunker 285
    # against torch.compile's 184, where one process apiece had timed 163, 156 and 161).
    least = {k: min(s) for k, s in samples.items()}
    rate = {s: 2 * n * h * v / (least[("gemm", s)] * 1e6) for s in SHAPES}
    peak = 2 * 2048 * 1024 * 4096 / (least[("gemm", "peak")] * 1e6)
    best = max(rate.values())
    rows = []
    for labeled, frozen in CASES:
        key = f"{labeled}:{int(frozen)}"
        ms = {p: least[(p, key)] for p in PROVIDERS}
        mats = 2 if frozen else 3
        rows_computed = n if labeled == 100 else round(n * labeled / 100)  # fastops drops the ignored rows
        row = {"threads": threads, "n": n, "h": h, "v": v, "labeled_pct": labeled, "frozen_head": int(frozen),
               **{f"ms_{p}": round(ms[p], 2) for p in PROVIDERS},
               "speedup_best_peer": round(min(ms[p] for p in PEERS) / ms["fastops"], 3),
               "speedup_eager": round(ms["eager"] / ms["fastops"], 3),
               "frozen_speedup": round(least[("fastops", f"{labeled}:0")] / ms["fastops"], 3) if frozen else "",
               **{f"mem_{p}_mib": mib[p][key] if mem else "" for p in PROVIDERS},
               "mem_vs_eager": round(mib["fastops"][key] / mib["eager"][key], 3) if mem else "",
               "mem_floor_mib": round(((0 if frozen else 2 * v * h) + 2 * n * h) / 2**20, 1),
               **{f"gemm_{s}_gflops": round(rate[s], 1) for s in SHAPES}, "peak_gflops": round(peak, 1),
               "floor_ms": round(mats * 2 * n * h * v / (best * 1e6), 2),
               "fastops_floor_ms": round(mats * 2 * rows_computed * h * v / (best * 1e6), 2),
               "fastops_pct_peak": round(100 * mats * 2 * rows_computed * h * v / (ms["fastops"] * 1e6) / peak, 1),
               "load1": load1}  # fmt: skip
        rows.append(row)
    return rows


def _done(path: str) -> set[tuple]:
    if not os.path.exists(path):
        return set()
    with open(path, newline="") as f:
        return {tuple(int(r[k]) for k in ("threads", "n", "h", "v")) for r in csv.DictReader(f)}


@contextlib.contextmanager
def _locked(path):
    """The benchmark lock for one point (its providers' rounds run back to back), or nothing: a grid of hours
    takes the lock point by point, so other benchmarks on the machine can run between points."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(a) -> None:
    base = common.result_base(a.out)
    path = base + ".csv"
    done = _done(path)
    points = sorted(((t, n, h, v) for t in a.threads for n in a.n for h in a.h for v in a.v),
                    key=lambda p: (p[1] * p[2] * p[3], p[0]))  # cheapest first: a cut-short run covers the most
    todo = [p for p in points if p not in done]
    print(f"{len(points) - len(todo)} of {len(points)} points already in {path}; {len(todo)} to run", flush=True)
    meta_path = base + ".json"
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {"runs": []}
    meta["hardware"] = common.hardware("cpu").rsplit(" x", 1)[0]
    meta["machine"] = f"{platform.node()} ({os.cpu_count()} cpus)"
    meta["columns"] = __doc__[__doc__.index("  threads,"):__doc__.index("\n\n    python")]
    run = {"command": " ".join(sys.argv), "start": time.strftime("%Y-%m-%d %H:%M:%S"), "points": len(todo)}
    meta["runs"].append(run)
    start = time.time()
    for threads, n, h, v in todo:
        with _locked(a.lock):
            t0 = time.time()
            rounds = a.rounds or (2 if threads == 1 else 4)
            rows = run_point(threads, n, h, v, rounds, threads in a.mem_threads)
            took = time.time() - t0
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerows(rows)
        for r in rows:
            print(f"t{threads} N{n} H{h} V{v} lab{r['labeled_pct']} frozen{r['frozen_head']}: "
                  + " ".join(f"{p} {r[f'ms_{p}']:.0f}" for p in PROVIDERS)
                  + f" | x{r['speedup_best_peer']} best peer, x{r['speedup_eager']} eager, mem {r['mem_vs_eager']}",
                  flush=True)
        print(f"  point took {took:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
        run["wall_s"] = round(time.time() - start)
        run["load_end"] = round(os.getloadavg()[0], 2)
        json.dump(meta, open(meta_path, "w"), indent=1)
    report(a)


def _plans(r: dict, mem_eager_mib: float | None) -> tuple[float, bool]:
    """What physics leaves the op at an all-labeled point, with the matmuls at the best rate the point measured and
    the row passes free. First, the ms of vocabulary blocks, which compute the logits twice (once for each row's
    log-sum-exp, once more for the gradients) except for those that fit in 15% of eager's extra memory beside the
    gradients returned and the fp32 N x H grad_x. Second, whether a plan that computes each logit once fits in that
    15%: a trained head's grad_weight needs every row's log-sum-exp before it can be summed exactly, so either all
    N x V logits are held (2 B each) or rows go in chunks whose partial grad_weights add up in an fp32 V x H
    accumulator (4 B each, the sum fp32 as torch's matmul's; bf16 sums of the partials moved a BERT's grad norms 9%,
    linear_ce.cpp). A frozen head's chunks of rows need no accumulator, and unknown memory fits."""
    n, h, v = r["n"], r["h"], r["v"]
    rate = max(r["peak_gflops"], *(r[f"gemm_{s}_gflops"] for s in SHAPES))
    matmul_ms = 2 * n * h * v / (rate * 1e6)
    if r["frozen_head"] or mem_eager_mib is None:
        return 4 * matmul_ms, True
    budget_mib = 0.15 * mem_eager_mib - r["mem_floor_mib"] - 4 * n * h / 2**20
    kept = min(max(budget_mib * 2**20 / (2 * n * v), 0.0), 1.0)
    least_mib = r["mem_floor_mib"] + min(4 * v * h, 2 * n * v) / 2**20
    return (4 - kept) * matmul_ms, least_mib <= 0.15 * mem_eager_mib


def report(a) -> None:
    """Per target: the points met, not met, and ruled out by the measured floors; then the plot."""
    base = common.result_base(a.out)
    with open(base + ".csv", newline="") as f:
        rows = [{k: (float(x) if x not in ("",) else None) for k, x in r.items()} for r in csv.DictReader(f)]
    tally: dict[str, dict[str, list]] = {}

    def verdict(target, name, ok, ruled_out=False):
        tally.setdefault(target, {"met": [], "not met": [], "ruled out": []})
        tally[target]["met" if ok else "ruled out" if ruled_out else "not met"].append(name)

    # Eager's peak memory by shape (measured at one thread count: it does not depend on them).
    mem_eager = {(r["n"], r["h"], r["v"], r["labeled_pct"], r["frozen_head"]): r["mem_eager_mib"]
                 for r in rows if r["mem_eager_mib"] is not None}
    for r in rows:
        name = (f"t{r['threads']:.0f} N{r['n']:.0f} H{r['h']:.0f} V{r['v']:.0f} lab{r['labeled_pct']:.0f}"
                f"{' frozen' if r['frozen_head'] else ''}")
        if r["labeled_pct"] == 100:
            blocks_ms, fits = _plans(r, mem_eager.get((r["n"], r["h"], r["v"], 100, r["frozen_head"])))
            # Out of reach where the plans that keep to 15% of eager's memory (vocabulary blocks) take longer than
            # the peer at the best measured matmul rate, and those with three matmuls do not fit.
            verdict("all labeled >= 1.0x best peer", name, r["speedup_best_peer"] >= 1.0,
                    not fits and blocks_ms > min(r["ms_compile"], r["ms_chunker"]))
            # Eager within 1.2x of its matmuls' floor: 1.2x eager would need less than the floor.
            verdict("all labeled >= 1.2x eager", name, r["speedup_eager"] >= 1.2,
                    r["ms_eager"] < 1.2 * r["floor_ms"] or (not fits and blocks_ms > r["ms_eager"] / 1.2))
        else:
            verdict("15% labeled >= 1.5x best peer", name, r["speedup_best_peer"] >= 1.5)
        if r["frozen_head"]:
            verdict("frozen head >= 1.3x trainable", name, r["frozen_speedup"] >= 1.3)
        if r["mem_vs_eager"] is not None:
            verdict("extra memory <= 15% of eager's", name, r["mem_vs_eager"] <= 0.15,
                    r["mem_floor_mib"] > 0.15 * r["mem_eager_mib"])
    lines = [f"# {os.path.basename(base)}: fastops.linear_cross_entropy against its peers, per target", ""]
    with open(base + ".json") as f:  # tests/claims.py reads a summary's machine and command from these two lines
        meta = json.load(f)
    lines += [f"Machine: {meta.get('hardware')} ({meta.get('machine')})",
              f"Command: python benchmarks/bench_loss.py ... --out {os.path.basename(base)} (each point's in the JSON), "
              "then --report", ""]
    for target, t in tally.items():
        lines.append(f"- {target}: met {len(t['met'])}, not met {len(t['not met'])}, ruled out {len(t['ruled out'])}")
        lines += [f"  - {k}: {', '.join(t[k])}" for k in ("not met", "ruled out") if t[k]]
    lines += ["", "Per point (ms: see the CSV; mem: MiB; floor: the gradients the call returns; fastops' design: "
              "its logits, 2 B each, the weight's copy where rows >= 4 H and the head is trained, the fp32 accumulator "
              "where chunked; in vocabulary blocks, N x cols logits and an fp32 N x H grad_x).", "",
              "| threads | N | H | V | labeled | head | x best peer | x eager | x frozen | eager / floor | "
              "fastops % peak | mem fastops | mem eager | mem fastops / eager | mem floor | fastops design |",
              "|" + "---|" * 16]
    from fastops._lce import held

    for r in rows:
        m = r["n"] if r["labeled_pct"] == 100 else round(r["n"] * r["labeled_pct"] / 100)
        n, h, v, trained = int(r["n"]), int(r["h"]), int(r["v"]), not r["frozen_head"]
        design = held(int(m), h, v, 2, trained) + (2 * v * h if trained else 0)  # + the grad_weight returned
        cells = [f"{r['threads']:.0f}", f"{r['n']:.0f}", f"{r['h']:.0f}", f"{r['v']:.0f}", f"{r['labeled_pct']:.0f}%",
                 "frozen" if r["frozen_head"] else "trained", f"{r['speedup_best_peer']:.2f}", f"{r['speedup_eager']:.2f}",
                 f"{r['frozen_speedup']:.2f}" if r["frozen_speedup"] else "", f"{r['ms_eager'] / r['floor_ms']:.2f}",
                 f"{r['fastops_pct_peak']:.0f}", *(f"{r[k]:.0f}" if r[k] is not None else "" for k in
                 ("mem_fastops_mib", "mem_eager_mib")), f"{r['mem_vs_eager']:.3f}" if r["mem_vs_eager"] else "",
                 f"{r['mem_floor_mib']:.0f}", f"{(design + 2 * n * h) / 2**20:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[: lines.index("") + 1 + 2 * len(tally)]))
    print("wrote", base + ".md")
    plot(base, rows)


def plot(base: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 9), sharey=False)
    for ax, (labeled, frozen) in zip(axes.flat, CASES):
        sel = [r for r in rows if r["labeled_pct"] == labeled and bool(r["frozen_head"]) == frozen]
        shapes = sorted({(r["n"], r["h"], r["v"]) for r in sel}, key=lambda s: s[0] * s[1] * s[2])
        for threads, marker in ((1, "o"), (2, "s")):
            ys = {(r["n"], r["h"], r["v"]): r["speedup_best_peer"] for r in sel if r["threads"] == threads}
            xs = [i for i, s in enumerate(shapes) if s in ys]
            ax.plot(xs, [ys[shapes[i]] for i in xs], marker, label=f"{threads} thread(s)")
        ax.axhline(1.5 if labeled == 15 else 1.0, color="red", lw=0.8, ls="--", label="target")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"N{n:.0f} H{h:.0f}\nV{v:.0f}" for n, h, v in shapes], fontsize=6, rotation=90)
        ax.set_title(f"{labeled}% labeled, head {'frozen' if frozen else 'trainable'}")
        ax.set_ylabel("fastops speed-up over the best compiled peer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"fastops.linear_cross_entropy vs min(torch.compile, + auto-chunker), bf16: {os.path.basename(base)}")
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=110)
    print("wrote", base + ".png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=list(GRID["threads"]))
    p.add_argument("--n", type=int, nargs="+", default=list(GRID["n"]))
    p.add_argument("--h", type=int, nargs="+", default=list(GRID["h"]))
    p.add_argument("--v", type=int, nargs="+", default=list(GRID["v"]))
    p.add_argument("--rounds", type=int,
                   help="timing processes a point, each timing every provider (default 2 at 1 thread, 4 at more)")
    p.add_argument("--mem-threads", type=int, nargs="*", default=[1],
                   help="thread counts whose points also measure peak memory (it does not depend on them)")
    p.add_argument("--out", default="loss_grid")
    p.add_argument("--lock", default="", help="a lock file taken around each point (e.g. /tmp/fastops-bench.lock)")
    p.add_argument("--report", action="store_true", help="only summarise and plot the CSV")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.threads, a.n, a.h, a.v = a.threads[0], a.n[0], a.h[0], a.v[0]
        worker(a)
    elif a.report:
        report(a)
    else:
        measure(a)


if __name__ == "__main__":
    main()
