"""fastops.compile_check: the option sets, the launch recording, the resource rules, and (in a process without
TRITON_INTERPRET) real compiles for sm_90 of a broken kernel, a real spec, and a real spec forced to spill."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastops import compile_check as cc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP = {op.name: op for op in cc.OPS}


def _pairs(rows, names):
    return {(a, r[a], b, r[b]) for r in rows for a, b in itertools.combinations(names, 2)}


def test_combinations_cover_every_pair_and_the_heaviest_rows():
    for op in cc.OPS:
        names, rows = list(op.options), cc.combinations(op.options)
        full = cc.combinations(op.options, exhaustive=True)
        assert len(full) == len(list(itertools.product(*op.options.values())))
        assert _pairs(rows, names) == _pairs(full, names), op.name
        for v in op.options[names[0]]:
            assert {names[0]: v, **{n: op.options[n][-1] for n in names[1:]}} in rows
        assert len(rows) <= max(cc.EXHAUSTIVE_UP_TO, len(full))
    small = {"a": (1, 2), "b": (3, 4)}
    assert cc.combinations(small) == [{"a": 1, "b": 3}, {"a": 1, "b": 4}, {"a": 2, "b": 3}, {"a": 2, "b": 4}]


def test_recorded_launch_follows_the_options():
    # Under the interpreter (conftest), launches are recorded and nothing runs.
    base = {"dtype": torch.bfloat16, "aligned": True, "lr": "host", "grad_scale": "host", "found_inf": None,
            "weight_decay": "decoupled", "beta1": 0.9, "maximize": False, "amsgrad": True, "master": True}  # fmt: skip
    (launch,) = cc.capture(OP["adam_step_"], base)
    assert launch.fn.__name__ == "_adam_kernel"
    k = launch.kwargs
    assert (k["LR_PTR"], k["SCALE"], k["FOUND_INF"], k["WD"], k["AMSGRAD"], k["MASTER"], k["LERP_SMALL"]) == (
        False, 1, False, 2, True, True, True)  # fmt: skip
    (launch,) = cc.capture(OP["adam_step_"], {**base, "lr": torch.float32, "grad_scale": torch.float32,
                                               "aligned": False})  # fmt: skip
    assert (launch.kwargs["LR_PTR"], launch.kwargs["SCALE"], launch.kwargs["ALIGNED"]) == (True, 2, False)
    stats = cc.capture(OP["grad_stats"], {"dtype": torch.float32, "aligned": True, "inv_scale": None, "chunks": 16,
                                          "mixed": True})  # fmt: skip
    assert [lc.fn.__name__ for lc in stats] == ["_grad_stats_kernel"] * 2 + ["_grad_stats_reduce_kernel"]
    reduce = dict(zip(stats[-1].fn.arg_names, stats[-1].args))
    assert reduce["n"] == 17  # partials of both launches: 16 chunks and 1
    uncovered = cc.uncovered_kernels(stats)
    assert {"fastops.kernels.adam._adam_kernel", "fastops.kernels.amp._unscale_check_kernel"} <= set(uncovered)
    assert not any("grad_stats" in name for name in uncovered)


def test_resident_blocks_and_the_cuda_launch_rule(monkeypatch):
    assert cc.resident_blocks(90, 512, 32, 0) == 4
    assert cc.resident_blocks(90, 512, 40, 0) == 3  # 40 x 32 = 1280 registers a warp: 51 warps of 64
    assert cc.resident_blocks(90, 128, 168, 4096) == 3
    assert cc.resident_blocks(80, 512, 16, 60 * 1024) == 2  # shared memory: 164 KiB / 61 KiB
    usage = [
        (90, "unscale_check_kernel", {"REG": 32, "LOCAL": 0, "STACK": 0, "SHARED": 0}),
        (90, "unscale_check_kernel", {"REG": 40, "LOCAL": 0, "STACK": 0, "SHARED": 0}),
        (80, "unscale_check_kernel", {"REG": 24, "LOCAL": 8, "STACK": 8, "SHARED": 0}),
        (90, "grad_stats_reduce_kernel", {"REG": 128, "LOCAL": 0, "STACK": 0, "SHARED": 256}),
        (90, "new_kernel", {"REG": 16, "LOCAL": 0, "STACK": 0, "SHARED": 0}),
    ]
    monkeypatch.setattr(cc.cuda, "resource_usage", lambda path: usage)  # the module that reads it
    errors = [r.error for r in cc.check_cuda_kernels("fastops/_C.so")]
    assert errors[0] == "" and errors[3] == ""
    assert "3 resident block(s)" in errors[1] and "assumes 4" in errors[1]
    assert "16 bytes of local memory" in errors[2]
    assert "no launch config for new_kernel" in errors[4]


def test_parse_resource_usage():
    text = textwrap.dedent("""
        Fatbin elf code:
        ================
        arch = sm_90
        code version = [1,8]

        Resource usage:
         Common:
          GLOBAL:0
         Function _ZN7fastops4cuda12_GLOBAL__N_111adam_kernelIfLb0ELb0EEEvNS0_8AdamArgsE:
          REG:36 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0

        Fatbin elf code:
        ================
        arch = sm_100
         Function k:
          REG:44 STACK:8 SHARED:1280 LOCAL:4 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0
    """)
    (a, b) = cc.parse_resource_usage(text)
    assert a[0] == 90 and a[1].endswith("AdamArgsE") and a[2]["REG"] == 36
    assert b[0] == 100 and b[1] == "k" and (b[2]["STACK"], b[2]["SHARED"], b[2]["LOCAL"]) == (8, 1280, 4)


COMPILE = '''
import torch, triton, triton.language as tl
from fastops import compile_check as cc

@triton.jit
def _bad_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)  # not a power of 2: a compile error the interpreter does not raise
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)

def bad(options):
    _bad_kernel[(1,)](torch.zeros(1000), BLOCK=options["block"])

REAL = list(cc.OPS)
cc.OPS[:] = [cc.Op("bad", bad, {"block": (1000,)})]
assert cc.main(["--archs", "90", "--ops", "bad", "--no-cuda-ext", "-j", "1"]) == 1
# Without --ops (CI's call) the kernels no entry launched are listed too: every real one here.
assert cc.main(["--archs", "90", "--no-cuda-ext", "-j", "1"]) == 1

OP = {op.name: op for op in REAL}
(real,) = cc.capture(OP["unscale_check_"], {"dtype": torch.float32, "aligned": True, "inv_scale": torch.float32})
r = cc.compile_launch(real, 90)
print("REAL", r.line())
assert not r.error and r.regs > 0 and r.local == 0 and r.warps_per_sm > 0, r.line()

# The heaviest Adam spec with registers capped: ptxas spills, and that is an error.
heavy = {n: v[-1] for n, v in OP["adam_step_"].options.items()}
(adam,) = cc.capture(OP["adam_step_"], {**heavy, "dtype": torch.bfloat16})
adam.kwargs["maxnreg"] = 32
r = cc.compile_launch(adam, 90)
print("SPILL", r.line())
assert r.local > 0 and "spills" in r.error, r.line()

# The same spec at 4 warps: the bf16 streams load 8 elements a thread and the fp32 ones 4, which takes layout
# conversions, an error; at the launcher's 8 warps it takes none.
(adam,) = cc.capture(OP["adam_step_"], {**heavy, "dtype": torch.bfloat16})
r = cc.compile_launch(adam, 90)
print("ADAM8", r.line())
assert not r.error and r.converts == 0 and r.regs <= cc.MAX_TRITON_REGS, r.line()
adam.kwargs["num_warps"] = 4
r = cc.compile_launch(adam, 90)
print("ADAM4", r.line())
assert r.converts > 0 and "layout conversion" in r.error, r.line()

# The 8-bit and bf16 state kernels at their heaviest specs.
lowp = {n: v[-1] for n, v in OP["adam_step_lowp_"].options.items()}
for state in ("8bit", "bf16"):
    (launch,) = cc.capture(OP["adam_step_lowp_"], {**lowp, "state": state, "dtype": torch.bfloat16})
    r = cc.compile_launch(launch, 90)
    print("LOWP", r.line())
    assert r.converts == 0 and r.regs <= cc.MAX_TRITON_REGS and r.local == 0, r.line()
'''


def test_layout_conversions_are_counted():
    ttgir = """
        %a = ttg.convert_layout %x : tensor<4x1xf32, #blocked1> -> tensor<4x1xf32, #blocked>
        %b = tt.load %p : tensor<1024x!tt.ptr<f32>, #blocked>
        %c = ttg.convert_layout %y : tensor<4xf32, #ttg.slice<{dim = 1, parent = #blocked}>> -> tensor<4xf32, #blocked2>
    """
    assert cc.layout_conversions(ttgir) == 2
    assert cc.layout_conversions("%b = tt.load %p") == 0


def test_local_accesses_are_counted():
    # A stack frame without these (a slow-path subroutine's ABI frame) is not reported as a spill.
    sass = """
        /*0100*/                   STL [R1+0x4], R12 ;
        /*0110*/                   LDL.64 R4, [R1] ;
        /*0120*/                   STG.E [R2.64], R5 ;
        /*0130*/                   CALL.REL.NOINC 0xc8b0 ;
    """
    assert cc.count_local_accesses(sass) == 2
    assert cc.count_local_accesses("STG.E [R2.64], R5 ;\nLDG.E R4, [R2.64] ;") == 0


def test_real_compiles_flag_errors_and_spills(tmp_path):
    script = tmp_path / "compile_check_run.py"
    script.write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("bad_kernel") and "ERROR CompilationError" in line for line in lines), out.stdout
    assert "1 Triton kernel/spec/arch compiles" in out.stdout and "1 failed" in out.stdout
    assert "fastops.kernels.sgd._sgd_kernel: ERROR launched by no compile_check.OPS entry" in out.stdout, out.stdout
    print(out.stdout)


VECTORS = r'''
import re, torch, triton
from triton.compiler import ASTSource
from fastops import compile_check as cc
from fastops.compile_check.capture import _target

OP = {op.name: op for op in cc.OPS}
for name, stores in (("adam_step_", True), ("sgd_step_", True), ("unscale_check_", True), ("grad_stats", False)):
    heavy = {n: v[-1] for n, v in OP[name].options.items()}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for aligned in (False, True):
            launch = cc.capture(OP[name], {**heavy, "dtype": dtype, "aligned": aligned})[0]
            options, signature, constexprs, attrs = cc.specialize(launch, 90)
            ptx = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=_target(90),
                                 options=options.__dict__).asm["ptx"]
            ld, st = (len(re.findall(rf"{op}\.global(\.\w+)*\.v4", ptx)) for op in ("ld", "st"))
            assert (ld > 0 and (st > 0 or not stores)) == aligned, (name, dtype, aligned, ld, st)
print("ok")
'''


@pytest.mark.slow
def test_aligned_specs_compile_to_vector_accesses():
    """What ALIGNED buys: with every pointer of the table 16-byte aligned the full-chunk loops load and store 16 bytes a
    thread (ld/st.global.v4 in the sm_90 PTX), without it none does (Triton's bundled ptxas, no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", VECTORS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]
