"""Signals: parsers (real captured text, edge cases, fuzz), window arithmetic, resets, scraper."""
from __future__ import annotations

import dataclasses

import http.server
import json
import logging
import math
import threading
import time
import urllib.request
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.signals import (
    REQUIRED_FIELDS,
    BatchStat,
    ModelCounters,
    ModelWindow,
    Scraper,
    StatsCounters,
    busy_fraction,
    parse_metrics,
    parse_stats,
)

DATA = Path(__file__).parent / "data"
METRICS_SAMPLE = (DATA / "metrics_sample.txt").read_text()
STATS_SAMPLE = json.loads((DATA / "stats_sample.json").read_text())


# =====================================================================================
# parse_metrics
# =====================================================================================

def test_parse_real_triton_metrics_sample():
    # Captured from tritonserver 2.51 after 5 requests of batch sizes 1, 2, 4, 1, 3.
    counters = parse_metrics(METRICS_SAMPLE)
    assert set(counters) == {"resnet_tiny"}
    c = counters["resnet_tiny"]
    assert (c.success, c.failure, c.inference_count, c.exec_count) == (5, 0, 11, 5)
    assert (c.queue_us, c.compute_input_us, c.compute_infer_us, c.compute_output_us) == (605, 563, 136980, 543)
    assert c.request_us == 138727
    assert c.pending == 0
    assert c.p99_us == 14484
    assert c.custom == {
        "model_executions_total": 5,
        "model_executed_items_total": 5,
        "model_execution_us_total": pytest.approx(125457.142),
        "model_last_batch_size": 1,
    }


def test_the_compute_summarys_quantiles_are_read_per_model():
    # the real capture: 5 requests, the compute (infer) summary's quantiles in us
    c = parse_metrics(METRICS_SAMPLE)["resnet_tiny"]
    assert c.compute_quantiles_us == ((0.5, 10059.0), (0.9, 14071.0), (0.95, 14071.0), (0.99, 14071.0), (0.999, 14071.0))
    # Nan before any request: that quantile left out; several versions: the larger per quantile; none: ()
    text = METRICS_SAMPLE.replace('quantile="0.9"} 14071', 'quantile="0.9"} Nan') + \
        'nv_inference_compute_infer_summary_us{model="resnet_tiny",version="2",quantile="0.5"} 12000\n'
    assert parse_metrics(text)["resnet_tiny"].compute_quantiles_us[:2] == ((0.5, 12000.0), (0.95, 14071.0))
    plain = "\n".join(ln for ln in METRICS_SAMPLE.splitlines() if "summary" not in ln) + "\n"
    assert parse_metrics(plain)["resnet_tiny"].compute_quantiles_us == ()


def test_whether_the_server_publishes_summaries_at_all():
    # the real capture (summary_latencies=true): published; Nan before a request still is; without the flag: not
    assert parse_metrics(METRICS_SAMPLE)["resnet_tiny"].summaries
    nan = "\n".join(ln.replace(ln.rsplit(" ", 1)[-1], "Nan") if ln.startswith("nv_inference_request_summary_us{") else ln
                    for ln in METRICS_SAMPLE.splitlines()) + "\n"
    assert parse_metrics(nan)["resnet_tiny"].p99_us is None and parse_metrics(nan)["resnet_tiny"].summaries
    plain = "\n".join(ln for ln in METRICS_SAMPLE.splitlines() if "summary" not in ln) + "\n"
    assert not parse_metrics(plain)["resnet_tiny"].summaries
    # another model's summary says nothing of this one
    other = plain + 'nv_inference_request_summary_us_count{model="b",version="1"} 3\n'
    assert not parse_metrics(other)["resnet_tiny"].summaries


def test_summary_nan_before_first_request_is_none():
    text = METRICS_SAMPLE.replace('quantile="0.99"} 14484', 'quantile="0.99"} Nan')
    assert 'quantile="0.99"} Nan' in text
    assert parse_metrics(text)["resnet_tiny"].p99_us is None


def test_without_summary_latencies_p99_is_none():
    text = "\n".join(ln for ln in METRICS_SAMPLE.splitlines() if "summary" not in ln) + "\n"
    c = parse_metrics(text)["resnet_tiny"]
    assert c.p99_us is None and c.success == 5


