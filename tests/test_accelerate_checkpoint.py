"""Accelerator.save/load: bitwise resume, atomic writes (modes, fsyncs, killed saves, symlinks), RNG states of
another world size, truncated or mismatched files."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from fastops.accelerate import Accelerator, _checkpoint
from tests.accelerate_helpers import ROOT, Noisy, batches, loop, make, params


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


def test_resume_through_a_shuffled_dataloader_is_bitwise(tmp_path):
    def fresh():
        acc = Accelerator(precision="fp32")
        model, opt = make(dropout=0.3)
        model, opt, loader = acc.prepare(model, opt, DataLoader(Noisy(), batch_size=4, shuffle=True))
        torch.manual_seed(5)
        return acc, model, opt, loader

    acc, model, opt, loader = fresh()
    for _ in range(3):  # shuffling, augmentation and dropout all draw from the global generator
        loop(model, opt, loader)
    uninterrupted = params(model)

    acc, model, opt, loader = fresh()
    loop(model, opt, loader)
    acc.save(tmp_path / "ckpt.pt")
    acc, model, opt, loader = fresh()
    torch.manual_seed(1234)
    acc.load(tmp_path / "ckpt.pt")
    assert loader.epoch == 1 and acc.step == 6
    for _ in range(2):
        loop(model, opt, loader)
    assert all(torch.equal(p, u) for p, u in zip(model.parameters(), uninterrupted))


def test_checkpoint_file_mode_and_fsyncs(tmp_path, monkeypatch):
    acc, model, opt, sched = _fresh()
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), fsync(fd)))
    umask = os.umask(0o027)
    try:
        acc.save(tmp_path / "ckpt.pt")
    finally:
        os.umask(umask)
    # What open(path, "wb") creates under that umask (mkstemp would give 0o600).
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt.pt").st_mode) == 0o640
    assert synced == [False, True]  # the file, then its directory after the rename


_KILLED_SAVE = """
import os, signal, sys, torch
from fastops.accelerate import Accelerator
from tests.accelerate_helpers import make
acc = Accelerator(precision="fp32")
acc.prepare(*make())
def dies(obj, f, *a, **k):  # killed halfway through writing the checkpoint
    f.write(b"x" * 1000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dies
acc.save(sys.argv[1])
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_checkpoint_save_removes_temp_files_of_killed_saves(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (tmp_path / "other.pt.0123456789ab.tmp").write_bytes(b"another target's")
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.pt.")]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp") and not path.exists()
    acc, model, opt, sched = _fresh()
    acc.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "other.pt.0123456789ab.tmp"]
    acc.load(path)


def test_checkpoint_saved_through_a_symlink_keeps_the_link(tmp_path):
    (tmp_path / "runs").mkdir()
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "runs" / "step100.pt")  # dangling until the first save, as torch.save allows
    acc, model, opt, sched = _fresh()
    for _ in range(2):
        acc.save(link)
        assert link.is_symlink() and (tmp_path / "runs" / "step100.pt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt", "runs"]
    assert os.listdir(tmp_path / "runs") == ["step100.pt"]
    acc.load(link)


def test_checkpoint_rng_of_another_world_size_or_version(tmp_path):
    path = tmp_path / "ckpt.pt"
    acc, model, opt, sched = _fresh()
    acc.save(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["fastops_checkpoint"] == 2 and len(ckpt["rng"]) == 1
    mine = ckpt["rng"][0]["torch"]
    torch.manual_seed(42)
    ckpt["rng"].append(_checkpoint._rng_state())  # as if saved by 2 ranks
    torch.save(ckpt, path)
    torch.manual_seed(7)
    with pytest.warns(UserWarning, match=r"RNG states of 2 rank\(s\), this run has 1; rank r restores saved rank"):
        acc.load(path)
    assert torch.equal(torch.get_rng_state(), mine)

    ckpt.update(fastops_checkpoint=1, rng=ckpt["rng"][0])  # version 1: rank 0's state, not a list
    torch.save(ckpt, path)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.load(path)
    assert torch.equal(torch.get_rng_state(), mine)


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


def test_checkpoint_with_numpy_hyperparameters_loads(tmp_path):
    import fractions

    import numpy as np

    model, opt = make()
    opt.param_groups[0]["lr"] = np.float64(3e-3)  # from a config file or a sweep
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=np.float32(0.5))  # base_lrs get np.float64
    acc = Accelerator(precision="fp32")
    model, opt, sched = acc.prepare(model, opt, sched)
    loop(model, opt, batches(3), sched)
    acc.save(tmp_path / "np.pt")
    lr = opt.param_groups[0]["lr"]
    acc.load(tmp_path / "np.pt")
    assert opt.param_groups[0]["lr"] == lr and type(opt.param_groups[0]["lr"]) is float
    assert sched.scheduler.base_lrs == [3e-3] and sched.scheduler.gamma == 0.5

    opt.param_groups[0]["note"] = fractions.Fraction(1, 3)  # a type weights_only unpickling refuses
    acc.save(tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match=r"refuses to unpickle, not damaged data.*add_safe_globals") as e:
        acc.load(tmp_path / "other.pt")
    assert "truncated" not in str(e.value)
