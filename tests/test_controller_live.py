"""The whole loop against a real tritonserver, on the SIMULATED accelerator model (sim_accel):
each execution waits on a simulated device (see model_repository/sim_accel/1/model.py), so more
instances help the way they do on a GPU that idles between executions."""
from __future__ import annotations

import contextlib
import json
import threading
import time


from conftest import start_server
from controller.actuation import Actuator, TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync
from controller.loop import Controller
from controller.types import Settings

MODEL = "sim_accel"



def _config(server, log_path, dry_run=False) -> ControllerConfig:
    return ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, dry_run=dry_run,
                        decision_log=str(log_path), gpu="simulated"),
        models={MODEL: ModelLimits(p99_target_ms=15.0, max_instances=4, scale_up_cooldown_s=1.0,
                                   scale_down_delay_s=4.0, delay_cooldown_s=600.0, max_delay_us=0)},
    )


def _load(server, rate_rps: float, seconds: float, results: list):
    trace = load_trace({"phases": [{"name": "busy", "duration_s": seconds, "rate_rps": rate_rps}]})
    schedule = poisson_schedule(trace, seed=7, max_requests=int(rate_rps * seconds * 2))
    cfg = TritonControl(server.grpc_url, server.http_url).config(MODEL)
    results.extend(run_open_loop_sync(server.grpc_url, MODEL, schedule, inputs_from_config(cfg), timeout_s=10.0))


@contextlib.contextmanager
def running_controller(cfg: ControllerConfig):
    """A Controller running in a thread, with the instance counts it held sampled every 0.25 s;
    stopped, joined and closed on the way out."""
    controller = Controller(cfg)
    counts: list[tuple[float, int]] = []
    stop = threading.Event()

    def watch():
        while not stop.wait(0.25):
            mm = controller.models.get(MODEL)
            if mm and mm.current:
                counts.append((time.monotonic(), mm.current.instance_count))

    threads = [threading.Thread(target=controller.run, args=(stop,)), threading.Thread(target=watch)]
    for t in threads:
        t.start()
    try:
        yield controller, counts
    finally:
        stop.set()
        for t in threads:
            t.join()
        controller.close()


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_instances_rise_under_load_and_fall_after_with_no_failed_request(sim_server, tmp_path):
    log_path = tmp_path / "decisions.jsonl"
    act = Actuator(TritonControl(sim_server.grpc_url, sim_server.http_url))
    assert act.apply(MODEL, Settings(1, 0)).ok
    with running_controller(_config(sim_server, log_path)) as (controller, counts):
        results: list = []
        _load(sim_server, rate_rps=220, seconds=25, results=results)
        peak = max(c for _, c in counts)
        # After the load stops: low load must last scale_down_delay_s before each removal.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and controller.models[MODEL].current.instance_count > 1:
            time.sleep(0.5)
    failed = [r for r in results if not r.ok]
    assert results and not failed, failed[:3]
    assert peak >= 2, counts
    assert controller.models[MODEL].current.instance_count == 1, [(round(r["t"], 1), r["action"], r["reason"], r.get("mode"), r.get("detail", "")[:160]) for r in _records(log_path)][-40:]
    assert act.read(MODEL)[1] == Settings(1, 0)
    applied = [r for r in _records(log_path) if r["action"] == "applied"]
    ups = [r for r in applied if r["reason"].startswith("ScaleUp")]
    # the load-driven scale-down: the planner's consolidation, its choice of fewer instances where the live count
    # is predicted over the target and fewer under it (CI on 6c13640 went 4 -> 1 "ScaleDownPredicted"), or the
    # reactive rule where it stood aside. Not a memory cap's or a no-gain review's step back.
    downs = [r for r in applied if r["reason"] in ("ScaleDownConsolidated", "ScaleDownPredicted", "ScaleDownIdle",
                                                   "ScaleDownKnownGood")]
    assert ups and downs, [(r["reason"], r["target"], r.get("detail", "")[:200]) for r in applied]
    assert all(r["obs"].get("valid", True) for r in ups)
    assert ups[0]["t"] < downs[0]["t"]
    assert all(r["kind"] == "in_place" for r in applied)    # max_delay_us=0: only instance changes
    # untraced (the pip server's 2.51 under `tracing: auto`), the planner checked itself by mean latency: its
    # observations carry the predicted mean beside the counters' mean, and its decisions say where the
    # correction came from (planner.record_ratio)
    modelled = [r for r in _records(log_path) if r.get("mode") == "model" and r["obs"].get("valid", True)]
    assert modelled and all(r["obs"]["p99_source"] != "trace" for r in modelled)
    assert any(r["obs"].get("predicted_mean_ms", 0) > 0 and r["obs"]["mean_ms"] > 0 for r in modelled), modelled[:3]
    estimated = [r["obs"] for r in modelled if r["obs"]["p99_source"] == "mean_x_tail_ratio"]
    assert estimated and all(o["tail_ratio"] >= 1.0 and "tail_ratio_measured" in o for o in estimated)  # for status
    assert any("(from mean latencies)" in r.get("detail", "") for r in modelled), \
        [r.get("detail", "")[:200] for r in modelled][-10:]


