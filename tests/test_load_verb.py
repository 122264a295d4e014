"""`python -m controller load`: open-loop traffic to one model of a running server (controller/evaluation/load.py).
Against a real tritonserver: a run's lines and summary, its JSON, a Ctrl-C that waits for the requests in flight,
finding serve's one model from its run-state file, and a one-line error for each bad input. The summary's arithmetic
on made-up records."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from controller.evaluation import load, loadgen
from controller.evaluation.loadgen import ERROR_NOT_SENT, RequestRecord


def _load(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", "load", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _url(server, protocol: str = "grpc") -> str:
    return f"127.0.0.1:{server.options.grpc_port if protocol == 'grpc' else server.options.http_port}"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_run_prints_a_line_per_interval_and_a_summary_that_counts_every_request(sim_server, tmp_path, protocol):
    out = tmp_path / "load.json"
    r = _load("--model", "sim_accel", "--url", _url(sim_server, protocol), "--protocol", protocol, "--rate", "60",
              "--seconds", "3", "--every", "1", "--sla-ms", "1000", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sending ") and f"({protocol})" in lines[0], lines
    ticks = [ln for ln in lines if ln.lstrip().split(" ")[0].replace(".", "").isdigit() and " s  sent " in ln]
    assert len(ticks) == 3, lines                     # at 1, 2 and 3 s
    doc = json.loads(out.read_text())
    n = int(lines[0].split()[1])
    assert doc["requests"] == doc["ok"] == n and doc["failed"] == 0, doc
    assert doc["within_sla"] == n and 0 < doc["p50_ms"] <= doc["p99_ms"] < 1000
    assert sum(int(t.split("sent")[1].split()[0]) for t in ticks) == n   # each request in one line's "sent"
    assert f"sim_accel via {_url(sim_server, protocol)} ({protocol}): {n} requests" in r.stdout
    assert doc["send_lag_p99_ms"] is not None and doc["stopped_at_s"] is None


def test_requests_of_several_items(sim_server):
    r = _load("--model", "sim_accel", "--url", _url(sim_server), "--rate", "20", "--seconds", "1", "--batch-size", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("sending ") and " requests of 4 items to sim_accel" in r.stdout.splitlines()[0]
    assert " 0 failed" in r.stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_sending_waits_for_those_in_flight_and_summarises(sim_server, signum):
    """Ctrl-C, or SIGTERM (a job's timeout, `kill`): no request cancelled (a cancelled gRPC call can crash 2.51)."""
    proc = subprocess.Popen([sys.executable, "-m", "controller", "load", "--model", "sim_accel", "--url",
                             _url(sim_server), "--rate", "50", "--seconds", "60", "--every", "0.5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("sending "), first + proc.stderr.read()
        assert " s  sent " in proc.stdout.readline()      # it sends
        t0 = time.monotonic()
        proc.send_signal(signum)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (rest, err)
    assert time.monotonic() - t0 < 10
    assert "stopping at " in rest and "Traceback" not in err, (rest, err)
    summary = rest[rest.index("sim_accel via "):]
    sent = int(summary.split(": ")[1].split()[0])
    assert 10 < sent < 600 and f"{sent} ok, 0 failed" in summary, summary    # far fewer than 60 s would send


def test_serves_one_model_is_the_default_and_nothing_running_is_one_line(tmp_path):
    from controller import runstate
    env = {**os.environ, "TRITON_AUTOTUNE_RUN_DIR": str(tmp_path)}
    r = _load("--rate", "5", env=env)
    assert r.returncode == 1 and r.stderr.startswith("error: nothing is running") and "--url" in r.stderr, r.stderr
    # a run-state file as serve writes it, for this process (alive), naming two models
    runstate.write({"http_url": "127.0.0.1:9", "grpc_url": "127.0.0.1:9", "models": ["a", "b"]}, folder=tmp_path)
    try:
        r = _load("--rate", "5", env=env)
        assert r.returncode == 2 and f"serve pid {os.getpid()} runs a, b; choose one" in r.stderr, r.stderr
        runstate.write({"http_url": "127.0.0.1:9", "grpc_url": "127.0.0.1:9", "models": ["a"]}, folder=tmp_path)
        r = _load("--rate", "5", env=env)      # serve's one model, at serve's address (nothing listens there)
        assert r.returncode == 1 and r.stderr.startswith("error: Triton at 127.0.0.1:9 (grpc) is not reachable")
    finally:
        runstate.remove(folder=tmp_path)


@pytest.mark.parametrize("argv, rc, piece", [
    (["--model", "nope", "--rate", "5"], 1, "model 'nope' is not ready on 127.0.0.1:{grpc}: "),
    (["--model", "sim_accel"], 2, "give either --rate R"),
    (["--model", "sim_accel", "--rate", "5", "--trace", "x.yaml"], 2, "give either --rate R"),
    (["--model", "sim_accel", "--trace", "/nonexistent.yaml"], 2, "load: trace: "),
    (["--model", "sim_accel", "--rate", "5", "--url", "10.1.2.3:8001"], 2, "refusing to send load to '10.1.2.3'"),
    (["--model", "sim_accel", "--rate", "5", "--url", "garbage"], 2, "expected 'host:port' with an explicit port"),
    (["--model", "sim_accel", "--rate", "5", "--url", "127.0.0.1:9", "--protocol", "http"], 1,
     "Triton at 127.0.0.1:9 (http) is not reachable"),
    (["--model", "sim_accel", "--rate", "0"], 2, "argument --rate: 0 is outside [0.01, 100000]"),
    (["--model", "sim_accel", "--rate", "1000", "--seconds", "3600"], 2, "about 3,600,000 requests: at most 1,000,000"),
    (["--model", "sim_accel", "--rate", "5", "--batch-size", "33"], 2,
     "--batch-size 33: model 'sim_accel' takes at most 32 per request"),
    (["--model", "sim_accel", "--rate", "5", "--pid", "1"], 2, "at most one of --url, --config and --pid"),
    (["--model", "sim_accel", "--rate", "5", "--json", "/proc/x/y.json"], 2, "--json: cannot write"),
])
def test_bad_inputs_are_one_line(sim_server, argv, rc, piece, tmp_path):
    if "--url" not in argv:
        argv = [*argv, "--url", _url(sim_server)]
    r = _load(*argv, "--json", str(tmp_path / "out.json")) if "--json" not in argv else _load(*argv)
    assert r.returncode == rc, (r.stdout, r.stderr)
    assert not (tmp_path / "out.json").exists()                # no empty summary left behind
    assert piece.format(grpc=sim_server.options.grpc_port) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_stopped_run_records_what_was_never_sent_as_such(sim_server):
    """loadgen's `stop`: the requests not yet due are ERROR_NOT_SENT, every one sent comes back."""
    schedule = np.arange(0.0, 20.0, 0.02)
    arrays = {"INPUT": np.ones((1, 16), np.float32)}
    seen: list[RequestRecord] = []

    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.0, stop.set)
        return await loadgen.run_open_loop(_url(sim_server), "sim_accel", schedule, lambda: arrays, stop=stop,
                                           on_record=seen.append)

    t0 = time.monotonic()
    records = asyncio.run(main())
    assert time.monotonic() - t0 < 5
    sent = [r for r in records if r.error != ERROR_NOT_SENT]
    assert 30 < len(sent) < 70 and all(r.ok for r in sent), len(sent)
    assert all(r.sent_s is None and r.scheduled_s > 0.9 for r in records if r.error == ERROR_NOT_SENT)
    assert len(seen) == len(records)                    # each record reported once, as it became final


def _rec(scheduled: float, latency_ms: float | None, error: str | None = None) -> RequestRecord:
    if error:
        return RequestRecord(scheduled, None if error == ERROR_NOT_SENT else scheduled, None, False, error)
    return RequestRecord(scheduled, scheduled + 0.001, scheduled + latency_ms / 1e3, True, None)


def test_the_summary_counts_phases_failures_and_leaves_out_what_was_never_sent():
    trace = loadgen.load_trace({"phases": [{"name": "low", "duration_s": 2, "rate_rps": 5},
                                           {"name": "high", "duration_s": 2, "rate_rps": 5}]})
    records = [_rec(0.1 * i, 10.0 + i) for i in range(20)]                 # 0.0-1.9 s: 10..29 ms
    records += [_rec(2.5, None, "timeout"), _rec(2.6, None, "timeout"), _rec(2.7, 50.0)]
    records += [_rec(3.5, None, ERROR_NOT_SENT)] * 4                       # stopped at 3.0 s
    doc = load.summarize(records, trace, 3.0, sla_ms=25.0)
    assert (doc["requests"], doc["ok"], doc["failed"]) == (23, 21, 2)
    assert doc["errors"] == {"timeout": 2} and doc["within_sla"] == 16 and doc["seconds"] == 3.0
    assert doc["sent_rps"] == pytest.approx(23 / 3.0)
    low, high = doc["phases"]
    assert (low["requests"], high["requests"], high["failed"]) == (20, 3, 2)
    assert high["sent_rps"] == pytest.approx(3 / 1.0)                      # over the 1 s of it that ran
    assert low["p50_ms"] == pytest.approx(19.5) and high["p99_ms"] == pytest.approx(50.0)
    text = load.format_summary(doc, "m", "127.0.0.1:1 (grpc)", 25.0)
    assert "23 requests in 3.0 s (7.7/s): 21 ok, 2 failed" in text and "failed: 2 x timeout" in text
    assert "within 25 ms: 16 (69.6% of those sent)" in text and "high" in text


def test_a_lagging_client_is_named_in_the_summary():
    trace = loadgen.load_trace({"phases": [{"name": "p", "duration_s": 1, "rate_rps": 5}]})
    late = [RequestRecord(0.1 * i, 0.1 * i + 0.02, 0.1 * i + 0.03, True, None) for i in range(10)]   # 20 ms late
    text = load.format_summary(load.summarize(late, trace, 1.0, None), "m", "x", None)
    assert "fell up to 20.0 ms (p99) behind schedule (counted in the latencies above); that is a large part" in text
    # 20 ms late of a 200-ms p99: named, not blamed
    slow = [RequestRecord(0.1 * i, 0.1 * i + 0.02, 0.1 * i + 0.2, True, None) for i in range(10)]
    text = load.format_summary(load.summarize(slow, trace, 1.0, None), "m", "x", None)
    assert "fell up to 20.0 ms" in text and "large part" not in text, text
    on_time = [_rec(0.1 * i, 5.0) for i in range(10)]
    text = load.format_summary(load.summarize(on_time, trace, 1.0, None), "m", "x", None)
    assert "fell up to 1.0 ms (p99) behind schedule" in text and "large part" not in text, text


@pytest.mark.parametrize("config, piece", [
    ({"model_transaction_policy": {"decoupled": True}}, "is decoupled"),
    ({"model_transaction_policy": {"decoupled": "true"}}, "is decoupled"),
    ({"model_transaction_policy": {"decoupled": "false"}}, None),
    ({"sequence_batching": {"control_input": [{"name": "START"}]}}, "is stateful (a sequence batcher)"),
    ({"sequence_batching": {"max_sequence_idle_microseconds": "1000"}}, "is stateful"),
    ({"model_transaction_policy": {"decoupled": False}, "dynamic_batching": {}}, None),
    ({}, None),
])
def test_models_that_one_response_requests_cannot_load_are_named(config, piece):
    why = load.unsupported(config)
    assert (why is None) if piece is None else piece in why


def test_a_line_counts_what_came_back_in_its_interval():
    live = load.Live(np.array([0.1, 0.2, 0.3, 1.2, 1.4]), None)
    for r in (_rec(0.1, 10.0), _rec(0.2, 30.0), RequestRecord(0.3, 0.3, 0.35, False, "boom")):
        live.add(r)
    first = live.line(1.0)
    assert "sent      3 (    3.0/s)  ok     2.0/s  failed    0" not in first
    assert "sent      3" in first and "failed    1" in first and "in flight 0" in first, first
    live.add(_rec(1.2, 10.0))
    second = live.line(2.0)
    assert "sent      2" in second and "ok     1.0/s" in second and "in flight 1" in second, second
    assert live.line(3.0).endswith("(no answers)  in flight 1")


def test_the_servers_address_from_a_controller_config(sim_server, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"server:\n  grpc_url: {_url(sim_server)}\n  http_url: {_url(sim_server, 'http')}\n")
    for protocol in ("grpc", "http"):
        r = _load("--model", "sim_accel", "--config", str(cfg), "--protocol", protocol, "--rate", "20",
                  "--seconds", "1")
        assert r.returncode == 0 and f"via {_url(sim_server, protocol)} ({protocol})" in r.stdout, r.stdout + r.stderr
    cfg.write_text("server: [")
    r = _load("--model", "sim_accel", "--config", str(cfg), "--rate", "20")
    assert r.returncode == 2 and r.stderr.startswith("config error: "), r.stderr
