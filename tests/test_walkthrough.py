"""scripts/walkthrough.py: one model under `serve` with a phased load, summarised from the controller's own logs."""
from __future__ import annotations

import json

import pytest

from conftest import load_script


@pytest.mark.parametrize("argv, says", [
    (["--phases", "6"], "RATExSECONDS"), (["--phases", "ax10"], "RATExSECONDS"), (["--phases", "0x10"], "> 0"),
    (["--phases", "5x-1"], "> 0"), (["--phases", ","], "at least one"),
])
def test_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        load_script("walkthrough").main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_phases():
    assert load_script("walkthrough").parse_phases("6x150, 25x40") == [
        {"name": "p0", "duration_s": 150.0, "rate_rps": 6.0}, {"name": "p1", "duration_s": 40.0, "rate_rps": 25.0}]


def _tick(t, reason, mode, p99=None, predicted=None, model="m"):
    return {"t": t, "model": model, "reason": reason, "mode": mode,
            "obs": {k: v for k, v in (("p99_ms", p99), ("predicted_p99_ms", predicted)) if v is not None}}


def test_summary_counts_who_decided_and_how_well():
    ticks = [_tick(100.0, "HoldWarmup", None, 50.0, 10.0),           # a gate: neither mode nor ratio
             _tick(102.0, "HoldPredictedOk", "model", 20.0, 10.0),
             _tick(104.0, "HoldPredictedOk", "model", 10.0, 10.0),
             _tick(106.0, "HoldSteady", "fallback", 30.0, 10.0),
             _tick(108.0, "HoldSteady", "fallback", 40.0),             # no prediction: no ratio
             _tick(108.0, "HoldSteady", "fallback", 40.0, 1.0, model="other")]
    decisions = [{"t": 103.0, "model": "m", "action": "started", "reason": "ScaleUpPredicted"},
                 {"t": 104.5, "model": "m", "action": "applied", "reason": "ScaleUpPredicted",
                  "target": {"instances": 2, "delay_us": 0}},
                 {"t": 105.0, "model": "other", "action": "applied", "reason": "ScaleDownIdle"}]
    s = load_script("walkthrough").summarise(ticks, decisions, "m")
    assert s["ticks"] == 5 and s["modes"] == {"model": 2, "fallback": 2}
    assert s["reasons"] == {"HoldWarmup": 1, "HoldPredictedOk": 2, "HoldSteady": 2}
    assert s["traced_over_predicted"] == {"ticks": 3, "median": 2.0, "p10": 1.0, "p90": 3.0}
    assert s["changes"] == [{"t_s": 4.5, "reason": "ScaleUpPredicted", "target": {"instances": 2, "delay_us": 0}}]
    empty = load_script("walkthrough").summarise([], [], "m")
    assert empty["ticks"] == 0 and empty["traced_over_predicted"]["median"] is None


@pytest.mark.slow
def test_a_short_walkthrough_of_sim_accel(tmp_path, capsys):
    out = tmp_path / "walk"
    rc = load_script("walkthrough").main(["--model", "sim_accel", "--phases", "40x45", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0 and summary["failed"] == 0 and summary["requests"] > 1400, summary
    assert summary["ticks"] >= 5, summary
    # past the first window (20 s) and the ownership claim's reload, ticks are decided; the status shows the model
    assert sum(summary["modes"].values()) >= 1, summary
    assert "sim_accel" in (out / "status.txt").read_text()
    assert "decided by the planner's model" in capsys.readouterr().out
