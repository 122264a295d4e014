"""How close the planner's model is to the server: its p99 for the live configuration against the traced one
(or, with `--mean`, its mean latency against the counters' mean: the check the planner corrects itself by where
nothing is traced, `planner.record_ratio`).

    python -m controller.evaluation.accuracy results/r13/shift/adaptive_observations.jsonl [more logs ...]
    python -m controller.evaluation.accuracy --mean results/r82/shift/adaptive_observations.jsonl

Reads observation logs, with their rotated files (`<log>.1`, ...): the controller writes one where
`loop.observation_log` is set in its config, and the bench's adaptive arm always does
(`<out>/adaptive_observations.jsonl`). A torn line (the controller still writing) is skipped. A tick counts where the window's p99
came from request traces over at least `--min-samples` requests and the planner predicted the live
configuration at the measured arrival rate (`predicted_p99_ms`: the raw simulation, before the
observed/predicted correction). Per log and model it prints the ticks counted, the median of observed /
predicted, the median and 90th percentile of |ratio - 1|, and the share of ticks within 15%. With `--mean` a tick
counts where the window completed at least `--min-samples` requests and holds both means (`mean_ms`,
`predicted_mean_ms`), traced or not.

Example: ratios 1.04, 0.95, 1.10, 1.40 -> median 1.07; |ratio - 1| 0.04, 0.05, 0.10, 0.40 -> median 0.075,
p90 0.31 (linear interpolation), within 15%: 3 of 4 = 75%.
This checks the model where it is checked every tick (the live configuration); a candidate it only predicts
is confirmed by a sweep, not here.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from ..decision_log import read_rotated

MIN_SAMPLES = 100     # a p99 from fewer traced requests is mostly its sample's noise
WITHIN = 0.15


@dataclass(frozen=True)
class Accuracy:
    ticks: int
    median_ratio: float
    median_error: float   # median |observed / predicted - 1|
    p90_error: float
    within: float         # share of ticks with |ratio - 1| <= WITHIN


def _requests(obs: dict) -> float | None:
    rate, span = obs.get("completion_rps"), obs.get("span_s")
    return rate * span if isinstance(rate, (int, float)) and isinstance(span, (int, float)) else None


def ratios(records: Iterable[dict], min_samples: int = MIN_SAMPLES, mean: bool = False) -> dict[str, list[float]]:
    """observed / predicted p99 (`mean`: mean latency) per model, from an observation log's records
    (`decision_log.read_rotated`)."""
    out: dict[str, list[float]] = {}
    for row in records:
        obs = row.get("obs")
        if not isinstance(obs, dict) or (not mean and obs.get("p99_source") != "trace"):
            continue
        if mean:
            observed, predicted, samples = obs.get("mean_ms"), obs.get("predicted_mean_ms"), _requests(obs)
        else:
            observed, predicted, samples = obs.get("p99_ms"), obs.get("predicted_p99_ms"), obs.get("p99_samples")
        if not all(isinstance(x, (int, float)) for x in (observed, predicted, samples)) or samples < min_samples:
            continue
        if not (math.isfinite(observed) and math.isfinite(predicted)) or observed <= 0 or predicted <= 0:
            continue
        out.setdefault(str(row.get("model", "?")), []).append(observed / predicted)
    return out


def summarise(values: list[float]) -> Accuracy | None:
    if not values:
        return None
    r = np.asarray(values, dtype=float)
    err = np.abs(r - 1.0)
    return Accuracy(len(r), float(np.median(r)), float(np.median(err)), float(np.percentile(err, 90)),
                    float(np.mean(err <= WITHIN + 1e-12)))


def table(paths: list[Path], min_samples: int = MIN_SAMPLES, mean: bool = False) -> str:
    what = "mean" if mean else "p99"
    lines = [f"| log | model | ticks | median observed/predicted {what} | median abs(ratio - 1) | p90 | "
             f"within {WITHIN:.0%} |", "|---|---|---:|---:|---:|---:|---:|"]
    for path in paths:
        per_model, name = ratios(read_rotated(path), min_samples, mean), str(path)
        if not per_model:
            lines.append(f"| {name} | - | 0 | - | - | - | - |")
        for model, values in sorted(per_model.items()):
            a = summarise(values)
            lines.append(f"| {name} | {model} | {a.ticks} | {a.median_ratio:.2f} | {a.median_error:.2f} | "
                         f"{a.p90_error:.2f} | {a.within:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m controller.evaluation.accuracy",
        description="the planner's predicted p99 of the live configuration against the traced p99 "
                    "(--mean: its mean against the counters' mean)")
    parser.add_argument("logs", nargs="+", type=Path, help="observation logs (JSONL)")
    parser.add_argument("--min-samples", type=int, default=MIN_SAMPLES,
                        help=f"traced requests a tick's p99 (with --mean: completed requests) needs to count "
                             f"(default {MIN_SAMPLES})")
    parser.add_argument("--mean", action="store_true",
                        help="compare mean latencies (the counters' against the predicted): the planner's check "
                             "where nothing is traced")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        print(f"error: no such observation log: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.min_samples < 1:
        print("error: --min-samples must be at least 1", file=sys.stderr)
        return 2
    print(table(args.logs, args.min_samples, args.mean))
    return 0


if __name__ == "__main__":
    sys.exit(main())
