"""``python -m fastops demo``: it rejects bad arguments before running, and a short run writes its results as the
benchmarks do, with fastops' losses following plain PyTorch's step for step."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fastops.__main__ import main


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
        (["--batch", "two"], "--batch: expected an integer, got 'two'"),
        (["--dim", "30"], "--dim: must be a multiple of 4"),
        (["--device", "cuda"], "--device: 'cuda' needs CUDA, which this torch .* does not have"),
        (["--device", "meta"], "--device: 'meta' is not supported; use 'cpu' or 'cuda'"),
    ],
)
def test_demo_rejects_bad_arguments(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2  # argparse's usage error, before anything runs
    assert re.search(match, capsys.readouterr().err)


def test_a_short_demo_writes_results_and_follows_plain_pytorch(tmp_path):
    # fp32, so the two runs differ only in the optimizer step: fastops' fused AdamW against torch's, at rounding
    # level (tests/test_adam.py), which 6 steps of this model carried into the loss as at most 6.6e-8 relative
    # (Xeon with AVX-512): 1e-5 leaves 150x for other machines, far below what one lost step moves.
    out = tmp_path / "demo"
    argv = ["demo", "--steps", "6", "--batch", "2", "--seq", "16", "--dim", "32", "--layers", "1", "--vocab", "64",
            "--precision", "fp32", "--device", "cpu", "--lr", "1e-2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out.with_suffix(".json")).read_text())
    meta, rows = results["meta"], results["rows"]
    assert [r["provider"] for r in rows] == ["plain PyTorch", "fastops fp32"]
    assert meta["command"].startswith("python -m fastops demo --steps 6 ") and meta["hardware"] and meta["torch"]
    assert len(meta["loadavg_before"]) == 3 and out.with_suffix(".csv").read_text().startswith("bench,provider")
    plain, fast = meta["losses"]["plain PyTorch"], meta["losses"]["fastops fp32"]
    assert len(plain) == len(fast) == 6
    assert plain[0] == fast[0]  # the same initial weights and batch: the first forward is the same computation
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=0)
    assert plain[-1] < plain[0] - 0.1  # it learns, so a missed or doubled step would move the losses
    assert rows[1]["speedup_vs_plain"] == pytest.approx(rows[0]["ms"] / rows[1]["ms"], rel=1e-2)
