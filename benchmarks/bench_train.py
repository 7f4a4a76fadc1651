"""End-to-end training step time of real models, taken from their own libraries (``train_cases.py``):
torchvision's ``resnet50`` and ``maskrcnn_resnet50_fpn``, HF transformers' ``BertForMaskedLM`` and
``LlamaForCausalLM``; small sizes on the CPU, larger configs with ``--device cuda``. Trained by

- torch fp32: the plain loop with torch's default optimizer for the model: SGD with momentum 0.9 and weight
  decay 1e-4 for the vision models (torchvision's reference recipe, learning rate scaled to the batch as
  there), AdamW for BERT; torch picks its default implementation (the for-loop on the CPU, foreach on CUDA);
- torch AMP recipe: the same loop written as torch documents it: bf16 autocast and the optimizer with
  ``fused=True``;
- HF Accelerate bf16: ``Accelerator(mixed_precision="bf16", cpu=<device is the CPU>)``,
  ``accelerator.prepare(model, optimizer, loader)`` and ``accelerator.backward(loss)``, as HF documents a plain
  loop; the user's optimizer is kept as it is;
- torch.compile recipe: the AMP recipe with ``torch.compile(model)``, the strongest peer a user has;
- fastops compile=True, fastops fused_loss: ``fastops.accelerate`` with regional compilation, and with the fused
  linear-cross-entropy loss on top for the language models;
- fastops.accelerate: the one line (precision "auto": bf16 where the device has it natively), the loop unchanged.

Fair by construction: every provider gets the same initial weights (seeded), the same batches through a
DataLoader over one list (the prepared ones move them to the device, the plain loops call ``.to(device)``),
the same dropout masks and Mask R-CNN proposal samples (the global RNG is seeded before each step, outside the
timed region, by common.time_samples' reset), the same optimizer hyperparameters and the same loop
(``_steps``). Each provider runs in its own process (fastops.accelerate keeps freed memory in the process on
the CPU, a process-wide setting that must not reach the others), ``--blocks`` times with the providers taking
turns, so load from other processes hits them alike; medians with 20/80% quantiles over the timed steps of
all runs. Loss curves are compared at the end (see loss_check); a mismatch gives exit status 1.

    python benchmarks/bench_train.py                        # every model on the CPU
    python benchmarks/bench_train.py --quick                # smoke run (841 s with --rounds 2 at a load of 4-8 on 2 cores)
    python benchmarks/bench_train.py --quick --device cuda  # full configs on a GPU
    python benchmarks/bench_train.py --models bert --rounds 6 --profile 2 --out scratch_train
        # short run of one model, then a torch.profiler table per provider (2 steps each)

Results: benchmarks/results/train_{cpu,cuda}.{json,csv,png} (``--out`` names another file or a path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fastops.accelerate import accelerate  # noqa: E402

# The seed's claims against plain fp32 (README), and the targets on the CPU: fastops beats each claim and is
# at least HF_TARGET x HF Accelerate bf16.
CLAIMS = {"resnet": 1.30, "maskrcnn": 1.40, "bert": 1.20, "llama": 1.20}
HF_TARGET = 1.1
# Loss checks over the last LOSS_TAIL steps (mean of |loss - loss_ref| / loss_ref at the same steps); the
# measurements behind the tolerances are in loss_check's docstring.
LOSS_TAIL = 5
FP32, AMP_REF, HF, FASTOPS = "torch fp32", "torch AMP recipe", "HF Accelerate bf16", "fastops.accelerate"
COMPILE, FASTOPS_COMPILE, FASTOPS_FUSED = "torch.compile recipe", "fastops compile=True", "fastops fused_loss"
SAME_RECIPE_RTOL = 2e-3  # a bf16 provider against torch's own bf16 autocast recipe
BF16_VS_FP32_RTOL = 5e-2  # torch's bf16 recipe against fp32

from train_cases import CASES  # noqa: E402



# ---- data ------------------------------------------------------------------------------------------------


def _loader(batches: list) -> DataLoader:
    # The list is the map-style dataset; batch_size=None: its items are whole batches. Its own generator: a
    # DataLoader without one draws its base seed from the global RNG when iterated, and the dropout masks would
    # then differ by provider.
    return DataLoader(batches, batch_size=None, generator=torch.Generator().manual_seed(0))


# ---- providers: each returns an iterator whose next() runs one training step and gives the loss ------------


def _steps(model, opt, loader, loss_fn, device, amp_dtype=None, backward=None):
    dev = torch.device(device)
    model.train()
    while True:
        for batch in loader:
            # a no-op where the loader already moved the batch
            batch = tree_map(lambda t: t.to(dev, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)
            amp = torch.autocast(dev.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
            with record_function("## forward + loss"), amp:
                loss = loss_fn(model, batch)
            with record_function("## backward"):
                (backward or torch.Tensor.backward)(loss)
            with record_function("## optimizer.step"):
                opt.step()
            with record_function("## zero_grad"):
                opt.zero_grad()
            yield loss.detach()


def torch_fp32(case, model, loader, device):
    model.to(device)
    return _steps(model, case["opt"](model.parameters()), loader, case["loss"], device)


def torch_amp(case, model, loader, device):
    model.to(device)
    opt = case["opt"](model.parameters(), fused=True)
    return _steps(model, opt, loader, case["loss"], device, amp_dtype=torch.bfloat16)


def hf_accelerate_bf16(case, model, loader, device):
    from accelerate import Accelerator

    # cpu=True keeps it on the CPU even where CUDA is visible. One provider per process, so one Accelerator.
    acc = Accelerator(mixed_precision="bf16", cpu=torch.device(device).type == "cpu")
    model, opt, loader = acc.prepare(model, case["opt"](model.parameters()), loader)
    return _steps(model, opt, loader, case["loss"], device, backward=acc.backward)


def torch_compile_recipe(case, model, loader, device):
    """The strongest peer a user has: torch.compile of the whole model, bf16 autocast, torch's fused AdamW/SGD."""
    model.to(device)
    opt = case["opt"](model.parameters(), fused=True)
    return _steps(torch.compile(model), opt, loader, case["loss"], device, amp_dtype=torch.bfloat16)


