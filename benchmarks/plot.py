"""Draws benchmark results: one PNG next to each CSV, from the columns every benchmark writes
(common.SCHEMA: bench, provider, size, ms, ms_q20, ms_q80, device, hardware). One panel per bench in the file:
ms per provider against a numeric size (log axes), or grouped bars where the sizes are labels; a second panel of
effective GB/s where the rows have a ``gbs`` column, with the roofline (``roofline_gbs``) dashed. Files whose rows
have a ``loss`` column (parity_lowp.py) get loss curves against the step instead, one panel per bench.

    python benchmarks/plot.py                       # every benchmarks/results/*.csv
    python benchmarks/plot.py results/sgd_cpu.csv   # the files given
"""

from __future__ import annotations

import csv
import glob
import os
import sys


def _number(x: str):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _panel_ms(ax, rows: list[dict]) -> None:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    numeric = all(_number(s) is not None for s in sizes) and len(sizes) > 1
    width = 0.8 / len(providers)
    for j, p in enumerate(providers):
        rs = [r for r in rows if r["provider"] == p]
        ms = [float(r["ms"]) for r in rs]
        err = [[m - float(r["ms_q20"]) for m, r in zip(ms, rs)], [float(r["ms_q80"]) - m for m, r in zip(ms, rs)]]
        if numeric:
            ax.errorbar([_number(r["size"]) for r in rs], ms, yerr=err, marker="o", capsize=2, label=p)
        else:
            xs = [sizes.index(r["size"]) + (j - (len(providers) - 1) / 2) * width for r in rs]
            ax.bar(xs, ms, width, yerr=err, capsize=2, label=p)
    if numeric:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("size")
    else:
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([str(s).replace(" ", "\n", 1) for s in sizes], fontsize=7)
    ax.set_ylabel("ms (median, 20-80%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _panel_gbs(ax, rows: list[dict]) -> None:
    for p in dict.fromkeys(r["provider"] for r in rows):
        rs = [r for r in rows if r["provider"] == p and _number(r.get("gbs")) is not None]
        ax.plot([_number(r["size"]) for r in rs], [float(r["gbs"]) for r in rs], marker="o", label=p)
    roof = {}
    for r in rows:
        if _number(r.get("roofline_gbs")) is not None:
            roof.setdefault(_number(r["size"]), float(r["roofline_gbs"]))
    if roof:
        kernel = next((r.get("roofline_kernel") for r in rows if r.get("roofline_kernel")), "")
        ax.plot(list(roof), list(roof.values()), "k--", label=f"roofline {kernel}".strip())
    ax.set_xscale("log")
    ax.set_xlabel("size")
    ax.set_ylabel("effective GB/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _panel_loss(ax, rows: list[dict]) -> None:
    """Training loss against the step (``size``), one line per provider (parity_lowp.py's rows)."""
    for p in dict.fromkeys(r["provider"] for r in rows):
        rs = [r for r in rows if r["provider"] == p]
        ax.plot([_number(r["size"]) for r in rs], [float(r["loss"]) for r in rs], label=p, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def draw(csv_path: str) -> str | None:
    """``csv_path`` as a PNG next to it; None (and a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot for {csv_path}")
        return None
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    benches = list(dict.fromkeys(r["bench"] for r in rows))
    if any(_number(r.get("loss")) is not None for r in rows):  # loss curves: one panel of them per bench
        panels = [(b, "loss") for b in benches]
    else:
        panels = [(b, kind) for b in benches for kind in ("ms", "gbs")
                  if kind == "ms" or any(_number(r.get("gbs")) is not None for r in rows if r["bench"] == b)]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (bench, kind) in zip(axes[0], panels):
        rs = [r for r in rows if r["bench"] == bench]
        {"ms": _panel_ms, "gbs": _panel_gbs, "loss": _panel_loss}[kind](ax, rs)
        ax.set_title(bench, fontsize=9)
    fig.suptitle(f"{os.path.basename(csv_path)}: {rows[0]['hardware']}", fontsize=9)
    fig.tight_layout()
    out = os.path.splitext(csv_path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(paths: list[str]) -> int:
    paths = paths or sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "*.csv")))
    for path in paths:
        out = draw(path)
        if out:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
