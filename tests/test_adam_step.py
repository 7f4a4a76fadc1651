"""The fastops Adam/AdamW step's surface: step_was_skipped and last_grad_norm, torch.compile, fastops.patch(),
GradScaler skips and parity with torch's fused step, DTensor params."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
from fastops import _backend
from tests.adam_helpers import _fresh_dynamo, _model_params, _grads
from tests.rounding import norm_rtol


def test_step_was_skipped_is_a_bool_tensor_without_grads(cpu_backend):
    """torch's GradScaler hands over found_inf = sum([]) = 0, a Python int, when no param has a grad (its
    update() then raises; fastops.amp.GradScaler raises already in step())."""
    model = torch.nn.Linear(3, 2)
    opt = fastops.optim.AdamW(model.parameters(), fused=True)  # torch's scaler hands fused optimizers found_inf
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 3)).sum())  # sets up the scale; no backward, so no grads
    scaler.step(opt)
    skipped = opt.step_was_skipped
    assert isinstance(skipped, torch.Tensor) and skipped.dtype == torch.bool and skipped.device == model.weight.device
    assert not skipped and opt.last_grad_norm.isnan()


def test_last_grad_norm_is_this_steps_or_nan(cpu_backend):
    """Set when this step computed the norm (clipping, or a GradScaler's scale handed over); nan otherwise,
    never an earlier step's value."""
    params = _model_params(11, (5, 9))
    opt = fastops.optim.AdamW(params, lr=1e-2, max_grad_norm=1.0)

    def feed(step, scale=1.0):
        grads = _grads(step, params, scale)
        for p, g in zip(params, grads):
            p.grad = g
        return torch.linalg.vector_norm(torch.cat(grads)) / scale

    want = feed(0)
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm, want, rtol=2 * norm_rtol(sum(p.numel() for p in params)), atol=0)
    opt.param_groups[0]["max_grad_norm"] = None
    feed(1)
    opt.step()
    assert opt.last_grad_norm.isnan()
    want = feed(2, scale=1024.0)
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), None  # as fastops.amp.GradScaler hands it over
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm, want, rtol=2 * norm_rtol(sum(p.numel() for p in params)), atol=0)
    opt.grad_scale, opt.found_inf = None, torch.tensor(0.0)  # after unscale_: the flag is known, no read
    feed(3)
    opt.step()
    assert opt.last_grad_norm.isnan() and opt.step_was_skipped.dtype == torch.bool
    del opt.grad_scale, opt.found_inf


@pytest.mark.parametrize("first_compiled", [True, False])
def test_compiled_step_updates_the_flags(first_compiled):
    """Attributes assigned inside a torch.compile'd step do not survive it; the flags are tensors made with the
    optimizer and written in place, so they are this step's also after a compiled first step."""
    _fresh_dynamo()
    with _backend.use("cpu", "reference"):
        p = torch.nn.Parameter(torch.zeros(3))
        o = fastops.optim.AdamW([p], max_grad_norm=100.0)
        compiled = torch.compile(o.step, backend="aot_eager")
        for k, value in enumerate((1.0, 10.0, 2.0)):
            p.grad = torch.full((3,), value)
            compiled() if first_compiled or k else o.step()
            torch.testing.assert_close(o.last_grad_norm, torch.tensor(value * 3**0.5))
            assert not o.step_was_skipped


def test_compiled_scaler_step_and_update():
    """torch.compile(lambda: (scaler.step(o), scaler.update())) with fastops' GradScaler, from the first step,
    with an inf at step 1: the skip flag, the scale and the params follow the eager run."""
    _fresh_dynamo()
    runs = []
    for compiled in (True, False):
        with _backend.use("cpu", "reference"):
            p = torch.nn.Parameter(torch.ones(3))
            o = fastops.optim.AdamW([p], lr=0.1)
            scaler = fastops.amp.GradScaler("cpu", init_scale=4.0)
            phase = lambda: (scaler.step(o), scaler.update())  # noqa: E731
            phase = torch.compile(phase, backend="aot_eager") if compiled else phase
            flags = []
            for step in range(3):
                scaler.scale((p * (float("inf") if step == 1 else 1.0)).sum()).backward()
                phase()
                flags.append(bool(o.step_was_skipped))
                o.zero_grad()
        runs.append((flags, scaler.get_scale(), p.detach().clone()))
    assert runs[0][0] == [False, True, False] and runs[0][:2] == runs[1][:2]
    assert torch.equal(runs[0][2], runs[1][2])


