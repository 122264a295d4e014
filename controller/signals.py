"""Signals: turn Triton's counters into timestamped samples and windowed observations.

Three layers, each usable alone:

* parsers (pure): `parse_metrics` reads the Prometheus text of `/metrics`, `parse_stats`
  reads the JSON of `/v2/models/<m>/stats` (or of `/v2/models/stats`, every model at once).
  Garbage in gives `{}`, never an exception; a missing, NaN or infinite number gives `None`
  ("no data"), never 0.
* `ModelWindow` (pure, one per managed model): a time-ordered list of
  `(t, ModelCounters | None)` samples and the arithmetic that turns the samples of one
  sliding window into an `Observation` (rates, per-request times, busy fraction, p99).
* `Scraper` (I/O): fetches both endpoints with urllib; a network error gives `None`
  and one log line per failure streak, never an exception.

Times are seconds on the caller's clock (monotonic in the controller); nothing here reads
a clock, so every piece can be driven by a fake clock in tests.
"""
from __future__ import annotations

import bisect
import http.client
import json
import logging
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from controller.types import Observation

log = logging.getLogger("controller.signals")

# ---------------------------------------------------------------------------------
# Parsed counters
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCounters:
    """One model's server counters at one scrape of `/metrics` (summed over versions).

    Cumulative counters (they only grow until a model unload or server restart):
    `success`, `failure` (requests), `inference_count` (items, a request of batch 4
    counts 4), `exec_count` (model executions = batches), and the duration counters in
    microseconds. `pending` is a gauge. `p99_us` is the server's own 0.99 quantile of
    request time, present only with `--metrics-config summary_latencies=true` and after a
    first request. Every field is `None` when the server did not publish a finite value.

    `failure_shed` is the part of `failure` whose `reason` label is REJECTED or CANCELED (Triton >= 2.4x
    labels each failure: REJECTED, CANCELED, BACKEND, OTHER): requests that timed out in the queue (a queue
    policy's `default_timeout_microseconds`) or were cancelled. They are load, not a fault. (Measured on 2.51:
    requests refused for a full queue, `max_queue_size`, are not counted in any failure series.) 0.0 when the
    server labels no reason (older servers: every failure then counts as a fault).

    `custom` holds the model's own metrics (any family not starting with `nv_` that
    carries the label `model=<name>`), keyed by sample name (e.g.
    `model_executions_total`), summed over their other labels (instances). The parser
    names every counter sample `<family>_total`, so a `_total` key is a counter and any
    other key a gauge. Quantile and bucket samples are left out (they do not add).
    """

    success: float | None = None
    failure: float | None = None
    failure_shed: float | None = None
    inference_count: float | None = None
    exec_count: float | None = None
    queue_us: float | None = None
    compute_input_us: float | None = None
    compute_infer_us: float | None = None
    compute_output_us: float | None = None
    request_us: float | None = None
    pending: float | None = None
    p99_us: float | None = None
    custom: dict[str, float] = field(default_factory=dict)
    # the server's quantiles of the compute (infer) time charged to each request over about the last minute,
    # ((quantile, us), ...) by quantile: `nv_inference_compute_infer_summary_us` (summary_latencies=true)
    compute_quantiles_us: tuple[tuple[float, float], ...] = ()
    # whether the server publishes latency summaries for this model at all (`nv_inference_request_summary_us`, `Nan`
    # included): False on a server started without `--metrics-config summary_latencies=true` (Triton's default)
    summaries: bool = False


