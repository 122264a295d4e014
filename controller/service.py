"""Service time per batch size: how long one execution of `b` items takes, per live configuration.

Triton's `batch_stats` (`signals.BatchStat`) count each execution once, per batch size, with its
compute_input/infer/output nanoseconds. The difference between two scrapes gives, for every size
`b` that ran in between, (executions, mean ms). A line fitted to those means,

    s(b) = alpha + beta * b        (ms of compute for one execution of a batch of b)

weighted by the executions, is the model's service curve: `alpha` the fixed cost of an execution
(launch, copies, framework), `beta` the cost of one more item. It is what batching buys: b items
cost alpha + beta*b together instead of b*(alpha + beta) one by one.

Two layers, both pure (no I/O, no clock: the caller passes the time):

* `fit_service`: weighted least squares over `{b: (executions, mean ms)}`, with alpha and beta
  kept >= 0;
* `ServiceTimes` (one per managed model): turns the model's cumulative statistics, one sample
  per tick, into per-size sums per configuration (`Settings`), because instances on one device
  contend and s(b) grows with the instance count, so every configuration has its own curve.

Counter restarts (a full reload, a server restart) and configuration changes never put a wrong
or negative interval into the sums: such an interval is dropped and the sample that ends it
becomes the new baseline. The first executions after such a baseline are left out as well
(`SETTLE_EXECUTIONS` per instance): they hold the new instances' cold start.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .signals import BatchStat, ModelCounters, StatsCounters
from .traces import COMPUTE_PROBS
from .types import Settings

MIN_EXECUTIONS = 20         # fewer executions of a configuration than this: no fit
HALF_LIFE_S = 600.0         # data of a configuration loses half its weight per 10 min of newer data
MAX_CONFIGS = 32            # configurations kept per model; the least recently fed goes first
MAX_SIZES = 1024            # batch sizes kept per configuration (Triton's max_batch_size is far lower)
MIN_WEIGHT = 0.01           # a size whose decayed executions fall below this is forgotten
SETTLE_EXECUTIONS = 25      # per instance: executions after a change, restart or gap that the sums leave out
COLD_START_EXECUTIONS = 25  # a settle whose left-out executions took this many executions' worth more than the curve
COLD_START_RATIO = 1.25     # ... and this many times the curve's time for them
COLD_START_SETTLES = 2      # ... in this many of the last COLD_START_KEPT settles: the model starts cold
COLD_START_ONE = 50         # ... or in one whose excess is this many executions' worth (a load's own settle)
COLD_START_KEPT = 8
SEED_SPAN_S = 5.0           # after a restart of the counters this recent, a settle's reading holds all since the load
COLD_SETTLE_MARGIN = 1.5    # a settle also lasts this many times the longest cold start per instance read lately
SETTLE_MAX_S = 60.0         # ... but no longer than this (executing) (why: one long stall must not blind the curve)


@dataclass(frozen=True)
class ServiceFit:
    """The service curve s(b) = alpha_ms + beta_ms * b of one configuration, and what it rests on.

    `batch_sizes` maps each size seen to (executions, mean ms of compute per execution);
    `executions` is their sum. Executions are weights: whole counts unless old data has been
    decayed (`ServiceTimes(half_life_s=...)`), then fractional.

    `r2` is the weighted coefficient of determination of the per-size *means* (weights =
    executions): 1 - sum n_b (m_b - s(b))^2 / sum n_b (m_b - mean)^2. It says how straight the
    curve is, not how much single executions scatter around it. It is 1.0 when every mean is
    the same (a flat line fits them exactly) and lies in [0, 1] (see `fit_service`).

    With a single size seen the slope is unknown: `alpha_ms`, `beta_ms` and `r2` are None, and
    `predict_ms` gives a bound that never promises a saving from batching (see there).
    """

    alpha_ms: float | None
    beta_ms: float | None
    r2: float | None
    executions: float
    batch_sizes: dict[int, tuple[float, float]]

    def summary(self) -> dict[str, Any]:
        """JSON-ready, rounded: {"alpha_ms", "beta_ms", "r2", "executions", "sizes"}."""
        return {"alpha_ms": _rounded(self.alpha_ms), "beta_ms": _rounded(self.beta_ms), "r2": _rounded(self.r2),
                "executions": round(self.executions), "sizes": sorted(self.batch_sizes)}

    def predict_ms(self, b: float) -> float:
        """Compute time of one execution of a batch of `b` (a negative `b` counts as 0).

        Example: alpha 6, beta 1.5 -> predict_ms(4) = 12.0. With one size seen, say 9 ms at
        b=2: predict_ms(1) = 9.0 and predict_ms(4) = 18.0. Both are upper bounds whenever the
        true curve has alpha, beta >= 0 (a smaller batch costs no more; a larger one costs at
        most proportionally more), so an unknown slope never reads as cheap batching.
        """
        b = max(0.0, b)
        if self.alpha_ms is None or self.beta_ms is None:
            (size, (_, mean_ms)), = self.batch_sizes.items()
            return mean_ms * max(1.0, b / size)
        return self.alpha_ms + self.beta_ms * b


def _usable_point(b: Any, point: Any) -> tuple[float, float] | None:
    """(executions, mean ms) if `b` is a size >= 1, executions finite > 0 and the mean finite >= 0."""
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        return None
    if not isinstance(point, (tuple, list)) or len(point) != 2:
        return None
    n, mean_ms = point
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in (n, mean_ms)):
        return None
    return (float(n), float(mean_ms)) if n > 0 and mean_ms >= 0 else None


def _sq(x: float) -> float:
    return x * x  # why: float ** 2 raises OverflowError where x * x gives inf (caught below)


def _sse(points: dict[int, tuple[float, float]], alpha: float, beta: float) -> float:
    return sum(n * _sq(m - alpha - beta * b) for b, (n, m) in points.items())


def fit_service(points: Mapping[int, tuple[float, float]]) -> ServiceFit | None:
    """Fit s(b) = alpha + beta*b to `{b: (executions, mean ms)}` by least squares weighted by executions.

    Worked example: {1: (30, 8.0), 2: (20, 9.0), 4: (10, 13.0)}: N = 60 executions, weighted mean
    size 110/60 = 1.833, mean time 550/60 = 9.167 ms; Sxx = sum n(b - 1.833)^2 = 68.33,
    Sxy = sum n(b - 1.833)(m - 9.167) = 111.67, so beta = 111.67/68.33 = 1.634 ms per item and
    alpha = 9.167 - 1.634 * 1.833 = 6.171 ms; residuals give SSE 5.85 against SST 188.3, r2 = 0.969.

    The fit is constrained to alpha >= 0 and beta >= 0 (a negative fixed cost, or a batch that
    gets cheaper with more items, is noise). When the free line breaks a constraint, the
    optimum lies on the boundary: the better (smaller weighted SSE) of the flat line at the
    weighted mean and the line through the origin (beta = sum n b m / sum n b^2). Example:
    {2: (10, 2.0), 4: (10, 6.0)} is free 2b - 2; through the origin beta = 280/200 = 1.4 (SSE 8)
    beats flat 4.0 (SSE 80): alpha 0, beta 1.4, r2 = 1 - 8/80 = 0.9. As the flat line is a
    candidate and its SSE is the total SS, r2 is never below 0.

    Points with a size below 1, no executions, or a mean that is negative or not finite are
    ignored. No usable point (or sums that overflow) gives None; one size gives a fit with
    alpha, beta and r2 None. Never raises.
    """
    usable: dict[int, tuple[float, float]] = {}
    for b, point in (points.items() if isinstance(points, Mapping) else ()):
        cleaned = _usable_point(b, point)
        if cleaned is not None:
            usable[b] = cleaned
    if not usable:
        return None
    total = sum(n for n, _ in usable.values())
    if len(usable) == 1:
        # why: one size says nothing about the slope; predict_ms then bounds from that size alone
        return ServiceFit(None, None, None, total, usable) if math.isfinite(total) else None
    b_mean = sum(n * b for b, (n, _) in usable.items()) / total
    y_mean = sum(n * m for n, m in usable.values()) / total
    sxx = sum(n * _sq(b - b_mean) for b, (n, _) in usable.items())
    sxy = sum(n * (b - b_mean) * (m - y_mean) for b, (n, m) in usable.items())
    sst = sum(n * _sq(m - y_mean) for n, m in usable.values())
    beta = sxy / sxx if sxx > 0 else 0.0
    alpha = y_mean - beta * b_mean
    if alpha < 0 or beta < 0:
        sbb = sum(n * b * b for b, (n, _) in usable.items())
        through_origin = (0.0, sum(n * b * m for b, (n, m) in usable.items()) / sbb if sbb > 0 else 0.0)
        flat = (y_mean, 0.0)
        alpha, beta = min(flat, through_origin, key=lambda line: _sse(usable, *line))
    sse = _sse(usable, alpha, beta)
    # why: equal means leave no variance to explain; the (flat) fit through them is exact
    r2 = 1.0 if sst <= 1e-12 * total * _sq(max(y_mean, 1e-12)) else max(0.0, 1.0 - sse / sst)
    if not all(math.isfinite(v) for v in (alpha, beta, r2, total)):
        return None  # why: absurd inputs overflow the sums; no fit is better than an inf one
    return ServiceFit(max(0.0, alpha), max(0.0, beta), r2, total, usable)


# ---------------------------------------------------------------------------------
# Accumulating one model's statistics
# ---------------------------------------------------------------------------------

_SCALAR_COUNTERS = ("inference_count", "execution_count", "success_count", "success_ns", "fail_count", "fail_ns",
                    "queue_count", "queue_ns", "compute_input_count", "compute_input_ns", "compute_infer_count",
                    "compute_infer_ns", "compute_output_count", "compute_output_ns")
_BATCH_COUNTERS = ("executions", "compute_input_ns", "compute_infer_ns", "compute_output_ns")
_NO_EXECUTION = BatchStat(0, 0, 0, 0)


def counters_restarted(before: StatsCounters, after: StatsCounters) -> bool:
    """True if any cumulative counter went down between two samples (full reload, server restart).

    A batch size whose row disappeared counts as its counters falling to 0. Example: before
    `execution_count=258, batch_stats={1: BatchStat(128, ...)}`, after a full reload with no
    traffic yet `execution_count=0, batch_stats={}` -> True. Unknown (None) counters are not compared.
    """
    for name in _SCALAR_COUNTERS:
        old, new = getattr(before, name), getattr(after, name)
        if old is not None and new is not None and new < old:
            return True
    for size, old_stat in before.batch_stats.items():
        new_stat = after.batch_stats.get(size, _NO_EXECUTION)
        if any(getattr(new_stat, f) < getattr(old_stat, f) for f in _BATCH_COUNTERS):
            return True
    return False


def batch_deltas(before: StatsCounters, after: StatsCounters) -> dict[int, tuple[int, int]]:
    """Per batch size >= 1, (executions, compute ns) run between two samples of unrestarted counters.

    A size absent before had no execution then (0). Sizes with nothing new are left out.
    Example: size 2 at (85 executions, 850,381,112 ns) then (95, 950,000,000) -> {2: (10, 99,618,888)}.
    """
    deltas: dict[int, tuple[int, int]] = {}
    for size, new_stat in after.batch_stats.items():
        old_stat = before.batch_stats.get(size, _NO_EXECUTION)
        executions = new_stat.executions - old_stat.executions
        ns = new_stat.compute_ns - old_stat.compute_ns
        if size >= 1 and (executions > 0 or ns > 0) and executions >= 0 and ns >= 0:
            deltas[size] = (executions, ns)
    return deltas


JITTER_MIN_SAMPLES = 50     # traced compute times a jitter estimate rests on, at least
JITTER_FLOOR = 0.05         # a squared coefficient of variation below this is simulated as none: a model timed by
                            # sleeps (sim_accel) measured 0.001-0.025 here, the CPU torch model 0.5-1.3
MIX_TOLERANCE = 1.02        # the p99 match's tolerance (the mixture's p99 is read off a grid): within 2% is a match
JITTER_TAIL_SUPPORT = 2     # a quantile of J is used only where n x (1 - p) >= this: at least this many traced times
                            # lie above its nearest-rank point, so one or two stalls never shape it (500 times reach the
                            # 0.995 quantile, the 3rd largest; 250 the 0.99; 100 the 0.98)


@dataclass(frozen=True)
class Jitter:
    """How one execution's time varies around its batch size's mean: the factor J in x = c_B * J (mean 1).

    `scv` is Var(J); `quantiles` is J's quantile function at `traces.COMPUTE_PROBS` (mean 1), empty when
    `scv` is under JITTER_FLOOR (the executions are then taken as exact). `planner.simulate` draws J from it.
    """

    scv: float
    quantiles: tuple[float, ...] = ()
    # what it was measured from: "trace" (traced requests' compute times) or "summary" (Triton's compute summary)
    source: str = field(default="trace", compare=False)

    def at(self, q: float) -> float:
        """J's q-quantile (1.0 when taken as exact). Example: quantiles with 0.99 -> 3.9: at(0.99) = 3.9."""
        return float(np.interp(q, COMPUTE_PROBS, self.quantiles)) if self.quantiles else 1.0

    def summary(self) -> dict[str, Any]:
        return {"scv": round(self.scv, 3), "p99_x": round(self.at(0.99), 2), "from": self.source}


