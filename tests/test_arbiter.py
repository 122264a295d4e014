"""Arbitration between models sharing one device and memory budget: table cases and a fake-clock scenario."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from controller import policy
from controller.arbiter import ModelView, arbitrate
from controller.config import LoopConfig, ModelLimits
from controller.types import Cap, Decision, GpuObservation, Observation, Settings

MiB = 2**20


def S(n: int) -> Settings:
    return Settings(n, 0)


def obs(busy=0.5, p99=30.0, queue=0.1, pending=0.2, arrival=100.0) -> Observation:
    return Observation(valid=True, span_s=10, since=0, arrival_rps=arrival, completion_rps=arrival,
                       busy_fraction=busy, p99_ms=p99, queue_ms_per_request=queue, compute_ms_per_request=5.0,
                       pending_mean=pending)


HOT = obs(busy=0.95, p99=90.0, queue=8.0, pending=5.0, arrival=400.0)
IDLE = obs(busy=0.1, p99=5.0, arrival=10.0)
BUSY = obs(busy=0.9, p99=85.0, queue=6.0, pending=3.0, arrival=300.0)


def view(name, n, o, reason="HoldSteady", priority=0, min_instances=1, target=None) -> ModelView:
    lim = ModelLimits(p99_target_ms=100.0, priority=priority, min_instances=min_instances)
    held_by = Cap.MEMORY if reason == "HoldMemoryCap" else None
    return ModelView(name, S(n), Decision(target or S(n), reason, held_by=held_by), o, lim, 64 * MiB)


@pytest.mark.parametrize("views,expected", [
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 3, IDLE)],
                 {"b": ("RebalanceToHotModel", 2)}, id="idle-model-gives-to-hot"),
    pytest.param([view("a", 2, HOT, "HoldSteady"), view("b", 3, IDLE)],
                 {}, id="nobody-blocked-by-memory-no-move"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 1, IDLE)],
                 {}, id="donor-at-min-instances-keeps-it"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 3, BUSY)],
                 {}, id="equal-priority-busy-donor-keeps-its-sla"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap", priority=5), view("b", 3, BUSY, priority=1)],
                 {"b": ("RebalanceToHigherPriority", 2)}, id="lower-priority-busy-donor-gives-up-its-sla"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap", priority=1), view("b", 3, BUSY, priority=5)],
                 {}, id="higher-priority-busy-model-is-not-a-donor"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 3, IDLE, priority=3), view("c", 3, IDLE, priority=0)],
                 {"c": ("RebalanceToHotModel", 2)}, id="lowest-priority-idle-donor-first"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 3, IDLE, target=S(2), reason="ScaleDownIdle")],
                 {}, id="one-move-at-a-time"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap", priority=0), view("b", 2, HOT, "HoldMemoryCap", priority=9),
                  view("c", 3, IDLE)],
                 {"c": ("RebalanceToHotModel", 2)}, id="two-hot-one-idle-donor"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap", priority=0), view("b", 3, HOT, "HoldMemoryCap", priority=9)],
                 {"a": ("RebalanceToHigherPriority", 1)}, id="higher-priority-hot-model-takes-from-lower-hot"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 3, Observation(valid=False))],
                 {}, id="donor-without-data-is-not-idle"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"),
                  view("b", 3, dataclasses.replace(IDLE, failure_rps=1.0), reason="RepairFullReload")],
                 {}, id="a-failing-model-is-not-a-donor"),
    pytest.param([view("a", 2, HOT, "HoldMemoryCap"), view("b", 3, dataclasses.replace(IDLE, failure_rps=1.0, shed_rps=1.0))],
                 {"b": ("RebalanceToHotModel", 2)}, id="load-shed-is-no-fault"),
])
def test_arbitrate(views, expected):
    got = {name: (d.reason, d.target.instance_count) for name, d in arbitrate(views).items()}
    assert got == expected


def test_priority_move_says_which_sla_is_given_up():
    d = arbitrate([view("gold", 2, HOT, "HoldMemoryCap", priority=5), view("bronze", 3, BUSY, priority=1)])["bronze"]
    assert "bronze (priority 1) gives up its 100 ms target for gold (priority 5" in d.detail


# ---- scenario: two models, one budget, alternating peaks, on a fake clock -------------------------

PER_INSTANCE = 100 * MiB
BUDGET_MB = 600           # 6 instances in all
LOOP = LoopConfig(window_s=6.0, settle_s=2.0, min_span_s=4.0)
LIMITS = ModelLimits(p99_target_ms=50.0, max_instances=6, memory_budget_mb=BUDGET_MB, scale_up_cooldown_s=2.0,
                     scale_down_delay_s=60.0, max_delay_us=0)


def plant_obs(n: int, load: float, used: int, since: float) -> Observation:
    """Capacity 100 req/s per instance; p99 grows as load nears capacity."""
    cap = 100.0 * n
    rho = min(load / cap, 0.99)
    p99 = 10.0 / (1 - rho)
    busy = rho
    gpus = (GpuObservation(0, None, used, 16 * 1024 * MiB),)
    return Observation(valid=True, span_s=6.0, since=since, arrival_rps=load, completion_rps=min(load, cap),
                       busy_fraction=busy, p99_ms=p99, queue_ms_per_request=p99 / 4 if rho > 0.7 else 0.1,
                       compute_ms_per_request=5.0, pending_mean=5.0 if rho > 0.8 else 0.1, gpus=gpus)


def run_two(loads, seconds, start, states=None, t0=0.0):
    """Walk both models with a 2 s tick; apply each tick's (arbitrated) decisions at once."""
    names = ["a", "b"]
    counts = dict(start)
    states = states or {m: policy.initial_state(t0 - 100) for m in names}
    limits = {m: LIMITS for m in names}
    history = []
    t = t0
    while t < t0 + seconds:
        used = sum(counts.values()) * PER_INSTANCE
        decided = {}
        for m in names:
            o = plant_obs(counts[m], loads[m], used, since=min(t - 6.0, max(states[m].last_change_at + 2.0, t - 6.0)))
            d, states[m] = policy.decide(o, S(counts[m]), states[m], limits[m], LOOP, t)
            decided[m] = (d, o)
        views = [ModelView(m, S(counts[m]), d, o, limits[m], states[m].instance_memory_bytes) for m, (d, o) in decided.items()]
        for m, d in arbitrate(views).items():
            decided[m] = (d, decided[m][1])
        for m, (d, o) in decided.items():
            if d.valid and d.target != S(counts[m]):
                states[m] = policy.record_applied(states[m], d, S(counts[m]), o, t)
                counts[m] = d.target.instance_count
                history.append((t, m, d.reason, counts[m]))
        assert sum(counts.values()) * PER_INSTANCE <= BUDGET_MB * MiB, (t, counts)
        t += 2.0
    return counts, states, history


