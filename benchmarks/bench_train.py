"""End-to-end training step time: a BERT-like encoder with an MLM loss and a ResNet-50, written in plain
PyTorch, on the CPU or a GPU (``--device``), trained by

- torch fp32: the plain loop, torch.optim.AdamW defaults (for-loop on the CPU, foreach on CUDA);
- torch bf16 tuned: bf16 autocast + torch.optim.AdamW(fused=True);
- HF-recipe bf16 (torch): what HF Accelerate's mixed_precision="bf16" runs for a single process, written out
  in torch (bf16 autocast, fp32 outputs, the user's AdamW unchanged); kept as the stand-in where `accelerate`
  is not installed;
- HF Accelerate bf16: ``Accelerator(mixed_precision="bf16", cpu=<device is the CPU>)`` and
  ``accelerator.prepare(model, optimizer, loader)``, ``accelerator.backward(loss)``, as HF documents a plain
  loop; skipped when `import accelerate` fails;
- fastops.accelerate: the one line (precision "auto": bf16 where the device has it natively).

Fair by construction: every provider gets the same initial weights (seeded), the same batches through its own
DataLoader over one list (the prepared ones move them to the device, the plain loops call ``.to(device)``),
the same dropout masks (the global RNG is seeded before each step, and the loaders draw from their own
generator), the same AdamW hyperparameters (ADAMW below) and the same loop (``_steps``). Each provider runs in
its own process (fastops.accelerate keeps freed memory in the process on the CPU, a process-wide setting that
must not reach the others), ``--blocks`` times with the providers taking turns, so load from other processes
hits them alike; medians with 20/80% quantiles over the timed steps of all runs. Losses are checked at the end (see loss_check): over the last LOSS_TAIL steps, every bf16
provider must track torch's own bf16 autocast recipe and that recipe must track fp32, else the exit status is 1.

    python benchmarks/bench_train.py                        # ~3 min on 2 CPU cores
    python benchmarks/bench_train.py --quick                # < 1 min smoke run
    python benchmarks/bench_train.py --quick --device cuda  # on a GPU (bf16 autocast on CUDA)
    python benchmarks/bench_train.py --models bert --rounds 6 --profile 2 --out scratch_train
        # short run of one model, then a torch.profiler table per provider (2 steps each)

Results: benchmarks/results/train_{cpu,cuda}.{json,csv,png} (``--out`` names another file or a path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import hardware, result_base, sync, write_results  # noqa: E402

from fastops.accelerate import accelerate  # noqa: E402

ADAMW = dict(lr=1e-4)  # every provider; torch's defaults otherwise (betas (0.9, 0.999), eps 1e-8, weight_decay 0.01)
# Loss checks over the last LOSS_TAIL steps (mean of |loss - loss_ref| / loss_ref at the same steps); the
# measurements behind the tolerances are in loss_check's docstring.
LOSS_TAIL = 5
FP32, BF16_REF = "torch fp32", "torch bf16 tuned"
SAME_RECIPE_RTOL = 2e-4  # a bf16 provider against torch's own bf16 autocast recipe
BF16_VS_FP32_RTOL = 5e-2  # torch's bf16 recipe against fp32

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


CASES = {"bert": bert_case, "resnet": resnet_case}
_RESULT = "RESULT "  # prefix of the worker's one line of JSON on stdout


# ---- data ------------------------------------------------------------------------------------------------


class _Batches(Dataset):
    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        return self.batches[i]


def _loader(batches: list) -> DataLoader:
    # batch_size=None: the items are whole batches. Its own generator: a DataLoader without one draws its
    # base seed from the global RNG when iterated, and the dropout masks would then differ by provider.
    return DataLoader(_Batches(batches), batch_size=None, generator=torch.Generator().manual_seed(0))


# ---- providers: each returns an iterator whose next() runs one training step and gives the loss ------------


def _steps(model, opt, loader, loss_fn, device, amp_dtype=None, backward=None):
    dev = torch.device(device)
    while True:
        for batch in loader:
            batch = tuple(t.to(dev, non_blocking=True) for t in batch)  # no-op where the loader already did it
            amp = torch.autocast(dev.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
            with record_function("## forward + loss"), amp:
                loss = loss_fn(model, batch)
            with record_function("## backward"):
                (backward or torch.Tensor.backward)(loss)
            with record_function("## optimizer.step"):
                opt.step()
            with record_function("## zero_grad"):
                opt.zero_grad()
            yield loss.detach()


def torch_fp32(model, loader, loss_fn, device):
    model.to(device)
    return _steps(model, torch.optim.AdamW(model.parameters(), **ADAMW), loader, loss_fn, device)


def torch_bf16_tuned(model, loader, loss_fn, device):
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    return _steps(model, opt, loader, loss_fn, device, amp_dtype=torch.bfloat16)


def hf_recipe_bf16(model, loader, loss_fn, device):
    # The loss functions take the logits to fp32 themselves, which is what HF's convert_outputs_to_fp32 adds.
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return _steps(model, opt, loader, loss_fn, device, amp_dtype=torch.bfloat16)


_HF: dict[str, object] = {}


def hf_accelerate_bf16(model, loader, loss_fn, device):
    from accelerate import Accelerator

    # One Accelerator per process, as HF's docs have it (its state is a process-wide singleton); each model,
    # optimizer and loader is prepared by it. cpu=True keeps it on the CPU even where CUDA is visible.
    if device not in _HF:
        _HF[device] = Accelerator(mixed_precision="bf16", cpu=torch.device(device).type == "cpu")
    acc = _HF[device]
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), **ADAMW), loader)
    return _steps(model, opt, loader, loss_fn, device, backward=acc.backward)


def fastops_accelerate(model, loader, loss_fn, device):
    model, opt, loader = accelerate(model, torch.optim.AdamW(model.parameters(), **ADAMW), loader, device=device)
    # precision="auto" picks fp32 on a CPU without native bf16; the loss check then compares it with fp32.
    fastops_accelerate.precision = opt.accelerator.precision
    return _steps(model, opt, loader, loss_fn, device)


def providers(quiet: bool = False) -> dict:
    out = {"torch fp32": torch_fp32, "torch bf16 tuned": torch_bf16_tuned, "HF-recipe bf16 (torch)": hf_recipe_bf16}
    try:
        import accelerate as _hf  # noqa: F401

        out["HF Accelerate bf16"] = hf_accelerate_bf16
    except ImportError:
        if not quiet:
            print("note: HF Accelerate is not installed (`import accelerate` failed); its provider is skipped, and "
                  "'HF-recipe bf16 (torch)' runs the same recipe (bf16 autocast, the user's AdamW) in plain torch")
    out["fastops.accelerate"] = fastops_accelerate
    return out


def _start(case: dict, makers: dict, batches: list, device: str) -> dict:
    runners = {}
    for label, make in makers.items():
        torch.manual_seed(0)  # same weights for every provider
        runners[label] = make(case["make"](), _loader(batches), case["loss"], device)
    return runners


def run_provider(case: dict, label: str, make, steps: int, device: str) -> dict:
    """``steps`` training steps of one provider from the shared initial weights: per-step ms and losses."""
    it = _start(case, {label: make}, case["batches"](steps), device)[label]
    times, losses = [], []
    for r in range(steps):
        torch.manual_seed(1000 + r)  # same dropout masks for every provider (CUDA's generators too)
        sync(device)
        start = time.perf_counter()
        losses.append(next(it).item())  # the step is done (and synced) once its loss is on the host
        times.append(1e3 * (time.perf_counter() - start))
    it.close()
    precision = getattr(make, "precision", "fp32" if label == FP32 else "bf16")
    return {"times": times, "losses": losses, "precision": precision}


def _in_process(model_key: str, label: str, steps: int, device: str) -> dict:
    """run_provider in a fresh interpreter (``--worker``): fastops.accelerate changes process-wide state on
    the CPU (it keeps freed memory in the process), which must not reach the providers measured against it."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_key, label, str(steps), "--device", device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in r.stdout.splitlines() if x.startswith(_RESULT)), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"bench_train worker {model_key}/{label} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(line[len(_RESULT):])


