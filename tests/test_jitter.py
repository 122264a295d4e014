"""Execution jitter: how much one execution's time varies around its batch size's mean, measured from traced
requests (service.execution_jitter), carried by the observer per configuration, and simulated by the planner."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import load_script
from controller.observer import ModelObserver
from controller.planner import ServiceModel, jitter_factors, predict, simulate, simulate_quantised
from controller.service import JITTER_FLOOR, Jitter, ServiceFit, execution_jitter, quantile_mean, summary_quantiles
from controller.signals import BatchStat, ModelCounters, StatsCounters
from controller.traces import COMPUTE_PROBS, TraceSample, TraceWindow
from controller.types import Settings

LIVE = Settings(1, 0)


def quantiles_of(values) -> tuple[float, ...]:
    """What TraceWindow.summary gives for these compute times: nearest-rank quantiles over the mean."""
    w = TraceWindow()
    w.add([TraceSample("m", 100.0, 1.0, 1.0, 0.0, float(v)) for v in values], read_at=100.0)
    return w.summary(100.0, 10.0).compute_quantiles


# ---- the estimate -----------------------------------------------------------------------------------------

def _mixed(sizes: dict[int, int], line, sigma: float, seed: int = 2):
    """Executions of each size (count) at line(b) ms times a lognormal J of log-sd sigma (0: exact); per request,
    as a traced request or the summary sees them: (times, batch deltas)."""
    rng = np.random.default_rng(seed)
    xs, deltas = [], {}
    for b, n in sizes.items():
        ex = line(b) * (rng.lognormal(-sigma ** 2 / 2, sigma, n) if sigma else np.ones(n))
        deltas[b] = (n, int(ex.sum() * 1e6))
        xs.append(np.repeat(ex, b))
    return np.concatenate(xs), deltas


def test_a_tail_that_the_sizes_mix_makes_is_not_taken_as_jitter():
    """resnet_tiny's curve, s(b) = 2.245 + 1.29 b, exact executions of batches of 1-8 (one instance under a
    heavy load). Read from a summary, whose straight lower half overstates the variance (0.27 against 0.16), the
    variance leaves J at 0.09, over the floor, and the tail pulled by it alone gave J a p99 over 1.5x of its
    own; the p99 match leaves it exact. Beside a real J (batches of 1-5) the match still finds J's tail."""
    line = lambda b: 2.245 + 1.29 * b              # noqa: E731
    x, deltas = _mixed({1: 2000, 2: 1200, 3: 800, 4: 500, 6: 300, 8: 150}, line, 0.0)
    m = float(x.mean())
    scv, q = summary_quantiles(tuple((p, float(np.quantile(x, p))) for p in (0.5, 0.9, 0.95, 0.99, 0.999)), m)
    j = execution_jitter(scv, q, len(x), deltas, source="summary")
    assert j.scv >= JITTER_FLOOR and j.at(0.99) == 1.0 and j.quantiles == ()
    sizes = {1: 3000, 2: 1500, 3: 700, 4: 300, 5: 100}
    for sigma, true_p99 in ((0.3, 1.92), (0.5, 2.80)):        # lognormal J: its own p99 over its mean
        x, deltas = _mixed(sizes, line, sigma)
        m = float(x.mean())
        traced = execution_jitter(float(x.var()) / m ** 2, quantiles_of(x), len(x), deltas)
        scv, q = summary_quantiles(tuple((p, float(np.quantile(x, p))) for p in (0.5, 0.9, 0.95, 0.99, 0.999)), m)
        summary = execution_jitter(scv, q, len(x), deltas, source="summary")
        assert traced.at(0.99) == pytest.approx(true_p99, rel=0.1) and summary.at(0.99) == pytest.approx(true_p99, rel=0.1)


def test_the_docstring_example():
    deltas = {1: (90, 900_000_000), 2: (5, 60_000_000)}       # 90 x 10 ms, 5 x 12 ms
    flat = tuple(1.0 for _ in COMPUTE_PROBS)
    j = execution_jitter(0.6, flat, 100, deltas)
    assert j.scv == pytest.approx(1.6 / (104.4 / 10.2 ** 2) - 1, rel=1e-9) and j.scv == pytest.approx(0.594, abs=1e-3)


