"""The one harness every benchmark times through: medians with 20/80% quantiles (``time_ms``, with a
``reset`` hook run outside the timed region), providers taking turns round by round (``interleaved``), one row
schema (``row``: SCHEMA's columns, then the benchmark's own, each named in COLUMNS with its one meaning), speedup
columns (``speedup_vs``, ``fastops_speedup``), one CSV and one JSON per run (``write_results``, which also draws
the run with benchmarks/plot.py), the memory roofline measured in the same run (``StreamKernels``) and a
profile of a step (``profile_steps``). The optimizer benchmarks' runner is runner.py."""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

# The checkout these benchmarks sit in comes first: they measure its fastops, not one an editable install
# elsewhere would put on the path (benchmarks import common before fastops).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastops import demo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
SCHEMA = ("bench", "provider", "size", "size_unit", "ms", "ms_q20", "ms_q80", "samples", "device", "hardware")
# Every column a benchmark writes, with its one meaning; write_results refuses a column not named here (or
# speedup_vs_<provider>) and copies the meanings of a file's columns into its JSON.
COLUMNS = {
    "bench": "what is measured: adamw, adamw_lowp, sgd, unscale, phase, prefetch, prefetch_h2d, train, parity_lowp, "
             "accumulate",
    "provider": "the implementation measured (fastops, torch_fused, ...)",
    "size": "the problem size: a number in size_unit, or a label naming the configuration when size_unit is "
            "'config'",
    "size_unit": "what size counts: params, MiB per batch, or config",
    "ms": "median wall time in ms of one unit of work (optimizer step, kernel call, batch, training step)",
    "ms_q20": "20% quantile of the same samples", "ms_q80": "80% quantile of the same samples",
    "samples": "number of timings behind ms and its quantiles (each may itself be a median, see the bench)",
    "device": "the torch device the work ran on (cpu, cuda)", "hardware": "CPU model and torch threads, or the GPU's name",
    "speedup_vs_*": "ms of the named provider (speedup_vs_fp32: torch fp32) at the same bench and size / this row's "
                    "ms (>1: this row is faster)",
    "fastops_speedup": "this row's ms / fastops' ms at the same bench and size: how many times faster fastops is",
    "tensors": "number of parameter tensors the params are split into", "dtype": "dtype of the params and grads",
    "gbs": "effective GB/s: the bytes the provider must move (bytes_per_param or bytes_per_elem) / ms",
    "roofline_gbs": "GB/s of the best streaming kernel measured in the same rounds (common.StreamKernels)",
    "roofline_kernel": "the streaming kernel that set roofline_gbs", "pct_roofline": "100 * gbs / roofline_gbs",
    "copy_gbs": "GB/s of a tensor copy in the same rounds, STREAM's count", "pct_copy": "100 * gbs / copy_gbs",
    "working_set_mib": "MiB of params, grads and fp32 states: what a step must keep in cache to run from it",
    "fits_llc": "whether the working set fits the CPU's last-level cache (a step could then beat the roofline)",
    "bytes_per_param": "bytes one optimizer step moves per param, as counted for gbs",
    "ns_per_param": "ms per step in ns per param", "state_bytes_per_param": "optimizer state held per param",
    "torch_default": "whether this is the implementation torch's optimizer picks here without foreach/fused",
    "bytes_per_elem": "bytes one kernel call moves per element, as counted for gbs",
    "max_param_diff": "largest |param| difference between the two recipes after the check phases",
    "param_atol": "the rounding tolerance max_param_diff is held to",
    "kind": "the loader's and step's work: sleep, or torch ops", "x_ms": "the loader's ms per batch",
    "y_ms": "the step's ms per batch", "model": "the model's key on the command line (--models)",
    "precision": "the precision the provider trained in", "optimizer": "the optimizer class fastops ran, if any",
    "vs_hf_accelerate": "HF Accelerate bf16's ms at the same size / this row's ms",
    "seed_claim_vs_fp32": "the speedup over plain fp32 the seed claims for the model",
    "first_loss": "the loss of the first step", "tail_loss": "mean loss of the last loss-check steps",
    "tail_rel_diff_vs_fp32": "mean |loss - torch fp32's| / torch fp32's over the last loss-check steps",
    "tail_rel_diff_vs_amp": "the same against torch's AMP recipe", "loss_check": "ok, or the failed checks",
    "rerun_loss_rel_diff": "largest relative loss difference between runs of the same provider",
    "vs_torch_compile": "the torch.compile recipe's ms at the same size / this row's ms",
    "first_step_ms": "wall time of the first training step of the provider's first run, compile time included",
    "peak_mem_mib": "peak memory of the provider's process: resident set on the CPU, max_memory_allocated on CUDA",
    "step": "the training step's index (0 is the first)", "loss": "the training loss at that step",
    "train_mem_mib": "training memory: peak resident set during the steps minus the resident set before the first "
                     "(CPU), max_memory_allocated (CUDA); the largest over the provider's runs",
    "gflop_per_step": "FLOPs of one bf16 forward + backward of the unmodified model (torch.utils.flop_counter)",
    "peak_gflops": "the bf16 GEMM peak measured in the same rounds (2048 x 1024 @ 1024 x 4096)",
    "mfu": "gflop_per_step / step time / peak_gflops", "decision": "what fastops.accelerate decided, and why",
    "breakdown_ms": "ms per step by category from torch.profiler self times (train_profile.CATEGORIES)",
    "gemm_share": "share of the profiled step in GEMM and convolution",
    "gemm_efficiency": "gflop_per_step over the profiled GEMM, convolution, attention and fused-loss time, / peak",
    "vs_best_peer": "the fastest peer's ms (torch AMP recipe, HF Accelerate bf16, torch.compile recipe) / this row's",
    "best_peer": "the peer that vs_best_peer is against",
    "vs_fastest_explicit": "the fastest explicit fastops configuration's ms / this row's ms",
    "gflops": "GFLOP/s of the matmul at the median: 2 m n k / ms",
}


