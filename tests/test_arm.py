"""The shared bench arm (controller/evaluation/arm.py) without a real server: the steps every arm takes,
and the cleanup that runs whatever failed (the controller process killed, the helper stopped, the client closed)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import controller.actuation
import controller.server
from controller.evaluation import arm as arm_mod
from controller.evaluation.arm import ArmSpec, ControllerSpec, run_arm
from controller.evaluation.loadgen import RequestRecord
from controller.server import ServerError
from controller.types import Settings


class FakeServer:
    http_url, grpc_url, metrics_url = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
    stopped = False
    process = None                    # no process: the arm's ServerSupervisor has nothing to watch

    def __init__(self, options):
        self.options = options

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        FakeServer.stopped = True


class FakeControl:
    closed = False

    def __init__(self, *a, **kw):
        pass

    def close(self):
        FakeControl.closed = True


class FakeActuator:
    live: dict[str, Settings] = {}
    refuse: set[str] = set()

    def __init__(self, control):
        pass

    def apply(self, model, target):
        ok = model not in self.refuse
        if ok:
            FakeActuator.live[model] = target
        return controller.actuation.ApplyResult(ok, "in_place", target, 0.0, "" if ok else "refused")

    def read(self, model):
        return {}, FakeActuator.live[model]


class FakeHelper:
    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True
        return [{"t": 1.0, "instances": 2}]


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    """No server, no client, no traffic: each fake records what was done to it."""
    FakeServer.stopped, FakeControl.closed, FakeActuator.live, FakeActuator.refuse = False, False, {}, set()
    monkeypatch.setattr(controller.server, "TritonServer", FakeServer)
    monkeypatch.setattr(controller.actuation, "TritonControl", FakeControl)
    monkeypatch.setattr(controller.actuation, "Actuator", FakeActuator)
    monkeypatch.setattr(arm_mod, "live_config", lambda url, model: {"name": model, "max_batch_size": 0, "input": [
        {"name": "X", "data_type": "TYPE_FP32", "dims": [1]}]})
    monkeypatch.setattr(arm_mod, "CONTROLLER_LEAD_S", 0.05)
    procs: list[subprocess.Popen] = []

    def start_controller(spec, server, out, name):
        """A stand-in controller process that logs one applied change and then waits to be stopped."""
        log = out / f"{name}_decisions.jsonl"
        log.write_text(json.dumps({"time": time.time() + 0.5, "model": "m", "action": "applied", "reason": "Up",
                                   "kind": "in_place", "live": {"instances": 3, "delay_us": 0}}) + "\n")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        procs.append(proc)
        return proc, {"controller": dict(spec.settings), "models": dict(spec.models)}, log, None

    monkeypatch.setattr(arm_mod, "start_controller", start_controller)
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()


def spec(tmp_path, **kw) -> ArmSpec:
    base = dict(name="adaptive", models=["m"], initial={"m": Settings(1, 0)}, schedules={"m": np.array([0.0, 0.1])},
                out=tmp_path, controller=ControllerSpec({"interval_s": 1.0}, {"m": {}}, duration_s=30.0))
    return ArmSpec(**{**base, **kw})


def ok_traffic(url, model, schedule, make_inputs, **kw):
    return [RequestRecord(float(t), float(t), float(t) + 0.01, True, None) for t in schedule]


def test_an_arm_with_a_controller_stops_it_and_reads_its_decisions(fakes, tmp_path, monkeypatch):
    monkeypatch.setattr(arm_mod, "run_open_loop_sync", ok_traffic)
    helper = FakeHelper()
    run = run_arm(spec(tmp_path, helper=lambda server, t0: helper))
    assert [len(r) for r in run.records.values()] == [2]
    assert fakes[0].poll() is not None                     # stopped (SIGTERM) before the arm returned
    assert run.controller["exit_code"] == fakes[0].returncode
    assert [(c["model"], c["instances"], c["reason"]) for c in run.applied_changes()] == [("m", 3, "Up")]
    assert 0.0 < run.applied_changes()[0]["t"] <= 0.5
    assert helper.stopped and run.helper_events == [{"t": 1.0, "instances": 2}]
    assert run.live_at_end == {"m": Settings(1, 0)}
    assert FakeControl.closed and FakeServer.stopped


def test_a_failure_during_the_traffic_still_kills_the_controller_and_stops_the_helper(fakes, tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise ConnectionError("server went away")
    monkeypatch.setattr(arm_mod, "run_open_loop_sync", broken)
    helper = FakeHelper()
    with pytest.raises(ConnectionError):
        run_arm(spec(tmp_path, helper=lambda server, t0: helper))
    assert fakes[0].poll() is not None                     # no controller left running
    assert helper.stopped and FakeControl.closed and FakeServer.stopped


def test_an_initial_config_the_server_refuses_fails_the_arm_before_any_controller(fakes, tmp_path, monkeypatch):
    monkeypatch.setattr(arm_mod, "run_open_loop_sync", ok_traffic)
    FakeActuator.refuse = {"b"}
    with pytest.raises(ServerError, match="cannot apply the initial config .* to b: refused"):
        run_arm(spec(tmp_path, models=["a", "b"], initial={"a": Settings(1, 0), "b": Settings(2, 0)},
                     schedules={"a": np.array([0.0]), "b": np.array([0.0])}))
    assert fakes == [] and FakeControl.closed and FakeServer.stopped


def test_several_models_are_driven_at_once_and_an_error_in_any_of_them_is_raised(fakes, tmp_path, monkeypatch):
    two = dict(models=["a", "b"], initial={"a": Settings(1, 0), "b": Settings(2, 0)}, controller=None,
               schedules={"a": np.array([0.0, 0.1]), "b": np.array([0.0, 0.1, 0.2])})
    monkeypatch.setattr(arm_mod, "run_open_loop_sync", ok_traffic)
    run = run_arm(spec(tmp_path, **two))
    assert {n: len(r) for n, r in run.records.items()} == {"a": 2, "b": 3} and run.controller is None

    def b_fails(url, model, schedule, make_inputs, **kw):
        if model == "b":
            raise TimeoutError("b")
        return ok_traffic(url, model, schedule, make_inputs)
    monkeypatch.setattr(arm_mod, "run_open_loop_sync", b_fails)
    with pytest.raises(TimeoutError):
        run_arm(spec(tmp_path, **two))
