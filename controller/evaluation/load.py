"""`python -m controller load`: open-loop traffic to one model of a running server, and what came back.

    python -m controller load --model sim_accel --rate 200 --seconds 60        # the serve running here
    python -m controller load --model sim_accel --trace scripts/scenarios/shift.yaml
    python -m controller load --model m --rate 50 --url 127.0.0.1:8001          # a server started otherwise

The way to watch the controller work (`status` in another terminal) without writing a client. Requests go out
at Poisson times of the given rate (or of a trace's phases, the bench's format) whether or not earlier ones
have finished, and each latency counts from its *scheduled* time, so a client that falls behind shows up in
the numbers instead of hiding the server's queue (closed-loop tools such as perf_analyzer's concurrency mode
wait for answers before sending more). Every `--every` seconds one line: the requests sent, the answers and
failures that came back in those seconds and their p50/p99. At the end a summary, per phase where the trace has
several, and how far the client's sends fell behind its schedule (where that is large, the client, not the
server, set the latency). Ctrl-C (or SIGTERM) stops sending, waits for the requests in flight, then summarises.

Inputs are random tensors built from the model's live config (every input; a variable dimension becomes 1 unless
`--shape NAME:D1,...` sets it; batch 1 where the model batches, `--batch-size N` for more), the same tensors in
every request, or the user's requests from `--input-data FILE` (perf_analyzer's JSON format), sent in turn: see
`inputs`. An input whose variable dims go out as 1 is named before the run. Only loopback
addresses are accepted, as everywhere in this project's load generators. Exit status: 0 when every request
sent came back, 1 when some failed (the summary counts them by error), 130 after Ctrl-C.
"""
from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import loadgen
from .inputs import InputSpec, InputSpecError, describe, variable_notes

# why a cap: every request's record is kept for the summary (~300 bytes each, measured as the process's peak RSS
# over 4,526 and 22,559 requests: about 300 MB at the cap); 1 M is 83 min at 200 req/s
MAX_REQUESTS = 1_000_000


class LoadError(Exception):
    """An unusable target or a failed run: one line (exit 1)."""


class LoadInputError(LoadError):
    """A bad input: the rate, the trace, the address (exit 2)."""


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    model: str
    url: str                       # host:port of the protocol's endpoint (loopback)
    protocol: str = "grpc"
    rate_rps: float | None = None
    seconds: float = 60.0
    trace: Path | None = None
    every_s: float = 5.0
    timeout_s: float = 10.0
    seed: int = 0
    sla_ms: float | None = None
    json_out: Path | None = None
    inputs: InputSpec | None = None        # --shape / --input-data / --batch-size

    @property
    def batch_size(self) -> int:
        """Items a request carries (--batch-size, in the input spec); 1 without one."""
        return 1 if self.inputs is None else self.inputs.batch_size


def build_trace(opts: LoadOptions) -> loadgen.Trace:
    if (opts.rate_rps is None) == (opts.trace is None):
        raise LoadInputError("give either --rate R (requests per second, for --seconds) or --trace FILE")
    try:
        if opts.trace is not None:
            return loadgen.load_trace(opts.trace)
        return loadgen.load_trace({"phases": [{"name": "load", "duration_s": opts.seconds,
                                               "rate_rps": opts.rate_rps}]})
    except loadgen.TraceError as e:
        raise LoadInputError(f"trace: {e}") from None
    except OSError as e:
        raise LoadInputError(f"trace: cannot read {opts.trace}: {e.strerror or e}") from None


def model_config(protocol: str, url: str, model: str, timeout_s: float = 10.0) -> dict:
    """The model's live config from the server, after checking that it answers and the model is ready."""
    from tritonclient.utils import InferenceServerException
    try:
        if protocol == "http":
            import tritonclient.http as client_module
            client = client_module.InferenceServerClient(url=url, connection_timeout=timeout_s,
                                                         network_timeout=timeout_s)
        else:
            import tritonclient.grpc as client_module
            client = client_module.InferenceServerClient(url=url)
    except Exception as e:  # noqa: BLE001  (a malformed address is the client's ValueError or its own)
        raise LoadInputError(f"cannot use {url!r} ({protocol}): {_text(e)}") from None
    try:
        try:
            live = client.is_server_live(**_grpc_timeout(protocol, timeout_s))
        except Exception as e:  # noqa: BLE001  (the HTTP client raises the socket's own errors)
            raise LoadError(f"Triton at {url} ({protocol}) is not reachable: {_text(e)}") from None
        if not live:
            raise LoadError(f"Triton at {url} ({protocol}) answers but is not live")
        if not client.is_model_ready(model, **_grpc_timeout(protocol, timeout_s)):
            why = _config_error(client, protocol, model, timeout_s)
            raise LoadError(f"model {model!r} is not ready on {url}: {why}")
        if protocol == "http":
            return client.get_model_config(model)
        return client.get_model_config(model, as_json=True, **_grpc_timeout(protocol, timeout_s))["config"]
    except (InferenceServerException, OSError) as e:   # why: the server went away, or timed out, mid-way
        raise LoadError(f"cannot read the config of {model!r} from {url}: {_text(e)}") from None
    finally:
        client.close()


