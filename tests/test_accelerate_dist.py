"""fastops.accelerate with process groups (gloo): one rank in this process, then two ranks launched as torchrun
would, against one process."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from fastops.accelerate import accelerate
from tests import dist_worker
from tests.rounding import assert_as_accurate, assert_orders_agree
from tests.accelerate_helpers import ROOT, make, batches, _free_port, _start_group, _wait_group, _gone


# ---- one rank in this process (gloo) -------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulation_skips_gradient_sync_on_micro_steps(strategy, one_rank_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    syncs = []  # per forward: whether its backward all-reduces (DDP) / reduce-scatters (FSDP2)
    if strategy == "ddp":
        no_sync = DistributedDataParallel.no_sync
        monkeypatch.setattr(DistributedDataParallel, "no_sync", lambda self: (syncs.append(False), no_sync(self))[1])
    else:
        set_sync = FSDPModule.set_requires_gradient_sync
        monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync",
                            lambda self, sync, **kw: (syncs.append(sync), set_sync(self, sync, **kw))[1])  # fmt: skip
    k, data = 2, batches(8, 2)
    model, opt = make()
    model, opt, loader = accelerate(model, opt, data, precision="fp32", strategy=strategy, accumulate=k)
    for x, y in loader:
        before = len(syncs)
        F.cross_entropy(model(x), y).backward()
        if strategy == "ddp" and len(syncs) == before:
            syncs.append(True)  # this forward ran outside no_sync()
        opt.step()
        opt.zero_grad()
    assert syncs == [False, True] * 4


def test_the_group_fastops_started_is_destroyed_at_exit_and_a_users_is_left(tmp_path):
    """Left to interpreter finalization, a gloo group can abort the rank at exit (torchrun saw SIGABRT once):
    fastops destroys the group it started while the interpreter is whole, and leaves one the user started."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(ROOT)}  # fmt: skip
    # atexit runs handlers last-registered first: the probe, registered before accelerate(), sees the group after
    # fastops' handler has run.
    probe = ("import atexit, torch, torch.distributed as dist\n"
             "atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))\n"
             "from fastops.accelerate import accelerate\n"
             "{user}"
             "m = torch.nn.Linear(4, 2); o = torch.optim.AdamW(m.parameters())\n"
             "accelerate(m, o, [(torch.randn(2, 4),)], precision='fp32', strategy='ddp')\n")  # fmt: skip
    user = f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rv'}', rank=0, world_size=1)\n"
    for started_by, code, left in (("fastops", probe.format(user=""), False), ("the user", probe.format(user=user), True)):
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"initialized at exit: {left}" in out.stdout, (started_by, out.stdout, out.stderr[-2000:])


# ---- two ranks (gloo) ----------------------------------------------------------------------------------


