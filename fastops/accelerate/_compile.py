"""Regional compilation for ``fastops.accelerate(compile=True)``.

A model is mostly a stack of one repeated block (a transformer layer, a ResNet bottleneck). Compiling each block
with ``nn.Module.compile`` traces that block's code once: the instances share the graph (their parameters are
graph inputs), so compile time is one block's instead of the whole model's, and the steady state is close to a
full compile (PyTorch's regional compilation recipe, HF Accelerate's ``compile_regions``, torchtitan's per-block
compile). The blocks are HF transformers' ``_no_split_modules`` classes, else the items of any ``ModuleList`` or
``Sequential`` that repeats one class (torchvision's and timm's stages, a user's ``nn.ModuleList`` of layers); the
rest of the model stays eager. Without any repeated block the whole forward is compiled once.

Regions where compiling does not pay (``fastops.accelerate._auto.region_stays_eager``: convolution blocks on the
CPU) stay eager, and the decision line says so. A compile that fails (a backend error, an operator dynamo cannot
trace) makes every region run eagerly from then
on, with one warning that gives the reason. Graph breaks and recompiles are reported once, after the first
optimizer steps, in one warning, since each means compile time spent again or code left eager.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import platform
import threading
import types
import warnings

import torch
import torch.nn as nn

# The backend regions compile with; tests set "eager" to check the mechanics without inductor's compile time.
BACKEND = "inductor"
# Optimizer steps after which the compile statistics are read once (the second step shows recompiles caused by
# whatever changed after the first, such as the optimizer's state).
REPORT_AFTER = 2


def find_regions(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (see the module docstring), outermost first; none nested in another."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
    else:
        found = []

        def visit(module: nn.Module) -> None:
            for child in module.children():
                items = list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else []
                if len(items) >= 2 and len({type(c) for c in items}) == 1 and any(True for _ in child.parameters()):
                    found.extend(items)
                else:
                    visit(child)

        visit(model)
    inside = set()
    for m in found:
        inside.update(id(sub) for sub in m.modules() if sub is not m)
    return [m for m in found if id(m) not in inside]


def signature(module: nn.Module) -> tuple:
    """What a compiled graph of ``module`` is specific to: its classes, their configuration (strides, sizes) and
    its parameters' shapes and dtypes. Blocks with one signature share one graph."""
    parts = tuple((type(m).__name__, m.extra_repr()) for m in module.modules())
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(), *module.named_buffers()))
    return parts, tensors


_TAGS = itertools.count()


def _entry():
    """A function of its own code object for one signature: dynamo keeps its compiled graphs and its recompile
    count per code object, so blocks of different shapes (ResNet's stages) neither recompile each other nor
    push one another to dynamic shapes, and none counts against another's recompile limit. The name is unique
    in the process: dynamo remembers which sizes changed by (file, line, name), so a second model's region of
    the same name would start out dynamic."""
    tag = next(_TAGS)

    def region(call, *args, **kwargs):
        return call(*args, **kwargs)

    code = region.__code__.replace(co_name=f"fastops_region_{tag}")
    return types.FunctionType(code, region.__globals__, code.co_name)