def test_the_spread_that_batch_sizes_explain_is_not_jitter():
    # executions of 1 item take 5 ms, of 8 items 19 ms, exactly; requests are sampled per item, so a traced
    # request ran in a batch of 8 with probability 8 x 40 / (100 + 8 x 40)
    deltas = {1: (100, 500_000_000), 8: (40, 760_000_000)}
    x = np.array([5.0] * 100 + [19.0] * 320)
    scv_x = x.var() / x.mean() ** 2
    j = execution_jitter(float(scv_x), quantiles_of(x), len(x), deltas)
    assert scv_x > 0.1 and j.scv == pytest.approx(0.0, abs=1e-9)          # 0.145 of spread, none of it jitter
    assert j.quantiles == () and j.at(0.99) == 1.0        # under the floor: exact executions


def test_a_spread_within_one_size_is_jitter_and_keeps_its_shape():
    rng = np.random.default_rng(1)
    x = 8.0 * rng.lognormal(-0.3, math.sqrt(0.6), 4000)     # one size, heavy-tailed
    x *= 8.0 / x.mean()
    scv_x = float(x.var() / x.mean() ** 2)
    j = execution_jitter(scv_x, quantiles_of(x), len(x), {1: (4000, int(8e6 * 4000))})
    assert j.scv == pytest.approx(scv_x, rel=1e-9)        # nothing explained by sizes: all of it
    assert j.at(0.99) == pytest.approx(np.percentile(x, 99) / x.mean(), rel=0.05)
    assert j.at(0.99) > 3.0 and j.at(0.5) < 1.0           # the measured shape: a long right tail
    # the quantile function has mean 1: draws from it keep the service curve's mean
    assert float(np.mean(jitter_factors(j.quantiles, 200_000, seed=0))) == pytest.approx(1.0, abs=0.01)


def test_one_stall_moves_the_variance_but_only_the_top_of_the_shape():
    rng = np.random.default_rng(3)
    calm = 8.0 * rng.lognormal(-0.005, 0.1, 499)
    stalled = np.append(calm, 300.0)                      # one execution held up 300 ms (a pause of the machine)
    deltas = lambda x: {1: (len(x), int(x.sum() * 1e6))}   # noqa: E731
    j_calm = execution_jitter(float(calm.var() / calm.mean() ** 2), quantiles_of(calm), len(calm), deltas(calm))
    j_stall = execution_jitter(float(stalled.var() / stalled.mean() ** 2), quantiles_of(stalled), len(stalled),
                               deltas(stalled))
    assert j_calm.scv < JITTER_FLOOR < 1.0 < j_stall.scv            # the variance reads the stall ...
    # ... the shape does not: with 500 times it reaches the 0.995 quantile (the 3rd largest), not the stall
    assert j_stall.at(0.995) < 1.4 and j_stall.at(1.0) == j_stall.at(0.995)
    line = lambda b: 6.0 + 1.5 * b               # noqa: E731
    assert simulate(60, 1, 0, 8, line, jitter=j_stall.quantiles).p99_ms < 1.5 * simulate(60, 1, 0, 8, line).p99_ms
    # 5,000 times reach the 0.999 quantile: ten stalls among them are a rate, and they are simulated
    many = np.append(8.0 * rng.lognormal(-0.005, 0.1, 4990), [300.0] * 10)
    j_many = execution_jitter(float(many.var() / many.mean() ** 2), quantiles_of(many), len(many), deltas(many))
    assert j_many.at(0.999) > 10 and simulate(60, 1, 0, 8, line, jitter=j_many.quantiles).p99_ms > 100