def quantile_mean(quantiles: Sequence[float]) -> float:
    """The mean of the distribution whose quantile function is `quantiles` at COMPUTE_PROBS, straight lines
    between the points (what `planner.jitter_factors` draws from). Example: 0.5 at p 0..0.5 rising to 1.5 at
    p 1 (0.5 at every point up to 0.5): 0.5 x 0.5 + 0.5 x 1.0 = 0.75."""
    return sum((p1 - p0) * (a + b) / 2 for p0, p1, a, b in zip(COMPUTE_PROBS, COMPUTE_PROBS[1:], quantiles, quantiles[1:]))


def summary_quantiles(points: Sequence[tuple[float, float]], mean: float) -> tuple[float, tuple[float, ...]] | None:
    """(scv, quantiles at COMPUTE_PROBS over the mean) of the compute times whose quantiles Triton's summary gives
    (`points`: (quantile, value), e.g. at 0.5, 0.9, 0.95, 0.99, 0.999) and whose mean the counters give (`mean`,
    the same unit): what `execution_jitter` reads from traced times, where nothing is traced.

    The summary names no quantile under its lowest (0.5), so the quantile function is taken as a straight line
    from q0 at p = 0 to the lowest point, q0 chosen so that the whole function's mean is the counters' (clipped to
    0 .. the lowest point's value); straight lines between the summary's points; its highest point's value above
    it (the tail cut there, as `execution_jitter` cuts traced times where two no longer reach). The scv is that
    function's: what the lower half's line misses is small beside the tail's share. None without a point at or
    under 0.5 and one at or over 0.99, or a mean that is not positive.
    Example: mean 10 ms, 0.5 -> 9, 0.9 -> 13, 0.95 -> 15, 0.99 -> 20, 0.999 -> 30 ms: over the mean 0.9, 1.3, 1.5,
    2.0, 3.0; on COMPUTE_PROBS' grid the upper half (0.5 .. 1) holds 0.61 of the mean, so the line runs from
    q0 = 0.68 at p = 0 to 0.9 at 0.5 (0.5 x (0.68 + 0.9) / 2 = 0.39): p99 2.0, scv 0.09.
    """
    if not mean > 0 or not math.isfinite(mean):
        return None
    known = sorted((p, v / mean) for p, v in points if 0.0 < p < 1.0 and math.isfinite(v) and v >= 0)
    if not known or known[0][0] > 0.5 or known[-1][0] < 0.99:
        return None
    probs = [p for p, _ in known]
    values = list(np.maximum.accumulate([v for _, v in known]))      # a quantile function never falls
    low_p, low_v = probs[0], values[0]

    def grid(q0: float) -> list[float]:
        return [q0 + (low_v - q0) * p / low_p if p < low_p else float(np.interp(p, probs, values)) for p in COMPUTE_PROBS]

    base, slope = quantile_mean(grid(0.0)), quantile_mean(grid(1.0)) - quantile_mean(grid(0.0))
    q0 = min(max((1.0 - base) / slope if slope > 0 else low_v, 0.0), low_v)
    quantiles = grid(q0)
    area = quantile_mean(quantiles)
    if area <= 0:
        return None
    second = sum((p1 - p0) * (a * a + a * b + b * b) / 3
                 for p0, p1, a, b in zip(COMPUTE_PROBS, COMPUTE_PROBS[1:], quantiles, quantiles[1:]))
    return max(0.0, second / area ** 2 - 1.0), tuple(q / area for q in quantiles)


