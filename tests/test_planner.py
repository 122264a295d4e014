"""The planner's model of the server (controller/planner.py): a dynamic-batcher simulation."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from controller.planner import simulate
from controller.traces import COMPUTE_PROBS

SIM = lambda b: 6.0 + 1.5 * b  # noqa: E731  sim_accel's cost per execution with one instance (config.pbtxt)


def test_docstring_example_one_and_two_instances():
    one = simulate(100, 1, 0, 8, SIM)
    two = simulate(100, 2, 0, 8, SIM)
    assert one.stable and two.stable
    assert 15 <= one.p99_ms <= 25 and 1.1 <= one.mean_batch <= 1.4 and 0.55 <= one.busy <= 0.7
    assert two.p99_ms < one.p99_ms and two.mean_batch < one.mean_batch and two.busy < one.busy


def test_the_simulation_asks_the_curve_once_per_batch_size_and_gives_the_numbers_it_gave_before():
    # why: the controller's CPU is mostly these simulations; the loop works on plain floats and asks the curve once
    # for each batch size it forms. The pinned numbers are those of the loop before that change (059074c's parent),
    # so that a faster loop that simulates something else fails here (the arrivals are numpy's default_rng stream).
    asked: list[int] = []

    def curve(b: int) -> float:
        asked.append(b)
        return SIM(b)

    jitter = tuple(0.6 + 0.1 * i for i in range(len(COMPUTE_PROBS)))     # one quantile per point
    plain = simulate(300, 2, 1000, 8, curve, requests=1000)
    assert len(asked) == len(set(asked)) and 1 < len(asked) <= 8
    jittered = simulate(300, 2, 1000, 8, SIM, requests=1000, jitter=jitter)
    assert plain.p99_ms == pytest.approx(19.850019542783315, rel=1e-12)
    assert plain.mean_batch == pytest.approx(1.5923566878980893, rel=1e-12)
    assert jittered.p99_ms == pytest.approx(25.27984883242762, rel=1e-12)
    assert jittered.mean_batch == pytest.approx(1.7035775127768313, rel=1e-12)
    assert jittered.busy == pytest.approx(0.8035580435215206, rel=1e-12)


def test_light_load_is_one_request_per_batch_at_about_the_service_time():
    p = simulate(2, 1, 0, 8, SIM)
    assert p.mean_batch == pytest.approx(1.0, abs=0.02) and p.mean_ms == pytest.approx(7.5, abs=0.3)


def test_over_capacity_is_unstable():
    # full batches of 8 take 18 ms: one instance serves at most 444 req/s
    assert not simulate(600, 1, 0, 8, SIM).stable
    assert simulate(600, 3, 0, 8, SIM).stable


def test_a_delay_adds_latency_at_light_load_and_makes_bigger_batches():
    no_delay, delay = simulate(50, 1, 0, 8, SIM), simulate(50, 1, 4000, 8, SIM)
    assert delay.mean_batch > no_delay.mean_batch
    assert delay.mean_ms > no_delay.mean_ms + 1.0          # a lone request waits out (part of) the 4 ms


def test_a_delay_pays_when_a_fixed_cost_dominates_near_capacity():
    # 20 ms per execution whatever the batch: unbatched capacity is 50 req/s; at 45 req/s the queue is long
    fixed = lambda b: 20.0  # noqa: E731
    no_delay, delay = simulate(45, 1, 0, 8, fixed), simulate(45, 1, 2000, 8, fixed)
    assert delay.busy < no_delay.busy


def test_same_inputs_same_answer_and_no_prediction_without_arrivals():
    assert simulate(100, 1, 0, 8, SIM) == simulate(100, 1, 0, 8, SIM)
    assert simulate(0, 1, 0, 8, SIM) is None and simulate(math.nan, 1, 0, 8, SIM) is None
    assert simulate(10, 0, 0, 8, SIM) is None


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(0.1, 2000), n=st.integers(1, 8), delay=st.integers(0, 20000), mbs=st.integers(0, 64),
       alpha=st.floats(0, 50), beta=st.floats(0, 10))
def test_property_latencies_are_at_least_one_execution(rate, n, delay, mbs, alpha, beta):
    p = simulate(rate, n, delay, mbs, lambda b: alpha + beta * b, requests=300)
    assert p is not None
    assert p.p99_ms >= alpha + beta - 1e-6 and p.mean_ms >= alpha + beta - 1e-6
    assert 1 <= p.mean_batch <= max(1, mbs) and 0 <= p.busy <= 1 + 1e-9


def test_quantised_simulation_is_on_a_one_percent_grid_and_remembered():
    from controller.planner import _q, simulate_quantised
    assert _q(101.3) == pytest.approx(1.01 ** 464) and _q(0.0) == 0.0
    assert _q(299.0) == _q(300.0) != _q(306.0)
    a = simulate_quantised(300.0, 2, 0, 32, SIM)
    b = simulate_quantised(299.0, 2, 0, 32, lambda x: 6.0 + 1.5 * x)      # the same grid point, the same curve
    c = simulate_quantised(306.0, 2, 0, 32, SIM)
    assert a is b and a is not c
    exact = simulate(_q(300.0), 2, 0, 32, SIM, requests=1000)
    assert a.p99_ms == pytest.approx(exact.p99_ms, rel=0.03) and a.mean_batch == pytest.approx(exact.mean_batch, rel=0.03)


def test_quantised_simulation_follows_a_curve_with_a_single_size_bound():
    from controller.planner import simulate_quantised
    bound = lambda b: 9.0 * max(1.0, b / 2)  # noqa: E731  (service.ServiceFit with one size seen: 9 ms at b=2)
    p = simulate_quantised(150.0, 1, 0, 32, bound)
    assert p is not None and p.stable and p.p99_ms > 9.0


def test_requests_of_several_items_are_simulated_in_requests_with_their_items_service_time():
    """`items`: a batch of r requests of 4 items runs s(4r), a full batch holds max_batch / 4 requests, and the
    answer's batches are in items (simulate_quantised's doc)."""
    from controller.planner import simulate_quantised
    four = simulate_quantised(40.0, 1, 0, 32, SIM, items=4.0)
    same = simulate_quantised(40.0, 1, 0, 8, lambda r: SIM(4 * r))     # the same queue written in requests
    assert four.p99_ms == same.p99_ms and four.mean_batch == pytest.approx(4 * same.mean_batch)
    assert four.p99_ms >= SIM(4) and 4.0 <= four.mean_batch <= 32.0
    one = simulate_quantised(40.0, 1, 0, 32, SIM)                        # taken as 1 item each: far too fast
    assert one.p99_ms < 0.8 * four.p99_ms
    # more items than a full batch / 2: one request a batch; a mean between integers is kept on the 1% grid
    assert simulate_quantised(10.0, 1, 0, 32, SIM, items=20.0).mean_batch == pytest.approx(20.0, rel=0.011)
    assert simulate_quantised(40.0, 1, 0, 32, SIM, items=1.0) is one          # 1 item: the plain simulation
    assert simulate_quantised(40.0, 1, 0, 32, SIM, items=float("nan")) is one


def test_the_batchers_own_wait_is_found_one_step_a_window():
    """implicit_step: the wait (beyond the delay) at which the live configuration's simulation forms the batches the
    server formed, one grid step a window; none to read where a batch holds one request only or nothing came."""
    from controller.planner import implicit_step, simulate_quantised
    from controller.types import Settings
    live, curve = Settings(4, 0), lambda b: 7.14 + 1.555 * b      # sim_accel's fit in the batched bench (r68)
    server = simulate_quantised(95.0, 4, 1000, 32, curve, None, 4.0).mean_batch   # a batcher that waits ~1 ms
    wait, steps = 0, []
    for _ in range(5):
        wait = implicit_step([(95.0, 1.0)], live, curve, 32, 4.0, server, None, wait)
        steps.append(wait)
    assert steps == [250, 500, 1000, 1000, 1000]
    plain = simulate_quantised(95.0, 4, 0, 32, curve, None, 4.0).mean_batch      # batches as a 0-wait batcher's
    wait, steps = 1000, []
    for _ in range(4):
        wait = implicit_step([(95.0, 1.0)], live, curve, 32, 4.0, plain, None, wait)
        steps.append(wait)
    assert steps == [500, 250, 0, 0]
    # two loads in the window (a burst and a lull): their batches mix by their requests
    assert implicit_step([(40.0, 0.3), (150.0, 0.7)], live, curve, 32, 4.0, 50.0, None, 2000) == 2000   # the top
    assert implicit_step([(95.0, 1.0)], live, curve, 4, 4.0, 4.0) is None     # one request a batch: nothing to read
    assert implicit_step([(0.0, 1.0)], live, curve, 32, 4.0, 4.0) is None
    assert implicit_step([(95.0, 1.0)], live, curve, 32, 4.0, 0.0) is None