SYNTHETIC = """\
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="a",version="1"} 10
nv_inference_request_success{model="a",version="2"} 5
nv_inference_request_success{model="b",version="1"} 7
nv_inference_request_success{model="c",version="1"} 7
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="a",reason="OTHER",version="1"} 0
nv_inference_request_failure{model="a",reason="BACKEND",version="1"} 2
nv_inference_request_failure{model="a",reason="REJECTED",version="2"} 1
nv_inference_request_failure{model="b",reason="OTHER",version="1"} NaN
nv_inference_request_failure{model="c",version="1"} 4
# TYPE nv_inference_count counter
nv_inference_count{model="a",version="1"} +Inf
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="a",version="1"} 3
nv_inference_pending_request_count{model="a",version="2"} 1
# TYPE nv_inference_request_summary_us summary
nv_inference_request_summary_us{model="a",version="1",quantile="0.5"} 100
nv_inference_request_summary_us{model="a",version="1",quantile="0.99"} 900
nv_inference_request_summary_us{model="a",version="2",quantile="0.99"} 1200
nv_inference_request_summary_us_count{model="a",version="1"} 10
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-1"} 0.5
# TYPE sim_device_memory_bytes gauge
sim_device_memory_bytes{model="a",instance="a_0_0"} 1000
sim_device_memory_bytes{model="a",instance="a_0_1"} 2500
sim_device_memory_bytes{instance="orphan"} 99
# TYPE model_executions counter
model_executions_total{model="a",instance="a_0_0"} 4
model_executions_total{model="a",instance="a_0_1"} 6
# TYPE model_latency_seconds summary
model_latency_seconds{model="a",quantile="0.5"} 0.1
"""


@pytest.mark.parametrize(
    "model, field_name, expected",
    [
        pytest.param("a", "success", 15.0, id="success-summed-over-versions"),
        pytest.param("a", "failure", 3.0, id="failure-summed-over-reasons-and-versions"),
        pytest.param("b", "failure", None, id="nan-counter-is-none"),
        pytest.param("a", "failure_shed", 1.0, id="rejected-failures-are-shed"),
        pytest.param("b", "failure_shed", None, id="shed-unknown-when-failures-are"),
        pytest.param("c", "failure_shed", 0.0, id="no-reason-labels-nothing-shed"),
        pytest.param("a", "inference_count", None, id="inf-counter-is-none"),
        pytest.param("a", "exec_count", None, id="absent-counter-is-none"),
        pytest.param("a", "pending", 4.0, id="pending-gauge-summed"),
        pytest.param("b", "pending", None, id="absent-gauge-is-none"),
        pytest.param("a", "p99_us", 1200.0, id="p99-is-worst-version-not-sum"),
        pytest.param("b", "p99_us", None, id="no-summary-is-none"),
    ],
)
def test_parse_synthetic_fields(model, field_name, expected):
    assert getattr(parse_metrics(SYNTHETIC)[model], field_name) == expected


def test_parse_custom_metrics_summed_over_instances_only_for_the_model():
    parsed = parse_metrics(SYNTHETIC)
    assert set(parsed) == {"a", "b", "c"}  # nv_gpu_utilization and the orphan carry no model label
    assert parsed["a"].custom == {"sim_device_memory_bytes": 3500.0, "model_executions_total": 10.0}
    assert parsed["b"].custom == {}


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("garbage", id="word"),
        pytest.param("{}", id="braces"),
        pytest.param('nv_inference_request_success{model="a" 1', id="unclosed-labels"),
        pytest.param(METRICS_SAMPLE + "\nthis is not prometheus\n", id="valid-then-garbage"),
        pytest.param(None, id="not-a-string"),
        pytest.param(b"nv_inference_count{model=\"a\"} 1", id="bytes"),
    ],
)
def test_garbage_metrics_text_is_no_data(text):
    assert parse_metrics(text) == {}


def _all_fields_finite_or_none(counters: ModelCounters) -> bool:
    if not isinstance(counters.summaries, bool):
        return False
    numbers = [getattr(counters, f.name) for f in fields(counters)
               if f.name not in ("custom", "compute_quantiles_us", "summaries")]
    numbers += list(counters.custom.values())
    numbers += [n for pair in counters.compute_quantiles_us for n in pair]
    return all(n is None or (isinstance(n, float) and math.isfinite(n)) for n in numbers)