def test_zero_size_and_no_grad_params_are_fine(cpu_backend):
    params = [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = fastops.optim.AdamW(params)
    params[0].grad = torch.empty(0)
    params[1].grad = torch.ones(3)
    opt.step()
    assert params[2] not in opt.state
    assert opt.state[params[0]]["step"].item() == 1
    assert (params[1] < 1).all()


def test_torch_compile_without_graph_break():
    _fresh_dynamo()
    model = torch.nn.Linear(8, 4)
    opt = fastops.optim.AdamW(model.parameters(), lr=1e-2)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step():
        opt.step()

    x = torch.randn(2, 8)
    for _ in range(3):
        for m, o in ((model, step), (ref_model, ref.step)):
            m.zero_grad()
            m(x).square().sum().backward()
            o()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_patch_unpatch_patched():
    original_adamw, original_adam = torch.optim.AdamW, torch.optim.Adam
    fastops.patch()
    try:
        assert torch.optim.AdamW is fastops.optim.AdamW and torch.optim.Adam is fastops.optim.Adam
        from torch.optim.adamw import AdamW

        assert AdamW is fastops.optim.AdamW
        fastops.patch()  # idempotent
    finally:
        fastops.unpatch()
    assert torch.optim.AdamW is original_adamw and torch.optim.Adam is original_adam
    with fastops.patched():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
        assert isinstance(opt, fastops.optim.AdamW)
    assert torch.optim.AdamW is original_adamw


@pytest.mark.parametrize("make", [lambda ps: fastops.optim.AdamW(ps, lr=1e-2, max_grad_norm=1.0),
                                  lambda ps: fastops.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.2),
                                  lambda ps: fastops.optim.SGD(ps, lr=1e-2, momentum=0.9, master_weights=True)],
                         ids=["AdamW", "SGD", "SGD-master"])  # fmt: skip
def test_grad_scaler_skips_without_changing_anything(cpu_backend, make):
    params = _model_params(6, (5, 9), torch.bfloat16)
    opt = make(params)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    before = copy.deepcopy((params, opt.state_dict()))
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    for p, g in zip(params, _grads(1, params)):
        p.grad = g
    opt.step()
    del opt.grad_scale, opt.found_inf
    for a, b in zip(params, before[0]):
        assert torch.equal(a, b)
    after = opt.state_dict()["state"]
    for i, st in before[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(after[i][k], v), k


def test_grad_scaler_parity_with_torch_fused(cpu_backend):
    """torch.amp.GradScaler drives both optimizers through the grad_scale/found_inf attributes."""
    results = []
    for cls, kw in ((fastops.optim.AdamW, {}), (torch.optim.AdamW, {"fused": True})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = cls(model.parameters(), lr=1e-2, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        for step in range(12):
            opt.zero_grad()
            x = torch.linspace(-1, 1, 24).view(4, 6) * (step + 1)
            loss = model(x).square().mean()
            scaler.scale(loss).backward()
            if step in (4, 9):
                model[0].weight.grad[0, 0] = float("inf") if step == 4 else float("nan")
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale(),
                        [opt.state[p]["step"].item() for p in model.parameters()]))
    (pa, sa, ka), (pb, sb, kb) = results
    assert sa == sb and ka == kb == [10.0] * 4
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dtensor_params_update_their_local_shard(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        full = torch.randn(8, 4)
        dparam = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(full.clone())
        opt, ref = fastops.optim.AdamW([dparam], lr=1e-2), torch.optim.AdamW([plain], lr=1e-2, foreach=False)
        for step in range(5):
            g = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            dparam.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            plain.grad = g
            opt.step()
            ref.step()
        torch.testing.assert_close(dparam.full_tensor(), plain.detach(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