def test_a_mix_of_sizes_and_jitter_keeps_only_the_jitter():
    rng = np.random.default_rng(2)
    sizes = rng.choice([1, 4], p=[0.5, 0.5], size=6000)         # per request
    means = np.where(sizes == 1, 6.0, 12.0)
    x = means * rng.lognormal(-0.5 * math.log(1.3), math.sqrt(math.log(1.3)), len(sizes))   # Var(J) = 0.3
    n1, n4 = int((sizes == 1).sum()), int((sizes == 4).sum()) // 4      # executions: 4 requests per batch of 4
    deltas = {1: (n1, int(6e6 * n1)), 4: (n4, int(12e6 * n4))}
    j = execution_jitter(float(x.var() / x.mean() ** 2), quantiles_of(x), len(x), deltas)
    assert j.scv == pytest.approx(0.3, abs=0.05)
    assert 1.0 < j.at(0.99) < np.percentile(x, 99) / x.mean()   # pulled towards 1: the sizes' part taken out


@pytest.mark.parametrize("scv, quantiles, samples, deltas", [
    (None, tuple(1.0 for _ in COMPUTE_PROBS), 100, {1: (10, 10_000_000)}),          # no compute times traced
    (0.5, tuple(1.0 for _ in COMPUTE_PROBS), 49, {1: (10, 10_000_000)}),            # too few
    (0.5, (1.0, 2.0), 100, {1: (10, 10_000_000)}),                                   # quantiles of another grid
    (0.5, tuple(1.0 for _ in COMPUTE_PROBS), 100, {}),                               # no execution in the span
    (float("nan"), tuple(1.0 for _ in COMPUTE_PROBS), 100, {1: (10, 10_000_000)}),
    (-0.1, tuple(1.0 for _ in COMPUTE_PROBS), 100, {1: (10, 10_000_000)}),
])
def test_nothing_to_estimate_from(scv, quantiles, samples, deltas):
    assert execution_jitter(scv, quantiles, samples, deltas) is None


def test_the_trace_summary_gives_the_compute_spread():
    w = TraceWindow()
    w.add([TraceSample("m", 10.0 + i / 100, 20.0, 19.0, 1.0, c) for i, c in enumerate([4.0, 12.0] * 50)], read_at=12.0)
    s = w.summary(12.0, 10.0)
    assert s.compute_count == 100 and s.compute_mean_ms == 8.0
    assert s.compute_scv == pytest.approx(0.25)                # sd 4 over mean 8
    assert s.compute_quantiles[0] == 0.5 and s.compute_quantiles[-1] == 1.5 and len(s.compute_quantiles) == len(COMPUTE_PROBS)
    assert TraceWindow().summary(0.0, 10.0).compute_quantiles == ()


# ---- the simulation ---------------------------------------------------------------------------------------

HEAVY = Jitter(0.6, tuple(float(q) for q in np.interp(COMPUTE_PROBS, [0, 0.5, 0.9, 0.99, 1.0], [0.3, 0.7, 1.8, 3.9, 6.0])))


def _normalised(j: Jitter) -> Jitter:
    area = quantile_mean(j.quantiles)
    return Jitter(j.scv, tuple(q / area for q in j.quantiles))


def test_jitter_raises_the_p99_keeps_the_mean_work_and_is_deterministic():
    line = lambda b: 6.0 + 1.5 * b               # noqa: E731
    heavy = _normalised(HEAVY)
    plain = simulate(60, 1, 0, 8, line)
    jittered = simulate(60, 1, 0, 8, line, jitter=heavy.quantiles)
    assert jittered.p99_ms > 2.0 * plain.p99_ms                       # the tail of one execution reaches the p99
    assert jittered.busy == pytest.approx(plain.busy, rel=0.1)        # J has mean 1: the same work on average
    assert simulate(60, 1, 0, 8, line, jitter=heavy.quantiles) == jittered
    assert simulate(60, 1, 0, 8, line, jitter=()) == plain            # no jitter: the simulation as before


def test_the_memo_tells_jitters_apart():
    line = lambda b: 6.0 + 1.5 * b               # noqa: E731
    a = simulate_quantised(61.7, 1, 0, 8, line)
    b = simulate_quantised(61.7, 1, 0, 8, line, _normalised(HEAVY))
    assert b.p99_ms > a.p99_ms
    assert simulate_quantised(61.7, 1, 0, 8, line, Jitter(0.01)) == a   # under the floor: exact, the same entry