_metric_line = st.builds(
    lambda name, model, extra, value: f'{name}{{model="{model}"{extra}}} {value}',
    st.sampled_from(["nv_inference_request_success", "nv_inference_count", "nv_inference_request_summary_us",
                     "nv_inference_compute_infer_summary_us", "nv_inference_pending_request_count",
                     "model_executions_total", "x", "nv_"]),
    st.text(min_size=0, max_size=5),
    st.sampled_from(["", ',version="1"', ',quantile="0.99"', ',le="1"', ",", ',model="z"']),
    st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str), st.sampled_from(["Nan", "+Inf", "x", ""])),
)
_metric_text = st.lists(
    st.one_of(_metric_line, st.text(max_size=30), st.sampled_from(["# TYPE x counter", "# HELP x y", "# TYPE x_total summary"])),
    max_size=12,
).map("\n".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), _metric_text))
def test_fuzz_parse_metrics_never_raises_and_never_invents_numbers(text):
    parsed = parse_metrics(text)
    assert isinstance(parsed, dict)
    for model, counters in parsed.items():
        assert isinstance(model, str) and model
        assert isinstance(counters, ModelCounters)
        assert _all_fields_finite_or_none(counters)
    if "model" not in text:  # no model label can exist: garbage is no data
        assert parsed == {}


# =====================================================================================
# parse_stats
# =====================================================================================

def test_parse_real_stats_sample():
    stats = parse_stats(STATS_SAMPLE)
    assert set(stats) == {"resnet_tiny"}
    s = stats["resnet_tiny"]
    assert (s.inference_count, s.execution_count) == (11, 5)
    assert (s.success_count, s.success_ns) == (5, 138729309)
    assert (s.fail_count, s.fail_ns) == (0, 0)
    assert (s.queue_count, s.queue_ns) == (5, 607174)
    assert (s.compute_infer_count, s.compute_infer_ns) == (5, 136982896)
    assert {size: b.executions for size, b in s.batch_stats.items()} == {1: 2, 2: 1, 3: 1, 4: 1}
    assert sum(size * b.executions for size, b in s.batch_stats.items()) == s.inference_count  # 2+2+3+4 = 11
    assert sum(b.executions for b in s.batch_stats.values()) == s.execution_count
    assert s.batch_stats[2] == BatchStat(executions=1, compute_input_ns=84626, compute_infer_ns=47653546,
                                         compute_output_ns=134771)
    assert s.batch_stats[1].compute_ns == 274710 + 65198246 + 198987
    # each execution counted once here, where inference_stats charges each request its batch's time
    assert sum(b.compute_infer_ns for b in s.batch_stats.values()) <= s.compute_infer_ns


def test_parse_all_models_stats_answer():
    # Shape of GET /v2/models/stats (tritonserver 2.51): one entry per loaded model, an idle one with no rows.
    idle = {"name": "idle", "version": "1", "last_inference": 0, "inference_count": 0, "execution_count": 0,
            "inference_stats": {k: {"count": 0, "ns": 0} for k in ("success", "fail", "queue", "compute_input",
                                                                   "compute_infer", "compute_output")},
            "batch_stats": [], "memory_usage": []}
    stats = parse_stats({"model_stats": [idle, *STATS_SAMPLE["model_stats"]]})
    assert set(stats) == {"idle", "resnet_tiny"}
    assert stats["idle"].batch_stats == {} and stats["idle"].execution_count == 0
    assert stats["resnet_tiny"] == parse_stats(STATS_SAMPLE)["resnet_tiny"]


def test_parse_stats_accepts_text_and_bytes():
    raw = (DATA / "stats_sample.json").read_text()
    assert parse_stats(raw) == parse_stats(raw.encode()) == parse_stats(STATS_SAMPLE)


def _row(size, count, infer_ns, input_ns=1, output_ns=2) -> dict:
    """A batch_stats row whose input and output times are `input_ns` and `output_ns` per execution."""
    return {"batch_size": size, "compute_input": {"count": count, "ns": input_ns * count},
            "compute_infer": {"count": count, "ns": infer_ns}, "compute_output": {"count": count, "ns": output_ns * count}}


