#!/bin/bash
# The record of what ran (2026-12-02): bench_new was a worktree at 602ab26, bench_old one at 9adff70, and
# the bursty sweep the one of results/r22 (docs/bench/all/bursty/sweep.json). Not a script to rerun as is.
# A/B of the rise guard: new (bench_new worktree) vs old (9adff70), same scenario and seed, one after the other
PY=/work/main/.venv/bin/python
SW=/work/bench_wt/results/r22/bursty/sweep.json
ab() {  # ab NAME SCENARIO SEED
  echo "== $1 seed $3 new $(date -u +%T)"
  (cd /work/bench_new && $PY -m controller bench --model sim_accel --scenario $2 --sweep $SW \
     --sla-ms 40 --max-instances 8 --arms best_static,adaptive --seed $3 --out /work/main/results/ab/$1_new_s$3 2>&1 | grep -v "^|" | tail -32)
  echo "== $1 seed $3 old $(date -u +%T)"
  (cd /work/bench_old && $PY -m controller bench --model sim_accel --scenario $2 --sweep $SW \
     --sla-ms 40 --max-instances 8 --arms adaptive --seed $3 --out /work/main/results/ab/$1_old_s$3 2>&1 | grep -v "^|" | tail -32)
}
ab timer /work/main/scripts/scenarios/timer_bursts.yaml 0
ab bursty /work/main/scripts/scenarios/bursty.yaml 1
echo "== done $(date -u +%T)"
