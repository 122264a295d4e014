"""serve's restart of a tritonserver that died (server.RestartBudget, server.ServerSupervisor), on a stand-in server
object: the budget's arithmetic, and the supervisor's restart, give-up, failed start and stop. Then a bench arm whose
real server is SIGSEGV'd under traffic (the arm restarts it as serve does). serve's real path (a SIGSEGV'd
tritonserver started again with its live configs) is tests/test_server.py's
test_serve_starts_a_dead_server_again_with_its_live_configs."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from controller.evaluation.arm import ArmSpec, run_arm
from controller.server import RestartBudget, ServerError, ServerSupervisor, exit_words
from controller.types import Settings


@pytest.mark.parametrize("code, words", [
    (-11, "exited with code -11 (SIGSEGV)"), (-6, "exited with code -6 (SIGABRT)"), (1, "exited with code 1"),
    (0, "exited with code 0"), (-99, "exited with code -99"), (None, "exited")])
def test_exit_words_name_the_signal(code, words):
    assert exit_words(code) == words


def test_budget_waits_then_doubles_then_gives_up_within_its_window():
    b = RestartBudget(max_restarts=3, window_s=600, backoff_s=5, max_backoff_s=60)
    waits = []
    for t in (0.0, 100.0, 130.0):
        waits.append(b.next_wait(t))
        b.record(t)
    assert waits == [0.0, 5.0, 10.0]                 # the docstring's example
    assert b.next_wait(200.0) is None                # a fourth within 600 s: given up
    assert b.describe() == "3 restart(s) within 600 s, the most allowed (--max-restarts)"
    assert b.next_wait(650.0) == 10.0                # the first has left the window: 2 recent, so 5 x 2


def test_budget_forgets_restarts_older_than_its_window():
    b = RestartBudget(max_restarts=3, window_s=600)
    assert b.next_wait(0.0) == 0.0
    b.record(0.0)
    assert b.next_wait(700.0) == 0.0 and b.recent == 0


def test_budget_caps_the_wait():
    b = RestartBudget(max_restarts=10, backoff_s=5, max_backoff_s=12)
    for t in range(5):
        b.record(float(t))
    assert b.next_wait(6.0) == 12.0                  # 5 x 2^4 = 80, capped


def test_no_restarts_at_all_with_zero():
    b = RestartBudget(max_restarts=0)
    assert b.next_wait(0.0) is None
    assert b.describe() == "restarts are off (--max-restarts 0)"


class _Proc:
    _pids = iter(range(5000, 6000))

    def __init__(self):
        self.returncode = None
        self.pid = next(self._pids)

    def poll(self):
        return self.returncode


class _Server:
    """What the supervisor uses of a TritonServer: process, keep_log, log_tail, restart."""

    def __init__(self, fail_restarts: int = 0):
        self.process = _Proc()
        self.restarted_with: list = []
        self.fail_restarts = fail_restarts
        self.kept: list[bool] = []

    def die(self, code: int = -11) -> None:
        self.process.returncode = code

    def keep_log(self, repoint: bool = True) -> Path:
        self.kept.append(repoint)
        return Path(f"/tmp/tritonserver-{self.process.pid}.log")

    def log_tail(self) -> str:
        return "Signal (11) received."

    def restart(self, configs=None):
        self.restarted_with.append(configs)
        if self.fail_restarts:
            self.fail_restarts -= 1
            self.process = None
            raise ServerError("HTTP port 127.0.0.1:8000 was taken while tritonserver was down")
        self.process = _Proc()
        return self


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_dead_server_is_started_again_with_the_configs_of_that_moment():
    server, stop, said, told = _Server(), threading.Event(), [], []
    live = {"m": {"name": "m", "instance_group": [{"count": 1}]}}
    sup = ServerSupervisor(server, stop, configs=lambda: dict(live), budget=RestartBudget(3, backoff_s=0.01),
                           say=said.append, on_restart=told.append, poll_s=0.01).start()
    try:
        live["m"] = {"name": "m", "instance_group": [{"count": 2}]}     # what the controller runs when it dies
        first = server.process.pid
        server.die()
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"))
        assert server.restarted_with == [{"m": {"name": "m", "instance_group": [{"count": 2}]}}]
        assert server.kept == [False]                    # a copy; the server goes on writing its own log
        assert said[0].startswith("tritonserver exited with code -11 (SIGSEGV): Signal (11) received. "
                                  f"(full log: /tmp/tritonserver-{first}.log); starting it again (restart 1 of at "
                                  "most 3 within 600 s)"), said
        assert said[1].startswith("tritonserver started again in ") and said[1].endswith(
            "its models loaded with the live configs they had"), said
        rec = sup.restarts[0]
        assert rec["exit"] == "exited with code -11 (SIGSEGV)" and rec["pid"] == server.process.pid != first
        assert told and told[-1] == sup.restarts
        assert not stop.is_set() and not sup.gave_up.is_set()
        server.die(-6)                                   # a second death: after the backoff, again
        _wait_for(lambda: len(sup.restarts) == 2 and sup.restarts[-1].get("ok"))
        assert "restart 2 of at most 3" in said[2] and "(SIGABRT)" in said[2], said
    finally:
        stop.set()


def test_with_no_restarts_left_it_stops_everything_and_says_why():
    server, stop = _Server(), threading.Event()
    sup = ServerSupervisor(server, stop, budget=RestartBudget(0), say=lambda _: None, poll_s=0.01).start()
    server.die()
    assert stop.wait(5)
    assert sup.gave_up.is_set() and server.restarted_with == []
    assert sup.last_words.startswith("tritonserver exited with code -11 (SIGSEGV): Signal (11) received.")
    assert sup.last_words.endswith("; not started again: restarts are off (--max-restarts 0)")


def test_a_start_that_fails_counts_and_is_tried_again_until_the_budget_is_spent():
    server, stop, said = _Server(fail_restarts=5), threading.Event(), []
    sup = ServerSupervisor(server, stop, budget=RestartBudget(2, backoff_s=0.01), say=said.append,
                           poll_s=0.01).start()
    server.die()
    assert stop.wait(5)
    assert len(server.restarted_with) == 2 and [r["ok"] for r in sup.restarts] == [False, False]
    assert sup.restarts[0]["error"] == "HTTP port 127.0.0.1:8000 was taken while tritonserver was down"
    assert said[1].startswith("tritonserver did not start again: HTTP port"), said
    assert sup.last_words == ("tritonserver did not start again: HTTP port 127.0.0.1:8000 was taken while "
                              "tritonserver was down; not started again: 2 restart(s) within 600 s, the most "
                              "allowed (--max-restarts)")


def test_a_stop_during_the_backoff_starts_nothing():
    server, stop = _Server(), threading.Event()
    budget = RestartBudget(3, backoff_s=30)
    budget.record(time.monotonic())                      # one recent restart: the next waits 30 s
    sup = ServerSupervisor(server, stop, budget=budget, say=lambda _: None, poll_s=0.01).start()
    server.die()
    time.sleep(0.2)
    stop.set()
    sup._thread.join(5)
    assert not sup._thread.is_alive() and server.restarted_with == [] and not sup.gave_up.is_set()


def test_the_owner_holding_the_lock_keeps_a_restart_from_starting():
    """serve takes the lock to stop the server: a death seen meanwhile must not start a new one after the stop."""
    server, stop = _Server(), threading.Event()
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=lambda _: None, poll_s=0.01)
    with sup.lock:
        sup.start()
        server.die()
        time.sleep(0.2)                                  # the watch saw the death and waits for the lock
        stop.set()
    sup._thread.join(5)
    assert server.restarted_with == []


def test_a_bench_arm_whose_server_dies_goes_on_with_its_config(tmp_path):
    """A static arm (2 instances, 300 us) under 40 req/s for 10 s, its tritonserver SIGSEGV'd 3 s in by the arm's
    helper: the arm starts it again with the arm's config, the requests after the gap are served, and the restart is
    in the arm's record (the bench reports it)."""
    class Killer:
        def __init__(self, server, t0):
            self.timer = threading.Timer(3.0, lambda: os.kill(server.process.pid, signal.SIGSEGV))
            self.timer.start()

        def stop(self):
            self.timer.cancel()
            return []

    schedule = np.arange(0.0, 10.0, 0.025)
    run = run_arm(ArmSpec("static", ["sim_accel"], {"sim_accel": Settings(2, 300)}, {"sim_accel": schedule},
                          tmp_path, helper=Killer))
    assert len(run.server_restarts) == 1 and run.server_restarts[0]["ok"], run.server_restarts
    assert run.server_restarts[0]["exit"] == "exited with code -11 (SIGSEGV)"
    assert 2.5 < run.server_restarts[0]["t"] < 5.0, run.server_restarts
    assert run.live_at_end["sim_accel"] == Settings(2, 300)
    records = run.records["sim_accel"]
    failed = [r.scheduled_s for r in records if not r.ok]
    assert failed, "the crash cost no request: was the server killed?"
    assert min(failed) > 2.5 and max(failed) < 7.0, (min(failed), max(failed), len(failed))
    assert sum(r.ok for r in records if r.scheduled_s >= 7.0) == sum(schedule >= 7.0)
