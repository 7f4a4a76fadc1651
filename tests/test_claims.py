"""Every claim backed (tests/claims.py reads them): the README's status table names tests that exist, and at the
end of the session one of them passed on each device a row claims; every figure in the README and docs/ is held
by a results file it cites, which names its machine and command; benchmarks/gpu_check.sh selects every GPU case.
Each checker is also shown to catch what it is for, on planted text."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import claims
from tests.claims import DOCS, ROOT, Outcome, Row

README = (ROOT / "README.md").read_text()


def test_every_status_row_names_tests_that_exist():
    rows = claims.ledger(README)
    assert len(rows) >= 10
    assert not [r.where for r in rows if not r.tests], "rows without tests"
    problems = [why for r in rows for t in r.tests if (why := claims.missing_tests(t))]
    assert not problems, "\n".join(problems)


def test_the_ledger_catches_a_missing_test():
    assert claims.missing_tests("test_claims.py::test_every_status_row_names_tests_that_exist") is None
    assert claims.missing_tests("test_claims.py") is None
    assert "defines no test_nothing" in claims.missing_tests("test_claims.py::test_nothing")
    assert "no file" in claims.missing_tests("test_nowhere.py")
    table = ("| what | CPU | CUDA | tested how |\n|---|---|---|---|\n"
             "| x | works | built, not run | `tests/test_a.py::t` |\n")
    (row,) = claims.ledger(table, "planted")
    assert row.tests == ["test_a.py::t"] and row.claimed_devices() == ["cpu"]


def test_the_ledger_catches_a_device_claim_nothing_ran_on():
    row = Row("planted:1", "patch()", {"CPU": "works", "CUDA": "works"}, ["test_a.py::t"])
    cpu_only = {"tests/test_a.py::t[cpu]": Outcome("passed", device="cpu"),
                "tests/test_a.py::t[cuda]": Outcome("skipped", "needs a CUDA GPU", device="cpu")}  # fmt: skip
    bad, _ = claims.unbacked([row], cpu_only)
    assert len(bad) == 1 and "claims cuda" in bad[0]
    on_gpu = {**cpu_only, "tests/test_a.py::t[cuda]": Outcome("passed", device="cuda")}
    assert claims.unbacked([row], on_gpu) == ([], [])
    failed = {"tests/test_a.py::t[cpu]": Outcome("failed", device="cpu")}
    row.cells["CUDA"] = "built, not run"
    assert "claims cpu" in claims.unbacked([row], failed)[0][0]
    no_timm = {"tests/test_a.py::t": Outcome("skipped", "could not import 'timm'", device="cpu")}
    assert claims.unbacked([row], no_timm, env_complete=False) == ([], ["planted:1 (patch()) on cpu"])
    assert "claims cpu" in claims.unbacked([row], no_timm, env_complete=True)[0][0]
    assert claims.unbacked([row], {}) == ([], ["planted:1 (patch()) on cpu"])


@pytest.mark.session_end
@pytest.mark.session_outcomes
def test_every_claimed_device_ran_a_test_in_this_session():
    """Runs last (tests/claims.py orders it), so every other test of the session has reported. Under pytest-xdist
    the controller judges the same at the session's end instead (claims.pytest_sessionfinish)."""
    bad, none_ran = claims.judge_session(README)
    assert not bad, "\n".join(bad)
    if none_ran:
        pytest.skip("none of the status table's tests ran in this session: run the suite to check its claims")


# ---- figures ---------------------------------------------------------------------------------------------


def test_every_figure_is_held_by_a_results_file_it_cites():
    problems = [p for doc in DOCS for p in claims.figure_problems(doc.read_text(), doc.relative_to(ROOT).as_posix())]
    assert not problems, "\n".join(problems)