def run_case(model_key: str, makers: dict, rounds: int, warmup: int, blocks: int, device: str) -> tuple[list[dict], dict]:
    """Each provider runs in its own process, ``blocks`` times in turn (providers alternate, so load from other
    processes on a shared machine hits them alike); the first ``warmup`` steps of each run are not timed."""
    case = CASES[model_key]()
    samples = {label: [] for label in makers}
    losses: dict[str, list[float]] = {}
    precision: dict[str, str] = {}
    rerun_diff = {label: 0.0 for label in makers}
    for _ in range(blocks):
        for label in makers:
            out = _in_process(model_key, label, rounds + warmup, device)
            samples[label] += out["times"][warmup:]
            # Same weights, batches and dropout masks in every run; oneDNN's convolutions still differ in the
            # last bits from run to run (ResNet-50 fp32), so the runs' agreement is reported, not required.
            if label in losses:
                diff = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], losses[label]))
                rerun_diff[label] = max(rerun_diff[label], diff)
            else:
                losses[label], precision[label] = out["losses"], out["precision"]
    check = loss_check(losses, precision)
    base = statistics.median(samples[FP32])
    rows = []
    for label, xs in samples.items():
        q = statistics.quantiles(xs, n=5, method="inclusive")
        ms = statistics.median(xs)
        rows.append({
            "model": case["name"], "provider": label,
            "ms": round(ms, 2), "ms_q20": round(q[0], 2), "ms_q80": round(q[3], 2),
            "speedup_vs_fp32": round(base / ms, 3), "first_loss": round(losses[label][0], 5),
            "tail_loss": round(check[label]["tail_loss"], 5),
            "tail_rel_diff_vs_fp32": float(f"{check[label]['rel_diff_fp32']:.3g}"),
            "tail_rel_diff_vs_bf16": float(f"{check[label]['rel_diff_bf16']:.3g}"),
            "loss_check": "; ".join(check[label]["fail"]) or "ok",
            "rerun_loss_rel_diff": float(f"{rerun_diff[label]:.3g}"),
            "samples": len(xs), "device": device, "hardware": hardware(device),
        })  # fmt: skip
    return rows, losses


