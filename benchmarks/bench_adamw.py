"""fastops.optim.AdamW against torch.optim.AdamW's three implementations (foreach=True, fused=True, for-loop
foreach=False), 1M to 100M params in 100 tensors. torch's default is foreach on CUDA and the for-loop on the
CPU (foreach kernels are CUDA/XPU-only); the run says which, and compares fastops with it.

Reports ms/step (median, 20/80% quantiles), effective GB/s at 28 bytes/param for fp32 (read grad, read and
write param, exp_avg, exp_avg_sq) and the percentage of the memory roofline: the best of a few streaming
kernels (copy, in-place scale, in-place add, triad, and Adam's own access pattern with trivial math; see
common.StreamKernels) on a footprint far past the caches, sampled in every round next to the providers, so
the roofline sees the same machine load. Copy bandwidth (STREAM's count) is reported too. Rows say whether
the working set (16 B/param: p, g, m, v) fits the CPU's last-level cache, where a step could beat the roofline.
Providers are interleaved round by round so drift on a noisy machine hits them all alike.

    python benchmarks/bench_adamw.py                  # CPU, 1M..100M
    python benchmarks/bench_adamw.py --quick          # CPU, 1M and 4M, a few seconds
    python benchmarks/bench_adamw.py --device cuda    # on a GPU
    python benchmarks/bench_adamw.py --sizes 16 64 --rounds 3 --out scratch_adamw   # a short trial run
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import fastops  # noqa: E402

class Spec:
    """One optimizer's benchmark: its providers, fp32 bytes moved per param, the working set a step must
    keep in cache to run from it, and the roofline kernels (common.STREAM_KERNELS) run next to it, with the
    one it is held to (None: the best of them)."""

    def __init__(self, name, providers, bytes_per_param, working_set, kernels, roofline=None):
        self.name, self.providers, self.bytes_per_param = name, providers, bytes_per_param
        self.working_set, self.kernels, self.roofline = working_set, kernels, roofline


ADAMW = Spec(
    "adamw",
    {
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
        "fastops": lambda ps: fastops.optim.AdamW(ps, lr=1e-3),
    },
    bytes_per_param=28,  # read g, read + write p, exp_avg, exp_avg_sq
    working_set=16,  # p, g, m, v
    kernels=("copy", "scale_inplace", "add_inplace", "triad", "adam_pattern"),
)


def torch_default(device: str) -> str:
    """The provider that torch's optimizer without a foreach/fused argument runs on ``device``."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    _, foreach = _default_to_fused_or_foreach([torch.empty(1, device=device)], differentiable=False)
    return "torch_foreach" if foreach else "torch_forloop"


def make_params(total: int, n_tensors: int, device: str) -> list[torch.nn.Parameter]:
    # ~100 tensors of uneven sizes, as in a real model (a few big matrices, many small vectors).
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(n_tensors, generator=g) ** 3 + 0.01
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    sizes[0] += total - sizes.sum()
    params = []
    for n in sizes.tolist():
        p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(n, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def bench_size(spec: Spec, total: int, args, stream: common.StreamKernels) -> tuple[list[dict], dict]:
    base = make_params(total, args.tensors, args.device)
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
    samples = {name: [] for name in opts}
    stream_samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        stream.sample(stream_samples)
        for name, opt in opts.items():
            t = common.time_ms(opt.step, args.device, repeats=args.repeats, warmup=1)
            samples[name].append(t["ms"])
    roof = stream.summary(stream_samples, spec.roofline)
    working_set = spec.working_set * total
    llc = common.llc_bytes() if args.device == "cpu" else None
    rows = []
    for name, s in samples.items():
        gbs = spec.bytes_per_param * total / (common.quantile_row(s)["ms"] / 1e3) / 1e9
        rows.append(common.row(
            spec.name, name, total, s, args.device, tensors=args.tensors, dtype="float32", gbs=round(gbs, 2),
            roofline_gbs=round(roof["roofline_gbs"], 2), roofline_kernel=roof["roofline_kernel"],
            pct_roofline=round(100 * gbs / roof["roofline_gbs"], 1), copy_gbs=round(roof["copy_gbs"], 2),
            pct_copy=round(100 * gbs / roof["copy_gbs"], 1), working_set_mib=round(working_set / 2**20),
            fits_llc=llc is not None and working_set <= llc,
        ))  # fmt: skip
    del opts
    return rows, roof


def main(spec: Spec = ADAMW, doc: str = __doc__, sizes=(1, 4, 16, 32, 64, 100)) -> None:
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
    p.add_argument("--out", default=None,
                   help=f"result name under benchmarks/results, or a path (default {spec.name}_<device>)")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.rounds = [1, 4], 3
    dev_type = args.device.split(":")[0]
    default = torch_default(args.device)
    stream = common.StreamKernels(args.device, args.footprint_mib and args.footprint_mib << 20, names=spec.kernels)
    llc = common.llc_bytes() if dev_type == "cpu" else None
    print(f"{common.hardware(args.device)}; fastops backend {fastops._backend.active(dev_type)}; torch's default "
          f"{spec.name} here is {default}; roofline kernels on {stream.footprint / 2**30:.2f} GiB"
          + (f"; last-level cache {llc / 2**20:.0f} MiB" if llc else ""))  # fmt: skip
    rows, roofs = [], {}
    for m in args.sizes:
        size_rows, roof = bench_size(spec, int(m * 1e6), args, stream)
        roofs[f"{m:g}M"] = roof
        by = {r["provider"]: r for r in size_rows}
        first = size_rows[0]
        print(f"{m:6g}M  roofline {roof['roofline_gbs']:.1f} GB/s ({roof['roofline_kernel']}); "
              + ", ".join(f"{k} {v['gbs']:.1f}" for k, v in roof["kernels"].items())
              + f"; working set {first['working_set_mib']} MiB" + (" (fits the LLC)" if first["fits_llc"] else ""))
        for r in size_rows:
            if "fastops" in by:
                r["fastops_speedup"] = round(r["ms"] / by["fastops"]["ms"], 3)
            r["torch_default"] = r["provider"] == default
            print(f"        {r['provider']:14s} {r['ms']:9.2f} ms  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
                  f"{r['gbs']:6.1f} GB/s = {r['pct_roofline']:5.1f}% of roofline, {r['pct_copy']:5.1f}% of copy"
                  + (f"; fastops is {r['fastops_speedup']:.2f}x this" if "fastops_speedup" in r else "")
                  + ("  (torch default)" if r["torch_default"] else ""))  # fmt: skip
        rows += size_rows
    name = args.out or f"{spec.name}_{dev_type}"
    meta = {"roofline": roofs, "torch_default": default, "llc_bytes": llc, "torch": torch.__version__,
            "argv": sys.argv[1:]}  # fmt: skip
    base = common.write_results(name, rows, meta)
    print(f"wrote {base}.json/.csv (and .png with matplotlib)")


if __name__ == "__main__":
    main()
