"""A version folder dropped into the repository while the controller runs: a reload re-reads the repository, so
under the default version policy the controller's next instance change would deploy it (measured on 2.51: version
2 READY, version 1 UNLOADING). The controller holds instead (HoldVersionsMoved) and resumes once the operator has
loaded the model as they want it. Against a real tritonserver."""
from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from conftest import open_loop, running_controller, sim_copy, start_server
from controller.actuation import TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.server import version_change


def test_version_change_reads_the_policy_against_the_versions_that_serve(tmp_path):
    m = tmp_path / "m"
    for v in ("1", "2", "3"):
        (m / v).mkdir(parents=True)
    (m / "notes").mkdir()
    assert version_change(m, {"version_policy": {"latest": {"num_versions": 1}}}, {3}) == ([], [])
    assert version_change(m, {}, {1}) == ([3], [1])                      # the default: the newest only
    assert version_change(m, {"version_policy": {"latest": {"num_versions": 2}}}, {2, 3}) == ([], [])
    assert version_change(m, {"version_policy": {"all": {}}}, {1, 2}) == ([3], [])
    assert version_change(m, {"version_policy": {"specific": {"versions": ["1"]}}}, {1}) == ([], [])   # pinned
    shutil.rmtree(m / "1")
    assert version_change(m, {"version_policy": {"specific": {"versions": ["1"]}}}, {1}) == ([], [1])
    assert version_change(tmp_path / "absent", {}, {1}) == ([], [])


def _index(server) -> list[tuple[str, str, str]]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return sorted((e["name"], e.get("version", ""), e.get("state", "")) for e in json.load(r))


@pytest.mark.slow
def test_a_new_version_folder_holds_the_reloads_until_the_operator_loads_it(tmp_path):
    repo = tmp_path / "repo"
    sim_copy(repo, "m", {})
    server = start_server(["m"], repository=repo)
    log_path = tmp_path / "decisions.jsonl"
    cfg = ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url,
                            repository=str(repo)),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, decision_log=str(log_path),
                        gpu="simulated", owner_mark=False),
        models={"m": ModelLimits(p99_target_ms=15.0, max_instances=4, scale_up_cooldown_s=1.0,
                                 scale_down_delay_s=60.0, max_delay_us=0)})
    try:
        shutil.copytree(repo / "m" / "1", repo / "m" / "2")       # the operator drops a new version in
        with running_controller(cfg) as controller:
            held = open_loop(server, "m", rate_rps=220, seconds=10, seed=3)        # enough to want a second instance
            records = [json.loads(line) for line in log_path.read_text().splitlines()]
            holds = [r for r in records if r["reason"] == "HoldVersionsMoved"]
            assert holds, [(r["action"], r["reason"]) for r in records]
            assert "version(s) 1 serve, and a reload now would load version(s) 2 of the repository and would unload " \
                   "version(s) 1" in holds[0]["detail"] and holds[0]["detail"].startswith("wanted ScaleUp"), holds[0]
            assert not [r for r in records if r["action"] in ("started", "applied")]
            assert ("m", "1", "READY") in _index(server) and ("m", "2", "READY") not in _index(server)
            assert controller.models["m"].current.instance_count == 1
            assert held and all(r.ok for r in held)
            # the operator loads it (from the file: the newest version): the controller goes on, on version 2
            TritonControl(server.grpc_url, server.http_url).load("m")
            assert ("m", "2", "READY") in _index(server)
            after = open_loop(server, "m", rate_rps=220, seconds=10, seed=3)
            records = [json.loads(line) for line in log_path.read_text().splitlines()]
            ups = [r for r in records if r["action"] == "applied" and r["reason"].startswith("ScaleUp")]
            assert ups, [(r["action"], r["reason"], r.get("detail", "")[:120]) for r in records][-10:]
            assert controller.models["m"].current.instance_count >= 2
            assert [e for e in _index(server) if e[2] == "READY"] == [("m", "2", "READY")]
            assert after and all(r.ok for r in after)
    finally:
        server.stop()
