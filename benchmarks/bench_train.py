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
timed region, by _Provider.reseed), the same optimizer hyperparameters and the same loop
(``_steps``). Each provider runs in a process of its own (fastops.accelerate keeps freed memory in the process on
the CPU, a process-wide setting that must not reach the others), ``--blocks`` times; in a block the providers'
processes live side by side and take turns step by step (see run_case), so a slow stretch of the machine hits them
all alike; medians with 20/80% quantiles over the timed steps of all blocks. Loss curves are compared at the end
(see loss_check); a mismatch gives exit status 1.

    python benchmarks/bench_train.py                        # every model on the CPU
    python benchmarks/bench_train.py --quick                # smoke run (841 s, --rounds 2, load 4-8 on 2 cores)
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
import tempfile
import time

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import train_profile  # noqa: E402

from fastops.accelerate import accelerate  # noqa: E402

from train_report import (AMP_NOISE, AMP_REF, CLAIMS, COMPILE, EXPLICIT, F_BOTH, F_COMPILE, F_EAGER,  # noqa: E402
                          F_FUSED, F_NCHW, F_SDPA, FASTOPS, FP32, HF, LOSS_TAIL, PEERS, SAME_RECIPE_RTOL,
                          BF16_VS_FP32_RTOL, loss_check, print_rows, targets)
from train_cases import CASES  # noqa: E402


# ---- data ------------------------------------------------------------------------------------------------


class _Run(torch.utils.data.Dataset):
    """The batches, cycled, as a pass of RUN_STEPS: a training run of ordinary length, of which the benchmark
    times a window (fastops' compile="auto" leaves a short run uncompiled)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return RUN_STEPS

    def __getitem__(self, i: int):
        return self.batches[i % len(self.batches)]


RUN_STEPS = 10_000
# "wall" (time.perf_counter), or "cpu": the process's CPU time (time.process_time, every thread), steadier than
# wall time on a machine other processes load, at one thread (--threads 1) where no thread waits on another.
CLOCK = "wall"


def _loader(batches: list) -> DataLoader:
    # batch_size=None: the dataset's items are whole batches. Its own generator: a DataLoader without one draws
    # its base seed from the global RNG when iterated, and the dropout masks would then differ by provider.
    return DataLoader(_Run(batches), batch_size=None, generator=torch.Generator().manual_seed(0))


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


def torch_amp_perturbed(case, model, loader, device):
    """The AMP recipe from params each moved by one bf16 rounding (x (1 +- 2^-9), signs drawn from their own
    generator): how far the recipe's losses move on rounding alone, the noise every bf16 provider is held to."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
            p.mul_(1 + sign * 2.0**-9)
    return torch_amp(case, model, loader, device)


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


def _fastops(env=None, **options):
    def provider(case, model, loader, device):
        os.environ.update(env or {})  # this worker's process only
        model, opt, loader = accelerate(model, case["opt"](model.parameters()), loader, device=device, **options)
        # precision="auto" picks fp32 on a CPU without native bf16; the loss check then compares it with fp32.
        provider.precision = opt.accelerator.precision
        provider.optimizer = f"{type(opt).__module__}.{type(opt).__name__}"
        provider.decision = opt.accelerator.decision.line() if hasattr(opt.accelerator, "decision") else ""
        return _steps(model, opt, loader, case["loss"], device)

    provider.lm_only = bool(options.get("fused_loss")) or "FASTOPS_ATTENTION" in (env or {})
    provider.conv_only = env is not None and "FASTOPS_CHANNELS_LAST" in env
    return provider


