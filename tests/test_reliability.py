"""Faults around the control loop, against a real tritonserver and the SIMULATED accelerator (sim_accel):
a reload that fails (as out-of-memory would), a server that goes away and comes back, a server that is
down when the controller starts, NVML failing mid-run, and a controller killed with SIGKILL."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from conftest import ROOT, start_server
from controller.actuation import Actuator, TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.gpu import FakeGpuSource
from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync
from controller.loop import Controller
from controller.server import ServerOptions, TritonServer, free_port
from controller.types import GpuObservation, Settings

MODEL = "sim_accel"
WINDOW_S = 4.0


# ---- helpers --------------------------------------------------------------------------------------

def _config(http_url, grpc_url, metrics_url, log_path, *, gpu="simulated", backoff_s=30.0, **limits) -> ControllerConfig:
    lim = dict(p99_target_ms=15.0, max_instances=4, scale_up_cooldown_s=1.0, scale_down_delay_s=600.0,
               delay_cooldown_s=600.0, max_delay_us=0)
    lim.update(limits)
    return ControllerConfig(
        server=ServerConfig(http_url=http_url, grpc_url=grpc_url, metrics_url=metrics_url, timeout_s=2.0),
        loop=LoopConfig(interval_s=0.5, window_s=WINDOW_S, settle_s=1.0, min_span_s=2.0, decision_log=str(log_path),
                        gpu=gpu, failure_backoff_s=backoff_s),
        models={MODEL: ModelLimits(**lim)})


def _server_config(server, log_path, **kw) -> ControllerConfig:
    return _config(server.http_url, server.grpc_url, server.metrics_url, log_path, **kw)


def _load(server, rate_rps: float, seconds: float, seed: int = 7) -> list:
    trace = load_trace({"phases": [{"name": "busy", "duration_s": seconds, "rate_rps": rate_rps}]})
    schedule = poisson_schedule(trace, seed=seed, max_requests=int(rate_rps * seconds * 2) + 10)
    cfg = TritonControl(server.grpc_url, server.http_url).config(MODEL)
    return run_open_loop_sync(server.grpc_url, MODEL, schedule, inputs_from_config(cfg), timeout_s=10.0)


class _ControllerThread:
    def __init__(self, cfg: ControllerConfig, **kw):
        self.controller = Controller(cfg, **kw)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.controller.run, args=(self.stop,), daemon=True)

    def __enter__(self) -> "_ControllerThread":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        self.controller.close()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _no_traceback(caplog) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]



# ---- 2. a reload that fails -----------------------------------------------------------------------

def _oom_repository(tmp_path: Path) -> Path:
    """A copy of sim_accel that starts with 2 instances and cannot load a 3rd (simulated out of memory),
    slowed down (20 ms of host work per batch) so 2 instances are short of capacity at 150 req/s."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / MODEL, repo / MODEL, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / MODEL / "config.pbtxt"
    text = cfg.read_text()
    for old, new in (('count: 1,', 'count: 2,'),
                     ('"oom_above_instances", value: { string_value: "0" }', '"oom_above_instances", value: { string_value: "2" }'),
                     ('"fixed_overhead_ms", value: { string_value: "4" }', '"fixed_overhead_ms", value: { string_value: "20" }')):
        assert old in text, old
        text = text.replace(old, new)
    cfg.write_text(text)
    return repo


def test_failed_reload_keeps_the_old_config_learns_the_limit_and_backs_off(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    server = start_server([MODEL], repository=_oom_repository(tmp_path))
    log_path = tmp_path / "decisions.jsonl"
    backoff_s = 6.0
    try:
        act = Actuator(TritonControl(server.grpc_url, server.http_url))
        assert act.read(MODEL)[1] == Settings(2, 0)
        with _ControllerThread(_server_config(server, log_path, gpu="none", backoff_s=backoff_s,
                                              p99_target_ms=10.0)) as ct:
            # 22 s: room for the longest path, two failed attempts (a jump, then target - 1 after the backoff,
            # ~9 s in) and the second's backoff, before the learned maximum is read (16 s ended inside it once)
            results = _load(server, rate_rps=150, seconds=22)
        mm = ct.controller.models[MODEL]
        live = act.read(MODEL)[1]
        ready = TritonControl(server.grpc_url, server.http_url).ready(MODEL)
    finally:
        server.stop()
    records = _records(log_path)
    summary = [(r["t"], r["action"], r["reason"]) for r in records]
    failed = [r for r in records if r["action"] == "failed"]
    # attempts above 2 instances, refused by the model's initialize(); never retried in a loop: a jump
    # (the planner may ask for 4 at once) that fails teaches "at most target - 1", so at most one more
    # attempt (3) follows, after the backoff
    assert 1 <= len(failed) <= 2, summary
    assert [r["target"]["instances"] for r in failed] == sorted((r["target"]["instances"] for r in failed), reverse=True)
    assert all(r["target"]["instances"] > 2 and "simulated out of device memory" in r["error"]
               and r["live"] == {"instances": 2, "delay_us": 0} for r in failed), failed
    assert len(failed) == 1 or failed[1]["t"] >= failed[0]["t"] + backoff_s - 0.01
    assert not [r for r in records if r["action"] == "applied"], summary
    # the last good config keeps serving, and every request succeeded
    assert live == Settings(2, 0) and ready
    assert mm.current == Settings(2, 0)
    bad = [r for r in results if not r.ok]
    assert results and not bad, bad[:3]
    # backoff, then the learned maximum holds it at 2
    after = [r for r in records if r["t"] > failed[-1]["t"]]
    assert after and after[0]["reason"] == "HoldBackoff", summary
    assert all(r["reason"] == "HoldBackoff" for r in after if r["t"] < failed[-1]["t"] + backoff_s - 0.01), summary
    later = [r["reason"] for r in after if r["t"] >= failed[-1]["t"] + backoff_s - 0.01]
    assert "HoldLearnedMax" in later, summary
    assert mm.state.learned_max_instances == failed[-1]["target"]["instances"] - 1 >= 2   # what the last failure taught
    # the reason is in the log, once, and nothing crashed
    warnings = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and r.levelno == logging.WARNING
                and r.name == "controller.loop"]
    assert len(warnings) == len(failed) and all("simulated out of device memory" in w for w in warnings), warnings
    _no_traceback(caplog)


