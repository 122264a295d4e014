"""controller/observer.py pieces the planner reads: the arrival-rate forecast fed each tick, and the device
utilisation averaged over the observation's span (the rates it is divided by cover the span)."""
from __future__ import annotations

import pytest

from controller.observer import ModelObserver
from controller.signals import BatchStat, ModelCounters, StatsCounters
from controller.types import GpuObservation, Observation, Settings

LIVE = Settings(1, 0)


def counters(t: float, rate: float) -> ModelCounters:
    n = rate * t
    return ModelCounters(success=n, failure=0.0, inference_count=n, exec_count=n, queue_us=0.0, compute_input_us=0.0,
                         compute_infer_us=5000.0 * n, compute_output_us=0.0, request_us=6000.0 * n, pending=0.0)


def gpu(util: float | None) -> tuple[GpuObservation, ...]:
    return (GpuObservation(index=0, utilization_pct=util, memory_used_bytes=1, memory_total_bytes=10),)


def test_utilisation_is_averaged_over_the_span_of_the_rates_beside_it():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    for t in range(0, 21):
        o.add_scrape(float(t), counters(float(t), 100.0), None, LIVE)
        util = 20.0 if t < 15 else 80.0          # one tick's reading jumps at t = 15
        obs = o.observe(float(t), LIVE, gpu(util))
    assert obs.valid and obs.span_s == 10.0
    # the span 10..20 s holds 5 readings of 20% and 6 of 80%: the window's figure, not the last tick's
    assert obs.gpus[0].utilization_pct == (5 * 20.0 + 6 * 80.0) / 11


def test_a_device_without_utilisation_stays_without():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    for t in range(0, 5):
        o.add_scrape(float(t), counters(float(t), 50.0), None, LIVE)
        obs = o.observe(float(t), LIVE, gpu(None))
    assert obs.valid and obs.gpus[0].utilization_pct is None


def test_the_forecast_follows_the_tick_rates():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    total = 0.0
    for t in range(0, 12):
        total += 40.0 if t < 6 else 200.0        # 40 req/s, then a step to 200
        c = counters(1.0, 0.0)
        c = ModelCounters(**{**c.__dict__, "success": total, "inference_count": total, "exec_count": total})
        o.add_scrape(float(t), c, None, LIVE)
    assert o.forecast is not None and o.forecast.ticks == 11
    assert o.forecast.band(2.0)[2] >= 200.0 and 150.0 < o.forecast.level < 200.0


def _fed(rates: list[float]):
    """An observer whose forecast saw these 1-s tick rates, and a window over them: (observer, window)."""
    from types import SimpleNamespace

    from controller.planner import Forecast

    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    f = Forecast.start(0.0, rates[0])
    for t, r in enumerate(rates[1:], start=1):
        f = f.update(float(t), r)
    o.forecast = f
    return o, SimpleNamespace(since=-0.5, arrival_rps=sum(rates) / len(rates))


def test_the_window_p99_mixes_bursts_and_lulls_and_moves_little_with_one_burst_tick():
    from types import SimpleNamespace

    from controller.planner import simulate_quantised

    fit = SimpleNamespace(predict_ms=lambda b: 6.0 + 1.5 * b)     # one instance: 133 req/s unbatched, ~440 in 8s

    def window_p99(rates: list[float]) -> float:
        o, obs = _fed(rates)
        return o._window_prediction(obs, LIVE, 8, fit, None, o._window_parts(obs))[0]

    lull, burst = simulate_quantised(100.0, 1, 0, 8, fit.predict_ms).p99_ms, simulate_quantised(
        378.0, 1, 0, 8, fit.predict_ms).p99_ms
    four = window_p99([100.0] * 6 + [378.0] * 4)       # 72% of the requests in bursts
    three = window_p99([100.0] * 7 + [378.0] * 3)      # 62%
    two = window_p99([100.0] * 8 + [378.0] * 2)        # 49%: the median request is now a lull's
    assert lull < two <= three <= four <= burst
    assert four - two < 0.35 * (burst - lull)           # one burst tick less moves it a little, not lull <-> burst
    steady = window_p99([200.0] * 10)                   # one load: the simulation at its rate
    assert steady == simulate_quantised(200.0, 1, 0, 8, fit.predict_ms).p99_ms


