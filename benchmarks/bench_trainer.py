"""HF's Trainer, bf16, on the models of bench_train.py (BertForMaskedLM, LlamaForCausalLM): the same script with and
without ``fastops.patch()`` as its first line. Each run is a fresh process (patch() changes process-wide state);
the two alternate over ``--blocks`` runs. A step's time is taken by a TrainerCallback, from on_step_begin to
on_step_end (forward, backward, clipping, optimizer and scheduler step), after ``--warmup`` steps; medians of all
runs. The runs' logged losses, grad norms and learning rates are compared step by step.

    python benchmarks/bench_trainer.py --threads 1 --clock cpu     # results/train_trainer_cpu.{json,csv}
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PLAIN, PATCHED = "HF Trainer bf16", "HF Trainer bf16 + fastops.patch()"
TARGET = 1.25


def _worker(model_key: str, patched: bool, steps: int, warmup: int, clock_name: str) -> dict:
    if patched:
        import fastops

        fastops.patch()
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from train_cases import CASES

    case = CASES[model_key](False)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    batches = case["batches"](steps, torch.Generator().manual_seed(1))
    # The Trainer batches samples itself: the case's batches, split into rows, in order.
    samples = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(next(iter(b.values()))))]
    per_batch = len(samples) // steps
    times: list[float] = []
    first: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t, self.w = clock(), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(1e3 * (clock() - self.t))
            if not first:
                first.append(1e3 * (time.perf_counter() - self.w))

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, bf16=True, max_steps=steps, per_device_train_batch_size=per_batch,
            learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear", logging_steps=1,
            report_to="none", save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
            dataloader_drop_last=True,
        )  # fmt: skip
        torch.manual_seed(0)
        model = case["make"]()
        trainer = Trainer(model=model, args=args, train_dataset=samples, callbacks=[Timer()])
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "learning_rate" in h]
    decision = getattr(model, "_fastops_decision", None)
    return {"times": times[warmup:], "first_ms": first[0], "optimizer": type(trainer.optimizer.optimizer).__name__,
            "decision": str(decision) if decision else "", **{k: [h[k] for h in logs] for k in
                                                                ("loss", "grad_norm", "learning_rate")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=["bert", "llama"])
    p.add_argument("--steps", type=int, default=8, help="Trainer steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per run")
    p.add_argument("--blocks", type=int, default=2, help="runs of each, alternating")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--out", default="train_trainer_cpu")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        common.reply(_worker(args.worker[0], args.worker[1] == "1", args.steps, args.warmup, args.clock))
        return 0
    load0, start = os.getloadavg(), time.perf_counter()
    flags = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--clock", args.clock,
             f"--threads={torch.get_num_threads()}"]
    rows, summary = [], {}
    for key in args.models:
        runs: dict[str, dict] = {}

        def run(label, key=key):
            out = common.in_fresh_process(__file__, ["--worker", key, "1" if label == PATCHED else "0", *flags])
            runs.setdefault(label, out)
            return out["times"]

        samples = common.interleaved({PLAIN: lambda: run(PLAIN), PATCHED: lambda: run(PATCHED)}, args.blocks)
        plain, fast = runs[PLAIN], runs[PATCHED]
        rel = {k: max(abs(a - b) / abs(a) for a, b in zip(plain[k], fast[k])) for k in ("loss", "grad_norm")}
        same_lr = plain["learning_rate"] == fast["learning_rate"]
        speedup = statistics.median(samples[PLAIN]) / statistics.median(samples[PATCHED])
        summary[key] = {"speedup": round(speedup, 3), "met": speedup >= TARGET, "max_loss_rel_diff": rel["loss"],
                        "max_grad_norm_rel_diff": rel["grad_norm"], "same_lr_schedule": same_lr}
        for label in (PLAIN, PATCHED):
            r = runs[label]
            rows.append(common.row("trainer", label, key, samples[label], "cpu", size_unit="config", model=key,
                                   optimizer=r["optimizer"], first_step_ms=round(r["first_ms"], 1),
                                   decision=r["decision"], first_loss=r["loss"][0], tail_loss=r["loss"][-1]))
        print(f"{key}: {PLAIN} {statistics.median(samples[PLAIN]):.1f} ms, {PATCHED} "
              f"{statistics.median(samples[PATCHED]):.1f} ms: {speedup:.2f}x (target {TARGET}x); losses within "
              f"{rel['loss']:.1e}, grad norms within {rel['grad_norm']:.1e}, LR schedule "
              f"{'the same' if same_lr else 'DIFFERENT'}\n  {fast['decision']}", flush=True)
    common.speedup_vs(rows, PLAIN, "speedup_vs_plain_trainer")
    meta = {"hardware": common.hardware("cpu"), "threads": torch.get_num_threads(), "clock": args.clock,
            "steps": args.steps, "warmup": args.warmup, "blocks": args.blocks, "summary": summary,
            "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(), "argv": sys.argv[1:],
            "seconds": round(time.perf_counter() - start)}
    base = common.write_results(args.out, rows, meta)
    print(f"load average {load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; wrote {base}.json/.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
