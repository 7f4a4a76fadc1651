"""The demo behind ``python -m fastops demo``: a small GPT-style language model in plain PyTorch, trained on
synthetic text twice with the same seed and batches, first with plain PyTorch (fp32, torch.optim.AdamW
defaults) and then after the one line ``fastops.accelerate(model, optimizer, loader)``. The training loop is
the same function both times. It prints ms/step, tokens/s, final loss and the speed-up, and with ``--out PATH``
writes them as the benchmarks do (PATH.json with the machine, command and load, PATH.csv). No downloads."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 4, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Text from a fixed random sparse bigram model (each token is followed by one of 4 tokens): learnable
    structure, so the loss visibly falls. A dense vocab x vocab table took 68 s for 30 batches at vocab
    8192 here; this takes well under a second."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 4), generator=g)
    probs = torch.softmax(2 * torch.randn(vocab, 4, generator=g), dim=-1)
    tokens = torch.empty(steps * batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (steps * batch,), generator=g)
    for t in range(seq):
        prev = tokens[:, t]
        choice = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
        tokens[:, t + 1] = successors[prev, choice]
    return [(tokens[i : i + batch, :-1], tokens[i : i + batch, 1:]) for i in range(0, steps * batch, batch)]


def train_loop(model, optimizer, loader, device, label: str, tokens_per_step: int) -> dict:
    """The user's loop: the same code for both runs."""
    from tqdm import tqdm

    times, losses = [], []
    start = time.perf_counter()
    bar = tqdm(loader, desc=f"{label:14s}", leave=True)
    for idx, targets in bar:
        idx, targets = idx.to(device), targets.to(device)
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        now = time.perf_counter()
        times.append(now - start)  # from the end of the previous step: includes waiting for the batch
        start = now
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    warmup = min(3, len(times) - 1)  # the first steps warm up kernels; --steps >= 1 leaves one to time
    timed = [1e3 * t for t in times[warmup:]]
    ms = statistics.median(timed)
    q = statistics.quantiles(timed, n=5, method="inclusive") if len(timed) > 1 else [ms] * 4
    return {"label": label, "ms": ms, "ms_q20": q[0], "ms_q80": q[3], "samples": len(timed),
            "tok_s": tokens_per_step / (ms / 1e3), "loss": losses[-1], "losses": losses, "warmup": warmup}


HEADS = 4


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _model_dim(text: str) -> int:
    value = _positive_int(text)
    if value % HEADS:
        raise argparse.ArgumentTypeError(f"must be a multiple of {HEADS} (the attention heads), got {value}")
    return value


def _device(text: str) -> str:
    """Checked while parsing, so a bad device is a usage error instead of a traceback from deep in torch."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use 'cpu' or 'cuda'") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; use 'cpu' or 'cuda'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} needs CUDA, which this torch ({torch.__version__}) does not have or cannot reach; "
                "use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=_positive_int, default=40,
                   help="training steps per run (40: about 20 s in all on 2 CPU cores)")  # fmt: skip
    p.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="precision of the fastops run (auto: bf16 where the device has it natively)")  # fmt: skip
    p.add_argument("--batch", type=_positive_int, default=8)
    p.add_argument("--seq", type=_positive_int, default=128)
    p.add_argument("--dim", type=_model_dim, default=256, help=f"model width, a multiple of {HEADS}")
    p.add_argument("--layers", type=_positive_int, default=4)
    p.add_argument("--vocab", type=_positive_int, default=8192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="PATH",
                   help="also write the results to PATH.json and PATH.csv, as the benchmarks do")  # fmt: skip


def hardware(device: str) -> str:
    """The device's name as results files give it (benchmarks/common.py takes it from here)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name} x{torch.get_num_threads()} threads"


def write_results(path: str, args: argparse.Namespace, rows: list[dict], load_before: tuple, seconds: float) -> None:
    """PATH.json ({"meta", "rows"}, the benchmarks' schema: benchmarks/common.py) and PATH.csv."""
    machine = hardware(args.device)
    size = f"TinyGPT d{args.dim} l{args.layers} v{args.vocab} b{args.batch}x{args.seq}"
    out = []
    for r in rows:
        out.append({"bench": "demo", "provider": r["label"], "size": size, "size_unit": "config",
                    "ms": round(r["ms"], 4), "ms_q20": round(r["ms_q20"], 4), "ms_q80": round(r["ms_q80"], 4),
                    "samples": r["samples"], "device": args.device, "hardware": machine,
                    "speedup_vs_plain": round(rows[0]["ms"] / r["ms"], 3), "tokens_per_s": round(r["tok_s"], 1),
                    "first_loss": round(r["losses"][0], 6), "loss": round(r["loss"], 6)})  # fmt: skip
    options = {k: v for k, v in vars(args).items() if k not in ("cmd", "out")}
    command = "python -m fastops demo " + " ".join(f"--{k} {v}" for k, v in options.items())
    meta = {"command": command, "hardware": machine,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "seconds": round(seconds, 1),
            "final_loss_rel_diff": round(abs(rows[1]["loss"] - rows[0]["loss"]) / abs(rows[0]["loss"]), 6),
            "losses": {r["label"]: r["losses"] for r in rows}}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "rows": out}, f, indent=1)
    with open(path + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    print(f"wrote {path}.json and {path}.csv")


def run(args: argparse.Namespace) -> int:
    from fastops.accelerate import accelerate

    load_before, start = os.getloadavg(), time.perf_counter()
    batches = synthetic_batches(args.steps, args.batch, args.seq, args.vocab, args.seed)
    tokens = args.batch * args.seq

    def fresh():
        torch.manual_seed(args.seed)
        model = TinyGPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=HEADS, seq=args.seq).to(args.device)
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr)

    model, optimizer = fresh()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TinyGPT: {n_params / 1e6:.1f}M params, batch {args.batch} x {args.seq} tokens, {args.steps} steps on {args.device}")
    rows = [train_loop(model, optimizer, batches, args.device, "plain PyTorch", tokens)]

    model, optimizer = fresh()
    # The one line; the loop below it is the same function as above.
    model, optimizer, loader = accelerate(model, optimizer, batches, precision=args.precision, device=args.device)
    acc = optimizer.accelerator
    rows.append(train_loop(model, optimizer, loader, args.device, f"fastops {acc.precision}", tokens))

    base = rows[0]["ms"]
    print(f"\n{'run':16s} {'ms/step':>9s} {'tokens/s':>10s} {'final loss':>11s} {'speed-up':>9s}")
    for r in rows:
        print(f"{r['label']:16s} {r['ms']:9.1f} {r['tok_s']:10.0f} {r['loss']:11.4f} {base / r['ms']:8.2f}x")
    print(f"\nfastops run: fastops.accelerate(model, optimizer, loader) -> precision {acc.precision}, "
          f"strategy {acc.strategy}, fused {type(optimizer).__name__}, batches prefetched; ms/step is the median "
          f"after {rows[-1]['warmup']} warm-up step(s)")  # fmt: skip
    if args.out is not None:
        write_results(args.out, args, rows, load_before, time.perf_counter() - start)
    if not all(math.isfinite(r["loss"]) for r in rows):
        print("a run diverged")
        return 1
    return 0
