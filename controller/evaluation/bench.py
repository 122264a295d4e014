"""The benchmark: one traffic scenario, four arms, each on its own fresh tritonserver (run by arm.py).

Every arm replays the *same* open-loop Poisson schedule (same trace, same seed), and latency is
measured from each request's scheduled send time (no coordinated omission).

Arms:
  default      Triton's defaults as shipped: 1 instance, max_queue_delay_us 0.
  best_static  the one config the sweep predicts gives the most goodput over the whole trace
               (each phase weighted by its duration; within 1% counts as a tie, and ties go to
               fewer instances, then the shorter delay).
  oracle       the best sweep config per phase (same rule), switched at each phase border by a
               background thread through the Actuator; a ramp is first cut into pieces of at most
               ORACLE_PIECE_S (`oracle_pieces`), so the oracle adds an instance where the ramp's rate
               needs it, not at the ramp's start. It knows the future: a hindsight reference, not a
               deployable policy.
  adaptive     the controller as a separate process (`python -m controller run`), starting from
               the default 1 instance / 0 us; its CPU is read from /proc/<pid>/stat.
  model_analyzer  (only with `--model-analyzer FILE`) Triton Model Analyzer's pick, found offline by
               scripts/model_analyzer.sh (model_analyzer.json), held static for the whole trace; its
               offline wall time is compared with the adaptive arm's first_good_config_s (time-to-tuned).

Predictions from the sweep (pure, see `predicted_phase_goodput`): for each config, the fraction
of offered load served within the SLA is interpolated linearly in the offered rate between the
sweep's load levels (flat beyond the lowest and highest level); a phase's predicted goodput is
the mean of rate(t) * fraction(rate(t)) over the phase, sampled every 0.5 s, so ramps and bursts
are weighed by the rates they actually offer.

Metrics (see `summarize_bench`): goodput (completions within the SLA per second of trace),
p99 per phase, failures, instance-seconds (the integral of the live instance count over the
trace, from the applied changes), reloads, goodput ratios, `reaction_s` per step change of the
offered rate, `first_good_config_s`, controller CPU, and the issue's targets with met/missed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..decision_log import read_records
from ..sweep_schema import Cell, cells_of, load_sweep
from ..types import Settings
from .arm import REQUEST_TIMEOUT_S, ArmSpec, ControllerSpec, controller_run_s, log as _log, settings_dict
from .arm import run_arm as run_shared_arm
from .inputs import InputSpec, InputSpecError, describe, make_spec
from .loadgen import Phase, Trace, client_bound, load_trace, poisson_schedule, send_lag_p99_ms, summarize

ARMS = ("default", "best_static", "oracle", "adaptive")
MA_ARM = "model_analyzer"                  # the fifth arm, run only when a model_analyzer.json is given
DEFAULT_SETTINGS = Settings(1, 0)          # Triton's defaults for sim_accel: 1 instance, no batching delay
TIE_TOLERANCE = 0.01                       # predicted goodput within 1% of the best is a tie
PREDICTION_STEP_S = 0.5                    # sampling step of rate(t) inside a phase
STEP_CHANGE_RATIO = 0.2                    # a phase border is a step if the rate jumps >= 20%
ORACLE_PIECE_S = 5.0                       # the oracle's plan cuts ramps into pieces this long (at most)
REACTION_WITHIN = 0.10                     # adaptive goodput within 10% of the oracle's ...
REACTION_HOLD_BINS = 3                     # ... for 3 consecutive 1-s bins (or until the next step)
SCHEDULE_MAX_REQUESTS = 2_000_000

TARGETS = {   # name -> (comparison, threshold), from issue 4
    "adaptive_vs_default": (">=", 2.0),
    "adaptive_vs_best_static": (">=", 0.95),
    "instance_seconds_adaptive_vs_best_static": ("<=", 0.75),
    "adaptive_vs_oracle": (">=", 0.9),
    "failed_requests_every_arm": ("==", 0),
    "max_reaction_s": ("<=", 30.0),
    "first_good_config_s": ("<=", 60.0),
    "controller_cpu_pct": ("<=", 2.0),
}


class BenchError(ValueError):
    """Bad bench input (scenario, sweep file, options); one line for the user."""


# ---------------------------------------------------------------------------------------------
# Pure: predictions and choices from sweep cells
# ---------------------------------------------------------------------------------------------
def _fraction_curves(cells: Sequence[Cell]) -> dict[Settings, tuple[np.ndarray, np.ndarray]]:
    """Per config: (load levels, fraction of offered requests served within the SLA)."""
    curves: dict[Settings, tuple[np.ndarray, np.ndarray]] = {}
    for s in sorted({c.settings for c in cells}, key=lambda s: (s.instance_count, s.max_queue_delay_us)):
        pts = sorted((c for c in cells if c.settings == s), key=lambda c: c.arrival_rps)
        xs = np.array([c.arrival_rps for c in pts], dtype=float)
        fr = np.array([min(1.0, c.goodput_rps / c.offered_rps) if c.offered_rps > 0 else 1.0 for c in pts], dtype=float)
        curves[s] = (xs, fr)
    return curves


def predicted_goodput(curve: tuple[np.ndarray, np.ndarray], rate_rps: np.ndarray | float) -> np.ndarray:
    """rate * within-SLA fraction, the fraction interpolated between levels (flat outside them).

    Example: levels 100 -> 0.99 and 300 -> 0.5; at 200 req/s the fraction is 0.745: 149 req/s.
    """
    xs, fr = curve
    rate = np.asarray(rate_rps, dtype=float)
    return rate * np.interp(rate, xs, fr)


def predicted_phase_goodput(cells: Sequence[Cell], trace: Trace, step_s: float = PREDICTION_STEP_S
                            ) -> dict[Settings, list[float]]:
    """Per config, the predicted goodput (req/s) of every phase of `trace`."""
    out: dict[Settings, list[float]] = {}
    for s, curve in _fraction_curves(cells).items():
        per_phase = []
        for p in trace.phases:
            n = max(1, int(round(p.duration_s / step_s)))
            t = p.start_s + (np.arange(n) + 0.5) * (p.duration_s / n)
            per_phase.append(float(predicted_goodput(curve, p.rates_at(t)).mean()))
        out[s] = per_phase
    return out


def pick(predicted: dict[Settings, float], tie_tolerance: float = TIE_TOLERANCE) -> Settings:
    """The config with the most predicted goodput; within `tie_tolerance` of it counts as a tie,
    and ties go to fewer instances, then the shorter delay.

    Example: {(1,0): 124.5, (2,0): 198.9, (4,0): 200.0} -> (2,0): 198.9 >= 0.99 * 200 = 198.
    """
    if not predicted:
        raise BenchError("the sweep has no cells to choose a config from")
    best = max(predicted.values())
    tied = [s for s, g in predicted.items() if g >= best * (1.0 - tie_tolerance)]
    return min(tied, key=lambda s: (s.instance_count, s.max_queue_delay_us))


def choose_best_static(cells: Sequence[Cell], trace: Trace, tie_tolerance: float = TIE_TOLERANCE
                       ) -> tuple[Settings, float]:
    """The single config with the most predicted goodput over the whole trace (phases weighted by
    duration), and that goodput in req/s."""
    per_phase = predicted_phase_goodput(cells, trace)
    total = {s: sum(g * p.duration_s for g, p in zip(gs, trace.phases)) / trace.duration_s
             for s, gs in per_phase.items()}
    best = pick(total, tie_tolerance)
    return best, total[best]


def oracle_pieces(trace: Trace, piece_s: float = ORACLE_PIECE_S) -> Trace:
    """`trace` with every ramp cut into equal pieces of at most `piece_s` (each piece a ramp between the
    rates at its ends, named `<phase>[k]`); constant and bursty phases are kept whole.

    Why: chosen per phase, the oracle provisions a ramp for its highest rate from its first second (shift's
    morning ramp 40 -> 300 req/s got 2 instances at 25 s, where one holds the SLA up to ~250 req/s, ~50 s):
    a "lag" behind that switch measured the oracle's over-provisioning, not a late controller. A burst is
    not chased: 2-4-s bursts are shorter than a reload pays off. Example: a 35-s ramp 40 -> 300 becomes 7
    pieces of 5 s, the first 40 -> 77.1, the last 262.9 -> 300.
    """
    out: list[Phase] = []
    for p in trace.phases:
        n = int(math.ceil(p.duration_s / piece_s - 1e-9))
        if p.from_rps == p.to_rps or p.burst is not None or n <= 1:
            out.append(p)
            continue
        edges = [p.start_s + k * p.duration_s / n for k in range(n + 1)]
        rates = [p.from_rps + (p.to_rps - p.from_rps) * k / n for k in range(n + 1)]   # a ramp is linear
        out.extend(Phase(f"{p.name}[{k}]", edges[k], edges[k + 1], rates[k], rates[k + 1]) for k in range(n))
    return Trace(tuple(out))


def choose_oracle(cells: Sequence[Cell], trace: Trace, tie_tolerance: float = TIE_TOLERANCE
                  ) -> list[tuple[Settings, float]]:
    """Per phase, the config with the most predicted goodput in that phase (same tie rule)."""
    per_phase = predicted_phase_goodput(cells, trace)
    plan = []
    for k in range(len(trace.phases)):
        s = pick({cfg: gs[k] for cfg, gs in per_phase.items()}, tie_tolerance)
        plan.append((s, per_phase[s][k]))
    return plan


# ---------------------------------------------------------------------------------------------
# Pure: metrics from timelines and bins
# ---------------------------------------------------------------------------------------------
def instance_seconds(events: Sequence[tuple[float, int]], duration_s: float) -> float:
    """Integral of the live instance count over [0, duration_s].

    `events` are (time, count) pairs, sorted; the first gives the count from t=0 (changes before 0
    count from 0, after duration_s not at all). Example: [(0, 1), (30, 4), (90, 2)] over 120 s
    -> 1*30 + 4*60 + 2*30 = 330.
    """
    if not events:
        return 0.0
    total = 0.0
    for k, (t, count) in enumerate(events):
        start = min(max(t, 0.0), duration_s)
        end = duration_s if k + 1 == len(events) else min(max(events[k + 1][0], 0.0), duration_s)
        total += count * max(0.0, end - start)
    return total


def step_changes(trace: Trace, min_ratio: float = STEP_CHANGE_RATIO) -> list[dict]:
    """Phase borders where the offered rate jumps by at least `min_ratio` of the larger side.

    Example: a ramp 40 -> 300 followed by a constant 300 is no step; 300 -> 380 is one
    (80 >= 0.2 * 380 = 76); 380 -> 320 is not (60 < 76).
    """
    steps = []
    for before, after in zip(trace.phases, trace.phases[1:]):
        r0 = float(before.rates_at(np.array([after.start_s - 1e-6]))[0])
        r1 = float(after.rates_at(np.array([after.start_s]))[0])
        if abs(r1 - r0) >= min_ratio * max(r0, r1) and max(r0, r1) > 0:
            steps.append({"at_s": after.start_s, "from_phase": before.name, "to_phase": after.name,
                          "from_rps": round(r0, 1), "to_rps": round(r1, 1)})
    return steps


def reaction_times(steps: Sequence[dict], adaptive_bins: Sequence[dict], oracle_bins: Sequence[dict],
                   duration_s: float, within: float = REACTION_WITHIN, hold_bins: int = REACTION_HOLD_BINS
                   ) -> list[dict]:
    """Per step: seconds from the step until the adaptive arm's per-bin goodput is within `within`
    of the oracle's (adaptive >= (1 - within) * oracle) for `hold_bins` consecutive bins, counted to
    the end of the first of them; the search stops at the next step (None if never).

    Example: step at 60 s; bins [60,61) and [61,62) at 50% of the oracle, then 95%, 92%, 99%
    -> reaction_s = 63 - 60 = 3.
    """
    out = []
    for k, step in enumerate(steps):
        stop_s = steps[k + 1]["at_s"] if k + 1 < len(steps) else duration_s
        idx = [i for i, b in enumerate(adaptive_bins) if step["at_s"] - 1e-9 <= b["start_s"] < stop_s - 1e-9]
        ok = [adaptive_bins[i]["goodput_rps"] >= (1.0 - within) * oracle_bins[i]["goodput_rps"] for i in idx]
        reaction = None
        for j in range(len(ok)):
            if all(ok[j:j + hold_bins]):
                reaction = round(adaptive_bins[idx[j]]["end_s"] - step["at_s"], 3)
                break
        out.append({**step, "reaction_s": reaction})
    return out


def scale_up_lags(adaptive_events: Sequence[dict], oracle_events: Sequence[dict], duration_s: float) -> list[dict]:
    """Per scale-up of the oracle (its instance count rising to n at t_o): seconds from t_o until the
    adaptive arm runs >= n instances (0 when it already did, negative never: being early is 0), or None
    if it never does before the oracle changes again. Also `first_up_s`, issue 10's "first scale-up within 10 s
    of the oracle's" on every rising step or ramp taken literally: seconds from t_o to the adaptive arm's first
    rise in instances (0 where it already runs >= n, or more than the oracle ran before: early), None if
    it does not rise before the oracle changes again. The two differ where the adaptive arm scales up at once
    but to fewer instances than the oracle (a batching delay or a count the sweep's 4-s cells did not credit),
    so a large `lag_s` with a small `first_up_s` is a count the oracle would not have chosen, not a late move.

    Example: the oracle goes 1 -> 2 at 25 s and 2 -> 1 at 115 s; the adaptive arm goes 1 -> 2 at 46 s:
    one lag, 21 s (first_up_s 21 too). Had it gone to 2 at 20 s: 0. Oracle 2 -> 4 at 50 s, adaptive 2 -> 3 at
    52 s and 3 -> 4 at 107 s: lag 57 s, first_up_s 2 s.
    """
    def count_at(events: Sequence[dict], t: float) -> int:
        n = events[0]["instances"]
        for e in events:
            if e["t"] <= t + 1e-9 and e.get("ok", True):
                n = e["instances"]
        return n

    ok_oracle = [e for e in oracle_events if e.get("ok", True)]
    ok_adaptive = sorted((e for e in adaptive_events if e.get("ok", True)), key=lambda e: e["t"])
    out = []
    for k, e in enumerate(ok_oracle[1:], start=1):
        before = ok_oracle[k - 1]["instances"]
        if e["instances"] <= before:
            continue
        t_o, n = max(0.0, e["t"]), e["instances"]
        until = next((x["t"] for x in ok_oracle[k + 1:] if x["instances"] != n), duration_s)
        had = count_at(ok_adaptive, t_o)
        if had >= n:
            lag = 0.0
        else:
            lag = next((round(x["t"] - t_o, 2) for x in ok_adaptive if t_o < x["t"] < until and x["instances"] >= n), None)
        if had >= n or had > before:
            first = 0.0
        else:
            first = next((round(x["t"] - t_o, 2) for x in ok_adaptive if t_o < x["t"] < until and x["instances"] > had),
                         None)
        out.append({"at_s": round(t_o, 2), "oracle_instances": n, "lag_s": lag, "first_up_s": first})
    return out


def first_good_config_s(bins: Sequence[dict], sla_ms: float) -> float | None:
    """End of the first bin with load whose p99 meets the SLA and with no failure (cold start = 0)."""
    for b in bins:
        if b["offered_rps"] > 0 and b["failed"] == 0 and b["p99_ms"] is not None and b["p99_ms"] <= sla_ms:
            return b["end_s"]
    return None


SIGNAL_MIN_RPS = 20.0          # phases and readings below this load are not judged (too few requests for a p99)
SIGNAL_TOLERANCE = 0.20        # the controller's p99 within 20% of the client's
SIGNAL_HOLD_READINGS = 3       # a step is followed once this many readings in a row are within tolerance
SIGNAL_MIN_CLIENT_REQUESTS = 50


def signal_accuracy(observations: Sequence[dict], records: Sequence, trace: Trace,
                    tolerance: float = SIGNAL_TOLERANCE, min_rps: float = SIGNAL_MIN_RPS) -> dict:
    """How well the controller's p99 reading matched what the clients saw.

    `observations` are the controller's per-tick records (`t_s`: seconds from the traffic start,
    `p99_ms`, `p99_source`, `span_s`, `arrival_rps`); `records` the load generator's. Each reading
    covers the `span_s` before it, so it is compared with the client-side p99 of the requests that
    completed in that same span (`error` = reading / client - 1). Per phase: the median reading, the
    client p99 of the whole phase, the median absolute matched error and the share of readings that
    came from traces, and, where the observations carry the planner's prediction for the live config
    (`predicted_p99_ms`), its median and median absolute error against the same client windows, raw (the
    simulation's) and as the planner applies it (times the tick's `correction`, 1.0 where none is logged). Per
    step change of the offered rate: seconds until `SIGNAL_HOLD_READINGS`
    readings in a row are within `tolerance` of the client (None: never before the next step).

    Example: a reading of 22 ms at t=50 s over a 10-s span, while the requests done in [40, 50) had
    a client p99 of 20 ms, has error +0.10.
    """
    done = np.array([r.done_s for r in records if r.ok and r.done_s is not None], dtype=float)
    lat = np.array([1000.0 * r.latency_s for r in records if r.ok and r.done_s is not None], dtype=float)
    order = np.argsort(done)
    done, lat = done[order], lat[order]

    def client_p99(t0: float, t1: float) -> tuple[float | None, int]:
        a, b = np.searchsorted(done, [t0, t1])
        sel = lat[a:b]
        return (float(np.percentile(sel, 99)) if sel.size >= SIGNAL_MIN_CLIENT_REQUESTS else None), int(sel.size)

    matched = []
    for o in observations:
        if o.get("p99_ms") is None or not o.get("span_s") or o["t_s"] < 0 or o["t_s"] > trace.duration_s:
            continue
        client, n = client_p99(o["t_s"] - o["span_s"], o["t_s"])
        if client is None or n / o["span_s"] < min_rps:
            continue
        matched.append({**o, "client_p99_ms": client, "error": o["p99_ms"] / client - 1.0})
    by_phase = {}
    for p in trace.phases:
        inside = [m for m in matched if p.start_s <= m["t_s"] < p.start_s + p.duration_s]
        client, n = client_p99(p.start_s, p.start_s + p.duration_s)
        judged = n / p.duration_s >= min_rps and bool(inside)
        errors = [abs(m["error"]) for m in inside]
        predicted = [m for m in inside if m.get("predicted_p99_ms") is not None]
        by_phase[p.name] = {
            "offered_rps": round(n / p.duration_s, 1), "readings": len(inside),
            "controller_p99_ms": _round(float(np.median([m["p99_ms"] for m in inside])) if inside else None),
            "client_p99_ms": _round(client),
            "median_abs_error": _round(float(np.median(errors)), 3) if errors else None,
            "trace_share": _round(sum(m["p99_source"] == "trace" for m in inside) / len(inside), 3) if inside else None,
            # the planner's model, checked not used: its p99 for the live config vs the clients', same seconds
            "predicted_p99_ms": _round(float(np.median([m["predicted_p99_ms"] for m in predicted]))) if predicted else None,
            "predicted_median_abs_error": _round(float(np.median([abs(m["predicted_p99_ms"] / m["client_p99_ms"] - 1)
                                                                  for m in predicted])), 3) if predicted else None,
            # ... and as the planner used it: times the correction of that tick (observed / predicted, recent windows)
            "corrected_p99_ms": _round(float(np.median([_corrected(m) for m in predicted]))) if predicted else None,
            "corrected_median_abs_error": _round(float(np.median([abs(_corrected(m) / m["client_p99_ms"] - 1)
                                                                  for m in predicted])), 3) if predicted else None,
            "within_tolerance": (float(np.median(errors)) <= tolerance) if judged else None,
        }
    follow = []
    steps = step_changes(trace)
    for k, step in enumerate(steps):
        stop_s = steps[k + 1]["at_s"] if k + 1 < len(steps) else trace.duration_s
        after = [m for m in matched if step["at_s"] <= m["t_s"] < stop_s]
        ok = [abs(m["error"]) <= tolerance for m in after]
        lag = next((round(after[j]["t_s"] - step["at_s"], 2) for j in range(len(ok))
                    if all(ok[j:j + SIGNAL_HOLD_READINGS]) and len(ok[j:j + SIGNAL_HOLD_READINGS]) == SIGNAL_HOLD_READINGS),
                   None)
        follow.append({**step, "follow_s": lag})
    busy = [o for o in observations if (o.get("arrival_rps") or 0) >= min_rps and o.get("p99_ms") is not None]
    readings = [[round(o["t_s"], 2), o["p99_ms"], o["p99_source"]] for o in observations
                if o.get("p99_ms") is not None and 0 <= o["t_s"] <= trace.duration_s]
    # (time, the simulation's p99, as the planner applied it: times the tick's correction)
    predictions = [[round(o["t_s"], 2), o["predicted_p99_ms"], round(_corrected(o), 3)] for o in observations
                   if o.get("predicted_p99_ms") is not None and 0 <= o["t_s"] <= trace.duration_s]
    return {"tolerance": tolerance, "readings_matched": len(matched), "p99_error_by_phase": by_phase,
            "readings": readings, "predictions": predictions,
            "step_follow_s": follow,
            "trace_share_busy": _round(sum(o["p99_source"] == "trace" for o in busy) / len(busy), 3) if busy else None}


def _corrected(m: dict) -> float:
    """A matched observation's predicted p99 as the planner applied it (times its correction, 1.0 if none)."""
    return m["predicted_p99_ms"] * (m.get("correction") or 1.0)