def test_the_figure_check_catches_an_uncited_or_unheld_figure(tmp_path):
    (tmp_path / "run.json").write_text('{"meta": {"hardware": "Xeon x2", "argv": ["--steps", "4"]}, '
                                       '"rows": [{"ms": 355.81, "speedup_vs_plain": 1.9721}]}')  # fmt: skip
    (tmp_path / "bare.json").write_text('{"meta": {}, "rows": [{"ms": 10.0}]}')
    check = lambda text: claims.figure_problems(text, "doc", tmp_path)  # noqa: E731
    assert check("plain 356 ms/step, fastops **1.97x** (`results/run.json`)") == []
    assert check("took 356 ms (`results/run.*`), with `8 MiB` blocks kept, 4x256 layers") == []
    assert "cite no results file" in check("plain 356 ms/step")[0]
    assert "1.98 is in none of ['run.json']" in check("| a | 1.98x | results/run.json |")[0]
    assert "does not exist" in check("356 ms (results/gone.json)")[0]
    assert sorted(check("10 ms (results/bare.json)")) == [
        "doc:1: results/bare.json does not name its command",
        "doc:1: results/bare.json does not name its machine"]  # fmt: skip
    assert claims.figures("a 2.5-minute build, 6.3 minutes, 35.5 MiB, 97% of the roofline, `1024` MiB") == [
        "2.5", "6.3", "35.5", "97"]  # fmt: skip


# ---- the GPU script ----------------------------------------------------------------------------------------


def _gpu_script_selections(script: str) -> list[list[str]]:
    """The pytest arguments of each test step of benchmarks/gpu_check.sh."""
    out = []
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        if "pytest" in words:
            args, kept = words[words.index("pytest") + 1:], []
            for a, before in zip(args, [None, *args]):
                if not (a.startswith(("--junitxml", "-q")) or before == "--junitxml"):
                    kept.append(a)
            out.append(kept)
    return out


def test_gpu_case_detection_sees_every_way_a_test_reaches_a_gpu(tmp_path):
    class Item:
        def __init__(self, path, params=None, skip_reason=None):
            self.path, self.marks = path, []
            if params is not None:
                self.callspec = type("C", (), {"params": params})()
            if skip_reason:
                self.marks.append(pytest.mark.skipif(True, reason=skip_reason).mark)

        def iter_markers(self, name):
            return [m for m in self.marks if m.name == name]

    plain = tmp_path / "test_plain.py"
    plain.write_text("import torch\n\ndef test_x():\n    assert torch.cuda.is_available() in (True, False)\n")
    chooser = tmp_path / "test_chooser.py"
    chooser.write_text("import torch\nDEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'\n")
    assert claims.gpu_case(Item(plain, {"device": "cuda", "backend": "triton"}))
    assert claims.gpu_case(Item(plain, {"device_backend": ("cuda", "cuda")}))
    assert claims.gpu_case(Item(plain, skip_reason="needs CUDA"))
    assert claims.gpu_case(Item(chooser))
    assert not claims.gpu_case(Item(plain, {"device": "cpu"}))
    assert not claims.gpu_case(Item(plain, {"argv": ["--device", "cuda"], "env": "cuda:triton"}))
    assert not claims.gpu_case(Item(plain, skip_reason="needs SIGKILL"))


@pytest.mark.slow
@pytest.mark.session_end
def test_gpu_script_selects_every_gpu_case():
    """Collects what each pytest step of gpu_check.sh selects (as it would on a GPU machine) and checks that every
    GPU case of this session is in it: a module with a CUDA or compiled-Triton case the script leaves out fails."""
    selections = _gpu_script_selections((ROOT / "benchmarks" / "gpu_check.sh").read_text())
    assert selections, "gpu_check.sh runs no pytest step"
    selected = set()
    for args in selections:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        selected |= {line.strip() for line in out.stdout.splitlines() if "::" in line}
    gpu = claims.GPU_CASES
    if not gpu:
        pytest.skip("no GPU case was collected in this session")
    left_out = sorted(gpu - selected)
    modules = sorted({nid.split("::")[0] for nid in left_out})
    assert not left_out, f"gpu_check.sh leaves out {len(left_out)} GPU cases, in {modules}: {left_out[:10]}"
    # test_ops.py has CUDA cases of every op: where this session collected it, the marking found them.
    if any(nid.startswith("tests/test_ops.py::") for nid in claims.SESSION):
        assert {nid.split("::")[0] for nid in gpu} >= {"tests/test_ops.py"}


def test_gpu_script_parsing():
    script = "step build 190 pip install .\nstep tests 75 python -m pytest -q -m cuda tests --junitxml x.xml  # all\n"
    assert _gpu_script_selections(script) == [["-m", "cuda", "tests"]]
    assert Path(ROOT / "benchmarks" / "gpu_check.sh").is_file()