def test_parse_stats_sums_versions_and_marks_unknowns():
    obj = {"model_stats": [
        {"name": "m", "version": "1", "inference_count": 8, "execution_count": 2,
         "inference_stats": {"success": {"count": 5, "ns": 50}, "queue": {"count": 5, "ns": "x"}},
         "batch_stats": [_row(4, 2, 9)]},
        {"name": "m", "version": "2", "inference_count": 4, "execution_count": 1,
         "inference_stats": {"success": {"count": 7, "ns": 70}, "queue": {"count": 7, "ns": 1}},
         "batch_stats": [_row(4, 1, 5), {"batch_size": 8, "compute_infer": {"count": 1}},  # no times: left out
                         {"batch_size": "?"}]},
        {"version": "1", "inference_count": 99},   # no name: skipped
    ]}
    s = parse_stats(obj)["m"]
    assert (s.inference_count, s.execution_count, s.success_count, s.success_ns) == (12, 3, 12, 120)
    assert s.queue_count == 12 and s.queue_ns is None   # one unknown part makes the sum unknown
    assert s.fail_count is None                          # absent section
    assert s.batch_stats == {4: BatchStat(executions=3, compute_input_ns=3, compute_infer_ns=14, compute_output_ns=6)}


@pytest.mark.parametrize(
    "row",
    [
        pytest.param({"batch_size": 2, "compute_infer": {"count": 1, "ns": 10}}, id="no-input-output"),
        pytest.param({**_row(2, 1, 10), "compute_output": {"count": 1, "ns": -5}}, id="negative-ns"),
        pytest.param({**_row(2, 1, 10), "compute_infer": {"count": 1.5e400, "ns": 10}}, id="infinite-count"),
        pytest.param({**_row(2, 1, 10), "compute_input": None}, id="section-not-an-object"),
        pytest.param({**_row(2, 1, 10), "batch_size": -1}, id="negative-size"),
        pytest.param({**_row(2, 1, 10), "batch_size": True}, id="bool-size"),
    ],
)
def test_incomplete_batch_rows_are_left_out(row):
    obj = {"model_stats": [{"name": "m", "batch_stats": [row, _row(1, 3, 30)]}]}
    assert parse_stats(obj)["m"].batch_stats == {1: BatchStat(3, 3, 30, 6)}


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(None, id="none"),
        pytest.param([], id="list"),
        pytest.param("not json", id="bad-text"),
        pytest.param(b"\xff\xfe", id="bad-bytes"),
        pytest.param({"error": "unknown model"}, id="error-body"),
        pytest.param({"model_stats": "x"}, id="stats-not-a-list"),
        pytest.param({"model_stats": [{"name": 5}, 3, None]}, id="entries-without-names"),
    ],
)
def test_garbage_stats_is_no_data(obj):
    assert parse_stats(obj) == {}


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["model_stats", "name", "inference_stats", "success", "count", "ns",
                                         "batch_stats", "batch_size", "compute_infer", "compute_input",
                                         "compute_output", "x"]) | st.text(max_size=5),
                        inner, max_size=5),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json, _json.map(json.dumps), st.text(), st.binary()))
def test_fuzz_parse_stats_never_raises(obj):
    parsed = parse_stats(obj)
    assert isinstance(parsed, dict)
    for name, s in parsed.items():
        assert isinstance(name, str) and name
        assert isinstance(s, StatsCounters)
        numbers = [getattr(s, f.name) for f in fields(s) if f.name != "batch_stats"]
        assert all(n is None or (isinstance(n, int) and n >= 0) for n in numbers)
        for size, b in s.batch_stats.items():
            assert isinstance(size, int) and size >= 0 and isinstance(b, BatchStat)
            assert all(isinstance(getattr(b, f.name), int) and getattr(b, f.name) >= 0 for f in fields(b))
    as_text = obj.decode("utf-8", "replace") if isinstance(obj, bytes) else obj if isinstance(obj, str) else json.dumps(obj)
    if "model_stats" not in as_text:  # garbage is no data
        assert parsed == {}


# =====================================================================================
# ModelWindow arithmetic
# =====================================================================================

