"""What every bench arm does, in one place (the one-model bench and the two-model bench both use it).

`run_arm(spec)`:

1. starts a fresh tritonserver with the arm's models (free ports, the arm's repository);
2. applies each model's initial settings through the Actuator (an arm that cannot start from them
   fails with ServerError);
3. for an arm with a controller: writes its config to `OUT/<arm>_controller.yaml` (the server's URLs
   and the decision log `OUT/<arm>_decisions.jsonl` filled in), starts `python -m controller run`
   from this source tree as a separate process (output in `OUT/<arm>_controller.log`, a
   `--duration-s` so it stops by itself), and gives it `CONTROLLER_LEAD_S`; one that exits before
   the traffic fails the arm;
4. replays each model's open-loop schedule (one thread per model when there are several), with an
   optional helper running beside the traffic (the oracle's switcher) and, in every arm alike, a
   `StatsSampler` reading the server's statistics every `STATS_EVERY_S` (so the bench can say how long
   the server took per execution in each phase: a slower server and a longer queue are told apart);
5. after the traffic: reads the controller's CPU, stops it (SIGTERM, then SIGKILL), reads its
   decision log back, and reads the live settings of every model;
6. in `finally`, whatever happened: stops the helper, kills the controller if it still runs, closes
   the client and stops the server.

Throughout, a tritonserver that dies is started again as `serve` starts it (server.ServerSupervisor: same ports,
each model with the live config its snapshot read last, every 2 s; at most 3 times), so that one crash of Triton's
costs an arm the seconds it was down rather than the rest of its traffic; `ArmRun.server_restarts` lists them, and the
bench reports them per arm.

Every arm is judged on the same traffic, so everything but the settings and the controller is
the same here for all of them.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from ..decision_log import read_records
from ..types import Settings
from .inputs import InputSpec, variable_notes
from .loadgen import RequestRecord, inputs_from_config, live_config, run_open_loop_sync

CONTROLLER_LEAD_S = 2.0            # the controller process starts this long before the traffic
CONTROLLER_STOP_S = 15.0           # SIGTERM, then SIGKILL after this long
REQUEST_TIMEOUT_S = 10.0
STATS_EVERY_S = 2.0                # the StatsSampler's period


class Helper(Protocol):
    """Something that runs beside an arm's traffic (started by its factory) and reports change events."""

    def stop(self) -> list[dict]: ...


@dataclass(frozen=True)
class ControllerSpec:
    """The controller of an arm: its config's `controller:` section (less the decision and observation
    log paths, filled in here) and `models:` section, and how long it may run before it stops by itself."""

    settings: Mapping
    models: Mapping
    duration_s: float
    observation_log: bool = False


@dataclass(frozen=True)
class ArmSpec:
    name: str                                   # names the files under `out`
    models: Sequence[str]
    initial: Mapping[str, Settings]             # applied to each model before the traffic
    schedules: Mapping[str, np.ndarray]         # each model's request offsets (s) from the traffic start
    out: Path
    repository: Path | None = None              # None: the shipped model repository
    controller: ControllerSpec | None = None
    helper: Callable[[object, float], Helper] | None = None   # (server, traffic t0 monotonic) -> a started helper
    inputs: Mapping[str, InputSpec | None] = field(default_factory=dict)   # per model: --shape/--input-data


@dataclass
class ArmRun:
    records: dict[str, list[RequestRecord]]
    wall0: float                                # time.time() at the traffic start
    traffic_s: float
    server_start_s: float
    live_at_end: dict[str, Settings | None]
    helper_events: list[dict] = field(default_factory=list)
    controller_doc: dict | None = None          # the config the controller ran with
    controller: dict | None = None              # cpu_pct, cpu_pct_incl_startup, cpu_s, exit_code
    decisions: list[dict] = field(default_factory=list)
    observation_log: Path | None = None
    stats_samples: list[tuple[float, dict]] = field(default_factory=list)   # StatsSampler.samples
    server_restarts: list[dict] = field(default_factory=list)             # ServerSupervisor.restarts, `t` added

    def applied_changes(self) -> list[dict]:
        """The controller's applied changes, `t` in seconds from the traffic start (decision log records)."""
        out = []
        for rec in self.decisions:
            if rec.get("action") != "applied":
                continue
            live = rec.get("live") or rec.get("target") or {}
            out.append({"t": round(rec["time"] - self.wall0, 3), "model": rec.get("model"),
                        "instances": live.get("instances"), "delay_us": live.get("delay_us"),
                        "kind": rec.get("kind"), "reason": rec.get("reason"), "apply_s": rec.get("apply_s"),
                        "detail": rec.get("detail")})
        return out


