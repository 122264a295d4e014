"""The reload soak (`python -m controller soak`): a short one runs here; N=100 is in the README."""
from __future__ import annotations

import json

import pytest

from conftest import start_server
from controller.actuation import Actuator, TritonControl
from controller.cli import main
from controller.evaluation.soak import CounterTracker, _targets
from controller.types import Settings

MODEL = "sim_accel"


def test_counter_tracker_counts_across_resets_and_gaps():
    t = CounterTracker()
    for v in (5, 7, None, 2, 4, 4):
        t.update(v)
    assert t.total == 6 and t.resets == 1 and t.missed == 1


def test_reloads_alternate_in_place_and_full():
    base, current, seen = Settings(1, 0), Settings(1, 0), []
    for i in range(6):
        kind, current = _targets(base, i, current)
        seen.append((kind, current.instance_count, current.max_queue_delay_us))
    assert seen == [("in_place", 2, 0), ("full_reload", 2, 500), ("in_place", 1, 500),
                    ("full_reload", 1, 0), ("in_place", 2, 0), ("full_reload", 2, 500)]


def test_short_soak_loses_no_request(tmp_path, capsys):
    rc = main(["soak", "--reloads", "6", "--out", str(tmp_path), "--rate-rps", "60", "--gap-s", "0.3"])
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, out
    assert "6 reloads" in out and "0 failed" in out
    assert doc["reloads"] == 6 and doc["reloads_ok"] == 6
    assert doc["kinds"] == {"in_place": 3, "full_reload": 3}
    assert [r["kind"] for r in doc["reload_log"]] == ["in_place", "full_reload"] * 3
    # the load ran through the whole soak, and nothing was lost on either side
    assert doc["requests"] >= 60 * doc["elapsed_s"] * 0.6, doc["requests"]
    assert doc["failed_requests"] == 0 and doc["client_errors"] == {}
    assert set(doc["protocols"]) == {"grpc", "http"}                  # both kinds of client at once, by default
    for p, v in doc["protocols"].items():
        assert v["requests"] > 0 and v["failed_requests"] == 0 and v["rate_rps"] == 30.0, (p, v)
    assert sum(v["requests"] for v in doc["protocols"].values()) == doc["requests"]
    assert "grpc 0 of" in out and "http 0 of" in out
    assert doc["server_failures"] == 0
    assert doc["server_successes"] == doc["requests"]        # the server counted every request we sent
    assert doc["server_scrapes_missed"] == 0
    # an in-place update keeps the model object (its stats carry on); a full reload replaces it
    assert not any(r["stats_restarted"] for r in doc["reload_log"] if r["kind"] == "in_place")
    assert any(r["stats_restarted"] for r in doc["reload_log"] if r["kind"] == "full_reload")
    for kind in ("in_place", "full_reload"):
        d = doc["durations_s"][kind]
        assert d["n"] == 3 and 0 < d["mean"] <= d["max"] < 60
    assert doc["latency_ms"]["p99"] is not None


@pytest.fixture(scope="module")
def guarded_server():
    s = start_server([MODEL], restricted_key=("admin-key", "soak-test-key"))
    yield s
    s.stop()


def test_soak_against_a_running_server_restores_its_config(guarded_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_ADMIN_KEY", "soak-test-key")
    rc = main(["soak", "--reloads", "3", "--url", guarded_server.http_url, "--grpc-url", guarded_server.grpc_url,
               "--metrics-url", guarded_server.metrics_url, "--auth-header", "admin-key", "--out", str(tmp_path),
               "--rate-rps", "40", "--gap-s", "0.2"])
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, capsys.readouterr()
    assert doc["reloads_ok"] == 3 and doc["failed_requests"] == 0 and doc["server_failures"] == 0
    assert doc["restored"] is True
    assert Actuator(TritonControl(guarded_server.grpc_url, guarded_server.http_url)).read(MODEL)[1] == Settings(1, 0)


def test_soak_without_the_key_is_refused_by_the_server(guarded_server, tmp_path, capsys):
    rc = main(["soak", "--reloads", "2", "--url", guarded_server.http_url, "--grpc-url", guarded_server.grpc_url,
               "--metrics-url", guarded_server.metrics_url, "--out", str(tmp_path),
               "--rate-rps", "20", "--gap-s", "0"])
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 1
    assert doc["reloads_failed"] == 2 and all("restricted" in r["error"] for r in doc["reload_log"])
    assert doc["failed_requests"] == 0                     # inference stays open; only the reloads are refused


def test_protocols_flag_is_checked():
    from controller.cli import _protocols
    assert _protocols("http") == ("http",) and _protocols("grpc,http,grpc") == ("grpc", "http")
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        _protocols("grpc,websocket")
