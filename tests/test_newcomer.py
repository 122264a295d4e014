"""The newcomer's path: `serve` -> `status` with no flags (the run-state file), what `status` shows (the
controller's own /status snapshot), and one-line messages that say what happened (unreachable server,
restricted repository API, wrong key). Unit tests first; the walk against a real tritonserver last."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from conftest import ROOT
from controller import runstate
from controller.actuation import OTHER, RESTRICTED, UNREACHABLE, WRONG_KEY, classify_error, explain_error
from controller.cli import main
from controller.server import free_port
from controller.status import format_model, format_text, watch
from controller.telemetry import ControllerMetrics
from controller.types import Decision, Settings


@pytest.fixture
def run_folder(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "run"
    monkeypatch.setenv(runstate.ENV_RUN_DIR, str(folder))
    return folder


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- the run-state file ------------------------------------------------------------------------

def test_run_dir_prefers_the_override_then_xdg_then_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(runstate.ENV_RUN_DIR, str(tmp_path / "explicit"))
    assert runstate.run_dir() == tmp_path / "explicit"
    assert stat.S_IMODE((tmp_path / "explicit").stat().st_mode) == 0o700
    monkeypatch.delenv(runstate.ENV_RUN_DIR)
    (tmp_path / "xdg").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert runstate.run_dir() == tmp_path / "xdg" / "triton-autotune"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runstate.run_dir() == tmp_path / "home" / ".cache" / "triton-autotune" / "run"


def test_the_file_is_0600_written_whole_and_removed(run_folder):
    path = runstate.write({"started": 1.0, "http_url": "127.0.0.1:1"})
    assert path == run_folder / f"serve-{os.getpid()}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in run_folder.iterdir()] == [path.name]          # no temporary file left
    doc = json.loads(path.read_text())
    assert doc["pid"] == os.getpid() and doc["http_url"] == "127.0.0.1:1"
    assert runstate.choose().pid == os.getpid()
    runstate.remove()
    assert not path.exists()
    with pytest.raises(runstate.NothingRunning, match="nothing is running.*--config"):
        runstate.choose()


def test_files_of_dead_or_reused_pids_are_dropped(run_folder):
    run_folder.mkdir()
    dead = _dead_pid()
    (run_folder / f"serve-{dead}.json").write_text(json.dumps({"pid": dead, "started": 1.0}))
    # our own pid, but another process start time: the pid was reused since that serve wrote the file
    (run_folder / f"serve-{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid(), "process_start": "1"}))
    (run_folder / "serve-junk.json").write_text("{not json")
    assert runstate.live_serves() == []
    assert sorted(p.name for p in run_folder.iterdir()) == ["serve-junk.json"]   # not ours to delete


def test_several_serves_are_listed_and_one_is_chosen_by_pid(run_folder, capsys):
    runstate.write({"started": 2.0, "http_url": "127.0.0.1:8000", "grpc_url": "127.0.0.1:8001"})
    runstate.write({"pid": os.getppid(), "started": 1.0, "http_url": "127.0.0.1:9000", "grpc_url": "127.0.0.1:9001"})
    with pytest.raises(runstate.SeveralRunning) as e:
        runstate.choose()
    assert [s.pid for s in e.value.serves] == [os.getppid(), os.getpid()]          # oldest first
    assert runstate.choose(os.getppid()).get("http_url") == "127.0.0.1:9000"
    dead = _dead_pid()     # not pid 1: a test run whose parent has exited has pid 1 as its parent, a "serve" here
    with pytest.raises(runstate.RunStateError, match=f"no serve with pid {dead} "):
        runstate.choose(dead)
    assert main(["status"]) == 2
    out = capsys.readouterr().out
    assert "2 serves are running" in out and "--pid N" in out
    assert f"pid {os.getpid()}," in out and "HTTP 127.0.0.1:9000" in out
    assert main(["run", "--duration-s", "1"]) == 2                       # run asks too, in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "choose one with --pid N" in err[0]


def test_status_with_nothing_running_says_so_in_one_line(run_folder, capsys):
    assert main(["status"]) == 1
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == ["nothing is running: no `python -m controller serve` on this machine "
                                        "(for a server started otherwise, pass --config FILE)"]


def test_run_beside_a_serve_without_a_controller_reads_the_repository_serve_runs(run_folder):
    from controller.cli import _config_from_serve
    runstate.write({"started": time.time(), "phase": "running", "http_url": "127.0.0.1:1", "grpc_url": "127.0.0.1:2",
                    "repository": "/srv/models"})
    cfg, state = _config_from_serve(None)
    assert (cfg.server.http_url, cfg.server.repository) == ("127.0.0.1:1", "/srv/models") and state.pid == os.getpid()


def test_status_with_no_flags_finds_the_controller_that_run_started_beside_a_serve_without_one(run_folder):
    """serve --no-controller, then `run` with no flags: its file beside serve's names its port, so `status` shows
    that controller; a file whose run is gone is dropped, and serve's own list never holds it."""
    from controller.status import target_from_state
    runstate.write({"started": time.time(), "phase": "running", "http_url": "127.0.0.1:1", "grpc_url": "127.0.0.1:2",
                    "decision_log": "/serve/decisions.jsonl"})
    serve = runstate.choose(None)
    alone = target_from_state(serve)
    assert alone.controller_port is None and alone.no_controller_why == "serve runs with --no-controller"
    mine = runstate.write_beside(serve.pid, {"started": time.time(), "controller_port": 40123, "decision_log": None})
    found = target_from_state(runstate.choose(None))
    assert (found.controller_port, found.no_controller_why, found.decision_log) == \
        (40123, "", "/serve/decisions.jsonl")
    assert [s.pid for s in runstate.live_serves()] == [serve.pid]
    gone = runstate.beside_path(serve.pid, _dead_pid())
    gone.write_text(json.dumps({"pid": int(gone.stem.rsplit("-", 1)[1]), "controller_port": 1, "started": 2e9}))
    assert runstate.controller_beside(serve.pid)["controller_port"] == 40123 and not gone.exists()
    mine.unlink()                                       # what run does when it stops
    assert runstate.controller_beside(serve.pid) is None and target_from_state(serve).controller_port is None


