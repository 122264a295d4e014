"""serve's restart of a tritonserver that died (server.RestartBudget, server.ServerSupervisor), on a stand-in server
object: the budget's arithmetic, and the supervisor's restart, give-up, failed start and stop. Then a bench arm whose
real server is SIGSEGV'd under traffic (the arm restarts it as serve does). serve's real path (a SIGSEGV'd
tritonserver started again with its live configs) is tests/test_server.py's
test_serve_starts_a_dead_server_again_with_its_live_configs."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from controller.evaluation.arm import ArmSpec, run_arm
from controller.server import RestartBudget, ServerError, ServerSupervisor, exit_words
from controller.types import Settings
from conftest import ROOT, process_alive, sim_copy, start_server


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
    """What the supervisor uses of a TritonServer: process, keep_log, log_tail, live_models, restart. `running`: what
    live_models answers (None: the read fails, as it does on a server that does not answer)."""

    def __init__(self, fail_restarts: int = 0, running: dict | None = None, not_loaded: list | None = None):
        self.process = _Proc()
        self.log_path: Path | None = None          # no log to read (the wedge test gives one)
        self.log_offset = 0
        self.restarted_with: list = []
        self.loaded_names: list = []
        self.fail_restarts = fail_restarts
        self.kept: list[bool] = []
        self.running = running
        self.reads: list[bool] = []         # each live_models call: True where it read every config
        self.not_loaded = not_loaded or []
        self.in_restart = threading.Event()
        self.hold: threading.Event | None = None      # set: a restart waits until cancelled (a slow start)
        self.stuck: threading.Event | None = None     # set: a restart waits until kill_group (a load that hangs)
        self.killed = False

    def die(self, code: int = -11) -> None:
        self.process.returncode = code

    def keep_log(self, repoint: bool = True) -> Path:
        self.kept.append(repoint)
        return Path(f"/tmp/tritonserver-{self.process.pid}.log")

    def log_tail(self) -> str:
        return "Signal (11) received."

    def live_models(self, known=None):
        """As TritonServer.live_models: a model `known` holds a config for keeps it (its config not read)."""
        if self.running is None:
            raise ServerError("cannot read the repository index: connection refused")
        self.reads.append(known is None)
        return {n: known[n] if known and known.get(n) is not None else c for n, c in self.running.items()}

    def kill_group(self):
        self.killed = True
        if self.stuck is not None:
            self.stuck.set()

    def restart(self, configs=None, names=None, cancel=None):
        self.restarted_with.append(configs)
        self.loaded_names.append(names)
        self.in_restart.set()
        if self.stuck is not None:
            assert self.stuck.wait(10), "never killed"
            self.process = None
            raise ServerError("model 'm' failed to load: tritonserver exited with code -9 (SIGKILL) while loading it")
        if self.hold is not None:
            while not cancel.wait(0.01):
                pass
            self.process = None
            raise ServerError("stopped while tritonserver was starting")
        if self.fail_restarts:
            self.fail_restarts -= 1
            self.process = None
            raise ServerError("HTTP port 127.0.0.1:8000 was taken while tritonserver was down")
        self.process = _Proc()
        return list(self.not_loaded)


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


def test_a_restart_loads_what_ran_with_the_live_configs_read_last():
    """The snapshot: a model serve loaded and one an operator loaded by hand, each with its live config (the
    controller's fresher one where it has one), an ensemble from its file; not a model the controller still holds
    a config for that is no longer loaded, nor one whose read failed this time and never succeeded."""
    ens = {"name": "ens", "platform": "ensemble"}
    server = _Server(running={"m": {"name": "m", "count": 1}, "hand": {"name": "hand", "count": 3}, "ens": ens})
    stop, said = threading.Event(), []
    fresher = {"m": {"name": "m", "count": 2}, "gone": {"name": "gone", "count": 1}}
    sup = ServerSupervisor(server, stop, configs=lambda: fresher, budget=RestartBudget(3, backoff_s=0.01),
                           say=said.append, poll_s=0.01, snapshot_s=0.01).start()
    try:
        _wait_for(lambda: sup.running is not None)
        server.die()
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"))
        assert server.loaded_names == [["m", "hand", "ens"]]
        assert server.restarted_with == [{"m": {"name": "m", "count": 2}, "hand": {"name": "hand", "count": 3}}]
        assert said[1].endswith("same ports; 3 model(s) loaded with the live configs they had"), said
    finally:
        stop.set()


def test_a_snapshot_keeps_the_last_config_read_and_drops_a_model_no_longer_running():
    server = _Server(running={"m": {"count": 2}, "hand": {"count": 1}})
    sup = ServerSupervisor(server, threading.Event())
    sup.snapshot()
    server.running = {"m": None}                   # m's config read failed; hand was unloaded by an operator
    sup.snapshot()
    assert sup.running == {"m": {"count": 2}}
    server.running = None                          # the index read fails: the whole last snapshot stands
    sup.snapshot()
    assert sup.running == {"m": {"count": 2}}
    assert sup._what_ran() == (["m"], {"m": {"count": 2}})


def test_which_models_run_is_read_every_snapshot_s_and_their_configs_every_configs_every_s():
    """The index often (a model loaded by hand shortly before a crash is not missed), each config less often (one
    read per model); a model new in the index gets its config read at once."""
    clock = [0.0]
    server = _Server(running={"m": {"count": 1}})
    sup = ServerSupervisor(server, threading.Event(), snapshot_s=1.0, configs_every_s=5.0, clock=lambda: clock[0])
    sup.snapshot()
    server.running = {"m": {"count": 3}, "hand": {"count": 2}}     # m changed by hand; hand loaded by hand
    sup.snapshot(configs=False)
    assert sup.running == {"m": {"count": 1}, "hand": {"count": 2}}
    sup.snapshot()
    assert sup.running == {"m": {"count": 3}, "hand": {"count": 2}}
    server.reads.clear()
    stop = threading.Event()
    sup = ServerSupervisor(server, stop, poll_s=0.01, snapshot_s=1.0, configs_every_s=5.0, clock=lambda: clock[0])
    sup.start()
    try:
        for _ in range(12):             # 12 s of the watch's clock, a snapshot due each second
            _wait_for(lambda: len(server.reads) > clock[0])
            clock[0] += 1.0
        assert server.reads[:12] == [True, False, False, False, False, True, False, False, False, False, True, False]
    finally:
        stop.set()
        sup._thread.join(5)


def test_a_real_index_read_keeps_the_configs_it_knows_and_reads_a_new_one(server):
    running = server.live_models()
    assert {"sim_accel", "resnet_tiny"} <= set(running) and running["sim_accel"]["name"] == "sim_accel"
    known = {"sim_accel": {"name": "sim_accel", "mark": 1}, "gone": {"name": "gone"}}
    again = server.live_models(known=known)
    assert again["sim_accel"] == {"name": "sim_accel", "mark": 1} and "gone" not in again
    assert again["resnet_tiny"] == running["resnet_tiny"]


def test_without_a_snapshot_it_loads_what_start_loaded():
    server, stop = _Server(running=None), threading.Event()
    sup = ServerSupervisor(server, stop, configs=lambda: {"m": {"count": 2}}, budget=RestartBudget(3),
                           say=lambda _: None, poll_s=0.01).start()
    try:
        server.die()
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"))
        assert server.loaded_names == [None] and server.restarted_with == [{"m": {"count": 2}}]
    finally:
        stop.set()


def test_a_model_that_fails_to_load_again_is_left_out_and_named():
    server = _Server(running={"m": {"count": 1}, "b": {"count": 1}},
                     not_loaded=["model 'b' failed to load: no file 1/model.py"])
    stop, said, told = threading.Event(), [], []
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=said.append, on_restart=told.append,
                           poll_s=0.01).start()
    try:
        _wait_for(lambda: sup.running is not None)
        server.die()
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"))
        _wait_for(lambda: len(said) == 2)
        assert sup.restarts[0]["not_loaded"] == ["model 'b' failed to load: no file 1/model.py"]
        assert said[1].endswith("1 model(s) loaded with the live configs they had; not loaded: model 'b' failed to "
                                "load: no file 1/model.py"), said
        assert not stop.is_set() and told[-1][0]["not_loaded"]
    finally:
        stop.set()


def test_a_stop_during_a_restart_ends_it_at_once_and_is_no_failure():
    """serve's Ctrl-C while the server starts again: the restart ends at its next step rather than after the
    start-up (up to 120 s), and it is not counted as a start that failed."""
    server, stop = _Server(running={"m": {"count": 1}}), threading.Event()
    server.hold = threading.Event()
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=lambda _: None, poll_s=0.01).start()
    server.die()
    assert server.in_restart.wait(5)
    t0 = time.monotonic()
    stop.set()
    with sup.lock:                                   # what serve's stop does next
        assert time.monotonic() - t0 < 2
    sup._thread.join(5)
    assert not sup._thread.is_alive() and sup._failed is None and not sup.gave_up.is_set()
    assert sup.restarts[0]["error"] == "stopped while tritonserver was starting"


def test_a_restart_stuck_in_a_load_is_ended_by_killing_its_server():
    """A restart whose model load does not answer (so it never reaches its next step): the owner's `ended` waits
    `wait_s`, kills the server's process group (which ends the load), and then holds the lock."""
    server, stop, said = _Server(running={"m": {"count": 1}}), threading.Event(), []
    server.stuck = threading.Event()
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=said.append, poll_s=0.01).start()
    server.die()
    assert server.in_restart.wait(5)
    t0 = time.monotonic()
    with sup.ended(wait_s=0.3):
        assert server.killed and stop.is_set()
        assert 0.3 <= time.monotonic() - t0 < 3
    assert said[-1] == "a restart of tritonserver still under way after 0 s; stopping it", said
    sup._thread.join(5)
    assert not sup._thread.is_alive() and sup._failed is None
    assert sup.restarts[0]["error"].endswith("(SIGKILL) while loading it")


