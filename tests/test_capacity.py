"""The fleet scaler's signal (controller/capacity.py): its semantics, the gauges, the bind address."""
from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client import generate_latest

from controller.capacity import HEADROOM_MAX, SATURATED_MAX, pod_utilization, utilization
from controller.config import ConfigError, LoopConfig, ModelLimits, parse_config
from controller.policy import PerfPoint, PolicyState, decide, instance_ceiling
from controller.telemetry import ControllerMetrics, is_loopback_host
from controller.types import Cap, GpuObservation, Observation, Settings

T = 100.0


def obs(arrival, p99, busy=0.5, completion=None, gpus=()):
    return Observation(valid=True, span_s=10.0, arrival_rps=arrival,
                       completion_rps=arrival if completion is None else completion, p99_ms=p99,
                       p99_source="trace", busy_fraction=busy, queue_ms_per_request=20.0,
                       compute_ms_per_request=10.0, pending_mean=2.0, gpus=gpus)


def point(n, arrival, met=True, completion=None):
    return PerfPoint(0.0, n, 0, arrival, arrival if completion is None else completion, 50.0, met)


def hpa_desired(replicas, values, target=0.8, tolerance=0.1):
    """The HPA's own formula on a Pods metric: the average over pods, 10% tolerance."""
    ratio = sum(values) / len(values) / target
    if abs(ratio - 1.0) <= tolerance:
        return replicas
    return math.ceil(replicas * ratio)


# ---- semantics --------------------------------------------------------------------------------------

def test_the_docstring_worked_example():
    u1 = utilization(obs(90, 85, busy=0.95), Settings(1, 0), 2, T)
    assert u1.utilization == pytest.approx(90 / (90 / 0.85 * 2)) and not u1.saturated
    pts = [point(2, 120)]
    u2 = utilization(obs(120, 60, busy=0.9), Settings(2, 0), 2, T, pts)
    assert u2.utilization == pytest.approx(0.6) and u2.capacity_rps == pytest.approx(200)
    u3 = utilization(obs(200, 900, busy=1.0, completion=150), Settings(2, 0), 2, T, pts, Cap.MAX)
    assert u3.utilization == pytest.approx(SATURATED_MAX) and u3.saturated
    assert hpa_desired(2, [u3.utilization] * 2) == 5
    u4 = utilization(obs(10, 25, busy=0.1), Settings(2, 0), 2, T, pts)
    assert u4.utilization == pytest.approx(10 / 120)
    assert hpa_desired(2, [u4.utilization] * 2) == 1


@pytest.mark.parametrize("p99", [50.0, 99.0, 150.0, 5000.0])
@pytest.mark.parametrize("busy", [0.1, 0.9, 1.0])
@pytest.mark.parametrize("pts", [(), (point(1, 50),), (point(1, 300), point(2, 20))])
def test_below_one_while_an_instance_can_still_be_added(p99, busy, pts):
    """However hot the live configuration is, the tuner can still add an instance: no new pod."""
    for arrival in (1.0, 100.0, 10_000.0):
        c = utilization(obs(arrival, p99, busy=busy, completion=arrival / 2), Settings(1, 0), 3, T, pts)
        assert c.utilization <= HEADROOM_MAX < 1.0 and not c.saturated
        assert hpa_desired(2, [c.utilization, c.utilization]) <= 2    # target 0.8, 10%: no scale-out


@pytest.mark.parametrize("cap", [Cap.MAX, Cap.MEMORY, Cap.SATURATED, Cap.LEARNED_MAX])
def test_at_or_above_one_when_held_at_the_ceiling_with_the_target_missed(cap):
    c = utilization(obs(300, 120, busy=1.0, completion=250), Settings(3, 0), 3, T, [point(3, 200)], cap)
    assert c.saturated and c.utilization >= 1.0 and c.held_by == cap.value
    assert c.utilization == pytest.approx(max(1.0, 300 / 200, 1.2))
    over = utilization(obs(300, 9000, busy=1.0, completion=250), Settings(3, 0), 3, T, [point(3, 200)], cap)
    assert over.utilization == SATURATED_MAX      # a queue in seconds does not ask for 90 pods
    assert hpa_desired(2, [c.utilization, c.utilization]) > 2


