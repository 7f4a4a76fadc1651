"""``fuse_``: torch's Adam, AdamW or SGD turned into fastops' class in place."""

from __future__ import annotations

import functools
import weakref

import torch

from . import _state
from ._fallback import _check_no_overlap, _kernels_take
from .adam import Adam, AdamW
from .optimizer import _Fused
from .sgd import SGD

# torch's classes (exactly) -> fastops'. fastops.patch() rebinds the torch.optim names, not these bases.
_FUSABLE = {cls.__bases__[-1]: cls for cls in (AdamW, Adam, SGD)}


def _tracked_step(opt: torch.optim.Optimizer):
    """The instance step torch's LRScheduler installs (it sets ``_opt_called``, which its order check reads),
    around the optimizer's current class's step."""
    opt_ref = weakref.ref(opt)

    @functools.wraps(type(opt).step)
    def wrapper(*args, **kwargs):
        o = opt_ref()
        o._opt_called = True
        return type(o).step(o, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    return wrapper


def fuse_(opt: torch.optim.Optimizer) -> bool:
    """Turns a torch ``Adam``, ``AdamW`` or ``SGD`` (exactly those classes, not subclasses) into fastops' class in
    place and returns True: the same object with the same param_group dicts, state, hooks and step counts, so LR
    schedulers built on it keep driving it. Its states move to fastops' layout (fp32, on the param's device), as
    when a torch state_dict is loaded into a fastops optimizer; ``master_weights`` is off and ``max_grad_norm``
    None. Returns True, changing nothing, for an optimizer that already is fastops'. Returns False and leaves it
    as it was when fastops cannot take every group (another class, ``differentiable=True``, params that are not
    float32/bfloat16/float16, complex, sparse, strided with gaps, on several devices in a group, or overlapping)."""
    if isinstance(opt, _Fused):
        return True
    cls = _FUSABLE.get(type(opt))
    if cls is None or opt.defaults.get("differentiable", False):
        return False
    if not all(_kernels_take(group) for group in opt.param_groups):
        return False
    try:
        _check_no_overlap([p for g in opt.param_groups for p in g["params"]], "")
    except ValueError:
        return False
    torch_step = type(opt).step
    opt.__class__ = cls
    opt._fastops_init(master_weights=False, max_grad_norm=None)
    # torch wraps a class's step (step hooks, profiler) when the first instance is constructed; a class
    # assigned without a constructor call gets the same here.
    opt._patch_step_function()
    sched_step = opt.__dict__.get("step")
    if getattr(sched_step, "_wrapped_by_lr_sched", False) and getattr(sched_step, "__wrapped__", None) is torch_step:
        # An LR scheduler made before the conversion wrapped the instance's step around torch's class's function.
        opt.step = _tracked_step(opt)
    opt._fastops_loading = [(p, dict(s)) for p, s in opt.state.items()]
    _state.load_post_hook(opt)
    return True
