"""Tests for controller.evaluation.loadgen: traces, schedules, the loopback guard, summaries, a real run."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script
from controller.evaluation.loadgen import (
    ERROR_CLIENT_OVERLOADED, ERROR_TIMEOUT, RequestRecord, TraceError, inputs_from_config,
    load_trace, make_inputs_from_config, make_resnet_tiny_inputs, poisson_schedule,
    gc_frozen, require_loopback, run_open_loop_sync, summarize,
)


def constant(name: str, duration_s: float, rate_rps: float) -> dict:
    return {"name": name, "duration_s": duration_s, "rate_rps": rate_rps}


# ------------------------------------------------------------------------------- shipped files
ROOT = Path(__file__).resolve().parents[1]
SCENARIO_FILES = sorted((ROOT / "scripts" / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path):
    """A scenario (or controller config) the README or bench_all.sh names must parse: a typo in one would surface only minutes
    into a bench, after its sweep."""
    import yaml
    from controller.config import load_config
    from controller.evaluation.bench_multi import is_multi_model_scenario, load_scenario
    raw = yaml.safe_load(path.read_text())
    if "controller" in raw or "defaults" in raw:       # a controller config shipped beside its repository
        assert load_config(path).models
    elif is_multi_model_scenario(path):
        scenario = load_scenario(path)
        assert len(scenario.models) == 2 and scenario.duration_s > 0
    else:
        trace = load_trace(path)
        assert trace.duration_s > 0 and trace.phases


def test_shipped_scenarios_are_found():
    assert {"shift", "bursty", "delay_matters", "heavy_day", "host_heavy", "two_models"} <= {p.stem for p in SCENARIO_FILES}


LINKED_MODELS = sorted(p for p in (ROOT / "scripts" / "scenarios" / "repos").glob("*/*/1/model.py") if p.is_symlink())


def test_the_profile_repositories_are_found():
    assert {p.parents[1].name for p in LINKED_MODELS} >= {"sim_fixed", "sim_heavy", "sim_host"}


@pytest.mark.parametrize("model_py", LINKED_MODELS, ids=lambda p: p.parents[1].name)
def test_scenario_repositories_link_the_simulated_model(model_py):
    """The profile repositories reuse model_repository/sim_accel/1/model.py through a relative link; a
    moved file would leave a dangling link that Triton reports only as a failed load."""
    assert model_py.resolve() == (ROOT / "model_repository" / "sim_accel" / "1" / "model.py").resolve()
    assert model_py.exists()


# --------------------------------------------------------------------------------------- traces
def test_trace_phases_rates_and_lookup():
    trace = load_trace({"phases": [
        constant("warm", 10, 100),
        {"name": "rise", "duration_s": 10, "ramp": [0, 200]},
        {"name": "spiky", "duration_s": 10, "rate_rps": 10,
         "burst": {"every_s": 2, "length_s": 0.5, "rate_rps": 200}},
    ]})
    assert trace.duration_s == 30
    assert [(p.name, p.start_s, p.end_s) for p in trace.phases] == [
        ("warm", 0, 10), ("rise", 10, 20), ("spiky", 20, 30)]
    assert trace.rate_at(5) == 100
    assert trace.rate_at(15) == pytest.approx(100)          # halfway up the ramp
    assert trace.rate_at(21.9) == 10                         # before the first burst (starts at +2 s)
    assert trace.rate_at(22.1) == 200 and trace.rate_at(24.4) == 200
    assert trace.rate_at(22.6) == 10
    assert trace.rate_at(30) == 0 and trace.rate_at(-1) == 0
    assert trace.phase_at(10).name == "rise" and trace.phase_at(9.999).name == "warm"
    assert trace.phase_at(30) is None
    # 1000 + 1000 + (10 * 10 + 4 bursts * 0.5 s * (200 - 10))
    assert trace.expected_requests() == pytest.approx(2480)


def test_trace_from_yaml_file(tmp_path: Path):
    path = tmp_path / "t.yaml"
    path.write_text("phases:\n  - {name: a, duration_s: 2, rate_rps: 5}\n  - {name: b, duration_s: 3, ramp: [5, 1]}\n")
    trace = load_trace(path)
    assert [p.name for p in trace.phases] == ["a", "b"] and trace.duration_s == 5


def test_day_curve_expands_to_named_sinusoid():
    trace = load_trace({"day_curve": {"duration_s": 120, "min_rps": 10, "max_rps": 100, "phases": 12}})
    names = [p.name for p in trace.phases]
    assert len(names) == 12 and len(set(names)) == 12
    assert names[0].startswith("night") and names[5].startswith("midday") and names[-1].startswith("night")
    assert any(n.startswith("morning") for n in names) and any(n.startswith("evening") for n in names)
    assert trace.duration_s == pytest.approx(120)
    assert trace.rate_at(0) == pytest.approx(10)            # night trough
    assert trace.rate_at(60) == pytest.approx(100)          # midday peak
    assert trace.rate_at(30) == pytest.approx(55)           # morning, halfway
    # continuous at every boundary
    for a, b in zip(trace.phases, trace.phases[1:]):
        assert a.to_rps == pytest.approx(b.from_rps)


VALID_PHASE = constant("p", 10, 5)
INVALID_TRACES = [
    pytest.param({}, "exactly one of 'phases'", id="no-phases"),
    pytest.param({"phases": [VALID_PHASE], "day_curve": {}}, "exactly one of 'phases'", id="both-forms"),
    pytest.param({"phases": []}, "non-empty list", id="empty-phases"),
    pytest.param({"phases": [VALID_PHASE], "bogus": 1}, "unknown field(s) bogus", id="unknown-top-key"),
    pytest.param({"phases": [{"duration_s": 1, "rate_rps": 1}]}, "phases[0]: missing required field(s) name", id="no-name"),
    pytest.param({"phases": [{"name": "", "duration_s": 1, "rate_rps": 1}]}, "phases[0].name", id="empty-name"),
    pytest.param({"phases": [constant("a", 0, 1)]}, "phases[0].duration_s: 0 is outside the valid range (0, 86400]", id="zero-duration"),
    pytest.param({"phases": [constant("a", "10", 1)]}, "phases[0].duration_s: expected a number in (0, 86400]", id="string-duration"),
    pytest.param({"phases": [constant("a", 1, -5)]}, "phases[0].rate_rps: -5 is outside the valid range [0, 100000]", id="negative-rate"),
    pytest.param({"phases": [constant("a", 1, float("nan"))]}, "phases[0].rate_rps: expected a number", id="nan-rate"),
    pytest.param({"phases": [constant("a", 1, True)]}, "phases[0].rate_rps: expected a number", id="bool-rate"),
    pytest.param({"phases": [VALID_PHASE, constant("b", 1, 2e5)]}, "phases[1].rate_rps: 200000 is outside", id="rate-too-high"),
    pytest.param({"phases": [{"name": "a", "duration_s": 1}]}, "exactly one of rate_rps or ramp", id="no-rate"),
    pytest.param({"phases": [{"name": "a", "duration_s": 1, "rate_rps": 1, "ramp": [1, 2]}]}, "exactly one of rate_rps or ramp", id="rate-and-ramp"),
    pytest.param({"phases": [{"name": "a", "duration_s": 1, "ramp": [1]}]}, "phases[0].ramp: expected [from_rps, to_rps]", id="short-ramp"),
    pytest.param({"phases": [{"name": "a", "duration_s": 1, "ramp": [1, -2]}]}, "phases[0].ramp[1] (to_rps)", id="negative-ramp"),
    pytest.param({"phases": [{"name": "a", "duration_s": 10, "rate_rps": 1, "burst": {"every_s": 2, "length_s": 2, "rate_rps": 9}}]},
                 "phases[0].burst.length_s", id="burst-too-long"),
    pytest.param({"phases": [{"name": "a", "duration_s": 10, "rate_rps": 1, "burst": {"every_s": 20, "length_s": 1, "rate_rps": 9}}]},
                 "phases[0].burst.every_s: 20 is outside the valid range (0, 10]", id="burst-every-beyond-phase"),
    pytest.param({"phases": [{"name": "a", "duration_s": 10, "rate_rps": 1, "burst": {"every_s": 2, "length_s": 1}}]},
                 "phases[0].burst: missing required field(s) rate_rps", id="burst-missing-rate"),
    pytest.param({"phases": [{"name": "a", "duration_s": 10, "ramp": [1, 2], "burst": {"every_s": 2, "length_s": 1, "rate_rps": 3}}]},
                 "bursts need a constant rate_rps", id="burst-on-ramp"),
    pytest.param({"phases": [VALID_PHASE, VALID_PHASE]}, "phases[1].name: 'p' is used twice", id="duplicate-name"),
    pytest.param({"phases": [constant("a", 86400, 1), constant("b", 1, 1)]}, "total duration 86401", id="too-long-total"),
    pytest.param({"day_curve": {"duration_s": 60, "min_rps": 50, "max_rps": 10, "phases": 4}},
                 "day_curve.max_rps: 10 is outside the valid range [50, 100000]", id="day-max-below-min"),
    pytest.param({"day_curve": {"duration_s": 60, "min_rps": 1, "max_rps": 10, "phases": 1}},
                 "day_curve.phases: expected an integer in [2, 1000]", id="day-one-phase"),
    pytest.param({"day_curve": {"duration_s": 60, "min_rps": 1, "max_rps": 10}},
                 "day_curve: missing required field(s) phases", id="day-missing-phases"),
]


@pytest.mark.parametrize("raw, message", INVALID_TRACES)
def test_invalid_traces_name_field_and_range(raw, message):
    with pytest.raises(TraceError) as info:
        load_trace(raw)
    assert message in str(info.value)


def test_unreadable_trace_file(tmp_path: Path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("phases: [unclosed")
    with pytest.raises(TraceError, match="not valid YAML at line 1, column 18: expected") as info:
        load_trace(bad)
    assert "\n" not in str(info.value)                  # one line, as the config's errors (PyYAML's spans several)


# ------------------------------------------------------------------------------------ schedules
def test_constant_schedule_count_and_poisson_gaps():
    trace = load_trace({"phases": [constant("c", 100, 50)]})
    offsets_s = poisson_schedule(trace, seed=7, max_requests=10_000)
    assert np.all(np.diff(offsets_s) >= 0) and offsets_s[0] >= 0 and offsets_s[-1] < 100
    assert abs(len(offsets_s) - 5000) < 4 * math.sqrt(5000)    # mean 5000, sd ~71
    gaps_s = np.diff(offsets_s)
    assert gaps_s.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps_s.std() / gaps_s.mean() == pytest.approx(1.0, abs=0.05)   # exponential: CV = 1


def test_schedule_is_deterministic_per_seed():
    trace = load_trace({"phases": [{"name": "r", "duration_s": 5, "ramp": [10, 100]}]})
    a, b = poisson_schedule(trace, 3, 10_000), poisson_schedule(trace, 3, 10_000)
    c = poisson_schedule(trace, 4, 10_000)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_ramp_schedule_shape():
    trace = load_trace({"phases": [{"name": "r", "duration_s": 20, "ramp": [0, 200]}]})
    offsets_s = poisson_schedule(trace, seed=1, max_requests=10_000)
    first, second = int((offsets_s < 10).sum()), int((offsets_s >= 10).sum())
    # expected 500 and 1500 (rate integrates to 0.5*100*10 and 0.5*(100+200)*10)
    assert abs(first - 500) < 4 * math.sqrt(500) and abs(second - 1500) < 4 * math.sqrt(1500)
    assert second / first == pytest.approx(3.0, rel=0.2)


def test_burst_schedule_concentrates_in_windows():
    trace = load_trace({"phases": [{"name": "b", "duration_s": 20, "rate_rps": 10,
                                    "burst": {"every_s": 4, "length_s": 1, "rate_rps": 300}}]})
    offsets_s = poisson_schedule(trace, seed=2, max_requests=10_000)
    in_burst = (offsets_s >= 4) & (np.mod(offsets_s, 4) < 1)
    # 4 bursts (at 4, 8, 12, 16 s) x 1 s x 300 rps = 1200; 16 s of base at 10 rps = 160
    assert abs(int(in_burst.sum()) - 1200) < 4 * math.sqrt(1200)
    assert abs(int((~in_burst).sum()) - 160) < 4 * math.sqrt(160)
    assert not np.any(offsets_s[offsets_s < 4] >= 4)


def test_schedule_refuses_to_exceed_max_requests():
    trace = load_trace({"phases": [constant("c", 10, 100)]})
    with pytest.raises(TraceError, match="max_requests=500"):
        poisson_schedule(trace, seed=0, max_requests=500)
    with pytest.raises(TraceError, match="max_requests"):
        poisson_schedule(trace, seed=0, max_requests=0)
    # Expected count (1000) within the bound but a draw above it: an error, never a truncation.
    seed = next(seed for seed in range(50) if len(poisson_schedule(trace, seed, 2000)) > 1000)
    with pytest.raises(TraceError, match=f"seed {seed} has .* more than max_requests=1000"):
        poisson_schedule(trace, seed=seed, max_requests=1000)


def test_zero_rate_trace_gives_empty_schedule():
    trace = load_trace({"phases": [constant("idle", 5, 0)]})
    assert poisson_schedule(trace, seed=0, max_requests=1).size == 0


# -------------------------------------------------------------------------------- loopback guard
@pytest.mark.parametrize("url, normalized", [
    ("127.0.0.1:8001", "127.0.0.1:8001"),
    ("127.10.20.30:1", "127.10.20.30:1"),
    ("localhost:8000", "localhost:8000"),
    ("LOCALHOST:8000", "localhost:8000"),
    ("[::1]:8001", "[::1]:8001"),
    ("[::ffff:127.0.0.1]:8001", "[::ffff:127.0.0.1]:8001"),
    ("http://127.0.0.1:8000", "127.0.0.1:8000"),
    ("grpc://localhost:8001", "localhost:8001"),
])
def test_loopback_targets_accepted(url, normalized):
    assert require_loopback(url) == normalized


@pytest.mark.parametrize("url", [
    "10.0.0.1:8001", "192.168.1.10:8000", "8.8.8.8:8001", "0.0.0.0:8001", "[::]:8001",
    "[2001:db8::1]:8001", "example.com:8001", "localhost.example.com:8001",
    "127.0.0.1@evil.example:8001", "[::ffff:10.0.0.1]:8001", "128.0.0.1:8001",
])
def test_non_loopback_targets_refused(url):
    with pytest.raises(ValueError, match="refusing|plain 'host:port'"):
        require_loopback(url)


@pytest.mark.parametrize("url", ["127.0.0.1", "", "ftp://127.0.0.1:21", "127.0.0.1:8001/v2"])
def test_malformed_targets_refused(url):
    with pytest.raises(ValueError):
        require_loopback(url)


def test_run_refuses_remote_target_before_connecting():
    with pytest.raises(ValueError, match="refusing"):
        run_open_loop_sync("10.1.2.3:8001", "resnet_tiny", [0.0], make_resnet_tiny_inputs())
    with pytest.raises(ValueError, match="refusing"):
        make_inputs_from_config("example.com:8000", "resnet_tiny")


# ------------------------------------------------------------------------------------ summaries
def rec(scheduled_s: float, latency_ms: float | None, error: str | None = None) -> RequestRecord:
    if error is not None:
        return RequestRecord(scheduled_s, scheduled_s, None, False, error)
    return RequestRecord(scheduled_s, scheduled_s, scheduled_s + latency_ms / 1000, True, None)


def test_summarize_worked_example():
    trace = load_trace({"phases": [constant("a", 2, 2), constant("b", 1.5, 2)]})
    records = [
        rec(0.1, 10), rec(0.5, 20), rec(0.7, 30), rec(0.9, 40),        # bin 0, phase a
        rec(1.2, 150), rec(1.6, None, ERROR_TIMEOUT),                   # bin 1, phase a
        # bin 2 (2-3 s, phase b) is empty
        rec(3.1, 50), rec(3.2, None, ERROR_CLIENT_OVERLOADED),          # bin 3 (3-3.5 s, half width)
    ]
    s = summarize(records, trace, sla_ms=100, bin_s=1.0)
    assert [(b.start_s, b.end_s) for b in s.bins] == [(0, 1), (1, 2), (2, 3), (3, 3.5)]
    b0, b1, b2, b3 = s.bins
    assert (b0.offered_rps, b0.completion_rps, b0.goodput_rps, b0.failed) == (4, 4, 4, 0)
    assert b0.p99_ms == pytest.approx(39.7)      # linear: 30 + 0.97 * (40 - 30)
    assert (b1.offered_rps, b1.completion_rps, b1.goodput_rps, b1.failed) == (2, 1, 0, 1)
    assert b1.p99_ms == pytest.approx(150)
    assert (b2.offered_rps, b2.completion_rps, b2.goodput_rps, b2.failed, b2.p99_ms) == (0, 0, 0, 0, None)
    assert (b3.offered_rps, b3.completion_rps, b3.goodput_rps, b3.failed) == (4, 2, 2, 1)   # per 0.5 s
    assert b3.p99_ms == pytest.approx(50)

    a, b = s.phases
    assert (a.name, a.requests, a.ok, a.failed) == ("a", 6, 5, 1)
    assert a.p50_ms == pytest.approx(30)         # median of 10, 20, 30, 40, 150
    assert a.p99_ms == pytest.approx(145.6)      # 40 + 0.96 * (150 - 40)
    assert a.goodput_rps == pytest.approx(2.0)   # 4 within SLA / 2 s
    assert a.offered_rps == pytest.approx(3.0)
    assert (b.requests, b.ok, b.failed) == (2, 1, 1)
    assert b.goodput_rps == pytest.approx(1 / 1.5) and b.p50_ms == pytest.approx(50)

    t = s.totals
    assert (t.requests, t.ok, t.failed, t.within_sla) == (8, 6, 2, 5)
    assert t.goodput_rps == pytest.approx(5 / 3.5)
    assert t.errors == {ERROR_TIMEOUT: 1, ERROR_CLIENT_OVERLOADED: 1}
    assert s.to_dict()["totals"]["ok"] == 6


def test_summarize_latency_counts_from_scheduled_time():
    trace = load_trace({"phases": [constant("a", 1, 1)]})
    late = RequestRecord(scheduled_s=0.0, sent_s=0.3, done_s=0.31, ok=True, error=None)  # 10 ms of service
    s = summarize([late], trace, sla_ms=100)
    assert s.phases[0].p50_ms == pytest.approx(310)
    assert s.totals.within_sla == 0                       # late send breaks the SLA


def test_summarize_all_empty_gives_none_percentiles():
    trace = load_trace({"phases": [constant("a", 2, 1)]})
    s = summarize([], trace, sla_ms=50, bin_s=0.5)
    assert len(s.bins) == 4 and all(b.p99_ms is None and b.offered_rps == 0 for b in s.bins)
    assert s.phases[0].p50_ms is None and s.totals.requests == 0


def test_inputs_from_config_builds_batch1_tensors():
    config = {"name": "m", "max_batch_size": 8, "input": [
        {"name": "X", "data_type": "TYPE_FP32", "dims": [3, -1]},
        {"name": "IDS", "data_type": "TYPE_INT64", "dims": ["4"]},
        {"name": "S", "data_type": "TYPE_STRING", "dims": [2]},
    ]}
    arrays = inputs_from_config(config, seed=0)()
    assert arrays["X"].shape == (1, 3, 1) and arrays["X"].dtype == np.float32
    assert arrays["IDS"].shape == (1, 4) and arrays["IDS"].dtype == np.int64
    assert arrays["S"].shape == (1, 2) and isinstance(arrays["S"][0, 0], bytes)
    no_batch = inputs_from_config({"max_batch_size": 0, "input": [{"name": "X", "data_type": "TYPE_FP16", "dims": [2]}]})()
    assert no_batch["X"].shape == (2,) and no_batch["X"].dtype == np.float16


# ------------------------------------------------------------------- late calls (no server: a fake client)
class _SlowClient:
    """Answers every infer after `answer_s`; counts the calls that finished and those cancelled."""

    def __init__(self, answer_s: float):
        self.answer_s, self.finished, self.cancelled = answer_s, 0, 0

    async def infer(self, model, inputs, headers=None):
        import asyncio
        try:
            await asyncio.sleep(self.answer_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1


def _drive(client, offsets, timeout_s, keep_late_calls):
    import asyncio

    from controller.evaluation.loadgen import _Run

    async def go():
        run = _Run(client, "m", [[]], np.asarray(offsets, float), timeout_s, 100, None, keep_late_calls=keep_late_calls)
        return run, await run.drive()
    return asyncio.run(go())


def test_late_grpc_calls_are_left_to_finish_not_cancelled():
    """A gRPC cancellation racing the answer crashes tritonserver 2.51 (server#7840): a late call is recorded
    as a timeout at its deadline, and the run waits for the call instead of cancelling it."""
    client = _SlowClient(answer_s=0.3)
    started = time.monotonic()
    run, records = _drive(client, [0.0, 0.01, 0.02], timeout_s=0.05, keep_late_calls=True)
    assert [r.error for r in records] == [ERROR_TIMEOUT] * 3 and all(r.done_s is None for r in records)
    assert (client.finished, client.cancelled, run.cancelled_at_end) == (3, 0, 0)
    assert time.monotonic() - started >= 0.3                    # it waited for them
    # without keeping them (HTTP): each is cut off at its deadline
    client = _SlowClient(answer_s=0.3)
    run, records = _drive(client, [0.0, 0.01, 0.02], timeout_s=0.05, keep_late_calls=False)
    assert [r.error for r in records] == [ERROR_TIMEOUT] * 3
    assert (client.finished, client.cancelled) == (0, 3)


def test_late_calls_still_out_after_the_wait_are_cancelled(monkeypatch):
    import controller.evaluation.loadgen as loadgen
    monkeypatch.setattr(loadgen, "ABANDONED_WAIT_S", 0.1)
    client = _SlowClient(answer_s=30.0)                          # a server that never answers in time
    started = time.monotonic()
    run, records = _drive(client, [0.0, 0.0], timeout_s=0.05, keep_late_calls=True)
    assert time.monotonic() - started < 5.0                     # bounded: max(timeout, wait) after the deadline
    assert [r.error for r in records] == [ERROR_TIMEOUT] * 2
    assert (client.finished, client.cancelled, run.cancelled_at_end) == (0, 2, 2)


# ---------------------------------------------------------------------------------- integration
@pytest.fixture(scope="module")
def server():
    from controller.server import ServerOptions, TritonServer, free_port

    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            models=["resnet_tiny"], startup_timeout_s=60)
    with TritonServer(options) as s:
        yield s


def test_open_loop_against_real_server(server):
    trace = load_trace({"phases": [constant("steady", 3, 30)]})
    schedule_s = poisson_schedule(trace, seed=11, max_requests=1000)
    records = run_open_loop_sync(server.grpc_url, "resnet_tiny", schedule_s, make_resnet_tiny_inputs(),
                                 timeout_s=10.0)
    assert len(records) == len(schedule_s) and 60 <= len(records) <= 120
    assert all(r.ok and r.error is None for r in records), {r.error for r in records if not r.ok}
    assert [r.scheduled_s for r in records] == pytest.approx(list(schedule_s))
    for r in records:
        assert r.sent_s >= r.scheduled_s                  # never sent early
        assert r.done_s >= r.sent_s
        assert r.latency_s == pytest.approx(r.done_s - r.scheduled_s) and r.latency_s >= 0
    assert max(r.sent_s - r.scheduled_s for r in records) < 0.5    # open loop: on time at 30 rps
    s = summarize(records, trace, sla_ms=1000)
    assert s.totals.ok == len(records) and s.phases[0].p99_ms is not None


def test_a_run_keeps_the_process_heap_out_of_the_garbage_collector(server, monkeypatch):
    # why: a full collection over a big heap (a test session's, a bench's) stops the client's event loop and
    # reads as server latency; gc_frozen's docstring has the measurement
    import gc

    from controller.evaluation import loadgen

    assert gc.get_freeze_count() == 0
    seen = []
    drive = loadgen._Run.drive

    async def probed(run):
        seen.append(gc.get_freeze_count())         # as the run starts sending
        return await drive(run)

    monkeypatch.setattr(loadgen._Run, "drive", probed)
    records = run_open_loop_sync(server.grpc_url, "resnet_tiny", np.linspace(0, 0.5, 10), make_resnet_tiny_inputs(),
                                 timeout_s=10.0)
    assert len(records) == 10 and all(r.ok for r in records)
    assert seen and seen[0] > 1000                 # while it drives, the objects alive before it are frozen
    assert gc.get_freeze_count() == 0              # and given back afterwards


def test_gc_frozen_nests_across_overlapping_runs():
    import gc

    assert gc.get_freeze_count() == 0
    with gc_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        garbage = [[] for _ in range(1000)]        # allocated while the first run drives ...
        # a frozen object that dies leaves the permanent generation, so the count may only fall while frozen
        # (another thread of a long session drops a few); a second freeze would add the 1000 lists at least
        with gc_frozen():
            assert 0 < gc.get_freeze_count() <= frozen     # ... stays collectable when a second starts
        del garbage
        assert 0 < gc.get_freeze_count() <= frozen     # the outer run is still measuring
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with gc_frozen():
            raise RuntimeError("a run that fails")
    assert gc.get_freeze_count() == 0              # given back on an exception too
    gc.freeze()                                    # the process's own freeze (a pre-fork server's) ...
    try:
        mine = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert gc.get_freeze_count() >= mine > 0   # ... is not undone by a run
    finally:
        gc.unfreeze()


def test_open_loop_http_and_config_inputs(server):
    make_inputs = make_inputs_from_config(server.http_url, "resnet_tiny")
    assert make_inputs()["INPUT"].shape == (1, 3, 32, 32)
    records = run_open_loop_sync(server.http_url, "resnet_tiny", np.linspace(0, 0.5, 10), make_inputs,
                                 protocol="http", timeout_s=10.0)
    assert len(records) == 10 and all(r.ok for r in records)


def test_open_loop_records_overload_and_timeouts(server):
    # Twenty requests due at once with room for one in flight: 19 are recorded, not dropped.
    records = run_open_loop_sync(server.grpc_url, "resnet_tiny", [0.0] * 20, make_resnet_tiny_inputs(),
                                 max_in_flight=1, timeout_s=10.0)
    errors = [r.error for r in records]
    assert len(records) == 20 and records[0].ok
    assert errors[1:] == [ERROR_CLIENT_OVERLOADED] * 19 and all(r.sent_s is None for r in records[1:])
    # A deadline far below one round trip: every request fails as a timeout, the run stays bounded.
    records = run_open_loop_sync(server.grpc_url, "resnet_tiny", [0.0, 0.01], make_resnet_tiny_inputs(),
                                 timeout_s=1e-5)
    assert [r.error for r in records] == [ERROR_TIMEOUT] * 2 and all(r.done_s is None for r in records)
    # 200 requests at once, 50 ms each to answer: far beyond this server; stragglers time out in flight
    # (sent, never done); their calls are left to finish (not cancelled) and the run ends once answered.
    started_s = time.monotonic()
    records = run_open_loop_sync(server.grpc_url, "resnet_tiny", [0.0] * 200, make_resnet_tiny_inputs(),
                                 timeout_s=0.05)
    assert time.monotonic() - started_s < 5.0
    timed_out = [r for r in records if r.error == ERROR_TIMEOUT]
    assert len(records) == 200 and len(timed_out) >= 100
    assert all(r.done_s is None for r in timed_out)
    assert any(r.sent_s is not None for r in timed_out)          # some were cut off while in flight
    # an answer counts as ok only if it came within the deadline; its done time is read when its task
    # resumes, which a loop busy with 200 tasks can delay on a loaded machine (CI once saw > 50 ms): a bound
    # of twice the deadline still catches a deadline that is not applied (the default is 10 s)
    assert all(r.latency_s <= 2 * 0.05 for r in records if r.ok)


def test_open_loop_grpc_late_calls_are_served_not_cancelled(server):
    """The server's own counts: every request sent was executed, none cancelled. Cancelled on timeout (before
    this was fixed), the server counted about half of these 200 as failures (98 and 132 in two runs here)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)

    def counts():
        stats = client.get_inference_statistics("resnet_tiny", as_json=True)["model_stats"][0]["inference_stats"]
        return int(stats["success"].get("count", 0)), int(stats["fail"].get("count", 0))

    # why: an earlier test's calls on this shared server, left to finish by design, can still land here (CI once
    # counted 202 for these 200: the two 10-us-deadline calls of the test before): start from counts that stand still
    before, deadline = counts(), time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = counts()
        if now == before:
            break
        before = now
    records = run_open_loop_sync(server.grpc_url, "resnet_tiny", [0.0] * 200, make_resnet_tiny_inputs(),
                                 timeout_s=0.05)
    sent = sum(r.sent_s is not None for r in records)
    assert sent > 0 and any(r.error == ERROR_TIMEOUT and r.sent_s is not None for r in records)
    deadline = time.monotonic() + 5.0
    while counts()[0] - before[0] < sent and time.monotonic() < deadline:
        time.sleep(0.1)
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (sent, 0)
    client.close()


