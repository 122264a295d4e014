"""The two levels of control, shown on this machine: two independent servers ("pods"), each with its own
controller, behind a round-robin open-loop client; the HPA's own formula applied to the gauges they export.

The model is the SIMULATED accelerator with slower costs (one device slot, batches of at most 2), so that
one instance serves about 70 req/s and two about 140 req/s, within what two cores can drive:

* phase `headroom`: 80 req/s per pod: one instance is not enough, the controller adds the second; while
  it can, the pods' figure stays low enough that the HPA adds no pod;
* phase `beyond`: 200 req/s per pod: both pods at max_instances and past the target: scale-out;
* phase `low`: 10 req/s per pod: scale-in.
"""
from __future__ import annotations

import math
import re
import shutil
import threading
import time
import warnings

import pytest

from conftest import ROOT, start_server
from controller.actuation import TritonControl
from controller.capacity import HEADROOM_MAX
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync
from controller.loop import Controller

MODEL = "sim_accel"
TARGET = 0.8                     # the HPA's averageValue in deploy/k8s/hpa.yaml
# per pod: name, s, req/s. `low` is long because `beyond` leaves ~1,000 requests queued on each pod: they drain
# in ~12 s on a quiet machine, during which the pods rightly read saturated
PHASES = [("headroom", 22.0, 80.0), ("beyond", 16.0, 200.0), ("low", 30.0, 10.0)]
SLOW = {"max_batch_size": None, "fixed_overhead_ms": "10", "host_per_item_ms": "2", "compute_base_ms": "10",
        "compute_per_item_ms": "2", "device_parallelism": "1"}


def _low_tail(rows: list[dict]) -> list[dict]:
    """The last 4 samples (with figures for both pods) of the low phase and after."""
    return [r for r in rows if r["phase"] in ("low", "after") and None not in r["u"] and None not in r["n"]][-4:]


def _scaled_in(samples: list[dict]) -> bool:
    tail = _low_tail(list(samples))
    return len(tail) == 4 and all(hpa_desired(2, r["u"]) < 2 for r in tail)


# The controllers' observation window here (deploy/k8s/configmap.yaml: 20 s; 5x shorter on this test's compressed clock).
WINDOW_S = 4.0
# deploy/k8s/hpa.yaml scales up on the lowest recommendation of its last 30 s (stabilizationWindowSeconds), 1.5x
# the controller's 20-s window, so a momentary reading adds no pod: one slow second stays in every window that
# holds it, a whole window long, and the HPA's look-back outlasts it. Here the same 1.5x (it was 2 s, shorter than
# one window: CI saw both pods read p99 2.0-2.4x the target for the headroom phase's last 2.5 s, unchanged from
# one reading to the next, while 80 req/s each was well within 2 instances, and the emulated HPA added a pod).
STABILIZE_S = 1.5 * WINDOW_S


def stabilized(rows: list[dict], i: int) -> int:
    """The HPA's scale-up recommendation at sample i: the lowest desired count over the last STABILIZE_S."""
    t = rows[i]["t"]
    return min(hpa_desired(2, r["u"]) for r in rows[:i + 1] if r["t"] > t - STABILIZE_S)


def hpa_desired(replicas: int, values: list[float], target: float = TARGET, tolerance: float = 0.1) -> int:
    """The HPA's rule for a Pods metric: ratio = average / target; within 10% of 1: keep; else ceil(n x ratio)."""
    ratio = sum(values) / len(values) / target
    if abs(ratio - 1.0) <= tolerance:
        return replicas
    return math.ceil(replicas * ratio)


def slow_repository(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / MODEL, repo / MODEL, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / MODEL / "config.pbtxt"
    text = re.sub(r"max_batch_size: \d+", "max_batch_size: 2", cfg.read_text())
    for key, value in SLOW.items():
        if value is not None:
            text, n = re.subn(rf'(key: "{key}", value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
            assert n == 1, key
    cfg.write_text(text)
    return repo


def controller_config(server) -> ControllerConfig:
    return ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=WINDOW_S, settle_s=1.0, min_span_s=2.0, gpu="simulated", tracing=True),
        models={MODEL: ModelLimits(p99_target_ms=100.0, max_instances=2, scale_up_cooldown_s=1.0,
                                   scale_down_delay_s=6.0, delay_cooldown_s=600.0, max_delay_us=0)})


