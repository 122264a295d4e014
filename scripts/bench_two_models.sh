#!/usr/bin/env bash
# One command: the two-model scenario (two SIMULATED-accelerator models, one memory budget, alternating
# peaks) against every static split of the budget and the controller.
#   scripts/bench_two_models.sh [OUT_DIR]      (default results/two_models; about 9 minutes on 2 cores)
#   SCENARIO=scripts/scenarios/two_models_tight.yaml scripts/bench_two_models.sh results/two_tight   (SLA 25 ms)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m controller bench --scenario "${SCENARIO:-scripts/scenarios/two_models.yaml}" --out "${1:-results/two_models}"
