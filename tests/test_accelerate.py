"""fastops.accelerate: the one line, with the training loop unchanged, against plain torch."""

from __future__ import annotations

import importlib
import math
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastops import optim
from fastops.accelerate import Accelerator, accelerate
from tests import dist_worker

facc = importlib.import_module("fastops.accelerate")  # the module: `fastops.accelerate` may be the function
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def make(dropout: float = 0.0, opt: str = "adamw", **kw):
    torch.manual_seed(0)
    model = Net(dropout)
    if opt == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(n: int, b: int = 8, seed: int = 1):
    """Labels from a fixed linear rule, so the loss can fall."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(99))
    xs = [torch.randn(b, 6, generator=g) for _ in range(n)]
    return [(x, (x @ w).argmax(1)) for x in xs]


def loop(model, opt, loader, sched=None, zero_first: bool = False):
    """The user's loop, as written for plain PyTorch."""
    losses = []
    for x, y in loader:
        if zero_first:
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if not zero_first:
            opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def params(model):
    return [p.detach().clone() for p in model.parameters()]


# ---- the one line --------------------------------------------------------------------------------------


def test_fp32_parity_with_plain_torch():
    data = batches(12)
    model, opt = make()
    ref_losses = loop(model, opt, data)
    ref = params(model)

    model, opt = make()
    model2, opt2, loader = accelerate(model, opt, data, precision="fp32")
    assert model2 is model and isinstance(opt2, optim.AdamW) and isinstance(opt2, torch.optim.AdamW)
    losses = loop(model2, opt2, loader)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    for p, r in zip(model2.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_optimizer_groups_hyperparameters_and_state_carried_over():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(
        [{"params": model.fc1.parameters(), "lr": 3e-3, "weight_decay": 0.01}, {"params": model.fc2.parameters()}],
        lr=1e-3, betas=(0.8, 0.9), amsgrad=True,
    )  # fmt: skip
    loop(model, opt, batches(1))  # state exists before the one line
    _, new, _ = accelerate(model, opt, precision="fp32")
    assert type(new) is optim.Adam
    for old_g, new_g in zip(opt.param_groups, new.param_groups):
        assert [id(p) for p in old_g["params"]] == [id(p) for p in new_g["params"]]
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
            assert old_g[k] == new_g[k]
    for p in model.parameters():
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k].float(), new.state[p][k])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_loop_unchanged_low_precision(precision):
    data = batches(40)
    model, opt = make()
    model, opt, loader = accelerate(model, opt, data, precision=precision)
    x = data[0][0]
    assert model(x).dtype == torch.float32  # outputs come back in fp32
    if precision == "bf16":
        with torch.no_grad():  # autocast is on inside forward
            seen = []
            h = model.fc1.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
            model(x)
            h.remove()
        assert seen == [torch.bfloat16]
    losses = loop(model, opt, loader)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        y = self.fc(x)
        return {"logits": y, "extra": (y.argmax(1), [y * 2]), "note": "kept"}


def test_nested_outputs_come_back_fp32():
    model, _, _ = accelerate(_Nested(), torch.optim.SGD(_Nested().parameters(), lr=0.1), precision="bf16")
    out = model(torch.randn(4, 6))
    assert out["logits"].dtype == out["extra"][1][0].dtype == torch.float32
    assert out["extra"][0].dtype == torch.int64 and out["note"] == "kept"


def test_fp16_scales_grads_and_skips_steps():
    data = batches(3)
    model, opt = make()
    ref_model, _ = make()
    model, opt, _ = accelerate(model, opt, precision="fp16")
    scaler = opt.accelerator.scaler
    scale = scaler.get_scale()

    x, y = data[0]
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref_model(x), y).backward()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        # loss.backward() alone gives grads times the loss scale (fp16 autocast: 1e-2 relative).
        torch.testing.assert_close(p.grad / scale, r.grad, rtol=2e-2, atol=2e-4)
    opt.step()
    opt.zero_grad()
    assert not opt.step_was_skipped

    before = params(model)
    sched = opt.accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    lr = opt.param_groups[0]["lr"]
    x_inf = data[1][0].clone()
    x_inf[0, 0] = float("inf")
    F.cross_entropy(model(x_inf), data[1][1]).backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    assert opt.step_was_skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == scale / 2
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 0  # the scheduler did not advance
    assert opt.accelerator.step == 2


