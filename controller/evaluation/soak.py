"""Reload soak: apply N reloads to a model under open-loop load and count every request lost.

`python -m controller soak --reloads N --out DIR` starts its own tritonserver (repository API behind
a generated key) or uses a running one (`--url`, loopback only), drives a Poisson open-loop load
(`controller/evaluation/loadgen.py`, gRPC) and meanwhile applies N reloads through the controller's own
`Actuator`, alternating

* an instance-only change (count base <-> base+1): Triton updates instances in place, and
* a delay change (max_queue_delay_us base <-> base+500): a full reload (a second copy loads, then
  the first is unloaded).

It writes `DIR/soak.json`: `reloads`, `requests`, `failed_requests`, `client_errors` (error text ->
count), `server_failures` (the increase of Triton's `nv_inference_request_failure` for the model over
the run, read before, after every reload and at the end, so a counter reset loses nothing),
`server_successes`, the reload kinds and their durations, and one record per reload. A reload whose
`/v2/models/<m>/stats` counters did not restart was not a full reload (`stats_restarted`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..actuation import Actuator, TritonControl, has_dynamic_batching, settings_of
from .inputs import InputSpec, InputSpecError
from .loadgen import inputs_from_config, load_trace, poisson_schedule, require_loopback, run_open_loop
from ..server import DEFAULT_REPOSITORY, ServerError, ServerOptions, TritonServer, free_port
from ..signals import Scraper
from ..types import Settings

log = logging.getLogger("controller.evaluation.soak")

ADMIN_HEADER = "admin-key"
DELAY_STEP_US = 500          # the full reloads toggle the delay by this much
SEGMENT_S = 2.0              # the load runs as back-to-back open-loop segments, so it can stop when the reloads do
WARMUP_S = 1.0               # load before the first reload
TAIL_S = 1.0                 # load after the last reload


class SoakError(ValueError):
    """Bad soak input (a usage error): the message names the option."""


@dataclasses.dataclass
class SoakOptions:
    reloads: int
    out: Path
    rate_rps: float = 50.0
    model: str = "sim_accel"
    repository: Path = DEFAULT_REPOSITORY
    url: str | None = None                 # HTTP host:port of a running server; None: start one
    grpc_url: str | None = None            # default: the HTTP port + 1
    metrics_url: str | None = None         # default: http://host:(HTTP port + 2)/metrics
    auth_header: str | None = None         # with --url: the repository-API header, value from auth_key_env
    auth_key_env: str = "TRITON_ADMIN_KEY"
    gap_s: float = 0.5                     # pause between two reloads
    seed: int = 0
    request_timeout_s: float = 10.0
    protocols: tuple[str, ...] = ("grpc", "http")   # clients of each at once; the offered rate is split evenly
    inputs: InputSpec | None = None        # --shape / --input-data (default: random values, variable dims 1)


# ---- counters -------------------------------------------------------------------------------------

class CounterTracker:
    """The increase of a cumulative counter over many readings; a decrease is a reset (the new value
    counts from zero). Example: 5, 7, 2, 4 -> (7-5) + 2 + (4-2) = 6 with one reset."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.total = 0.0
        self.resets = 0
        self.missed = 0

    def update(self, value: float | None) -> None:
        if value is None:
            self.missed += 1
            return
        if self.last is not None:
            if value >= self.last:
                self.total += value - self.last
            else:
                self.total += value
                self.resets += 1
        self.last = value


# ---- load -----------------------------------------------------------------------------------------

class LoadThread(threading.Thread):
    """Open-loop Poisson load in back-to-back segments of SEGMENT_S until `stop` is set.

    Every segment is scheduled on the same grid (segment k starts k x SEGMENT_S after the first), so
    the offered rate has no gaps; the records of all segments are kept.
    """

    def __init__(self, url: str, model: str, make_inputs, rate_rps: float, seed: int, timeout_s: float,
                 protocol: str = "grpc"):
        super().__init__(name=f"soak-load-{protocol}", daemon=True)
        self.url, self.model, self.make_inputs, self.protocol = url, model, make_inputs, protocol
        self.rate_rps, self.seed, self.timeout_s = rate_rps, seed, timeout_s
        self.stop = threading.Event()
        self.records: list = []
        self.error: BaseException | None = None
        self.segments = 0

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        trace = load_trace({"phases": [{"name": "soak", "duration_s": SEGMENT_S, "rate_rps": self.rate_rps}]})
        cap = max(100, int(self.rate_rps * SEGMENT_S * 3))
        t0 = loop.time()
        tasks = []
        while not self.stop.is_set():
            schedule = poisson_schedule(trace, seed=self.seed * 100_003 + self.segments, max_requests=cap)
            tasks.append(asyncio.create_task(run_open_loop(self.url, self.model, schedule, self.make_inputs,
                                                           protocol=self.protocol, timeout_s=self.timeout_s)))
            self.segments += 1
            next_at = t0 + self.segments * SEGMENT_S
            while not self.stop.is_set() and loop.time() < next_at:
                await asyncio.sleep(min(0.05, max(0.0, next_at - loop.time())))
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
            self.records.extend(result)