def test_rank_launcher_kills_the_whole_group_on_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    spawn = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")  # fmt: skip
    cmds = [[sys.executable, "-c", spawn], [sys.executable, "-c", "import time; time.sleep(600)"]]
    procs = _start_group(cmds, [{}, {}], tmp_path)
    for _ in range(3000):  # until the grandchild exists (at most 30 s)
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.01)
    grandchild = int(pid_file.read_text())
    with pytest.raises(subprocess.TimeoutExpired):
        _wait_group(procs, timeout=0.1)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    for _ in range(1000):  # SIGKILL is delivered at once; the exit itself can take a moment
        if _gone(grandchild):
            break
        time.sleep(0.01)
    assert _gone(grandchild), "the rank's child survived the launcher's timeout"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(strategy, tmp_path):
    out = tmp_path / "result.pt"
    # The ranks are started here rather than by torchrun, which gives each worker its own session: a killpg
    # on torchrun after a hang would leave them running.
    port = str(_free_port())
    world = dist_worker.WORLD
    envs = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world)) for r in range(world)]  # fmt: skip
    cmd = [sys.executable, os.path.join(ROOT, "tests", "dist_worker.py"), strategy, str(out)]
    procs = _start_group([cmd] * world, envs, tmp_path)
    logs = lambda: "".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world))  # noqa: E731
    try:
        _wait_group(procs, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks hung; killed:\n" + logs())
    assert [p.returncode for p in procs] == [0] * world, logs()
    result = torch.load(out)
    for name in dist_worker.SCENARIOS:
        # Two ranks sum the grads in another order than one process: as accurate as it, against float64.
        ref_losses, ref_params = dist_worker.reference(name)
        exact_losses, exact_params = dist_worker.reference(name, torch.float64)
        got = result[name]
        if dist_worker.SCENARIOS[name]["accumulate"] == 1:
            assert_as_accurate(got["losses"], ref_losses, exact_losses, what=f"{strategy} {name} losses")
        for n, p in ref_params.items():
            assert_as_accurate(got["params"][n], p, exact_params[n], what=f"{strategy} {name} {n}")
    assert result["checkpoint_ok"]
    assert result["sharded_sampler"]  # a map-style DataLoader got a DistributedSampler, visible as loader.sampler
    assert result["resume_bitwise"]  # each rank got its own RNG state back
    assert result["save_error_on_every_rank"]
    if strategy == "ddp":
        assert result["rank0_only_load"]  # returned without waiting for the other rank
    for name in ("fp16_adamw_clip", "fp16_sgd_clip"):
        scales = result[name]["scales"]
        assert scales[0] == scales[1], (name, scales)  # the same steps were skipped on both ranks
        assert all(map(math.isfinite, result[name]["losses"][-2:]))
    assert result["fp16_adamw_clip"]["scales"][0] < 65536.0  # some steps were skipped
    if strategy == "fsdp":
        _check_sharded_fsdp_checkpoints(result)


def _check_sharded_fsdp_checkpoints(result):
    """Saved by 2 FSDP ranks after one epoch: the directory of shards holds no gathered file; it resumes at 2 ranks
    and in one process with the losses of the uninterrupted run, scheduler and fp16 scaler included."""
    per_epoch = dist_worker.N // (dist_worker.PER_RANK_BATCH * dist_worker.WORLD)
    for precision in ("fp32", "fp16"):
        got = result[f"sharded_{precision}"]
        assert got["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "fastops.pt"]
        after = got["straight"][per_epoch:]
        assert got["first"] == got["straight"][:per_epoch]
        assert got["resumed"]["losses"] == after  # the same ranks in the same order: bitwise
        assert got["resumed"]["state"] == got["saved"] and got["resumed"]["step"] == 2 * per_epoch
        if precision == "fp16":  # steps were skipped before the save: the scale and the scheduler show it
            assert got["saved"]["scaler"]["scale"] < 65536.0
            assert got["saved"]["sched"]["last_epoch"] < per_epoch
        else:  # the one file FSDP saved before, gathered
            assert got["legacy"]["losses"] == after
            assert got["legacy"]["state"] == got["saved"]

        # One process, the same global batches (both ranks' halves side by side).
        acc, model, opt, sched, _ = dist_worker.sharded_setup("none", precision)
        with pytest.warns(UserWarning, match=r"RNG states of 2 rank\(s\), this run has 1"):
            acc.load(got["path"])
        assert acc.step == per_epoch and sched.state_dict() == got["saved"]["sched"]
        if precision == "fp16":
            assert acc.scaler.state_dict() == got["saved"]["scaler"]
        x, y = dist_worker.data()
        sc = dict(epochs=dist_worker.SHARDED_EPOCHS, shuffle=False)
        batches = [(x[i], y[i]) for i in dist_worker.global_batches(sc)[per_epoch:]]
        losses = dist_worker.sharded_epoch(model, opt, sched, batches)
        # The loaded weights, exactly (the first loss's forward sums the batch in another order: a few ulps).
        assert abs(losses[0] - after[0]) <= 8 * 2.0**-24 * abs(after[0])
        if precision == "fp32":  # one process sums the grads in another order than 2 ranks (tests/rounding.py)
            full32, full64 = dist_worker.sharded_reference(torch.float32), dist_worker.sharded_reference(torch.float64)
            assert_orders_agree(losses, after, full32, full64, what="fsdp checkpoint continued in one process")
        else:
            # An fp16 rounding that flips with the order moves the third loss by 1.6e-4 relative: within 4 units
            # of fp16's roundoff (2**-11 = 4.9e-4), the bound being fp16's, not the checkpoint's.
            torch.testing.assert_close(losses, after, rtol=4 * 2.0**-11, atol=0)
