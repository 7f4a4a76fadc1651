"""Timing and result files shared by the benchmark scripts: medians with 20/80% quantiles, one CSV and one
JSON per run, rows of provider/size/ms/hardware, and the machine's copy bandwidth as the roofline."""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median and 20/80% quantiles of ``fn``'s wall time in ms, synchronising the device around each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(1e3 * (time.perf_counter() - start))
    q = statistics.quantiles(samples, n=5) if len(samples) >= 5 else [min(samples)] * 4
    return {"ms": statistics.median(samples), "ms_q20": q[0], "ms_q80": q[3]}


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 28, repeats: int = 10) -> float:
    """Effective bandwidth of ``dst.copy_(src)`` (bytes read + bytes written), the roofline for streaming kernels."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / (t["ms"] / 1e3) / 1e9


def write_results(name: str, rows: list[dict], meta: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, name)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(base + ".csv", "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return base
