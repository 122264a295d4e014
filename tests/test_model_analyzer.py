"""Tests for controller.evaluation.model_analyzer and the bench's model_analyzer arm, pure parts only:
MA's config for the bench's grid, its result table and pick, a variant's config, the pick file the
bench reads, and the summary lines. Model Analyzer itself is not run here (scripts/model_analyzer.sh
runs it; its measured result is in docs/bench/model_analyzer_shift.json).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT

from controller.cli import main
from controller.evaluation.bench import (
    ARMS, BenchError, bench_ratios, evaluate_targets, format_summary, load_model_analyzer,
)
from controller.evaluation.model_analyzer import (
    MARow, ModelAnalyzerError, best_row, configs_table, load_pick, ma_config, model_analyzer_lines,
    parse_inference_csv, pick_document, settings_from_pbtxt, summary_entry, summary_report_best,
    time_to_tuned_line,
)
from controller.types import Settings

# As MA 1.58 writes it: configs in its ranking, each config's passing measurements first.
CSV = """Model,Batch,Concurrency,Model Config Path,Instance Group,Max Batch Size,Satisfies Constraints,Throughput (infer/sec),p99 Latency (ms)
sim_accel,1,16,sim_accel_config_2,4:CPU,32,Yes,610.2,35.1
sim_accel,1,8,sim_accel_config_2,4:CPU,32,Yes,540.0,20.3
sim_accel,1,32,sim_accel_config_2,4:CPU,32,No,640.0,61.0
sim_accel,1,8,sim_accel_config_1,2:CPU,32,Yes,400.5,30.0
sim_accel,1,1,sim_accel_config_default,1:CPU,32,Yes,107.8,13.7
"""

NONE_PASS = """Model,Batch,Concurrency,Model Config Path,Instance Group,Max Batch Size,Satisfies Constraints,Throughput (infer/sec),p99 Latency (ms)
sim_accel,1,32,sim_accel_config_2,4:CPU,32,No,640.0,61.0
sim_accel,1,1,sim_accel_config_default,1:CPU,32,No,107.8,45.0
"""

VARIANT_PBTXT = """name: "sim_accel"
max_batch_size: 32
instance_group {
  count: 4
  kind: KIND_CPU
}
dynamic_batching {
  max_queue_delay_microseconds: 2000
}
parameters {
  key: "device_parallelism"
  value {
    string_value: "2"
  }
}
"""

VARIANTS = {"sim_accel_config_2": Settings(4, 2000), "sim_accel_config_1": Settings(2, 0),
            "sim_accel_config_default": Settings(1, 0)}


def test_parse_inference_csv_keeps_mas_order_and_reads_the_columns():
    rows = parse_inference_csv(CSV)
    assert [r.variant for r in rows][:3] == ["sim_accel_config_2"] * 3
    assert rows[0] == MARow("sim_accel_config_2", 16, True, 610.2, 35.1)
    assert rows[2].satisfies is False


def test_parse_inference_csv_names_a_missing_column():
    with pytest.raises(ModelAnalyzerError, match="Satisfies Constraints"):
        parse_inference_csv("Model,Model Config Path\nsim_accel,sim_accel_config_0\n")


def test_the_pick_is_the_first_row_meeting_the_constraint():
    rows = parse_inference_csv(CSV)
    assert best_row(rows).variant == "sim_accel_config_2"
    assert pick_document(rows, VARIANTS) == {"variant": "sim_accel_config_2", "instances": 4, "delay_us": 2000,
                                             "concurrency": 16, "throughput_rps": 610.2, "p99_ms": 35.1}
    # a failing first row is skipped (MA lists a config's failing measurements after its passing ones)
    rows2 = [MARow("a", 32, False, 9.0, 99.0), MARow("b", 4, True, 5.0, 10.0)]
    assert best_row(rows2).variant == "b"


def test_no_pick_when_nothing_meets_the_constraint():
    assert pick_document(parse_inference_csv(NONE_PASS), VARIANTS) is None


def test_a_pick_without_its_variant_config_is_an_error():
    with pytest.raises(ModelAnalyzerError, match="sim_accel_config_2"):
        pick_document(parse_inference_csv(CSV), {})


def test_configs_table_one_entry_per_config_with_its_best_passing_measurement():
    table = configs_table(parse_inference_csv(CSV), VARIANTS)
    assert [t["variant"] for t in table] == ["sim_accel_config_2", "sim_accel_config_1", "sim_accel_config_default"]
    assert table[0]["measurements"] == 3 and table[0]["best_passing"]["concurrency"] == 16
    assert table[0]["instances"] == 4 and table[0]["delay_us"] == 2000


def test_settings_from_pbtxt_both_instance_group_forms():
    assert settings_from_pbtxt(VARIANT_PBTXT) == Settings(4, 2000)
    # the shipped config (a list, and a comment naming 'count' elsewhere does not count)
    shipped = (ROOT / "model_repository" / "sim_accel" / "config.pbtxt").read_text()
    assert settings_from_pbtxt(shipped) == Settings(1, 0)
    # MA leaves out a zero delay: `dynamic_batching { }`
    assert settings_from_pbtxt("instance_group { count: 6 kind: KIND_CPU }\ndynamic_batching {\n}\n") == Settings(6, 0)
    two_groups = "instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 kind: KIND_CPU } ]"
    assert settings_from_pbtxt(two_groups) == Settings(3, 0)


def test_summary_report_best_reads_the_first_config_of_the_table():
    html = ("<p>In 4 measurements across 2 configurations, sim_accel_config_default provides no gain</p>"
            "<table><tr><th>Model Config Name</th></tr><tr><td>sim_accel_config_3</td></tr>"
            "<tr><td>sim_accel_config_default</td></tr></table>")
    assert summary_report_best(html, "sim_accel") == "sim_accel_config_3"
    assert summary_report_best("<p>nothing</p>", "sim_accel") is None


def test_ma_config_is_the_bench_grid_under_the_sla(tmp_path):
    cfg = ma_config(model="sim_accel", repository=Path("/repo"), work=tmp_path, sla_ms=40, instances=[1, 2, 4, 6],
                    delays_us=[0, 2000], concurrency=[1, 2, 4], tritonserver=Path("/bin/tritonserver"),
                    perf_analyzer=Path("/venv/bin/perf_analyzer"), backend_dir=Path("/b"), ports=(1, 2, 3),
                    environment={"SIM_ACCEL_DIR": "/x"})
    assert cfg["triton_launch_mode"] == "local" and cfg["run_config_search_disable"] is True
    assert cfg["constraints"] == {"perf_latency_p99": {"max": 40.0}}
    m = cfg["profile_models"]["sim_accel"]
    assert m["cpu_only"] is True and m["parameters"] == {"concurrency": [1, 2, 4]}
    assert [g[0]["count"] for g in m["model_config_parameters"]["instance_group"]] == [1, 2, 4, 6]
    assert m["model_config_parameters"]["dynamic_batching"] == {"max_queue_delay_microseconds": [0, 2000]}
    # every endpoint on loopback, on the ports given
    assert cfg["triton_server_flags"]["http-address"] == "127.0.0.1"
    assert cfg["triton_grpc_endpoint"] == "localhost:2" and cfg["triton_metrics_url"] == "http://localhost:3/metrics"


def _write(tmp_path, doc) -> Path:
    p = tmp_path / "model_analyzer.json"
    p.write_text(json.dumps(doc))
    return p


def test_load_pick_and_the_benchs_checks(tmp_path):
    good = {"model": "sim_accel", "sla_ms": 40.0, "wall_s": 300.5, "version": "1.58.0",
            "pick": {"variant": "sim_accel_config_2", "instances": 4, "delay_us": 2000}}
    settings, doc = load_pick(_write(tmp_path, good))
    assert settings == Settings(4, 2000) and doc["wall_s"] == 300.5
    assert load_model_analyzer(_write(tmp_path, good), "sim_accel", 40.0)[0] == Settings(4, 2000)
    with pytest.raises(BenchError, match="100 ms"):
        load_model_analyzer(_write(tmp_path, good), "sim_accel", 100.0)
    with pytest.raises(BenchError, match="resnet_tiny"):
        load_model_analyzer(_write(tmp_path, good), "resnet_tiny", 40.0)
    # a failed run has no pick: the bench says why instead of running a made-up arm
    failed = {"model": "sim_accel", "sla_ms": 40.0, "wall_s": 12.0, "pick": None, "error": "MA wrote no results"}
    with pytest.raises(ModelAnalyzerError, match="no Model Analyzer pick .MA wrote no results"):
        load_pick(_write(tmp_path, failed))
    with pytest.raises(ModelAnalyzerError):
        load_pick(tmp_path / "missing.json")


def test_time_to_tuned_line():
    assert time_to_tuned_line(412.3, 3.0) == ("time-to-tuned: Model Analyzer 412 s offline (before serving) "
                                              "vs adaptive 3 s online (first_good_config_s), 137x")
    assert time_to_tuned_line(412.3, None) == ("time-to-tuned: Model Analyzer 412 s offline (before serving) "
                                               "vs adaptive not measured")


def _arm(goodput: float, inst_s: float) -> dict:
    return {"goodput_rps": goodput, "requests": 100, "failed_requests": 0, "errors": {}, "p99_ms": 20.0,
            "p99_ms_by_phase": {"a": 20.0}, "goodput_rps_by_phase": {"a": goodput}, "instance_seconds": inst_s,
            "mean_instances": inst_s / 180, "reloads": 0, "full_reloads": 0, "changes": []}


def test_summary_with_the_fifth_arm():
    arms = {"default": _arm(100.0, 180.0), "best_static": _arm(250.0, 360.0), "oracle": _arm(260.0, 300.0),
            "adaptive": _arm(240.0, 252.0), "model_analyzer": _arm(245.0, 720.0)}
    ratios = bench_ratios(arms)
    assert ratios["adaptive_vs_model_analyzer"] == pytest.approx(240 / 245)
    assert ratios["instance_seconds_adaptive_vs_model_analyzer"] == pytest.approx(0.35)
    assert "adaptive_vs_model_analyzer" not in bench_ratios({k: arms[k] for k in ARMS})
    summary = {"arms": arms, "ratios": ratios, "reaction_s": [], "first_good_config_s": 3.0,
               "controller_cpu_pct": 0.5, "sla_ms": 40.0}
    summary["targets"] = evaluate_targets(summary)
    assert summary["targets"]["failed_requests_every_arm"]["met"] is True   # five arms still count as all
    ma_doc = {"version": "1.58.0", "wall_s": 412.3, "sla_ms": 40.0, "grid": {"concurrency": [1, 2, 4, 8, 16, 32]},
              "pick": {"variant": "sim_accel_config_5", "instances": 4, "delay_us": 0}}
    summary.update(summary_entry(ma_doc, "docs/bench/model_analyzer_shift.json"))
    assert summary["model_analyzer_wall_s"] == 412.3
    assert summary["model_analyzer"]["pick"]["instances"] == 4
    lines = model_analyzer_lines(summary)
    assert lines == [
        "model_analyzer: pick 4 inst, 0 us (Model Analyzer 1.58.0, p99 <= 40.0 ms, closed-loop concurrency 1..32)",
        "time-to-tuned: Model Analyzer 412 s offline (before serving) vs adaptive 3 s online (first_good_config_s), 137x",
        "whole trace: goodput adaptive 240.0/s vs model_analyzer 245.0/s (0.980); "
        "instance-s adaptive 252 vs model_analyzer 720 (0.350)"]
    table = format_summary(summary)
    assert "\nmodel_analyzer " in table and lines[1] in table


def test_cli_bench_refuses_a_model_analyzer_file_without_a_pick(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("phases:\n  - {name: a, duration_s: 2, rate_rps: 10}\n")
    ma = _write(tmp_path, {"model": "sim_accel", "sla_ms": 40.0, "wall_s": 5.0, "pick": None,
                           "error": "no config met the p99 <= 40 ms constraint"})
    assert main(["bench", "--scenario", str(scenario), "--arms", "default", "--model-analyzer", str(ma),
                 "--out", str(tmp_path / "o")]) == 2
    assert "no Model Analyzer pick" in capsys.readouterr().err
