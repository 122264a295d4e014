"""Issue 13, item 3: one instance's stub process is killed (as the OOM killer or a segfault would) under
open-loop load, against a real tritonserver 2.51 and the controller.

What 2.51 does (measured here, see the printed figures): the model stays READY and keeps the dead instance;
every request the scheduler hands to it fails after about 1 s ("Stub process '<instance>' is not healthy.",
counted with reason BACKEND), the other instance serves the rest. The server does not restart the stub; a
full reload of the model (all instances new) repairs it. The controller must read the failures as a fault,
not as load (hold: no scale-up, no saturation mark), and repair the model once they last (policy.repair)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

from conftest import live_stubs, start_server
from controller.actuation import REPAIR_KEY, Actuator, TritonControl, settings_of
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.gpu import SIM_MEMORY_METRIC
from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync
from controller.loop import Controller
from controller.signals import Scraper
from controller.types import Settings

MODEL = "sim_accel"



def _stubs(server) -> list[int]:
    """The pids of the live (not zombie) `triton_python_backend_stub` children of tritonserver for the model."""
    return [pid for pid, argv in live_stubs(server).items() if any(MODEL in a for a in argv)]


def _newest_stub(server) -> int:
    """The pid of the newest live stub of the model: the newest instance."""
    stubs = _stubs(server)
    assert len(stubs) >= 2, stubs
    return max(stubs, key=lambda p: os.stat(f"/proc/{p}").st_ctime)


class ServerDied(Exception):
    """tritonserver itself exited during the scenario: nothing the controller did can be judged from that run."""


def test_a_killed_stub_is_held_as_a_fault_then_repaired_by_a_full_reload(sim_server, tmp_path):
    """The scenario below; once more on a fresh server when the server process itself died during it.

    Why: the pip tritonserver 2.51 crashes now and then on its own (README, "Server failures seen in the
    benches"). A CI run here saw it exit just as the stub was killed (the controller's only record after the kill:
    HoldServerUnreachable); the same test had passed in every CI run before. A second death fails the test."""
    try:
        _killed_stub_scenario(sim_server, tmp_path / "first")
    except ServerDied as died:
        print(f"\ntritonserver died during the scenario ({died}); once more on a fresh server")
        fresh = start_server([MODEL])
        try:
            _killed_stub_scenario(fresh, tmp_path / "second")
        except ServerDied as again:
            raise AssertionError(f"tritonserver died in both runs: {died}; then {again}") from again
        finally:
            fresh.stop()


def _killed_stub_scenario(sim_server, tmp_path) -> None:
    tmp_path.mkdir()
    act = Actuator(TritonControl(sim_server.grpc_url, sim_server.http_url))
    assert act.apply(MODEL, Settings(2, 0)).ok
    log_path = tmp_path / "decisions.jsonl"
    cfg = ControllerConfig(
        server=ServerConfig(http_url=sim_server.http_url, grpc_url=sim_server.grpc_url, metrics_url=sim_server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, decision_log=str(log_path),
                        gpu="simulated", repair_after_s=4.0),
        models={MODEL: ModelLimits(p99_target_ms=50.0, min_instances=2, max_instances=4, scale_up_cooldown_s=1.0,
                                   scale_down_delay_s=60.0, max_delay_us=0)})
    controller = Controller(cfg)
    stop = threading.Event()
    ctl_thread = threading.Thread(target=controller.run, args=(stop,))
    live_cfg = TritonControl(sim_server.grpc_url, sim_server.http_url).config(MODEL)
    duration = 30
    schedule = poisson_schedule(load_trace({"phases": [{"name": "busy", "duration_s": duration, "rate_rps": 100}]}),
                                seed=3, max_requests=6000)
    results: list = []
    load = threading.Thread(target=lambda: results.extend(
        run_open_loop_sync(sim_server.grpc_url, MODEL, schedule, inputs_from_config(live_cfg), timeout_s=10.0)))
    ctl_thread.start()
    time.sleep(6)                     # the controller's warm-up window on an idle model
    t0 = time.time()
    load.start()
    try:
        time.sleep(6)
        victim = _newest_stub(sim_server)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        load.join()
        time.sleep(1.0)
    finally:
        stop.set()
        ctl_thread.join()
        controller.close()
    if sim_server.process.poll() is not None:
        raise ServerDied(f"exit {sim_server.process.returncode}, found {time.time() - killed_at:.1f} s after the kill; "
                         f"its log: {sim_server.log_tail()}")
    kill_s = killed_at - t0
    records = [json.loads(x) for x in log_path.read_text().splitlines()]
    after = [r for r in records if r["time"] >= killed_at]
    repaired = [r for r in after if r["action"] == "repaired"]
    assert repaired and repaired[0]["reason"] == "RepairFullReload", [(r["action"], r["reason"], r["detail"]) for r in after]
    repaired_s = repaired[0]["time"] - t0
    failed = [r for r in results if not r.ok]
    print(f"\ncrashed instance: {len(results)} requests, {len(failed)} failed; killed at {kill_s:.1f} s, repaired "
          f"(recorded) at {repaired_s:.1f} s after a {repaired[0].get('apply_s')} s reload; "
          f"failures scheduled {min((r.scheduled_s for r in failed), default=float('nan')):.1f}-"
          f"{max((r.scheduled_s for r in failed), default=float('nan')):.1f} s; "
          f"errors {sorted({(r.error or '')[:90] for r in failed})}; detail: {repaired[0]['detail']}")
    assert failed, "a dead instance fails the requests handed to it (2.51)"
    assert all("is not healthy" in (r.error or "") for r in failed), {r.error for r in failed}
    assert all(kill_s - 0.5 <= r.scheduled_s <= repaired_s for r in failed)   # none after the repair's swap
    assert len(failed) < 0.1 * len(results)                      # the other instance serves the rest
    assert len([r for r in results if r.scheduled_s > repaired_s]) > 500      # ... and a long stretch after it, all ok
    assert len(repaired) == 1                                    # repaired once, not again

    holds = [r for r in after if r["reason"] == "HoldFailures" and r["time"] < repaired[0]["time"]]
    assert holds and "failed req/s" in holds[0]["detail"], [(r["reason"], r["detail"]) for r in after]
    ups = [r for r in after if r["action"] in ("started", "applied") and r["reason"].startswith("ScaleUp")]
    assert not ups, [(r["reason"], r["detail"]) for r in ups]     # no scale-up storm
    assert controller.models[MODEL].state.saturated_at is None   # no saturation mark
    assert not any(r["reason"] == "HoldSaturated" for r in after)

    live = TritonControl(sim_server.grpc_url, sim_server.http_url).config(MODEL)
    assert REPAIR_KEY in live.get("parameters", {})              # the full reload's stamp
    assert settings_of(live) == Settings(2, 0)                   # settings unchanged
    client = grpcclient.InferenceServerClient(sim_server.grpc_url)
    x = np.ones((1, 16), np.float32)
    for _ in range(40):                                          # every instance answers again
        inp = grpcclient.InferInput("INPUT", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        client.infer(MODEL, [inp])
    # the killed stub never ran finalize(): its memory series is zeroed by a live stub (its pid is gone), so the
    # reading is what the live stubs hold. On 2.51 the old version's healthy stub outlives the repair (its
    # unload waits on the dead instance): it still holds its memory and is counted.
    scraper = Scraper(sim_server.metrics_url, sim_server.http_url)
    deadline, memory, live_stubs = time.monotonic() + 10, None, []
    while time.monotonic() < deadline:
        memory = (scraper.metrics() or {})[MODEL].custom.get(SIM_MEMORY_METRIC)
        live_stubs = _stubs(sim_server)
        if memory == len(live_stubs) * 64 * 2**20:
            break
        time.sleep(0.3)
    print(f"memory after the repair: {memory / 2**20:.0f} MiB, {len(live_stubs)} live stub(s)")
    assert len(live_stubs) >= 2 and memory == len(live_stubs) * 64 * 2**20, (memory / 2**20, live_stubs)
    assert act.apply(MODEL, Settings(1, 0)).ok
