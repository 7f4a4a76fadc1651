"""fastops.patch() runs every script torch runs (groups the kernels do not take go to torch's step), and
fastops.optim.fuse_ converts torch's optimizers in place."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
from fastops import _backend, optim
from tests.adam_helpers import _grads, _model_params

TORCH = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
KW = {"AdamW": dict(lr=1e-2), "Adam": dict(lr=1e-2, weight_decay=0.1), "SGD": dict(lr=0.05, momentum=0.9)}


def test_patch_covers_sgd():
    original = torch.optim.SGD
    with fastops.patched():
        from torch.optim.sgd import SGD

        assert torch.optim.SGD is fastops.optim.SGD and SGD is fastops.optim.SGD
        assert isinstance(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))]), fastops.optim.SGD)
    from torch.optim.sgd import SGD

    assert torch.optim.SGD is original and SGD is original


def _case(case: str, algo: str, seed: int):
    """Params for a group the kernels do not take, and the constructor kwargs that go with them."""
    g = torch.Generator().manual_seed(seed)
    if case == "float64":
        return [torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))], {}
    if case == "complex":
        return [torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.complex64))], {}
    if case == "strided":
        return [torch.nn.Parameter(torch.randn(4, 6, generator=g)[:, ::2])], {}
    if case == "differentiable":  # torch's differentiable steps take non-leaf params (in-place under grad mode)
        return [torch.randn(5, generator=g).requires_grad_().clone()], {"differentiable": True}
    raise AssertionError(case)


def _feed(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


@pytest.mark.parametrize("algo", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("case", ["float64", "complex", "strided", "differentiable"])
def test_patched_optimizers_take_what_torch_takes(algo, case):
    """A group the kernels do not take next to one they do: the first runs torch's own step (identical to torch),
    the second the fused one (identical on the reference)."""
    runs = []
    for patched in (True, False):
        odd, kw = _case(case, algo, 0)
        plain = [] if kw else _model_params(1, (7, 3))
        with fastops.patched() if patched else _nothing():
            if kw:  # differentiable=True is a setting of the optimizer: all of it is torch's
                opt = getattr(torch.optim, algo)(odd, **KW[algo], **kw)
            else:
                opt = getattr(torch.optim, algo)([{"params": odd}, {"params": plain}], **KW[algo])
            assert isinstance(opt, getattr(fastops.optim, algo)) == patched
            with _backend.use("cpu", "reference"):
                for step in range(6):
                    _feed(odd + plain, step)
                    opt.step()
        runs.append([p.detach().clone() for p in odd + plain])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_sparse_grads_of_sgd_go_to_torch():
    """nn.Embedding(sparse=True) trains with torch's SGD; fastops' SGD gives the same result."""
    out = []
    for cls in (fastops.optim.SGD, torch.optim.SGD):
        torch.manual_seed(0)
        emb, lin = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)
        opt = cls([{"params": emb.parameters()}, {"params": lin.parameters()}], lr=0.1, momentum=0.9)
        with _backend.use("cpu", "reference"):
            for step in range(5):
                opt.zero_grad()
                lin(emb(torch.tensor([step, 3, 7]))).sum().backward()
                opt.step()
        out.append([p.detach().clone() for p in (*emb.parameters(), *lin.parameters())])
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaler_name", ["torch", "fastops"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_torch_groups_under_a_scaler_and_clip(scaler_name, max_grad_norm):
    """A float64 group under a GradScaler (and a folded clip): its grads are unscaled (and clipped by the norm of
    all grads) in place as torch does, and it skips with the fused group on inf (step 2)."""
    results = []
    for mine in (True, False):
        odd, _ = _case("float64", "AdamW", 0)
        plain = _model_params(1, (7, 3))
        groups = [{"params": odd}, {"params": plain}]
        if mine:
            opt = fastops.optim.AdamW(groups, lr=1e-2, max_grad_norm=max_grad_norm)
            scaler = (torch.amp.GradScaler if scaler_name == "torch" else fastops.amp.GradScaler)("cpu", init_scale=8.0)
        else:
            opt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
            scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        with _backend.use("cpu", "reference"):
            for step in range(5):
                _feed(odd + plain, step)
                scale = scaler.scale(torch.ones(()))  # (also sets the scaler up)
                for p in odd + plain:
                    p.grad.mul_(scale.to(p.dtype))
                if step == 2:
                    plain[0].grad[0] = float("inf")
                if not mine:
                    scaler.unscale_(opt)
                    if max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(odd + plain, max_grad_norm)
                scaler.step(opt)
                scaler.update()
        results.append(([p.detach().clone() for p in odd + plain], scaler.get_scale()))
    (pa, sa), (pb, sb) = results
    assert sa == sb
    # The fused group divides by scale / clip coef where torch multiplies by 1/scale, then coef: rounding only.
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algo", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fuse_converts_in_place_mid_training(algo, dtype):
    """After 5 torch steps fuse_ makes it fastops' (same object, groups, hooks, scheduler) and the run goes on as
    the torch run does (fp32: bit for bit on the reference; bf16: states upcast, so the update is the fp32 one)."""
    kw = dict(KW[algo])
    mine, theirs = _model_params(2, (7, 3, 0), dtype), _model_params(2, (7, 3, 0), dtype)
    opt, ref = TORCH[algo](mine, foreach=False, **kw), TORCH[algo](theirs, foreach=False, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, 3, gamma=0.5)
    hook_calls = []
    opt.register_step_post_hook(lambda *a: hook_calls.append(1))
    groups = opt.param_groups
    with _backend.use("cpu", "reference"):
        for step in range(10):
            if step == 5:
                assert optim.fuse_(opt) and optim.fuse_(opt)  # (a second call changes nothing)
                assert type(opt) is getattr(fastops.optim, algo) and opt.param_groups is groups
                for s in opt.state.values():
                    assert all(v.dtype == torch.float32 for k, v in s.items() if k != "step")
            if step == 7:  # a skipped step (as a GradScaler hands it over) changes nothing in a fastops step
                opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
                opt.step()
                del opt.grad_scale, opt.found_inf
                assert opt.step_was_skipped
            for ps, o, sc in ((mine, opt, sched), (theirs, ref, ref_sched)):
                for p, g in zip(ps, _grads(step, ps)):
                    p.grad = g
                o.step()
                sc.step()
    assert len(hook_calls) == 11 and opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    if dtype == torch.float32:
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    else:
        # torch keeps bf16 states and rounds after every op; fastops' fp32 states and single rounding do not. Over
        # the 5 steps after the conversion the worst |diff| / (1e-3 + 2^-7 |torch|) measured 0.99 (SGD, whose bf16
        # buffer accumulates the roundings), 0.33 (AdamW), 0 (Adam): twice that bound.
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2e-3)


def test_fuse_declines_what_it_cannot_take():
    class MyAdamW(torch.optim.AdamW):
        pass

    p32 = [torch.nn.Parameter(torch.ones(2))]
    declined = [
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]),
        torch.optim.SGD(p32, differentiable=True),
        MyAdamW(p32),
        torch.optim.RMSprop(p32),
        torch.optim.SGD([torch.nn.Parameter(torch.randn(4, 6)[:, ::2])]),
    ]
    for opt in declined:
        cls, state = type(opt), copy.deepcopy(opt.state_dict())
        assert not optim.fuse_(opt)
        assert type(opt) is cls and opt.state_dict() == state


def test_subclass_of_a_fastops_optimizer_falls_back_to_torchs_step():
    """A user's subclass of fastops' class still finds torch's step for a float64 group (not its own again)."""

    class MySGD(fastops.optim.SGD):
        pass

    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt, ref = MySGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([q], lr=0.1, momentum=0.9)
    for _ in range(3):
        p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
        opt.step()
        ref.step()
    assert torch.equal(p, q) and opt.state[p]["momentum_buffer"].dtype == torch.float64


