"""An ensemble's target passed down to the step that holds its latency (controller/ensemble.py): no server."""
from __future__ import annotations

import logging
import re

from controller import ensemble as E
from controller.config import ControllerConfig, ModelLimits, ServerConfig
from controller.loop import Controller
from controller.observer import TraceFeed
from controller.types import Observation
from test_loop_ticks import LOOP, Clock, FakeControl, FakeModel, FakeScraper, model_config, run_ticks


def obs(p99=None, queue=0.0, valid=True):
    return Observation(valid=valid, p99_ms=p99, queue_ms_per_request=queue)


def test_the_step_that_queues_longest_holds_the_latency():
    o = {"pre": obs(5, queue=0.5), "net": obs(40, queue=12.0), "post": obs(3, queue=0.1), "gone": None}
    assert E.holder(["pre", "net", "post", "gone"], o) == "net"
    assert E.holder(["a"], {"a": obs(valid=False)}) is None


def test_only_the_holder_gets_the_ensemble_target_less_the_rest():
    own = {"pre": 100.0, "net": 100.0}
    t = E.step_targets("ens", 50.0, obs(60.0), ["pre", "net"], {"pre": obs(6, 0.2), "net": obs(45, 9.0)}, own)
    assert t["pre"] == E.StepTarget("pre", 100.0)                 # one step at a time
    assert t["net"].target_ms == 35.0 and t["net"].ensemble == "ens"   # 50 - (60 - 45)
    assert "queues longest" in t["net"].why


def test_never_looser_than_the_steps_own_nor_below_a_floor():
    own = {"net": 20.0}
    assert E.step_targets("ens", 50.0, obs(30.0), ["net"], {"net": obs(25, 3.0)}, own)["net"].ensemble == ""
    own = {"net": 100.0}
    t = E.step_targets("ens", 50.0, obs(200.0), ["net"], {"net": obs(10, 3.0)}, own)["net"]
    assert t.target_ms == 10.0                                   # 50 - 190 < 0: the floor, 20% of 50


def test_the_rest_is_the_difference_of_the_mean_request_times_where_known():
    own = {"net": 100.0}
    ens = Observation(valid=True, p99_ms=60.0, request_ms_mean=30.0)
    net = Observation(valid=True, p99_ms=58.0, queue_ms_per_request=9.0, request_ms_mean=22.0)
    assert E.step_targets("ens", 50.0, ens, ["net"], {"net": net}, own)["net"].target_ms == 42.0   # 50 - (30 - 22)


def test_an_ensemble_over_its_target_asks_the_step_to_cut_the_excess():
    own = {"net": 100.0}
    ens = Observation(valid=True, p99_ms=30.0, request_ms_mean=12.0)
    net = Observation(valid=True, p99_ms=23.0, queue_ms_per_request=2.0, request_ms_mean=11.0)
    t = E.step_targets("ens", 25.0, ens, ["net"], {"net": net}, own)["net"]
    assert t.target_ms == 18.0 and "over" in t.why      # min(25 - 1, 23 - (30 - 25))


def test_the_cut_stops_at_the_steps_compute_time():
    """The ensemble is 23 ms over while its step's p99 is 27 ms with 9 ms of compute a request and almost no
    queue: the cut (27 - 23 = 4 ms) would ask for less than the compute, which no instance count removes."""
    own = {"net": 1000.0}
    ens = Observation(valid=True, p99_ms=48.0, request_ms_mean=11.0)
    net = Observation(valid=True, p99_ms=27.0, queue_ms_per_request=0.3, compute_ms_per_request=9.0, request_ms_mean=10.0)
    t = E.step_targets("ens", 25.0, ens, ["net"], {"net": net}, own)["net"]
    assert t.target_ms == 9.0 and "not below its compute time" in t.why     # not 27 - 23 = 4
    # where the cut stays above the compute time, it is taken as before
    net = Observation(valid=True, p99_ms=27.0, queue_ms_per_request=3.0, compute_ms_per_request=5.0, request_ms_mean=10.0)
    ens = Observation(valid=True, p99_ms=35.0, request_ms_mean=11.0)
    t = E.step_targets("ens", 25.0, ens, ["net"], {"net": net}, own)["net"]
    assert t.target_ms == 17.0 and "compute" not in t.why                    # 27 - 10


