"""What the README and docs/ claim, read back so tests/test_claims.py can hold each claim to what backs it, and
the pytest hooks that record what ran in this session (tests/conftest.py imports them).

- The status table (README.md, header ``| what | CPU | CUDA | tested how |``) is a ledger: each row's "tested
  how" cell names its tests in backticks (``tests/test_x.py::test_name``, or a whole module), and a device cell
  that does not say "not run" (or "n/a") claims that the row works there. Adding a row: write its cells and
  the ids of the tests that show it; test_claims checks that they exist and, at the end of a session, that
  one of them passed on every device the row claims.
- A figure is a number with a unit of time, speed or size (``FIGURE``) outside code. Each table row or paragraph
  that holds one cites the results files under benchmarks/results/ that hold it (``results/NAME`` or
  ``results/NAME.*``), and each cited file names its machine and its command.

Devices: a test case ran on CUDA when it is a GPU case (below) and this session has a GPU; else on the CPU. A GPU
case is one that runs on a GPU where there is one: parametrized with a CUDA device (tests/devices.py's pairs), or
skipped where CUDA is absent, or in a module that picks its device from ``torch.cuda.is_available()`` at import.
Every GPU case gets the ``cuda`` mark, which is what benchmarks/gpu_check.sh selects."""

from __future__ import annotations

import ast
import functools
import glob
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LEDGER_HEADER = ["what", "CPU", "CUDA", "tested how"]
DEVICE_COLUMNS = {"CPU": "cpu", "CUDA": "cuda"}
NO_RUN_CLAIM = re.compile(r"\bnot run\b|\bn/a\b|\bnot written\b", re.I)
TEST_ID = re.compile(r"`(?:tests/)?(test_\w+\.py)((?:::\w+)*)`")
CITATION = re.compile(r"(?:benchmarks/)?results/([\w.*-]+\w|[\w.-]+\*)")
_NUM = r"(\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)"
# Units of measured time, speed and size; "%" counts only as a share of a roofline.
FIGURE = re.compile(
    _NUM + r"(?:-| ?)(?:ms/step|ms|µs|us|s|seconds|minutes?|GB/s|GFLOP/s|ns/param|tokens/s|MiB|GiB)(?![\w/])"
    r"|" + _NUM + r"x(?![\w])"
    r"|" + _NUM + r" ?% of (?:the |its |its own )?(?:\d+ B/param )?(?:roofline|copy)"
)
CODE = re.compile(r"`[^`]*`")
GPU_SKIP = re.compile(r"\bCUDA\b|\bGPU\b", re.I)
SESSION_END = "session_end"  # tests with this mark run after every other test of the session
# The test with this mark judges every outcome of the session. A pytest-xdist worker sees only its own share, so
# under xdist the workers leave it out and the controller, which gets every report, judges at its session's end.
SESSION_OUTCOMES = "session_outcomes"


