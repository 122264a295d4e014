"""`python -m controller status`: what the running controller sees, for people (aligned text) and scripts (--json).

Where it looks, in this order: `--config FILE` (the server's addresses, its key from the environment,
the controller's endpoint at `controller.metrics_port`); else the run-state file of the one `serve`
on this machine (`runstate`; `--pid N` when there are several), which gives the addresses, the key
file and the controller's port. It reads

* from the server: each model's state (READY, ...) through the repository API;
* from the controller: its `/status` snapshot (load, p99 and its source, queue vs compute time, the
  reason it holds and for how long, the last change), not re-derived from logs;
* when the controller cannot be reached (`serve --no-controller`, `run` without a metrics port): the
  server's live configs, and the decision log's last records if one is known.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import runstate, warmup
from .actuation import TritonControl, explain_error, settings_of
from .config import ControllerConfig, ServerConfig
from .decision_log import by_model, read_records
from .service import JITTER_FLOOR
from .signals import SUMMARIES_OFF
from .server import LIVE_STATES, ServerError, load_error_text

CONTROLLER_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Target:
    """Everything `status` needs to know about one deployment."""

    server: ServerConfig
    headers: dict[str, str]
    controller_port: int | None
    decision_log: str | None
    models: tuple[str, ...] = ()          # configured models (empty: what the server has)
    serve: runstate.ServeState | None = None
    config_path: str | None = None
    no_controller_why: str = ""

    @property
    def where(self) -> str:
        return self.server.grpc_url if self.server.control_protocol == "grpc" else self.server.http_url


def read_key(state: runstate.ServeState, env: str = "TRITON_ADMIN_KEY") -> str | None:
    """The admin key of a serve: from its key file (0600, the same user), else from `$env`."""
    key_file = state.get("key_file")
    if not state.get("auth_header"):
        return None
    if key_file:
        try:
            return Path(key_file).read_text().strip()
        except OSError as e:
            if os.environ.get(env):
                return os.environ[env]
            raise ServerError(f"cannot read the admin key of serve pid {state.pid} from {key_file} "
                              f"({e.strerror or e}); set {env} to it") from None
    if os.environ.get(env):
        return os.environ[env]
    raise ServerError(f"serve pid {state.pid} is still starting (no key file yet); try again in a moment")


def server_config_from_state(state: runstate.ServeState) -> ServerConfig:
    return ServerConfig(http_url=state.get("http_url"), grpc_url=state.get("grpc_url"),
                        metrics_url=state.get("metrics_url"), auth_header=state.get("auth_header"))


def target_from_state(state: runstate.ServeState) -> Target:
    if state.get("phase") == "starting":
        raise ServerError(f"serve pid {state.pid} is starting tritonserver (for {_dur(time.time() - state.get('started', 0))}); "
                          "try again in a moment")
    server = server_config_from_state(state)
    key = read_key(state, server.auth_key_env)
    headers = {server.auth_header: key} if server.auth_header and key else {}
    port, decision_log = state.get("controller_port"), state.get("decision_log")
    beside = None if port else runstate.controller_beside(state.pid)
    if beside is not None:      # `run` with no flags beside this serve --no-controller
        port, decision_log = beside.get("controller_port"), beside.get("decision_log") or decision_log
    why = "" if port else "serve runs with --no-controller"
    return Target(server, headers, port, decision_log, tuple(state.get("models") or ()), serve=state,
                  no_controller_why=why)


def target_from_config(cfg: ControllerConfig, path: str | None) -> Target:
    port, decision_log = cfg.loop.metrics_port or None, cfg.loop.decision_log
    run = runstate.controller_for_config(Path(path)) if port is None and path else None
    if run is not None:        # `run --config` with this file, on the port it took (runstate.py)
        port, decision_log = run.get("controller_port"), run.get("decision_log") or decision_log
    return Target(cfg.server, cfg.server.auth_headers(), port, decision_log, tuple(cfg.models),
                  config_path=path, no_controller_why="" if port else "the config sets no controller.metrics_port "
                  "and no `run` with it runs here")


# ---- gathering ----------------------------------------------------------------------------------

def by_name(index: list[dict]) -> dict[str, dict]:
    """The repository index by model name. A model of several versions on the server (its version policy loads
    `all` or `latest N`) has one entry per version: its state is READY where one version is (the server serves it),
    else the last one's, and `versions` keeps each version's state and reason (a new version that failed to load
    beside one that serves is what a user asks about; the controller's count applies to every version).

    Example: [{"name": "m", "version": "1", "state": "READY"}, {"name": "m", "version": "2", "state": "UNAVAILABLE",
    "reason": "..."}] -> {"m": {"name": "m", "version": "1", "state": "READY", "versions": [{"version": "1",
    "state": "READY", "reason": ""}, {"version": "2", "state": "UNAVAILABLE", "reason": "..."}]}}.
    """
    grouped: dict[str, list[dict]] = {}
    for entry in index:
        grouped.setdefault(entry["name"], []).append(entry)
    out = {}
    for name, entries in grouped.items():
        ready = [e for e in entries if e.get("state") == "READY"]
        entry = dict(ready[0] if ready else entries[-1])
        versioned = [e for e in entries if e.get("version")]
        if len(versioned) > 1:
            entry["versions"] = [{"version": str(e["version"]), "state": e.get("state") or "",
                                  "reason": load_error_text(e.get("reason") or "")} for e in versioned]
        out[name] = entry
    return out


def fetch_controller(port: int, timeout_s: float = CONTROLLER_TIMEOUT_S) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout_s) as r:
        return json.loads(r.read())


def gather(target: Target, last: int = 3) -> dict[str, Any]:
    """One status document (what --json prints). Raises ServerError with a one-line, classified message."""
    s = target.server
    control = TritonControl(s.grpc_url, s.http_url, s.control_protocol, target.headers, timeout_s=min(s.timeout_s, 5.0))
    try:
        try:
            index = control.repository_index()
        except Exception as e:  # noqa: BLE001 - any client error: say which kind
            raise ServerError(explain_error(e, target.where, bool(target.headers), s.auth_key_env)) from None
        states = by_name(index)
        # why: serve's run-state says for sure that no controller runs; a config without a port says only that none
        # is reachable (`run` may tune without one)
        absent = target.serve is not None and not target.controller_port
        snapshot, ctl_error = None, target.no_controller_why or None
        if target.controller_port:
            try:
                snapshot = fetch_controller(target.controller_port)
                ctl_error = None
            except (OSError, ValueError) as e:
                ctl_error = f"http://127.0.0.1:{target.controller_port}/status: {_short(e)}"
        seen = dict(snapshot.get("models") or {}) if snapshot else {}
        names = list(seen) or list(target.models) or [n for n, m in states.items() if m.get("state")] or list(states)
        models: dict[str, dict] = {}
        history = by_model(read_records(target.decision_log)) if snapshot is None else {}

        def live_settings(name: str, m: dict) -> None:
            try:
                live = settings_of(control.config(name))
                m.update(instances=live.instance_count, delay_us=live.max_queue_delay_us)
            except Exception as e:  # noqa: BLE001
                m["error"] = _short(e)
        for name in names:
            entry = states.get(name, {})
            m: dict[str, Any] = {"state": entry.get("state") or "NOT LOADED"}
            if entry.get("reason"):
                m["state_reason"] = entry["reason"]
            if entry.get("versions"):
                m["versions"] = entry["versions"]
            if name in seen:
                m.update(seen[name])
            elif m["state"] == "READY":
                live_settings(name, m)
            if history.get(name):
                m["log"] = history[name][-max(last, 1):]
            models[name] = m
        for name, entry in states.items():
            # why: what else the server runs (a model loaded by hand beside serve's) is what a user asks about next
            if name in models or entry.get("state") not in LIVE_STATES:
                continue
            models[name] = {"state": entry["state"], "unmanaged": True}
            if absent:
                # why: under --no-controller nothing is tuned; the line says only that serve was not given it
                models[name]["unmanaged_why"] = "loaded on the server, not one of serve's models (--models)"
            elif snapshot is None and target.serve is None and target.models:
                # why: without the controller's own view, a model the config does not name may still be managed
                models[name]["unmanaged_why"] = ("not named in the config; the controller (not reachable) may manage "
                                                 "it all the same, as an ensemble's step or a model a BLS model calls")
                models[name]["unmanaged_guess"] = True
            if entry["state"] == "READY":
                live_settings(name, models[name])
    finally:
        control.close()
    doc: dict[str, Any] = {"time": time.time()}
    if target.serve is not None:
        st = target.serve
        doc["source"] = {"kind": "serve", "pid": st.pid, "started": st.get("started"), "run_state": str(st.path),
                         "phase": st.get("phase"), "server_restarts": st.get("server_restarts") or []}
    else:
        doc["source"] = {"kind": "config", "path": target.config_path}
    doc["server"] = {"http_url": s.http_url, "grpc_url": s.grpc_url, "metrics_url": s.metrics_url}
    doc["decision_log"] = (snapshot or {}).get("decision_log") or target.decision_log
    doc["controller"] = None if snapshot is None else {k: v for k, v in snapshot.items() if k != "models"}
    doc["controller_error"] = ctl_error
    doc["controller_absent"] = absent
    doc["models"] = models
    return doc


# ---- text ---------------------------------------------------------------------------------------

NOW_WHY = {"no_samples": "no data yet",
           "scrape_failed": "the metrics scrape failed (check server.metrics_url, and that the server runs with "
                            "metrics on: --allow-metrics=true, its default)",
           "too_few_samples": "collecting data",
           "span_too_short": "collecting data since the last change", "server_unreachable": "the server does not answer"}


def _dur(seconds: float | None) -> str:
    """12 s, 3m 05s, 2h 10m."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "?"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _share(x: Any) -> str:
    """A fraction as a percentage that stays readable when small: 0.003 -> "0.3%" (not "0.00"), 1.5 -> "150%"."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "?"
    return f"{x:.1%}" if abs(x) < 0.095 else f"{x:.0%}"


CORRECTED_BY = {"trace": "traced p99s", "mean": "mean latencies (untraced; the tail not yet checked)",
                   "mean_tail": "mean latencies x the tail Triton's summaries measured (untraced)"}


def _correction_text(c) -> str:
    """The factor the planner's predictions carry (observed / predicted over recent windows) and what it compares.
    Example: {"x": 1.18, "from": "mean_tail"} -> "; predictions x 1.18, from mean latencies x the tail ..."."""
    if not isinstance(c, dict) or not isinstance(c.get("x"), (int, float)):
        return ""
    return f"; predictions x {c['x']:.2f}, from " + CORRECTED_BY.get(c.get("from"), str(c.get("from") or "?"))


def _warm_up_text(w: dict) -> str:
    """The warm-up row: the live config's model_warmup, or why the controller did not add one (loop.warm_up_status)."""
    sizes = warmup.spans(w.get("sizes") or [])
    if w.get("live"):
        if w.get("by") == "controller":
            return (f"Triton's model_warmup, added by the controller after it read a cold start ({w.get('detail') or 'zero data'}"
                    + ("" if w.get("detail") else f" at batch size(s) {sizes}") + ")")
        return f"Triton's model_warmup, the model's own (batch size(s) {sizes})"
    state = w.get("state")
    if state == "waiting":
        return ("to be added by the controller (Triton's model_warmup, a full reload at the live settings) at a quiet "
                f"tick with its instances at most {warmup.BUSY_MAX:.0%} busy (or after {warmup.WAIT_MAX_S / 60:g} minutes of "
                "waiting), no other reload in flight "
                "and room for a second copy")
    if state == "reloading":
        return f"adding Triton's model_warmup ({w.get('detail')}): a full reload in flight"
    if state == "failed":
        return (f"the reload with Triton's model_warmup failed ({w.get('detail')}); it serves on unwarmed, not tried "
                "again: warm it up in its initialize or give its config a model_warmup")
    if state == "cannot":
        return (f"not added: {w.get('detail')}; warm it up in its initialize or give its config a model_warmup")
    if state == "added":     # an operator's load since then dropped it: the controller does not add it twice
        return f"added by the controller ({w.get('detail')}), since gone from the live config: not added again"
    return f"{state}: {w.get('detail')}"


def _busy_note(o: dict) -> str:
    """" (estimated)" where the busy figure came from the request counters (no `batch_stats` over the
    window: it reads high when batch sizes vary); nothing where it is exact or the log predates the field."""
    return " (estimated)" if o.get("busy_source") == "requests" else ""


def _g(x: Any) -> str:
    return "?" if x is None else f"{x:g}"


def _settings(instances: Any, delay_us: Any) -> str:
    plural = "" if instances == 1 else "s"
    return f"{instances} instance{plural}, delay {delay_us} us"


def _clock(wall: float | None) -> str:
    return "?" if wall is None else time.strftime("%H:%M:%S", time.localtime(wall))


def _change(fr: dict | None, to: dict | None) -> str:
    if not to:
        return "?"
    if fr == to:            # a reload of the same settings: a claim, a repair, a warm-up
        return f"same settings ({_settings(to.get('instances'), to.get('delay_us'))})"
    if fr and fr.get("delay_us") == to.get("delay_us"):
        return f"{fr.get('instances')} -> {_settings(to.get('instances'), to.get('delay_us'))}"
    if fr:
        return f"{_settings(fr.get('instances'), fr.get('delay_us'))} -> {_settings(to.get('instances'), to.get('delay_us'))}"
    return "-> " + _settings(to.get("instances"), to.get("delay_us"))


def format_header(doc: dict) -> list[str]:
    src, srv, ctl = doc.get("source") or {}, doc.get("server") or {}, doc.get("controller")
    where = f"HTTP {srv.get('http_url')}  gRPC {srv.get('grpc_url')}  metrics {srv.get('metrics_url')}"
    if src.get("kind") == "serve":
        up = _dur(doc.get("time", time.time()) - src["started"]) if src.get("started") else "?"
        lines = [f"serve pid {src.get('pid')}, up {up}: {where}"]
        restarts = src.get("server_restarts") or []
        if restarts:
            last = restarts[-1]
            when = time.strftime("%H:%M:%S", time.localtime(last.get("at") or 0))
            then = "started again" if last.get("ok") else f"did not start again ({last.get('error')})"
            failed = last.get("not_loaded") or []
            if failed:
                then += f" without {len(failed)} model(s) that failed to load ({'; '.join(failed)})"
            lines.append(f"tritonserver died and was restarted {len(restarts)} time(s); last at {when}: "
                         f"{last.get('exit')}, {then}; its log then: {last.get('log') or '?'}")
    else:
        lines = [f"server from {src.get('path') or 'the default addresses'}: {where}"]
    if ctl is not None:
        tracing = ctl.get("tracing") or "?"
        mode = "dry run (decides, changes nothing)" if ctl.get("dry_run") else "applies its changes"
        lines.append(f"controller: up {_dur(ctl.get('uptime_s'))}, a tick every {_g(ctl.get('interval_s'))} s over a "
                     f"{_g(ctl.get('window_s'))} s window, {mode}; tracing {tracing}")
        if ctl.get("tracing_caution"):
            lines.append(f"tracing: {ctl['tracing_caution']}")
        if ctl.get("summaries") is False:
            lines.append(f"latency summaries: none on this server; {SUMMARIES_OFF}")
        if ctl.get("error"):
            lines.append(f"controller error: {ctl['error']}")
        if (ctl.get("tick_age_s") or 0) > 3 * (ctl.get("interval_s") or 1) + 5:
            lines.append(f"controller: last tick {_dur(ctl['tick_age_s'])} ago (a slow scrape or reload?)")
    else:
        why = doc.get("controller_error")
        if doc.get("controller_absent"):
            lines.append(f"no controller: {why}; showing the server's live configs only")
        else:
            lines.append("controller not reachable; showing the server's live configs only"
                         + (f" ({why})" if why else ""))
    if doc.get("decision_log"):
        lines.append(f"decision log: {doc['decision_log']}")
    return lines


def _calls_text(callee: str, k: dict) -> str:
    """"plain (1.0 a request)", or "plain (4.0 a request, 1.2 of them in sequence)" where a request sends its
    calls at once (controller/calls.py)."""
    each, serial = k.get("per_request"), k.get("in_sequence")
    text = f"{callee} ({_num(each, 1)} a request"
    if isinstance(each, (int, float)) and isinstance(serial, (int, float)) and each - serial >= 0.05:
        text += f", {_num(serial, 1)} of them in sequence"
    return text + ")"


def _calls_row(calls: dict, tracing_off: bool = False) -> str:
    """The `calls` row: the callees seen in the request traces, then those only named in the model's source (a
    caller that does not pass its trace on, or request tracing off; controller/calls.py), with what to do about it."""
    seen = [_calls_text(c, k) for c, k in calls.items() if k.get("traced", True)]
    named = [c for c, k in calls.items() if not k.get("traced", True)]
    parts = [", ".join(seen) + ", seen in its request traces"] if seen else []
    if named:
        why = ("request tracing is off, so its calls are not measured" if tracing_off else
               "its calls are not traced: pass trace=request.trace() to the InferenceRequest to measure them")
        parts.append(", ".join(named) + f" named in its model.py or config, taken as 1 call a request ({why})")
    return "; ".join(parts) + ": their latency is part of this model's"


def _step_line(step: str, s: dict | None, ensemble: str) -> str:
    """One step of an ensemble, as the ensemble's block shows it: instances, p99 against the target it runs under."""
    if not s:
        return f"{step}: not on the server"
    o = s.get("obs") or {}
    parts = [f"{step}: {s.get('state', '?')}"]
    if s.get("instances") is not None:
        parts.append(_settings(s["instances"], s.get("delay_us")))
    if o.get("p99_ms") is not None:
        parts.append(f"p99 {_num(o['p99_ms'], 1)} ms")
    if s.get("p99_target_ms") is not None:
        parts.append(f"target {_num(s['p99_target_ms'], 1)} ms"
                     + (f" (from {ensemble})" if s.get("target_ensemble") == ensemble else " (its own)"))
    if o.get("queue_ms") is not None and o.get("completion_rps"):     # why: with no request, 0.00 ms is no figure
        parts.append(f"queue {_num(o['queue_ms'], 2)} ms + compute {_num(o.get('compute_ms'), 2)} ms per request")
    if s.get("reloading"):
        parts.append("reloading")
    elif s.get("reason"):
        parts.append(str(s["reason"]))
    return ", ".join(parts)


def _ensemble_rows(m: dict, models: dict, name: str) -> list[tuple[str, str]]:
    """An ensemble's own figures: its end-to-end latency, and each step as the controller tunes it."""
    rows: list[tuple[str, str]] = []
    o = m.get("obs") or {}
    steps = m.get("ensemble_steps") or []
    if o.get("mean_ms") is not None and o.get("completion_rps"):      # why: with no request, 0.00 ms is no figure
        step_means = [((models.get(s) or {}).get("obs") or {}).get("mean_ms") for s in steps]
        text = f"mean {_num(o['mean_ms'], 2)} ms per request end to end"
        if steps and all(x is not None for x in step_means):
            text += f"; {_num(sum(step_means), 2)} ms in its steps, {_num(max(0.0, o['mean_ms'] - sum(step_means)), 2)} ms around them"
        rows.append(("per request", text))
    for s in steps:
        rows.append(("step", _step_line(s, models.get(s), name)))
    return rows


def _versions_line(versions: list[dict], instances: int | None) -> str:
    text = ", ".join(f"{v['version']} {v['state'] or 'listed'}" + (f" ({v['reason']})" if v["reason"] and
                                                                     v["state"] != "READY" else "")
                     for v in versions)
    ready = sum(v["state"] == "READY" for v in versions)
    if ready > 1:
        each = f"{instances} instance(s) each, {ready * instances} in all" if instances else "the count applies to each"
        text += f": {each} (the version policy loads several; traffic picks its version)"
    return text


def _cpu_text(cpu: dict, name: str) -> str:
    """The CPU as the model's device (cpu.py): how busy its usable cores were, the server's part of that, and this
    model's part of the server's. Example: "the device: 2 usable cores 96% busy, 81% of it the server's processes;
    this model's instances 100% of its models'"."""
    text = f"the device: {cpu.get('cores', 0):.3g} usable cores {100 * cpu['util']:.0f}% busy"
    if isinstance(cpu.get("server"), (int, float)):
        text += f", {100 * cpu['server']:.0f}% of it the server's processes"
    stubs = cpu.get("stubs") or {}
    if isinstance(stubs.get(name), (int, float)):
        text += f"; this model's instances {100 * stubs[name]:.0f}% of its models'"
    return text


def format_model(name: str, m: dict, last: int = 3, models: dict | None = None) -> list[str]:
    """One aligned block per model (`models`: every model's block, for an ensemble's steps)."""
    ens = m.get("ensemble_steps") is not None
    head = f"{name}  {m.get('state', '?')}"
    if m.get("instances") is not None:
        head += f"  {_settings(m['instances'], m.get('delay_us'))}"
    if m.get("p99_target_ms") is not None and ens:
        head += f"  (target p99 {_num(m['p99_target_ms'], 0)} ms, end to end; tuned through its steps)"
    elif m.get("p99_target_ms") is not None:
        head += (f"  (target p99 {_num(m['p99_target_ms'], 1 if m.get('target_ensemble') else 0)} ms"
                 + (f" from {m['target_ensemble']}" if m.get("target_ensemble") else "")
                 + f", {m.get('min_instances')}-{m.get('max_instances')} instances)")
    if m.get("state_reason") and m.get("state") != "READY":
        head += f": {load_error_text(m['state_reason'])}"
    rows: list[tuple[str, str]] = []
    if m.get("error"):
        rows.append(("error", m["error"]))
    if m.get("unmanaged"):
        rows.append(("model", m.get("unmanaged_why")
                     or "loaded on the server but not given to serve or the controller: not tuned"))
    if m.get("knobs"):          # what the model is and which knobs the controller turns (controller/modelkind.py)
        rows.append(("model", m["knobs"]))
    if m.get("target_from"):    # an ensemble's or a caller's target passed to this model (controller/ensemble.py)
        rows.append(("target", m["target_from"]))
    tracing_off = str(m.get("tracing", "")).startswith("off")
    if m.get("calls"):          # a model calling others (BLS): seen in its request traces, or named in its source
        rows.append(("calls", _calls_row(m["calls"], tracing_off)))
    if m.get("called_by"):
        untraced = set(m.get("called_by_untraced") or ())
        seen = [c for c in m["called_by"] if c not in untraced]
        rows.append(("called by", "; ".join(
            ([", ".join(seen) + ", seen in their request traces"] if seen else [])
            + ([", ".join(sorted(untraced)) + (", which names it in its model.py or config" if len(untraced) == 1 else
                                                ", which name it in their model.py or config")
                + (" (request tracing off)" if tracing_off else " (calls not traced)")]
               if untraced else []))))
    if m.get("versions"):       # several versions loaded: each runs the instance count shown
        rows.append(("versions", _versions_line(m["versions"], m.get("instances"))))
    if m.get("per_device"):     # instances per device, for a model on several (controller/groups.py)
        rows.append(("devices", ", ".join(f"{d} {n}" for d, n in m["per_device"].items())))
    o = m.get("obs")
    if "reason" in m:       # the controller's view
        if o:
            age = m.get("obs_age_s")
            now = m.get("obs_now")
            when = f"  (over {_num(o.get('span_s'))} s" + (f", {_dur(age)} ago" if age and age >= 1 else "") + ")"
            if now:
                when += f"; now: {NOW_WHY.get(now, now)}"
            rows.append(("load", f"{_num(o.get('arrival_rps'))} req/s arriving, {_num(o.get('completion_rps'))} req/s done"
                         + (f", {_num(o.get('failure_rps'), 2)} failing" if o.get("failure_rps") else "") + when))
            tracing = "off, see above" if tracing_off else m.get("tracing", "?")   # the header says why, once
            if o.get("p99_ms") is not None:
                source = o.get("p99_source", "?")
                if o.get("p99_samples"):
                    source += f", {o['p99_samples']} samples"
                if isinstance(o.get("tail_ratio"), (int, float)):    # the estimate's factor, and where it came from
                    source += f", mean x {o['tail_ratio']:.2f} " + (
                        "(measured)" if o.get("tail_ratio_measured") else
                        "(the default: the server publishes no latency summaries, see above)" if m.get("summaries") is False
                        else "(the default until a quiet minute is measured)")
                warm = "; warming up: the model's first executions since it loaded, not held against its model" \
                    if o.get("warming_up") else ""
                rows.append(("p99", f"{_num(o['p99_ms'], 2)} ms  from {source}  (tracing {tracing}){warm}"))
            else:
                none = "none: no requests in the window" if not o.get("completion_rps") else "none yet"
                rows.append(("p99", f"{none} (tracing {tracing})"))
            busy = o.get("busy")
            if ens:
                rows.extend(_ensemble_rows(m, models or {}, name))
            elif o.get("completion_rps"):
                items = o.get("items_per_request")     # logged only where a request carries more than one
                rows.append(("per request", f"queue {_num(o.get('queue_ms'), 2)} ms + compute {_num(o.get('compute_ms'), 2)} ms; "
                             f"busy {'?' if busy is None else f'{100 * busy:.0f}%'}{_busy_note(o)}, {_num(o.get('avg_batch'), 2)} "
                             + (f"items per batch, {_num(items, 2)} per request" if items else "per batch")))
            cpu = o.get("cpu")
            if isinstance(cpu, dict) and cpu.get("util") is not None and not ens:
                rows.append(("cpu", _cpu_text(cpu, name)))
            svc = o.get("service")
            if svc and svc.get("alpha_ms") is not None:
                jitter = o.get("jitter") or {}
                rows.append(("service", f"{svc['alpha_ms']} + {svc['beta_ms']} x batch ms per execution "
                             f"(r2 {svc.get('r2')}, {svc.get('executions')} executions)"
                             + (f"; executions of one size vary: p99 {jitter['p99_x']}x their mean"
                                + (" (from Triton's compute summary)" if jitter.get("from") == "summary" else "")
                                if isinstance(jitter, dict) and (jitter.get("scv") or 0) >= JITTER_FLOOR
                                and (jitter.get("p99_x") or 0) > 1.0 else "")))   # 1.0: the sizes' mix holds the tail
            cold = o.get("cold_start")
            wu = m.get("warm_up") if isinstance(m.get("warm_up"), dict) else {}
            if isinstance(cold, dict):
                seen = (f"the first {cold.get('executions')} executions after {cold.get('instances')} x "
                        f"{cold.get('delay_us')}us went live took {_num(cold.get('ms'), 1)} ms each, against "
                        f"{_num(cold.get('usual_ms'), 1)} ms after them")
                rows.append(("cold start", seen + (": new instances now warm up before they serve (warm-up below)"
                                                   if wu.get("live") else
                             f": mild ({wu.get('detail')}), not worth the full reload a warm-up takes; none added"
                             if wu.get("state") == "mild" else
                             ": the controller is adding a warm-up (below); until then every instance a reload starts "
                             "serves its first requests slowly" if wu.get("state") in ("waiting", "reloading") else
                             ": warm the model up before it is ready (in initialize, or Triton's model_warmup); until "
                             "then every instance a reload starts serves its first requests slowly, and the planner "
                             "changes the delay (a full reload) only where it must")))
            if wu and wu.get("state") != "mild":
                rows.append(("warm-up", _warm_up_text(wu)))
        else:
            now = m.get("obs_now")
            rows.append(("load", NOW_WHY.get(now, now) if now else "no observation yet"))
        if m.get("capacity") is not None:
            c = m["capacity"]
            if isinstance(c, dict):
                text = (f"{_share(c.get('utilization'))} of this pod's capacity with up to {c.get('ceiling')} instance(s)"
                        + (f" ({_num(c.get('capacity_rps'), 1)} req/s, {c.get('source')})" if c.get("capacity_rps") else "")
                        + ("; SATURATED" if c.get("saturated") else ""))
            else:
                text = str(c)
            rows.append(("capacity", text))
        pred = m.get("predicted")
        if isinstance(pred, dict) and pred.get("capacity_rps"):
            caps = pred["capacity_rps"]
            live = m.get("instances")
            parts = [f"{n} instance(s) {_num(v, 1) if v is not None else '?'} req/s" + (" (live)" if str(n) == str(live) else "")
                     for n, v in sorted(caps.items(), key=lambda kv: int(kv[0]))]
            rows.append(("predicted", f"within the target: {'; '.join(parts)}"
                         + (f"  [{pred['mode']}]" if pred.get("mode") else "") + _correction_text(pred.get("correction"))))
        if ens:
            pass    # never reloaded, nothing held: the model row says so, and its steps carry the decisions
        elif m.get("reason"):
            text = f"{m['reason']} for {_dur(m.get('held_for_s'))}"
            if m.get("detail"):
                text += f": {m['detail']}"
            if m.get("wants") and not m.get("reloading"):
                text += f" (wants {_settings(m['wants'].get('instances'), m['wants'].get('delay_us'))})"
            rows.append(("reason", text))
        own = m.get("owner")
        if own:   # the owner mark in the live config (controller/ownership.py)
            rows.append(("owner", "this controller" if own.get("mine") else
                         f"{own.get('owner')} ({own.get('status_url') or 'no status URL'}): not acting on it"
                         if own.get("state") in ("foreign_live", "foreign_unreachable") else
                         f"{own.get('owner')}, taking over ({own.get('detail')})"))
        ch = m.get("last_change")
        if ens:
            pass
        elif ch:
            text = f"{_clock(ch.get('time'))} ({_dur(ch.get('ago_s'))} ago) {_change(ch.get('from'), ch.get('to'))}: " \
                   f"{ch.get('reason')} ({(ch.get('kind') or '?').replace('_', ' ')}, {_num(ch.get('apply_s'))} s)"
            if not ch.get("ok", True):
                text += f" FAILED: {ch.get('error')}"
            rows.append(("last change", text))
        else:
            rows.append(("last change", "none since the controller started"))
        r = m.get("reloading")
        if r:
            rows.append(("reloading", f"-> {_settings((r.get('to') or {}).get('instances'), (r.get('to') or {}).get('delay_us'))}: "
                         f"{r.get('reason')} ({r.get('kind', '?').replace('_', ' ')}, {_dur(r.get('for_s'))} so far)"))
        for rec in (m.get("recent") or [])[-last:] if last > 0 and not ens else []:
            rows.append(("recent", _recent(rec)))
    else:                   # the server's view only, and the decision log's last records
        log = m.get("log") or []
        seen = next((r for r in reversed(log) if (r.get("obs") or {}).get("p99_ms") is not None), None)
        if seen is not None:
            rows.append(("logged", describe_observation(seen)))
        for rec in log[-last:] if last > 0 else []:
            rows.append(("recent", _recent(rec)))
    width = max((len(k) for k, _ in rows), default=0)
    return [head] + [f"  {k:<{width}}  {v}" for k, v in rows]


def _recent(rec: dict) -> str:
    tgt = rec.get("target") or {}
    line = f"{_clock(rec.get('time'))} {rec.get('action') or '?':8} {rec.get('reason') or '?':26} -> " \
           f"{tgt.get('instances')} inst, {tgt.get('delay_us')} us"
    if rec.get("detail"):
        line += f"  {rec['detail']}"
    if rec.get("error"):
        line += f"  error: {rec['error']}"
    return line


def describe_observation(rec: dict) -> str:
    """One line of what a decision-log record saw: "seen 12:00:01: 150 req/s, p99 12.3 ms (trace, 240 samples), ..."."""
    o = rec.get("obs") or {}
    source = o.get("p99_source", "?") + (f", {o['p99_samples']} samples" if o.get("p99_samples") else "")
    parts = [f"{o.get('arrival_rps', 0):g} req/s", f"p99 {o['p99_ms']:g} ms ({source})",
             f"queue {o.get('queue_ms', 0):g} ms, compute {o.get('compute_ms', 0):g} ms per request"]
    svc = o.get("service")
    if svc:
        beta = "?" if svc.get("beta_ms") is None else f"{svc['beta_ms']:g}"
        parts.append(f"service {svc.get('alpha_ms')} + {beta} x batch ms (r2 {svc.get('r2')}, {svc.get('executions')} executions)")
    if rec.get("tracing"):
        parts.append(f"tracing {rec['tracing']}")
    return f"seen {_clock(rec.get('time'))}: " + "; ".join(parts)


DETAILS_MAX = 6      # more models than this: the summary table, and each model's block only when asked


def _summary_row(name: str, m: dict) -> list[str]:
    o = m.get("obs") or {}
    ens = m.get("ensemble_steps") is not None
    p99, target = o.get("p99_ms"), m.get("p99_target_ms")
    over = isinstance(p99, (int, float)) and isinstance(target, (int, float)) and p99 > target
    if ens:
        why = "ensemble: tuned through its steps"
    elif m.get("unmanaged"):
        why = "not named in the config" if m.get("unmanaged_guess") else "not managed"
    elif "reason" not in m:
        log = m.get("log") or []          # no controller to ask: its decision log's last record
        why = str(log[-1].get("reason") or "-") + " (logged)" if log else "-"
    else:
        why = str(m.get("reason") or "-") + (" (reloading)" if m.get("reloading") else "")
    return [name, str(m.get("state", "?")),
            "-" if ens or m.get("instances") is None else str(m["instances"]),
            "-" if ens or m.get("delay_us") is None else str(m["delay_us"]),
            _num(o.get("arrival_rps")) if o.get("arrival_rps") is not None else "-",
            (_num(p99, 1) if p99 is not None else "-") + (" OVER" if over else ""),
            _num(target, 0) if target is not None else "-", why]


def format_summary(models: dict, order: list[str]) -> list[str]:
    """One line a model, as `kubectl get` has it: state, instances, delay, arrivals, p99 (OVER where above the
    target it runs under), target, and why it holds or what it did last."""
    rows = [["MODEL", "STATE", "INST", "DELAY_US", "REQ/S", "P99_MS", "TARGET_MS", "REASON"]]
    rows += [_summary_row(n, models[n]) for n in order]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    right = {2, 3, 4, 6}
    return ["  ".join((c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths)))
            + "  " + r[-1] for r in rows]