def test_no_data_says_nothing():
    own = {"net": 100.0}
    for e in (None, obs(valid=False), obs(None)):
        assert E.step_targets("ens", 50.0, e, ["net"], {"net": obs(25, 3.0)}, own) is None
    assert E.step_targets("ens", 50.0, obs(60.0), ["net"], {"net": obs(valid=False)}, own) is None


def test_a_gap_in_the_data_keeps_the_targets_the_steps_have():
    views = [E.EnsembleView("ens", 50.0, obs(valid=False), ("net",))]
    held = E.StepTarget("net", 35.0, "ens", "earlier")
    assert E.plan(views, {"net": obs(45, 9.0)}, {"net": 100.0}, {"net": held}) == {"net": held}
    # with nothing held yet, its own target, capped at the ensemble's (next test)
    assert E.plan(views, {"net": obs(45, 9.0)}, {"net": 100.0}, {})["net"].target_ms == 50.0
    assert E.plan(views, {"net": obs(45, 9.0)}, {"net": 30.0}, {}) == {"net": E.StepTarget("net", 30.0)}


def test_no_step_runs_under_a_target_looser_than_its_ensembles():
    """Every request of an ensemble passes through each step, so a step's p99 is part of the ensemble's: a step
    left under the defaults' 1 s (seen in the mixed repository's `status` before its first request) could be
    consolidated to where it alone misses the ensemble's 25 ms. Before any data, and for a step that does not
    queue longest, the ensemble's target is the step's ceiling; a tighter own target stays."""
    no_data = [E.EnsembleView("ens", 25.0, None, ("pre", "net", "post"))]
    own = {"pre": 1000.0, "net": 1000.0, "post": 10.0}
    cur = {s: E.StepTarget(s, ms) for s, ms in own.items()}     # what the loop passes on its first tick
    t = E.plan(no_data, {}, own, cur)
    assert t["pre"].target_ms == 25.0 and t["pre"].ensemble == "ens" and "part of ens's" in t["pre"].why
    assert t["net"].target_ms == 25.0 and t["post"] == E.StepTarget("post", 10.0)
    # with data: the step that queues longest gets the derived target; the others stay capped, not at 1 s
    ens = Observation(valid=True, p99_ms=20.0, request_ms_mean=12.0)
    o = {"pre": Observation(valid=True, p99_ms=3.0, queue_ms_per_request=0.1, request_ms_mean=1.0),
         "net": Observation(valid=True, p99_ms=15.0, queue_ms_per_request=2.0, request_ms_mean=9.0),
         "post": Observation(valid=True, p99_ms=2.0, queue_ms_per_request=0.0, request_ms_mean=1.0)}
    t = E.plan([E.EnsembleView("ens", 25.0, ens, ("pre", "net", "post"))], o, own, t)
    assert t["net"].target_ms == 22.0 and "queues longest" in t["net"].why         # 25 - (12 - 9), not held at 25
    assert t["pre"].target_ms == 25.0 and t["post"].target_ms == 10.0
    # a step in two ensembles: the stricter cap
    two = [E.EnsembleView("a", 40.0, None, ("s",)), E.EnsembleView("b", 30.0, None, ("s",))]
    assert E.plan(two, {}, {"s": 1000.0}, {})["s"].ensemble == "b"


def test_a_shared_step_gets_the_strictest_and_noise_does_not_move_it():
    a = {"s": E.StepTarget("s", 30.0, "a", "x")}
    b = {"s": E.StepTarget("s", 25.0, "b", "y")}
    assert E.merge([a, b])["s"].ensemble == "b"
    assert E.settle(30.0, 31.0, 100.0) == 30.0     # within 10%: keep
    assert E.settle(30.0, 25.0, 100.0) == 25.0
    assert E.settle(30.0, 100.0, 100.0) == 100.0   # back to its own


