"""`python -m controller <verb>` (also installed as `triton-autotune`).

Verbs: serve (tritonserver + controller), run (controller beside a running server), status,
sweep, bench, soak (N reloads under load, counting lost requests), load (open-loop traffic to one model).
Every user error ends in one line on stderr and a non-zero exit: 2 for bad arguments or
configuration, 1 for a server or runtime failure. Never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from .config import ConfigError, ControllerConfig, ServerConfig, load_config
from .runstate import RunStateError, SeveralRunning
from .server import DEFAULT_REPOSITORY, ServerError, ServerOptions, TritonServer, held_by

log = logging.getLogger("controller")

ADMIN_HEADER = "admin-key"


class UsageError(Exception):
    """Bad command-line input (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        raise UsageError(f"{self.prog}: {message}")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 65535], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m controller", description="Tune Triton instance counts and batching delay online.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    s = sub.add_parser("serve", help="start tritonserver with a model repository and run the controller beside it")
    s.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository (default: the shipped one)")
    s.add_argument("--config", type=Path, help="controller YAML (default: manage every model with the defaults)")
    s.add_argument("--models", help="comma-separated models to load (default: every model in the repository)")
    s.add_argument("--tritonserver", help="server binary (default: tritonserver on PATH, else the nvidia-pytriton one)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    s.add_argument("--http-port", type=_port, default=8000)
    s.add_argument("--grpc-port", type=_port, default=8001)
    s.add_argument("--metrics-port", type=_port, default=8002)
    s.add_argument("--controller-metrics-port", type=_port,
                   help="the controller's /metrics and /status, on loopback (default: the config's, else a free port)")
    s.add_argument("--decision-log", help="JSONL decision log (default: the config's, else decisions.jsonl in the run-state folder)")
    s.add_argument("--dry-run", action="store_true", help="decide and log, change nothing")
    s.add_argument("--no-controller", action="store_true", help="only start the server")
    s.add_argument("--no-auth", action="store_true", help="leave the repository API open (default: guarded by a generated key)")
    s.add_argument("--duration-s", type=_bounded(float, 0.1, 1e7), help="stop by itself after this many seconds (tests, demos)")
    s.add_argument("--max-restarts", type=_bounded(int, 0, 1000), default=3,
                   help="start tritonserver again when it dies, at most this many times within 10 minutes (at once, "
                        "then after 5, 10, 20 s...), with the models' live configs; 0: stop with it (default 3)")

    r = sub.add_parser("run", help="run the controller against a running server (e.g. the NGC container)")
    r.add_argument("--config", type=Path, help="controller YAML (default: the serve running on this machine, "
                   "else loopback ports 8000/8001/8002)")
    r.add_argument("--pid", type=int, help="without --config and with several serves running: the one to use")
    r.add_argument("--dry-run", action="store_true", help="decide and log, change nothing")
    r.add_argument("--duration-s", type=_bounded(float, 0.1, 1e7), help="stop by itself after this many seconds")
    r.add_argument("--decision-log", help="JSONL decision log (overrides the config)")

    st = sub.add_parser("status", help="what the running controller sees: per model load, p99 and its source, why it holds")
    st.add_argument("--config", type=Path, help="controller YAML (default: the serve running on this machine)")
    st.add_argument("--pid", type=int, help="without --config and with several serves running: the one to show")
    st.add_argument("--json", action="store_true", help="one JSON document (the controller's snapshot and the server's model states)")
    st.add_argument("--watch", type=_bounded(float, 0.2, 3600.0), metavar="N", help="redraw every N seconds until Ctrl-C")
    st.add_argument("--decision-log", help="without a reachable controller: read recent decisions from this JSONL file")
    st.add_argument("--last", type=_bounded(int, 0, 50), default=3, help="recent decisions to show per model (default 3)")
    st.add_argument("models", nargs="*", metavar="MODEL", help="only these models' details (default: every model's, "
                    "under a summary line per model; with more than 6 models, the summary only)")
    st.add_argument("--details", action="store_true", help="every model's details, however many")

    sw = sub.add_parser("sweep", help="offline grid: instances x max_queue_delay_us x offered load on one fresh server")
    sw.add_argument("--model", default="sim_accel", help="model to sweep (default sim_accel, the SIMULATED accelerator)")
    sw.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository (default: the shipped one)")
    sw.add_argument("--instances", type=_bounded_list(int, 1, 64), default=[1, 2, 4, 6], help="instance counts (default 1,2,4,6)")
    sw.add_argument("--delays-us", type=_bounded_list(int, 0, 1_000_000), default=[0, 2000], help="max_queue_delay_us values (default 0,2000)")
    sw.add_argument("--rates", type=_bounded_list(float, 0.1, 100_000.0),
                    help="offered loads in req/s (default 50,150,300, or from --scenario); a cell the client could not "
                         "send on time is named after the table")
    sw.add_argument("--scenario", type=Path, help="take the load levels from this trace's phases")
    sw.add_argument("--seconds", type=_bounded(float, 0.5, 600.0), default=6.0, help="measured seconds per cell (default 6)")
    sw.add_argument("--warmup-s", type=_bounded(float, 0.0, 60.0), default=1.0, help="unmeasured warm-up per cell (default 1)")
    sw.add_argument("--sla-ms", type=_bounded(float, 0.1, 600_000.0), default=40.0, help="p99 objective in ms (default 40)")
    sw.add_argument("--seed", type=int, default=0, help="Poisson schedule seed (default 0)")
    sw.add_argument("--out", type=Path, default=Path("results/sweep"), help="output folder (default results/sweep)")

    b = sub.add_parser("bench", help="replay a traffic scenario against default, best_static, oracle and adaptive arms")
    b.add_argument("--scenario", type=Path,
                   help="trace YAML (phases or day_curve), or a two-model scenario (models: with a trace each)")
    b.add_argument("--trace-overhead", action="store_true",
                   help="instead of the arms: measure what request tracing costs (off vs on, same schedule, alternating)")
    b.add_argument("--overhead-rates", type=_bounded_list(float, 1.0, 2000.0), default=[200.0, 500.0],
                   help="with --trace-overhead: steady and overload rates in req/s (default 200,500)")
    b.add_argument("--overhead-rounds", type=_bounded(int, 1, 10), default=2,
                   help="with --trace-overhead: off/on pairs to run (default 2)")
    b.add_argument("--out", type=Path, default=Path("results/bench"), help="output folder (default results/bench)")
    b.add_argument("--sweep", type=Path, help="sweep.json to choose best_static and oracle from (default: run one first)")
    b.add_argument("--sla-ms", type=_bounded(float, 0.1, 600_000.0), default=40.0, help="p99 objective in ms (default 40)")
    b.add_argument("--model", default="sim_accel", help="model (default sim_accel, the SIMULATED accelerator)")
    b.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository (default: the shipped one)")
    b.add_argument("--arms", type=_arm_list, help="comma-separated subset of default,best_static,oracle,adaptive (default all)")
    b.add_argument("--seed", type=int, default=0, help="Poisson schedule seed, the same for every arm (default 0)")
    b.add_argument("--max-instances", type=_bounded(int, 1, 64), default=8, help="the controller's max_instances (default 8)")
    b.add_argument("--controller-interval-s", type=_bounded(float, 0.1, 60.0), default=1.0, help="controller tick (default 1)")
    b.add_argument("--controller-scale-down-delay-s", type=_bounded(float, 0.0, 86_400.0),
                   help="the controller's scale_down_delay_s (default: the controller's own, 30)")
    b.add_argument("--controller-planner", choices=("on", "off"), default="on",
                   help="off: the adaptive arm decides by the reactive rules alone, the planner's fallback (default on)")
    b.add_argument("--controller-tracing", choices=("auto", "on", "off"), default="auto",
                   help="the adaptive arm's request tracing: on, off, or auto (the controller's default) (default auto)")
    b.add_argument("--controller-window-s", type=_bounded(float, 1.0, 600.0), default=10.0, help="controller window (default 10)")
    b.add_argument("--controller-gpu", choices=("auto", "nvml", "simulated", "none"),
                   help="the controller's gpu source (default: simulated for sim_accel, else auto)")
    b.add_argument("--instances", type=_bounded_list(int, 1, 64), default=[1, 2, 4, 6], help="sweep instance counts when no --sweep (default 1,2,4,6)")
    b.add_argument("--delays-us", type=_bounded_list(int, 0, 1_000_000), default=[0, 2000], help="sweep delays when no --sweep (default 0,2000)")
    b.add_argument("--model-analyzer", type=Path, metavar="FILE",
                   help="model_analyzer.json from scripts/model_analyzer.sh: adds the static arm model_analyzer at its pick")
    b.add_argument("--sweep-seconds", type=_bounded(float, 0.5, 600.0), default=4.0, help="measured seconds per sweep cell when no --sweep (default 4)")

    so = sub.add_parser("soak", help="apply N reloads (alternately in place and full) under open-loop load; count lost requests")
    so.add_argument("--reloads", type=_bounded(int, 1, 100_000), required=True, help="reloads to apply")
    so.add_argument("--out", type=Path, required=True, help="output folder for soak.json")
    so.add_argument("--rate-rps", type=_bounded(float, 0.1, 100_000.0), default=50.0,
                    help="offered load in req/s (default 50)")
    so.add_argument("--model", default="sim_accel", help="model to reload (default sim_accel, the SIMULATED accelerator)")
    so.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository for the own server")
    so.add_argument("--url", help="HTTP host:port of a running server (loopback only; default: start one)")
    so.add_argument("--grpc-url", help="with --url: gRPC host:port (default: the HTTP port + 1)")
    so.add_argument("--metrics-url", help="with --url: metrics URL (default: http://host:<HTTP port + 2>/metrics)")
    so.add_argument("--auth-header", help="with --url: repository-API header; its value from $TRITON_ADMIN_KEY")
    so.add_argument("--gap-s", type=_bounded(float, 0.0, 60.0), default=0.5, help="pause between reloads (default 0.5)")
    so.add_argument("--seed", type=_bounded(int, 0, 2**31 - 1), default=0, help="Poisson schedule seed (default 0)")
    so.add_argument("--protocols", type=_protocols, default=("grpc", "http"),
                    help="inference clients driven at once, the rate split evenly (default grpc,http)")

    ld = sub.add_parser("load", help="send open-loop traffic to one model of the running serve (or --url) and "
                        "print what comes back: to watch the controller work")
    ld.add_argument("--model", help="the model (default: serve's one model, where it runs one)")
    ld.add_argument("--rate", type=_bounded(float, 0.01, 100_000.0), metavar="R",
                    help="requests per second, Poisson arrivals, for --seconds")
    ld.add_argument("--seconds", type=_bounded(float, 0.1, 86_400.0), default=60.0,
                    help="with --rate: how long (default 60)")
    ld.add_argument("--trace", type=Path, metavar="FILE", help="instead of --rate: a trace YAML (phases or day_curve, "
                    "as in scripts/scenarios/)")
    ld.add_argument("--pid", type=int, help="with several serves running: the one to load")
    ld.add_argument("--config", type=Path, help="take the server's addresses from this controller YAML")
    ld.add_argument("--url", help="host:port of a server started otherwise (its gRPC port; with --protocol http its "
                    "HTTP port); loopback only")
    ld.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="inference protocol (default grpc)")
    ld.add_argument("--every", type=_bounded(float, 0.2, 3600.0), default=5.0, metavar="S",
                    help="a line every S seconds (default 5)")
    ld.add_argument("--sla-ms", type=_bounded(float, 0.1, 600_000.0), help="also count the answers within this latency")
    ld.add_argument("--timeout-s", type=_bounded(float, 0.1, 600.0), default=10.0,
                    help="a request not answered this long after its time counts as failed (default 10)")
    ld.add_argument("--seed", type=_bounded(int, 0, 2**31 - 1), default=0, help="Poisson schedule seed (default 0)")
    ld.add_argument("--json", type=Path, metavar="FILE", help="also write the summary as JSON")
    for verb in (ld, sw, b, so):
        _add_input_args(verb)
    return p