def C(success=0.0, failure=0.0, inference_count=0.0, exec_count=0.0, queue_us=0.0, compute_us=0.0,
      request_us=0.0, pending=0.0, p99_us=None, custom=None) -> ModelCounters:
    """Counters with all compute time put in compute_infer_us (the three are summed anyway)."""
    return ModelCounters(success=success, failure=failure, inference_count=inference_count, exec_count=exec_count,
                         queue_us=queue_us, compute_input_us=0.0, compute_infer_us=compute_us,
                         compute_output_us=0.0, request_us=request_us, pending=pending, p99_us=p99_us,
                         custom=custom or {})


def window_of(*samples: tuple[float, ModelCounters | None]) -> ModelWindow:
    w = ModelWindow()
    for t, c in samples:
        w.add(t, c)
    return w


WORKED = (
    (100.0, C(success=1000, inference_count=2000, exec_count=250, pending=2)),
    (110.0, C(success=1500, inference_count=3000, exec_count=375, pending=6, queue_us=1_000_000,
              compute_us=10_000_000, request_us=11_500_000)),
)


@pytest.mark.parametrize(
    "samples, instances, expected",
    [
        pytest.param(
            WORKED, 1,
            dict(span_s=10, since=100, arrival_rps=50.4, completion_rps=50, failure_rps=0, exec_rps=12.5,
                 avg_batch_size=8, items_per_request=2, pending_mean=4, queue_ms_per_request=2,
                 compute_ms_per_request=20, request_ms_mean=23, busy_fraction=0.25),
            id="docstring-worked-example",
        ),
        pytest.param(WORKED, 2, dict(busy_fraction=0.125), id="two-instances-halve-busy"),
        pytest.param(
            ((0.0, C()), (5.0, C(success=90, failure=10, inference_count=100, exec_count=100,
                                 compute_us=100 * 5_000, queue_us=100 * 500, request_us=100 * 6_000))), 1,
            # 100 requests of one item each in 5 s, 5 ms compute each: 0.5 s busy of 5 s.
            dict(arrival_rps=20, completion_rps=18, failure_rps=2, avg_batch_size=1, queue_ms_per_request=0.5,
                 compute_ms_per_request=5, request_ms_mean=6, busy_fraction=0.1),
            id="failures-count-as-requests",
        ),
        pytest.param(
            ((0.0, C(success=40, pending=3)), (4.0, C(success=40, pending=3))), 1,
            dict(arrival_rps=0, completion_rps=0, avg_batch_size=0, items_per_request=1, queue_ms_per_request=0,
                 compute_ms_per_request=0, busy_fraction=0, pending_mean=3, p99_ms=None, p99_source="none"),
            id="idle-window-is-valid-zero-not-nan",
        ),
        pytest.param(
            ((0.0, C()), (5.0, C(success=100, inference_count=50, exec_count=50))), 1,
            dict(items_per_request=1, avg_batch_size=1),
            id="cached-responses-succeed-without-inferences-items-at-least-1",
        ),
        pytest.param(
            ((0.0, C(success=10, pending=8)), (2.0, C(success=30, pending=0))), 1,
            dict(arrival_rps=6, completion_rps=10, pending_mean=4),
            id="draining-queue-arrivals-below-completions",
        ),
    ],
)
def test_window_arithmetic(samples, instances, expected):
    w = window_of(*samples)
    obs = w.observe(now=samples[-1][0], window_s=60, instance_count=instances)
    assert obs.valid
    for name, value in expected.items():
        actual = getattr(obs, name)
        assert actual == (pytest.approx(value) if value is not None else None), name


def test_busy_fraction_docstring_numbers():
    assert busy_fraction(10_000_000, 500, 125, 10.0, 1) == pytest.approx(0.25)
    assert busy_fraction(10_000_000, 500, 125, 10.0, 2) == pytest.approx(0.125)
    assert busy_fraction(0, 0, 0, 10.0, 1) == 0.0


def test_window_is_by_time_not_by_sample_count():
    w = ModelWindow()
    for t in range(0, 101):  # one sample a second, 10 requests a second
        w.add(float(t), C(success=10.0 * t))
    w.add(105.0, C(success=2000))  # in the future of `now`: not used
    obs = w.observe(now=100.0, window_s=10.0, instance_count=1)
    assert (obs.since, obs.span_s) == (90.0, 10.0)
    assert obs.completion_rps == pytest.approx(10.0)
    sparse = window_of((0.0, C()), (30.0, C(success=300)))  # two samples 30 s apart, 10 s window
    assert not sparse.observe(now=30.0, window_s=10.0, instance_count=1).valid


