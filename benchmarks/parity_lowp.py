"""Loss parity of low-precision optimizer states: the same training run with fastops AdamW on fp32, bf16 and 8-bit
states, and with torchao's and bitsandbytes' AdamW8bit where they import and run, on

- ``bert``: HF ``BertForMaskedLM`` in bench_train's CPU config (4 layers x 256, 4 heads, FFN 1024, vocabulary
  8192), masked-LM on 15% of the tokens, AdamW lr 1e-4 and weight decay 0.01 as in bench_train;
- ``llama``: a tiny HF ``LlamaForCausalLM`` (2 layers x 128, 4 heads, 2 KV heads, FFN 344, vocabulary 2048),
  causal LM, AdamW lr 1e-3, weight decay 0.01.

Same initial weights (seeded), same batches, same dropout masks (the global RNG is seeded before each step) for every
provider. The tokens follow a fixed random first-order Markov chain (each token has 4 likely successors), so the
loss keeps falling for hundreds of steps instead of stalling at the uniform entropy of random tokens. The final
loss is the mean of the last ``--tail`` steps; the target is each provider's within 1% of fastops fp32.

    python benchmarks/parity_lowp.py                              # both models, 300 steps each
    python benchmarks/parity_lowp.py --steps 30 --models llama     # smoke run
    FASTOPS_BACKEND=reference python benchmarks/parity_lowp.py --steps 30   # before the C++ kernel of the op lands

Writes benchmarks/results/parity_lowp_cpu.{json,csv,png} (``--out`` names another file): one row per model, provider
and step: ``size`` names the model's configuration, ``step`` the step, ``loss`` its loss and ``ms`` its wall time
(forward, backward and optimizer; one sample, so ms_q20 = ms_q80 = ms); and the loss curves side by side.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from runner import state_bytes  # noqa: E402

import fastops  # noqa: E402

PROVIDERS = ("fastops fp32", "fastops bf16", "fastops 8bit", "torchao AdamW8bit", "bnb AdamW8bit")
TARGET = 0.01  # final loss within 1% of fastops fp32 (issue 13)


def markov_tokens(n_seqs: int, seq: int, vocab: int, g: torch.Generator, low: int = 0) -> torch.Tensor:
    """(n_seqs, seq) tokens in [low, vocab) from one fixed random chain: 4 successors a token, drawn with weights
    0.55/0.25/0.12/0.08 (the chain comes from a generator of its own, the same for every call)."""
    chain_g = torch.Generator().manual_seed(1234)
    succ = torch.randint(low, vocab, (vocab, 4), generator=chain_g)
    weights = torch.tensor([0.55, 0.25, 0.12, 0.08])
    out = torch.empty(n_seqs, seq, dtype=torch.long)
    out[:, 0] = torch.randint(low, vocab, (n_seqs,), generator=g)
    for t in range(1, seq):
        pick = torch.multinomial(weights, n_seqs, replacement=True, generator=g)
        out[:, t] = succ[out[:, t - 1], pick]
    return out


def bert_case(batch: int, seq: int) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024)  # fmt: skip

    def batches(n, g):
        out = []
        for _ in range(n):
            ids = markov_tokens(batch, seq, cfg.vocab_size, g, low=1000)
            mask = torch.rand(batch, seq, generator=g) < 0.15
            out.append({"input_ids": ids.masked_fill(mask, 103), "labels": ids.masked_fill(~mask, -100)})
        return out

    return dict(name=f"BertForMaskedLM 4x256 b{batch} s{seq}", make=lambda: BertForMaskedLM(cfg), lr=1e-4,
                batches=batches)  # fmt: skip


def llama_case(batch: int, seq: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)  # fmt: skip

    def batches(n, g):
        out = []
        for _ in range(n):
            ids = markov_tokens(batch, seq, cfg.vocab_size, g)
            out.append({"input_ids": ids, "labels": ids})
        return out

    return dict(name=f"LlamaForCausalLM 2x128 b{batch} s{seq}", make=lambda: LlamaForCausalLM(cfg), lr=1e-3,
                batches=batches)  # fmt: skip


CASES = {"bert": bert_case, "llama": llama_case}


def make_optimizer(provider: str, params, lr: float):
    kw = dict(lr=lr, weight_decay=0.01)
    if provider.startswith("fastops"):
        return fastops.optim.AdamW(params, state_dtype=provider.split()[1], **kw)
    if provider == "torchao AdamW8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, **kw)
    if provider == "bnb AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kw)
    raise ValueError(provider)


def train(case: dict, provider: str, steps: int, batches: list) -> dict:
    torch.manual_seed(0)
    model = case["make"]()
    model.train()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    opt = make_optimizer(provider, params, case["lr"])
    losses: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(**batches[len(losses)]).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())

    def before() -> None:  # outside the timed region
        if losses and not math.isfinite(losses[-1]):
            raise RuntimeError(f"{provider}: loss {losses[-1]} at step {len(losses) - 1}")
        torch.manual_seed(10_000 + len(losses))  # the same dropout masks for every provider

    ms = common.time_samples(step, "cpu", steps, warmup=0, reset=before)
    before()
    return {"losses": losses, "ms": ms, "state_bytes_per_param": state_bytes(opt) / n_params}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", default="bert,llama", help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated, from: " + ",".join(PROVIDERS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--tail", type=int, default=20, help="final loss: mean of the last TAIL steps")
    ap.add_argument("--out", default="parity_lowp_cpu")
    args = ap.parse_args()
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        ap.error(f"unknown providers {unknown}; expected some of {PROVIDERS}")
    if "fastops fp32" not in providers:
        ap.error("'fastops fp32' is the reference of the ratios; keep it in --providers")
    hw = common.hardware("cpu")
    rows, summary = [], []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        case = CASES[model_name](args.batch, args.seq)
        batches = case["batches"](args.steps, torch.Generator().manual_seed(0))
        results = {}
        for provider in providers:
            t0 = time.perf_counter()
            try:
                results[provider] = r = train(case, provider, args.steps, batches)
            except Exception as e:  # noqa: BLE001 - a peer that does not run on this machine is reported, not fatal
                print(f"{case['name']:40s} {provider:18s} did not run: {type(e).__name__}: {str(e)[:300]}", flush=True)
                summary.append({"model": case["name"], "provider": provider, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            for step, (loss, ms) in enumerate(zip(r["losses"], r["ms"])):
                rows.append(common.row("parity_lowp", provider, case["name"], [ms], "cpu", size_unit="config",
                                       model=model_name, step=step, loss=loss))  # fmt: skip
            r["final"] = sum(r["losses"][-args.tail:]) / len(r["losses"][-args.tail:])
            r["wall_s"] = time.perf_counter() - t0
            print(f"{case['name']:40s} {provider:18s} done in {r['wall_s']:.0f} s, final loss {r['final']:.4f}",
                  flush=True)
        ref = results["fastops fp32"]["final"] if "fastops fp32" in results else None
        for provider, r in results.items():
            ratio = r["final"] / ref if ref else float("nan")
            ok = abs(ratio - 1) <= TARGET
            step_ms = sorted(r["ms"])[len(r["ms"]) // 2]
            print(f"{case['name']:40s} {provider:18s} final loss {r['final']:.4f}  ratio vs fp32 {ratio:.4f} "
                  f"({'within' if ok else 'OUTSIDE'} 1%)  state {r['state_bytes_per_param']:.2f} B/param  "
                  f"median step {step_ms:.0f} ms  run {r['wall_s']:.0f} s", flush=True)  # fmt: skip
            summary.append({"model": case["name"], "provider": provider, "final_loss": r["final"], "ratio": ratio,
                            "within_target": ok, "state_bytes_per_param": r["state_bytes_per_param"],
                            "median_step_ms": step_ms, "wall_s": r["wall_s"]})  # fmt: skip
    meta = {"steps": args.steps, "batch": args.batch, "seq": args.seq, "tail": args.tail, "hardware": hw,
            "backend": fastops._backend.active("cpu"), "torch": torch.__version__, "summary": summary}  # fmt: skip
    base = common.write_results(args.out, rows, meta)
    print(f"wrote {base}.json, {base}.csv, {base}.png")
    return 0 if all(s.get("within_target", True) for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
