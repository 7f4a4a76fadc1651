"""The AMP optimizer phase: torch's recipe against fastops', plus the unscale kernel on its own.

(a) ``torch.ops.fastops.unscale_check_`` vs ``torch._amp_foreach_non_finite_check_and_unscale_``, with
    inv_scale alternating 2**-16 and 2**16: exact in fp32, the grads stay normal and return to their start,
    and both kernels read and write every element (at inv_scale == 1 fastops' CPU kernel only reads, which
    would compare 4 bytes/element against torch's 8). Providers are interleaved round by round; GB/s counts
    the bytes each provider moves.
(b) The whole phase at 24M fp32 params in 100 tensors, from the same scaled grads:
    torch:   AdamW(fused=True) + GradScaler: unscale_, clip_grad_norm_, step, update
    fastops: AdamW(max_grad_norm=...) + fastops.amp.GradScaler: step, update
    Before timing, both run three phases from identical states on grads whose unscaled norms are 0.25, 4 and
    0.5 x max_norm (only the second is clipped); their params must then agree within check_atol, or the script
    exits with status 1.

    python benchmarks/bench_amp.py            # CPU
    python benchmarks/bench_amp.py --quick    # 4M params, a few seconds
    python benchmarks/bench_amp.py --device cuda
    python benchmarks/bench_amp.py --quick --out scratch_amp   # a trial run that keeps results/amp_* as they are
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from runner import make_params  # noqa: E402

import fastops  # noqa: E402
import fastops.amp as famp  # noqa: E402

SCALE = 2.0**16
MAX_NORM = 1.0
LR = 1e-3
# Unscale factors for (a): powers of two, so x * 2**-16 * 2**16 == x exactly; grads of ~1e-3 become ~1.5e-8,
# far above fp32's smallest normal (1.2e-38), so no denormal slows either kernel.
INV_PAIR = (2.0**-16, 2.0**16)
# Unscaled grad norms of the three check phases, in units of MAX_NORM: the middle one is clipped. Adam is
# invariant to a constant grad scale, so phases that are all clipped (or none) would hide a missing unscale
# or clip; mixing them makes each phase's weight in m and v depend on both.
CHECK_NORMS = (0.25, 4.0, 0.5)


def check_atol(params) -> float:
    """The params may differ by rounding only. Each phase moves a param by about LR and rounds it once: 2 ulp
    of the largest |param| per phase, plus LR * 1e-5 per phase for the two orders of the unscale and clip
    (grad / scale * coef vs grad / (scale / coef), a few fp32 ulp apart, through m / sqrt(v)). Measured at 4M
    and 24M params: 1.5e-8 against a tolerance of 7.5e-8; dropping the clip from torch's recipe makes it
    1.2e-3, dropping its unscale 1.1e-3."""
    biggest = max(p.abs().max().item() for p in params)
    ulp = torch.finfo(torch.float32).eps * 2.0 ** torch.tensor(biggest).log2().floor().item()
    return len(CHECK_NORMS) * (2 * ulp + LR * 1e-5)


def torch_phase(params, device):
    opt = torch.optim.AdamW(params, lr=LR, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=SCALE, growth_interval=10**6)

    def phase():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(opt)
        scaler.update()

    return scaler, phase


def fastops_phase(params, device):
    opt = fastops.optim.AdamW(params, lr=LR, max_grad_norm=MAX_NORM)
    scaler = famp.GradScaler(device, init_scale=SCALE, growth_interval=10**6)

    def phase():
        scaler.step(opt)
        scaler.update()

    return scaler, phase


def timed_phases(make, total, args):
    params = make_params(total, args.tensors, args.device)
    scaler, phase = make(params, args.device)
    scaler.scale(torch.ones((), device=args.device))  # creates the scale tensor, as the forward would

    def load(grads):
        for p, g in zip(params, grads):
            p.grad.copy_(g)

    return params, phase, load


def scaled_grads(params, seed, unscaled_norm=None):
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(p.device) for p in params]
    if unscaled_norm is not None:
        norm = torch.stack([x.double().norm() for x in grads]).norm().item()
        grads = [x * (unscaled_norm / norm) for x in grads]
    return [x * SCALE for x in grads]


def unscale_bytes(provider: str, inv: float, device: str) -> int:
    """Bytes per element one call moves: a read and a write of every element, except fastops' CPU kernel at
    inv == 1, which only reads (x * 1 == x)."""
    if provider.startswith("fastops") and inv == 1.0 and device == "cpu":
        return 4
    return 8


def bench_unscale(total, args):
    grads = [p.grad for p in make_params(total, args.tensors, args.device)]
    found = torch.zeros(1, device=args.device)
    invs = [torch.tensor(x, device=args.device) for x in INV_PAIR]
    kernels = {
        "torch_amp_foreach": torch._amp_foreach_non_finite_check_and_unscale_,
        "fastops_unscale_check": torch.ops.fastops.unscale_check_,
    }

    def pair(fn):  # two passes, after which the grads are back to their start bit for bit
        fn(grads, found, invs[0])
        fn(grads, found, invs[1])

    for fn in kernels.values():
        pair(fn)
    # a sample: the median of ``repeats`` pairs, per call
    measure = {name: (lambda fn=fn: common.time_ms(lambda: pair(fn), args.device, args.repeats, warmup=0)["ms"] / 2)
               for name, fn in kernels.items()}  # fmt: skip
    samples = common.interleaved(measure, args.rounds)
    if found.item() != 0:
        raise SystemExit("bench_amp: found_inf set by finite grads")
    rows = []
    for name, s in samples.items():
        per_elem = sum(unscale_bytes(name, inv, args.device) for inv in INV_PAIR) / len(INV_PAIR)
        gbs = per_elem * total / (common.quantile_row(s)["ms"] / 1e3) / 1e9
        rows.append(common.row("unscale", name, total, s, args.device, size_unit="params", bytes_per_elem=per_elem,
                               gbs=round(gbs, 2)))  # fmt: skip
    common.fastops_speedup(rows, "fastops_unscale_check")
    return rows


def check_phase(total, args) -> dict:
    """Three phases of each recipe from identical params and grads; the largest param difference."""
    setups = {"torch_recipe": timed_phases(torch_phase, total, args),
              "fastops": timed_phases(fastops_phase, total, args)}
    for k, norm in enumerate(CHECK_NORMS):
        grads = scaled_grads(setups["fastops"][0], seed=100 + k, unscaled_norm=norm * MAX_NORM)
        for _, phase, load in setups.values():
            load(grads)
            phase()
    a, b = setups["torch_recipe"][0], setups["fastops"][0]
    diff = max((x - y).abs().max().item() for x, y in zip(a, b))
    moved = max((x - y).abs().max().item() for x, y in zip(a, make_params(total, args.tensors, args.device)))
    return {"max_param_diff": diff, "atol": check_atol(a), "max_param_change": moved}


def bench_phase(total, args):
    setups = {"torch_recipe": timed_phases(torch_phase, total, args),
              "fastops": timed_phases(fastops_phase, total, args)}
    scaled = scaled_grads(setups["fastops"][0], seed=1)
    for _, phase, load in setups.values():  # warm-up: optimizer state, scale tensor
        load(scaled)
        phase()
    # Every phase is a sample. Phases write grads (torch unscales in place): reset restores them outside the
    # timed region.
    def measure(phase, load):
        return lambda: common.time_samples(phase, args.device, args.repeats, warmup=0, reset=lambda: load(scaled))

    samples = common.interleaved({name: measure(ph, ld) for name, (_, ph, ld) in setups.items()}, args.rounds)
    rows = [common.row("phase", name, total, s, args.device, size_unit="params") for name, s in samples.items()]
    common.fastops_speedup(rows)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--params", type=float, default=24, help="millions")
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="result name under benchmarks/results, or a path (default amp_<device>)")
    args = p.parse_args()
    if args.quick:
        args.params, args.rounds, args.repeats = 4, 3, 3
    total = int(args.params * 1e6)
    hw = common.hardware(args.device)
    print(f"{hw}; fastops backend {fastops._backend.active(args.device.split(':')[0])}")
    check = check_phase(total, args)
    ok = check["max_param_diff"] <= check["atol"]
    print(f"params after {len(CHECK_NORMS)} phases (unscaled grad norms {CHECK_NORMS} x max_norm): torch recipe vs "
          f"fastops max |diff| {check['max_param_diff']:.2e}, tolerance {check['atol']:.2e} "
          f"(largest change from the start {check['max_param_change']:.2e}): {'ok' if ok else 'MISMATCH'}")  # fmt: skip
    rows = bench_unscale(total, args) + bench_phase(total, args)
    for r in rows:
        if r["bench"] == "phase":
            r.update(max_param_diff=check["max_param_diff"], param_atol=check["atol"])
        extra = f"{r['gbs']:.1f} GB/s at {r['bytes_per_elem']:g} B/elem" if "gbs" in r else ""
        speed = f"fastops {r['fastops_speedup']:.2f}x faster" if not r["provider"].startswith("fastops") else ""
        print(f"{r['bench']:8s} {r['provider']:22s} {r['ms']:9.2f} ms  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
              f"{extra}  {speed}")  # fmt: skip
    meta = {"torch": torch.__version__, "argv": sys.argv[1:], "inv_pair": INV_PAIR, "check": check}
    base = common.write_results(args.out or f"amp_{args.device.split(':')[0]}", rows, meta)
    print(f"wrote {base}.json/.csv (and .png with matplotlib)")
    if not ok:
        print("bench_amp: the two recipes' params differ beyond rounding", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