def test_patch_reaches_classes_imported_before_it():
    """``from torch.optim import AdamW`` holds torch's class from before patch(); what it builds afterwards is
    fastops' all the same, and torch's again after unpatch(). A user's subclass of torch's class stays as it is (as
    fuse_ leaves it)."""
    from torch.amp import GradScaler
    from torch.optim import SGD, Adam, AdamW

    class Mine(AdamW):
        pass

    model = torch.nn.Linear(3, 2)
    made = {AdamW: fastops.optim.AdamW, Adam: fastops.optim.Adam, SGD: fastops.optim.SGD}
    for _ in range(2):  # a second patch/unpatch round works as the first
        with fastops.patched():
            for torch_cls, fastops_cls in made.items():
                assert type(torch_cls(model.parameters(), lr=0.1)) is fastops_cls
            assert type(GradScaler("cpu", init_scale=4.0)) is fastops.amp.GradScaler
            assert type(Mine(model.parameters())) is Mine
        for torch_cls in made:
            assert type(torch_cls(model.parameters(), lr=0.1)) is torch_cls
        scaler = GradScaler("cpu", init_scale=4.0)
        assert type(scaler) is GradScaler and scaler.get_scale() == 4.0
    assert type(fastops.optim.AdamW(model.parameters(), lr=0.1)) is fastops.optim.AdamW


def test_patch_reaches_timms_optimizer_table():
    """timm's optimizer table is built when timm is imported, with torch's classes; under patch() what
    create_optimizer_v2 builds is fastops' all the same, and torch's after unpatch()."""
    timm_optim = pytest.importorskip("timm.optim", reason="timm needs torchvision, which the torch 2.13 CI leg lacks")
    model = torch.nn.Linear(3, 2)
    with fastops.patched():
        assert type(timm_optim.create_optimizer_v2(model, "adamw", lr=1e-3)) is fastops.optim.AdamW
        assert type(timm_optim.create_optimizer_v2(model, "sgd", lr=1e-3, momentum=0.9)) is fastops.optim.SGD
    assert type(timm_optim.create_optimizer_v2(model, "adamw", lr=1e-3)) is torch.optim.AdamW


def test_patch_names_the_function_references_it_cannot_reach(monkeypatch):
    """A module that did ``from torch.nn.utils import clip_grad_norm_`` before patch() keeps calling torch's:
    patch() says which."""
    import sys
    import types

    script = types.ModuleType("train_script")
    script.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
    script.other = torch.nn.utils.clip_grad_value_
    monkeypatch.setitem(sys.modules, "train_script", script)
    with pytest.warns(RuntimeWarning, match=r"train_script\.clip_grad_norm_ \(torch\.nn\.utils\.clip_grad_norm_\)"):
        with fastops.patched():
            assert torch.nn.utils.clip_grad_norm_ is fastops.amp.clip_grad_norm_
    monkeypatch.delitem(sys.modules, "train_script")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastops.patched():
            pass
