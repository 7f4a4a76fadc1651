"""Train a small transformer classifier with plain PyTorch code plus one line of fastops.

    python examples/train_one_line.py                              # one process
    torchrun --nproc_per_node=2 examples/train_one_line.py         # DDP, the data sharded across ranks
    torchrun --nproc_per_node=4 examples/train_one_line.py --strategy tp       # tensor parallel 2 x data parallel 2
    torchrun --nproc_per_node=4 examples/train_one_line.py --strategy fsdp+tp  # FSDP2 over dp x TP on one mesh
    torchrun --nproc_per_node=2 examples/train_one_line.py --strategy pp       # 2 pipeline stages

Under --strategy pp the schedule runs forward and backward itself: the loop's two lines
``loss = F.cross_entropy(model(tokens), labels); loss.backward()`` become
``loss = acc.train_step((tokens, labels), F.cross_entropy)``; the rest of the loop stays.

The one line picks bf16 where the hardware has it, swaps torch's AdamW for fastops' fused one, wraps the
model in DDP under torchrun, shards and prefetches the loader. Everything else is ordinary PyTorch.
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fastops.accelerate import accelerate


class MeanPool(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def classifier(vocab=256, dim=64, layers=2, classes=4):
    # nn.Sequential: pipeline parallelism cuts it into stages between children.
    return nn.Sequential(
        nn.Embedding(vocab, dim),
        *(nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True) for _ in range(layers)),
        MeanPool(),
        nn.Linear(dim, classes),
    )


# Tensor parallel over the feed-forward of each encoder layer (attention's packed in_proj has no TP style).
TP_PLAN = {"*.linear1": "colwise", "*.linear2": "rowwise"}


def dataset(n=2048, seq=32, vocab=256, classes=4):
    """Label = which quarter of the vocabulary the sequence's most common token falls in."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (n, seq), generator=g)
    tokens[:, : seq // 2] = tokens[:, :1]  # half of each sequence repeats its first token
    return TensorDataset(tokens, tokens[:, 0] * classes // vocab)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp", "tp", "fsdp+tp", "pp", "none"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--ckpt", default=None, help="checkpoint path (default: one in the temp directory)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(args.samples), batch_size=64, shuffle=True)
    parallel = {"tp": dict(tp_size=2, tp_plan=TP_PLAN), "fsdp+tp": dict(tp_size=2, tp_plan=TP_PLAN),
                "pp": dict(pp_size=2, n_microbatches=4)}.get(args.strategy, {})  # fmt: skip

    model, optimizer, loader = accelerate(model, optimizer, loader, grad_clip=1.0, strategy=args.strategy,
                                          **parallel)  # the one line  # fmt: skip

    acc = optimizer.accelerator
    for epoch in range(args.epochs):
        for tokens, labels in loader:
            if args.strategy == "pp":
                loss = acc.train_step((tokens, labels), F.cross_entropy)
            else:
                loss = F.cross_entropy(model(tokens), labels)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if acc.is_main:
            print(f"epoch {epoch}: loss {loss.item():.4f} ({acc.world_size} process(es), {acc.strategy}, {acc.precision})")

    path = args.ckpt or os.path.join(tempfile.gettempdir(), f"fastops_one_line_{args.strategy}.pt")
    acc.save(path)  # every rank calls it; under tp, fsdp+tp and pp a directory of shards, no rank gathers the model
    acc.load(path)  # each rank reads the file and gets its own RNG state back
    if acc.is_main:
        print(f"saved and reloaded {path} at step {acc.step}")


if __name__ == "__main__":
    main()
