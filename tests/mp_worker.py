"""Model-parallel runs for tests/test_model_parallel.py: ``tests/mp_worker.py CASES OUT [CKPT]``, once per rank,
with the environment torchrun would set. CASES is a comma-separated list run in one launch (one process start
per rank for several checks: the imports cost more than the tiny models). Rank 0 saves ``{case: result}`` to OUT.

The models, data and the one-process reference live here so the test and the ranks share them. Global batches
are the same whatever the mesh: each dp rank takes its slice, so the mean of the dp ranks' losses is the one
process loss, and averaged grads are its grads.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fastops
from tests.accelerate_helpers import leave_without_shutdown  # noqa: E402

STEPS, SAVE_AT = 10, 5
LLAMA_CLIP = 0.5  # below the grad norm of every step here: the folded clip is active throughout
NET_CLIP = 0.05
SEQ_CLIP = 0.05
NET_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)  # fmt: skip
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # replicated under the plan: its grad must count once in the norm
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))  # fmt: skip


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "llama":
        ids = torch.randint(0, 64, (4, 8), generator=g)
        return ids, ids
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def loss_of(kind: str, model, x, y):
    if kind == "llama":
        return model(input_ids=x, labels=y).loss
    return F.mse_loss(model(x), y)


def mse(out, y):
    return F.mse_loss(out, y)


def optimizer(kind: str, params):
    import fastops.optim

    clip = {"llama": LLAMA_CLIP, "net": NET_CLIP, "seq": SEQ_CLIP}[kind]
    return fastops.optim.AdamW(params, lr=1e-2, max_grad_norm=clip)


def record_norms(opt, norms: list):
    """Wraps the optimizer's grad statistics (global under a mesh, amp.grad_stats in one process) to record the
    norm the folded clip uses."""
    import fastops.amp

    inner = opt.grad_stats_fn or fastops.amp.grad_stats

    def fn(grads, inv_scale):
        stats = inner(grads, inv_scale)
        norms.append(float(stats[0].sqrt()))
        return stats

    opt.grad_stats_fn = fn


def reference(kind: str, steps: int = STEPS, start=None, dtype=torch.float32):
    """One process, the same model and fused optimizer: (losses, clip norms). ``start``: a state to resume from
    (model, optimizer) loaded by the caller, as a callable taking (model, opt) and returning the first step.
    ``dtype=torch.float64``: the same run in float64, the exact answer of tests/rounding.py (fastops' AdamW runs
    torch's step and clip for float64 params, and reports the norm it clipped with in last_grad_norm)."""
    model = {"llama": llama, "net": Net, "seq": seq}[kind]().to(dtype)
    opt = optimizer(kind, model.parameters())
    first = start(model, opt) if start else 0
    norms, losses = [], []
    if dtype == torch.float32:
        record_norms(opt, norms)
    for step in range(first, steps):
        x, y = batch(kind, step)
        if x.is_floating_point():
            x, y = x.to(dtype), y.to(dtype)
        loss = loss_of(kind, model, x, y)
        loss.backward()
        opt.step()
        if dtype != torch.float32:
            norms.append(float(opt.last_grad_norm))
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


# ---------------------------------------------------------------------------------------------------- ranks


def _dp_slice(t, mesh):
    dp = mesh["dp"]
    n, r = dp.size(), dp.get_local_rank()
    k = t.shape[0] // n
    return t[r * k:(r + 1) * k]


def _mean_over_dp(loss, mesh):
    import torch.distributed as dist

    loss = loss.detach().float().clone()
    if mesh["dp"].size() > 1:
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        loss /= mesh["dp"].size()
    return float(loss)


def train_parallel(kind, strategy, tp, steps=STEPS, bf16=False, ckpt=None, load=None, first=0):
    from fastops.accelerate import _dcp as dcp
    from fastops.accelerate import _parallel as par

    mesh = par.make_mesh(tp_size=tp)
    model = {"llama": llama, "net": Net}[kind]()
    par.parallelize(model, mesh, strategy, tp_plan=NET_PLAN if kind == "net" else None)
    opt = optimizer(kind, model.parameters())
    par.global_grad_stats(opt, mesh)
    norms, losses, out = [], [], {}
    record_norms(opt, norms)
    if load:
        first = int(dcp.load(load, model, opt)["step"])
    for step in range(first, steps):
        x, y = (_dp_slice(t, mesh) for t in batch(kind, step))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(kind, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_dp(loss, mesh))
        if ckpt and step + 1 == SAVE_AT:
            dcp.save(ckpt, model, opt, extra={"step": torch.tensor(step + 1)})
            dcp.save(ckpt + ".pt", model, opt, extra={"step": torch.tensor(step + 1)}, full=True)
    out.update(losses=losses, norms=norms)
    return out


def train_pipeline(schedule, steps=STEPS):
    from fastops.accelerate import _parallel as par

    mesh = par.make_mesh(pp_size=2)
    pipe = par.Pipeline(seq(), mesh, n_microbatches=2, schedule=schedule)
    opt = optimizer("seq", pipe.parameters())
    par.global_grad_stats(opt, mesh)
    norms, losses = [], []
    record_norms(opt, norms)
    try:
        pipe(torch.zeros(1, 4))
        plain_loop_error = None
    except RuntimeError as e:
        plain_loop_error = str(e)
    for step in range(steps):
        x, y = (_dp_slice(t, mesh) for t in batch("seq", step))
        loss = pipe.train_step((x, y), mse)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return dict(losses=losses, norms=norms, plain_loop_error=plain_loop_error)


ACC_N, ACC_GLOBAL_BATCH = 64, 8


def acc_data():
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(ACC_N, 4, generator=g), torch.randn(ACC_N, 1, generator=g))


