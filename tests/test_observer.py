"""controller/observer.py pieces the planner reads: the arrival-rate forecast fed each tick, and the device
utilisation averaged over the observation's span (the rates it is divided by cover the span)."""
from __future__ import annotations

from controller.observer import ModelObserver
from controller.signals import ModelCounters
from controller.types import GpuObservation, Settings

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