def _fastops(**options):
    def provider(case, model, loader, device):
        extra = {k: v for k, v in options.items() if k != "fused_loss" or case.get("lm")}
        model, opt, loader = accelerate(model, case["opt"](model.parameters()), loader, device=device, **extra)
        # precision="auto" picks fp32 on a CPU without native bf16; the loss check then compares it with fp32.
        provider.precision = opt.accelerator.precision
        provider.optimizer = f"{type(opt).__module__}.{type(opt).__name__}"
        return _steps(model, opt, loader, case["loss"], device)

    return provider


PROVIDERS = {FP32: torch_fp32, AMP_REF: torch_amp, HF: hf_accelerate_bf16, COMPILE: torch_compile_recipe,
             FASTOPS: _fastops(), FASTOPS_COMPILE: _fastops(compile=True),
             FASTOPS_FUSED: _fastops(fused_loss=True, compile=True)}


def _start(case: dict, label: str, steps: int, device: str):
    torch.manual_seed(0)  # same weights for every provider
    batches = case["batches"](steps, torch.Generator().manual_seed(1))
    return PROVIDERS[label](case, case["make"](), _loader(batches), device)


def run_provider(case: dict, label: str, steps: int, device: str) -> dict:
    """``steps`` training steps of one provider from the shared initial weights: per-step ms and losses."""
    it = _start(case, label, steps, device)
    losses: list[float] = []

    def reseed() -> None:  # same dropout masks and proposal samples for every provider (CUDA's generators too)
        torch.manual_seed(1000 + len(losses))

    # The step is done (and synced) once its loss is on the host.
    times = common.time_samples(lambda: losses.append(next(it).item()), device, steps, warmup=0, reset=reseed)
    it.close()
    make = PROVIDERS[label]
    if torch.device(device).type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:  # the process's peak resident set: each provider runs in a process of its own
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"times": times, "losses": losses, "peak_mem_mib": round(peak, 1), "precision": getattr(make, "precision", "fp32" if label == FP32 else "bf16"),
            "optimizer": getattr(make, "optimizer", None)}  # fmt: skip


def _in_process(model_key: str, label: str, steps: int, device: str) -> dict:
    """run_provider in a fresh interpreter (``--worker``): fastops.accelerate changes process-wide state on
    the CPU (it keeps freed memory in the process), which must not reach the providers measured against it."""
    return common.in_fresh_process(__file__, ["--worker", model_key, label, str(steps), "--device", device])


