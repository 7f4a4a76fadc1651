"""Benchmark of fastops.data.Prefetcher, and the measurement behind "no C++ part".

CPU: a loader that takes X ms per batch and a step that takes Y ms, both releasing the GIL (time.sleep, or
torch ops on one intra-op thread each), run as a plain loop, through DataLoader(num_workers=1|2) and
through Prefetcher. Overlap makes a step cost max(X, Y) instead of X + Y, so at X = Y the Prefetcher must
be >= 1.8x faster than the plain loop (checked; exit status 1 if not).
The "op" rows (torch matmuls on both sides) need two free cores to overlap; on a shared 2-core machine
they ranged from 0.86x to 1.6x and are not checked.

GIL: whether torch's host copy (the pageable -> pinned fill of a staging buffer) releases the GIL, measured
as a pure-Python thread's progress while another thread copies, and as two copying threads against one.

CUDA (when available): large pageable batches copied while a matmul step runs: plain
.to(device, non_blocking=True) in the loop (a synchronous copy from pageable memory), a timm-style prefetcher
and fastops, against the step alone. The timm-style baseline gets what timm gets from
DataLoader(num_workers>0, pin_memory=True): batches pinned off the consumer thread (DataLoader's pin-memory
thread, two batches ahead), then copied on a side stream one batch ahead with wait_stream (timm's
PrefetchLoader). fastops pins and copies in its own worker thread.

Results: benchmarks/results/prefetch_{cpu,cuda}.{json,csv,png}. Medians over repeats, quantiles 20/80.

    python benchmarks/bench_prefetch.py            # about 1.5 min on a 2-core CPU
    python benchmarks/bench_prefetch.py --quick    # < 30 s smoke run
    python benchmarks/bench_prefetch.py --quick --cuda-only --out /tmp/x/prefetch   # the GPU part alone
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fastops.data import Prefetcher  # noqa: E402


# ---- CPU: loader X ms, step Y ms ----


class Work:
    """X ms of GIL-free work: time.sleep, or repeated 512x512 matmuls calibrated to take that long (a few ms
    each: fewer GIL hand-offs between the two threads than many small ops)."""

    def __init__(self, kind: str, ms: float):
        self.kind, self.s = kind, ms / 1000
        if kind == "op":
            self.a = torch.randn(512, 512)
            self.reps = max(1, round(ms / common.device_ms(lambda: self.a @ self.a, "cpu", 20)))

    def __call__(self) -> None:
        if self.kind == "sleep":
            time.sleep(self.s)
        else:
            for _ in range(self.reps):
                self.a @ self.a


class SlowDataset(Dataset):
    def __init__(self, n: int, load: Work):
        self.n, self.load = n, load

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.load()
        return torch.full((64,), float(i))


def slow_loader(n: int, load: Work):
    for i in range(n):
        load()
        yield torch.full((64,), float(i))


def per_batch_ms(make, n: int, step, device: str) -> float:
    """ms per batch over one pass of ``make()``'s n batches, from the first batch's arrival to the last one's:
    steady state, without the DataLoader's worker start-up (about 0.1 s here, which would dominate short runs).
    The iterator and its first step are common.time_samples' reset, outside the timed region."""
    box = {}

    def reset() -> None:
        box["it"] = iter(make())
        step(next(box["it"]))

    def rest() -> None:
        box["count"] = 0
        for x in box["it"]:
            step(x)
            box["count"] += 1

    ms = common.time_samples(rest, device, repeats=1, warmup=0, reset=reset)[0]
    assert box["count"] == n - 1
    return ms / box["count"]