def test_a_server_whose_crash_handler_hangs_is_killed_and_started_again(tmp_path):
    """The handler's "Signal (6) received." in the running process's lines, the process still alive: killed
    `wedged_after_s` later and restarted, its death named as such. The same line left by an earlier process (before
    `log_offset`), or not yet ended by a newline, kills nothing; the new process's lines are read from its own
    offset."""
    log_file = tmp_path / "tritonserver.log"
    log_file.write_bytes(b"I1206 starting\nSignal (11) received.\n")       # an earlier process's crash
    server, stop, said = _Server(), threading.Event(), []
    server.log_path, server.log_offset = log_file, log_file.stat().st_size
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3, backoff_s=0.01), say=said.append, poll_s=0.01,
                           wedged_after_s=0.2).start()
    try:
        time.sleep(0.3)
        assert not server.killed and sup.fatal_signal() is None
        with open(log_file, "ab") as f:
            f.write(b"corrupted double-linked list (not small)\nSignal (6) rec")     # half a line so far
            f.flush()
            time.sleep(0.3)
            assert not server.killed
            f.write(b"eived.\n")
        t0 = time.monotonic()
        _wait_for(lambda: server.killed)
        assert 0.15 <= time.monotonic() - t0 < 3
        assert not sup.restarts                           # killed: the death comes when the process ends
        first = server.process.pid
        server.die(-9)                                    # what SIGKILL does to the real one
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"))
        assert sup.restarts[0]["exit"] == ("received signal 6 (SIGABRT) and was still running 0.2 s later "
                                           "(its crash handler hangs; killed)"), sup.restarts
        assert said[0].startswith("tritonserver received signal 6 (SIGABRT) and was still running"), said
        # the new process: its lines begin after what is there now, so the old line does not kill it
        server.killed = False
        server.log_offset = log_file.stat().st_size
        time.sleep(0.4)
        assert server.process.pid != first and not server.killed and sup.fatal_signal() is None
        server.die(-11)                                   # a plain death after it keeps its plain words
        _wait_for(lambda: len(sup.restarts) == 2 and sup.restarts[-1].get("ok"))
        assert sup.restarts[1]["exit"] == "exited with code -11 (SIGSEGV)"
    finally:
        stop.set()


