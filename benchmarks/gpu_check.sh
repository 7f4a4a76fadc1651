#!/usr/bin/env bash
# One script for a lent GPU machine: build fastops with its CUDA kernels, run the CUDA tests with the real
# Triton compiler (no interpreter), then the benchmarks, writing everything into the folder given.
# Budget: under 8 minutes on one H200. It uses the machine's own torch and triton (no installs there).
#
#   bash benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log, remember failures
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"
  tail -n 5 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}

{ nvidia-smi; python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } >"$out/env.txt" 2>&1
step build 240 env FASTOPS_CUDA=1 MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -e .
step info 60 python -m fastops info
step tests_cuda 150 python -m pytest -q -m cuda tests
step bench_adamw 90 python benchmarks/bench_adamw.py --device cuda --sizes 1 16 100 --rounds 5 --repeats 10
step bench_amp 60 python benchmarks/bench_amp.py --device cuda --rounds 5 --repeats 10
step bench_prefetch 60 python benchmarks/bench_prefetch.py --quick
# End to end: plain PyTorch vs fastops.accelerate on the demo's TinyGPT (bench_train.py is CPU-only so far).
step demo 90 python -m fastops demo --device cuda --steps 60
cp benchmarks/results/*cuda* "$out"/ 2>/dev/null || true
echo "gpu_check finished with status $status; logs in $out"
exit $status
