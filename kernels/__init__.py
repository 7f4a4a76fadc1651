"""Triton kernels for fastops (the ``triton`` backend, see ``fastops._backend``).

Each launcher takes its op's arguments in the schema's order (fastops/_specs; the optimizer launchers read them
through the op's ``Args`` record), plus the keyword ``host_scalars``: the names of the scalar arguments to read on
the host even where they are on the tensors' device, the path CPU scalars take with CUDA tensors, which tests and
compile-check take on CPU tensors (``_common.StepScalars``). On CUDA tensors they run compiled; on CPU tensors only
under ``TRITON_INTERPRET=1`` (set before triton is imported), which is how they are tested without a GPU.
"""

from ._common import TABLES
from .adam import adam_step_
from .adam_lowp import adam_step_lowp_
from .amp import grad_stats, unscale_check_
from .dropout import dropout
from .linear_ce import linear_cross_entropy, linear_cross_entropy_backward
from .sgd import sgd_step_

__all__ = ["adam_step_", "adam_step_lowp_", "sgd_step_", "unscale_check_", "grad_stats", "linear_cross_entropy",
           "linear_cross_entropy_backward", "dropout", "TABLES"]