# ---- the soak -------------------------------------------------------------------------------------

def _urls(opts: SoakOptions) -> tuple[str, str, str]:
    """(http, grpc, metrics) of a running server, checked to be loopback."""
    try:
        http = require_loopback(opts.url)
    except ValueError as e:
        raise SoakError(f"--url: {e}") from None
    host, port = http.rsplit(":", 1)
    try:
        grpc = require_loopback(opts.grpc_url) if opts.grpc_url else f"{host}:{int(port) + 1}"
        metrics = opts.metrics_url or f"http://{host}:{int(port) + 2}/metrics"
        require_loopback(metrics.split("/metrics")[0])
    except ValueError as e:
        raise SoakError(f"--grpc-url/--metrics-url: {e}") from None
    return http, grpc, metrics


def _headers(opts: SoakOptions) -> dict[str, str]:
    if not opts.auth_header:
        return {}
    value = os.environ.get(opts.auth_key_env)
    if not value:
        raise SoakError(f"--auth-header is set but the environment variable {opts.auth_key_env} is empty")
    return {opts.auth_header: value}


def _durations(seconds: list[float]) -> dict[str, float | int | None]:
    if not seconds:
        return {"n": 0, "mean": None, "p50": None, "max": None}
    return {"n": len(seconds), "mean": round(statistics.fmean(seconds), 3),
            "p50": round(statistics.median(seconds), 3), "max": round(max(seconds), 3)}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _targets(base: Settings, i: int, current: Settings) -> tuple[str, Settings]:
    """Reload i: even -> toggle the count (in place), odd -> toggle the delay (full reload)."""
    if i % 2 == 0:
        other = base.instance_count + 1 if current.instance_count == base.instance_count else base.instance_count
        return "in_place", dataclasses.replace(current, instance_count=other)
    other = base.max_queue_delay_us + DELAY_STEP_US if current.max_queue_delay_us == base.max_queue_delay_us \
        else base.max_queue_delay_us
    return "full_reload", dataclasses.replace(current, max_queue_delay_us=other)


def run_soak(opts: SoakOptions) -> dict[str, Any]:
    """Run the soak, write `opts.out/soak.json` and return its content."""
    if not isinstance(opts.reloads, int) or opts.reloads < 1:
        raise SoakError(f"--reloads: must be an integer >= 1, got {opts.reloads!r}")
    if not opts.rate_rps > 0:
        raise SoakError(f"--rate-rps: must be > 0, got {opts.rate_rps!r}")
    server = None
    if opts.url:
        http, grpc, metrics = _urls(opts)
        headers = _headers(opts)
        where = f"existing server at {http}"
    else:
        key = secrets.token_urlsafe(24)
        options = ServerOptions(repository=opts.repository, http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), models=[opts.model], restricted_key=(ADMIN_HEADER, key))
        log.info("starting tritonserver with %s", opts.model)
        server = TritonServer(options).start()
        http, grpc, metrics, headers = server.http_url, server.grpc_url, server.metrics_url, {ADMIN_HEADER: key}
        where = "own tritonserver (repository API restricted)"
    try:
        return _soak(opts, http, grpc, metrics, headers, where)
    finally:
        if server is not None:
            server.stop()


