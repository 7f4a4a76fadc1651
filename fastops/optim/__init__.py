"""Drop-in fused Adam, AdamW and SGD.

``fastops.optim.Adam``/``AdamW``/``SGD`` subclass torch's classes, so ``isinstance`` checks, LR schedulers and
``torch.amp.GradScaler`` treat them as torch's own. They keep torch's constructor signature, defaults,
param_groups and state_dict format, and add two keywords, ``master_weights`` and ``max_grad_norm``. Each step is
one call of ``torch.ops.fastops.adam_step_`` / ``sgd_step_`` per param group (a few when some params need an fp32
master copy, or, for SGD, start their momentum buffer at this step).

Where they differ from torch on purpose (the README lists these too):
- optimizer states are fp32 for every param dtype (torch keeps bf16/fp16 states for bf16/fp16 params);
- grads are never written (torch's fused kernels leave the unscaled grad behind when a GradScaler is
  used; reading the grad after ``scaler.step`` gives the scaled grad here);
- ``foreach`` and ``fused`` are accepted and stored but ignored: the fastops kernel always runs;
- hyperparameters are checked with torch's constructor checks and wording in ``add_param_group`` and again
  at every ``step`` (torch checks only the constructor's values, so a group added or edited later with
  betas=(1.0, 0.999) gives nan params there).

Param groups the kernels do not take run torch's own step, so every script torch runs keeps running after
``fastops.patch()``. The choice is per param group and per step: a group goes to torch when it has
``differentiable=True``, or any of its params is not float32/bfloat16/float16, is complex, sparse, strided with
gaps, on a device fastops does not serve, or on another device than the group's first param, or has a sparse
grad at this step (torch's SGD takes it; torch's Adam raises its own error). Such a group gets torch's results
exactly (torch's code, torch's state layout); ``master_weights`` does not apply to it, ``max_grad_norm`` does (its
grads count in the norm and are clipped in place first, as ``clip_grad_norm_`` would). Under a GradScaler its
grads are unscaled in place first, as torch's GradScaler does for torch's optimizers, and the skip decision is
read on the host (one sync per step, which torch's GradScaler also takes for those optimizers).
"""

from __future__ import annotations

# The package, shaped like torch.optim: optimizer.py (the shared step), adam.py, sgd.py, fuse.py, and the pieces
# the step stands on: _fallback.py (which params the kernels take; torch's step for the rest), _state.py (state
# formats and state_dict hooks), _master.py (master weights).
from .. import _ops  # noqa: F401  (fastops.optim._ops, as before the split: tests patch its functions)
from ._state import STATE_DTYPES, _state_format, moments_fp32  # noqa: F401
from .adam import Adam, AdamW
from .fuse import fuse_
from .optimizer import _Fused  # noqa: F401
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "fuse_", "moments_fp32", "STATE_DTYPES"]
