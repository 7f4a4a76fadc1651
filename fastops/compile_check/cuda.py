"""The CUDA resource rules (blocks an SM holds at a kernel's registers and shared memory) and the cuobjdump parser:
what ``python -m fastops compile-check`` reads from every cubin, Triton's and the built ``fastops._C``'s."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess

ARCHS = (80, 90, 100)


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    regs: int = 65536  # 32-bit registers per SM
    warps: int = 64
    blocks: int = 32
    smem: int = 228 * 1024  # shared memory per SM, of which 1 KiB per block is reserved


# A100 (sm_80) has 164 KiB of shared memory per SM; H100/H200 (sm_90) and B200 (sm_100) 228 KiB.
LIMITS = {80: ArchLimits(smem=164 * 1024), 90: ArchLimits(), 100: ArchLimits()}


def resident_blocks(arch: int, threads: int, regs: int, smem: int) -> int:
    """Blocks of ``threads`` threads one SM holds at ``regs`` registers a thread and ``smem`` bytes of shared
    memory a block (the CUDA occupancy calculator's rules: registers are allocated per warp, in units of 256)."""
    lim = LIMITS[arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (lim.regs // regs_per_warp) // warps
    by_smem = lim.smem // (smem + 1024)
    return min(lim.blocks, lim.warps // warps, by_regs, by_smem)


# --- CUDA C++ kernels ------------------------------------------------------------------------------------------

# Kernel name (as in csrc/cuda/*.cu) -> (threads a block, blocks an SM the launch assumes resident, or None where
# the launcher sizes its grid with cudaOccupancyMaxActiveBlocksPerMultiprocessor: then only spills are checked).
# The binding sizes every grid-stride grid as multiProcessorCount * (2048 / kThreads) blocks of kThreads = 512
# threads (binding.cpp's launch_context, kernels.cuh): four resident blocks an SM, or the grid runs in waves.
# grad_stats_reduce is one block.
CUDA_LAUNCHES = {
    "adam_kernel": (512, None),
    "adam_lowp_kernel": (512, None),
    "sgd_kernel": (512, None),
    "unscale_check_kernel": (512, 4),
    "grad_stats_partials_kernel": (512, 4),
    "grad_stats_reduce_kernel": (512, 1),
    # linear_cross_entropy's row pass (linear_ce.cu): one block of 256 threads a row of logits, thousands of rows a
    # launch; 4 resident blocks an SM (32 of 64 warps) keep the loads in flight at <= 64 registers.
    "ce_rows_kernel": (256, 4),
    # dropout.cu: a grid-stride element loop sized like the others.
    "dropout_kernel": (512, 4),
}


@dataclasses.dataclass
class Result:
    kernel: str
    spec: str
    arch: int
    regs: int = 0
    local: int = 0
    smem: int = 0
    warps_per_sm: int = 0
    converts: int = 0
    error: str = ""

    def line(self) -> str:
        head = f"{self.kernel:28s} {self.spec:60s} sm_{self.arch:<4d}"
        if self.error and not self.regs:
            return f"{head} ERROR {self.error}"
        text = (f"{head} regs {self.regs:3d}  local {self.local:4d} B  smem {self.smem:6d} B  "
                f"converts {self.converts:2d}  warps/SM {self.warps_per_sm:2d}")
        return f"{text}  ERROR {self.error}" if self.error else text


def cuobjdump() -> str:
    """The cuobjdump to use: $CUOBJDUMP, the one Triton ships (the version its ptxas matches, which knows every
    arch it compiles for), one on PATH, or the toolkit's."""
    candidates = [os.environ.get("CUOBJDUMP")]
    with contextlib.suppress(Exception):
        import triton

        candidates.append(triton.knobs.nvidia.cuobjdump.path)
    candidates += [shutil.which("cuobjdump"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    raise RuntimeError("compile-check: no cuobjdump (set CUOBJDUMP, install triton or nvidia-cuda-cuobjdump)")


def resource_usage(path: str, arch: int | None = None) -> list[tuple[int, str, dict[str, int]]]:
    """(arch, function, {REG, STACK, SHARED, LOCAL, ...}) for each function in a cubin (of ``arch``) or in every
    ELF of a fatbinary-holding file (a .so built by nvcc names each ELF's arch)."""
    out = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True)
    if out.returncode != 0:
        if "does not contain device code" in out.stderr:
            return []
        raise RuntimeError(f"cuobjdump {path}: {out.stderr.strip()}")
    return parse_resource_usage(out.stdout, arch)


def local_accesses(path: str) -> int:
    """The local-memory loads and stores (STL/LDL: spills, local arrays) in a cubin's SASS."""
    return count_local_accesses(subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True,
                                               check=True).stdout)


def count_local_accesses(sass: str) -> int:
    return len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass))


def parse_resource_usage(text: str, arch: int | None = None) -> list[tuple[int, str, dict[str, int]]]:
    found = []
    function = None
    for line in text.splitlines():
        if m := re.match(r"\s*arch = sm_(\d+)", line):
            arch = int(m.group(1))
        elif m := re.match(r"\s*Function (\S+):\s*$", line):
            function = m.group(1)
        elif function and "REG:" in line:
            fields = {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", line)}
            found.append((arch, function, fields))
            function = None
    return found


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else names


def check_cuda_kernels(ext_path: str) -> list[Result]:
    usage = resource_usage(ext_path)
    results = []
    for (arch, _, f), name in zip(usage, demangle([u[1] for u in usage])):
        # "void fastops::cuda::(anonymous namespace)::adam_kernel<float, false, true>(fastops::cuda::AdamArgs)"
        name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
        kernel = re.split(r"[<(]", name, maxsplit=1)[0].split("::")[-1]
        template = re.search(r"<(.*)>\s*\(", name)
        spec = template.group(1).replace(" ", "") if template else "-"
        r = Result(kernel, spec, arch, f["REG"], f["LOCAL"] + f["STACK"], f["SHARED"])
        launch = CUDA_LAUNCHES.get(kernel)
        if arch not in LIMITS:
            r.error = f"no limits for sm_{arch} in compile_check.LIMITS"
        elif launch is None:
            r.error = f"no launch config for {kernel} in compile_check.CUDA_LAUNCHES"
        else:
            threads, want = launch
            got = resident_blocks(arch, threads, r.regs, r.smem)
            r.warps_per_sm = got * threads // 32
            if want is not None and got < want:
                r.error = (f"{got} resident block(s) of {threads} threads per SM at {r.regs} registers, "
                           f"the launch assumes {want} (at most {65536 // (threads * want)} registers)")
        if r.local:
            r.error = (r.error + "; " if r.error else "") + f"{r.local} bytes of local memory (spills)"
        results.append(r)
    return results


def cuda_extension() -> str | None:
    spec = importlib.util.find_spec("fastops._C")
    return spec.origin if spec is not None else None
