"""The step scalars of the Triton Adam kernels (kernels/_adam.py program_scalars: -lr / bias_correction1,
sqrt(bias_correction2), 1 - lr * weight_decay with lr read in the kernel) against the reference's, bit for bit.

The reference computes them from Python floats (fp64, beta ** step through libm's pow) and torch rounds them once
to fp32; the kernels compute them in fp64 (beta ** step by squaring) and round once. Measured over steps 1..10000
at 4 beta pairs, and 10k steps sampled up to 1.6e7, they differ in none (the fp32 -expm1 recipe the fp32 kernel
used before differed in 66-2545 of the sqrt(bc2) values), so the comparison is exact.
Under the Triton interpreter on CPU without a GPU (conftest), compiled on CUDA with one."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastops.kernels import _adam  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COLS = _adam.FIRST_OWN.value + 1  # the common columns, then numel
STEPS = list(range(1, 201)) + [999, 1000, 4096, 12345, 10**5, 999_999, 10**7, 2**24]


@triton.jit
def _scalars_kernel(rows, chunks, consts, lr_ptr, out, COLS: tl.constexpr):
    # One program per table row; program_scalars reads the row's step through its STEP column.
    common = (rows, chunks, consts, lr_ptr, 0.0, 0.0, lr_ptr, 1.0, lr_ptr, 0.0, 0.0, 0.0, 0.0, 0.0)
    _, _, _, s, _ = _adam.program_scalars(common, COLS, 1, True, 0, False)
    scale, decay, neg_step_size, bc2_sqrt = s
    pid = tl.program_id(0)
    tl.store(out + 3 * pid, decay)
    tl.store(out + 3 * pid + 1, neg_step_size)
    tl.store(out + 3 * pid + 2, bc2_sqrt)


def _kernel_scalars(lr, beta1, beta2, weight_decay):
    steps = torch.tensor(STEPS, dtype=torch.float32, device=DEVICE)
    n = len(STEPS)
    rows = torch.zeros(n, COLS, dtype=torch.int64)
    rows[:, _adam.STEP.value] = steps.data_ptr() + 4 * torch.arange(n)
    rows[:, COLS - 1] = 1
    chunks = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.int64)], 1)
    consts = torch.tensor([beta1, beta2, weight_decay], dtype=torch.float64, device=DEVICE)
    out = torch.empty(n, 3, device=DEVICE)
    lr_t = torch.tensor(lr, dtype=torch.float32, device=DEVICE)
    _scalars_kernel[(n,)](rows.to(DEVICE), chunks.to(DEVICE), consts, lr_t, out, COLS=COLS)
    return out.cpu()


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.95, 0.9999), (0.5, 0.99), (0.0, 0.9)], ids=str)
def test_triton_step_scalars_are_the_references(betas):
    beta1, beta2 = betas
    lr = torch.tensor(3e-4, dtype=torch.float32).item()  # the value a fp32 lr tensor's .item() gives
    weight_decay = 0.3  # not exact in fp32: an fp32 copy gave another decay for 29 of 10k lrs
    got = _kernel_scalars(lr, beta1, beta2, weight_decay)
    # reference.py's expressions, rounded to fp32 as torch's kernels take their Python scalars.
    want = torch.tensor(
        [[1 - lr * weight_decay, -(lr / (1 - beta1**s)), math.sqrt(1 - beta2**s)] for s in map(float, STEPS)],
        dtype=torch.float64,
    ).float()
    diff = (got != want).any(1).nonzero().flatten().tolist()
    assert not diff, [(STEPS[i], got[i].tolist(), want[i].tolist()) for i in diff[:5]]