def unsupported(config: dict) -> str | None:
    """Why one-response requests without a sequence cannot load this model (None: they can)."""
    from ..modelkind import classify
    kind = classify(config)
    if kind.decoupled:
        return ("is decoupled (its responses stream): load sends requests that take one response each; "
                "drive it with a streaming client")
    if kind.sequence_batching:
        return ("is stateful (a sequence batcher): every request needs a sequence id and start/end flags, "
                "which load does not send; drive it with your own sequences")
    return None


def _grpc_timeout(protocol: str, timeout_s: float) -> dict:
    return {"client_timeout": timeout_s} if protocol == "grpc" else {}


def _config_error(client: Any, protocol: str, model: str, timeout_s: float) -> str:
    """Why the server will not serve `model`: its own words where it has some (unknown, still loading, ...)."""
    try:
        client.get_model_config(model, **_grpc_timeout(protocol, timeout_s))
    except Exception as e:  # noqa: BLE001
        return _text(e)
    return "loaded, not ready (loading or unloading?)"


def _text(e: BaseException) -> str:
    message = getattr(e, "message", None)
    text = message() if callable(message) else str(e)
    return " ".join(str(text).split())[:300]


class Live:
    """The records as they come back, and one line per interval."""

    def __init__(self, schedule_s: np.ndarray, sla_ms: float | None):
        self.schedule_s = schedule_s
        self.sla_ms = sla_ms
        self.records: list[loadgen.RequestRecord] = []
        self._interval: list[loadgen.RequestRecord] = []
        self._back = 0            # records of requests sent (or due) that are final
        self._last_s = 0.0
        self.stop_s: float | None = None   # when Ctrl-C stopped the sending

    def add(self, record: loadgen.RequestRecord) -> None:
        self.records.append(record)
        if record.error != loadgen.ERROR_NOT_SENT:
            self._interval.append(record)
            self._back += 1

    @property
    def pending(self) -> bool:
        """Records came back since the last line."""
        return bool(self._interval)

    def line(self, now_s: float) -> str:
        """What came back since the last line; `sent` counts the schedule's offsets due in those seconds."""
        lo = bisect.bisect_left(self.schedule_s, self._last_s)
        hi = bisect.bisect_left(self.schedule_s, now_s if self.stop_s is None else min(now_s, self.stop_s))
        width_s = max(1e-9, now_s - self._last_s)
        done = self._interval
        ok_ms = np.array([1e3 * r.latency_s for r in done if r.ok and r.latency_s is not None])
        failed = sum(1 for r in done if not r.ok)
        in_flight = hi - self._back
        text = (f"{now_s:7.1f} s  sent {hi - lo:6d} ({(hi - lo) / width_s:7.1f}/s)  ok {len(ok_ms) / width_s:7.1f}/s  "
                f"failed {failed:4d}")
        if ok_ms.size:
            text += f"  p50 {np.percentile(ok_ms, 50):7.2f} ms  p99 {np.percentile(ok_ms, 99):7.2f} ms"
        else:
            text += "  (no answers)"
        text += f"  in flight {max(0, in_flight)}"
        self._interval, self._last_s = [], now_s
        return text


def summarize(records: list[loadgen.RequestRecord], trace: loadgen.Trace, elapsed_s: float,
              sla_ms: float | None) -> dict:
    """Counts, latency percentiles (from each request's scheduled time) and the client's send lag, in total and
    per phase. Requests never sent (stopped) are left out; rates use the seconds the run actually sent."""
    sent = [r for r in records if r.error != loadgen.ERROR_NOT_SENT]
    span_s = max(1e-9, min(elapsed_s, trace.duration_s))
    doc = _counts(sent, span_s, sla_ms)
    doc["send_lag_p99_ms"] = loadgen.send_lag_p99_ms(sent)
    doc["seconds"] = span_s
    phases = []
    for p in trace.phases:
        if p.start_s >= span_s:
            break
        mine = [r for r in sent if p.start_s <= r.scheduled_s < p.end_s]
        phases.append({"name": p.name, "start_s": p.start_s, **_counts(mine, min(p.end_s, span_s) - p.start_s, sla_ms)})
    doc["phases"] = phases
    return doc