hardware = demo.hardware  # the device's name, as the demo's results give it


def llc_bytes() -> int | None:
    """Size of the CPU's largest cache (sysfs), or None where it cannot be read."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in (d for d in os.listdir(base) if d.startswith("index")):
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    except (OSError, ValueError):
        return None
    return max(sizes) if sizes else None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def quantile_row(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=5, method="inclusive") if len(samples) > 1 else [samples[0]] * 4
    return {"ms": statistics.median(samples), "ms_q20": q[0], "ms_q80": q[3]}


def time_samples(fn: Callable[[], object], device: str, repeats: int, warmup: int = 3,
                 reset: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:  # fmt: skip
    """``fn``'s wall time in ms, ``repeats`` times after ``warmup`` untimed calls, synchronising the device
    around each call (host overhead, such as an optimizer's per-tensor Python loop, is part of what is
    measured). ``reset``, when given, runs before every call (warm-up ones too) outside the timed region:
    restoring grads a call overwrote, seeding, or building an iterator whose first item is not measured.
    ``clock``: time.thread_time measures the calling thread's CPU time instead, steadier on a loaded machine
    when the work runs on that one thread (torch.set_num_threads(1))."""
    samples = []
    for i in range(warmup + repeats):
        if reset is not None:
            reset()
        sync(device)
        start = clock()
        fn()
        sync(device)
        if i >= warmup:
            samples.append(1e3 * (clock() - start))
    return samples


def time_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 3,
            reset: Callable[[], object] | None = None,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:  # fmt: skip
    """Median and 20/80% quantiles of ``time_samples``."""
    return quantile_row(time_samples(fn, device, repeats, warmup, reset, clock))


def interleaved(measure: dict[str, Callable[[], float | list[float]]], rounds: int,
                before_round: Callable[[], object] | None = None) -> dict[str, list[float]]:  # fmt: skip
    """ms samples of each provider: every round measures each of them once, in turn, so drift on a shared
    machine hits them all alike. A measurement returns one sample or a list of them; ``before_round`` runs at
    the start of each round (the roofline kernels sample there)."""
    samples: dict[str, list[float]] = {name: [] for name in measure}
    for _ in range(rounds):
        if before_round is not None:
            before_round()
        for name, fn in measure.items():
            out = fn()
            samples[name] += out if isinstance(out, list) else [out]
    return samples


def row(bench: str, provider: str, size, samples: list[float], device: str, *, size_unit: str, **extra) -> dict:
    """One result row in the shared schema (SCHEMA first, then ``extra``), from raw ms samples."""
    t = {k: round(v, 4) for k, v in quantile_row(samples).items()}
    return {"bench": bench, "provider": provider, "size": size, "size_unit": size_unit, **t,
            "samples": len(samples), "device": device, "hardware": hardware(device), **extra}  # fmt: skip


def _ratio(rows: list[dict], ref: str, column: str, ref_over_row: bool) -> None:
    refs = {(r["bench"], r["size"]): r["ms"] for r in rows if r["provider"] == ref}
    for r in rows:
        m = refs.get((r["bench"], r["size"]))
        if m is not None:
            r[column] = round(m / r["ms"] if ref_over_row else r["ms"] / m, 3)


def speedup_vs(rows: list[dict], baseline: str, column: str | None = None) -> None:
    """Adds ``column`` (default speedup_vs_<baseline>): ``baseline``'s ms / this row's ms, at the same bench
    and size, to every row that has a baseline row next to it."""
    _ratio(rows, baseline, column or f"speedup_vs_{baseline}", ref_over_row=True)


def fastops_speedup(rows: list[dict], fastops: str = "fastops") -> None:
    """Adds fastops_speedup: this row's ms / the ms of provider ``fastops`` at the same bench and size (1 on
    fastops' own row)."""
    _ratio(rows, fastops, "fastops_speedup", ref_over_row=False)