def test_dry_run_decides_but_changes_nothing(sim_server, tmp_path):
    log_path = tmp_path / "dry.jsonl"
    act = Actuator(TritonControl(sim_server.grpc_url, sim_server.http_url))
    assert act.apply(MODEL, Settings(1, 0)).ok
    with running_controller(_config(sim_server, log_path, dry_run=True)) as (controller, counts):
        results: list = []
        _load(sim_server, rate_rps=220, seconds=12, results=results)
    records = _records(log_path)
    assert any(r["action"] == "dry_run" and r["reason"].startswith("ScaleUp") for r in records), \
        [(r["action"], r["reason"]) for r in records]
    assert not any(r["action"] in ("applied", "failed") for r in records)
    assert {c for _, c in counts} == {1}
    assert act.read(MODEL)[1] == Settings(1, 0)


LEVEL_S = 15.0      # seconds of each load level in the trace-p99 test


def test_the_trace_p99_follows_the_client_p99_at_two_load_levels(sim_server, tmp_path):
    """The controller's own reading (p99_source "trace") against what the clients measured, over the same
    seconds, at a light and a heavy load. Dry run at a fixed config, so that only the load changes.

    Where tritonserver itself died under it (CI 95: connection refused at the second level), it runs once more on a
    fresh server and fails if that one dies too: 2.51's request tracing can corrupt its heap (server#7795, fixed by
    PR #8144 in 2.57; docs/results.md, "Server failures"), and this test traces 60 requests a second."""
    import warnings
    try:
        _trace_follows_the_client(sim_server, tmp_path / "first")
        return
    except Exception as e:  # noqa: BLE001
        if sim_server.process is None or sim_server.process.poll() is None:
            raise
        warnings.warn(f"tritonserver died under the trace test ({sim_server.process.returncode}: "
                      f"{sim_server.log_tail()}; {type(e).__name__}); running it again on a fresh server")
    fresh = start_server([MODEL])
    try:
        _trace_follows_the_client(fresh, tmp_path / "again")
        assert fresh.process.poll() is None, f"tritonserver died again: {fresh.log_tail()}"
    finally:
        fresh.stop()