def loss_check(losses: dict[str, list[float]], precision: dict[str, str]) -> dict[str, dict]:
    """Per provider, the mean of its last LOSS_TAIL losses, and their mean relative difference from torch
    fp32's and from torch's bf16 autocast recipe's (BF16_REF) at the same steps: same batches, same dropout
    masks. Failures are listed under "fail". A provider that ran in fp32 (``precision``) is held to torch
    fp32 with SAME_RECIPE_RTOL.

    - bf16 providers against BF16_REF, SAME_RECIPE_RTOL = 2e-4: they run the same autocast forward, and only
      the optimizers' fp32 rounding differs (for-loop, fused, fastops). Measured on the CPU: 0 (the losses
      agree to 6 decimals over 5 steps on both models). An optimizer that does not step moves the
      losses by 1.2e-3 (BERT-like) and 1.7e-2 (ResNet-50), twice the learning rate by 7.4e-4 and 7.3e-2
      (10 steps), so 2e-4 catches both with room left for CUDA's non-deterministic backward kernels.
    - BF16_REF against fp32, BF16_VS_FP32_RTOL = 5e-2: bf16 keeps 8 significant bits. On ResNet-50 the
      first step, with identical weights, already differs by 1.4e-2 (50 layers of bf16 convs on batches of
      8); the last 5 steps differed by 2.5e-2 in a 5-step run, 1.1e-2 in a 10-step and 1.8e-2 in an 18-step
      one (the default 3 + 15); the BERT-like model by 1.5e-5. Ten times the learning rate gives 0.68."""
    k = min(LOSS_TAIL, len(losses[FP32]))
    out = {}
    for label, ls in losses.items():
        row = {"tail_loss": statistics.fmean(ls[-k:]), "fail": []}
        for ref, key in ((FP32, "rel_diff_fp32"), (BF16_REF, "rel_diff_bf16")):
            if ref in losses:
                row[key] = statistics.fmean(abs(a - b) / abs(b) for a, b in zip(ls[-k:], losses[ref][-k:]))
        if label == BF16_REF and row["rel_diff_fp32"] > BF16_VS_FP32_RTOL:
            row["fail"].append(f"{row['rel_diff_fp32']:.2e} from {FP32} (tolerance {BF16_VS_FP32_RTOL:g})")
        same = FP32 if precision[label] == "fp32" else BF16_REF
        diff = row["rel_diff_fp32" if same == FP32 else "rel_diff_bf16"]
        if label not in (FP32, BF16_REF) and diff > SAME_RECIPE_RTOL:
            row["fail"].append(f"{diff:.2e} from {same} (tolerance {SAME_RECIPE_RTOL:g})")
        out[label] = row
    return out


