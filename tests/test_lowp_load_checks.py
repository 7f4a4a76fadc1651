"""Malformed low-precision (8-bit, bf16) state dicts fail at ``load_state_dict`` with a ValueError naming the
problem, before anything changes (issue 20): the loading optimizer's params, states and param_groups are those it
had. Without the checks a negative absmax loaded and trained on sign-flipped moments, a missing absmax raised a
bare KeyError, float moments next to absmax keys loaded as fp32 moments (a param moved by 8.9 at lr 1e-3), and a
nan absmax or a negative step poisoned every param at the next step."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
from fastops import _backend

N = 5000  # over MIN_8BIT_NUMEL (4096): 8-bit states; 20 blocks of 256, the last one partial
SMALL = 7  # under it: fp32 states under "8bit"


def _trained(fmt: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (N, SMALL)]
    opt = fastops.optim.AdamW(params, lr=1e-3, state_dtype=fmt)
    with _backend.use("cpu", "reference"):
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    return params, opt


def _snapshot(params, opt):
    def copy_value(v):
        return v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)

    state = {i: {k: copy_value(v) for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    groups = [{k: (v if k != "params" else [id(p) for p in v]) for k, v in g.items()} for g in opt.param_groups]
    return [p.detach().clone() for p in params], state, copy.deepcopy(groups)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _set(key, value):
    def edit(st):
        st[key] = value(st) if callable(value) else value

    return edit


def _drop(key):
    return lambda st: st.pop(key)


def _negate_block(st):
    st["exp_avg_absmax"] = st["exp_avg_absmax"].clone()
    st["exp_avg_absmax"][3] = -st["exp_avg_absmax"][3]


def _nan_block(st):
    st["exp_avg_sq_absmax"] = st["exp_avg_sq_absmax"].clone()
    st["exp_avg_sq_absmax"][-1] = float("nan")


def _float_moments(st):
    # Two formats mixed: fp32 moments (what an fp32 optimizer saves) next to the 8-bit absmax keys.
    st["exp_avg"], st["exp_avg_sq"] = fastops.optim.moments_fp32(st)


# (saved format, edit of the large param's saved state, the message's words)
CASES = {
    "negative absmax": ("8bit", _negate_block, r"exp_avg_absmax holds -.*finite number >= 0"),
    "nan absmax": ("8bit", _nan_block, r"exp_avg_sq_absmax holds nan"),
    "inf absmax": ("8bit", _set("exp_avg_absmax", lambda st: st["exp_avg_absmax"] * float("inf")),
                   r"exp_avg_absmax holds inf"),
    "missing exp_avg_absmax": ("8bit", _drop("exp_avg_absmax"),
                               r"8-bit exp_avg \(uint8 codes\) needs its exp_avg_absmax in the same state"),
    "missing exp_avg_sq_absmax": ("8bit", _drop("exp_avg_sq_absmax"),
                                  r"8-bit exp_avg_sq \(uint8 codes\) needs its exp_avg_sq_absmax"),
    "missing exp_avg_sq": ("8bit", _drop("exp_avg_sq"),
                           r"8-bit states need both exp_avg and exp_avg_sq; exp_avg_sq is missing"),
    "float moments next to absmax": ("8bit", _float_moments, r"exp_avg is torch.float32 next to .*mixes two formats"),
    "bf16 moments next to absmax": ("8bit", _set("exp_avg", lambda st: torch.zeros(N, dtype=torch.bfloat16)),
                                    r"exp_avg is torch.bfloat16 next to"),
    "int8 codes": ("8bit", _set("exp_avg_sq", lambda st: st["exp_avg_sq"].to(torch.int8)),
                   r"exp_avg_sq is torch.int8 next to"),
    "codes of another shape": ("8bit", _set("exp_avg", lambda st: st["exp_avg"].view(50, 100)),
                               r"8-bit exp_avg has shape \(50, 100\); its param's is \(5000,\)"),
    "absmax of another length": ("8bit", _set("exp_avg_absmax", lambda st: st["exp_avg_absmax"][:-1]),
                                 r"exp_avg_absmax must be float32 of shape \(20,\).*got torch.float32 of shape "
                                 r"\(19,\)"),
    "float64 absmax": ("8bit", _set("exp_avg_absmax", lambda st: st["exp_avg_absmax"].double()),
                       r"exp_avg_absmax must be float32"),
    "negative step, 8-bit": ("8bit", _set("step", torch.tensor(-1.0)), r"step is -1.0; a step count is a number >= 0"),
    "nan step, bf16": ("bf16", _set("step", torch.tensor(float("nan"))), r"step is nan"),
    "negative step, fp32": ("fp32", _set("step", -3), r"step is -3"),
    "absmax next to bf16 moments": ("bf16", _set("exp_avg_absmax", torch.ones(20)), r"exp_avg is torch.bfloat16 next"),
}


@pytest.mark.parametrize("into", ["8bit", "bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_a_malformed_state_dict_fails_before_anything_changes(case, into):
    fmt, edit, words = CASES[case]
    _, source = _trained(fmt, seed=0)
    sd = copy.deepcopy(source.state_dict())
    edit(sd["state"][0])
    params, opt = _trained(into, seed=1)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=r"fastops.optim.AdamW.load_state_dict: state\[0\]: " + words):
        opt.load_state_dict(sd)
    assert _same(_snapshot(params, opt), before)
    # And it still steps as before: nothing half-loaded was left for the post hook.
    assert "_fastops_loading" not in opt.__dict__


@pytest.mark.parametrize("fmt", ["8bit", "bf16", "fp32"])
def test_a_well_formed_state_dict_loads(fmt):
    # The same path without an edit loads, and changes the states: the cases above would fail on a check that
    # refused everything, or on a snapshot that could not see a load.
    source_params, source = _trained(fmt, seed=0)
    params, opt = _trained(fmt, seed=1)
    before = _snapshot(params, opt)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    assert not _same(_snapshot(params, opt), before)
    assert _same(_snapshot(params, opt)[1], _snapshot(source_params, source)[1])


def test_a_zero_absmax_and_step_zero_load():
    # The bounds are inclusive: fresh 8-bit states are codes 0 with absmax 0, at step 0.
    _, source = _trained("8bit", seed=0)
    sd = copy.deepcopy(source.state_dict())
    st = sd["state"][0]
    st["exp_avg_absmax"].zero_()
    st["step"] = torch.tensor(0.0)
    params, opt = _trained("8bit", seed=1)
    opt.load_state_dict(sd)
    assert float(opt.state[params[0]]["step"]) == 0.0 and not opt.state[params[0]]["exp_avg_absmax"].any()
