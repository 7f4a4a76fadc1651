"""End-to-end training step time: a BERT-like encoder with an MLM loss and a ResNet-50, written in plain
PyTorch, trained by

- torch fp32: the plain loop, torch.optim.AdamW defaults (foreach);
- torch bf16 tuned: bf16 autocast + torch.optim.AdamW(fused=True);
- HF-recipe bf16 (torch): bf16 autocast + the user's AdamW unchanged, which is what HF Accelerate's
  mixed_precision="bf16" runs on a CPU; a stand-in when `accelerate` is not installed;
- HF Accelerate bf16: Accelerator(mixed_precision="bf16"), when `import accelerate` works;
- fastops.accelerate: the one line (precision "auto": bf16 where the CPU has it natively).

Every provider starts from the same weights and batches; their first-step losses must agree within bf16
tolerance. Steps are interleaved (one step of each provider per round), so load from other processes on a
shared machine hits all providers alike; medians with 20/80% quantiles.

    python benchmarks/bench_train.py            # ~3 min on 2 CPU cores
    python benchmarks/bench_train.py --quick    # < 1 min smoke run

Results: benchmarks/results/train_{cpu,cuda}.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import hardware, sync, write_results  # noqa: E402

from fastops.accelerate import accelerate  # noqa: E402

# ---- models ----------------------------------------------------------------------------------------------


class EncoderLayer(nn.Module):
    """BERT's post-LN layer."""

    def __init__(self, dim: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff1, self.ff2 = nn.Linear(dim, ff), nn.Linear(ff, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        x = self.ln1(x + self.drop(self.out(att.transpose(1, 2).reshape(b, t, d))))
        return self.ln2(x + self.drop(self.ff2(F.gelu(self.ff1(x)))))


class BertMLM(nn.Module):
    def __init__(self, vocab=8192, dim=256, layers=4, heads=4, seq=128, dropout=0.1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.ln, self.drop = nn.LayerNorm(dim), nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, dropout) for _ in range(layers))
        self.transform, self.ln_head = nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.decoder = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))))
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.ln_head(F.gelu(self.transform(x))))  # logits at every position, as HF's


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(n):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def bert_case(batch=16, seq=128, vocab=8192):
    def batches(n, seed=0):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            ids = torch.randint(vocab, (batch, seq), generator=g)
            labels = torch.full_like(ids, -100)
            mask = torch.rand(batch, seq, generator=g) < 0.15  # MLM: predict 15% of the tokens
            labels[mask] = ids[mask]
            out.append((ids.masked_fill(mask, 0), labels))
        return out

    def loss_fn(model, batch):
        ids, labels = batch
        logits = model(ids)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)

    return dict(name=f"bert-4x256 b{batch} s{seq}", make=lambda: BertMLM(vocab=vocab, seq=seq), batches=batches,
                loss=loss_fn, tokens=batch * seq)  # fmt: skip


def resnet_case(batch=8, size=64):
    def batches(n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(1000, (batch,), generator=g)) for _ in range(n)]

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return dict(name=f"resnet50 b{batch} {size}x{size}", make=ResNet50, batches=batches, loss=loss_fn, tokens=batch)


# ---- providers: each returns an iterator whose next() runs one training step and gives the loss ------------


def _steps(model, opt, loader, loss_fn, autocast=None, backward=None):
    while True:
        for batch in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
                loss = loss_fn(model, batch)
            (backward or torch.Tensor.backward)(loss)
            opt.step()
            opt.zero_grad()
            yield loss.detach()


def torch_fp32(model, data, loss_fn):
    return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-4), data, loss_fn)


def torch_bf16_tuned(model, data, loss_fn):
    return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), data, loss_fn, autocast="bf16")


def hf_recipe_bf16(model, data, loss_fn):
    return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-4), data, loss_fn, autocast="bf16")


def hf_accelerate_bf16(model, data, loss_fn):
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="bf16", cpu=not torch.cuda.is_available())
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return _steps(model, opt, data, loss_fn, backward=acc.backward)


def fastops_accelerate(model, data, loss_fn):
    model, opt, loader = accelerate(model, torch.optim.AdamW(model.parameters(), lr=1e-4), data)
    return _steps(model, opt, loader, loss_fn)