# ---- 3. the server goes away and comes back -------------------------------------------------------

def test_server_restart_controller_holds_then_rereads_and_holds_a_full_window(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=[MODEL])
    log_path = tmp_path / "decisions.jsonl"
    first = TritonServer(options).start()
    second = None
    try:
        with _ControllerThread(_server_config(first, log_path)) as ct:
            mm_deadline = time.monotonic() + 10
            while time.monotonic() < mm_deadline and not (MODEL in ct.controller.models and ct.controller.models[MODEL].current):
                time.sleep(0.1)
            time.sleep(WINDOW_S + 1)              # past the first warm-up: the policy is live
            first.stop()
            down_at = time.monotonic()
            time.sleep(3.0)                       # ~6 ticks with the server gone
            assert ct.thread.is_alive()
            second = TritonServer(options).start()   # same ports, same (file) config: only the counters tell
            up_at = time.monotonic()
            deadline = up_at + 15
            while time.monotonic() < deadline and not ct.controller.models[MODEL].reachable:
                time.sleep(0.1)
            back_at = time.monotonic()
            time.sleep(WINDOW_S + 1.5)
            assert ct.thread.is_alive()
            mm = ct.controller.models[MODEL]
            assert mm.reachable and mm.current == Settings(1, 0)
            assert mm.state.started_at >= down_at, "the policy must start over after the server came back"
    finally:
        if second is not None:
            second.stop()
        first.stop()
    records = _records(log_path)
    summary = [(round(r["t"] - down_at, 1), r["action"], r["reason"]) for r in records]
    unreachable = [r for r in records if r["reason"] == "HoldServerUnreachable"]
    assert len(unreachable) == 1, summary
    # a restarted server answers before its model is loaded: the controller may hold on that (HoldNotLoaded) first
    after = [r for r in records if r["t"] > unreachable[0]["t"] and r["reason"] != "HoldNotLoaded"]
    assert after and after[0]["reason"] in ("HoldWarmup", "HoldNoData"), summary
    assert any(r["reason"] == "HoldWarmup" for r in after), summary
    assert not [r for r in records if r["action"] in ("applied", "failed", "dry_run")], summary
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot read live config" in m for m in messages) == 1, messages
    assert sum("answers again" in m or "READY on the server now" in m for m in messages) == 1, messages
    _no_traceback(caplog)
    assert back_at - up_at < 10


def _run_cli(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "controller", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, **kw)


