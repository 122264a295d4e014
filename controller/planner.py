"""The planner: a model of the server, and the choice of instances and delay made from it (pure, no I/O).

Sections, in the order a decision uses them:

1. `simulate`: what p99 a configuration gives at an arrival rate (below);
2. `Forecast`: where the arrival rate will be when a change pays off;
3. `ServiceModel`: s(b) for any instance count (measured, or scaled by contention);
4. `DeviceShare`, `predict`, `capacity_rps`: one candidate's corrected p99, its capacity;
5. `choose`: the fewest instances, then the shortest delay, predicted under the target's margin (a
   scale-up at the live delay where one meets it), with consolidation for scale-downs and the fallback to
   the reactive rules (policy.py calls it).

Each observation also carries the p99 predicted for the live configuration at the measured rate
(`Observation.predicted_p99_ms`), logged beside the measured one: the ratio of the two corrects
every prediction, and a large disagreement sets the planner aside. Where no request is traced (Triton
before 2.57 under `tracing: auto`), the check is the counters' mean latency, which they measure exactly,
against the simulation's mean (`Observation.predicted_mean_ms`): see `record_ratio`.

The model is a small event simulation of Triton's dynamic batcher in front of `n` instances:

* requests arrive as a Poisson process of rate λ;
* an instance that is free takes the queued requests as one batch (at most `max_batch`) as soon as
  the oldest has waited `delay_us` or the queue holds a full batch; with a delay of 0 it takes
  whatever is queued at once (so under load a queue batches by itself);
* an execution of a batch of b takes s(b) ms, the service curve measured for this configuration
  (`service.ServiceFit.predict_ms`), the same for every instance: contention between instances on
  one device is already inside a curve measured at this instance count; times a random factor J
  (mean 1) where executions of one size were measured to vary (`jitter`, below);
* a request's latency is its wait in the queue plus its batch's execution.

Worked example (`simulate(100, 1, 0, 8, lambda b: 6 + 1.5 * b)`): one instance busy 7.5 ms for a
lone request could serve 133 req/s unbatched; at 100 req/s requests often arrive while it is busy and
leave together: batches average ~1.2, the instance is busy ~63% of the time, p99 ~19 ms (mean ~11).
The same load on 2 instances: batches of ~1.04, busy ~36%, p99 ~14 ms. At 600 req/s one instance
cannot keep up even with full batches of 8 (8 / 18 ms = 444 req/s): `stable` is False.
Each call simulates `requests` arrivals (default 2,000, a few ms of CPU) with a fixed seed, so the
same inputs give the same answer.

`jitter` is the quantile function of J (`service.Jitter.quantiles`: measured from traced requests, or untraced
from Triton's compute summary, the spread that batch sizes do not explain), empty for exact executions; with J
the planner simulates 4,000 arrivals (SIM_REQUESTS_JITTERED), its p99 being noisier. A model timed by sleeps (sim_accel)
measured a squared coefficient of variation of 0.001-0.025 here and is simulated as exact (under
`service.JITTER_FLOOR`); the CPU torch model (resnet_tiny, one instance, 10-50 req/s) measured 0.53-0.79, its
executions' p99 3.7-4.7x their mean: without J its p99 was predicted at 9.9-19.1 ms where 24.9-41.4 ms was
traced, with J at 23.4-39.5 ms (`scripts/jitter_check.py`).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from .types import Settings

from .service import Jitter
from .traces import COMPUTE_PROBS

if TYPE_CHECKING:
    from .service import ServiceFit


@dataclass(frozen=True)
class Prediction:
    """What the simulation says for one configuration at one arrival rate."""

    p99_ms: float
    mean_ms: float
    mean_batch: float
    busy: float            # mean fraction of time the instances spend executing
    stable: bool           # False when the queue grew to the end: the configuration cannot hold the load
    tail: tuple[tuple[float, float], ...] = ()   # (P(latency > x), x ms) at TAIL_SURVIVAL: the upper tail's shape


TAIL_SURVIVAL = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002)


def jitter_factors(jitter: Sequence[float], n: int, seed: int) -> np.ndarray | None:
    """`n` draws of J from its quantile function `jitter` (at `COMPUTE_PROBS`, straight lines between the
    points); None for exact executions (empty). Example: quantiles (0.5, 1, 1.5) at (0, 0.5, 1): a uniform
    draw u = 0.75 gives 1.25."""
    if len(jitter) != len(COMPUTE_PROBS):
        return None
    return np.interp(np.random.default_rng(seed + 7919).random(n), COMPUTE_PROBS, jitter)


def simulate(arrival_rps: float, instances: int, delay_us: int, max_batch: int,
             service_ms: Callable[[int], float], requests: int = 2000, seed: int = 0,
             jitter: Sequence[float] = ()) -> Prediction | None:
    """Simulate the dynamic batcher; None when there is nothing to predict (no arrivals, bad inputs)."""
    if not (arrival_rps > 0 and math.isfinite(arrival_rps)) or instances < 1 or requests < 10:
        return None
    max_batch = max(1, int(max_batch))
    delay_s = max(0, int(delay_us)) / 1e6
    # why plain floats and each batch size's cost once: the loop below is pure Python, where numpy scalars and the
    # service curve's call per batch cost twice the time (the controller's CPU is mostly these simulations)
    arrival_times = np.cumsum(np.random.default_rng(seed).exponential(1.0 / arrival_rps, requests))
    arrivals = arrival_times.tolist()
    drawn = jitter_factors(jitter, requests, seed)     # at most one execution per request
    factors = None if drawn is None else drawn.tolist()
    cost_s: dict[int, float] = {}
    free_at = [0.0] * instances                 # when each instance is next free
    heapq.heapify(free_at)
    ends: list[float] = []                      # per batch, when it ended
    batches: list[int] = []
    busy_s = 0.0
    # the queue is arrivals[head:i]: requests leave in arrival order, a batch takes the whole queue (it never holds
    # more than max_batch), so indices stand for the queue and each batch's requests are consecutive
    head = i = 0
    replace, join, end, size = heapq.heapreplace, bisect.bisect_right, ends.append, batches.append  # bound once
    while i < requests or head < i:
        t_free = free_at[0]
        if head == i:                           # wait for the next arrival
            i += 1
            continue
        # the batch leaves when an instance is free and (the oldest waited long enough or the batch is full)
        due = arrivals[head] + delay_s
        ready = t_free if t_free > due else due
        limit = head + max_batch if head + max_batch < requests else requests
        if i < limit and arrivals[i] <= ready:  # the arrivals up to `ready` join, up to a full batch
            i = join(arrivals, ready, i, limit)
        b = i - head
        if b < max_batch:
            start = ready
        else:
            full = arrivals[head + max_batch - 1]
            start = t_free if t_free > full else full
        run_s = cost_s.get(b)
        if run_s is None:
            run_s = cost_s[b] = max(0.0, float(service_ms(b))) / 1000.0
        if factors is not None:
            run_s *= factors[len(ends)]
        replace(free_at, start + run_s)
        end(start + run_s)
        size(b)
        busy_s += run_s
        head = i
    horizon = max(max(free_at), arrivals[-1])
    in_order = (np.repeat(ends, batches) - arrival_times) * 1000.0     # batches leave in arrival order
    half = len(in_order) // 2
    # why: a queue that only grows makes the later requests wait far longer than the earlier ones
    stable = bool(np.mean(in_order[half:]) < 2.0 * np.mean(in_order[:half]) + 1.0)
    lat = np.sort(in_order)

    def rank(q: float) -> float:
        return float(lat[min(len(lat) - 1, max(0, math.ceil(q * len(lat)) - 1))])

    return Prediction(p99_ms=rank(0.99), mean_ms=float(lat.mean()), mean_batch=float(np.mean(batches)),
                      busy=busy_s / (horizon * instances), stable=stable,
                      tail=tuple((s, rank(1.0 - s)) for s in TAIL_SURVIVAL))


def survival(p: Prediction, x_ms: float) -> float:
    """P(latency > x_ms) from a prediction's tail points: log-linear between them, linear from (0 ms, 1) to the
    median, and beyond the last point continued at the last segment's decay. Example: tail (0.01, 30 ms),
    (0.005, 34 ms): P(> 32 ms) = 0.01 x 0.5 ** 0.5 = 0.0071; P(> 38 ms) = 0.0025."""
    pts = p.tail
    if not pts:
        return 1.0 if x_ms < p.p99_ms else 0.0
    s0, x0 = pts[0]
    if x_ms <= x0:
        return 1.0 - (1.0 - s0) * (max(0.0, x_ms) / x0) if x0 > 0 else s0
    for (sa, xa), (sb, xb) in zip(pts, pts[1:]):
        if x_ms <= xb:
            if xb <= xa:
                return sb
            return sa * (sb / sa) ** ((x_ms - xa) / (xb - xa))
    (sa, xa), (sb, xb) = pts[-2], pts[-1]
    if xb <= xa:
        return 0.0
    return sb * (sb / sa) ** ((x_ms - xb) / (xb - xa))


def mixture_p99(parts: Sequence[tuple[Prediction, float]], q: float = 0.99) -> float | None:
    """The p99 over the requests of several loads together (each part: its prediction and its share of the
    requests): the x where the shares' weighted P(latency > x) is 1 - q (bisection). One part: its own p99.

    Example: a window whose requests came 70% in bursts (there p98 26 ms, p99 30 ms, p99.5 34 ms) and 30%
    between them (all under 15 ms): 0.7 x P_burst(> x) = 0.01 at P_burst = 0.0143, x = 27.9 ms: the window's
    p99 is the bursts' p98.6. It moves smoothly with the bursts' share (45%: 25.5 ms, p95 there 22 ms),
    where a rate picked by the median request jumped from the burst's to the lull's as the share crossed 50%."""
    parts = [(p, w) for p, w in parts if p is not None and w > 0]
    if not parts:
        return None
    total = sum(w for _, w in parts)
    if len(parts) == 1:
        return parts[0][0].p99_ms
    target = 1.0 - q
    lo, hi = 0.0, max(max((x for _, x in p.tail), default=p.p99_ms) for p, _ in parts) * 4 + 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(w * survival(p, mid) for p, w in parts) / total > target:
            lo = mid
        else:
            hi = mid
    return hi


def rate_components(rates: Sequence[float], tick_s: float, k: float = 3.0) -> list[tuple[float, float]]:
    """A window's tick rates grouped into loads that differ by more than counting noise: (rate, share of the
    requests) per group, its rate the one its requests arrived in (sum r^2 / sum r). Sorted rates split where
    neighbours are more than `k` x the Poisson noise of a tick's rate apart, sqrt(rate / tick_s).

    Example (1-s ticks): 378, 380, 102, 97, 99, 101 -> gap 102 -> 378 >> 3 x sqrt(378) = 58: two loads,
    (99.8, 0.34) and (379.0, 0.66). A steady 200 req/s (ticks 186-214) is one load (~200.5, 1.0): its ticks
    differ by counting noise, which a simulation at the mean rate already holds."""
    rs = sorted(r for r in rates if math.isfinite(r) and r >= 0)
    total = sum(rs)
    if not rs or total <= 0:
        return []
    groups: list[list[float]] = [[rs[0]]]
    for r in rs[1:]:
        prev = groups[-1][-1]
        if r - prev > k * math.sqrt(max(r, 1.0) / max(tick_s, 0.1)):
            groups.append([r])
        else:
            groups[-1].append(r)
    return [(sum(x * x for x in g) / sum(g), sum(g) / total) for g in groups if sum(g) > 0]


# ---- the arrival-rate forecast ---------------------------------------------------------------------

@dataclass(frozen=True)
class Forecast:
    """The arrival rate's level (an EWMA of the per-tick rates) and rising trend, with a robust error band.

    `update` takes one tick's rate; `band(h)` says where the rate will be `h` seconds on:
    mid = level + trend * (1 - phi^h) / (1 - phi) (the trend fades: phi = 0.8 per second, so no horizon
    adds more than 5 s of it), plus `z` times the spread of the recent one-tick-ahead errors above it, minus
    `z` times their spread below it.

    * The trend is the least-squares slope of the last `TREND_TICKS` rates, used only when it rises, the
      line explains them (r^2 >= `TREND_R2`) and no single jump makes more than `STEP_SHARE` of the line's
      rise: a ramp, not a step. A Holt filter's trend rings after
      a step (it overshoots, then undershoots for many ticks); a falling trend is not used at all, since
      a scale-down waits for consolidation anyway.
    * The spreads are 1.4826 x the upper (above) and minus the lower (below) quartile of the last
      `ERRORS_KEPT` errors (for symmetric noise both equal the standard deviation; robust: one step in the
      load is one large error, not a wide band for the next minute), and never less than the Poisson noise
      of a tick's rate, sqrt(level / tick). One-sided because a ramp's errors are: a falling load comes in
      below the lagging level every tick, which says nothing about rates above it.

    The high end is never below the last measured rate (a step up is seen at once, not 3 ticks late), and
    never above the highest tick rate of the last `PEAK_S` seconds continued by the trend (that peak
    already carries the ticks' counting noise: the highest of 30 one-second ticks at a steady 378 req/s is
    ~420, and under a steady load the cap is above mid + z x spread, so it does not bind). An on/off load (2-s bursts at 380 req/s between 100 req/s) makes one-tick errors
    of +-200 req/s, so mid + z x spread reached 540-580 req/s, far above any rate it had seen: sized for that,
    the planner held 3-4 instances where 2 carry the bursts (bursty bench, 1.29x the best static
    instance-seconds). Burstiness says the rate swings between its lows and its peaks, not that it will
    exceed them.

    Worked example (alpha 0.5, ticks 2 s apart): rates 100, 100, 120, 140, 160, 180. The level goes
    100, 100, 110, 125, 142.5, 161.25; the last five rates lie on a line of slope 10 req/s per s (r^2
    1.0), so a reload of 1 s plus a tick (h = 3) gives mid = 161.25 + 10 * 2.44 = 185.6. The errors
    (each rate less the mid forecast for it) are 0, 20, 30, 22.4, 23.1: upper quartile 23.1 -> spread above
    34.2, so mid + z x spread = 230.1 at z = 1.3; the peak 180 continued by the trend (+24.4) caps the high
    end at 204.4; lower quartile 20 > 0, so the spread below is the Poisson noise sqrt(161.25 / 2) = 9.0:
    band 174-204 req/s. A load alternating 30 /
    250 req/s every 20 s: no trend (a step is not a line), the level within 5% of the new rate 4 ticks
    after each step, the high end at the new rate from the first tick, and the band at the end of a phase
    about the Poisson noise.
    """

    level: float
    t: float
    recent: tuple[tuple[float, float], ...] = ()   # (time, rate) of the last ticks, newest last
    errors: tuple[float, ...] = ()                 # the last one-tick-ahead errors, newest last
    tick_s: float = 2.0                            # the last interval between updates
    ticks: int = 1
    peaks: tuple[tuple[float, float], ...] = ()    # (time, rate) of the ticks of the last PEAK_S seconds

    ALPHA = 0.5
    PHI = 0.8             # the trend's persistence per second
    TREND_TICKS = 5
    TREND_R2 = 0.8
    STEP_SHARE = 0.5      # ... and no one jump between ticks makes more than half of the line's rise
    ERRORS_KEPT = 10
    PEAK_S = 30.0         # how far back the high end's cap looks for the highest rate

    @staticmethod
    def start(t: float, rate: float) -> "Forecast":
        return Forecast(level=rate, t=t, recent=((t, rate),), peaks=((t, rate),))

    @property
    def trend(self) -> float:
        """The rising slope of the recent rates (req/s per second), 0 when they do not rise on a line."""
        if len(self.recent) < 3:
            return 0.0
        ts = np.array([x[0] for x in self.recent])
        rs = np.array([x[1] for x in self.recent])
        tc, rc = ts - ts.mean(), rs - rs.mean()
        sxx, syy = float(tc @ tc), float(rc @ rc)
        if sxx <= 0 or syy <= 0:
            return 0.0
        slope = float(tc @ rc) / sxx
        r2 = slope * slope * sxx / syy
        if slope <= 0 or r2 < self.TREND_R2:
            return 0.0
        # why: a step caught mid-window (100, 100, 100, 380, 380: r^2 0.75, with noise often > 0.8) is not a
        # ramp; a ramp spreads its rise over the ticks, a step puts most of it in one jump
        rise = slope * float(ts[-1] - ts[0])
        return slope if float(np.max(np.diff(rs))) <= self.STEP_SHARE * rise else 0.0

    def update(self, t: float, rate: float) -> "Forecast":
        if not math.isfinite(rate) or rate < 0:
            return self
        dt = t - self.t
        if dt <= 0:
            return self
        if dt > 30.0:             # a long gap (server away): the old level means little now
            return Forecast.start(t, rate)
        err = rate - self.band(dt)[1]
        level = self.level + self.ALPHA * (rate - self.level)
        return Forecast(level, t, (self.recent + ((t, rate),))[-self.TREND_TICKS:],
                        (self.errors + (err,))[-self.ERRORS_KEPT:], dt, self.ticks + 1,
                        tuple(p for p in self.peaks if p[0] > t - self.PEAK_S) + ((t, rate),))

    def poisson(self) -> float:
        """The standard deviation of one tick's rate from counting noise alone, at the current level."""
        return math.sqrt(max(self.level, 1.0) / max(self.tick_s, 0.1))

    def spread_above(self) -> float:
        """How far rates have come in above the forecast: 1.4826 x the errors' upper quartile (the standard
        deviation, for symmetric noise), at least the Poisson noise. A falling ramp's errors are all below
        the forecast (the level lags it): they do not widen the high end, which held a cold model's band at
        ~4x its rate for 10 s after its load fell (two_models_tight: 0-113 req/s at 29), and so its instance
        from the model that needed it."""
        if not self.errors:
            return self.poisson()
        return max(1.4826 * float(np.percentile(self.errors, 75)), self.poisson())

    def spread_below(self) -> float:
        """The same below the forecast: 1.4826 x minus the errors' lower quartile, at least the Poisson noise."""
        if not self.errors:
            return self.poisson()
        return max(-1.4826 * float(np.percentile(self.errors, 25)), self.poisson())

    def rates_since(self, since: float) -> list[float]:
        """The tick rates of the ticks after `since` (of the last PEAK_S seconds), oldest first."""
        return [r for t, r in self.peaks if t > since]

    def peak(self, since: float, until: float) -> float | None:
        """The highest tick rate of the ticks in (since, until]; None without one."""
        return max((r for t, r in self.peaks if since < t <= until), default=None)

    def last_rise(self, low: float, high: float) -> float | None:
        """When the load last rose from a lull in the last PEAK_S seconds: the time of the latest tick above
        `high` that came after a tick at or under `low`; None where no tick rose so.

        Example (1-s ticks, low 120, high 250): 100 at 0 s, 370 at 1-4, 100 at 5-10, 370 at 11-14, 100 at
        15-17 s -> 11.0 (the rise at 1 s came after the lull at 0 s too; the ticks at 12-14 were high already).
        A load falling from 390 to 60 without rising again -> None, whatever `low` is."""
        rise, seen_low = None, False
        for t, r in self.peaks:
            if r > high:
                rise, seen_low = (t if seen_low else rise), False
            elif r <= low:
                seen_low = True
        return rise

    def band(self, horizon_s: float, z: float = 1.3) -> tuple[float, float, float]:
        """(low, mid, high) arrival rate `horizon_s` from the last update; never below 0."""
        fade = (1 - self.PHI ** max(0.0, horizon_s)) / (1 - self.PHI)
        trend = self.trend
        mid = max(0.0, self.level + trend * fade)
        last = self.recent[-1][1] if self.recent else 0.0
        peak = max((r for _, r in self.peaks), default=last)
        cap = peak + trend * fade
        return max(0.0, mid - z * self.spread_below()), mid, max(min(mid + z * self.spread_above(), cap), last)