def test_plan_settles_against_the_current_target():
    views = [E.EnsembleView("ens", 50.0, obs(60.0), ("net",))]
    before = E.StepTarget("net", 34.0, "ens", "earlier")
    assert E.plan(views, {"net": obs(45, 9.0)}, {"net": 100.0}, {"net": before}) == {"net": before}   # 35 is within 10%
    assert E.plan(views, {"net": obs(45, 9.0)}, {"net": 100.0}, {})["net"].target_ms == 35.0


# ---- the loop ----------------------------------------------------------------------------------------

ENS = {"name": "ens", "platform": "ensemble", "max_batch_size": 8, "instance_group": [],
       "ensemble_scheduling": {"step": [{"model_name": "net"}]}}


def test_the_ensemble_target_scales_its_step_which_alone_would_hold(caplog):
    """The step's own target (1 s) is met with room to spare; the ensemble's (40 ms) is not: the step grows."""
    caplog.set_level(logging.INFO, logger="controller.loop")
    ctl, control = _grown_step()          # the step is not named in the configuration
    net = ctl.models["net"]
    assert any(m.startswith("net: managed as a step of ensemble ens") for m in caplog.messages)
    assert net.target_from is not None and net.target_from.ensemble == "ens" and net.limits.p99_target_ms < 40.0
    assert control.loads and control.loads[0][0] == "net" and control.loads[0][1].instance_count == 2
    assert not [m for m, _ in control.loads if m == "ens"]
    assert "less" in ctl.status_snapshot()["models"]["net"]["target_from"]
    ctl.close()


def _ensemble_run(ens: FakeModel, net: FakeModel) -> tuple[Controller, FakeControl]:
    """The ensemble `ens` (target 40 ms) in front of `net` (its own target loose), served by fakes, 10 ticks."""
    clock = Clock()
    control = FakeControl(["ens", "net"])
    control.configs.update(ens=ENS, net=model_config("net"))
    # min_gain_pct 0: the fake server's throughput does not follow the instances, so no ScaleDownNoGain step back
    loose = ModelLimits(p99_target_ms=1000.0, max_instances=4, scale_up_cooldown_s=0.0, max_delay_us=0, min_gain_pct=0.0)
    cfg = ControllerConfig(server=ServerConfig(), loop=LOOP, defaults=loose,
                           models={"ens": ModelLimits(p99_target_ms=40.0, max_delay_us=0)})
    scraper = FakeScraper(clock, {"ens": ens, "net": net})
    ctl = Controller(cfg, control=control, scraper=scraper, clock=clock, traces=TraceFeed(None))
    run_ticks(ctl, clock, 10)
    return ctl, control


def test_an_ensemble_within_its_target_changes_nothing():
    ctl, control = _ensemble_run(FakeModel(50, 6, 5.5), FakeModel(50, 5, 4.5))
    net = ctl.models["net"]
    assert net.limits.p99_target_ms == 39.0 and net.target_from.ensemble == "ens"    # 40 less the 1 ms ens adds (means 6 - 5)
    assert control.loads == [] and net.last_decision.reason.startswith("Hold")
    ctl.close()


def _grown_step():
    ctl, control = _ensemble_run(FakeModel(300, 32, 31), FakeModel(300, 30, 5, pending=4))
    ctl.wait_for_pending()
    return ctl, control


def test_a_change_to_a_step_restarts_the_ensembles_window():
    """ensemble.py compares the ensemble's p99 with its step's: after the step changes, the ensemble's window
    must not reach back into the old step's seconds (seen live: a stale ensemble p99 drove the step's target
    to its 20% floor and the step to its maximum)."""
    ctl, control = _grown_step()
    assert control.loads and control.loads[0][0] == "net"
    net, ens = ctl.models["net"].observer, ctl.models["ens"].observer
    assert net.changed_at > 0 and ens.changed_at == net.changed_at
    ctl.close()