def fleet_run(tmp_path) -> dict:
    """Two pods, each with its controller, under the PHASES traffic: every half-second sample of their figures, the
    clients' results, and each server's exit code (None: still running at the end) with the last lines of its log."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    repo = slow_repository(tmp_path)
    servers = [start_server([MODEL], repository=repo, log_path=str(tmp_path / f"pod{i}.log")) for i in range(2)]
    stop = threading.Event()
    controllers = [Controller(controller_config(s)) for s in servers]
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in controllers]
    samples: list[dict] = []
    t0 = [0.0]

    def phase_at(t: float) -> str:
        for name, seconds, _ in PHASES:
            if t < seconds:
                return name
            t -= seconds
        return "after"

    def sample():
        while not stop.wait(0.5):
            row = {"t": time.monotonic() - t0[0], "u": [], "n": [], "ceiling": [], "saturated": [], "p": []}
            for c in controllers:
                mm = c.models.get(MODEL)
                u = c.metrics.registry.get_sample_value("triton_autotune_pod_capacity_utilization")
                row["u"].append(u)
                row["n"].append(None if mm is None or mm.current is None else mm.current.instance_count)
                row["ceiling"].append(None if mm is None or mm.capacity is None else mm.capacity.ceiling)
                row["saturated"].append(c.metrics.registry.get_sample_value("triton_autotune_saturated", {"model": MODEL}))
                row["p"].append(c.metrics.registry.get_sample_value("triton_autotune_p99_over_target", {"model": MODEL}))
            row["phase"] = phase_at(row["t"])
            samples.append(row)

    try:
        for t in threads:
            t.start()
        time.sleep(1.0)                       # the controllers hold their first window (4 s) under the traffic
        trace = load_trace({"phases": [{"name": n, "duration_s": s, "rate_rps": 2 * r} for n, s, r in PHASES]})
        schedule = poisson_schedule(trace, seed=11, max_requests=20_000)
        inputs = inputs_from_config(TritonControl(servers[0].grpc_url, servers[0].http_url).config(MODEL))
        results: list[list] = [[], []]

        def client(i):                        # round robin: every other request to each pod
            results[i] = run_open_loop_sync(servers[i].grpc_url, MODEL, schedule[i::2], inputs, timeout_s=8.0)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        t0[0] = time.monotonic()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        # The overload's backlog is still load: Triton serves what queued after the clients gave up (8 s), and on a
        # loaded machine one pod drained past the low phase (CI: pod 1 in at 74 s, pod 2 still saturated at 76 s).
        # So the scale-in below is judged once both pods have drained, or 60 s after the traffic, whichever first.
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not _scaled_in(samples):
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        for c in controllers:
            c.close()
        exited = [s.process and s.process.poll() for s in servers]   # None: still running when the traffic ended
        # the server's own last words where one exited (the log lives in tmp_path, past stop())
        last_words = ["\n".join([f"pod {i}'s log, last lines:"] + (tmp_path / f"pod{i}.log").read_text(errors="replace").splitlines()[-20:])
                      for i, code in enumerate(exited) if code is not None]
        for s in servers:
            s.stop()
    return {"samples": samples, "results": results, "exited": exited, "last_words": last_words}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_fleet_scales_out_only_when_both_pods_are_at_their_limit_and_back_in(tmp_path):
    run = fleet_run(tmp_path / "run1")
    if any(code is not None for code in run["exited"]):
        # tritonserver itself died mid-run (CI: once with -6 in the overload, once with every port refusing in the
        # headroom phase); upstream reports the same with the Python backend under load and reloads (server#6800,
        # #7723). Nothing about the two levels can be judged from a fleet that lost a pod: run it once more, and
        # fail if a server dies again.
        warnings.warn(f"a server exited during the two-pod run ({run['exited']}); running it again\n"
                      + "\n".join(run["last_words"]))
        run = fleet_run(tmp_path / "run2")
        assert all(code is None for code in run["exited"]), f"servers exited: {run['exited']}\n" + "\n".join(run["last_words"])
    samples, results, exited, last_words = run["samples"], run["results"], run["exited"], run["last_words"]
    known = [r for r in samples if None not in r["u"] and None not in r["n"]]
    summary = [(round(r["t"]), r["phase"], r["n"], [round(u, 2) for u in r["u"]]) for r in known]
    # 1. no scale-out while an in-pod instance can still be added
    headroom = [r for r in known if all(n < c for n, c in zip(r["n"], r["ceiling"]) if c is not None)
                and None not in r["ceiling"]]
    assert any(r["phase"] == "headroom" for r in headroom), summary
    for r in headroom:
        assert max(r["u"]) <= HEADROOM_MAX and hpa_desired(2, r["u"]) <= 2, (r, summary)
    # the pods did take the load in-pod first: both reached their second instance while 80 req/s arrived
    assert any(r["phase"] == "headroom" and r["n"] == [2, 2] for r in known), summary
    # ... and at the ceiling with load the pods can serve (the last 8 s of that phase), no scale-out either
    # (at the ceiling the reading is p99 / target, so a p99 excursion on a loaded machine can put one reading over
    # 0.88 on average; the HPA's scale-up window, above, is what keeps such a reading from adding a pod)
    at_headroom_end = lambda r: r["phase"] == "headroom" and r["t"] >= PHASES[0][1] - 8.0  # noqa: E731
    settled = [i for i, r in enumerate(known) if at_headroom_end(r)]
    rows = lambda idx: "\n".join(f"{known[i]['t']:.1f} n={known[i]['n']} u={known[i]['u']} p99/target={known[i]['p']}"
                                 for i in idx)  # noqa: E731
    # (no settled reading at all: every sample of the phase's end, None where a pod had no figure)
    assert settled, "\n".join(f"{r['t']:.1f} n={r['n']} u={r['u']}" for r in samples if at_headroom_end(r))
    assert all(stabilized(known, i) <= 2 for i in settled), rows(settled)
    # 2. scale-out once both pods are at their limit
    out = [r for i, r in enumerate(known) if r["phase"] == "beyond" and r["n"] == [2, 2]
           and r["saturated"] == [1.0, 1.0] and stabilized(known, i) > 2]
    assert out, summary
    # 3. scale-in when the load falls back (the last seconds of the low phase)
    tail = _low_tail(known)
    # a string, printed whole: every sample of the low phase (None: no figure), and whether the servers lived
    low = "\n".join(f"{r['t']:.1f} {r['phase']} n={r['n']} u={r['u']} saturated={r['saturated']}"
                    for r in samples if r["phase"] in ("beyond", "low", "after"))
    assert tail and all(hpa_desired(2, r["u"]) < 2 for r in tail), f"servers exited: {exited}\n{low}\n" + "\n".join(last_words)
    print("\n".join(map(str, summary)))    # with -s: the run, one line per half second
    served = sum(1 for rs in results for x in rs if x.ok)
    assert served > 0.5 * sum(len(rs) for rs in results)


@pytest.mark.slow
def test_readiness_holds_through_reloads():
    """deploy/k8s's readiness probe is Triton's /v2/health/ready: a reload must not take the pod out of the Service."""
    import urllib.request

    from controller.actuation import Actuator
    from controller.types import Settings
    server = start_server([MODEL])
    failed, polls, stop = [], [0], threading.Event()

    def poll():
        while not stop.is_set():
            try:
                with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as r:
                    ok = r.status == 200
            except OSError:
                ok = False
            polls[0] += 1
            if not ok:
                failed.append(time.monotonic())
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        act = Actuator(TritonControl(server.grpc_url, server.http_url))
        kinds = []
        for s in (Settings(2, 0), Settings(2, 1000), Settings(1, 0)):      # in place, full, full
            result = act.apply(MODEL, s)
            assert result.ok, result
            kinds.append(result.kind)
    finally:
        stop.set()
        poller.join()
        server.stop()
    assert kinds == ["in_place", "full_reload", "full_reload"]
    assert polls[0] > 50 and not failed, (polls[0], len(failed))


def test_the_emulated_hpa_ignores_one_high_reading_and_follows_a_sustained_one():
    n = int((3.0 + STABILIZE_S) / 0.5) + 2                       # samples every 0.5 s, past one look-back
    rows = [{"t": 0.5 * k, "u": [0.55, 0.55]} for k in range(n)]
    rows[5]["u"] = [0.95, 0.95]                                  # one reading: 3 pods wanted for half a second
    assert hpa_desired(2, rows[5]["u"]) == 3 and max(stabilized(rows, i) for i in range(n)) == 2
    # high for a whole controller window (what one slow second does to every reading that holds it): no pod
    for r in rows[5:5 + int(WINDOW_S / 0.5)]:
        r["u"] = [2.0, 2.0]
    assert max(stabilized(rows, i) for i in range(n)) == 2
    for r in rows[5:]:
        r["u"] = [2.0, 2.0]                                      # saturated from 2.5 s on
    # every reading of the last STABILIZE_S high from the first sample with t - STABILIZE_S >= 2.0 on
    first = next(i for i, r in enumerate(rows) if r["t"] - STABILIZE_S >= 2.0)
    assert [stabilized(rows, i) for i in range(n)] == [2] * first + [5] * (n - first)
