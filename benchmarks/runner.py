"""The optimizer benchmarks' runner (bench_adamw.py, bench_sgd.py): a ``Spec`` names an optimizer's providers,
the bytes a step moves per param and its roofline kernels; ``parser`` gives the shared command line and
``run`` times every provider's step on the same params, round by round next to the roofline kernels
(common.StreamKernels), and writes the rows through common.write_results. ``make_params`` and
``state_bytes`` are shared with bench_amp.py and parity_lowp.py."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastops  # noqa: E402


class Spec:
    """One optimizer's benchmark: its providers (name -> a function of the params that builds the optimizer),
    bytes moved per param (one number, or one per provider), the working set a step must keep in cache to run
    from it (bytes per param), and the roofline kernels (common.STREAM_KERNELS) run next to it, with the one it
    is held to (None: the best of them). ``baseline``: None gives every row fastops_speedup, a provider name
    gives speedup_vs_<baseline>. ``multiple``: param sizes are rounded down to it (torchao's AdamW8bit keeps
    fp32 states for a param whose size is not a multiple of its block of 256, which would make its "8-bit" row
    an fp32 one). ``report_state``: rows carry the optimizer state held per param."""

    def __init__(self, name, providers, bytes_per_param, working_set, kernels, roofline=None, baseline=None,
                 multiple=1, report_state=False):  # fmt: skip
        self.name, self.providers, self.bytes_per_param = name, providers, bytes_per_param
        self.working_set, self.kernels, self.roofline = working_set, kernels, roofline
        self.baseline, self.multiple, self.report_state = baseline, multiple, report_state

    def bytes_of(self, provider: str) -> float:
        b = self.bytes_per_param
        return b[provider] if isinstance(b, dict) else b


def _tensor_bytes(t) -> int:
    # Tensor subclasses (torchao's OptimState8bit) hold their data in inner tensors.
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt) -> int:
    """Bytes of optimizer state (moments, scales, step counters) held for all params."""
    tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(_tensor_bytes(t) for t in tensors)


def peer(module: str, cls: str):
    """A peer optimizer class, or None where its package does not import here."""
    try:
        return getattr(importlib.import_module(module), cls)
    except Exception as e:  # noqa: BLE001
        print(f"skipping {module}.{cls}: {type(e).__name__}: {e}")
        return None


def torch_default(device: str) -> str:
    """The provider that torch's optimizer without a foreach/fused argument runs on ``device``."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    _, foreach = _default_to_fused_or_foreach([torch.empty(1, device=device)], differentiable=False)
    return "torch_foreach" if foreach else "torch_forloop"


def make_params(total: int, n_tensors: int, device: str, multiple: int = 1) -> list[torch.nn.Parameter]:
    """``total`` params with grads in ``n_tensors`` tensors of uneven sizes, as in a real model (a few big
    matrices, many small vectors), each size rounded down to ``multiple``; seeded, so every call is alike."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(n_tensors, generator=g) ** 3 + 0.01
    sizes = (weights / weights.sum() * total).long().div(multiple, rounding_mode="floor").mul(multiple).clamp(min=multiple)
    sizes[0] += total - sizes.sum()
    params = []
    for n in sizes.tolist():
        p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(n, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def bench_size(spec: Spec, total: int, args, stream: common.StreamKernels) -> tuple[list[dict], dict]:
    """Rows of every provider at ``total`` params, and the roofline measured in the same rounds. A sample is the
    median of ``args.repeats`` steps; one per provider per round."""
    base = make_params(total, args.tensors, args.device, spec.multiple)
    opts = {}
    for name, make in spec.providers.items():
        if args.providers and name not in args.providers:
            continue
        params = [torch.nn.Parameter(p.detach().clone()) for p in base]
        for p, b in zip(params, base):
            p.grad = b.grad.clone()
        opts[name] = make(params)
        opts[name].step()  # state initialisation is not what is measured
    del base
    stream_samples: dict[str, list[float]] = {}
    measure = {name: (lambda opt=opt: common.time_ms(opt.step, args.device, args.repeats, warmup=1,
                                                     clock=clock(args))["ms"])
               for name, opt in opts.items()}  # fmt: skip
    samples = common.interleaved(measure, args.rounds, before_round=lambda: stream.sample(stream_samples))
    roof = stream.summary(stream_samples, spec.roofline)
    working_set = spec.working_set * total
    llc = common.llc_bytes() if args.device == "cpu" else None
    rows = []
    for name, s in samples.items():
        ms = common.quantile_row(s)["ms"]
        gbs = spec.bytes_of(name) * total / (ms / 1e3) / 1e9
        extra = {"state_bytes_per_param": round(state_bytes(opts[name]) / total, 3)} if spec.report_state else {}
        rows.append(common.row(
            spec.name, name, total, s, args.device, size_unit="params", tensors=args.tensors, dtype="float32",
            gbs=round(gbs, 2), roofline_gbs=round(roof["roofline_gbs"], 2), roofline_kernel=roof["roofline_kernel"],
            pct_roofline=round(100 * gbs / roof["roofline_gbs"], 1), copy_gbs=round(roof["copy_gbs"], 2),
            pct_copy=round(100 * gbs / roof["copy_gbs"], 1), working_set_mib=round(working_set / 2**20),
            fits_llc=llc is not None and working_set <= llc, bytes_per_param=round(spec.bytes_of(name), 3),
            ns_per_param=round(ms * 1e6 / total, 3), **extra,
        ))  # fmt: skip
    del opts
    return rows, roof


def parser(doc: str, name: str, sizes) -> argparse.ArgumentParser:
    """The optimizer benchmarks' command line; ``name`` and ``sizes`` (millions of params) are the defaults of
    --out and --sizes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", type=float, nargs="*", default=list(sizes), help="millions of params")
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="steps timed per provider per round")
    p.add_argument("--providers", nargs="*")
    p.add_argument("--footprint-mib", type=int, default=None,
                   help="bytes each roofline kernel streams (default: 4 GiB on CUDA; max(1 GiB, 4x LLC) on the CPU)")
    p.add_argument("--quick", action="store_true", help="1M and 4M params, fewer rounds")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before the run")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the calling thread's CPU time (time.thread_time), steadier on a loaded machine; needs "
                   "--threads 1, where the steps and the roofline kernels run on that thread")
    p.add_argument("--out", default=None,
                   help=f"result name under benchmarks/results, or a path (default {name}_<device>)")
    return p


