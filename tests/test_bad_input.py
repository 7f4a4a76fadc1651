"""Bad input gets a clear error naming the problem, on every backend; never a silently wrong result."""

from __future__ import annotations

import pytest
import torch

import fastops
from fastops import _backend
from fastops._specs import SPECS
from tests.devices import PAIRS

ops = torch.ops.fastops


BAD_HYPERPARAMETERS = [
    # torch.optim.Adam's constructor checks, with its wording
    ({"lr": -1e-3}, "Invalid learning rate: -0.001"),
    ({"lr": float("nan")}, "Invalid learning rate: nan"),
    ({"lr": torch.tensor(-1.0)}, "Invalid learning rate: -1.0"),
    ({"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element"),
    ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
    ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
    ({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1: 1.0"),
    ({"eps": -1e-8}, "Invalid epsilon value: -1e-08"),
    ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    # torch's constructor keeps betas[:2] of these, and its step fails to unpack one set in a group
    ({"betas": (0.9, 0.99, 0.5)}, r"betas must be a pair \(beta1, beta2\), got 3 elements"),
    ({"betas": (0.9,)}, r"betas must be a pair \(beta1, beta2\), got 1 elements"),
    # torch has no rule; an integer lr would fail only at the first step, inside the op
    ({"lr": torch.tensor(1)}, "Tensor lr must be a floating-point tensor, got torch.int64"),
]


@pytest.mark.parametrize("cls", [fastops.optim.AdamW, fastops.optim.Adam])
@pytest.mark.parametrize("kwargs,match", BAD_HYPERPARAMETERS)
def test_hyperparameters_use_torch_wording(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.ones(2))], **kwargs)


BAD_GROUP_HYPERPARAMETERS = BAD_HYPERPARAMETERS + [({"max_grad_norm": -1.0}, "Invalid max_grad_norm value: -1.0")]


@pytest.mark.parametrize("kwargs,match", BAD_GROUP_HYPERPARAMETERS)
def test_add_param_group_checks_hyperparameters(kwargs, match):
    """torch checks only the constructor's values; a group added later with betas=(1.0, 0.999) would give nan."""
    opt = fastops.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], **kwargs})
    assert len(opt.param_groups) == 1, "a group that raised is not added"


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("lr", -1.0, r"Invalid learning rate: -1.0 \(param_groups\[1\]\)"),
        ("betas", (1.0, 0.999), r"Invalid beta parameter at index 0: 1.0 \(param_groups\[1\]\)"),
        ("betas", (torch.tensor(0.9), torch.tensor(1.5)),
         r"Invalid beta parameter at index 1: 1.5 \(param_groups\[1\]\)"),
        ("eps", -1.0, r"Invalid epsilon value: -1.0 \(param_groups\[1\]\)"),
        ("weight_decay", -0.1, r"Invalid weight_decay value: -0.1 \(param_groups\[1\]\)"),
        ("max_grad_norm", -1.0, r"Invalid max_grad_norm value: -1.0 \(param_groups\[1\]\)"),
        ("betas", (0.9, 0.99, 0.5), r"a pair .* got 3 elements: \(0.9, 0.99, 0.5\) \(param_groups\[1\]\)"),
        ("lr", torch.tensor(1), r"Tensor lr must be a floating-point tensor, got torch.int64 \(param_groups\[1\]\)"),
    ],
)
def test_hyperparameters_changed_between_steps(cpu_backend, key, value, match):
    """A scheduler or user edit after construction is checked at the next step, before anything changes."""
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))]
    opt = fastops.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params]
    opt.param_groups[1][key] = value
    with pytest.raises(ValueError, match=match):
        opt.step()
    for p, b, m in zip(params, *before):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["exp_avg"], m)
        assert opt.state[p]["step"].item() == 1


def test_cpu_tensor_lr_set_negative_between_steps(cpu_backend):
    lr = torch.tensor(1e-2)
    p = torch.nn.Parameter(torch.randn(4))
    opt = fastops.optim.AdamW([p], lr=lr)
    p.grad = torch.ones(4)
    opt.step()
    lr.fill_(-1.0)
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1.0 \(param_groups\[0\]\)"):
        opt.step()