def profile_case(case: dict, makers: dict, steps: int, device: str, path: str) -> None:
    """torch.profiler over ``steps`` steps of each provider (after two warm-up steps): a table of ops by
    self time, and the "## ..." ranges that _steps marks (forward + loss, backward, optimizer.step,
    zero_grad). Appended to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    runners = _start(case, makers, case["batches"](steps + 2), device)
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    with open(path, "a") as f:
        for label, it in runners.items():
            for r in range(2):
                torch.manual_seed(1000 + r)
                next(it).item()
            sync(device)
            start = time.perf_counter()
            with profile(activities=activities) as prof:
                for r in range(steps):
                    torch.manual_seed(1002 + r)
                    next(it).item()
            wall = 1e3 * (time.perf_counter() - start) / steps
            it.close()
            events = prof.key_averages()
            phases = sorted((e for e in events if e.key.startswith("## ")), key=lambda e: e.key)
            # On CUDA the host times of the phases are launch times; the device column is the GPU's.
            lines = [f"==== {case['name']} / {label}: {steps} steps, {wall:.1f} ms per step under the profiler"]
            for e in phases:
                device_ms = f"  device {e.device_time_total / 1e3 / steps:8.1f} ms" if cuda else ""
                lines.append(f"  {e.key[3:]:18s} host {e.cpu_time_total / 1e3 / steps:8.1f} ms{device_ms}")
            table = events.table(sort_by=sort, row_limit=25, max_name_column_width=50)
            f.write("\n".join(lines) + "\n" + table + "\n")
            print("\n".join(lines), flush=True)
    print(f"profiles (ops by self time) appended to {path}")


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
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per provider and run (default 10, quick 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, quick 1)")
    p.add_argument("--blocks", type=int, default=None, help="runs per provider, taking turns (default 2, quick 1)")
    p.add_argument("--models", nargs="*", choices=list(CASES), default=list(CASES))
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="afterwards, profile STEPS steps of each provider per model (torch.profiler, one process)")
    p.add_argument("--out", default=None,
                   help="result name under benchmarks/results, or a path (default train_<device>)")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "PROVIDER", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print(f"bench_train: --device {device} but CUDA is not available")
        return 2
    if args.worker:
        model_key, label, steps = args.worker
        out = run_provider(CASES[model_key](), label, providers(quiet=True)[label], int(steps), device)
        print(_RESULT + json.dumps(out), flush=True)
        return 0
    rounds = args.rounds or (4 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    blocks = args.blocks or (1 if args.quick else 2)
    makers = providers()
    rows, all_losses = [], {}
    for key in args.models:
        name = CASES[key]()["name"]
        print(f"{name} on {hardware(device)}: {blocks} x {rounds} timed steps per provider after {warmup} warm-up, "
              "one process per run", flush=True)  # fmt: skip
        case_rows, losses = run_case(key, makers, rounds, warmup, blocks, device)
        all_losses[name] = losses
        hf = next((r for r in case_rows if r["provider"] == "HF Accelerate bf16"), None)
        hf = hf or next(r for r in case_rows if r["provider"] == "HF-recipe bf16 (torch)")
        fo = next(r for r in case_rows if r["provider"] == "fastops.accelerate")
        for r in case_rows:
            r["fastops_vs_hf"] = round(hf["ms"] / fo["ms"], 3)
            print(f"  {r['provider']:24s} {r['ms']:8.1f} ms [{r['ms_q20']:.1f}, {r['ms_q80']:.1f}]  "
                  f"{r['speedup_vs_fp32']:5.2f}x fp32  loss {r['first_loss']:.4f} -> {r['tail_loss']:.4f} "
                  f"(last {LOSS_TAIL}: {r['tail_rel_diff_vs_fp32']:.1e} from fp32, "
                  f"{r['tail_rel_diff_vs_bf16']:.1e} from bf16)")  # fmt: skip
        print(f"  fastops.accelerate is {fo['fastops_vs_hf']:.3f}x {hf['provider']}")
        rows += case_rows
    bad = [r for r in rows if r["loss_check"] != "ok"]
    for r in bad:
        print(f"LOSS MISMATCH: {r['model']} {r['provider']}: last {LOSS_TAIL} losses {r['loss_check']}")
    load = os.getloadavg()
    meta = {"device": device, "hardware": hardware(device), "torch": torch.__version__, "rounds": rounds,
            "warmup": warmup, "blocks": blocks, "threads": torch.get_num_threads(), "adamw": ADAMW,
            "loss_tail": LOSS_TAIL, "same_recipe_rtol": SAME_RECIPE_RTOL, "bf16_vs_fp32_rtol": BF16_VS_FP32_RTOL,
            "losses": all_losses, "loadavg_at_end": load, "argv": sys.argv[1:],
            "note": "one process per provider and run, runs taking turns; the CPU may be shared with other "
                    "processes (see loadavg_at_end)"}  # fmt: skip
    name = args.out or f"train_{torch.device(device).type}"
    base = write_results(name, rows, meta)
    plot(rows, base + ".png")
    print(f"load average at the end: {load[0]:.2f} ({os.cpu_count()} cores: above that, other processes competed)")
    print(f"wrote {base}.json/.csv/.png")
    if args.profile:
        path = result_base(name) + "_profile.txt"
        if os.path.exists(path):
            os.remove(path)
        for key in args.models:
            profile_case(CASES[key](), makers, args.profile, device, path)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