# ---- service time of a configuration not yet measured ----------------------------------------------

DEFAULT_CONTENTION = 0.1      # added service time per extra instance, before anything says otherwise
DEVICE_SHARE = 0.5            # the share of an execution assumed to run on the device (the prior's scale) ...
CPU_SHARE = 1.0               # ... where the device is the CPU (cpu.py), all of it: the host's part runs there too


@dataclass(frozen=True)
class ServiceModel:
    """s(b) for any instance count: measured where a configuration ran, scaled by contention elsewhere.

    Instances on one device contend: with more of them executing at once, each execution takes
    longer. The model: s_n(b) = s_m(b) * c(n) / c(m), with c(n) = 1 + gamma * (n - 1) and m the
    nearest measured count. `gamma` (the extra time one more instance adds, as a fraction) is
    learned from every pair of measured counts (their curves compared at a common batch size);
    with one count measured it comes from the device's utilisation u instead: gamma = u * 0.5 (a new
    execution finds the device busy a fraction u of the time, and about half of an execution runs
    on the device; where the device is the CPU, `CPU_SHARE`: all of it, gamma = u), and
    `DEFAULT_CONTENTION` without a utilisation reading. Example: the torch MLP of scripts/scenarios/repos/cpu_mlp,
    one instance keeping the 2 cores 67% busy: gamma 0.67, two instances each 1.67x as slow (1.2x one's capacity,
    where the default 0.1 said 1.8x); they measured 1.00, the cap (each execution ~5x as long: 2 x 2 torch threads
    on 2 cores, an oversubscription no utilisation shows). Where the device is the CPU the cores say more
    (`contention_floor`, `cpu.CpuUse.contention`: the cores an execution uses against those free): the prior is
    the larger of the two, "cores" where that one is. The same MLP: 1.7 cores per execution of 1.85 free: 0.84.

    Example: 2 instances measured at s(1) = 8.0 ms, 4 instances at 10.4 ms: r = 1.3 = (1 + 3g) /
    (1 + g) -> g = 0.3 / 1.7 = 0.176. Six instances are then predicted at s_4(b) * (1 + 5g) / (1 + 3g)
    = 1.24 x s_4(b).

    `jitters`: per measured count, how much one execution's time varies around its size's mean (`simulate`);
    a count not measured takes the nearest measured count's (`jitter`).

    A count measured at one batch size only (its slope unknown: `ServiceFit.predict_ms` bounds a batch of b
    at b / b0 times the size b0 seen) takes its curve's shape from the nearest count measured at two sizes or
    more, scaled to its own mean at b0: the same proportional scaling between counts as above, applied to
    the shape where the level is measured. Why: a configuration seen only at a low load runs batches of 1;
    bounded, its batches of 2 under a queue cost twice one, and at 22 req/s one sim_accel instance (8.9 ms)
    was predicted at p99 24 ms where 16 ms was observed (17 predicted with a slope). A controller that had
    scaled up on such a curve (the long-run test, twice in three runs) never found one instance fit for the
    low phase again: that curve is only refreshed where it runs. Example: 1 instance seen at b = 1 only,
    9.0 ms; 2 instances fitted at s(b) = 8.0 + 1.5 b: 1 instance is taken as 9.0 / 9.5 x (8.0 + 1.5 b),
    s(2) = 10.4 ms where the bound said 18.0. Without a count measured at two sizes the bound stays.
    """

    fits: dict[int, "ServiceFit"]
    gamma: float
    gamma_source: str            # "measured" | "utilisation" | "cores" | "default"
    jitters: dict[int, "Jitter"] = dataclasses.field(default_factory=dict)   # per count measured
    items: float = 1.0           # items a request carries on average: what `predict` turns the curves' items into
                                 # requests by (`simulate_quantised`), as every rate here is in requests
    implicit_us: int = 0         # the server's batcher acts as if it waited this long more than its delay (measured:
                                 # `implicit_step`); `predict` simulates every candidate's delay plus it

    @staticmethod
    def build(fits_by_config: Sequence[tuple[Settings, "ServiceFit"]], device_util: float | None,
              jitter_by_config: Sequence[tuple[Settings, "Jitter"]] = (), items: float = 1.0,
              implicit_us: int = 0, device_share: float = DEVICE_SHARE,
              contention_floor: float | None = None) -> "ServiceModel":
        per_count: dict[int, ServiceFit] = {}
        for s, fit in fits_by_config:
            best = per_count.get(s.instance_count)
            if best is None or fit.executions > best.executions:
                per_count[s.instance_count] = fit
        jitters = jitter_per_count(jitter_by_config)
        model = ServiceModel._build(per_count, device_util, device_share, contention_floor)
        model = dataclasses.replace(model, fits=ServiceModel._shaped(per_count),
                                    items=max(1.0, items) if math.isfinite(items) else 1.0,
                                    implicit_us=max(0, int(implicit_us)))
        return dataclasses.replace(model, jitters=jitters) if jitters else model

    @staticmethod
    def _shaped(per_count: dict[int, "ServiceFit"]) -> dict[int, "ServiceFit"]:
        """Each count measured at one size only with the shape of the nearest count that has a slope (the
        smaller on a tie), scaled to its own mean at that size; the others as they are (see the class)."""
        sloped = {n: f for n, f in per_count.items() if f.alpha_ms is not None and f.beta_ms is not None}
        if not sloped:
            return per_count
        out = dict(per_count)
        for n, fit in per_count.items():
            if n in sloped or len(fit.batch_sizes) != 1:
                continue
            ref = sloped[min(sloped, key=lambda c: (abs(c - n), c))]
            (size, (_, mean_ms)), = fit.batch_sizes.items()
            at = ref.predict_ms(size)
            if at > 0 and math.isfinite(mean_ms / at):
                k = mean_ms / at
                out[n] = dataclasses.replace(fit, alpha_ms=ref.alpha_ms * k, beta_ms=ref.beta_ms * k)
        return out

    @staticmethod
    def _build(per_count: dict[int, "ServiceFit"], device_util: float | None,
               device_share: float = DEVICE_SHARE, contention_floor: float | None = None) -> "ServiceModel":
        gammas = []
        counts = sorted(per_count)
        for i, m1 in enumerate(counts):
            for m2 in counts[i + 1:]:
                common = sorted(set(per_count[m1].batch_sizes) & set(per_count[m2].batch_sizes))
                b = common[0] if common else 1
                s1, s2 = per_count[m1].predict_ms(b), per_count[m2].predict_ms(b)
                if s1 <= 0:
                    continue
                r = s2 / s1
                denom = (m2 - 1) - r * (m1 - 1)
                if denom > 0:
                    gammas.append(min(1.0, max(0.0, (r - 1) / denom)))
        if gammas:
            return ServiceModel(per_count, float(np.median(gammas)), "measured")
        if device_util is not None and math.isfinite(device_util):
            prior = ServiceModel(per_count, min(1.0, max(0.0, device_util)) * device_share, "utilisation")
        else:
            prior = ServiceModel(per_count, DEFAULT_CONTENTION, "default")
        if contention_floor is not None and math.isfinite(contention_floor) and contention_floor > prior.gamma:
            return ServiceModel(per_count, min(1.0, contention_floor), "cores")
        return prior

    def curve(self, n: int) -> Callable[[float], float] | None:
        """s_n(b) in ms, or None when no count has been measured."""
        if not self.fits:
            return None
        if n in self.fits:
            return self.fits[n].predict_ms
        m = min(self.fits, key=lambda c: (abs(c - n), c))
        scale = (1 + self.gamma * (n - 1)) / (1 + self.gamma * (m - 1))
        base = self.fits[m].predict_ms
        return lambda b: base(b) * scale

    def jitter(self, n: int) -> "Jitter | None":
        """The jitter measured at `n` instances, else at the nearest count measured (the smaller on a tie), else
        None. Example: measured at 1 instance (scv 0.6) and at 2 (0.08): 3 instances are simulated with 2's."""
        return nearest_jitter(self.jitters, n)