def test_the_window_mean_weighs_each_load_by_its_requests():
    from types import SimpleNamespace

    from controller.planner import simulate_quantised

    fit = SimpleNamespace(predict_ms=lambda b: 6.0 + 1.5 * b)
    o, obs = _fed([100.0] * 6 + [378.0] * 4)
    parts = o._window_parts(obs)
    assert len(parts) == 2
    p99, mean = o._window_prediction(obs, LIVE, 8, fit, None, parts)
    by_part = [(simulate_quantised(r, 1, 0, 8, fit.predict_ms).mean_ms, w) for r, w in parts]
    assert mean == pytest.approx(sum(m * w for m, w in by_part) / sum(w for _, w in by_part))
    lull_mean, burst_mean = sorted(m for m, _ in by_part)
    assert lull_mean < mean < burst_mean and mean < p99
    # one load: the simulation's own mean
    o.forecast = None
    one = SimpleNamespace(since=-0.5, arrival_rps=200.0)
    assert o._window_prediction(one, LIVE, 8, fit, None, o._window_parts(one))[1] == \
        simulate_quantised(200.0, 1, 0, 8, fit.predict_ms).mean_ms


# The busy fraction: exact from `batch_stats` (each execution once), the request counters' estimate otherwise.
# observer._executing's docstring example: in 10 s one instance ran 100 executions of 1 item (5 ms each) and
# 100 of 9 items (30 ms each): busy 3.5 s of 10 = 0.35; the counters charge each request its batch's time,
# (100 x 5 + 900 x 30) ms / 1000 requests x 200 executions = 5.5 s: 0.55.

def mixed_counters(f: float) -> ModelCounters:
    """The example's `/metrics` counters after the share f of its 10 s."""
    return ModelCounters(success=1000 * f, failure=0.0, inference_count=1000 * f, exec_count=200 * f, queue_us=0.0,
                         compute_input_us=0.0, compute_infer_us=27_500_000 * f, compute_output_us=0.0,
                         request_us=28_000_000 * f, pending=0.0)


def mixed_stats(f: float) -> StatsCounters:
    """The example's statistics after the share f of its 10 s: each execution once, in its batch size's row."""
    rows = {1: BatchStat(round(100 * f), 0, round(500e6 * f), 0), 9: BatchStat(round(100 * f), 0, round(3000e6 * f), 0)}
    return StatsCounters(inference_count=round(1000 * f), execution_count=round(200 * f), batch_stats=rows)


def run_mixed(stats_at) -> Observation:
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    for t in range(0, 11):
        o.add_scrape(float(t), mixed_counters(t / 10), stats_at(t), LIVE)
    return o.observe(10.0, LIVE)


def test_busy_is_exact_from_batch_stats_where_they_cover_the_window():
    obs = run_mixed(lambda t: mixed_stats(t / 10))
    assert obs.valid and obs.span_s == 10.0
    assert obs.busy_source == "batch_stats" and abs(obs.busy_fraction - 0.35) < 1e-9


def test_busy_falls_back_to_the_counters_estimate_without_statistics():
    obs = run_mixed(lambda t: None)
    assert obs.busy_source == "requests" and abs(obs.busy_fraction - 0.55) < 1e-9


def test_busy_falls_back_where_the_statistics_break_within_the_window():
    # a tick without statistics in the middle: a restart between could not be seen
    gap = run_mixed(lambda t: None if t == 5 else mixed_stats(t / 10))
    assert gap.busy_source == "requests" and abs(gap.busy_fraction - 0.55) < 1e-9
    # the statistics restarted (a full reload) while the counters did not: the delta would be wrong
    restart = run_mixed(lambda t: mixed_stats(t / 10) if t < 6 else mixed_stats((t - 6) / 10))
    assert restart.busy_source == "requests"


def test_busy_keeps_the_estimate_where_batch_stats_miss_the_executions():
    # an ensemble, for one, reports executions in /metrics but no batch_stats rows
    obs = run_mixed(lambda t: StatsCounters(inference_count=100 * t, execution_count=20 * t))
    assert obs.busy_source == "requests" and abs(obs.busy_fraction - 0.55) < 1e-9


