"""csrc/cuda/qmaps.cuh holds the 8-bit maps and encoder constants of fastops/_quant.py as hex float literals; this
regenerates it and fails when the two drift apart (no GPU needed)."""

from __future__ import annotations

import os

from fastops import _quant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "cuda", "qmaps.cuh")


def _lit(v: float) -> str:
    return f"{float(v).hex()}f" if v != 0 else "0.0f"


def qmaps_header() -> str:
    out = ["// Generated from fastops/_quant.py by tests/test_qmaps_header.py::qmaps_header (test_qmaps_header_matches_quant",
           "// fails when they drift apart): the 8-bit maps' values and the encoder's fp32 constants, bit for bit (hex",
           "// float literals).", "#pragma once", "", "namespace fastops {", "namespace cuda {", ""]
    for signed, tag in ((True, "kSigned"), (False, "kUnsigned")):
        c = _quant.constants(signed)
        q = c["qmap"]
        body = ",\n    ".join(", ".join(_lit(v) for v in q[i:i + 6]) for i in range(0, len(q), 6))
        out.append(f"__device__ __constant__ float {tag}Qmap[256] = {{\n    {body}}};\n")
        for name, n in (("T", 8), ("P", 7), ("F", 7)):
            out.append(f"__device__ __constant__ float {tag}{name}[{n}] = {{{', '.join(_lit(v) for v in c[name])}}};")
        out.append("")
    out += ["}  // namespace cuda", "}  // namespace fastops", ""]
    return "\n".join(out)


def test_qmaps_header_matches_quant():
    with open(HEADER) as f:
        assert f.read() == qmaps_header(), "regenerate csrc/cuda/qmaps.cuh from tests/test_qmaps_header.py::qmaps_header"


def test_hex_literals_are_the_fp32_values():
    import torch

    for v in _quant.QMAP_SIGNED.tolist() + _quant.constants(False)["F"]:
        assert torch.tensor(float.fromhex(_lit(v)[:-1]), dtype=torch.float32).item() == v
