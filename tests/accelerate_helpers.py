"""What the fastops.accelerate test files share: a small net and its batches, the user's loop as written for plain
PyTorch, the launcher of rank groups (tests/test_accelerate_dist.py, test_model_parallel.py, test_lowp_dist.py) and
how their workers leave."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


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


class Noisy(Dataset):
    """A random augmentation: draws from torch's global generator in __getitem__. Records the loading threads."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x @ torch.randn(6, 3, generator=g)).argmax(1)
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.threads.add(threading.current_thread().name)
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]





def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_group(cmds: list[list[str]], envs: list[dict[str, str]], log_dir) -> list[subprocess.Popen]:
    """Starts the commands in one new process group (the first one's), so that one killpg ends them all
    along with anything they spawned. A group, not a session per process (start_new_session): a process can
    only join a group of its own session. Output goes to files: a rank blocked on a full pipe would stall the
    others."""
    procs: list[subprocess.Popen] = []
    for i, (cmd, env) in enumerate(zip(cmds, envs)):
        join = functools.partial(os.setpgid, 0, procs[0].pid if procs else 0)  # 0: a new group, led by rank 0
        with open(os.path.join(log_dir, f"rank{i}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=join))  # fmt: skip
    return procs


def _wait_group(procs: list[subprocess.Popen], timeout: float) -> None:
    """Waits for every process; past ``timeout`` (a hang) kills the whole group and raises TimeoutExpired."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(procs[0].pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        raise


def leave_without_shutdown() -> None:
    """Ends a worker rank whose results are written. Twice in about 100 runs a rank died with SIGABRT ("terminate
    called without an active exception") in the interpreter's shutdown, after everything had returned on both
    ranks and the group was destroyed: a c10d/gloo teardown race in torch (pytorch#179291 describes one), not
    something a worker checks; tests/lowp_worker.py's rank 0 hit it in CI's torch 2.13 leg. Leave without that
    shutdown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie has exited; only its entry is left
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
