"""Traces: a true per-request p99 within seconds, from Triton's request-trace files.

Triton's latency counters give means; its summary quantiles cover the past minute. A
sample of per-request traces (1 in `rate` requests, written to rotated JSON files) gives
the real latency distribution of the last few seconds. Five pieces, each usable alone:

* `parse_trace_text` (pure): the JSON of one trace file -> `TraceSample`s. Garbage in
  gives `[]`, never an exception.
* `TraceFiles` (file I/O): reads the rotated files `<path>.0`, `<path>.1`, ... as the
  server writes them, and removes each once read so that disk use stays bounded.
* `TraceApi` (HTTP I/O): the per-model trace settings (`/v2/models/<m>/trace/setting`).
* `TraceWindow` (pure, one per model): maps server time to controller time and turns the
  samples of one window into a `TraceSummary` (count, p50, p99, max, queue p99).
* `choose_sampling` / `needs_change` (pure): how many requests to trace at a given
  arrival rate, with hysteresis so that a noisy rate does not move the setting every tick.

Verified on tritonserver 2.51 (see /work/shared/triton-notes.md, "Request traces"):
* the trace file can only be set on the command line; `trace_file: ""` means none;
* every POST of a model's setting (a new rate, or level OFF) replaces the server's setting
  object, and the old one writes its buffered traces to a new indexed file at once: turning
  tracing off flushes it;
* the trace endpoints are not part of the `model-repository` restricted category: with only
  that category restricted they answer without the key (headers are sent anyway);
* the `ns` timestamps are CLOCK_MONOTONIC, like `time.monotonic()` on the same machine; this
  module does not rely on it (`TraceWindow` estimates the offset).

Times are seconds on the caller's clock; nothing here but `TraceFiles` (file ages) reads a
clock, so every piece can be driven by a fake clock in tests.
"""
from __future__ import annotations

import bisect
import http.client
import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger("controller.traces")

# ---------------------------------------------------------------------------------
# Parsing one trace file
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSample:
    """One traced request, durations in ms, `end_s` in seconds of the SERVER's clock.

    * `request_ms`: REQUEST_START -> REQUEST_END, the time inside Triton's core.
    * `latency_ms`: what the client sees minus the network: from the frontend's end of
      reading the request (GRPC_WAITREAD_END; HTTP_RECV_START for HTTP) to the end of
      sending the response (GRPC_SEND_END / HTTP_SEND_END); `request_ms` when the frontend
      timestamps are missing. It is usually a little more than `request_ms`, but can be up
      to ~0.3 ms less: in a batch each response goes out as soon as the model returns it,
      before the batch's COMPUTE_END and REQUEST_END (seen on 2.51, gRPC and HTTP).
    * `queue_ms`: QUEUE_START -> COMPUTE_START; `compute_ms`: COMPUTE_START -> COMPUTE_END
      (input copy + execution + output copy of the batch the request ran in); None if absent.
    * `parent_id`: the trace id of the request this one was made for, else None: the ensemble request a
      composing step belongs to, or the request of a Python (BLS) model that passed its trace on
      (`pb_utils.InferenceRequest(..., trace=request.trace())`; seen on 2.51: without it the call is not traced).
    * `trace_id`: this trace's own id (what a child's `parent_id` names), None where not known.

    Worked number (a gRPC trace seen on 2.51, ns relative to REQUEST_START): WAITREAD_END -59,448,
    QUEUE_START 26,229, COMPUTE_START 118,961, COMPUTE_END 8,946,579, REQUEST_END 8,971,937,
    GRPC_SEND_END 9,009,786 give request_ms 8.972, latency_ms 9.069, queue_ms 0.093,
    compute_ms 8.828.
    """

    model: str
    end_s: float
    latency_ms: float
    request_ms: float
    queue_ms: float | None = None
    compute_ms: float | None = None
    parent_id: int | None = None
    trace_id: int | None = None


_NS_LIMIT = 2**64  # why: timestamps are uint64 ns; anything larger is garbage (and would overflow float)

