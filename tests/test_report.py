"""The bench report: one Markdown table from several summary.json files, every number read, none made up."""
from __future__ import annotations

import json

import pytest

from controller.evaluation.report import ReportError, main, markdown


def _summary(tmp_path, name, **over):
    doc = {"scenario": f"scripts/scenarios/{name}.yaml", "sla_ms": 40.0,
           "best_static": {"instances": 2, "delay_us": 0},
           "arms": {"best_static": {"goodput_rps": 200.0, "instance_seconds": 360.0, "p99_ms": 27.4,
                                    "failed_requests": 0, "reloads": 0,
                                    "changes": [{"t": 0.0, "instances": 2, "delay_us": 0, "kind": "initial"}]},
                    "adaptive": {"goodput_rps": 190.0, "instance_seconds": 270.0, "p99_ms": 30.3,
                                 "failed_requests": 3, "reloads": 2,
                                 "changes": [{"t": 0.0, "instances": 1, "delay_us": 0, "kind": "initial"},
                                             {"t": 40.0, "instances": 3, "delay_us": 0, "kind": "in_place"},
                                             {"t": 90.0, "instances": 3, "delay_us": 2000, "kind": "full"}]}},
           "first_good_config_s": 2.0, "scale_up_lag_s": [{"lag_s": 4.5}, {"lag_s": 12.25}],
           "controller_cpu_pct": 1.5}
    doc.update(over)
    path = tmp_path / name / "summary.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    return path


def test_rows_carry_the_summary_numbers_and_ratios_to_best_static(tmp_path):
    text = markdown([_summary(tmp_path, "shift"), _summary(tmp_path, "bursty", sla_ms=25.0, scale_up_lag_s=[])])
    lines = text.splitlines()
    assert "| shift | 40 | best_static | 2 inst, 0 us | 200.0 | 1.00 | 360 | 1.00 | 27.4 | 0 | 0 |" in lines
    # 190/200 = 0.95 of the goodput, 270/360 = 0.75 of the instance-seconds; the range of counts and delays it ran
    assert "| shift | 40 | adaptive | 1-3 inst, 0/2000 us | 190.0 | 0.95 | 270 | 0.75 | 30.3 | 3 | 2 |" in lines
    assert "| bursty | 25 | adaptive | 1-3 inst, 0/2000 us | 190.0 | 0.95 | 270 | 0.75 | 30.3 | 3 | 2 |" in lines
    assert "- **shift** (adaptive): first good config 2 s; worst scale-up lag behind the oracle 12.2 s; controller CPU 1.50%" in lines
    assert "worst scale-up lag behind the oracle none (the oracle never scaled up)" in text
    both = markdown([_summary(tmp_path, "tight", scale_up_lag_s=[{"lag_s": 10.0, "first_up_s": 10.0},
                                                                 {"lag_s": 57.0, "first_up_s": 2.0}])])
    assert ("worst scale-up lag behind the oracle 57.0 s (to the oracle's count; its first scale-up at most 10.0 s "
            "after the oracle's)") in both
    none = markdown([_summary(tmp_path, "none", scale_up_lag_s=[{"lag_s": None, "first_up_s": None},
                                                                {"lag_s": 3.0, "first_up_s": 3.0}])])
    assert "3.0 s (to the oracle's count; on one step no scale-up at all)" in none


def test_a_missing_reference_arm_says_n_a_rather_than_a_ratio(tmp_path):
    p = _summary(tmp_path, "shift")
    doc = json.loads(p.read_text())
    del doc["arms"]["best_static"]
    p.write_text(json.dumps(doc))
    row = next(line for line in markdown([p]).splitlines() if "| adaptive |" in line)
    assert "| 190.0 | n/a | 270 | n/a |" in row


@pytest.mark.parametrize("content", ["not json", json.dumps({"arms": []}), json.dumps([1, 2])])
def test_a_file_that_is_not_a_summary_is_one_line_and_exit_2(tmp_path, capsys, content):
    p = tmp_path / "summary.json"
    p.write_text(content)
    with pytest.raises(ReportError, match="summary"):
        markdown([p])
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert main([str(tmp_path / "missing.json")]) == 2