def _bounded(convert, lo, hi):
    """An argparse type: one number in [lo, hi]."""
    def parse(text: str):
        try:
            value = convert(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in [{lo:g}, {hi:g}], got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value:g} is outside [{lo:g}, {hi:g}]")
        return value
    return parse


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
    from .evaluation.inputs import parse_shape
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_input_args(parser: argparse.ArgumentParser) -> None:
    """--shape and --input-data: what the requests carry (see controller/evaluation/inputs.py)."""
    parser.add_argument("--shape", type=_shape, action="append", default=[], metavar="NAME:D1,D2",
                        help="an input's dims without the batch dim, setting its variable (-1) ones (repeat per "
                             "input; default: 1 for each variable dim)")
    parser.add_argument("--input-data", type=Path, metavar="FILE",
                        help="the requests' contents, perf_analyzer's JSON format ({\"data\": [{INPUT: [values]}, "
                             "...]}), sent in turn (default: random values)")
    parser.add_argument("--batch-size", type=_bounded(int, 1, 1_000_000), default=1, metavar="N",
                        help="items per request, where the model batches (default 1)")


def _input_spec(args):
    """The InputSpec of --shape/--input-data/--batch-size, or None where none was given; UsageError for a bad one."""
    from .evaluation.inputs import InputSpecError, make_spec
    try:
        return make_spec(args.shape, args.input_data, args.batch_size)
    except InputSpecError as e:
        raise UsageError(str(e)) from None