SERVER_EXEC_MIN = 20            # executions of one batch size in a phase before its mean time is reported


def server_exec_ms_by_phase(samples: Sequence[tuple[float, dict]], model: str, trace: Trace,
                            min_executions: int = SERVER_EXEC_MIN) -> dict[str, dict[str, float]]:
    """Per phase, the server's mean compute time per execution (ms) at each batch size, from the arm's
    statistics samples (`arm.StatsSampler`: seconds since the traffic start, {model: StatsCounters}).

    Why: an arm's p99 can be higher because its server ran each execution slower or because more requests
    queued; the same batch size's time, phase by phase, in every arm of one run tells the two apart.
    Each pair of consecutive samples counts in the phase holding its midpoint; a pair across a restart of
    the counters (a full reload) counts nowhere. Sizes with fewer than `min_executions` in a phase are
    left out. Example: samples at 0, 2 and 4 s, size 2 at (0, 0 ns), (100, 1.0e9 ns), (300, 3.2e9 ns), in one
    phase of 0-4 s: {"p": {"2": 10.667}} (3,200 ms over 300 executions, rounded to 3 decimals; the sizes are
    strings, as in summary.json).
    """
    from ..service import batch_deltas, counters_restarted

    sums: dict[str, dict[int, list[int]]] = {p.name: {} for p in trace.phases}
    pairs = [(a, b) for a, b in zip(samples, samples[1:]) if model in a[1] and model in b[1]]
    for (t_a, before), (t_b, after) in pairs:
        if counters_restarted(before[model], after[model]):
            continue
        mid = (t_a + t_b) / 2
        phase = next((p for p in trace.phases if p.start_s <= mid < p.end_s), None)
        if phase is None:
            continue
        for size, (executions, ns) in batch_deltas(before[model], after[model]).items():
            acc = sums[phase.name].setdefault(size, [0, 0])
            acc[0] += executions
            acc[1] += ns
    return {name: {str(size): round(ns / n / 1e6, 3) for size, (n, ns) in sorted(by_size.items()) if n >= min_executions}
            for name, by_size in sums.items()}


