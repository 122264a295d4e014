"""Open-loop load generator for Triton, free of coordinated omission.

Four parts, usable on their own:

1. **Traces** (`load_trace`): a YAML (or dict) list of phases, each with a constant rate, a linear
   ramp, or a constant rate with periodic bursts; or a `day_curve` shorthand that expands to N
   ramp phases following a compressed sinusoidal day.
2. **Schedules** (`poisson_schedule`): non-homogeneous Poisson arrival times for a trace, drawn by
   thinning, deterministic for a seed.
3. **Driving** (`run_open_loop`, `run_open_loop_sync`): every request is sent at its scheduled time
   whether or not earlier ones have finished, and its latency is measured from the *scheduled*
   time, so a late send (client or event loop behind) counts against latency instead of vanishing.
   Only loopback targets are accepted. While a run drives, the process's older objects are kept out of
   the garbage collector (`gc_frozen`), so a full collection cannot stall the sends it measures.
4. **Summaries** (`summarize`): per-bin and per-phase rates, goodput and latency percentiles.

Trace format::

    phases:
      - {name: warm,  duration_s: 10, rate_rps: 20}
      - {name: rise,  duration_s: 20, ramp: [20, 200]}
      - {name: spiky, duration_s: 30, rate_rps: 50, burst: {every_s: 10, length_s: 2, rate_rps: 300}}

or::

    day_curve: {duration_s: 120, min_rps: 10, max_rps: 200, phases: 12}

During a burst window the burst rate *replaces* the phase's base rate. Burst windows start
`every_s` into the phase and then every `every_s` (`[k*every_s, k*every_s + length_s)`, k >= 1),
so a phase never opens with a burst.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import gc
import json
import math
import threading
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..telemetry import is_loopback_host
from .inputs import InputSpec, input_sets

__all__ = [
    "TraceError", "Burst", "Phase", "Trace", "load_trace", "expand_day_curve",
    "poisson_schedule",
    "RequestRecord", "InputFactory", "require_loopback", "run_open_loop", "run_open_loop_sync", "gc_frozen",
    "make_resnet_tiny_inputs", "make_inputs_from_config", "inputs_from_config", "live_config",
    "send_lag_p99_ms", "client_bound", "LAG_WARN_MS", "LAG_SHARE",
    "BinStats", "PhaseStats", "Totals", "LoadSummary", "summarize",
    "ERROR_TIMEOUT", "ERROR_CLIENT_OVERLOADED",
]

# Validation ranges (inclusive unless stated).
MAX_DURATION_S = 86_400.0
MAX_RATE_RPS = 100_000.0
MIN_DAY_PHASES = 2
MAX_DAY_PHASES = 1_000

LIVE_CHECK_TIMEOUT_S = 10.0   # how long run_open_loop waits for the server to answer "live"
# How long, after the last deadline, a run waits for the gRPC calls it stopped waiting for (at least): they
# are left to finish, not cancelled (see `_Run.one`), and only those still out then are cancelled.
ABANDONED_WAIT_S = 10.0
STOP_POLL_S = 0.2                # with a `stop` event: the longest the driver sleeps before it looks at it

ERROR_TIMEOUT = "timeout"
ERROR_CLIENT_OVERLOADED = "client_overloaded"
ERROR_NOT_SENT = "not_sent"      # the run was stopped (`stop`) before this request's time came


class TraceError(ValueError):
    """An invalid trace or schedule request; the message names the field and the valid range."""


# ---------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Burst:
    """Periodic bursts inside a constant-rate phase."""

    every_s: float
    length_s: float
    rate_rps: float


@dataclasses.dataclass(frozen=True)
class Phase:
    """One named stretch of a trace: rate goes linearly from `from_rps` to `to_rps`
    (equal for a constant phase), replaced by `burst.rate_rps` inside burst windows."""

    name: str
    start_s: float
    end_s: float
    from_rps: float
    to_rps: float
    burst: Burst | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def peak_rps(self) -> float:
        """The highest rate anywhere in the phase (the thinning envelope)."""
        peak = max(self.from_rps, self.to_rps)
        return max(peak, self.burst.rate_rps) if self.burst else peak

    def rates_at(self, t_s: np.ndarray) -> np.ndarray:
        """Vectorised rate (req/s) at absolute trace times `t_s`, assumed inside the phase."""
        offset_s = np.asarray(t_s, dtype=float) - self.start_s
        rate = self.from_rps + (self.to_rps - self.from_rps) * (offset_s / self.duration_s)
        if self.burst is not None:
            rate = np.where(self._in_burst(offset_s), self.burst.rate_rps, rate)
        return rate

    def _in_burst(self, offset_s: np.ndarray) -> np.ndarray:
        b = self.burst
        assert b is not None
        return (offset_s >= b.every_s) & (np.mod(offset_s, b.every_s) < b.length_s)

    def expected_requests(self) -> float:
        """The integral of the rate over the phase (the mean request count)."""
        base = 0.5 * (self.from_rps + self.to_rps) * self.duration_s
        if self.burst is None:
            return base
        burst_s = self._burst_seconds()
        return base + (self.burst.rate_rps - self.from_rps) * burst_s  # bursts only on constant phases

    def _burst_seconds(self) -> float:
        b = self.burst
        assert b is not None
        total_s, k = 0.0, 1
        while k * b.every_s < self.duration_s:
            total_s += min(b.length_s, self.duration_s - k * b.every_s)
            k += 1
        return total_s


@dataclasses.dataclass(frozen=True)
class Trace:
    """An ordered, gap-free sequence of phases starting at t = 0."""

    phases: tuple[Phase, ...]

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s if self.phases else 0.0

    @property
    def peak_rps(self) -> float:
        return max((p.peak_rps for p in self.phases), default=0.0)

    def phase_at(self, t_s: float) -> Phase | None:
        """The phase covering `t_s` (phases are [start_s, end_s)); None outside [0, duration_s)."""
        if not 0.0 <= t_s < self.duration_s:
            return None
        starts_s = [p.start_s for p in self.phases]
        return self.phases[bisect.bisect_right(starts_s, t_s) - 1]

    def rate_at(self, t_s: float) -> float:
        """Offered rate (req/s) at `t_s`; 0.0 outside [0, duration_s)."""
        phase = self.phase_at(t_s)
        return float(phase.rates_at(np.array([t_s]))[0]) if phase else 0.0

    def expected_requests(self) -> float:
        return sum(p.expected_requests() for p in self.phases)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any, field: str, low: float, high: float, *, low_open: bool = False) -> float:
    """Return `value` as a float if it is a finite number in range, else raise TraceError."""
    bracket = "(" if low_open else "["
    rng = f"{bracket}{low:g}, {high:g}]"
    if not _is_number(value):
        raise TraceError(f"{field}: expected a number in {rng}, got {value!r}")
    ok_low = value > low if low_open else value >= low
    if not (ok_low and value <= high):
        raise TraceError(f"{field}: {value:g} is outside the valid range {rng}")
    return float(value)


def _check_keys(raw: Mapping, field: str, required: set[str], optional: set[str]) -> None:
    missing = sorted(required - raw.keys())
    if missing:
        raise TraceError(f"{field}: missing required field(s) {', '.join(missing)}")
    unknown = sorted(set(raw.keys()) - required - optional)
    if unknown:
        valid = ", ".join(sorted(required | optional))
        raise TraceError(f"{field}: unknown field(s) {', '.join(map(str, unknown))} (valid: {valid})")


def _parse_burst(raw: Any, field: str, phase_duration_s: float) -> Burst:
    if not isinstance(raw, Mapping):
        raise TraceError(f"{field}: expected a mapping {{every_s, length_s, rate_rps}}, got {raw!r}")
    _check_keys(raw, field, {"every_s", "length_s", "rate_rps"}, set())
    every_s = _number(raw["every_s"], f"{field}.every_s", 0.0, phase_duration_s, low_open=True)
    length_s = _number(raw["length_s"], f"{field}.length_s", 0.0, every_s, low_open=True)
    if length_s >= every_s:
        raise TraceError(f"{field}.length_s: {length_s:g} must be shorter than every_s ({every_s:g})")
    rate_rps = _number(raw["rate_rps"], f"{field}.rate_rps", 0.0, MAX_RATE_RPS)
    return Burst(every_s, length_s, rate_rps)


def _parse_phase(raw: Any, index: int, start_s: float) -> Phase:
    field = f"phases[{index}]"
    if not isinstance(raw, Mapping):
        raise TraceError(f"{field}: expected a mapping with name, duration_s and rate_rps or ramp, got {raw!r}")
    _check_keys(raw, field, {"name", "duration_s"}, {"rate_rps", "ramp", "burst"})
    name = raw["name"]
    if not isinstance(name, str) or not name.strip():
        raise TraceError(f"{field}.name: expected a non-empty string, got {name!r}")
    duration_s = _number(raw["duration_s"], f"{field}.duration_s", 0.0, MAX_DURATION_S, low_open=True)
    has_rate, has_ramp = "rate_rps" in raw, "ramp" in raw
    if has_rate == has_ramp:
        raise TraceError(f"{field} ({name}): give exactly one of rate_rps or ramp")
    if has_rate:
        from_rps = to_rps = _number(raw["rate_rps"], f"{field}.rate_rps", 0.0, MAX_RATE_RPS)
    else:
        ramp = raw["ramp"]
        if not (isinstance(ramp, Sequence) and not isinstance(ramp, str) and len(ramp) == 2):
            raise TraceError(f"{field}.ramp: expected [from_rps, to_rps], two numbers in [0, {MAX_RATE_RPS:g}], got {ramp!r}")
        from_rps = _number(ramp[0], f"{field}.ramp[0] (from_rps)", 0.0, MAX_RATE_RPS)
        to_rps = _number(ramp[1], f"{field}.ramp[1] (to_rps)", 0.0, MAX_RATE_RPS)
    burst = None
    if "burst" in raw:
        if has_ramp:
            raise TraceError(f"{field}.burst: bursts need a constant rate_rps, not a ramp")
        burst = _parse_burst(raw["burst"], f"{field}.burst", duration_s)
    return Phase(name, start_s, start_s + duration_s, from_rps, to_rps, burst)


def _day_rate_rps(fraction: float, min_rps: float, max_rps: float) -> float:
    """Compressed day: trough at midnight (fraction 0 and 1), peak at midday (0.5)."""
    return min_rps + (max_rps - min_rps) * 0.5 * (1.0 - math.cos(2.0 * math.pi * fraction))


def _day_label(fraction: float) -> str:
    if fraction < 0.2 or fraction >= 0.8:
        return "night"
    if fraction < 0.4:
        return "morning"
    if fraction < 0.6:
        return "midday"
    return "evening"


def expand_day_curve(raw: Any) -> list[dict[str, Any]]:
    """Expand `{duration_s, min_rps, max_rps, phases: N}` to N ramp phases (as raw dicts).

    The rate follows min + (max - min) * (1 - cos(2*pi*t/D)) / 2, sampled at the phase boundaries
    and joined by linear ramps: night trough, morning rise, midday peak, evening fall.
    Phase names are `<part of day>-<NN>`, e.g. `night-01`, `morning-03`.
    """
    field = "day_curve"
    if not isinstance(raw, Mapping):
        raise TraceError(f"{field}: expected a mapping {{duration_s, min_rps, max_rps, phases}}, got {raw!r}")
    _check_keys(raw, field, {"duration_s", "min_rps", "max_rps", "phases"}, set())
    duration_s = _number(raw["duration_s"], f"{field}.duration_s", 0.0, MAX_DURATION_S, low_open=True)
    min_rps = _number(raw["min_rps"], f"{field}.min_rps", 0.0, MAX_RATE_RPS)
    max_rps = _number(raw["max_rps"], f"{field}.max_rps", min_rps, MAX_RATE_RPS)
    count = raw["phases"]
    if not isinstance(count, int) or isinstance(count, bool) or not MIN_DAY_PHASES <= count <= MAX_DAY_PHASES:
        raise TraceError(f"{field}.phases: expected an integer in [{MIN_DAY_PHASES}, {MAX_DAY_PHASES}], got {count!r}")
    width_s = duration_s / count
    phases = []
    for i in range(count):
        f0, f1 = i / count, (i + 1) / count
        phases.append({
            "name": f"{_day_label((f0 + f1) / 2)}-{i + 1:02d}",
            "duration_s": width_s,
            "ramp": [_day_rate_rps(f0, min_rps, max_rps), _day_rate_rps(f1, min_rps, max_rps)],
        })
    return phases


def _read_trace_source(path_or_dict: str | Path | Mapping) -> Mapping:
    if isinstance(path_or_dict, Mapping):
        return path_or_dict
    import yaml

    path = Path(path_or_dict)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise TraceError(f"trace file {path}: cannot read it ({e.strerror or e})") from e
    except yaml.YAMLError as e:
        from ..config import yaml_error_text
        raise TraceError(f"trace file {path}: {yaml_error_text(e)}") from None
    if not isinstance(raw, Mapping):
        raise TraceError(f"trace file {path}: expected a mapping with 'phases' or 'day_curve' at the top")
    return raw


def load_trace(path_or_dict: str | Path | Mapping) -> Trace:
    """Parse and validate a trace from a YAML file path or an already-loaded mapping.

    Top-level keys: exactly one of `phases` (a non-empty list) or `day_curve`; optional `name`
    and `description` are ignored. Raises TraceError naming the offending field and its range.
    """
    raw = _read_trace_source(path_or_dict)
    _check_keys(raw, "trace", set(), {"phases", "day_curve", "name", "description"})
    if ("phases" in raw) == ("day_curve" in raw):
        raise TraceError("trace: give exactly one of 'phases' (a list) or 'day_curve'")
    items = expand_day_curve(raw["day_curve"]) if "day_curve" in raw else raw["phases"]
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise TraceError(f"phases: expected a non-empty list of phases, got {items!r}")
    segments: list[Phase] = []
    start_s = 0.0
    for index, item in enumerate(items):
        phase = _parse_phase(item, index, start_s)
        if any(p.name == phase.name for p in segments):
            raise TraceError(f"phases[{index}].name: '{phase.name}' is used twice; phase names must be unique")
        segments.append(phase)
        start_s = phase.end_s
    if start_s > MAX_DURATION_S:
        raise TraceError(f"phases: total duration {start_s:g} s is outside the valid range (0, {MAX_DURATION_S:g}]")
    return Trace(tuple(segments))


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------
_CANDIDATES_PER_CHUNK = 1_000_000


def _thin_phase(phase: Phase, rng: np.random.Generator) -> np.ndarray:
    """Arrivals in one phase: homogeneous Poisson at the phase's peak rate, thinned to rate(t).

    Long, fast phases are cut into chunks of about `_CANDIDATES_PER_CHUNK` candidates to bound memory.
    """
    peak_rps = phase.peak_rps
    if peak_rps <= 0.0:
        return np.empty(0)
    chunks = max(1, math.ceil(peak_rps * phase.duration_s / _CANDIDATES_PER_CHUNK))
    edges_s = np.linspace(phase.start_s, phase.end_s, chunks + 1)
    kept: list[np.ndarray] = []
    for lo_s, hi_s in zip(edges_s[:-1], edges_s[1:]):
        n = rng.poisson(peak_rps * (hi_s - lo_s))
        t_s = np.sort(rng.uniform(lo_s, hi_s, size=n))
        accept = rng.uniform(0.0, peak_rps, size=n) < phase.rates_at(t_s)
        kept.append(t_s[accept])
    return np.concatenate(kept)


def poisson_schedule(trace: Trace, seed: int, max_requests: int) -> np.ndarray:
    """Send offsets (s, sorted, in [0, trace.duration_s)) of a non-homogeneous Poisson process.

    Drawn by thinning, deterministic for `seed`. Raises TraceError if the trace's expected count,
    or the drawn count, exceeds `max_requests` (never truncates silently).
    """
    if not isinstance(max_requests, int) or isinstance(max_requests, bool) or max_requests < 1:
        raise TraceError(f"max_requests: expected an integer >= 1, got {max_requests!r}")
    expected = trace.expected_requests()
    if expected > max_requests:
        raise TraceError(f"trace expects about {expected:.0f} requests, more than max_requests={max_requests}; "
                         "shorten the trace, lower its rates, or raise max_requests")
    rng = np.random.default_rng(seed)
    offsets_s = np.concatenate([_thin_phase(p, rng) for p in trace.phases] or [np.empty(0)])
    if len(offsets_s) > max_requests:
        raise TraceError(f"the schedule drawn for seed {seed} has {len(offsets_s)} requests, "
                         f"more than max_requests={max_requests}; raise max_requests")
    return offsets_s


# ---------------------------------------------------------------------------------------------
# Driving the server
# ---------------------------------------------------------------------------------------------
InputFactory = Callable[[], "dict[str, np.ndarray] | list[dict[str, np.ndarray]]"]   # one set, or sets in turn


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """The fate of one scheduled request; times are seconds from the run start.

    `sent_s` is None if the request was never sent (client_overloaded, or a timeout that expired
    before the client got to send it); `done_s` is None if no answer came back (timeout,
    client_overloaded). `error` is None exactly when `ok`.
    """

    scheduled_s: float
    sent_s: float | None
    done_s: float | None
    ok: bool
    error: str | None

    @property
    def latency_s(self) -> float | None:
        """Completion time minus *scheduled* time (late sends count), None without a completion."""
        return None if self.done_s is None else self.done_s - self.scheduled_s


def require_loopback(url: str) -> str:
    """Return `url` as "host:port" if its host is loopback, else raise ValueError.

    Accepted hosts: 127.0.0.0/8, ::1 (also as ::ffff:127.x.y.z) and `localhost`. Names are not
    resolved: any other name is refused. A scheme (http://, https://, grpc://) is allowed and dropped.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"target URL must be a non-empty 'host:port' string, got {url!r}")
    text = url.strip()
    if "://" in text:
        scheme, text = text.split("://", 1)
        if scheme.lower() not in ("http", "https", "grpc"):
            raise ValueError(f"target {url!r}: unsupported scheme {scheme!r}")
    parts = urllib.parse.urlsplit("//" + text)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ValueError(f"target {url!r}: cannot parse host:port ({e})") from e
    if parts.username is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"target {url!r}: expected plain 'host:port'")
    if not host or port is None:
        raise ValueError(f"target {url!r}: expected 'host:port' with an explicit port")
    if not is_loopback_host(host):
        raise ValueError(f"refusing to send load to {host!r}: this load generator only targets the local "
                         "machine (127.0.0.0/8, localhost, ::1)")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _validated_schedule(schedule_s: Sequence[float] | np.ndarray) -> np.ndarray:
    offsets_s = np.asarray(schedule_s, dtype=float).reshape(-1)
    if offsets_s.size and (not np.all(np.isfinite(offsets_s)) or offsets_s.min() < 0.0):
        raise ValueError("schedule: every offset must be a finite number of seconds >= 0")
    if np.any(np.diff(offsets_s) < 0.0):
        raise ValueError("schedule: offsets must be sorted ascending")
    return offsets_s