def test_capped_by_memory_at_the_target_from_the_policy_itself():
    """The policy's own ceiling and held_by: a budget that holds 2 instances of 100 MiB, p99 at the target."""
    limits = ModelLimits(p99_target_ms=T, max_instances=8, memory_budget_mb=250)
    mib = 2**20
    gpu = GpuObservation(0, 90.0, 200 * mib, 1000 * mib)
    o = obs(400, 100.0, busy=0.95, gpus=(gpu,))
    state = PolicyState(started_at=-100.0, instance_memory_bytes=100 * mib)
    d, state = decide(o, Settings(2, 0), state, limits, LoopConfig(), now=0.0)
    assert d.held_by is Cap.MEMORY
    ceiling, _ = instance_ceiling(Settings(2, 0), limits, state, o, 0.0)
    assert ceiling == 2
    c = utilization(o, Settings(2, 0), ceiling, T, state.perf, d.held_by)
    assert c.saturated and c.utilization >= 1.0 and c.held_by == "memory"


def test_at_the_ceiling_within_the_target_follows_the_load():
    pts = [point(2, 200)]
    low = utilization(obs(50, 20, busy=0.2), Settings(2, 0), 2, T, pts)
    high = utilization(obs(180, 60, busy=0.8), Settings(2, 0), 2, T, pts)
    assert low.utilization < high.utilization < 1.0 and not high.saturated
    near = utilization(obs(190, 99, busy=1.0), Settings(2, 0), 2, T, [])
    assert near.utilization == pytest.approx(0.99) and near.source == "extrapolated"
    busy_only = utilization(obs(190, None, busy=0.95), Settings(2, 0), 2, T, [])     # no p99: busy is the fraction
    assert busy_only.utilization == pytest.approx(0.95) and busy_only.p99_over_target is None


def test_points_that_missed_or_did_not_keep_up_do_not_count_as_capacity():
    pts = [point(2, 500, met=False), point(2, 400, completion=300), point(2, 100)]
    c = utilization(obs(90, 10, busy=0.05), Settings(2, 0), 2, T, pts)
    assert c.capacity_rps == pytest.approx(max(100, 90 / 0.1))
    assert c.utilization == pytest.approx(0.1)


def test_a_planner_figure_replaces_the_measured_one():
    c = utilization(obs(100, 30, busy=0.3), Settings(2, 0), 2, T, [point(2, 120)], planned_capacity_rps=400.0)
    assert c.source == "planner" and c.utilization == pytest.approx(100 / 400)
    # at the ceiling too, not floored by the rate over p99 / target (100 / 0.1 = 1,000 req/s)
    light = utilization(obs(100, 10, busy=0.3), Settings(2, 0), 2, T, planned_capacity_rps=400.0)
    assert light.source == "planner" and light.capacity_rps == pytest.approx(400.0)
    # a planner's figure under the rate served within the target: the rate served, at the limit, not past it
    under = utilization(obs(450, 90, busy=0.9), Settings(2, 0), 2, T, planned_capacity_rps=400.0)
    assert under.source == "measured" and under.utilization == pytest.approx(1.0) and not under.saturated


def test_below_the_ceiling_the_planner_replaces_the_linear_extrapolation():
    # the docstring's example: 1 instance, 90 req/s, p99 85 ms; the planner predicts 150 req/s for 2 (one device)
    c = utilization(obs(90, 85), Settings(1, 0), 2, T, planned_capacity_rps=150.0)
    assert c.source == "planner" and c.capacity_rps == pytest.approx(150.0) and c.utilization == pytest.approx(0.6)
    linear = utilization(obs(90, 85), Settings(1, 0), 2, T)
    assert linear.source == "extrapolated" and linear.capacity_rps == pytest.approx(2 * 90 / 0.85)
    # never under what the live count has been measured to do: a point that served 200 req/s at 1, or the rate it
    # serves now within the target
    served = utilization(obs(90, 85), Settings(1, 0), 2, T, [point(1, 200)], planned_capacity_rps=150.0)
    assert served.source == "measured" and served.capacity_rps == pytest.approx(200.0)
    now = utilization(obs(160, 85), Settings(1, 0), 2, T, planned_capacity_rps=150.0)
    assert now.source == "measured" and now.capacity_rps == pytest.approx(160.0)
    # but not floored by p99 / target read as the load's fraction: 90 req/s at 30 ms is not 300 req/s at 100 ms (at a
    # light load the p99 is the service time; seen: resnet_tiny, 300 req/s at 5 ms of 40, "2,400 req/s" on 2 cores)
    light = utilization(obs(90, 30), Settings(1, 0), 2, T, planned_capacity_rps=150.0)
    assert light.source == "planner" and light.capacity_rps == pytest.approx(150.0)
    assert utilization(obs(90, 30), Settings(1, 0), 2, T).capacity_rps == pytest.approx(2 * 90 / 0.3)   # no planner
    # and below the ceiling it stays under the headroom bound, however small the planner's figure
    small = utilization(obs(140, 95), Settings(1, 0), 2, T, planned_capacity_rps=150.0)
    assert small.utilization <= HEADROOM_MAX and not small.saturated


