"""Builds fastops and its extension ``fastops._C``.

- The C++ CPU kernels (``csrc/cpu``) are always built. They are compiled for a portable x86-64 baseline;
  the hot loops are also compiled for AVX2 and AVX-512 (``csrc/cpu/kernels_{avx2,avx512}.cpp``, GCC
  target pragmas) and picked at load time with ``__builtin_cpu_supports``, so one wheel runs everywhere
  and still uses the wide units (``FASTOPS_NATIVE=1`` adds ``-march=native`` for a build that only has
  to run on the machine that built it).
- The CUDA kernels (``csrc/cuda``) are built when torch has CUDA and nvcc is found; ``FASTOPS_CUDA=1`` forces
  them (and fails loudly if that cannot work), ``FASTOPS_CUDA=0`` skips them.
- ``kernels/`` (Triton) is installed as ``fastops.kernels``.
"""

import glob
import os

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _want_cuda() -> bool:
    flag = os.environ.get("FASTOPS_CUDA")
    if flag is not None:
        return flag == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


# -fno-math-errno lets std::sqrt vectorize: without it the AdamW loop ran at 0.34x torch's fused=True here,
# with it 0.95x (shared/NOTES.md). -ffp-contract=off: the kernels place their FMAs explicitly where torch's
# vectorised ops use them (lerp_, add(alpha), addcmul_), which makes fp32 Adam match the reference bit for
# bit on AVX2/AVX-512; GCC's default contraction also fused p*(1-lr*wd) into the update (25% of params
# 1 ulp off). -std=c++20: torch 2.13's headers warn under C++17, and c++20 is its own default.
cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
if os.environ.get("FASTOPS_NATIVE") == "1":
    cxx_flags.append("-march=native")
sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
define_macros = []
ext_cls = CppExtension
extra = {"cxx": cxx_flags}
if _want_cuda():
    ext_cls = CUDAExtension
    sources += sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    define_macros.append(("WITH_CUDA", None))
    # No --use_fast_math: its -ftz=true flushes denormal m/v values (torch's fused Adam keeps them), and the
    # kernels are bound by memory, not by the slower IEEE division and square root.
    extra["nvcc"] = ["-O3", "-std=c++17", "-lineinfo"]

setup(
    packages=["fastops", "fastops.kernels"],
    package_dir={"fastops": "fastops", "fastops.kernels": "kernels"},
    ext_modules=[
        ext_cls(
            "fastops._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
