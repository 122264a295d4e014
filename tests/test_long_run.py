"""Issue 13, item 5, short CI version of scripts/long_run.py: `serve` for two minutes under a load alternating
low/high every 20 s (the controller scales up and down), sampled every 3 s; after a 30-s warm-up neither the controller
nor the server grows past a bound in RSS, open fds or threads, and no request fails."""
from __future__ import annotations

import json
import warnings

import pytest
from conftest import load_script

long_run = load_script("long_run")


def test_check_growth_flags_only_what_grew_past_its_bound():
    s = lambda t, rss, fds, th: {"t_s": t, "controller": {"rss_mb": rss, "fds": fds, "threads": th},  # noqa: E731
                                 "server": {"rss_mb": 100, "fds": 50, "threads": 40}}
    flat = [s(0, 10, 5, 5), s(40, 80, 9, 9), s(80, 85, 9, 9)]
    assert long_run.check_growth(flat, 30, rss_mb=20, fds=5, threads=5) == []
    grew = [s(40, 80, 9, 9), s(80, 120, 30, 9)]
    assert long_run.check_growth(grew, 30, rss_mb=20, fds=5, threads=5) == [
        "controller rss_mb: 80 -> 120 (bound +20)", "controller fds: 9 -> 30 (bound +5)"]
    assert long_run.check_growth(flat[:1], 30, 1, 1, 1) == ["only 0 samples after the warm-up"]


def test_the_server_is_compared_at_the_same_instance_count():
    def s(t, n, threads, rss=60.0):
        return {"t_s": t, "controller": {"rss_mb": 90, "fds": 9, "threads": 10},
                "server": {"rss_mb": rss, "fds": 60 + n, "threads": threads}, "stubs": {"count": n}}
    varying = [s(t, n, 28 + 35 * n) for t, n in ((0, 1), (30, 1), (60, 6), (90, 6), (120, 2), (150, 2), (180, 8),
                                                  (210, 8), (240, 6), (270, 6), (300, 2), (330, 2))]
    assert long_run.check_growth(varying, 30, rss_mb=20, fds=5, threads=5) == []     # more instances, not a leak
    starting = varying + [{**s(340, 6, 203), "steady": False}]      # a stub up before its instance's threads
    assert long_run.check_growth(starting, 30, rss_mb=20, fds=5, threads=5) == []
    # the CI case: the first sample after 1 -> 2 read one instance's threads and was steady over its recheck
    scaled_up = [s(0, 1, 63), s(30, 1, 63), s(33, 1, 63), s(36, 2, 66), s(39, 2, 98), s(42, 2, 99)]
    assert long_run.check_growth(scaled_up, 30, rss_mb=20, fds=5, threads=5) == []
    leaking = varying + [s(360, 2, 98, rss=95.0)]
    assert long_run.check_growth(leaking, 30, rss_mb=20, fds=5, threads=5) == [
        "server rss_mb at 2 instance(s): 60.0 -> 95.0 (bound +20)"]
    threads_leaking = scaled_up + [s(45, 2, 120)]
    assert long_run.check_growth(threads_leaking, 30, rss_mb=20, fds=5, threads=5) == [
        "server threads at 2 instance(s): 98 -> 120 (bound +5)"]


def _report(doc: dict) -> str:
    return (f"{len(doc['samples'])} samples, serve exited {doc['serve_exit']}; serve's last lines:\n{doc['serve_tail']}"
            "\nthe controller's last records:\n" + "\n".join(json.dumps(r) for r in doc["last_decisions"]))


def test_two_minutes_of_serve_under_varying_load_stay_flat():
    # why 20-s phases: under a load that flips every 8 s the planner rightly keeps the instances of the high phase
    # (its forecast's band spans both rates), so an 8-s test passed only on delay-change churn. Why a 28-ms
    # target: under 25 ms the consolidation to one instance passed at 18.3-20.0 ms against its 20 ms (0.8 x 25),
    # in the low phase's second half (one instance is predicted at the forecast's high end after the step down,
    # 25-30 req/s, whether the low rate is 20 or 10): a machine a tenth slower would not scale down. Under 28 ms
    # it came ~11 s into each low phase (2 runs); one instance at 200 req/s is predicted at 30-34 ms, over 0.9 x 28
    run = lambda: long_run.long_run(minutes=2.0, every_s=3.0, phase_s=20.0, low_rps=20.0, high_rps=200.0,  # noqa: E731
                                    target_ms=28.0, log=lambda _: None)
    doc = run()
    if "tritonserver exited with code" in doc["serve_tail"]:
        # tritonserver itself aborted (CI of stop 33: a std::length_error ~90 s in, not reproduced in 3 more runs
        # nor under a stress of trace-setting changes and reloads; README, "Server failures seen in the benches"):
        # nothing about growth can be judged from that run, whether serve stopped or started it again (its
        # requests in flight failed). Once more on a fresh serve; a second death fails.
        warnings.warn("tritonserver died under the long run; running it again\n" + _report(doc))
        doc = run()
    samples = doc["samples"]
    if len(samples) < 15 or doc["serve_exit"] != 0:
        # in full, not through an assert's repr (cut to a few hundred characters): a server's backtrace is the point
        pytest.fail(_report(doc), pytrace=False)
    assert doc["requests"] > 2000 and doc["failed_requests"] == 0, doc["errors"]
    assert max(s["stubs"]["count"] for s in samples) >= 2              # the controller did add instances ...
    assert doc["reloads_applied"] >= 2 and doc["reloads_failed"] == 0, doc["applied_reasons"]
    reasons = doc["applied_reasons"]                                   # ... and removed them again
    assert any(r.startswith("ScaleUp") for r in reasons) and any(r.startswith("ScaleDown") for r in reasons), reasons
    growth = long_run.check_growth(samples, warmup_s=30.0, rss_mb=40, fds=15, threads=10)
    assert not growth, (growth, [(s["t_s"], s["controller"], s["server"]) for s in samples])