def jitter_per_count(jitter_by_config: Sequence[tuple[Settings, "Jitter"]]) -> dict[int, "Jitter"]:
    """Per instance count, the jitter measured there; several delays at one count: the one that varies most (the
    cautious one)."""
    out: dict[int, Jitter] = {}
    for s, j in jitter_by_config:
        if s.instance_count not in out or j.scv > out[s.instance_count].scv:
            out[s.instance_count] = j
    return out


def nearest_jitter(per_count: dict[int, "Jitter"], n: int) -> "Jitter | None":
    """The jitter at `n` instances, else at the nearest count measured (the smaller on a tie), else None: what the
    planner simulates `n` instances with (`ServiceModel.jitter`) and the observer its window's prediction."""
    if not per_count:
        return None
    return per_count[min(per_count, key=lambda c: (abs(c - n), c))]


# ---- predictions for candidate configurations -----------------------------------------------------

SIM_REQUESTS = 1000           # arrivals simulated per candidate (~0.5 ms of CPU here) ...
SIM_REQUESTS_JITTERED = 4000  # ... and where executions vary (a jitter): its p99 is the 10th slowest of 1,000, and a
                              # run of slow draws in a burst of arrivals moved it by half. Measured (resnet_tiny's
                              # summary jitter, 1 instance, 315 req/s, 40 seeds): 1,000 requests p99 22.4 +- 7.0 ms,
                              # max 55.6 (a scale-up taken on such a 56 and undone 11 s later, r97); 4,000 22.1 +- 2.0,
                              # max 27.9 (~2 ms a simulation); exact executions 15.7 +- 1.6 at 1,000
DEVICE_LIMIT = 0.95           # a configuration that would keep the device busier than this cannot hold the load ...
DEVICE_SELF_BATCH = 0.8       # ... at the batches the simulation forms; where the device is busy its queue forms
                              # bigger ones by itself, sized (in `predict`) to keep it this busy
SELF_BATCH_STEPS = 4          # tries at a longer implicit wait when the simulated batches stay too small


@dataclass(frozen=True)
class DeviceShare:
    """How much of the device one execution of b items uses, from the utilisation at the live config.

    At the live configuration the device was `util` busy while it ran `exec_rps` executions of
    `batch` items on average: one execution used util / exec_rps of the device's second. Another
    batch size is scaled by the service curve's shape: phi(b) = phi(batch) * s(b) / s(batch).
    Example: 90% busy at 400 executions/s of 1 item, s(b) = 6 + 1.5 b: phi(1) = 0.00225; at b = 8,
    phi(8) = 0.00225 * 18 / 7.5 = 0.0054, so 400 req/s in batches of 8 use 50 x 0.0054 = 27% of the
    device: the "100% busy yet slow" case, where larger batches free the device.

    Several models on one device: the utilisation is theirs together. `fraction` is this model's share
    of the work on it (its instance-seconds executing per second over all the device's models', from the
    loop); the rest, `others`, stays as it is in every candidate. Example: 90% busy, this model 1/3 of the
    work: phi comes from 30%, and a candidate's load is 60% + its own.
    """

    per_exec: float            # phi(batch)
    batch: float
    shape: Callable[[float], float]
    others: float = 0.0        # the device's load from other models

    @staticmethod
    def at(device_util: float | None, exec_rps: float, avg_batch: float, fit: "ServiceFit",
           fraction: float | None = None) -> "DeviceShare | None":
        """From the live configuration's readings; None without a utilisation reading or executions."""
        if device_util is None or not math.isfinite(device_util) or exec_rps <= 0:
            return None
        util = min(1.0, max(0.0, device_util))
        mine = 1.0 if fraction is None or not math.isfinite(fraction) else min(1.0, max(0.0, fraction))
        return DeviceShare(util * mine / exec_rps, max(1.0, avg_batch), fit.predict_ms, util * (1.0 - mine))

    def load(self, arrival_rps: float, mean_batch: float) -> float:
        """The device's predicted load with this model at `arrival_rps` in batches of `mean_batch`, both in items
        (`predict` passes requests/s x items a request: executions/s are items/s over items a batch)."""
        b = max(1.0, mean_batch)
        base = max(1e-9, self.shape(self.batch))
        return self.others + arrival_rps / b * self.per_exec * self.shape(b) / base

    def batch_for(self, arrival_rps: float, load: float, max_batch: int) -> float | None:
        """The smallest mean batch (1 .. `max_batch`) that keeps the device's load at `arrival_rps` under
        `load`; None when even full batches do not. The cost per request, s(b) / b, falls with b (the
        curves are lines with a positive intercept), so the load falls with b: bisection.
        Example: phi(1) = 0.00225 (90% busy at 400 executions/s of 1 item), s(b) = 6 + 1.5 b: at 400 req/s the
        load is 0.12 x (6 / b + 1.5), so batches of 1.16 keep the device 80% busy (0.66 at 1.5, 0.9 at 1)."""
        top = float(max(1, max_batch))
        if self.load(arrival_rps, top) > load:
            return None
        if self.load(arrival_rps, 1.0) <= load:
            return 1.0
        lo, hi = 1.0, top
        for _ in range(30):
            mid = (lo + hi) / 2
            if self.load(arrival_rps, mid) <= load:
                hi = mid
            else:
                lo = mid
        return hi


@dataclass(frozen=True)
class Candidate:
    settings: Settings
    arrival_rps: float
    p99_ms: float              # corrected by the observed/predicted ratio; inf when the load cannot be held
    raw_p99_ms: float
    mean_batch: float
    device_load: float | None
    meets: bool
    self_batch_us: int = 0     # > 0: the device is the limit; predicted with the queue forming bigger batches by
                               # itself, as if the batcher waited this long (see `predict`)
    within: float = 1.0        # the predicted share of requests served within the limit (0 when the load cannot be
                               # held: a queue that grows without end ends up missing every target)

    def as_dict(self) -> dict:
        r = lambda x, n=2: None if x is None or not math.isfinite(x) else round(x, n)  # noqa: E731
        out = {"instances": self.settings.instance_count, "delay_us": self.settings.max_queue_delay_us,
               "at_rps": r(self.arrival_rps, 1), "p99_ms": r(self.p99_ms), "mean_batch": r(self.mean_batch),
               "device_load": r(self.device_load, 3)}
        if self.self_batch_us:
            out["self_batch_us"] = self.self_batch_us
        return out


QUANTUM = 0.01               # rates and service times are simulated on a 1% grid ...
MEMO_SIZE = 2048             # ... so that the same quantised inputs reuse a simulation (a few ms each)
_memo: "OrderedDict[tuple, Prediction | None]" = OrderedDict()