# Frontend spans, in order of preference: (read-end name, send-end name).
_FRONTENDS = (("GRPC_WAITREAD_END", "GRPC_SEND_END"), ("HTTP_RECV_START", "HTTP_SEND_END"))


def _ns(value: Any) -> int | float | None:
    """A timestamp as a number of ns in [0, 2**64), else None (bool, NaN, negative are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if 0 <= value < _NS_LIMIT else None


def _trace_id(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Trace:
    """The records of one trace id: model, parent, and first/last ns of every timestamp name."""

    __slots__ = ("model", "parent_id", "first", "last")

    def __init__(self) -> None:
        self.model: str | None = None
        self.parent_id: int | None = None
        self.first: dict[str, int | float] = {}
        self.last: dict[str, int | float] = {}

    def add_record(self, record: dict[str, Any]) -> None:
        name = record.get("model_name")
        if isinstance(name, str) and name:
            self.model = name
            self.parent_id = _trace_id(record.get("parent_id"))
        stamps = record.get("timestamps")
        for stamp in stamps if isinstance(stamps, list) else []:
            if not isinstance(stamp, dict) or not isinstance(stamp.get("name"), str):
                continue
            ns = _ns(stamp.get("ns"))
            if ns is None:
                continue
            key = stamp["name"]
            # why: decoupled models send several responses (several SEND_END): keep both ends
            self.first[key] = min(ns, self.first.get(key, ns))
            self.last[key] = max(ns, self.last.get(key, ns))

    def span_ms(self, start: str, end: str) -> float | None:
        """Earliest `start` to latest `end` in ms; None if either is missing or the span is negative."""
        if start not in self.first or end not in self.last:
            return None
        span = self.last[end] - self.first[start]
        return span / 1e6 if span >= 0 else None

    def sample(self, trace_id: int | None = None) -> TraceSample | None:
        request_ms = self.span_ms("REQUEST_START", "REQUEST_END")
        if self.model is None or request_ms is None:
            return None  # why: without a model or both request ends there is nothing to attribute
        frontend_ms = next((ms for ms in (self.span_ms(a, b) for a, b in _FRONTENDS) if ms is not None), None)
        # why: the client has its answer at SEND_END even when that precedes REQUEST_END (batched requests)
        latency_ms = request_ms if frontend_ms is None else frontend_ms
        return TraceSample(
            model=self.model,
            end_s=self.last["REQUEST_END"] / 1e9,
            latency_ms=latency_ms,
            request_ms=request_ms,
            queue_ms=self.span_ms("QUEUE_START", "COMPUTE_START"),
            compute_ms=self.span_ms("COMPUTE_START", "COMPUTE_END"),
            parent_id=self.parent_id,
            trace_id=trace_id,
        )


def _parse(text: str | bytes) -> list[TraceSample] | None:
    """The samples of one trace file, or None if `text` is not a JSON array (not a whole file)."""
    try:
        records = json.loads(text)
    except (ValueError, TypeError, RecursionError):  # why: truncated, not UTF-8, or absurdly nested
        return None
    if not isinstance(records, list):
        return None
    traces: dict[int, _Trace] = {}
    for record in records:
        if not isinstance(record, dict):     # why dict, not Mapping: JSON gives dicts, and the ABC's check on
            continue                         # every record and stamp showed in a profile of the tick
        trace_id = _trace_id(record.get("id"))
        if trace_id is not None:
            traces.setdefault(trace_id, _Trace()).add_record(record)
    return [s for s in (t.sample(i) for i, t in traces.items()) if s is not None]


def parse_trace_text(text: str | bytes) -> list[TraceSample]:
    """Parse one Triton trace file (a JSON array of records) into samples, in order of trace id.

    Records are grouped by `id`: one `{"id", "model_name", "model_version"[, "parent_id"]}`
    per trace and one `{"id", "timestamps": [{"name", "ns"}]}` per timestamp, in any order.
    Example: a trace with REQUEST_START at 1,000,000 ns and REQUEST_END at 9,500,000 ns and no
    frontend stamps gives `request_ms = latency_ms = 8.5`, `end_s = 0.0095`.
    A trace without a model name, REQUEST_START or REQUEST_END, or with REQUEST_END before
    REQUEST_START, is skipped; a negative queue or compute span gives None for that field.
    Anything that is not a JSON array (garbage, a file cut off mid-write) gives `[]`.
    """
    try:
        return _parse(text) or []
    except Exception:  # noqa: BLE001  why: belt and braces: a parser of untrusted files must not raise
        return []


# ---------------------------------------------------------------------------------
# The rotated files
# ---------------------------------------------------------------------------------


def _one_line(error: OSError) -> str:
    """`Permission denied: /x/trace.json.3` rather than a multi-part repr."""
    text = f"{error.strerror or type(error).__name__}: {error.filename}" if error.filename else str(error)
    return " ".join(text.split())[:300]


class TraceFiles:
    """Reads the server's rotated trace files `<path>.<index>` incrementally and removes them.

    The server writes each file in one go (`[`, the traces, `]`) and never rewrites an index,
    so a file that parses is complete. `poll()` reads every file present in index order and
    removes it once read. A file that does not parse may still be being written: it is left
    for the next poll, unless a higher index already existed when it failed and it fails
    again, or its mtime is more than `stale_s` old; then it is removed and counted in
    `corrupt_files` (a disk-full server leaves such truncated files).

    Worked number: a reader that fell behind finds 100 files of 1 MB with `max_bytes` 64 MB:
    it removes the 36 oldest unread (`dropped_files += 36`) and reads the newest 64.

    An OSError while listing, reading or removing (missing or unwritable dir, permission,
    I/O error) sets `error` to a one-line reason and `poll` returns what it had read; the
    caller then turns tracing off and falls back. `error` describes the last poll (None
    after a clean one). The base file `<path>` itself (written only with log_frequency 0)
    is not read.
    """

    def __init__(self, path: str | Path, max_bytes: int = 64 * 2**20, stale_s: float = 5.0,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.stale_s = stale_s
        self._wall_clock = wall_clock
        self._pattern = re.compile(re.escape(self.path.name) + r"\.(\d+)")
        self._failed: dict[int, bool] = {}     # index -> a higher index existed when it first failed
        self._done: set[int] = set()           # read but could not be removed: never read twice
        self.error: str | None = None
        self.files_read = 0
        self.bytes_read = 0
        self.samples_read = 0
        self.corrupt_files = 0
        self.dropped_files = 0

    def _list(self) -> list[tuple[int, Path, int, float]]:
        """(index, path, size, mtime) of every indexed file present and not yet read, by index."""
        found = []
        present: set[int] = set()
        with os.scandir(self.path.parent) as entries:
            for entry in entries:
                match = self._pattern.fullmatch(entry.name)
                if not match:
                    continue
                index = int(match.group(1))
                present.add(index)
                if index in self._done:
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # why: removed between the listing and the stat; nothing to read
                found.append((index, Path(entry.path), st.st_size, st.st_mtime))
        found.sort()
        self._done &= present  # why: bookkeeping only for files still there
        self._failed = {i: v for i, v in self._failed.items() if i in present}
        return found

    def _remove(self, index: int, path: Path) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass  # why: already gone is what we wanted
        except OSError:
            self._done.add(index)  # why: its samples were taken; reading it again would count them twice
            raise

    def _drop_over_cap(self, found: list[tuple[int, Path, int, float]]) -> list[tuple[int, Path, int, float]]:
        total = sum(size for _, _, size, _ in found)
        while found and total > self.max_bytes:
            index, path, size, _ = found.pop(0)
            self._remove(index, path)
            self._failed.pop(index, None)
            self.dropped_files += 1
            total -= size
        return found

    def poll(self) -> list[TraceSample]:
        """Read, parse and remove every complete file not yet read; the samples in index order."""
        self.error = None
        samples: list[TraceSample] = []
        try:
            found = self._drop_over_cap(self._list())
            highest = found[-1][0] if found else -1
            for index, path, _, mtime in found:
                with open(path, "rb") as f:
                    data = f.read()
                parsed = _parse_safely(data)
                if parsed is None:
                    self._after_failure(index, path, mtime, highest)
                    continue
                self._failed.pop(index, None)
                samples.extend(parsed)
                self.files_read += 1
                self.bytes_read += len(data)
                self.samples_read += len(parsed)
                self._remove(index, path)
        except OSError as error:  # why: the caller falls back to counters; it must get what was read
            self.error = f"trace files at {self.path}: {_one_line(error)}"
        return samples

    def _after_failure(self, index: int, path: Path, mtime: float, highest: int) -> None:
        """Leave a file that does not parse for the next poll, or give up on it (see the class doc)."""
        failed_before_with_higher = self._failed.get(index, False)
        too_old = self._wall_clock() - mtime > self.stale_s
        if failed_before_with_higher or too_old:
            self._failed.pop(index, None)
            self.corrupt_files += 1
            log.warning("trace file %s does not parse; removed", path)
            self._remove(index, path)
        else:
            self._failed[index] = highest > index


def _parse_safely(data: bytes) -> list[TraceSample] | None:
    try:
        return _parse(data)
    except Exception:  # noqa: BLE001  why: same belt and braces as parse_trace_text; unparseable = corrupt
        return None


# ---------------------------------------------------------------------------------
# Trace settings over HTTP
# ---------------------------------------------------------------------------------


class TraceApiError(RuntimeError):
    """A trace-settings call failed; the message is one line (callers catch it and fall back)."""


def _with_scheme(url: str) -> str:
    """`127.0.0.1:8000` (as TritonServer.http_url gives it) -> `http://127.0.0.1:8000`."""
    return url if "://" in url else f"http://{url}"


_LEVELS = frozenset({"OFF", "TIMESTAMPS", "TENSORS"})

TRACE_RELEASE_FIXED = (2, 57)   # Triton's first version whose trace release does not free a locked mutex


def trace_release_unsafe(version: str | None) -> bool:
    """Whether this Triton version's request tracing can corrupt its heap: before 2.57 (r25.04) the trace
    manager's release deleted a trace while holding that trace's own mutex, then unlocked the freed memory
    (triton-inference-server/server#7795, "Signal (11) when tracing is enabled", fixed by PR #8144, "Fix segfaults
    in tracing mode after long run"; tracer.cc `TraceManager::TraceRelease`). Every traced request passes there, so
    the odds of a crash grow with the traced requests. False where the version is unknown or not "major.minor...".
    Examples: "2.51.0" -> True, "2.57.0" -> False, "2.60.1" -> False, None -> False."""
    match = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return match is not None and (int(match.group(1)), int(match.group(2))) < TRACE_RELEASE_FIXED


class TraceApi:
    """Triton's trace extension over HTTP: `GET /v2/trace/setting`, `GET|POST /v2/models/<m>/trace/setting`.

    Values go as strings (`{"trace_rate": "5"}`): 2.51 answers a JSON number with HTTP 500
    "attempt to access JSON non-string as string". Every failure raises `TraceApiError`.
    """

    def __init__(self, http_url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> None:
        self.http_url = _with_scheme(http_url).rstrip("/")
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s

    def _url(self, model: str | None) -> str:
        if model is None:
            return f"{self.http_url}/v2/trace/setting"
        return f"{self.http_url}/v2/models/{urllib.parse.quote(model, safe='')}/trace/setting"

    def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {**self.headers, **({"Content-Type": "application/json"} if data is not None else {})}
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            raise TraceApiError(f"{method} {url}: HTTP {error.code}: {_server_error(error)}") from error
        except (OSError, ValueError, http.client.HTTPException) as error:  # refused, timeout, bad URL, cut-off body
            reason = getattr(error, "reason", None) or error
            raise TraceApiError(f"{method} {url}: {' '.join(str(reason).split())[:300]}") from error
        try:
            answer = json.loads(raw)
        except ValueError as error:
            raise TraceApiError(f"{method} {url}: the answer is not JSON") from error
        if not isinstance(answer, dict):
            raise TraceApiError(f"{method} {url}: expected a JSON object, got {type(answer).__name__}")
        return answer

    def setting(self, model: str | None = None) -> dict:
        """The global setting, or the one `model` uses (its own, else the global one)."""
        return self._call("GET", self._url(model))

    def server_version(self) -> str | None:
        """The server's version (`GET /v2`: "2.51.0"), or None where it does not say."""
        version = self._call("GET", f"{self.http_url}/v2").get("version")
        return version if isinstance(version, str) else None

    def trace_file(self) -> str | None:
        """The base path of the trace files, or None when the server was started without one."""
        path = self.setting().get("trace_file")
        if path is not None and not isinstance(path, str):
            raise TraceApiError(f"GET {self._url(None)}: trace_file is {type(path).__name__}, not a string")
        return path or None

    def set_model(self, model: str, *, level: str, rate: int, log_frequency: int) -> dict:
        """Set `model`'s level, 1-in-`rate` sampling and file size (traces per file); its new setting.

        Raises `TraceApiError` if the server refuses or answers with another level than asked
        (e.g. `level` TIMESTAMPS on a server without a trace file: "trace file name is not given").
        """
        if level not in _LEVELS:
            raise TraceApiError(f"trace level must be one of {sorted(_LEVELS)}, got {level!r}")
        for name, value in (("rate", rate), ("log_frequency", log_frequency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TraceApiError(f"trace {name} must be an integer >= 1, got {value!r}")
        body = {"trace_level": [level], "trace_rate": str(rate), "log_frequency": str(log_frequency)}
        answer = self._call("POST", self._url(model), body)
        if answer.get("trace_level") != [level]:
            raise TraceApiError(f"trace setting of {model}: asked for level {level}, "
                                f"the server answered {answer.get('trace_level')!r}")
        return answer

    def off(self, model: str) -> dict:
        """Stop tracing `model`; the server writes the traces it still holds to a new file."""
        return self._call("POST", self._url(model), {"trace_level": ["OFF"]})


def _server_error(error: urllib.error.HTTPError) -> str:
    """Triton's `{"error": "..."}` text if there is one, else the HTTP reason; one line."""
    try:
        raw = error.read()
        text = json.loads(raw).get("error") if raw else None
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        text = None
    return " ".join(str(text or error.reason).split())[:300]


# ---------------------------------------------------------------------------------
# Window arithmetic
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSummary:
    """Traced requests of one model that ended in [`start`, `now`] (controller time, seconds).

    `p50_ms`/`p99_ms`/`max_ms` are of `latency_ms`, `queue_p99_ms` of `queue_ms`,
    `compute_mean_ms` the mean `compute_ms`, `compute_scv` its squared coefficient of variation
    (variance / mean^2) and `compute_quantiles` its quantiles at COMPUTE_PROBS divided by the mean, over
    the `compute_count` samples that carry it; None (or empty) when `count` is 0 (or no sample carries
    that field). Percentiles are nearest-rank (see `nearest_rank`).
    """

    count: int
    start: float
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    queue_p99_ms: float | None = None
    compute_mean_ms: float | None = None
    newest_at: float | None = None
    compute_scv: float | None = None
    compute_count: int = 0
    compute_quantiles: tuple[float, ...] = ()


# the probabilities `TraceSummary.compute_quantiles` are read at: the tail finer (it sets a p99)
COMPUTE_PROBS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


def nearest_rank(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile: the smallest value with at least q of the values at or below it.

    It is always one of the values, never an interpolation, so it is honest for small counts:
    with 100 values the p99 is the 2nd-largest (99 of 100 are at or below it); with 50 or
    fewer it is the largest. Same as numpy's `percentile(..., method="inverted_cdf")`.
    Example: [1, 2, ..., 100] gives p50 = 50 and p99 = 99.
    """
    if not sorted_values:
        return None
    rank = math.ceil(q * len(sorted_values) - 1e-9)  # why: 0.99 * 100 must stay rank 99, not 100 by rounding
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


class TraceWindow:
    """The traced requests of one model, in controller time, and the window arithmetic over them.

    Clocks: a sample's end is on the server's clock; `add` learns the offset to the
    controller's clock from the polls themselves. Every sample was read after it ended, so
    `read_at - end_s >= offset` for each, and the freshest sample of a poll comes closest:
    the offset is the minimum of `read_at - end_s` over the polls of the last
    `offset_horizon_s` (the most recent one if none is that recent). It is an upper bound: a
    sample maps at most that lag late, never early, and never later than the poll that read
    it. Worked number: a server clock 1000 s behind, a file flushed at server time 49.8 and
    read at controller time 1050.0: lag 1000.2; a later poll reads a sample that ended at 59.95
    at 1060.0: lag 1000.05, the offset; the sample that ended at 49.8 maps to 1049.85.
    Mapping happens at query time, so earlier samples also profit from a better estimate.

    `model` (optional) makes `add` ignore the samples of other models. Samples are pruned
    once they map more than `max_age_s` before the newest poll. After a server restart on
    another host (a new clock), call `reset()`.
    """

    def __init__(self, model: str | None = None, max_age_s: float = 120.0, offset_horizon_s: float = 60.0) -> None:
        self.model = model
        self.max_age_s = max_age_s
        self.offset_horizon_s = offset_horizon_s
        self.reset()

    def reset(self) -> None:
        self._lags: deque[tuple[float, float]] = deque()   # (read_at, smallest lag of that poll)
        self._ends: list[float] = []                        # server-clock ends, sorted
        self._rows: list[tuple[float, float | None, float | None]] = []  # (latency, queue, compute)
        self._last_read_at: float | None = None

    def __len__(self) -> int:
        return len(self._ends)

    @property
    def offset_s(self) -> float | None:
        """Controller time minus server time, as estimated; None before the first sample."""
        return min(lag for _, lag in self._lags) if self._lags else None

    @property
    def newest_at(self) -> float | None:
        """Controller time of the newest sample kept; None when there is none."""
        offset = self.offset_s
        return self._ends[-1] + offset if self._ends and offset is not None else None

    def add(self, samples: Iterable[TraceSample], read_at: float) -> None:
        """Record the samples of one poll made at controller time `read_at`."""
        fresh = [s for s in samples if (self.model is None or s.model == self.model) and math.isfinite(s.end_s)]
        self._last_read_at = read_at if self._last_read_at is None else max(self._last_read_at, read_at)
        if fresh:
            self._lags.append((read_at, min(read_at - s.end_s for s in fresh)))
        for s in fresh:
            i = bisect.bisect_right(self._ends, s.end_s)
            self._ends.insert(i, s.end_s)
            self._rows.insert(i, (s.latency_ms, s.queue_ms, s.compute_ms))
        self._prune()

    def _prune(self) -> None:
        while len(self._lags) > 1 and self._lags[0][0] < self._last_read_at - self.offset_horizon_s:
            self._lags.popleft()
        offset = self.offset_s
        if offset is None:
            return
        cut = bisect.bisect_left(self._ends, self._last_read_at - self.max_age_s - offset)
        del self._ends[:cut], self._rows[:cut]

    def summary(self, now: float, window_s: float, since: float | None = None) -> TraceSummary:
        """Summarise the samples that ended in [max(now - window_s, since), now] (controller time).

        Worked number: 100 samples with latencies 1..100 ms in the window give count 100,
        p50 50, p99 99 (the 2nd-largest), max 100.
        """
        start = now - window_s if since is None else max(now - window_s, since)
        offset = self.offset_s
        if offset is None:
            return TraceSummary(count=0, start=start)
        lo = bisect.bisect_left(self._ends, start - offset)
        hi = bisect.bisect_right(self._ends, now - offset)
        rows = self._rows[lo:hi]
        if not rows:
            return TraceSummary(count=0, start=start)
        latencies = sorted(r[0] for r in rows)
        queues = sorted(r[1] for r in rows if r[1] is not None)
        computes = [r[2] for r in rows if r[2] is not None]
        mean = sum(computes) / len(computes) if computes else None
        scv = None if not mean or mean <= 0 else sum((c - mean) ** 2 for c in computes) / len(computes) / mean ** 2
        ranked = sorted(computes)
        quantiles = () if scv is None else tuple(nearest_rank(ranked, p) / mean for p in COMPUTE_PROBS)
        return TraceSummary(
            count=len(rows),
            start=start,
            p50_ms=nearest_rank(latencies, 0.50),
            p99_ms=nearest_rank(latencies, 0.99),
            max_ms=latencies[-1],
            queue_p99_ms=nearest_rank(queues, 0.99),
            compute_mean_ms=mean,
            newest_at=self._ends[hi - 1] + offset,
            compute_scv=scv,
            compute_count=len(computes),
            compute_quantiles=quantiles,
        )


# ---------------------------------------------------------------------------------
# How much to trace
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSampling:
    """Trace 1 request in `rate`; the server writes a file every `log_frequency` traces."""

    rate: int
    log_frequency: int


def choose_sampling(arrival_rps: float, samples_per_s: float = 20.0, flush_every_s: float = 1.0,
                    max_rate: int = 1000) -> TraceSampling:
    """The sampling that keeps about `samples_per_s` traces a second, in a file every `flush_every_s`.

    rate = max(1, floor(arrival / samples_per_s)) (at most `max_rate`), and
    log_frequency = max(1, round(arrival / rate * flush_every_s)) traces per file.

    Worked numbers (defaults):
    * 1000 req/s: rate 50 (20 traces/s), log_frequency 20: a file a second.
    * 300 req/s: rate 15, log_frequency 20.
    * 5 req/s: rate 1 (every request is traced, only 5 traces/s), log_frequency 5: a file per
      ~5 traces, still one a second. A 20-s window then holds ~100 samples, so its p99
      (nearest rank) is about the second-largest latency: the p99 of a slow model is coarse.
    * 0 req/s (or a NaN, infinite or negative rate: no data): rate 1, log_frequency 1.
    * 50,000 req/s: rate capped at 1000 (50 traces/s), log_frequency 50.
    """
    if not (samples_per_s > 0 and math.isfinite(samples_per_s)):
        raise ValueError(f"samples_per_s must be a finite number > 0, got {samples_per_s!r}")
    if not (flush_every_s > 0 and math.isfinite(flush_every_s)):
        raise ValueError(f"flush_every_s must be a finite number > 0, got {flush_every_s!r}")
    if isinstance(max_rate, bool) or not isinstance(max_rate, int) or max_rate < 1:
        raise ValueError(f"max_rate must be an integer >= 1, got {max_rate!r}")
    measured = isinstance(arrival_rps, (int, float)) and math.isfinite(arrival_rps) and arrival_rps > 0
    arrival = float(arrival_rps) if measured else 0.0  # why: a NaN or infinite rate is no measurement
    rate = min(max_rate, max(1, math.floor(arrival / samples_per_s)))
    return TraceSampling(rate, max(1, round(arrival / rate * flush_every_s)))


HYSTERESIS = 1.5


def needs_change(current: TraceSampling | None, wanted: TraceSampling) -> bool:
    """Whether to send `wanted` to the server, given the setting it has (None: none yet).

    Change when the rate, or the log frequency, differs from the current one by more than a
    factor 1.5 either way. The log frequency counts too: below `samples_per_s` req/s the rate
    stays 1 while the traces per file follow the arrival rate; left at 35 when the rate drops
    from 35 to 5 req/s, the server would write a file every 7 s instead of every second.
    Example: current rate 10; wanted 14 or 7 -> False; wanted 16 or 6 -> True.
    """
    if current is None:
        return True

    def far(a: int, b: int) -> bool:
        return a > b * HYSTERESIS or b > a * HYSTERESIS

    return far(wanted.rate, current.rate) or far(wanted.log_frequency, current.log_frequency)


__all__ = [
    "TraceSample", "TraceSummary", "TraceSampling", "TraceFiles", "TraceApi", "TraceApiError", "TraceWindow",
    "parse_trace_text", "nearest_rank", "choose_sampling", "needs_change",
]