def test_a_real_wedged_tritonserver_is_killed_and_started_again(tmp_path):
    """A real tritonserver stopped (SIGSTOP: alive, answering nothing, as the hung handler left one) with its
    handler's line appended to its log: the supervisor kills it and starts it again, and the model serves."""
    server = start_server(["sim_accel"], log_path=str(tmp_path / "tritonserver.log"))
    stop, said, sup = threading.Event(), [], None
    try:
        sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=said.append, poll_s=0.05,
                               wedged_after_s=1.0).start()
        _wait_for(lambda: sup.running is not None)
        pid = server.process.pid
        os.kill(pid, signal.SIGSTOP)
        with open(server.log_path, "ab") as f:
            f.write(b"corrupted double-linked list (not small)\nSignal (6) received.\n")
        _wait_for(lambda: len(said) >= 2, timeout_s=90)
        rec = sup.restarts[0]
        assert rec["ok"] and rec["pid"] != pid, rec
        assert rec["exit"].startswith("received signal 6 (SIGABRT) and was still running 1 s later"), rec
        assert "corrupted double-linked list (not small) | Signal (6) received." in said[0], said
        assert not process_alive(pid)
        _serves_and_stays(server, sup, 1.5)               # the old line is the old process's: no second kill
    finally:
        _end(server, sup, stop)


