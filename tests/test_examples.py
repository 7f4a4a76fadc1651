"""examples/train_one_line.py runs as its docstring says: in one process, and under torchrun with 2 ranks (DDP
over gloo on the CPU), each saving and reloading its checkpoint."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.accelerate_helpers import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "train_one_line.py")


def _run(cmd: list[str], tmp_path) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _check(stdout: str, processes: int, strategy: str) -> None:
    losses = [float(x) for x in re.findall(rf"loss (\S+) \({processes} process\(es\), {strategy}, ", stdout)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), stdout
    assert re.search(r"saved and reloaded .* at step \d+", stdout), stdout


@pytest.mark.slow
def test_the_example_in_one_process(tmp_path):
    cmd = [sys.executable, EXAMPLE, "--epochs", "2", "--samples", "256", "--ckpt", str(tmp_path / "one.pt")]
    _check(_run(cmd, tmp_path), 1, "none")


@pytest.mark.slow
def test_the_example_under_torchrun_with_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", EXAMPLE,
           "--epochs", "2", "--samples", "256", "--ckpt", str(tmp_path / "ddp.pt")]  # fmt: skip
    _check(_run(cmd, tmp_path), 2, "ddp")