def test_old_samples_are_pruned_and_out_of_order_adds_are_sorted():
    w = ModelWindow(max_age_s=30.0)
    for t in range(100):
        w.add(float(t), C(success=t))
    assert len(w.samples) == 31 and w.samples[0].t == 69.0
    w.add(98.5, C(success=98.5))
    assert [s.t for s in w.samples][-3:] == [98.0, 98.5, 99.0]


# -- resets -------------------------------------------------------------------------------

def test_counter_drop_is_a_reset_and_earlier_samples_are_discarded():
    w = window_of(
        (0.0, C(success=1000, request_us=1000 * 5_000)),
        (5.0, C(success=1500, request_us=1500 * 5_000)),
        (10.0, C(success=10, request_us=10 * 50_000)),    # server restarted: counters from zero
        (12.0, C(success=60, request_us=60 * 50_000)),
    )
    obs = w.observe(now=12.0, window_s=60.0, instance_count=1)
    assert obs.valid
    assert obs.since == 10.0 and obs.span_s == 2.0          # only the reset sample and after
    assert obs.completion_rps == pytest.approx(25.0)        # (60 - 10) / 2, not (60 - 1000) / 12
    assert obs.arrival_rps >= 0 and obs.request_ms_mean == pytest.approx(50.0)
    assert obs.p99_ms == pytest.approx(50.0)                # pre-reset 5 ms intervals are gone


def test_reset_of_any_cumulative_counter_counts():
    w = window_of((0.0, C(success=100, exec_count=50)), (5.0, C(success=150, exec_count=10)), (10.0, C(success=200, exec_count=30)))
    obs = w.observe(now=10.0, window_s=60.0, instance_count=1)
    assert obs.since == 5.0 and obs.exec_rps == pytest.approx(4.0)


def test_reset_with_one_sample_after_is_invalid():
    w = window_of((0.0, C(success=1000)), (5.0, C(success=1500)), (10.0, C(success=3)))
    obs = w.observe(now=10.0, window_s=60.0, instance_count=1)
    assert not obs.valid and obs.invalid_reason == "too_few_samples"


def test_pending_drop_is_not_a_reset():
    w = window_of((0.0, C(success=0, pending=9)), (5.0, C(success=50, pending=1)))
    obs = w.observe(now=5.0, window_s=60.0, instance_count=1)
    assert obs.since == 0.0 and obs.arrival_rps == pytest.approx((50 - 8) / 5)


# -- no data ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "samples, now, reason",
    [
        pytest.param((), 10.0, "no_samples", id="empty"),
        pytest.param(((0.0, C()),), 10.0, "too_few_samples", id="one-sample"),
        pytest.param(((0.0, C()), (0.5, C(success=5))), 0.5, "span_too_short", id="span-under-1s"),
        pytest.param(((0.0, C()), (5.0, C(success=5)), (10.0, None)), 10.0, "scrape_failed", id="newest-scrape-failed"),
        pytest.param(((0.0, C()), (5.0, C(success=5)), (10.0, replace(C(success=9), pending=None))), 10.0,
                     "scrape_failed", id="newest-missing-a-counter"),
        pytest.param(((0.0, None), (5.0, None)), 5.0, "scrape_failed", id="all-failed"),
        pytest.param(((0.0, C()), (5.0, C(success=5))), 100.0, "no_samples", id="all-stale"),
    ],
)
def test_not_enough_data_is_invalid(samples, now, reason):
    obs = window_of(*samples).observe(now=now, window_s=30.0, instance_count=1)
    assert not obs.valid
    assert obs.invalid_reason == reason


def test_failed_scrape_in_the_middle_is_skipped():
    w = window_of((0.0, C()), (5.0, None), (10.0, C(success=100)))
    obs = w.observe(now=10.0, window_s=60.0, instance_count=1)
    assert obs.valid and obs.span_s == 10.0 and obs.completion_rps == pytest.approx(10.0)