def run_case(model_key: str, labels: list[str], rounds: int, warmup: int, blocks: int, device: str):
    """Each provider runs in its own process, ``blocks`` times in turn (providers alternate, so load from other
    processes on a shared machine hits them alike); the first ``warmup`` steps of each run are not timed."""
    case = CASES[model_key](torch.device(device).type == "cuda")
    losses: dict[str, list[float]] = {}
    info: dict[str, dict] = {}
    rerun_diff = {label: 0.0 for label in labels}
    first_ms: dict[str, float] = {}
    peak_mib: dict[str, float] = {}

    def run(label: str) -> list[float]:
        out = _in_process(model_key, label, rounds + warmup, device)
        # Same weights, batches, dropout masks and samples in every run; oneDNN's convolutions still differ in
        # the last bits from run to run, so the runs' agreement is reported, not required.
        if label in losses:
            diff = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], losses[label]))
            rerun_diff[label] = max(rerun_diff[label], diff)
        else:
            losses[label], info[label] = out["losses"], out
        first_ms.setdefault(label, out["times"][0])  # with compile providers: the compile time
        peak_mib[label] = max(peak_mib.get(label, 0.0), out["peak_mem_mib"])
        return out["times"][warmup:]

    samples = common.interleaved({label: (lambda label=label: run(label)) for label in labels}, blocks)
    check = loss_check(losses, {k: v["precision"] for k, v in info.items()})
    rows = [common.row(
        "train", label, case["name"], xs, device, size_unit="config", model=model_key,
        precision=info[label]["precision"], optimizer=info[label]["optimizer"], seed_claim_vs_fp32=CLAIMS[model_key],
        first_loss=round(losses[label][0], 5), tail_loss=round(check[label]["tail_loss"], 5),
        tail_rel_diff_vs_fp32=float(f"{check[label]['rel_diff_fp32']:.3g}"),
        tail_rel_diff_vs_amp=float(f"{check[label].get('rel_diff_amp', float('nan')):.3g}"),
        loss_check="; ".join(check[label]["fail"]) or "ok", rerun_loss_rel_diff=float(f"{rerun_diff[label]:.3g}"),
        first_step_ms=round(first_ms[label], 1), peak_mem_mib=peak_mib[label],
    ) for label, xs in samples.items()]  # fmt: skip
    common.speedup_vs(rows, FP32, "speedup_vs_fp32")
    common.speedup_vs(rows, HF, "vs_hf_accelerate")
    if COMPILE in samples:
        common.speedup_vs(rows, COMPILE, "vs_torch_compile")
    return rows, losses


