"""Two SIMULATED-accelerator models on one simulated device and one memory budget, on a real server:
instances move from the model whose traffic stopped to the one whose traffic rose, never over the budget."""
from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from conftest import ROOT, start_server
from controller.actuation import TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync
from controller.loop import Controller

MiB = 2**20
BUDGET_MB = 200          # 64 MiB per instance: 3 instances fit in all, 4 do not


@pytest.fixture(scope="module")
def two_model_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name in ("sim_a", "sim_b"):
        shutil.copytree(ROOT / "model_repository" / "sim_accel", repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        cfg = repo / name / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace('name: "sim_accel"', f'name: "{name}"'))
    s = start_server(["sim_a", "sim_b"], repository=repo)
    yield s
    s.stop()


def _load(server, model, rate_rps, seconds, out):
    trace = load_trace({"phases": [{"name": "busy", "duration_s": seconds, "rate_rps": rate_rps}]})
    schedule = poisson_schedule(trace, seed=3, max_requests=int(rate_rps * seconds * 2))
    cfg = TritonControl(server.grpc_url, server.http_url).config(model)
    out.extend(run_open_loop_sync(server.grpc_url, model, schedule, inputs_from_config(cfg), timeout_s=10.0))


def test_instances_move_to_the_busy_model_within_the_budget(two_model_server, tmp_path):
    s = two_model_server
    log_path = tmp_path / "decisions.jsonl"
    limits = ModelLimits(p99_target_ms=15.0, max_instances=4, memory_budget_mb=BUDGET_MB, scale_up_cooldown_s=1.0,
                         scale_down_delay_s=300.0, max_delay_us=0)
    cfg = ControllerConfig(
        server=ServerConfig(http_url=s.http_url, grpc_url=s.grpc_url, metrics_url=s.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, decision_log=str(log_path),
                        gpu="simulated", simulated_device_memory_mb=4096),
        models={"sim_a": limits, "sim_b": limits})
    controller = Controller(cfg)
    stop = threading.Event()
    seen: list[tuple[float, int, int, float]] = []

    def watch():
        while not stop.wait(0.25):
            a, b = controller.models.get("sim_a"), controller.models.get("sim_b")
            if a and b and a.current and b.current:
                used = sum(g.memory_used_bytes or 0 for g in (a.last_obs.gpus if a.last_obs else ()))
                seen.append((time.monotonic(), a.current.instance_count, b.current.instance_count, used))

    threads = [threading.Thread(target=controller.run, args=(stop,)), threading.Thread(target=watch)]
    for t in threads:
        t.start()
    results: list = []
    try:
        _load(s, "sim_a", 250, 20, results)
        a_peak = max(a for _, a, _, _ in seen)
        _load(s, "sim_b", 250, 25, results)
    finally:
        stop.set()
        for t in threads:
            t.join()
        controller.close()
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert a_peak >= 2, seen[-5:]      # with sim_b's one instance, the budget is then full
    final_a, final_b = controller.models["sim_a"].current.instance_count, controller.models["sim_b"].current.instance_count
    assert final_b >= 2 and final_a < a_peak, (final_a, final_b)
    assert all((a + b) * 64 <= BUDGET_MB for _, a, b, _ in seen)          # never over the budget, as counted
    assert all(used <= BUDGET_MB * MiB for *_, used in seen)              # ... and as the device reported it
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    moves = [r for r in records if r["action"] == "applied" and r["reason"] == "RebalanceToHotModel"]
    assert moves and all(r["model"] == "sim_a" for r in moves), [(r["model"], r["reason"]) for r in records if r["action"] == "applied"]
    assert "for sim_b" in moves[0]["detail"]