def test_busy_uses_only_the_fresh_span_and_the_live_instance_count():
    o = ModelObserver("m", window_s=10.0, settle_s=2.0)
    for t in range(0, 11):
        o.add_scrape(float(t), mixed_counters(t / 10), mixed_stats(t / 10), Settings(2, 0))
    o.mark_change(4.0)           # fresh from 6 s: 4 s of a steady 0.35 instance-seconds per second over 2 instances
    obs = o.observe(10.0, Settings(2, 0))
    assert obs.span_s == 4.0 and obs.busy_source == "batch_stats" and abs(obs.busy_fraction - 0.175) < 1e-9


# The warm-up: a span that began before the model's first WARMUP_EXECUTIONS executions since its load.

def _since_load(executions: int, batch_stats: bool = True) -> StatsCounters:
    rows = {1: BatchStat(executions, 0, executions * 8_000_000, 0)} if batch_stats else {}
    return StatsCounters(inference_count=executions, execution_count=executions, batch_stats=rows)


def _observe_at(t_obs: float, stats_at, settle_s: float = 0.0, change_at: float | None = None) -> Observation:
    o = ModelObserver("m", window_s=10.0, settle_s=settle_s)
    for t in range(0, int(t_obs) + 1):
        o.add_scrape(float(t), counters(t, 10.0), stats_at(t), LIVE)
        if change_at is not None and t == change_at:
            o.mark_change(float(t))
    return o.observe(t_obs, LIVE)


def test_a_span_from_the_models_first_executions_is_warming_up():
    from controller.observer import WARMUP_EXECUTIONS
    assert WARMUP_EXECUTIONS == 50
    fresh = lambda t: _since_load(10 * t)                     # noqa: E731 - loaded at 0, 10 executions a second
    assert _observe_at(10.0, fresh).warming_up                # the span 0-10 s holds executions 1-100
    assert not _observe_at(20.0, fresh).warming_up            # 10-20 s: from the 100th on
    assert not _observe_at(10.0, lambda t: _since_load(60 + 10 * t)).warming_up   # a warm server (60 before)
    # unknown: no statistics, or statistics that count no execution (an ensemble has no batch_stats rows)
    assert not _observe_at(10.0, lambda t: None).warming_up
    assert not _observe_at(10.0, lambda t: _since_load(10 * t, batch_stats=False)).warming_up
    # a full reload at 12 s restarts the count: the fresh span after it (from 12 s) holds its first executions
    reload = lambda t: _since_load(10 * t) if t < 12 else _since_load(10 * (t - 12))   # noqa: E731
    assert _observe_at(18.0, reload, change_at=12).warming_up
    assert not _observe_at(30.0, reload, change_at=12).warming_up


def test_the_batchers_own_wait_steps_at_most_every_five_seconds_and_is_the_median_of_the_last_steps():
    """observer._note_implicit: a step of planner.implicit_step once IMPLICIT_EVERY_S, over windows of enough
    executions; the wait the planner uses is the median of the last IMPLICIT_KEPT steps."""
    from types import SimpleNamespace

    from controller.planner import simulate_quantised

    fit = SimpleNamespace(predict_ms=lambda b: 7.14 + 1.555 * b)
    live = Settings(4, 0)
    server = simulate_quantised(95.0, 4, 1000, 32, fit.predict_ms, None, 4.0).mean_batch   # a batcher waiting ~1 ms
    window = SimpleNamespace(warming_up=False, exec_rps=90.0, span_s=10.0, since=0.0, arrival_rps=95.0,
                             avg_batch_size=server, busy_fraction=0.3)
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    o.items_per_request = 4.0
    for t in range(30):                                     # a tick a second: steps at 0, 5, ..., 25 s
        o._note_implicit(float(t), window, live, 32, fit, None, [(95.0, 1.0)])
    assert list(o._implicit) == [500, 1000, 1000, 1000, 1000] and o.implicit_us == 1000
    assert o.plan_inputs(32, 1.0).implicit_us == 1000
    few = ModelObserver("m", window_s=10.0, settle_s=0.0)   # 50 executions in the window: nothing read
    few.items_per_request = 4.0
    few._note_implicit(0.0, SimpleNamespace(**{**vars(window), "exec_rps": 5.0}), live, 32, fit, None, [(95.0, 1.0)])
    assert not few._implicit and few.implicit_us == 0
    busy = ModelObserver("m", window_s=10.0, settle_s=0.0)  # instances busy 90%: the queue forms the batches
    busy.items_per_request = 4.0
    busy._note_implicit(0.0, SimpleNamespace(**{**vars(window), "busy_fraction": 0.9}), live, 32, fit, None,
                        [(95.0, 1.0)])
    assert not busy._implicit and busy.implicit_us == 0