def _yaml_config(path: Path, http_port, grpc_port, metrics_port, decision_log: Path) -> Path:
    doc = {
        "server": {"http_url": f"127.0.0.1:{http_port}", "grpc_url": f"127.0.0.1:{grpc_port}",
                   "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics", "timeout_s": 2},
        "controller": {"interval_s": 0.5, "window_s": WINDOW_S, "settle_s": 1, "min_span_s": 2,
                       "decision_log": str(decision_log), "gpu": "simulated"},
        "models": {MODEL: {"p99_target_ms": 15, "max_instances": 4, "scale_up_cooldown_s": 1,
                           "scale_down_delay_s": 600, "max_delay_us": 0}},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_run_with_the_server_down_warns_once_and_exits_cleanly_after_the_duration(tmp_path):
    cfg = _yaml_config(tmp_path / "c.yaml", free_port(), free_port(), free_port(), tmp_path / "d.jsonl")
    t0 = time.monotonic()
    proc = _run_cli("run", "--config", str(cfg), "--duration-s", "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 30
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "WARNING" in lines[0] and "not reachable" in lines[0] and "retrying" in lines[0], err
    assert "Traceback" not in err + out


def test_run_started_before_the_server_retries_and_then_manages_it(tmp_path):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=[MODEL])
    log_path = tmp_path / "d.jsonl"
    cfg = _yaml_config(tmp_path / "c.yaml", options.http_port, options.grpc_port, options.metrics_port, log_path)
    proc = _run_cli("run", "--config", str(cfg), "--duration-s", "60")
    server = None
    try:
        time.sleep(2.0)
        assert proc.poll() is None
        server = TritonServer(options).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not [r for r in _records(log_path) if r["reason"]
                                                    not in ("HoldServerUnreachable", "HoldNotLoaded")]:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None:
            server.stop()
    assert proc.returncode == 0, err
    # the server answers "live" before its model is loaded: the controller holds on that first, saying so
    records = [r for r in _records(log_path) if r["reason"] not in ("HoldServerUnreachable", "HoldNotLoaded")]
    assert records and records[0]["reason"] in ("HoldWarmup", "HoldNoData"), records
    assert records[0]["current"] == {"instances": 1, "delay_us": 0}
    assert sum("not reachable" in ln for ln in err.splitlines()) == 1, err
    assert "Traceback" not in err + out


# ---- 4. NVML failing mid-run ----------------------------------------------------------------------

def test_gpu_reads_that_start_raising_fall_back_logged_once(sim_server, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    gpu0 = (GpuObservation(index=0, utilization_pct=40.0, memory_used_bytes=2 * 2**30, memory_total_bytes=16 * 2**30),)
    fake = FakeGpuSource([gpu0] * 6 + [RuntimeError("NVML: GPU is lost")])
    cfg = _server_config(sim_server, tmp_path / "d.jsonl", gpu="nvml")
    cfg = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, interval_s=0.3, min_span_s=1.0, window_s=2.0))
    controller = Controller(cfg, gpu=fake)
    try:
        controller.run(threading.Event(), max_ticks=6)
        mm = controller.models[MODEL]
        assert mm.last_obs is not None and mm.last_obs.valid, mm.last_obs
        assert controller._last_devices == gpu0              # NVML data read while it works (sim_accel's
        assert mm.last_obs.gpus == ()                          # KIND_CPU group reads no GPU: Controller._model_devices)
        controller.run(threading.Event(), max_ticks=8)         # now every read raises
        assert fake.calls == 14                                # the ticks went on, one read each
        assert controller._last_devices == ()
        assert mm.last_obs.valid                               # decisions go on without GPU signals
        assert mm.last_decision is not None and mm.last_decision.valid
    finally:
        controller.close()
    gpu_warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "GPU" in r.getMessage()]
    assert len(gpu_warnings) == 1 and "NVML: GPU is lost" in gpu_warnings[0], gpu_warnings
    _no_traceback(caplog)


# ---- 7. the controller is killed --------------------------------------------------------------------

def test_sigkilled_controller_leaves_the_model_serving_and_a_restart_holds_a_full_window(sim_server, tmp_path):
    act = Actuator(TritonControl(sim_server.grpc_url, sim_server.http_url))
    assert act.apply(MODEL, Settings(1, 0)).ok
    http_port, grpc_port, metrics_port = (u.rsplit(":", 1)[1].split("/")[0] for u in
                                          (sim_server.http_url, sim_server.grpc_url, sim_server.metrics_url))
    log1, log2 = tmp_path / "d1.jsonl", tmp_path / "d2.jsonl"
    cfg1 = _yaml_config(tmp_path / "c1.yaml", http_port, grpc_port, metrics_port, log1)
    cfg2 = _yaml_config(tmp_path / "c2.yaml", http_port, grpc_port, metrics_port, log2)
    results: list = []
    load = threading.Thread(target=lambda: results.extend(_load(sim_server, rate_rps=220, seconds=30)))
    load.start()
    first = _run_cli("run", "--config", str(cfg1))
    second = None
    try:
        deadline = time.monotonic() + 25
        applied = []
        while time.monotonic() < deadline and not applied:
            applied = [r for r in _records(log1) if r["action"] == "applied"]
            time.sleep(0.05)
        assert applied, _records(log1)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
        last = applied[-1]["live"]
        time.sleep(1.0)
        live = act.read(MODEL)[1]
        assert {"instances": live.instance_count, "delay_us": live.max_queue_delay_us} == last
        assert live.instance_count >= 2
        assert TritonControl(sim_server.grpc_url, sim_server.http_url).ready(MODEL)
        second = _run_cli("run", "--config", str(cfg2))
        time.sleep(WINDOW_S + 4)
        assert act.read(MODEL)[1].instance_count >= 1
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=30)
        assert second.returncode == 0, err
        assert "Traceback" not in err
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        load.join()
        act.apply(MODEL, Settings(1, 0))
    bad = [r for r in results if not r.ok]
    assert results and not bad, bad[:3]                  # serving never stopped, through kill and restart
    records = _records(log2)
    summary = [(r["t"], r["action"], r["reason"]) for r in records]
    assert records[0]["reason"] in ("HoldWarmup", "HoldNoData"), summary
    assert records[0]["current"] == last                  # the restarted controller adopted the live config
    start = records[0]["t"]
    early = [r for r in records if r["action"] != "hold" and r["t"] < start + WINDOW_S]
    assert not early, summary