def _q(x: float, step: float = 1.01) -> float:
    """`x` (> 0) on the logarithmic grid of `step` (1%). Example: 101.3 -> 101.28 (1.01 ** 464), 0 stays 0."""
    if x <= 0 or not math.isfinite(x):
        return x
    return step ** round(math.log(x) / math.log(step))


ITEMS_STEP = 0.05           # items a request carries are simulated on this grid (simulate_quantised)
JITTER_GRID = 1.05           # jitter quantiles are simulated on a 5% grid: the estimate moves every tick (a new window
                             # enters its median), and on the 1% grid every tick would simulate every candidate anew


def _in_requests(max_batch: int, items: float) -> tuple[float, int]:
    """(the items a request carries, on the ITEMS_STEP grid and at least 1; the requests a full batch of `max_batch`
    items holds, at least 1). Example: 32 and 4.0 -> (4.0, 8); 16 and 5.02 -> (5.0, 3)."""
    k = max(1.0, round(round(items / ITEMS_STEP) * ITEMS_STEP, 2)) if math.isfinite(items) else 1.0
    return k, max(1, int(max(1, int(max_batch)) / k + 1e-9))


def simulate_quantised(arrival_rps: float, instances: int, delay_us: int, max_batch: int,
                       service_ms: Callable[[int], float], jitter: "Jitter | None" = None,
                       items: float = 1.0) -> Prediction | None:
    """`simulate` on the 1% grid, remembered: the rate and the service curve (at b = 1, 2, 4, ... and
    `max_batch`, joined by straight lines) are rounded to 1%, so that the answer depends only on the
    rounded inputs and a tick that sees the same load as the last reuses its simulations. The curves
    are lines (service.py), so the rounded curve is within 1% of the measured one everywhere.
    Example: rates 300.0 and 301.5 req/s fall on the same grid point (300.3); 306 does not. The jitter's
    quantiles are rounded to a 5% grid (JITTER_GRID).

    `items`: the items a request carries on average (the observation's `items_per_request`). Triton's batch sizes,
    `max_batch` and the service curve count items; the rates and the simulation count requests. So a batch of r
    requests takes service_ms(r x items), a full batch holds max_batch / items requests (at least 1), and the
    answer's `mean_batch` is in items again. Example: max_batch 32, requests of 4 items: at most 8 requests a batch,
    and 3 queued requests run as one execution of 12 items. Requests of mixed sizes are taken at their mean, on a
    grid of 0.05 items (ITEMS_STEP: whole numbers stay whole). Why: simulated as one item each, clients that sent 4
    items a request were predicted a p99 of 23 ms at 32 req/s where 65 ms was observed, and the planner stood aside
    for the reactive rules."""
    k, mb = _in_requests(max_batch, items)
    points = sorted({1, mb} | {2 ** j for j in range(1, 16) if 2 ** j < mb})
    values = tuple(_q(max(0.0, float(service_ms(b * k)))) for b in points)
    jq = () if jitter is None else tuple(_q(x, JITTER_GRID) for x in jitter.quantiles)
    key = (_q(arrival_rps), instances, int(delay_us), mb, values, jq, k)
    if key in _memo:
        _memo.move_to_end(key)
        return _memo[key]

    def line(b: float) -> float:
        if b <= points[0]:
            return values[0]
        for (b0, v0), (b1, v1) in zip(zip(points, values), zip(points[1:], values[1:])):
            if b <= b1:
                return v0 + (v1 - v0) * (b - b0) / (b1 - b0)
        return values[-1]

    result = simulate(key[0], instances, delay_us, mb, line, requests=SIM_REQUESTS_JITTERED if jq else SIM_REQUESTS,
                      jitter=jq)
    if result is not None and k != 1.0:
        result = dataclasses.replace(result, mean_batch=result.mean_batch * k)
    _memo[key] = result
    if len(_memo) > MEMO_SIZE:
        _memo.popitem(last=False)
    return result


IMPLICIT_GRID_US = (0, 250, 500, 1000, 2000)   # the batcher's own wait, as measured (implicit_step), on this grid
IMPLICIT_TOLERANCE = 0.02    # a simulated mean batch within 2% under the observed one matches it (simulation noise)


def implicit_step(parts: Sequence[tuple[float, float]], live: Settings, curve: Callable[[float], float],
                  max_batch: int, items: float, observed_batch: float, jitter: "Jitter | None" = None,
                  current: int = 0) -> int | None:
    """One step of the search for how long the server's batcher acts as if it waited before taking a batch from an
    instance that is free: the wait on IMPLICIT_GRID_US, added to the live delay, at which the simulation of the live
    configuration forms batches as large as the server did over the window (`observed_batch`: items an execution, the
    window's avg_batch_size). From `current` it moves one grid step a window: up where the simulation's batches at
    `current` fall short of the observed ones (by more than IMPLICIT_TOLERANCE), down where they exceed them by as
    much and the next wait down already forms them, else it stays; so a step simulates once, twice where it may go
    down. `parts`: the window's loads (rate, share of its requests: `rate_components`); their batches mix as the
    requests' share over each load's mean batch. None where nothing can be read: no load, or batches that hold one
    request only (no wait makes them larger).

    Why: the simulation's batcher takes a batch the instant an instance is free, so with instances to spare every
    request runs alone; the server formed larger ones. sim_accel, 4 instances, 95 req/s of 4 items (batched r68):
    1.07 requests an execution where the simulation formed 1.00, and those batches of 8-12 items set the p99 (26.4 ms
    traced, 15.9 simulated): the correction reached 1.34-1.6, the planner took a 4th instance it did not need and
    then stood aside. Simulated with a 1,000-us wait: 1.08 requests an execution and p99 26.2 ms; at 3 instances
    1.07 and 25.1 ms (1.06-1.08 and 23-28 traced), at 2 1.07 (1.06). Whatever makes it (the batcher's thread waking
    late on a busy host, requests arriving in clumps), it is measured where it shows, in the batches.
    Example: observed 4.29 items an execution at 4 instances, 95 req/s of 4 items: 0 us simulates 4.01, 250 us 4.14,
    500 us 4.20, 1,000 us 4.32 >= 4.29 x 0.98; from 0 the steps go 250, 500, 1,000 and stay there."""
    k, full = _in_requests(max_batch, items)
    parts = [(r, w) for r, w in parts if r > 0 and w > 0]
    if not parts or not observed_batch > 0 or full < 2:
        return None

    def batch_at(wait: int) -> float | None:
        sims = [(simulate_quantised(r, live.instance_count, live.max_queue_delay_us + wait, max_batch, curve, jitter,
                                    k), w) for r, w in parts]
        if any(p is None for p, _ in sims):
            return None
        return sum(w for _, w in sims) / sum(w / max(p.mean_batch, 1e-9) for p, w in sims)   # items / executions

    grid = IMPLICIT_GRID_US
    i = grid.index(current) if current in grid else 0
    enough = observed_batch * (1.0 - IMPLICIT_TOLERANCE)
    here = batch_at(grid[i])
    if here is None:
        return None
    if here < enough:
        return grid[min(i + 1, len(grid) - 1)]
    if i > 0 and here > observed_batch * (1.0 + IMPLICIT_TOLERANCE):
        below = batch_at(grid[i - 1])
        if below is None:
            return None
        if below >= enough:
            return grid[i - 1]
    return grid[i]


def predict(settings: Settings, arrival_rps: float, model: ServiceModel, max_batch: int, correction: float,
            limit_ms: float, device: DeviceShare | None = None) -> Candidate | None:
    """One candidate's corrected p99 at `arrival_rps` (requests/s of `model.items` items each); None without a service
    curve for it."""
    curve = model.curve(settings.instance_count)
    if curve is None:
        return None
    jitter = model.jitter(settings.instance_count)
    k = model.items
    if arrival_rps < 0.01:       # why: no load to speak of (and 1/rate would overflow): a lone request
        s1 = curve(k) * (1.0 if jitter is None else jitter.at(0.99))
        ok = s1 * correction <= limit_ms
        return Candidate(settings, arrival_rps, s1 * correction, s1, k, 0.0, ok, within=1.0 if ok else 0.0)
    delay_us = settings.max_queue_delay_us + model.implicit_us     # the batcher's wait, as the server shows it
    sim = simulate_quantised(arrival_rps, settings.instance_count, delay_us, max_batch, curve, jitter, k)
    if sim is None:
        return None
    # the device's load and batches are in items: executions/s = items/s over items a batch
    load = None if device is None else device.load(arrival_rps * k, sim.mean_batch)
    waited_us = 0
    if device is not None and sim.stable and load > DEVICE_LIMIT:
        # why: the simulation's batches are what free instances take at once; where those would keep the device
        # over its limit, instances wait on the device and the queue grows meanwhile, so the batches grow by
        # themselves (without any delay) until the device keeps up. Predicted as the wait that forms batches big
        # enough to keep the device DEVICE_SELF_BATCH busy: a measured host-heavy model at 2 x 0us held 300 req/s
        # (p99 43 ms, SLA 50) where the load at its small batches read "cannot hold", and the planner chose a
        # needless 8-ms delay (a full reload) instead (docs/results.md, "A model the planner was not tuned on").
        need = device.batch_for(arrival_rps * k, DEVICE_SELF_BATCH, max_batch) \
            or device.batch_for(arrival_rps * k, DEVICE_LIMIT, max_batch)   # full batches, busier still
        if need is None:
            sim = dataclasses.replace(sim, stable=False)
        else:
            wait_us = max(delay_us, _wait_us((need / k - 1.0) / arrival_rps))
            for _ in range(SELF_BATCH_STEPS):
                waited = simulate_quantised(arrival_rps, settings.instance_count, wait_us, max_batch, curve, jitter, k)
                if waited is None:
                    return None
                sim, waited_us, load = waited, wait_us, device.load(arrival_rps * k, waited.mean_batch)
                if load <= DEVICE_LIMIT or not sim.stable:
                    break
                wait_us = _wait_us(1.5 * wait_us / 1e6)
    holds = sim.stable and (load is None or load <= DEVICE_LIMIT)
    p99 = sim.p99_ms * correction if holds else math.inf
    within = 1.0 - survival(sim, limit_ms / max(correction, 1e-9)) if holds and math.isfinite(limit_ms) else \
        (1.0 if holds else 0.0)
    return Candidate(settings, arrival_rps, p99, sim.p99_ms if holds else math.inf, sim.mean_batch, load,
                     p99 <= limit_ms, waited_us if holds else 0, within)


def _wait_us(seconds: float) -> int:
    """A wait in whole 250-us steps, rounded up (so that nearby rates reuse one simulation)."""
    return int(250 * math.ceil(max(0.0, seconds) * 1e6 / 250))


def delay_grid(min_us: int, max_us: int, current_us: int) -> list[int]:
    """Delays worth trying, shortest first: the minimum, the live one, x4 steps from 500 us, the maximum."""
    grid = {min_us, current_us}
    d = 500
    while d <= max_us:
        if d >= min_us:
            grid.add(d)
        d *= 4
    if max_us > min_us:
        grid.add(max_us)
    return sorted(x for x in grid if min_us <= x <= max_us)