def _soak(opts: SoakOptions, http: str, grpc: str, metrics: str, headers: dict, where: str) -> dict[str, Any]:
    control = TritonControl(grpc, http, "grpc", headers)
    actuator = Actuator(control)
    scraper = Scraper(metrics, http, headers=headers)
    try:
        try:
            live_cfg = control.config(opts.model)
        except Exception as e:  # noqa: BLE001 - unreachable server or unknown model: a runtime error (exit 1)
            raise ServerError(f"cannot read the config of model {opts.model!r} at {grpc}: "
                              f"{' '.join(str(e).split())[:200]}") from None
        if not has_dynamic_batching(live_cfg):
            raise SoakError(f"--model: {opts.model} has no dynamic_batching section, so its delay (the full reload) "
                            "cannot be changed")
        base = settings_of(live_cfg)
        failures, successes = CounterTracker(), CounterTracker()

        def sample() -> None:
            counters = (scraper.metrics() or {}).get(opts.model)
            failures.update(None if counters is None else counters.failure)
            successes.update(None if counters is None else counters.success)

        def stats_success() -> int | None:
            s = scraper.stats(opts.model)
            return None if s is None else s.success_count

        sample()
        per_rate = opts.rate_rps / len(opts.protocols)
        try:
            make_inputs = inputs_from_config(live_cfg, opts.seed, spec=opts.inputs)
        except InputSpecError as e:
            raise SoakError(str(e)) from None
        loads = [LoadThread(grpc if p == "grpc" else http, opts.model, make_inputs, per_rate, opts.seed + 7919 * k,
                            opts.request_timeout_s, protocol=p) for k, p in enumerate(opts.protocols)]
        t_start = time.monotonic()
        for load in loads:
            load.start()
        time.sleep(WARMUP_S)
        current, done = base, []
        try:
            for i in range(opts.reloads):
                if any(load.error is not None for load in loads):
                    break
                expected, target = _targets(base, i, current)
                before_stats = stats_success()
                result = actuator.apply(opts.model, target)
                after_stats = stats_success()
                sample()
                done.append({
                    "i": i, "expected_kind": expected, "kind": result.kind, "ok": result.ok,
                    "from": dataclasses.asdict(current), "to": dataclasses.asdict(target),
                    "live": None if result.live is None else dataclasses.asdict(result.live),
                    "seconds": round(result.seconds, 3), "error": result.error or None,
                    "stats_restarted": (None if before_stats is None or after_stats is None
                                        else after_stats < before_stats),
                })
                if result.live is not None:
                    current = result.live
                if not result.ok:
                    log.warning("reload %d (%s -> %s) failed: %s", i, expected, target, result.error)
                    try:
                        alive = control.live()
                    except Exception:  # noqa: BLE001
                        alive = False
                    if not alive:
                        log.error("server is not live; stopping the soak after %d reloads", i + 1)
                        break
                if (i + 1) % 10 == 0 or i + 1 == opts.reloads:
                    log.info("%d/%d reloads", i + 1, opts.reloads)
                time.sleep(opts.gap_s)
            time.sleep(TAIL_S)
        finally:
            for load in loads:
                load.stop.set()
            for load in loads:
                load.join()
        sample()
        restored = None
        if current != base:   # leave the model as we found it (after the load, so it is not counted)
            restored = actuator.apply(opts.model, base).ok
    finally:
        control.close()
    for load in loads:
        if load.error is not None and not load.records:
            raise RuntimeError(f"the {load.protocol} load generator failed: {load.error}")
    elapsed = time.monotonic() - t_start
    records = [r for load in loads for r in load.records]
    failed = [r for r in records if not r.ok]

    def per_protocol(load: LoadThread) -> dict[str, Any]:
        bad = [r for r in load.records if not r.ok]
        lat = [1000.0 * r.latency_s for r in load.records if r.ok and r.latency_s is not None]
        return {"rate_rps": per_rate, "requests": len(load.records), "failed_requests": len(bad),
                "client_errors": dict(Counter(r.error or "unknown" for r in bad)),
                "latency_ms": {"p50": _round(_percentile(lat, 50)), "p99": _round(_percentile(lat, 99)),
                               "max": _round(max(lat) if lat else None)},
                "load_error": None if load.error is None else str(load.error)}

    latencies = [1000.0 * r.latency_s for r in records if r.ok and r.latency_s is not None]
    kinds = Counter(r["kind"] for r in done)
    doc = {
        "model": opts.model, "server": where, "rate_rps": opts.rate_rps, "gap_s": opts.gap_s, "seed": opts.seed,
        "reloads": len(done), "reloads_requested": opts.reloads,
        "reloads_ok": sum(1 for r in done if r["ok"]), "reloads_failed": sum(1 for r in done if not r["ok"]),
        "requests": len(records), "ok_requests": len(records) - len(failed), "failed_requests": len(failed),
        "client_errors": dict(Counter(r.error or "unknown" for r in failed)),
        "server_failures": int(failures.total), "server_successes": int(successes.total),
        "server_counter_resets": failures.resets + successes.resets, "server_scrapes_missed": failures.missed,
        "kinds": {"in_place": kinds.get("in_place", 0), "full_reload": kinds.get("full_reload", 0)},
        "durations_s": {k: _durations([r["seconds"] for r in done if r["kind"] == k and r["ok"]])
                        for k in ("in_place", "full_reload")},
        "latency_ms": {"p50": _round(_percentile(latencies, 50)), "p99": _round(_percentile(latencies, 99)),
                       "max": _round(max(latencies) if latencies else None)},
        "protocols": {load.protocol: per_protocol(load) for load in loads},
        "base": dataclasses.asdict(base), "restored": restored,
        "load_error": next((str(load.error) for load in loads if load.error is not None), None),
        "elapsed_s": round(elapsed, 1), "reload_log": done,
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def summary_line(doc: dict) -> str:
    d = doc["durations_s"]
    return (f"soak {doc['model']}: {doc['reloads']} reloads ({doc['kinds']['in_place']} in place, "
            f"{doc['kinds']['full_reload']} full; {doc['reloads_failed']} failed), {doc['requests']} requests at "
            f"{doc['rate_rps']:g} req/s, {doc['failed_requests']} failed ("
            + ", ".join(f"{p} {v['failed_requests']} of {v['requests']}" for p, v in doc.get("protocols", {}).items())
            + f"), server failures {doc['server_failures']}; "
            f"reload s mean in place {d['in_place']['mean']}, full {d['full_reload']['mean']}; "
            f"p99 {doc['latency_ms']['p99']} ms")