def _fit(alpha: float) -> ServiceFit:
    return ServiceFit(alpha, 1.5, 1.0, 100.0, {1: (50.0, alpha + 1.5), 2: (50.0, alpha + 3.0)})


def test_the_model_takes_the_nearest_counts_jitter_and_the_cautious_one_at_a_count():
    low, high = Jitter(0.1, HEAVY.quantiles), Jitter(0.6, HEAVY.quantiles)
    model = ServiceModel.build([(Settings(1, 0), _fit(6.0)), (Settings(2, 0), _fit(7.0))], None,
                               [(Settings(1, 0), low), (Settings(1, 2000), high), (Settings(3, 0), Jitter(0.2))])
    assert model.jitter(1) is high                 # two delays at one count: the one that varies more
    assert model.jitter(2) is high and model.jitter(3).scv == 0.2 and model.jitter(8).scv == 0.2
    assert ServiceModel.build([(Settings(1, 0), _fit(6.0))], None).jitter(1) is None


def test_a_lone_requests_p99_is_its_executions_p99():
    heavy = _normalised(HEAVY)
    model = ServiceModel.build([(LIVE, _fit(6.0))], None, [(LIVE, heavy)])
    c = predict(LIVE, 0.0, model, 8, 1.0, 100.0)
    assert c.p99_ms == pytest.approx((6.0 + 1.5) * heavy.at(0.99))
    assert predict(LIVE, 0.0, ServiceModel.build([(LIVE, _fit(6.0))], None), 8, 1.0, 100.0).p99_ms == 7.5


# ---- the observer -----------------------------------------------------------------------------------------

def _counters(t: float) -> ModelCounters:
    n = 10.0 * t
    return ModelCounters(success=n, failure=0.0, inference_count=n, exec_count=n, queue_us=0.0, compute_input_us=0.0,
                         compute_infer_us=8000.0 * n, compute_output_us=0.0, request_us=9000.0 * n, pending=0.0)


def _stats(t: float, before: int) -> StatsCounters:
    n = before + 10 * int(t)                        # 10 executions of 1 item a second, 8 ms each
    return StatsCounters(inference_count=n, execution_count=n, batch_stats={1: BatchStat(n, 0, n * 8_000_000, 0)})


def _feed(o: ModelObserver, seconds, computes, before: int = 1000, live: Settings = LIVE):
    """One request a 0.1 s over `seconds` (compute times cycling through `computes`), traced, read each second;
    the last observation."""
    obs = None
    for t in seconds:
        o.add_scrape(float(t), _counters(t), _stats(t, before), live)
        o.add_traces([TraceSample("m", t - 1 + k / 10, computes[(10 * t + k) % len(computes)] + 1.0,
                                  computes[(10 * t + k) % len(computes)] + 1.0, 0.5, computes[(10 * t + k) % len(computes)])
                      for k in range(10)], read_at=float(t))
        obs = o.observe(float(t), live, max_batch_size=8)
    return obs


def _observe(computes, before: int = 1000, until: int = 20) -> tuple[ModelObserver, object]:
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    return o, _feed(o, range(0, until + 1), computes, before)


def test_the_observer_measures_the_live_configs_jitter_and_hands_it_to_the_planner():
    o, obs = _observe([4.0, 12.0])                   # mean 8 ms as the statistics say, sd 4: scv 0.25
    assert obs.jitter is not None and obs.jitter.scv == pytest.approx(0.25, abs=0.01)
    assert dict(o.plan_inputs(8, 2.0).jitters)[LIVE] is obs.jitter
    _, exact = _observe([8.0])
    assert exact.jitter.scv == pytest.approx(0.0, abs=1e-9) and exact.jitter.quantiles == ()
    # the prediction the planner checks itself by carries the jitter: higher than for exact executions
    assert obs.predicted_p99_ms > exact.predicted_p99_ms


def test_no_jitter_from_a_span_that_is_warming_up():
    _, obs = _observe([4.0, 12.0], before=0, until=4)    # the span holds the model's first 40 executions
    assert obs.warming_up and obs.jitter is None