# Triton sample name -> ModelCounters field (summed over every label but `model`).
_NV_SUMMED_FIELDS: dict[str, str] = {
    "nv_inference_request_success": "success",
    "nv_inference_request_failure": "failure",
    "nv_inference_count": "inference_count",
    "nv_inference_exec_count": "exec_count",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_input_duration_us": "compute_input_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    "nv_inference_compute_output_duration_us": "compute_output_us",
    "nv_inference_request_duration_us": "request_us",
    "nv_inference_pending_request_count": "pending",
}
# `reason` labels of nv_inference_request_failure that mean load shed, not a fault (measured on 2.51: a
# crashed instance's failures are BACKEND; a malformed request is refused before it is counted at all)
SHED_REASONS = frozenset({"REJECTED", "CANCELED"})
_P99_SAMPLE = "nv_inference_request_summary_us"
_P99_QUANTILE = 0.99
_COMPUTE_SUMMARY = "nv_inference_compute_infer_summary_us"
# what a server without latency summaries costs (the controller's warning and `status`: loop._note_summaries)
SUMMARIES_OFF = ("where requests are not traced the p99 is estimated as the mean latency x 2.0, a default, not a "
                 "measurement, and the planner cannot check its tail or how much executions vary; add "
                 "--metrics-config summary_latencies=true to tritonserver's command line")

# Fields that must all be known for a sample to enter window arithmetic.
REQUIRED_FIELDS: tuple[str, ...] = tuple(_NV_SUMMED_FIELDS.values())
# Cumulative ones: a decrease of any of them between two samples is a reset.
CUMULATIVE_FIELDS: tuple[str, ...] = tuple(f for f in REQUIRED_FIELDS if f != "pending")
# Labels that split a metric into quantiles or buckets: summing over them is meaningless.
_DISTRIBUTION_LABELS = frozenset({"quantile", "le"})


def _finite(value: Any) -> float | None:
    """`value` as a float if it is a finite real number, else None (bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class _Accumulator:
    """Sums per (model, key); one non-finite addend poisons the key to None."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, float | None]] = {}

    def add(self, model: str, key: str, value: float) -> None:
        per_model = self.sums.setdefault(model, {})
        number = _finite(value)
        if number is None or (key in per_model and per_model[key] is None):
            per_model[key] = None  # why: a sum with one unknown part is unknown
            return
        per_model[key] = per_model.get(key, 0.0) + number


def _is_p99(name: str, labels: Mapping[str, str]) -> bool:
    if name != _P99_SAMPLE or "quantile" not in labels:
        return False
    try:
        return float(labels["quantile"]) == _P99_QUANTILE
    except ValueError:
        return False


def parse_metrics(text: str) -> dict[str, ModelCounters]:
    """Parse Triton's Prometheus text into `{model: ModelCounters}`.

    Example: `nv_inference_request_failure` carries one series per `reason` (and per
    `version`); the four series 0 + 2 + 0 + 1 give `failure=3.0`. A model whose
    `nv_inference_request_summary_us{quantile="0.99"}` is `Nan` (no request yet) gets
    `p99_us=None`; with several versions the largest p99 is kept (quantiles do not add).
    Text that the Prometheus parser rejects gives `{}` (no data), never an exception.
    """
    if not isinstance(text, str):
        return {}
    nv = _Accumulator()
    custom = _Accumulator()
    p99: dict[str, float | None] = {}
    compute: dict[str, dict[float, float]] = {}
    summarised: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(_P99_SAMPLE) and sample.labels.get("model"):
                    summarised.add(sample.labels["model"])      # its quantiles, _count or _sum: published
                if sample.name == _COMPUTE_SUMMARY:
                    _add_compute_quantile(sample.labels, sample.value, compute)
                else:
                    _route_sample(sample.name, sample.labels, sample.value, nv, custom, p99)
    except Exception:  # noqa: BLE001  why: the parser raises assorted errors on garbage
        return {}
    models = set(nv.sums) | set(custom.sums) | set(p99)
    return {m: _build_counters(nv.sums.get(m, {}), custom.sums.get(m, {}), p99.get(m),
                               tuple(sorted(compute.get(m, {}).items())), m in summarised) for m in models}


def _add_compute_quantile(labels: Mapping[str, str], value: float, compute: dict[str, dict[float, float]]) -> None:
    """One quantile of a model's compute summary (`Nan` before any request: left out); with several versions the
    largest value per quantile, as for the p99."""
    model, number = labels.get("model"), _finite(value)
    try:
        q = float(labels.get("quantile", ""))
    except ValueError:
        return
    if not model or number is None or not 0.0 < q < 1.0:
        return
    per_model = compute.setdefault(model, {})
    per_model[q] = max(number, per_model.get(q, number))