def test_below_the_ceiling_without_the_planner_the_instances_scale_by_their_contention():
    """The docstring's last example: where the planner's figure is not given (set aside) the live count's capacity
    scales to the ceiling by c(n) / c(N), c(k) = 1 + gamma (k - 1): with gamma 1.0 (instances that take turns on
    the device) the ceiling adds nothing; 0 (or unknown) is linear, as before."""
    turns = utilization(obs(90, 85), Settings(1, 0), 2, T, contention=1.0)
    assert turns.capacity_rps == pytest.approx(90 / 0.85) and turns.utilization == pytest.approx(HEADROOM_MAX)
    assert utilization(obs(90, 85), Settings(1, 0), 2, T, contention=0.0).capacity_rps == pytest.approx(2 * 90 / 0.85)
    # the MLP under serve: 1 instance measured at 372.4 req/s, 8 allowed, gamma 1.00 from the cores: 372.4, not 2,979
    mlp = utilization(obs(50.3, 26.44), Settings(1, 0), 8, T, [point(1, 372.4)], contention=1.0)
    assert mlp.capacity_rps == pytest.approx(372.4) and mlp.utilization == pytest.approx(50.3 / 372.4)
    assert utilization(obs(50.3, 26.44), Settings(1, 0), 8, T, [point(1, 372.4)]).capacity_rps == pytest.approx(8 * 372.4)
    # 2 of 4 instances, gamma 0.2: x 4/2 x 1.2 / 1.6
    part = utilization(obs(100, 50), Settings(2, 0), 4, T, contention=0.2)
    assert part.capacity_rps == pytest.approx(200 * 2 * 1.2 / 1.6)
    # a planner's figure, where given, is the capacity: the contention does not enter
    assert utilization(obs(90, 85), Settings(1, 0), 2, T, planned_capacity_rps=150.0,
                       contention=1.0).capacity_rps == pytest.approx(150.0)


def test_unknown_without_a_valid_observation_and_zero_without_traffic():
    assert utilization(Observation(valid=False), Settings(1, 0), 2, T) is None
    assert utilization(None, Settings(1, 0), 2, T) is None
    assert utilization(obs(0, None, busy=0.0), Settings(2, 0), 2, T).utilization == 0.0
    assert utilization(obs(0, None, busy=0.0), Settings(1, 0), 2, T).utilization == 0.0
    assert pod_utilization([None, None]) is None
    a = utilization(obs(50, 20, busy=0.2), Settings(2, 0), 2, T, [point(2, 200)])
    b = utilization(obs(300, 150, busy=1.0), Settings(2, 0), 2, T, [], Cap.MAX)
    assert pod_utilization([a, None, b]) == b.utilization


# ---- the gauges ---------------------------------------------------------------------------------------

def test_gauges_are_absent_until_known_then_removed_again():
    m = ControllerMetrics()
    text = lambda: generate_latest(m.registry).decode()  # noqa: E731
    m.capacity_of("a", None)
    m.pod_capacity_of(None)
    series = [ln for ln in text().splitlines() if ln.startswith("triton_autotune") and not ln.startswith("#")]
    assert series == []
    c = utilization(obs(300, 150, busy=1.0), Settings(2, 0), 2, T, [], Cap.MEMORY)
    m.capacity_of("a", c)
    m.pod_capacity_of(c.utilization)
    t = text()
    assert 'triton_autotune_capacity_utilization{model="a"} 1.5' in t   # p99 150 ms against 100
    assert 'triton_autotune_saturated{model="a"} 1.0' in t
    assert 'triton_autotune_p99_over_target{model="a"} 1.5' in t
    assert "triton_autotune_pod_capacity_utilization 1.5" in t
    assert "(ratio" in t and "(req/s)" in t
    m.capacity_of("a", None)
    m.pod_capacity_of(None)
    assert 'model="a"' not in text() and "triton_autotune_pod_capacity_utilization " not in text()


def test_metrics_address_is_validated_and_binds_where_told():
    assert LoopConfig().metrics_address == "127.0.0.1"
    assert parse_config({"controller": {"metrics_address": "0.0.0.0"}}).loop.metrics_address == "0.0.0.0"
    with pytest.raises(ConfigError, match="controller.metrics_address: must be an IP address"):
        parse_config({"controller": {"metrics_address": "pod-ip"}})
    m = ControllerMetrics()
    with pytest.raises(ValueError, match="loopback"):
        m.serve(0, "0.0.0.0")
    ep = m.serve(0, "0.0.0.0", allow_remote=True)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        ep.close()