class UnknownModel(ValueError):
    """`status MODEL` named a model that neither the server nor the controller knows."""


def select_models(doc: dict, names: list[str]) -> dict:
    """`doc` with only the models named, every model kept under `all_models` (a named ensemble's or caller's block
    reads its steps' and callees' figures there); a name the snapshot does not hold raises UnknownModel naming those
    it does."""
    models = doc.get("models") or {}
    unknown = [n for n in names if n not in models]
    if unknown:
        raise UnknownModel(f"no model {', '.join(unknown)} here; the models are: {', '.join(models) or 'none'}")
    return {**doc, "models": {n: models[n] for n in names}, "all_models": models}


def format_text(doc: dict, last: int = 3, details: bool | None = None) -> str:
    """The header, a summary line a model (two models or more, none named), then each model's block: every one's
    with DETAILS_MAX models or fewer (or `details` True), the named ones' (`select_models`), or a line saying how to
    see them."""
    lines = format_header(doc)
    models = doc.get("models") or {}
    everyone = doc.get("all_models") or models
    order: list[str] = []
    for name, m in models.items():      # an ensemble's steps right after it
        for n in [name] + [s for s in (m.get("ensemble_steps") or []) if s in models]:
            if n not in order:
                order.append(n)
    named = "all_models" in doc
    if len(order) >= 2 and not named:
        lines += [""] + format_summary(models, order)
    if details is None:
        details = named or len(order) <= DETAILS_MAX
    if details:
        for name, m in ((n, models[n]) for n in order):
            lines.append("")
            lines.extend(format_model(name, m, last, everyone))
    elif order:
        lines += ["", f"{len(order)} models: `python -m controller status MODEL [MODEL ...]` shows those models' "
                      "details, `--details` every model's"]
    if not doc.get("models"):
        lines += ["", "no models on the server"]
    hint = _no_traffic_hint(doc)
    if hint:
        lines += ["", hint]
    return "\n".join(lines)