def _serves_and_stays(server, sup, wait_s: float) -> None:
    """sim_accel answers an inference on the restarted server, which is still the one restart `wait_s` later."""
    status, _ = server._http("POST", "/v2/models/sim_accel/infer", {"inputs": [
        {"name": "INPUT", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]})
    assert status == 200
    time.sleep(wait_s)
    assert len(sup.restarts) == 1 and server.process.poll() is None


def _end(server, sup, stop) -> None:
    stop.set()
    if sup is not None:
        sup._thread.join(30)
    server.stop()


def test_ended_takes_the_lock_at_once_without_a_restart():
    server, stop = _Server(), threading.Event()
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=lambda _: None, poll_s=0.01).start()
    with sup.ended(wait_s=5):
        assert stop.is_set() and sup.lock.locked() and not server.killed
    assert not sup.lock.locked()


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


def test_a_real_restart_loads_a_model_loaded_by_hand_and_leaves_out_one_that_no_longer_loads(tmp_path):
    """A real tritonserver started with one model; an operator loads two more by hand, one with 2 instances. Its
    SIGSEGV: the supervisor's snapshot has all three, the restart loads the first two with their live configs and
    leaves out the third, whose model file was removed meanwhile (named in the record); the server serves on. Then
    a restart with its stop already set ends during the start-up wait."""
    for name in ("sim_b", "sim_c"):
        sim_copy(tmp_path, name, {})
    shutil.copytree(ROOT / "model_repository" / "sim_accel", tmp_path / "sim_accel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    server = start_server(["sim_accel"], repository=tmp_path)
    stop, said, sup = threading.Event(), [], None
    try:
        server.load_model("sim_c")                           # by hand, as an operator would
        server.load_model("sim_b")
        _, cfg = server._http("GET", "/v2/models/sim_b/config")
        cfg["instance_group"][0]["count"] = 2
        server.load_model("sim_b", cfg)
        running = server.live_models()
        assert set(running) == {"sim_accel", "sim_b", "sim_c"}
        assert running["sim_b"]["instance_group"][0]["count"] == 2
        sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=said.append, poll_s=0.05).start()
        _wait_for(lambda: sup.running is not None and len(sup.running) == 3)
        (tmp_path / "sim_c" / "1" / "model.py").unlink()
        os.kill(server.process.pid, signal.SIGSEGV)
        _wait_for(lambda: len(said) >= 2, timeout_s=90)
        assert len(said) == 2, said
        rec = sup.restarts[0]
        assert rec["ok"], rec
        assert len(rec["not_loaded"]) == 1 and rec["not_loaded"][0].startswith("model 'sim_c' failed to load"), rec
        assert "2 model(s) loaded with the live configs they had; not loaded: model 'sim_c'" in said[1], said
        _wait_for(lambda: set(sup.running) == {"sim_accel", "sim_b"})      # the next snapshot: what runs now
        assert sup.running["sim_b"]["instance_group"][0]["count"] == 2
        status, _ = server._http("POST", "/v2/models/sim_b/infer", {"inputs": [
            {"name": "INPUT", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]})
        assert status == 200
    finally:
        stop.set()
        if sup is not None:
            sup._thread.join(30)                # why: one thread at a time restarts a TritonServer
    try:
        cancel = threading.Event()
        cancel.set()
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="stopped while tritonserver was starting"):
            server.restart({}, ["sim_accel"], cancel=cancel)
        assert server.process is None and time.monotonic() - t0 < 10
    finally:
        server.stop()


