"""Train a small transformer classifier with plain PyTorch code plus one line of fastops.

    python examples/train_one_line.py                              # one process
    torchrun --nproc_per_node=2 examples/train_one_line.py         # DDP, the data sharded across ranks

The one line picks bf16 where the hardware has it, swaps torch's AdamW for fastops' fused one, wraps the
model in DDP under torchrun, shards and prefetches the loader. Everything else is ordinary PyTorch.
"""

import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fastops.accelerate import accelerate


class Classifier(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.emb(tokens)).mean(dim=1))


def dataset(n=2048, seq=32, vocab=256, classes=4):
    """Label = which quarter of the vocabulary the sequence's most common token falls in."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (n, seq), generator=g)
    tokens[:, : seq // 2] = tokens[:, :1]  # half of each sequence repeats its first token
    return TensorDataset(tokens, tokens[:, 0] * classes // vocab)


def main():
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(), batch_size=64, shuffle=True)

    model, optimizer, loader = accelerate(model, optimizer, loader, grad_clip=1.0)  # the one line

    acc = optimizer.accelerator
    for epoch in range(3):
        for tokens, labels in loader:
            loss = F.cross_entropy(model(tokens), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if acc.is_main:
            print(f"epoch {epoch}: loss {loss.item():.4f} ({acc.world_size} process(es), {acc.strategy}, {acc.precision})")

    path = os.path.join(tempfile.gettempdir(), "fastops_one_line.pt")
    acc.save(path)  # every rank calls it (it gathers each rank's RNG state); rank 0 writes
    acc.load(path)  # each rank reads the file and gets its own RNG state back
    if acc.is_main:
        print(f"saved and reloaded {path} at step {acc.step}")


if __name__ == "__main__":
    main()
