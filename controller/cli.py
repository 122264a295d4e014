"""`python -m controller <verb>` (also installed as `triton-autotune`).

Verbs: serve (tritonserver + controller), run (controller beside a running server), status,
sweep, bench, soak (N reloads under load, counting lost requests).
Every user error ends in one line on stderr and a non-zero exit: 2 for bad arguments or
configuration, 1 for a server or runtime failure. Never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from .config import ConfigError, ControllerConfig, ServerConfig, load_config
from .server import DEFAULT_REPOSITORY, ServerError, ServerOptions, TritonServer

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
    s.add_argument("--controller-metrics-port", type=_port, help="serve the controller's own metrics here")
    s.add_argument("--decision-log", help="JSONL decision log (default: none, or the config's)")
    s.add_argument("--dry-run", action="store_true", help="decide and log, change nothing")
    s.add_argument("--no-controller", action="store_true", help="only start the server")
    s.add_argument("--no-auth", action="store_true", help="leave the repository API open (default: guarded by a generated key)")
    s.add_argument("--duration-s", type=_bounded(float, 0.1, 1e7), help="stop by itself after this many seconds (tests, demos)")

    r = sub.add_parser("run", help="run the controller against a running server (e.g. the NGC container)")
    r.add_argument("--config", type=Path, help="controller YAML (default: loopback ports 8000/8001/8002)")
    r.add_argument("--dry-run", action="store_true", help="decide and log, change nothing")
    r.add_argument("--duration-s", type=_bounded(float, 0.1, 1e7), help="stop by itself after this many seconds")
    r.add_argument("--decision-log", help="JSONL decision log (overrides the config)")

    st = sub.add_parser("status", help="print each managed model's live config and recent decisions")
    st.add_argument("--config", type=Path, help="controller YAML (for the server address and decision log)")
    st.add_argument("--decision-log", help="read recent decisions from this JSONL file")
    st.add_argument("--last", type=int, default=5, help="decisions to show per model")

    sw = sub.add_parser("sweep", help="offline grid: instances x max_queue_delay_us x offered load on one fresh server")
    sw.add_argument("--model", default="sim_accel", help="model to sweep (default sim_accel, the SIMULATED accelerator)")
    sw.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository (default: the shipped one)")
    sw.add_argument("--instances", type=_bounded_list(int, 1, 64), default=[1, 2, 4, 6], help="instance counts (default 1,2,4,6)")
    sw.add_argument("--delays-us", type=_bounded_list(int, 0, 1_000_000), default=[0, 2000], help="max_queue_delay_us values (default 0,2000)")
    sw.add_argument("--rates", type=_bounded_list(float, 0.1, 400.0), help="offered loads in req/s (default 50,150,300, or from --scenario)")
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
    b.add_argument("--controller-window-s", type=_bounded(float, 1.0, 600.0), default=10.0, help="controller window (default 10)")
    b.add_argument("--controller-gpu", choices=("auto", "nvml", "simulated", "none"),
                   help="the controller's gpu source (default: simulated for sim_accel, else auto)")
    b.add_argument("--instances", type=_bounded_list(int, 1, 64), default=[1, 2, 4, 6], help="sweep instance counts when no --sweep (default 1,2,4,6)")
    b.add_argument("--delays-us", type=_bounded_list(int, 0, 1_000_000), default=[0, 2000], help="sweep delays when no --sweep (default 0,2000)")
    b.add_argument("--sweep-seconds", type=_bounded(float, 0.5, 600.0), default=4.0, help="measured seconds per sweep cell when no --sweep (default 4)")

    so = sub.add_parser("soak", help="apply N reloads (alternately in place and full) under open-loop load; count lost requests")
    so.add_argument("--reloads", type=_bounded(int, 1, 100_000), required=True, help="reloads to apply")
    so.add_argument("--out", type=Path, required=True, help="output folder for soak.json")
    so.add_argument("--rate-rps", type=_bounded(float, 0.1, 400.0), default=50.0, help="offered load in req/s (default 50)")
    so.add_argument("--model", default="sim_accel", help="model to reload (default sim_accel, the SIMULATED accelerator)")
    so.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository for the own server")
    so.add_argument("--url", help="HTTP host:port of a running server (loopback only; default: start one)")
    so.add_argument("--grpc-url", help="with --url: gRPC host:port (default: the HTTP port + 1)")
    so.add_argument("--metrics-url", help="with --url: metrics URL (default: http://host:<HTTP port + 2>/metrics)")
    so.add_argument("--auth-header", help="with --url: repository-API header; its value from $TRITON_ADMIN_KEY")
    so.add_argument("--gap-s", type=_bounded(float, 0.0, 60.0), default=0.5, help="pause between reloads (default 0.5)")
    so.add_argument("--seed", type=_bounded(int, 0, 2**31 - 1), default=0, help="Poisson schedule seed (default 0)")
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


def _with_overrides(cfg: ControllerConfig, args) -> ControllerConfig:
    loop = cfg.loop
    if getattr(args, "dry_run", False):
        loop = dataclasses.replace(loop, dry_run=True)
    if getattr(args, "decision_log", None):
        loop = dataclasses.replace(loop, decision_log=args.decision_log)
    if getattr(args, "controller_metrics_port", None):
        loop = dataclasses.replace(loop, metrics_port=args.controller_metrics_port)
    return dataclasses.replace(cfg, loop=loop)


def _run_controller(cfg: ControllerConfig, stop: threading.Event) -> None:
    from .loop import Controller
    controller = Controller(cfg)
    if cfg.loop.metrics_port:
        controller.metrics.serve(cfg.loop.metrics_port)
        log.info("controller metrics on http://127.0.0.1:%d/metrics", cfg.loop.metrics_port)
    try:
        controller.run(stop)
    finally:
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
    server.start()
    try:
        print(f"tritonserver ready in {time.monotonic() - t0:.1f} s: HTTP {server.http_url}, gRPC {server.grpc_url}, "
              f"metrics {server.metrics_url}", flush=True)
        if restricted:
            key_file = server.workdir / "admin-key"
            key_file.touch(mode=0o600)
            key_file.write_text(restricted[1])
            print(f"repository API restricted: send header '{ADMIN_HEADER}' with the value in {key_file} "
                  f"(or set {cfg.server.auth_key_env} before starting to choose it; --no-auth to disable)", flush=True)
        print(f"server log: {server.log_path}", flush=True)
        if args.duration_s:
            _stop_after(args.duration_s, stop)
        if args.no_controller:
            while not stop.wait(0.5):
                if server.process.poll() is not None:
                    raise ServerError(f"tritonserver exited with code {server.process.returncode}: {server.log_tail()}")
            return 0
        server_cfg = dataclasses.replace(
            cfg.server, http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url,
            auth_header=ADMIN_HEADER if restricted else cfg.server.auth_header)
        cfg = dataclasses.replace(cfg, server=server_cfg)
        if not cfg.models:
            cfg = cfg.with_models(models or _loaded_models(server))
        print(f"controller managing {', '.join(cfg.models)} (p99 targets: "
              f"{', '.join(f'{m} {lim.p99_target_ms:g} ms' for m, lim in cfg.models.items())})", flush=True)
        died = _watch_server(server, stop)
        _run_controller(cfg, stop)
        if died.is_set():
            raise ServerError(f"tritonserver exited with code {server.process.returncode}: {server.log_tail()}")
        return 0
    finally:
        server.stop()
        print("stopped", flush=True)


def _watch_server(server: TritonServer, stop: threading.Event) -> threading.Event:
    """Stop everything if the server process exits on its own; the returned event says it did."""
    died = threading.Event()

    def watch():
        while not stop.wait(0.5):
            if server.process is not None and server.process.poll() is not None:
                died.set()
                stop.set()
    threading.Thread(target=watch, daemon=True).start()
    return died


def _loaded_models(server: TritonServer) -> list[str]:
    from .server import repository_models
    return repository_models(server.options.repository)


def cmd_run(args) -> int:
    cfg = _with_overrides(load_config(args.config), args)
    headers = cfg.server.auth_headers()
    stop = threading.Event()
    _install_signal_handlers(stop)
    if args.duration_s:
        _stop_after(args.duration_s, stop)
    if not _wait_for_server(cfg.server, stop, headers):
        return 0
    _run_controller(cfg, stop)
    return 0


def cmd_status(args) -> int:
    import json
    from .actuation import TritonControl, settings_of
    cfg = _with_overrides(load_config(args.config), args)
    s = cfg.server
    control = TritonControl(s.grpc_url, s.http_url, s.control_protocol, cfg.server.auth_headers(), timeout_s=s.timeout_s)
    try:
        try:
            index = control.repository_index()
        except Exception as e:  # noqa: BLE001
            raise ServerError(f"cannot reach the server at {s.grpc_url if s.control_protocol == 'grpc' else s.http_url}: "
                              f"{' '.join(str(e).split())[:150]}") from None
        names = list(cfg.models) or sorted(m["name"] for m in index)
        states = {m["name"]: m.get("state", "?") for m in index}
        history: dict[str, list[dict]] = {}
        if cfg.loop.decision_log and Path(cfg.loop.decision_log).exists():
            for line in Path(cfg.loop.decision_log).read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                history.setdefault(rec.get("model"), []).append(rec)
        for name in names:
            state = states.get(name, "NOT IN REPOSITORY")
            line = f"{name}: {state}"
            if state == "READY":
                live = settings_of(control.config(name))
                line += f", {live.instance_count} instance(s), max_queue_delay_us {live.max_queue_delay_us}"
            print(line)
            seen = next((r for r in reversed(history.get(name, [])) if (r.get("obs") or {}).get("p99_ms") is not None), None)
            if seen is not None:
                print("  " + describe_observation(seen))
            for rec in history.get(name, [])[-args.last:]:
                when = time.strftime("%H:%M:%S", time.localtime(rec.get("time", 0)))
                tgt = rec.get("target") or {}
                print(f"  {when} {rec.get('action'):8} {rec.get('reason'):26} -> {tgt.get('instances')} inst, "
                      f"{tgt.get('delay_us')} us  {rec.get('detail') or ''}")
        return 0
    finally:
        control.close()


def describe_observation(rec: dict) -> str:
    """One line of what the controller last saw: "seen 12:00:01: 150 req/s, p99 12.3 ms (trace, 240 samples), ..."."""
    o = rec.get("obs") or {}
    when = time.strftime("%H:%M:%S", time.localtime(rec.get("time", 0)))
    source = o.get("p99_source", "?") + (f", {o['p99_samples']} samples" if o.get("p99_samples") else "")
    parts = [f"{o.get('arrival_rps', 0):g} req/s", f"p99 {o['p99_ms']:g} ms ({source})",
             f"queue {o.get('queue_ms', 0):g} ms, compute {o.get('compute_ms', 0):g} ms per request"]
    svc = o.get("service")
    if svc:
        beta = "?" if svc.get("beta_ms") is None else f"{svc['beta_ms']:g}"
        parts.append(f"service {svc.get('alpha_ms')} + {beta} x batch ms (r2 {svc.get('r2')}, {svc.get('executions')} executions)")
    if rec.get("tracing"):
        parts.append(f"tracing {rec['tracing']}")
    return f"seen {when}: " + "; ".join(parts)


def cmd_sweep(args) -> int:
    from .loadgen import TraceError, load_trace
    from .sweep import format_table, rates_from_trace, run_sweep, write_sweep
    if args.rates is None and args.scenario is not None:
        try:
            args.rates = rates_from_trace(load_trace(args.scenario))
        except TraceError as e:
            raise UsageError(f"scenario: {e}") from None
    rates = args.rates or [50.0, 150.0, 300.0]
    if max(rates) > 400:
        raise UsageError(f"--rates: the load generator sustains about 400 req/s here; got {max(rates):g}")
    doc = run_sweep(args.model, args.instances, args.delays_us, rates, seconds=args.seconds, warmup_s=args.warmup_s,
                    sla_ms=args.sla_ms, seed=args.seed, repository=args.repository)
    path = write_sweep(doc, args.out)
    print(format_table(doc))
    print(f"wrote {path} and {path.with_suffix('.png')} ({doc['elapsed_s']:g} s)")
    return 0


def cmd_bench(args) -> int:
    if args.trace_overhead:
        from .overhead import OverheadOptions, format_overhead, run_trace_overhead
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
    from .bench import BenchError, run_bench
    from .bench_multi import MultiBenchError, is_multi_model_scenario, run_bench_multi
    try:
        if is_multi_model_scenario(args.scenario):
            return run_bench_multi(args)      # two models sharing one device and memory budget
        return run_bench(args)
    except (BenchError, MultiBenchError) as e:
        raise UsageError(str(e)) from None


def cmd_soak(args) -> int:
    from .soak import SoakError, SoakOptions, run_soak, summary_line
    opts = SoakOptions(reloads=args.reloads, out=args.out, rate_rps=args.rate_rps, model=args.model,
                       repository=args.repository, url=args.url, grpc_url=args.grpc_url, metrics_url=args.metrics_url,
                       auth_header=args.auth_header, gap_s=args.gap_s, seed=args.seed)
    if not args.url and (args.grpc_url or args.metrics_url or args.auth_header):
        raise UsageError("--grpc-url, --metrics-url and --auth-header need --url")
    try:
        doc = run_soak(opts)
    except SoakError as e:
        raise UsageError(str(e)) from None
    print(summary_line(doc))
    print(f"wrote {Path(args.out) / 'soak.json'}")
    return 0 if doc["failed_requests"] == 0 and doc["server_failures"] == 0 and doc["reloads_failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    verbs = {"serve": cmd_serve, "run": cmd_run, "status": cmd_status, "sweep": cmd_sweep, "bench": cmd_bench,
             "soak": cmd_soak}
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
    except KeyboardInterrupt:
        return 130
