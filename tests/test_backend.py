"""FASTOPS_BACKEND: which backend the user asks for on each device type (fastops/_backend.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastops import _backend


@pytest.mark.parametrize(
    "spec, cpu, cuda",
    [
        ("", "auto", "auto"),
        ("auto", "auto", "auto"),
        ("Reference", "reference", "reference"),  # one backend for every device type, any case
        ("cpu:cpp", "cpp", "auto"),  # a device type left out gets auto
        (" cpu : reference , cuda:triton ", "reference", "triton"),  # spaces around names are ignored
        ("cpu:cpp,,cuda:cuda,", "cpp", "cuda"),  # so are empty items (cpu:cpp,$EXTRA in a shell script)
        ("cpu:auto,cuda:reference", "auto", "reference"),
    ],
)
def test_accepted_values(monkeypatch, spec, cpu, cuda):
    monkeypatch.setenv("FASTOPS_BACKEND", spec)
    assert (_backend.requested("cpu"), _backend.requested("cuda")) == (cpu, cuda)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("gpu:cpp", "unknown device type 'gpu' in entry 'gpu:cpp'"),
        ("cpu:cpp,cpu:reference", "device type 'cpu' is given twice ('cpu:cpp' and 'cpu:reference')"),
        ("cpu:cpp, CPU:cpp", "device type 'cpu' is given twice"),  # even when both agree
        ("cpu", "'cpu' is a device type, not a backend; write cpu:<backend>"),
        (":cpp", "entry ':cpp' names no device type"),
        ("cpu:", "entry 'cpu:' names no backend"),
        ("cpp,cuda:triton", "entry 'cpp' is not device:backend"),
        ("cpu:fast", "unknown backend 'fast'"),
        ("cpu:cpp:x", "unknown backend 'cpp:x'"),
        ("c pp", "unknown backend 'c pp'"),
        ("cpu:cuda", "backend 'cuda' does not run on cpu tensors"),
        ("cuda:cpp", "backend 'cpp' does not run on cuda tensors"),
    ],
)
def test_malformed_values_raise_naming_the_variable_and_the_problem(monkeypatch, spec, problem):
    monkeypatch.setenv("FASTOPS_BACKEND", spec)
    # The whole value is checked whichever device type asks: a bad cuda entry fails a CPU-only run too.
    for device_type in _backend.DEVICE_TYPES:
        with pytest.raises(ValueError) as e:
            _backend.requested(device_type)
        assert str(e.value).startswith(f"FASTOPS_BACKEND={spec!r}: ") and problem in str(e.value)


_STEP = """
import os, torch, fastops
p = torch.nn.Parameter(torch.ones(3)); opt = fastops.optim.AdamW([p]); p.grad = torch.ones(3)
for spec in ("gpu:cpp", "cpu:reference,cpu:cpp", "cpu: reference, cuda: triton"):
    os.environ["FASTOPS_BACKEND"] = spec
    try:
        opt.step()
    except ValueError as e:
        print(e)
print(fastops._backend.active("cpu"), bool((p < 1).all()))
"""


def test_the_first_step_reads_the_variable():
    # The backend of a device type is chosen when its first op runs (a failed choice is not kept), so one
    # fresh interpreter can try several values in turn.
    r = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "FASTOPS_BACKEND='gpu:cpp': unknown device type 'gpu' in entry 'gpu:cpp'; expected one of ('cpu', 'cuda')",
        "FASTOPS_BACKEND='cpu:reference,cpu:cpp': device type 'cpu' is given twice ('cpu:reference' and 'cpu:cpp')",
        "reference True",
    ]
