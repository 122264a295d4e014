"""The two-model bench: scenario parsing, splits, and a tiny end-to-end run on real servers."""
from __future__ import annotations

import json
import warnings

import pytest

from controller.evaluation.bench_multi import (MultiBenchError, _peak_total, bench_multi, format_summary,
                                               is_multi_model_scenario, load_scenario, static_splits)


def test_static_splits_cover_every_split_with_one_instance_each():
    assert static_splits(3) == [(1, 2), (2, 1)]
    assert static_splits(4) == [(1, 3), (2, 2), (3, 1)]


def test_peak_total_counts_instances_alive_at_once():
    events = {"a": [(0.0, 1), (10.0, 2), (30.0, 1)], "b": [(0.0, 1), (20.0, 2)]}
    assert _peak_total(events) == 4        # 10..30 s: a=2, and from 20 s b=2
    assert _peak_total({"a": [(0.0, 2), (5.0, 1)], "b": [(0.0, 1), (6.0, 2)]}) == 3


@pytest.mark.parametrize("doc,message", [
    pytest.param("models: {a: {phases: []}}", "exactly two models", id="one-model"),
    pytest.param("sla_ms: -1\nbudget_instances: 3\nmodels: {a: {phases: [{name: x, duration_s: 1, rate_rps: 1}]}, "
                 "b: {phases: [{name: y, duration_s: 1, rate_rps: 1}]}}", "sla_ms must be a number in (0, 60000]", id="bad-sla"),
    pytest.param("sla_ms: 40\nbudget_instances: 1\nmodels: {a: {phases: [{name: x, duration_s: 1, rate_rps: 1}]}, "
                 "b: {phases: [{name: y, duration_s: 1, rate_rps: 1}]}}", "budget_instances must be an integer in [2, 16]",
                 id="budget-too-small"),
    pytest.param("sla_ms: 40\nbudget_instances: 3\nmodels: {a: {phases: [{name: x, duration_s: 1, rate_rps: -5}]}, "
                 "b: {phases: [{name: y, duration_s: 1, rate_rps: 1}]}}", "models.a.phases[0].rate_rps", id="bad-rate"),
    pytest.param("models:\n  a: {phases: [oops\n", "not valid YAML at line 3, column 1: expected ',' or ']'",
                 id="malformed-yaml"),
])
def test_bad_scenarios_say_what_is_wrong(tmp_path, doc, message):
    path = tmp_path / "s.yaml"
    path.write_text(doc)
    with pytest.raises(MultiBenchError, match=None) as err:
        load_scenario(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_shipped_scenario_is_a_two_model_scenario():
    from conftest import ROOT
    path = ROOT / "scripts" / "scenarios" / "two_models.yaml"
    assert is_multi_model_scenario(path)
    sc = load_scenario(path)
    assert set(sc.models) == {"sim_a", "sim_b"} and sc.budget_instances == 3
    assert sc.models["sim_a"].duration_s == sc.models["sim_b"].duration_s == 150
    assert not is_multi_model_scenario(ROOT / "scripts" / "scenarios" / "shift.yaml")
    tight = load_scenario(ROOT / "scripts" / "scenarios" / "two_models_tight.yaml")   # the same traffic at 25 ms
    assert tight.sla_ms == 25 and tight.budget_instances == 3 and tight.models == sc.models


def test_tiny_two_model_bench_end_to_end(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text("""
name: tiny
sla_ms: 40
budget_instances: 3
models:
  sim_a: {phases: [{name: a1, duration_s: 4, rate_rps: 60}, {name: a2, duration_s: 4, rate_rps: 10}]}
  sim_b: {phases: [{name: b1, duration_s: 4, rate_rps: 10}, {name: b2, duration_s: 4, rate_rps: 60}]}
""")
    out = tmp_path / "out"
    summary = bench_multi(scenario, out)
    died = {name: arm["server_restarts"] for name, arm in summary["arms"].items() if arm.get("server_restarts")}
    if died:
        # why: tritonserver 2.51 itself can die under in-place instance updates (CI, 2026-12-07: SIGSEGV in
        # __libc_free under TRITONSERVER_ServerInferAsync in the adaptive arm; the bench started it again and 155
        # requests failed while it was down; upstream server#7723). As in test_two_pods: nothing about the arms can
        # be judged from a run whose server died; run it once more, and fail if a server dies again.
        warnings.warn(f"tritonserver died during the tiny two-model bench ({died}); running it again")
        out = tmp_path / "out2"
        summary = bench_multi(scenario, out)
        assert not any(arm.get("server_restarts") for arm in summary["arms"].values()), summary["arms"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["ratios"] == summary["ratios"]
    assert set(summary["arms"]) == {"static_1+2", "static_2+1", "adaptive"}
    for arm in summary["arms"].values():
        assert arm["failed_requests"] == 0
        assert set(arm["models"]) == {"sim_a", "sim_b"}
        assert arm["models"]["sim_a"]["requests"] > 100 and arm["goodput_rps"] > 0
        # the server's own time per execution, per model and phase (sim_accel: 7.5 ms of sleeps at batch 1)
        assert 7.0 < arm["models"]["sim_a"]["server_exec_ms_by_phase"]["a1"]["1"] < 25.0
        assert set(arm["models"]["sim_b"]["server_exec_ms_by_phase"]) == {"b1", "b2"}
    assert summary["arms"]["static_1+2"]["instance_seconds"] == pytest.approx(3 * 8, rel=0.01)
    assert summary["best_static"] in ("static_1+2", "static_2+1")
    assert summary["targets"]["within_budget"]["met"]
    assert summary["ratios"]["adaptive_vs_best_static_split"] > 0
    # the ceiling: (4 x 60 + 4 x 10) x 2 requests scheduled over 8 s, whatever the arms served
    assert summary["offered_rps"] == pytest.approx(70.0, rel=0.2)
    assert summary["ratios"]["ceiling_vs_best_static_split"] == pytest.approx(
        summary["offered_rps"] / summary["arms"][summary["best_static"]]["goodput_rps"])
    assert summary["ratios"]["ceiling_vs_best_static_split"] >= 0.99 * max(
        a["goodput_rps"] for a in summary["arms"].values()) / summary["arms"][summary["best_static"]]["goodput_rps"]
    assert "the most any arm can reach" in format_summary(summary)
    assert "sim_b: server ms per execution of 1 (per phase):" in format_summary(summary)
    assert (out / "timeline.png").stat().st_size > 10_000
