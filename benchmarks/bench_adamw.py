"""fastops.optim.AdamW against torch.optim.AdamW's three implementations (foreach default, fused=True,
for-loop), 1M to 100M params in about 100 tensors.

Reports ms/step (median, 20/80% quantiles), effective GB/s at 28 bytes/param for fp32 (read grad, read and
write param, exp_avg, exp_avg_sq) and the machine's copy bandwidth measured in the same run as the
roofline. Providers are interleaved round by round so drift on a noisy machine hits them all alike.

    python benchmarks/bench_adamw.py                  # CPU, 1M..100M
    python benchmarks/bench_adamw.py --quick          # CPU, 1M and 4M, a few seconds
    python benchmarks/bench_adamw.py --device cuda    # on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import fastops  # noqa: E402

BYTES_PER_PARAM = {torch.float32: 28}
PROVIDERS = {
    "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "torch_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "fastops": lambda ps: fastops.optim.AdamW(ps, lr=1e-3),
}


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


def bench_size(total: int, args) -> list[dict]:
    opts = {}
    for name, make in PROVIDERS.items():
        if args.providers and name not in args.providers:
            continue
        params = make_params(total, args.tensors, args.device)
        opts[name] = make(params)
        opts[name].step()  # state initialisation is not what is measured
    samples = {name: [] for name in opts}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            t = common.time_ms(opt.step, args.device, repeats=args.repeats, warmup=1)
            samples[name].append(t["ms"])
    rows = []
    for name, s in samples.items():
        ms = statistics.median(s)
        q = statistics.quantiles(s, n=5) if len(s) >= 5 else [min(s), 0, 0, max(s)]
        rows.append({
            "provider": name, "params": total, "tensors": args.tensors, "dtype": "float32",
            "ms": round(ms, 4), "ms_q20": round(q[0], 4), "ms_q80": round(q[3], 4),
            "gbs": round(BYTES_PER_PARAM[torch.float32] * total / (ms / 1e3) / 1e9, 2),
            "device": args.device, "hardware": common.hardware(args.device),
        })  # fmt: skip
    del opts
    return rows


def plot(rows: list[dict], roofline: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["provider"] for r in rows):
        rs = [r for r in rows if r["provider"] == name]
        ax1.plot([r["params"] / 1e6 for r in rs], [r["ms"] for r in rs], marker="o", label=name)
        ax2.plot([r["params"] / 1e6 for r in rs], [r["gbs"] for r in rs], marker="o", label=name)
    ax2.axhline(roofline, color="k", linestyle="--", label=f"copy bandwidth {roofline:.0f} GB/s")
    for ax, ylabel in ((ax1, "ms / step"), (ax2, "effective GB/s (28 B/param)")):
        ax.set_xscale("log")
        ax.set_xlabel("params (M)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    fig.suptitle(f"AdamW step, fp32, {rows[0]['hardware']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", type=float, nargs="*", default=[1, 4, 16, 32, 64, 100], help="millions of params")
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="steps timed per provider per round")
    p.add_argument("--providers", nargs="*")
    p.add_argument("--quick", action="store_true", help="1M and 4M params, fewer rounds")
    p.add_argument("--out", default=None, help="result name under benchmarks/results (default adamw_<device>)")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.rounds = [1, 4], 3
    roofline = common.copy_bandwidth_gbs(args.device)
    print(f"{common.hardware(args.device)}; fastops backend {fastops._backend.active(args.device.split(':')[0])}; "
          f"copy bandwidth {roofline:.1f} GB/s")
    rows = []
    for m in args.sizes:
        size_rows = bench_size(int(m * 1e6), args)
        by = {r["provider"]: r for r in size_rows}
        for r in size_rows:
            r["roofline_gbs"] = round(roofline, 2)
            r["pct_roofline"] = round(100 * r["gbs"] / roofline, 1)
            if "fastops" in by:
                r["fastops_speedup"] = round(r["ms"] / by["fastops"]["ms"], 3)
            print(f"{m:6.0f}M {r['provider']:14s} {r['ms']:9.2f} ms  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
                  f"{r['gbs']:6.1f} GB/s ({r['pct_roofline']:5.1f}% of copy)  fastops is {r.get('fastops_speedup', 0):.2f}x this")
        rows += size_rows
    name = args.out or f"adamw_{args.device.split(':')[0]}"
    base = common.write_results(name, rows, {"roofline_gbs": roofline, "torch": torch.__version__, "argv": sys.argv[1:]})
    plot(rows, roofline, base + ".png")
    print(f"wrote {base}.json/.csv/.png")


if __name__ == "__main__":
    main()