def _open_client(protocol: str, target: str, max_in_flight: int) -> tuple[Any, Any]:
    """An asyncio Triton client for `protocol` and the module that holds its InferInput class."""
    if protocol == "grpc":
        import tritonclient.grpc.aio as module

        return module.InferenceServerClient(url=target), module
    if protocol == "http":
        import tritonclient.http.aio as module

        return module.InferenceServerClient(url=target, conn_limit=max_in_flight), module
    raise ValueError(f"protocol: expected 'grpc' or 'http', got {protocol!r}")


def _infer_inputs(module: Any, arrays: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]
                  ) -> list[list[Any]]:
    """The client's tensors of each distinct request (one set, or several sent in turn), built once."""
    from tritonclient.utils import np_to_triton_dtype

    sets = [arrays] if isinstance(arrays, Mapping) else list(arrays)
    if not sets:
        raise ValueError("make_inputs() returned no input sets")
    out = []
    for one in sets:
        inputs = []
        for name, array in one.items():
            tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        out.append(inputs)
    return out


def _error_text(exc: BaseException) -> str:
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, InferenceServerException):
        status = exc.status()
        text = f"{status}: {exc.message()}" if status else str(exc.message())
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:300]


class _Run:
    """State of one open-loop run: the clock origin, in-flight count and the records by index."""

    def __init__(self, client: Any, model: str, inputs: list[list[Any]], schedule_s: np.ndarray,
                 timeout_s: float, max_in_flight: int, headers: Mapping[str, str] | None,
                 keep_late_calls: bool = False, on_record: Callable[[RequestRecord], None] | None = None,
                 stop: asyncio.Event | None = None):
        self.client, self.model, self.inputs = client, model, inputs
        self.on_record, self.stop = on_record, stop
        self.schedule_s, self.timeout_s, self.max_in_flight = schedule_s, timeout_s, max_in_flight
        self.headers = dict(headers) if headers else None
        self.keep_late_calls = keep_late_calls
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.in_flight = 0
        self.records: list[RequestRecord | None] = [None] * len(schedule_s)
        self.tasks: set[asyncio.Task] = set()
        self.abandoned: set[asyncio.Future] = set()   # late calls left to finish (keep_late_calls)
        self.cancelled_at_end = 0                       # ... of which still out when the run gave up on them

    def now_s(self) -> float:
        return self.loop.time() - self.t0

    def record(self, index: int, record: RequestRecord) -> None:
        self.records[index] = record
        if self.on_record is not None:
            self.on_record(record)

    async def one(self, index: int) -> None:
        """Send request `index` and record its fate by its deadline.

        With `keep_late_calls` (gRPC) a call past its deadline is recorded as a timeout but left to finish,
        never cancelled: in tritonserver 2.51 (r24.10) a gRPC cancellation that races the response's
        completion can crash the server (SIGSEGV in the gRPC frontend's infer handler; fixed upstream in
        r24.12, triton-inference-server/server#7840). Reproduced here: a 30-ms client timeout at 250 req/s
        on sim_accel killed the server within three minutes; the same load with late calls kept ran on.
        """
        scheduled_s = float(self.schedule_s[index])
        sent_s = self.now_s()
        call: asyncio.Future | None = None
        try:
            remaining_s = scheduled_s + self.timeout_s - sent_s
            if remaining_s <= 0.0:   # expired before it could go out: never sent
                self.record(index, RequestRecord(scheduled_s, None, None, False, ERROR_TIMEOUT))
                return
            inputs = self.inputs[index % len(self.inputs)]
            call = asyncio.ensure_future(self.client.infer(self.model, inputs, headers=self.headers))
            await asyncio.wait_for(asyncio.shield(call) if self.keep_late_calls else call, remaining_s)
            self.record(index, RequestRecord(scheduled_s, sent_s, self.now_s(), True, None))
        except asyncio.TimeoutError:
            self.record(index, RequestRecord(scheduled_s, sent_s, None, False, ERROR_TIMEOUT))
            self.abandon(call)
        except asyncio.CancelledError:
            self.record(index, RequestRecord(scheduled_s, sent_s, None, False, ERROR_TIMEOUT))
            self.abandon(call)
            raise
        except Exception as exc:  # noqa: BLE001  (any failure is a failed request, with its text)
            self.record(index, RequestRecord(scheduled_s, sent_s, self.now_s(), False, _error_text(exc)))
        finally:
            self.in_flight -= 1

    def abandon(self, call: asyncio.Future | None) -> None:
        """Keep a late call (its record is final) until it ends by itself; without keep_late_calls, the
        wait_for that timed out has already cancelled it."""
        if call is None or call.done() or not self.keep_late_calls:
            return
        self.abandoned.add(call)
        # why the callback reads the result: an abandoned call's error is expected, not "never retrieved"
        call.add_done_callback(lambda c: (self.abandoned.discard(c), c.cancelled() or c.exception()))

    def dispatch_due(self, index: int) -> int:
        """Send (or record as overloaded) every request due by now, starting at `index`."""
        now_s = self.now_s()
        while index < len(self.schedule_s) and self.schedule_s[index] <= now_s:
            if self.in_flight >= self.max_in_flight:
                self.record(index, RequestRecord(float(self.schedule_s[index]), None, None, False,
                                                 ERROR_CLIENT_OVERLOADED))
            else:
                self.in_flight += 1
                task = self.loop.create_task(self.one(index))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            index += 1
        return index

    async def drive(self) -> list[RequestRecord]:
        index = 0
        while index < len(self.schedule_s):
            if self.stop is not None and self.stop.is_set():
                for i in range(index, len(self.schedule_s)):   # never sent: the caller stopped the run
                    self.record(i, RequestRecord(float(self.schedule_s[i]), None, None, False, ERROR_NOT_SENT))
                break
            wait_s = self.schedule_s[index] - self.now_s()
            if self.stop is not None:
                wait_s = min(wait_s, STOP_POLL_S)   # why: a long gap between sends must not delay the stop
            # Sleep until the next request is due; yield at least once so sends start promptly.
            await asyncio.sleep(max(0.0, wait_s))
            index = self.dispatch_due(index)
        await self.drain()
        for i, r in enumerate(self.records):
            if r is None:
                self.record(i, RequestRecord(float(self.schedule_s[i]), None, None, False, ERROR_TIMEOUT))
        return list(self.records)

    async def drain(self) -> None:
        """Wait for stragglers (each already bounded by its own deadline), then cancel any left; then for the
        late calls left to finish (bounded by max(timeout_s, ABANDONED_WAIT_S)), cancelling only those still out."""
        if self.tasks:
            last_deadline_s = float(self.schedule_s[-1]) + self.timeout_s
            _, pending = await asyncio.wait(set(self.tasks), timeout=max(0.0, last_deadline_s - self.now_s()) + 1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        if self.abandoned:   # late calls the server is still working through: let it answer them
            _, left = await asyncio.wait(set(self.abandoned), timeout=max(self.timeout_s, ABANDONED_WAIT_S))
            self.cancelled_at_end = len(left)
            for call in left:
                call.cancel()
            if left:
                await asyncio.wait(left, timeout=1.0)


async def run_open_loop(url: str, model: str, schedule: Sequence[float] | np.ndarray,
                        make_inputs: InputFactory, *, protocol: str = "grpc", timeout_s: float = 10.0,
                        max_in_flight: int = 1024, headers: Mapping[str, str] | None = None,
                        keep_late_calls: bool | None = None,
                        on_record: Callable[[RequestRecord], None] | None = None,
                        on_start: Callable[[], None] | None = None,
                        stop: asyncio.Event | None = None) -> list[RequestRecord]:
    """Send one request per schedule offset, open loop, and return one record per offset (in order).

    - Each request goes out at its scheduled offset from the run start whether or not earlier ones
      have finished; latency is measured from the scheduled time.
    - A request not answered within `timeout_s` of its scheduled time fails with "timeout". Over gRPC
      its call is left to finish, not cancelled (a cancellation racing the answer can crash
      tritonserver 2.51: `_Run.one`); the run waits up to max(`timeout_s`, ABANDONED_WAIT_S) after the
      last deadline for such calls, then cancels what is left. Over HTTP a late call is cut off at its
      deadline (its connection closes; the server does not cancel HTTP requests). So a run ends at most
      `timeout_s` (HTTP) or `timeout_s` + max(`timeout_s`, 10 s) (gRPC), plus ~1 s, after the last offset.
    - When `max_in_flight` requests are outstanding, a due request is recorded as failed with
      "client_overloaded" instead of being sent (never dropped from the records). A call past its
      deadline no longer counts as outstanding, even while it is left to finish.
    - `keep_late_calls` (default: True over gRPC, False over HTTP) says whether a late call is left to
      finish; False over gRPC only to reproduce the crash (`scripts/grpc_cancel_repro.py`).
    - `make_inputs()` is called once. It returns one set of tensors (a dict: every request carries it) or a
      list of sets (request k carries set k mod N: `--input-data`'s entries).
    - While it drives, the process's older objects are frozen out of the garbage collector (`gc_frozen`).
    - `on_start()` is called at the run's time 0 (after the connection and the live check), and
      `on_record(record)` as each record becomes final, both in the event loop (for a live view).
    - Setting `stop` ends the sending: the requests not yet due are recorded as ERROR_NOT_SENT, and the
      ones in flight are waited for as at the end of a run (never cancelled while the server may answer).
    - Only loopback targets are accepted (ValueError otherwise). Raises ConnectionError if the
      server is not live before the run starts.
    """
    target = require_loopback(url)
    offsets_s = _validated_schedule(schedule)
    if not _is_number(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
    if not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight: expected an integer >= 1, got {max_in_flight!r}")
    client, module = _open_client(protocol, target, max_in_flight)
    try:
        inputs = _infer_inputs(module, make_inputs())
        await _check_live(client, target, LIVE_CHECK_TIMEOUT_S)   # also opens the connection before t0
        keep = protocol == "grpc" if keep_late_calls is None else keep_late_calls
        with gc_frozen():
            run = _Run(client, model, inputs, offsets_s, timeout_s, max_in_flight, headers,
                       keep_late_calls=keep, on_record=on_record, stop=stop)
            if on_start is not None:
                on_start()
            return await run.drive()
    finally:
        await client.close()


_gc_lock = threading.Lock()
_gc_runs = 0      # runs inside gc_frozen now (several: soak's concurrent runs, bench_multi's threads)
_gc_frozen_before = False   # the process had frozen objects of its own when the first of them came in


@contextlib.contextmanager
def gc_frozen():
    """Move every object the process holds now into the collector's permanent generation for the block.

    why: latency is measured from each request's scheduled time, and the client shares its process (and the
    GIL) with whatever else lives there. A full (generation-2) collection walks every tracked object and
    stops the event loop meanwhile: 656 ms measured here over a heap of 3 M small objects, 16 ms over the
    ~100 k a bare process with this project's imports holds (a long test session may hold more). Every request
    due in that pause is sent late and counted late: a p99 that says "the server stalled" when the client
    did (`scripts/gc_pause_repro.py` shows it side by side). Frozen objects are skipped by every collection
    (gc.freeze), so collections during the run walk only what the run allocates; new garbage is still
    collected. Reference-counted across overlapping runs (threads or tasks): the first in freezes, the last
    out unfreezes, unless the process had frozen objects of its own before (a pre-fork server's gc.freeze),
    which stay frozen. A run that starts while others drive freezes nothing more: soak starts one every 2 s,
    each overlapping the last one's drain, and freezing at each start would keep every cycle of garbage
    alive at those moments until the soak ends. So what is frozen is what was alive when the first run
    started; at worst a cycle among it waits for a collection after the last run.
    """
    global _gc_runs, _gc_frozen_before
    with _gc_lock:
        if _gc_runs == 0:
            _gc_frozen_before = gc.get_freeze_count() > 0
            gc.freeze()
        _gc_runs += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_runs -= 1
            if _gc_runs == 0 and not _gc_frozen_before:
                gc.unfreeze()


async def _check_live(client: Any, target: str, timeout_s: float) -> None:
    try:
        live = await asyncio.wait_for(client.is_server_live(), timeout_s)
    except Exception as exc:  # noqa: BLE001
        raise ConnectionError(f"Triton at {target} is not reachable: {_error_text(exc)}") from exc
    if not live:
        raise ConnectionError(f"Triton at {target} is not live")


def run_open_loop_sync(url: str, model: str, schedule: Sequence[float] | np.ndarray,
                       make_inputs: InputFactory, **kwargs: Any) -> list[RequestRecord]:
    """`run_open_loop` in a fresh event loop (not callable from inside a running loop)."""
    return asyncio.run(run_open_loop(url, model, schedule, make_inputs, **kwargs))


# ---------------------------------------------------------------------------------------------
# Input factories
# ---------------------------------------------------------------------------------------------
def make_resnet_tiny_inputs(seed: int = 0) -> InputFactory:
    """Inputs for resnet_tiny: "INPUT", FP32 [1, 3, 32, 32], standard normal, fixed seed."""
    array = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
    return lambda: {"INPUT": array}


def inputs_from_config(config: Mapping[str, Any], seed: int = 0, batch_size: int = 1,
                       spec: InputSpec | None = None) -> InputFactory:
    """Inputs for every input of a model config (the JSON Triton serves); see `inputs` for the rules.

    Without `spec`: one random set (variable dims become 1; a batch dim of `batch_size` in front where
    max_batch_size > 0). With `spec.shapes`, those dims; with `spec.data`, one set per entry, sent in turn.
    Raises ValueError (`InputSpecError`) where they do not fit the config.
    """
    sets = input_sets(config, spec, seed=seed, batch_size=batch_size)
    if len(sets) == 1 and (spec is None or spec.data is None):
        return lambda: sets[0]
    return lambda: sets


def make_inputs_from_config(http_url: str, model: str, *, seed: int = 0,
                            headers: Mapping[str, str] | None = None, timeout_s: float = 10.0,
                            spec: InputSpec | None = None) -> InputFactory:
    """GET the live config of `model` from the (loopback) HTTP endpoint and build its inputs."""
    return inputs_from_config(live_config(http_url, model, headers=headers, timeout_s=timeout_s), seed, spec=spec)


def live_config(http_url: str, model: str, *, headers: Mapping[str, str] | None = None,
                timeout_s: float = 10.0) -> dict:
    """The model's live config (the JSON Triton serves) from the (loopback) HTTP endpoint."""
    target = require_loopback(http_url)
    request = urllib.request.Request(f"http://{target}/v2/models/{urllib.parse.quote(model)}/config",
                                     headers=dict(headers or {}))
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------
# the client's p99 send lag above which, and above this share of the p99 latency, the client set much of the latency
# (not the server): every latency counts from the scheduled time, so a client that falls behind adds its own delay
LAG_WARN_MS = 5.0
LAG_SHARE = 0.25


def send_lag_p99_ms(records: Sequence[RequestRecord]) -> float | None:
    """p99 of how far each sent request went out behind its schedule, in ms (None: none sent)."""
    lag_ms = np.array([1e3 * (r.sent_s - r.scheduled_s) for r in records if r.sent_s is not None])
    return float(np.percentile(lag_ms, 99)) if lag_ms.size else None


def client_bound(lag_ms: float | None, p99_ms: float | None) -> bool:
    """True where the client's send lag is a large part of the p99 (LAG_WARN_MS, LAG_SHARE): the load generator,
    not the server, set the latency. Example: lag 12 ms against a p99 of 30 ms -> True; 1.6 against 31 -> False."""
    return lag_ms is not None and p99_ms is not None and lag_ms > LAG_WARN_MS and lag_ms >= LAG_SHARE * p99_ms


@dataclasses.dataclass(frozen=True)
class BinStats:
    """Requests *scheduled* in [start_s, end_s) and what became of them (rates per second of bin)."""

    start_s: float
    end_s: float
    offered_rps: float
    completion_rps: float        # successful requests
    goodput_rps: float           # successful within the SLA
    failed: int
    p99_ms: float | None         # over successful requests; None when there are none


@dataclasses.dataclass(frozen=True)
class PhaseStats:
    name: str
    start_s: float
    end_s: float
    requests: int
    ok: int
    failed: int
    offered_rps: float
    goodput_rps: float
    p50_ms: float | None
    p99_ms: float | None


@dataclasses.dataclass(frozen=True)
class Totals:
    requests: int
    ok: int
    failed: int
    within_sla: int
    goodput_rps: float           # within-SLA completions per second of trace
    errors: dict[str, int]       # error text -> count


@dataclasses.dataclass(frozen=True)
class LoadSummary:
    sla_ms: float
    bin_s: float
    bins: list[BinStats]
    phases: list[PhaseStats]
    totals: Totals

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _percentile_ms(latencies_ms: np.ndarray, q: float) -> float | None:
    return float(np.percentile(latencies_ms, q)) if latencies_ms.size else None


class _Columns:
    """Records as parallel numpy arrays."""

    def __init__(self, records: Sequence[RequestRecord], sla_ms: float):
        self.scheduled_s = np.array([r.scheduled_s for r in records], dtype=float)
        self.ok = np.array([r.ok for r in records], dtype=bool)
        self.latency_ms = np.array([1000.0 * r.latency_s if r.ok and r.latency_s is not None else np.nan
                                    for r in records], dtype=float)
        self.good = self.ok & (self.latency_ms <= sla_ms)

    def select(self, lo_s: float, hi_s: float) -> np.ndarray:
        return (self.scheduled_s >= lo_s) & (self.scheduled_s < hi_s)


def summarize(records: Sequence[RequestRecord], trace: Trace, sla_ms: float, bin_s: float = 1.0) -> LoadSummary:
    """Bin and phase statistics of a run; every request counts in the bin/phase of its scheduled time.

    Bins tile [0, trace.duration_s) (the last may be shorter; its rates use its real width).
    Latency percentiles (numpy, linear interpolation) cover successful requests only and are None
    where there are none. Goodput counts successful requests with latency <= sla_ms.
    """
    if not _is_number(sla_ms) or sla_ms <= 0:
        raise ValueError(f"sla_ms: expected a number > 0, got {sla_ms!r}")
    if not _is_number(bin_s) or bin_s <= 0:
        raise ValueError(f"bin_s: expected a number > 0, got {bin_s!r}")
    cols = _Columns(records, sla_ms)
    return LoadSummary(float(sla_ms), float(bin_s), _bin_stats(cols, trace.duration_s, bin_s),
                       _phase_stats(cols, trace), _totals(cols, records, trace.duration_s))


def _bin_stats(cols: _Columns, duration_s: float, bin_s: float) -> list[BinStats]:
    bins = []
    for k in range(math.ceil(duration_s / bin_s - 1e-9)):
        lo_s, hi_s = k * bin_s, min((k + 1) * bin_s, duration_s)
        sel, width_s = cols.select(lo_s, hi_s), hi_s - lo_s
        bins.append(BinStats(
            start_s=lo_s, end_s=hi_s,
            offered_rps=int(sel.sum()) / width_s,
            completion_rps=int((sel & cols.ok).sum()) / width_s,
            goodput_rps=int((sel & cols.good).sum()) / width_s,
            failed=int((sel & ~cols.ok).sum()),
            p99_ms=_percentile_ms(cols.latency_ms[sel & cols.ok], 99),
        ))
    return bins


def _phase_stats(cols: _Columns, trace: Trace) -> list[PhaseStats]:
    stats = []
    for p in trace.phases:
        sel = cols.select(p.start_s, p.end_s)
        latencies_ms = cols.latency_ms[sel & cols.ok]
        width_s = p.end_s - p.start_s
        stats.append(PhaseStats(
            name=p.name, start_s=p.start_s, end_s=p.end_s,
            requests=int(sel.sum()), ok=int((sel & cols.ok).sum()), failed=int((sel & ~cols.ok).sum()),
            offered_rps=int(sel.sum()) / width_s, goodput_rps=int((sel & cols.good).sum()) / width_s,
            p50_ms=_percentile_ms(latencies_ms, 50), p99_ms=_percentile_ms(latencies_ms, 99),
        ))
    return stats


def _totals(cols: _Columns, records: Sequence[RequestRecord], duration_s: float) -> Totals:
    ok = int(cols.ok.sum())
    within = int(cols.good.sum())
    errors = Counter(r.error or "unknown" for r in records if not r.ok)
    return Totals(requests=len(records), ok=ok, failed=len(records) - ok, within_sla=within,
                  goodput_rps=within / duration_s if duration_s > 0 else 0.0, errors=dict(errors))