def test_status_shows_the_ensemble_end_to_end_and_its_steps():
    from controller.status import format_text
    ctl, _ = _grown_step()
    snap = ctl.status_snapshot()
    doc = {"models": {n: {"state": "READY", **m} for n, m in snap["models"].items()}}
    ctl.close()
    text = format_text(doc)
    ens_block = text.split("\n\nens  ")[1].split("\n\n")[0]
    assert ens_block.startswith("READY  (target p99 40 ms, end to end; tuned through its steps)"), ens_block
    assert "instances" not in ens_block.splitlines()[0] and "busy" not in ens_block and "HoldEnsemble" not in ens_block
    assert "per request  mean 32.00 ms per request end to end; 30.00 ms in its steps, 2.00 ms around them" in ens_block
    step = [line for line in ens_block.splitlines() if line.strip().startswith("step ")]
    # the step grew (to 2 or 3 by this snapshot: a reload may still be in flight when it was taken)
    assert len(step) == 1 and re.search(r"net: READY, [23] instances", step[0]) and "(from ens)" in step[0], step
    # the step's own block follows the ensemble's, its target marked as the ensemble's
    assert text.index("\n\nnet  ") > text.index("\n\nens  ")
    net_head = text.split("\n\nnet  ")[1].splitlines()[0]
    assert " from ens, 1-4 instances)" in net_head, net_head
    # a window without requests (right after serve starts): no "0.00 ms" figures for the ensemble or its step
    for m in doc["models"].values():
        m["obs"] = {**m["obs"], "arrival_rps": 0.0, "completion_rps": 0.0, "mean_ms": 0.0, "queue_ms": 0.0,
                    "compute_ms": 0.0, "p99_ms": None}
    quiet = format_text(doc).split("\n\nens  ")[1].split("\n\n")[0]
    assert "per request" not in quiet and "0.00 ms" not in quiet, quiet
    assert re.search(r"\n  p99 +none: no requests in the window", quiet), quiet


def test_a_callers_target_over_its_calls_the_docstrings_worked_example():
    """bls (target 60 ms, mean 40, p99 50, queue 0.5) calls plain twice a request (mean 15, queue 6): the rest is
    40 - 2 x 15 = 10 ms, and each of the two calls gets (60 - 10) / 2 = 25 ms."""
    bls = Observation(valid=True, p99_ms=50.0, request_ms_mean=40.0, queue_ms_per_request=0.5)
    plain = Observation(valid=True, p99_ms=20.0, request_ms_mean=15.0, queue_ms_per_request=6.0)
    t = E.step_targets("bls", 60.0, bls, ["plain"], {"plain": plain}, {"plain": 1000.0}, calls={"plain": 2.0})
    assert t["plain"].target_ms == 25.0 and t["plain"].ensemble == "bls" and "over 2 calls a request" in t["plain"].why
    # the same as an ensemble step (one pass a request): 60 - (40 - 15)
    assert E.step_targets("bls", 60.0, bls, ["plain"], {"plain": plain}, {"plain": 1000.0})["plain"].target_ms == 35.0


def test_a_caller_that_queues_longest_cuts_no_callees_target():
    """Its own instances are what helps: the callees keep their (capped) own targets."""
    bls = Observation(valid=True, p99_ms=80.0, request_ms_mean=40.0, queue_ms_per_request=20.0)
    plain = Observation(valid=True, p99_ms=20.0, request_ms_mean=15.0, queue_ms_per_request=6.0)
    t = E.step_targets("bls", 60.0, bls, ["plain"], {"plain": plain}, {"plain": 60.0}, calls={"plain": 1.0})
    assert t == {"plain": E.StepTarget("plain", 60.0)}


def test_a_callee_never_runs_under_a_target_looser_than_its_callers():
    view = E.EnsembleView("bls", 60.0, None, ("plain",), {"plain": 1.0})
    planned = E.plan([view], {"plain": None}, {"plain": 1000.0}, {})
    assert planned["plain"].target_ms == 60.0 and planned["plain"].ensemble == "bls"
    assert "bls calls plain (seen in its request traces), so plain's p99 is part of bls's" in planned["plain"].why
    # a tighter own target stays
    assert E.plan([view], {"plain": None}, {"plain": 30.0}, {})["plain"].target_ms == 30.0