def _route_sample(
    name: str, labels: Mapping[str, str], value: float,
    nv: _Accumulator, custom: _Accumulator, p99: dict[str, float | None],
) -> None:
    model = labels.get("model")
    if not model:
        return
    # why: prometheus_client 0.2x names counter samples `<family>_total` even where Triton
    # wrote `nv_inference_request_success`; older parsers keep the name as written.
    base = name[: -len("_total")] if name.endswith("_total") else name
    if base in _NV_SUMMED_FIELDS:
        nv.add(model, _NV_SUMMED_FIELDS[base], value)
        if base == "nv_inference_request_failure" and labels.get("reason") in SHED_REASONS:
            nv.add(model, "failure_shed", value)
    elif _is_p99(name, labels):
        number = _finite(value)
        previous = p99.get(model)
        # why: quantiles of several versions do not add; the worst one is the honest bound
        p99[model] = number if previous is None else (previous if number is None else max(previous, number))
    elif not name.startswith("nv_") and not (_DISTRIBUTION_LABELS & labels.keys()):
        custom.add(model, name, value)


def _build_counters(nv: dict[str, float | None], custom: dict[str, float | None], p99: float | None,
                    compute: tuple[tuple[float, float], ...] = (), summaries: bool = False) -> ModelCounters:
    known_custom = {k: v for k, v in custom.items() if v is not None}
    shed = nv.get("failure_shed", 0.0 if nv.get("failure") is not None else None)
    return ModelCounters(**{f: nv.get(f) for f in REQUIRED_FIELDS}, failure_shed=shed, p99_us=p99, custom=known_custom,
                         compute_quantiles_us=compute, summaries=summaries)


# ---------------------------------------------------------------------------------
# /v2/models/<m>/stats
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchStat:
    """Cumulative compute statistics of the executions of one batch size (one `batch_stats` row).

    Unlike `inference_stats`, which charges every request of a batch the whole batch's time,
    these count each execution once: `executions` is the row's compute_infer count and the
    `*_ns` fields are the total nanoseconds of those executions. Example: the row
    `{batch_size: 2, compute_input: {count: 85, ns: 4350377}, compute_infer: {count: 85,
    ns: 831398426}, compute_output: {count: 85, ns: 14632309}}` (sim_accel, Triton 2.51) gives
    `BatchStat(85, 4350377, 831398426, 14632309)`: (4.35 + 831.40 + 14.63) ms / 85 = 10.0 ms
    per execution of 2 items.
    """

    executions: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int

    @property
    def compute_ns(self) -> int:
        """input + infer + output: the whole compute time of these executions."""
        return self.compute_input_ns + self.compute_infer_ns + self.compute_output_ns

    def __add__(self, other: "BatchStat") -> "BatchStat":
        """Field-wise sum (two versions of a model, or two rows of one size)."""
        return BatchStat(self.executions + other.executions,
                         self.compute_input_ns + other.compute_input_ns,
                         self.compute_infer_ns + other.compute_infer_ns,
                         self.compute_output_ns + other.compute_output_ns)


@dataclass(frozen=True)
class StatsCounters:
    """One model's cumulative statistics from `/v2/models/<m>/stats` (summed over versions).

    Counts are requests (`*_count`) and times are nanoseconds (`*_ns`), as Triton reports
    them; `inference_count` counts items and `execution_count` batches. `batch_stats`
    maps a batch size to the `BatchStat` of the executions of that size; a size with no row
    has had no execution (0). These counters belong to the loaded model object: they
    restart after a full reload.
    """

    inference_count: int | None = None
    execution_count: int | None = None
    success_count: int | None = None
    success_ns: int | None = None
    fail_count: int | None = None
    fail_ns: int | None = None
    queue_count: int | None = None
    queue_ns: int | None = None
    compute_input_count: int | None = None
    compute_input_ns: int | None = None
    compute_infer_count: int | None = None
    compute_infer_ns: int | None = None
    compute_output_count: int | None = None
    compute_output_ns: int | None = None
    batch_stats: dict[int, BatchStat] = field(default_factory=dict)


