"""The controller's own Prometheus metrics (served on loopback when `metrics_port` > 0)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .types import Settings


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

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

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
