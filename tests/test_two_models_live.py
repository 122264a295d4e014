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
from controller.gpu import SIM_MEMORY_METRIC
from controller.loop import Controller
from controller.signals import Scraper

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


def _load(server, model, rate_rps, seconds, out, until=None):
    """Open-loop Poisson load on `model`; with `until`, in 5-s pieces that stop once until() is true."""
    cfg = TritonControl(server.grpc_url, server.http_url).config(model)
    piece = seconds if until is None else 5.0
    left = seconds
    while left > 0 and not (until is not None and until()):
        trace = load_trace({"phases": [{"name": "busy", "duration_s": min(piece, left), "rate_rps": rate_rps}]})
        schedule = poisson_schedule(trace, seed=int(left), max_requests=int(rate_rps * piece * 2))
        out.extend(run_open_loop_sync(server.grpc_url, model, schedule, inputs_from_config(cfg), timeout_s=10.0))
        left -= piece


def _device_bytes(scraper: Scraper) -> float:
    """The simulated device's memory in use, as the models' instances report it on the server's /metrics."""
    metrics = scraper.metrics()
    if metrics is None:
        raise RuntimeError("the server's /metrics could not be read")
    return sum(c.custom.get(SIM_MEMORY_METRIC, 0.0) for c in metrics.values())


def _server_count(control: TritonControl, model: str) -> int:
    """Instances of `model` in the config the server is serving now."""
    return sum(int(g.get("count", 1)) for g in control.config(model).get("instance_group", []))


def test_instances_move_to_the_busy_model_within_the_budget(two_model_server, tmp_path):
    s = two_model_server
    log_path = tmp_path / "decisions.jsonl"
    # min_gain_pct 0: this test is about the move, not the review of a step (policy.review_step, tested on its
    # own). On CI's 2 loaded cores sim_b's 2nd instance once raised its throughput only 6.7% (< 10%) in the 2 s
    # after the move, a backlog draining, and the review stepped back to 1 (ScaleDownNoGain) before the check
    limits = ModelLimits(p99_target_ms=15.0, max_instances=4, memory_budget_mb=BUDGET_MB, scale_up_cooldown_s=1.0,
                         scale_down_delay_s=300.0, max_delay_us=0, min_gain_pct=0.0)
    cfg = ControllerConfig(
        server=ServerConfig(http_url=s.http_url, grpc_url=s.grpc_url, metrics_url=s.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, decision_log=str(log_path),
                        gpu="simulated", simulated_device_memory_mb=4096),
        models={"sim_a": limits, "sim_b": limits})
    controller = Controller(cfg)
    stop = threading.Event()
    # sampled from the server and the device, not from the controller: (time, sim_a count, sim_b count, bytes)
    seen: list[tuple[float, int, int, float]] = []
    watch_errors: list[str] = []

    def watch():
        control, scraper = TritonControl(s.grpc_url, s.http_url), Scraper(s.metrics_url, s.http_url)
        while not stop.wait(0.25):
            try:
                seen.append((time.monotonic(), _server_count(control, "sim_a"), _server_count(control, "sim_b"),
                             _device_bytes(scraper)))
            except Exception as e:  # noqa: BLE001 - a sample missed during a reload is reported, not fatal
                watch_errors.append(repr(e))
        control.close()

    threads = [threading.Thread(target=controller.run, args=(stop,)), threading.Thread(target=watch)]
    for t in threads:
        t.start()
    results: list = []
    try:
        _load(s, "sim_a", 250, 20, results)
        a_peak = max(a for _, a, _, _ in seen)
        # sim_b's traffic until the server serves it with 2 instances: ~6 s on a quiet machine; 60 s at most
        _load(s, "sim_b", 250, 60, results, until=lambda: bool(seen) and seen[-1][2] >= 2)
        _load(s, "sim_b", 250, 3, results)    # and a little after the move, so its requests cross the swap
    finally:
        stop.set()
        for t in threads:
            t.join()
        controller.close()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    # a string, so that pytest prints it whole (a tuple's repr is cut to one line): the decisions, then the device
    story = "\n".join([f"{r.get('t', 0):.1f} {r['model']} {r['action']} {r['reason']} {r.get('mode')}: "
                        f"{(r.get('detail') or '')[:220]}" for r in records if r["reason"] != "HoldSteady"][-40:]
                       + [f"served a={a} b={b}, device {used / MiB:.0f} MiB" for _, a, b, used in seen[-3:]])
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert len(seen) >= 100 and len(watch_errors) <= len(seen) // 10, (len(seen), watch_errors[:3])
    assert a_peak >= 2, story      # with sim_b's one instance, the budget is then full
    final_a, final_b = seen[-1][1], seen[-1][2]
    assert final_b >= 2 and final_a < a_peak, f"final a={final_a} b={final_b}\n{story}"
    assert all((a + b) * 64 <= BUDGET_MB for _, a, b, _ in seen), story    # never over the budget, as served
    over = [(a, b, used / MiB) for _, a, b, used in seen if used > BUDGET_MB * MiB]
    assert not over, f"{over[:5]}\n{story}"                                    # ... and as the device reported it
    # the quiet model gives its instance: as idle (its planner says it spares one), or because the planner's
    # goodput says it buys sim_b clearly more than it costs sim_a (whichever the arbiter reaches first)
    moves = [r for r in records if r["action"] == "applied" and r["reason"] in ("RebalanceToHotModel", "RebalanceForGoodput")]
    assert moves and all(r["model"] == "sim_a" for r in moves), story
    assert "for sim_b" in moves[0]["detail"] or "buys sim_b" in moves[0]["detail"], moves[0]["detail"]
