"""Tensor, 2-D FSDP2 x TP and pipeline parallelism (accelerate/_parallel.py) and resharding checkpoints (_dcp.py),
on gloo/CPU at 4 and 2 ranks against one process (tests/mp_worker.py holds the models and the reference).

Each launch runs several cases in one process start per rank under a timeout that kills the ranks and fails:
pipelining over gloo can hang (pytorch#132644)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from fastops.accelerate import _dcp as dcp
from fastops.accelerate import _parallel as par
from tests import mp_worker as w
from tests.rounding import assert_as_accurate, assert_orders_agree
from tests.test_accelerate import ROOT, _free_port, _start_group, _wait_group

ACC = ["acc_tp", "acc_fsdptp", "acc_pp"]  # through fastops.accelerate
CASES_4 = ["fsdptp_llama", "tp_llama", "tp_net", "fsdptp_net", "bf16_llama", "pp_gpipe", "pp_1f1b", *ACC]
CASES_2 = ["load_tp", "tp_llama", "tp_net", "fsdptp_net", "pp_gpipe", "pp_1f1b", *ACC]
KIND = {"llama": "llama", "net": "net", "gpipe": "seq", "1f1b": "seq"}


def _launch(world: int, cases: list[str], out, ckpt, log_dir, timeout: float = 240) -> dict:
    port = str(_free_port())
    envs = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1") for r in range(world)]  # fmt: skip
    cmd = [sys.executable, os.path.join(ROOT, "tests", "mp_worker.py"), ",".join(cases), str(out), str(ckpt)]
    procs = _start_group([cmd] * world, envs, log_dir)
    logs = lambda: "".join((log_dir / f"rank{r}.log").read_text()[-3000:] for r in range(world))  # noqa: E731
    try:
        _wait_group(procs, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{world} ranks running {cases} hung; killed:\n" + logs())
    assert [p.returncode for p in procs] == [0] * world, logs()
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d4, d2 = tmp_path_factory.mktemp("ranks4"), tmp_path_factory.mktemp("ranks2")
    ckpt = d4 / "ckpt"
    r4 = _launch(4, CASES_4, d4 / "out.pt", ckpt, d4)
    r2 = _launch(2, CASES_2, d2 / "out.pt", ckpt, d2)  # loads the 4-rank checkpoint under tp 2
    return {4: r4, 2: r2, "ckpt": str(ckpt)}


@pytest.fixture(scope="module")
def refs():
    """kind -> (fp32 losses, fp32 clip norms, float64 losses, float64 clip norms), one process."""
    return {kind: (*w.reference(kind), *w.reference(kind, dtype=torch.float64)) for kind in ("llama", "net", "seq")}


def _assert_matches_one_process(got, ref, what):
    """The ranks sum the same terms as one process in another order (sharded matmuls, all-reduces): their losses and
    clip norms must be as close to the float64 run as one process's are (tests/rounding.py)."""
    losses32, norms32, losses64, norms64 = ref
    assert len(got["losses"]) == len(losses64)
    assert_as_accurate(got["losses"], losses32, losses64, what=f"{what} losses")
    # The global norm the folded clip used: replicated params (norms, under TP; every param over dp) count once.
    assert_as_accurate(got["norms"], norms32, norms64, what=f"{what} clip norms")


@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("case", ["tp_llama", "tp_net", "fsdptp_net", "pp_gpipe", "pp_1f1b"])
def test_fp32_losses_and_clip_norm_match_one_process(runs, refs, world, case):
    assert len(runs[world][case]["losses"]) == w.STEPS
    _assert_matches_one_process(runs[world][case], refs[KIND[case.split("_")[1]]], f"{case} at {world} ranks")


def test_fsdp_tp_llama_at_4_ranks_matches_one_process(runs, refs):
    _assert_matches_one_process(runs[4]["fsdptp_llama"], refs["llama"], "fsdptp_llama at 4 ranks")


def test_bf16_autocast_under_fsdp_tp_trains(runs, refs):
    got = runs[4]["bf16_llama"]["losses"]
    assert all(torch.isfinite(torch.tensor(got)))
    torch.testing.assert_close(got, refs["llama"][0][: len(got)], rtol=2e-2, atol=0)  # bf16's 8-bit mantissa


def test_pipeline_refuses_the_plain_loop(runs):
    for world in (4, 2):
        for case in ("pp_gpipe", "pp_1f1b"):
            assert "train_step((x, y), loss_fn)" in runs[world][case]["plain_loop_error"]


