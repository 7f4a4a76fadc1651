"""Builds fastops and its extension ``fastops._C``.

- The C++ CPU kernels (``csrc/cpu``) are always built. They are compiled for a portable x86-64 baseline;
  the hot loops are also compiled for AVX2 and AVX-512 (``csrc/cpu/kernels_{avx2,avx512}.cpp``, GCC
  target pragmas) and picked at load time with ``__builtin_cpu_supports``, so one wheel runs everywhere
  and still uses the wide units (``FASTOPS_NATIVE=1`` adds ``-march=native`` for a build that only has
  to run on the machine that built it).
- The CUDA kernels (``csrc/cuda``) are built when torch is a CUDA build and nvcc is found, with no GPU
  needed (a docker build, a CI runner, a login node). ``FASTOPS_CUDA=0`` skips them, ``FASTOPS_CUDA=1``
  requires them. What is found and chosen is printed as ``fastops setup: ...`` lines:
  - the toolkit: ``CUDA_HOME`` (or ``CUDA_PATH``) when set, else the one nvcc on PATH belongs to, as nvcc
    itself reports it (``nvcc -dryrun``'s TOP), so a wrapper script or a symlink in another ``bin`` works;
  - the archs: ``TORCH_CUDA_ARCH_LIST`` when set, else the visible GPUs' (torch's default), else sm_80,
    sm_90 and sm_100 (those this nvcc knows) plus PTX of the newest, which later GPUs JIT-compile;
  - the headers torch's CUDA headers include (cuSPARSE, cuBLAS, cuSOLVER) from the toolkit, else from the
    pip ``nvidia-*`` packages torch depends on (searched after the toolkit's, so its own headers win).
  Where the CUDA kernels were asked for (or nvcc was found) but cannot be built, the build stops with a
  message that says what is missing.
- ``kernels/`` (Triton) is installed as ``fastops.kernels``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata

from setuptools import setup

import torch

DEFAULT_ARCHS = ("8.0", "9.0", "10.0")
# What ATen/cuda/CUDAContextLight.h includes beyond the CUDA runtime; some toolkits (a minimal docker image,
# a conda cuda-nvcc) ship none of them.
LIBRARY_HEADERS = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")


def say(msg: str) -> None:
    print(f"fastops setup: {msg}", flush=True)


def stop(msg: str) -> None:
    sys.exit(f"fastops setup: error: {msg}\n(FASTOPS_CUDA=0 builds fastops without its CUDA kernels; the Triton "
             "backend still serves CUDA tensors.)")


def toolkit_of(nvcc: str) -> str:
    """The toolkit root nvcc runs from: the TOP it reports (a shell wrapper execs the real nvcc, so neither the
    wrapper's path nor its resolved symlinks lead there), else its resolved path's parent folder."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cu")
        open(src, "w").close()
        try:
            out = subprocess.run([nvcc, "-dryrun", "-c", src, "-o", os.path.join(tmp, "probe.o")],
                                 capture_output=True, text=True, timeout=60)
            top = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        except (OSError, subprocess.SubprocessError):
            top = None
    if top:
        return os.path.realpath(top.group(1).strip())
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def find_toolkit(required: bool) -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if not os.path.isfile(os.path.join(home, "bin", "nvcc")):
                stop(f"{var}={home} has no bin/nvcc")
            say(f"CUDA toolkit {home} (from {var})")
            return home
    nvcc = shutil.which("nvcc")
    if nvcc is None and os.path.isfile("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if nvcc is None:
        if required:
            stop("FASTOPS_CUDA=1 but no nvcc on PATH, in /usr/local/cuda, or under CUDA_HOME")
        return None
    home = toolkit_of(nvcc)
    say(f"CUDA toolkit {home} (where {nvcc} runs from)")
    return home


def pip_header_dirs() -> list[str]:
    """include/ folders of the installed nvidia-* packages that hold one of LIBRARY_HEADERS."""
    found = []
    for dist in metadata.distributions():
        if not (dist.metadata["Name"] or "").lower().startswith("nvidia-"):
            continue
        for f in dist.files or ():
            if f.name in LIBRARY_HEADERS and f.parent.name == "include":
                d = str(dist.locate_file(f).parent)
                if d not in found:
                    found.append(d)
    return sorted(found)


def header_dirs(home: str) -> list[str]:
    """Folders to search after the toolkit's include/ for LIBRARY_HEADERS; stops naming what is missing."""
    toolkit_inc = os.path.join(home, "include")
    if not os.path.isfile(os.path.join(toolkit_inc, "cuda_runtime_api.h")):
        stop(f"the CUDA toolkit at {home} has no include/cuda_runtime_api.h; point CUDA_HOME at a full toolkit")
    missing = [h for h in LIBRARY_HEADERS if not os.path.isfile(os.path.join(toolkit_inc, h))]
    if not missing:
        return []
    extra = pip_header_dirs()
    still = [h for h in missing if not any(os.path.isfile(os.path.join(d, h)) for d in extra)]
    if still:
        stop(f"torch's CUDA headers include {', '.join(still)}, found neither in {toolkit_inc} nor in an installed "
             "nvidia-* pip package; install the toolkit's cuSPARSE/cuBLAS/cuSOLVER development headers, or the "
             "nvidia-* packages of torch's CUDA version (pip install torch pulls them in)")
    say(f"{', '.join(missing)} not in the toolkit; taken from {', '.join(extra)}")
    return extra


def nvcc_archs(home: str) -> set[str]:
    out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True, text=True)
    return {f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)", out.stdout)}