def _bounded_list(convert, lo, hi):
    """An argparse type: comma-separated distinct numbers, each in [lo, hi]."""
    one = _bounded(convert, lo, hi)
    def parse(text: str) -> list:
        values = [one(item) for item in text.split(",")]
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"duplicate values in {text!r}")
        return values
    return parse


BENCH_ARMS = ("default", "best_static", "oracle", "adaptive")


def _arm_list(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if a not in BENCH_ARMS]
    if bad or not arms:
        raise argparse.ArgumentTypeError(f"arms must be among {','.join(BENCH_ARMS)}, got {text!r}")
    return arms


# ---- helpers ------------------------------------------------------------------------------

def _install_signal_handlers(stop: threading.Event) -> None:
    def handler(signum, _frame):
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be: the same clean stop, exit 143."""


def _terminate_as_interrupt():
    """SIGTERM (a CI job's timeout, `kill`, a Kubernetes Job ended) stops sweep, bench, soak and load as Ctrl-C does:
    their servers stopped, their work folders removed. Python's default for SIGTERM ends the process at once, and
    left a tritonserver's work folder (its traces, the backend copy) behind in /tmp. Returns the handler it
    replaced (None where none could be set: main() called off the main thread)."""
    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # why: a second SIGTERM ends it at once
        raise Terminated()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _with_overrides(cfg: ControllerConfig, args) -> ControllerConfig:
    loop = cfg.loop
    if getattr(args, "dry_run", False):
        loop = dataclasses.replace(loop, dry_run=True)
    if getattr(args, "decision_log", None):
        loop = dataclasses.replace(loop, decision_log=args.decision_log)
    if getattr(args, "controller_metrics_port", None):
        loop = dataclasses.replace(loop, metrics_port=args.controller_metrics_port)
    return dataclasses.replace(cfg, loop=loop)


def _start_controller(cfg: ControllerConfig, port: int | None, mark: bool = True):
    """A Controller and, when `port` is not None, its loopback endpoint (/metrics, /status; 0: a free port).
    `mark`: its status URL goes into the owner marks it writes (controller/ownership.py); `run` on a port the config
    did not name marks nothing, as before it served one (a claim is a full reload of each model)."""
    from .loop import Controller
    controller = Controller(cfg)
    endpoint = None
    host = cfg.loop.metrics_address
    if port is not None:
        try:
            # why: an address other than loopback is only ever the config's explicit choice
            endpoint = controller.metrics.serve(port, host, status=controller.status_snapshot, allow_remote=True)
        except OSError as e:
            controller.close()
            raise ServerError(f"cannot serve the controller's metrics on {host}:{port}: {e.strerror or e}"
                              + held_by(port, " (by {})")
                              + " (choose another with --controller-metrics-port or controller.metrics_port)") from None
        log.info("controller metrics and status on http://%s:%d/metrics and /status", _hostport(host), endpoint.port)
        import socket
        reach = "127.0.0.1" if host in ("127.0.0.1", "::1", "localhost") else \
            (socket.gethostname() if host in ("0.0.0.0", "::") else host)
        if mark:
            controller.set_status_url(f"http://{_hostport(reach)}:{endpoint.port}/status")   # goes into the owner mark
    return controller, endpoint


def _hostport(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _run_controller(controller, endpoint, stop: threading.Event) -> None:
    try:
        controller.run(stop)
    finally:
        if endpoint is not None:
            endpoint.close()
        controller.close()


def _stop_after(seconds: float, stop: threading.Event) -> None:
    """Set `stop` after `seconds`; a daemon timer, so a stop by signal does not wait for it to expire."""
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()


def _wait_for_server(server: ServerConfig, stop: threading.Event, headers: dict) -> bool:
    """Wait, with backoff, until the server is live. False if stopped first."""
    from .actuation import TritonControl
    delay, said = 1.0, False
    while not stop.is_set():
        control = TritonControl(server.grpc_url, server.http_url, server.control_protocol, headers, timeout_s=server.timeout_s)
        try:
            if control.live():
                return True
        except Exception as e:  # noqa: BLE001
            if not said:
                log.warning("server at %s (%s) is not reachable (%s); retrying with backoff", server.grpc_url if
                            server.control_protocol == "grpc" else server.http_url, server.control_protocol, " ".join(str(e).split())[:150])
                said = True
        finally:
            control.close()
        stop.wait(delay)
        delay = min(delay * 2, 30.0)
    return False


# ---- verbs ----------------------------------------------------------------------------------

def cmd_serve(args) -> int:
    from . import runstate
    cfg = _with_overrides(load_config(args.config), args)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    restricted = None
    if not args.no_auth:
        key = os.environ.get(cfg.server.auth_key_env) or secrets.token_urlsafe(24)
        os.environ[cfg.server.auth_key_env] = key
        restricted = (ADMIN_HEADER, key)
    options = ServerOptions(repository=args.repository, host=args.host, http_port=args.http_port,
                            grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                            tritonserver=args.tritonserver, models=models, restricted_key=restricted)
    stop = threading.Event()
    _install_signal_handlers(stop)
    t0 = time.monotonic()
    server = TritonServer(options)
    state = {"pid": os.getpid(), "started": time.time(), "phase": "starting", "http_url": server.http_url,
             "grpc_url": server.grpc_url, "metrics_url": server.metrics_url,
             "auth_header": ADMIN_HEADER if restricted else None, "key_file": None, "decision_log": None,
             "controller_port": None, "models": models, "repository": str(args.repository)}
    folder = _write_run_state(state, None)
    controller = endpoint = supervisor = None
    try:
        premarked = {}
        if not args.no_controller:
            # why: started before the server, the controller's owner mark goes into each model's first load, so
            # that no claim (a full reload of every instance) follows under the load that begins after "ready"
            server_cfg = dataclasses.replace(
                cfg.server, http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url,
                auth_header=ADMIN_HEADER if restricted else cfg.server.auth_header,
                repository=str(server.options.repository))
            cfg = dataclasses.replace(cfg, server=server_cfg)
            served = server.model_names()
            if not cfg.models:
                cfg = cfg.with_models(served)
            else:
                _check_config_models(cfg, server.options.repository, args.config)
            if not cfg.loop.decision_log and folder is not None:
                # why: a newcomer's first question is "what did it do?"; the log outlives the serve
                cfg = dataclasses.replace(cfg, loop=dataclasses.replace(
                    cfg.loop, decision_log=str(runstate.serve_dir(os.getpid(), folder) / "decisions.jsonl")))
            controller, endpoint = _start_controller(cfg, cfg.loop.metrics_port or 0)
            premarked = controller.first_load_configs(server.options.repository, served)
        server.start(premarked)
        print(f"tritonserver ready in {time.monotonic() - t0:.1f} s: HTTP {server.http_url}, gRPC {server.grpc_url}, "
              f"metrics {server.metrics_url}", flush=True)
        if restricted:
            key_file = server.workdir / "admin-key"
            key_file.touch(mode=0o600)
            key_file.write_text(restricted[1])
            state["key_file"] = str(key_file)
            print(f"repository API restricted: send header '{ADMIN_HEADER}' with the value in {key_file} "
                  f"(or set {cfg.server.auth_key_env} before starting to choose it; --no-auth to disable)", flush=True)
        print(f"server log: {server.log_path}", flush=True)
        if args.duration_s:
            _stop_after(args.duration_s, stop)
        if args.no_controller:
            state["phase"] = "running"
            _write_run_state(state, folder)
            print("no controller (--no-controller); `python -m controller status` shows the server's live configs",
                  flush=True)
            supervisor = _supervise(server, stop, args.max_restarts, None, state, folder)
            while not stop.wait(0.5):     # why: a wait with a timeout, so that the signal handler runs promptly
                pass
            if supervisor.gave_up.is_set():
                raise ServerError(supervisor.last_words)
            return 0
        state.update(phase="running", decision_log=cfg.loop.decision_log and str(Path(cfg.loop.decision_log).resolve()),
                     controller_port=endpoint.port, models=list(cfg.models))
        _write_run_state(state, folder)
        print(f"controller status: python -m controller status (or http://127.0.0.1:{endpoint.port}/status); "
              f"decision log: {state['decision_log'] or 'none'}", flush=True)
        _say_which_wait(cfg, controller, models)
        print(f"controller managing {', '.join(cfg.models)} (p99 targets: "
              f"{', '.join(f'{m} {lim.p99_target_ms:g} ms' for m, lim in cfg.models.items())})", flush=True)
        supervisor = _supervise(server, stop, args.max_restarts,
                                lambda: controller.restart_configs(server.options.repository, served), state, folder)
        controller.run(stop)
        if supervisor.gave_up.is_set():
            raise ServerError(supervisor.last_words)
        return 0
    finally:
        stop.set()
        if endpoint is not None:
            endpoint.close()
        if controller is not None:
            controller.close()
        # why: after a restart under way has ended (the supervisor holds its lock through it and its run-state write)
        with supervisor.ended() if supervisor is not None else contextlib.nullcontext():
            if folder is not None:
                runstate.remove(os.getpid(), folder)
            server.stop()
        print("stopped", flush=True)


def _check_config_models(cfg: ControllerConfig, repository, config_path) -> None:
    """A model the config names must be in the repository `serve` runs: a typo (`sim_acel`) would otherwise leave the
    model meant unmanaged and the controller holding a model that cannot exist."""
    from .server import is_model_folder, repository_models
    repo = Path(repository)
    unknown = [m for m in cfg.models if not is_model_folder(repo / m)]
    if unknown:
        held = repository_models(repo)
        raise ConfigError(f"{config_path or 'the config'}: models: {', '.join(unknown)} not in the repository {repo} "
                          f"(its models: {', '.join(held) or 'none'})")


def _say_which_wait(cfg: ControllerConfig, controller, listed) -> None:
    """A model the config names that `serve` did not load (not in --models, nor a step of an ensemble there) is held
    until someone loads it; say so once at start-up rather than leave it to a log line per model."""
    try:
        ready = {m["name"] for m in controller.control.repository_index() if m.get("state") == "READY"}
    except Exception as e:    # why: only a notice; the loop reports an unreachable server in its own words
        log.debug("cannot list the loaded models: %s", e)
        return
    waiting = [m for m in cfg.models if m not in ready]
    if waiting:
        print(f"not loaded: {', '.join(waiting)} (named in the config, not loaded by serve"
              f"{' --models ' + ','.join(listed) if listed else ''}); the controller manages "
              f"{'it' if len(waiting) == 1 else 'them'} once loaded", flush=True)


def _write_run_state(state: dict, folder: Path | None) -> Path | None:
    """Write serve's run-state file (see runstate); the folder it went to, None if it cannot be written."""
    from . import runstate
    try:
        folder = folder or runstate.run_dir()
        runstate.write(state, folder)
        return folder
    except OSError as e:
        log.warning("cannot write the run-state file (%s); `status` and `run` will need --config", e)
        return None


def _supervise(server: TritonServer, stop: threading.Event, max_restarts: int, configs,
               state: dict, folder: Path | None) -> "ServerSupervisor":
    """Start the server's watch (server.ServerSupervisor): a server that dies is started again with the models it
    ran (`configs`: the controller's live configs, fresher than the watch's own 5-s read of them), at most
    `max_restarts` times within 10 minutes; its notices go to serve's output, its restarts to the run-state file
    (`status` shows the last)."""
    from .server import RestartBudget, ServerSupervisor

    def say(text: str) -> None:
        print(text, flush=True)

    def restarted(records: list[dict]) -> None:
        state["server_restarts"] = records[-20:]
        _write_run_state(state, folder)
    return ServerSupervisor(server, stop, configs, RestartBudget(max_restarts), say=say, on_restart=restarted).start()


def cmd_run(args) -> int:
    from . import runstate
    serve = None
    if args.config is None:
        cfg, serve = _config_from_serve(args.pid)
        cfg = _with_overrides(cfg, args)
    else:
        cfg = _with_overrides(load_config(args.config), args)
    headers = cfg.server.auth_headers()
    stop = threading.Event()
    _install_signal_handlers(stop)
    if args.duration_s:
        _stop_after(args.duration_s, stop)
    if not _wait_for_server(cfg.server, stop, headers):
        return 0
    _check_repository_access(cfg.server, headers, cfg.loop.dry_run)
    cfg = _with_local_repository(cfg)
    # why: `status` finds this controller through a file in the run-state folder (beside serve's, or naming the
    # config file), so its endpoint is always served: on a free loopback port unless the config names one
    if not cfg.loop.metrics_port:      # why: a port the config did not ask for stays on loopback
        cfg = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, metrics_address="127.0.0.1"))
    controller, endpoint = _start_controller(cfg, cfg.loop.metrics_port or 0, mark=bool(cfg.loop.metrics_port))
    state = {"started": time.time(), "controller_port": endpoint.port, "decision_log": cfg.loop.decision_log}
    written = None
    if serve is not None:
        written = runstate.write_beside(serve.pid, state)
        log.info("beside serve pid %d: `python -m controller status` shows this controller's view", serve.pid)
    elif not cfg.loop.metrics_port and args.config is not None:
        written = runstate.write_config_run(args.config, state)
        log.info("`python -m controller status --config %s` shows this controller's view", args.config)
    try:
        _run_controller(controller, endpoint, stop)
    finally:
        if written is not None:
            written.unlink(missing_ok=True)
    return 0


