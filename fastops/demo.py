"""The demo behind ``python -m fastops demo``: a small GPT-style language model in plain PyTorch, trained
on synthetic text twice, first with plain PyTorch and then with fastops switched on by one line, with the
same seed and data. It prints ms/step, tokens/s, final loss and the speed-up. No downloads."""

from __future__ import annotations

import argparse
import math
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
    """Text from a fixed random bigram model: learnable structure, so the loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    transition = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=-1)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(transition[tokens[:, t]], 1, generator=g).squeeze(1)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train(label: str, use_fastops: bool, batches, args) -> dict[str, float]:
    from tqdm import tqdm

    import fastops

    torch.manual_seed(args.seed)
    model = TinyGPT(vocab=args.vocab, dim=args.dim, layers=args.layers, seq=args.seq).to(args.device)
    ctx = fastops.patched() if use_fastops else _nullcontext()
    times, loss = [], float("nan")
    with ctx:
        # The user's code, unchanged: under fastops.patched() this AdamW is fastops' fused one.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        for idx, targets in tqdm(batches, desc=label, leave=True):
            idx, targets = idx.to(args.device), targets.to(args.device)
            start = time.perf_counter()
            loss_t = model(idx, targets)
            loss_t.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_t.item()
            times.append(time.perf_counter() - start)
    warm = times[min(3, len(times) - 1):]
    ms = 1e3 * statistics.median(warm)
    return {"label": label, "ms": ms, "tok_s": args.batch * args.seq / (ms / 1e3), "loss": loss}


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    batches = synthetic_batches(args.steps, args.batch, args.seq, args.vocab, args.seed)
    n_params = sum(p.numel() for p in TinyGPT(args.vocab, args.dim, args.layers, seq=args.seq).parameters())
    print(f"TinyGPT: {n_params / 1e6:.1f}M params, batch {args.batch} x {args.seq} tokens, {args.steps} steps on {args.device}")
    rows = [train("plain PyTorch", False, batches, args), train("fastops", True, batches, args)]
    base = rows[0]["ms"]
    print(f"\n{'run':16s} {'ms/step':>9s} {'tokens/s':>10s} {'final loss':>11s} {'speed-up':>9s}")
    for r in rows:
        print(f"{r['label']:16s} {r['ms']:9.1f} {r['tok_s']:10.0f} {r['loss']:11.4f} {base / r['ms']:8.2f}x")
    if not all(math.isfinite(r["loss"]) for r in rows):
        print("a run diverged")
        return 1
    return 0