def test_open_loop_unknown_model_fails_with_server_error(server):
    records = run_open_loop_sync(server.grpc_url, "no_such_model", [0.0, 0.05], make_resnet_tiny_inputs())
    assert len(records) == 2 and not any(r.ok for r in records)
    assert all(r.error not in (ERROR_TIMEOUT, ERROR_CLIENT_OVERLOADED) and "no_such_model" in r.error for r in records)


@pytest.mark.parametrize("script, argv, text", [
    ("grpc_cancel_repro", ["--arms", "cancel,bogus"], "--arms"), ("grpc_cancel_repro", ["--rate", "0"], "must be > 0"),
    ("gc_pause_repro", ["--arms", "plain,bogus"], "--arms"), ("gc_pause_repro", ["--every-s", "0"], "> 0"),
])
def test_the_repro_scripts_refuse_bad_arguments(capsys, script, argv, text):
    """scripts/grpc_cancel_repro.py, scripts/gc_pause_repro.py: a clear usage error, before any server starts."""
    with pytest.raises(SystemExit) as e:
        load_script(script).main(argv)
    assert e.value.code == 2 and text in capsys.readouterr().err


@pytest.mark.slow
def test_gc_pause_repro_runs_both_arms_and_puts_the_freeze_back(tmp_path):
    """The script's plumbing, not its numbers (those are timing: its docstring has them): each arm sweeps, and the
    load generator's freeze is the real one again afterwards."""
    from controller.evaluation import loadgen
    real = loadgen.gc_frozen
    rc = load_script("gc_pause_repro").main(["--objects", "1000", "--rates", "30", "--seconds", "1",
                                          "--out", str(tmp_path)])
    assert rc in (0, 1)                            # 1 only where a frozen cell missed the SLA on a slow machine
    for arm in ("plain", "frozen"):
        cells = json.loads((tmp_path / arm / "sweep.json").read_text())["cells"]
        assert len(cells) == 1 and cells[0]["failed"] == 0
    assert loadgen.gc_frozen is real