def test_instances_follow_the_traffic_within_the_budget():
    # Phase 1: a is hot, b quiet.
    counts, states, h1 = run_two({"a": 450.0, "b": 20.0}, 120, {"a": 1, "b": 1})
    assert counts["a"] >= 4 and counts["b"] == 1
    # Phase 2: the peaks swap. a keeps its instances (it is slow to scale down) until b, blocked by the
    # budget, takes them: RebalanceToHotModel moves instances from a to b, one at a time.
    counts, states, h2 = run_two({"a": 20.0, "b": 450.0}, 120, counts, states, t0=120.0)
    reasons = [r for _, _, r, _ in h2]
    assert "RebalanceToHotModel" in reasons
    assert counts["b"] >= 4 and counts["a"] <= 2
    moves = [(m, r) for _, m, r, _ in h2 if r == "RebalanceToHotModel"]
    assert all(m == "a" for m, _ in moves)


def planned(name, n, o, spare, reason="HoldPredictedOk") -> ModelView:
    """A model the planner decided for: `spare` instances it predicts it can do without."""
    lim = ModelLimits(p99_target_ms=100.0)
    held_by = Cap.MEMORY if reason == "HoldPredictedNoneMeets" else None
    return ModelView(name, S(n), Decision(S(n), reason, held_by=held_by, mode="model", plan={"spare": spare}),
                     o, lim, 64 * MiB)


def test_with_the_planner_the_donor_is_whoever_its_model_says_can_spare_one():
    # a donor still busy by the reactive rule (55% busy, so one fewer would be 110%: not `is_low`), whose
    # planner predicts one instance fewer meets its target at the upper band of its forecast
    busyish = obs(busy=0.55, p99=30.0, arrival=150.0)
    assert not policy.is_low(busyish, S(2), ModelLimits(p99_target_ms=100.0))
    moves = arbitrate([planned("a", 1, HOT, 0, "HoldPredictedNoneMeets"), planned("b", 2, busyish, 1)])
    assert moves["b"].reason == "RebalanceToHotModel" and moves["b"].target == S(1) and moves["b"].mode == "arbiter"
    # and one whose planner says it needs all it has is not a donor, however idle it looks
    assert arbitrate([planned("a", 1, HOT, 0, "HoldPredictedNoneMeets"), planned("b", 2, IDLE, 0)]) == {}