def test_accumulation_matches_one_big_batch():
    k, b = 4, 2
    data = batches(8 * k, b)
    big = [(torch.cat([x for x, _ in data[i : i + k]]), torch.cat([y for _, y in data[i : i + k]])) for i in range(0, len(data), k)]
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loop(model, opt, big, sched)
    ref = params(model)

    for zero_first in (False, True):
        model, opt = make()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        acc = Accelerator(precision="fp32", accumulate=k)
        model, opt, sched, loader = acc.prepare(model, opt, sched, data)
        start = params(model)
        prefetched = list(loader)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's scheduler sees the prepared step as the right order
            loop(model, opt, prefetched[: k - 1], sched, zero_first)
        # the first k-1 step()/zero_grad() calls did nothing; the grads accumulated
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        assert all(p.grad is not None for p in model.parameters()) and acc.step == 0
        assert opt.param_groups[0]["lr"] == 1e-2
        loop(model, opt, prefetched[k - 1 :], sched, zero_first)
        assert acc.step == 8 and sched.last_epoch == 8
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_grad_clip_folded_and_other_optimizers():
    data = batches(6)
    for kind in ("adamw", "sgd"):
        model, opt = make(opt=kind)
        for x, y in data:
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        ref = params(model)

        model, opt = make(opt=kind)
        model, opt2, loader = accelerate(model, opt, data, precision="fp32", grad_clip=0.1)
        if kind == "sgd":
            assert opt2 is opt  # kept, and still clipped
        else:
            assert all(g["max_grad_norm"] == 0.1 for g in opt2.param_groups)  # folded into the fused step
        loop(model, opt2, loader)
        assert opt2.last_grad_norm > 0.1  # the clip was active
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_other_optimizer_fp16_unscales_clips_and_skips():
    data = batches(8)
    data[3] = (data[3][0].clone().fill_(float("inf")), data[3][1])  # this step must be skipped
    model, opt = make(opt="sgd")
    scaler = torch.amp.GradScaler("cpu")
    for x, y in data:  # torch's recipe for fp16 with clipping
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    ref = params(model)

    model, opt = make(opt="sgd")
    model, opt2, loader = accelerate(model, opt, data, precision="fp16", grad_clip=0.5)
    assert opt2 is opt
    loop(model, opt2, loader)
    assert opt2.accelerator.scaler.get_scale() == scaler.get_scale() == 32768.0
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