@pytest.mark.parametrize("missing", REQUIRED_FIELDS)
def test_a_sample_missing_any_required_counter_is_not_used(missing):
    w = window_of((0.0, C()), (5.0, replace(C(success=999, exec_count=999), **{missing: None})), (10.0, C(success=100, exec_count=20)))
    obs = w.observe(now=10.0, window_s=60.0, instance_count=1)
    assert obs.valid and obs.completion_rps == pytest.approx(10.0) and obs.exec_rps == pytest.approx(2.0)


# -- p99 -----------------------------------------------------------------------------------------

def test_p99_uses_the_server_summary_only_over_a_window_as_long_as_its_own():
    w = window_of((0.0, C(p99_us=90_000)), (60.0, C(success=10, request_us=100_000, p99_us=12_000)))
    obs = w.observe(now=60.0, window_s=60.0, instance_count=1)
    assert (obs.p99_ms, obs.p99_source) == (pytest.approx(12.0), "summary")


def test_p99_ignores_a_summary_older_than_the_window():
    """A 5-s window: the summary still holds the last minute, so the fresh interval mean is used."""
    w = window_of((0.0, C(p99_us=90_000)), (5.0, C(success=10, request_us=100_000, p99_us=33_000)))
    obs = w.observe(now=5.0, window_s=60.0, instance_count=1)
    assert (obs.p99_ms, obs.p99_source) == (pytest.approx(10.0), "interval_mean_max")


def test_p99_is_none_without_requests_even_if_the_summary_has_a_value():
    w = window_of((0.0, C(p99_us=33_000)), (70.0, C(p99_us=33_000)))
    obs = w.observe(now=70.0, window_s=80.0, instance_count=1)
    assert (obs.p99_ms, obs.p99_source) == (None, "none")


def test_p99_falls_back_to_worst_interval_mean():
    w = window_of(
        (0.0, C()),
        (1.0, C(success=10, request_us=10 * 4_000)),                     # 4 ms mean
        (2.0, C(success=12, failure=2, request_us=10 * 4_000 + 4 * 30_000)),  # 4 requests at 30 ms mean
        (3.0, C(success=12, failure=2, request_us=10 * 4_000 + 4 * 30_000)),  # idle interval: skipped
    )
    obs = w.observe(now=3.0, window_s=60.0, instance_count=1)
    assert (obs.p99_ms, obs.p99_source) == (pytest.approx(30.0), "interval_mean_max")


# =====================================================================================
# Scraper
# =====================================================================================

class _Handler(http.server.BaseHTTPRequestHandler):
    seen_headers: list[dict] = []

    def do_GET(self):  # noqa: N802
        _Handler.seen_headers.append({k.lower(): v for k, v in self.headers.items()})
        if self.path == "/metrics":
            body, code = METRICS_SAMPLE.encode(), 200
        elif self.path in ("/v2/models/resnet_tiny/stats", "/v2/models/stats"):
            body, code = json.dumps(STATS_SAMPLE).encode(), 200
        else:
            body, code = b'{"error":"unknown model"}', 400
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_scraper_reads_both_endpoints_and_sends_headers(fake_server):
    scraper = Scraper(f"http://{fake_server}/metrics", fake_server, headers={"admin-key": "s3cret"})
    metrics = scraper.metrics()
    assert metrics is not None and metrics["resnet_tiny"].success == 5
    stats = scraper.stats("resnet_tiny")
    assert stats is not None and {size: b.executions for size, b in stats.batch_stats.items()} == {1: 2, 2: 1, 3: 1, 4: 1}
    every = scraper.all_stats()
    assert every is not None and every == {"resnet_tiny": stats}
    assert all(h.get("admin-key") == "s3cret" for h in _Handler.seen_headers[-3:])


def test_scraper_http_error_is_none(fake_server, caplog):
    caplog.set_level(logging.DEBUG, logger="controller.signals")
    assert Scraper(f"http://{fake_server}/metrics", fake_server).stats("nope") is None
    assert any("400" in r.getMessage() for r in caplog.records)