# ---- the markdown ----------------------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[list[str], list[tuple[int, list[str]]]]]:
    """Every pipe table in ``text``: (header cells, [(line number, cells)])."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1].strip()):
            header, rows, j = _cells(lines[i]), [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, _cells(lines[j])))
                j += 1
            out.append((header, rows))
            i = j
        else:
            i += 1
    return out


@dataclass
class Row:
    where: str
    what: str
    cells: dict[str, str]
    tests: list[str] = field(default_factory=list)  # "test_x.py" or "test_x.py::name"

    def claimed_devices(self) -> list[str]:
        return [dev for col, dev in DEVICE_COLUMNS.items() if not NO_RUN_CLAIM.search(self.cells[col])]


def ledger(text: str, where: str = "README.md") -> list[Row]:
    found = [rows for header, rows in tables(text) if header == LEDGER_HEADER]
    if len(found) != 1:
        raise AssertionError(f"{where}: expected one status table with header {LEDGER_HEADER}, found {len(found)}")
    out = []
    for line, cells in found[0]:
        cells = dict(zip(LEDGER_HEADER, cells))
        tests = [file + name for file, name in TEST_ID.findall(cells["tested how"])]
        out.append(Row(f"{where}:{line}", cells["what"], cells, tests))
    return out


def missing_tests(test_id: str, tests_dir: Path = ROOT / "tests") -> str | None:
    """Why ``test_id`` names no test (None when it does): the module, or the function/class in it, is absent."""
    file, _, names = test_id.partition("::")
    path = tests_dir / file
    if not path.is_file():
        return f"{test_id}: no file tests/{file}"
    if not names:
        return None
    scope = ast.parse(path.read_text()).body
    for name in names.split("::"):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            return f"{test_id}: tests/{file} defines no {name}"
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return None


def units(text: str):
    """(line number, text) of every table row and paragraph or list item, outside fenced code blocks."""
    block, start, fenced = [], 0, False
    for n, line in enumerate(text.splitlines() + [""], 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        bullet = re.match(r"^\s*([-*]|\d+\.) ", line)
        if line.startswith("|") or not line.strip() or line.startswith("#") or bullet:
            if block:
                yield start, " ".join(block)
                block = []
            if line.startswith("|"):
                yield n, line
                continue
            if bullet:
                block, start = [line], n
            continue
        if not block:
            start = n
        block.append(line)


def figures(unit: str) -> list[str]:
    """The figures (numbers) of a table row or paragraph, code spans left out."""
    return [next(g for g in m.groups() if g) for m in FIGURE.finditer(CODE.sub(" ", unit))]


def citations(unit: str) -> list[str]:
    return CITATION.findall(unit)


def cited_files(name: str, results: Path = RESULTS) -> list[Path]:
    """The files a citation names: ``train_cpu.*`` or ``adamw_lowp_cpu*`` globs, ``train_cpu`` any extension."""
    pattern = name if "*" in name or "." in name else name + ".*"
    return sorted(Path(p) for p in glob.glob(str(results / pattern)) if Path(p).suffix != ".png")


# ---- the results files -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def numbers_in(path: Path) -> frozenset[float]:
    text = path.read_text(errors="replace")
    return frozenset(float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text))


def holds(figure: str, numbers) -> bool:
    """Whether some number, as written at the figure's precision (or as a share, or in other units of 1000
    or 60), is the figure."""
    figure = figure.replace(",", "")
    want = float(figure)
    if "e" in figure:
        digits = len(figure.split("e")[0].replace(".", "")) - 1
        fmt = lambda x: float(f"{x:.{digits}e}")  # noqa: E731
    else:
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        fmt = lambda x: round(x, decimals)  # noqa: E731
    scales = (1, 100, 1e-2, 1e3, 1e-3, 1 / 60)
    return any(abs(fmt(x * s) - want) <= 1e-9 * max(1.0, want) for x in numbers for s in scales)


def names_machine_and_command(path: Path, unit: str = "") -> list[str]:
    """What ``path`` lacks of its machine (CPU model or GPU) and the command that wrote it; the command may
    also be given in the citing row or paragraph, as a code span (results written before files held it)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        meta = json.loads(text).get("meta", {})
        rows = json.loads(text).get("rows", [])
        machine = "hardware" in meta or any("hardware" in r for r in rows[:1])
        command = "command" in meta or "argv" in meta
    elif path.suffix == ".csv":
        machine, command = "hardware" in text.splitlines()[0], True  # its .json holds the command
    else:
        machine = re.search(r"^(Machine|machine|hardware)\b", text, re.M) is not None
        command = re.search(r"^(Command|command)\b", text, re.M) is not None
    command = command or re.search(r"`(python|bash|flock) [^`]+`", unit) is not None
    return [what for what, ok in (("machine", machine), ("command", command)) if not ok]


def figure_problems(text: str, where: str, results: Path = RESULTS) -> list[str]:
    """Every figure of ``text`` that no results file it cites holds, and every cited file that is missing or
    does not name its machine and command."""
    out = []
    for line, unit in units(text):
        found, cited = figures(unit), citations(unit)
        if not found:
            continue
        if not cited:
            out.append(f"{where}:{line}: figures {found} cite no results file")
            continue
        paths = []
        for name in cited:
            files = cited_files(name, results)
            if not files:
                out.append(f"{where}:{line}: cites results/{name}, which does not exist")
            paths += files
        numbers = frozenset().union(*(numbers_in(p) for p in paths)) if paths else frozenset()
        for p in paths:
            for what in names_machine_and_command(p, unit):
                out.append(f"{where}:{line}: results/{p.name} does not name its {what}")
        for fig in found:
            if paths and not holds(fig, numbers):
                out.append(f"{where}:{line}: {fig} is in none of {[p.name for p in paths]}")
    return out


# ---- GPU cases and what ran: pytest hooks ------------------------------------------------------------------


def _picks_device_at_import(module_path: str) -> bool:
    """Whether a module-level statement of the test module reads torch.cuda.is_available()."""
    try:
        tree = ast.parse(Path(module_path).read_text())
    except (OSError, SyntaxError):
        return False
    return any("cuda.is_available" in ast.unparse(node) for node in tree.body
               if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)))  # fmt: skip


_DEVICE_CHOICE: dict[str, bool] = {}


def gpu_case(item) -> bool:
    callspec = getattr(item, "callspec", None)
    for name, value in (callspec.params.items() if callspec is not None else ()):
        first = value[0] if isinstance(value, (tuple, list)) and value else value  # a (device, backend) pair
        if "device" in name and isinstance(first, (str, torch.device)) and str(first).startswith("cuda"):
            return True
    for mark in item.iter_markers("skipif"):
        if GPU_SKIP.search(str(mark.kwargs.get("reason", ""))):
            return True
    path = str(item.path)
    if path not in _DEVICE_CHOICE:
        _DEVICE_CHOICE[path] = _picks_device_at_import(path)
    return _DEVICE_CHOICE[path]


@dataclass
class Outcome:
    outcome: str = "passed"  # passed, skipped, failed
    reason: str = ""
    device: str = "cpu"