def choose_archs(home: str) -> None:
    """Sets TORCH_CUDA_ARCH_LIST where torch's own default would fail: with no GPU visible it indexes an empty
    device list (IndexError in _get_cuda_arch_flags)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        say(f"archs {os.environ['TORCH_CUDA_ARCH_LIST']} (from TORCH_CUDA_ARCH_LIST)")
        return
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        caps = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        say(f"archs {';'.join(caps)} (the visible GPUs; torch's default)")
        return
    known = nvcc_archs(home)
    archs = [a for a in DEFAULT_ARCHS if a in known]
    if not archs:
        stop(f"no GPU visible and this nvcc supports none of sm_{', sm_'.join(a.replace('.', '') for a in DEFAULT_ARCHS)}; "
             "set TORCH_CUDA_ARCH_LIST")
    archs[-1] += "+PTX"
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    say(f"archs {os.environ['TORCH_CUDA_ARCH_LIST']} (no GPU visible; set TORCH_CUDA_ARCH_LIST to change)")


def configure_cuda() -> list[str] | None:
    """None: build without the CUDA kernels. Else the extra header folders. Runs before torch.utils.cpp_extension
    is imported, which reads CUDA_HOME once, at import."""
    flag = os.environ.get("FASTOPS_CUDA")
    if flag not in (None, "", "0", "1"):
        stop(f"FASTOPS_CUDA={flag!r}: use 1 (require the CUDA kernels) or 0 (skip them)")
    if flag == "0":
        say("CUDA kernels skipped (FASTOPS_CUDA=0)")
        return None
    required = flag == "1"
    if torch.version.cuda is None:
        if required:
            stop(f"FASTOPS_CUDA=1 but torch {torch.__version__} is not a CUDA build")
        say(f"CUDA kernels skipped: torch {torch.__version__} is not a CUDA build")
        return None
    home = find_toolkit(required)
    if home is None:
        say(f"CUDA kernels skipped: torch is a CUDA {torch.version.cuda} build but no nvcc was found (set CUDA_HOME "
            "or put nvcc on PATH to build them; FASTOPS_CUDA=1 makes this an error)")
        return None
    os.environ["CUDA_HOME"] = home
    extra = header_dirs(home)
    choose_archs(home)
    say(f"building the CUDA kernels for torch's CUDA {torch.version.cuda} (MAX_JOBS={os.environ.get('MAX_JOBS', 'all cores')})")
    return extra


cuda_headers = configure_cuda()
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402  (after CUDA_HOME)

# -fno-math-errno lets std::sqrt vectorize: without it the AdamW loop ran at 0.34x torch's fused=True here,
# with it 0.95x (47.7 GB/s at 32M params, AVX2 build). -ffp-contract=off: the kernels place their FMAs explicitly where torch's
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
if cuda_headers is not None:
    ext_cls = CUDAExtension
    sources += sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    define_macros.append(("WITH_CUDA", None))
    # -idirafter: after the toolkit's -I, so a pip package's copy of cuda_runtime.h never shadows the toolkit's.
    # Only the binding (g++) includes torch's CUDA headers; the .cu files include CUDA headers alone.
    for d in cuda_headers:
        cxx_flags += ["-idirafter", d]
    # No --use_fast_math: its -ftz=true flushes denormal m/v values (torch's fused Adam keeps them), and the
    # kernels are bound by memory, not by the slower IEEE division and square root.
    extra["nvcc"] = ["-O3", "-std=c++17", "-lineinfo"]

setup(
    packages=["fastops", "fastops._specs", "fastops.accelerate", "fastops.compile_check", "fastops.kernels",
              "fastops.optim"],
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
