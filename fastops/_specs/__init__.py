"""One spec per ``torch.ops.fastops`` op: its schema (the one place its arguments are written), its argument check,
its sample inputs by device and the bad calls it must refuse. fastops/_ops.py registers the ops from these;
opcheck, the parity and compile tests, the bad-input test and ``python -m fastops compile-check`` all read the same
sample inputs; fastops/_specs/codegen.py generates the C++ argument structs and bindings from the schemas."""

from __future__ import annotations

from . import adam, adam_lowp, amp, dropout, linear_ce, sgd
from .spec import BadCall, OpSpec, Sample

SPECS: dict[str, OpSpec] = {
    s.name: s for s in (adam.SPEC, adam_lowp.SPEC, sgd.SPEC, amp.UNSCALE_CHECK, amp.GRAD_STATS, linear_ce.FORWARD,
                        linear_ce.BACKWARD, dropout.SPEC)
}

__all__ = ["SPECS", "OpSpec", "Sample", "BadCall", "adam", "adam_lowp", "sgd", "amp", "linear_ce", "dropout"]