def _counts(records: list[loadgen.RequestRecord], seconds: float, sla_ms: float | None) -> dict:
    ok_ms = np.array([1e3 * r.latency_s for r in records if r.ok and r.latency_s is not None])
    doc: dict[str, Any] = {
        "requests": len(records), "ok": int(ok_ms.size), "failed": len(records) - int(ok_ms.size),
        "sent_rps": len(records) / max(1e-9, seconds),
        "errors": dict(Counter(r.error or "unknown" for r in records if not r.ok)),
    }
    for q in (50, 90, 99):
        doc[f"p{q}_ms"] = float(np.percentile(ok_ms, q)) if ok_ms.size else None
    doc["max_ms"] = float(ok_ms.max()) if ok_ms.size else None
    if sla_ms is not None:
        good = int((ok_ms <= sla_ms).sum())
        doc["within_sla"] = good
        doc["goodput_rps"] = good / max(1e-9, seconds)
    return doc


def format_summary(doc: dict, model: str, where: str, sla_ms: float | None) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [f"{model} via {where}: {doc['requests']} requests in {doc['seconds']:.1f} s "
             f"({doc['sent_rps']:.1f}/s): {doc['ok']} ok, {doc['failed']} failed"]
    if doc["errors"]:
        by_count = sorted(doc["errors"].items(), key=lambda x: -x[1])
        lines.append("  failed: " + "; ".join(f"{n} x {e}" for e, n in by_count))
    lines.append(f"  latency from each request's scheduled time: p50 {ms(doc['p50_ms'])} ms, p90 {ms(doc['p90_ms'])}"
                 f" ms, p99 {ms(doc['p99_ms'])} ms, max {ms(doc['max_ms'])} ms")
    if sla_ms is not None and doc["requests"]:
        lines.append(f"  within {sla_ms:g} ms: {doc['within_sla']} ({100.0 * doc['within_sla'] / doc['requests']:.1f}%"
                     f" of those sent), goodput {doc['goodput_rps']:.1f}/s")
    if len(doc["phases"]) > 1:
        lines.append(f"  {'phase':<16} {'start s':>8} {'sent/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'failed':>7}")
        for p in doc["phases"]:
            lines.append(f"  {p['name'][:16]:<16} {p['start_s']:8.1f} {p['sent_rps']:8.1f} {ms(p['p50_ms']):>8} "
                         f"{ms(p['p99_ms']):>8} {p['failed']:7d}")
    lag = doc["send_lag_p99_ms"]
    if lag is not None:
        note = f"  client: its sends fell up to {lag:.1f} ms (p99) behind schedule (counted in the latencies above)"
        if loadgen.client_bound(lag, doc["p99_ms"]):
            note += ("; that is a large part of the p99, set by the client, not the server: lower the rate, or run "
                     "the client where a core is free")
        lines.append(note)
    return "\n".join(lines)


def run_load(opts: LoadOptions, out: Callable[[str], None] = print) -> tuple[dict, bool]:
    """Drive the load, printing a line every `every_s`; return (summary, stopped by Ctrl-C)."""
    trace = build_trace(opts)
    created = False
    if opts.json_out is not None:       # why: found out before the run, not after minutes of it
        try:
            opts.json_out.parent.mkdir(parents=True, exist_ok=True)
            created = not opts.json_out.exists()
            with open(opts.json_out, "a"):
                pass
        except OSError as e:
            raise LoadInputError(f"--json: cannot write {opts.json_out}: {e.strerror or e}") from None
    try:
        return _run_load(opts, trace, out)
    except BaseException:
        if created:                     # why: no empty file left where a script looks for a summary
            opts.json_out.unlink(missing_ok=True)
        raise