def capacity_rps(settings: Settings, model: ServiceModel, max_batch: int, correction: float, target_ms: float,
                 device: DeviceShare | None = None, iterations: int = 7, upper: float | None = None) -> float | None:
    """The highest arrival rate at which `settings` is predicted to keep p99 under `target_ms` (bisection).

    Example: s(b) = 6 + 1.5 b, one instance, delay 0, target 40 ms: about 290 req/s, since at 300
    the batcher's batches (~4) barely keep up and the queue's tail passes 40 ms."""
    curve = model.curve(settings.instance_count)
    if curve is None:
        return None
    b = max(1, max_batch)
    top = settings.instance_count * b / max(1e-6, curve(b) / 1000.0) / model.items   # every instance, full batches
    lo, hi = 0.0, top if upper is None else min(top, upper)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        c = predict(settings, mid, model, max_batch, correction, target_ms, device)
        if c is not None and c.meets:
            lo = mid
        else:
            hi = mid
    return lo


# ---- the choice ----------------------------------------------------------------------------------

MARGIN = 0.9                 # a configuration is chosen when its predicted p99 stays under 0.9 x the target
CONSOLIDATE_MARGIN = 0.8     # ... and a smaller one replaces the live one only under 0.8 x the target ...
CONSOLIDATE_TICKS = 3        # ... on this many decisions in a row (and carrying any rise from a lull in the
                             # forecast's look-back: `choose`'s `past_rise`) ...
CONSOLIDATE_HEADROOM = 1.25  # ... or under MARGIN x the target at this many times the forecast's high end,
RISING = 1.05                # ... unless the forecast's mid rises past this many times its level (a ramp under way)
NO_GAIN = 1.05               # ... or when the instances it drops buy nothing: its p99 within 5% of the live one's
CORRECTION_BOUNDS = (0.67, 1.5)  # observed/predicted p99 is applied within these bounds ...
DISAGREE = 0.5               # ... and when its median is off by more than 50%, the model is not trusted
RATIO_WINDOWS = 3            # recent windows the correction is the median of: windows that do not overlap, so one
                             # bad second (in every window that holds it) is one ratio of three, not the majority
DELAY_MIN_GAIN = 0.9         # a longer delay is chosen over the shortest only if its p99 is predicted 10% lower
BEST_EFFORT_GAIN = 0.9       # where nothing meets: a change only for a p99 predicted 10% lower (where neither
                             # holds the load: for a sustained rate 1/0.9 = 11% higher)
RATIO_MAX_AGE_S = 90.0
MIN_RATIO_SAMPLES = 20       # a window's traced p99 (or, untraced, its mean) rests on at least this many requests
RATIO_SOURCES = ("trace", "mean", "mean_tail")   # what a window's ratio compares: traced p99s, or (untraced) mean
                                                 # latencies, alone or times the summaries' tail (policy.window_check)
OBSERVED_OK_SAMPLES = 100    # a scale-up is held when the live config was seen meeting the margin: over this many
OBSERVED_OK_AGE_S = 2.0      # traced requests, with the forecast's high end reached at least this long ago


@dataclass(frozen=True)
class ConfigRatios:
    """What one configuration did when live: its last windows' observed/predicted ratios (clipped), the two kinds
    kept apart (`own_ratio` reads each, `config_correction` takes the larger). `ratios`: estimates of its p99's
    ratio (a traced p99, or untraced the mean times the summaries' tail); `bounds`: untraced windows before the
    tail was measured, the mean's ratio, which is only a lower bound of the p99's (a mean at or under the
    prediction is recorded as 1.0: the tail is not seen). `at` / `bounds_at`: when each kind was last recorded."""

    settings: Settings
    at: float = -math.inf
    ratios: tuple[float, ...] = ()
    bounds_at: float = -math.inf
    bounds: tuple[float, ...] = ()

    def own(self, now: float) -> float | None:
        """The larger of what each kind says (`own_ratio`), or None where neither remembers anything."""
        said = [r for r in (own_ratio(self.ratios, now - self.at), own_ratio(self.bounds, now - self.bounds_at))
                if r is not None]
        return max(said) if said else None


@dataclass(frozen=True)
class PlannerState:
    """What the planner remembers between decisions (kept inside the policy's state)."""

    ratios: tuple[tuple[float, float], ...] = ()      # (time, observed / predicted p99) of recent windows
    by_config: tuple[ConfigRatios, ...] = ()          # per configuration, what it did when live, the most recent last
    smaller_ticks: int = 0                            # a smaller configuration met CONSOLIDATE_MARGIN this many decisions in a row
    smaller_best: Settings | None = None              # the largest of those smaller choices (the safe one)
    ratio_source: str = ""                            # what the last recorded window compared (RATIO_SOURCES)
    reload_s: float = 2.0                             # how long an applied change took (EWMA)


CONFIG_RATIO_MAX_AGE_S = 900.0   # what a configuration did when live is remembered this long ...
CONFIG_RATIO_CONFIRMED = 2       # ... as the smaller of its last this many windows' ratios (one bad window is not
                                 # what it did); a lone window only as long as a recent ratio is (RATIO_MAX_AGE_S) ...
CONFIG_RATIO_KEPT = 16           # ... for this many configurations


def bounded(ratio: float) -> float:
    """An observed/predicted ratio within CORRECTION_BOUNDS: how far one ratio may move a prediction."""
    return min(max(ratio, CORRECTION_BOUNDS[0]), CORRECTION_BOUNDS[1])


def own_ratio(ratios: tuple[float, ...], since_s: float) -> float | None:
    """What a configuration did when live, from its last windows' (clipped) ratios, the last `since_s` ago:
    the smaller of its last CONFIG_RATIO_CONFIRMED, kept CONFIG_RATIO_MAX_AGE_S; a lone window's kept only as
    long as a recent ratio is (RATIO_MAX_AGE_S); None when forgotten. Why: in bursty r24 the first window
    after the warm-up read 1.68 on one instance, the only window one instance ever had; as one instance's own
    correction (clipped to 1.5) for 15 minutes it put every later check of one instance at 1.5x, and no
    consolidation to one followed. Examples: (1.5,) -> 1.5 for 90 s, then None; (1.5, 1.0) -> 1.0 (the bad
    window was not what it does); (1.4, 1.4) -> 1.4 for 15 minutes (a delay that ran worse twice)."""
    if not ratios:
        return None
    if len(ratios) >= CONFIG_RATIO_CONFIRMED:
        return min(ratios[-CONFIG_RATIO_CONFIRMED:]) if since_s <= CONFIG_RATIO_MAX_AGE_S else None
    return ratios[-1] if since_s <= RATIO_MAX_AGE_S else None


def record_ratio(state: PlannerState, observed: float | None, predicted: float | None, source: str,
                 samples: int, now: float, live: Settings | None = None, since: float | None = None) -> PlannerState:
    """Keep observed/predicted of a window measured on enough requests (`samples`): in the recent windows
    (the correction of every prediction) and, per configuration, as what that configuration did when it
    was live (the correction of its own predictions when it is a candidate again).

    `source` says what is compared: "trace", the traced p99 against the predicted p99; "mean", where nothing
    is traced, the counters' mean latency (exact: every request's time over their count) against the
    simulation's mean for the same window. Any other source (a p99 estimated from the counters, Triton's
    minute-old summary) is not a measurement of this window's p99 and is not recorded. Why the mean stands in
    for the p99 untraced: an error of the model's service times (a contention the curve missed, a host cost
    outside the measured compute) moves the whole distribution, its mean as much as its tail; the mean is
    measured exactly, while the untraced p99 is that mean times a tail ratio learned from Triton's summaries,
    so checking that estimate against the prediction would only add the tail ratio's error. What the mean does not see is a tail the model misses with the right
    mean (execution jitter, which untraced is not measured either), so a mean ratio only ever raises the
    predictions: one under 1 is recorded as 1. Measured traced, both ratios side by side (r82, 137-177 ticks
    each): the CPU torch model's means ran at 0.90 of the prediction while its p99s ran at 1.21; applied as a
    correction, the mean would have lowered p99s the model already under-predicted. sim_accel 1.00 / 1.05,
    sim_wide 1.00 / 1.01, sim_host 0.95 / 0.92. So a model whose means run slow is corrected and, past
    1 + DISAGREE, set aside for the reactive rules; one whose means run fast is left as predicted (it may
    over-provision, never under-). Example: a window untraced over 900 requests, mean 19.8 ms where the
    simulation's mean is 16.5 ms: ratio 1.2, and every prediction is multiplied by it as by a traced window's;
    mean 14.0 ms: recorded as 1.0. "mean_tail": the mean times what the summaries measured of the tail against
    the simulation's (`observer.ModelObserver._check_tail`), a p99 ratio as a traced window's, recorded as it is
    (the tail is measured, so a mean that runs fast may lower it): mean ratio 0.9 x tail 1.34 records 1.21.

    `since`: where the window began (None: unknown, taken as new). A window that overlaps the last one
    recorded is skipped: decisions come every tick, windows span many ticks, and a one-second stall would
    otherwise sit in every window that holds it and count as most of the recent ratios. Example: 10-s
    windows, 1-s ticks, ratios 1.0 at 60 s and 70 s, a 120-ms second at 84 s: the window ending at 80 s is
    recorded (1.0), those ending at 81-89 s are skipped (they overlap it), the one ending at 90 s reads
    2.5: the median of (1.0, 1.0, 2.5) is 1.0, the planner stays in charge. Were the model really 2.5x
    off, the window ending at 100 s would read 2.5 too, and the median of the last three would say so.
    What a configuration did when live is its last windows' ratios, each clipped to `CORRECTION_BOUNDS`,
    read by `own_ratio` (an untraced mean's, a lower bound, kept apart: `ConfigRatios`): one bad window counts
    for 90 s, two for 15 minutes. A delay that really ran worse
    than predicted is set aside for 90 s after one window and, tried again and worse again, for 15 minutes."""
    if (observed is None or predicted is None or source not in RATIO_SOURCES or samples < MIN_RATIO_SAMPLES
            or predicted <= 0 or not math.isfinite(predicted) or observed <= 0):
        return state
    last = state.ratios[-1][0] if state.ratios else None     # end of the last recorded window
    if since is not None and last is not None and since < last <= now:
        return state
    ratio = max(1.0, observed / predicted) if source == "mean" else observed / predicted
    kept = tuple(r for r in state.ratios if now - r[0] <= RATIO_MAX_AGE_S)
    by_config = state.by_config
    if live is not None:
        by_config = tuple(x for x in by_config if now - max(x.at, x.bounds_at) <= CONFIG_RATIO_MAX_AGE_S)
        old = next((x for x in by_config if x.settings == live), ConfigRatios(live))
        if source == "mean":        # a lower bound of its p99's ratio (the tail not seen): kept apart, `ConfigRatios`
            mine = dataclasses.replace(old, bounds_at=now,
                                       bounds=(old.bounds + (bounded(ratio),))[-CONFIG_RATIO_CONFIRMED:])
        else:
            mine = dataclasses.replace(old, at=now, ratios=(old.ratios + (bounded(ratio),))[-CONFIG_RATIO_CONFIRMED:])
        by_config = (tuple(x for x in by_config if x.settings != live) + (mine,))[-CONFIG_RATIO_KEPT:]
    return dataclasses.replace(state, ratios=(kept + ((now, ratio),))[-RATIO_WINDOWS:], by_config=by_config,
                               ratio_source=source)


CORRECTION_FROM = {"mean": " (from mean latencies)",
                   "mean_tail": " (from mean latencies x the summaries' tail)"}


