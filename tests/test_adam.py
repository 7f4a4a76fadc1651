"""fastops.optim.Adam/AdamW against torch.optim.Adam/AdamW, many steps, every CPU backend."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops

STEPS = 50


def _model_params(seed: int, sizes, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def _grads(step: int, params, scale: float = 1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).mul_(scale).to(p.dtype) for p in params]


def _schedule(step: int, n: int):
    """Which params get a grad at this step: a frozen param for steps 20-29, no grads at all at step 35."""
    if step == 35:
        return []
    return [i for i in range(n) if not (i == 1 and 20 <= step < 30)]


def _run(opt, params, steps, lr_change_at=10, tensor_lr=False):
    for step in range(steps):
        if step == lr_change_at:
            for k, group in enumerate(opt.param_groups):
                new = group["lr"] * (0.5 + 0.25 * k)
                if tensor_lr:
                    group["lr"].fill_(float(new))
                else:
                    group["lr"] = new
        grads = _grads(step, params)
        live = _schedule(step, len(params))
        for i, p in enumerate(params):
            p.grad = grads[i] if i in live else None
        opt.step()


def _groups(params, tensor_lr: bool):
    lr1, lr2 = (torch.tensor(1e-2), torch.tensor(3e-3)) if tensor_lr else (1e-2, 3e-3)
    return [
        {"params": params[:2], "lr": lr1},
        {"params": params[2:], "lr": lr2, "betas": (0.8, 0.95), "weight_decay": 0.3, "eps": 1e-6},
    ]


def _sizes(backend):
    # The Triton interpreter runs ~1e5 elements/s, so it gets small tensors; the others get odd real sizes.
    return (3, 1023, 1, 77, 0) if backend == "triton" else (3, 1023, 1, 4097, 0, 10_000)


@pytest.mark.parametrize("algo", ["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_parity_fp32(cpu_backend, algo, amsgrad, maximize, weight_decay):
    sizes = _sizes(cpu_backend)
    mine, theirs = _model_params(0, sizes), _model_params(0, sizes)
    kw = dict(amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay)
    opt = getattr(fastops.optim, algo)(_groups(mine, False), **kw)
    ref = getattr(torch.optim, algo)(_groups(theirs, False), foreach=False, **kw)
    _run(opt, mine, STEPS)
    _run(ref, theirs, STEPS)
    # fp32: the C++ and Triton kernels fuse multiply-adds and compute bias corrections in one go, so they
    # differ from torch's op-by-op for-loop by a few ulps per step; 50 steps of lr ~1e-2 stay well inside
    # rtol 1e-5 / atol 1e-6 (measured max difference ~1e-7). The reference replays torch's ops: bit-exact.
    exact = cpu_backend == "reference"
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
    for a, b in zip(mine, theirs):
        if b in ref.state:
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in ref.state[b]:
                    torch.testing.assert_close(opt.state[a][key], ref.state[b][key], rtol=1e-5, atol=1e-7)
            assert opt.state[a]["step"].item() == ref.state[b]["step"].item()


def test_parity_tensor_lr(cpu_backend):
    sizes = _sizes(cpu_backend)
    mine, theirs = _model_params(1, sizes), _model_params(1, sizes)
    opt = fastops.optim.AdamW(_groups(mine, True))
    ref = torch.optim.AdamW(_groups(theirs, True), foreach=False)
    _run(opt, mine, STEPS, tensor_lr=True)
    _run(ref, theirs, STEPS, tensor_lr=True)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _upcast_run(sizes, steps, seed, dtype, to):
    """torch.optim.AdamW in dtype ``to`` from the same start and grads as a ``dtype`` run (both rounded to ``dtype``)."""
    low = _model_params(seed, sizes, dtype)
    params = [p.detach().to(to).requires_grad_() for p in low]
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    for step in range(steps):
        for p, g in zip(params, _grads(step, low)):
            p.grad = g.to(to)
        opt.step()
    return [p.detach() for p in params]


def _err(params, truth):
    return max((p.detach().double() - t).abs().max().item() for p, t in zip(params, truth) if t.numel())


# Low-precision params: the error against an fp64 run, as a multiple of the error torch itself makes in
# the same dtype (flash-attention's rule: a kernel may be at most ~2x worse than plain PyTorch at that
# dtype). With an fp32 master the comparison point is torch's fp32 run, since the master *is* fp32.
LOW_PRECISION = [
    # dtype, master, torch run it is held to, allowed ratio, why
    (torch.bfloat16, False, torch.bfloat16, 1.5, "fp32 states make fastops no worse than torch's bf16 states"),
    (torch.float16, False, torch.float16, 1.5, "as bf16; fp16 rounding is 8x finer, so both errors are smaller"),
    (torch.bfloat16, True, torch.float32, 2.0, "the master is updated in fp32; params are its rounding"),
    (torch.float16, True, torch.float32, 2.0, "as bf16"),
]


@pytest.mark.parametrize("dtype,master,peer,ratio,why", LOW_PRECISION, ids=lambda v: str(v))
def test_low_precision_error_vs_fp64(cpu_backend, dtype, master, peer, ratio, why):
    sizes, steps = _sizes(cpu_backend), STEPS
    truth = _upcast_run(sizes, steps, 2, dtype, torch.float64)
    theirs = _upcast_run(sizes, steps, 2, dtype, peer)
    mine = _model_params(2, sizes, dtype)
    opt = fastops.optim.AdamW(mine, lr=1e-2, master_weights=master)
    for step in range(steps):
        for p, g in zip(mine, _grads(step, mine)):
            p.grad = g
        opt.step()
    if master:
        masters = [opt.state[p]["master_param"] for p in mine if p.numel()]
        assert all(m.dtype == torch.float32 for m in masters)
        for p in mine:
            torch.testing.assert_close(p, opt.state[p]["master_param"].to(dtype), rtol=0, atol=0)
        mine_err = _err(masters, [t for t in truth if t.numel()])
    else:
        mine_err = _err(mine, truth)
    # the peer's error plus one rounding of the param dtype, so a bit-exact peer still leaves room
    slack = torch.finfo(dtype).eps if not master else 1e-6
    assert mine_err <= ratio * _err(theirs, truth) + slack, why
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in mine)


def test_state_dict_cross_load_both_ways(cpu_backend):
    sizes = _sizes(cpu_backend)
    baseline = _model_params(3, sizes)
    base_opt = torch.optim.AdamW(baseline, lr=1e-2, amsgrad=True)
    _run(base_opt, baseline, 30, lr_change_at=-1)

    switched = _model_params(3, sizes)
    torch_opt = torch.optim.AdamW(switched, lr=1e-2, amsgrad=True)
    for step in range(30):
        if step == 10:  # torch -> fastops
            fast_opt = fastops.optim.AdamW(switched, lr=1e-2, amsgrad=True)
            fast_opt.load_state_dict(torch_opt.state_dict())
            opt = fast_opt
        elif step == 20:  # fastops -> torch
            torch_opt = torch.optim.AdamW(switched, lr=5.0, amsgrad=False)
            torch_opt.load_state_dict(copy.deepcopy(fast_opt.state_dict()))
            opt = torch_opt
        elif step == 0:
            opt = torch_opt
        grads = _grads(step, switched)
        live = _schedule(step, len(switched))
        for i, p in enumerate(switched):
            p.grad = grads[i] if i in live else None
        opt.step()
    assert torch_opt.param_groups[0]["lr"] == 1e-2 and torch_opt.param_groups[0]["amsgrad"]
    for a, b in zip(switched, baseline):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd = fast_opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32


def test_state_dict_keeps_fp32_states_for_bf16_params():
    params = _model_params(4, (5, 7), torch.bfloat16)
    opt = fastops.optim.AdamW(params, master_weights=True)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    other = fastops.optim.AdamW(params, master_weights=True)
    other.load_state_dict(sd)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert other.state[p][key].dtype == torch.float32
            torch.testing.assert_close(other.state[p][key], opt.state[p][key], rtol=0, atol=0)
    # A torch state_dict has no master_weights key: the optimizer keeps its own setting.
    torch_sd = torch.optim.AdamW(params).state_dict()
    other.load_state_dict(torch_sd)
    assert other.param_groups[0]["master_weights"] is True


def test_add_param_group_and_hyperparameters_roundtrip():
    params = _model_params(5, (4, 6, 8))
    opt = fastops.optim.AdamW(params[:1], lr=1e-3)
    opt.add_param_group({"params": params[1:], "lr": 5e-4, "weight_decay": 0.0})
    ref = torch.optim.AdamW(params[:1], lr=1e-3)
    ref.add_param_group({"params": params[1:], "lr": 5e-4, "weight_decay": 0.0})
    strip = lambda groups: [{k: v for k, v in g.items() if k not in ("master_weights", "max_grad_norm")} for g in groups]  # noqa: E731
    assert strip(opt.state_dict()["param_groups"]) == ref.state_dict()["param_groups"]
    assert isinstance(opt, torch.optim.AdamW) and isinstance(fastops.optim.Adam(params), torch.optim.Adam)


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


def test_grad_scaler_skips_without_changing_anything(cpu_backend):
    params = _model_params(6, (5, 9))
    opt = fastops.optim.AdamW(params, lr=1e-2)
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
