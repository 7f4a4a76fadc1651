#!/usr/bin/env bash
# One script for a lent GPU machine: build fastops with its CUDA kernels (setup.py finds the toolkit and the
# GPU's arch itself, no variables needed), run every GPU test case with the real Triton compiler (no
# interpreter), compile-check, then the benchmarks, writing logs and results into the folder given.
# It uses the machine's own torch and triton (no installs there); HF accelerate runs in bench_train only if
# that machine has it.
#
# Budget: under 8 minutes on one H200, build included. Each step has its own time limit (the second argument
# of `step` below) and the limits add up to 480 s; a step also never runs past DEADLINE seconds from the
# start, so a slow step cannot push the script over. A step that times out is killed (rc 124), counted as
# a failure, and the next step runs. The limits are estimates: no GPU has run this script yet.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the steps run from the repository root
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
DEADLINE=475
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log, remember failures
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 10 ]; then
    echo "== $name skipped: ${left}s left of the ${DEADLINE}s budget" | tee -a "$out/summary.txt"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" >>"$out/summary.txt"
  echo "   rc=$rc in $((SECONDS - t0)) s"
  tail -n 5 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}

: >"$out/summary.txt"
{ nvidia-smi; python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } >"$out/env.txt" 2>&1
# 190 s: the CUDA build, for the visible GPU's arch only, on all cores (measured 4.6 CPU-minutes for three archs
# on the CPU machine). The build log's "fastops setup:" lines say which toolkit, headers and archs it took.
step build 190 python -m pip install -v --no-build-isolation --no-deps -e .
# 10 s: imports and the backend table.
step info 10 python -m fastops info
# 160 s: every GPU test case, Triton kernels compiled for real. The cuda mark is not kept by hand: tests/claims.py
# puts it on every case parametrized with a CUDA device (tests/devices.py's pairs), skipped without CUDA, or in a
# module that picks its device from torch.cuda.is_available(); tests/test_claims.py fails when this step would
# leave one out. The junit file records each case's outcome.
step tests_cuda 160 python -m pytest -q -p no:cacheprovider -m cuda --junitxml="$out/tests_cuda.xml" tests
# 25 s: AdamW at 1M/16M/100M; the roofline kernels stream 4 GiB each and one is torch.compile'd (~10 s).
step bench_adamw 25 python benchmarks/bench_adamw.py --device cuda --sizes 1 16 100 --rounds 5 --repeats 10 --out "$out/adamw_cuda"
# 15 s: unscale kernel and the AMP optimizer phase at 24M params.
step bench_amp 15 python benchmarks/bench_amp.py --device cuda --rounds 5 --repeats 10 --out "$out/amp_cuda"
# 15 s: momentum SGD at 1M/16M/64M against torch's fused/foreach paths and its 20 B/param roofline.
step bench_sgd 15 python benchmarks/bench_sgd.py --device cuda --sizes 1 16 64 --rounds 5 --repeats 10 --out "$out/sgd_cuda"
# 15 s: H2D copies of 64 and 256 MiB batches under a matmul step (the CPU part is skipped here).
step bench_prefetch 15 python benchmarks/bench_prefetch.py --quick --cuda-only --cuda-sizes 64 256 --out "$out/prefetch"
# 25 s: end to end on HF BERT (bf16 autocast on CUDA), 4 providers, each in its own process
# (imports and CUDA start-up, ~5 s each, then 5 steps).
step bench_train 25 python benchmarks/bench_train.py --quick --device cuda --models bert --out "$out/train_cuda"
# 10 s: the demo, plain PyTorch then fastops.accelerate on TinyGPT, its results written as the benchmarks'.
step demo 10 python -m fastops demo --device cuda --steps 40 --out "$out/demo_cuda"
# 15 s: every Triton kernel spec compiled for sm_80/90/100 and every kernel's registers and spills checked (needs
# no GPU; 132 compiles took 134 s with 2 jobs on the CPU machine, here 16 jobs). Last: the GPU steps come first.
step compile_check 15 python -m fastops compile-check -j 16
echo "total $SECONDS s" >>"$out/summary.txt"
echo "gpu_check finished with status $status in $SECONDS s; logs and results in $out"
exit $status
