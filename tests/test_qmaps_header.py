"""csrc/cuda/qmaps.cuh holds the 8-bit maps and encoder constants of fastops/_quant.py as hex float literals,
written by fastops._quant.qmaps_header(); this fails when the file and the module drift apart (no GPU needed).
Regenerate with: python -c "import fastops._quant as q; open('csrc/cuda/qmaps.cuh', 'w').write(q.qmaps_header())"."""

from __future__ import annotations

import os

import torch

from fastops import _quant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "cuda", "qmaps.cuh")


def test_qmaps_header_matches_quant():
    with open(HEADER) as f:
        assert f.read() == _quant.qmaps_header(), "regenerate csrc/cuda/qmaps.cuh (see this file's docstring)"


def test_hex_literals_are_the_fp32_values():
    for v in _quant.QMAP_SIGNED.tolist() + _quant.constants(False)["F"]:
        assert torch.tensor(float.fromhex(_quant._hex_literal(v)[:-1]), dtype=torch.float32).item() == v
