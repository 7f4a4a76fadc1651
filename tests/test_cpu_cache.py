"""The caching layer over torch's CPU allocator (csrc/cpu/cache.cpp) that fastops.accelerate installs on the
CPU. It replaces torch's allocator for the whole process, so every check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastops import _backend

pytestmark = pytest.mark.skipif(_backend._C is None, reason="the cache is part of fastops._C")

MiB = 1 << 20


def _run(code: str, timeout: float = 120, **env) -> str:
    env = {**os.environ, **env}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


_ACCELERATE = """
import resource, torch, fastops
from fastops._backend import _C
m = torch.nn.Linear(2, 2)
_, opt, _ = fastops.accelerate(m, torch.optim.AdamW(m.parameters()), precision="fp32", device="cpu")
x = torch.ones(16 << 20)  # 64 MiB, above glibc's largest mmap threshold
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.full((16 << 20,), 2.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
assert bool((x == 2).all())
print(opt.accelerator.keeps_freed_memory, faults, _C.cpp.cpu_cache_stats()["hits"])
"""


@pytest.mark.parametrize("setting", ["1", "0"])
def test_accelerate_on_the_cpu_reuses_freed_blocks(setting):
    # Page faults show whether a freed 64 MiB block came back from the cache (none) or was mapped anew by
    # glibc (one per 4 KiB page: 16384).
    kept, faults, hits = _run(_ACCELERATE, FASTOPS_KEEP_FREED_MEMORY=setting).split()
    if setting == "1":
        assert (kept, hits) == ("True", "1") and int(faults) < 100
    else:
        assert (kept, hits) == ("False", "0") and int(faults) > 10000


def test_best_fit_limit_and_release():
    out = _run(
        """
import torch
from fastops._backend import _C
MiB = 1 << 20
stats = _C.cpp.cpu_cache_stats
assert _C.cpp.cpu_cache_enable(100 * MiB)
def block(mib):  # a tensor of `mib` MiB
    return torch.empty(mib * MiB // 4)
a = block(40); ptr = a.data_ptr(); del a
assert stats()["cached_bytes"] == 40 * MiB, stats()
b = block(34)  # 40 MiB wastes less than a quarter of 34: served from the cache
assert b.data_ptr() == ptr and stats()["hits"] == 1 and stats()["cached_bytes"] == 0, stats()
c = block(20)  # 40 MiB would waste half: a new block
assert stats()["misses"] == 2, stats()
d = block(2)  # below 8 MiB: torch's own allocator, not counted
assert stats()["misses"] == 2, stats()
e, f = block(46), block(50)
del b, c, e, f  # 40 + 20 + 46 + 50 MiB freed, newest last; the limit keeps 50 + 46
s = stats()
assert s["cached_bytes"] == 96 * MiB and s["released"] == 2, s
g = block(46)  # the 46 MiB block, not the 50 MiB one
assert stats()["cached_bytes"] == 50 * MiB
_C.cpp.cpu_cache_enable(10 * MiB)  # a lower limit releases at once
assert stats()["cached_bytes"] == 0 and stats()["limit_bytes"] == 10 * MiB
del g  # larger than the whole limit: given back to the OS, not cached
assert stats()["cached_bytes"] == 0
_C.cpp.cpu_cache_enable(100 * MiB)
h = block(12); del h
_C.cpp.cpu_cache_empty()
assert stats()["cached_bytes"] == 0
print("ok")
"""
    )
    assert out.strip() == "ok"


def test_fused_loss_workspace_comes_from_the_cache():
    # The fused loss's own buffers in one chunk of rows (bf16 logits 1024 x 32000, 62.5 MiB; on CPUs with AMX the
    # weight's H x V copy, 15.6 MiB) are mapped afresh at every call on huge pages, and come from the cache once
    # fastops.accelerate installed it. (The op's own plan goes through the vocabulary there: 2 MiB blocks.)
    # The second call's other large block hits the cache either way (1 hit with the buffers on huge pages of their
    # own, measured); the buffers make it 2, or 3 with the copy.
    out = _run(
        """
import torch, fastops
from fastops._backend import _C
assert _C.cpp.cpu_cache_enable(1 << 30)
g = torch.Generator().manual_seed(0)
x = torch.randn(1024, 256, generator=g).bfloat16().requires_grad_()
w = (torch.randn(32000, 256, generator=g) / 16).bfloat16().requires_grad_()
t = torch.randint(0, 32000, (1024,), generator=g)
def call():
    x.grad = w.grad = None
    fastops.linear_cross_entropy(x, w, t, chunk_rows=1024).backward()
call()
hits = _C.cpp.cpu_cache_stats()["hits"]
call()
print(_C.cpp.cpu_cache_stats()["hits"] - hits)
"""
    )
    copy = "amx_bf16" in Path("/proc/cpuinfo").read_text().split()  # linear_ce.cpp copies the weight where AMX is
    assert int(out) >= 2 + copy, out


def test_threads_share_the_cache_safely():
    # Four threads allocate, fill, check and free blocks of 8 to 60 MiB against a cache smaller than what
    # they hold together, so hits, misses and evictions interleave.
    out = _run(
        """
import random, threading, torch
from fastops._backend import _C
assert _C.cpp.cpu_cache_enable(96 << 20)
errors, count = [], [0] * 4
def work(k):
    rng = random.Random(k)
    for i in range(40):
        n = rng.randint(8, 60) << 18  # floats: 8 to 60 MiB
        t = torch.full((n,), float(k * 1000 + i))
        if not t.min().item() == t.max().item() == k * 1000 + i:  # scalar results: no other large block
            errors.append((k, i))
        count[k] += 1
threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
s = _C.cpp.cpu_cache_stats()
assert not errors, errors
assert s["hits"] + s["misses"] == sum(count) == 160 and s["hits"] > 0 and s["cached_bytes"] <= 96 << 20, s
print("ok")
"""
    )
    assert out.strip() == "ok"


def test_forked_children_do_not_inherit_a_locked_cache():
    # DataLoader workers forked while a training thread allocates: fork copies only the forking thread, so
    # without the cache's fork handlers a child forked while the other thread is inside the cache waits for
    # its lock forever. The backward pass of a chain of 12 MiB tensors allocates and frees (GIL released)
    # against a 16 MiB limit, so blocks are taken, cached and evicted (freed under the lock) all the time.
    # Without the handlers 44 of the 60 children hung and 6 more started with the parent's cached blocks;
    # with the cache off none hung. Each child checks that it starts with an empty cache and that its own
    # blocks are cached and reused.
    out = _run(
        """
import os, signal, threading, time, torch
from fastops._backend import _C
MiB = 1 << 20
stats = _C.cpp.cpu_cache_stats
assert _C.cpp.cpu_cache_enable(16 * MiB)
x = torch.ones(3 * MiB, requires_grad=True)
def step():
    h = x
    for _ in range(8):
        h = h * 1.5
    h.sum().backward()
# Each op once first: a child forked while the thread runs an op for the first time waits forever on the
# op's static initialisation, left half done (__cxa_guard_acquire in as_strided, 9 of 100): torch's hazard.
step(); torch.empty(4 * MiB)
stop = threading.Event()
def train():
    while not stop.is_set():
        step()
thread = threading.Thread(target=train); thread.start()
children = []
for _ in range(60):
    pid = os.fork()
    if pid == 0:
        fresh = False
        try:
            before = stats()
            t = torch.empty(4 * MiB); ptr = t.data_ptr(); del t
            t = torch.empty(4 * MiB)
            fresh = before["cached_bytes"] == 0 and t.data_ptr() == ptr and stats()["hits"] == before["hits"] + 1
        finally:
            os._exit(0 if fresh else 1)
    children.append(pid)
stop.set(); thread.join()
def exit_code(pid, deadline):
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
    return "hung"
deadline = time.monotonic() + 30  # a child exits in milliseconds; a hung one never does
codes = [exit_code(pid, deadline) for pid in children]
print(codes.count("hung"), "hung", codes.count(1), "failed")
""",
        timeout=300,
    )
    assert out.strip() == "0 hung 0 failed"
