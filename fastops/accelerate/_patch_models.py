"""``fastops.patch(models=True)``: HF transformers models get ``fastops.accelerate``'s rules inside any training
loop (HF's Trainer, Lightning, an HF Accelerate loop, the user's own).

``PreTrainedModel.__call__`` is given a check: the first call of a model in training mode, with grad enabled and
``labels=``, applies the rules of ``_auto`` to that model: the fused loss with lazy logits (``_fused_loss``), regional
compilation where it pays (``_compile``) and, on the CPU, dropout on the fused op (``_dropout``). The call itself then
runs the usual way and, with it, the first-loss decision of the fused loss; the decision is logged in one line (logger
``fastops.accelerate``) and kept as ``model._fastops_decision``. Calls without labels, in eval mode or under no_grad are
left alone, and so is a model trained before ``patch()`` was called until its next labeled training call.

transformers is not imported for this: if it is not loaded yet, an import hook patches ``PreTrainedModel`` when
``transformers.modeling_utils`` is first imported."""

from __future__ import annotations

import importlib.abc
import sys
import types

import torch
import torch.nn as nn

from . import _auto

_MODULE = "transformers.modeling_utils"
_state = {"on": False, "patched": None}


def _call(self, *args, **kwargs):
    if (_state["on"] and "_fastops_decision" not in self.__dict__ and self.training and torch.is_grad_enabled()
            and kwargs.get("labels") is not None):
        decision = apply_rules(self)
        out = nn.Module.__call__(self, *args, **kwargs)
        decision.log()
        return out
    return nn.Module.__call__(self, *args, **kwargs)


def apply_rules(model: nn.Module) -> _auto.Decision:
    """The auto rules for ``model`` as it is now: its device, and the autocast the caller opened (HF's Trainer and
    Accelerate, Lightning). One call per model."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    decision = _auto.Decision(prefix=f"fastops.patch: {type(model).__name__}")
    ctx = types.SimpleNamespace(device=device, strategy="none", amp_dtype=amp, decision=decision)
    model._fastops_decision = ctx.decision
    _auto.decide_fused(ctx, model, _auto.AUTO)
    ctx.decision.compile, ctx.decision.compile_why = _auto.decide_compile(ctx, model, _auto.AUTO)
    if ctx.decision.compile:
        from . import _compile

        model._fastops_regions = _compile.compile_regions(model, eager=_auto.region_stays_eager(device))
    _auto.decide_dropout(ctx, model)
    return ctx.decision


def _patch(module) -> None:
    cls = module.PreTrainedModel
    if "__call__" not in cls.__dict__:
        cls.__call__ = _call
    _state["patched"] = cls


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches PreTrainedModel right after transformers.modeling_utils is executed."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


_finder = _AfterImport()


def enable() -> None:
    _state["on"] = True
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def disable() -> None:
    _state["on"] = False
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    cls = _state["patched"]
    if cls is not None and cls.__dict__.get("__call__") is _call:
        del cls.__call__
    _state["patched"] = None
