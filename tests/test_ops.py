"""The op registry (fastops/_ops.py): opcheck and torch.compile on every op's sample inputs (fastops/_specs) over every
(device, backend) pair, the schemas, the backend choice and its fallback, and the Triton launchers' shared machinery
(tables, bf16 rounding). Each op's own parity tests: test_ops_adam.py, test_ops_sgd.py, test_ops_amp.py,
test_lowp_ops.py; its bad calls: test_bad_input.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import fastops  # noqa: F401  (registers the ops)
from fastops import _backend
from fastops._specs import SPECS
from fastops.kernels import _common as kcommon
from fastops.kernels._common import round_to
from tests.devices import PAIRS

ops = torch.ops.fastops


def _samples():
    for name, spec in SPECS.items():
        for sample in spec.sample_inputs("cpu"):
            yield pytest.param(name, sample.id, id=f"{name}-{sample.id}")


def _sample(name, case, device):
    return next(s.args for s in SPECS[name].sample_inputs(device) if s.id == case)


def test_the_schema_is_where_the_arguments_are_written():
    """What is derived from each spec's schema: the names the record addresses, the mutated positions the dispatcher
    kernel bumps (those the schema marks Tensor(a!)), the defaults."""
    adam, stats = SPECS["adam_step_"], SPECS["grad_stats"]
    assert adam.Args._fields[:3] == ("params", "grads", "exp_avgs") and adam.Args._fields[-1] == "found_inf"
    assert adam.mutated == (0, 2, 3, 4, 5, 6)
    assert stats.mutated == () and stats.Args([]).inv_scale is None
    for name, spec in SPECS.items():
        schema = getattr(ops, name).default._schema
        assert [a.name for a in schema.arguments] == list(spec.Args._fields)
        written = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write)
        assert spec.mutated == written


@pytest.mark.parametrize("device,backend", PAIRS)
def test_opcheck(device, backend):
    """Every op's sample inputs (fastops/_specs), on every (device, backend) pair: schema, fake kernel against the
    real one, autograd registration, AOT dispatch."""
    with _backend.use(device, backend):
        for name, spec in SPECS.items():
            for sample in spec.sample_inputs(device):
                torch.library.opcheck(getattr(ops, name).default, tuple(sample.args))


@pytest.mark.parametrize("name,case", list(_samples()))
def test_sample_inputs_under_torch_compile_match_eager(name, case):
    """fullgraph torch.compile of each op on each sample input writes what the eager op writes (the backend auto
    chose for the CPU; the compiled graph calls the same dispatcher kernel)."""
    args, want = _sample(name, case, "cpu"), _sample(name, case, "cpu")
    op = getattr(ops, name)
    torch._dynamo.reset()  # one code object for every case: without it the recompile limit is reached

    @torch.compile(fullgraph=True, backend="aot_eager")
    def call(*a):
        return op(*a)

    got_out, want_out = call(*args), op(*want)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(args, want, rtol=0, atol=0, equal_nan=True)


def test_schemas_live_in_the_registry():
    from fastops import _ops

    for name, schema in _ops.SCHEMAS.items():
        assert str(getattr(ops, name).default._schema) == f"fastops::{schema}"


def _run_python(code: str, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


BLOCK_C = "import sys; sys.modules['fastops._C'] = None\n"


def test_a_stale_extension_counts_as_missing():
    """An extension built from older sources (no checks, say) is not used: fastops calls its submodules by name."""
    stale = type(sys)("fastops._C")
    stale.cpp = object()
    why = _backend._stale(stale)
    assert "older sources" in why and "checks" in why and "rebuild" in why
    if _backend._C is not None:
        assert _backend._stale(_backend._C) is None


def test_fallback_when_extension_is_missing_warns_once():
    code = BLOCK_C + (
        "import warnings, torch\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    import fastops\n"
        "    p = torch.nn.Parameter(torch.ones(3)); opt = fastops.optim.AdamW([p])\n"
        "    for _ in range(3):\n"
        "        p.grad = torch.ones(3); opt.step()\n"
        "msgs = [str(x.message) for x in w if 'fastops' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert 'reference' in msgs[0] and 'fastops._C' in msgs[0], msgs\n"
        "assert fastops._backend.active('cpu') == 'reference'\n"
        "assert (p < 1).all()\n"
    )
    r = _run_python(code, FASTOPS_BACKEND="auto")
    assert r.returncode == 0, r.stderr


def test_explicit_backend_that_is_unavailable_raises():
    code = BLOCK_C + (
        "import torch, fastops\n"
        "p = torch.nn.Parameter(torch.ones(3)); opt = fastops.optim.AdamW([p]); p.grad = torch.ones(3)\n"
        "try:\n"
        "    opt.step()\n"
        "except RuntimeError as e:\n"
        "    assert 'cpp' in str(e) and 'fastops._C' in str(e), e\n"
        "    print('raised')\n"
    )
    r = _run_python(code, FASTOPS_BACKEND="cpp")
    assert r.returncode == 0 and "raised" in r.stdout, r.stderr


def test_backend_env_parsing(monkeypatch):
    monkeypatch.setenv("FASTOPS_BACKEND", "cpu:reference,cuda:triton")
    assert _backend.requested("cpu") == "reference" and _backend.requested("cuda") == "triton"
    monkeypatch.setenv("FASTOPS_BACKEND", "cuda")
    with pytest.raises(_backend.BackendUnavailable, match="does not run on cpu"):
        _backend.choose("cpu")
    monkeypatch.setenv("FASTOPS_BACKEND", "fast")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        _backend.requested("cpu")


def test_info_command_lists_every_op():
    r = subprocess.run([sys.executable, "-m", "fastops", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"torch {torch.__version__}" in r.stdout and "triton" in r.stdout
    served = {tuple(line.split()) for line in r.stdout.splitlines() if "fastops::" in line}
    for name in ("adam_step_", "sgd_step_", "unscale_check_", "grad_stats"):
        assert ("cpu", f"fastops::{name}", _backend.active("cpu")) in served, r.stdout


def test_triton_tables_are_cached_and_bounded(monkeypatch):
    """A Triton launch builds its tensor table on the first step only (one per dtype group), and the LRU keeps at most
    its capacity."""
    from fastops._specs import adam

    kcommon.TABLES.clear()  # freed tensors' addresses come back, so an earlier test may hold a matching table
    builds = []
    real = kcommon.build_table
    monkeypatch.setattr(kcommon, "build_table", lambda *a: builds.append(a) or real(*a))
    args = adam.inputs([100, 7])
    args = args._replace(**{k: v + adam.inputs([7], torch.bfloat16)._asdict()[k] for k, v in args._asdict().items()
                            if isinstance(v, list) and v})  # fmt: skip
    with _backend.use("cpu", "triton"):
        for _ in range(3):
            ops.adam_step_(*args)
    assert len(builds) == 2
    cache, dev = kcommon.TableCache(capacity=4), torch.device("cpu")
    for t in [torch.zeros(3) for _ in range(10)]:
        flat = [t.data_ptr(), 3]
        cache.get(("grads", dev, 16384, tuple(flat)), flat, 2, 16384, dev)
    assert len(cache) == 4


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, round_to(tl.load(x_ptr + offs, mask=mask), tl.bfloat16), mask=mask)


def test_triton_bf16_rounding_matches_torch_on_every_kind_of_value():
    """kernels/_common.round_to, the one fp32 -> bf16 rounding of every Triton store, on 50k random bit patterns and
    the edges: inf, nan, the largest values (rounding to inf), denormals, signed zero, ties."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (50_000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = [math.inf, -math.inf, math.nan, 3.3961775e38, 3.4e38, 1e-40, -1e-45, 0.0, -0.0, 1.00390625, 1.01171875]
    x = torch.cat([bits.view(torch.float32), torch.tensor(special)]).to(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _round_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    want = x.bfloat16()
    assert bool(((y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())).all())