# two executions in 100 take 48 ms, the rest 8: a 10-s window's 100 traced times reach only the 0.98 quantile (8 ms)
RARE_SLOW = [8.0] * 49 + [48.0]


def test_the_estimate_reads_the_configurations_last_minute_not_only_the_window():
    o, obs = _observe(RARE_SLOW, until=70)
    window = o.traces.summary(70.0, 10.0)
    assert window.compute_count == 100
    cut = execution_jitter(window.compute_scv, window.compute_quantiles, window.compute_count, {1: (100, 800_000_000)})
    assert cut.at(0.99) == pytest.approx(1.0)          # the window alone: its shape stops at 8 ms, i.e. exact
    # 60 s hold 600 traced times, 12 of them slow: the 0.99 and 0.995 quantiles are supported, and slow
    assert obs.jitter.at(0.99) == pytest.approx(48.0 / 8.8, rel=0.05)
    assert obs.jitter.at(0.999) == obs.jitter.at(0.995)   # 0.6 times beyond the 0.999: cut there


def test_the_span_starts_at_the_change_and_after_the_warm_up():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    _feed(o, range(0, 61), RARE_SLOW)
    other = Settings(2, 0)
    o.mark_change(60.0)                                 # the new configuration's executions are exact
    obs = _feed(o, range(61, 81), [8.0], live=other)
    assert obs.jitter.scv == pytest.approx(0.0, abs=1e-9) and o.jitter(LIVE).at(0.99) > 5.0
    # a fresh model (statistics from 0): nothing before its 50th execution, then the exact ones only
    o = ModelObserver("m", window_s=30.0, settle_s=0.0)
    slow_first = [48.0] * 50 + [8.0] * 1000            # its first 5 s are slow, a warm-up
    assert _feed(o, range(0, 5), slow_first, before=0).jitter is None
    obs = _feed(o, range(5, 30), slow_first, before=0)
    # the observation's 30-s window still holds the warm-up; the jitter's span does not
    assert obs.warming_up and obs.jitter.scv == pytest.approx(0.0, abs=1e-9)
    # the statistics restart (a full reload of the same configuration): nothing from before it
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    _feed(o, range(0, 41), RARE_SLOW)
    assert o.jitter(LIVE).at(0.99) > 5.0
    obs = _feed(o, range(41, 71), [8.0], before=-400)   # 10 executions at t=41, as after a load
    assert obs.jitter.scv == pytest.approx(0.0, abs=1e-9)


def test_one_windows_stall_does_not_decide_alone():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    from collections import deque
    o._jitter[LIVE] = deque([Jitter(0.2), Jitter(0.25), Jitter(3.5), Jitter(0.22), Jitter(0.3)])
    assert o.jitter(LIVE).scv == 0.25                    # the median of the last five, not the stall's 3.5


# ---- untraced: from Triton's compute summary (service.summary_quantiles, observer._summary_jitter) -----------

DOC_POINTS = ((0.5, 9.0), (0.9, 13.0), (0.95, 15.0), (0.99, 20.0), (0.999, 30.0))


def test_the_summarys_quantiles_make_a_quantile_function_of_mean_one():
    scv, q = summary_quantiles(DOC_POINTS, 10.0)             # the docstring's example
    assert q[0] == pytest.approx(0.678, abs=0.002) and quantile_mean(q) == pytest.approx(1.0)
    assert float(np.interp(0.99, COMPUTE_PROBS, q)) == pytest.approx(2.0) and scv == pytest.approx(0.09, abs=0.005)
    assert q[-1] == q[-2] == pytest.approx(3.0)              # nothing above the summary's 0.999: cut there
    # the summary's upper half alone holds more than the mean (the counters' and the summary's minutes differ):
    # the line starts at 0, the function is scaled to mean 1
    scv, q = summary_quantiles(DOC_POINTS, 6.0)
    assert q[0] == 0.0 and quantile_mean(q) == pytest.approx(1.0)
    # a quantile that falls (the summary's estimates are approximate) is held at the one below it
    falling = summary_quantiles(((0.5, 9.0), (0.9, 8.0), (0.99, 20.0)), 10.0)[1]
    assert falling[9] == falling[5] and list(falling) == sorted(falling)       # p 0.9 held at p 0.5's
    # nothing to build on: no point at or under the median, none at or over 0.99, no mean
    assert summary_quantiles(((0.9, 13.0), (0.99, 20.0)), 10.0) is None
    assert summary_quantiles(((0.5, 9.0), (0.95, 15.0)), 10.0) is None
    assert summary_quantiles(DOC_POINTS, 0.0) is None and summary_quantiles((), 10.0) is None


