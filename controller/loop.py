"""The control loop: scrape -> observe -> decide -> apply, once per `interval_s`, per model.

One `Controller` manages the models named in its config (or every READY model). Each tick:

1. scrape `/metrics` once, read the devices (NVML, the simulated device, or nothing);
2. per model: read the live config (a server restart or someone else's change is adopted, and
   the policy then holds one full window), add the sample to the model's window and build an
   observation over the data since the last change settled;
3. `policy.decide` per model, then `arbiter.arbitrate` across models that share the device: a model
   held by the memory budget may take an instance from an idle or lower-priority one; log the
   decision (JSONL, only changes and reason transitions) and count it;
4. if it is a change and not `dry_run`: apply through the actuator, one action at a time, and
   record it in the policy's history only if it succeeded; a failure backs off.

An unreachable server is "no data": the loop keeps running, logs once, and retries each tick.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import policy
from .arbiter import ModelView, arbitrate
from .actuation import Actuator, ApplyResult, TritonControl, has_dynamic_batching, settings_of
from .config import ControllerConfig, ModelLimits
from .gpu import GpuSource, GpuUnavailable, NullSource, open_gpu_source
from .signals import SUMMARY_MAX_AGE_S, ModelCounters, ModelWindow, Scraper
from .telemetry import ControllerMetrics
from .types import Decision, GpuObservation, Observation, Settings

log = logging.getLogger("controller.loop")

SIM_MEMORY_METRIC = "sim_device_memory_bytes"
DEFAULT_TAIL_RATIO = 2.0        # p99 / mean latency until the server's summaries have measured it
TAIL_RATIO_BOUNDS = (1.0, 5.0)
MIN_REQUESTS_FOR_TAIL = 200     # a p99 of fewer requests says little


@dataclass
class ManagedModel:
    name: str
    limits: ModelLimits
    window: ModelWindow
    state: policy.PolicyState
    current: Settings | None = None
    max_batch_size: int = 0
    last_reason: str = ""
    last_decision: Decision | None = None
    last_obs: Observation | None = None
    reachable: bool = True
    history: list[dict] = field(default_factory=list)   # recent decision records, newest last
    tail_ratio: float = DEFAULT_TAIL_RATIO              # p99 / mean latency, from the server's own summaries
    tail_ratio_measured: bool = False


class DecisionLog:
    """Append-only JSONL of decisions: every change and every change of reason."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def simulated_devices(scraped: dict[str, ModelCounters] | None, total_mb: float) -> tuple[GpuObservation, ...] | None:
    """The SIMULATED device of the sim_accel model: memory = what its instances report."""
    if scraped is None:
        return None
    used = [c.custom.get(SIM_MEMORY_METRIC) for c in scraped.values() if SIM_MEMORY_METRIC in c.custom]
    if not used or any(u is None for u in used):
        return ()
    return (GpuObservation(index=0, utilization_pct=None, memory_used_bytes=int(sum(used)),
                           memory_total_bytes=int(total_mb * 2**20)),)


def warm_start_points(path: str, model: str, limits: ModelLimits, now: float) -> tuple[policy.PerfPoint, ...]:
    """A sweep's cells for `model` as the policy's perf memory, judged against this model's own target.
    A missing or unreadable file is a one-line warning, not a crash: the controller then learns online."""
    from .sweep import cells_of, load_sweep
    try:
        doc = load_sweep(path)
        cells = cells_of(doc) if doc.get("model", model) == model else []
    except ValueError as e:
        log.warning("warm start: cannot use %s (%s); learning online instead", path, _short(e))
        return ()
    points = tuple(
        policy.PerfPoint(now, c.instance_count, c.max_queue_delay_us, c.offered_rps, c.completion_rps, c.p99_ms,
                         c.p99_ms is not None and c.p99_ms <= limits.p99_target_ms and c.failed == 0
                         and c.completion_rps >= 0.95 * c.offered_rps)
        for c in cells)
    return points[-policy.PERF_MEMORY:]


def estimate_p99(obs: Observation, tail_ratio: float) -> Observation:
    """A fresh p99 estimate for a short window: the larger of the worst interval mean and
    mean latency x tail ratio. Example: mean 20 ms, tail ratio 1.8, worst 1-s mean 24 ms -> 36 ms."""
    if not obs.valid or obs.p99_source != "interval_mean_max" or obs.p99_ms is None:
        return obs
    return dataclasses.replace(obs, p99_ms=max(obs.p99_ms, obs.request_ms_mean * tail_ratio), p99_source="mean_x_tail_ratio")