class _Epochs:
    """An iterable that records set_epoch calls."""

    def __init__(self, data):
        self.data, self.epochs = data, []

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_loader_kinds_and_set_epoch():
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(5)
    src = _Epochs(data)
    acc = Accelerator(precision="fp32")
    acc.prepare(*make())
    loader = acc.prepare(src)
    for _ in range(3):
        got = list(loader)
    assert src.epochs == [0, 1, 2] and len(loader) == 5
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, data))
    gen = acc.prepare(b for b in data)
    assert len(list(gen)) == 5
    ds = TensorDataset(torch.arange(10.0))
    dl = acc.prepare(DataLoader(ds, batch_size=4))
    assert [b[0].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_compile_smoke():
    # CI and the dev machines have gcc, so inductor must compile here: any failure is a real one.
    model, opt = make()
    model, opt, loader = accelerate(model, opt, batches(3), precision="fp32", compile=True)
    losses = loop(model, opt, loader)
    assert all(torch.isfinite(torch.tensor(losses)))


# ---- checkpoints ---------------------------------------------------------------------------------------


def _fresh(dropout=0.3):
    model, opt = make(dropout)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    acc = Accelerator(precision="fp32")
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def test_checkpoint_resume_is_bitwise(tmp_path):
    data = batches(6)
    acc, model, opt, sched = _fresh()
    loop(model, opt, data, sched)  # dropout draws from the torch RNG every step
    uninterrupted = params(model)

    acc, model, opt, sched = _fresh()
    loop(model, opt, data[:3], sched)
    acc.save(tmp_path / "ckpt.pt")
    torch.manual_seed(1234)  # the process state moves on; load must restore it
    acc, model, opt, sched = _fresh()
    acc.load(tmp_path / "ckpt.pt")
    assert acc.step == 3 and sched.last_epoch == 3
    loop(model, opt, data[3:], sched)
    assert all(torch.equal(p, u) for p, u in zip(model.parameters(), uninterrupted))


def test_checkpoint_truncated_or_mismatched_keeps_last_good(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    acc, model, opt, sched = _fresh()
    loop(model, opt, batches(2), sched)
    acc.save(path)
    good = path.read_bytes()

    def crash(obj, f, *a, **k):  # a save that dies halfway through writing
        f.write(good[: len(good) // 2])
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", crash)
        with pytest.raises(OSError, match="disk full"):
            acc.save(path)
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left

    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good[: len(good) // 2])
    before = params(model)
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        acc.load(bad)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    other = Accelerator(precision="fp32")
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3))
    other.prepare(wide, torch.optim.AdamW(wide.parameters()))
    before = params(wide)
    with pytest.raises(ValueError, match="does not match.*missing keys"):
        other.load(path)
    assert all(torch.equal(p, b) for p, b in zip(wide.parameters(), before))

    fp16 = Accelerator(precision="fp16")
    fp16.prepare(*make())
    with pytest.raises(ValueError, match="precision='fp32'.*'fp16'"):
        fp16.load(path)
    acc.load(path)  # the last good one still loads


# ---- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="fp8"), "unknown precision 'fp8'"),
        (dict(strategy="deepspeed"), "unknown strategy 'deepspeed'"),
        (dict(accumulate=0), "accumulate must be an int >= 1"),
        (dict(accumulate=2.5), "accumulate must be an int >= 1"),
        (dict(grad_clip=-1.0), "grad_clip must be > 0"),
        (dict(strategy="ddp"), "strategy='ddp' needs a process group"),
        (dict(strategy="fsdp"), "strategy='fsdp' needs a process group"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accelerate(*make(), **kwargs)


def test_fp16_without_autocast_support(monkeypatch):
    monkeypatch.setattr(facc, "_autocast_supported", lambda device_type, dtype: dtype != torch.float16)
    with pytest.raises(ValueError, match="precision='fp16' is not supported by autocast on device cpu"):
        accelerate(*make(), precision="fp16")


def test_model_without_parameters():
    with pytest.raises(ValueError, match="has no parameters"):
        accelerate(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


# ---- two ranks (gloo) ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(strategy, tmp_path):
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           os.path.join(ROOT, "tests", "dist_worker.py"), strategy, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(out)
    for name in dist_worker.SCENARIOS:
        ref_losses, ref_params = dist_worker.reference(name)
        got = result[name]
        if dist_worker.SCENARIOS[name]["accumulate"] == 1:
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        for n, p in ref_params.items():
            torch.testing.assert_close(got["params"][n], p, rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")
    assert result["checkpoint_ok"]
    for name in ("fp16_adamw_clip", "fp16_sgd_clip"):
        scales = result[name]["scales"]
        assert scales[0] == scales[1], (name, scales)  # the same steps were skipped on both ranks
        assert all(map(math.isfinite, result[name]["losses"][-2:]))
    assert result["fp16_adamw_clip"]["scales"][0] < 65536.0  # some steps were skipped