def _with_local_repository(cfg: ControllerConfig) -> ControllerConfig:
    """Where the config sets no `server.repository` and the server listens on this machine: the folder its
    tritonserver process was given (server.served_repository), said in one line. With it the controller holds a
    reload that would change the versions served, and reads which models a BLS model calls in its source (README,
    "With your own server")."""
    from .telemetry import is_loopback_host
    from .server import served_repository
    if cfg.server.repository:
        return cfg
    host, _, port = cfg.server.http_url.rpartition(":")
    host = host.split("://")[-1].strip("[]")
    # why: the loopback check (127.0.0.0/8, localhost, ::1); 0.0.0.0 as a client address is local too
    if not (host == "0.0.0.0" or is_loopback_host(host)) or not port.isdigit():
        return cfg
    path, why = served_repository(int(port))
    if path is None:
        log.info("server.repository not set and not found (%s): no check of the versions a reload would serve, no "
                 "reading of the models BLS models name in their source; set it where this machine reads the "
                 "repository", why)
        return cfg
    log.info("server.repository not set: reading %s, %s", path, why)
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, repository=str(path)))


def _config_from_serve(pid: int | None):
    """`run` without --config: the serve on this machine (its addresses and key) and its run state, else the
    defaults and None."""
    from . import runstate
    from .status import read_key, server_config_from_state
    try:
        state = runstate.choose(pid)
    except runstate.NothingRunning:
        log.info("no serve found in %s; using the default addresses (loopback 8000/8001/8002)", runstate.run_dir(create=False))
        return ControllerConfig(), None
    if state.get("controller_port"):
        raise UsageError(f"run: serve pid {state.pid} already runs a controller on its models; start serve with "
                         "--no-controller to run one separately (or pass --config for another server)")
    server = server_config_from_state(state)
    key = read_key(state, server.auth_key_env)
    if key:
        os.environ[server.auth_key_env] = key
    log.info("using serve pid %d: gRPC %s, HTTP %s", state.pid, server.grpc_url, server.http_url)
    # why: serve's repository, which its run state records, is what the controller reads for versions and BLS calls
    return ControllerConfig(server=dataclasses.replace(server, repository=state.get("repository"))), state