PROVIDERS = {FP32: torch_fp32, AMP_REF: torch_amp, AMP_NOISE: torch_amp_perturbed, HF: hf_accelerate_bf16,
             COMPILE: torch_compile_recipe,
             FASTOPS: _fastops(),
             F_EAGER: _fastops(compile=False, fused_loss=False), F_COMPILE: _fastops(compile=True, fused_loss=False),
             F_FUSED: _fastops(compile=False, fused_loss=True), F_BOTH: _fastops(compile=True, fused_loss=True),
             F_NCHW: _fastops(env={"FASTOPS_CHANNELS_LAST": "0"}, compile=False, fused_loss=False),
             F_SDPA: _fastops(env={"FASTOPS_ATTENTION": "0"})}


def _start(case: dict, label: str, steps: int, device: str):
    torch.manual_seed(0)  # same weights for every provider
    batches = case["batches"](steps, torch.Generator().manual_seed(1))
    return PROVIDERS[label](case, case["make"](), _loader(batches), device)


class _Provider:
    """One provider's training run, in a worker process of its own: ``step`` runs and times one step from the
    shared initial weights, ``finish`` gives the losses and the training memory, and with ``profile_steps`` a
    profiler breakdown of that many more steps."""

    def __init__(self, case: dict, label: str, steps: int, device: str) -> None:
        self.label, self.device = label, device
        self.it = _start(case, label, steps, device)
        self.losses: list[float] = []
        self.cuda = torch.device(device).type == "cuda"
        self.rss0 = None if self.cuda else train_profile.rss_start()
        self.clock = time.process_time if CLOCK == "cpu" else time.perf_counter
        self.first_wall = None

    def reseed(self) -> None:  # same dropout masks and proposal samples for every provider (CUDA's generators too)
        torch.manual_seed(1000 + len(self.losses))

    def step(self) -> float:
        self.reseed()
        common.sync(self.device)
        t, w = self.clock(), time.perf_counter()
        self.losses.append(next(self.it).item())  # the step is done (and synced) once its loss is on the host
        ms = 1e3 * (self.clock() - t)
        # The first step's wall time: torch.compile's compile workers are other processes.
        self.first_wall = self.first_wall or 1e3 * (time.perf_counter() - w)
        return ms

    def finish(self, profile_steps: int = 0) -> dict:
        if self.cuda:
            mem = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = train_profile.rss_peak()
            mem = None if self.rss0 is None or peak is None else peak - self.rss0
        out = {"first_wall_ms": self.first_wall, "losses": self.losses,
               "mem_mib": None if mem is None else round(mem, 1)}
        if profile_steps:
            self.reseed()
            out["breakdown"], out["profile"] = train_profile.profile(lambda: next(self.it).item(), profile_steps,
                                                                     self.label)
        self.it.close()
        make = PROVIDERS[self.label]
        out.update(precision=getattr(make, "precision", "fp32" if self.label == FP32 else "bf16"),
                   optimizer=getattr(make, "optimizer", None), decision=getattr(make, "decision", ""))
        return out


def _serve(case: dict, label: str, steps: int, device: str, pin: int | None) -> None:
    """A provider's worker: a step at each request, pinned to CPU ``pin`` from its first timed step (after its
    warm-up, so that torch.compile's compile workers still had every CPU), then ``finish``."""
    prov = _Provider(case, label, steps, device)
    for req in common.requests():
        if req["op"] == "step":
            if req.get("timed") and pin is not None:
                os.sched_setaffinity(0, {pin})
                pin = None  # pinned: once is enough
            common.reply({"ms": prov.step()})
        else:
            common.reply(prov.finish(req.get("profile", 0)))
            return