def test_scraper_network_errors_are_none_and_logged_once_per_streak(fake_server, caplog):
    caplog.set_level(logging.DEBUG, logger="controller.signals")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again below: nothing listens there
    scraper = Scraper(f"http://127.0.0.1:{dead_port}/metrics", f"127.0.0.1:{dead_port}", timeout_s=0.5)
    assert [scraper.all_stats() for _ in range(2)] == [None, None]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    caplog.clear()
    assert [scraper.metrics() for _ in range(3)] == [None, None, None]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(dead_port) in warnings[0].getMessage()

    scraper.metrics_url = f"http://{fake_server}/metrics"   # the server "comes back"
    assert scraper.metrics() is not None
    assert [r.levelno for r in caplog.records].count(logging.INFO) == 1
    scraper.metrics_url = f"http://127.0.0.1:{dead_port}/metrics"
    assert scraper.metrics() is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


# =====================================================================================
# Live tritonserver
# =====================================================================================

@pytest.fixture(scope="module")
def live_server():
    from controller.server import ServerOptions, TritonServer, free_port
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=["resnet_tiny"])
    with TritonServer(options) as server:
        yield server


def _infer(http_url: str, batch: int) -> None:
    body = {"inputs": [{"name": "INPUT", "shape": [batch, 3, 32, 32], "datatype": "FP32",
                        "data": [0.5] * (batch * 3 * 32 * 32)}]}
    request = urllib.request.Request(f"http://{http_url}/v2/models/resnet_tiny/infer", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert json.loads(response.read())["outputs"][0]["shape"] == [batch, 10]


def test_live_server_counters_rise_after_inferences(live_server):
    scraper = Scraper(live_server.metrics_url, live_server.http_url)
    window = ModelWindow()
    before = scraper.metrics()
    stats_before = scraper.stats("resnet_tiny")
    assert before is not None and stats_before is not None
    window.add(time.monotonic(), before["resnet_tiny"])
    started = time.monotonic()
    for batch in (1, 2, 3):
        _infer(live_server.http_url, batch)
    time.sleep(max(0.0, 1.1 - (time.monotonic() - started)))  # a window needs >= 1 s of span
    after = scraper.metrics()
    assert after is not None
    window.add(time.monotonic(), after["resnet_tiny"])

    b, a = before["resnet_tiny"], after["resnet_tiny"]
    assert a.success - b.success == 3
    assert a.inference_count - b.inference_count == 6
    assert a.exec_count - b.exec_count == 3
    assert a.compute_infer_us > b.compute_infer_us
    assert a.p99_us is not None and a.p99_us > 0        # ServerOptions enables summary latencies
    assert a.custom["model_executions_total"] - b.custom["model_executions_total"] == 3
    stats_after = scraper.stats("resnet_tiny")
    assert stats_after.success_count - stats_before.success_count == 3
    for size in (1, 2, 3):   # one execution of each size, its compute time counted once
        was = stats_before.batch_stats.get(size, BatchStat(0, 0, 0, 0))
        now = stats_after.batch_stats[size]
        assert now.executions - was.executions == 1 and now.compute_ns > was.compute_ns
    assert scraper.all_stats()["resnet_tiny"].execution_count == stats_after.execution_count

    obs = window.observe(now=time.monotonic(), window_s=60.0, instance_count=1)
    assert obs.valid and obs.completion_rps > 0 and obs.avg_batch_size == pytest.approx(2.0)
    assert obs.p99_source == "interval_mean_max" and obs.p99_ms > 0 and obs.compute_ms_per_request > 0  # a short window: not the 60-s summary


def test_shed_failures_are_counted_apart_from_faults():
    # 5 s: 90 ok, 10 failed, of which 6 refused by the scheduler's queue policy (REJECTED) and 4 in the model
    a = dataclasses.replace(C(), failure_shed=0.0)
    b = dataclasses.replace(C(success=90, failure=10, inference_count=90, exec_count=90, compute_us=90 * 5_000,
                              request_us=90 * 6_000), failure_shed=6.0)
    o = window_of((0.0, a), (5.0, b)).observe(5.0, 20.0, 1)
    assert o.failure_rps == pytest.approx(2.0) and o.shed_rps == pytest.approx(1.2) and o.fault_rps == pytest.approx(0.8)
    unknown = window_of((0.0, C()), (5.0, dataclasses.replace(b, failure_shed=None))).observe(5.0, 20.0, 1)
    assert unknown.shed_rps == 0.0 and unknown.fault_rps == pytest.approx(2.0)   # no reasons: every failure a fault