def _check_repository_access(server: ServerConfig, headers: dict, dry_run: bool = False) -> None:
    """Repository calls before the loop starts, so that a refused key, or a server that takes no model loads (not in
    explicit model-control mode: every change would fail), is one clear line, not a log loop. A dry run changes
    nothing, so a server without model control only gets a warning there."""
    from .actuation import (CONTROL_OFF_WHY, RESTRICTED, WRONG_KEY, TritonControl, classify_error, control_off_text,
                            explain_error)
    control = TritonControl(server.grpc_url, server.http_url, server.control_protocol, headers, timeout_s=server.timeout_s)
    where = server.grpc_url if server.control_protocol == "grpc" else server.http_url
    try:
        control.repository_index()
        takes_loads = control.takes_model_loads()
    except Exception as e:  # noqa: BLE001
        if classify_error(e, bool(headers)) in (RESTRICTED, WRONG_KEY):
            raise ServerError(explain_error(e, where, bool(headers), server.auth_key_env)) from None
        return      # why: anything else (a server going away) the loop reports, and retries, in its own words
    finally:
        control.close()
    if not takes_loads:
        if not dry_run:
            raise ServerError(f"{control_off_text(where)}, or run with --dry-run to only watch and decide")
        log.warning("the server at %s takes no model loads: %s (a dry run changes nothing, so it goes on)", where,
                    CONTROL_OFF_WHY)