@contextlib.contextmanager
def _inductor_cache(cache_dir: str | None):
    """``TORCHINDUCTOR_CACHE_DIR`` set for the workers started inside: each provider its own inductor cache,
    empty at its first run, so that its first step is a cold compile, as a user's first run is."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = env


def _applies(label: str, case: dict) -> bool:
    make = PROVIDERS[label]
    if getattr(make, "conv_only", False):
        return not case.get("lm")
    return not getattr(make, "lm_only", False) or bool(case.get("lm"))


def run_case(model_key: str, labels: list[str], rounds: int, warmup: int, blocks: int, device: str,
             cache_root: str, profile_steps: int = 0, turn: int = 1):
    """Every provider in a process of its own (fastops.accelerate changes process-wide state on the CPU: it keeps
    freed memory in the process, which must not reach the providers measured against it), ``blocks`` times. In a
    block the providers' processes start one after another and take their ``warmup`` untimed steps alone (a cold
    compile has the machine to itself); then they live side by side and take ``rounds`` turns of ``turn`` steps
    each, the order rotating each round, so that a slow stretch of the machine hits them all alike (above one step
    a turn, its first is not timed: it finds the caches as the other providers left them). A process per provider and
    block, taking turns block by block, had not been enough: one of this VM's two vCPUs runs 2x slower by turns,
    for seconds to minutes, and a process could sit on the slow one for its whole life (bench_loss.py's
    docstring): ResNet-50's defaults read 1.14x the torch.compile recipe that way at 1 thread, 1.02x-1.03x this
    way. At one thread every worker is pinned to the same CPU for its timed steps, for the same reason. The GEMM
    peak is sampled at every round, pinned alike; the FLOPs of a step are counted once, in a process of their own."""
    case = CASES[model_key](torch.device(device).type == "cuda")
    labels = [x for x in labels if _applies(x, case)]
    losses: dict[str, list[float]] = {}
    info: dict[str, dict] = {}
    rerun_diff = {label: 0.0 for label in labels}
    first_ms: dict[str, float] = {}
    mem_mib: dict[str, float] = {}
    samples: dict[str, list[float]] = {label: [] for label in labels}
    peak_samples: list[float] = []
    for block in range(blocks):
        live = {}
        for label in labels:
            cache = os.path.join(cache_root, f"{model_key}-{label}".replace(" ", "_").replace("=", ""))
            with _inductor_cache(cache):
                live[label] = common.Live(__file__, ["--serve", model_key, label,
                                                     str(rounds * turn + warmup + profile_steps), "--device", device,
                                                     *_THREAD_ARGS])  # fmt: skip
            for _ in range(warmup):
                live[label].ask({"op": "step"})
        sampler = common.Live(__file__, ["--peak", "--device", device, *_THREAD_ARGS])
        for r in range(rounds):
            peak_samples += sampler.ask({"op": "sample"})["samples"]
            for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                for k in range(turn):
                    ms = live[label].ask({"op": "step", "timed": True})["ms"]
                    if k or turn == 1:
                        samples[label].append(ms)
        sampler.close()
        for label, worker in live.items():
            # The last block profiles after its timed steps.
            out = worker.ask({"op": "finish", "profile": profile_steps if block == blocks - 1 else 0})
            worker.close()
            # Same weights, batches, dropout masks and samples in every block; oneDNN's convolutions still differ
            # in the last bits from run to run, so the blocks' agreement is reported, not required.
            if label in losses:
                diff = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], losses[label]))
                rerun_diff[label] = max(rerun_diff[label], diff)
            else:
                losses[label], info[label] = out["losses"], out
            if "breakdown" in out:
                info[label]["breakdown"], info[label]["profile"] = out["breakdown"], out["profile"]
            first_ms.setdefault(label, out["first_wall_ms"])  # the first block's: a cold compile for compile providers
            if out["mem_mib"] is not None:
                mem_mib[label] = max(mem_mib.get(label, 0.0), out["mem_mib"])
    peak_ms = statistics.median(peak_samples)
    peak = train_profile.gemm_gflops(peak_ms)
    flops = common.in_fresh_process(__file__, ["--flops", model_key, "--device", device])["flops"]
    check = loss_check(losses, {k: v["precision"] for k, v in info.items()})
    rows = []
    for label, xs in samples.items():
        ms = statistics.median(xs)
        extra = {}
        if "breakdown" in info[label]:
            bd = info[label]["breakdown"]
            extra = {"breakdown_ms": bd, "gemm_share": round(bd.get("gemm+conv", 0.0) / bd["wall"], 3),
                     "gemm_efficiency": round(flops / (bd.get("gemm+conv", 0.0) + bd.get("fused loss", 0.0)
                                                       + bd.get("attention", 0.0)) / 1e6 / peak, 3)}
        rows.append(common.row(
            "train", label, case["name"], xs, device, size_unit="config", model=model_key,
            precision=info[label]["precision"], optimizer=info[label]["optimizer"],
            seed_claim_vs_fp32=CLAIMS[model_key], first_loss=round(losses[label][0], 5),
            tail_loss=round(check[label]["tail_loss"], 5),
            tail_rel_diff_vs_fp32=float(f"{check[label].get('rel_diff_fp32', float('nan')):.3g}"),
            tail_rel_diff_vs_amp=float(f"{check[label].get('rel_diff_amp', float('nan')):.3g}"),
            loss_check="; ".join(check[label]["fail"]) or "ok", rerun_loss_rel_diff=float(f"{rerun_diff[label]:.3g}"),
            first_step_ms=round(first_ms[label], 1), train_mem_mib=mem_mib.get(label),
            gflop_per_step=round(flops / 1e9, 2), peak_gflops=round(peak, 1),
            mfu=round(flops / (ms / 1e3) / (peak * 1e9), 3), decision=info[label].get("decision", ""), **extra))
    for ref, column in ((FP32, "speedup_vs_fp32"), (HF, "vs_hf_accelerate"), (COMPILE, "vs_torch_compile")):
        if ref in samples:
            common.speedup_vs(rows, ref, column)
    best = [r for r in rows if r["provider"] in PEERS]
    if best:
        ref = min(best, key=lambda r: r["ms"])
        for r in rows:
            r["vs_best_peer"], r["best_peer"] = round(ref["ms"] / r["ms"], 3), ref["provider"]
    explicit = [r for r in rows if r["provider"] in EXPLICIT]
    if explicit:
        fastest = min(explicit, key=lambda r: r["ms"])
        for r in rows:
            r["vs_fastest_explicit"] = round(fastest["ms"] / r["ms"], 3)
    profiles = {label: info[label]["profile"] for label in labels if "profile" in info[label]}
    return rows, losses, profiles


def _worker(args, cuda: bool, device: str) -> int:
    if args.peak:  # a sample at each request, taking its turn with the providers
        if args.cpu is not None:
            os.sched_setaffinity(0, {args.cpu})
        for _ in common.requests():
            common.reply({"samples": train_profile.gemm_samples(device, time.process_time if CLOCK == "cpu" else None,
                                                                repeats=3)})
    elif args.flops:
        case = CASES[args.flops](cuda)
        torch.manual_seed(0)
        batch = case["batches"](1, torch.Generator().manual_seed(1))[0]
        common.reply({"flops": train_profile.flops_per_step(case["make"](), batch, case["loss"], device)})
    else:
        model_key, label, steps = args.serve
        _serve(CASES[model_key](cuda), label, int(steps), device, args.cpu)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="few steps, one run per provider (gpu_check.sh)")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per provider and run (default 6, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    p.add_argument("--blocks", type=int, default=None,
                   help="fresh processes per provider, the providers taking turns step by step in each (default 2, "
                   "quick 1)")
    p.add_argument("--turn", type=int, default=1, help="steps a provider takes at its turn; above 1 the first "
                   "is not timed (it finds the caches as the other providers left them)")
    p.add_argument("--models", nargs="*", choices=list(CASES), default=list(CASES))
    p.add_argument("--providers", nargs="*", choices=list(PROVIDERS), default=list(PROVIDERS),
                   help="default all; the fused-loss ones run on the language models only")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="each provider's last run profiles STEPS more steps (torch.profiler): the breakdown "
                        "columns, and the top ops in <out>_profile.txt")  # fmt: skip
    p.add_argument("--out", default=None,
                   help="result name under benchmarks/results, or a path (default train_<device>)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in every process (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by wall clock, or by the process's CPU time (steadier under load at 1 thread)")
    p.add_argument("--serve", nargs=3, metavar=("MODEL", "PROVIDER", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--flops", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print(f"bench_train: --device {device} but CUDA is not available")
        return 2
    global CLOCK
    CLOCK = args.clock
    if args.threads:
        torch.set_num_threads(args.threads)
    _THREAD_ARGS[:] = [f"--threads={torch.get_num_threads()}", f"--clock={CLOCK}"]
    if torch.get_num_threads() == 1 and hasattr(os, "sched_getaffinity") and args.cpu is None:
        _THREAD_ARGS.append(f"--cpu={min(os.sched_getaffinity(0))}")
    if args.serve or args.peak or args.flops:
        return _worker(args, cuda, device)
    rounds = args.rounds or (3 if args.quick else 6)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    blocks = args.blocks or (1 if args.quick else 2)
    turn = args.turn
    labels = list(dict.fromkeys(args.providers))
    rows, all_losses, profiles, summary = [], {}, {}, {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_train_inductor_") as cache_root:
        for key in args.models:
            name = CASES[key](cuda)["name"]
            print(f"{name} on {common.hardware(device)}: {blocks} x {rounds} turns of {turn} steps per provider after "
                  f"{warmup} warm-up, the providers taking turns; the first block of each compiles cold", flush=True)
            case_rows, losses, case_profiles = run_case(key, labels, rounds, warmup, blocks, device, cache_root,
                                                        args.profile, turn)
            all_losses[name] = losses
            profiles[name] = case_profiles
            first = case_rows[0]
            print(f"  {first['gflop_per_step']:.1f} GFLOP per step; bf16 GEMM peak {first['peak_gflops']:.0f} GFLOP/s",
                  flush=True)
            print_rows(case_rows)
            summary[key] = targets(key, case_rows)
            rows += case_rows
    bad = [r for r in rows if r["loss_check"] != "ok"]
    for r in bad:
        print(f"LOSS MISMATCH: {r['size']} {r['provider']}: last {LOSS_TAIL} losses {r['loss_check']}")
    load = os.getloadavg()
    meta = {"device": device, "hardware": common.hardware(device), "torch": torch.__version__, "rounds": rounds,
            "warmup": warmup, "blocks": blocks, "turn": turn, "threads": torch.get_num_threads(), "clock": CLOCK,
            "loss_tail": LOSS_TAIL,
            "same_recipe_rtol": SAME_RECIPE_RTOL, "bf16_vs_fp32_rtol": BF16_VS_FP32_RTOL, "claims": CLAIMS,
            "targets": summary, "losses": all_losses, "loadavg_at_start": start_load, "loadavg_at_end": load,
            "seconds": round(time.perf_counter() - start), "argv": sys.argv[1:],
            "note": "one process per provider and block, taking turns step by step; the CPU may be shared with "
                    "other processes (see loadavg_*)"}  # fmt: skip
    name = args.out or f"train_{torch.device(device).type}"
    base = common.write_results(name, rows, meta)
    print(f"load average at the start {start_load[0]:.2f}, at the end {load[0]:.2f} ({os.cpu_count()} cores: "
          "above that, other processes competed)")
    print(f"wrote {base}.json/.csv in {meta['seconds']} s")
    if args.profile:
        with open(common.result_base(name) + "_profile.txt", "w") as f:
            for case_name, by_label in profiles.items():
                for label, text in by_label.items():
                    f.write(f"# {case_name}\n{text}")
        print(f"profiles (ops by self time) in {common.result_base(name)}_profile.txt")
    return 1 if bad else 0


start_load = os.getloadavg()
_THREAD_ARGS: list[str] = []  # --threads and --clock, handed to every worker

if __name__ == "__main__":
    sys.exit(main())
