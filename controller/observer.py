"""Observation: one `ModelObserver` per managed model, and the `TraceFeed` that serves them all.

A `ModelObserver` owns everything the controller knows about what one model did:

* its window of `/metrics` counters (`signals.ModelWindow`) and the fresh span after a change
  (data from before `changed_at + settle_s` describes the old configuration and is not used);
* its sampled request traces (`traces.TraceWindow`) and the latency figure with its source;
* its service time per batch size, per live configuration (`service.ServiceTimes`), how much one
  execution's time varies around it (`service.execution_jitter`, per configuration: from the traced requests,
  or untraced from Triton's compute summary over a quiet minute, `_summary_jitter`; until a configuration has its
  own, the nearest count's, as the planner simulates it: `_nearest_jitter`), and the p99 the
  planner's model predicts from both for the live configuration at the measured arrival rate (logged
  beside the measured p99, so that prediction error is known before anything decides on it);
* the device readings attached to its observations.

`observe()` turns that into one `Observation` for the policy. The p99 comes from the best source
available, and the observation says which (`p99_source`):

1. ``trace``: the 99th percentile of the sampled requests that ended in the fresh span (at least
   `MIN_TRACE_SAMPLES` of them): what the server measured for each request, within seconds;
2. ``summary``: Triton's own summary quantile, when the span is as long as the summary's own
   (about 60 s) so that it does not describe the past;
3. ``mean_x_tail_ratio``: max(worst per-scrape mean, mean x tail ratio), the tail ratio learned
   from a quiet minute of summaries (2.0 until then). A server started without a trace file, one
   whose files this process cannot see, or a Triton older than 2.57 under `tracing: auto` (the
   default) gets this one (logged once by the `TraceFeed`).

The `TraceFeed` turns TIMESTAMPS tracing on for each managed model, adapts the sampling rate to
the arrival rate (`traces.choose_sampling`: about `samples_per_s` traces a second, so a window
holds a few hundred at high load, and every request is traced at a few req/s), reads and removes
the rotated trace files, and routes the samples to the observers. Anything that stops it (no
trace file on the server, files that never appear here, an unwritable or full disk) turns tracing
off with one log line and leaves the observers on the counters' estimate: never an exception. So
does, under `tracing: auto`, a Triton older than 2.57, whose request tracing can crash it
(`traces.trace_release_unsafe`); `tracing: true` (`forced`) traces it anyway and says so once.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

from .cpu import CpuSeries
from .planner import (DEVICE_SHARE, Forecast, PlanInputs, implicit_step, jitter_per_count, mixture_p99, nearest_jitter,
                      rate_components, simulate_quantised)
from .service import Jitter, ServiceTimes, batch_deltas, counters_restarted, execution_jitter, summary_jitter
from .signals import SUMMARY_MAX_AGE_S, ModelCounters, ModelWindow, StatsCounters
from .traces import (TraceApi, TraceApiError, TraceFiles, TraceSample, TraceSampling, TraceSummary, TraceWindow,
                     choose_sampling, needs_change, trace_release_unsafe)
from .types import GpuObservation, Observation, Settings

log = logging.getLogger("controller.observer")

DEFAULT_TAIL_RATIO = 2.0        # p99 / mean latency until the server's summaries have measured it
TAIL_RATIO_BOUNDS = (1.0, 5.0)
MIN_REQUESTS_FOR_TAIL = 200     # a summary p99 over fewer requests says little
MIN_TRACE_SAMPLES = 10          # fewer sampled requests than this in the span: use the counters' estimate
TRACE_MAX_AGE_S = 120.0
WARMUP_EXECUTIONS = 50          # a span that began before the model's first this-many executions is warming up
JITTER_KEPT = 5                 # a configuration's jitter is the median of its last this-many windows' estimates
JITTER_SPAN_S = 60.0            # a jitter estimate reads the traced times of up to this much of the live configuration
IMPLICIT_KEPT = 5               # the batcher's implicit wait is the median of the last this-many windows' steps ...
IMPLICIT_MIN_EXECUTIONS = 100   # ... each over at least this many executions, ...
IMPLICIT_EVERY_S = 5.0          # ... at most one step this often (each costs one or two simulations), ...
IMPLICIT_BUSY_MAX = 0.8         # ... and only where the instances were busy less than this share of the window
JITTER_CONFIGS = 32             # configurations whose jitter is remembered; the least recently seen goes first
TAIL_CHECK_EVERY_S = 10.0       # untraced, the summaries' tail is checked against the model's at most this often ...
TAIL_CHECK_BOUNDS = (0.67, 2.0)  # ... each reading within these bounds (2.0: past the planner's DISAGREE, so a model
                                 # whose tail runs twice its prediction is set aside for the reactive rules, not trusted)

_Read = tuple[int, int, int, StatsCounters]   # one tick's statistics: (chain, executions, ns executing, themselves)


def estimate_p99(obs: Observation, tail_ratio: float, measured: bool = False) -> Observation:
    """A p99 estimate for a short window from counters alone: the larger of the worst interval mean
    and mean latency x tail ratio (`measured`: learned from the summaries, not the default; the observation
    carries both, for `status`). Example: mean 20 ms, tail ratio 1.8, worst 1-s mean 24 ms -> 36 ms."""
    if not obs.valid or obs.p99_source != "interval_mean_max" or obs.p99_ms is None:
        return obs
    return dataclasses.replace(obs, p99_ms=max(obs.p99_ms, obs.request_ms_mean * tail_ratio), p99_source="mean_x_tail_ratio",
                               tail_ratio=tail_ratio, tail_ratio_measured=measured)


class ModelObserver:
    """Everything observed about one model; `observe()` gives the policy its `Observation`."""

    def __init__(self, name: str, *, window_s: float, settle_s: float):
        self.name = name
        self.window_s = window_s
        self.settle_s = settle_s
        self.counters = ModelWindow(max_age_s=max(600.0, 3 * window_s))
        self.traces = TraceWindow(max_age_s=max(TRACE_MAX_AGE_S, 3 * window_s))
        self.service = ServiceTimes(settle_s=settle_s)
        self.changed_at = -math.inf    # the last applied or adopted change (the start is none: warm-up is the policy's)
        self.tail_ratio = DEFAULT_TAIL_RATIO
        self.tail_ratio_measured = False
        self.last: Observation | None = None
        self._latest: ModelCounters | None = None
        self.forecast: Forecast | None = None     # of the arrival rate, one update per tick with usable counters
        self._utilisation: deque[tuple[float, dict[int, float]]] = deque()   # (time, {device: % busy}) per tick
        # per tick with statistics: (time, chain, executions, ns executing, the statistics), cumulative over every
        # batch size; a new chain starts where the statistics restarted or a tick had none (see `_executing`)
        self._executed: deque[tuple[float, int, int, int, StatsCounters]] = deque()
        self._executed_chain = 0
        self._executed_last: StatsCounters | None = None
        self._jitter: dict[Settings, deque[Jitter]] = {}    # per configuration: its last windows' estimates
        self.items_per_request = 1.0   # of the last window in which a request succeeded (Observation's field)
        self.implicit_us = 0           # the batcher's implicit wait (planner.implicit_step): the median of ...
        self._implicit: deque[int] = deque(maxlen=IMPLICIT_KEPT)     # ... the last windows' steps
        self._implicit_at = -math.inf                                 # when the last step was taken
        self.tail_check: float | None = None     # untraced: the summaries' tail over the model's (`_check_tail`)
        self._tail_check_at = -math.inf
        self._summary_jitter_at = -math.inf      # untraced: when the compute summary was last read (`_summary_jitter`)
        self._tick_rates: deque[tuple[float, float]] = deque()        # (time, arrival rate) per tick, the last minute

    # -- feeding -------------------------------------------------------------------------------
    def add_scrape(self, now: float, counters: ModelCounters | None, stats: StatsCounters | None,
                   live: Settings | None) -> None:
        """One tick's counters (None: the scrape failed or the model was absent) and statistics."""
        self.counters.add(now, counters)
        self._latest = counters
        self.service.add(live, stats, now)     # why: None (config unknown, reload in flight) breaks the chain
        self._add_executed(now, stats if live is not None else None)
        self._update_forecast(now)

    def _add_executed(self, now: float, stats: StatsCounters | None) -> None:
        """Keep the statistics' cumulative execution count and time (`batch_stats`: each execution once)."""
        if stats is None:
            self._executed_last = None
            return
        if self._executed_last is None or counters_restarted(self._executed_last, stats):
            self._executed_chain += 1
        self._executed_last = stats
        rows = [b for size, b in stats.batch_stats.items() if size >= 1]
        self._executed.append((now, self._executed_chain, sum(b.executions for b in rows), sum(b.compute_ns for b in rows),
                               stats))
        while self._executed and self._executed[0][0] < now - self.counters.max_age_s:
            self._executed.popleft()

    def executed_sizes(self) -> dict[int, int]:
        """Executions per batch size since the model (this copy of it) loaded: the last statistics read ({} if none)."""
        if not self._executed or self._executed_last is None:
            return {}
        return {size: b.executions for size, b in self._executed[-1][4].batch_stats.items() if size >= 1}

    def _update_forecast(self, now: float) -> None:
        """Feed the forecast this tick's arrival rate (the last two samples; a reset or gap feeds nothing)."""
        samples = self.counters.samples
        if len(samples) < 2:
            return
        tick = self.counters.observe(now, now - samples[-2].t + 1e-6, 1)
        if not tick.valid:
            return
        self._tick_rates.append((now, tick.arrival_rps))
        while self._tick_rates and self._tick_rates[0][0] < now - SUMMARY_MAX_AGE_S - 5.0:
            self._tick_rates.popleft()
        if self.forecast is None:
            self.forecast = Forecast.start(now, tick.arrival_rps)
        else:
            self.forecast = self.forecast.update(now, tick.arrival_rps)

    def plan_inputs(self, max_batch_size: int, interval_s: float, device_fraction: float | None = None,
                    device_share: float = DEVICE_SHARE, contention_floor: float | None = None) -> PlanInputs:
        """What the planner needs from this observer: every measured service curve and the forecast."""
        fits = tuple((s, f) for s in self.service.configs() if (f := self.service.fit(s)) is not None)
        jitters = tuple((s, j) for s in self._jitter if (j := self.jitter(s)) is not None)
        return PlanInputs(fits=fits, forecast=self.forecast, max_batch=max_batch_size, interval_s=interval_s,
                          device_fraction=device_fraction, jitters=jitters, items_per_request=self.items_per_request,
                          implicit_us=self.implicit_us, device_share=device_share,
                          contention_floor=contention_floor)

    def jitter(self, settings: Settings) -> Jitter | None:
        """The configuration's execution jitter: of its last JITTER_KEPT windows' estimates, the one with the
        median variance (so that a window that held a stall of the machine does not decide alone)."""
        values = self._jitter.get(settings)
        return sorted(values, key=lambda j: j.scv)[len(values) // 2] if values else None

    def _nearest_jitter(self, live: Settings) -> Jitter | None:
        """Where the live configuration has no jitter of its own yet (its first minute, untraced; its first traced
        windows), the one the planner simulates its instance count with (`planner.nearest_jitter`: another delay at
        the count, else the nearest count measured), so that the window's prediction, which the planner checks
        itself against, is the planner's own. Why: resnet_tiny r103, one instance's executions p99 1.86x their mean;
        two instances' windows were predicted with exact executions for their first minute while the planner
        predicted two instances with one's jitter, and what they recorded of the model's error was of another
        model. `obs.jitter` stays the configuration's own (what `status` shows as measured)."""
        others = tuple((s, j) for s in self._jitter if s != live and (j := self.jitter(s)) is not None)
        return nearest_jitter(jitter_per_count(others), live.instance_count)

    def add_traces(self, samples: Iterable[TraceSample], read_at: float) -> None:
        self.traces.add(list(samples), read_at)

    def mark_change(self, now: float) -> None:
        """A change was applied (or adopted): data from before `now + settle_s` is the old config's."""
        self.changed_at = now

    @property
    def fresh_from(self) -> float:
        return self.changed_at + self.settle_s

    # -- the observation -----------------------------------------------------------------------
    def observe(self, now: float, live: Settings, devices: tuple[GpuObservation, ...] = (),
                max_batch_size: int = 0, cpu: CpuSeries | None = None) -> Observation:
        """`devices`: the devices this model runs on, as read this tick; `cpu`: where the CPU is its device instead
        (cpu.py), the server's CPU readings, averaged here over the observation's span as a device's utilisation."""
        span = min(self.window_s, max(0.0, now - self.fresh_from))
        obs = self.counters.observe(now, span, live.instance_count)
        ends: tuple[_Read | None, _Read | None] = (None, None)
        if obs.valid:
            # the statistics read at the span's two ends, one lookup each for every use
            ends = self._executed_at(obs.since), self._executed_at(obs.since + obs.span_s)
            obs = self._warming_up(self._executing(obs, live.instance_count, *ends), *ends)
        self._utilisation.append((now, {g.index: g.utilization_pct for g in devices if g.utilization_pct is not None}))
        while self._utilisation and self._utilisation[0][0] < now - self.counters.max_age_s:
            self._utilisation.popleft()
        if obs.valid and devices:
            obs = dataclasses.replace(obs, gpus=self._window_utilisation(devices, obs.since, now))
        elif obs.valid and cpu is not None:
            use = cpu.span(obs.since, now)
            if use is not None and use.runs_on_cpu(self.name, obs.busy_fraction * live.instance_count):
                obs = dataclasses.replace(obs, cpu=use)
        quiet = self._quiet_minute(now, live)      # read once a tick, for the tail ratio and the tail check
        self._calibrate_tail(quiet)
        traced = self.traces.summary(now, now - obs.since, since=obs.since) if obs.valid else None
        obs = self._latency(obs, traced)
        if obs.valid and obs.completion_rps > 0:
            self.items_per_request = obs.items_per_request
        if obs.valid:
            self._add_jitter(now, live, obs.since + obs.span_s, ends[1])
            if quiet is not None and obs.p99_source != "trace":
                self._summary_jitter(now, quiet, live)
            fit = self.service.fit(live)
            jitter = self.jitter(live)
            simulated = jitter if jitter is not None else self._nearest_jitter(live)
            parts = self._window_parts(obs) if fit is not None else []   # once a tick, for both uses
            if fit is not None:
                self._note_implicit(now, obs, live, max(1, max_batch_size), fit, simulated, parts)
            p99, mean = (None, None) if fit is None else \
                self._window_prediction(obs, live, max(1, max_batch_size), fit, simulated, parts)
            if fit is not None and quiet is not None and obs.p99_source != "trace":
                self._check_tail(now, quiet, live, max(1, max_batch_size), fit, simulated)
            obs = dataclasses.replace(obs, service=fit, jitter=jitter, cold_start=self.service.cold_start(),
                                      predicted_p99_ms=p99, predicted_mean_ms=mean,
                                      tail_check=None if obs.p99_source == "trace" else self.tail_check)
        self.last = obs
        return obs

    def _add_jitter(self, now: float, live: Settings, end: float, last: _Read | None) -> None:
        """Estimate the live configuration's execution jitter (`execution_jitter`: traced compute times against
        the batch statistics at the span's two ends) and keep it.

        The span is longer than the observation's: from the first tick of the last JITTER_SPAN_S seconds that is
        past the configuration's change (`fresh_from`) and past the model's first WARMUP_EXECUTIONS executions
        since it loaded (a fresh model's first executions are slow for reasons of their own), to `end`, with no
        restart of the statistics between (`last`: `_executed_at(end)`). Why longer: the jitter's tail is used
        only as far as two traced times reach (`service.JITTER_TAIL_SUPPORT`), so a 20-s window of 100 traced
        requests (5 req/s, every one traced) stops at the 0.98 quantile and under-reads a p99 that lies beyond
        it; 60 s of the same configuration hold 300 and reach the 0.99. The estimate then moves more slowly with
        the machine (the last JITTER_KEPT estimates' median adds a few ticks more): a jitter belongs to a
        configuration and changes over minutes, the load's queueing (which the simulation predicts) over seconds."""
        if last is None:
            return
        start = max(now - JITTER_SPAN_S, self.fresh_from)
        first = next(((u, (c, n, ns, st)) for u, c, n, ns, st in self._executed
                      if start - 1e-6 <= u < end and c == last[0] and n >= WARMUP_EXECUTIONS), None)
        if first is None or first[1][1] >= last[1]:
            return
        since, read = first
        traced = self.traces.summary(end, end - since, since=since)
        value = execution_jitter(traced.compute_scv, traced.compute_quantiles, traced.compute_count,
                                 batch_deltas(read[3], last[3]))
        if value is not None:
            self._keep_jitter(live, value)

    def _keep_jitter(self, live: Settings, value: Jitter) -> None:
        kept = self._jitter.pop(live, None) or deque(maxlen=JITTER_KEPT)
        kept.append(value)
        self._jitter[live] = kept                     # re-inserted: the most recently seen last
        while len(self._jitter) > JITTER_CONFIGS:
            self._jitter.pop(next(iter(self._jitter)))

    def _summary_jitter(self, now: float, quiet: tuple[float, Observation], live: Settings) -> None:
        """Untraced, estimate the live configuration's execution jitter from Triton's compute summary over a quiet
        minute (`_quiet_minute`'s) and keep it as a traced estimate is kept (`_add_jitter`), at most one every
        TAIL_CHECK_EVERY_S: the summary's quantiles of the compute (infer) time charged to each request
        (`nv_inference_compute_infer_summary_us`), over the counters' mean of the same time for the minute,
        against the statistics' executions per batch size over it (`service.summary_jitter`: `summary_quantiles`,
        then `execution_jitter`, which takes out the part of the spread that the sizes' mix explains).

        Why: untraced, the simulation drew every execution at its size's mean, so its p99 for a model whose
        executions vary (a CPU model under contention) was short whatever the load: resnet_tiny untraced (r92)
        predicted 12.4 ms where the clients measured 18.1, and the tail check (`_check_tail`) could only scale
        every prediction by one figure read at one load, where the jitter's share of a p99 falls as the queue's
        grows. The summary gives the shape where traces are not read; the tail check then measures what is left.
        Nothing is read where the statistics break within the minute or count no execution in it (an ensemble)."""
        c = self._latest
        if now - self._summary_jitter_at < TAIL_CHECK_EVERY_S or c is None or not c.compute_quantiles_us:
            return
        self._summary_jitter_at = now
        _, minute = quiet
        end = minute.since + minute.span_s
        first, last = self._executed_at(minute.since), self._executed_at(end)
        at_start, at_end = self._counters_at(minute.since), self._counters_at(end)
        if first is None or last is None or first[0] != last[0] or last[1] <= first[1] or at_start is None \
                or at_end is None:
            return
        value = summary_jitter(c.compute_quantiles_us, at_start, at_end, batch_deltas(first[3], last[3]))
        if value is not None:
            self._keep_jitter(live, value)

    def _check_tail(self, now: float, quiet: tuple[float, Observation], live: Settings, max_batch: int, fit,
                    jitter: Jitter | None) -> None:
        """Untraced, check the model's tail against the server's: over the summaries' last minute (`quiet`:
        `_quiet_minute`'s, as the tail ratio's), the summary's p99 over the counters' mean, against the
        simulation's p99 over its mean for the same minute's loads (`_window_prediction` of the minute's tick
        rates). Their quotient, within TAIL_CHECK_BOUNDS, is what the simulation misses in the tail alone; the
        planner multiplies each window's mean ratio by it (`policy.window_check`), which makes the untraced check
        a p99 check: p99 observed / predicted = (mean observed / predicted) x (tail observed / predicted).
        `tail_check` follows the readings as the tail ratio does (0.8 old + 0.2 new), one every TAIL_CHECK_EVERY_S.

        Why: the mean alone cannot see a tail the simulation misses with the right mean (execution jitter, which
        nothing measures untraced; the host's share of each request), so untraced the planner's p99s ran 10-20%
        under the server's on sim_accel (shift r89: 22.1 predicted, 26.2 measured in the morning) and 20-40% on
        the CPU torch model (tracing r80: 8-10 against 10-14 ms), with a correction of 1.00 from the means;
        traced, the same runs' p99 ratios corrected it (1.1-1.2). Why a minute: Triton's summaries span about
        the last minute whatever changed in it, so a shorter span would mix configurations.
        Example: summary p99 30 ms over a minute whose mean was 12 ms (2.5); the simulation's p99 22 ms over its
        mean 11 ms (2.0) for the same loads: 1.25. With a later window's mean ratio 1.04 the planner records
        1.04 x 1.25 = 1.3 for it, where the mean alone gave 1.04."""
        if now - self._tail_check_at < TAIL_CHECK_EVERY_S:
            return
        self._tail_check_at = now
        summary_p99_ms, minute = quiet
        tick_s = self.forecast.tick_s if self.forecast is not None else 1.0
        parts = [(rate, share) for rate, share in rate_components([r for t, r in self._tick_rates if t > minute.since],
                                                                   tick_s) if share >= 0.005]
        p99, mean = self._window_prediction(minute, live, max_batch, fit, jitter, parts or [(minute.arrival_rps, 1.0)])
        if p99 is None or mean is None or p99 <= 0 or mean <= 0 or not math.isfinite(p99):
            return
        reading = (summary_p99_ms / minute.request_ms_mean) / (p99 / mean)
        reading = min(max(reading, TAIL_CHECK_BOUNDS[0]), TAIL_CHECK_BOUNDS[1])
        self.tail_check = reading if self.tail_check is None else 0.8 * self.tail_check + 0.2 * reading

    def _window_parts(self, obs: Observation) -> list[tuple[float, float]]:
        """The loads the window's ticks held (rate, share of its requests: `rate_components`), else its mean rate."""
        parts = []
        if self.forecast is not None:
            parts = [(rate, share) for rate, share in rate_components(self.forecast.rates_since(obs.since),
                                                                      self.forecast.tick_s) if share >= 0.005]
        return parts or [(obs.arrival_rps, 1.0)]

    def _note_implicit(self, now: float, obs: Observation, live: Settings, max_batch: int, fit,
                       jitter: Jitter | None, parts: list[tuple[float, float]]) -> None:
        """One step of the batcher's implicit wait (planner.implicit_step) from this window's batches, where the
        window holds IMPLICIT_MIN_EXECUTIONS executions past the model's warm-up and the last step is IMPLICIT_EVERY_S
        old; `implicit_us` the median of the last IMPLICIT_KEPT steps (a window of clumped arrivals moves it one
        step, not to the top of the grid). Why not every tick: a step a tick raised the controller's CPU from
        1.7% to 2.3% in the batched bench (r70), for a figure that changes over minutes. Why not where the instances
        are busy (IMPLICIT_BUSY_MAX): there the queue forms the batches, and where a busy device holds the instances
        (host_heavy r70, 3 instances 97-99% busy, the device the limit) its larger batches read as a 2,000-us wait
        that `predict`'s self-batching already accounts for; the wait shows where instances wait for work."""
        if obs.warming_up or obs.exec_rps * obs.span_s < IMPLICIT_MIN_EXECUTIONS or now - self._implicit_at < \
                IMPLICIT_EVERY_S or obs.busy_fraction >= IMPLICIT_BUSY_MAX:
            return
        self._implicit_at = now
        step = implicit_step(parts, live, fit.predict_ms, max_batch, self.items_per_request,
                             obs.avg_batch_size, jitter, self._implicit[-1] if self._implicit else 0)
        if step is None:
            return
        self._implicit.append(step)
        self.implicit_us = sorted(self._implicit)[len(self._implicit) // 2]

    def _window_prediction(self, obs: Observation, live: Settings, max_batch: int, fit, jitter: Jitter | None,
                           parts: list[tuple[float, float]]) -> tuple[float | None, float | None]:
        """The live configuration's predicted (p99, mean latency) over the window, for the planner's check of
        itself against the measured ones (the traced p99; the counters' mean where nothing is traced): one
        simulation per load the window's ticks held (`rate_components`: one under a steady load or a ramp, two
        under on/off bursts), their tails mixed by their requests (`mixture_p99`), so that the bursts' queueing
        is predicted rather than read as model error, and a window that holds one more or one less burst tick
        moves the prediction a little, not from the lull's p99 to the burst's. The mean is the parts' means
        weighted by their requests (exact for a mixture). Example: 70% of the requests at 380 req/s (mean 18 ms),
        30% at 100 req/s (mean 11 ms): mean 15.9 ms."""
        delay_us = live.max_queue_delay_us + self.implicit_us      # as the planner simulates it (planner.predict)
        sims = [(simulate_quantised(rate, live.instance_count, delay_us, max_batch, fit.predict_ms, jitter,
                                     self.items_per_request), share) for rate, share in parts]
        if any(p is None for p, _ in sims):
            single = simulate_quantised(obs.arrival_rps, live.instance_count, delay_us, max_batch, fit.predict_ms,
                                        jitter, self.items_per_request)
            return (None, None) if single is None else (single.p99_ms, single.mean_ms)
        total = sum(share for _, share in sims)
        return mixture_p99(sims), sum(p.mean_ms * share for p, share in sims) / total

    def _executed_at(self, t: float) -> _Read | None:
        """(chain, executions, ns executing, the statistics) read at the tick of time t, or None."""
        return next(((c, n, ns, st) for u, c, n, ns, st in self._executed if abs(u - t) <= 1e-6), None)

    def _counters_at(self, t: float) -> ModelCounters | None:
        """The `/metrics` counters scraped at the tick of time t, or None."""
        return next((s.counters for s in self.counters.samples if abs(s.t - t) <= 1e-6), None)

    def _executing(self, obs: Observation, instance_count: int, first: _Read | None,
                   last: _Read | None) -> Observation:
        """The busy fraction from the statistics' `batch_stats`, which count each execution once, over the
        observation's own span; the counters' estimate (`signals.busy_fraction`) where they cannot give it.

        The `/metrics` counters charge every request its whole batch's compute time, so their estimate
        (mean compute per request x executions) weighs each execution by its batch size: when sizes vary
        it reads high, over 100% on a saturated instance (measured, sim_accel, 1 instance, 20 s each:
        1.04 against 0.92 from `batch_stats` at 200 req/s, 1.13 against 0.98 at 300 req/s). Example: in
        10 s one instance ran 100 executions of 1 item (5 ms each) and 100 of 9 items (30 ms each): it was
        busy (0.5 + 3.0) s / 10 s = 0.35; the counters give (100 x 5 + 900 x 30) / 1000 requests = 27.5 ms
        per request x 200 executions = 5.5 s, 0.55.

        Used only where the statistics were read at both ends of the span, without a restart or a missing
        tick between, and account for the executions the counters saw (a model without `batch_stats`
        rows, an ensemble for one, keeps the estimate). `first`, `last`: `_executed_at` the span's two ends."""
        if first is None or last is None or first[0] != last[0] or obs.span_s <= 0:
            return obs
        executions, ns = last[1] - first[1], last[2] - first[2]
        if executions <= 0 < obs.exec_rps or ns < 0:
            return obs
        busy = ns / 1e9 / obs.span_s / max(1, instance_count)
        return dataclasses.replace(obs, busy_fraction=busy, busy_source="batch_stats")

    def _warming_up(self, obs: Observation, first: _Read | None, last: _Read | None) -> Observation:
        """Mark a span that began before the model's first `WARMUP_EXECUTIONS` executions since it loaded
        (Triton's statistics count from the load, so a full reload starts the count again).

        Why: a fresh model's first requests are slow (lazy initialisation in the backend; on a GPU the CUDA
        context and cuDNN's set-up per batch size: on an H200, resnet_tiny without its warm-up had a p99 of
        180-270 ms in its first second against 7 ms later, docs/results.md "A real GPU (H200)"), and a
        window's p99 over a few hundred traced requests is its 3rd or 4th slowest: a handful of them reads as
        a model error. Measured here, sim_accel on a fresh server at 115 req/s: the first two requests took 32
        and 41 ms, the rest 11-20 ms; in the bursty bench (r18) the first
        windows read a traced p99 of 43-47 ms against 19 predicted, the planner stood aside on that 2.3x and
        the reactive rules added an instance at 3 s that the oracle never needed. The planner therefore records
        no observed/predicted ratio from such a span (policy.decide_by_model), as Kubernetes' HPA discounts a
        pod's CPU during its initialisation period. Unknown (no statistics at the span's start): not marked.
        Statistics that count no execution in the span (an ensemble has no `batch_stats` rows) say nothing.
        Example: the statistics show 12 executions since the load at the span's start and 480 at its end:
        warming up; 60 and 480: not; 0 and 0 (an ensemble): not. `first`, `last`: as for `_executing`."""
        if first is None or last is None or first[0] != last[0] or last[1] <= first[1] or first[1] >= WARMUP_EXECUTIONS:
            return obs
        return dataclasses.replace(obs, warming_up=True)

    def _window_utilisation(self, devices: tuple[GpuObservation, ...], since: float, now: float) -> tuple[GpuObservation, ...]:
        """The devices with their utilisation averaged over the observation's span (each tick's reading
        covers one tick; the rates beside it cover the span, and the planner divides one by the other)."""
        out = []
        for g in devices:
            values = [u[g.index] for t, u in self._utilisation if since <= t <= now and g.index in u]
            out.append(dataclasses.replace(g, utilization_pct=sum(values) / len(values)) if values else g)
        return tuple(out)

    def _latency(self, obs: Observation, traced: TraceSummary | None) -> Observation:
        """The best p99 figure for the observation's span (`traced`: the span's request traces), and where it
        came from."""
        if not obs.valid or traced is None:
            return obs
        if traced.count >= MIN_TRACE_SAMPLES and traced.p99_ms is not None:
            return dataclasses.replace(obs, p99_ms=traced.p99_ms, p99_source="trace", p99_samples=traced.count)
        return estimate_p99(obs, self.tail_ratio, self.tail_ratio_measured)

    def _minute_may_hold_warm_up(self, now: float) -> bool:
        """Whether the summaries' last minute may hold the model's first WARMUP_EXECUTIONS executions since it
        loaded (`_warming_up`'s warm-up), so that its p99 over that minute is the warm-up's, not the model's.

        Read from the statistics: the read at or just before the minute's start and the latest, in one chain (no
        restart, no tick without statistics between). Warm: the minute began past the model's first
        WARMUP_EXECUTIONS executions, or the statistics count none at all (an ensemble has no `batch_stats`
        rows). Not known warm (True): the reads do not reach a minute back (the first minute after the
        controller started), or the chain broke within it. No statistics ever read: False, as before (nothing
        to tell by). Why: cold_start r85 (an 800-ms first execution per instance, untraced) learned its tail
        ratio from its first minute, summary p99 446 ms over a 10-ms mean: 5.0, the bound, and the p99 it showed
        read 2.5x the clients' (69 against 28 ms at midday) for 100 s, until that minute aged out of a later
        one; a GPU model's first executions are as slow (resnet_tiny on an H200: 180-270 ms against 7 ms).
        Example: 1-s ticks, at 61 s the read at 1 s counts 12 executions since the load and the latest 5,400:
        not calibrated; at 75 s the read at 15 s counts 1,300: calibrated."""
        if not self._executed:
            return False
        before = [e for e in self._executed if e[0] <= now - SUMMARY_MAX_AGE_S + 1e-6]
        if not before:
            return True
        (_, chain, executions, _, _), (_, last_chain, last_executions, _, _) = before[-1], self._executed[-1]
        if chain != last_chain:
            return True
        return last_executions > 0 and executions < WARMUP_EXECUTIONS

    def _quiet_minute(self, now: float, live: Settings) -> tuple[float, Observation] | None:
        """(the server's summary p99 in ms, the counters over the same last minute) where that minute can be read
        as the live configuration's, else None.

        Triton's summaries span about the last minute, so they are only trusted once the config has
        been stable that long, the model past its warm-up that long (`_minute_may_hold_warm_up`), and the minute
        held at least MIN_REQUESTS_FOR_TAIL completed requests."""
        c = self._latest
        if c is None or c.p99_us is None or now - self.changed_at < SUMMARY_MAX_AGE_S + self.settle_s:
            return None
        if self._minute_may_hold_warm_up(now):
            return None
        minute = self.counters.observe(now, SUMMARY_MAX_AGE_S, live.instance_count)
        if not minute.valid or minute.request_ms_mean <= 0 or minute.completion_rps * minute.span_s < MIN_REQUESTS_FOR_TAIL:
            return None
        return c.p99_us / 1000.0, minute

    def _calibrate_tail(self, quiet: tuple[float, Observation] | None) -> None:
        """Learn p99 / mean latency from a quiet minute (`_quiet_minute`), when there is one this tick.
        Example: summary p99 46 ms over a minute whose mean was 25 ms -> 1.84.
        """
        if quiet is None:
            return
        summary_p99_ms, minute = quiet
        ratio = min(max(summary_p99_ms / minute.request_ms_mean, TAIL_RATIO_BOUNDS[0]), TAIL_RATIO_BOUNDS[1])
        self.tail_ratio = ratio if not self.tail_ratio_measured else 0.8 * self.tail_ratio + 0.2 * ratio
        self.tail_ratio_measured = True


class TraceFeed:
    """Request tracing for the managed models: on, adapted, read, routed; off with one line if it cannot work.

    `state` is "starting" (not yet asked the server), "on", or "off: <why>". Per model, `sampling`
    holds the setting the server has (1 in `rate` requests, a file every `log_frequency` traces).
    """

    RECHECK_S = 30.0            # re-read each model's trace setting this often (a restarted server forgets it)
    NO_FILES_AFTER_S = 30.0     # traffic for this long and no trace file seen here: the files are elsewhere

    def __init__(self, api: TraceApi | None, *, samples_per_s: float = 20.0, path_override: str | None = None,
                 files_factory: Callable[[Path], TraceFiles] = TraceFiles, forced: bool = False):
        self.api = api
        self.forced = forced                   # `tracing: true`: on even where the server's tracing can crash it
        self.samples_per_s = samples_per_s
        self.path_override = path_override
        self.files_factory = files_factory
        self.files: TraceFiles | None = None
        self.trace_path: Path | None = None
        self.state = "starting" if api is not None else "off: disabled in the configuration"
        self.caution: str | None = None        # what the user should know about tracing on this server (a bug)
        self.sampling: dict[str, TraceSampling] = {}
        self._checked_at: dict[str, float] = {}
        self._failing: set[str] = set()        # models whose last settings call failed (warned once per streak)
        self._traffic_since: float | None = None
        self._seen_any = False

    @property
    def on(self) -> bool:
        return self.state == "on"

    def start(self) -> None:
        """Find the server's trace file; without one, fall back for good (logged once)."""
        if self.state != "starting":
            return
        try:
            path = self.path_override or self.api.trace_file()
        except TraceApiError as e:
            log.debug("trace settings not readable yet (%s); retrying", e)
            return
        if not path:
            self._turn_off("the server was started without a trace file (add "
                           "--trace-config triton,file=/tmp/traces/trace.json to tritonserver's command line)")
            return
        try:
            version = self.api.server_version()
        except TraceApiError as e:
            log.debug("server version not readable (%s)", e)
            version = None
        unsafe = trace_release_unsafe(version)
        if unsafe and not self.forced:
            self._turn_off(f"Triton {version} can crash under request tracing (server#7795, fixed in 2.57), so "
                           "`tracing: auto` leaves it off; `tracing: true` under `controller:` turns it on anyway")
            return
        self.trace_path = Path(path)
        self.files = self.files_factory(self.trace_path)
        self.state = "on"
        log.info("request tracing: reading %s.<n>, about %g sampled requests/s per model", path, self.samples_per_s)
        if unsafe:
            self.caution = (f"Triton {version} can crash under request tracing (before 2.57 its trace release "
                            "frees a locked mutex: server#7795, fixed in 2.57 by PR #8144); a newer Triton, or "
                            "`tracing: auto` or `false` under `controller:` (the p99 then estimated from the "
                            "counters), avoids it")
            log.warning("request tracing: %s", self.caution)

    def adapt(self, model: str, arrival_rps: float | None, now: float) -> None:
        """Turn tracing on for `model`, or change its rate when the arrival rate moved enough."""
        if not self.on:
            return
        if arrival_rps is None:
            return    # why: no rate yet (start) or no data this tick: tracing every request at 400 req/s would cost
        wanted = choose_sampling(arrival_rps, self.samples_per_s)
        current = self.sampling.get(model)
        recheck = now - self._checked_at.get(model, -1e18) >= self.RECHECK_S
        if current is not None and not needs_change(current, wanted) and not recheck:
            return
        try:
            if current is not None and recheck and not needs_change(current, wanted):
                live = self.api.setting(model)
                self._checked_at[model] = now
                if "TIMESTAMPS" in (live.get("trace_level") or []) and str(live.get("trace_rate")) == str(current.rate):
                    return
                log.info("%s: its trace setting was reset (server restart?); turning it on again", model)
            self.api.set_model(model, level="TIMESTAMPS", rate=wanted.rate, log_frequency=wanted.log_frequency)
        except TraceApiError as e:
            if model not in self._failing:
                log.warning("%s: cannot set its trace setting (%s); will retry", model, e)
            self._failing.add(model)
            return
        if model in self._failing:
            log.info("%s: trace setting applied again", model)
            self._failing.discard(model)
        self.sampling[model] = wanted
        self._checked_at[model] = now

    def poll(self, now: float, traffic: bool) -> dict[str, list[TraceSample]]:
        """New samples per model. `traffic`: some managed model had arrivals this tick."""
        if not self.on or self.files is None:
            return {}
        samples = self.files.poll()
        if self.files.error:
            self._turn_off(self.files.error)
            return {}
        self._seen_any = self._seen_any or self.files.files_read > 0
        if traffic and not self._seen_any:
            self._traffic_since = self._traffic_since if self._traffic_since is not None else now
            if now - self._traffic_since >= self.NO_FILES_AFTER_S:
                self._turn_off(f"no trace file appeared at {self.trace_path}.<n> after {self.NO_FILES_AFTER_S:g} s "
                               "of traffic (is the server on another machine? set controller.trace_file to where its "
                               "trace file is visible from here)")
                return {}
        routed: dict[str, list[TraceSample]] = {}
        for s in samples:
            routed.setdefault(s.model, []).append(s)
        return routed

    def describe(self, model: str) -> str:
        """One line for logs and status: "on, 1 in 10 requests" or "off: why"."""
        if not self.on:
            return self.state
        s = self.sampling.get(model)
        return "on (not yet set)" if s is None else f"on, 1 in {s.rate} requests"

    def forget(self, model: str) -> None:
        """A model no longer managed (unloaded): nothing to turn off, and its setting is asked afresh if it returns."""
        self.sampling.pop(model, None)
        self._checked_at.pop(model, None)
        self._failing.discard(model)

    def stop(self) -> None:
        """Turn off what we turned on, so that files do not pile up with nobody reading them."""
        for model in list(self.sampling):
            try:
                self.api.off(model)
            except TraceApiError:
                pass
        self.sampling.clear()

    def _turn_off(self, why: str) -> None:
        log.warning("request tracing off: %s; p99 falls back to the counters' estimate", why)
        self.stop()
        self.state = f"off: {why}"