def config_correction(state: PlannerState, settings: Settings, default: float, now: float) -> float:
    """The correction for one candidate: `default` (the recent windows' ratio), or its own ratio from
    when it was live (`own_ratio`) where that was worse. Never better than `default`: a ratio from another
    time (a quieter machine, say) must not make one candidate look cheaper than the others.

    Example: 1 instance at 2000 us was live and ran at 1.3x its prediction in its last two windows; the
    recent windows say 1.1: when it is a candidate again, its prediction is multiplied by 1.3. Had it run at
    0.9x: by 1.1. Had only one window said 1.3: by 1.3 for 90 s after it, then by 1.1.

    Untraced, its windows from before the tail was measured (the mean's ratio, a lower bound: `ConfigRatios`) and
    those after (an estimate) are read apart and the larger taken, not the smaller of the last two of both. Why:
    resnet_tiny r103, one instance: mean windows 1.15 and 1.0 (a mean under the prediction, recorded as 1.0), then
    the first with the summaries' tail, 1.18; the planner scaled up on one instance predicted over the margin x
    1.18, and 13 s later, at the same load, took one instance back as "under 0.8x the target" x min(1.0, 1.18) =
    1.0; back at one instance its next window read 1.23. Now: max(1.18, min(1.15, 1.0)) = 1.18."""
    for x in state.by_config:
        if x.settings == settings:
            own = x.own(now)
            return default if own is None else max(default, own)
    return default


def correction(state: PlannerState, now: float) -> tuple[float, float | None]:
    """(the factor applied to predictions, the raw median ratio or None without recent windows).

    Example: recent ratios 1.1, 1.3, 1.2 -> median 1.2: every prediction is multiplied by
    1.2. Ratios 2.4, 2.0, 2.2 -> median 2.2, applied as 1.5 (the bound), and off by more than
    `DISAGREE`: the planner steps aside for the reactive rules."""
    recent = [r for t, r in state.ratios if now - t <= RATIO_MAX_AGE_S]
    if not recent:
        return 1.0, None
    raw = float(np.median(recent))
    return bounded(raw), raw


@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs beyond the observation: every measured service curve and the forecast."""

    fits: tuple[tuple[Settings, "ServiceFit"], ...]
    forecast: Forecast | None
    max_batch: int
    interval_s: float
    device_fraction: float | None = None     # this model's share of its device's work (None: all of it)
    jitters: tuple[tuple[Settings, "Jitter"], ...] = ()   # per configuration: its executions' jitter (`simulate`)
    items_per_request: float = 1.0           # items a request carries on average (`simulate_quantised`)
    implicit_us: int = 0                     # the batcher's wait beyond its delay, as measured (`implicit_step`)
    device_share: float = DEVICE_SHARE       # the share of an execution on the device (CPU_SHARE where it is the CPU)
    contention_floor: float | None = None    # the contention the free cores imply (`cpu.CpuUse.contention`; CPU only)


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one decision."""

    target: Settings | None                  # None: keep the live configuration
    reason: str
    detail: str
    usable: bool                             # False: fall back to the reactive rules (reason says why)
    live: Candidate | None = None
    chosen: Candidate | None = None
    band: tuple[float, float, float] | None = None
    correction: float = 1.0
    state: PlannerState = PlannerState()
    spare: int = 0                           # instances the live config could give up now (what the arbiter reads)


def fallback(why: str, state: PlannerState) -> Plan:
    return Plan(None, "Fallback", why, usable=False, state=state)