def test_sparse_grad(cpu_backend):
    """The group goes to torch's step (see test_patch), which raises its own message, changing nothing."""
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = fastops.optim.AdamW([p])
    p.grad = torch.ones(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(p, torch.ones(4, 3)) and len(opt.state[p]) == 0


def _stale_grad(param_shape, grad, param_dtype=torch.float32, transpose=False):
    """A param reassigned through .data keeps its old grad, the one way torch lets a grad's shape or dtype
    differ from its param's (assigning p.grad checks both)."""
    p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
    p.grad = grad
    new = torch.randn(param_shape[::-1] if transpose else param_shape).to(param_dtype)
    p.data = new.t() if transpose else new
    return p


# Each row's grad and param have different strides (the grad would be copied into the param's layout, which
# broadcasts or casts: checked by the optimizer first, naming the group) or the same strides (passed to the op
# as they are: checked by the op, as in test_grad_with_wrong_dtype_or_shape_at_the_op).
COPIED, AT_THE_OP = r"fastops.optim.AdamW: in param_groups\[1\], ", "fastops: "


@pytest.mark.parametrize(
    "param_shape,grad,dtype,transpose,where,match",
    [
        ((1, 4), torch.ones(4, 1), torch.float32, False, COPIED,
         r"grads\[1\] has shape \(4, 1\) but params\[1\] has shape \(1, 4\)"),
        ((4, 3), torch.ones(3), torch.float32, True, COPIED,
         r"grads\[1\] has shape \(3,\) but params\[1\] has shape \(4, 3\)"),
        ((2, 3), torch.ones(2, 3), torch.bfloat16, True, COPIED,
         r"grads\[1\] has dtype torch.float32 but must be torch.bfloat16 \(as params\[1\]\)"),
        ((1, 4), torch.ones(3, 4), torch.float32, False, AT_THE_OP,
         r"grads\[1\] has shape \(3, 4\) but params\[1\] has shape \(1, 4\)"),
        ((2, 3), torch.ones(2, 3), torch.float16, False, AT_THE_OP,
         r"grads\[1\] has dtype torch.float32 but must be torch.float16 \(as params\[1\]\)"),
        ((4, 1), torch.ones(1), torch.float32, False, AT_THE_OP,  # one element: never copied
         r"grads\[1\] has shape \(1,\) but params\[1\] has shape \(4, 1\)"),
    ],
)  # fmt: skip
def test_grad_with_wrong_shape_or_dtype_through_the_optimizer(cpu_backend, param_shape, grad, dtype, transpose, where,
                                                             match):  # fmt: skip
    good = torch.nn.Parameter(torch.randn(3))
    good.grad = torch.ones(3)
    bad = _stale_grad(param_shape, grad, dtype, transpose)
    before = bad.detach().clone(), good.detach().clone()
    opt = fastops.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": [good, bad]}])
    with pytest.raises(RuntimeError, match=where + match):
        opt.step()
    assert torch.equal(bad, before[0]) and torch.equal(good, before[1])


def test_overlapping_params():
    base = torch.zeros(10)
    with pytest.raises(ValueError, match="params 0 and 1 overlap in memory"):
        fastops.optim.AdamW([torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])])


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


def _bits(t):
    t = t.reshape(-1)
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).long()
    return t.long()


def _snapshot(args):
    """Each tensor's bits (nan payloads and -0.0 compared as written), dense copies of gapped ones."""
    return [[_bits(t.cpu()) for t in a] if isinstance(a, list) else a for a in args]


@pytest.mark.parametrize("device,backend", PAIRS)
@pytest.mark.parametrize("name", list(SPECS))
def test_bad_input_fails_alike_on_every_backend(name, device, backend):
    """Each bad call of the op's spec (fastops/_specs) raises the spec's error with its message word for word, on
    every (device, backend) pair, and writes nothing: the op checks once, before any backend runs (the CUDA
    C++ binding once had weaker checks of its own: a transposed grad reached a kernel that walks memory flat)."""
    with _backend.use(device, backend):
        for bad in SPECS[name].bad_inputs(device):
            before = _snapshot(bad.args)
            with pytest.raises(bad.error) as err:
                getattr(ops, name)(*bad.args)
            assert str(err.value) == bad.message, bad.id
            for got, want in zip(_snapshot(bad.args), before):
                if isinstance(got, list):
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{bad.id}: an argument was written"


@pytest.mark.parametrize("name", list(SPECS))
def test_bad_input_fails_while_tracing(name):
    """The fake kernel runs the same check on metadata, so inside torch.compile a bad call fails when traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for bad in SPECS[name].bad_inputs("cpu"):
        if not bad.traced:
            continue
        with FakeTensorMode() as mode:
            fake = [[mode.from_tensor(t) for t in a] if isinstance(a, list) else
                    mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in bad.args]  # fmt: skip
            with pytest.raises(bad.error) as err:
                getattr(ops, name)(*fake)
        assert str(err.value) == bad.message, bad.id
