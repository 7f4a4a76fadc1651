"""The models bench_train.py times, from their own libraries: torchvision's resnet50 and Mask R-CNN, HF's
BertForMaskedLM and LlamaForCausalLM. Each case gives its name, a constructor, its optimizer (the library's
reference recipe), batches and the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- the models, from their own libraries -------------------------------------------------------------------


def _sgd(lr: float):
    return lambda params, **kw: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4, **kw)


def resnet_case(cuda: bool) -> dict:
    """torchvision's ImageNet recipe: SGD lr 0.1 per 256 images, momentum 0.9, weight decay 1e-4."""
    import torchvision

    batch, size = (64, 224) if cuda else (8, 128)

    def batches(n, g):
        return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(1000, (batch,), generator=g))
                for _ in range(n)]  # fmt: skip

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return dict(name=f"resnet50 b{batch} {size}x{size}", make=lambda: torchvision.models.resnet50(weights=None),
                opt=_sgd(0.1 * batch / 256), batches=batches, loss=loss_fn)  # fmt: skip


def maskrcnn_case(cuda: bool) -> dict:
    """torchvision's COCO recipe: SGD lr 0.02 per 16 images, momentum 0.9, weight decay 1e-4; images resized
    to min_size (800 there; 160 on the CPU, where a step at 256 took 36 s under a load of 8 on 2 cores)."""
    import torchvision

    batch, (h, w), min_size, max_size = (2, (480, 640), 800, 1333) if cuda else (2, (160, 224), 160, 224)

    def batches(n, g):
        out = []
        for _ in range(n):
            images, targets = [], []
            for _ in range(batch):
                k = 3  # objects per image
                xy = torch.rand(k, 2, generator=g) * torch.tensor([w / 2, h / 2])
                boxes = torch.cat([xy, xy + 16 + torch.rand(k, 2, generator=g) * torch.tensor([w / 3, h / 3])], 1)
                masks = torch.zeros(k, h, w, dtype=torch.uint8)
                for j, (x0, y0, x1, y1) in enumerate(boxes.long().tolist()):
                    masks[j, y0:y1, x0:x1] = 1
                images.append(torch.rand(3, h, w, generator=g))
                targets.append({"boxes": boxes, "labels": torch.randint(1, 91, (k,), generator=g), "masks": masks})
            out.append((images, targets))
        return out

    def loss_fn(model, batch):
        images, targets = batch
        return sum(model(images, targets).values())  # train mode: a dict of losses, which the user sums

    def make():
        return torchvision.models.detection.maskrcnn_resnet50_fpn(
            weights=None, weights_backbone=None, min_size=min_size, max_size=max_size
        )

    return dict(name=f"maskrcnn_resnet50_fpn b{batch} {min_size}/{max_size}", make=make, opt=_sgd(0.02 * batch / 16),
                batches=batches, loss=loss_fn)  # fmt: skip


def bert_case(cuda: bool) -> dict:
    """HF's BertForMaskedLM: bert-base (BertConfig's defaults) on CUDA, 4 x 256 with an 8192 vocabulary on the
    CPU; AdamW lr 1e-4, weight decay 0.01, dropout 0.1 as configured."""
    from transformers import BertConfig, BertForMaskedLM

    if cuda:
        batch, seq, cfg = 32, 128, BertConfig()
    else:
        batch, seq = 16, 128
        cfg = BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=1024)  # fmt: skip

    def batches(n, g):
        out = []
        for _ in range(n):
            ids = torch.randint(1000, cfg.vocab_size, (batch, seq), generator=g)
            mask = torch.rand(batch, seq, generator=g) < 0.15  # MLM: predict 15% of the tokens
            out.append({"input_ids": ids.masked_fill(mask, 103), "labels": ids.masked_fill(~mask, -100)})
        return out

    def loss_fn(model, batch):
        return model(**batch).loss

    return dict(name=f"BertForMaskedLM {cfg.num_hidden_layers}x{cfg.hidden_size} b{batch} s{seq}",
                make=lambda: BertForMaskedLM(cfg),
                opt=lambda params, **kw: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw),
                batches=batches, loss=loss_fn, lm=True)  # fmt: skip


def llama_case(cuda: bool) -> dict:
    """HF's LlamaForCausalLM, 4 x 256 with a 32000 vocabulary on the CPU (8 x 1024 with 4 KV heads on CUDA):
    causal LM, every token labeled; AdamW lr 3e-4, weight decay 0.1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    batch, seq = (16, 512) if cuda else (8, 128)
    width, layers, heads = (1024, 8, 16) if cuda else (256, 4, 4)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=seq)

    def batches(n, g):
        out = []
        for _ in range(n):
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
            out.append({"input_ids": ids, "labels": ids})
        return out

    def loss_fn(model, batch):
        return model(**batch).loss

    return dict(name=f"LlamaForCausalLM {layers}x{width} v32000 b{batch} s{seq}", make=lambda: LlamaForCausalLM(cfg),
                opt=lambda params, **kw: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, **kw),
                batches=batches, loss=loss_fn, lm=True)  # fmt: skip


CASES = {"resnet": resnet_case, "maskrcnn": maskrcnn_case, "bert": bert_case, "llama": llama_case}
