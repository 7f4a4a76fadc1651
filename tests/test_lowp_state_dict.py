"""fastops.optim.Adam/AdamW's low-precision states (``state_dtype``) in state dicts and param groups: torch's state
dict format for fp32 states, the round trip through torch, any format loaded into any other, per-group formats and
the params that keep fp32 states."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fastops
from fastops import _backend, optim
from tests.test_lowp_states import FORMATS, LR, _assert_same, _params, _run, _snapshot


def _state_keys(opt, p):
    return {k: v.dtype for k, v in opt.state[p].items()}


def test_groups_exclude_params_and_small_params_stay_fp32():
    emb, w, norm = (torch.nn.Parameter(torch.randn(n)) for n in (8192, 8192, 64))
    opt = fastops.optim.AdamW([{"params": [emb], "state_dtype": "fp32"}, {"params": [w, norm]}], state_dtype="8bit")
    with _backend.use("cpu", "reference"):
        _run(opt, [emb, w, norm], steps=2)
    assert _state_keys(opt, emb) == {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    assert _state_keys(opt, norm) == _state_keys(opt, emb)  # under MIN_8BIT_NUMEL
    assert _state_keys(opt, w) == {"step": torch.float32, "exp_avg": torch.uint8, "exp_avg_sq": torch.uint8,
                                   "exp_avg_absmax": torch.float32, "exp_avg_sq_absmax": torch.float32}  # fmt: skip
    assert opt.state[w]["exp_avg_absmax"].shape == (32,)
    # The other way round: an fp32 optimizer with one 8-bit group.
    opt = fastops.optim.AdamW([{"params": [emb]}, {"params": [w], "state_dtype": "bf16"}])
    with _backend.use("cpu", "reference"):
        _run(opt, [emb, w], steps=1)
    assert opt.state[emb]["exp_avg"].dtype == torch.float32 and opt.state[w]["exp_avg"].dtype == torch.bfloat16
    assert "state_dtype" not in opt.state_dict()["param_groups"][0]


def test_bad_state_dtype_and_amsgrad_raise():
    p = torch.nn.Parameter(torch.randn(5000))
    with pytest.raises(ValueError, match="amsgrad=True needs fp32 states"):
        fastops.optim.AdamW([p], amsgrad=True, state_dtype="8bit")
    with pytest.raises(ValueError, match=r"amsgrad=True needs fp32 states"):
        fastops.optim.Adam([{"params": [p]}, {"params": [torch.nn.Parameter(torch.ones(2))], "state_dtype": "bf16",
                                              "amsgrad": True}])  # fmt: skip
    with pytest.raises(ValueError, match="Invalid state_dtype: 'int8'"):
        fastops.optim.AdamW([p], state_dtype="int8")
    with pytest.raises(ValueError, match="state_dtype applies to Adam and AdamW"):
        fastops.optim.SGD([{"params": [p], "state_dtype": "8bit"}])
    opt = fastops.optim.AdamW([p], state_dtype="8bit")
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="amsgrad=True needs fp32 states"):
        opt.step()


def test_fp32_state_dict_has_no_new_keys():
    """state_dtype="fp32" (the default) writes the state_dict fastops wrote before state_dtype existed: torch's
    keys plus master_weights and max_grad_norm, and a torch.save of it holds the same bytes whether or not the
    constructor was given the defaults explicitly."""
    blobs = []
    for kw in ({}, {"state_dtype": "fp32", "state_seed": 0}):
        params = _params(7)
        opt = fastops.optim.AdamW(params, lr=LR, **kw)
        with _backend.use("cpu", "reference"):
            _run(opt, params, steps=2)
        sd = opt.state_dict()
        ref = torch.optim.AdamW(_params(7), lr=LR)
        torch_keys = set(ref.state_dict()["param_groups"][0])
        assert set(sd["param_groups"][0]) == torch_keys | {"master_weights", "max_grad_norm"}
        assert set(sd["state"][3]) == {"step", "exp_avg", "exp_avg_sq"}
        buf = io.BytesIO()
        torch.save(sd, buf)
        blobs.append(buf.getvalue())
    assert blobs[0] == blobs[1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip_through_torch(cpu_backend, fmt):
    """fastops lowp -> to_fp32_state_dict -> torch.optim.AdamW -> its state_dict -> fastops lowp again: torch gets
    the decoded moments, and fastops requantizes them to what it had. bf16 and 8-bit exp_avg_sq (unsigned map, +1.0
    in it) come back bit for bit; 8-bit exp_avg within one rounding, since the signed map has no -1.0: a block
    whose largest magnitude is negative decodes to 0.9955 of its absmax, and requantizing rescales the block."""
    params = _params(8)
    opt = fastops.optim.AdamW(params, lr=LR, state_dtype=fmt)
    _run(opt, params, steps=5)
    exported = opt.to_fp32_state_dict()
    assert "state_dtype" not in exported["param_groups"][0] and "state_dtype" in opt.state_dict()["param_groups"][0]
    assert opt.state[params[3]]["exp_avg"].dtype != torch.float32  # exporting changes nothing in the optimizer
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(twins, lr=LR)
    ref.load_state_dict(copy.deepcopy(exported))
    for p, t in zip(params, twins):
        m, v = optim.moments_fp32(opt.state[p])
        assert torch.equal(ref.state[t]["exp_avg"], m) and torch.equal(ref.state[t]["exp_avg_sq"], v)
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    back = fastops.optim.AdamW(back_params, lr=LR, state_dtype=fmt)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    if fmt == "bf16":
        _assert_same(_snapshot(opt, params), _snapshot(back, back_params))
        return
    for p, q in zip(params, back_params):
        a, b = opt.state[p], back.state[q]
        assert a.keys() == b.keys()
        for key in ("step", "exp_avg_sq", "exp_avg_sq_absmax"):
            if key in a:
                assert torch.equal(a[key], b[key]), key
        m0, m1 = optim.moments_fp32(a)[0], optim.moments_fp32(b)[0]
        assert (m1 - m0).abs().max() <= 0.9 / 128 * m0.abs().max() * (1 + 1e-5)


@pytest.mark.parametrize("src,dst", [("8bit", "fp32"), ("bf16", "fp32"), ("fp32", "8bit"), ("bf16", "8bit"),
                                     ("8bit", "bf16"), ("fp32", "bf16")])  # fmt: skip
def test_switch_state_dtype_by_load(src, dst):
    """A state_dict of any format loads into an optimizer of any other: the states are converted to the loading
    optimizer's state_dtype (its group keys win) and training continues from the decoded moments."""
    params = _params(9)
    opt = fastops.optim.AdamW(params, lr=LR, state_dtype=src)
    with _backend.use("cpu", "reference"):
        _run(opt, params, steps=3)
    sd = opt.state_dict()
    other_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = fastops.optim.AdamW(other_params, lr=LR, state_dtype=dst)
    other.load_state_dict(sd)
    assert other.param_groups[0].get("state_dtype", "fp32") == dst
    for p, q in zip(params, other_params):
        fmt = optim._state_format(other.param_groups[0], q)
        want = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[fmt]
        assert other.state[q]["exp_avg"].dtype == want
        assert ("exp_avg_absmax" in other.state[q]) == (fmt == "8bit")
        m0, v0 = optim.moments_fp32(opt.state[p])
        m1, v1 = optim.moments_fp32(other.state[q])
        if fmt == "fp32":  # widening is exact
            assert torch.equal(m0, m1) and torch.equal(v0, v1)
        else:  # one rounding into the format, see test_one_step_states_are_within_one_rounding
            tol = 2**-8 if fmt == "bf16" else 0.9 / 128
            assert (m1 - m0).abs().max() <= tol * m0.abs().max() * (1 + 1e-5)
            assert (v1 - v0).abs().max() <= tol * v0.abs().max() * (1 + 1e-5)
    with _backend.use("cpu", "reference"):
        _run(other, other_params, steps=2, start=3)
    assert all(other.state[q]["step"].item() == 5 for q in other_params)


def test_changing_the_group_key_between_steps_converts():
    params = _params(10)
    opt = fastops.optim.AdamW(params, lr=LR)
    with _backend.use("cpu", "reference"):
        _run(opt, params, steps=2)
        opt.param_groups[0]["state_dtype"] = "8bit"
        _run(opt, params, steps=1, start=2)
    assert opt.state[params[3]]["exp_avg"].dtype == torch.uint8
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32
