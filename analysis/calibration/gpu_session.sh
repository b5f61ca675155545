#!/usr/bin/env bash
# One calibration session on a lent GPU: the whole profile -> fit -> check loop, then the kernel shapes of the
# validation rows measured on a cluster of the same GPU family. Everything lands in $WORK (default
# /tmp/clustersim-gpu) and, when $OUT is set, in one archive $OUT/gpu_session.tgz, also when a step fails or
# runs out of time (each step has its own limit and a killed profile keeps the rows it measured).
#
#   bash analysis/calibration/gpu_session.sh [VALIDATION_CLUSTER] [SUSTAIN_S]
#
# Run from the repository root with a python3 that has PyTorch (CUDA) and the core dependencies; where simpy is
# missing, put its wheel in .whl/ (analysis/calibration/README.md says how).
set -u
cluster="${1:-dgx-h100}"
sustain="${2:-60}"
WORK="${WORK:-/tmp/clustersim-gpu}"
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
if ! python3 -c "import simpy" 2>/dev/null && ls .whl/simpy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/simpy-*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
cs() { python3 -m simulator "$@"; }
finish() {
  date -u +%FT%TZ >"$WORK/finished_at"
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_session.tgz" -C "$WORK" .; fi
}
trap finish EXIT
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  git rev-parse HEAD 2>/dev/null
} >"$WORK/environment.txt" 2>&1
nvidia-smi -q >"$WORK/nvidia-smi-q.txt" 2>&1

# 1. The loop: profile the check configurations (with FP8 GEMMs and the sustained-load probe), fit, write the
#    host's device, table and cluster, and train the check GPTs for real against the predictions.
timeout 300 python3 -m simulator calibrate host --device cuda --ranks 1 --micro-batch 1,2,4 --passes 2 --fp8 \
  --sustain "$sustain" --name gpu-host --out "$WORK/host" --format json >"$WORK/host.json" 2>"$WORK/host.log"
echo "host exit $?" >>"$WORK/steps.txt"

# 2. The kernel shapes of the validation rows on $cluster (shapes only; their step times are not read).
timeout 180 python3 analysis/calibration/profile_validation_shapes.py data/validation/published_runs.csv \
  --cluster "$cluster" --device cuda --out "$WORK/validation" >"$WORK/validation.log" 2>&1
echo "validation-shapes exit $?" >>"$WORK/steps.txt"

# 3. Where step 1 ran out of time, finish its check (its profile resumes where it stopped).
if [ ! -s "$WORK/host/check.json" ]; then
  timeout 100 python3 -m simulator calibrate check --device cuda --no-ddp --work "$WORK/host" --format json \
    >"$WORK/check.json" 2>"$WORK/check.log"
  echo "check exit $?" >>"$WORK/steps.txt"
fi

# 4. Where the check's real steps spend their time: GPU busy time against wall time (torch.profiler).
timeout 90 python3 analysis/calibration/trace_check_steps.py --out "$WORK/trace_steps.json" >"$WORK/trace.log" 2>&1
echo "trace exit $?" >>"$WORK/steps.txt"