def clock(args):
    return time.thread_time if args.clock == "cpu" else time.perf_counter


def run(spec: Spec, args) -> str:
    """Every size of ``args.sizes``, printed and written as <args.out or spec.name_<device>>.json/.csv/.png;
    returns the path without extension."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu measures one thread's CPU time: run it with --threads 1")
    load_start = os.getloadavg()
    if args.quick:
        args.sizes, args.rounds = [1, 4], 3
    dev_type = args.device.split(":")[0]
    default = torch_default(args.device)
    stream = common.StreamKernels(args.device, args.footprint_mib and args.footprint_mib << 20, names=spec.kernels,
                                  clock=clock(args))
    llc = common.llc_bytes() if dev_type == "cpu" else None
    print(f"{common.hardware(args.device)}; fastops backend {fastops._backend.active(dev_type)}; torch's default "
          f"{spec.name} here is {default}; roofline kernels on {stream.footprint / 2**30:.2f} GiB"
          + (f"; last-level cache {llc / 2**20:.0f} MiB" if llc else "")
          + (f"; fastops CPU level {fastops._C.cpu_capability()}" if fastops._backend._C is not None else "")
          + f", torch's {torch.backends.cpu.get_cpu_capability()}; {args.clock} clock; load average "
          + " ".join(f"{x:.2f}" for x in load_start))  # fmt: skip
    rows, roofs = [], {}
    speed = f"speedup_vs_{spec.baseline}" if spec.baseline else "fastops_speedup"
    for m in args.sizes:
        size_rows, roof = bench_size(spec, int(m * 1e6), args, stream)
        roofs[f"{m:g}M"] = roof
        first = size_rows[0]
        print(f"{m:6g}M  roofline {roof['roofline_gbs']:.1f} GB/s ({roof['roofline_kernel']}); "
              + ", ".join(f"{k} {v['gbs']:.1f}" for k, v in roof["kernels"].items())
              + f"; working set {first['working_set_mib']} MiB" + (" (fits the LLC)" if first["fits_llc"] else ""))
        if spec.baseline:
            common.speedup_vs(size_rows, spec.baseline)
        else:
            common.fastops_speedup(size_rows)
        for r in size_rows:
            r["torch_default"] = r["provider"] == default
            print(f"        {r['provider']:14s} {r['ms']:9.2f} ms  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
                  f"{r['gbs']:6.1f} GB/s = {r['pct_roofline']:5.1f}% of roofline, {r['pct_copy']:5.1f}% of copy"
                  + (f"; fastops is {r[speed]:.2f}x this" if speed == "fastops_speedup" and speed in r else "")
                  + (f"; {r[speed]:.2f}x {spec.baseline}" if speed != "fastops_speedup" and speed in r else "")
                  + (f"; {r['ns_per_param']:.2f} ns/param, state {r['state_bytes_per_param']:.2f} B/param"
                     if "state_bytes_per_param" in r else "")
                  + ("  (torch default)" if r["torch_default"] else ""))  # fmt: skip
        rows += size_rows
    meta = {"roofline": roofs, "torch_default": default, "llc_bytes": llc, "torch": torch.__version__,
            "argv": sys.argv[1:], "clock": args.clock, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "fastops_cpu_capability": fastops._C.cpu_capability() if fastops._backend._C is not None else None,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
    base = common.write_results(args.out or f"{spec.name}_{dev_type}", rows, meta)
    print(f"wrote {base}.json/.csv (and .png with matplotlib)")
    return base
