#!/usr/bin/env bash
# Every bench scenario, one after the other, on this machine: one Markdown table and one PNG per scenario.
#   scripts/bench_all.sh [OUT_DIR]          (default results/all; about 75 minutes on 2 cores)
# For each scenario: a sweep of its instance x delay grid at its load levels (skipped when
# OUT_DIR/<scenario>/sweep.json exists: copy a sweep there to reuse it), then the bench's arms side by side
# on fresh servers (default, best_static, oracle, adaptive, and model_analyzer where a Model Analyzer pick
# for the same model and SLA is given). Writes OUT_DIR/<scenario>/{sweep,summary}.json and timeline.png,
# and OUT_DIR/table.md (python -m controller.evaluation.report), which it also prints.
#   shift          the compressed day, SLA 40 ms (lenient: 5x the device time)
#   shift_tight    the same day, SLA 25 ms (about 2.2x the unloaded client latency)
#   bursty         on/off bursts at the same 200 req/s mean as smooth phases, SLA 40 ms
#   delay_matters  the fixed-cost profile on a diurnal day, SLA 25 ms, 4 instances at most
#   heavy_day      a slow model (~57 ms a request, scripts/scenarios/repos/heavy) on the shift day's shape at
#                  5-80 req/s, SLA 200 ms, 4 instances at most (not in the default set: its sweep takes 6 min)
#   host_heavy     a host-heavy model (2 ms host work a request, a fixed-cost device: scripts/scenarios/repos/
#                  host_heavy) on delay_matters' day, SLA 50 ms, 4 instances at most (not in the default set)
#   timer_bursts   4-s bursts of 370 req/s every 10 s over a quiet 60 req/s, SLA 40 ms (not in the default set:
#                  the load of the planner's HoldRecurringLoad)
#   cold_start     the shift day and SLA on a model that starts cold (scripts/scenarios/repos/cold_start: 800 ms on
#                  each instance's first execution, 50 ms on its first of each batch size; not in the default set)
#   two_peaks      a day with two peaks (a sudden step, a lull, a ramp) on a wide-device model (~9 ms a request, 3
#                  device slots: scripts/scenarios/repos/wide), SLA 25 ms, 4 instances at most (not in the default set)
#   lunch          a working day with a lunch spike on a per-item-heavy model (~9.5 ms a request, 2 device slots:
#                  scripts/scenarios/repos/per_item), SLA 40 ms, 4 instances at most (not in the default set)
#   batched        the shift day sent in requests of 4 items (--batch-size 4) at a quarter of its rates, SLA 40 ms
#                  (not in the default set)
#   resnet_shift   the shift day and SLA on resnet_tiny, the shipped torch model (on the CPU where there is no GPU:
#                  the load generator shares its cores), 4 instances at most (not in the default set)
# SCENARIOS="shift bursty" runs a subset; MODEL_ANALYZER=FILE overrides docs/bench/model_analyzer_shift.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${1:-results/all}
SCENARIOS=${SCENARIOS:-shift shift_tight bursty delay_matters}
MA=${MODEL_ANALYZER:-docs/bench/model_analyzer_shift.json}
mkdir -p "$OUT"

run() {   # run NAME SLA_MS REPOSITORY MODEL INSTANCES DELAYS MAX_INSTANCES [extra bench args...]
    local name=$1 sla=$2 repo=$3 model=$4 inst=$5 delays=$6 maxi=$7; shift 7
    local dir="$OUT/$name" scenario="scripts/scenarios/${TRAFFIC:-$name}.yaml"
    mkdir -p "$dir"
    echo "== $name: $scenario, SLA $sla ms, $model ($(date -u +%H:%M:%S))"
    if [ ! -f "$dir/sweep.json" ]; then
        "$PY" -m controller sweep --repository "$repo" --model "$model" --scenario "$scenario" --instances "$inst" \
            --delays-us "$delays" --seconds "${SWEEP_SECONDS:-4}" --sla-ms "$sla" --out "$dir" ${INPUT_ARGS:-}
    else
        echo "   reusing $dir/sweep.json"
    fi
    "$PY" -m controller bench --repository "$repo" --model "$model" --scenario "$scenario" --sweep "$dir/sweep.json" \
        --sla-ms "$sla" --max-instances "$maxi" --out "$dir" ${INPUT_ARGS:-} "$@"
}

SIM=model_repository
FIXED=scripts/scenarios/repos/fixed_cost
for s in $SCENARIOS; do
    case $s in
        shift)
            if [ -f "$MA" ]; then run shift 40 $SIM sim_accel 1,2,4,6 0,2000 8 --model-analyzer "$MA"
            else run shift 40 $SIM sim_accel 1,2,4,6 0,2000 8; fi ;;
        shift_tight)   run shift_tight 25 $SIM sim_accel 1,2,4,6 0,2000 8 ;;
        bursty)        run bursty 40 $SIM sim_accel 1,2,4,6 0,2000 8 ;;
        delay_matters) run delay_matters 25 $FIXED sim_fixed 1,2,4 0,1000,4000 4 ;;
        heavy_day)     SWEEP_SECONDS=6 run heavy_day 200 scripts/scenarios/repos/heavy sim_heavy 1,2,3,4 0,20000 4 ;;
        host_heavy)    run host_heavy 50 scripts/scenarios/repos/host_heavy sim_host 1,2,3,4 0,4000,8000 4 ;;
        timer_bursts)  run timer_bursts 40 $SIM sim_accel 1,2,4,6 0,2000 8 ;;
        cold_start)    TRAFFIC=shift run cold_start 40 scripts/scenarios/repos/cold_start sim_cold 1,2,4,6 0,2000 8 ;;
        two_peaks)     run two_peaks 25 scripts/scenarios/repos/wide sim_wide 1,2,3,4 0,2000 4 ;;
        lunch)         run lunch 40 scripts/scenarios/repos/per_item sim_item 1,2,3,4 0,4000 4 ;;
        batched)       INPUT_ARGS="--batch-size 4" run batched 40 $SIM sim_accel 1,2,4,6 0,2000 8 ;;
        resnet_shift)  TRAFFIC=shift run resnet_shift 40 $SIM resnet_tiny 1,2,3,4 0,2000 4 ;;
        *) echo "unknown scenario '$s' (known: shift shift_tight bursty delay_matters heavy_day host_heavy timer_bursts cold_start two_peaks lunch batched resnet_shift)" >&2; exit 2 ;;
    esac
done
summaries=()
for s in $SCENARIOS; do summaries+=("$OUT/$s/summary.json"); done
"$PY" -m controller.evaluation.report "${summaries[@]}" | tee "$OUT/table.md"
echo "PNGs: $(for s in $SCENARIOS; do printf '%s ' "$OUT/$s/timeline.png"; done)"
