"""The LM-head loss alone, forward + backward: ``F.cross_entropy(F.linear(x, W), target)`` eager, the same two
lines under ``torch.compile``, and ``fastops.linear_cross_entropy``; bf16, N = 2048 rows (B8 x L256), H = 256,
V = 32000, no bias, with 15% of the rows labeled (masked LM) and all of them (causal LM).

Each provider runs in its own process (common.in_fresh_process), so compile caches, allocator state and peak
memory are its own (timing and memory in separate processes, see below); the providers take turns, ``--rounds``
processes each, and a row holds the samples of all of its rounds, so drift on a shared machine hits them alike.
Peak extra memory: the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) during
one forward + backward, less its RSS before it, after warm-up, in a process of its own where glibc is held to mmap
every block of 64 KiB and more (MALLOC_MMAP_THRESHOLD_), so freed buffers leave the RSS and the next call's peak
is its own. The timing processes keep glibc's default, as training runs it: with the threshold fixed every buffer
is a fresh mapping and pays its page faults, which hits the chunked op hardest (all rows labeled, one process,
1 thread: fastops 1889 ms against eager's 1769 with the fixed threshold, 1388 against 1789 with the default). The
gradients of x and W the call creates are part of every provider's figure. A "gemm" worker times ATen's bf16
matmul of the three shapes the loss needs (logits, grad_x, grad_W) alone: the ceiling of a loss made of them.

    python benchmarks/bench_loss.py                      # 1 thread, writes results/loss_cpu_1t.*
    python benchmarks/bench_loss.py --threads 2 --out loss_cpu_2t
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PROVIDERS = ("eager", "compile", "fastops")


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


def _inputs(args, labeled: float):
    import torch

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(args.n, args.h, generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(args.v, args.h, generator=g) / args.h**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, args.v, (args.n,), generator=g)
    t[torch.rand(args.n, generator=g) >= labeled] = -100
    return x, w, t


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    out = {"rows": [], "peak_extra_mib": {}, "flop": {}}
    if args.provider == "gemm":
        x, w, _ = _inputs(args, 1.0)
        x, w = x.detach(), w.detach()
        dl = torch.randn(args.n, args.v).bfloat16()
        out["flop"] = {f"aten_mm_{k}": 2 * args.n * args.v * args.h for k in ("logits", "grad_x", "grad_w")}
        shapes = {"logits": lambda: x @ w.t(), "grad_x": lambda: dl @ w, "grad_w": lambda: dl.t() @ x}
        for name, fn in shapes.items():
            s = common.time_samples(fn, "cpu", args.repeats, warmup=2)
            out["rows"].append(["loss_gemm", f"aten_mm_{name}", args.size, s])
        common.reply(out)
        return
    import fastops

    out["backend"] = fastops._backend.active("cpu")

    def loss_fn(x, w, t):
        return F.cross_entropy(F.linear(x, w), t)

    fn = {"eager": loss_fn, "compile": torch.compile(loss_fn),
          "fastops": lambda x, w, t: fastops.linear_cross_entropy(x, w, t)}[args.provider]
    for labeled in (0.15, 1.0):
        x, w, t = _inputs(args, labeled)

        def step():
            x.grad = w.grad = None
            fn(x, w, t).backward()

        key = f"{args.size}_labeled{int(labeled * 100)}"
        if args.mem:
            step()
            step()
            x.grad = w.grad = None
            out["peak_extra_mib"][key] = round(min(_peak_extra_mib(step) for _ in range(2)), 1)
            continue
        s = common.time_samples(step, "cpu", args.repeats, warmup=3)
        rows = int((t != -100).sum())
        out["flop"][key] = 6 * (rows if args.provider == "fastops" else args.n) * args.v * args.h
        out["rows"].append(["loss", args.provider, key, s])
    common.reply(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--h", type=int, default=256)
    p.add_argument("--v", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--providers", nargs="*", default=list(PROVIDERS))
    p.add_argument("--out", default=None)
    p.add_argument("--provider", help=argparse.SUPPRESS)  # set in the worker processes
    p.add_argument("--mem", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.size = f"N{args.n}_H{args.h}_V{args.v}"
    if args.provider:
        worker(args)
        return
    import torch

    torch.set_num_threads(args.threads)  # the rows' hardware column names the workers' thread count
    common_args = ["--threads", str(args.threads), "--n", str(args.n), "--h", str(args.h), "--v", str(args.v),
                   "--repeats", str(args.repeats)]
    samples, flop, meta = {}, {}, {"peak_extra_mib": {}, "gflops": {}, "command": " ".join(sys.argv)}
    for provider in args.providers:  # peak memory: one process each, glibc's threshold fixed (module docstring)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        try:
            res = common.in_fresh_process(__file__, [*common_args, "--provider", provider, "--mem"])
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        meta["peak_extra_mib"].update({f"{provider}:{k}": v for k, v in res["peak_extra_mib"].items()})
        print(provider, "peak extra MiB", res["peak_extra_mib"], flush=True)
    for _ in range(args.rounds):
        for provider in ["gemm", *args.providers]:
            res = common.in_fresh_process(__file__, [*common_args, "--provider", provider])
            for bench, prov, size, s in res["rows"]:
                samples.setdefault((bench, prov, size), []).extend(s)
            flop.update({(provider, k): v for k, v in res["flop"].items()})
            if "backend" in res:
                meta["fastops_backend"] = res["backend"]
            print(provider, {r[2]: round(common.quantile_row(r[3])["ms"], 1) for r in res["rows"]}, flush=True)
    rows = [common.row(bench, prov, size, s, "cpu", size_unit="config", dtype="bfloat16")
            for (bench, prov, size), s in samples.items()]
    for r in rows:
        key = (r["provider"], r["size"]) if r["bench"] == "loss" else ("gemm", r["provider"])
        meta["gflops"][f"{key[0]}:{key[1]}"] = round(flop[key] / (r["ms"] * 1e6), 1)
    loss_rows = [r for r in rows if r["bench"] == "loss"]
    common.speedup_vs(loss_rows, "eager")
    common.speedup_vs(loss_rows, "compile")
    meta["peak_extra_mib_meaning"] = ("MiB of RSS above the pre-call level at the peak of one forward + backward "
                                      "(the grads of x and W included)")
    meta["gflops_meaning"] = ("matmul GFLOP/s: 2 N V H per matmul (gemm rows), 6 x rows x V x H per forward + "
                              "backward, rows = all N for eager/compile, the labeled ones for fastops")
    base = common.write_results(args.out or f"loss_cpu_{args.threads}t", rows, meta)
    print("wrote", base)
    for k, v in meta["peak_extra_mib"].items():
        print(f"peak extra {k}: {v} MiB")
    for k, v in meta["gflops"].items():
        print(f"GFLOP/s {k}: {v}")


if __name__ == "__main__":
    main()