_STAT_SECTIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def _count(value: Any) -> int | None:
    """A JSON counter as a non-negative int, else None."""
    number = _finite(value)
    return int(number) if number is not None and number >= 0 else None


def _add(a: int | None, b: int | None) -> int | None:
    """Sum of two counters; unknown if either is unknown."""
    return None if a is None or b is None else a + b


def _stats_fields(entry: Mapping[str, Any]) -> dict[str, int | None]:
    fields: dict[str, int | None] = {
        "inference_count": _count(entry.get("inference_count")),
        "execution_count": _count(entry.get("execution_count")),
    }
    sections = entry.get("inference_stats")
    sections = sections if isinstance(sections, Mapping) else {}
    for name in _STAT_SECTIONS:
        section = sections.get(name)
        section = section if isinstance(section, Mapping) else {}
        fields[f"{name}_count"] = _count(section.get("count"))
        fields[f"{name}_ns"] = _count(section.get("ns"))
    return fields


def _section(row: Mapping[str, Any], name: str) -> tuple[int | None, int | None]:
    """(count, ns) of one section of a batch_stats row; None where absent or not a counter."""
    section = row.get(name)
    if not isinstance(section, Mapping):
        return None, None
    return _count(section.get("count")), _count(section.get("ns"))


def _batch_row(row: Any) -> tuple[int, BatchStat] | None:
    """One batch_stats row as (size, BatchStat), or None unless every number is known."""
    if not isinstance(row, Mapping):
        return None
    size = _count(row.get("batch_size"))
    executions, infer_ns = _section(row, "compute_infer")
    input_ns = _section(row, "compute_input")[1]
    output_ns = _section(row, "compute_output")[1]
    if size is None or executions is None or None in (infer_ns, input_ns, output_ns):
        return None  # why: a row without its times gives no service time, and 0 would read as free compute
    return size, BatchStat(executions, input_ns, infer_ns, output_ns)


def _batch_stats(entry: Mapping[str, Any]) -> dict[int, BatchStat]:
    result: dict[int, BatchStat] = {}
    rows = entry.get("batch_stats")
    for row in rows if isinstance(rows, list) else []:
        parsed = _batch_row(row)
        if parsed is not None:
            size, stat = parsed
            result[size] = result[size] + stat if size in result else stat
    return result


def parse_stats(obj: Any) -> dict[str, StatsCounters]:
    """Parse the statistics JSON (a parsed object, or its str/bytes) into `{model: StatsCounters}`.

    Example: two versions of model `m` with success counts 5 and 7 give
    `success_count=12`; a `batch_stats` row `{batch_size: 4, compute_input: {count: 3, ns: 30},
    compute_infer: {count: 3, ns: 9000}, compute_output: {count: 3, ns: 60}}` gives
    `{4: BatchStat(executions=3, compute_input_ns=30, compute_infer_ns=9000, compute_output_ns=60)}`
    (a row missing any of those numbers is left out). Both `/v2/models/<m>/stats` and
    `/v2/models/stats` (every model in one answer) have this shape. Anything that is not
    Triton's `{"model_stats": [...]}` shape gives `{}`.
    """
    try:
        if isinstance(obj, (str, bytes, bytearray)):
            obj = json.loads(obj)
        entries = obj.get("model_stats") if isinstance(obj, Mapping) else None
        if not isinstance(entries, list):
            return {}
        merged: dict[str, tuple[dict[str, int | None], dict[int, BatchStat]]] = {}
        for entry in entries:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not entry["name"]:
                continue
            _merge_stats(merged, entry["name"], _stats_fields(entry), _batch_stats(entry))
        return {name: StatsCounters(**fields, batch_stats=batches) for name, (fields, batches) in merged.items()}
    except Exception:  # noqa: BLE001  why: arbitrary JSON (deep nesting, odd types) is no data
        return {}