def _round(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def observations_for_bench(path: Path, model: str, wall0: float) -> list[dict]:
    """The controller's observation log as `signal_accuracy` wants it (times from the traffic start)."""
    out = []
    for rec in read_records(path):
        obs = rec.get("obs") or {}
        if rec.get("model") != model or not obs or obs.get("valid") is False:
            continue
        out.append({"t_s": rec["time"] - wall0, "p99_ms": obs.get("p99_ms"), "p99_source": obs.get("p99_source"),
                    "span_s": obs.get("span_s"), "arrival_rps": obs.get("arrival_rps"),
                    "predicted_p99_ms": obs.get("predicted_p99_ms"),
                    "correction": (rec.get("correction") or {}).get("x", 1.0)})
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def bench_ratios(arms: dict[str, dict]) -> dict[str, float | None]:
    """Goodput ratios of the adaptive arm to each other arm, and its instance-seconds ratio."""
    g = {name: a.get("goodput_rps") for name, a in arms.items()}
    ad = g.get("adaptive")
    return {
        "adaptive_vs_default": ratio(ad, g.get("default")),
        "adaptive_vs_best_static": ratio(ad, g.get("best_static")),
        "adaptive_vs_oracle": ratio(ad, g.get("oracle")),
        "instance_seconds_adaptive_vs_best_static": ratio(arms.get("adaptive", {}).get("instance_seconds"),
                                                          arms.get("best_static", {}).get("instance_seconds")),
        **({} if MA_ARM not in arms else {
            "adaptive_vs_model_analyzer": ratio(ad, g.get(MA_ARM)),
            "instance_seconds_adaptive_vs_model_analyzer": ratio(arms.get("adaptive", {}).get("instance_seconds"),
                                                                 arms[MA_ARM].get("instance_seconds"))}),
    }


def evaluate_targets(summary: dict) -> dict[str, dict]:
    """Each target of issue 4 with its measured value and met (True/False; None if not measured)."""
    r = summary["ratios"]
    arms = summary["arms"]
    reactions = summary.get("reaction_s") or []
    reaction_values = [x["reaction_s"] for x in reactions]
    values = {
        **{k: r.get(k) for k in ("adaptive_vs_default", "adaptive_vs_best_static",
                                 "instance_seconds_adaptive_vs_best_static", "adaptive_vs_oracle")},
        "failed_requests_every_arm": (sum(a["failed_requests"] for a in arms.values())
                                      if all(a in arms for a in ARMS) else None),
        # a step the adaptive arm never caught up with counts as infinitely slow
        "max_reaction_s": (None if "adaptive" not in arms or "oracle" not in arms else
                           (math.inf if any(v is None for v in reaction_values) else max(reaction_values, default=0.0))),
        "first_good_config_s": summary.get("first_good_config_s"),
        "controller_cpu_pct": summary.get("controller_cpu_pct"),
    }
    if "adaptive" in arms and values["first_good_config_s"] is None:
        values["first_good_config_s"] = math.inf
    out = {}
    for name, (op, threshold) in TARGETS.items():
        v = values[name]
        met = None if v is None else {">=": v >= threshold, "<=": v <= threshold, "==": v == threshold}[op]
        out[name] = {"target": f"{op} {threshold:g}", "value": (None if v is None else
                                                                 ("never" if v == math.inf else round(v, 3))),
                     "met": met}
    return out


# ---------------------------------------------------------------------------------------------
# Running the arms
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchOptions:
    scenario: Path
    out: Path
    sweep: Path | None = None
    sla_ms: float = 40.0
    model: str = "sim_accel"
    repository: Path | None = None
    arms: Sequence[str] = ARMS
    seed: int = 0
    max_instances: int = 8
    controller_interval_s: float = 1.0
    controller_window_s: float = 10.0
    instances: Sequence[int] = (1, 2, 4, 6)
    delays_us: Sequence[int] = (0, 2000)
    sweep_seconds: float = 4.0
    controller_gpu: str | None = None      # None: "simulated" for sim_accel, else "auto"
    controller_scale_down_delay_s: float | None = None   # None: the controller's default
    controller_planner: bool = True        # False: the reactive rules alone (the planner's fallback), to bench them
    controller_tracing: bool | None = None  # None: the controller's default; True/False: `tracing` forced on/off
    model_analyzer: Path | None = None     # model_analyzer.json: adds the static arm `model_analyzer` at MA's pick
    inputs: InputSpec | None = None        # --shape / --input-data (default: random values, variable dims 1)


class _OracleSwitcher(threading.Thread):
    """Applies the oracle's per-phase config at each phase border (relative to `t0`, monotonic)."""

    def __init__(self, grpc_url: str, http_url: str, model: str, plan: list[tuple[float, Settings]], t0: float):
        super().__init__(daemon=True, name="oracle-switcher")
        from ..actuation import Actuator, TritonControl
        self.control = TritonControl(grpc_url, http_url)
        self.actuator = Actuator(self.control)
        self.model, self.plan, self.t0 = model, plan, t0
        self.events: list[dict] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            for at_s, target in self.plan:
                if self.stop_event.wait(max(0.0, self.t0 + at_s - time.monotonic())):
                    return
                result = self.actuator.apply(self.model, target)
                if result.kind == "none" and result.ok:
                    continue
                self.events.append({"t": round(time.monotonic() - self.t0, 3), "asked_at": at_s,
                                    "instances": (result.live or target).instance_count,
                                    "delay_us": (result.live or target).max_queue_delay_us,
                                    "kind": result.kind, "ok": result.ok, "apply_s": round(result.seconds, 2),
                                    "error": result.error or None})
        finally:
            self.control.close()

    def stop(self) -> list[dict]:
        """Stop switching (a change under way finishes first) and return the changes made."""
        self.stop_event.set()
        self.join(timeout=REQUEST_TIMEOUT_S * 3)
        return self.events


def _controller_spec(opts: BenchOptions, trace: Trace) -> ControllerSpec:
    limits = {"p99_target_ms": opts.sla_ms, "max_instances": opts.max_instances}
    if opts.controller_scale_down_delay_s is not None:
        limits["scale_down_delay_s"] = opts.controller_scale_down_delay_s
    return ControllerSpec(
        settings={"interval_s": opts.controller_interval_s, "window_s": opts.controller_window_s,
                  "gpu": opts.controller_gpu or ("simulated" if opts.model == "sim_accel" else "auto"),
                  "planner": opts.controller_planner,
                  **({} if opts.controller_tracing is None else {"tracing": opts.controller_tracing})},
        models={opts.model: limits}, observation_log=True,
        duration_s=controller_run_s(trace.duration_s))


def load_model_analyzer(path: Path, model: str, sla_ms: float) -> tuple[Settings, dict]:
    """MA's pick from model_analyzer.json, checked against the bench's model and SLA (BenchError if not usable)."""
    from .model_analyzer import ModelAnalyzerError, load_pick

    try:
        pick, doc = load_pick(path)
    except ModelAnalyzerError as e:
        raise BenchError(str(e)) from None
    if doc.get("model", model) != model:
        raise BenchError(f"{path} is Model Analyzer's pick for model {doc['model']!r}, the bench runs {model!r}")
    if doc.get("sla_ms") is not None and abs(float(doc["sla_ms"]) - sla_ms) > 1e-9:
        raise BenchError(f"{path} was searched under a {doc['sla_ms']:g} ms p99 constraint, the bench asks "
                         f"{sla_ms:g} ms: rerun scripts/model_analyzer.sh with SLA_MS={sla_ms:g}")
    return pick, doc


def run_arm(arm: str, trace: Trace, schedule: np.ndarray, opts: BenchOptions, initial: Settings,
            oracle_plan: list[tuple[float, Settings]] | None = None) -> dict:
    """Run one arm on its own fresh server (controller/evaluation/arm.py); return its records, change
    events and extras."""
    def start_switcher(server, t0: float) -> _OracleSwitcher:
        switcher = _OracleSwitcher(server.grpc_url, server.http_url, opts.model, oracle_plan[1:], t0)
        switcher.start()
        return switcher

    run = run_shared_arm(ArmSpec(arm, [opts.model], {opts.model: initial}, {opts.model: schedule}, opts.out,
                                 repository=opts.repository, inputs={opts.model: opts.inputs},
                                 helper=start_switcher if arm == "oracle" and oracle_plan else None,
                                 controller=_controller_spec(opts, trace) if arm == "adaptive" else None))
    events = [{"t": 0.0, "instances": initial.instance_count, "delay_us": initial.max_queue_delay_us,
               "kind": "initial"}] + run.helper_events
    extra: dict = {}
    if run.controller is not None:
        events += [{k: c[k] for k in ("t", "instances", "delay_us", "kind", "reason", "apply_s")}
                   for c in run.applied_changes()]
        reasons: dict[str, int] = {}
        modes: dict[str, int] = {}          # who decided each logged record: model | reactive | fallback | arbiter
        for rec in run.decisions:
            reasons[rec.get("reason", "?")] = reasons.get(rec.get("reason", "?"), 0) + 1
            modes[rec.get("mode", "-")] = modes.get(rec.get("mode", "-"), 0) + 1
        extra["controller_settings"] = {"controller": run.controller_doc["controller"],
                                        "model": run.controller_doc["models"][opts.model]}
        extra["controller_observations"] = observations_for_bench(run.observation_log, opts.model, run.wall0)
        extra["controller"] = {**run.controller, "decision_records": len(run.decisions), "reasons_logged": reasons,
                               "modes_logged": modes}
    events.sort(key=lambda e: e["t"])
    extra["live_at_end"] = settings_dict(run.live_at_end[opts.model])
    extra["server_exec_ms_by_phase"] = server_exec_ms_by_phase(run.stats_samples, opts.model, trace)
    extra.update(server_start_s=run.server_start_s, traffic_s=run.traffic_s, server_restarts=run.server_restarts)
    return {"records": run.records[opts.model], "events": events, "extra": extra}


def arm_summary(arm: str, run: dict, trace: Trace, sla_ms: float) -> tuple[dict, list[dict]]:
    """(the arm's summary entry, its per-bin dicts)."""
    s = summarize(run["records"], trace, sla_ms, bin_s=1.0)
    events = run["events"]
    changes = [e for e in events if e["kind"] not in ("initial", "none")]
    applied = [e for e in changes if e.get("ok", True)]
    entry = {
        "goodput_rps": s.totals.goodput_rps,
        "requests": s.totals.requests,
        "failed_requests": s.totals.failed,
        "server_restarts": len(run["extra"].get("server_restarts") or []),   # the server died and was started again
        "errors": s.totals.errors,
        "p99_ms": _p99_all(run["records"]),
        "client_lag_p99_ms": send_lag_p99_ms(run["records"]),    # the load generator's own lateness (loadgen)
        "p99_ms_by_phase": {p.name: p.p99_ms for p in s.phases},
        "goodput_rps_by_phase": {p.name: p.goodput_rps for p in s.phases},
        "instance_seconds": instance_seconds([(e["t"], e["instances"]) for e in events if e.get("ok", True)],
                                             trace.duration_s),
        "reloads": len(applied),
        "full_reloads": sum(1 for e in applied if e["kind"] == "full_reload"),
        "instance_updates": sum(1 for e in applied if e["kind"] == "in_place"),
        "failed_changes": sum(1 for e in changes if not e.get("ok", True)),
        "changes": events,
        **run["extra"],
    }
    entry["mean_instances"] = entry["instance_seconds"] / trace.duration_s
    observations = entry.pop("controller_observations", None)
    if observations is not None:
        entry["signal"] = signal_accuracy(observations, run["records"], trace)
    return entry, [dataclasses.asdict(b) for b in s.bins]


def _p99_all(records) -> float | None:
    ms = np.array([1000.0 * r.latency_s for r in records if r.ok], dtype=float)
    return float(np.percentile(ms, 99)) if ms.size else None


def summarize_bench(arms: dict[str, dict], bins: dict[str, list[dict]], trace: Trace, sla_ms: float) -> dict:
    """ratios, reaction_s, first_good_config_s, controller CPU and targets over the arms run."""
    summary: dict = {"arms": arms, "ratios": bench_ratios(arms)}
    steps = step_changes(trace)
    if "adaptive" in bins and "oracle" in bins:
        summary["reaction_s"] = reaction_times(steps, bins["adaptive"], bins["oracle"], trace.duration_s)
    else:
        summary["reaction_s"] = [{**s, "reaction_s": None} for s in steps]
    if "adaptive" in arms and "oracle" in arms:
        summary["scale_up_lag_s"] = scale_up_lags(arms["adaptive"]["changes"], arms["oracle"]["changes"],
                                                  trace.duration_s)
    summary["first_good_config_s"] = first_good_config_s(bins["adaptive"], sla_ms) if "adaptive" in bins else None
    summary["controller_cpu_pct"] = arms.get("adaptive", {}).get("controller", {}).get("cpu_pct")
    summary["targets"] = evaluate_targets(summary)
    if "signal" in arms.get("adaptive", {}):
        summary["signal"] = arms["adaptive"]["signal"]
        summary["signal_targets"] = evaluate_signal_targets(summary["signal"])
    return summary


def evaluate_signal_targets(signal_doc: dict) -> dict[str, dict]:
    """Issue 9's targets for the controller's latency reading (met: True/False; None if not measured)."""
    judged = [v["within_tolerance"] for v in signal_doc["p99_error_by_phase"].values() if v["within_tolerance"] is not None]
    follows = [f["follow_s"] for f in signal_doc["step_follow_s"]]
    worst_follow = None if not follows else (math.inf if any(f is None for f in follows) else max(follows))
    share = signal_doc.get("trace_share_busy")
    return {
        "p99_within_20pct_every_busy_phase": {"value": f"{sum(judged)}/{len(judged)}",
                                              "met": all(judged) if judged else None},
        "max_step_follow_s": {"target": "<= 10", "value": "never" if worst_follow == math.inf else worst_follow,
                              "met": None if worst_follow is None else worst_follow <= 10},
        "trace_share_busy": {"target": ">= 0.9", "value": share, "met": None if share is None else share >= 0.9},
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else ("never" if x == "never" else fmt.format(x))


def server_exec_lines(arms: dict[str, dict], w: int = 12) -> list[str]:
    """The server's ms per execution at batch sizes 1 and 2, per phase and arm ('-': too few executions)."""
    lines = []
    for size in (1, 2):
        rows = [(name, a.get("server_exec_ms_by_phase") or {}) for name, a in arms.items()]
        if not any(str(size) in by_size for _, phases in rows for by_size in phases.values()):
            continue
        lines.append(f"server ms per execution of {size} (per phase):")
        for name, phases in rows:
            lines.append(f"  {name:<{w}} " + ", ".join(f"{ph} {_f(by_size.get(str(size)), '{:.2f}')}"
                                                        for ph, by_size in phases.items()))
    return lines


def format_summary(summary: dict) -> str:
    w = max([12] + [len(n) for n in summary["arms"]])       # model_analyzer is 14 characters
    lines = [f"{'arm':<{w}} {'goodput/s':>9} {'p99_ms':>8} {'worst phase p99':>16} {'failed':>6} "
             f"{'inst-s':>8} {'mean inst':>9} {'reloads':>8}"]
    for name, a in summary["arms"].items():
        worst = max(((v, k) for k, v in a["p99_ms_by_phase"].items() if v is not None), default=(None, ""))
        lines.append(f"{name:<{w}} {a['goodput_rps']:>9.1f} {_f(a['p99_ms']):>8} "
                     f"{(_f(worst[0]) + ' ' + worst[1])[:16]:>16} {a['failed_requests']:>6} "
                     f"{a['instance_seconds']:>8.0f} {a['mean_instances']:>9.2f} "
                     f"{a['reloads']:>3} ({a['full_reloads']}f)")
    lines.append("ratios: " + ", ".join(f"{k} {_f(v, '{:.3f}')}" for k, v in summary["ratios"].items()))
    measured = "adaptive" in summary["arms"] and "oracle" in summary["arms"]
    lines.append("reaction_s: " + ("not measured (needs the adaptive and oracle arms)" if not measured else ", ".join(f"{r['from_phase']}->{r['to_phase']} ({r['from_rps']:g}->{r['to_rps']:g}/s) "
                                             f"{_f(r['reaction_s'], '{:.0f}') if r['reaction_s'] is not None else 'never'}"
                                             for r in summary["reaction_s"]) or "no step changes"))
    if summary.get("scale_up_lag_s") is not None:
        lines.append("scale-up lag behind the oracle (s): " + (", ".join(
            f"at {x['at_s']:g} s to {x['oracle_instances']} inst: {_f(x['lag_s'], '{:.0f}') if x['lag_s'] is not None else 'never'}"
            + (f" (first scale-up {_f(x['first_up_s'], '{:.0f}') if x['first_up_s'] is not None else 'never'})"
               if "first_up_s" in x and x["first_up_s"] != x["lag_s"] else "")
            for x in summary["scale_up_lag_s"]) or "the oracle never scales up"))
    lines.extend(server_exec_lines(summary["arms"], w))
    for name, a in summary["arms"].items():
        if client_bound(a.get("client_lag_p99_ms"), a.get("p99_ms")):
            lines.append(f"warning: arm {name}: the client sent up to {a['client_lag_p99_ms']:.1f} ms (p99) behind "
                         f"its schedule, a large part of its p99 of {a['p99_ms']:.1f} ms: its latencies are partly the "
                         "load generator's (run the bench where a core is free, or lower the scenario's rates)")
    lines.append(f"first_good_config_s: {_f(summary['first_good_config_s'], '{:.0f}')}, "
                 f"controller_cpu_pct: {_f(summary['controller_cpu_pct'], '{:.2f}')}")
    if summary.get("model_analyzer"):
        from .model_analyzer import model_analyzer_lines
        lines.extend(model_analyzer_lines(summary))
    if summary.get("signal"):
        lines.append("controller p99 reading vs client p99 (median |error| per phase, trace share): " + ", ".join(
            f"{k} {_f(v['controller_p99_ms'])}/{_f(v['client_p99_ms'])} ms "
            f"{_f(v['median_abs_error'], '{:.0%}')} {_f(v['trace_share'], '{:.0%}')}"
            for k, v in summary["signal"]["p99_error_by_phase"].items()))
        phases = {k: v for k, v in summary["signal"]["p99_error_by_phase"].items() if v.get("predicted_p99_ms") is not None}
        if phases:
            lines.append("planner's p99 for the live config, raw / as applied (x its correction) / client, ms: " + ", ".join(
                f"{k} {_f(v['predicted_p99_ms'])}/{_f(v.get('corrected_p99_ms'))}/{_f(v['client_p99_ms'])}"
                for k, v in phases.items()))
        for name, t in summary["signal_targets"].items():
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            lines.append(f"  signal {name:<35} {t.get('target', ''):>8}  value {t['value']!s:>8}  {verdict}")
    lines.append("targets:")
    for name, t in summary["targets"].items():
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = t["value"] if isinstance(t["value"], str) else _f(t["value"], "{:.3g}")
        lines.append(f"  {name:<42} {t['target']:>8}  value {value:>8}  {verdict}")
    return "\n".join(lines)


def plot_timeline(trace: Trace, summary: dict, bins: dict[str, list[dict]], path: Path, sla_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"default": "tab:gray", "best_static": "tab:blue", "oracle": "tab:green", "adaptive": "tab:red",
              MA_ARM: "tab:purple"}
    fig, axes = plt.subplots(5, 1, figsize=(11, 12), sharex=True)
    t_fine = np.linspace(0, trace.duration_s, 2000, endpoint=False)
    axes[0].plot(t_fine, [trace.rate_at(t) for t in t_fine], color="black", linewidth=1, label="trace rate")
    first = next(iter(bins.values()))
    axes[0].step([b["start_s"] for b in first] + [first[-1]["end_s"]],
                 [b["offered_rps"] for b in first] + [first[-1]["offered_rps"]], where="post",
                 color="tab:orange", linewidth=0.8, label="offered (per 1-s bin)")
    for p in trace.phases[1:]:
        for ax in axes:
            ax.axvline(p.start_s, color="black", alpha=0.15, linewidth=0.8)
    for name, bs in bins.items():
        c = colors.get(name)
        xs = [b["start_s"] for b in bs] + [bs[-1]["end_s"]]     # the last bin drawn to its end
        good = [b["goodput_rps"] for b in bs]
        p99 = [b["p99_ms"] if b["p99_ms"] is not None else np.nan for b in bs]
        axes[1].step(xs, good + good[-1:], where="post", color=c, linewidth=1, label=name)
        axes[2].step(xs, p99 + p99[-1:], where="post", color=c, linewidth=1, label=name)
        ev = [e for e in summary["arms"][name]["changes"] if e.get("ok", True)]
        tx = [max(0.0, e["t"]) for e in ev] + [trace.duration_s]
        axes[3].step(tx, [e["instances"] for e in ev] + [ev[-1]["instances"]], where="post", color=c, label=name)
        axes[4].step(tx, [e["delay_us"] for e in ev] + [ev[-1]["delay_us"]], where="post", color=c, label=name)
    readings = (summary.get("signal") or {}).get("readings") or []
    if readings:
        axes[2].plot([r[0] for r in readings], [r[1] for r in readings], ".", color="black", markersize=3,
                     label="controller's p99 reading (adaptive)")
    predictions = (summary.get("signal") or {}).get("predictions") or []
    if predictions:
        applied = [r for r in predictions if len(r) > 2]       # summaries before the correction was logged: raw only
        if applied:
            axes[2].plot([r[0] for r in predictions], [r[1] for r in predictions], ".", color="tab:purple", alpha=0.35,
                         markersize=2, label="planner's p99, live config, raw (adaptive)")
        axes[2].plot([r[0] for r in (applied or predictions)], [r[-1] for r in (applied or predictions)], "x",
                     color="tab:purple", markersize=3,
                     label="planner's p99, live config, x its correction (adaptive)" if applied
                     else "planner's predicted p99, live config (adaptive)")
    axes[2].axhline(sla_ms, color="red", linestyle=":", linewidth=1, label=f"SLA {sla_ms:g} ms")
    axes[2].set_yscale("log")
    titles = ["offered rate (req/s)", "goodput (req/s within SLA)", "p99 (ms, per 1-s bin)", "instances",
              "max_queue_delay_us"]
    for ax, title in zip(axes, titles):
        ax.set_ylabel(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=5)
    axes[-1].set_xlabel("time (s)")
    r = summary["ratios"]
    prefix = "SIMULATED accelerator (sim_accel): " if summary.get("model") == "sim_accel" else ""
    axes[0].set_title(prefix + f"adaptive/default {_f(r['adaptive_vs_default'], '{:.2f}')}, "
                        f"adaptive/best_static {_f(r['adaptive_vs_best_static'], '{:.2f}')}, "
                        f"adaptive/oracle {_f(r['adaptive_vs_oracle'], '{:.2f}')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------
def bench(opts: BenchOptions) -> dict:
    """Run the arms of `opts` and write summary.json and timeline.png under opts.out."""
    from .loadgen import TraceError
    from .sweep import rates_from_trace, run_sweep, write_sweep

    try:
        trace = load_trace(opts.scenario)
    except TraceError as e:
        raise BenchError(f"scenario: {e}") from None
    opts.out.mkdir(parents=True, exist_ok=True)
    need_sweep = any(a in ("best_static", "oracle") for a in opts.arms)
    sweep_path = opts.sweep
    cells: list[Cell] = []
    if need_sweep:
        if sweep_path is None:
            rates = rates_from_trace(trace)
            _log(f"no --sweep given: sweeping {list(opts.instances)} instances x {list(opts.delays_us)} us x {rates} req/s")
            doc = run_sweep(opts.model, opts.instances, opts.delays_us, rates, seconds=opts.sweep_seconds,
                            sla_ms=opts.sla_ms, seed=opts.seed, repository=opts.repository, inputs=opts.inputs)
            sweep_path = write_sweep(doc, opts.out)
        try:
            doc = load_sweep(sweep_path)
            cells = cells_of(doc)
        except ValueError as e:
            raise BenchError(str(e)) from None
        if abs(float(doc.get("sla_ms", opts.sla_ms)) - opts.sla_ms) > 1e-9:
            raise BenchError(f"the sweep {sweep_path} was measured against a {doc['sla_ms']:g} ms SLA, the bench asks "
                             f"{opts.sla_ms:g} ms: rerun the sweep or pass --sla-ms {doc['sla_ms']:g}")
        if doc.get("model", opts.model) != opts.model:
            raise BenchError(f"the sweep {sweep_path} is of model {doc['model']!r}, the bench runs {opts.model!r}")
        if doc.get("inputs", {"random": True}) != describe(opts.inputs):
            _log(f"warning: the sweep {sweep_path} sent inputs {doc.get('inputs', {'random': True})}, the bench sends "
                 f"{describe(opts.inputs)}: its best_static and oracle may not fit these requests")
    ma_pick, ma_doc = (None, None)
    if opts.model_analyzer is not None:
        ma_pick, ma_doc = load_model_analyzer(opts.model_analyzer, opts.model, opts.sla_ms)
        _log(f"model_analyzer: {ma_pick.instance_count} inst, {ma_pick.max_queue_delay_us} us "
             f"(Model Analyzer's pick, {ma_doc['wall_s']:.0f} s offline)")
    best_static = choose_best_static(cells, trace) if cells else None
    pieces = oracle_pieces(trace)
    oracle = choose_oracle(cells, pieces) if cells else None
    schedule = poisson_schedule(trace, opts.seed, SCHEDULE_MAX_REQUESTS)
    _log(f"scenario {opts.scenario}: {len(trace.phases)} phases, {trace.duration_s:g} s, {len(schedule)} requests "
         f"(seed {opts.seed}), SLA p99 <= {opts.sla_ms:g} ms")
    if best_static:
        _log(f"best_static: {best_static[0].instance_count} inst, {best_static[0].max_queue_delay_us} us "
             f"(predicted goodput {best_static[1]:.1f}/s)")
    if oracle:
        _log("oracle plan: " + ", ".join(f"{p.name}={s.instance_count}/{s.max_queue_delay_us}"
                                         for p, (s, _) in zip(pieces.phases, oracle)))
    arms: dict[str, dict] = {}
    bins: dict[str, list[dict]] = {}
    arms_dir = opts.out / "arms"
    arms_dir.mkdir(exist_ok=True)
    for arm in [a for a in ARMS if a in opts.arms] + ([MA_ARM] if ma_pick is not None else []):
        t = time.monotonic()
        _log(f"arm {arm}: starting a fresh server ...")
        if arm == "best_static":
            run = run_arm(arm, trace, schedule, opts, best_static[0])
        elif arm == "oracle":
            plan = [(p.start_s, s) for p, (s, _) in zip(pieces.phases, oracle)]
            run = run_arm(arm, trace, schedule, opts, plan[0][1], oracle_plan=plan)
        elif arm == MA_ARM:
            run = run_arm(arm, trace, schedule, opts, ma_pick)
        else:
            run = run_arm(arm, trace, schedule, opts, DEFAULT_SETTINGS)
        arms[arm], bins[arm] = arm_summary(arm, run, trace, opts.sla_ms)
        (arms_dir / f"{arm}.json").write_text(json.dumps({"summary": arms[arm], "bins": bins[arm]}, indent=1))
        died = arms[arm]["server_restarts"]
        _log(f"arm {arm}: goodput {arms[arm]['goodput_rps']:.1f}/s, failed {arms[arm]['failed_requests']}, "
             f"{arms[arm]['instance_seconds']:.0f} instance-s, {arms[arm]['reloads']} change(s) "
             f"({time.monotonic() - t:.0f} s)" + (f"; its server DIED and was started again {died} time(s)" if died
                                                  else ""))
    summary = {"scenario": str(opts.scenario), "model": opts.model, "sla_ms": opts.sla_ms, "seed": opts.seed,
               "duration_s": trace.duration_s, "requests": int(len(schedule)),
               "controller": {"planner": opts.controller_planner,
                              "tracing": "auto" if opts.controller_tracing is None else opts.controller_tracing},
               "sweep": None if sweep_path is None else str(sweep_path),
               "best_static": None if not best_static else {
                   "instances": best_static[0].instance_count, "delay_us": best_static[0].max_queue_delay_us,
                   "predicted_goodput_rps": round(best_static[1], 2)},
               "oracle_plan": None if not oracle else [
                   {"phase": p.name, "start_s": p.start_s, "instances": s.instance_count,
                    "delay_us": s.max_queue_delay_us, "predicted_goodput_rps": round(g, 2)}
                   for p, (s, g) in zip(pieces.phases, oracle)],
               **summarize_bench(arms, bins, trace, opts.sla_ms)}
    if ma_doc is not None:
        from .model_analyzer import summary_entry
        summary.update(summary_entry(ma_doc, str(opts.model_analyzer)))
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_timeline(trace, summary, bins, opts.out / "timeline.png", opts.sla_ms)
    return summary


def run_bench(args) -> int:
    """The `bench` verb: options from argparse, the table on stdout."""
    for p in (args.scenario, args.sweep, getattr(args, "model_analyzer", None)):
        if p is not None and not Path(p).is_file():
            raise BenchError(f"{p}: no such file")
    try:
        inputs = make_spec(getattr(args, "shape", ()), getattr(args, "input_data", None), getattr(args, "batch_size", 1))
    except InputSpecError as e:
        raise BenchError(str(e)) from None
    opts = BenchOptions(scenario=args.scenario, out=args.out, sweep=args.sweep, sla_ms=args.sla_ms, model=args.model,
                        repository=args.repository, arms=args.arms or ARMS, seed=args.seed,
                        max_instances=args.max_instances, controller_interval_s=args.controller_interval_s,
                        controller_window_s=args.controller_window_s, instances=args.instances,
                        delays_us=args.delays_us, sweep_seconds=args.sweep_seconds,
                        controller_gpu=args.controller_gpu,
                        controller_scale_down_delay_s=args.controller_scale_down_delay_s,
                        controller_planner=getattr(args, "controller_planner", "on") == "on",
                        controller_tracing={"on": True, "off": False}.get(getattr(args, "controller_tracing", "auto")),
                        model_analyzer=getattr(args, "model_analyzer", None), inputs=inputs)
    try:
        summary = bench(opts)
    except InputSpecError as e:
        raise BenchError(str(e)) from None
    print(format_summary(summary))
    print(f"wrote {opts.out / 'summary.json'} and {opts.out / 'timeline.png'}")
    return 0