def choose(live: Settings, arrival_rps: float, inputs: PlanInputs, state: PlannerState, *, target_ms: float,
           min_instances: int, ceiling: int, min_delay_us: int, max_delay_us: int, delay_allowed: bool,
           device_util: float | None, exec_rps: float, avg_batch: float, now: float,
           reload_max: int | None = None, starts_cold: bool = False) -> Plan:
    """The fewest instances, then the shortest delay, predicted to keep p99 under MARGIN x target at
    the forecast's upper band; a smaller configuration only after CONSOLIDATE_TICKS checks in a row, and,
    where the load rose from a lull in the forecast's look-back, only as far as that rise allows (`past_rise`).

    A smaller configuration qualifies by one of three rules:

    * *margin*: it is predicted under CONSOLIDATE_MARGIN x the target at the forecast's high end;
    * *room*: it is predicted under MARGIN x the target (the margin the choice keeps) at CONSOLIDATE_HEADROOM x the
      forecast's high end: a quarter more load than that. For a p99 that hardly grows with the load, near the
      target, where a margin on the latency says nothing about the load a configuration can take. An unseen model's
      bench (r52: ~9 ms a request, host work then a device of 3 slots, a 25-ms target): one instance's p99 is
      predicted 20-22 ms from 80 req/s to 150 (mostly a request waiting behind another's execution), never under
      0.8 x 25 = 20 ms above ~30 req/s, so the lull of its day (80 req/s for 30 s) kept the second instance throughout:
      instance-seconds 1.01 of the best static configuration's, where the oracle, one instance in the lull (22.5 ms
      measured), needed 0.77. With the rule (r53) one instance was predicted 22.2 ms at 1.25 x 98 = 122 req/s, under
      22.5, and took the lull 13 s into it: 0.93, the same goodput (r56, with the guard below: 0.79). A
      configuration chosen so is not scaled straight back up: the choice asks the same margin at the high end
      itself, 25% less load. Where the p99 rises steeply (a busy instance), the rule is the stricter one: shift's
      afternoon (one sim_accel instance ~97% busy at 220 req/s) does not hold 275. Not while the load rises (the
      forecast's mid over RISING x its level): where the p99 is that flat, 1.25 x the load adds only ~1 ms to it, as
      much as the observed/predicted correction moves from one window to the next, and on a ramp such a flip is paid
      at once. r55 (the same bench again): at 265 req/s on the ramp to 360, 3 -> 2 by this rule (correction 1.00),
      2 -> 3 nine seconds later (correction 1.05);
    * *buys nothing*: the instances it drops buy nothing at this load: its p99, predicted with the live
      configuration's correction, is within NO_GAIN of the live one's (and under MARGIN x the target, unless
      nothing is). For targets close to the model's own latency: with a 9 ms target on a model whose lone
      request takes 7.5 ms, 0.8 x 9 = 7.2 ms is out of reach at any load, yet at 0 req/s a second instance is
      pure waste; with an 8 ms target not even 0.9 x 8 = 7.2 ms is, and the same holds. (A configuration's own
      remembered ratio is not used there: it was measured at another load, and at this one both configurations
      run the same lone requests.)

    Worked example (s(b) = 6 + 1.5 b measured at 1 instance, gamma 0.1, target 40 ms, max batch 32):
    the forecast says 220-260 req/s within the next reload + tick. At 260 req/s one instance at
    delay 0 is predicted at ~44 ms (> 36 = 0.9 x 40), two instances at ~17 ms: the choice is 2 (or
    more, in one jump, if the band were higher). Later the band falls to 80-100 req/s: one instance
    at 100 req/s is predicted at ~19 ms (< 32 = 0.8 x 40) three decisions in a row: back to 1.

    `reload_max`: the most instances a full reload may load now (None: no limit known). A new delay is a full
    reload, which loads the target's instances beside the live ones, so a candidate with another delay and
    more instances than that is not considered (the memory budget, double memory during a full reload).
    Example: budget 3 instances, 1 of another model and 1 live here: 1 x 0us -> 2 x 2000us would hold 4 for
    a moment; `reload_max` = 1, so 2 x 0us (in place) or 1 x 2000us are the options.

    **A scale-up keeps the live delay where it can.** Where the live configuration misses the margin, the choice is
    the fewest instances *at the live delay* (instances added in place), and a new delay only where no count at
    the live delay, up to the ceiling, is predicted under the margin: the device the limit (more instances
    contend and buy nothing), the ceiling or the memory budget reached. Why: a new delay is a full reload, which
    starts every instance again beside the live ones while the load is rising, and the benches never showed one
    paying for that. shift_tight r74: 3 x 0us -> 3 x 2000us in the flash, by a full reload, its p99 40.1 ms against
    a 25-ms SLA; r80 (traced round 1): the same change at 103 s, the flash's p99 29.7 ms, against 23.2-24.9 ms in
    the three runs beside it that added an instance in place instead; resnet_shift r77: a 6.2-s full reload to
    1 x 2000us where 2 x 0us in place was predicted within the margin. The configuration passed over is named in
    the decision ("in place rather than 3x2000us"). A scale-down may still shorten the delay (consolidation).

    `starts_cold`: the model's first executions after a load are slow (`service.ServiceTimes.cold_start`). A new
    delay is a full reload, whose every instance then starts cold, while an in-place change starts only the
    instances it adds. So the delay stays where it is, as on any scale-up, and a consolidation keeps the delay too.
    Why: sim_accel with an 800-ms first execution (an H200's without a warm-up) in the shift bench went
    2 x 0us -> 2 x 500us -> 2 x 0us -> 2 x 2000us -> 2 x 0us, four full reloads, each serving its first requests
    800 ms late: a p99 of 734 ms over the run against 20 ms where the same model held 3 x 0us.
    """
    model = ServiceModel.build(inputs.fits, device_util, inputs.jitters, inputs.items_per_request, inputs.implicit_us,
                               inputs.device_share, inputs.contention_floor)
    if live.instance_count not in model.fits:
        return fallback("too little data: no service curve measured for the live instance count yet", state)
    factor, raw = correction(state, now)
    if raw is not None and not (1 - DISAGREE) <= raw <= 1 + DISAGREE:
        what = {"mean": "mean latency", "mean_tail": "p99 (mean latency x the summaries' tail)"}.get(
            state.ratio_source, "p99")
        return fallback(f"observed {what} is {raw:.2f}x the predicted over recent windows", state)
    horizon = state.reload_s + inputs.interval_s
    if inputs.forecast is not None and inputs.forecast.ticks >= 3:
        band = inputs.forecast.band(horizon)
    else:
        band = (arrival_rps, arrival_rps, arrival_rps * 1.1)
    hi = max(band[2], 0.0)
    device = DeviceShare.at(device_util, exec_rps, avg_batch, model.fits[live.instance_count], inputs.device_fraction)
    mb = max(1, inputs.max_batch)
    limit = MARGIN * target_ms
    every_delay = delay_grid(min_delay_us, max_delay_us, live.max_queue_delay_us) if delay_allowed and mb > 1 \
        else [live.max_queue_delay_us]
    delays = every_delay
    cache: dict[Settings, Candidate | None] = {}

    def reloadable(s: Settings) -> bool:
        """A change to `s` fits in memory: in place (same delay), or a full reload of at most `reload_max`."""
        return s.max_queue_delay_us == live.max_queue_delay_us or reload_max is None or s.instance_count <= reload_max

    def correction_of(s: Settings) -> float:
        """The correction a prediction of `s` takes: the recent one for the live configuration, else its own."""
        return factor if s == live else config_correction(state, s, factor, now)

    def at_hi(s: Settings) -> Candidate | None:
        if s not in cache:
            cache[s] = predict(s, hi, model, mb, correction_of(s), limit, device)
        return cache[s]

    def at_headroom(s: Settings) -> Candidate | None:
        """`s` predicted at CONSOLIDATE_HEADROOM x the forecast's high end (for a scale-down, see the doc)."""
        return predict(s, hi * CONSOLIDATE_HEADROOM, model, mb, correction_of(s), limit, device)

    def shrinks(c: Candidate) -> bool:
        """`c` is smaller than the live configuration: fewer instances, or as many with a shorter delay."""
        n, d = c.settings.instance_count, c.settings.max_queue_delay_us
        return n < live.instance_count or (n == live.instance_count and d < live.max_queue_delay_us)

    def fewest(under_ms: float, longest_us: int | None = None,
               at: Callable[[Settings], Candidate | None] | None = None, most: int | None = None,
               among: Sequence[int] | None = None) -> Candidate | None:
        """The fewest instances (up to `most`), then the shortest delay (up to `longest_us`; of `among`, else of
        `delays`), predicted under `under_ms` (by `at`: at the forecast's high end unless given).

        A longer delay is taken over its count's shortest only for a clear predicted gain (DELAY_MIN_GAIN); one
        passed over for that is still taken where the count above would need a longer delay too and is predicted
        no faster. Why: the skip sent host_heavy's planner from 3 x 8000us (43.2 ms, against 3 x 0us at 45.4) to
        4 x 8000us (44.6 ms): a full reload as well, one instance more, and slower by the same model."""
        at = at or at_hi
        ds = delays if among is None else among
        passed: Candidate | None = None      # the first longer delay that met `under_ms` without a clear gain
        top = max(ceiling, min_instances) if most is None else min(max(ceiling, min_instances), most)
        for n in range(min_instances, top + 1):
            shortest = at(Settings(n, ds[0]))
            # why: at a stable shortest delay far over the limit no delay rescues this count (a delay moves
            # p99 by the batching it adds, a fraction of it); skipping those saves most of the simulations
            hopeless = shortest is not None and math.isfinite(shortest.p99_ms) and shortest.p99_ms > 2 * under_ms
            for d in ds[:1] if hopeless else ds:
                if longest_us is not None and d > longest_us:
                    break
                if not reloadable(Settings(n, d)):
                    continue
                c = at(Settings(n, d))
                if c is None or c.p99_ms > under_ms:
                    continue
                # why: a longer delay costs a full reload and adds latency when the load falls; it is chosen
                # over the shortest only for a clear predicted gain, not for noise in the last digits
                if d == ds[0] or shortest is None or c.p99_ms <= DELAY_MIN_GAIN * shortest.p99_ms:
                    return passed if passed is not None and d != ds[0] and passed.p99_ms <= c.p99_ms else c
                if passed is None:
                    passed = c
        return None

    def buys_nothing(live_c: Candidate, below: int, must_meet: bool = True) -> Candidate | None:
        """The fewest instances under `below` (the live delay) predicted, with the live correction, within
        NO_GAIN of the live p99 (and under the margin, if `must_meet`): the instances above it buy nothing
        at this load."""
        if not math.isfinite(live_c.p99_ms):
            return None
        for n in range(min_instances, below):
            c = predict(Settings(n, live.max_queue_delay_us), hi, model, mb, factor, limit, device)
            if c is not None and (c.meets or not must_meet) and c.p99_ms <= NO_GAIN * live_c.p99_ms:
                return c
        return None

    def past_rise(s: Settings) -> tuple[Settings | None, str | None]:
        """Where a consolidation to `s` may go while the load comes back in bursts: (`s`, None) where in the
        last PEAK_S seconds it did not rise from a lull (a tick at or under the forecast's high end, where `s`
        was just found to fit) past what `s` carries under the margin; else the fewest instances between `s`
        and the live count (at `s`'s delay) predicted under the margin at that look-back's peak, with why (None
        and why where only the live count carries it: nothing goes until the rise has left the look-back).

        Why: scaling down in a lull of recurring bursts is undone by the next burst, after it has queued for a
        reload's time. The forecast's high end looks only a reload ahead, and in the lulls of a slow on/off load
        (4-s bursts every 10 s) it fell to the lull's rate: bursty r19 went 2 -> 1 instance in a lull and back
        to 2 at the next burst, p99 42-44 ms there against a 40-ms target. Kubernetes' HPA holds every
        scale-down at the highest recommendation of a look-back (5 minutes by default) for this; here only a
        load seen to come back is held to its peak, so one that falls and stays down (an evening) is followed
        at once. Example: bursts of 370 req/s for 4 s every 10 s over 100 req/s, one instance carrying ~260:
        in every lull the last rise is under 10 s old, so 2 instances stay until 30 s after the last burst
        began; from 4 instances the consolidation goes to 2 in the first lull, not to 1."""
        f = inputs.forecast
        if f is None or f.ticks < 3:
            return s, None
        own = correction_of(s)
        peak = max(r for _, r in f.peaks)
        top = predict(s, peak, model, mb, own, limit, device)
        if top is None or top.meets:
            return s, None
        carries = max(capacity_rps(s, model, mb, own, limit, device, upper=peak) or 0.0, hi)
        rise = f.last_rise(hi, carries)
        if rise is None:
            return s, None
        why = (f"the load rose from a lull past the {carries:.0f} req/s {_fmt_settings(s)} carries {f.t - rise:.0f} s "
               f"ago (peak {peak:.0f} req/s in the last {f.PEAK_S:.0f} s)")
        for n in range(s.instance_count + 1, live.instance_count):
            bigger = Settings(n, s.max_queue_delay_us)
            if not reloadable(bigger):
                break
            c = predict(bigger, peak, model, mb, config_correction(state, bigger, factor, now), limit, device)
            if c is not None and c.meets:
                return bigger, f"{_fmt_settings(bigger)}, not {_fmt_settings(s)}: {why}"
        return None, f"{_fmt_settings(s)} predicted {at_hi(s).p99_ms:.1f} ms now, but {why}: waiting until that is " \
                     f"{f.PEAK_S:.0f} s ago"

    def consolidate(chosen: Candidate, why: str) -> Plan:
        """`chosen`, a smaller configuration, once it was found CONSOLIDATE_TICKS decisions in a row (the
        largest of those found, the safe one, or a larger one still that `past_rise` asks for); a pending hold
        before."""
        ticks = state.smaller_ticks + 1
        best = chosen.settings if state.smaller_best is None else max(
            state.smaller_best, chosen.settings, key=lambda s: (s.instance_count, s.max_queue_delay_us))
        st = dataclasses.replace(state, smaller_ticks=ticks, smaller_best=best)
        target, rise = past_rise(best)
        if target is None:
            # the checks keep counting (the change follows once the rise has left the look-back); the instances
            # are not spare meanwhile: the next burst needs them
            return Plan(None, "HoldRecurringLoad", f"{rise}; {where}", usable=True, chosen=chosen, state=st,
                        **common)
        spare = max(0, live.instance_count - max((chosen.settings if rise is None else target).instance_count,
                                                 min_instances))
        rise = "" if rise is None else f"; {rise}"
        if ticks < CONSOLIDATE_TICKS:
            return Plan(None, "HoldConsolidationPending", f"{_fmt_settings(chosen.settings)} predicted "
                        f"{chosen.p99_ms:.1f} ms, {why} ({ticks}/{CONSOLIDATE_TICKS}){rise}; {where}", usable=True,
                        chosen=chosen, state=st, spare=spare, **common)
        return Plan(target, change_reason(live, target, "Consolidated"), f"{_fmt_settings(best)} predicted {why} "
                    f"{CONSOLIDATE_TICKS} times in a row{rise}; {where}", usable=True,
                    chosen=at_hi(target) or chosen, state=keep, spare=spare, **common)

    def sustained_rps(s: Settings) -> float | None:
        """How much of the forecast's high end `s` is predicted to sustain at all (any latency: its queue
        stable, the device under DEVICE_LIMIT); None without a service curve for it. Bisected below the high
        end only: with the device shared, a far higher rate can read as sustained (batches grow, the device's
        cost per request falls), which says nothing about the load that comes."""
        return capacity_rps(s, model, mb, 1.0, math.inf, device, upper=hi)

    def best_effort() -> tuple[Candidate | None, Candidate | None]:
        """Where nothing is predicted under the margin: of every count from the live one to the ceiling, at every
        delay a change may take, the fewest instances predicted within NO_GAIN of the lowest p99 (at that count,
        its lowest p99); the live configuration where it is the lowest; where none holds the load (every p99
        infinite), the ceiling's count, which sustains the most. Returned with the lowest p99 of more instances
        than the live count (None where none is finite): what one or more instances would buy at best.

        Why every count, not only the ceiling's: where instances share a device, one more can predict a higher
        p99 (its contention outweighs its parallelism). host_heavy r32 (SLA 50 ms, 341 req/s, 2 x 8000us live)
        went to the ceiling's best, 4 x 0us (a full reload), where the sweep measured 4 instances slower than 3 at
        every load (48.8 vs 41.8 ms at 307 req/s); goodput 0.94 of the best static, 1.21 of its instance-seconds.
        Example (tests/test_planner_choice.py): 3 x 8000us at 43.2 ms, 4 x 8000us 44.6, 4 x 0us 49.8 against a
        36-ms margin: 3 x 8000us, not the ceiling's 4 x 8000us."""
        top = max(ceiling, min_instances)
        first = min(max(live.instance_count, min_instances), top)
        options = [c for n in range(first, top + 1) for d in delays if reloadable(Settings(n, d))
                   if (c := at_hi(Settings(n, d))) is not None]
        finite = [c for c in options if math.isfinite(c.p99_ms)]
        if not finite:
            most = min((c for c in options if c.settings.instance_count == top),
                       key=lambda c: c.settings.max_queue_delay_us, default=None)
            return most, None

        def lowest(cs: list[Candidate]) -> Candidate | None:
            return min(cs, key=lambda c: (c.p99_ms, c.settings.max_queue_delay_us), default=None)
        best = lowest(finite)
        more = lowest([c for c in finite if c.settings.instance_count > live.instance_count])
        near = [c for c in finite if c.p99_ms <= NO_GAIN * best.p99_ms and c.settings != live]
        if best.settings == live or not near:
            return best, more
        fewest_n = min(c.settings.instance_count for c in near)
        return lowest([c for c in near if c.settings.instance_count == fewest_n]), more

    live_c = at_hi(live)
    scale_up = live_c is None or not live_c.meets
    in_place_over: Candidate | None = None     # the new delay passed over for instances added in place
    if scale_up or starts_cold:
        delays = [live.max_queue_delay_us]     # see the doc: a new delay only where the live one cannot do
    chosen = fewest(limit)
    if chosen is None and delays != every_delay:
        delays = every_delay
        chosen = fewest(limit)
    elif chosen is not None and scale_up and delays != every_delay:
        other = fewest(limit, among=every_delay)       # only to name what the live delay's choice passed over
        if other is not None and other.settings != chosen.settings:
            in_place_over = other
    common = dict(live=live_c, band=band, correction=factor)
    jitter = model.jitter(live.instance_count)
    where = (f"forecast {band[0]:.0f}-{band[2]:.0f} req/s in {horizon:.1f} s; live {_desc(live_c)}; "
             f"gamma {model.gamma:.2f} ({model.gamma_source}), "
             + (f"batcher's own wait {model.implicit_us} us (measured), " if model.implicit_us else "")
             + (f"executions p99 {jitter.at(0.99):.1f}x their mean, " if jitter is not None and jitter.quantiles else "")
             + f"correction {factor:.2f}" + (CORRECTION_FROM.get(state.ratio_source, "") if raw is not None else ""))
    keep = dataclasses.replace(state, smaller_ticks=0, smaller_best=None)
    if live_c is not None and live_c.meets:
        # consolidation: the fewest predicted under the stricter margin (not the fewest under 0.9x: that one
        # may sit just above 0.8x while a count between it and the live one fits well), or fewer still where
        # the instances dropped buy nothing
        # why: a scale-down never raises the delay. Trading an instance for a longer delay swaps a measured
        # configuration for the least certain part of the prediction (what a delay costs): in the shift bench
        # the planner consolidated 2x0us into 1x8000us at 215 req/s, where the sweep measured a delay making one
        # instance slower (1x2000us 45 ms vs 1x0us 35 ms at 220 req/s). A delay is raised by the scale-up path
        # (the ceiling reached, the device the limit), where the alternative is missing the target.
        strict = fewest(CONSOLIDATE_MARGIN * target_ms, longest_us=live.max_queue_delay_us)
        # or the fewest that keep the usual margin with room for more load (see the doc: a p99 that hardly grows
        # with the load, near the target, never gets under the stricter margin)
        f = inputs.forecast
        rising = f is not None and f.ticks >= 3 and band[1] > RISING * f.level
        roomy = None if rising else fewest(limit, longest_us=live.max_queue_delay_us, at=at_headroom,
                                           most=live.instance_count)
        if roomy is not None and not shrinks(roomy):
            roomy = None        # why: a rule for scale-downs; a hold logs the choice at the high end, not this one
        # (only fewer instances than these could win the choice below, so only those are simulated)
        free = buys_nothing(live_c, min([live.instance_count] + [c.settings.instance_count for c in (strict, roomy)
                                                                 if c is not None]))
        options = [c for c in (strict, roomy, free) if c is not None]
        if options:
            chosen = min(options, key=lambda c: (c.settings.instance_count, c.settings.max_queue_delay_us))
        if not (options and shrinks(chosen)):
            return Plan(None, "HoldPredictedOk", where, usable=True, chosen=chosen, state=keep, **common)
        why = ("buys nothing" if chosen is free else f"under {CONSOLIDATE_MARGIN:g}x the target" if chosen is strict
               else f"under {MARGIN:g}x the target at {CONSOLIDATE_HEADROOM:g}x the forecast's high end "
                    f"({hi * CONSOLIDATE_HEADROOM:.0f} req/s)")
        return consolidate(chosen, why)
    if chosen is None and live_c is not None:
        # why: where nothing meets the target, instances that buy nothing still go. At 0 req/s under a target
        # below 1/0.9 of the model's lone-request latency (or a correction that puts it there), every count runs
        # the same lone requests and none is predicted under the margin: without this the planner holds every
        # instance at 0 req/s (HoldAtMax), where the reactive rule removes them (the likely cause of a CI run
        # that kept 4 instances at 0 req/s for a minute).
        free = buys_nothing(live_c, live.instance_count, must_meet=False)
        if free is not None:
            return consolidate(free, "buys nothing")
    if chosen is None:
        # nothing is predicted to meet the target: the configuration predicted best, if it beats the live one
        best_c, more = best_effort()
        if best_c is None or best_c.settings == live:
            return Plan(None, "HoldPredictedNoneMeets", where, usable=True, state=keep, **common)
        overloaded = live_c is not None and not math.isfinite(live_c.p99_ms) and not math.isfinite(best_c.p99_ms)
        if overloaded:
            # why: where neither holds the load, both p99s are infinite and "10% lower" can never be true: a
            # model overloaded at 1 instance, with memory for a 2nd that would not hold the load either, held
            # at 1 (two_models_tight r5: a 5-s hold on a rising ramp; the likely cause of a CI failure where the
            # hot model never took the instance freed for it). There, what an instance buys is throughput: the
            # rate each sustains (its queue stable, its device under DEVICE_LIMIT); the best must sustain more.
            best_rps, live_rps = sustained_rps(best_c.settings), sustained_rps(live)
            if best_rps is None or live_rps is None or best_rps * BEST_EFFORT_GAIN < live_rps:
                return Plan(None, "HoldPredictedNoneMeets", f"no configuration holds the load; {_fmt_settings(best_c.settings)} "
                            f"sustains {best_rps or 0:.0f} req/s, live {live_rps or 0:.0f}; {where}", usable=True, state=keep, **common)
            how = (f"none holds the load: {_fmt_settings(best_c.settings)} sustains {best_rps:.0f} req/s, "
                   f"live {_fmt_settings(live)} {live_rps:.0f}")
        elif live_c is not None and best_c.p99_ms >= BEST_EFFORT_GAIN * live_c.p99_ms:
            if model.gamma_source != "measured" and more is not None:
                # why: "more instances buy < 10%" rests here on a contention estimated from the device's
                # utilisation, no second count having run: a guess, not a measurement, and holding on it kept a
                # model over its target for a whole CI test (an ensemble step at 2 instances, p99 37.7 ms
                # against 25, gamma 0.18 from utilisation; where gamma read 0.09 in other runs the same step went
                # to 4 and its p99 fell to 21-23 ms, about 30%, where 14% was predicted). The reactive rules try
                # one instance more where the queue builds and step back if it bought nothing (review_step);
                # once a second count has run, gamma is measured and the planner decides on it.
                return fallback(f"too little data: none is predicted under the target, {_fmt_settings(more.settings)} at "
                                f"{more.p99_ms:.1f} ms against the live {live_c.p99_ms:.1f}, but how more instances "
                                f"contend is estimated (gamma {model.gamma:.2f} from {model.gamma_source}), not "
                                f"measured", state)
            return Plan(None, "HoldPredictedNoneMeets", where, usable=True, state=keep, **common)
        else:
            how = _desc(best_c)
        return Plan(best_c.settings, change_reason(live, best_c.settings, "BestEffort"), f"no configuration within the ceiling ({ceiling}) is "
                    f"predicted under {MARGIN:g}x the target; {how}; {where}", usable=True, chosen=best_c,
                    state=keep, **common)
    over = (f"; in place rather than {_fmt_settings(in_place_over.settings)} (a new delay reloads every instance)"
            if in_place_over is not None else "")
    return Plan(chosen.settings, change_reason(live, chosen.settings, "Predicted"), f"{_desc(chosen)}{over}; {where}",
                usable=True, chosen=chosen, state=keep, **common)