def test_a_heavy_tail_read_from_five_quantiles_is_close_to_the_traced_one():
    rng = np.random.default_rng(3)
    x = 8.0 * rng.lognormal(-0.3, math.sqrt(0.6), 200_000)
    traced = execution_jitter(float(x.var() / x.mean() ** 2), quantiles_of(x), len(x), {1: (len(x), int(1e6 * x.sum()))})
    points = tuple((p, float(np.quantile(x, p))) for p in (0.5, 0.9, 0.95, 0.99, 0.999))
    scv, q = summary_quantiles(points, float(x.mean()))
    summary = execution_jitter(scv, q, len(x), {1: (len(x), int(1e6 * x.sum()))}, source="summary")
    assert summary.source == "summary" and summary.summary()["from"] == "summary"
    assert summary.at(0.99) == pytest.approx(traced.at(0.99), rel=0.05)      # the p99 is the summary's own point
    assert summary.at(0.9) == pytest.approx(traced.at(0.9), rel=0.05)
    assert summary.scv == pytest.approx(traced.scv, rel=0.35)   # the lower half's line and the cut tail: roughly


def test_a_jittered_prediction_does_not_jump_between_neighbouring_rates():
    """planner.SIM_REQUESTS_JITTERED: with resnet_tiny's summary jitter (r97: p99 2.05x the mean) one instance's p99
    over 280-344 req/s, on the 1% grid: from 1,000 simulated requests it jumped 48% between neighbours (18.8 ->
    27.8 ms) and a scale-up was taken on such a jump; from 4,000 at most 21%."""
    import controller.planner as planner
    scv, q = summary_quantiles(((0.5, 0.94), (0.9, 1.32), (0.95, 1.46), (0.99, 2.05), (0.999, 2.9)), 1.0)
    j = execution_jitter(scv, q, 10_000, {1: (100, 100)}, source="summary")
    line = lambda b: 2.245 + 1.29 * b              # noqa: E731  resnet_tiny's measured curve, one instance (r97)
    p99s = [simulate_quantised(r, 1, 1000, 32, line, j).p99_ms for r in range(280, 345, 3)]
    assert max(abs(a - b) / min(a, b) for a, b in zip(p99s, p99s[1:])) < 0.3
    assert max(p99s) / float(np.median(p99s)) < 1.4
    assert planner.SIM_REQUESTS_JITTERED > planner.SIM_REQUESTS


def _untraced(o: ModelObserver, seconds, points_us, live: Settings = LIVE, before: int = 1000):
    """`_feed`'s model untraced: 10 requests a second, 8 ms each on average, the compute summary's quantiles as
    given and a request summary's p99 (the quiet minute needs one); the last observation."""
    import dataclasses
    obs = None
    for t in seconds:
        c = dataclasses.replace(_counters(t), p99_us=20_000.0, compute_quantiles_us=points_us)
        o.add_scrape(float(t), c, _stats(t, before), live)
        obs = o.observe(float(t), live, max_batch_size=8)
    return obs


SUMMARY_US = tuple((p, 800.0 * v) for p, v in DOC_POINTS)      # the example's shape over an 8-ms mean