# ---- goodput: where an instance buys the most -----------------------------------------------------------

def capped(caps):
    """A goodput function from capacities: min(demand, capacity with n instances); None for an unknown count."""
    if caps is None:
        return None
    return lambda n, d: None if caps.get(n) is None else min(d, caps[n])


def gview(name, n, o, caps, reason="HoldSteady", priority=0, band_hi=None, band=None, goodput=None) -> ModelView:
    """A model with the planner's goodput (`caps` as capacities, or `goodput` itself) and forecast band (`band`:
    low, mid, high; `band_hi` alone: the same demand at all three)."""
    v = view(name, n, o, reason, priority)
    if band is None and band_hi is not None:
        band = (band_hi, band_hi, band_hi)
    plan = {"band_rps": list(band), "spare": 0} if band is not None else None
    d = Decision(v.decision.target, v.decision.reason, held_by=v.decision.held_by, mode="model" if plan else "",
                 plan=plan)
    return ModelView(name, v.current, d, o, v.limits, v.instance_memory_bytes, goodput or capped(caps))


def test_a_busy_donor_gives_where_an_instance_buys_clearly_more_goodput_docstring_example():
    # the module docstring's numbers: a's gain 95 at the high end of its band, 65 at its mid; b, on a falling
    # load, loses 0 at the low end of its band, 40 at its mid, 80 at its high end
    table = {("a", 2, 400.0): 290.0, ("a", 3, 400.0): 385.0, ("a", 2, 350.0): 280.0, ("a", 3, 350.0): 345.0,
             ("b", 2, 100.0): 100.0, ("b", 3, 100.0): 100.0, ("b", 2, 160.0): 120.0, ("b", 3, 160.0): 160.0,
             ("b", 2, 220.0): 140.0, ("b", 3, 220.0): 220.0}
    of = lambda m: (lambda n, d: table.get((m, n, d)))  # noqa: E731
    a = gview("a", 2, HOT, None, "HoldMemoryCap", band=(300.0, 350.0, 400.0), goodput=of("a"))
    b = gview("b", 3, BUSY, None, band=(100.0, 160.0, 220.0), goodput=of("b"))
    out = arbitrate([a, b])
    assert out["b"].reason == "RebalanceForGoodput" and out["b"].target == S(2)
    assert "buys a 95 req/s" in out["b"].detail and "costs b 0" in out["b"].detail and "65 and 40" in out["b"].detail
    # weighed at b's high end (its load not yet fallen): 95 < 1.5 x 80 + 5, no move
    b_high = gview("b", 3, BUSY, None, band=(220.0, 220.0, 220.0), goodput=of("b"))
    assert arbitrate([a, b_high]) == {}
    # and where the mid points disagree (b's mid loss 65 - 5 < 65 + 5 needed), no move either
    table[("b", 2, 160.0)] = 95.0
    assert arbitrate([a, b]) == {}


def test_the_earlier_capacity_example_still_moves():
    a = gview("a", 2, HOT, {1: 150.0, 2: 300.0, 3: 390.0}, "HoldMemoryCap", band_hi=400.0)
    b = gview("b", 3, BUSY, {2: 140.0, 3: 170.0, 4: 190.0}, band_hi=150.0)
    out = arbitrate([a, b])
    assert out["b"].reason == "RebalanceForGoodput" and out["b"].target == S(2)
    assert "buys a 90 req/s" in out["b"].detail and "costs b 10" in out["b"].detail