def test_run_beside_a_serve_that_has_its_own_controller_refuses_and_a_starting_serve_is_said(run_folder, capsys):
    runstate.write({"started": time.time(), "phase": "running", "http_url": "127.0.0.1:1", "grpc_url": "127.0.0.1:2",
                    "controller_port": 1234})
    assert main(["run", "--duration-s", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"serve pid {os.getpid()} already runs a controller" in err[0] and "--no-controller" in err[0]
    runstate.write({"started": time.time(), "phase": "starting", "http_url": "127.0.0.1:1", "grpc_url": "127.0.0.1:2"})
    assert main(["status"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"serve pid {os.getpid()} is starting tritonserver" in err[0]


# ---- what an error means -----------------------------------------------------------------------

# the real server's messages (tritonserver 2.51, seen in tests/test_security.py and below)
GRPC_RESTRICTED = InferenceServerException(
    msg="This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'", status="StatusCode.UNAVAILABLE")
HTTP_RESTRICTED = InferenceServerException(msg="This API is restricted, expecting header 'admin-key'", status="403")
GRPC_REFUSED = InferenceServerException(
    msg="failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:42689: Failed to connect to remote "
        "host: Connection refused", status="StatusCode.UNAVAILABLE")
GRPC_DEADLINE = InferenceServerException(msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED")
NOT_FOUND = InferenceServerException(msg="Request for unknown model: 'x' is not found", status="StatusCode.NOT_FOUND")


@pytest.mark.parametrize("error, key_sent, kind", [
    (GRPC_RESTRICTED, False, RESTRICTED), (GRPC_RESTRICTED, True, WRONG_KEY),
    (HTTP_RESTRICTED, False, RESTRICTED), (HTTP_RESTRICTED, True, WRONG_KEY),
    (GRPC_REFUSED, False, UNREACHABLE), (GRPC_REFUSED, True, UNREACHABLE),
    (GRPC_DEADLINE, True, UNREACHABLE),
    (ConnectionRefusedError(111, "Connection refused"), False, UNREACHABLE),      # HTTP client, nothing listening
    (TimeoutError("timed out"), True, UNREACHABLE),                               # HTTP client, nothing answers
    (NOT_FOUND, True, OTHER), (InferenceServerException(msg="bad request", status="400"), False, OTHER),
])
def test_errors_are_classified(error, key_sent, kind):
    assert classify_error(error, key_sent) == kind


def test_each_kind_has_its_own_message():
    restricted = explain_error(GRPC_RESTRICTED, "127.0.0.1:8001", key_sent=False)
    assert "repository API" in restricted and "is restricted" in restricted and "pass the key" in restricted
    assert "export TRITON_ADMIN_KEY=" in restricted and "server.auth_header: admin-key" in restricted
    assert "same machine as serve" in restricted and "triton-grpc-protocol-" not in restricted
    wrong = explain_error(HTTP_RESTRICTED, "127.0.0.1:8000", key_sent=True)
    assert "refused the key sent in header 'admin-key'" in wrong and "$TRITON_ADMIN_KEY" in wrong
    down = explain_error(GRPC_REFUSED, "127.0.0.1:8001", key_sent=True)
    assert down.startswith("cannot reach the server at 127.0.0.1:8001: ") and "Connection refused" in down
    assert "answered with an error" in explain_error(NOT_FOUND, "x", key_sent=False)


# ---- the text ----------------------------------------------------------------------------------

SEEN = {
    "state": "READY", "instances": 2, "delay_us": 0, "reachable": True, "p99_target_ms": 40.0,
    "min_instances": 1, "max_instances": 4,
    "obs": {"span_s": 20.0, "arrival_rps": 151.2, "completion_rps": 150.9, "failure_rps": 0.0, "queue_ms": 1.25,
            "compute_ms": 8.1, "p99_ms": 12.34, "p99_source": "trace", "p99_samples": 240, "busy": 0.45,
            "avg_batch": 1.8, "service": {"alpha_ms": 6.2, "beta_ms": 1.6, "r2": 0.97, "executions": 60, "sizes": [1, 2]}},
    "obs_age_s": 0.4, "obs_now": None, "tracing": "on, 1 in 7 requests", "reason": "HoldSteady", "detail": None,
    "held_for_s": 80.0, "wants": None,
    "last_change": {"time": 1_700_000_000.0, "ago_s": 130.0, "ok": True, "from": {"instances": 1, "delay_us": 0},
                    "to": {"instances": 2, "delay_us": 0}, "reason": "ScaleUpQueueGrowing", "kind": "in_place",
                    "apply_s": 0.71, "error": None},
    "reloading": None, "recent": [], "capacity": None,
}


def test_the_service_row_says_how_much_executions_vary_and_from_what():
    def service(jitter):
        o = dict(SEEN["obs"], jitter=jitter) if jitter is not None else SEEN["obs"]
        return dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", dict(SEEN, obs=o))[1:])["service"]
    plain = "6.2 + 1.6 x batch ms per execution (r2 0.97, 60 executions)"
    assert service(None) == plain
    assert service({"scv": 0.01, "p99_x": 1.1, "from": "trace"}) == plain          # under the floor: exact
    assert service({"scv": 0.09, "p99_x": 1.0, "from": "summary"}) == plain        # spread, but the tail is the sizes'
    assert service({"scv": 0.3, "p99_x": 2.4, "from": "trace"}) == plain + "; executions of one size vary: p99 2.4x their mean"
    assert service({"scv": 0.09, "p99_x": 2.0, "from": "summary"}) == \
        plain + "; executions of one size vary: p99 2.0x their mean (from Triton's compute summary)"


def test_a_failing_metrics_scrape_says_where_to_look():
    """No observation because /metrics does not answer (a wrong metrics_url, or a server started with
    --allow-metrics=false): the load row names both, not only that the scrape failed."""
    rows = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", dict(SEEN, obs=None,
                                                                                     obs_now="scrape_failed"))[1:])
    assert rows["load"].startswith("the metrics scrape failed (check server.metrics_url") and \
        "--allow-metrics=true" in rows["load"], rows


def test_the_text_is_one_aligned_block_per_model():
    block = format_model("sim_accel", SEEN)
    assert block[0] == "sim_accel  READY  2 instances, delay 0 us  (target p99 40 ms, 1-4 instances)"
    rows = dict((ln[:15].strip(), ln[15:]) for ln in block[1:])
    assert set(rows) == {"load", "p99", "per request", "service", "reason", "last change"}
    assert {ln[2:15] == f"{ln[2:15].strip():<13}" for ln in block[1:]} == {True}      # one label column
    assert rows["load"].startswith("151.2 req/s arriving, 150.9 req/s done  (over 20.0 s)")
    assert rows["p99"] == "12.34 ms  from trace, 240 samples  (tracing on, 1 in 7 requests)"
    assert rows["per request"] == "queue 1.25 ms + compute 8.10 ms; busy 45%, 1.80 per batch"
    assert rows["reason"] == "HoldSteady for 1m 20s"
    # from the request counters (no batch_stats over the window) the busy figure is an estimate, and says so
    estimated = dict(SEEN, obs=dict(SEEN["obs"], busy_source="requests"))
    rows_est = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", estimated)[1:])
    assert rows_est["per request"] == "queue 1.25 ms + compute 8.10 ms; busy 45% (estimated), 1.80 per batch"
    # requests of several items (a client batching on its side): the batch is in items, and the request's items shown
    batched = dict(SEEN, obs=dict(SEEN["obs"], avg_batch=7.2, items_per_request=4.0))
    rows_items = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", batched)[1:])
    assert rows_items["per request"] == "queue 1.25 ms + compute 8.10 ms; busy 45%, 7.20 items per batch, 4.00 per request"
    exact = dict(SEEN, obs=dict(SEEN["obs"], busy_source="batch_stats"))
    assert "busy 45%, 1.80" in "\n".join(format_model("sim_accel", exact))
    # a window holding the model's first executions since it loaded says so beside its p99
    warm = dict(SEEN, obs=dict(SEEN["obs"], warming_up=True))
    rows_warm = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", warm)[1:])
    assert rows_warm["p99"] == ("12.34 ms  from trace, 240 samples  (tracing on, 1 in 7 requests); warming up: the "
                                "model's first executions since it loaded, not held against its model")
    # tracing off: the model's row says so and leaves the why (one long line) to the header, said once
    off = dict(SEEN, tracing="off: Triton 2.51.0 can crash under request tracing (...)",
               obs=dict(SEEN["obs"], p99_source="mean_x_tail_ratio", p99_samples=None))
    rows_off = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", off)[1:])
    assert rows_off["p99"] == "12.34 ms  from mean_x_tail_ratio  (tracing off, see above)"
    # the estimate's factor, and whether it was measured or is still the default
    for measured, said in ((False, "(the default until a quiet minute is measured)"), (True, "(measured)")):
        tail = dict(off, obs=dict(off["obs"], tail_ratio=2.0 if not measured else 1.84, tail_ratio_measured=measured))
        rows_tail = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", tail)[1:])
        factor = "1.84" if measured else "2.00"
        assert rows_tail["p99"] == f"12.34 ms  from mean_x_tail_ratio, mean x {factor} {said}  (tracing off, see above)"
    # a server without latency summaries: the default is never measured, and the header says why
    nosum = dict(off, summaries=False, obs=dict(off["obs"], tail_ratio=2.0, tail_ratio_measured=False))
    assert dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", nosum)[1:])["p99"] == \
        "12.34 ms  from mean_x_tail_ratio, mean x 2.00 (the default: the server publishes no latency summaries, see " \
        "above)  (tracing off, see above)"
    assert rows["last change"].endswith("(2m 10s ago) 1 -> 2 instances, delay 0 us: ScaleUpQueueGrowing (in place, 0.7 s)")
    # a model whose first executions after a change run slow (service.ServiceTimes.cold_start) is told what to do
    cold = dict(SEEN, obs=dict(SEEN["obs"], cold_start={"instances": 2, "delay_us": 0, "executions": 50, "ms": 24.0,
                                                        "usual_ms": 8.0, "excess_executions": 100.0}))
    rows_cold = dict((ln[:15].strip(), ln[15:]) for ln in format_model("sim_accel", cold)[1:])
    assert rows_cold["cold start"] == (
        "the first 50 executions after 2 x 0us went live took 24.0 ms each, against 8.0 ms after them: warm the "
        "model up before it is ready (in initialize, or Triton's model_warmup); until then every instance a reload "
        "starts serves its first requests slowly, and the planner changes the delay (a full reload) only where it must")
    assert "cold start" not in rows


def test_the_text_says_when_there_is_no_fresh_data_and_when_a_reload_is_in_flight():
    m = dict(SEEN, obs_age_s=6.0, obs_now="span_too_short", reason="HoldReloading", held_for_s=2.0,
             reloading={"to": {"instances": 3, "delay_us": 0}, "reason": "ScaleUpQueueGrowing", "kind": "in_place",
                        "for_s": 2.0})
    text = "\n".join(format_model("sim_accel", m))
    assert "6 s ago); now: collecting data since the last change" in text
    assert "reloading    -> 3 instances, delay 0 us: ScaleUpQueueGrowing (in place, 2 s so far)" in text
    fresh = dict(SEEN, obs=None, obs_now="too_few_samples", last_change=None)
    text = "\n".join(format_model("m", fresh))
    assert "load         collecting data" in text and "last change  none since the controller started" in text


def test_without_a_controller_the_text_says_so_and_shows_the_live_configs():
    doc = {"time": 100.0, "source": {"kind": "serve", "pid": 42, "started": 40.0},
           "server": {"http_url": "h:1", "grpc_url": "h:2", "metrics_url": "http://h:3/metrics"},
           "controller": None, "controller_error": "serve runs with --no-controller", "controller_absent": True,
           "models": {"resnet_tiny": {"state": "READY", "instances": 1, "delay_us": 0},
                      "sim_accel": {"state": "UNAVAILABLE", "state_reason": "unloaded"}}}
    lines = format_text(doc).splitlines()
    assert lines[0] == "serve pid 42, up 1m 00s: HTTP h:1  gRPC h:2  metrics http://h:3/metrics"
    assert lines[1] == "no controller: serve runs with --no-controller; showing the server's live configs only"
    assert "resnet_tiny  READY  1 instance, delay 0 us" in lines
    assert "sim_accel  UNAVAILABLE: unloaded" in lines


def test_watch_redraws_until_ctrl_c():
    import io
    frames = iter(["one", "two"])

    def render():
        try:
            return next(frames)
        except StopIteration:
            raise KeyboardInterrupt from None
    out = io.StringIO()
    assert watch(render, 0.01, out=out) == 0
    assert out.getvalue() == "one\n" + "-" * 40 + "\ntwo\n" + "-" * 40 + "\n"        # not a tty: no escape codes


# ---- the controller's snapshot and endpoint (fakes, no server) ----------------------------------

def test_the_snapshot_says_what_the_controller_sees_and_the_endpoint_serves_it():
    from test_loop_ticks import Clock, FakeModel, make, run_ticks
    clock = Clock()
    ctl, control, _ = make(["m"], {"m": FakeModel(50, 5, 4)}, clock)
    assert ctl.status_snapshot()["models"] == {}                 # before the first tick: an answer, not an error
    run_ticks(ctl, clock, 6)
    snap = ctl.status_snapshot()
    m = snap["models"]["m"]
    assert (m["instances"], m["delay_us"], m["reason"]) == (1, 0, "HoldSteady")
    assert m["obs"]["arrival_rps"] == pytest.approx(50, rel=0.05) and m["obs"]["p99_source"] == "mean_x_tail_ratio"
    assert m["obs"]["queue_ms"] == pytest.approx(1.0) and m["obs"]["compute_ms"] == pytest.approx(4.0)
    assert m["held_for_s"] >= 0 and m["last_change"] is None and m["reloading"] is None
    assert snap["ticks"] == 6 and snap["interval_s"] == 1.0 and snap["tracing"].startswith("off")
    ctl._act(ctl.models["m"], Decision(Settings(2, 0), "ScaleUpQueueGrowing"), ctl.models["m"].last_obs, clock.t)
    ctl.wait_for_pending()
    clock.t += 1.0
    ctl.tick()
    clock.t += 3.0
    m = ctl.status_snapshot()["models"]["m"]
    assert m["instances"] == 2 and m["last_change"]["to"] == {"instances": 2, "delay_us": 0}
    assert m["last_change"]["reason"] == "ScaleUpQueueGrowing" and m["last_change"]["ago_s"] == pytest.approx(4.0)
    assert m["obs"] is not None and m["obs_now"] in ("too_few_samples", "span_too_short")   # the last valid one; why not now
    json.dumps(ctl.status_snapshot())
    endpoint = ctl.metrics.serve(0, status=ctl.status_snapshot)
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        doc = json.loads(urllib.request.urlopen(base + "/status", timeout=5).read())
        assert doc["models"]["m"]["instances"] == 2
        assert 'controller_instance_count{model="m"} 2.0' in urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(base + "/other", timeout=5)
    finally:
        endpoint.close()
        ctl.close()
    with pytest.raises(ValueError, match="loopback"):
        ControllerMetrics().serve(0, host="0.0.0.0")


# ---- the walk, against a real tritonserver ------------------------------------------------------

def _cli(env, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_the_newcomer_walk_serve_status_traffic_status_stop(tmp_path, capsys):
    from controller.evaluation.loadgen import load_trace, make_inputs_from_config, poisson_schedule, run_open_loop_sync
    folder = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_ADMIN_KEY"}
    env[runstate.ENV_RUN_DIR] = str(folder)
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "controller", "serve", "--http-port", str(http), "--grpc-port",
                             str(grpc), "--metrics-port", str(metrics)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:                  # serve's start-up lines, up to "controller managing"
            lines.append(line)
            if line.startswith("controller managing") or proc.poll() is not None:
                break
        assert lines and lines[-1].startswith("controller managing"), "".join(lines)
        drain = threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True)
        drain.start()
        state_file = folder / f"serve-{proc.pid}.json"
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
        decision_log = folder / f"serve-{proc.pid}" / "decisions.jsonl"
        assert any(f"decision log: {decision_log}" in ln for ln in lines), "".join(lines)

        # status with no flags: both models READY, what the controller sees
        r = _cli(env, "status")
        assert r.returncode == 0, r.stdout + r.stderr
        out = r.stdout.splitlines()
        assert out[0].startswith(f"serve pid {proc.pid}, up ") and f"HTTP 127.0.0.1:{http}" in out[0]
        assert out[1].startswith("controller: up ")
        for model in ("resnet_tiny", "sim_accel"):
            assert any(ln.startswith(f"{model}  READY  1 instance, delay ") for ln in out), r.stdout

        # traffic, and status --json until the controller reports it with a p99 and its source
        trace = load_trace({"phases": [{"name": "steady", "duration_s": 20, "rate_rps": 60}]})
        schedule = poisson_schedule(trace, seed=3, max_requests=4000)
        inputs = make_inputs_from_config(f"127.0.0.1:{http}", "sim_accel")
        results: list = []
        load = threading.Thread(target=lambda: results.extend(
            run_open_loop_sync(f"127.0.0.1:{grpc}", "sim_accel", schedule, inputs, timeout_s=10.0)))
        load.start()
        deadline, seen, doc = time.monotonic() + 40, None, None
        while time.monotonic() < deadline:
            time.sleep(2.0)
            r = _cli(env, "status", "--json")
            assert r.returncode == 0, r.stderr
            doc = json.loads(r.stdout)
            m = doc["models"]["sim_accel"]
            o = m.get("obs") or {}
            if (o.get("arrival_rps") or 0) > 0 and o.get("p99_ms") is not None and o.get("p99_source"):
                seen = m
                break
        assert seen is not None, json.dumps(doc, indent=1)[-3000:]
        assert seen["state"] == "READY" and doc["models"]["resnet_tiny"]["state"] == "READY"
        assert seen["obs"]["p99_source"] in ("trace", "summary", "mean_x_tail_ratio", "interval_mean_max")
        assert seen["reason"] and seen["held_for_s"] is not None and doc["controller"]["ticks"] > 0
        # serve's controller marks the models it owns with its /status (a run on a port it picked does not)
        assert (doc["controller"]["status_url"] or "").startswith("http://127.0.0.1:"), doc["controller"]
        assert doc["source"] == {"kind": "serve", "pid": proc.pid, "started": doc["source"]["started"],
                                 "run_state": str(state_file), "phase": "running", "server_restarts": []}
        r = _cli(env, "status")
        assert r.returncode == 0 and "  p99 " in r.stdout and " ms  from " in r.stdout, r.stdout
        assert "req/s arriving" in r.stdout
        summary = [ln.split() for ln in r.stdout.splitlines() if ln.split()[:1] in (["MODEL"], ["sim_accel"])]
        assert summary[0][:3] == ["MODEL", "STATE", "INST"] and summary[1][:3] == ["sim_accel", "READY", "1"], r.stdout

        # one model's details; a name the server does not have, said in one line with those it has
        r = _cli(env, "status", "sim_accel")
        assert r.returncode == 0 and "sim_accel  READY" in r.stdout and "resnet_tiny" not in r.stdout, r.stdout
        r = _cli(env, "status", "resnet")
        assert r.returncode == 1 and r.stdout.strip().splitlines()[-1] == \
            "no model resnet here; the models are: resnet_tiny, sim_accel", r.stdout + r.stderr
        assert not r.stderr, r.stderr

        # what happened, said as such: the restricted API without a key, and with a wrong one
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"server: {{grpc_url: '127.0.0.1:{grpc}', http_url: '127.0.0.1:{http}', timeout_s: 5}}\n")
        assert main(["status", "--config", str(cfg)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is restricted" in err[0] and "pass the key: export TRITON_ADMIN_KEY=" in err[0], err
        cfg.write_text(f"server: {{grpc_url: '127.0.0.1:{grpc}', http_url: '127.0.0.1:{http}', timeout_s: 5, "
                       "auth_header: admin-key, auth_key_env: NEWCOMER_WRONG_KEY, control_protocol: http}\n")
        os.environ["NEWCOMER_WRONG_KEY"] = "not-the-key"
        try:
            assert main(["status", "--config", str(cfg)]) == 1
        finally:
            del os.environ["NEWCOMER_WRONG_KEY"]
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "refused the key sent in header 'admin-key'" in err[0], err
        load.join(60)
        assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, "".join(lines)[-2000:]
    assert not state_file.exists() and decision_log.exists()       # the log outlives serve, the run state not
    r = _cli(env, "status")
    assert r.returncode == 1 and r.stdout.startswith("nothing is running"), r.stdout + r.stderr


def test_under_serve_with_no_traffic_status_says_how_to_send_some():
    idle = {"state": "READY", "instances": 1, "delay_us": 0, "reason": "HoldSteady",
            "obs": {"arrival_rps": 0.0, "completion_rps": 0.0, "span_s": 18.0}}
    doc = {"time": 100.0, "source": {"kind": "serve", "pid": 42, "started": 40.0},
           "server": {"http_url": "h:1", "grpc_url": "h:2", "metrics_url": "http://h:3/metrics"},
           "controller": {"uptime_s": 60, "interval_s": 2, "window_s": 20, "tracing": "on"},
           "models": {"resnet_tiny": dict(idle), "sim_accel": dict(idle)}}
    text = format_text(doc)
    assert text.endswith("no requests yet: `python -m controller load --model resnet_tiny --rate 50` sends some, "
                         "open loop, a line every 5 s (README, \"Then: send it traffic\")"), text
    busy = dict(doc, models={"resnet_tiny": dict(idle), "sim_accel": dict(idle, obs={"arrival_rps": 3.0})})
    assert "no requests yet" not in format_text(busy)                       # one model has traffic: no hint
    assert "no requests yet" not in format_text(dict(doc, source={"kind": "config", "path": "c.yaml"}))
    assert "no requests yet" not in format_text(dict(doc, controller=None))
    # an ensemble is what users call: its name, not its step's, though the step sorts first
    ens = dict(doc, models={"a_step": dict(idle), "ens": dict(idle, ensemble_steps=["a_step"])})
    assert "load --model ens --rate 50" in format_text(ens)
    only_step = dict(doc, models={"a_step": dict(idle), "ens": dict(idle, ensemble_steps=["a_step"], state="LOADING")})
    assert "load --model a_step --rate 50" in format_text(only_step)
    # after traffic has stopped: not "yet" (a model with executions behind its fit, or one changed, had requests)
    served = dict(idle, obs=dict(idle["obs"], service={"executions": 2201, "sizes": [1]}))
    after = format_text(dict(doc, models={"resnet_tiny": served, "sim_accel": dict(idle)}))
    assert after.endswith("no requests in the last 18 s: `python -m controller load --model resnet_tiny --rate 50` "
                          "sends some, open loop, a line every 5 s (README, \"Then: send it traffic\")"), after
    changed = format_text(dict(doc, models={"resnet_tiny": dict(idle), "sim_accel": dict(idle, last_change={"t": 1})}))
    assert "no requests in the last 18 s" in changed and "no requests yet" not in changed
    # `load` refuses a stateful model (sequence ids, start/end flags): the hint names one it can drive, or says so
    seq = dict(doc, models={"a_seq": dict(idle, stateful=True), "sim_accel": dict(idle)})
    assert "load --model sim_accel --rate 50" in format_text(seq)
    only_seq = format_text(dict(doc, models={"a_seq": dict(idle, stateful=True)}))
    assert only_seq.endswith("no requests yet: a_seq is stateful (a sequence batcher), which `python -m controller "
                             "load` cannot drive (its requests need sequence ids and start/end flags): send it your "
                             "own sequences"), only_seq


def test_a_model_of_several_versions_is_ready_where_one_is_and_status_names_each():
    from controller.status import by_name
    index = [{"name": "m", "version": "1", "state": "READY", "reason": ""},
             {"name": "m", "version": "2", "state": "READY", "reason": ""},
             {"name": "m", "version": "3", "state": "UNAVAILABLE",
              "reason": "Internal: RuntimeError: v3 is broken\n\nAt:\n  /r/m/3/model.py(9): initialize\n"},
             {"name": "other"}]
    states = by_name(index)
    assert states["m"]["state"] == "READY" and "versions" not in states["other"]        # the last entry said UNAVAILABLE
    assert [v["state"] for v in states["m"]["versions"]] == ["READY", "READY", "UNAVAILABLE"]
    m = {"state": "READY", "instances": 2, "delay_us": 0, "versions": states["m"]["versions"]}
    line = [ln.split(None, 1)[1] for ln in format_model("m", m) if ln.strip().startswith("versions")]
    assert line == ["1 READY, 2 READY, 3 UNAVAILABLE (Internal: RuntimeError: v3 is broken (at "
                    "/r/m/3/model.py(9): initialize)): 2 instance(s) each, 4 in all (the version policy loads several; "
                    "traffic picks its version)"], line
    failing = by_name([{"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "a\nb"},
                       {"name": "m", "version": "2", "state": "UNLOADING", "reason": ""}])["m"]
    assert failing["state"] == "UNLOADING"                                 # none READY: the last one's state
    assert "READY:" not in format_model("m", {"state": "UNLOADING", "versions": failing["versions"]})[1]
    assert by_name([{"name": "m", "version": "1", "state": "READY"}])["m"].get("versions") is None   # one: no line