def loss_check(losses: dict[str, list[float]], precision: dict[str, str]) -> dict[str, dict]:
    """Per provider, the mean of its last LOSS_TAIL losses, and their mean relative difference from torch
    fp32's and from torch's bf16 AMP recipe's (AMP_REF) at the same steps: same batches, dropout masks and
    proposal samples. Failures are listed under "fail". A provider that ran in fp32 (``precision``) is held to
    torch fp32 with SAME_RECIPE_RTOL.

    - bf16 providers against AMP_REF, SAME_RECIPE_RTOL: they run the same autocast forward, and only the
      optimizers' fp32 rounding differs (for-loop, fused, fastops), which bf16 weights can round differently.
    - AMP_REF against fp32, BF16_VS_FP32_RTOL = 5e-2: bf16 keeps 8 significant bits (ResNet-50's first step,
      with identical weights, already differs by about 1e-2)."""
    k = min(LOSS_TAIL, len(losses[FP32]))
    out = {}
    for label, ls in losses.items():
        row = {"tail_loss": statistics.fmean(ls[-k:]), "fail": []}
        for ref, key in ((FP32, "rel_diff_fp32"), (AMP_REF, "rel_diff_amp")):
            if ref in losses:
                row[key] = statistics.fmean(abs(a - b) / abs(b) for a, b in zip(ls[-k:], losses[ref][-k:]))
        if label == AMP_REF and row["rel_diff_fp32"] > BF16_VS_FP32_RTOL:
            row["fail"].append(f"{row['rel_diff_fp32']:.2e} from {FP32} (tolerance {BF16_VS_FP32_RTOL:g})")
        same = FP32 if precision[label] == "fp32" else AMP_REF
        key = "rel_diff_fp32" if same == FP32 else "rel_diff_amp"
        if label not in (FP32, AMP_REF) and key in row and row[key] > SAME_RECIPE_RTOL:
            row["fail"].append(f"{row[key]:.2e} from {same} (tolerance {SAME_RECIPE_RTOL:g})")
        out[label] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="few steps, one run per provider (gpu_check.sh)")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per provider and run (default 6, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    p.add_argument("--blocks", type=int, default=None, help="runs per provider, taking turns (default 2, quick 1)")
    p.add_argument("--models", nargs="*", choices=list(CASES), default=list(CASES))
    p.add_argument("--providers", nargs="*", choices=list(PROVIDERS), default=list(PROVIDERS),
                   help=f"default all; {FP32!r} is always run (the baseline)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="afterwards, profile STEPS steps of each provider per model (torch.profiler, one process)")
    p.add_argument("--out", default=None,
                   help="result name under benchmarks/results, or a path (default train_<device>)")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "PROVIDER", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print(f"bench_train: --device {device} but CUDA is not available")
        return 2
    if args.worker:
        model_key, label, steps = args.worker
        common.reply(run_provider(CASES[model_key](cuda), label, int(steps), device))
        return 0
    rounds = args.rounds or (3 if args.quick else 6)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    blocks = args.blocks or (1 if args.quick else 2)
    labels = [FP32] + [x for x in args.providers if x != FP32]
    rows, all_losses, summary = [], {}, {}
    start = time.perf_counter()
    for key in args.models:
        name = CASES[key](cuda)["name"]
        print(f"{name} on {common.hardware(device)}: {blocks} x {rounds} timed steps per provider after {warmup} "
              "warm-up, one process per run", flush=True)  # fmt: skip
        case_rows, losses = run_case(key, labels, rounds, warmup, blocks, device)
        all_losses[name] = losses
        for r in case_rows:
            vs_hf = f"{r['vs_hf_accelerate']:5.2f}x HF" if "vs_hf_accelerate" in r else ""
            vs_hf += f" {r['vs_torch_compile']:5.2f}x compile" if "vs_torch_compile" in r else ""
            print(f"  {r['provider']:20s} {r['ms']:8.1f} ms [{r['ms_q20']:.1f}, {r['ms_q80']:.1f}]  "
                  f"{r['speedup_vs_fp32']:5.2f}x fp32 {vs_hf}  first step {r['first_step_ms']:.0f} ms, peak {r['peak_mem_mib']:.0f} MiB  loss {r['first_loss']:.4f} -> {r['tail_loss']:.4f} "
                  f"(last {LOSS_TAIL}: {r['tail_rel_diff_vs_fp32']:.1e} from fp32, "
                  f"{r['tail_rel_diff_vs_amp']:.1e} from the AMP recipe)  {r['optimizer'] or ''}".replace("nan from", "- from"), flush=True)  # fmt: skip
        fo = next((r for r in case_rows if r["provider"] == FASTOPS), None)
        if fo:
            claim, hf = CLAIMS[key], fo.get("vs_hf_accelerate")
            summary[key] = {"fastops_vs_fp32": fo["speedup_vs_fp32"], "seed_claim": claim,
                            "beats_claim": fo["speedup_vs_fp32"] > claim, "fastops_vs_hf": hf,
                            "meets_hf_target": hf is not None and hf >= HF_TARGET}  # fmt: skip
            print(f"  fastops.accelerate: {fo['speedup_vs_fp32']:.2f}x fp32 (the seed claims {claim:.2f}x) and "
                  + (f"{hf:.2f}x HF Accelerate bf16 (target {HF_TARGET}x)" if hf else "no HF Accelerate run"))
        rows += case_rows
    bad = [r for r in rows if r["loss_check"] != "ok"]
    for r in bad:
        print(f"LOSS MISMATCH: {r['size']} {r['provider']}: last {LOSS_TAIL} losses {r['loss_check']}")
    load = os.getloadavg()
    meta = {"device": device, "hardware": common.hardware(device), "torch": torch.__version__, "rounds": rounds,
            "warmup": warmup, "blocks": blocks, "threads": torch.get_num_threads(), "loss_tail": LOSS_TAIL,
            "same_recipe_rtol": SAME_RECIPE_RTOL, "bf16_vs_fp32_rtol": BF16_VS_FP32_RTOL, "claims": CLAIMS,
            "hf_target": HF_TARGET, "summary": summary, "losses": all_losses, "loadavg_at_end": load,
            "seconds": round(time.perf_counter() - start), "argv": sys.argv[1:],
            "note": "one process per provider and run, runs taking turns; the CPU may be shared with other "
                    "processes (see loadavg_at_end)"}  # fmt: skip
    name = args.out or f"train_{torch.device(device).type}"
    base = common.write_results(name, rows, meta)
    print(f"load average at the end: {load[0]:.2f} ({os.cpu_count()} cores: above that, other processes competed)")
    print(f"wrote {base}.json/.csv in {meta['seconds']} s")
    if args.profile:
        path = common.result_base(name) + "_profile.txt"
        if os.path.exists(path):
            os.remove(path)
        # In this process, after two warm-up steps: the "## ..." ranges that _steps marks and ops by self time.
        with open(path, "a") as f:
            for key in args.models:
                case = CASES[key](cuda)
                for label in labels:
                    it = _start(case, label, args.profile + 2, device)
                    for _ in range(2):
                        next(it).item()
                    common.profile_steps(lambda: next(it).item(), args.profile, device, f"{case['name']} / {label}", f)
                    it.close()
        print(f"profiles (ops by self time) appended to {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