class StatsSampler(threading.Thread):
    """Reads every model's statistics (`GET /v2/models/stats`, one request) every `every_s` during an arm's
    traffic. `samples` is [(seconds since the traffic start, {model: StatsCounters})]; a failed read is
    skipped. One request every 2 s is far less than the controller's own reads (one a second), and every arm
    gets it, so it costs all arms alike."""

    def __init__(self, http_url: str, metrics_url: str, t0: float, every_s: float = STATS_EVERY_S):
        super().__init__(daemon=True, name="stats-sampler")
        from ..signals import Scraper
        self.scraper = Scraper(metrics_url, http_url)
        self.t0, self.every_s = t0, every_s
        self.samples: list[tuple[float, dict]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while True:
            self._read()
            if self.stop_event.wait(self.every_s):
                self._read()            # the traffic's end
                return

    def _read(self) -> None:
        t = time.monotonic() - self.t0
        stats = self.scraper.all_stats()
        if stats is not None:
            self.samples.append((round(t, 3), stats))

    def stop(self) -> list[tuple[float, dict]]:
        self.stop_event.set()
        self.join(timeout=10)
        return self.samples


def controller_run_s(traffic_s: float) -> float:
    """The controller's --duration-s: it outlives the lead, the traffic and its last timeouts, then stops by
    itself if nobody stops it. Example: 180 s of traffic -> 2 + 180 + 2 * 10 + 30 = 232 s."""
    return CONTROLLER_LEAD_S + traffic_s + 2 * REQUEST_TIMEOUT_S + 30


def log(msg: str) -> None:
    """A harness progress line, on stderr."""
    print(msg, file=sys.stderr, flush=True)


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process in seconds, from /proc/<pid>/stat (None if gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # fields 14, 15 of stat


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def start_controller(spec: ControllerSpec, server, out: Path, arm: str) -> tuple[subprocess.Popen, dict, Path, Path | None]:
    """Write the arm's controller config and start `python -m controller run` from this source tree.

    Returns (process, the config document, decision log path, observation log path or None).
    """
    import yaml

    from ..server import PACKAGE_ROOT

    out = out.resolve()       # the controller runs in the source root: give it absolute paths
    decision_log = out / f"{arm}_decisions.jsonl"
    observation_log = out / f"{arm}_observations.jsonl" if spec.observation_log else None
    for log in (decision_log, observation_log):
        if log is not None:
            log.unlink(missing_ok=True)
    logs = {"decision_log": str(decision_log)}
    if observation_log is not None:
        logs["observation_log"] = str(observation_log)
    doc = {"server": {"http_url": server.http_url, "grpc_url": server.grpc_url, "metrics_url": server.metrics_url},
           "controller": {**spec.settings, **logs},
           "models": {name: dict(limits) for name, limits in spec.models.items()}}
    cfg_path = out / f"{arm}_controller.yaml"
    cfg_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(out / f"{arm}_controller.log", "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "controller", "run", "--config", str(cfg_path),
                                 "--duration-s", str(spec.duration_s)],
                                cwd=PACKAGE_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    return proc, doc, decision_log, observation_log


def _drive(url: str, schedules: Mapping[str, np.ndarray], inputs: Mapping) -> dict[str, list[RequestRecord]]:
    """Each model's schedule at once (a thread per model beyond the first); the first error is raised."""
    records: dict[str, list[RequestRecord]] = {}
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            records[name] = run_open_loop_sync(url, name, schedules[name], inputs[name], protocol="grpc",
                                               timeout_s=REQUEST_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            errors.append(e)

    names = list(schedules)
    threads = [threading.Thread(target=one, args=(n,), name=f"traffic-{n}") for n in names[1:]]
    for t in threads:
        t.start()
    one(names[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records


def run_arm(spec: ArmSpec) -> ArmRun:
    """Run one arm on its own fresh server (see the module doc)."""
    from ..actuation import Actuator, TritonControl
    from ..server import (DEFAULT_REPOSITORY, RestartBudget, ServerError, ServerOptions, ServerSupervisor, TritonServer,
                          free_port)

    # why: the server's own log outlives its work dir, so that an arm whose server failed says why
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            models=list(spec.models), repository=spec.repository or DEFAULT_REPOSITORY,
                            log_path=Path(spec.out).resolve() / f"{spec.name}_tritonserver.log")
    t_start = time.monotonic()
    with TritonServer(options) as server:
        server_start_s = time.monotonic() - t_start
        control = TritonControl(server.grpc_url, server.http_url)
        actuator = Actuator(control)
        controller = helper = sampler = supervisor = None
        watching = threading.Event()
        try:
            for name in spec.models:
                result = actuator.apply(name, spec.initial[name])
                if not result.ok:
                    raise ServerError(f"arm {spec.name}: cannot apply the initial config {spec.initial[name]} "
                                      f"to {name}: {result.error}")
            # why: every arm alike, its live configs read every STATS_EVERY_S (from the initial ones just applied)
            # (the controller runs apart, so the snapshot is its configs' only source: both read every 2 s)
            supervisor = ServerSupervisor(server, watching, budget=RestartBudget(3), snapshot_s=STATS_EVERY_S,
                                          configs_every_s=STATS_EVERY_S,
                                          say=lambda text: log(f"arm {spec.name}: {text}")).start()
            inputs = {}
            for name in spec.models:
                config = live_config(server.http_url, name)
                inputs[name] = inputs_from_config(config, spec=spec.inputs.get(name))
                for note in variable_notes(config, spec.inputs.get(name)):
                    log(f"arm {spec.name}: note: {name}: {note}")
            run_doc = None
            if spec.controller is not None:
                controller, run_doc, decision_log, observation_log = start_controller(
                    spec.controller, server, spec.out, spec.name)
                spawned = time.monotonic()
                time.sleep(CONTROLLER_LEAD_S)
                if controller.poll() is not None:
                    raise ServerError(f"the controller exited with code {controller.returncode} before the traffic; "
                                      f"see {spec.out / f'{spec.name}_controller.log'}")
                cpu_start = proc_cpu_s(controller.pid)
            wall0, t0 = time.time(), time.monotonic()
            if spec.helper is not None:
                helper = spec.helper(server, t0)
            sampler = StatsSampler(server.http_url, server.metrics_url, t0)
            sampler.start()
            records = _drive(server.grpc_url, {n: spec.schedules[n] for n in spec.models}, inputs)
            traffic_s = time.monotonic() - t0
            run = ArmRun(records, wall0, round(traffic_s, 2), round(server_start_s, 2), live_at_end={})
            run.stats_samples, sampler = sampler.stop(), None
            if helper is not None:
                run.helper_events, helper = helper.stop(), None
            if controller is not None:
                cpu_end, t_end = proc_cpu_s(controller.pid), time.monotonic()
                stop_process(controller, timeout_s=CONTROLLER_STOP_S)
                run.controller_doc, run.observation_log = run_doc, observation_log
                run.decisions = read_records(decision_log)
                run.controller = {
                    "cpu_pct": (None if cpu_start is None or cpu_end is None else
                                round(100.0 * (cpu_end - cpu_start) / (t_end - t0), 3)),
                    "cpu_pct_incl_startup": None if cpu_end is None else round(100.0 * cpu_end / (t_end - spawned), 3),
                    "cpu_s": cpu_end, "exit_code": controller.returncode}
            for name in spec.models:
                try:
                    run.live_at_end[name] = actuator.read(name)[1]
                except Exception:  # noqa: BLE001 - informational only
                    run.live_at_end[name] = None
            run.server_restarts = [{**r, "t": round(r["at"] - wall0, 2)} for r in supervisor.restarts]
            return run
        finally:
            if helper is not None:
                helper.stop()
            if sampler is not None:
                sampler.stop()
            if controller is not None and controller.poll() is None:
                controller.kill()
                controller.wait(timeout=10)
            watching.set()
            control.close()
            if supervisor is not None:
                with supervisor.ended():    # why: a restart under way ends before the server stops (with's exit)
                    pass


def settings_dict(settings: Settings | None) -> dict | None:
    return None if settings is None else dataclasses.asdict(settings)
