"""What request tracing costs: the same open-loop schedule with tracing off and on, side by side.

`python -m controller bench --trace-overhead --model M` runs, on fresh servers, alternating
off / on / off / on (`rounds` times each, so drift on a noisy machine hits both arms alike):

* a **steady** phase at `steady_rps` (below capacity): the client-side p50/p99 tell what tracing
  adds to each request's latency;
* an **overload** phase at `overload_rps`: if that is above what the model serves, completions per
  second there are the server's throughput and on/off is tracing's throughput cost (if the load
  generator cannot drive that much, completions equal the offered rate: the report shows it);
* the tritonserver process's own CPU time per request (it writes the traces), on vs off: a cost
  figure that needs no saturation.

With tracing on, the controller's own `TraceFeed` sets the model's trace rate exactly as the
controller does (about `samples_per_s` sampled requests a second, adapted each second to the
offered rate) and reads and removes the trace files, so the cost measured is the one users get.
The model runs at a fixed configuration (`settings`); no controller changes it.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np

from .arm import proc_cpu_s
from .loadgen import load_trace, make_inputs_from_config, poisson_schedule, run_open_loop_sync, summarize
from ..types import Settings


@dataclasses.dataclass
class OverheadOptions:
    model: str = "sim_accel"
    repository: Path | None = None
    out: Path = Path("results/trace_overhead")
    settings: Settings = Settings(1, 0)
    steady_rps: float = 200.0
    overload_rps: float = 500.0
    steady_s: float = 20.0
    overload_s: float = 15.0
    rounds: int = 2
    samples_per_s: float = 20.0
    sla_ms: float = 40.0
    seed: int = 0


def _arm(opts: OverheadOptions, tracing: bool, schedule: np.ndarray, trace) -> dict:
    from ..actuation import Actuator, TritonControl
    from ..observer import TraceFeed
    from ..server import DEFAULT_REPOSITORY, ServerError, ServerOptions, TritonServer, free_port
    from ..traces import TraceApi

    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            models=[opts.model], repository=opts.repository or DEFAULT_REPOSITORY)
    with TritonServer(options) as server:
        control = TritonControl(server.grpc_url, server.http_url)
        try:
            if not Actuator(control).apply(opts.model, opts.settings).ok:
                raise ServerError(f"cannot apply {opts.settings} to {opts.model}")
        finally:
            control.close()
        make_inputs = make_inputs_from_config(server.http_url, opts.model)
        # forced: this measures tracing, whatever the server's version (the controller's `tracing: auto` leaves
        # a Triton < 2.57 untraced)
        feed = TraceFeed(TraceApi(server.http_url), samples_per_s=opts.samples_per_s, forced=True) if tracing else None
        done = threading.Event()
        read = {"samples": 0, "rates": set()}
        t0 = time.monotonic()

        def follow() -> None:
            # what the controller does each tick: set the rate for the offered load, read and remove files
            while not done.wait(1.0):
                now = time.monotonic()
                feed.start()
                feed.adapt(opts.model, trace.rate_at(min(now - t0, trace.duration_s - 1e-6)), now)
                read["samples"] += sum(len(v) for v in feed.poll(now, traffic=True).values())
                if opts.model in feed.sampling:
                    read["rates"].add(feed.sampling[opts.model].rate)

        follower = threading.Thread(target=follow, daemon=True) if feed is not None else None
        cpu0 = proc_cpu_s(server.process.pid)
        if follower is not None:
            feed.start()
            feed.adapt(opts.model, trace.rate_at(0.0), time.monotonic())
            follower.start()
        try:
            records = run_open_loop_sync(server.grpc_url, opts.model, schedule, make_inputs, protocol="grpc",
                                         timeout_s=10.0)
            cpu1 = proc_cpu_s(server.process.pid)
        finally:
            done.set()
            if follower is not None:
                follower.join(timeout=5)
                feed.stop()
    s = summarize(records, trace, opts.sla_ms)
    steady = s.phases[0]
    return {"tracing": tracing, "steady_p50_ms": steady.p50_ms, "steady_p99_ms": steady.p99_ms,
            "overload_completed_rps": _completed_rps(records, trace.phases[1]),
            "failed": s.totals.failed,
            # the tritonserver process itself (frontends, scheduler, trace writer), not the model's stub processes
            "server_cpu_ms_per_request": (None if cpu0 is None or cpu1 is None or not s.totals.ok else
                                          1000.0 * (cpu1 - cpu0) / s.totals.ok),
            "samples_read": read["samples"] if tracing else 0,
            "trace_rates": sorted(read["rates"]) if tracing else []}


OVERLOAD_SKIP_S = 2.0   # the first seconds of the overload phase: the queue is still building


def _completed_rps(records, phase) -> float:
    """Answers that came back during the overload phase (after its first seconds), per second: with a
    queue that only grows there, this is what the server can do. Example: 4,160 answers in the 13 s
    from 22 s to 35 s -> 320/s."""
    start, end = phase.start_s + OVERLOAD_SKIP_S, phase.start_s + phase.duration_s
    return sum(1 for r in records if r.ok and r.done_s is not None and start <= r.done_s < end) / (end - start)


KEYS = ("steady_p50_ms", "steady_p99_ms", "overload_completed_rps", "server_cpu_ms_per_request")


def run_trace_overhead(opts: OverheadOptions, log=print) -> dict:
    trace = load_trace({"phases": [
        {"name": "steady", "duration_s": opts.steady_s, "rate_rps": opts.steady_rps},
        {"name": "overload", "duration_s": opts.overload_s, "rate_rps": opts.overload_rps}]})
    schedule = poisson_schedule(trace, opts.seed, 2_000_000)
    runs = []
    for k in range(opts.rounds):
        for tracing in (False, True):
            t = time.monotonic()
            run = _arm(opts, tracing, schedule, trace)
            runs.append(run)
            log(f"round {k + 1}, tracing {'on ' if tracing else 'off'}: steady p99 {run['steady_p99_ms']:.1f} ms, "
                f"overload throughput {run['overload_completed_rps']:.1f}/s, {run['samples_read']} samples read "
                f"({time.monotonic() - t:.0f} s)")

    def mean(key: str, tracing: bool) -> float:
        return float(np.mean([r[key] for r in runs if r["tracing"] == tracing]))

    doc = {"model": opts.model, "settings": dataclasses.asdict(opts.settings), "steady_rps": opts.steady_rps,
           "overload_rps": opts.overload_rps, "rounds": opts.rounds, "samples_per_s": opts.samples_per_s,
           "requests_per_run": int(len(schedule)), "runs": runs,
           "off": {k: round(mean(k, False), 3) for k in KEYS},
           "on": {k: round(mean(k, True), 3) for k in KEYS}}
    doc["throughput_on_vs_off"] = round(doc["on"]["overload_completed_rps"] / doc["off"]["overload_completed_rps"], 4)
    doc["steady_p99_on_vs_off"] = round(doc["on"]["steady_p99_ms"] / doc["off"]["steady_p99_ms"], 4)
    doc["server_cpu_on_vs_off"] = round(doc["on"]["server_cpu_ms_per_request"] / doc["off"]["server_cpu_ms_per_request"], 4)
    doc["failed_requests"] = sum(r["failed"] for r in runs)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "trace_overhead.json").write_text(json.dumps(doc, indent=1))
    return doc


def format_overhead(doc: dict) -> str:
    return (f"tracing overhead on {doc['model']} ({doc['rounds']} rounds each, same schedule, "
            f"~{doc['samples_per_s']:g} sampled requests/s):\n"
            f"  overload throughput ({doc['overload_rps']:g} req/s offered): off {doc['off']['overload_completed_rps']:.1f}/s, "
            f"on {doc['on']['overload_completed_rps']:.1f}/s, on/off {doc['throughput_on_vs_off']:.3f}\n"
            f"  steady p99 ({doc['steady_rps']:g} req/s): off {doc['off']['steady_p99_ms']:.1f} ms, "
            f"on {doc['on']['steady_p99_ms']:.1f} ms, on/off {doc['steady_p99_on_vs_off']:.3f}\n"
            f"  tritonserver CPU per request: off {doc['off']['server_cpu_ms_per_request']:.3f} ms, "
            f"on {doc['on']['server_cpu_ms_per_request']:.3f} ms, on/off {doc['server_cpu_on_vs_off']:.3f}; "
            f"failed requests {doc['failed_requests']}")
