"""bf16 and 8-bit Adam states under FSDP2 and under TP at 2 ranks (gloo, CPU), and their DCP checkpoints (FSDP2):
saved at 2 ranks, loaded at 2 ranks and in one process. The ranks run tests/lowp_worker.py."""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

from tests.accelerate_helpers import ROOT, _free_port, _start_group, _wait_group
from tests import lowp_worker as W
from tests.rounding import assert_as_accurate, assert_orders_agree

# Losses of 10 steps against fp32 states (measured: bf16 4e-5, 8-bit 3e-4 relative at lr 1e-2).
LOWP_RTOL = {"bf16": 1e-3, "8bit": 2e-3}
# One re-quantization at the load (8-bit): measured 1.5e-4 relative on the 5 steps after it.
REQUANT_RTOL = 1e-3


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lowp_dist")
    out, ckpt = str(tmp / "out.pt"), str(tmp / "ckpt")
    port = str(_free_port())
    envs = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(2)]  # fmt: skip
    procs = _start_group([[sys.executable, os.path.join(ROOT, "tests", "lowp_worker.py"), out, ckpt]] * 2, envs, tmp)
    _wait_group(procs, timeout=180)
    logs = "\n".join(open(tmp / f"rank{r}.log").read()[-3000:] for r in range(2))
    assert all(p.returncode == 0 for p in procs), logs
    return torch.load(out), ckpt


@pytest.mark.parametrize("run", ["fp32", "tp-fp32"])
def test_fp32_states_match_one_process(two_ranks, run):
    res, _ = two_ranks
    model = W.net()
    losses, norms = W.train(model, W.optimizer(model, "fp32"), range(W.STEPS))
    exact = W.net().double()
    exact_losses, exact_norms = W.train(exact, W.optimizer(exact, "fp32"), range(W.STEPS))  # torch's step, float64
    assert_as_accurate(res[run]["full"], losses, exact_losses, what=f"{run} losses")
    # The clip norm is the global one (over both shards, each TP shard once), not a shard's.
    assert_as_accurate(res[run]["norms"], norms, exact_norms, what=f"{run} clip norms")
    assert norms[0] > W.CLIP  # the clip is active


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_lowp_states_train_under_fsdp2(two_ranks, fmt):
    res, _ = two_ranks
    r, ref = res[fmt], res["fp32"]
    assert all(math.isfinite(x) for x in r["full"])
    assert r["full"] != ref["full"]  # the format was used (8-bit: weights over MIN_8BIT_NUMEL)
    torch.testing.assert_close(r["full"], ref["full"], rtol=LOWP_RTOL[fmt], atol=0)
    torch.testing.assert_close(r["norms"], ref["norms"], rtol=LOWP_RTOL[fmt], atol=0)
    # What DCP saves: bf16 states as bf16 DTensors, 8-bit ones decoded to fp32 DTensors (reshardable).
    want = "torch.bfloat16DTensor" if fmt == "bf16" else "torch.float32DTensor"
    assert set(r["saved_dtypes"].values()) == {want}


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_lowp_states_train_under_tp(two_ranks, fmt):
    """8-bit states on TP shards (torchtitan#742: 8-bit AdamW diverging under TP): each rank quantizes the blocks
    of its own shard (2500 elements, so not the one-process blocks), and the run follows fp32 states as closely
    as under FSDP2."""
    res, _ = two_ranks
    r, ref = res["tp-" + fmt], res["tp-fp32"]
    want = "torch.bfloat16" if fmt == "bf16" else "torch.uint8"
    assert want in r["state_dtypes"]  # the weights' shards hold the format (the biases may stay fp32)
    assert all(math.isfinite(x) for x in r["full"])
    assert r["full"] != ref["full"]
    torch.testing.assert_close(r["full"], ref["full"], rtol=LOWP_RTOL[fmt], atol=0)
    torch.testing.assert_close(r["norms"], ref["norms"], rtol=LOWP_RTOL[fmt], atol=0)


def test_dcp_resume_at_two_ranks(two_ranks):
    res, _ = two_ranks
    assert res["fp32"]["resumed"] == res["fp32"]["full"]
    # bf16: the states and the stochastic-rounding count are restored, so the resumed run is the same bits.
    assert res["bf16"]["resumed"] == res["bf16"]["full"]
    torch.testing.assert_close(res["8bit"]["resumed"], res["8bit"]["full"], rtol=REQUANT_RTOL, atol=0)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
def test_dcp_load_in_one_process(two_ranks, fmt):
    """The 2-rank checkpoint loaded into an unsharded model and a plain optimizer of the same format, which
    continues training where the 2-rank run left off."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    res, ckpt = two_ranks
    model = W.net()
    opt = W.optimizer(model, fmt)
    # The template for DCP has the checkpoint's layout: fp32 states (bf16 for bf16), not the plain 8-bit codes.
    tmpl = W.net()
    msd, _ = get_state_dict(model, opt)
    _, osd = get_state_dict(tmpl, W.optimizer(tmpl, "bf16" if fmt == "bf16" else "fp32"))
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(ckpt, fmt))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    losses, _ = W.train(model, opt, range(W.SAVE_AT, W.STEPS))
    if fmt == "fp32":  # one process continues in another summation order than 2 ranks (tests/rounding.py)
        ref = W.net()
        full32, _ = W.train(ref, W.optimizer(ref, "fp32"), range(W.STEPS))
        exact = W.net().double()
        full64, _ = W.train(exact, W.optimizer(exact, "fp32"), range(W.STEPS))
        assert_orders_agree(losses, res[fmt]["full"][W.SAVE_AT:], full32, full64, what="fp32 states continued")
    else:
        torch.testing.assert_close(losses, res[fmt]["full"][W.SAVE_AT:], rtol=REQUANT_RTOL, atol=0)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_torch_fallback_mid_training_gets_fp32_states(fmt):
    """A lowp group that turns to torch's step (here: its param reassigned to a view with gaps, which the kernels
    do not update in place) hands torch fp32 states, not uint8 codes or bf16 moments; torch.optim.AdamW resumed from
    the same states is the oracle. The next fused step brings the states back to the group's format."""
    import fastops

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 80))  # 5120 elements: over MIN_8BIT_NUMEL, so 8-bit is used
    opt = fastops.optim.AdamW([p], lr=1e-2, state_dtype=fmt)
    for _ in range(3):
        p.grad = torch.randn(64, 80)
        opt.step()
    assert opt.state[p]["exp_avg"].dtype == (torch.uint8 if fmt == "8bit" else torch.bfloat16)
    ref = torch.nn.Parameter(p.detach().clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.to_fp32_state_dict()))  # not sharing the step tensor
    gapped = torch.zeros(64, 160)
    gapped[:, ::2] = p.detach()
    p.data = gapped[:, ::2]
    grad = torch.randn(64, 80)
    p.grad, ref.grad = grad.clone(), grad.clone()
    opt.step()
    ref_opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach(), ref.detach())
    torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[ref]["exp_avg"])
    p.data = p.detach().contiguous()
    p.grad = torch.randn(64, 80)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == (torch.uint8 if fmt == "8bit" else torch.bfloat16)
