#!/usr/bin/env bash
# Triton Model Analyzer on the bench's model and grid: the tool a Triton user would run instead, offline.
#   scripts/model_analyzer.sh [OUT_DIR]      (default results/shift; writes OUT_DIR/model_analyzer.json)
# 1. creates .venv-ma (its own virtualenv: MA 1.58.0 wants packages the project's venv does not pin)
#    with triton-model-analyzer==1.58.0 and tritonclient[all]==2.51.0 (perf_analyzer) and the CUDA
#    runtime library perf_analyzer links against (no GPU needed);
# 2. runs MA in local launch mode with the pip tritonserver (nvidia-pytriton, from the project's venv):
#    brute search over instances 1,2,4,6 x max_queue_delay_us 0,2000 (the grid of scripts/bench.sh),
#    closed-loop concurrency 1..32, constraint p99 <= SLA_MS (40 ms, the SLA of scenarios/shift.yaml);
# 3. records MA's wall time and its pick in OUT_DIR/model_analyzer.json
#    (controller/evaluation/model_analyzer.py). Replay the pick as a fifth bench arm with
#    `python -m controller bench ... --model-analyzer OUT_DIR/model_analyzer.json`.
# Takes several minutes on 2 cores (each config x concurrency is one perf_analyzer measurement).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${1:-results/shift}
SCENARIO=scripts/scenarios/shift.yaml
SLA_MS=${SLA_MS:-40}
MA_VENV=${MA_VENV:-.venv-ma}
if ! "$MA_VENV/bin/python" -c 'import model_analyzer' 2>/dev/null; then
    "$PY" -m venv "$MA_VENV"
    "$MA_VENV/bin/pip" install -q triton-model-analyzer==1.58.0 'tritonclient[all]==2.51.0' nvidia-cuda-runtime-cu12
fi
mkdir -p "$OUT"
"$PY" -m controller.evaluation.model_analyzer --venv "$MA_VENV" --out "$OUT" --scenario "$SCENARIO" \
    --sla-ms "$SLA_MS" --instances 1,2,4,6 --delays-us 0,2000 --invocation "SLA_MS=$SLA_MS $0 $*" "${@:2}"