def _run_load(opts: LoadOptions, trace: loadgen.Trace, out: Callable[[str], None]) -> tuple[dict, bool]:
    try:
        url = loadgen.require_loopback(opts.url)
    except ValueError as e:
        raise LoadInputError(str(e)) from None
    if trace.expected_requests() > MAX_REQUESTS:
        raise LoadInputError(f"about {trace.expected_requests():,.0f} requests: at most {MAX_REQUESTS:,} in one run "
                             "(each one's record is kept for the summary); shorten it, lower the rate, or run it again")
    try:
        schedule = loadgen.poisson_schedule(trace, opts.seed, MAX_REQUESTS)
    except loadgen.TraceError as e:
        raise LoadInputError(str(e)) from None
    config = model_config(opts.protocol, url, opts.model, opts.timeout_s)
    why = unsupported(config)
    if why:
        raise LoadError(f"model {opts.model!r} {why}")
    try:        # a --batch-size the model cannot take is refused here too (inputs.input_sets)
        make_inputs = loadgen.inputs_from_config(config, opts.seed, spec=opts.inputs)
    except InputSpecError as e:
        raise LoadInputError(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
        raise LoadError(f"cannot build inputs for {opts.model!r} from its config: {e}") from None
    for note in variable_notes(config, opts.inputs):
        out(f"note: {note}")
    live = Live(schedule, opts.sla_ms)
    stopped = {"at": None}
    items = f" of {opts.batch_size} items" if opts.batch_size > 1 else ""
    sets = make_inputs()
    if isinstance(sets, list):
        items += f" ({len(sets)} distinct, from {opts.inputs.source} in turn)" if len(sets) > 1 else \
            f" (from {opts.inputs.source})"
    out(f"sending {len(schedule)} requests{items} to {opts.model} over {trace.duration_s:g} s via {url} "
        f"({opts.protocol}); a line every {opts.every_s:g} s; Ctrl-C stops")

    async def main() -> float:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        clock = {"t0": loop.time()}     # the run's time 0, set again when it starts sending
        tasks: list[asyncio.Future] = []

        def on_start() -> None:
            clock["t0"] = loop.time()
            tasks.append(asyncio.ensure_future(_report(live, loop, clock["t0"], opts.every_s, trace.duration_s, out)))

        def on_sigint() -> None:
            stopped["at"] = live.stop_s = loop.time() - clock["t0"]
            stop.set()
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)         # a second Ctrl-C (or SIGTERM) quits at once
            out(f"stopping at {stopped['at']:.1f} s: waiting for the requests in flight (Ctrl-C again quits now)")

        with _sigint(loop, on_sigint):
            try:
                await loadgen.run_open_loop(url, opts.model, schedule, make_inputs, protocol=opts.protocol,
                                            timeout_s=opts.timeout_s, on_record=live.add, on_start=on_start,
                                            stop=stop)
            except ConnectionError as e:
                raise LoadError(str(e)) from None
            finally:
                for task in tasks:
                    task.cancel()
        return loop.time() - clock["t0"]

    elapsed_s = asyncio.run(main())
    span_s = stopped["at"] if stopped["at"] is not None else elapsed_s
    doc = summarize(live.records, trace, span_s, opts.sla_ms)
    doc.update(model=opts.model, url=url, protocol=opts.protocol, stopped_at_s=stopped["at"],
               inputs=describe(opts.inputs), batch_size=opts.batch_size)
    out(format_summary(doc, opts.model, f"{url} ({opts.protocol})", opts.sla_ms))
    if opts.json_out is not None:
        try:
            opts.json_out.parent.mkdir(parents=True, exist_ok=True)
            opts.json_out.write_text(json.dumps(doc, indent=1))
        except OSError as e:
            raise LoadError(f"--json: cannot write {opts.json_out}: {e.strerror or e}") from None
        out(f"wrote {opts.json_out}")
    return doc, stopped["at"] is not None


async def _report(live: Live, loop: asyncio.AbstractEventLoop, t0: float, every_s: float, duration_s: float,
                  out: Callable[[str], None]) -> None:
    k = 1
    while True:
        await asyncio.sleep(max(0.0, t0 + k * every_s - loop.time()))
        now_s = loop.time() - t0
        if now_s > duration_s + 1e-6 and not live.pending:
            k += 1
            continue        # after the schedule: a line only when answers still come back
        out(live.line(now_s))
        k += 1


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _sigint:
    """Ctrl-C, or SIGTERM, sets the run's stop event instead of cancelling it (a cancelled gRPC call can crash
    Triton 2.51, and the server may be a user's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handler: Callable[[], None]):
        self.loop, self.handler, self.installed = loop, handler, False

    def __enter__(self):
        try:
            for sig in STOP_SIGNALS:
                self.loop.add_signal_handler(sig, self.handler)
            self.installed = True
        except (RuntimeError, ValueError, NotImplementedError):   # not the main thread (tests)
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            for sig in STOP_SIGNALS:
                self.loop.remove_signal_handler(sig)


def flush_print(text: str) -> None:
    print(text, flush=True)