def _no_cache_in_training(model: nn.Module, regions: "_Regions") -> None:
    """An HF model's training calls that do not say otherwise run with ``use_cache=False`` while its regions are
    compiled. Its config's default (True) has a training forward build a KV cache that nothing reads, and the
    cache's update reads each layer's layer_idx, on which dynamo specializes: every layer then compiles a graph of
    its own, where one serves them all. A 12-layer Llama (hidden 64, 2 threads) took its first step in 28.3 s with
    the cache (12 graphs) and 16.2 s without (1 graph). A call that passes use_cache, eval, no_grad and a model
    whose regions stay eager run as before (docs/differences.md)."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return
    forward = model.forward
    try:
        takes = "use_cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return

    @functools.wraps(forward)
    def call(*args, **kwargs):
        if regions.modules and model.training and torch.is_grad_enabled() and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return forward(*args, **kwargs)

    model.forward = call


class _Regions:
    """The compiled regions of one model and what the run learned about them."""

    def __init__(self, model: nn.Module, dynamic: bool | None = None, eager=None) -> None:
        from torch._dynamo.utils import counters

        self.counters = counters
        self.start = {"unique_graphs": counters["stats"]["unique_graphs"],
                      "breaks": sum(counters["graph_break"].values())}
        self.failed: str | None = None
        self.reported = False
        regions = find_regions(model) or [model]
        # Regions where compiling does not pay stay eager: eager(module) gives the reason, or None.
        self.left_eager = {}
        for module in regions:
            why = eager(module) if eager is not None else None
            if why is not None:
                self.left_eager.setdefault(why, []).append(type(module).__name__)
        self.modules = [m for m in regions if eager is None or eager(m) is None]
        self.classes = {type(m).__name__ for m in self.modules}
        # Inductor's ISA checks, side by side at the first compiled call (not here: a short run may still turn the
        # compile off, and the checks would then compete with its steps for nothing).
        self.probe = bool(self.modules) and BACKEND == "inductor" and all(
            p.device.type == "cpu" for p in model.parameters())
        keys = [signature(module) for module in self.modules]
        groups = {key: torch.compile(_entry(), backend=BACKEND, dynamic=dynamic) for key in keys}
        # Dynamo specializes on the int attributes a block reads, such as HF's layer_idx (read by the KV cache's
        # update, which runs in training too): then each block of a signature compiles a graph of its own. Past
        # the recompile limit (8) dynamo ran the rest eagerly: 4 of 12 LlamaDecoderLayers did, 24 of a 32-layer
        # model's would. Each signature's code object may compile once per block beyond that limit.
        limits = {key: torch._dynamo.config.recompile_limit + keys.count(key) - 1 for key in groups}
        for module, key in zip(self.modules, keys):
            module._compiled_call_impl = self._guarded(groups[key], module._call_impl, limits[key])
        self.signatures = len(groups)
        if self.modules:
            _no_cache_in_training(model, self)

    def remove(self) -> None:
        """Every region eager again (before its first call: nothing was compiled)."""
        for module in self.modules:
            module._compiled_call_impl = None
        self.modules = []

    def _guarded(self, compiled, eager, limit: int):
        regions = self

        def call(*args, **kwargs):
            # Training calls only: an eval or no_grad call would compile graphs of its own for no gain worth
            # the compile time.
            if regions.failed is not None or not torch.is_grad_enabled():
                return eager(*args, **kwargs)
            if regions.probe:
                regions.probe = False
                probe_vector_isas()
                _await_probes()
            config = torch._dynamo.config
            before = config.recompile_limit  # set and restored directly: config.patch() took 123 us a call
            config.recompile_limit = max(before, limit)
            try:
                return compiled(eager, *args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                # Raised by dynamo and the backends while tracing or compiling, before the region's code ran: the
                # eager call computes what the compiled one would have.
                cause = getattr(e, "inner_exception", None) or e.__cause__ or e  # a backend's own error, if any
                lines = [line for line in str(cause).splitlines() if line.strip()]
                regions.failed = f"{type(cause).__name__}: {lines[0] if lines else ''}"
                warnings.warn(
                    f"fastops.accelerate(compile=True): compiling {sorted(regions.classes)} failed, so the model "
                    f"runs eagerly from here on ({regions.failed})",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return eager(*args, **kwargs)
            finally:
                config.recompile_limit = before

        return call

    def report(self, steps: int) -> None:
        """One warning after REPORT_AFTER optimizer steps when the regions broke graphs or recompiled."""
        if self.reported or steps < REPORT_AFTER or self.failed is not None:
            return
        self.reported = True
        graphs = self.counters["stats"]["unique_graphs"] - self.start["unique_graphs"]
        breaks = {k: v for k, v in self.counters["graph_break"].items()}
        n_breaks = sum(breaks.values()) - self.start["breaks"]
        # One graph per block (a signature's blocks may differ in an int attribute they read), one more per
        # signature and input shape it saw, at most: more means recompiles.
        if n_breaks == 0 and graphs <= len(self.modules) + self.signatures + 2:
            return
        reasons = "; ".join(f"{reason} ({count}x)" for reason, count in list(breaks.items())[:3])
        warnings.warn(
            f"fastops.accelerate(compile=True): {len(self.modules)} regions ({sorted(self.classes)}) made {graphs} "
            f"graphs in {steps} steps with {n_breaks} graph breaks{': ' + reasons if reasons else ''}. Graph breaks "
            "leave code eager and recompiles spend compile time again; torch._logging.set_logs(graph_breaks=True, "
            "recompiles=True) shows where.",
            RuntimeWarning,
            stacklevel=2,
        )


_probes: list[threading.Thread] = []  # running, until _await_probes
_probed = False


def probe_vector_isas() -> list[threading.Thread]:
    """Starts inductor's checks of the CPU's vector ISAs, one thread each, and returns the threads (once per
    process; later calls return what is still running).

    Inductor makes these checks inside the first compile of a CPU kernel, one ISA after another: each builds a test
    library with that ISA's flags and loads it in a fresh Python. With a new inductor cache (a new machine, a
    cleared /tmp) the three of an AMD Zen 5 (AVX-512 with VNNI, AVX-512, AVX2) took 3.4-4.1 s each. Side by side
    on its 2 cores, the Llama benchmark's accelerate() and first step (1 thread) took 14.8-20.2 s, median 16.3 over 7
    runs, against 17.3-21.0, median 18.8, without. The results are inductor's own, cached in the ISA objects. The first
    compiled call starts them and waits for them (``_await_probes``) before it compiles, so its compile never
    checks an ISA while a thread does (VecAVX512's check changes the object's flags for a while)."""
    global _probed
    if _probed or platform.machine() not in ("x86_64", "AMD64"):
        return list(_probes)
    _probed = True
    try:
        from torch._inductor import cpu_vec_isa

        have = cpu_vec_isa.x86_isa_checker()
        isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if str(isa).split() and all(flag in have for flag in str(isa).split())]
    except (ImportError, AttributeError, TypeError):  # another torch's internals: its compile checks them as before
        return []

    def check(isa) -> None:
        try:
            bool(isa)
        except Exception:  # noqa: BLE001 - the compile's own check raises it again, in the caller's thread
            pass

    for isa in isas:
        thread = threading.Thread(target=check, args=(isa,), name=f"fastops-probe-{isa}", daemon=True)
        thread.start()
        _probes.append(thread)
    return list(_probes)


def _await_probes() -> None:
    while _probes:
        _probes.pop().join()


def compile_regions(model: nn.Module, dynamic: bool | None = None, eager=None) -> _Regions:
    """Compiles ``model``'s repeated blocks in place (their ``__call__`` goes through the compiled code) and
    returns the record ``fastops.accelerate`` reports from. ``eager(module)``: why a region stays eager, or None."""
    return _Regions(model, dynamic, eager)
