"""Draws benchmark results: one PNG next to each CSV, from the columns every benchmark writes (common.SCHEMA;
files written before it had size_unit and samples draw too). One panel per bench in the file: ms per provider
against a numeric size (log axes, labelled with size_unit), or grouped bars where the sizes are labels; a second
panel of effective GB/s where the rows have a ``gbs`` column, with the roofline (``roofline_gbs``) dashed. Files
whose rows have a ``step`` column (parity_lowp.py) get loss curves against the step instead, one panel per bench
and size. Where one file holds runs on several ``hardware`` (adamw_lowp_cpu.csv: 1 and 2 threads), each
provider gets a line per hardware.

    python benchmarks/plot.py                       # every benchmarks/results/*.csv
    python benchmarks/plot.py results/sgd_cpu.csv   # the files given
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import sys


def _number(x: str):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by provider, and by hardware too where the rows span several (labelled by what differs)."""
    hw = list(dict.fromkeys(r["hardware"] for r in rows))
    prefix = os.path.commonprefix(hw) if len(hw) > 1 else None
    if prefix is not None:  # whole words: "x1 threads", not "1 threads"
        prefix = prefix[: prefix.rfind(" ") + 1]
    out: dict[str, list[dict]] = {}
    for r in rows:
        key = r["provider"] if prefix is None else f"{r['provider']} ({r['hardware'][len(prefix):] or r['hardware']})"
        out.setdefault(key, []).append(r)
    return out


def _size_label(rows: list[dict]) -> str:
    unit = next((r.get("size_unit") for r in rows if r.get("size_unit")), None)
    return f"size ({unit})" if unit and unit != "config" else "size"


def _panel_ms(ax, rows: list[dict]) -> None:
    series = _series(rows)
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    numeric = all(_number(s) is not None for s in sizes) and len(sizes) > 1
    width = 0.8 / len(series)
    for j, (p, rs) in enumerate(series.items()):
        ms = [float(r["ms"]) for r in rs]
        err = [[m - float(r["ms_q20"]) for m, r in zip(ms, rs)], [float(r["ms_q80"]) - m for m, r in zip(ms, rs)]]
        if numeric:
            ax.errorbar([_number(r["size"]) for r in rs], ms, yerr=err, marker="o", capsize=2, label=p)
        else:
            xs = [sizes.index(r["size"]) + (j - (len(series) - 1) / 2) * width for r in rs]
            ax.bar(xs, ms, width, yerr=err, capsize=2, label=p)
    if numeric:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(_size_label(rows))
    else:
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([str(s).replace(" ", "\n", 1) for s in sizes], fontsize=7)
        if _size_label(rows) != "size":  # numbers of one size each: say what they count
            ax.set_xlabel(_size_label(rows))
    ax.set_ylabel("ms (median, 20-80%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _panel_gbs(ax, rows: list[dict]) -> None:
    for p, rs in _series(rows).items():
        rs = [r for r in rs if _number(r.get("gbs")) is not None]
        ax.plot([_number(r["size"]) for r in rs], [float(r["gbs"]) for r in rs], marker="o", label=p)
    for hw, rs in _series([{**r, "provider": "roofline"} for r in rows]).items():
        roof = {}
        for r in rs:
            if _number(r.get("roofline_gbs")) is not None:
                roof.setdefault(_number(r["size"]), float(r["roofline_gbs"]))
        if roof:
            kernel = next((r.get("roofline_kernel") for r in rs if r.get("roofline_kernel")), "")
            ax.plot(list(roof), list(roof.values()), "k--", label=f"{hw} {kernel}".strip())
    ax.set_xscale("log")
    ax.set_xlabel(_size_label(rows))
    ax.set_ylabel("effective GB/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _panel_loss(ax, rows: list[dict]) -> None:
    """Training loss against the step, one line per provider (parity_lowp.py's rows)."""
    for p, rs in _series(rows).items():
        ax.plot([_number(r["step"]) for r in rs], [float(r["loss"]) for r in rs], label=p, linewidth=0.8)
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
    if "step" in rows[0]:  # loss curves: one panel of them per bench and size (the model)
        panels = [(b, s, "loss") for b in benches for s in dict.fromkeys(r["size"] for r in rows if r["bench"] == b)]
    else:
        panels = [(b, None, kind) for b in benches for kind in ("ms", "gbs")
                  if kind == "ms" or any(_number(r.get("gbs")) is not None for r in rows if r["bench"] == b)]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (bench, size, kind) in zip(axes[0], panels):
        rs = [r for r in rows if r["bench"] == bench and size in (None, r["size"])]
        {"ms": _panel_ms, "gbs": _panel_gbs, "loss": _panel_loss}[kind](ax, rs)
        ax.set_title(bench if size is None else f"{bench}: {size}", fontsize=9)
    hardware = list(dict.fromkeys(r["hardware"] for r in rows))
    fig.suptitle(f"{os.path.basename(csv_path)}: {' / '.join(hardware)}", fontsize=9)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="CSV files (default: every benchmarks/results/*.csv)")
    sys.exit(main(ap.parse_args().paths))
