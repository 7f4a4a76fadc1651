"""The CUDA kernels' math, run on the CPU: fastops._C.cuda_math compiles csrc/cuda/adam_math.cuh, codec.cuh and
dropout_math.cuh (the Adam update and its step scalars, the 8-bit codec, the stochastic rounding, dropout's mask) for
the host and walks CPU tensors as the kernels walk theirs (csrc/cuda_math.cpp). So every CPU run of the suite executes
that code:
- against fastops.reference: the states bit for bit (8-bit codes and absmax, stochastically rounded bf16, fp32
  moments, step counters), the params within the reference's sqrt (MKL's on the CPU, not correctly rounded; see
  tests/test_lowp_ops.assert_step_matches);
- against the C++ CPU kernels where they have FMA (AVX2, AVX-512): those place their fused multiply-adds and roundings
  where the CUDA math does, and take correctly rounded sqrt and division too, so everything matches bit for bit.
lr is a float32 tensor here: the math reads it through a pointer, as the CUDA kernels read an lr on the GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastops
from fastops import _backend, reference
from fastops._quant import StateFormat
from fastops._specs import adam, adam_lowp, dropout
from tests.devices import clone
from tests.test_lowp_ops import assert_step_matches, bits

pytestmark = pytest.mark.skipif(_backend._C is None, reason=f"fastops._C did not load: {_backend._C_ERROR}")

SPECS = {"adam_step_": adam, "adam_step_lowp_": adam_lowp}


def fp32_lr(args):
    return args._replace(lr=args.lr.float())


def with_fma():
    return _backend._C is not None and fastops._C.cpu_capability() in ("avx2", "avx512", "avx512_vbmi")


def run_cuda_math(name, args):
    getattr(_backend._C.cuda_math, name)(*args)


def check(name, want, **tolerance):
    """The CUDA math from ``want``'s inputs against the reference, then against the C++ kernels (with FMA)."""
    got = clone(want)
    run_cuda_math(name, got)
    cpp = clone(want)
    getattr(reference, name)(*want)
    assert_step_matches(got, want, **tolerance)
    if with_fma():
        _backend.load("cpp", "cpu")
        getattr(_backend._C.cpp, name)(*cpp)
        for field, a_list in got._asdict().items():
            if isinstance(a_list, list):
                for a, b in zip(a_list, getattr(cpp, field)):
                    assert torch.equal(bits(a), bits(b)), field


@pytest.mark.parametrize("name,case", [(n, s.id) for n, spec in SPECS.items() for s in spec.sample_inputs()])
def test_samples(name, case):
    check(name, fp32_lr(next(s.args for s in SPECS[name].sample_inputs() if s.id == case)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 1300), min_size=1, max_size=4), fmt=st.sampled_from(list(StateFormat)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), master=st.booleans(),
       wd=st.sampled_from([0.0, 0.1]), decoupled=st.booleans(), maximize=st.booleans(),
       beta1=st.sampled_from([0.9, 0.3]), scale=st.sampled_from([None, 8.0]),
       seed=st.integers(-(2**63), 2**63 - 1))  # fmt: skip
def test_parity_hypothesis(sizes, fmt, dtype, master, wd, decoupled, maximize, beta1, scale, seed):
    scale = None if scale is None else torch.tensor(scale)
    if fmt is StateFormat.FP32:  # fp32 states: adam_step_, amsgrad for odd seeds
        args = adam.inputs(sizes, dtype, amsgrad=seed % 2 == 1, master=master, scale=scale, seed=seed % 1000)
        name = "adam_step_"
    else:
        args = adam_lowp.inputs(sizes, fmt, dtype, master=master, scale=scale, seed=seed)
        name = "adam_step_lowp_"
    # max_ulps=2, as tests/test_lowp_ops.py's sweep argues: an update as large as the param carries the reference's
    # 1-ulp sqrt error into the result, and the subtraction rounds once more (found here: 2 ulps in an fp32 amsgrad
    # step, sizes [64, 100, 1007], maximize, L2 decay).
    check(name, fp32_lr(args._replace(weight_decay=wd, decoupled=decoupled, maximize=maximize, beta1=beta1)),
          param_ulp_share=0.05, max_ulps=2)


@pytest.mark.parametrize("fmt", [StateFormat.EIGHT_BIT, StateFormat.BF16])
def test_skipped_step_and_special_values(fmt):
    """found_inf set: nothing is written (the kernels' first line); nan and inf grads: the blocks' absmax and codes as
    the reference has them."""
    args = fp32_lr(adam_lowp.inputs([600, 300], fmt, found_inf=torch.ones(())))
    before = clone(args)
    run_cuda_math("adam_step_lowp_", args)
    assert all(torch.equal(bits(a), bits(b)) for f in ("params", "exp_avgs", "state_steps")
               for a, b in zip(getattr(args, f), getattr(before, f)))  # fmt: skip
    want = args._replace(found_inf=None)
    for i, v in ((3, float("nan")), (300, float("inf")), (520, -float("inf"))):
        want.grads[0][i] = v
    got = clone(want)
    run_cuda_math("adam_step_lowp_", got)
    reference.adam_step_lowp_(*want)
    for name in ("exp_avgs", "exp_avg_sqs", "exp_avg_absmax", "exp_avg_sq_absmax"):
        for a, b in zip(getattr(got, name), getattr(want, name)):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), name


@pytest.mark.parametrize("case", [s.id for s in dropout.sample_inputs()])
def test_dropout_samples(case):
    # dropout.cu's per-element math (dropout_math.cuh), bit for bit with the reference.
    args = next(s.args for s in dropout.sample_inputs() if s.id == case)
    assert torch.equal(bits(_backend._C.cuda_math.dropout(*args)), bits(reference.dropout(*args)))
