"""The AMP optimizer phase: torch's recipe against fastops', plus the unscale kernel on its own.

(a) ``torch.ops.fastops.unscale_check_`` vs ``torch._amp_foreach_non_finite_check_and_unscale_``.
(b) The whole phase at 24M fp32 params in ~100 tensors, from the same scaled grads:
    torch:   AdamW(fused=True) + GradScaler: unscale_, clip_grad_norm_, step, update
    fastops: AdamW(max_grad_norm=...) + fastops.amp.GradScaler: step, update
    Both start from identical states; the resulting params are compared before timing.

    python benchmarks/bench_amp.py            # CPU
    python benchmarks/bench_amp.py --quick    # 4M params, a few seconds
    python benchmarks/bench_amp.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
from bench_adamw import make_params  # noqa: E402

import fastops  # noqa: E402
import fastops.amp as famp  # noqa: E402

SCALE = 2.0**16
MAX_NORM = 1.0


def torch_phase(params, device):
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=SCALE, growth_interval=10**6)

    def phase():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(opt)
        scaler.update()

    return scaler, phase


def fastops_phase(params, device):
    opt = fastops.optim.AdamW(params, lr=1e-3, max_grad_norm=MAX_NORM)
    scaler = famp.GradScaler(device, init_scale=SCALE, growth_interval=10**6)

    def phase():
        scaler.step(opt)
        scaler.update()

    return scaler, phase


def timed_phases(make, total, args, scaled_grads):
    params = make_params(total, args.tensors, args.device)
    scaler, phase = make(params, args.device)
    scaler.scale(torch.ones((), device=args.device))  # creates the scale tensor, as the forward would

    def reset():
        for p, g in zip(params, scaled_grads):
            p.grad.copy_(g)

    return params, phase, reset


def median_ms(phase, reset, device, repeats):
    samples = []
    for _ in range(repeats):
        reset()  # phases write grads (torch unscales in place): restore them outside the timed region
        common.sync(device)
        start = time.perf_counter()
        phase()
        common.sync(device)
        samples.append(1e3 * (time.perf_counter() - start))
    return samples


def bench_unscale(total, args):
    grads = [p.grad for p in make_params(total, args.tensors, args.device)]
    found, inv = torch.zeros(1, device=args.device), torch.tensor(1.0, device=args.device)
    rows = []
    for name, fn in (
        ("torch_amp_foreach", lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)),
        ("fastops_unscale_check", lambda: torch.ops.fastops.unscale_check_(grads, found, inv)),
    ):
        t = common.time_ms(fn, args.device, repeats=args.repeats * args.rounds)
        rows.append({"bench": "unscale", "provider": name, "params": total, **{k: round(v, 4) for k, v in t.items()},
                     "gbs": round(8 * total / (t["ms"] / 1e3) / 1e9, 2)})
    return rows


def bench_phase(total, args):
    scaled = [torch.randn(p.shape, device=args.device) * 1e-3 * SCALE for p in make_params(total, args.tensors, args.device)]
    setups = {"torch_recipe": timed_phases(torch_phase, total, args, scaled),
              "fastops": timed_phases(fastops_phase, total, args, scaled)}
    # Same start, same grads, one phase each: the params must agree before any time is taken.
    for _, phase, reset in setups.values():
        reset()
        phase()
    diff = max((a - b).abs().max().item() for a, b in zip(setups["torch_recipe"][0], setups["fastops"][0]))
    samples = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (_, phase, reset) in setups.items():
            samples[name] += median_ms(phase, reset, args.device, args.repeats)
    rows = []
    for name, s in samples.items():
        q = statistics.quantiles(s, n=5)
        rows.append({"bench": "phase", "provider": name, "params": total, "ms": round(statistics.median(s), 4),
                     "ms_q20": round(q[0], 4), "ms_q80": round(q[3], 4), "max_param_diff": diff})
    speedup = rows[0]["ms"] / rows[1]["ms"]
    for r in rows:
        r["fastops_speedup"] = round(speedup, 3)
    return rows


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, bench, title in ((axes[0], "unscale", "unscale + inf check"), (axes[1], "phase", "AMP optimizer phase")):
        rs = [r for r in rows if r["bench"] == bench]
        ax.bar([r["provider"] for r in rs], [r["ms"] for r in rs],
               yerr=[[r["ms"] - r["ms_q20"] for r in rs], [r["ms_q80"] - r["ms"] for r in rs]], color=["#999", "#2a7"])
        ax.set_ylabel("ms (median, 20-80%)")
        ax.set_title(f"{title}, {rs[0]['params'] / 1e6:.0f}M fp32 params")
    fig.suptitle(rows[0]["hardware"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--params", type=float, default=24, help="millions")
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.params, args.rounds, args.repeats = 4, 3, 3
    total = int(args.params * 1e6)
    print(f"{common.hardware(args.device)}; fastops backend {fastops._backend.active(args.device.split(':')[0])}")
    rows = bench_unscale(total, args) + bench_phase(total, args)
    for r in rows:
        r["device"], r["hardware"] = args.device, common.hardware(args.device)
        extra = f"{r['gbs']:.1f} GB/s" if "gbs" in r else f"fastops {r['fastops_speedup']:.2f}x faster, max param diff {r['max_param_diff']:.1e}"
        print(f"{r['bench']:8s} {r['provider']:22s} {r['ms']:9.2f} ms  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  {extra}")
    base = common.write_results(args.out or f"amp_{args.device.split(':')[0]}", rows, {"torch": torch.__version__, "argv": sys.argv[1:]})
    plot(rows, base + ".png")
    print(f"wrote {base}.json/.csv/.png")


if __name__ == "__main__":
    main()