def cmd_status(args) -> int:
    from . import runstate
    from .status import UnknownModel, format_text, gather, resolve, select_models, watch

    def one() -> str:
        target = resolve(args.config, args.pid, lambda p: _with_overrides(load_config(p), args))
        if args.decision_log:
            target = dataclasses.replace(target, decision_log=args.decision_log)
        doc = gather(target, last=args.last)
        if args.models:
            doc = select_models(doc, args.models)
            if args.json:
                doc.pop("all_models")
        return json.dumps(doc, indent=1) if args.json else \
            format_text(doc, last=args.last, details=True if args.details else None)

    def frame() -> str:
        try:
            return one()
        except runstate.SeveralRunning as e:
            return f"{e}:\n{e.listing()}"
        except (runstate.RunStateError, ServerError, UnknownModel) as e:
            return f"{time.strftime('%H:%M:%S')} {e}"

    if args.watch:
        return watch(frame, args.watch)
    try:
        print(one())
    except runstate.NothingRunning as e:
        print(str(e))
        return 1
    except runstate.SeveralRunning as e:
        print(f"{e}:\n{e.listing()}")
        return 2
    except runstate.RunStateError as e:
        raise ServerError(str(e)) from None
    except UnknownModel as e:        # a model named that the server and the controller do not know
        print(str(e))
        return 1
    return 0


