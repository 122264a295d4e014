"""What an operator reads: `status`, the decision log and the controller's own metrics endpoint."""
from __future__ import annotations

import pytest

import dataclasses
import json
import subprocess
import sys
import urllib.request

import yaml

from conftest import ROOT
from controller import runstate
from controller.config import ControllerConfig, LoopConfig, ServerConfig
from controller.loop import Controller
from controller.server import free_port
from controller.status import format_text, gather, target_from_state
from controller.telemetry import ControllerMetrics
from controller.types import Settings


def _config_file(tmp_path, server, log_path) -> str:
    path = tmp_path / "ctl.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"http_url": server.http_url, "grpc_url": server.grpc_url, "metrics_url": server.metrics_url},
        "controller": {"decision_log": str(log_path)},
        "models": ["resnet_tiny", "sim_accel"],
    }))
    return str(path)


def test_status_without_a_controller_prints_live_configs_and_recent_decisions(server, tmp_path):
    log_path = tmp_path / "decisions.jsonl"
    records = [{"time": 1_700_000_000 + i, "t": i, "model": "sim_accel", "action": "applied", "reason": f"Reason{i}",
                "detail": f"detail {i}", "target": {"instances": 1 + i, "delay_us": 0}} for i in range(7)]
    log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = subprocess.run([sys.executable, "-m", "controller", "status", "--config", _config_file(tmp_path, server, log_path),
                        "--last", "3"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == ("controller not reachable; showing the server's live configs only "
                        "(the config sets no controller.metrics_port and no `run` with it runs here)")
    assert "resnet_tiny  READY  1 instance, delay 0 us" in lines
    assert "sim_accel  READY  1 instance, delay 0 us" in lines
    shown = [ln for ln in lines if "Reason" in ln and ln.split()[0] == "recent"]
    assert [ln.split()[3] for ln in shown] == ["Reason4", "Reason5", "Reason6"]   # the last 3, in order
    # the summary line a model: no controller to ask, so its decision log's last record
    assert any(ln.split()[:2] == ["sim_accel", "READY"] and ln.endswith("Reason6 (logged)") for ln in lines), lines
    assert "-> 7 inst" in shown[-1]


def test_status_shows_what_else_the_server_runs_as_not_named_in_the_config(server, tmp_path):
    """A model on the server that the config does not name (loaded by hand beside the managed ones) is listed after
    them with its live settings, said to be not named (the controller, not reachable here, could still manage it: an
    ensemble's step, a model a BLS model calls); in --json, `unmanaged`."""
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"http_url": server.http_url, "grpc_url": server.grpc_url, "metrics_url": server.metrics_url},
        "models": ["sim_accel"]}))
    r = subprocess.run([sys.executable, "-m", "controller", "status", "--config", str(path)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = lines.index("resnet_tiny  READY  1 instance, delay 0 us")
    assert at > lines.index("sim_accel  READY  1 instance, delay 0 us")
    assert lines[at + 1] == ("  model  not named in the config; the controller (not reachable) may manage it all the "
                             "same, as an ensemble's step or a model a BLS model calls")
    assert any(ln.split()[:2] == ["resnet_tiny", "READY"] and ln.endswith("not named in the config") for ln in lines)
    r = subprocess.run([sys.executable, "-m", "controller", "status", "--config", str(path), "--json"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    doc = json.loads(r.stdout)
    assert doc["models"]["resnet_tiny"]["unmanaged"] is True and "unmanaged" not in doc["models"]["sim_accel"]


def test_status_of_a_serve_without_a_controller_says_so_and_calls_no_model_tuned(server, tmp_path):
    """Under `serve --no-controller` nothing is tuned: the header says there is no controller (not that one cannot be
    reached), and a model loaded beside serve's is named as not one of serve's models, not as "not tuned" beside
    models that would be."""
    state = runstate.ServeState(tmp_path / "serve.json", {
        "pid": 42, "started": 1.0, "phase": "serving", "http_url": server.http_url, "grpc_url": server.grpc_url,
        "metrics_url": server.metrics_url, "models": ["sim_accel"]})
    doc = gather(target_from_state(state))
    assert doc["controller_absent"] is True and doc["models"]["resnet_tiny"]["unmanaged"] is True
    lines = format_text(doc).splitlines()
    assert lines[1] == "no controller: serve runs with --no-controller; showing the server's live configs only"
    at = lines.index("resnet_tiny  READY  1 instance, delay 0 us")
    assert lines[at + 1] == "  model  loaded on the server, not one of serve's models (--models)"
    assert not any("not tuned" in ln for ln in lines)
    with_ctl = gather(dataclasses.replace(target_from_state(state), controller_port=free_port(), no_controller_why=""))
    assert with_ctl["controller_absent"] is False and "unmanaged_why" not in with_ctl["models"]["resnet_tiny"]
    assert format_text(with_ctl).splitlines()[1].startswith("controller not reachable; ")


def test_status_with_no_server_is_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"grpc_url": f"127.0.0.1:{free_port()}", "timeout_s": 2}}))
    r = subprocess.run([sys.executable, "-m", "controller", "status", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.startswith("error: cannot reach the server") and "Traceback" not in r.stderr


def test_controller_metrics_endpoint_reports_settings_and_decisions(server):
    port = free_port()
    metrics = ControllerMetrics()
    metrics.serve(port)
    cfg = ControllerConfig(server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url,
                                               metrics_url=server.metrics_url),
                           loop=LoopConfig(interval_s=0.2, window_s=2.0, min_span_s=1.0), models={})
    controller = Controller(cfg, metrics=metrics)
    try:
        controller.run(max_ticks=3)
    finally:
        controller.close()
    assert set(controller.models) == {"resnet_tiny", "sim_accel"}     # no models configured: every READY one
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'controller_instance_count{model="sim_accel"} 1.0' in text
    assert 'controller_max_queue_delay_us{model="resnet_tiny"} 0.0' in text
    assert 'controller_decisions_total{model="sim_accel",reason="HoldNoData"} 3.0' in text   # too little data in 3 ticks
    assert controller.models["sim_accel"].current == Settings(1, 0)


def test_warm_start_reads_a_sweep_and_judges_it_against_the_model_target(tmp_path):
    from controller.config import ModelLimits
    from controller.loop import warm_start_points
    sweep = tmp_path / "sweep.json"
    def cell(n, offered, completed, p99):   # a sweep.json cell as `controller sweep` writes it
        return {"instance_count": n, "max_queue_delay_us": 0, "arrival_rps": offered, "offered_rps": offered,
                "completion_rps": completed, "goodput_rps": completed, "p50_ms": p99 / 2, "p99_ms": p99,
                "requests": int(offered * 4), "failed": 0, "met_sla": p99 <= 100}
    cells = [cell(1, 300.0, 300.0, 46.0), cell(2, 300.0, 299.0, 28.0), cell(2, 390.0, 300.0, 30.0)]
    sweep.write_text(json.dumps({"model": "sim_accel", "cells": cells}))
    points = warm_start_points(str(sweep), "sim_accel", ModelLimits(p99_target_ms=40.0), now=5.0)
    assert [(p.instance_count, p.arrival_rps, p.met_target) for p in points] == [
        (1, 300.0, False), (2, 300.0, True), (2, 390.0, False)]   # the last one fell behind its load
    assert warm_start_points(str(sweep), "other_model", ModelLimits(), now=5.0) == ()
    assert warm_start_points(str(tmp_path / "missing.json"), "sim_accel", ModelLimits(), now=5.0) == ()


def test_p99_estimate_is_mean_times_tail_ratio_or_the_worst_interval():
    from controller.observer import estimate_p99
    from controller.types import Observation
    base = Observation(valid=True, span_s=10, p99_ms=24.0, p99_source="interval_mean_max", request_ms_mean=20.0)
    est = estimate_p99(base, 1.8)
    assert (round(est.p99_ms, 6), est.p99_source) == (36.0, "mean_x_tail_ratio")
    assert (est.tail_ratio, est.tail_ratio_measured) == (1.8, False)    # what status shows beside it
    assert estimate_p99(base, 1.8, measured=True).tail_ratio_measured
    assert estimate_p99(base, 1.0).p99_ms == 24.0                       # the worst interval was higher
    summary = Observation(valid=True, span_s=60, p99_ms=46.0, p99_source="summary", request_ms_mean=25.0)
    assert estimate_p99(summary, 3.0) == summary                        # a fresh summary is used as it is
    assert estimate_p99(Observation(valid=False), 2.0) == Observation(valid=False)


def _doc(n: int) -> dict:
    models = {f"m{i:02d}": {"state": "READY", "instances": 1 + i % 3, "delay_us": 0, "reason": "HoldPredictedOk",
                            "p99_target_ms": 50.0, "obs": {"arrival_rps": 10.0 * i, "p99_ms": 20.0 + 10 * i}}
              for i in range(1, n + 1)}
    return {"time": 100.0, "source": {"kind": "config", "path": "c.yaml"}, "controller": {"ticks": 3},
            "models": models}


def test_status_puts_a_line_a_model_first_and_marks_a_p99_over_its_target():
    from controller.status import format_text
    text = format_text(_doc(3))
    table = [ln.split() for ln in text.splitlines() if ln.split()[:1] in (["MODEL"], ["m01"], ["m02"], ["m03"])]
    assert table[:4] == [["MODEL", "STATE", "INST", "DELAY_US", "REQ/S", "P99_MS", "TARGET_MS", "REASON"],
                         ["m01", "READY", "2", "0", "10.0", "30.0", "50", "HoldPredictedOk"],
                         ["m02", "READY", "3", "0", "20.0", "40.0", "50", "HoldPredictedOk"],
                         ["m03", "READY", "1", "0", "30.0", "50.0", "50", "HoldPredictedOk"]], text
    assert "m03  READY  1 instance" in text           # three models: every block follows the table
    over = format_text(_doc(4))
    assert any(ln.split()[:7] == ["m04", "READY", "2", "0", "40.0", "60.0", "OVER"] for ln in over.splitlines()), over


def test_status_with_many_models_shows_the_table_and_says_how_to_see_one_and_one_model_alone():
    from controller.status import DETAILS_MAX, UnknownModel, format_text, select_models
    doc = _doc(DETAILS_MAX + 1)
    text = format_text(doc)
    assert "m07  READY" not in text and sum(ln.startswith("m0") for ln in text.splitlines()) == DETAILS_MAX + 1
    assert f"{DETAILS_MAX + 1} models: `python -m controller status MODEL [MODEL ...]`" in text
    assert "m07  READY  2 instances" in format_text(doc, details=True)
    one = format_text(select_models(doc, ["m02"]))
    assert "MODEL" not in one and "m02  READY  3 instances" in one and "m01" not in one, one
    with pytest.raises(UnknownModel, match="no model m99 here; the models are: m01, m02"):
        select_models(doc, ["m02", "m99"])