def test_status_names_a_restart_and_the_models_it_left_out():
    from controller.status import format_header
    doc = {"time": 1000.0, "server": {"http_url": "h", "grpc_url": "g", "metrics_url": "m"},
           "source": {"kind": "serve", "pid": 7, "started": 900.0, "server_restarts": [
               {"at": 990.0, "exit": "exited with code -11 (SIGSEGV)", "log": "/tmp/t.log", "ok": True,
                "not_loaded": ["model 'b' failed to load: /r/b/1/model.py not found"]}]}}
    line = format_header(doc)[1]
    assert line.startswith("tritonserver died and was restarted 1 time(s); last at "), line
    assert line.endswith("exited with code -11 (SIGSEGV), started again without 1 model(s) that failed to load "
                         "(model 'b' failed to load: /r/b/1/model.py not found); its log then: /tmp/t.log"), line


def _flagged_model(repo: Path, name: str, flag: Path, then: str) -> None:
    """A Python model in `repo` whose initialize does `then` (one statement, `os`, `signal` and `time` imported)
    while the file `flag` exists: it loads at the start, and misbehaves at a reload once the test makes the flag."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [{name: "X", data_type: TYPE_FP32, dims: [1]}]\noutput [{name: "Y", data_type: TYPE_FP32, dims: [1]}]\n')
    (repo / name / "1" / "model.py").write_text(
        "import os, signal, time\nclass TritonPythonModel:\n    def initialize(self, args):\n"
        f"        if os.path.exists({str(flag)!r}):\n            {then}\n")


def test_a_restart_whose_load_kills_the_server_fails_as_a_whole(tmp_path):
    """A model that loaded at the start kills tritonserver when it loads again (a flag file its initialize reads):
    the restart is a failure (the supervisor counts it and tries again), not a server 'started again' with the
    models after it left out, and nothing of it is left running."""
    flag = tmp_path / "kill"
    _flagged_model(tmp_path, "flaky", flag, "os.kill(os.getppid(), signal.SIGKILL)")
    shutil.copytree(ROOT / "model_repository" / "sim_accel", tmp_path / "sim_accel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    server = start_server(["flaky", "sim_accel"], repository=tmp_path)
    try:
        first = server.process.pid
        os.kill(first, signal.SIGSEGV)
        server.process.wait(10)
        flag.touch()
        with pytest.raises(ServerError, match=r"^model 'flaky' failed to load: tritonserver exited with code -9 "
                                              r"\(SIGKILL\) while loading it"):
            server.restart({}, ["flaky", "sim_accel"])
        assert server.process is None
        flag.unlink()
        assert server.restart({}, ["flaky", "sim_accel"]) == []          # the next try, as the supervisor's
        assert set(server.live_models()) == {"flaky", "sim_accel"}
    finally:
        server.stop()


def test_a_real_restart_stuck_in_a_load_ends_when_the_owner_stops(tmp_path):
    """serve's Ctrl-C while a restart waits on a model whose load does not answer (its initialize sleeps): `ended`
    kills the server after its wait, the restart fails at once, and nothing of the server is left."""
    flag = tmp_path / "slow"
    _flagged_model(tmp_path, "sleepy", flag, "time.sleep(120)")
    server = start_server(["sleepy"], repository=tmp_path)
    stop, said = threading.Event(), []
    try:
        sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=said.append, poll_s=0.05).start()
        _wait_for(lambda: sup.running is not None)
        flag.touch()
        first = server.process.pid
        os.kill(first, signal.SIGSEGV)
        _wait_for(lambda: server.process is not None and server.process.pid != first
                  and "loading: sleepy" in server.log_path.read_text().split("Signal (11)")[-1], timeout_s=60)
        time.sleep(0.5)                                       # in the load now
        pid = server.process.pid
        t0 = time.monotonic()
        with sup.ended(wait_s=1.0):
            took = time.monotonic() - t0
        assert took < 8, took
        assert "still under way after 1 s; stopping it" in said[-1], said
        assert sup.restarts[-1]["ok"] is False and "while loading it" in sup.restarts[-1]["error"], sup.restarts
        assert server.process is None and not process_alive(pid)
    finally:
        stop.set()
        server.stop()


def test_a_server_that_answers_no_health_check_for_deaf_after_s_is_killed_and_started_again():
    """The liveness probe (a stand-in for gRPC ServerLive): a server alive but silent for `deaf_after_s` is killed
    and restarted, its death named as such. Silence is counted from the last answer, so a probe that fails now and
    then never kills; a new process's silence counts from its own start."""
    answers = {"live": True, "flaky": False, "n": 0}

    def probe() -> bool:
        answers["n"] += 1
        return answers["live"] and not (answers["flaky"] and answers["n"] % 2)

    server, stop, said = _Server(), threading.Event(), []
    sup = ServerSupervisor(server, stop, budget=RestartBudget(3, backoff_s=0.01), say=said.append, poll_s=0.01,
                           deaf_after_s=0.4, probe_every_s=0.05, probe=probe).start()
    try:
        answers["flaky"] = True                       # every other check unanswered: 0.05 s silences, no kill
        time.sleep(1.0)
        assert not server.killed and answers["n"] >= 10
        answers["live"] = False
        t0 = time.monotonic()
        _wait_for(lambda: server.killed)
        assert 0.3 <= time.monotonic() - t0 < 3
        first = server.process.pid
        server.die(-9)
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"))
        words = sup.restarts[0]["exit"]
        assert words.startswith("was running but answered no gRPC health check for 0.") and \
            words.endswith(" s (hung; killed)"), sup.restarts
        assert said[0].startswith("tritonserver was running but answered no gRPC health check for "), said
        server.killed = False
        answers["live"] = True                        # the new process answers: never killed
        time.sleep(0.8)
        assert server.process.pid != first and not server.killed and len(sup.restarts) == 1
    finally:
        stop.set()
        sup._thread.join(5)


