"""fastops.optim.SGD(momentum=0.9) against torch.optim.SGD's three implementations (fused=True, foreach=True,
for-loop foreach=False), 1M to 64M params in 100 tensors, fp32, through runner.py as bench_adamw.

Momentum SGD moves 20 bytes/param in fp32: read g, read and write p and the momentum buffer. The roofline is
a streaming kernel with exactly that traffic (p += c*buf; buf = a*buf + g, one torch.compile'd loop, see
common.STREAM_KERNELS), timed in the same rounds as the providers on a footprint far past the caches; copy
(STREAM's count) and an in-place add run next to it for comparison. Rows say whether the working set
(12 B/param: p, g, buf) fits the CPU's last-level cache, where a step could beat the roofline.

    python benchmarks/bench_sgd.py                 # CPU, 1M..64M
    python benchmarks/bench_sgd.py --quick         # CPU, 1M and 4M, a few seconds
    python benchmarks/bench_sgd.py --device cuda   # on a GPU
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402

import fastops  # noqa: E402

SGD = dict(lr=1e-3, momentum=0.9)
SPEC = runner.Spec(
    "sgd",
    {
        "torch_foreach": lambda ps: torch.optim.SGD(ps, **SGD, foreach=True),
        "torch_fused": lambda ps: torch.optim.SGD(ps, **SGD, fused=True),
        "torch_forloop": lambda ps: torch.optim.SGD(ps, **SGD, foreach=False),
        "fastops": lambda ps: fastops.optim.SGD(ps, **SGD),
    },
    bytes_per_param=20,  # read g, read + write p and the momentum buffer
    working_set=12,  # p, g, buf
    kernels=("copy", "add_inplace", "sgd_pattern"),
    roofline="sgd_pattern",
)

if __name__ == "__main__":
    runner.run(SPEC, runner.parser(__doc__, "sgd", sizes=(1, 4, 16, 32, 64)).parse_args())
