"""The Triton launchers (fastops.kernels) called directly against fastops.reference.

Without a GPU they run on CPU tensors under the Triton interpreter, so sizes stay small (the interpreter
does ~1e5 elements/s). On a GPU machine the same comparisons run compiled on CUDA tensors. One test also
compiles every kernel for sm_90 in a subprocess (Triton's bundled ptxas, no GPU needed), which catches what
the interpreter lets through (type mismatches between branches, unsupported ops) and checks that the
full-chunk path uses 16-byte accesses.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastops import reference  # noqa: E402
from fastops.kernels import _common as kcommon  # noqa: E402
from fastops.kernels import adam as kadam  # noqa: E402
from fastops.kernels import amp as kamp  # noqa: E402
from fastops.kernels import sgd as ksgd  # noqa: E402
from fastops.kernels._common import round_to  # noqa: E402
from tests.rounding import sum_rtol  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = (0, 1, 1023, 5000)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Initial step counters: fresh, resumed, long-running.
STEPS0 = (0.0, 5.0, 100.0, 1.0)


def _state(dtypes, sizes, amsgrad, master, seed):
    g = torch.Generator().manual_seed(seed)
    P, G, M, V, VM, S, W = [], [], [], [], [], [], []
    for k, (dt, n) in enumerate(zip(dtypes, sizes)):
        w = torch.randn(n, generator=g)
        P.append(w.to(dt))
        G.append((torch.randn(n, generator=g) * 0.5).to(dt))
        M.append(torch.randn(n, generator=g) * 0.1)
        V.append(torch.rand(n, generator=g) * 0.01)
        if amsgrad:
            VM.append(V[-1] + torch.rand(n, generator=g) * 0.01 * (torch.rand(n, generator=g) > 0.5))
        S.append(torch.tensor(STEPS0[k % len(STEPS0)]))
        if master:
            W.append(w.clone())
    return [[t.to(DEVICE) for t in lst] for lst in (P, G, M, V, VM, S, W)]


def _clone(state):
    return [[t.clone() for t in lst] for lst in state]


def _assert_lists_close(names, mine, ref, where):
    for name, la, lb in zip(names, mine, ref):
        for i, (a, b) in enumerate(zip(la, lb)):
            what = f"{where}: {name}[{i}]"
            if name in ("grads", "state_steps"):
                # Grads are read-only; step counters are exact small integers in fp32.
                assert torch.equal(a, b), what
            elif name == "params" and a.dtype != torch.float32:
                # bf16/fp16: rounded once from an fp32 value within ~1e-7 relative of the reference's, so at
                # most one ulp apart (measured: bit-identical in every case here).
                ulp = torch.finfo(a.dtype).eps * b.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
                assert ((a.float() - b.float()).abs() <= ulp).all(), what
            else:
                # fp32: Adam's bias corrections in fp32 in the kernel against fp64 in the reference (<= 2.2e-7
                # relative), fma where torch's CPU kernels fuse (the interpreter computes it unfused): measured
                # max 2.4e-7 on |p| < 4.
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=what)


def _assert_adam_close(mine, ref, where):
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "master_params")
    _assert_lists_close(names, mine, ref, where)


def _adam_both(state, lr, beta1, beta2, eps, wd, amsgrad, maximize, decoupled, grad_scale, found_inf, on_host, steps):
    mine, ref = _clone(state), _clone(state)
    for _ in range(steps):
        kw = dict(scalars_on_host=on_host)
        fa = None if found_inf is None else found_inf.clone()
        fb = None if found_inf is None else found_inf.clone()
        kadam._adam_step(*mine, lr, beta1, beta2, eps, wd, amsgrad, maximize, decoupled, grad_scale, fa, **kw)
        reference.adam_step_(*ref, lr, beta1, beta2, eps, wd, amsgrad, maximize, decoupled, grad_scale, fb)
    return mine, ref


# (amsgrad, maximize, weight_decay, decoupled, master): every flag on and off at least once with every other.
FLAG_SETS = [
    (False, False, 0.0, False, False),
    (True, False, 0.0, False, False),
    (False, True, 0.1, False, False),
    (False, False, 0.1, True, False),
    (True, True, 0.1, True, True),
    (False, False, 0.1, False, True),
    (True, False, 0.1, False, True),
    (False, True, 0.0, False, True),
]
# (grad_scale, found_inf, scalars read on the host)
SCALAR_SETS = [(None, None, False), (1024.0, 0.0, False), (1024.0, None, True), (None, 0.0, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "ams{}-max{}-wd{}-dec{}-master{}".format(*map(int, f)))
@pytest.mark.parametrize("scalars", SCALAR_SETS, ids=lambda s: f"scale{s[0]}-inf{s[1]}-host{int(s[2])}")
def test_adam_matches_reference(dtype, flags, scalars):
    amsgrad, maximize, wd, decoupled, master = flags
    gs, fi, on_host = scalars
    state = _state([dtype] * len(SIZES), SIZES, amsgrad, master, seed=7)
    dev = "cpu" if on_host else DEVICE
    lr = torch.tensor(1e-2, device=dev)
    grad_scale = None if gs is None else torch.tensor(gs, device=dev)
    found_inf = None if fi is None else torch.tensor([fi], device=dev)
    mine, ref = _adam_both(state, lr, 0.9, 0.999, 1e-8, wd, amsgrad, maximize, decoupled, grad_scale, found_inf,
                           on_host, steps=2)  # fmt: skip
    _assert_adam_close(mine, ref, f"{dtype} {flags} {scalars}")


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_found_inf_changes_nothing(on_host, amsgrad):
    state = _state([torch.float32, torch.bfloat16, torch.float16, torch.float32], SIZES, amsgrad, True, seed=3)
    dev = "cpu" if on_host else DEVICE
    mine = _clone(state)
    kadam._adam_step(*mine, torch.tensor(1e-2, device=dev), 0.9, 0.999, 1e-8, 0.1, amsgrad, False, True,
                     torch.tensor(2.0, device=dev), torch.tensor([1.0], device=dev), scalars_on_host=on_host)  # fmt: skip
    for la, lb in zip(mine, state):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)


def test_adam_mixed_dtypes_and_a_multi_chunk_tensor():
    # 70_000 elements: four full 16384-element chunks and a tail, next to tensors of other dtypes.
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    sizes = [1023, 5000, 1, 70_000, 70_000]
    for amsgrad, decoupled, master in [(True, True, True), (False, False, False)]:
        state = _state(dtypes, sizes, amsgrad, master, seed=11)
        lr = torch.tensor(3e-3, device=DEVICE)
        mine, ref = _adam_both(state, lr, 0.8, 0.95, 1e-6, 0.3, amsgrad, False, decoupled,
                               torch.tensor(512.0, device=DEVICE), torch.tensor([0.0], device=DEVICE), False, 2)  # fmt: skip
        _assert_adam_close(mine, ref, f"mixed ams={amsgrad}")


def test_adam_lr_as_float64_cpu_tensor_and_empty_lists():
    state = _state([torch.float32] * 4, SIZES, False, False, seed=5)
    lr = torch.tensor(1e-3, dtype=torch.float64)
    mine, ref = _adam_both(state, lr, 0.9, 0.999, 1e-8, 0.0, False, False, False, None, None, True, 1)
    _assert_adam_close(mine, ref, "fp64 lr")
    kadam.adam_step_([], [], [], [], [], [], [], lr, 0.9, 0.999, 1e-8, 0.0, False, False, False, None, None)


def test_adam_tables_are_cached(monkeypatch):
    kcommon.TABLES.clear()  # freed tensors' addresses come back, so an earlier test may hold a matching table
    builds = []
    real = kcommon.build_table
    monkeypatch.setattr(kcommon, "build_table", lambda *a: builds.append(a) or real(*a))
    state = _state([torch.float32, torch.bfloat16], [100, 7], False, False, seed=1)
    lr = torch.tensor(1e-3, device=DEVICE)
    for _ in range(3):
        kadam.adam_step_(*state, lr, 0.9, 0.999, 1e-8, 0.0, False, False, False, None, None)
    assert len(builds) == 2  # one table per dtype group, built on the first step only
    assert [float(s) for s in state[5]] == [STEPS0[0] + 3, STEPS0[1] + 3]


def test_table_cache_lru_bound():
    cache = kcommon.TableCache(capacity=4)
    dev = torch.device("cpu")
    ts = [torch.zeros(3) for _ in range(10)]
    for t in ts:
        flat = [t.data_ptr(), 3]
        cache.get(("grads", dev, 16384, tuple(flat)), flat, 2, 16384, dev)
    assert len(cache) == 4


def _sgd_state(dtypes, sizes, momentum, master, seed):
    g = torch.Generator().manual_seed(seed)
    P, G, B, W = [], [], [], []
    for dt, n in zip(dtypes, sizes):
        w = torch.randn(n, generator=g)
        P.append(w.to(dt))
        G.append((torch.randn(n, generator=g) * 0.5).to(dt))
        if momentum:
            B.append(torch.randn(n, generator=g) * 0.1)
        if master:
            W.append(w.clone())
    return [[t.to(DEVICE) for t in lst] for lst in (P, G, B, W)]


def _assert_sgd_close(mine, ref, where):
    _assert_lists_close(("params", "grads", "momentum_buffers", "master_params"), mine, ref, where)


# (momentum, dampening, nesterov, weight_decay, maximize, master): each flag on and off with the others.
SGD_FLAG_SETS = [
    (0.0, 0.0, False, 0.0, False, False),
    (0.9, 0.0, False, 0.0, False, False),
    (0.9, 0.0, True, 0.1, False, False),
    (0.9, 0.3, False, 0.1, True, True),
    (0.5, 0.1, True, 0.0, True, True),
    (0.0, 0.0, False, 0.1, True, True),
]


def _sgd_both(state, flags, lr, grad_scale, found_inf, on_host, first_steps):
    """Runs the kernel and the reference from the same state, one step per entry of ``first_steps``."""
    mom, damp, nest, wd, maximize, _ = flags
    mine, ref = _clone(state), _clone(state)
    for first in first_steps:
        fa = None if found_inf is None else found_inf.clone()
        fb = None if found_inf is None else found_inf.clone()
        ksgd._sgd_step(*mine, lr, wd, mom, damp, nest, maximize, first, grad_scale, fa, scalars_on_host=on_host)
        reference.sgd_step_(*ref, lr, wd, mom, damp, nest, maximize, first, grad_scale, fb)
    return mine, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", SGD_FLAG_SETS, ids=lambda f: "mom{}-damp{}-nest{:d}-wd{}-max{:d}-master{:d}".format(*f))
@pytest.mark.parametrize("scalars", SCALAR_SETS, ids=lambda s: f"scale{s[0]}-inf{s[1]}-host{int(s[2])}")
def test_sgd_matches_reference(dtype, flags, scalars):
    gs, fi, on_host = scalars
    state = _sgd_state([dtype] * len(SIZES), SIZES, flags[0] != 0, flags[5], seed=7)
    dev = "cpu" if on_host else DEVICE
    lr = torch.tensor(1e-2, device=dev)
    grad_scale = None if gs is None else torch.tensor(gs, device=dev)
    found_inf = None if fi is None else torch.tensor([fi], device=dev)
    # With momentum: torch's first step (buf = grad), then a step that reads the buffer.
    first_steps = (True, False) if flags[0] else (False,)
    mine, ref = _sgd_both(state, flags, lr, grad_scale, found_inf, on_host, first_steps)
    _assert_sgd_close(mine, ref, f"{dtype} {flags} {scalars}")


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_sgd_found_inf_changes_nothing(on_host, first):
    state = _sgd_state([torch.float32, torch.bfloat16, torch.float16, torch.float32], SIZES, True, True, seed=3)
    dev = "cpu" if on_host else DEVICE
    mine = _clone(state)
    ksgd._sgd_step(*mine, torch.tensor(1e-2, device=dev), 0.1, 0.9, 0.0, True, False, first,
                   torch.tensor(2.0, device=dev), torch.tensor([1.0], device=dev), scalars_on_host=on_host)  # fmt: skip
    for la, lb in zip(mine, state):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)


def test_sgd_mixed_dtypes_multi_chunk_and_empty_lists():
    # 70_000 elements: four full 16384-element chunks and a tail, next to tensors of other dtypes.
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    sizes = [1023, 5000, 1, 70_000, 70_000]
    for flags in (SGD_FLAG_SETS[3], SGD_FLAG_SETS[2]):
        state = _sgd_state(dtypes, sizes, True, flags[5], seed=11)
        mine, ref = _sgd_both(state, flags, torch.tensor(3e-3, dtype=torch.float64, device=DEVICE),
                              torch.tensor(512.0, device=DEVICE), torch.tensor([0.0], device=DEVICE), False, (False,))  # fmt: skip
        _assert_sgd_close(mine, ref, f"mixed {flags}")
    ksgd.sgd_step_([], [], [], [], torch.tensor(0.1), 0.0, 0.9, 0.0, False, False, False, None, None)


def _grads(dtypes, sizes, poison, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for dt, n in zip(dtypes, sizes):
        x = torch.randn(n, generator=g) * 3
        if poison is not None and n:
            x[torch.randint(0, n, (1,), generator=g)] = poison
        out.append(x.to(dt).to(DEVICE))
    return out


def _same_bits(a, b):
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(((a.view(view) == b.view(view)) | (a.isnan() & b.isnan())).all())


POISONS = (None, math.inf, -math.inf, math.nan)
GRAD_CASES = [
    ([torch.float32] * 4, list(SIZES)),
    ([torch.bfloat16] * 4, list(SIZES)),
    ([torch.float16] * 4, list(SIZES)),
    ([torch.float32, torch.bfloat16, torch.float16, torch.bfloat16], [70_000, 3, 0, 16384]),
]


@pytest.mark.parametrize("case", range(len(GRAD_CASES)))
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("inv,on_host,found0", [(0.5, False, 0.0), (1 / 65536, True, 0.0), (3.0, False, 1.0)])
def test_unscale_check_matches_reference(case, poison, inv, on_host, found0):
    dtypes, sizes = GRAD_CASES[case]
    mine = _grads(dtypes, sizes, poison, 1)
    ref = [t.clone() for t in mine]
    fa, fb = torch.tensor([found0], device=DEVICE), torch.tensor([found0], device=DEVICE)
    inv_t = torch.tensor(inv, device="cpu" if on_host else DEVICE)
    kamp._unscale_check(mine, fa, inv_t, scalars_on_host=on_host)
    reference.unscale_check_(ref, fb, inv_t)
    assert torch.equal(fa, fb)
    for a, b in zip(mine, ref):
        assert _same_bits(a, b)  # one fp32 multiply, one rounding: bit-identical


@pytest.mark.parametrize("case", range(len(GRAD_CASES)))
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("inv,on_host", [(None, False), (2.0**-16, False), (3.0, True)])
def test_grad_stats_matches_reference_and_is_deterministic(case, poison, inv, on_host):
    dtypes, sizes = GRAD_CASES[case]
    grads = _grads(dtypes, sizes, poison, 2)
    inv_t = None if inv is None else torch.tensor(inv, device="cpu" if on_host else DEVICE)
    mine = kamp._grad_stats(grads, inv_t, scalars_on_host=on_host)
    again, ref = kamp._grad_stats(grads, inv_t, scalars_on_host=on_host), reference.grad_stats(grads, inv_t)
    assert mine.shape == (3,) and mine.dtype == torch.float32 and mine.device == ref.device
    assert _same_bits(mine, again)
    assert _same_bits(mine[1:], ref[1:])  # max |g| and the flag are exact
    if ref[0].isfinite():
        # Summation order differs (per chunk, then over chunks): two sums of n squares (tests/rounding.py).
        n = sum(g.numel() for g in grads)
        torch.testing.assert_close(mine[0], ref[0], rtol=2 * sum_rtol(n), atol=0)
    else:
        assert _same_bits(mine[:1], ref[:1])


def test_grad_stats_edges():
    with pytest.raises(RuntimeError, match="needs at least one tensor"):
        kamp.grad_stats([])
    empty = [torch.empty(0, device=DEVICE), torch.empty(0, dtype=torch.bfloat16, device=DEVICE)]
    assert kamp.grad_stats(empty).tolist() == [0.0, 0.0, 0.0]
    # The sum overflows but every element is finite: the flag comes from the elements, not the sum.
    big = [torch.full((4,), 3e38, device=DEVICE)]
    mine, ref = kamp.grad_stats(big), reference.grad_stats(big)
    assert _same_bits(mine, ref) and mine[0] == math.inf and mine[2] == 0
    # The same grads behind a 2^70 loss scale: unscaled before squaring, the norm is finite.
    inv = torch.tensor(2.0**-70, device=DEVICE)
    mine, ref = kamp.grad_stats(big, inv), reference.grad_stats(big, inv)
    assert mine[0].isfinite() and mine[2] == 0 and _same_bits(mine[1:], ref[1:])
    torch.testing.assert_close(mine[0], ref[0], rtol=2 * sum_rtol(4), atol=0)
    kamp.unscale_check_([], torch.zeros(1, device=DEVICE), torch.tensor(1.0))


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, round_to(tl.load(x_ptr + offs, mask=mask), tl.bfloat16), mask=mask)


def test_bf16_rounding_matches_torch_on_every_kind_of_value():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (50_000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = [math.inf, -math.inf, math.nan, 3.3961775e38, 3.4e38, 1e-40, -1e-45, 0.0, -0.0, 1.00390625, 1.01171875]
    x = torch.cat([bits.view(torch.float32), torch.tensor(special)]).to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    assert _same_bits(y, x.bfloat16())


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import itertools, re
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fastops.kernels import adam as A, amp as M, sgd as S

    def compile_(fn, sig, consts):
        sig = dict(sig, **{k: "constexpr" for k in consts})
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
        return len(re.findall(r"ld\\.global\\.v4", ptx)), len(re.findall(r"st\\.global\\.v4", ptx))

    # common: (rows, chunks, consts, lr_ptr, lr_value, decay_value, scale_ptr, scale_value, found_inf_ptr, beta2,
    # one_minus_beta2, lerp_weight, eps, weight_decay), kernels/_adam.py's launch.
    adam_sig = {"common": ("*i64", "*i64", "*fp64", "*fp32", "fp32", "fp32", "*fp32", "fp32", "*fp32", "fp32", "fp32",
                           "fp32", "fp32", "fp32")}
    # Vector accesses follow the dtype and the alignment; the other constexprs take each value in some set (3 sets
    # instead of their 24 combinations: 72 compiles took 50 s of CI's 2 cores).
    adam_sets = [(False, False, 2, 2, True, True), (True, True, 1, 1, False, False), (True, False, 0, 0, True, False)]
    for dt, aligned, (ams, master, wd, scale, inf, lrp) in itertools.product(
            [tl.float32, tl.bfloat16, tl.float16], [False, True], adam_sets):
        c = dict(P_DTYPE=dt, CHUNK=16384, COLS=8, BLOCK=1024, LR_PTR=lrp, SCALE=scale, FOUND_INF=inf, AMSGRAD=ams,
                 MAXIMIZE=ams, WD=wd, MASTER=master, LERP_SMALL=not ams, ALIGNED=aligned, EMULATE_FMA=False)
        ld, st = compile_(A._adam_kernel, adam_sig, c)
        assert (ld > 0 and st > 0) == aligned, (c, ld, st)
    for dt, aligned, ip in itertools.product([tl.float32, tl.bfloat16, tl.float16], [False, True], [False, True]):
        ld, st = compile_(M._unscale_check_kernel, {"rows": "*i64", "chunks": "*i64", "found_inf_ptr": "*fp32",
                          "inv_ptr": "*fp32", "inv_value": "fp32"},
                          dict(G_DTYPE=dt, CHUNK=16384, BLOCK=1024, INV_PTR=ip, ALIGNED=aligned))
        assert (ld > 0) == aligned, (dt, aligned, ld)
        ld, _ = compile_(M._grad_stats_kernel, {"rows": "*i64", "chunks": "*i64", "partials": "*fp32",
                         "first_partial": "i32", "inv_ptr": "*fp32", "inv_value": "fp32"},
                         dict(G_DTYPE=dt, CHUNK=16384, BLOCK=1024, INV_PTR=ip, ALIGNED=aligned))
        assert (ld > 0) == aligned, (dt, aligned, ld)
    compile_(M._grad_stats_reduce_kernel, {"partials": "*fp32", "out": "*fp32", "n": "i32"}, dict(BLOCK=1024))
    sgd_sig = {"rows": "*i64", "chunks": "*i64", "lr_ptr": "*fp32", "lr_value": "fp32", "scale_ptr": "*fp32",
               "scale_value": "fp32", "found_inf_ptr": "*fp32", "weight_decay": "fp32", "momentum": "fp32",
               "one_minus_dampening": "fp32"}
    # (MOMENTUM, NESTEROV, MASTER, SCALE, FOUND_INF, LR_PTR, WD, MAXIMIZE): every constexpr both ways somewhere.
    sgd_sets = [(0, False, False, 2, True, True, True, True), (1, True, True, 1, False, False, False, False),
                (2, False, False, 0, True, False, True, False), (2, True, True, 2, False, True, False, True)]
    for dt, aligned, (mom, nest, master, scale, inf, lrp, wd, mx) in itertools.product(
            [tl.float32, tl.bfloat16, tl.float16], [False, True], sgd_sets):
        c = dict(P_DTYPE=dt, CHUNK=16384, BLOCK=1024, LR_PTR=lrp, SCALE=scale, FOUND_INF=inf, MAXIMIZE=mx, WD=wd,
                 MOMENTUM=mom, NESTEROV=nest, MASTER=master, ALIGNED=aligned)
        ld, st = compile_(S._sgd_kernel, sgd_sig, c)
        assert (ld > 0 and st > 0) == aligned, (c, ld, st)
    print("ok")
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_vector_accesses():
    pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]