def bench_cpu(configs, n: int, repeats: int) -> list[dict]:
    rows = []
    for kind, x_ms, y_ms in configs:
        torch.set_num_threads(1)  # two single-threaded torch ops can then run side by side on 2 cores
        load, step = Work(kind, x_ms), Work(kind, y_ms)
        ds = SlowDataset(n, load)
        providers = {
            "plain": lambda: slow_loader(n, load),
            "dataloader_w1": lambda: DataLoader(ds, batch_size=None, num_workers=1),
            "dataloader_w2": lambda: DataLoader(ds, batch_size=None, num_workers=2),
            "fastops": lambda: Prefetcher(slow_loader(n, load), device="cpu"),
        }
        measure = {name: (lambda make=make: per_batch_ms(make, n, lambda _batch: step(), "cpu"))
                   for name, make in providers.items()}  # fmt: skip
        times = common.interleaved(measure, repeats)
        torch.set_num_threads(os.cpu_count() or 1)
        size = f"{kind} load={x_ms:g}ms step={y_ms:g}ms"
        size_rows = [common.row("prefetch", name, size, ts, "cpu", size_unit="config", x_ms=x_ms, y_ms=y_ms, kind=kind)
                     for name, ts in times.items()]  # fmt: skip
        common.speedup_vs(size_rows, "plain")
        for r in size_rows:
            print(f"  {size:32s} {r['provider']:14s} {r['ms']:7.2f} ms/batch  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
                  f"{r['speedup_vs_plain']:.2f}x plain")  # fmt: skip
        rows += size_rows
    return rows


# ---- GIL: does torch's host copy release it? ----


def measure_gil(mib: int, seconds: float) -> dict:
    torch.set_num_threads(1)  # one core per copy, so "two threads" can mean two cores
    numel = mib * 2**20 // 4
    pin = torch.cuda.is_available()  # pinned memory needs CUDA; the CPU copy kernel is the same either way
    srcs = [torch.randn(numel) for _ in range(2)]
    dsts = [torch.empty(numel, pin_memory=pin) for _ in range(2)]

    def copies(i: int, until: float) -> int:
        k = 0
        while time.perf_counter() < until:
            dsts[i].copy_(srcs[i])
            k += 1
        return k

    def spin(until: float, out: list) -> None:
        k = 0
        while time.perf_counter() < until:
            k += 1
        out.append(k)

    def spin_until(done: threading.Event) -> None:
        while not done.is_set():
            pass

    def spinner_rate(during_copy: bool) -> tuple[float, float]:
        out: list[int] = []
        until = time.perf_counter() + seconds
        t = threading.Thread(target=spin, args=(until, out))
        t.start()
        n_copies = copies(0, until) if during_copy else (time.sleep(seconds) or 0)
        t.join()
        return out[0] / seconds, n_copies / seconds

    copies(0, time.perf_counter() + 0.2)  # warm-up: page in the buffers
    spin_alone, _ = spinner_rate(False)
    spin_copy, copy_with_spinner = spinner_rate(True)
    copy_alone = copies(0, time.perf_counter() + seconds) / seconds

    # Two threads copying at once against one: 2x the throughput if the copies run in parallel.
    counts: list[int] = [0, 0]
    until = time.perf_counter() + seconds

    def run(i: int) -> None:
        counts[i] = copies(i, until)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    two_threads = sum(counts) / seconds

    # Each torch call from the worker gives up the GIL and must get it back; while the consumer runs Python
    # that wait is up to sys.getswitchinterval() (5 ms) per call. A batch of 16 tensors as 16 copy_ calls
    # against one _foreach_copy_ (what Prefetcher does), with a thread spinning in Python.
    parts_src = list(srcs[0].chunk(16))
    parts_dst = list(dsts[0].chunk(16))
    batch_ms = {}
    for name, fn in (("per_tensor_copy", lambda: [d.copy_(s) for d, s in zip(parts_dst, parts_src)]),
                     ("foreach_copy", lambda: torch._foreach_copy_(parts_dst, parts_src))):
        for spinning in (False, True):
            done = threading.Event()
            spinner = threading.Thread(target=spin_until, args=(done,))
            if spinning:
                spinner.start()
            ms = common.time_ms(fn, "cpu", repeats=9, warmup=0)["ms"]
            done.set()
            if spinning:
                spinner.join()
            batch_ms[name + ("_spinning" if spinning else "")] = ms
    torch.set_num_threads(os.cpu_count() or 1)

    gbs = mib / 1024
    res = dict(
        copy_mib=mib,
        pinned=pin,
        copy_gbps_one_thread=copy_alone * gbs,
        copy_gbps_two_threads=two_threads * gbs,
        two_thread_speedup=two_threads / copy_alone,
        spinner_progress_during_copy=spin_copy / spin_alone,
        copy_gbps_with_spinner=copy_with_spinner * gbs,
        batch_of_16_ms=batch_ms,
    )
    print(
        f"  copy_ of {mib} MiB ({'pinned' if pin else 'pageable'} dst): "
        f"one thread {res['copy_gbps_one_thread']:.2f} GB/s, "
        f"two threads {res['copy_gbps_two_threads']:.2f} GB/s ({res['two_thread_speedup']:.2f}x)\n"
        f"  a Python thread spinning during copies keeps {100 * res['spinner_progress_during_copy']:.0f}% of its "
        f"speed (0% if copy_ held the GIL); the copies then run at {res['copy_gbps_with_spinner']:.2f} GB/s\n"
        f"  the same {mib} MiB as 16 tensors: 16 copy_ calls {batch_ms['per_tensor_copy']:.1f} ms, "
        f"{batch_ms['per_tensor_copy_spinning']:.1f} ms with the spinner; one _foreach_copy_ "
        f"{batch_ms['foreach_copy']:.1f} ms, {batch_ms['foreach_copy_spinning']:.1f} ms with the spinner"
    )
    return res


