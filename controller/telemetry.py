"""The controller's own endpoint: Prometheus `/metrics` and a JSON `/status`, on loopback by default.

`controller.metrics_address` may bind another address (a Kubernetes sidecar scraped by Prometheus:
`0.0.0.0`, the pod's IP); that is a choice, since `/status` then tells whoever reaches the pod what the
controller sees (no key, no settings; nothing can be changed through it).

`/status` is the controller's snapshot (`loop.Controller.status_snapshot`): per model what it sees
now (load, p99 and its source, queue vs compute time), why it holds, its last change. `status`
reads it; so can any script (`curl http://127.0.0.1:<port>/status`).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from .types import Settings

if TYPE_CHECKING:
    from .capacity import Capacity

CAPACITY_PREFIX = "triton_autotune"   # the project's prefix for the fleet scaler's metrics

log = logging.getLogger("controller.telemetry")


def is_loopback_host(host: str) -> bool:
    """True for this machine's own addresses: localhost (any case, a trailing dot), 127.0.0.0/8 (also written as IPv6,
    ::ffff:127.0.0.1) and ::1. Used by this endpoint's bind check, the load generator's target check and `run`'s
    search for the local server's repository."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


class Endpoint:
    """A small threaded HTTP server: /metrics (Prometheus text) and /status (JSON). Loopback unless
    `allow_remote` (the config's `controller.metrics_address` set to another address)."""

    def __init__(self, registry: CollectorRegistry, status: Callable[[], dict] | None, port: int = 0,
                 host: str = "127.0.0.1", allow_remote: bool = False):
        if not allow_remote and not is_loopback_host(host):
            raise ValueError(f"the controller's endpoint stays on loopback; refusing to bind {host}")
        registry_, status_ = registry, status

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry_))
                elif path == "/status" and status_ is not None:
                    try:
                        body = json.dumps(status_(), separators=(",", ":")).encode()
                    except Exception as e:  # noqa: BLE001 - a bad snapshot is a 500, not a dead endpoint
                        log.warning("status snapshot failed: %s", e)
                        self._send(500, "application/json", json.dumps({"error": str(e)[:200]}).encode())
                        return
                    self._send(200, "application/json", body)
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics or /status\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:   # no access log on stderr
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host = host
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="controller-endpoint", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.instances = Gauge("controller_instance_count", "Live instance count of the model", ["model"], registry=r)
        self.delay = Gauge("controller_max_queue_delay_us", "Live max_queue_delay_microseconds", ["model"], registry=r)
        self.p99 = Gauge("controller_observed_p99_ms", "p99 latency in the last observation window", ["model"], registry=r)
        self.decisions = Counter("controller_decisions", "Decisions made, by reason", ["model", "reason"], registry=r)
        self.reloads = Counter("controller_reloads", "Changes applied, by kind (in_place, full_reload)", ["model", "kind"], registry=r)
        self.failures = Counter("controller_reload_failures", "Changes the server refused or that timed out", ["model"], registry=r)
        # The fleet scaler's signal (see controller/capacity.py). A series exists only once it is known.
        self.capacity = Gauge(
            f"{CAPACITY_PREFIX}_capacity_utilization",
            "Arrival rate / the most this pod serves within the p99 target at its best allowed configuration "
            "(ratio; 1.0 = at the limit even after tuning; stays below 1 while an instance can be added)",
            ["model"], registry=r)
        self.pod_capacity = Gauge(
            f"{CAPACITY_PREFIX}_pod_capacity_utilization",
            "Highest capacity utilisation over this pod's models (ratio; the HPA/KEDA metric)",
            registry=None)   # registered with the first known value (pod_capacity_of)
        self.saturated = Gauge(
            f"{CAPACITY_PREFIX}_saturated",
            "1 when the model is at its instance ceiling and at or past its limit, else 0 (boolean)",
            ["model"], registry=r)
        self.p99_ratio = Gauge(
            f"{CAPACITY_PREFIX}_p99_over_target",
            "Observed p99 latency / the model's p99 target (ratio; dimensionless)", ["model"], registry=r)
        self.capacity_rps = Gauge(
            f"{CAPACITY_PREFIX}_capacity_requests_per_second",
            "Estimated requests per second this pod serves within the p99 target at its ceiling (req/s)",
            ["model"], registry=r)
        self._pod_known = False

    def serve(self, port: int, host: str = "127.0.0.1", status: Callable[[], dict] | None = None,
              allow_remote: bool = False) -> Endpoint:
        """Serve /metrics (and /status when `status` is given) on `host:port` (0: a free port; see `.port`)."""
        return Endpoint(self.registry, status, port, host, allow_remote=allow_remote)

    def capacity_of(self, model: str, cap: "Capacity | None") -> None:
        """Set (or, when unknown, remove) the model's capacity series: absent, never a made-up zero."""
        gauges = (self.capacity, self.saturated, self.p99_ratio, self.capacity_rps)
        if cap is None:
            for g in gauges:
                _remove(g, model)
            return
        self.capacity.labels(model).set(cap.utilization)
        self.saturated.labels(model).set(1 if cap.saturated else 0)
        if cap.p99_over_target is None:
            _remove(self.p99_ratio, model)
        else:
            self.p99_ratio.labels(model).set(cap.p99_over_target)
        if cap.capacity_rps is None:
            _remove(self.capacity_rps, model)
        else:
            self.capacity_rps.labels(model).set(cap.capacity_rps)

    def pod_capacity_of(self, value: float | None) -> None:
        """The pod's figure (max over models); an unlabelled gauge cannot be removed, so it is
        registered lazily: absent from /metrics until the first known value."""
        if value is None:
            if self._pod_known:
                self.registry.unregister(self.pod_capacity)
                self._pod_known = False
            return
        if not self._pod_known:
            try:
                self.registry.register(self.pod_capacity)
            except ValueError:
                pass
            self._pod_known = True
        self.pod_capacity.set(value)

    def forget(self, model: str) -> None:
        """A model no longer managed: its gauges go (a stale instance count would read as live); counters stay."""
        for g in (self.instances, self.delay, self.p99):
            _remove(g, model)
        self.capacity_of(model, None)

    def decision(self, model: str, reason: str) -> None:
        self.decisions.labels(model, reason).inc()

    def settings(self, model: str, s: Settings) -> None:
        self.instances.labels(model).set(s.instance_count)
        self.delay.labels(model).set(s.max_queue_delay_us)

    def reload(self, model: str, kind: str) -> None:
        self.reloads.labels(model, kind).inc()

    def failure(self, model: str) -> None:
        self.failures.labels(model).inc()

    def p99_ms(self, model: str, value: float) -> None:
        self.p99.labels(model).set(value)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass
