"""What bench_train.py measures beside the step time: the FLOPs of a step, the machine's bf16 GEMM peak, the
training memory (resident set) and where a step's time goes (torch.profiler, by category).

- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of the unmodified model under
  bf16 autocast (matmuls, convolutions, attention: what the counter counts). MFU = FLOPs / step time / peak.
- Peak: a bf16 ``a @ b``, 2048 x 1024 @ 1024 x 4096, timed in its own process in the same interleaved rounds as
  the providers, so load from other processes hits it as it hits them.
- Memory: peak resident set during the steps minus the resident set before the first step (Linux: VmHWM is
  reset through /proc/self/clear_refs just before the first step).
- Breakdown: self time of every profiled op, summed by category (CATEGORIES), per step; the time no op covers
  (Python, the autograd engine's own work, record_function ranges) is "python + autograd". The share of the
  step in GEMM + conv and the FLOPs over that time (the matmuls' own efficiency) bound the MFU: MFU <=
  gemm_share * gemm_efficiency.
"""

from __future__ import annotations

import re
import statistics
import time

import torch

PEAK_SHAPE = (2048, 1024, 4096)  # M, K, N

# (category, pattern on the op name); first match wins. Self times only, so nested ops count once.
CATEGORIES = [
    ("fused loss", re.compile(r"^fastops::linear_cross_entropy|linear_ce")),
    ("optimizer", re.compile(r"^fastops::(adam|sgd|grad_stats|unscale)|_fused_adam|_fused_sgd|Optimizer\.step")),
    ("gemm+conv", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_mm|convolution_backward|mkldnn_convolution|"
                             r"_convolution|convolution|_weight_int|mkldnn_linear|_addmm_activation|linear)$"
                             r"|^mkldnn::|onednn|^extern_kernels")),
    ("attention", re.compile(r"attention|_flash_|sdpa", re.I)),
    ("allocator", re.compile(r"^aten::(empty|empty_strided|empty_like|resize_|zeros|new_empty|new_empty_strided)$")),
    ("compiled code", re.compile(r"^(Torch-Compiled Region|CompiledFunction|## Call CompiledFxGraph|"
                                 r"cpp_fused|graph_|inductor)", re.I)),
    ("python + autograd", re.compile(r"^(## |autograd::engine|.*Backward\d*$|torch/|<built-in)")),
]
OTHER = "elementwise+norms"


def flops_per_step(model, batch, loss_fn, device) -> int:
    """FLOPs of one bf16 forward + backward of the unmodified ``model`` on ``batch``."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch.utils._pytree import tree_map

    model.to(device).train()
    batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.backward()
    return int(counter.get_total_flops())


def gemm_samples(device: str, clock=None, repeats: int = 7) -> list[float]:
    """ms of the bf16 peak matmul, ``repeats`` times after two warm-up calls, by ``clock`` (default wall)."""
    clock = clock or time.perf_counter
    m, k, n = PEAK_SHAPE
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    out = []
    for i in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = clock()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            out.append(1e3 * (clock() - t))
    return out


def gemm_gflops(ms: float) -> float:
    m, k, n = PEAK_SHAPE
    return 2 * m * k * n / ms / 1e6


def _status(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    return None


def rss_start() -> float | None:
    """The resident set now (MiB), with the high-water mark reset to it; None where Linux's files are missing."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    return _status("VmRSS")


def rss_peak() -> float | None:
    return _status("VmHWM")


def breakdown(prof, steps: int) -> dict[str, float]:
    """ms per step by category, from the self CPU times of a profile of ``steps`` steps; "step" is the sum."""
    out: dict[str, float] = {}
    for e in prof.events():
        name = e.name
        cat = next((c for c, pat in CATEGORIES if pat.search(name)), OTHER)
        out[cat] = out.get(cat, 0.0) + e.self_cpu_time_total / 1e3 / steps
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def profile(step, steps: int, title: str) -> tuple[dict[str, float], str]:
    """``steps`` calls of ``step`` under torch.profiler: the breakdown (plus "wall", ms per step under the
    profiler) and a text table of the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall = 1e3 * (time.perf_counter() - start) / steps
    cats = breakdown(prof, steps)
    covered = sum(cats.values())
    # Time the profiler saw no op in (the loop's Python, waiting for the loader) joins python + autograd.
    cats["python + autograd"] = round(cats.get("python + autograd", 0.0) + max(0.0, wall - covered), 2)
    cats["wall"] = round(wall, 2)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
    lines = [f"==== {title}: {steps} steps, {wall:.1f} ms per step under the profiler",
             "  " + ", ".join(f"{k} {v:.1f}" for k, v in cats.items() if k != "wall")]
    return cats, "\n".join(lines) + "\n" + table + "\n"


def median(xs: list[float]) -> float:
    return statistics.median(xs)