# ---- CUDA: copies under a matmul step ----


def bench_cuda(sizes_mib, n: int, repeats: int) -> list[dict]:
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    sink = torch.zeros((), device=dev)

    def step(x: torch.Tensor) -> None:
        for _ in range(reps):
            torch.mm(a, a, out=b)
        sink.add_(x[:1024].float().sum())  # the step reads its batch

    b = torch.empty_like(a)
    reps = 1
    one = common.device_ms(lambda: torch.mm(a, a, out=b), "cuda", 20) / 1e3  # s per matmul

    def pinned_in_thread(batches, depth: int = 2):
        """What DataLoader(num_workers>0, pin_memory=True) hands timm: each batch pinned by a thread of the
        consumer's process (DataLoader's pin-memory thread), up to ``depth`` batches ahead (prefetch_factor)."""
        q: queue.Queue = queue.Queue(maxsize=depth)
        end = object()

        def pin() -> None:
            for x in batches:
                q.put(x.pin_memory())
            q.put(end)

        worker = threading.Thread(target=pin, daemon=True)
        worker.start()
        while (x := q.get()) is not end:
            yield x
        worker.join()

    def timm_style(batches):
        # timm's PrefetchLoader: copy the next batch on a side stream, wait_stream, no record_stream.
        stream = torch.cuda.Stream()
        cur = None
        for x in pinned_in_thread(batches):
            with torch.cuda.stream(stream):
                nxt = x.to(dev, non_blocking=True)
            if cur is not None:
                yield cur
            torch.cuda.current_stream().wait_stream(stream)
            cur = nxt
        yield cur

    def run(make) -> float:
        return per_batch_ms(make, n, lambda x: step(x if x.is_cuda else x.to(dev, non_blocking=True)), "cuda")

    class Take:
        """The first n batches of a cycle over `batches`; iterable again and again, like a DataLoader."""

        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            return itertools.islice(itertools.cycle(self.batches), n)

    rows = []
    for mib in sizes_mib:
        host = [torch.randn(mib * 2**20 // 4) for _ in range(4)]
        # Step calibrated to about the time of a pinned copy of the batch (~25 GB/s), where overlap matters.
        reps = max(1, round((mib / 1024 / 25) / one))
        # One Prefetcher reused across passes, as across epochs: its pinned pool is allocated once.
        prefetcher = Prefetcher(Take(host), device=dev)
        providers = {
            "compute_only": lambda: Take([h.to(dev) for h in host]),
            "plain": lambda: Take(host),
            "timm_style": lambda: timm_style(Take(host)),
            "fastops": lambda: prefetcher,
        }
        for name, make in providers.items():
            run(make)  # warm-up: pinned allocations (fastops' pool, timm's host cache), cuBLAS
        times = common.interleaved({name: (lambda make=make: run(make)) for name, make in providers.items()}, repeats)
        size_rows = [common.row("prefetch_h2d", name, mib, ts, "cuda", size_unit="MiB per batch")
                     for name, ts in times.items()]  # fmt: skip
        common.speedup_vs(size_rows, "plain")
        compute = next(r["ms"] for r in size_rows if r["provider"] == "compute_only")
        for r in size_rows:
            print(f"  {mib:5d} MiB {r['provider']:14s} {r['ms']:8.2f} ms/step  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
                  f"{r['ms'] / compute:.2f}x compute, {r['speedup_vs_plain']:.2f}x plain")  # fmt: skip
        rows += size_rows
        prefetcher.close()
        del host, prefetcher
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run, < 30 s")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA part even when CUDA is available")
    ap.add_argument("--cuda-only", action="store_true", help="skip the CPU and GIL parts (for gpu_check.sh)")
    ap.add_argument("--cuda-sizes", type=int, nargs="*", default=None, help="MiB per batch (default 64 256, quick 64)")
    ap.add_argument("--out", default="prefetch", help="result name prefix under benchmarks/results, or a path prefix; "
                    "_cpu/_cuda are appended (default prefetch)")
    args = ap.parse_args()

    if args.quick:
        configs, n, repeats = [("sleep", 10, 10)], 20, 3
        gil_s, cuda_sizes, cuda_n = 0.5, [64], 10
    else:
        configs = [("sleep", 5, 5), ("sleep", 20, 20), ("sleep", 10, 20), ("sleep", 20, 10), ("op", 10, 10)]
        n, repeats = 40, 5
        gil_s, cuda_sizes, cuda_n = 1.0, [64, 256], 30
    cuda_sizes = args.cuda_sizes or cuda_sizes
    hardware = common.hardware("cpu")
    t0 = time.perf_counter()
    command = "python benchmarks/bench_prefetch.py " + " ".join(sys.argv[1:])
    ok = True
    if args.cuda_only and not torch.cuda.is_available():
        print("--cuda-only: CUDA is not available")
        return 1
    if not args.cuda_only:
        print(f"CPU ({hardware}), torch {torch.__version__}, {n} batches x {repeats} repeats")
        rows = bench_cpu(configs, n, repeats)
        print("GIL")
        gil = measure_gil(64, gil_s)

        checks = {r["size"]: dict(speedup_vs_plain=r["speedup_vs_plain"], required=1.8)
                  for r in rows if r["provider"] == "fastops" and r["x_ms"] == r["y_ms"]}  # fmt: skip
        ok = all(c["speedup_vs_plain"] >= c["required"] for k, c in checks.items() if k.startswith("sleep"))
        for k, c in checks.items():
            print(f"  {k}: fastops {c['speedup_vs_plain']:.2f}x faster than plain")
        meta = dict(command=command, torch=torch.__version__, hardware=hardware, gil=gil, checks=checks,
                    seconds=time.perf_counter() - t0)
        print(f"wrote {common.write_results(f'{args.out}_cpu', rows, meta)}.json/.csv")

    if torch.cuda.is_available() and not args.no_cuda:
        print(f"CUDA ({torch.cuda.get_device_name()})")
        crows = bench_cuda(cuda_sizes, cuda_n, repeats)
        meta = dict(command=command, torch=torch.__version__)
        print(f"wrote {common.write_results(f'{args.out}_cuda', crows, meta)}.json/.csv")
    print(f"done in {time.perf_counter() - t0:.0f} s; speedup check {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