def cmd_sweep(args) -> int:
    from .evaluation.loadgen import TraceError, load_trace
    from .evaluation.sweep import format_table, rates_from_trace, run_sweep, write_sweep
    if args.rates is None and args.scenario is not None:
        try:
            args.rates = rates_from_trace(load_trace(args.scenario))
        except TraceError as e:
            raise UsageError(f"scenario: {e}") from None
    rates = args.rates or [50.0, 150.0, 300.0]
    from .evaluation.inputs import InputSpecError
    inputs = _input_spec(args)
    try:
        doc = run_sweep(args.model, args.instances, args.delays_us, rates, seconds=args.seconds,
                        warmup_s=args.warmup_s, sla_ms=args.sla_ms, seed=args.seed, repository=args.repository,
                        inputs=inputs)
    except InputSpecError as e:
        raise UsageError(f"sweep: {e}") from None
    path = write_sweep(doc, args.out)
    print(format_table(doc))
    print(f"wrote {path} and {path.with_suffix('.png')} ({doc['elapsed_s']:g} s)")
    return 0


def cmd_bench(args) -> int:
    if args.trace_overhead:
        from .evaluation.overhead import OverheadOptions, format_overhead, run_trace_overhead
        if len(args.overhead_rates) != 2:
            raise UsageError("--overhead-rates: give two rates, steady and overload (e.g. 200,500)")
        doc = run_trace_overhead(OverheadOptions(
            model=args.model, repository=args.repository, out=args.out, steady_rps=args.overhead_rates[0],
            overload_rps=args.overhead_rates[1], rounds=args.overhead_rounds, sla_ms=args.sla_ms, seed=args.seed),
            log=lambda m: print(m, file=sys.stderr, flush=True))
        print(format_overhead(doc))
        print(f"wrote {args.out / 'trace_overhead.json'}")
        return 0
    if args.scenario is None:
        raise UsageError("bench: --scenario is required (or --trace-overhead)")
    from .evaluation.bench import BenchError, run_bench
    from .evaluation.bench_multi import MultiBenchError, is_multi_model_scenario, run_bench_multi
    try:
        if is_multi_model_scenario(args.scenario):
            if args.model_analyzer is not None:
                raise UsageError("--model-analyzer: only for a one-model scenario")
            if args.shape or args.input_data is not None or args.batch_size > 1:
                raise UsageError("--shape, --input-data and --batch-size: only for a one-model scenario (a two-model "
                                 "one sends random inputs of one item to each)")
            return run_bench_multi(args)      # two models sharing one device and memory budget
        return run_bench(args)
    except (BenchError, MultiBenchError) as e:
        raise UsageError(str(e)) from None