def device_ms(fn: Callable[[], object], device: str, calls: int,
              clock: Callable[[], float] = time.perf_counter) -> float:  # fmt: skip
    """ms per call of ``fn`` over ``calls`` back-to-back calls; CUDA events on a GPU, so the figure is the
    kernels' time on the device and not the host's launch and sync latency; on the CPU by ``clock``."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t = clock()
    for _ in range(calls):
        fn()
    return 1e3 * (clock() - t) / calls


def default_footprint(device: str) -> int:
    """Bytes each streaming kernel touches: far past any cache, so nothing stays cached from one call to the
    next. 4 GiB on a GPU (an H100's or H200's L2 is 50 MB); on the CPU at least 1 GiB and 4x the last-level cache (the
    development VM reports a 480 MiB L3, which would hold a 256 MiB footprint whole)."""
    if device.startswith("cuda"):
        return 4 << 30
    llc = llc_bytes() or 0
    want = max(1 << 30, 4 * llc)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        want = min(want, max(1 << 30, avail // 4))
    except (ValueError, OSError):
        pass
    return want


# Streaming kernels for the roofline: (name, number of equal fp32 arrays, bytes counted per element of one
# array, what the count means). Each kernel's arrays together are the footprint.
STREAM_KERNELS = (
    ("copy", 2, 8, "b.copy_(a): read a + write b, STREAM's count; write-allocate adds an unseen read of b"),
    ("scale_inplace", 1, 8, "a.mul_(s): read + write the same lines, no write-allocate"),
    ("add_inplace", 2, 12, "a.add_(b): read a, b + write a in place, Adam's pattern (it updates p, m, v in place)"),
    ("triad", 3, 12, "torch.add(b, c, alpha=s, out=a): STREAM triad count; write-allocate adds an unseen read of a"),
    ("adam_pattern", 4, 28, "p += c*g; m = a*m + b*g; v = a'*v + b'*g*g in one torch.compile'd loop: AdamW's fp32 "
     "traffic (read g, p, m, v; write p, m, v in place) with trivial math"),
    ("sgd_pattern", 3, 20, "p += c*buf; buf = a*buf + g in one torch.compile'd loop: momentum SGD's fp32 traffic "
     "(read g, p, buf; write p, buf in place) with trivial math"),
)


def _adam_pattern(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    p.add_(g, alpha=1e-9)
    m.mul_(0.9).add_(g, alpha=0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)


def _sgd_pattern(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor) -> None:
    p.add_(buf, alpha=-1e-9)
    buf.mul_(0.9).add_(g)


def _stream_fn(name: str, views: list[torch.Tensor]) -> Callable[[], object]:
    if name == "copy":
        return lambda: views[1].copy_(views[0])
    if name == "triad":
        return lambda: torch.add(views[1], views[2], alpha=0.5, out=views[0])
    if name == "adam_pattern":
        # Compiled, so the three updates are one pass; as three eager ops they would be seven. The values
        # converge (m to g, v to g*g) and p moves by 1e-9*g a call, so they stay bounded.
        fn = torch.compile(_adam_pattern, fullgraph=True, dynamic=False)
        return lambda: fn(views[1], views[0], views[2], views[3])
    if name == "sgd_pattern":  # buf converges to 10 g, p moves by 1e-8 g a call: bounded values
        fn = torch.compile(_sgd_pattern, fullgraph=True, dynamic=False)
        return lambda: fn(views[1], views[0], views[2])
    # The in-place kernels alternate x2 / x0.5 (exact) and +b / -b, so the values stay bounded however many
    # calls run.
    flip = [True]

    def inplace() -> None:
        flip[0] = not flip[0]
        if name == "scale_inplace":
            views[0].mul_(2.0 if flip[0] else 0.5)
        else:
            views[0].add_(views[1], alpha=1.0 if flip[0] else -1.0)

    return inplace


class StreamKernels:
    """The streaming kernels of ``STREAM_KERNELS`` on ``footprint`` bytes, sampled on demand so that a
    benchmark can interleave them with its providers: on a shared machine the roofline then sees the same
    load as what is measured against it (one 2 GiB in-place scale ran at 41.7 and 22.5 GB/s a minute apart
    on the development VM while other tests ran).

    The roofline is the best of them: a memory system that demonstrably sustains X GB/s for some streaming
    pattern bounds any streaming kernel by X, while a figure below what a real kernel reaches bounds nothing.
    Copy alone is not it: each store to a line not read before costs a read-for-ownership that STREAM's
    count (2 B per byte copied) leaves out. Nor are one- or two-stream kernels: on the 2-vCPU development VM
    a core's bandwidth is bounded by the misses it keeps in flight, so more concurrent streams move more
    bytes. Measured there (1.75 GiB, C loops with OpenMP on 2 threads): copy 24.5 GB/s, in-place scale 40,
    in-place add 41, and Adam's pattern (read g, p, m, v; write p, m, v in place) 49.5; the compiled
    ``adam_pattern`` below ran at 49.5 against 39.9 for ``add_`` in the same process. That pattern is the
    ceiling an AdamW step can be held to; the others stay in the report for comparison with other machines."""

    def __init__(self, device: str, footprint: int | None = None, calls: int = 2,
                 names: tuple[str, ...] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        """``names``: the kernels of STREAM_KERNELS to run (default all); ``clock``: as time_samples'."""
        self.device, self.calls, self.clock = device, calls, clock
        self.footprint = footprint or default_footprint(device)
        numel = self.footprint // 4
        self.pool = torch.empty(numel, dtype=torch.float32, device=device).uniform_(0.5, 1.0)
        self.fns, self.counted, self.skipped = {}, {}, {}
        for name, arrays, per_elem, _ in STREAM_KERNELS:
            if names is not None and name not in names:
                continue
            n = numel // arrays
            fn = _stream_fn(name, [self.pool[i * n : (i + 1) * n] for i in range(arrays)])
            try:
                fn()  # first touch of the pages, CUDA's lazy init and the compile, outside the timings
            except Exception as e:  # torch.compile needs a C++ compiler (CPU) or Triton (CUDA)
                self.skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"note: roofline kernel {name} skipped ({self.skipped[name]})")
                continue
            self.fns[name], self.counted[name] = fn, per_elem * n
        sync(device)

    def sample(self, samples: dict[str, list[float]]) -> None:
        """One timing (ms per call) of each kernel, appended to ``samples[name]``."""
        for name, fn in self.fns.items():
            samples.setdefault(name, []).append(device_ms(fn, self.device, self.calls, self.clock))

    def summary(self, samples: dict[str, list[float]], roofline: str | None = None) -> dict:
        """GB/s of each kernel; the roofline is the best of them, or the kernel named ``roofline``."""
        kernels = {}
        for name, _, _, meaning in STREAM_KERNELS:
            if name not in self.fns:
                continue
            t = quantile_row(samples[name])
            kernels[name] = {"gbs": self.counted[name] / (t["ms"] / 1e3) / 1e9, **t,
                             "bytes_counted": self.counted[name], "pattern": meaning}  # fmt: skip
        best = roofline or max(kernels, key=lambda k: kernels[k]["gbs"])
        return {"footprint_bytes": self.footprint, "kernels": kernels, "roofline_kernel": best,
                "roofline_gbs": kernels[best]["gbs"], "copy_gbs": kernels["copy"]["gbs"],
                "skipped": self.skipped}  # fmt: skip


