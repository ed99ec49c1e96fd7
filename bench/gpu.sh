#!/usr/bin/env bash
# The GPU checks in one call of the `device` tool (../shared/gpu/README.md),
# within its 10-minute limit: fairseq set up there, the cuda tests, the layer
# timings (bench/run.py --device cuda --sections layers), the device-only time
# of a step replayed in a CUDA graph with its host time (--sections device),
# and a fairseq-train --fp16 round at 4,096 and 16,384 tokens. Each step runs under what is left of the
# deadline (DEADLINE seconds, default 540, from the start); whatever it wrote
# is copied into $OUT (default out/gpu) at the end, even after a failed or
# stopped step, for the session to commit. Run from the repository root, with
# the GPU folder carried as .gpu:
#   cp -r ../shared/gpu .gpu && echo /.gpu/ >> .git/info/exclude   # once
#   run(command="bash bench/gpu.sh", carry=[".gpu"], timeout_s=600)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f .gpu/setup.sh ] || { echo "bench/gpu.sh: no .gpu here: cp -r ../shared/gpu .gpu, and carry it" >&2; exit 2; }
start=$(date +%s)
deadline=${DEADLINE:-540}
out=${OUT:-out/gpu}
mkdir -p "$out"

# step LIMIT NAME COMMAND...: the command under the lesser of LIMIT and the time left, its output in $out/NAME.log
step() {
  local limit=$1 name=$2 left
  shift 2
  left=$(( deadline - ($(date +%s) - start) ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then
    echo "== $name: skipped, $left s left" | tee -a "$out/steps.txt"
    return
  fi
  local t0=$(date +%s) rc
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$out/steps.txt"
  tail -n 5 "$out/$name.log"
}

collect() {
  cp bench/results/results-cuda.json bench/results/results-cuda.md bench/results/*-cuda.png "$out"/ 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
  echo "== total $(( $(date +%s) - start )) s" | tee -a "$out/steps.txt"
}
trap collect EXIT

step 240 setup bash .gpu/setup.sh
. .gpu/env.sh
export TRITON_INTERPRET=0
# the C++ autograd nodes that drive the Triton passes (kernels/compiled.py builds them here, once: about a minute)
step 120 build python -c "from powernorm_fairseq.norms.kernels import compiled; assert compiled.load(), compiled.failure"
step 120 tests python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k cuda
step 150 layers python bench/run.py --device cuda --sections layers
step 90 device python bench/run.py --device cuda --sections device
step 180 train python bench/run.py --device cuda --sections throughput --gpu-tokens 4096,16384 --rounds 1 --updates 60