def _merge_stats(
    merged: dict[str, tuple[dict[str, int | None], dict[int, BatchStat]]],
    name: str, fields: dict[str, int | None], batches: dict[int, BatchStat],
) -> None:
    if name not in merged:
        merged[name] = (fields, batches)
        return
    old_fields, old_batches = merged[name]
    for key, value in fields.items():
        old_fields[key] = _add(old_fields[key], value)
    for size, stat in batches.items():
        old_batches[size] = old_batches[size] + stat if size in old_batches else stat


# ---------------------------------------------------------------------------------
# Sliding window
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One scrape of one model: `counters=None` means the scrape failed (no data)."""

    t: float
    counters: ModelCounters | None


def _usable(sample: Sample) -> bool:
    c = sample.counters
    return c is not None and all(getattr(c, f) is not None for f in REQUIRED_FIELDS)


def _is_reset(before: ModelCounters, after: ModelCounters) -> bool:
    """True if any cumulative counter went down (unload/reload or server restart)."""
    return any(getattr(after, f) < getattr(before, f) for f in CUMULATIVE_FIELDS)


def _since_last_reset(samples: list[Sample]) -> list[Sample]:
    """The samples from the last reset on (the reset sample is the new baseline)."""
    start = 0
    for i in range(1, len(samples)):
        if _is_reset(samples[i - 1].counters, samples[i].counters):
            start = i
    return samples[start:]


def _delta(first: ModelCounters, last: ModelCounters, *names: str) -> float:
    return sum(getattr(last, n) - getattr(first, n) for n in names)


def _items_per_request(items: float, successes: float) -> float:
    """Items a successful request carried on average (at least 1; 1 where no request succeeded). Example: 1,000
    inferences over 250 successes: 4.0. At least 1: responses from the response cache count as successes but not as
    inferences, so a cached share would otherwise read as fewer items."""
    return max(1.0, items / successes) if successes > 0 and items > 0 else 1.0


def _per_request_ms(delta_us: float, delta_requests: float) -> float:
    """Mean microseconds per request, in ms; 0.0 when no request finished (nothing waited)."""
    return delta_us / delta_requests / 1000.0 if delta_requests > 0 else 0.0


def busy_fraction(compute_us: float, requests: float, executions: float, span_s: float, instance_count: int) -> float:
    """Share of the instances' time spent executing, from request-level counters.

    Triton charges every request of a batch the whole batch's compute time, so the mean
    compute time per request is (about) the compute time per execution, and
    `compute_us / requests * executions` is the instance-time spent executing.

    Worked number: in 10 s, 500 requests ran in 125 batches of 4, each batch taking 20 ms.
    Triton adds 20,000 µs to each request: compute_us = 500 × 20,000 = 10,000,000 µs,
    i.e. 20,000 µs per request ≈ per execution; × 125 executions = 2,500,000 µs = 2.5 s of
    instance time; / 10 s / 1 instance = 0.25 (0.125 with 2 instances).

    That holds only when every batch has the same size: the mean per request weighs each execution by
    its batch size, so with mixed sizes this reads high (over 1.0 on a saturated instance). The observer
    uses `batch_stats` instead where it has them (`observer.ModelObserver._executing`); this is the
    fallback.
    """
    if requests <= 0 or span_s <= 0:
        return 0.0
    instances = max(1, instance_count)  # why: a count of 0 would divide by zero; one is the floor
    return compute_us / requests * executions / span_s / 1e6 / instances


SUMMARY_MAX_AGE_S = 60.0  # Triton 2.51's latency summaries cover about the last 60 s (prometheus-cpp default)


def _p99(samples: list[Sample], span_s: float) -> tuple[float | None, str]:
    """A latency figure that describes this window, not the past minute.

    Triton's summary quantiles cover roughly the last 60 s whatever happened meanwhile: just
    after a config change, or after traffic stopped, they still report the old latency (seen:
    33 ms kept for a minute after a scale-up had removed the queue). So:
    * no request in the window -> None (nothing to judge);
    * a window of at least 60 s -> the newest summary value ("summary");
    * otherwise the worst per-scrape-interval mean request time ("interval_mean_max"). With
      1-s scrapes this tracks changes within seconds but reads lower than a true p99 (a mean of
      1-s buckets, not a tail): treat it as a lower bound.
    Example: intervals with 10 requests in 100 ms and 5 in 150 ms give max(10, 30) = 30 ms.
    """
    worst_ms: float | None = None
    for before, after in zip(samples, samples[1:]):
        requests = _delta(before.counters, after.counters, "success", "failure")
        if requests > 0:
            mean_ms = _delta(before.counters, after.counters, "request_us") / requests / 1000.0
            worst_ms = mean_ms if worst_ms is None else max(worst_ms, mean_ms)
    if worst_ms is None:
        return None, "none"
    newest = samples[-1].counters.p99_us
    if newest is not None and span_s >= SUMMARY_MAX_AGE_S:
        return newest / 1000.0, "summary"
    return worst_ms, "interval_mean_max"


class ModelWindow:
    """Timestamped samples of one model and the window arithmetic over them.

    `add` keeps samples in time order and prunes those older than `max_age_s` before the
    newest one (keep it at least as long as the longest window you observe). `observe`
    uses the samples with `now - window_s <= t <= now`; windows are by time, not count.
    """

    def __init__(self, max_age_s: float = 600.0, min_span_s: float = 1.0) -> None:
        self.max_age_s = max_age_s
        self.min_span_s = min_span_s
        self._samples: list[Sample] = []

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)

    def add(self, t: float, counters: ModelCounters | None) -> None:
        """Record one scrape at time `t` (None = the scrape failed or the model was absent)."""
        keys = [s.t for s in self._samples]
        self._samples.insert(bisect.bisect_right(keys, t), Sample(t, counters))
        horizon = self._samples[-1].t - self.max_age_s
        while self._samples and self._samples[0].t < horizon:
            self._samples.pop(0)

    def observe(self, now: float, window_s: float, instance_count: int) -> Observation:
        """Summarise the window ending at `now` into an `Observation`.

        Worked numbers (two samples 10 s apart, 1 instance): success 1000 -> 1500,
        failure 0 -> 0, pending 2 -> 6, inference_count 2000 -> 3000, exec_count 250 -> 375,
        queue_us +1,000,000, compute (input+infer+output) us +10,000,000, request_us
        +11,500,000 give arrival_rps = (500 + 0 + 4) / 10 = 50.4, completion_rps = 50,
        exec_rps = 12.5, avg_batch_size = 1000 / 125 = 8, items_per_request = 1000 / 500 = 2,
        queue_ms_per_request = 1e6 / 500 / 1000 = 2, compute_ms_per_request = 20, request_ms_mean = 23,
        busy_fraction = 20,000 µs × 125 / 10 s / 1e6 / 1 = 0.25.

        `valid=False` (with `invalid_reason`) when: no sample in the window; the newest
        sample is a failed scrape or lacks a required counter (stale data); fewer than two
        usable samples since the last counter reset; or they span less than `min_span_s`.
        """
        in_window = [s for s in self._samples if now - window_s <= s.t <= now]
        if not in_window:
            return Observation(valid=False, invalid_reason="no_samples")
        if not _usable(in_window[-1]):
            return Observation(valid=False, invalid_reason="scrape_failed")
        samples = _since_last_reset([s for s in in_window if _usable(s)])
        if len(samples) < 2:
            return Observation(valid=False, since=samples[0].t, invalid_reason="too_few_samples")
        span_s = samples[-1].t - samples[0].t
        if span_s < self.min_span_s:
            return Observation(valid=False, span_s=span_s, since=samples[0].t, invalid_reason="span_too_short")
        return _observation(samples, span_s, instance_count)


def _observation(samples: list[Sample], span_s: float, instance_count: int) -> Observation:
    first, last = samples[0].counters, samples[-1].counters
    successes = _delta(first, last, "success")
    failures = _delta(first, last, "failure")
    shed = _delta(first, last, "failure_shed") if first.failure_shed is not None and last.failure_shed is not None else 0.0
    requests = successes + failures
    executions = _delta(first, last, "exec_count")
    compute_us = _delta(first, last, "compute_input_us", "compute_infer_us", "compute_output_us")
    # why: arrivals = completions + queue growth; a non-atomic scrape can make it dip below 0
    arrivals = max(0.0, requests + _delta(first, last, "pending"))
    pendings = [s.counters.pending for s in samples]
    p99_ms, p99_source = _p99(samples, span_s)
    return Observation(
        valid=True,
        span_s=span_s,
        since=samples[0].t,
        arrival_rps=arrivals / span_s,
        completion_rps=successes / span_s,
        failure_rps=failures / span_s,
        shed_rps=min(max(0.0, shed), failures) / span_s,
        exec_rps=executions / span_s,
        avg_batch_size=_delta(first, last, "inference_count") / executions if executions > 0 else 0.0,
        items_per_request=_items_per_request(_delta(first, last, "inference_count"), successes),
        pending_mean=sum(pendings) / len(pendings),
        queue_ms_per_request=_per_request_ms(_delta(first, last, "queue_us"), requests),
        compute_ms_per_request=_per_request_ms(compute_us, requests),
        request_ms_mean=_per_request_ms(_delta(first, last, "request_us"), requests),
        p99_ms=p99_ms,
        p99_source=p99_source,
        busy_fraction=busy_fraction(compute_us, requests, executions, span_s, instance_count),
    )


# ---------------------------------------------------------------------------------
# Scraper (the only I/O here)
# ---------------------------------------------------------------------------------


def _with_scheme(url: str) -> str:
    """`127.0.0.1:8000` (as TritonServer.http_url gives it) -> `http://127.0.0.1:8000`."""
    return url if "://" in url else f"http://{url}"


class Scraper:
    """Fetches `/metrics` and `/v2/models/<m>/stats` (or every model's); failures give None, never raise.

    A failure is logged once (warning) per streak of failures of the same endpoint kind,
    and the first success after a streak is logged once (info).
    """

    def __init__(self, metrics_url: str, http_url: str, timeout_s: float = 2.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self.metrics_url = _with_scheme(metrics_url)
        self.http_url = _with_scheme(http_url).rstrip("/")
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._failing: dict[str, bool] = {}

    def metrics(self) -> dict[str, ModelCounters] | None:
        body = self._get("metrics", self.metrics_url)
        return None if body is None else parse_metrics(body.decode("utf-8", errors="replace"))

    def stats(self, model: str) -> StatsCounters | None:
        url = f"{self.http_url}/v2/models/{urllib.parse.quote(model, safe='')}/stats"
        body = self._get("stats", url)
        return None if body is None else parse_stats(body).get(model)

    def all_stats(self) -> dict[str, StatsCounters] | None:
        """Every loaded model's statistics in one request (`GET /v2/models/stats`); None on failure.

        A model missing from the answer (not loaded) is missing from the dict; a body that is
        not Triton's shape gives `{}`.
        """
        body = self._get("all_stats", f"{self.http_url}/v2/models/stats")
        return None if body is None else parse_stats(body)

    def _get(self, kind: str, url: str) -> bytes | None:
        request = urllib.request.Request(url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except (OSError, ValueError, http.client.HTTPException) as error:  # HTTPError, timeouts, refused, bad URL, cut-off body
            if not self._failing.get(kind):
                log.warning("scrape of %s failed (%s); treating as no data until it recovers", url, error)
            self._failing[kind] = True
            return None
        if self._failing.get(kind):
            log.info("scrape of %s recovered", url)
        self._failing[kind] = False
        return body


def counters_for(models: Iterable[str], scraped: dict[str, ModelCounters] | None) -> dict[str, ModelCounters | None]:
    """Per managed model, its counters from one scrape or None (failed scrape or model absent)."""
    return {m: (scraped.get(m) if scraped is not None else None) for m in models}


__all__ = [
    "ModelCounters", "BatchStat", "StatsCounters", "Sample", "ModelWindow", "Scraper",
    "parse_metrics", "parse_stats", "busy_fraction", "counters_for",
    "REQUIRED_FIELDS", "CUMULATIVE_FIELDS",
]