def _trace_follows_the_client(sim_server, tmp_path):
    import dataclasses

    import numpy as np
    tmp_path.mkdir(parents=True, exist_ok=True)
    obs_log = tmp_path / "observations.jsonl"
    act = Actuator(TritonControl(sim_server.grpc_url, sim_server.http_url))
    assert act.apply(MODEL, Settings(1, 0)).ok
    cfg = _config(sim_server, tmp_path / "decisions.jsonl", dry_run=True)
    # why 60 traces/s: a 5-s window (the default is 20 s) then holds ~300 traced requests at 160 req/s, so its
    # nearest-rank p99 is not the window's single slowest one; at the default 20/s it held ~85, and one slow
    # request among them read 2.3x the clients' p99 for four ticks (a CI failure, docs/results.md)
    cfg = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, interval_s=1.0, window_s=5.0,
                                                            tracing=True, trace_samples_per_s=60.0,
                                                            observation_log=str(obs_log)))
    with running_controller(cfg) as (controller, _):
        phases = []
        for rate in (40, 160):
            results: list = []
            wall0 = time.time()
            _load(sim_server, rate_rps=rate, seconds=LEVEL_S, results=results)
            phases.append((rate, wall0, results))
        time.sleep(1.5)                       # one more tick reads the last files
    records = [r for r in _records(obs_log) if r["model"] == MODEL and r["obs"].get("p99_ms") is not None]
    for rate, wall0, results in phases:
        assert results and all(r.ok for r in results), [(round(r.scheduled_s, 2), r.error) for r in results
                                                        if not r.ok][:5]
        done = np.array([r.done_s for r in results])
        # from the moment each request left the client: the time a busy load generator spends before sending
        # (its own lateness, counted in its scheduled-time latency) is invisible to the server, and on a loaded
        # CI machine it alone moved the clients' p99 at 40 req/s 40-50% above the server's reading
        lat = np.array([1000 * (r.done_s - r.sent_s) for r in results])
        # readings whose whole span lies after the first 6 s of this load level (a few ticks: one alone could
        # straddle the edges when a tick runs late on the shared cores)
        inside = [r for r in records if wall0 + 6 + r["obs"]["span_s"] <= r["time"] <= wall0 + LEVEL_S]
        assert inside, (rate, [(round(r["time"] - wall0, 1), r["obs"]) for r in records][-20:])
        assert all(r["obs"]["p99_source"] == "trace" for r in inside), [r["obs"] for r in inside]
        # the premise of the comparison: each window's p99 rests on more than 100 traced requests
        assert min(r["obs"]["p99_samples"] for r in inside) > 100, [r["obs"]["p99_samples"] for r in inside]
        # each tick says who decided it: nobody on a gate's hold, else the planner's model or the reactive rules
        gates = {"HoldWarmup", "HoldSettling", "HoldNoData", "HoldBackoff", "HoldFailures", "HoldReloading"}
        modes = [(r["reason"], r["mode"]) for r in inside]
        assert all((m is None) if why in gates else m in ("model", "fallback") for why, m in modes), modes
        errors = []
        for r in inside:
            t1, t0 = r["time"] - wall0, r["time"] - wall0 - r["obs"]["span_s"]
            client = float(np.percentile(lat[(done >= t0) & (done < t1)], 99))
            errors.append(r["obs"]["p99_ms"] / client - 1)
        # 2 shared cores: the client adds its own scheduling delay; a reading within 35% (median) is the bar here
        assert abs(float(np.median(errors))) <= 0.35, (rate, errors)
    # the log says what the planner multiplied its predictions by, and that traced windows set it
    corrected = [r["correction"] for r in _records(obs_log) if r.get("correction")]
    assert corrected and all(c["from"] == "trace" and 0.5 < c["x"] < 2.0 for c in corrected), corrected[-5:]
    from controller.traces import TraceApi, trace_release_unsafe
    api = TraceApi(sim_server.http_url)
    assert api.setting(MODEL)["trace_level"] == ["OFF"]     # turned off on the way out
    # the server here is 2.51: its tracing can crash it (server#7795), which the controller says
    assert api.server_version() == "2.51.0" and trace_release_unsafe(api.server_version())


def test_a_server_without_a_trace_file_falls_back_once_and_keeps_deciding(tmp_path, caplog):
    """The NGC recipe before the user adds the flag: the controller says so once and uses the counters' estimate."""
    import logging
    caplog.set_level(logging.WARNING)
    server = start_server([MODEL], trace_file=False)
    try:
        cfg = _config(server, tmp_path / "d.jsonl")
        with running_controller(cfg) as (controller, _):
            _load(server, rate_rps=60, seconds=8, results=[])
    finally:
        server.stop()
    assert controller.traces.state.startswith("off: the server was started without a trace file")
    assert sum("request tracing off" in r.message for r in caplog.records) == 1
    sources = {r["obs"].get("p99_source") for r in _records(tmp_path / "d.jsonl") if r["obs"].get("p99_ms") is not None}
    assert sources and "trace" not in sources, sources