def _protocols(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names or any(p not in ("grpc", "http") for p in names):
        raise argparse.ArgumentTypeError(f"expected grpc, http or grpc,http; got {text!r}")
    return names


def cmd_soak(args) -> int:
    from .evaluation.soak import SoakError, SoakOptions, run_soak, summary_line
    opts = SoakOptions(reloads=args.reloads, out=args.out, rate_rps=args.rate_rps, model=args.model,
                       repository=args.repository, url=args.url, grpc_url=args.grpc_url, metrics_url=args.metrics_url,
                       auth_header=args.auth_header, gap_s=args.gap_s, seed=args.seed, protocols=args.protocols,
                       inputs=_input_spec(args))
    if not args.url and (args.grpc_url or args.metrics_url or args.auth_header):
        raise UsageError("--grpc-url, --metrics-url and --auth-header need --url")
    try:
        doc = run_soak(opts)
    except SoakError as e:
        raise UsageError(str(e)) from None
    print(summary_line(doc))
    print(f"wrote {Path(args.out) / 'soak.json'}")
    return 0 if doc["failed_requests"] == 0 and doc["server_failures"] == 0 and doc["reloads_failed"] == 0 else 1


def cmd_load(args) -> int:
    from . import runstate
    from .evaluation.load import LoadError, LoadInputError, LoadOptions, flush_print, run_load
    if sum(x is not None for x in (args.url, args.config, args.pid)) > 1:
        raise UsageError("load: give at most one of --url, --config and --pid")
    serves_models: tuple[str, ...] = ()
    if args.url is not None:
        url = args.url
    elif args.config is not None:
        server = load_config(args.config).server
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
    else:
        try:
            state = runstate.choose(args.pid)
        except runstate.NothingRunning:
            raise RunStateError("nothing is running: no `python -m controller serve` on this machine "
                                "(for a server started otherwise, pass --url HOST:PORT)") from None
        url = state.get("grpc_url") if args.protocol == "grpc" else state.get("http_url")
        serves_models = tuple(state.get("models") or ())
        where = f"serve pid {state.pid}"
    model = args.model
    if model is None:
        if len(serves_models) == 1:
            model = serves_models[0]
        elif serves_models:
            raise UsageError(f"load: --model: {where} runs {', '.join(serves_models)}; choose one")
        else:
            raise UsageError("load: --model is required")
    opts = LoadOptions(model=model, url=url, protocol=args.protocol, rate_rps=args.rate, seconds=args.seconds,
                       trace=args.trace, every_s=args.every, timeout_s=args.timeout_s, seed=args.seed,
                       sla_ms=args.sla_ms, json_out=args.json, inputs=_input_spec(args))
    try:
        doc, stopped = run_load(opts, out=flush_print)
    except LoadInputError as e:
        raise UsageError(f"load: {e}") from None
    except LoadError as e:
        raise ServerError(str(e)) from None
    if stopped:
        return 130
    return 0 if doc["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    verbs = {"serve": cmd_serve, "run": cmd_run, "status": cmd_status, "sweep": cmd_sweep, "bench": cmd_bench,
             "soak": cmd_soak, "load": cmd_load}
    # why not serve and run: they stop on their own handlers (a stop event)
    previous = _terminate_as_interrupt() if args.verb not in ("serve", "run") else None
    try:
        return verbs[args.verb](args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RunStateError as e:          # run without --config: no such serve, or several (pass --pid)
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, SeveralRunning) else 1
    except Terminated:
        return 143
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
