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
    python benchmarks/bench_adamw.py --lowp --sizes 4 16   # 8-bit and bf16 states against torch, torchao, bnb

--lowp compares, on the same params: torch fused=True (fp32 states), fastops.optim.AdamW with fp32, bf16 and 8-bit
states (state_dtype=, as users call it), torchao's and bitsandbytes' AdamW8bit where they import. Each provider's GB/s
and roofline share count its own bytes (fp32 p and g: 28 fp32 states, 20 bf16, 16 + 1/32 8-bit; params under
4096 elements keep fp32 states under every 8-bit provider, as bnb and torchao do), and each row gives the
optimizer state held per param.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import fastops  # noqa: E402

class Spec:
    """One optimizer's benchmark: its providers, bytes moved per param (one number, or one per provider), the
    working set a step must keep in cache to run from it, and the roofline kernels (common.STREAM_KERNELS) run
    next to it, with the one it is held to (None: the best of them). Speedups are against ``baseline``."""

    def __init__(self, name, providers, bytes_per_param, working_set, kernels, roofline=None, baseline="fastops"):
        self.name, self.providers, self.bytes_per_param = name, providers, bytes_per_param
        self.working_set, self.kernels, self.roofline = working_set, kernels, roofline
        self.baseline = baseline

    def bytes_of(self, provider: str) -> float:
        b = self.bytes_per_param
        return b[provider] if isinstance(b, dict) else b


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


def _peer(module: str, cls: str):
    """A peer optimizer class, or None where its package does not import here."""
    try:
        return getattr(importlib.import_module(module), cls)
    except Exception as e:  # noqa: BLE001
        print(f"skipping {module}.{cls}: {type(e).__name__}: {e}")
        return None


def lowp_spec() -> Spec:
    providers = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "fastops": lambda ps: fastops.optim.AdamW(ps, lr=1e-3),
        # As users call it: the optimizer with its per-step Python (groups, calls, the bf16 seed), not the bare op.
        "fastops_bf16": lambda ps: fastops.optim.AdamW(ps, lr=1e-3, state_dtype="bf16"),
        "fastops_8bit": lambda ps: fastops.optim.AdamW(ps, lr=1e-3, state_dtype="8bit"),
    }
    ao, bnb = _peer("torchao.optim", "AdamW8bit"), _peer("bitsandbytes.optim", "AdamW8bit")
    if ao is not None:
        providers["torchao_8bit"] = lambda ps: ao(ps, lr=1e-3)
    if bnb is not None:
        providers["bnb_8bit"] = lambda ps: bnb(ps, lr=1e-3)
    eight = 16 + 2 * 4 / 256  # p r/w, g, two 1-byte codes r/w, two fp32 absmax per 256 r/w
    return Spec(
        "adamw_lowp", providers,
        bytes_per_param={"torch_fused": 28, "fastops": 28, "fastops_bf16": 20, "fastops_8bit": eight,
                         "torchao_8bit": eight, "bnb_8bit": eight},
        working_set=16, kernels=("copy", "scale_inplace", "add_inplace", "triad", "adam_pattern"),
        baseline="torch_fused",
    )  # fmt: skip


def torch_default(device: str) -> str:
    """The provider that torch's optimizer without a foreach/fused argument runs on ``device``."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    _, foreach = _default_to_fused_or_foreach([torch.empty(1, device=device)], differentiable=False)
    return "torch_foreach" if foreach else "torch_forloop"


def make_params(total: int, n_tensors: int, device: str, multiple: int = 1) -> list[torch.nn.Parameter]:
    # ~100 tensors of uneven sizes, as in a real model (a few big matrices, many small vectors). ``multiple``:
    # sizes rounded down to it (torchao's AdamW8bit keeps fp32 states for a param whose size is not a multiple
    # of its block of 256, which would make its "8-bit" row an fp32 one).
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
    base = make_params(total, args.tensors, args.device, 256 if spec.baseline != "fastops" else 1)
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
        gbs = spec.bytes_of(name) * total / (common.quantile_row(s)["ms"] / 1e3) / 1e9
        extra = {"state_bytes_per_param": round(state_bytes(opts[name]) / total, 3)} if spec.baseline != "fastops" else {}
        rows.append(common.row(
            spec.name, name, total, s, args.device, tensors=args.tensors, dtype="float32", gbs=round(gbs, 2),
            roofline_gbs=round(roof["roofline_gbs"], 2), roofline_kernel=roof["roofline_kernel"],
            pct_roofline=round(100 * gbs / roof["roofline_gbs"], 1), copy_gbs=round(roof["copy_gbs"], 2),
            pct_copy=round(100 * gbs / roof["copy_gbs"], 1), working_set_mib=round(working_set / 2**20),
            fits_llc=llc is not None and working_set <= llc, bytes_per_param=round(spec.bytes_of(name), 3),
            ns_per_param=round(common.quantile_row(s)["ms"] * 1e6 / total, 3), **extra,
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
    p.add_argument("--lowp", action="store_true", help="8-bit and bf16 states against torch, torchao and bnb")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before the run")
    p.add_argument("--out", default=None,
                   help=f"result name under benchmarks/results, or a path (default {spec.name}_<device>)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.lowp:
        spec = lowp_spec()
        if args.sizes == list(sizes):
            args.sizes = [4, 16]
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
            if spec.baseline in by and spec.baseline != "fastops":
                r[f"speedup_vs_{spec.baseline}"] = round(by[spec.baseline]["ms"] / r["ms"], 3)
            elif "fastops" in by:
                r["fastops_speedup"] = round(r["ms"] / by["fastops"]["ms"], 3)
            r["torch_default"] = r["provider"] == default
            print(f"        {r['provider']:14s} {r['ms']:9.2f} ms  [{r['ms_q20']:.2f}, {r['ms_q80']:.2f}]  "
                  f"{r['gbs']:6.1f} GB/s = {r['pct_roofline']:5.1f}% of roofline, {r['pct_copy']:5.1f}% of copy"
                  + (f"; fastops is {r['fastops_speedup']:.2f}x this" if "fastops_speedup" in r else "")
                  + (f"; {r['speedup_vs_' + spec.baseline]:.2f}x {spec.baseline}" if "speedup_vs_" + spec.baseline in r else "")
                  + (f"; {r['ns_per_param']:.2f} ns/param, state {r['state_bytes_per_param']:.2f} B/param"
                     if "state_bytes_per_param" in r else "")
                  + ("  (torch default)" if r["torch_default"] else ""))  # fmt: skip
        rows += size_rows
    name = args.out or f"{spec.name}_{dev_type}"
    meta = {"roofline": roofs, "torch_default": default, "llc_bytes": llc, "torch": torch.__version__,
            "argv": sys.argv[1:]}  # fmt: skip
    base = common.write_results(name, rows, meta)
    print(f"wrote {base}.json/.csv (and .png with matplotlib)")


if __name__ == "__main__":
    main()
