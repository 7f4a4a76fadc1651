"""fastops.optim.AdamW against torch.optim.AdamW's three implementations (foreach=True, fused=True, for-loop
foreach=False), 1M to 100M params in 100 tensors. torch's default is foreach on CUDA and the for-loop on the
CPU (foreach kernels are CUDA/XPU-only); the run says which, and compares fastops with it.

Reports ms/step (median, 20/80% quantiles), effective GB/s at 28 bytes/param for fp32 (read grad, read and
write param, exp_avg, exp_avg_sq) and the percentage of the memory roofline: the best of a few streaming
kernels (copy, in-place scale, in-place add, triad, and Adam's own access pattern with trivial math; see
common.StreamKernels) on a footprint far past the caches, sampled in every round next to the providers, so
the roofline sees the same machine load. Copy bandwidth (STREAM's count) is reported too. Rows say whether
the working set (16 B/param: p, g, m, v) fits the CPU's last-level cache, where a step could beat the roofline.
Providers are interleaved round by round so drift on a noisy machine hits them all alike.

    python benchmarks/bench_adamw.py                  # CPU, 1M..100M
    python benchmarks/bench_adamw.py --quick          # CPU, 1M and 4M, a few seconds
    python benchmarks/bench_adamw.py --device cuda    # on a GPU
    python benchmarks/bench_adamw.py --sizes 16 64 --rounds 3 --out scratch_adamw   # a short trial run
    python benchmarks/bench_adamw.py --lowp --sizes 4 16   # 8-bit and bf16 states against torch, torchao, bnb
    python benchmarks/bench_adamw.py --lowp --threads 1 --clock cpu --sizes 16 --tensors 20 --out adamw_lowp_cpu_1t
    FASTOPS_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_adamw.py --lowp ...   # an AVX2 CPU

--lowp compares, on the same params: torch fused=True (fp32 states), fastops.optim.AdamW with fp32, bf16 and 8-bit
states (state_dtype=, as users call it), torchao's and bitsandbytes' AdamW8bit where they import. Each provider's GB/s
and roofline share count its own bytes (fp32 p and g: 28 fp32 states, 20 bf16, 16 + 1/32 8-bit; params under
4096 elements keep fp32 states under every 8-bit provider, as bnb and torchao do), and each row gives the
optimizer state held per param; pct_copy is each provider's GB/s against a copy's in the same rounds.

The two environment variables lower the ISA both fastops' kernels and torch's own run at (an AVX2 machine's, on an
AVX-512 one): fastops' level and torch's are in the results' meta. --clock cpu (with --threads 1) times the calling
thread's CPU time, which a loaded machine disturbs less than wall time.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402
from runner import Spec  # noqa: E402

import fastops  # noqa: E402

SIZES = (1, 4, 16, 32, 64, 100)  # millions of params
LOWP_SIZES = (16, 24)
KERNELS = ("copy", "scale_inplace", "add_inplace", "triad", "adam_pattern")

ADAMW = Spec(
    "adamw",
    {
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
        "fastops": lambda ps: fastops.optim.AdamW(ps, lr=1e-3),
    },
    bytes_per_param=28,  # read g, read + write p, exp_avg, exp_avg_sq
    working_set=16,  # p, g, m, v
    kernels=KERNELS,
)


def lowp_spec() -> Spec:
    providers = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "fastops": lambda ps: fastops.optim.AdamW(ps, lr=1e-3),
        # As users call it: the optimizer with its per-step Python (groups, calls, the bf16 seed), not the bare op.
        "fastops_bf16": lambda ps: fastops.optim.AdamW(ps, lr=1e-3, state_dtype="bf16"),
        "fastops_8bit": lambda ps: fastops.optim.AdamW(ps, lr=1e-3, state_dtype="8bit"),
    }
    ao, bnb = runner.peer("torchao.optim", "AdamW8bit"), runner.peer("bitsandbytes.optim", "AdamW8bit")
    if ao is not None:
        providers["torchao_8bit"] = lambda ps: ao(ps, lr=1e-3)
    if bnb is not None:
        providers["bnb_8bit"] = lambda ps: bnb(ps, lr=1e-3)
    eight = 16 + 2 * 4 / 256  # p r/w, g, two 1-byte codes r/w, two fp32 absmax per 256 r/w
    return Spec(
        "adamw_lowp", providers,
        bytes_per_param={"torch_fused": 28, "fastops": 28, "fastops_bf16": 20, "fastops_8bit": eight,
                         "torchao_8bit": eight, "bnb_8bit": eight},
        working_set=16, kernels=KERNELS, baseline="torch_fused",
        multiple=256,  # torchao's block: other sizes would keep fp32 states there
        report_state=True,
    )  # fmt: skip


def main() -> None:
    p = runner.parser(__doc__, "adamw", SIZES)
    p.add_argument("--lowp", action="store_true", help="8-bit and bf16 states against torch, torchao and bnb "
                   f"(default sizes {' '.join(map(str, LOWP_SIZES))}, out adamw_lowp_<device>)")  # fmt: skip
    args = p.parse_args()
    spec = ADAMW
    if args.lowp:
        spec = lowp_spec()
        if args.sizes == list(SIZES):
            args.sizes = list(LOWP_SIZES)
    runner.run(spec, args)


if __name__ == "__main__":
    main()