@pytest.mark.parametrize("b_caps,b_demand,moves", [
    pytest.param({2: 100.0, 3: 200.0}, 250.0, False, id="donor-loses-100-more-than-the-hot-gains-90"),
    pytest.param({2: 93.0, 3: 200.0}, 150.0, False, id="loss-57-gain-90-just-under-1.5x57+5"),
    pytest.param({2: 94.0, 3: 200.0}, 150.0, True, id="loss-56-gain-90-just-over-1.5x56+5"),
    pytest.param({2: 60.0, 3: 200.0}, 150.0, False, id="loss-90-equal-to-gain-no-move"),
    pytest.param({2: 130.0, 3: 200.0}, 150.0, True, id="loss-20-gain-90-moves"),
    pytest.param(None, 150.0, False, id="donor-capacities-unknown-no-move"),
])
def test_goodput_move_needs_a_clear_gain_over_the_loss(b_caps, b_demand, moves):
    a = gview("a", 2, HOT, {2: 300.0, 3: 390.0}, "HoldMemoryCap", band_hi=400.0)   # gain 90
    b = gview("b", 3, BUSY, b_caps, band_hi=b_demand)
    out = arbitrate([a, b])
    assert ("b" in out) is moves, out
    # the reverse is never also worth it: after the move b is the hot one, and a's loss is its old gain
    if moves:
        a2 = gview("a", 3, HOT, {2: 300.0, 3: 390.0}, band_hi=400.0)
        b2 = gview("b", 2, BUSY, b_caps, "HoldMemoryCap", band_hi=b_demand)
        assert arbitrate([a2, b2]) == {}


def test_two_hot_models_the_one_an_instance_buys_more_for_takes_the_idle_donor():
    a = gview("a", 2, HOT, {2: 300.0, 3: 320.0}, "HoldMemoryCap", band_hi=400.0)   # gain 20
    b = gview("b", 2, HOT, {2: 200.0, 3: 300.0}, "HoldMemoryCap", band_hi=400.0)   # gain 100
    c = view("c", 3, IDLE)
    out = arbitrate([a, b, c])
    assert out["c"].reason == "RebalanceToHotModel" and "for b" in out["c"].detail


@settings(max_examples=200, deadline=None)
@given(ga=st.lists(st.floats(0, 500), min_size=9, max_size=9), gb=st.lists(st.floats(0, 500), min_size=9, max_size=9),
       band_a=st.lists(st.floats(0, 500), min_size=3, max_size=3), band_b=st.lists(st.floats(0, 500), min_size=3, max_size=3))
def test_property_a_move_and_its_reverse_are_never_both_worth_it(ga, gb, band_a, band_b):
    # any goodputs (per count 1-3, at each point of the band) and any bands: if b gives a one, then at the same
    # forecasts a (one more) would not give it back to b (one fewer)
    def of(g, band):
        table = {}
        for n in (1, 2, 3):
            for i, d in enumerate(band):
                table.setdefault((n, d), g[(n - 1) * 3 + i])
        return lambda n, d: table.get((n, d))
    ba, bb = sorted(band_a), sorted(band_b)
    a = gview("a", 2, HOT, None, "HoldMemoryCap", band=ba, goodput=of(ga, ba))
    b = gview("b", 2, BUSY, None, band=bb, goodput=of(gb, bb))
    if "b" not in arbitrate([a, b]):
        return
    a2 = gview("a", 3, BUSY, None, band=ba, goodput=of(ga, ba))
    b2 = gview("b", 1, HOT, None, "HoldMemoryCap", band=bb, goodput=of(gb, bb))
    assert "a" not in arbitrate([a2, b2])


def test_the_loop_hands_the_arbiter_the_planners_goodput_for_the_live_config():
    from types import SimpleNamespace

    from controller.loop import Controller
    from controller.planner import Forecast, PlanInputs
    from controller.service import fit_service
    curve = fit_service({1: (200, 7.5), 2: (100, 9.0), 4: (60, 12.0), 8: (40, 18.0)})   # s(b) = 6 + 1.5 b
    inputs = PlanInputs(fits=((S(1), curve),), forecast=Forecast.start(0.0, 100.0), max_batch=32, interval_s=1.0)
    mm = SimpleNamespace(current=S(1), plan_inputs=inputs, state=policy.PolicyState(started_at=0.0),
                         limits=ModelLimits(p99_target_ms=40.0))
    ctl = SimpleNamespace(clock=lambda: 100.0)
    live = obs(busy=0.5, arrival=100.0)
    g = Controller._goodput_of(ctl, mm, live)
    assert g(1, 50.0) == pytest.approx(50.0, rel=0.01) and g(1, 600.0) == 0.0 and g(2, 600.0) > 500.0
    # no function without the planner's inputs or a valid observation, none from a curve for another count
    assert Controller._goodput_of(ctl, SimpleNamespace(**{**vars(mm), "plan_inputs": None}), live) is None
    assert Controller._goodput_of(ctl, mm, Observation(valid=False)) is None
    assert Controller._goodput_of(ctl, SimpleNamespace(**{**vars(mm), "current": S(3)}), live)(3, 50.0) is None