def execution_jitter(compute_scv: float | None, compute_quantiles: Sequence[float], samples: int,
                     deltas: Mapping[int, tuple[int, int]], source: str = "trace") -> Jitter | None:
    """How much one execution's time varies around its batch size's mean, from the traced requests and the
    batch statistics of one span (`traces.TraceSummary`'s compute fields; `batch_deltas`).

    A traced request ran in a batch of size b with probability p_b proportional to b * n_b (n_b executions of
    size b in the span, each c_b ms on average); its compute time x is its batch's, c_B * J, with J independent
    of the size and of mean 1. Then E[x^2] / E[x]^2 = (E[c_B^2] / E[c_B]^2) * E[J^2], so

        scv = Var(J) = (1 + scv_x) / (1 + scv_c) - 1

    with scv_x the traced times' squared coefficient of variation and scv_c that of c_B: the part of the spread
    that the sizes' mix explains is taken out; what is left is the model's own (a CPU model under contention,
    inputs of varying length) or the machine's. J's shape is the traced times' own (x / mean x), pulled towards
    1 so that it keeps only that part, and scaled to mean 1: the measured tail, which is heavier than a
    lognormal's of the same variance (resnet_tiny on 2 cores: traced p99 2.8-6.8x the mean). The pull is the one
    under which the sizes' mix with J, c_B x J, has the measured p99 (bisection), at most sqrt(scv / scv_x); none
    where the mix alone reaches it (J then exact): the sizes' spread is in the tail too, and taking the tail as
    J's put it in twice. Measured: with the tail pulled by the variance alone, a summary whose spread was all the
    sizes' (one resnet_tiny instance at 400 req/s, batches of 1-5) read a J of p99 1.65x, and the planner, its
    p99 over-predicted at the flash, added an instance on 2 cores where one held (r101, r102); J's own tail is
    still found beside a mix (lognormal J of p99 1.92x and 2.80x: read as 1.78-1.80x and 2.67-2.77x).
    The shape goes only as far into the tail as JITTER_TAIL_SUPPORT samples reach (with 500 traced times, to
    the 0.995 quantile; the points above it take its value): one stall of the machine in a window is not a rate
    of stalls (drawn at the 0.995-1.0 points, one 300-ms stall in 500 executions put a simulated p99 at 203 ms
    where 16 ms was the rest's), and the observed/predicted check reads it instead. The cost: with few traced
    times the tail is cut short (a 10-s window of 100 reaches the 0.98 quantile) and the p99 under-read, which is
    why the observer estimates from a configuration's last minute of traced times (`observer.JITTER_SPAN_S`).
    Example: 90 executions of 1 item at 10 ms and 5 of 2 items at 12 ms: p = (0.9, 0.1), E[c] = 10.2,
    E[c^2] = 104.4, scv_c = 0.0035; traced scv_x 0.6 gives scv 1.6 / 1.0035 - 1 = 0.594 and a pull of at most
    sqrt(0.594 / 0.6) = 0.995: a traced p99 of 3.9x the mean becomes 1 + 2.9 x 0.995 = 3.89 (before the rescale).

    None with fewer than JITTER_MIN_SAMPLES traced times, no execution in the span or quantiles that do not
    match `COMPUTE_PROBS`; `scv` never below 0.
    """
    if compute_scv is None or samples < JITTER_MIN_SAMPLES or not math.isfinite(compute_scv) or compute_scv < 0 \
            or len(compute_quantiles) != len(COMPUTE_PROBS):
        return None
    weights = {b: b * n for b, (n, ns) in deltas.items() if n > 0 and ns >= 0}
    total = sum(weights.values())
    if total <= 0:
        return None
    mean = sum(w * deltas[b][1] / deltas[b][0] for b, w in weights.items()) / total
    if mean <= 0:
        return None
    second = sum(w * (deltas[b][1] / deltas[b][0]) ** 2 for b, w in weights.items()) / total
    scv = max(0.0, (1.0 + compute_scv) / (second / mean ** 2) - 1.0)
    if scv < JITTER_FLOOR:
        return Jitter(scv, source=source)
    pull = math.sqrt(min(1.0, scv / compute_scv))
    supported = [q for p, q in zip(COMPUTE_PROBS, compute_quantiles) if samples * (1.0 - p) >= JITTER_TAIL_SUPPORT]
    top = supported[-1] if supported else compute_quantiles[0]
    tail = [q if samples * (1.0 - p) >= JITTER_TAIL_SUPPORT else top for p, q in zip(COMPUTE_PROBS, compute_quantiles)]
    sizes = sorted(weights)
    costs = np.array([deltas[b][1] / deltas[b][0] / mean for b in sizes])     # c_b over E[c_B]
    shares = np.array([weights[b] / total for b in sizes])

    def shape(k: float) -> list[float] | None:
        shaped = [max(0.0, 1.0 + (q - 1.0) * k) for q in tail]
        area = quantile_mean(shaped)
        return None if area <= 0 else [q / area for q in shaped]

    def mixed_p99(j: list[float]) -> float:
        """The 0.99 quantile of c_B x J: P(c_B x J <= x) = sum_b share_b F_J(x / c_b) on a grid of x, then
        straight between the two grid points around 0.99 (one vectorised pass: this runs each tick, traced)."""
        xs = np.linspace(0.0, float(costs.max()) * j[-1] + 1e-9, 257)
        cdf = shares @ np.interp(xs[None, :] / costs[:, None], j, COMPUTE_PROBS)
        k = int(np.searchsorted(cdf, 0.99))
        if k <= 0 or k >= len(xs):
            return float(xs[min(max(k, 0), len(xs) - 1)])
        c0, c1 = float(cdf[k - 1]), float(cdf[k])
        return float(xs[k - 1] + (xs[k] - xs[k - 1]) * ((0.99 - c0) / (c1 - c0) if c1 > c0 else 1.0))

    # the shape's pull: as far as the measured p99 needs beside the sizes' own spread, at most the variance's
    target = float(np.interp(0.99, COMPUTE_PROBS, tail))
    full = shape(pull)
    if full is None:
        return Jitter(scv, source=source)
    if mixed_p99([1.0] * len(COMPUTE_PROBS)) * MIX_TOLERANCE >= target:
        return Jitter(scv, source=source)             # the sizes' mix alone makes the measured p99: no tail of J's own
    if mixed_p99(full) > target * MIX_TOLERANCE:
        lo, hi = 0.0, pull
        for _ in range(12):
            mid = (lo + hi) / 2
            j = shape(mid)
            if j is not None and mixed_p99(j) < target:
                lo = mid
            else:
                hi = mid
        full = shape(lo) or full
    return Jitter(scv, tuple(full), source=source)