def change_reason(live: Settings, target: Settings, how: str) -> str:
    """The reason of a planned change: what moves (ScaleUp, ScaleDown, DelayIncrease, DelayDecrease: the
    same words as the reactive rules', so a log reader finds every scale-up) and why (`how`: Predicted,
    Consolidated, BestEffort). Example: 1x0us -> 3x0us predicted: "ScaleUpPredicted"."""
    if target.instance_count != live.instance_count:
        what = "ScaleUp" if target.instance_count > live.instance_count else "ScaleDown"
    else:
        what = "DelayIncrease" if target.max_queue_delay_us > live.max_queue_delay_us else "DelayDecrease"
    return what + how


def _live_model(live: Settings, inputs: PlanInputs, state: PlannerState, device_util: float | None, exec_rps: float,
                avg_batch: float, now: float) -> tuple[ServiceModel, float, DeviceShare | None] | None:
    """The service model, the correction factor and the device share that predictions around the live
    configuration use (as in `choose`); None without a measured curve for the live count."""
    model = ServiceModel.build(inputs.fits, device_util, inputs.jitters, inputs.items_per_request, inputs.implicit_us,
                               inputs.device_share, inputs.contention_floor)
    if live.instance_count not in model.fits:
        return None
    factor, _ = correction(state, now)
    device = DeviceShare.at(device_util, exec_rps, avg_batch, model.fits[live.instance_count], inputs.device_fraction)
    return model, factor, device


def contention(inputs: PlanInputs, device_util: float | None) -> tuple[float, str] | None:
    """The contention between instances the planner's service model uses (`ServiceModel.gamma`) and where it comes
    from ("measured", "utilisation", "cores", "default"); None without a measured curve. Read apart from the choice:
    the fleet scaler's figure scales by it where the planner's p99 is set aside (capacity.py)."""
    model = ServiceModel.build(inputs.fits, device_util, device_share=inputs.device_share,
                               contention_floor=inputs.contention_floor)
    return (model.gamma, model.gamma_source) if model.fits else None


def capacities(live: Settings, inputs: PlanInputs, state: PlannerState, *, target_ms: float, min_instances: int,
               max_instances: int, device_util: float | None, exec_rps: float, avg_batch: float,
               now: float, also: Iterable[int] = ()) -> dict[int, float | None]:
    """Predicted capacity (req/s within the target) of the live configuration and of one instance fewer and
    one more (same delay), corrected like the choice: what `status` shows; and of the counts in `also` (the
    loop asks for the instance ceiling: the pod's capacity the fleet scaler reads, capacity.py). {} without
    a live curve."""
    ctx = _live_model(live, inputs, state, device_util, exec_rps, avg_batch, now)
    if ctx is None:
        return {}
    model, factor, device = ctx
    out: dict[int, float | None] = {}
    counts = (live.instance_count - 1, live.instance_count, live.instance_count + 1, *also)
    for n in sorted(set(counts)):
        if min_instances <= n <= max_instances:
            c = capacity_rps(Settings(n, live.max_queue_delay_us), model, max(1, inputs.max_batch), factor, target_ms,
                             device)
            out[n] = None if c is None else round(c, 1)
    return out


def goodput(live: Settings, inputs: PlanInputs, state: PlannerState, *, target_ms: float,
            device_util: float | None, exec_rps: float, avg_batch: float,
            now: float) -> Callable[[int, float], float | None] | None:
    """What the arbiter weighs an instance by: a function (n, demand req/s) -> the req/s predicted to be served
    within `target_ms` at that demand with n instances (the live delay), corrected like the choice; None
    where no curve covers n. None without a curve for the live count.

    The goodput is demand x the predicted share within the target (`Candidate.within`, from the simulated
    latencies' tail), and 0 where the load cannot be held. Unlike min(demand, capacity), it keeps falling past
    the capacity, as the measured share does: at 25 ms one instance at 300 req/s served ~31% in time and two
    ~82% (shift_tight's sweep), where capacities of ~130 and ~220 req/s within target would credit the second
    instance with 90 req/s, not ~150. The same 90 is what that instance is "worth" to a model at 250 or 400
    req/s: compared so, two models over their capacities look alike and an instance stays with the one whose
    load is falling. (Measured on two_models_tight, the hand-overs came no earlier with this: what binds there
    is the hot model's forecast reaching one instance's capacity; docs/results.md, "Runs 11-15".)"""
    ctx = _live_model(live, inputs, state, device_util, exec_rps, avg_batch, now)
    if ctx is None:
        return None
    model, factor, device = ctx
    mb = max(1, inputs.max_batch)
    memo: dict[tuple[int, float], float | None] = {}    # the share within the target, per count and grid rate

    def at(n: int, demand_rps: float) -> float | None:
        if n < 1 or not (demand_rps >= 0 and math.isfinite(demand_rps)):
            return None
        key = (n, _q(demand_rps))
        if key not in memo:
            c = predict(Settings(n, live.max_queue_delay_us), key[1], model, mb, factor, target_ms, device)
            memo[key] = None if c is None else c.within
        share = memo[key]
        return None if share is None else demand_rps * share
    return at


def _fmt_settings(s: Settings) -> str:
    return f"{s.instance_count}x{s.max_queue_delay_us}us"


def _desc(c: Candidate | None) -> str:
    if c is None:
        return "n/a"
    p = "cannot hold" if not math.isfinite(c.p99_ms) else f"p99 {c.p99_ms:.1f} ms"
    how = ", the device the limit" if c.self_batch_us else ""
    return f"{_fmt_settings(c.settings)} {p} at {c.arrival_rps:.0f} req/s (batch {c.mean_batch:.1f}{how})"