@pytest.mark.parametrize("host, local", [
    ("127.0.0.1", True), ("127.8.0.1", True), ("localhost", True), ("LOCALHOST.", True), ("::1", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("10.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("pod-ip", False), ("", False)])
def test_one_loopback_check_for_the_endpoint_the_load_generator_and_run(host, local):
    assert is_loopback_host(host) is local


# ---- in the loop: /metrics and status_snapshot ---------------------------------------------------------

def test_the_loop_exports_the_figure_once_known_and_drops_it_when_the_server_is_gone():
    from test_loop_ticks import Clock, FakeModel, make, run_ticks
    clock = Clock()
    limits = ModelLimits(p99_target_ms=40.0, max_instances=1, max_delay_us=0)     # at its ceiling from the start
    ctl, control, scraper = make(["m"], {"m": FakeModel(50, 5, 4)}, clock, limits=limits)
    text = lambda: generate_latest(ctl.metrics.registry).decode()  # noqa: E731
    run_ticks(ctl, clock, 1)
    assert "triton_autotune_capacity_utilization{" not in text()          # one sample: no observation yet
    assert ctl.status_snapshot()["models"]["m"]["capacity"] is None
    run_ticks(ctl, clock, 6)
    snap = ctl.status_snapshot()["models"]["m"]["capacity"]
    assert snap is not None and 0 < snap["utilization"] < 1 and snap["ceiling"] == 1 and not snap["saturated"]
    assert 'triton_autotune_capacity_utilization{model="m"}' in text()
    assert "triton_autotune_pod_capacity_utilization " in text()
    control.down = scraper.down = True
    run_ticks(ctl, clock, 1)
    assert 'model="m"' not in "\n".join(ln for ln in text().splitlines() if ln.startswith("triton_autotune"))
    assert ctl.status_snapshot()["models"]["m"]["capacity"] is None


def test_status_shows_the_figure():
    from test_newcomer import SEEN

    from controller.status import format_model
    c = utilization(obs(300, 150, busy=1.0), Settings(2, 0), 2, T, [point(2, 200)], Cap.MAX)
    rows = dict((ln[:15].strip(), ln[15:]) for ln in format_model("m", dict(SEEN, capacity=c.as_dict()))[1:])
    assert rows["capacity"] == "150% of this pod's capacity with up to 2 instance(s) (200.0 req/s, saturated); SATURATED"
    under = utilization(obs(50, 20, busy=0.2), Settings(2, 0), 2, T, [point(2, 200)])
    rows = dict((ln[:15].strip(), ln[15:]) for ln in format_model("m", dict(SEEN, capacity=under.as_dict()))[1:])
    assert rows["capacity"] == "20% of this pod's capacity with up to 2 instance(s) (250.0 req/s, extrapolated)"
    # a trickle of load reads as what it is, not as "0.00" (seen: 5.2 req/s of 1,673 at 8 instances)
    from controller.status import _share
    assert [_share(x) for x in (5.2 / 1673.2, 0.0, 0.5, None, "x")] == ["0.3%", "0.0%", "50%", "?", "?"]


def test_status_shows_the_predicted_capacities_and_what_corrects_them():
    from test_newcomer import SEEN

    from controller.status import format_model

    def row(pred):
        return dict((ln[:15].strip(), ln[15:]) for ln in format_model("m", dict(SEEN, instances=2, predicted=pred))[1:])

    pred = {"capacity_rps": {"1": 120.0, "2": 260.5, "3": None}, "mode": "model"}
    assert row(pred)["predicted"] == ("within the target: 1 instance(s) 120.0 req/s; 2 instance(s) 260.5 req/s "
                                      "(live); 3 instance(s) ? req/s  [model]")
    untraced = row(dict(pred, correction={"x": 1.18, "from": "mean_tail"}))["predicted"]
    assert untraced.endswith("[model]; predictions x 1.18, from mean latencies x the tail Triton's summaries "
                             "measured (untraced)"), untraced
    assert row(dict(pred, correction={"x": 1.0, "from": "mean"}))["predicted"].endswith(
        "; predictions x 1.00, from mean latencies (untraced; the tail not yet checked)")
    assert row(dict(pred, correction={"x": 1.21, "from": "trace"}))["predicted"].endswith("; predictions x 1.21, from traced p99s")
    assert row(dict(pred, correction=None))["predicted"].endswith("[model]")
