#!/usr/bin/env bash
# One command: sweep + four-arm bench of the shifting-traffic scenario on the SIMULATED accelerator.
#   scripts/bench.sh [OUT_DIR]        (default results/shift; about 18 minutes on 2 cores)
# 1. sweep: instances 1,2,4,6 x max_queue_delay_us 0,2000 x the scenario's load levels, 4 s each
#    (one fresh server, about 4-5 minutes);
# 2. bench: default, best_static, oracle, adaptive, each on its own fresh server, 180 s of traffic each
#    (and model_analyzer, Model Analyzer's pick, with MODEL_ANALYZER=OUT_DIR/model_analyzer.json).
# Prints the sweep table, then the arms/ratios/targets table; writes OUT_DIR/{sweep,summary}.json and
# OUT_DIR/{sweep,timeline}.png.
set -euo pipefail
cd "$(dirname "$0")/.."
# The README's virtualenv if there is one, else the python on PATH; PYTHON=... overrides both.
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${1:-results/shift}
SCENARIO=scripts/scenarios/shift.yaml
SLA_MS=${SLA_MS:-40}
mkdir -p "$OUT"
"$PY" -m controller sweep --model sim_accel --scenario "$SCENARIO" --instances 1,2,4,6 --delays-us 0,2000 \
    --seconds 4 --sla-ms "$SLA_MS" --out "$OUT"
# MODEL_ANALYZER=FILE (model_analyzer.json from scripts/model_analyzer.sh) adds the fifth arm, model_analyzer.
"$PY" -m controller bench --model sim_accel --scenario "$SCENARIO" --sweep "$OUT/sweep.json" --sla-ms "$SLA_MS" \
    --out "$OUT" ${MODEL_ANALYZER:+--model-analyzer "$MODEL_ANALYZER"}
