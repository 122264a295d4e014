"""Issue 13, item 4: one controller per model. The owner mark's rules (pure, fake probe and clock), and two
controllers against one real tritonserver: the second refuses while the owner lives, takes over a stale mark."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

import yaml

import pytest

from conftest import ROOT, start_server
from controller.actuation import Actuator, TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.loop import Controller
from controller.server import ServerOptions, TritonServer, free_port, repository_models
from controller.ownership import (FOREIGN_LIVE, FOREIGN_UNREACHABLE, MINE, OWNER_KEY, TAKE_OVER, UNMARKED, OwnerMark,
                                  OwnershipGuard, mark_of, marked_file_config, probe_status)
from controller.status import format_model
from controller.types import Settings

HOST = socket.gethostname()
ME = OwnerMark(f"{HOST}:100:1.000", "http://127.0.0.1:1/status")
OTHER = OwnerMark("otherhost:200:2.000", "http://10.0.0.2:9109/status")


def guard(answers: dict | None, **kw) -> tuple[OwnershipGuard, list]:
    calls = []

    def probe(url):
        calls.append(url)
        return answers

    return OwnershipGuard(ME, stale_after_s=60, probe_every_s=5, probe=probe, pid_alive=kw.pop("pid_alive", lambda p: True),
                          hostname=HOST, **kw), calls


@pytest.mark.parametrize("answer,mark,state", [
    (None, None, UNMARKED),
    (None, ME, MINE),
    ({"owner": OTHER.owner, "models": {"m": {}}}, OTHER, FOREIGN_LIVE),
    ({"owner": OTHER.owner, "models": {"other_model": {}}}, OTHER, TAKE_OVER),          # alive, not managing m
    ({"owner": "otherhost:999:9.000", "models": {"m": {}}}, OTHER, TAKE_OVER),          # its port now someone else's
    (None, OTHER, FOREIGN_UNREACHABLE),                                                 # silent: not yet stale
    (None, OwnerMark("otherhost:200:2.000", None), FOREIGN_UNREACHABLE),                # no URL, other host
], ids=["unmarked", "mine", "live-owner", "owner-not-managing", "port-reused", "silent", "no-url-other-host"])
def test_verdicts(answer, mark, state):
    g, _ = guard(answer)
    assert g.check("m", mark, now=0.0).state == state


def test_a_silent_owner_is_stale_after_the_timeout():
    g, calls = guard(None)
    assert g.check("m", OTHER, 0.0).state == FOREIGN_UNREACHABLE
    assert g.check("m", OTHER, 2.0).state == FOREIGN_UNREACHABLE and len(calls) == 1   # probed at most every 5 s
    assert g.check("m", OTHER, 30.0).state == FOREIGN_UNREACHABLE
    v = g.check("m", OTHER, 61.0)
    assert v.state == TAKE_OVER and v.may_act and "stale after 60 s" in v.detail


def test_an_owner_that_answers_again_is_live_again():
    answers = {"doc": None}
    g = OwnershipGuard(ME, stale_after_s=60, probe_every_s=0, probe=lambda url: answers["doc"], hostname=HOST)
    assert g.check("m", OTHER, 0.0).state == FOREIGN_UNREACHABLE
    answers["doc"] = {"owner": OTHER.owner, "models": {"m": {}}}
    assert g.check("m", OTHER, 50.0).state == FOREIGN_LIVE
    answers["doc"] = None
    assert g.check("m", OTHER, 100.0).state == FOREIGN_UNREACHABLE     # the silence counts from 100, not 0
    assert g.check("m", OTHER, 161.0).state == TAKE_OVER


def test_same_host_dead_pid_is_taken_over_at_once_and_live_pid_without_url_is_respected():
    dead = OwnerMark(f"{HOST}:4242:3.000", None)
    g, _ = guard(None, pid_alive=lambda pid: pid != 4242)
    assert g.check("m", dead, 0.0).state == TAKE_OVER
    alive = OwnerMark(f"{HOST}:4343:3.000", None)
    assert g.check("n", alive, 0.0).state == FOREIGN_LIVE


def test_mark_round_trips_through_a_config():
    cfg = {"parameters": {"seed": {"string_value": "0"}, OWNER_KEY: {"string_value": OTHER.encode()}}}
    assert mark_of(cfg) == OTHER
    assert mark_of({"parameters": {}}) is None and mark_of({}) is None


# ---- against the real server ---------------------------------------------------------------------

MODEL = "sim_accel"



def _unloads(sim_server, offset: int) -> int:
    return sim_server.log_path.read_text(errors="replace")[offset:].count("successfully unloaded 'sim_accel'")


def test_the_mark_survives_the_override_and_count_changes_stay_in_place(sim_server):
    control = TritonControl(sim_server.grpc_url, sim_server.http_url)
    original = control.config(MODEL)
    act = Actuator(control, mark=ME)
    before = len(sim_server.log_path.read_text(errors="replace"))
    try:
        first = act.claim(MODEL)
        assert first.ok and first.kind == "full_reload"        # a new parameters map: Triton reloads the model
        assert act.apply(MODEL, Settings(2, 0)).kind == "in_place"
        live = control.config(MODEL)
        assert mark_of(live) == ME
        assert live["parameters"]["fixed_overhead_ms"]["string_value"] == "4"     # the others are kept
        deadline = time.monotonic() + 15      # the old copy goes in the background after the new one is live
        while _unloads(sim_server, before) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        offset = len(sim_server.log_path.read_text(errors="replace"))
        up = act.apply(MODEL, Settings(3, 0))
        down = act.apply(MODEL, Settings(1, 0))
        assert up.ok and up.kind == "in_place" and down.ok and down.kind == "in_place"
        log = sim_server.log_path.read_text(errors="replace")[offset:]
        assert "sim_accel_0_2" in log and _unloads(sim_server, offset) == 0, log[-2000:]   # same mark: no full reload
        assert mark_of(control.config(MODEL)) == ME
    finally:
        control.load(MODEL, original)
    assert mark_of(control.config(MODEL)) is None


def _config(sim_server, log_path, stale_after_s: float = 60.0) -> ControllerConfig:
    return ControllerConfig(
        server=ServerConfig(http_url=sim_server.http_url, grpc_url=sim_server.grpc_url, metrics_url=sim_server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, decision_log=str(log_path),
                        gpu="simulated", owner_stale_after_s=stale_after_s, tracing=False),
        models={MODEL: ModelLimits(p99_target_ms=15.0, max_instances=4)})


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _tick_until_mine(b, control, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while mark_of(control.config(MODEL)).owner != b.me.owner:
        assert time.monotonic() < deadline, b.models[MODEL].last_decision
        b.tick()
        b.wait_for_pending(60)
        time.sleep(0.5)


def test_second_controller_refuses_while_the_owner_lives_and_takes_over_when_it_is_gone(sim_server, tmp_path, caplog):
    """A: `python -m controller run` in its own process, with its /status. B: a Controller in this process."""
    control = TritonControl(sim_server.grpc_url, sim_server.http_url)
    original = control.config(MODEL)
    port = free_port()
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({
        "server": {"http_url": sim_server.http_url, "grpc_url": sim_server.grpc_url, "metrics_url": sim_server.metrics_url},
        "controller": {"interval_s": 0.5, "window_s": 4, "min_span_s": 2, "settle_s": 1, "gpu": "simulated",
                       "tracing": False, "metrics_port": port, "decision_log": str(tmp_path / "a.jsonl")},
        "models": {MODEL: {"p99_target_ms": 15}}}))
    a = subprocess.Popen([sys.executable, "-m", "controller", "run", "--config", str(tmp_path / "a.yaml")],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    b = Controller(_config(sim_server, tmp_path / "b.jsonl"))
    b_endpoint = b.metrics.serve(0, status=b.status_snapshot)
    b.set_status_url(f"http://127.0.0.1:{b_endpoint.port}/status")
    b.ownership.probe_every_s = 0.0
    try:
        mark = _wait(lambda: mark_of(control.config(MODEL)), 60, "A to mark the model")   # A's claim: a full reload
        assert mark.pid == a.pid and mark.status_url == f"http://127.0.0.1:{port}/status"
        _wait(lambda: MODEL in (probe_status(mark.status_url) or {}).get("models", {}), 30, "A's /status")
        caplog.set_level(logging.INFO, logger="controller.loop")
        for _ in range(3):
            b.tick()
        mm = b.models[MODEL]
        assert mm.pending is None and mm.last_reason == "HoldOwnedByOther"
        lines = [r.getMessage() for r in caplog.records if "managed by another controller" in r.getMessage()]
        assert len(lines) == 1 and mark.owner in lines[0] and f"alive at {mark.status_url}" in lines[0], lines
        owner = b.status_snapshot()["models"][MODEL]["owner"]
        assert owner["owner"] == mark.owner and owner["state"] == FOREIGN_LIVE and owner["mine"] is False
        text = "\n".join(format_model(MODEL, b.status_snapshot()["models"][MODEL]))
        assert mark.owner in text and "not acting on it" in text, text
        held = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
        assert [r["reason"] for r in held].count("HoldOwnedByOther") == 1    # logged on the change of reason only
        assert mark_of(control.config(MODEL)) == mark                         # B changed nothing

        a.kill()                      # A is gone (SIGKILL: no chance to clean up)
        a.wait(10)
        b.tick()                      # same host, its pid gone: taken over at once, no timeout
        _tick_until_mine(b, control)  # the claim waits for a quiet moment: the policy holding on valid data
        assert any(f"taking over from {mark.owner} (its process {a.pid} is gone)" in r.getMessage() for r in caplog.records)
        assert mark_of(control.config(MODEL)).owner == b.me.owner and control.ready(MODEL)
        records = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
        assert [r["action"] for r in records if r["reason"] == "ClaimOwnership"] == ["claiming", "claimed"]
    finally:
        if a.poll() is None:
            a.kill()
        b_endpoint.close()
        b.close()
        control.load(MODEL, original)


def test_a_stale_mark_is_taken_over_after_the_timeout(sim_server, tmp_path, caplog):
    """A mark from a controller on another host whose /status no longer answers."""
    control = TritonControl(sim_server.grpc_url, sim_server.http_url)
    original = control.config(MODEL)
    gone = OwnerMark("elsewhere:4242:1.000", f"http://127.0.0.1:{free_port()}/status")
    assert Actuator(control, mark=gone).claim(MODEL).ok
    b = Controller(_config(sim_server, tmp_path / "b.jsonl", stale_after_s=1.5))
    b_endpoint = b.metrics.serve(0, status=b.status_snapshot)
    b.set_status_url(f"http://127.0.0.1:{b_endpoint.port}/status")
    b.ownership.probe_every_s = 0.0
    caplog.set_level(logging.INFO, logger="controller.loop")
    try:
        b.tick()
        assert b.models[MODEL].last_reason == "HoldOwnedByOther" and b.models[MODEL].pending is None
        assert b.status_snapshot()["models"][MODEL]["owner"]["state"] == FOREIGN_UNREACHABLE
        time.sleep(1.7)
        b.tick()
        _tick_until_mine(b, control)
        taken = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
        assert len(taken) == 1 and gone.owner in taken[0] and "does not answer for 2 s (stale after 1.5 s)" in taken[0], taken
        assert mark_of(control.config(MODEL)).owner == b.me.owner
        b.tick()
        assert b.status_snapshot()["models"][MODEL]["owner"]["mine"] is True
    finally:
        b_endpoint.close()
        b.close()
        control.load(MODEL, original)


def test_a_controller_without_a_status_endpoint_does_not_mark(sim_server, tmp_path):
    """Nobody could ask it whether it lives: its mark would look alive (or stale) whatever it does."""
    control = TritonControl(sim_server.grpc_url, sim_server.http_url)
    c = Controller(_config(sim_server, tmp_path / "c.jsonl"))
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            c.tick()
            time.sleep(0.5)
        assert c.models[MODEL].last_reason == "HoldNoData" or c.models[MODEL].last_decision.valid
        assert mark_of(control.config(MODEL)) is None
    finally:
        c.close()


# ---- serve's first load, marked (no claim to follow) ----------------------------------------------

def _without_mark(cfg: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    params = cfg.get("parameters") or {}
    params.pop(OWNER_KEY, None)
    if not params:
        cfg.pop("parameters", None)
    return cfg


AUTO_COMPLETED = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(8)
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
                for r in requests]
"""