def _no_traffic_hint(doc: dict) -> str | None:
    """Under serve, where no model the controller manages had a request in its window (the first minutes of a
    first run, as a rule): how to send some. Elsewhere the traffic is the users'."""
    if (doc.get("source") or {}).get("kind") != "serve" or doc.get("controller") is None:
        return None
    managed = [(n, m) for n, m in (doc.get("models") or {}).items() if "reason" in m and not m.get("unmanaged")]
    if not managed or any(((m.get("obs") or {}).get("arrival_rps") or 0) > 0
                          or ((m.get("obs") or {}).get("completion_rps") or 0) > 0 for _, m in managed):
        return None
    # why: the model the users call, an ensemble rather than one of its steps (which the ensemble's traffic reaches)
    steps = {s for _, m in (doc.get("models") or {}).items() for s in (m.get("ensemble_steps") or [])}
    ready = [n for n, m in managed if m.get("state") == "READY" and n not in steps] or \
        [n for n, m in managed if m.get("state") == "READY"]
    if not ready:
        return None
    # why: after traffic has stopped, "yet" would be wrong: a model that executed before (its service fit counts
    # executions) or was changed has had requests, just none in the window
    served = any(((m.get("obs") or {}).get("service") or {}).get("executions") or m.get("last_change")
                 for _, m in managed)
    span = max(((m.get("obs") or {}).get("span_s") or 0 for _, m in managed), default=0)
    when = f"no requests in the last {span:.0f} s" if served and span else "no requests yet"
    # why: `load` refuses a stateful model (its requests need sequence ids and start/end flags): not the hint there
    loadable = [n for n in ready if not (doc.get("models") or {})[n].get("stateful")]
    if not loadable:
        return (f"{when}: {ready[0]} is stateful (a sequence batcher), which `python -m controller load` cannot "
                "drive (its requests need sequence ids and start/end flags): send it your own sequences")
    return (f"{when}: `python -m controller load --model {loadable[0]} --rate 50` sends some, open loop, "
            "a line every 5 s (README, \"Then: send it traffic\")")


# ---- the verb -------------------------------------------------------------------------------------

def resolve(config_path: str | None, pid: int | None, load) -> Target:
    """The target: an explicit config wins; else the run-state of the one serve (or --pid)."""
    if config_path is not None:
        return target_from_config(load(config_path), str(config_path))
    return target_from_state(runstate.choose(pid))


def watch(render, every_s: float, out=None) -> int:
    """Redraw `render()` every `every_s` s: in place on a terminal, else one block after another. Ctrl-C: 0."""
    out = out or sys.stdout
    tty = out.isatty()
    try:
        while True:
            text = render()
            if tty:
                out.write("\x1b[H\x1b[2J" + text + "\n")
            else:
                out.write(text + "\n" + "-" * 40 + "\n")
            out.flush()
            time.sleep(every_s)
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
        return 0


def _short(e: BaseException) -> str:
    return " ".join(str(getattr(e, "reason", None) or e).split())[:200]


__all__ = ["Target", "gather", "format_text", "format_model", "format_header", "resolve", "watch",
           "target_from_state", "target_from_config", "describe_observation", "read_key", "server_config_from_state"]