def summary_jitter(points: Sequence[tuple[float, float]], start: ModelCounters, end: ModelCounters,
                   deltas: Mapping[int, tuple[int, int]]) -> Jitter | None:
    """The execution jitter Triton's compute summary gives over the span between two scrapes: its quantiles
    (`points`, `ModelCounters.compute_quantiles_us`) over the counters' mean compute (infer) time per request between
    `start` and `end` (`summary_quantiles`), against the executions per batch size over the span (`deltas`,
    `batch_deltas`; `execution_jitter`). None where the counters are unknown, no request completed between them, or
    the summary cannot be read. The observer's untraced estimate (`observer._summary_jitter`) and
    `scripts/jitter_check.py` both read it here."""
    if None in (start.compute_infer_us, end.compute_infer_us, start.success, end.success):
        return None
    requests = end.success - start.success
    if requests <= 0:
        return None
    shape = summary_quantiles(points, (end.compute_infer_us - start.compute_infer_us) / requests)
    if shape is None:
        return None
    return execution_jitter(shape[0], shape[1], int(requests), deltas, source="summary")


class ServiceTimes:
    """One model's service time per batch size, accumulated per configuration from cumulative stats.

    Feed `add(settings, stats, now)` once per tick with what was live over the interval that ends
    at this sample and the model's `/v2/models/<m>/stats` (None if the scrape failed). Each
    interval's per-size deltas go to that configuration's sums; an interval is dropped (and the
    new sample becomes the baseline) when:

    * the settings differ from the previous sample's (the interval straddles two
      configurations) -> counted in `straddles`;
    * any cumulative counter went down (the counters restarted) -> counted in `resets`;
    * the previous sample is missing (failed scrape, no settings): a gap may hide a reload whose
      counters have already grown past the old values.

    So nothing negative is ever added. After each new baseline, intervals are also left out (counted
    in `settling`) until the executions since that baseline reach `settle_executions` x the
    configuration's instance count, checked at the interval's start: the interval that holds the
    count's crossing is still left out; and until they have run for `settle_floor_s()` (`settle_s`, or
    1.5x a cold start read lately; `_restart_settle` says why a count alone is not enough). Why: a new
    instance's first executions (a full reload's, an in-place scale-up's, a restarted server's)
    include its cold start, which a model that does not
    warm up pays in its first requests; on an H200, resnet_tiny without its warm-up took 846 ms for
    its first execution and 23-76 ms for each new batch size against 1.6-2.1 ms later
    (docs/bench/gpu_h200/). Summed in, one such execution among 200 of 2.5 ms read s(1) as 4.1 ms
    five seconds after a scale-up and 2.8 ms (+13%) after 30 s, at 200 executions a second; the
    planner would have taken the new configuration for a slower one. A scale-down in place starts no
    instance and loses its first executions too (a second of data under load). The instance count is
    the configuration's, so an in-place scale-up's one new instance gets a share of the count, not all
    of it: at n = 4 about 25.

    Past the settle, the first interval that holds a batch size this configuration has not run since
    its baseline is left out for that size too (counted in `new_sizes`), since it holds the size's first
    execution: a backend's first run of a new shape (cuDNN's autotuning, a TensorRT profile, a
    recompile; sim_cold's 50 ms) is as cold as an instance's first run. Seen (CI, sim_cold, 60 req/s on
    one instance): sizes 3, 5 and 8 first ran after the settle, one or two executions each at 38-71 ms
    against ~10 ms, and the curve's slope read 8.3 ms an item where the model's is 1.5. Both kinds of
    left-out executions go to the configuration's settle reading (`cold_start`). A size an instance
    first runs after another instance of the same configuration ran it is not caught.

    Memory is bounded: per configuration only two sums per
    batch size (at most `max_sizes` sizes), at most `max_configs` configurations (the one fed
    least recently is evicted), and one baseline sample.

    Drift: when a configuration gets new data, its old sums are first multiplied by
    0.5 ** (seconds since it last got data / `half_life_s`), so the curve follows a model whose
    speed drifts (half the weight after 10 min of newer data by default). A configuration that
    is not running keeps its last curve unchanged (it is still the best knowledge of it) until
    it runs again. `half_life_s=None` keeps every execution at full weight (whole counts).

    Example (settle_executions=25): under Settings(1, 4000) size 4 goes from (100 executions,
    1.2e9 ns) at t=0 (the first sample: the baseline) to (130, 1.56e9 ns) at t=1 and (180, 2.16e9
    ns) at t=2. The interval t=0..1 began with 0 executions since the baseline: left out; t=1..2
    began with 30 >= 25 x 1: 50 executions of 12.0 ms at b=4 are added. If the t=3 sample shows
    (3, 3.6e7 ns) (a full reload), nothing is added and t=3 is the new baseline.
    """

    def __init__(self, min_executions: float = MIN_EXECUTIONS, half_life_s: float | None = HALF_LIFE_S,
                 max_configs: int = MAX_CONFIGS, max_sizes: int = MAX_SIZES,
                 settle_executions: int = SETTLE_EXECUTIONS, settle_s: float = 0.0) -> None:
        self.min_executions = min_executions
        self.half_life_s = half_life_s
        self.max_configs = max(1, max_configs)
        self.max_sizes = max(1, max_sizes)
        self.settle_executions = max(0, settle_executions)
        self.settle_s = settle_s if _is_time(settle_s) and settle_s > 0 else 0.0
        self.resets = 0
        self.straddles = 0
        self.settling = 0            # intervals left out after a new baseline (cold start)
        self.new_sizes = 0           # past the settle, a size's first interval left out (its first execution)
        self._sizes_run: set[int] = set()   # the sizes run since the last baseline
        self._run_record: dict[int, tuple[float, float]] | None = None   # this baseline's settle reading, once kept
        self._settle_base: int | None = None    # executions at the last new baseline; None once settled
        self._settle_floor_s = 0.0               # this settle's executing time to wait (`_restart_settle`)
        self._settle_from: float | None = None   # the start of its first interval with executions
        self._started = 0                        # instances this baseline started (for its cold reading)
        self._left_out: dict[int, list[float]] = {}   # size -> [executions, ns] left out since that baseline
        # the last COLD_START_KEPT settles: (configuration, its left-out executions: size -> (executions, ns),
        # instances it started)
        self._settles: deque[tuple[Settings, dict[int, tuple[float, float]], int]] = deque(maxlen=COLD_START_KEPT)
        self._last: tuple[float, StatsCounters] | None = None   # the last sample with statistics, kept across gaps
        # per configuration, in least-recently-fed-first order: size -> [executions, compute ns]
        self._sums: dict[Settings, dict[int, list[float]]] = {}
        self._fed_at: dict[Settings, float] = {}
        self._baseline: tuple[Settings, StatsCounters] | None = None

    # -- feeding ---------------------------------------------------------------------------
    def add(self, settings: Settings | None, stats: StatsCounters | None, now: float) -> None:
        """One tick: the model's cumulative statistics and the configuration live over the last interval."""
        if settings is None or stats is None or not _is_time(now):
            self._baseline = None
            return
        previous, self._baseline = self._baseline, (settings, stats)
        last, self._last = self._last, (now, stats)
        if previous is None:
            self._restart_settle(settings, None, stats, last, now)
            return
        old_settings, old_stats = previous
        if old_settings != settings:
            self.straddles += 1
            self._restart_settle(settings, old_settings, stats, last, now)
            return
        if counters_restarted(old_stats, stats):
            self.resets += 1
            self._restart_settle(settings, None, stats, last, now)
            return
        deltas = batch_deltas(old_stats, stats)
        if self._settle_base is not None:
            begun_at = last[0] if last is not None else now     # this interval's start
            if self._settle_from is None and any(n > 0 for n, _ in deltas.values()):
                self._settle_from = begun_at
            executing_s = 0.0 if self._settle_from is None else begun_at - self._settle_from
            if (_executions(old_stats) - self._settle_base < self.settle_executions * settings.instance_count
                    or executing_s < self._settle_floor_s):
                self.settling += 1
                self._add_sizes(self._left_out, deltas)
                for size in deltas:
                    self._note_size(size)
                return
            self._settle_base = None
            self._run_record = {b: (n, ns) for b, (n, ns) in self._left_out.items()}
            if self._run_record:
                self._settles.append((settings, self._run_record, self._started))
        new = {b: d for b, d in deltas.items() if b not in self._sizes_run and d[0] > 0 and self._note_size(b)}
        if new and self.settle_executions > 0 and self._run_record is not None:
            self.new_sizes += len(new)
            if not self._run_record:           # why: the settle left nothing out; a reading to hold these
                self._settles.append((settings, self._run_record, self._started))
            for b, (n, ns) in new.items():
                had_n, had_ns = self._run_record.get(b, (0.0, 0.0))
                self._run_record[b] = (had_n + n, had_ns + ns)
            deltas = {b: d for b, d in deltas.items() if b not in new}
        if deltas:
            self._accumulate(settings, deltas, now)

    def _restart_settle(self, settings: Settings, old_settings: Settings | None, stats: StatsCounters,
                        last: tuple[float, StatsCounters] | None, now: float) -> None:
        """A new baseline: the executions from here on are left out until the settle's count is reached and
        they have run for `settle_floor_s()` (timed from the start of the first interval with executions).

        Why the time too: the count is of executions as they *end*, and an in-place scale-up's new instance
        starts cold while the warm ones go on. In the cold_start live test (800 ms on a new instance's first
        execution, 90 req/s over two instances) the warm instance ended the 50 counted executions before the
        new one's first ended, which then landed in the kept curve (CI: 8 executions of 3 items read 129 ms,
        about 10 usual; once in 4 runs here: 362 of 1 item at 12.2 ms against 10.1). The executing time is
        what a cold execution needs to end, whichever instance runs it.

        Where the counters restarted (a full reload, a restarted server) and the last sample with statistics is
        at most SEED_SPAN_S old, the settle's cold reading (not the curve) also gets every execution since the
        load. Why: the controller reads no configuration while a reload is in flight, so the first sample after
        it (this baseline) comes up to a tick after the new instances were ready, and a cold first execution
        (800 ms in the cold_start bench) had often ended before it. Not after an in-place change, where the
        executions since the last sample are the old instances' during the load: on this 2-core machine
        resnet_tiny's ran at 3.9x its curve while a second instance loaded (torch's import and warm-up), which
        is the machine's contention, not a cold start. Not after a long gap either (a restart long ago).
        """
        restarted = last is not None and counters_restarted(last[1], stats)
        if old_settings is not None and not restarted:      # in place: only the instances added are new
            self._started = max(0, settings.instance_count - old_settings.instance_count)
        else:                      # a load, or unknown (a gap may hide a reload): count every instance as new
            self._started = settings.instance_count
        self._settle_floor_s = self.settle_floor_s()
        self._settle_from = None
        self._settle_base = _executions(stats)
        self._left_out = {}
        self._sizes_run = set()
        self._run_record = None
        if last is None or not 0 <= now - last[0] <= SEED_SPAN_S or not restarted:
            return
        seed = batch_deltas(StatsCounters(), stats)
        self._add_sizes(self._left_out, seed)
        for size in seed:
            self._note_size(size)

    def _note_size(self, size: int) -> bool:
        """Record `size` as run since the baseline, while fewer than `max_sizes` are (why: garbage stats with
        thousands of sizes must not grow memory); whether it is recorded."""
        if size in self._sizes_run or len(self._sizes_run) < self.max_sizes:
            self._sizes_run.add(size)
            return True
        return False

    def _accumulate(self, settings: Settings, deltas: dict[int, tuple[int, int]], now: float) -> None:
        sums = self._sums.pop(settings, None)
        if sums is None:
            while len(self._sums) >= self.max_configs:
                evicted = next(iter(self._sums))
                del self._sums[evicted], self._fed_at[evicted]
            sums = {}
        else:
            self._decay(sums, now - self._fed_at[settings])
        self._sums[settings] = sums           # why: re-inserted last, so the first key is the least recently fed
        self._fed_at[settings] = now
        self._add_sizes(sums, deltas)

    def _add_sizes(self, sums: dict[int, list[float]], deltas: Mapping[int, tuple[float, float]]) -> None:
        """Add each size's (executions, ns) to `sums` (size -> [executions, ns]), a new size only while fewer
        than `max_sizes` are kept (why: garbage stats with thousands of sizes must not grow memory)."""
        for size, (executions, ns) in deltas.items():
            if size not in sums:
                if len(sums) >= self.max_sizes:
                    continue
                sums[size] = [0.0, 0.0]
            sums[size][0] += executions
            sums[size][1] += ns

    def _decay(self, sums: dict[int, list[float]], elapsed_s: float) -> None:
        if not self.half_life_s or self.half_life_s <= 0 or elapsed_s <= 0:
            return
        factor = 0.5 ** (elapsed_s / self.half_life_s)
        for size in list(sums):
            sums[size][0] *= factor
            sums[size][1] *= factor
            if sums[size][0] < MIN_WEIGHT:
                del sums[size]

    def forget_except(self, keep: Settings | None) -> int:
        """Drop every configuration's curve but `keep`'s (the live one, which goes on being fed); the number
        dropped. For a model whose executions wait on another's (a BLS model's calls, controller/calls.py) when that
        other changed: the curves of its other configurations were measured against the old one."""
        dropped = [c for c in self._sums if c != keep]
        for c in dropped:
            del self._sums[c], self._fed_at[c]
        return len(dropped)

    # -- reading ---------------------------------------------------------------------------
    def configs(self) -> list[Settings]:
        """The configurations with data, least recently fed first."""
        return list(self._sums)

    def points(self, settings: Settings) -> dict[int, tuple[float, float]]:
        """Per batch size seen under `settings`: (executions, mean ms of compute per execution)."""
        sums = self._sums.get(settings, {})
        return {size: (n, ns / n / 1e6) for size, (n, ns) in sorted(sums.items()) if n > 0}

    def executions(self, settings: Settings) -> float:
        return sum(n for n, _ in self.points(settings).values())

    def fit(self, settings: Settings) -> ServiceFit | None:
        """The service curve of `settings`; None with fewer than `min_executions` executions seen."""
        points = self.points(settings)
        if sum(n for n, _ in points.values()) < self.min_executions:
            return None
        return fit_service(points)

    def _settle_reading(self, settings: Settings, left_out: dict[int, tuple[float, float]]) -> dict[str, Any] | None:
        """One settle's left-out executions against the configuration's curve now (None without a fit)."""
        fit = self.fit(settings)
        if fit is None:
            return None
        executions = sum(n for n, _ in left_out.values())
        usual = sum(n * fit.predict_ms(b) for b, (n, _) in left_out.items())
        took = sum(ns for _, ns in left_out.values()) / 1e6
        if executions <= 0 or usual <= 0:
            return None
        return {"instances": settings.instance_count, "delay_us": settings.max_queue_delay_us,
                "executions": round(executions), "ms": round(took / executions, 3),
                "usual_ms": round(usual / executions, 3),
                "excess_executions": round((took - usual) / (usual / executions), 1)}

    def settle_readings(self) -> list[dict[str, Any]]:
        """The readings of the last COLD_START_KEPT settles whose configuration has a curve, oldest first."""
        return [r for s, left_out, _ in self._settles if (r := self._settle_reading(s, left_out)) is not None]

    def cold_start_s(self) -> float:
        """The longest cold start per new instance that a kept settle read (seconds; 0.0 if none read cold).

        A settle reads cold as in `cold_start` (one such reading is enough here); its excess time over the curve
        is spread over the instances it started (a load's instances start cold side by side; an in-place
        scale-up starts only the added ones; a scale-down starts none and is skipped). Example: a load of one
        instance whose left-out executions took 1,327 ms where the curve gives 462: 0.865 s.
        """
        longest = 0.0
        for s, left_out, started in self._settles:
            r = self._settle_reading(s, left_out) if started > 0 else None
            if r is None or not _reads_cold(r):
                continue
            longest = max(longest, (r["ms"] - r["usual_ms"]) * r["executions"] / 1e3 / started)
        return longest

    def settle_floor_s(self) -> float:
        """How long a settle's executions run before the curve takes them: `settle_s`, or COLD_SETTLE_MARGIN x
        the longest cold start per instance read lately (`cold_start_s`) where that is longer, at most
        SETTLE_MAX_S; 0.0 with `settle_executions=0` (no settle). Example: settle_s=3 and a cold start of
        2.4 s read after the last load: 3.6 s."""
        if self.settle_executions <= 0:
            return 0.0
        return min(SETTLE_MAX_S, max(self.settle_s, COLD_SETTLE_MARGIN * self.cold_start_s()))

    def cold_start(self) -> dict[str, Any] | None:
        """The model's cold start, if its settles show one (JSON-ready), else None.

        Each settle's left-out executions (the first `settle_executions` per instance after a change, restart or
        gap, and after a full reload those since the load: `_restart_settle`) are compared with their
        configuration's curve at their batch sizes: `excess_executions` is the time they took beyond the curve's,
        in executions of their mean time. A settle reads cold where that excess is COLD_START_EXECUTIONS or more
        (the cold start cost at least a one-instance settle's length) and the executions took COLD_START_RATIO x
        the curve's time or more (so that a small mismatch of the curve over many executions is not read as
        one). The model starts cold where COLD_START_SETTLES of the last COLD_START_KEPT settles read cold (one
        stall of the machine in a settle is not a cold start; an in-place scale-down starts no instance and reads
        warm, which is why not "most of them"), or where one of them read COLD_START_ONE executions' worth or more
        (twice the threshold: a stall of the machine that long within a settle's few seconds is rarer than a cold
        start that long; why: asked for two, a model's load was its only reading before its first change, which
        the planner then made a full reload to 2 x 500 us, every instance cold again: cold_start r8's 631-ms
        morning p99, where its load's settle had read cold; sim_cold's load reads about 100 executions' worth,
        docs/bench/cold_start/calibration.txt); the latest such reading is returned. The excess, not the ratio
        alone, decides because an in-place scale-up's warm instances dilute the new one's cold executions.
        Measured on a real tritonserver:
        sim_accel with an 800-ms first execution and 50 ms more per new batch size read about 100 executions'
        worth after its load and after an in-place scale-up, plain sim_accel about 7 (the Python backend's own
        first calls). Example: 57 left out that took 1,327 ms where the curve gives 8.1 ms each (462 ms): 865 ms
        more, 106.8 executions' worth, 2.9x the curve: cold.
        """
        cold = [r for r in self.settle_readings() if _reads_cold(r)]
        if len(cold) >= COLD_START_SETTLES or any(r["excess_executions"] >= COLD_START_ONE for r in cold):
            return cold[-1]
        return None

    def summary(self, settings: Settings) -> dict[str, Any]:
        """For logs and status (JSON-ready). Example: {"alpha_ms": 6.171, "beta_ms": 1.634, "r2": 0.969,
        "executions": 60, "sizes": [1, 2, 4]}; the three figures are None until there is a fit with a slope."""
        fit = self.fit(settings)
        if fit is not None:
            return fit.summary()
        points = self.points(settings)
        return {"alpha_ms": None, "beta_ms": None, "r2": None,
                "executions": round(sum(n for n, _ in points.values())), "sizes": sorted(points)}


def _reads_cold(reading: dict[str, Any]) -> bool:
    """Whether one settle's reading (`ServiceTimes._settle_reading`) shows a cold start (see `cold_start`)."""
    return (reading["excess_executions"] >= COLD_START_EXECUTIONS
            and reading["ms"] >= COLD_START_RATIO * reading["usual_ms"])


def _executions(stats: StatsCounters) -> int:
    """Executions the statistics count over every batch size >= 1 (each execution once)."""
    return sum(b.executions for size, b in stats.batch_stats.items() if size >= 1)


def _is_time(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


__all__ = ["COLD_START_EXECUTIONS", "COLD_START_RATIO", "COLD_SETTLE_MARGIN", "SETTLE_MAX_S",
           "SETTLE_EXECUTIONS", "ServiceFit", "ServiceTimes", "fit_service", "counters_restarted", "batch_deltas", "Jitter", "execution_jitter", "quantile_mean",
           "MIN_EXECUTIONS", "HALF_LIFE_S"]