# The tail ratio (p99 / mean, the untraced p99 estimate's factor) is learned from Triton's summaries over a minute:
# never from a minute that may hold the model's first executions since it loaded (observer._minute_may_hold_warm_up).

def _tail_run(stats_at, p99_ms_at, until: int) -> ModelObserver:
    """1-s ticks at 30 req/s (mean 6 ms a request, `counters`); the summary's p99 and the statistics as given."""
    import dataclasses

    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    for t in range(0, until + 1):
        c = dataclasses.replace(counters(float(t), 30.0), p99_us=1000.0 * p99_ms_at(t))
        o.add_scrape(float(t), c, stats_at(t), LIVE)
        o.observe(float(t), LIVE)
    return o


def _cold_p99(t: int) -> float:
    return 446.0 if t < 62 else 12.0      # cold_start r85: the first minute's summary holds an 800-ms execution


def test_the_tail_ratio_is_not_learned_from_a_minute_that_holds_the_warm_up():
    def stats(t):
        return _since_load(30 * t)
    early = _tail_run(stats, _cold_p99, 61)         # the read at 1 s counts 30 executions: the warm-up is inside
    assert not early.tail_ratio_measured and early.tail_ratio == 2.0
    later = _tail_run(stats, _cold_p99, 75)         # at 75 s the minute began at 15 s, 450 executions in: warm
    assert later.tail_ratio_measured and later.tail_ratio == pytest.approx(2.0, rel=0.01)    # 12 ms / 6 ms
    # the rule's one reason: without it the first minute's 446 ms over 6 ms sets the bound (5.0) at once
    import controller.observer as observer_module
    from unittest import mock
    with mock.patch.object(observer_module.ModelObserver, "_minute_may_hold_warm_up", return_value=False):
        assert _tail_run(stats, _cold_p99, 30).tail_ratio == observer_module.TAIL_RATIO_BOUNDS[1]


def test_the_tail_ratio_waits_where_the_statistics_do_not_reach_a_minute_back_or_break_within_it():
    warm = _tail_run(lambda t: _since_load(5000 + 30 * t), lambda t: 12.0, 50)   # long warm, but < 1 min of reads
    assert not warm.tail_ratio_measured
    assert _tail_run(lambda t: _since_load(5000 + 30 * t), lambda t: 12.0, 62).tail_ratio_measured
    # a tick without statistics within the minute breaks the chain: not known warm until a minute after it
    def gap(t):
        return None if t == 40 else _since_load(5000 + 30 * t)
    assert not _tail_run(gap, lambda t: 12.0, 95).tail_ratio_measured
    assert _tail_run(gap, lambda t: 12.0, 102).tail_ratio_measured
    # no statistics ever read (nothing to tell by), or none that count executions (an ensemble): as before
    assert _tail_run(lambda t: None, lambda t: 12.0, 30).tail_ratio_measured
    assert _tail_run(lambda t: _since_load(0, batch_stats=False), lambda t: 12.0, 62).tail_ratio_measured


# Untraced, the summaries' tail is checked against the simulation's (observer._check_tail): the summary's p99 over the
# counters' mean, against the simulated p99 over its mean for the same minute's loads; the planner multiplies each
# window's mean ratio by it (policy.window_check).