def summarize_obs(obs: Observation) -> dict:
    if not obs.valid:
        return {"valid": False, "why": obs.invalid_reason}
    r = lambda x, n=2: None if x is None else round(x, n)  # noqa: E731
    out = {"span_s": r(obs.span_s, 1), "arrival_rps": r(obs.arrival_rps, 1), "completion_rps": r(obs.completion_rps, 1),
           "failure_rps": r(obs.failure_rps), "pending_mean": r(obs.pending_mean), "queue_ms": r(obs.queue_ms_per_request),
           "compute_ms": r(obs.compute_ms_per_request), "p99_ms": r(obs.p99_ms), "p99_source": obs.p99_source,
           "busy": r(obs.busy_fraction, 3), "avg_batch": r(obs.avg_batch_size), "mean_ms": r(obs.request_ms_mean)}
    if obs.gpus:
        out["mem_used_mb"] = r(sum(g.memory_used_bytes or 0 for g in obs.gpus) / 2**20, 1)
    return out


class Controller:
    def __init__(self, config: ControllerConfig, *, control: TritonControl | None = None,
                 scraper: Scraper | None = None, gpu: GpuSource | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics: ControllerMetrics | None = None):
        self.config = config
        self.clock = clock
        s = config.server
        headers = s.auth_headers()
        self.control = control or TritonControl(s.grpc_url, s.http_url, s.control_protocol, headers,
                                                timeout_s=s.timeout_s, load_timeout_s=config.loop.reload_timeout_s)
        self.actuator = Actuator(self.control, ready_timeout_s=config.loop.reload_timeout_s)
        self.scraper = scraper or Scraper(s.metrics_url, s.http_url, timeout_s=s.timeout_s, headers=headers)
        self.gpu_mode = config.loop.gpu
        self.gpu = gpu if gpu is not None else self._open_gpu(config.loop.gpu)
        self.decision_log = DecisionLog(config.loop.decision_log)
        self.metrics = metrics or ControllerMetrics()
        self.models: dict[str, ManagedModel] = {}
        self._stop = threading.Event()
        self._simulating = False
        self._gpu_failing = False

    # -- set-up -------------------------------------------------------------------------------
    def _open_gpu(self, mode: str) -> GpuSource:
        if mode in ("auto", "nvml"):
            try:
                return open_gpu_source(mode)
            except GpuUnavailable:
                raise
        if mode == "simulated":
            self.gpu_mode = "simulated"
        return NullSource()

    def discover(self) -> list[str]:
        """The models to manage: those in the config, else every READY model on the server."""
        if self.config.models:
            return list(self.config.models)
        return sorted(m["name"] for m in self.control.repository_index() if m.get("state") == "READY")

    def add_model(self, name: str, now: float) -> ManagedModel:
        limits = self.config.limits_for(name)
        mm = ManagedModel(name, limits, ModelWindow(max_age_s=max(600.0, 3 * self.config.loop.window_s)),
                          policy.initial_state(now))
        if self.config.loop.warm_start:
            mm.state = dataclasses.replace(mm.state, perf=warm_start_points(self.config.loop.warm_start, name, limits, now))
            if mm.state.perf:
                log.info("%s: warm start from %s (%d measured points)", name, self.config.loop.warm_start, len(mm.state.perf))
        self.models[name] = mm
        return mm

    def _refresh_live(self, mm: ManagedModel, now: float) -> bool:
        """Read the live config; adopt a change we did not make (restart, operator) and hold a window."""
        try:
            cfg = self.control.config(mm.name)
        except Exception as e:  # noqa: BLE001 - unreachable server or unloaded model: no data this tick
            if mm.reachable:
                log.warning("%s: cannot read live config (%s); holding until it answers", mm.name, _short(e))
            mm.reachable = False
            return False
        live = settings_of(cfg)
        if not has_dynamic_batching(cfg) and mm.limits.max_delay_us:
            mm.limits = dataclasses.replace(mm.limits, min_delay_us=0, max_delay_us=0)   # the delay knob does not exist
        mm.max_batch_size = int(cfg.get("max_batch_size", 0) or 0)
        if not mm.reachable:
            # why: the server may have restarted (counters reset, instances fresh): nothing learned before
            # the gap is trusted; hold one full window like at start
            log.info("%s: server answers again; live config %s; holding one window", mm.name, live)
            mm.state = policy.restarted_state(mm.state, now)
        elif mm.current is not None and live != mm.current:
            log.info("%s: live config changed outside the controller (%s -> %s); holding one window", mm.name, mm.current, live)
            mm.state = policy.restarted_state(mm.state, now)
        mm.current = live
        mm.reachable = True
        return True

    # -- one tick -------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        if not self.models:
            try:
                for name in self.discover():
                    self.add_model(name, now)
            except Exception as e:  # noqa: BLE001
                log.warning("cannot list models on the server (%s); retrying", _short(e))
                return
        scraped = self.scraper.metrics()
        devices = self._devices(scraped)
        decided = {}
        for mm in self.models.values():
            d = self._decide_model(mm, scraped, devices, now)
            if d is not None:
                decided[mm.name] = d
        for name, (decision, obs) in self._arbitrate(decided).items():
            self._act(self.models[name], decision, obs, now)

    def _devices(self, scraped: dict[str, ModelCounters] | None) -> tuple[GpuObservation, ...]:
        """NVML's devices; without NVML ("auto") or when asked, the SIMULATED device if a model reports one."""
        self._simulating = False
        if self.gpu_mode == "simulated" or (isinstance(self.gpu, NullSource) and self.gpu_mode == "auto"):
            sim = simulated_devices(scraped, self.config.loop.simulated_device_memory_mb)
            if sim:
                self._simulating = True
                return sim
        try:
            devices = self.gpu.read() or ()
        except Exception as e:  # noqa: BLE001 - GpuSource.read should not raise; if it does, no GPU signals
            if not self._gpu_failing:
                log.warning("GPU read failed (%s); deciding on non-GPU signals until it recovers", _short(e))
            self._gpu_failing = True
            return ()
        if self._gpu_failing:
            log.info("GPU reads recovered")
        self._gpu_failing = False
        return devices

    def _on_device(self, counters: ModelCounters | None) -> bool:
        """With the simulated device, only models that report simulated memory live on it."""
        if not self._simulating:
            return True
        return counters is not None and SIM_MEMORY_METRIC in counters.custom

    def _decide_model(self, mm: ManagedModel, scraped, devices, now: float) -> tuple[Decision, Observation] | None:
        """Observe and decide for one model; None when its live config cannot be read (logged)."""
        counters = None if scraped is None else scraped.get(mm.name)
        mm.window.add(now, counters)
        if not self._refresh_live(mm, now):
            self._record(mm, _invalid_decision(mm), Observation(valid=False, invalid_reason="server_unreachable"), now, "hold")
            return None
        loop = self.config.loop
        fresh_from = mm.state.last_change_at + loop.settle_s
        span = min(loop.window_s, max(0.0, now - fresh_from))
        obs = mm.window.observe(now, span, mm.current.instance_count)
        if obs.valid and devices and self._on_device(counters):
            obs = dataclasses.replace(obs, gpus=devices)
        self._calibrate_tail(mm, counters, now)
        obs = estimate_p99(obs, mm.tail_ratio)
        mm.last_obs = obs
        if mm.state.instance_memory_bytes is None and counters is not None and counters.custom.get(SIM_MEMORY_METRIC):
            # The simulated device says what each instance holds; a real GPU's is learned from step deltas.
            per = counters.custom[SIM_MEMORY_METRIC] / max(1, mm.current.instance_count)
            mm.state = dataclasses.replace(mm.state, instance_memory_bytes=per)
        decision, mm.state = policy.decide(obs, mm.current, mm.state, mm.limits, loop, now, mm.max_batch_size)
        return decision, obs

    def _calibrate_tail(self, mm: ManagedModel, counters: ModelCounters | None, now: float) -> None:
        """Learn p99 / mean latency from a minute without changes, when the server's summary covers it.

        Triton's summaries span about the last minute, so they are only trusted once the config has
        been stable that long. Example: summary p99 46 ms over a minute whose mean was 25 ms -> 1.84.
        """
        stable_since = max(mm.state.last_change_at, mm.state.started_at)
        if counters is None or counters.p99_us is None or now - stable_since < SUMMARY_MAX_AGE_S + self.config.loop.settle_s:
            return
        minute = mm.window.observe(now, SUMMARY_MAX_AGE_S, mm.current.instance_count)
        if not minute.valid or minute.request_ms_mean <= 0 or minute.completion_rps * minute.span_s < MIN_REQUESTS_FOR_TAIL:
            return
        ratio = min(max(counters.p99_us / 1000.0 / minute.request_ms_mean, TAIL_RATIO_BOUNDS[0]), TAIL_RATIO_BOUNDS[1])
        mm.tail_ratio = ratio if not mm.tail_ratio_measured else 0.8 * mm.tail_ratio + 0.2 * ratio
        mm.tail_ratio_measured = True

    def _arbitrate(self, decided: dict[str, tuple[Decision, Observation]]) -> dict[str, tuple[Decision, Observation]]:
        """Let a model held by the shared memory budget take an instance from an idle or lower-priority one."""
        if len(decided) < 2:
            return decided
        views = [ModelView(name, self.models[name].current, d, o, self.models[name].limits,
                           self.models[name].state.instance_memory_bytes) for name, (d, o) in decided.items()]
        for name, override in arbitrate(views).items():
            decided[name] = (override, decided[name][1])
        return decided

    def _act(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float) -> None:
        mm.last_decision = decision
        if not decision.valid or decision.target == mm.current:
            self._record(mm, decision, obs, now, "hold")
            return
        if self.config.loop.dry_run:
            self._record(mm, decision, obs, now, "dry_run")
            # Pretend it settled so the dry-run log shows a realistic cadence, not a change every tick.
            mm.state = dataclasses.replace(mm.state, last_change_at=now)
            return
        before = mm.current
        result = self.actuator.apply(mm.name, decision.target)
        self._after_apply(mm, decision, before, obs, result)

    def _after_apply(self, mm: ManagedModel, decision: Decision, before: Settings, obs: Observation, result: ApplyResult) -> None:
        now = self.clock()
        if result.ok:
            mm.state = policy.record_applied(mm.state, decision, before, obs, now)
            mm.current = result.live
            self.metrics.reload(mm.name, result.kind)
            log.info("%s: %s -> %s (%s, %s in %.1f s) %s", mm.name, _fmt(before), _fmt(result.live), decision.reason,
                     result.kind, result.seconds, decision.detail)
            self._record(mm, decision, obs, now, "applied", result)
        else:
            mm.state = policy.record_failed(mm.state, decision, before, now, self.config.loop.failure_backoff_s)
            if result.live is not None:
                mm.current = result.live
            self.metrics.failure(mm.name)
            log.warning("%s: reload to %s failed after %.1f s: %s; keeping %s, next try not before %.0f s",
                        mm.name, _fmt(decision.target), result.seconds, result.error,
                        _fmt(mm.current) if mm.current else "unknown", mm.state.backoff_until - now)
            self._record(mm, decision, obs, now, "failed", result)

    def _record(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float, action: str,
                result: ApplyResult | None = None) -> None:
        self.metrics.decision(mm.name, decision.reason)
        if mm.current is not None:
            self.metrics.settings(mm.name, mm.current)
        if obs.valid and obs.p99_ms is not None:
            self.metrics.p99_ms(mm.name, obs.p99_ms)
        if action == "hold" and decision.reason == mm.last_reason:
            return
        mm.last_reason = decision.reason
        record = {"time": time.time(), "t": round(now, 3), "model": mm.name, "action": action,
                  "reason": decision.reason, "detail": decision.detail,
                  "current": _asdict(mm.current if action != "applied" else None) or None,
                  "target": _asdict(decision.target), "obs": summarize_obs(obs)}
        if result is not None:
            record.update(kind=result.kind, apply_s=round(result.seconds, 2), error=result.error or None,
                          live=_asdict(result.live))
        mm.history = (mm.history + [record])[-50:]
        self.decision_log.write(record)

    # -- running ------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, max_ticks: int | None = None) -> None:
        stop = stop or self._stop
        interval = self.config.loop.interval_s
        ticks = 0
        next_at = self.clock()
        while not stop.is_set() and (max_ticks is None or ticks < max_ticks):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive any single bad tick
                log.exception("controller tick failed; continuing")
            ticks += 1
            next_at += interval
            stop.wait(max(0.0, next_at - self.clock()))

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.control.close()


def _invalid_decision(mm: ManagedModel) -> Decision:
    cur = mm.current or Settings(0, 0)
    return Decision(cur, "HoldServerUnreachable", valid=False)


def _asdict(s: Settings | None) -> dict | None:
    return None if s is None else {"instances": s.instance_count, "delay_us": s.max_queue_delay_us}


def _fmt(s: Settings | None) -> str:
    return "?" if s is None else f"{s.instance_count} inst/{s.max_queue_delay_us} us"


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200]
