"""The model-accuracy report over observation logs (controller.evaluation.accuracy): pure, no server."""
from __future__ import annotations

import json

import pytest

from controller.decision_log import read_rotated
from controller.evaluation.accuracy import main, ratios, summarise


def _tick(model="m", observed=20.0, predicted=20.0, source="trace", samples=200, **obs) -> str:
    return json.dumps({"model": model, "obs": {"p99_ms": observed, "predicted_p99_ms": predicted,
                                               "p99_source": source, "p99_samples": samples, **obs}})


def test_the_docstring_example():
    a = summarise([1.04, 0.95, 1.10, 1.40])
    assert a.ticks == 4
    assert a.median_ratio == pytest.approx(1.07)
    assert a.median_error == pytest.approx(0.075)
    assert a.p90_error == pytest.approx(0.31)
    assert a.within == pytest.approx(0.75)
    assert summarise([]) is None


def test_only_traced_windows_with_enough_samples_and_a_prediction_count(tmp_path):
    lines = [
        _tick(observed=22.0, predicted=20.0),                      # counts: 1.10
        _tick(observed=30.0, predicted=20.0, source="summary"),    # not a trace
        _tick(observed=30.0, predicted=20.0, samples=99),          # too few traced requests
        _tick(observed=30.0, predicted=None),                      # no prediction (warm-up, fallback without a curve)
        _tick(observed=None, predicted=20.0),                      # no p99
        _tick(observed=30.0, predicted=0.0),                       # nonsense prediction
        json.dumps({"model": "m", "obs": {"valid": False, "why": "too_few_samples"}}),
        _tick(model="other", observed=18.0, predicted=20.0),       # another model: its own row
        json.dumps({"model": "m", "obs": ["not", "an", "object"]}),
        "{not json",                                               # torn: skipped by the reader
        "",
    ]
    log = tmp_path / "obs.jsonl"
    log.write_text("\n".join(lines) + "\n")
    per_model = ratios(read_rotated(log))
    assert per_model == {"m": [pytest.approx(1.10)], "other": [pytest.approx(0.90)]}
    assert ratios(read_rotated(log), min_samples=50)["m"] == [pytest.approx(1.10), pytest.approx(1.5)]


def test_rotated_files_are_read_too(tmp_path):
    log = tmp_path / "obs.jsonl"
    log.write_text(_tick(observed=21.0) + "\n")
    (tmp_path / "obs.jsonl.1").write_text(_tick(observed=27.0) + "\n")     # JsonLog's rotation: older records
    assert ratios(read_rotated(log)) == {"m": [pytest.approx(1.35), pytest.approx(1.05)]}


def test_cli_prints_a_row_per_model_and_refuses_a_missing_log(tmp_path, capsys):
    log = tmp_path / "adaptive_observations.jsonl"
    log.write_text("\n".join([_tick(observed=21.0), _tick(observed=27.0), _tick(model="b", observed=19.0)]) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(log), str(empty)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == f"| {log} | b | 1 | 0.95 | 0.05 | 0.05 | 100% |"
    assert out[3] == f"| {log} | m | 2 | 1.20 | 0.20 | 0.32 | 50% |"
    assert out[4] == f"| {empty} | - | 0 | - | - | - | - |"
    assert main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such observation log" in capsys.readouterr().err
    assert main([str(log), "--min-samples", "0"]) == 2


def test_mean_mode_compares_the_counters_mean_with_the_predicted_mean_traced_or_not(tmp_path, capsys):
    def tick(mean, predicted_mean, rps=50.0, span=10.0, source="mean_x_tail_ratio"):
        return _tick(observed=40.0, predicted=20.0, source=source, samples=0, mean_ms=mean,
                     predicted_mean_ms=predicted_mean, completion_rps=rps, span_s=span)

    lines = [tick(11.0, 10.0),                        # 500 requests: 1.10
             tick(9.0, 10.0, source="trace"),          # traced windows count too: 0.90
             tick(30.0, 10.0, rps=5.0, span=10.0),     # 50 requests: too few at the default 100
             tick(12.0, None),                         # no predicted mean (no curve yet)
             tick(12.0, 10.0, rps=None)]               # no rate: the requests are unknown
    log = tmp_path / "obs.jsonl"
    log.write_text("\n".join(lines) + "\n")
    assert ratios(read_rotated(log), mean=True) == {"m": [pytest.approx(1.10), pytest.approx(0.90)]}
    assert ratios(read_rotated(log)) == {}              # the p99 mode: nothing traced with samples
    assert main([str(log), "--mean"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "median observed/predicted mean" in out[0]
    assert out[2] == f"| {log} | m | 2 | 1.00 | 0.10 | 0.10 | 100% |"