def result_base(name: str) -> str:
    """``name`` under benchmarks/results, or as given when it contains a directory (gpu_check.sh writes
    straight into its output folder)."""
    return name if os.path.dirname(name) else os.path.join(RESULTS, name)


def meaning(column: str) -> str | None:
    """The meaning COLUMNS gives ``column``, or None where it has none."""
    return COLUMNS.get("speedup_vs_*" if column.startswith("speedup_vs_") else column)


def write_results(name: str, rows: list[dict], meta: dict) -> str:
    """``name``.json (meta, with the meaning of every column under "columns", and rows) and ``name``.csv
    (rows: SCHEMA's columns first), then ``name``.png drawn by plot.py. Returns the path without extension."""
    for r in rows:
        missing = [k for k in SCHEMA if k not in r]
        if missing:
            raise ValueError(f"benchmark row without {missing}: {r}")
    fields = list(dict.fromkeys([*SCHEMA, *(k for r in rows for k in r)]))
    unnamed = [k for k in fields if meaning(k) is None]
    if unnamed:
        raise ValueError(f"columns {unnamed} have no meaning in common.COLUMNS: name them there (one meaning each)")
    base = result_base(name)
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump({"meta": {**meta, "columns": {k: meaning(k) for k in fields}}, "rows": rows}, f, indent=1)
    with open(base + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    import plot  # benchmarks/plot.py, next to this file (the benchmarks put this folder on sys.path)

    plot.draw(base + ".csv")
    return base


_REPLY = "RESULT "  # prefix of a worker's one line of JSON on stdout


def in_fresh_process(script: str, args: list[str]) -> dict:
    """``python script *args`` in a fresh interpreter, for a provider that changes process-wide state the
    others must not inherit; returns what the worker passed to ``reply``."""
    r = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True)
    line = next((x for x in r.stdout.splitlines() if x.startswith(_REPLY)), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"worker {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(line[len(_REPLY) :])


def reply(out: dict) -> None:
    """The worker's side of ``in_fresh_process`` and ``Live``."""
    print(_REPLY + json.dumps(out), flush=True)


class Live:
    """``python script *args`` kept running: ``ask(request)`` writes one JSON line to its stdin and returns the
    next ``reply`` it prints, so that providers in processes of their own can take turns request by request
    (``requests`` is the worker's side). Its stderr goes to a temporary file, quoted when it fails."""

    def __init__(self, script: str, args: list[str]) -> None:
        self.args = args
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True)  # fmt: skip

    def ask(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith(_REPLY):
                    return json.loads(line[len(_REPLY) :])
        except BrokenPipeError:
            pass
        self.proc.wait()
        self.err.seek(0)
        code, err = self.proc.returncode, self.err.read()[-4000:]
        raise RuntimeError(f"worker {' '.join(self.args)} exited with {code}:\n{err}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.err.close()


def requests():
    """The worker's side of ``Live``: each request, until the parent closes the pipe."""
    for line in sys.stdin:
        yield json.loads(line)


def profile_steps(step: Callable[[], object], steps: int, device: str, title: str, out) -> None:
    """``steps`` calls of ``step`` under torch.profiler, after the caller's warm-up: ms per call, the host
    (and, on CUDA, device) ms of each range the step marks with record_function("## name"), and a table of
    ops by self time, written to the open file ``out``; the ranges are printed too."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
    wall = 1e3 * (time.perf_counter() - start) / steps
    events = prof.key_averages()
    # On CUDA the host times of the ranges are launch times; the device column is the GPU's.
    lines = [f"==== {title}: {steps} steps, {wall:.1f} ms per step under the profiler"]
    for e in sorted((e for e in events if e.key.startswith("## ")), key=lambda e: e.key):
        dev = f"  device {e.device_time_total / 1e3 / steps:8.1f} ms" if cuda else ""
        lines.append(f"  {e.key[3:]:18s} host {e.cpu_time_total / 1e3 / steps:8.1f} ms{dev}")
    table = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25,
                         max_name_column_width=50)  # fmt: skip
    out.write("\n".join(lines) + "\n" + table + "\n")
    print("\n".join(lines), flush=True)