def test_checkpoint_saved_at_4_ranks_continues_at_2_ranks_and_in_one_process(runs, refs):
    saved_run = runs[4]["fsdptp_llama"]["losses"][w.SAVE_AT:]
    losses32, _, losses64, _ = refs["llama"]
    assert_orders_agree(runs[2]["load_tp"]["losses"], saved_run, losses32, losses64, what="tp at 2 ranks, continued")
    loaded = {}

    def start(model, opt):
        step = int(dcp.load(runs["ckpt"], model, opt)["step"])
        loaded["model"] = {k: v.clone() for k, v in model.state_dict().items()}
        return step

    losses, _ = w.reference("llama", start=start)
    assert_orders_agree(losses, saved_run, losses32, losses64, what="one process, continued")
    full = torch.load(runs["ckpt"] + ".pt")  # the consolidated export, read by plain torch
    assert int(full["extra"]["step"]) == w.SAVE_AT
    assert full["model"].keys() == loaded["model"].keys()
    for k, v in full["model"].items():
        assert torch.equal(v, loaded["model"][k]), k  # the sharded load reassembles exactly what was saved
    steps = [v for k, v in full["optim"].items() if k.endswith(".step")]
    assert len(steps) == len(full["model"]) and all(int(s) == w.SAVE_AT for s in steps)


@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("case", ACC)
def test_one_line_accelerate_matches_one_process_and_checkpoints(runs, world, case, tmp_path):
    strategy = case[4:].replace("fsdptp", "fsdp+tp")
    kind = "seq" if strategy == "pp" else "net"
    got = runs[world][case]
    assert got["dp"] == world // 2
    assert_as_accurate(got["losses"], w.acc_reference(kind), w.acc_reference(kind, torch.float64), what=case)
    assert got["step_after_load"] == len(got["losses"])
    assert got["rng_resumed"]  # every rank got its own RNG state back
    if strategy == "pp":
        assert "acc.train_step((x, y), loss_fn)" in got["plain_loop_error"]
    path = f"{runs['ckpt']}-{strategy}-w{world}"
    full = torch.load(path + ".pt")  # consolidated: the whole model, every stage's parameters included
    model = {"net": w.Net, "seq": w.seq}[kind]()
    model.load_state_dict(full["model"])
    for k, v in got["state"].items():  # rank 0's part of the model as training left it
        assert torch.equal(full["model"][k], v), k
    # The sharded directory loads into one process through the Accelerator, counters included.
    import fastops

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fastops.Accelerator(strategy="none", precision="fp32").prepare(model, opt)
    with pytest.warns(UserWarning, match=rf"RNG states of {world} rank\(s\), this run has 1") as warned:
        opt.accelerator.load(path)
    assert warned[0].filename == __file__  # points at the caller's load
    assert opt.accelerator.step == len(got["losses"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, full["model"][k]), k


def _net_and_opt():
    model = w.Net()
    return model, w.optimizer("net", model.parameters())


def _train_one(model, opt):
    x, y = w.batch("net", 0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    model, opt = _net_and_opt()
    _train_one(model, opt)
    dcp.save(path, model, opt, extra={"step": torch.tensor(1)}, meta={"schedulers": [{"last_epoch": 1}]})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train_one(model, opt)

    def killed(*args, **kwargs):
        os.makedirs(kwargs["checkpoint_id"], exist_ok=True)  # part of the shards written, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        dcp.save(path, model, opt, extra={"step": torch.tensor(2)}, meta={"schedulers": [{"last_epoch": 2}]})
    monkeypatch.undo()
    assert dcp.read_meta(path) == {"schedulers": [{"last_epoch": 1}]}  # written with the shards it goes with
    fresh, fresh_opt = _net_and_opt()
    assert int(dcp.load(path, fresh, fresh_opt)["step"]) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    os.rename(path, path + ".old")  # killed between the two renames of a later save
    assert int(dcp.load(path, *_net_and_opt())["step"]) == 1
    assert dcp.read_meta(path) == {"schedulers": [{"last_epoch": 1}]}


def test_model_without_a_plan_says_what_to_pass():
    with pytest.raises(ValueError, match="pass tp_plan="):
        par.resolve_tp_plan(w.Net())
    with pytest.raises(ValueError, match="matches no module"):
        par.resolve_tp_plan(w.Net(), {"blocks.*.fc3": "colwise"})
    with pytest.raises(ValueError, match="expected a torch ParallelStyle"):
        par.resolve_tp_plan(w.Net(), {"blocks.*.fc1": "columnwise"})


def test_hf_plan_is_the_models_own():
    plan = par.resolve_tp_plan(w.llama())
    assert "model.layers.*.self_attn.q_proj" in plan and "lm_head" in plan
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], par.RowwiseParallel)


def test_split_stages():
    stages = par.split_stages(w.seq(), 2)
    assert [list(dict(s.named_children())) for s in stages] == [["0", "1", "2", "3"], ["4", "5", "6"]]
    assert [len(s) for s in par.split_stages(w.seq(), 2, split=[2])] == [2, 5]
    with pytest.raises(ValueError, match="cannot split a Net automatically"):
        par.split_stages(w.Net(), 2)
    with pytest.raises(ValueError, match="non-empty stages"):
        par.split_stages(w.seq(), 2, split=[0])