def acc_reference(kind: str, dtype=torch.float32):
    """One process, plain loop, the same global batches (a DistributedSampler without shuffle deals each dp
    rank every dp-th sample of them). ``dtype``: as in reference()."""
    model = {"net": Net, "seq": seq}[kind]().to(dtype)
    opt = optimizer(kind, model.parameters())
    losses = []
    for x, y in torch.utils.data.DataLoader(acc_data(), batch_size=ACC_GLOBAL_BATCH):
        loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def train_accelerate(strategy: str, ckpt: str | None):
    """The loop through fastops.accelerate: unchanged under tp and fsdp+tp, train_step under pp."""
    import fastops

    kind = "seq" if strategy == "pp" else "net"
    model = {"net": Net, "seq": seq}[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # becomes fastops' fused AdamW in place
    kw = dict(pp_size=2, n_microbatches=2) if strategy == "pp" else dict(tp_size=2)
    if kind == "net":
        kw["tp_plan"] = NET_PLAN
    probe = fastops.Accelerator(strategy=strategy, precision="fp32", **kw)  # only for its mesh's dp size
    dp = probe.dp_size
    loader = torch.utils.data.DataLoader(acc_data(), batch_size=ACC_GLOBAL_BATCH // dp)
    model, opt, loader = fastops.accelerate(model, opt, loader, strategy=strategy, precision="fp32",
                                            grad_clip={"net": NET_CLIP, "seq": SEQ_CLIP}[kind], **kw)  # fmt: skip
    acc = opt.accelerator
    out = {"dp": dp, "losses": []}
    for x, y in loader:
        if strategy == "pp":
            loss = acc.train_step((x, y), mse)
        else:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(_mean_over_dp(loss, acc.mesh))
    if strategy == "pp":
        try:
            model(torch.zeros(2, 4))
        except RuntimeError as e:
            out["plain_loop_error"] = str(e)
    if ckpt:
        path = f"{ckpt}-{strategy}-w{acc.world_size}"
        acc.save(path)
        acc.save(path + ".pt", full=True)
        out["state"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(1000 + acc.rank)  # each rank's own stream, as dropout would leave it
        acc.save(path)
        drawn = torch.rand(3)
        acc.load(path)  # into the same shards: back to the same values, counters kept
        flag = torch.tensor(float(torch.equal(torch.rand(3), drawn)))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        out["step_after_load"], out["rng_resumed"] = acc.step, bool(flag)
    return out


def main() -> None:
    import torch.distributed as dist

    cases, out = sys.argv[1].split(","), sys.argv[2]
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = {}
    for case in cases:
        if case == "tp_llama":
            result[case] = train_parallel("llama", "tp", tp=2)
        elif case == "tp_net":
            result[case] = train_parallel("net", "tp", tp=2)
        elif case == "fsdptp_llama":
            result[case] = train_parallel("llama", "fsdp+tp", tp=2, ckpt=ckpt if world == 4 else None)
        elif case == "fsdptp_net":
            result[case] = train_parallel("net", "fsdp+tp", tp=2)
        elif case == "bf16_llama":
            result[case] = train_parallel("llama", "fsdp+tp", tp=2, steps=3, bf16=True)
        elif case == "load_tp":  # the 4-rank fsdp+tp checkpoint, here under tp 2 (x dp world/2)
            result[case] = train_parallel("llama", "tp", tp=2, load=ckpt)
        elif case.startswith("acc_"):
            result[case] = train_accelerate(case[4:].replace("fsdptp", "fsdp+tp"), ckpt)
        elif case in ("pp_gpipe", "pp_1f1b"):
            result[case] = train_pipeline(case[3:])
        else:
            raise ValueError(case)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.destroy_process_group()
    leave_without_shutdown()


if __name__ == "__main__":
    main()