@pytest.mark.parametrize("repository", ["model_repository", "scripts/scenarios/repos/mixed", "auto-completed"])
def test_a_model_loaded_with_its_marked_file_config_runs_the_config_its_file_gives(repository, tmp_path):
    """What `serve` loads first (ownership.marked_file_config) against what the file alone gives, model by model:
    the live configs differ only by the mark (the server normalises the override as it does the file: the kind,
    an ensemble's steps, a BLS model's and a Python model's defaults; and a model whose two-line file leaves its
    inputs, outputs, batch size and batcher to its model.py's `auto_complete_config`)."""
    repo = ROOT / repository
    if repository == "auto-completed":
        repo = tmp_path / "repo"
        (repo / "ac" / "1").mkdir(parents=True)
        (repo / "ac" / "config.pbtxt").write_text('backend: "python"\n')
        (repo / "ac" / "1" / "model.py").write_text(AUTO_COMPLETED)
        (repo / "no_file" / "1").mkdir(parents=True)                  # no config.pbtxt at all
        (repo / "no_file" / "1" / "model.py").write_text(AUTO_COMPLETED)
    names = repository_models(repo)
    assert repository != "auto-completed" or names == ["ac", "no_file"]
    server = start_server(names, repository=repo)
    try:
        control = TritonControl(server.grpc_url, server.http_url, "http")
        for name in names:
            plain = control.config(name)
            marked, why = marked_file_config(repo / name, ME)
            assert marked is not None, why
            server.load_model(name, marked)
            live = control.config(name)
            assert mark_of(live) == ME, name
            assert _without_mark(live) == _without_mark(plain), name
            assert repository != "auto-completed" or (live["max_batch_size"] == 8 and live["input"][0]["name"] == "IN")
    finally:
        server.stop()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.pbtxt").write_text('name: "odd"\nbackend: "python"\nnot_a_field: 3\n')
    config, why = marked_file_config(tmp_path / "odd", ME)
    assert config is None and "not_a_field" in why       # a field this client's ModelConfig lacks: load unmarked
    (tmp_path / "unnamed").mkdir()
    (tmp_path / "unnamed" / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 4\n')
    config, _ = marked_file_config(tmp_path / "unnamed", ME)
    assert config["name"] == "unnamed" and config["max_batch_size"] == 4 and mark_of(config) == ME


def test_serve_marks_the_managed_models_and_an_ensembles_steps_not_the_ensemble(tmp_path):
    """Controller.first_load_configs over the mixed repository: the models it manages (the config's, and the steps
    of an ensemble among them), not the ensemble (never reloaded), not a model it does not manage; none at all
    where the loop would not claim."""
    repo = ROOT / "scripts" / "scenarios" / "repos" / "mixed"
    names = ["bls", "ens", "ens_step", "plain"]

    def configs(**loop):
        cfg = ControllerConfig(server=ServerConfig(http_url="127.0.0.1:1", grpc_url="127.0.0.1:2",
                                                   metrics_url="http://127.0.0.1:3/metrics"),
                               loop=LoopConfig(gpu="simulated", tracing=False, **loop),
                               models={"ens": ModelLimits(p99_target_ms=25.0), "plain": ModelLimits(p99_target_ms=30.0)})
        c = Controller(cfg)
        try:
            c.set_status_url("http://127.0.0.1:4/status")
            return c.first_load_configs(repo, names), c.me
        finally:
            c.close()

    got, me = configs()
    assert sorted(got) == ["ens_step", "plain"]
    assert all(mark_of(c) == me and c["name"] == n for n, c in got.items())
    assert "dynamic_batching" not in got["plain"] and got["ens_step"]["dynamic_batching"] == {}   # as in the files
    assert configs(dry_run=True)[0] == {} and configs(owner_mark=False)[0] == {}
    names = ["ens"]                                       # `serve --models ens`: its step is marked all the same
    assert sorted(configs()[0]) == ["ens_step"]


def test_serve_of_an_ensemble_alone_loads_its_step_once_and_marked(tmp_path):
    """`serve --models ens`: the step, not listed, is loaded first with the mark, so the ensemble's load finds it
    loaded (before, the server loaded it unmarked as a dependency and the controller claimed it with a full reload
    once the load had begun)."""
    repo = ROOT / "scripts" / "scenarios" / "repos" / "mixed"
    marked, why = marked_file_config(repo / "ens_step", ME)
    assert marked is not None, why
    log_path = tmp_path / "server.log"
    server = TritonServer(ServerOptions(repository=repo, http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), models=["ens"], log_path=str(log_path),
                                        extra_args=["--exit-timeout-secs=5"]))
    server.start({"ens_step": marked})
    try:
        control = TritonControl(server.grpc_url, server.http_url, "http")
        assert mark_of(control.config("ens_step")) == ME
        assert mark_of(control.config("ens")) is None                 # the ensemble is never reloaded: not marked
        states = {m["name"]: m.get("state") for m in control.repository_index()}
        assert states["ens"] == states["ens_step"] == "READY", states
        assert "bls" not in states or states["bls"] != "READY"       # nothing else of the repository was loaded
    finally:
        server.stop()
    text = log_path.read_text()
    assert text.count("successfully loaded 'ens_step'") == 1, text   # loaded once, with the override
