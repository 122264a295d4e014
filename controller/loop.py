"""The control loop: orchestration only (scrape -> observe -> decide -> arbitrate -> act), per tick.

One `Controller` manages the models named in its config (or every READY model). Each tick:

1. collect the reloads that finished since the last tick (they run beside the loop, see 4);
2. scrape `/metrics` and `/v2/models/stats` once, read the devices (NVML, the simulated device,
   or nothing), read new request traces; hand each model's share to its `ModelObserver`;
3. per model: read the live config (a server restart or someone else's change is adopted, and the
   policy then only scales up for one full window), let the observer build its observation, `policy.decide`;
   then `arbiter.arbitrate` across models that share the device; log (JSONL, only changes and
   reason transitions) and count every decision; adapt the trace sampling to the arrival rate;
4. a change (not `dry_run`) is handed to a worker thread: a tick never waits on a reload. One action
   at a time per model, and one full reload at a time on the device (a full reload holds old + new
   memory). Its result is recorded in the policy's history only if it succeeded; a failure backs off.

An unreachable server is "no data": the loop keeps running, logs once, and retries each tick.
A tick that overran its interval is not followed by a burst of catch-up ticks.

After each tick the loop publishes what it sees (`status_snapshot`, read by the endpoint's `/status`
on another thread): the loop thread builds it, a lock hands it over.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import capacity as capacity_mod
from . import ensemble, groups, modelkind, planner, policy, warmup
from .arbiter import ModelView, arbitrate
from .actuation import UNREACHABLE, Actuator, ApplyResult, TritonControl, classify_error, settings_of
from .calls import SOURCE_FILES, CallGraph, named_in_source
from .config import ControllerConfig, ModelLimits, ServerConfig
from .decision_log import JsonLog
from .cpu import CpuSeries, ServerCpu
from .gpu import SIM_MEMORY_METRIC, GpuSource, NullSource, SimulatedDeviceSource, open_gpu_source
from .observer import ModelObserver, TraceFeed
from .ownership import FOREIGN_LIVE, FOREIGN_UNREACHABLE, MINE, TAKE_OVER, OwnerMark, OwnershipGuard, Verdict, identity, mark_of
from . import ownership
from .server import version_change
from .signals import SUMMARIES_OFF, ModelCounters, Scraper, StatsCounters
from .sweep_schema import cells_of, load_sweep
from .telemetry import ControllerMetrics
from .traces import TraceApi
from .types import Decision, GpuObservation, Observation, Settings

log = logging.getLogger("controller.loop")

CAPACITY_STALE_WINDOWS = 3      # a capacity figure outlives missing data (a reload) this many windows
DISCOVER_EVERY_S = 10.0         # without a models: section, the server's READY models are listed again this often
PREDICTED_EVERY_S = 30.0        # the planner's predicted capacities (for status) are recomputed this often
SEQUENCE_QUIET_MARGIN_S = 10.0  # a sequence batcher quiet this much past its idle timeout holds no live sequence


@dataclass
class PendingChange:
    """A change handed to a worker; `future` gives (ApplyResult, finished_at)."""

    decision: Decision
    before: Settings
    obs: Observation
    future: Future
    full_reload: bool
    since: float = 0.0        # when it was handed over (controller clock)


@dataclass
class ManagedModel:
    name: str
    limits: ModelLimits
    observer: ModelObserver
    state: policy.PolicyState
    current: Settings | None = None
    batch_limit: int = 0       # the most items one execution gathers from several requests: max_batch_size under a
                               # dynamic or sequence batcher, 0 (one request an execution) under the default scheduler
    sim_slots: int | None = None                         # a simulated device's slots, from the model's parameters
    last_reason: str = ""
    reason_since: float | None = None                   # when `last_reason` became the reason (controller clock)
    last_decision: Decision | None = None
    last_change: dict | None = None                     # the last applied (or failed) change, for status
    reachable: bool = True
    not_loaded: str | None = None                        # the server answers but does not serve it: its index state
    pending: PendingChange | None = None
    history: list[dict] = field(default_factory=list)   # recent decision records, newest last
    capacity: "capacity_mod.Capacity | None" = None      # the fleet scaler's figure (controller/capacity.py) ...
    capacity_t: float | None = None                     # ... as of then (kept through short gaps in the data)
    mark: OwnerMark | None = None                        # the owner mark in its live config (ownership.py)
    owner: Verdict | None = None                         # what that mark means for this controller
    predicted: dict | None = None                        # the planner's capacity of the live config, n +- 1, the ceiling ...
    predicted_t: float = -1e18                           # ... computed then (every PREDICTED_EVERY_S)
    plan_inputs: "planner.PlanInputs | None" = None      # the planner's inputs at this tick's decision (the arbiter's)
    kind: "modelkind.ModelKind | None" = None            # what the live config says the model is (modelkind.py)
    per_device: dict[str, int] = field(default_factory=dict)   # live instances per device (groups.py)
    target_from: "ensemble.StepTarget | None" = None    # set while an ensemble's target is passed to it
    sequences_kept: bool = False                         # a sequence batcher's floor follows its live count
    requests_seen: float | None = None                   # its requests (success + failure) at the last scrape ...
    last_request_t: float | None = None                  # ... and when that count last moved (or one was pending)
    live_config: dict | None = None                      # the config last read from the server (a restart loads it)
    warm_up: dict | None = None                          # this controller's warm-up of it (warmup.py): {"state": "reloading"
                                                         # | "added" | "failed" | "cannot", "detail", "t"}; None: not tried
    warm_up_since: float | None = None                   # when a warm-up was first wanted (waiting for a light tick)

    @property
    def last_obs(self) -> Observation | None:
        return self.observer.last


WARM_UP = "WarmUpColdStart"     # the decision of a reload that adds Triton's model_warmup (Controller._warm_up_now)

# the policy's gates: while one of these holds (start, a change settling), a claim's full reload would disturb it
_NOT_QUIET = frozenset({"HoldWarmup", "HoldSettling", "HoldCooldown", "HoldBackoff", "HoldNoData"})


def _quiet(decision: Decision, obs: Observation) -> bool:
    """A tick on which a full reload of the live settings (a claim, a warm-up) disturbs nothing: the policy holds on
    valid data, past its warm-up and settling gates (_NOT_QUIET)."""
    return decision.valid and obs.valid and decision.reason not in _NOT_QUIET


def _correction(state: planner.PlannerState, now: float) -> dict | None:
    """What the planner multiplies its predictions by now and what its recent windows compared (for the
    observation log and `status`); None without a recent window."""
    factor, raw = planner.correction(state, now)
    return None if raw is None else {"x": round(factor, 3), "from": state.ratio_source}


def warm_start_points(path: str, model: str, limits: ModelLimits, now: float) -> tuple[policy.PerfPoint, ...]:
    """A sweep's cells for `model` as the policy's perf memory, judged against this model's own target.
    A missing or unreadable file is a one-line warning, not a crash: the controller then learns online."""
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


def summarize_obs(obs: Observation) -> dict:
    if not obs.valid:
        return {"valid": False, "why": obs.invalid_reason}
    r = lambda x, n=2: None if x is None else round(x, n)  # noqa: E731
    out = {"span_s": r(obs.span_s, 1), "arrival_rps": r(obs.arrival_rps, 1), "completion_rps": r(obs.completion_rps, 1),
           "failure_rps": r(obs.failure_rps), "shed_rps": r(obs.shed_rps), "pending_mean": r(obs.pending_mean), "queue_ms": r(obs.queue_ms_per_request),
           "compute_ms": r(obs.compute_ms_per_request), "p99_ms": r(obs.p99_ms), "p99_source": obs.p99_source,
           "busy": r(obs.busy_fraction, 3), "busy_source": obs.busy_source, "avg_batch": r(obs.avg_batch_size), "batches_per_s": r(obs.exec_rps, 1),
           "mean_ms": r(obs.request_ms_mean)}
    if obs.p99_source == "trace":
        out["p99_samples"] = obs.p99_samples
    if obs.p99_source == "mean_x_tail_ratio" and obs.tail_ratio is not None:
        out["tail_ratio"], out["tail_ratio_measured"] = r(obs.tail_ratio), obs.tail_ratio_measured
    if obs.items_per_request > 1.0:       # requests of several items (the planner's unit: planner.simulate_quantised)
        out["items_per_request"] = r(obs.items_per_request)
    if obs.warming_up:
        out["warming_up"] = True
    if obs.predicted_p99_ms is not None:
        out["predicted_p99_ms"] = r(obs.predicted_p99_ms)
    if obs.predicted_mean_ms is not None:
        out["predicted_mean_ms"] = r(obs.predicted_mean_ms)
    if obs.tail_check is not None:
        out["tail_check"] = r(obs.tail_check, 3)
    if obs.service is not None:
        out["service"] = obs.service.summary()
    if obs.jitter is not None:
        out["jitter"] = obs.jitter.summary()
    if obs.cold_start is not None:
        out["cold_start"] = obs.cold_start
    if obs.gpus:
        out["mem_used_mb"] = r(sum(g.memory_used_bytes or 0 for g in obs.gpus) / 2**20, 1)
    if obs.cpu is not None:          # the CPU as this model's device (cpu.py)
        out["cpu"] = {"util": r(obs.cpu.utilisation, 3), "cores": r(obs.cpu.cores, 2), "server": r(obs.cpu.server, 3),
                      "stubs": {m: r(s, 3) for m, s in sorted(obs.cpu.stubs.items())}}
    return out


class Controller:
    def __init__(self, config: ControllerConfig, *, control: TritonControl | None = None,
                 scraper: Scraper | None = None, gpu: GpuSource | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics: ControllerMetrics | None = None,
                 traces: TraceFeed | None = None, control_factory: Callable[[], TritonControl] | None = None,
                 cpu: ServerCpu | None = None):
        self.config = config
        self.clock = clock
        s = config.server
        headers = s.auth_headers()
        new_control = control_factory or (lambda: TritonControl(
            s.grpc_url, s.http_url, s.control_protocol, headers, timeout_s=s.timeout_s,
            load_timeout_s=config.loop.reload_timeout_s))
        self.control = control or new_control()
        # why: reloads run on worker threads, each model with its own client; an injected control serves all
        self._new_control = (lambda: self.control) if control is not None and control_factory is None else new_control
        self.scraper = scraper or Scraper(s.metrics_url, s.http_url, timeout_s=s.timeout_s, headers=headers)
        self.gpu_mode = config.loop.gpu
        self.gpu = gpu if gpu is not None else self._open_gpu(config.loop.gpu)
        self.simulated = SimulatedDeviceSource(config.loop.simulated_device_memory_mb)
        # the server's CPU, the device of models on no other (cpu.py); by default read where the server is this
        # machine's (found by its port); an injected control (tests' fakes) reads none unless one is given
        self.cpu = cpu if cpu is not None else (_server_cpu(s) if control is None and config.loop.cpu_device else None)
        self.cpu_series = CpuSeries()
        max_bytes = int(config.loop.decision_log_max_mb * 2**20) if config.loop.decision_log_max_mb else None
        self.decision_log = JsonLog(config.loop.decision_log, max_bytes, config.loop.log_files_kept)
        self.observation_log = JsonLog(config.loop.observation_log, max_bytes, config.loop.log_files_kept)
        self.metrics = metrics or ControllerMetrics()
        if traces is None:
            api = TraceApi(s.http_url, headers, timeout_s=s.timeout_s) if config.loop.tracing is not False else None
            traces = TraceFeed(api, samples_per_s=config.loop.trace_samples_per_s, path_override=config.loop.trace_file,
                               forced=config.loop.tracing is True)
        self.traces = traces
        self.calls = CallGraph()         # who calls whom (BLS), from the request traces
        self.models: dict[str, ManagedModel] = {}
        # the server's model repository where this machine reads it (serve's; `server.repository` for run): a reload
        # that would change which versions serve is held (_versions_moved)
        self.repository: Path | None = Path(s.repository) if s.repository else None
        self._stop = threading.Event()
        self._simulating = False
        self._gpu_failing = False
        self.summaries: bool | None = None   # whether the server publishes latency summaries (None: not yet seen)
        self._workers: ThreadPoolExecutor | None = None
        self._actuators: dict[str, Actuator] = {}
        self._started = (time.time(), clock())
        self.me = OwnerMark(identity(self._started[0]))
        self.ownership = OwnershipGuard(self.me, stale_after_s=config.loop.owner_stale_after_s)
        ownership.running(self.me.owner)
        self._ticks = 0
        self._tick_error: str | None = None
        self._discovered_at = -math.inf                     # when the server's READY models were last listed
        self._sources_at = -math.inf                        # when the Python models' sources were last read
        self._sources_read: set[str] = set()                # the models whose sources have been read (calls.py)
        # a .py file read -> (mtime, size, whether it builds an InferenceRequest, its string constants)
        self._source_cache: dict[Path, tuple[int, int, bool, frozenset[str]]] = {}
        self._index_read: tuple[list[dict], Exception | None] | None = None   # this tick's repository index (_index)
        self._said_nothing_ready = False
        self._seen: dict[str, tuple[float, dict]] = {}     # per model: the last valid observation (time, summary)
        self._lock = threading.Lock()
        self._published: tuple[float, dict] | None = None   # (controller time, snapshot), see status_snapshot
        self._last_devices: tuple[GpuObservation, ...] = ()

    # -- set-up -------------------------------------------------------------------------------
    def set_status_url(self, url: str | None) -> None:
        """Where this controller's /status answers: it goes into the owner mark (call before the first tick)."""
        self.me = OwnerMark(self.me.owner, url)
        self.ownership.me = self.me
        for actuator in self._actuators.values():
            actuator.mark = self._mark()

    def _mark(self) -> OwnerMark | None:
        return self.me if self.config.loop.owner_mark else None

    def first_load_configs(self, repository, names) -> dict[str, dict]:
        """For a server this controller's caller is about to start (`serve`): the load override of each managed model
        among `names` that carries this controller's owner mark (ownership.marked_file_config), so that none needs a
        claim (a full reload) once the load has begun. Ensembles and decoupled models are never claimed, so not
        marked, but their steps are (the loop manages them too), also a step not among `names` (`serve --models ens`:
        the caller loads it first, so that the ensemble's load does not load it unmarked as a dependency); none at all
        where the loop would not claim (no mark, a dry run, no /status to put in the mark)."""
        if not self.config.loop.owner_mark or self.config.loop.dry_run or self.me.status_url is None:
            return {}
        configs: dict[str, dict] = {}
        todo, seen = [n for n in names if n in self.config.models], set()
        while todo:
            name = todo.pop(0)
            if name in seen:
                continue
            seen.add(name)
            config, why = ownership.marked_file_config(Path(repository) / name, self.me)
            kind = None if config is None else modelkind.classify(config)
            if kind is None:
                log.info("%s: loads from its file unmarked (%s); the controller claims it later", name, why)
            elif kind.ensemble:
                todo.extend(kind.steps)
            elif kind.managed:
                configs[name] = config
        return configs

    def restart_configs(self, repository, names) -> dict[str, dict]:
        """For a server this controller's caller starts again after it died (`serve`, server.ServerSupervisor): the
        load overrides of `first_load_configs`, with the live config the loop last read in place of the file's for
        each model it manages that was loaded then (the instances and delay it had chosen, with its owner mark), so
        that the restarted server runs what the dead one ran. The supervisor takes these over its own snapshot (every
        model the server ran, its live config read every 5 s) for the models it loads. May run in another thread than
        the loop: it reads each model's last config, a dict the loop replaces, never edits."""
        configs = self.first_load_configs(repository, names)
        for mm in list(self.models.values()):
            cfg = mm.live_config
            if cfg is not None and mm.kind is not None and mm.kind.managed:
                configs[mm.name] = cfg
        return configs

    def _open_gpu(self, mode: str) -> GpuSource:
        if mode in ("auto", "nvml"):
            return open_gpu_source(mode)      # "nvml" without NVML raises GpuUnavailable: the user asked for it
        return NullSource()

    def _index(self) -> list[dict]:
        """The server's repository index, asked at most once a tick (why: the listing and each model whose config
        read failed all want it; a server that does not answer raises again, without a second wait)."""
        if self._index_read is None:
            try:
                self._index_read = (self.control.repository_index(), None)
            except Exception as e:  # noqa: BLE001 - raised again below, to each caller this tick
                self._index_read = ([], e)
        index, error = self._index_read
        if error is not None:
            raise error
        return index

    def _ready_on_server(self) -> set[str]:
        return {m["name"] for m in self._index() if m.get("state") == "READY"}

    def _discover(self, now: float) -> None:
        """Add the models to manage that are not managed yet: the config's at the first tick; without a `models:`
        section, every model READY on the server, asked again every DISCOVER_EVERY_S, so that a model loaded later
        is managed too, and one the server no longer serves is let go (_let_go). Until one is READY, say once that
        there is nothing to manage (a server started without --load-model, a model still loading), rather than run
        silently on nothing."""
        ready = None if self.config.models else self._ready_on_server()
        names = list(self.config.models) if ready is None else sorted(ready)
        later = bool(self.models)            # why: the models found at the start are announced by their kind lines
        self._discovered_at = now
        if ready is not None:
            self._let_go(ready)
        for name in names:
            if name not in self.models:
                if later:
                    log.info("%s: READY on the server; managing it too", name)
                self.add_model(name, now)
        if self.models:
            self._said_nothing_ready = False        # why: said again if the set empties later (models unloaded)
        elif not self._said_nothing_ready:
            self._said_nothing_ready = True
            log.warning("no model is READY on the server %s, so nothing to manage; each model that becomes READY is "
                        "managed (load them with --load-model='*' or the repository API, or name them under models: "
                        "in the config)", "now" if later else "yet")

    def _let_go(self, ready: set[str]) -> None:
        """Without a `models:` section, stop managing a model the server no longer serves (an operator unloaded it):
        not READY on the index now, and its last config read found it not loaded (mm.not_loaded, so two readings
        agree), no change of ours in flight, not a step of a managed ensemble (which would take it back at once).
        It is managed afresh once READY again. A model named under `models:` is held instead ("HoldNotLoaded")."""
        steps = {s for mm in self.models.values() if mm.kind is not None and mm.kind.ensemble and mm.name in ready
                 for s in mm.kind.steps}
        for name, mm in list(self.models.items()):
            if name in ready or name in steps or mm.pending is not None or mm.not_loaded is None:
                continue
            log.info("%s: not loaded on the server (%s); no longer managed (managed again once it is READY)", name,
                     mm.not_loaded)
            del self.models[name]
            self._seen.pop(name, None)
            actuator = self._actuators.pop(name, None)
            if actuator is not None and actuator.control is not self.control:
                actuator.control.close()
            self.traces.forget(name)
            self.calls.forget(name)
            self._sources_read.discard(name)
            self.metrics.forget(name)

    def add_model(self, name: str, now: float) -> ManagedModel:
        limits = self.config.limits_for(name)
        loop = self.config.loop
        mm = ManagedModel(name, limits, ModelObserver(name, window_s=loop.window_s, settle_s=loop.settle_s),
                          policy.initial_state(now))
        if loop.warm_start:
            mm.state = policy.with_warm_start(mm.state, warm_start_points(loop.warm_start, name, limits, now))
            if mm.state.perf:
                log.info("%s: warm start from %s (%d measured points)", name, loop.warm_start, len(mm.state.perf))
        self.models[name] = mm
        return mm

    def _refresh_live(self, mm: ManagedModel, now: float) -> bool:
        """Read the live config; adopt a change we did not make (restart, operator) and hold a window."""
        try:
            cfg = self.control.config(mm.name)
        except Exception as e:  # noqa: BLE001 - unreachable server or unloaded model: no data this tick
            # why: an unreachable server's index would only time out again (one more wait per model per tick)
            why = None if classify_error(e, key_sent=False) == UNREACHABLE else self._not_loaded(mm.name)
            if why is not None and why != mm.not_loaded:
                log.warning("%s: not loaded on the server (%s); holding until it is READY", mm.name, why)
            elif why is None and (mm.reachable or mm.not_loaded is not None):
                log.warning("%s: cannot read live config (%s); holding until it answers", mm.name, _short(e))
            mm.reachable, mm.not_loaded = False, why
            if why is not None:
                mm.live_config = None       # why: not loaded (an operator unloaded it): a restart loads its file
            return False
        live = settings_of(cfg)
        mm.live_config = cfg
        self._adopt_kind(mm, cfg, now)
        mm.batch_limit = mm.kind.max_batch_size if mm.kind is not None and mm.kind.batches_requests else 0
        mm.sim_slots = _int_parameter(cfg, "device_parallelism")   # a simulated device's slots (sim_accel)
        mm.mark = mark_of(cfg)
        adopted = None
        changed = mm.current is not None and live != mm.current
        if not mm.reachable:
            # why: the server may have restarted (counters reset, instances fresh): nothing learned before
            # the gap is trusted; a full window of warm-up (scale-ups only) like at start
            back = "READY on the server now" if mm.not_loaded else "server answers again"
            adopted = f"{back}; live config {_fmt(live)}"
        elif changed:
            adopted = f"live config changed outside the controller ({_fmt(mm.current)} -> {_fmt(live)})"
        if adopted:
            log.info("%s: %s; one window of warm-up (scale-ups only)", mm.name, adopted)
            mm.state = policy.restarted_state(mm.state, now)
            mm.observer.mark_change(now)
            if changed:
                self._callee_changed(mm)
        mm.current = live
        mm.reachable, mm.not_loaded = True, None
        return True

    def _not_loaded(self, name: str) -> str | None:
        """Why a model's config could not be read while the server answers: its state on the repository index
        ("UNAVAILABLE: unloaded"; "not loaded yet" for a model of the repository that has no state: never loaded on
        this server process, which after a restart of tritonserver is every model until its load;
        "not in the server's repository"). None when the index does not answer either (the server is away) or lists
        the model READY (some other error)."""
        try:
            index = self._index()
        except Exception:  # noqa: BLE001 - the server is away: the caller says so
            return None
        entry = next((m for m in index if m.get("name") == name), None)
        if entry is None:
            return "not in the server's repository"
        state = entry.get("state") or "not loaded yet"
        if state == "READY":
            return None
        return f"{state}: {entry['reason']}" if entry.get("reason") else state

    def _adopt_kind(self, mm: ManagedModel, cfg: dict, now: float) -> None:
        """What the model is and which knobs apply (modelkind.py), logged once and again if it changes."""
        kind = modelkind.classify(cfg)
        if kind != mm.kind:
            log.info("%s", modelkind.start_line(mm.name, kind))
            mm.kind = kind
        if not kind.delay and mm.limits.max_delay_us:
            mm.limits = dataclasses.replace(mm.limits, min_delay_us=0, max_delay_us=0)   # the delay knob does not exist
        mm.per_device = groups.instances_per_device(cfg)
        floor = groups.min_total(cfg)
        self._keep_sequences(mm, kind, cfg, now, floor)
        if kind.instances and mm.limits.min_instances < floor:
            # why: the controller keeps one instance on each device the user's instance groups name
            log.info("%s: instance groups on %d devices (%s): at least %d instances", mm.name, floor,
                     ", ".join(mm.per_device), floor)
            mm.limits = dataclasses.replace(mm.limits, min_instances=floor, max_instances=max(mm.limits.max_instances, floor))

    def _keep_sequences(self, mm: ManagedModel, kind: "modelkind.ModelKind", cfg: dict, now: float,
                        floor: int) -> None:
        """A stateful model (sequence batcher): its floor is its live count, so that no path (the policy, the
        planner, the arbiter's moves) removes an instance, which would end the live sequences it holds; unless
        the model's `sequence_scale_down: true` (modelkind.py has the measurements). Except once it has had no
        request for its sequence idle timeout and SEQUENCE_QUIET_MARGIN_S more: Triton has then ended every
        sequence itself, none is live, and the floor is the configured one again until the next request (a
        sequence that starts while a scale-down is being applied could still land on a removed instance).
        `floor`: the least instances the user's groups place (groups.min_total), kept in any case."""
        if not (kind.sequence_batching and kind.instances):
            return
        own = self.config.limits_for(mm.name)
        if own.sequence_scale_down:
            return
        live = settings_of(cfg).instance_count
        idle_s = modelkind.sequence_idle_s(cfg)
        if not mm.sequences_kept:
            mm.sequences_kept = True
            log.info("%s: a sequence batcher (stateful): instances are only added while it has requests, since a "
                     "removed instance ends the live sequences it holds (and a full reload ends all); removed again "
                     "once it has had none for its sequence idle timeout (%.1f s) and %.0f s more; set "
                     "sequence_scale_down: true under the model to allow it always", mm.name, idle_s,
                     SEQUENCE_QUIET_MARGIN_S)
        quiet = None if mm.last_request_t is None else now - mm.last_request_t
        if quiet is not None and quiet >= idle_s + SEQUENCE_QUIET_MARGIN_S:
            base = max(own.min_instances, floor)      # the floor it would have without sequences
            if mm.limits.min_instances > base:
                log.info("%s: no request for %.0f s (its sequences end after %.1f s idle): no sequence is live, so "
                         "its instances may be removed again (floor %d -> %d)", mm.name, quiet, idle_s,
                         mm.limits.min_instances, base)
                mm.limits = dataclasses.replace(mm.limits, min_instances=base)
            return
        if live > mm.limits.min_instances:
            mm.limits = dataclasses.replace(mm.limits, min_instances=live,
                                            max_instances=max(mm.limits.max_instances, live))

    def _is_ensemble(self, name: str) -> bool:
        mm = self.models.get(name)
        return mm is not None and mm.kind is not None and mm.kind.ensemble

    def _caller_views(self) -> list[ensemble.EnsembleView]:
        """Each managed model seen calling others in its request traces, or naming them in its source (BLS;
        calls.py), with its callees. An ensemble's steps come from its config instead; a decoupled caller's p99 is
        not what its clients wait for (modelkind.py), and a decoupled callee has no target to pass on: both left
        out. A callee that is an ensemble takes the target as its own and passes it on to its steps (the next
        tick's ensemble view)."""
        views = []
        for caller in sorted({p for p, _ in self.calls.edges()}):
            mm = self.models.get(caller)
            if mm is None or mm.kind is None or not mm.kind.managed:
                continue
            callees = tuple(c for c in self.calls.callees(caller)
                            if (cm := self.models.get(c)) is None or cm.kind is None or cm.kind.managed
                            or cm.kind.ensemble)
            if not callees:
                continue
            # ensemble.py compares the caller's p99 with its callee's: where the caller's window reaches back before
            # a callee's change it describes the old callee (an ensemble's window restarts instead; a caller has
            # decisions of its own, which a restart would hold), so its callees keep their targets until it does not
            fresh = max((cm.observer.fresh_from for c in callees if (cm := self.models.get(c)) is not None),
                        default=-math.inf)
            obs = mm.last_obs if mm.last_obs is not None and mm.last_obs.since >= fresh else None
            views.append(ensemble.EnsembleView(mm.name, mm.limits.p99_target_ms, obs, callees,
                                               {c: self.calls.calls_in_sequence(caller, c) for c in callees},
                                               frozenset(c for c in callees if not self.calls.traced(caller, c))))
        return views

    def _read_sources(self, now: float) -> None:
        """Where this machine reads the repository: which READY models each managed Python model names where it
        builds an InferenceRequest (calls.named_in_source), as calls, for a caller that does not pass its trace on.
        Read for a model once its kind is known, then again every DISCOVER_EVERY_S (a model loaded later can be
        named, a callee unloaded comes back)."""
        if self.repository is None:
            return
        python = [mm for mm in self.models.values()
                  if mm.kind is not None and mm.kind.managed and not mm.kind.ensemble and mm.kind.backend == "python"]
        unread = any(m.name not in self._sources_read for m in python)
        if not python or (now - self._sources_at < DISCOVER_EVERY_S and not unread):
            return
        try:
            ready = self._ready_on_server()
        except Exception:  # noqa: BLE001 - the server does not answer: the loop says so; read again next tick
            return
        self._sources_at = now
        if len(self._source_cache) > 4 * SOURCE_FILES * len(python):
            self._source_cache.clear()      # why: bounded; files renamed or removed leave entries behind
        for mm in python:
            before = set(self.calls.callees(mm.name))
            named = named_in_source(self.repository / mm.name, ready, self._source_cache,
                                    _parameter_values(mm.live_config))
            self.calls.declare(mm.name, named)
            self._sources_read.add(mm.name)
            for c in sorted(set(named) - before):
                if not self.calls.traced(mm.name, c):
                    log.info("%s: its model.py (or its config) names %s where it builds an InferenceRequest: taken "
                             "as calling it once a request (its target passes to %s) %s", mm.name, c, c,
                             "until its request traces show the calls; pass trace=request.trace() to the "
                             "InferenceRequest for them to" if not self.traces.state.startswith("off")
                             else "(request tracing is off, so the calls are not measured)")

    def _pass_ensemble_targets(self, now: float) -> None:
        """An ensemble's p99 target to the step that holds its latency, and a caller's (BLS) to the model it calls
        that does (ensemble.py); its steps and callees are managed too."""
        views = [ensemble.EnsembleView(mm.name, mm.limits.p99_target_ms, mm.last_obs, mm.kind.steps)
                 for mm in self.models.values() if mm.kind is not None and mm.kind.ensemble]
        views += self._caller_views()
        for step in sorted({s for v in views for s in v.steps} - set(self.models)):
            log.info("%s: managed as %s", step, ", ".join(
                (f"a step of ensemble {v.name}" if v.calls is None else f"a model {v.name} calls")
                for v in views if step in v.steps))
            self.add_model(step, now)
        # an ensemble that a model calls takes its caller's target (passed on to its steps by its own view)
        steps = {s: self.models[s] for v in views for s in v.steps
                 if (k := self.models[s].kind) is None or k.managed or (v.calls is not None and k.ensemble)}
        own = {s: self.config.limits_for(s).p99_target_ms for s in steps}
        current = {s: mm.target_from or ensemble.StepTarget(s, mm.limits.p99_target_ms) for s, mm in steps.items()}
        planned = ensemble.plan(views, {s: mm.last_obs for s, mm in steps.items()}, own, current)
        for s, t in planned.items():
            mm = steps[s]
            if t.target_ms != mm.limits.p99_target_ms:
                log.info("%s: p99 target %g -> %g ms (%s)", s, mm.limits.p99_target_ms, t.target_ms, t.why)
                mm.limits = dataclasses.replace(mm.limits, p99_target_ms=t.target_ms)
            mm.target_from = t if t.ensemble else None
        for mm in self.models.values():
            # a model no view holds any more (its caller's source no longer names it, its ensemble dropped the step)
            # runs under its own target again; a gap in a view's data keeps the target instead (ensemble.plan)
            if mm.target_from is not None and mm.name not in planned:
                own_ms = self.config.limits_for(mm.name).p99_target_ms
                log.info("%s: p99 target %g -> %g ms, its own (%s no longer passes it one)", mm.name,
                         mm.limits.p99_target_ms, own_ms, mm.target_from.ensemble)
                mm.limits = dataclasses.replace(mm.limits, p99_target_ms=own_ms)
                mm.target_from = None

    def _prefer(self, mm: ManagedModel, room: dict[str, int] | None = None) -> tuple[str, ...]:
        """For a model on several devices: where to add instances first (groups.preference), from the readings
        and the memory room on each (policy.memory_room)."""
        if len(mm.per_device) < 2:
            return ()
        util = {groups.gpu_key(g.index): g.utilization_pct for g in self._last_devices}
        return tuple(groups.preference(mm.per_device, util, room))

    # -- one tick -------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        self._index_read = None
        try:
            self._tick(now)
        finally:
            self._ticks += 1
            self._publish(now)

    def _tick(self, now: float) -> None:
        if not self.models or (not self.config.models and now - self._discovered_at >= DISCOVER_EVERY_S):
            try:
                self._discover(now)
            except Exception as e:  # noqa: BLE001
                if not self.models:
                    if self._tick_error is None:
                        log.warning("cannot list models on the server (%s); retrying", _short(e))
                    self._tick_error = f"cannot list models on the server: {_short(e)}"
                    return
        self._tick_error = None
        self._collect_finished()
        self._read_sources(now)
        self._pass_ensemble_targets(now)
        self.traces.start()
        scraped = self.scraper.metrics()
        self._note_summaries(scraped)
        stats = self.scraper.all_stats() if scraped is not None else None
        devices = self._last_devices = self._devices(scraped)
        if self.cpu is not None:
            self.cpu_series.add(self.cpu.read(now))
        traffic = any(mm.last_obs is not None and mm.last_obs.valid and mm.last_obs.arrival_rps > 0
                      for mm in self.models.values())
        traced = self.traces.poll(now, traffic)
        self.calls.add(sample for samples in traced.values() for sample in samples)
        decided: dict[str, tuple[Decision, Observation]] = {}
        for mm in self.models.values():
            mm.observer.add_traces(traced.get(mm.name, ()), now)
            d = self._decide_model(mm, scraped, stats, devices, now)
            if d is not None:
                decided[mm.name] = d
        for name, (decision, obs) in self._arbitrate(decided).items():
            self._act(self.models[name], decision, obs, now)
        self._export_capacity()
        for mm in self.models.values():
            obs = mm.last_obs
            self.traces.adapt(mm.name, obs.arrival_rps if obs is not None and obs.valid else None, now)
            self._log_observation(mm, now)

    def _note_summaries(self, scraped: dict[str, ModelCounters] | None) -> None:
        """Whether the server publishes Triton's latency summaries for the managed models (any of them: the server
        has the flag or not); said once, with what it costs, when it does not.

        Why: Triton publishes them only with `--metrics-config summary_latencies=true`, off by default, and the
        controller reads from them, untraced (the default before Triton 2.57), the p99 / mean ratio of its p99
        estimate (2.0 until measured), the tail check and the executions' spread: without them the p99 shown and
        used is the mean x 2.0, a default, and the planner's tail goes unchecked. `serve` sets the flag; a server
        started otherwise (`run`) may not."""
        present = [scraped[m] for m in self.models if scraped and m in scraped]
        if not present:
            return
        on = any(c.summaries for c in present)
        if not on and self.summaries is not False:
            log.warning("the server publishes no latency summaries (tritonserver's --metrics-config "
                        "summary_latencies=true is not set): %s", SUMMARIES_OFF)
        elif on and self.summaries is False:
            log.info("the server now publishes latency summaries")
        self.summaries = on

    def _devices(self, scraped: dict[str, ModelCounters] | None) -> tuple[GpuObservation, ...]:
        """NVML's devices; without NVML ("auto") or when asked, the SIMULATED device if a model reports one."""
        self._simulating = False
        if self.gpu_mode == "simulated" or (isinstance(self.gpu, NullSource) and self.gpu_mode == "auto"):
            slots = [mm.sim_slots for mm in self.models.values() if mm.sim_slots]
            self.simulated.feed(scraped, self.clock(), max(slots) if slots else None)
            sim = self.simulated.read()
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

    def _model_devices(self, mm: ManagedModel, devices: tuple[GpuObservation, ...]) -> tuple[GpuObservation, ...]:
        """Of the GPUs read (NVML's), those `mm`'s instances run on, from its live instance groups (`mm.per_device`):
        a group on GPUs k reads GPUs k; a KIND_CPU group none, unless the model's own processes (its Python stubs,
        cpu.py) hold memory on a GPU in NVML's process lists (a Python model that moves its work to a GPU itself);
        where the GPUs are not known (`KIND_MODEL`, a GPU group with no ids) or the ids match none read (a server
        under CUDA_VISIBLE_DEVICES numbers its GPUs from 0, NVML does not), every GPU, as before.

        Why: each model read every GPU, so a KIND_CPU model on a GPU machine (an ensemble's pre-processing step)
        took a GPU's utilisation for its contention and that GPU's memory for its budget (another model filling the
        GPU held its scale-ups), and a model on gpu1 took gpu0's load as its own. Example: GPUs 0 and 1 read, the
        model's groups on gpu1 and the CPU, its stubs in no process list: gpu1 only."""
        if not devices or not mm.per_device:
            return devices
        if any(groups.gpu_index(d) is None and d != "cpu" for d in mm.per_device):
            return devices                                    # "gpu" (ids not known), "model", "auto"
        ids = {groups.gpu_index(d) for d in mm.per_device} - {None}
        mine = [g for g in devices if g.index in ids]
        if ids and not mine:
            return devices
        if "cpu" in mm.per_device:
            stubs = self.cpu_series.stub_pids(mm.name)
            mine += [g for g in devices if g.index not in ids and any(pid in stubs for pid, _ in g.process_memory_bytes)]
        return tuple(sorted(mine, key=lambda g: g.index))

    def _cpu_device(self, mm: ManagedModel, devices: tuple[GpuObservation, ...]) -> CpuSeries | None:
        """The server's CPU readings where the CPU is `mm`'s device: no device reports for it this tick (`devices`:
        its own, `_model_devices`), and either no GPU is read at all (no NVML, or `gpu: none`) or its instance
        groups are on the CPU alone (a model on a GPU that one GPU read missed is not taken for a CPU model); None
        otherwise (cpu.py)."""
        if self.cpu is None or devices:
            return None
        if isinstance(self.gpu, NullSource) or set(mm.per_device) == {"cpu"}:
            return self.cpu_series
        return None

    def _decide_model(self, mm: ManagedModel, scraped: dict[str, ModelCounters] | None,
                      stats: dict[str, StatsCounters] | None, devices, now: float) -> tuple[Decision, Observation] | None:
        """Observe and decide for one model; None when its live config cannot be read (logged)."""
        counters = None if scraped is None else scraped.get(mm.name)
        _note_requests(mm, counters, now)
        if mm.pending is not None:
            # why: the live config is in flux until the worker reports; observe, but neither adopt nor decide
            mm.observer.add_scrape(now, counters, None, None)
            return Decision(mm.pending.decision.target, "HoldReloading", valid=False), Observation(valid=False)
        if not self._refresh_live(mm, now):
            mm.observer.add_scrape(now, counters, None, None)
            if mm.not_loaded is not None:
                self._record(mm, Decision(mm.current or Settings(0, 0), "HoldNotLoaded", detail=mm.not_loaded,
                                          valid=False),
                             Observation(valid=False, invalid_reason="not_loaded"), now, "hold")
            else:
                self._record(mm, Decision(mm.current or Settings(0, 0), "HoldServerUnreachable", valid=False),
                             Observation(valid=False, invalid_reason="server_unreachable"), now, "hold")
            return None
        mm.observer.add_scrape(now, counters, None if stats is None else stats.get(mm.name), mm.current)
        if self._simulating:      # the simulated device's models are those that report on it
            devices = devices if self.simulated.hosts(counters) else ()
        else:
            devices = self._model_devices(mm, devices)
        obs = mm.observer.observe(now, mm.current, devices, mm.batch_limit, self._cpu_device(mm, devices))
        if obs.valid and mm.per_device:
            obs = dataclasses.replace(obs, placement=tuple(mm.per_device.items()))
        if obs.valid and warmup.has_warmup(mm.live_config):
            obs = dataclasses.replace(obs, loads_warm=True)
        if counters is not None and self._simulating and self.simulated.hosts(counters):
            # the simulated device says what each instance holds; a real GPU's is learned from step deltas
            per = counters.custom.get(SIM_MEMORY_METRIC, 0) / max(1, mm.current.instance_count)
            mm.state = policy.with_reported_instance_memory(mm.state, per)
        if mm.kind is not None and not mm.kind.managed:
            # an ensemble or a decoupled model: observed and shown, never changed (modelkind.py says why)
            self._record(mm, Decision(mm.current, mm.kind.hold_reason, valid=False, detail=mm.kind.knobs()), obs, now, "hold")
            return None
        if self.config.loop.owner_mark and not self._may_act(mm, obs, now):
            return None
        inputs = (mm.observer.plan_inputs(mm.batch_limit, self.config.loop.interval_s, self._device_fraction(mm, obs),
                                          planner.CPU_SHARE if obs.cpu is not None else planner.DEVICE_SHARE,
                                          None if obs.cpu is None else
                                          obs.cpu.contention(mm.name, obs.busy_fraction * mm.current.instance_count))
                  if self.config.loop.planner else None)
        mm.plan_inputs = inputs
        decision, mm.state = policy.decide(obs, mm.current, mm.state, mm.limits, self.config.loop, now, mm.batch_limit,
                                           inputs)
        ceiling, _ = policy.instance_ceiling(mm.current, mm.limits, mm.state, obs, now)
        correction = _correction(mm.state.plan, now)
        # why: the row says what its predictions were multiplied by; recomputed when that changes (a window recorded,
        # or the first with the summaries' tail), not up to PREDICTED_EVERY_S later beside a decision that says otherwise
        stale = (mm.predicted is None or mm.predicted["live"] != mm.current or mm.predicted["ceiling"] != ceiling
                 or mm.predicted["correction"] != correction)
        if inputs is not None and obs.valid and (stale or now - mm.predicted_t >= PREDICTED_EVERY_S):
            caps = planner.capacities(mm.current, inputs, mm.state.plan, target_ms=mm.limits.p99_target_ms,
                                      min_instances=mm.limits.min_instances, max_instances=mm.limits.max_instances,
                                      device_util=policy.device_utilisation(obs), exec_rps=obs.exec_rps,
                                      avg_batch=obs.avg_batch_size, now=now, also=(ceiling,))
            n = mm.current.instance_count
            mm.predicted, mm.predicted_t = {"capacity_rps": {k: v for k, v in caps.items() if abs(k - n) <= 1},
                                            "correction": correction,
                                            # why: no curve yet for the live count (just changed): ask again next tick
                                            "mode": decision.mode, "live": mm.current if caps else None, "ceiling": ceiling,
                                            # the most any count the model may use carries (the ceiling's or
                                            # fewer: instances that contend can carry less than one), capacity.py
                                            "at_ceiling_rps": max((v for k, v in caps.items() if k <= ceiling
                                                                   and v is not None), default=None)}, now
        elif inputs is None:
            mm.predicted = None
        elif mm.predicted is not None:
            mm.predicted["mode"] = decision.mode
        self._update_capacity(mm, obs, decision, ceiling, now)
        return decision, obs

    def _device_fraction(self, mm: ManagedModel, obs: Observation) -> float | None:
        """This model's share of the work on its devices: its instance-seconds executing per second over
        those of every managed model observed on the same devices (their last observations). None when it
        is alone there or nothing is known. Example: this model 2 instances 50% busy, another 1 instance
        100% busy on the same device: 1.0 / 2.0 = 0.5."""
        if obs.valid and not obs.gpus and obs.cpu is not None:
            # its part of the cores' busy time (cpu.py); an in-process backend (no stub) is given the server's part
            share = obs.cpu.share(mm.name)
            share = obs.cpu.server if share is None else share
            return None if share >= 0.999 else share
        if not obs.valid or not obs.gpus:
            return None
        mine_dev = {g.index for g in obs.gpus}
        own = obs.busy_fraction * (mm.current.instance_count if mm.current else 0)
        total = own
        for other in self.models.values():
            o = other.last_obs
            if other is mm or o is None or not o.valid or not ({g.index for g in o.gpus} & mine_dev):
                continue
            total += o.busy_fraction * (other.current.instance_count if other.current else 0)
        if total <= 0 or total == own:
            return None
        return own / total

    def _update_capacity(self, mm: ManagedModel, obs: Observation, decision: Decision, ceiling: int, now: float) -> None:
        """This model's use of the pod's capacity at its ceiling (controller/capacity.py), with the planner's
        capacity at the ceiling where it has one for the live configuration (recomputed on a change of it, of
        the ceiling or of the planner's correction, else every PREDICTED_EVERY_S). Without a valid observation the last figure stays for up to
        CAPACITY_STALE_WINDOWS windows, then goes (absent)."""
        p = mm.predicted
        # why: a planner set aside (its p99 far from the observed one, or too little data) is not trusted with the
        # fleet scaler's figure either (a stateful model's sequence slots: 12x off, its capacity read 1.6%)
        planned = (p["at_ceiling_rps"] if p is not None and p["live"] == mm.current and p["ceiling"] == ceiling
                   and decision.mode != "fallback" else None)
        # why: the contention between instances holds where the planner's p99 does not; the default (no reading) is
        # not one, and the linear extrapolation stays there
        gamma = (planner.contention(mm.plan_inputs, policy.device_utilisation(obs))
                 if planned is None and mm.plan_inputs is not None and obs.valid else None)
        cap = capacity_mod.utilization(obs, mm.current, ceiling, mm.limits.p99_target_ms, mm.state.perf,
                                       decision.held_by, planned_capacity_rps=planned,
                                       contention=gamma[0] if gamma is not None and gamma[1] != "default" else None)
        if cap is not None:
            mm.capacity, mm.capacity_t = cap, now
        elif mm.capacity_t is None or now - mm.capacity_t > CAPACITY_STALE_WINDOWS * self.config.loop.window_s:
            mm.capacity, mm.capacity_t = None, None

    def _export_capacity(self) -> None:
        for mm in self.models.values():
            if not mm.reachable:
                mm.capacity, mm.capacity_t = None, None
            self.metrics.capacity_of(mm.name, mm.capacity)
        self.metrics.pod_capacity_of(capacity_mod.pod_utilization(mm.capacity for mm in self.models.values()))

    def _goodput_of(self, mm: ManagedModel, obs: Observation) -> Callable[[int, float], float | None] | None:
        """The planner's goodput function for this tick (planner.goodput), built on the arbiter's first call; None
        without the planner's inputs or a valid observation."""
        inputs, current = mm.plan_inputs, mm.current
        if inputs is None or current is None or not obs.valid:
            return None
        now, built = self.clock(), []

        def at(n: int, demand_rps: float) -> float | None:
            if not built:
                built.append(planner.goodput(current, inputs, mm.state.plan, target_ms=mm.limits.p99_target_ms,
                                             device_util=policy.device_utilisation(obs), exec_rps=obs.exec_rps,
                                             avg_batch=obs.avg_batch_size, now=now))
            return None if built[0] is None else built[0](n, demand_rps)
        return at

    def _arbitrate(self, decided: dict[str, tuple[Decision, Observation]]) -> dict[str, tuple[Decision, Observation]]:
        """Let a model held by the shared memory budget take an instance from an idle or lower-priority one."""
        if len(decided) < 2:
            return decided
        views = [ModelView(name, self.models[name].current, d, o, self.models[name].limits,
                           self.models[name].state.instance_memory_bytes, self._goodput_of(self.models[name], o))
                 for name, (d, o) in decided.items() if self.models[name].current is not None]
        for name, override in arbitrate(views).items():
            decided[name] = (override, decided[name][1])
        return decided

    # -- one controller per model ---------------------------------------------------------------------
    def _may_act(self, mm: ManagedModel, obs: Observation, now: float) -> bool:
        """Check the owner mark (ownership.py). False: another live controller owns the model (held, logged
        once), or this controller claims it now (a full reload that puts its own mark in, settings unchanged)."""
        verdict = self.ownership.check(mm.name, mm.mark, now)
        before, mm.owner = mm.owner, verdict
        changed = before is None or before.state != verdict.state or before.mark != verdict.mark
        if verdict.state in (FOREIGN_LIVE, FOREIGN_UNREACHABLE):
            if changed:
                log.warning("%s: managed by another controller (%s, %s); not acting on it", mm.name,
                            verdict.mark.owner, verdict.detail)
            self._record(mm, Decision(mm.current, "HoldOwnedByOther", detail=f"owner {verdict.mark.owner}: {verdict.detail}"),
                         obs, now, "hold")
            return False
        if verdict.state == TAKE_OVER and changed:
            log.warning("%s: taking over from %s (%s)", mm.name, verdict.mark.owner, verdict.detail)
        return True

    def _claim_now(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float) -> bool:
        """Put this controller's mark into the model's config, at a quiet moment: the policy holds on valid data
        past its warm-up and settling gates, no reload is in flight anywhere (the claim is a full reload: old + new must fit), not in a backoff.
        A change wanted before that is applied unmarked (in place stays in place); the claim comes after."""
        v = mm.owner
        if self.me.status_url is None:
            # why: a mark nobody can check (no /status to ask) would look alive, or stale, whatever this controller does
            return False
        if not self.config.loop.owner_mark or self.config.loop.dry_run or v is None or v.state == MINE \
                or not v.may_act or not _quiet(decision, obs):
            return False
        if mm.kind is not None and mm.kind.sequence_batching:
            return False     # why: the claim's full reload would end every live sequence (modelkind.py)
        if not self._full_reload_may_go(mm, obs, now):
            return False
        detail = "unmarked" if v.mark is None else f"from {v.mark.owner}: {v.detail}"
        self._submit(mm, Decision(mm.current, "ClaimOwnership", detail=detail), obs, now, full=True, claim=True)
        return True

    def _full_reload_may_go(self, mm: ManagedModel, obs: Observation, now: float) -> bool:
        """Whether a full reload of `mm` at its live settings may start now (a claim's, a warm-up's): no reload in
        flight anywhere, `mm` not in a backoff, and a second copy within its memory budget."""
        return not any(o.pending is not None for o in self.models.values()) and now >= mm.state.backoff_until \
            and policy.full_reload_fits(mm.current, mm.limits, mm.state, obs)

    def _warm_up_now(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float) -> bool:
        """Reload a model that starts cold (`obs.cold_start`) once with Triton's `model_warmup` (warmup.py), at a
        quiet moment as `_claim_now` defines it and a light one (its instances at most `warmup.BUSY_MAX` busy, or
        `warmup.WAIT_MAX_S` after it was first wanted), where its live config has no warm-up of its own. True where that
        reload was submitted. Tried once per model: a warm-up the model refuses fails the load (the old copy serves
        on) and is not tried again; one that cannot be made (`warmup.samples`) is said once."""
        if not self.config.loop.warm_up or self.config.loop.dry_run or mm.warm_up is not None \
                or obs.cold_start is None or obs.loads_warm or mm.live_config is None or not _quiet(decision, obs):
            return False
        if (mm.kind is not None and not mm.kind.managed) or warmup.mild(obs.cold_start, mm.limits.p99_target_ms):
            return False
        samples, what = _warm_up_samples(mm)
        if samples is None:
            mm.warm_up = {"state": "cannot", "detail": what, "t": now}
            log.warning("%s: starts cold, and the controller cannot warm it up: %s; warm it up in its initialize "
                        "or give its config a model_warmup", mm.name, what)
            return False
        # why: the warm-up is housekeeping, a second copy loading beside the one serving (a torch import, the samples'
        # executions on every instance); at a peak that load competes with the requests: the torch MLP of
        # scripts/scenarios/repos/cpu_mlp on 2 cores had its warm-up reload at midday, 302 req/s, its instances 77%
        # busy, 11 s after a delay change's full reload; the clients' 10-s p99s read 138-358 ms around the two (target
        # 100)
        mm.warm_up_since = now if mm.warm_up_since is None else mm.warm_up_since
        if obs.busy_fraction > warmup.BUSY_MAX and now - mm.warm_up_since < warmup.WAIT_MAX_S:
            return False
        if not self._full_reload_may_go(mm, obs, now):
            return False
        cold = obs.cold_start
        detail = (f"its first executions after a load took {_num1(cold.get('ms'))} ms against {_num1(cold.get('usual_ms'))} ms; "
                  f"a full reload with Triton's model_warmup, {what}: new instances then warm up before they serve")
        mm.warm_up = {"state": "reloading", "detail": what, "t": now}
        self._submit(mm, Decision(mm.current, WARM_UP, detail=detail), obs, now, full=True, warm_up=samples)
        if mm.pending is None:          # not submitted (versions moved: _submit said why): another quiet tick
            mm.warm_up = None
        return True

    # -- acting -----------------------------------------------------------------------------------
    def _act(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float) -> None:
        if mm.pending is not None:
            self._record(mm, decision, obs, now, "hold")
            return
        if decision.reason == policy.REPAIR:
            self._repair(mm, decision, obs, now)
            return
        if not decision.valid or decision.target == mm.current:
            if not self._claim_now(mm, decision, obs, now) and not self._warm_up_now(mm, decision, obs, now):
                self._record(mm, decision, obs, now, "hold")
            return
        if self.config.loop.dry_run:
            self._record(mm, decision, obs, now, "dry_run")
            mm.state = policy.record_dry_run(mm.state, now)
            return
        full = decision.target.max_queue_delay_us != mm.current.max_queue_delay_us
        if decision.target.instance_count > mm.current.instance_count and any(
                o is not mm and o.pending is not None
                and o.pending.decision.target.instance_count > o.pending.before.instance_count
                and groups.may_share_memory(mm.per_device, o.per_device)
                for o in self.models.values()) \
                and policy.memory_cap(mm.current, mm.limits, mm.state, obs) is not None:
            # why: each model's room under a memory budget is read from the memory in use, which does not yet
            # hold the other model's instances being added; two steps in one tick went over a shared budget
            # (a CI run: two models each took the "one step to learn an instance's cost", 4 instances of 64 MiB
            # against 224). One growing model per GPU at a time; the next tick reads the memory with its
            # instances in. Models on different GPUs each have their own budget (policy.memory_room): no wait.
            self._record(mm, Decision(mm.current, "HoldOtherScaleUp", detail=f"wanted {_fmt(decision.target)}"),
                         obs, now, "hold")
            return
        if full and any(o.pending is not None and o.pending.full_reload for o in self.models.values()):
            # why: a full reload holds old + new memory until it finishes; two at once could exceed the budget
            self._record(mm, Decision(mm.current, "HoldOtherFullReload", detail=f"wanted {_fmt(decision.target)}"),
                         obs, now, "hold")
            return
        self._submit(mm, decision, obs, now, full)

    def _repair(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float) -> None:
        """A full reload of the live settings (policy.repair), one full reload on the device at a time."""
        if self.config.loop.dry_run:
            self._record(mm, decision, obs, now, "dry_run")
            mm.state = policy.record_repaired(mm.state, now, self.config.loop)   # as if done: one line per wait, not per tick
            return
        if any(o.pending is not None and o.pending.full_reload for o in self.models.values()):
            self._record(mm, Decision(mm.current, "HoldOtherFullReload", detail="wanted a repair"), obs, now, "hold")
            return
        log.warning("%s: requests keep failing (%s); repairing: a full reload of the same settings", mm.name, decision.detail)
        self._submit(mm, decision, obs, now, full=True, repair=True)

    def _versions_moved(self, mm: ManagedModel) -> str | None:
        """Why no reload of `mm` may go now: the repository (where this controller can read it: serve's, or
        `server.repository`) holds versions that its live config's version policy would load, or lacks ones that
        serve, so a reload would deploy or drop a version (server.version_change); None where not (or unknown)."""
        if self.repository is None or mm.live_config is None:
            return None
        try:
            live = {int(e["version"]) for e in self._index()
                    if e.get("name") == mm.name and e.get("state") == "READY" and str(e.get("version", "")).isdigit()}
        except Exception:  # noqa: BLE001 - the index unread: the reload's own errors say what is wrong
            return None
        if not live:
            return None
        load, unload = version_change(self.repository / mm.name, mm.live_config, live)
        if not load and not unload:
            return None
        serving = ", ".join(map(str, sorted(live)))
        parts = ([f"would load version(s) {', '.join(map(str, load))} of the repository"] if load else []) + \
                ([f"would unload version(s) {', '.join(map(str, unload))}"] if unload else [])
        return (f"version(s) {serving} serve, and a reload now {' and '.join(parts)} (the version policy re-reads "
                f"the repository): the controller changes instances and delay, never versions, so it waits until "
                f"they are loaded as the operator wants them (the repository API's load of {mm.name})")

    def _submit(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float, full: bool,
                claim: bool = False, repair: bool = False, warm_up: list[dict] | None = None) -> None:
        moved = self._versions_moved(mm)
        if moved is not None:
            if mm.last_decision is None or mm.last_decision.reason != "HoldVersionsMoved":
                log.warning("%s: not reloading (%s wanted): %s", mm.name, decision.reason, moved)
            self._record(mm, Decision(mm.current, "HoldVersionsMoved", detail=f"wanted {decision.reason}: {moved}"),
                         obs, now, "hold")
            return
        actuator = self._actuators.get(mm.name)
        if actuator is None:
            actuator = self._actuators[mm.name] = Actuator(self._new_control(), ready_timeout_s=self.config.loop.reload_timeout_s,
                                                           mark=self._mark())
        if self._workers is None:
            self._workers = ThreadPoolExecutor(max_workers=max(2, len(self.models)), thread_name_prefix="reload")
        # on several devices, instances go where memory allows (the budget holds per GPU: policy.memory_room)
        room = policy.memory_room(mm.limits, mm.state, obs) if len(mm.per_device) > 1 else None
        target, prefer = decision.target, self._prefer(mm, room)

        def work():
            if repair:
                result = actuator.repair(mm.name)
            elif warm_up is not None:
                result = actuator.warm_up(mm.name, warm_up)
            else:
                result = actuator.claim(mm.name) if claim else actuator.apply(mm.name, target, prefer, room)
            return result, self.clock()

        mm.pending = PendingChange(decision, mm.current, obs, self._workers.submit(work), full, now)
        self._record(mm, decision, obs, now, "claiming" if claim else "warming_up" if warm_up is not None else "started")

    def _collect_finished(self) -> None:
        for mm in self.models.values():
            p = mm.pending
            if p is None or not p.future.done():
                continue
            mm.pending = None
            try:
                result, finished_at = p.future.result()
            except Exception as e:  # noqa: BLE001 - Actuator.apply should not raise; if it does, it failed
                result, finished_at = ApplyResult(False, "none", None, 0.0, _short(e)), self.clock()
            self._after_apply(mm, p.decision, p.before, p.obs, result, finished_at)

    def wait_for_pending(self, timeout_s: float = 30.0) -> None:
        """Block until no change is in flight, then record them (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        for mm in self.models.values():
            if mm.pending is not None:
                try:
                    mm.pending.future.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - recorded by _collect_finished
                    pass
        self._collect_finished()

    def _mark_change(self, mm: ManagedModel, now: float) -> None:
        """A change to `mm`: its window restarts, and so does every ensemble's it is a step of (an ensemble's
        p99 over a window reaching back before its step's change describes the old step: ensemble.py compares
        the two, so both must cover the same seconds)."""
        mm.observer.mark_change(now)
        for e in self.models.values():
            if e.kind is not None and e.kind.ensemble and mm.name in e.kind.steps:
                e.observer.mark_change(now)

    def _callee_changed(self, mm: ManagedModel) -> None:
        """`mm`'s instances or delay changed. A model that calls it (BLS) waits on it in each execution: the
        service curves it measured at its other configurations were measured against the old `mm`, and would,
        say, keep it at a count it no longer needs after `mm` grew. Only its live one, which goes on being fed
        and follows the change, is kept (calls.py)."""
        for caller in self.calls.callers(mm.name):
            cm = self.models.get(caller)
            if cm is not None and cm.kind is not None and cm.kind.managed and cm is not mm:
                dropped = cm.observer.service.forget_except(cm.current)
                if dropped:
                    log.info("%s: dropped the service curves of %d other configuration(s): %s, which it calls, "
                             "changed", caller, dropped, mm.name)

    def _after_apply(self, mm: ManagedModel, decision: Decision, before: Settings, obs: Observation,
                     result: ApplyResult, now: float) -> None:
        if decision.reason == "ClaimOwnership":
            # settings unchanged: nothing for the policy to learn; a full reload restarted the stats counters
            self._mark_change(mm, now)
            if result.live is not None:
                mm.current = result.live
            if result.ok:
                mm.mark = self._mark()
                log.info("%s: marked as managed by this controller (%s, %.1f s)", mm.name, self.me.owner, result.seconds)
            else:
                mm.state = policy.record_failed(mm.state, decision, before, now, self.config.loop.failure_backoff_s)
                log.warning("%s: could not mark the model as ours (%s); acting anyway, retrying later", mm.name, result.error)
            self._record(mm, decision, obs, now, "claimed" if result.ok else "claim_failed", result)
            return
        if decision.reason == WARM_UP:
            # settings unchanged (a full reload: the statistics restart); tried once, whatever the outcome
            self._mark_change(mm, now)
            if result.live is not None:
                mm.current = result.live
            what = (mm.warm_up or {}).get("detail") or ""
            mm.warm_up = {"state": "added" if result.ok else "failed", "t": now,
                          "detail": what if result.ok else f"{what}: {result.error}"}
            if result.ok:
                self.metrics.reload(mm.name, result.kind)
                log.info("%s: reloaded with Triton's model_warmup (%s) in %.1f s: new instances warm up before they "
                         "serve", mm.name, what, result.seconds)
            else:
                self.metrics.failure(mm.name)
                log.warning("%s: the reload with Triton's model_warmup failed after %.1f s (%s); it serves on as before, "
                            "not warmed, and is not tried again: warm it up in its initialize or give its config a "
                            "model_warmup", mm.name, result.seconds, result.error)
            mm.last_change = _change(now, result, decision, mm.current, mm.current)
            self._record(mm, decision, obs, now, "warmed_up" if result.ok else "warm_up_failed", result)
            return
        if decision.reason == policy.REPAIR:
            self._mark_change(mm, now)
            if result.live is not None:
                mm.current = result.live
            if result.ok:
                mm.state = policy.record_repaired(mm.state, now, self.config.loop)
                self.metrics.reload(mm.name, result.kind)
                log.warning("%s: repaired (full reload of %s in %.1f s); next repair of a lasting fault not before %.0f s",
                            mm.name, _fmt(mm.current), result.seconds, mm.state.repair_not_before - now)
            else:
                mm.state = policy.record_failed(mm.state, decision, before, now, self.config.loop.failure_backoff_s)
                self.metrics.failure(mm.name)
                log.warning("%s: repair failed after %.1f s: %s", mm.name, result.seconds, result.error)
            mm.last_change = _change(now, result, decision, before, mm.current)
            self._record(mm, decision, obs, now, "repaired" if result.ok else "repair_failed", result)
            return
        mm.last_change = _change(now, result, decision, before, result.live if result.ok else decision.target)
        if result.ok:
            mm.state = policy.record_applied(mm.state, decision, before, obs, now, result.seconds)
            mm.current = result.live
            self._mark_change(mm, now)
            if result.live != before:
                self._callee_changed(mm)
            self.metrics.reload(mm.name, result.kind)
            log.info("%s: %s -> %s (%s, %s in %.1f s) %s", mm.name, _fmt(before), _fmt(result.live), decision.reason,
                     result.kind, result.seconds, decision.detail)
            self._record(mm, decision, obs, now, "applied", result)
        else:
            mm.state = policy.record_failed(mm.state, decision, before, now, self.config.loop.failure_backoff_s)
            if result.live is not None:
                mm.current = result.live
            self._mark_change(mm, now)
            self.metrics.failure(mm.name)
            log.warning("%s: reload to %s failed after %.1f s: %s; keeping %s, next try not before %.0f s",
                        mm.name, _fmt(decision.target), result.seconds, result.error,
                        _fmt(mm.current) if mm.current else "unknown", mm.state.backoff_until - now)
            self._record(mm, decision, obs, now, "failed", result)

    # -- records ----------------------------------------------------------------------------------
    def _record(self, mm: ManagedModel, decision: Decision, obs: Observation, now: float, action: str,
                result: ApplyResult | None = None) -> None:
        mm.last_decision = decision
        self.metrics.decision(mm.name, decision.reason)
        if mm.current is not None:
            self.metrics.settings(mm.name, mm.current)
        if obs.valid and obs.p99_ms is not None:
            self.metrics.p99_ms(mm.name, obs.p99_ms)
        if action == "hold" and decision.reason == mm.last_reason:
            return
        if decision.reason != mm.last_reason:
            mm.reason_since = now
        mm.last_reason = decision.reason
        record = {"time": time.time(), "t": round(now, 3), "model": mm.name, "action": action,
                  "reason": decision.reason, "detail": decision.detail,
                  "current": _asdict(mm.current if action != "applied" else None) or None,
                  "target": _asdict(decision.target), "obs": summarize_obs(obs),
                  "tracing": self.traces.describe(mm.name)}
        if len(mm.per_device) > 1:
            record["per_device"] = dict(mm.per_device)    # the live placement as last read (before this change)
        if decision.held_by is not None:
            record["held_by"] = decision.held_by.value
        if decision.mode:
            record["mode"] = decision.mode
        if decision.plan is not None:
            record["plan"] = decision.plan
        if result is not None:
            record.update(kind=result.kind, apply_s=round(result.seconds, 2), error=result.error or None,
                          live=_asdict(result.live))
        mm.history = (mm.history + [record])[-50:]
        self.decision_log.write(record)

    def _log_observation(self, mm: ManagedModel, now: float) -> None:
        if self.observation_log.path is None or mm.last_obs is None:
            return
        record = {"time": time.time(), "t": round(now, 3), "model": mm.name,
                  "current": _asdict(mm.current), "reason": mm.last_reason,
                  # who decided this tick: "model", "fallback", "reactive"; None for a gate's hold
                  "mode": (mm.last_decision.mode or None) if mm.last_decision is not None else None,
                  "target_ms": mm.limits.p99_target_ms, "obs": summarize_obs(mm.last_obs)}
        correction = _correction(mm.state.plan, now)
        if self.config.loop.planner and correction is not None:
            record["correction"] = correction
        self.observation_log.write(record)

    # -- what the controller sees, for /status -----------------------------------------------------
    def _publish(self, now: float) -> None:
        """Build the snapshot on the loop thread and hand it over under the lock (see status_snapshot)."""
        models = {}
        for mm in self.models.values():
            obs = mm.last_obs
            if obs is not None and obs.valid:
                self._seen[mm.name] = (now, summarize_obs(obs))
            models[mm.name] = model_status(mm, self._seen.get(mm.name), self.traces.describe(mm.name),
                                           warm_up_on=self.config.loop.warm_up and not self.config.loop.dry_run)
            models[mm.name]["owner"] = owner_status(mm, self.me)
            models[mm.name]["summaries"] = self.summaries     # the server's, for the p99 row's default factor
            # who calls whom (BLS), as the request traces showed it: {model: calls a request}, [callers]; an
            # ensemble's steps are shown as such (ensemble_steps)
            # "traced": False where the calls are only named in the caller's model.py (calls.py)
            models[mm.name]["calls"] = None if self._is_ensemble(mm.name) else {
                c: {"per_request": round(self.calls.calls_per_request(mm.name, c), 2),
                    "in_sequence": round(self.calls.calls_in_sequence(mm.name, c), 2),
                    "traced": self.calls.traced(mm.name, c)}
                for c in self.calls.callees(mm.name)} or None
            callers = [c for c in self.calls.callers(mm.name) if not self._is_ensemble(c)]
            models[mm.name]["called_by"] = callers or None
            models[mm.name]["called_by_untraced"] = [c for c in callers if not self.calls.traced(c, mm.name)] or None
        loop, s = self.config.loop, self.config.server
        snap = {"interval_s": loop.interval_s, "window_s": loop.window_s, "dry_run": loop.dry_run,
                "tracing": self.traces.state, "tracing_caution": self.traces.caution,
                "summaries": self.summaries, "decision_log": loop.decision_log, "ticks": self._ticks,
                "error": self._tick_error,
                "server": {"http_url": s.http_url, "grpc_url": s.grpc_url, "metrics_url": s.metrics_url},
                "owner": self.me.owner, "status_url": self.me.status_url, "models": models}
        with self._lock:
            self._published = (now, snap)

    def status_snapshot(self) -> dict:
        """What the controller sees now, JSON-ready; safe to call from any thread.

        Controller times (`*_t`, the loop's clock) become ages in seconds at the time of the call:
        `held_for_s` (the current reason), `obs_age_s`, `last_change.ago_s`, `reloading.for_s`, `tick_age_s`.
        """
        with self._lock:
            published = self._published
        now = self.clock()
        wall0, t0 = self._started
        out = {"time": time.time(), "started": wall0, "uptime_s": round(now - t0, 1), "owner": self.me.owner,
               "status_url": self.me.status_url}
        if published is None:
            return {**out, "ticks": 0, "tick_age_s": None, "models": {}, "interval_s": self.config.loop.interval_s,
                    "window_s": self.config.loop.window_s, "dry_run": self.config.loop.dry_run,
                    "tracing": self.traces.state, "decision_log": self.config.loop.decision_log, "error": None}
        at, snap = published
        snap = copy.deepcopy(snap)
        out.update(snap, tick_age_s=round(now - at, 1))
        age = lambda t: None if t is None else round(max(0.0, now - t), 1)  # noqa: E731
        for m in snap["models"].values():
            m["held_for_s"] = age(m.pop("reason_since_t"))
            m["obs_age_s"] = age(m.pop("obs_t"))
            if m["last_change"] is not None:
                m["last_change"]["ago_s"] = age(m["last_change"].pop("t"))
            if m["reloading"] is not None:
                m["reloading"]["for_s"] = age(m["reloading"].pop("since_t"))
        return out

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
            # why: a tick that overran (a slow scrape) is not followed by a burst of catch-up ticks
            next_at = max(next_at + interval, self.clock())
            stop.wait(max(0.0, next_at - self.clock()))

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Let a change in flight finish (the server keeps whatever it lands on), turn tracing off."""
        if self._workers is not None:
            self._workers.shutdown(wait=True)
            self._collect_finished()
        ownership.stopped(self.me.owner)
        self.traces.stop()
        for actuator in self._actuators.values():
            if actuator.control is not self.control:
                actuator.control.close()
        self.control.close()


def model_status(mm: ManagedModel, seen: tuple[float, dict] | None, tracing: str, warm_up_on: bool = False) -> dict:
    """One model's part of the status snapshot (times still on the controller's clock: `*_t`; `warm_up_on`: the
    controller adds warm-ups, `warm_up_status`)."""
    d, obs, p = mm.last_decision, mm.last_obs, mm.pending
    return {
        "instances": None if mm.current is None or (mm.kind is not None and mm.kind.ensemble) else mm.current.instance_count,
        "delay_us": None if mm.current is None else mm.current.max_queue_delay_us,
        "reachable": mm.reachable,
        "p99_target_ms": mm.limits.p99_target_ms,
        "min_instances": mm.limits.min_instances, "max_instances": mm.limits.max_instances,
        "obs": None if seen is None else seen[1],           # the last valid observation ...
        "obs_t": None if seen is None else seen[0],
        "obs_now": None if obs is None or obs.valid else (obs.invalid_reason or "no data"),   # ... and why not now
        "tracing": tracing,
        "reason": mm.last_reason or None,
        "detail": (d.detail or None) if d is not None else None,
        "held_by": None if d is None or d.held_by is None else d.held_by.value,
        "wants": _asdict(d.target) if d is not None and d.valid and d.target != mm.current else None,
        "reason_since_t": mm.reason_since,
        "last_change": dict(mm.last_change) if mm.last_change else None,
        "reloading": None if p is None else {"to": _asdict(p.decision.target), "reason": p.decision.reason,
                                             "kind": "full_reload" if p.full_reload else "in_place",
                                             "since_t": p.since},
        "recent": [{k: r.get(k) for k in ("time", "action", "reason", "detail", "current", "target", "kind", "error")}
                   for r in mm.history[-5:]],
        "capacity": None if mm.capacity is None else mm.capacity.as_dict(),   # the fleet scaler's figure
        "predicted": None if mm.predicted is None else {"capacity_rps": {str(k): v for k, v in mm.predicted["capacity_rps"].items()},
                                                        "mode": mm.predicted["mode"],
                                                        "correction": mm.predicted.get("correction")},
        "knobs": None if mm.kind is None else mm.kind.describe(),
        "target_from": None if mm.target_from is None else mm.target_from.why,
        "target_ensemble": None if mm.target_from is None else mm.target_from.ensemble,
        "ensemble_steps": list(mm.kind.steps) if mm.kind is not None and mm.kind.ensemble else None,
        "per_device": dict(mm.per_device) if len(mm.per_device) > 1 else None,
        "stateful": bool(mm.kind is not None and mm.kind.sequence_batching) or None,   # `load` cannot drive it
        "warm_up": warm_up_status(mm, warm_up_on),
    }


def _warm_up_samples(mm: ManagedModel) -> tuple[list[dict] | None, str]:
    """The warm-up `Controller._warm_up_now` would add to `mm`'s live config (warmup.samples), or (None, why not)."""
    if mm.kind is not None and mm.kind.sequence_batching:
        # why: the full reload that adds it would end every live sequence (modelkind.py)
        return None, "a stateful model (sequence batcher): the full reload that adds one would end its live sequences"
    return warmup.samples(mm.live_config or {}, mm.observer.executed_sizes())


def warm_up_status(mm: ManagedModel, on: bool = False) -> dict | None:
    """The live config's `model_warmup` (whose: "controller" or "model", its batch sizes) and this controller's
    attempt (`ManagedModel.warm_up`); with neither, where the model reads cold and the controller adds warm-ups
    (`on`), state "waiting" (`Controller._warm_up_now` waits for a quiet tick with room) or "cannot" (why), else None."""
    cfg, tried = mm.live_config, mm.warm_up
    if not warmup.has_warmup(cfg) and tried is None:
        obs = mm.last_obs
        if on and cfg is not None and obs is not None and obs.valid and obs.cold_start is not None:
            if warmup.mild(obs.cold_start, mm.limits.p99_target_ms):
                return {"state": "mild", "live": False,
                        "detail": f"{warmup.excess_ms(obs.cold_start):.1f} ms more an execution, under {warmup.MILD_SHARE:.0%} of the "
                                  f"{mm.limits.p99_target_ms:g}-ms target"}
            samples, why = _warm_up_samples(mm)
            return {"state": "waiting", "detail": None, "live": False} if samples is not None else \
                {"state": "cannot", "detail": why, "live": False}
        return None
    out = {"state": tried["state"] if tried else None, "detail": tried["detail"] if tried else None}
    if warmup.has_warmup(cfg):
        out.update(live=True, by="controller" if warmup.ours(cfg) else "model", sizes=warmup.batch_sizes(cfg))
    else:
        out["live"] = False
    return out


def owner_status(mm: ManagedModel, me: OwnerMark) -> dict | None:
    """Who manages the model according to the mark in its live config (None: no mark yet)."""
    if mm.mark is None:
        return None
    v = mm.owner
    return {"owner": mm.mark.owner, "status_url": mm.mark.status_url, "mine": mm.mark.owner == me.owner,
            "state": None if v is None else v.state, "detail": (v.detail or None) if v is not None else None}


def _server_cpu(server: ServerConfig) -> ServerCpu | None:
    """A reader of the server's CPU (cpu.py) where its gRPC address is this machine's, found by that port; None for
    a server elsewhere (its processes are not visible here)."""
    from .server import tritonserver_pid
    from .telemetry import is_loopback_host
    host, _, port = server.grpc_url.rpartition(":")
    host = host.split("://")[-1].strip("[]")
    if not (host == "0.0.0.0" or is_loopback_host(host)) or not port.isdigit():
        return None
    return ServerCpu(lambda: tritonserver_pid(int(port)))


def _note_requests(mm: ManagedModel, counters: ModelCounters | None, now: float) -> None:
    """When `mm` last had a request: the scrape at which its request count moved or one was pending (the first
    scrape counts as one, as a request may just have ended). A missing scrape says nothing."""
    if counters is None:
        return
    seen = (counters.success or 0.0) + (counters.failure or 0.0)
    if mm.requests_seen is None or seen != mm.requests_seen or (counters.pending or 0.0) > 0:
        mm.last_request_t = now
    mm.requests_seen = seen


def _parameter_values(cfg: dict | None) -> tuple[str, ...]:
    """The string values of a model config's `parameters` (Triton's JSON: {key: {"string_value": ...}})."""
    params = (cfg or {}).get("parameters") or {}
    if not isinstance(params, dict):
        return ()
    return tuple(v["string_value"] for v in params.values()
                 if isinstance(v, dict) and isinstance(v.get("string_value"), str))


def _int_parameter(cfg: dict, key: str) -> int | None:
    """An integer model-config parameter (`parameters {key: ..., value: {string_value: "2"}}`), or None."""
    try:
        value = int(cfg.get("parameters", {}).get(key, {}).get("string_value", ""))
    except (TypeError, ValueError, AttributeError):
        return None
    return value if value > 0 else None


def _change(now: float, result: ApplyResult, decision: Decision, before: Settings, to: Settings | None) -> dict:
    """The `last_change` a model's status shows for an applied, failed or repairing reload."""
    return {"time": time.time(), "t": now, "ok": result.ok, "from": _asdict(before), "to": _asdict(to),
            "reason": decision.reason, "detail": decision.detail, "kind": result.kind,
            "apply_s": round(result.seconds, 2), "error": result.error or None}


def _num1(x) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "?"


def _asdict(s: Settings | None) -> dict | None:
    return None if s is None else {"instances": s.instance_count, "delay_us": s.max_queue_delay_us}


def _fmt(s: Settings | None) -> str:
    return "?" if s is None else f"{s.instance_count} inst/{s.max_queue_delay_us} us"


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200]
