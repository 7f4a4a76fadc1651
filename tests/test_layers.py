"""fastops' modules import only from their own layer or the layers below it (issue 19): the op registry and the
checks at the bottom, then the backends and kernels, the shared grad math, the optimizers, amp, and on top the
training layer (accelerate, patch) and the command line. Every import statement counts, those inside functions
too: a deferred import is still a dependency, only a later one."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import fastops

ROOT = Path(fastops.__file__).resolve().parent

# Bottom first. The key is a module's first name under fastops (fastops/optim/adam.py -> "optim"); "fastops" is the
# package itself (fastops/__init__.py imports every layer).
LAYERS = [
    ("_util", "_checks", "_quant", "_specs"),
    ("reference", "kernels", "_backend", "_ops", "_lce", "_dropout"),
    ("_grads",),
    ("optim", "data"),
    ("amp",),
    ("accelerate", "_patch"),
    ("fastops", "__main__", "demo", "compile_check"),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["fastops", *parts])


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _imported(module: str, is_package: bool, source: str) -> set[str]:
    """The fastops modules ``source`` (the text of ``module``) imports, by full name."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "fastops")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "fastops":
                continue
            for alias in node.names:  # `from fastops import amp` imports the module fastops.amp
                sub = f"{origin}.{alias.name}"
                out.add(sub if _is_module(sub) else origin)
    return out


def _key(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fastops"


def violations(module: str, is_package: bool, source: str) -> list[str]:
    """The imports of ``module`` that reach a layer above its own, or modules LAYERS does not place."""
    key = _key(module)
    if key not in LAYER:
        return [f"{module} is in no layer: add {key!r} to LAYERS in tests/test_layers.py"]
    out = []
    for target in sorted(_imported(module, is_package, source)):
        tkey = _key(target)
        if tkey not in LAYER:
            out.append(f"{module} imports {target}, which is in no layer: add {tkey!r} to LAYERS")
        elif LAYER[tkey] > LAYER[key]:
            out.append(f"{module} (layer {LAYER[key]}, {key}) imports {target} (layer {LAYER[tkey]}, {tkey})")
    return out


def _sources():
    for folder, _, files in os.walk(ROOT, followlinks=True):  # fastops/kernels is a link in a checkout
        for f in sorted(files):
            if f.endswith(".py"):
                path = Path(folder) / f
                yield _module_name(path), f == "__init__.py", path.read_text()


def test_no_module_imports_a_layer_above_its_own():
    found = [(m, p) for m, p, _ in _sources()]
    assert ("fastops.optim.optimizer", False) in found and ("fastops._grads", False) in found  # the walk sees them
    assert len(found) > 30, found
    problems = [v for module, is_package, source in _sources() for v in violations(module, is_package, source)]
    assert not problems, "\n".join(problems)


def test_optim_and_amp_share_the_grad_math_below_both():
    # amp recognizes fastops' optimizers by a public class attribute, not by importing them.
    srcs = {m: s for m, _, s in _sources()}
    assert not any(t.startswith("fastops.optim") for t in _imported("fastops.amp", False, srcs["fastops.amp"]))
    assert "fastops._grads" in _imported("fastops.amp", False, srcs["fastops.amp"])
    assert "fastops._grads" in _imported("fastops.optim.optimizer", False, srcs["fastops.optim.optimizer"])
    assert fastops.optim.AdamW.takes_grad_scale is True and fastops.optim.SGD.takes_grad_scale is True


def test_the_walk_catches_an_upward_import():
    # The checker itself: each of these is an import the layers forbid, in every spelling the repository uses.
    assert violations("fastops._grads", False, "from . import amp")
    assert violations("fastops.optim.adam", False, "from .. import amp")
    assert violations("fastops.optim", True, "from ..amp import GradScaler")
    assert violations("fastops.amp", False, "def f():\n    from fastops.accelerate import Accelerator")
    assert violations("fastops._ops", False, "import fastops.optim")
    assert violations("fastops._ops", False, "from . import clip_grad_norm_")  # a name of fastops/__init__.py
    assert violations("fastops._nowhere", False, "") and violations("fastops.amp", False, "from . import _nowhere")
    assert not violations("fastops.amp", False, "from . import _grads, optim\nfrom .optim.adam import AdamW")