def providers() -> dict:
    out = {"torch fp32": torch_fp32, "torch bf16 tuned": torch_bf16_tuned, "HF-recipe bf16 (torch)": hf_recipe_bf16}
    try:
        import accelerate as _hf  # noqa: F401

        out["HF Accelerate bf16"] = hf_accelerate_bf16
    except ImportError:
        print("note: HF Accelerate is not installed (`import accelerate` failed); its provider is skipped, and "
              "'HF-recipe bf16 (torch)' runs the same recipe (bf16 autocast, the user's AdamW) in plain torch")  # fmt: skip
    out["fastops.accelerate"] = fastops_accelerate
    return out


def run_case(case: dict, makers: dict, rounds: int, warmup: int, device: str) -> list[dict]:
    runners, first_loss = {}, {}
    data = case["batches"](rounds + warmup)
    for label, make in makers.items():
        torch.manual_seed(0)  # same weights and dropout masks for every provider
        runners[label] = make(case["make"](), data, case["loss"])
    samples = {label: [] for label in runners}
    for r in range(rounds + warmup):
        for label, it in runners.items():
            torch.manual_seed(1000 + r)
            sync(device)
            start = time.perf_counter()
            loss = next(it)
            loss_value = loss.item()  # the step is done (and synced) once its loss is on the host
            elapsed = 1e3 * (time.perf_counter() - start)
            if r == 0:
                first_loss[label] = loss_value
            if r >= warmup:
                samples[label].append(elapsed)
    base = statistics.median(samples["torch fp32"])
    rows = []
    for label, xs in samples.items():
        q = statistics.quantiles(xs, n=5, method="inclusive")
        ms = statistics.median(xs)
        rows.append({
            "model": case["name"], "provider": label, "ms": round(ms, 2), "ms_q20": round(q[0], 2), "ms_q80": round(q[3], 2),
            "speedup_vs_fp32": round(base / ms, 3), "first_loss": round(first_loss[label], 5),
            "loss_rel_diff_vs_fp32": round(abs(first_loss[label] / first_loss["torch fp32"] - 1), 5),
            "samples": len(xs), "hardware": hardware(device),
        })  # fmt: skip
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4))
    for ax, model in zip(axes if len(models) > 1 else [axes], models):
        rs = [r for r in rows if r["model"] == model]
        ms = [r["ms"] for r in rs]
        err = [[r["ms"] - r["ms_q20"] for r in rs], [r["ms_q80"] - r["ms"] for r in rs]]
        ax.barh([r["provider"] for r in rs], ms, xerr=err, color="tab:blue")
        for i, r in enumerate(rs):
            ax.text(r["ms_q80"], i, f" {r['speedup_vs_fp32']:.2f}x", va="center")
        ax.set_title(model)
        ax.set_xlabel("ms per training step (median, 20/80% quantiles)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per provider (default 15, quick 4)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        print("note: this benchmark's providers are written for the CPU (autocast device 'cpu'); run it on the CPU")
        return 1
    rounds = args.rounds or (4 if args.quick else 15)
    warmup = 1 if args.quick else 3
    rows, makers = [], providers()
    for case in (bert_case(), resnet_case()):
        print(f"{case['name']}: {rounds} rounds after {warmup} warm-up", flush=True)
        case_rows = run_case(case, makers, rounds, warmup, device)
        for r in case_rows:
            print(f"  {r['provider']:24s} {r['ms']:8.1f} ms [{r['ms_q20']:.1f}, {r['ms_q80']:.1f}]  "
                  f"{r['speedup_vs_fp32']:5.2f}x  first loss {r['first_loss']:.4f}")  # fmt: skip
        rows += case_rows
    bad = [r for r in rows if r["loss_rel_diff_vs_fp32"] > 2e-2]
    for r in bad:
        print(f"LOSS MISMATCH: {r['model']} {r['provider']}: first loss {r['first_loss']} vs fp32 (> 2% apart)")
    load = os.getloadavg()
    meta = {"device": device, "hardware": hardware(device), "torch": torch.__version__, "rounds": rounds,
            "warmup": warmup, "threads": torch.get_num_threads(), "loadavg_at_end": load,
            "note": "interleaved rounds; the CPU may be shared with other processes (see loadavg_at_end)"}  # fmt: skip
    base = write_results(f"train_{device}", rows, meta)
    plot(rows, base + ".png")
    print(f"load average at the end: {load[0]:.2f} (2 cores: above ~2 means other processes competed)")
    print(f"wrote {base}.json/.csv/.png")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