def test_a_real_tritonserver_that_stops_answering_is_killed_and_started_again_and_a_long_load_is_no_hang(tmp_path):
    """Against a real tritonserver with a 2-s liveness limit: a model whose load takes 6 s (its initialize sleeps)
    loads without the server being killed (the gRPC health check answers during a load: measured ~2 ms); then the
    server stopped (SIGSTOP: alive, answering nothing, and no crash line in its log, unlike the wedge above) is
    killed and started again, and its models serve."""
    flag = tmp_path / "slow"
    _flagged_model(tmp_path, "sleepy", flag, "time.sleep(6)")
    shutil.copytree(ROOT / "model_repository" / "sim_accel", tmp_path / "sim_accel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    server = start_server(["sim_accel"], repository=tmp_path)
    stop, said, sup = threading.Event(), [], None
    try:
        sup = ServerSupervisor(server, stop, budget=RestartBudget(3), say=said.append, poll_s=0.05,
                               deaf_after_s=2.0, probe_every_s=0.25).start()
        _wait_for(lambda: sup.running is not None)
        flag.touch()
        t0 = time.monotonic()
        server.load_model("sleepy")
        assert time.monotonic() - t0 >= 6
        assert not said and not sup.restarts                          # a long load is no hang
        _wait_for(lambda: "sleepy" in (sup.running or {}))
        flag.unlink()                                                 # the restart's own load of it is quick
        pid = server.process.pid
        os.kill(pid, signal.SIGSTOP)
        _wait_for(lambda: sup.restarts and sup.restarts[-1].get("ok"), timeout_s=90)
        rec = sup.restarts[0]
        assert rec["ok"] and rec["pid"] != pid, rec
        assert rec["exit"].startswith("was running but answered no gRPC health check for "), rec
        assert not process_alive(pid)
        assert set(server.live_models()) == {"sim_accel", "sleepy"}
        _serves_and_stays(server, sup, 2.5)                           # the new process answers: no second kill
    finally:
        _end(server, sup, stop)