SESSION: dict[str, Outcome] = {}  # nodeid -> outcome, for every test case collected in this session
GPU_CASES: set[str] = set()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the cuda mark added here counts for `pytest -m cuda`
def pytest_collection_modifyitems(session, config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        gpu = gpu_case(item)
        if gpu:
            GPU_CASES.add(item.nodeid)
            item.add_marker("cuda")
        SESSION[item.nodeid] = Outcome(outcome="not run", device="cuda" if gpu and has_gpu else "cpu")
    items.sort(key=lambda item: item.get_closest_marker(SESSION_END) is not None)  # stable: the rest keep order
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        judges = [item for item in items if item.get_closest_marker(SESSION_OUTCOMES)]
        items[:] = [item for item in items if not item.get_closest_marker(SESSION_OUTCOMES)]
        config.hook.pytest_deselected(items=judges)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports a package requirements-dev.txt pins and this environment lacks (the torch 2.13
    leg has no timm, torchvision, transformers, Lightning or HF Accelerate) is skipped, saying which; with every
    requirement installed, an import error stays an error."""
    outcome = yield
    report = outcome.get_result()
    missing = re.search(r"No module named '([\w.]+)'", str(report.longrepr)) if report.failed else None
    if missing:
        name = missing.group(1).split(".")[0]
        dists = {d.replace("-", "_").lower() for d in missing_requirements()}
        if name.lower() in dists:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: could not import {name!r}, which "
                               "requirements-dev.txt pins and this environment lacks")  # fmt: skip


def pytest_deselected(items):
    for item in items:  # -k, -m: not part of this session's run
        SESSION.pop(item.nodeid, None)


def pytest_runtest_logreport(report):
    seen = SESSION.get(report.nodeid)
    if seen is None and getattr(report, "node", None) is not None:  # the xdist controller, a worker's report
        gpu = "cuda" in report.keywords and torch.cuda.is_available()
        seen = SESSION.setdefault(report.nodeid, Outcome(outcome="not run", device="cuda" if gpu else "cpu"))
    if seen is None:
        return
    if report.skipped:
        seen.outcome = "skipped"
        seen.reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        seen.outcome = "failed"
    elif report.when == "call" and seen.outcome == "not run":
        seen.outcome = "passed"


def matching(test_id: str, session: dict[str, Outcome]) -> dict[str, Outcome]:
    file, _, names = test_id.partition("::")
    prefix = f"tests/{file}" + (f"::{names}" if names else "")
    return {nid: o for nid, o in session.items()
            if nid == prefix or nid.startswith(prefix + ("[" if names else "::")) or nid.startswith(prefix + "::")}


def pytest_configure(config):
    config.addinivalue_line("markers", f"{SESSION_END}: runs after every other test of the session (tests/claims.py)")
    config.addinivalue_line("markers", f"{SESSION_OUTCOMES}: judges the whole session's outcomes; under pytest-xdist "
                                       "the controller does instead (tests/claims.py)")  # fmt: skip


def judge_session(readme: str | None = None) -> tuple[list[str], bool]:
    """(the status table's claims this session's outcomes contradict, whether none of its tests ran at all), for
    the README's text ``readme`` (README.md's by default)."""
    rows = ledger(DOCS[0].read_text() if readme is None else readme)
    bad, unjudged = unbacked(rows, SESSION)
    return bad, len(unjudged) == sum(len(r.claimed_devices()) for r in rows)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if not session.config.pluginmanager.has_plugin("dsession"):  # without xdist, test_claims judges
        return
    bad, _ = judge_session()
    if bad:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        reporter.write_line("tests/claims.py: the status table claims what this session did not show:", red=True)
        for line in bad:
            reporter.write_line("  " + line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@functools.lru_cache(maxsize=None)
def missing_requirements() -> tuple[str, ...]:
    """The packages requirements-dev.txt pins that this environment lacks (CI's torch 2.13 leg lacks timm,
    torchvision, transformers, ...)."""
    from importlib import metadata

    out = []
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        name = line.split("#")[0].split("==")[0].strip()
        if name:
            try:
                metadata.distribution(name)
            except metadata.PackageNotFoundError:
                out.append(name)
    return tuple(out)


def unbacked(rows: list[Row], session: dict[str, Outcome], env_complete: bool | None = None):
    """(claims that fail, claims this session cannot judge). A row's claim on a device fails when its tests
    were collected but none of them passed on that device. It cannot be judged when none of its tests were
    collected, or when all of them were skipped in an environment that lacks some of requirements-dev.txt
    (the torch 2.13 leg has no timm): with every test requirement installed, a row whose tests all skip fails."""
    if env_complete is None:
        env_complete = not missing_requirements()
    bad, unjudged = [], []
    for row in rows:
        cases = {nid: o for t in row.tests for nid, o in matching(t, session).items()}
        for device in row.claimed_devices():
            if any(o.outcome == "passed" and o.device == device for o in cases.values()):
                continue
            if not cases or (not env_complete and all(o.outcome == "skipped" for o in cases.values())):
                unjudged.append(f"{row.where} ({row.what}) on {device}")
                continue
            ran = sorted({f"{o.outcome} on {o.device}" for o in cases.values()})
            bad.append(f"{row.where} ({row.what}) claims {device}, but none of its {len(cases)} test cases passed "
                       f"there in this session ({', '.join(ran)}): say 'not run', or name a test that runs there")
    return bad, unjudged