def _tail_check_run(p99_ms: float, until: int, predicted=(22.0, 11.0), change_at: int | None = None,
                    stats_from: int = 5000) -> ModelObserver:
    """`_tail_run` at 30 req/s (mean 6 ms), the summary's p99 `p99_ms`, with the minute's prediction as given
    (p99, mean) where it is not None (the real simulation where it is)."""
    import dataclasses
    from unittest import mock

    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    real = o._window_prediction
    calls = []

    def prediction(obs, live, max_batch, fit, jitter, parts):
        if obs.span_s >= 50:            # the minute's, not the window's (10 s)
            calls.append(parts)
        return real(obs, live, max_batch, fit, jitter, parts) if predicted is None or obs.span_s < 50 else predicted

    with mock.patch.object(o, "_window_prediction", side_effect=prediction):
        for t in range(0, until + 1):
            c = dataclasses.replace(counters(float(t), 30.0), p99_us=1000.0 * p99_ms)
            o.add_scrape(float(t), c, _since_load(stats_from + 30 * t), LIVE)
            if change_at is not None and t == change_at:
                o.mark_change(float(t))
            o.last_obs = o.observe(float(t), LIVE, max_batch_size=8)
    o.minute_predictions = calls
    return o


def test_the_tail_check_is_the_summaries_p99_over_mean_against_the_simulations():
    o = _tail_check_run(15.0, 62)               # 15 / 6 = 2.5 measured; 22 / 11 = 2.0 predicted
    assert o.tail_check == pytest.approx(1.25)
    assert o.last_obs.tail_check == pytest.approx(1.25) and o.last_obs.p99_source == "mean_x_tail_ratio"
    # the minute's loads: one steady 30 req/s over the minute's ticks
    (rate, share), = o.minute_predictions[-1]
    assert rate == pytest.approx(30.0, rel=0.01) and share == pytest.approx(1.0)
    # the same shape measured as predicted: 1.0; the readings are bounded (one odd minute cannot swing it)
    assert _tail_check_run(12.0, 62).tail_check == pytest.approx(1.0)
    assert _tail_check_run(60.0, 62).tail_check == pytest.approx(2.0)       # 10 / 2 = 5, read as 2.0
    assert _tail_check_run(6.0, 62).tail_check == pytest.approx(0.67)       # 1 / 2 = 0.5, read as 0.67


def test_the_tail_check_waits_for_a_quiet_minute_and_moves_slowly():
    assert _tail_check_run(15.0, 58).tail_check is None                    # not yet a minute of counters
    assert _tail_check_run(15.0, 58).last_obs.tail_check is None
    # a change 20 s in: the summaries hold the old configuration until a minute after it
    assert _tail_check_run(15.0, 79, change_at=20).tail_check is None
    assert _tail_check_run(15.0, 81, change_at=20).tail_check == pytest.approx(1.25)
    # a minute that may hold the model's first executions since it loaded is not read (as for the tail ratio)
    assert _tail_check_run(15.0, 61, stats_from=0).tail_check is None      # the read at 1 s counts 30 executions
    assert _tail_check_run(15.0, 61).tail_check == pytest.approx(1.25)      # 5,030: long warm
    # one reading every TAIL_CHECK_EVERY_S, each moving it a fifth of the way
    from controller.observer import TAIL_CHECK_EVERY_S
    o = _tail_check_run(15.0, 62 + int(3 * TAIL_CHECK_EVERY_S))
    assert len(o.minute_predictions) == 4 and o.tail_check == pytest.approx(1.25)


def test_the_tail_check_runs_the_real_simulation_and_is_not_kept_where_traced():
    o = _tail_check_run(40.0, 62, predicted=None)       # 8-ms executions at 30 req/s: queueing adds little
    assert o.tail_check is not None and 1.0 < o.tail_check <= 2.0
    # traced: the window's traced p99 is checked directly, the observation carries no tail check
    import dataclasses
    traced = dataclasses.replace(o.last_obs, p99_source="trace")
    from controller import policy
    assert policy.window_check(traced)[2] == "trace"


def test_the_tail_check_is_logged_with_the_observation():
    from controller.loop import summarize_obs
    o = _tail_check_run(15.0, 62)
    assert summarize_obs(o.last_obs)["tail_check"] == 1.25
    assert "tail_check" not in summarize_obs(_tail_check_run(15.0, 58).last_obs)
