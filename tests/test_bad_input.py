"""Bad input gets a clear error naming the problem, on every CPU backend; never a silently wrong result."""

from __future__ import annotations

import pytest
import torch

import fastops
from tests.test_ops import adam_inputs

ops = torch.ops.fastops


@pytest.mark.parametrize("cls", [fastops.optim.AdamW, fastops.optim.Adam])
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -1e-3}, "Invalid learning rate"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
        ({"eps": -1e-8}, "Invalid epsilon value"),
        ({"weight_decay": -0.1}, "Invalid weight_decay value"),
    ],
)
def test_hyperparameters_use_torch_wording(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_differentiable_is_not_implemented():
    with pytest.raises(NotImplementedError, match="differentiable=True"):
        fastops.optim.AdamW([torch.nn.Parameter(torch.ones(2))], differentiable=True)


def test_sparse_grad(cpu_backend):
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = fastops.optim.AdamW([p])
    p.grad = torch.ones(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(p, torch.ones(4, 3)) and len(opt.state[p]) == 0


def test_complex_params():
    with pytest.raises(ValueError, match="does not support complex params"):
        fastops.optim.AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))])


def test_float64_params_name_the_dtype():
    with pytest.raises(ValueError, match="param 0 has dtype torch.float64"):
        fastops.optim.AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])


def test_params_on_two_devices_in_one_group():
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, device="meta"))]
    with pytest.raises(ValueError, match="param 1 is on meta but param 0 is on cpu"):
        fastops.optim.AdamW(params)


def test_overlapping_params():
    base = torch.zeros(10)
    with pytest.raises(ValueError, match="params 0 and 1 overlap in memory"):
        fastops.optim.AdamW([torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])])


def test_non_contiguous_params():
    with pytest.raises(ValueError, match="param 0 .* is not contiguous"):
        fastops.optim.AdamW([torch.nn.Parameter(torch.randn(4, 6)[:, ::2])])


def test_dense_permuted_params_work_like_torch(cpu_backend):
    """channels_last-style layouts are dense, so they are fine: the kernel walks memory in lockstep."""
    mine = torch.nn.Parameter(torch.randn(3, 5).t())
    theirs = torch.nn.Parameter(mine.detach().clone())
    opt, ref = fastops.optim.AdamW([mine]), torch.optim.AdamW([theirs], foreach=False)
    for step in range(3):
        g = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        mine.grad, theirs.grad = g.clone(), g.clone()  # contiguous grad, transposed param: copied to match
        opt.step()
        ref.step()
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_grad_with_wrong_dtype_or_shape_at_the_op(cpu_backend):
    args = adam_inputs([5, 4])
    args[1] = [args[1][0], args[1][1].half()]
    with pytest.raises(RuntimeError, match=r"grads\[1\] has dtype torch.float16"):
        ops.adam_step_(*args)
    args = adam_inputs([5, 4])
    args[1] = [args[1][0], torch.zeros(3)]
    with pytest.raises(RuntimeError, match=r"grads\[1\] has shape \(3,\) but params\[1\] has shape \(4,\)"):
        ops.adam_step_(*args)
    args = adam_inputs([5, 4])
    args[2] = args[2][:1]
    with pytest.raises(RuntimeError, match="expected 2 exp_avgs"):
        ops.adam_step_(*args)
    args = adam_inputs([5, 4])
    args[3] = [args[3][0], args[3][1].bfloat16()]
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[1\] has dtype torch.bfloat16"):
        ops.adam_step_(*args)


def test_bad_grads_at_the_amp_ops(cpu_backend):
    with pytest.raises(RuntimeError, match=r"grads\[1\] has dtype torch.int64"):
        ops.unscale_check_([torch.ones(3), torch.ones(3, dtype=torch.long)], torch.zeros(1), torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="needs at least one tensor"):
        ops.grad_stats([])