def test_untraced_the_observer_reads_the_jitter_from_the_compute_summary_over_a_quiet_minute():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    assert _untraced(o, range(0, 60), SUMMARY_US).jitter is None        # not yet a minute: the summary is not read
    obs = _untraced(o, range(60, 63), SUMMARY_US)
    assert obs.p99_source == "mean_x_tail_ratio" and obs.jitter.source == "summary"
    assert obs.jitter.scv == pytest.approx(0.09, abs=0.005)             # one size: all of it is jitter
    assert obs.jitter.at(0.99) == pytest.approx(2.0, rel=0.01)
    assert dict(o.plan_inputs(8, 2.0).jitters)[LIVE] is obs.jitter
    # the live configuration's prediction carries it: above the same observer's without a summary
    bare = ModelObserver("m", window_s=10.0, settle_s=0.0)
    plain = _untraced(bare, range(0, 63), ())
    assert plain.jitter is None and obs.predicted_p99_ms > plain.predicted_p99_ms
    # a change: nothing of its own for the new configuration until it has held a minute ...
    other = Settings(2, 0)
    o.mark_change(62.0)
    bare.mark_change(62.0)
    first = _untraced(o, range(63, 81), SUMMARY_US, live=other)
    exact = _untraced(bare, range(63, 81), (), live=other)
    assert first.jitter is None and exact.jitter is None
    # ... but its window is predicted as the planner simulates it, with the nearest count's (one instance's) jitter
    assert o._nearest_jitter(other) is o.jitter(LIVE) and bare._nearest_jitter(other) is None
    assert first.predicted_p99_ms > exact.predicted_p99_ms
    model = ServiceModel.build(o.plan_inputs(8, 2.0).fits, None, o.plan_inputs(8, 2.0).jitters)
    assert model.jitter(2) is o.jitter(LIVE)
    assert _untraced(o, range(81, 122), SUMMARY_US, live=other).jitter is None
    assert _untraced(o, range(122, 124), SUMMARY_US, live=other).jitter.source == "summary"
    assert o._nearest_jitter(other) is o.jitter(LIVE)      # what the live one would borrow, were it without its own


def test_traced_the_summary_is_not_read():
    o = ModelObserver("m", window_s=10.0, settle_s=0.0)
    obs = None
    for t in range(0, 70):                                 # traced requests, and a summary beside them
        import dataclasses
        o.add_scrape(float(t), dataclasses.replace(_counters(t), p99_us=20_000.0, compute_quantiles_us=SUMMARY_US),
                     _stats(t, 1000), LIVE)
        o.add_traces([TraceSample("m", t - 1 + k / 10, 9.0, 9.0, 0.5, 8.0) for k in range(10)], read_at=float(t))
        obs = o.observe(float(t), LIVE, max_batch_size=8)
    assert obs.p99_source == "trace" and obs.jitter.source == "trace" and obs.jitter.scv == pytest.approx(0.0, abs=1e-9)


# ---- scripts/jitter_check.py ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["--rates", "10,x"], "--rates"), (["--rates", "0"], "> 0"), (["--instances", "0"], ">= 1"),
    (["--seconds", "0"], "> 0"),
])
def test_jitter_check_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        load_script("jitter_check").main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slow
def test_jitter_check_compares_a_window(tmp_path):
    import json
    out = tmp_path / "rows.json"
    rc = load_script("jitter_check").main(["--model", "sim_accel", "--rates", "60", "--seconds", "3", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert rc == 0 and len(rows) == 1, rows
    r = rows[0]
    assert r["rate_rps"] == 60 and r["traced"] >= 100 and r["traced_p99_ms"] > 0
    assert r["exact_p99_ms"] > 0 and r["jitter_p99_ms"] > 0 and r["jitter_scv"] >= 0
    # sim_accel's executions are sleeps: under the floor the two predictions are one simulation
    assert r["jitter_scv"] >= JITTER_FLOOR or r["jitter_p99_ms"] == r["exact_p99_ms"]
    # and from the compute summary, as the controller reads it untraced (the same server's, the same window's counters)
    assert r["summary_scv"] is not None and r["summary_scv"] >= 0 and r["summary_p99_ms"] > 0
    assert r["summary_scv"] >= JITTER_FLOOR or r["summary_p99_ms"] == r["exact_p99_ms"]
