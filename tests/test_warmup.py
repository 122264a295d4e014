"""Triton's model_warmup for a model that starts cold (controller/warmup.py): the samples, the status rows, and on a
real tritonserver the controller's warm-up reload and an in-place scale-up after it that serves no cold request."""
from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import open_loop, running_controller, sim_copy, start_server
from controller import warmup
from controller.actuation import Actuator, TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.loop import WARM_UP, warm_up_status
from controller.status import format_model
from controller.types import Settings

CONFIG = {"name": "m", "max_batch_size": 32,
          "input": [{"name": "INPUT", "data_type": "TYPE_FP32", "dims": ["16"]},
                    {"name": "MASK", "data_type": "TYPE_BOOL", "dims": ["4", "2"]},
                    {"name": "EXTRA", "data_type": "TYPE_FP32", "dims": ["-1"], "optional": True}]}


POW = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("executed, max_batch, expected", [
    ({1: 700, 2: 250, 3: 40, 7: 10}, 8, list(range(1, 9))),          # up to ALL_UP_TO: every size
    ({}, 32, list(range(1, 33))),
    ({1: 5}, 0, [1]),                                                  # no batching: one request of its own shape
    ({3: 700, 5: 250, 1: 40, 6: 10}, 128, sorted(POW + [3, 5])),       # the module's example: 99.0% without 6
    ({}, 100, [1, 2, 4, 8, 16, 32, 64, 100]),                          # nothing executed yet; max_batch_size itself
    ({b: 1 for b in range(1, 129)}, 128, sorted(POW + [3, 5, 6, 7, 9, 10, 11, 12])),   # MAX_SIZES in all, the smaller
    ({300: 100, 3: 100}, 128, sorted(POW + [3])),                      # first; a size beyond max_batch_size: never
])
def test_sizes_cover_the_executions_since_the_load(executed, max_batch, expected):
    assert warmup.sizes(executed, max_batch) == expected


def test_spans_shorten_runs_of_sizes():
    assert warmup.spans(list(range(1, 33))) == "1-32"
    assert warmup.spans([16, 1, 2, 3, 4, 8, 9]) == "1-4, 8, 9, 16"
    assert warmup.spans([5]) == "5" and warmup.spans([]) == ""


def test_samples_are_zero_data_for_each_required_input_at_its_declared_shape():
    samples, what = warmup.samples(dict(CONFIG, max_batch_size=4), {1: 10, 4: 90})
    assert what == "zero data at batch size(s) 1-4"
    assert [s["name"] for s in samples] == [f"{warmup.SAMPLE_PREFIX}{b}" for b in (1, 2, 3, 4)]
    assert [s["batch_size"] for s in samples] == [1, 2, 3, 4] and all(s["count"] == 1 for s in samples)
    # the optional input (of variable shape) is left out: a request without it is valid by definition
    assert samples[3]["inputs"] == {"INPUT": {"data_type": "TYPE_FP32", "dims": ["16"], "zero_data": True},
                                    "MASK": {"data_type": "TYPE_BOOL", "dims": ["4", "2"], "zero_data": True}}
    cfg = dict(CONFIG, model_warmup=samples)
    assert warmup.has_warmup(cfg) and warmup.ours(cfg) and warmup.batch_sizes(cfg) == [1, 2, 3, 4]
    own = dict(CONFIG, model_warmup=[{"name": "sample", "batch_size": 8}])
    assert warmup.has_warmup(own) and not warmup.ours(own) and warmup.batch_sizes(own) == [8]
    assert not warmup.has_warmup(CONFIG) and not warmup.ours(CONFIG)


@pytest.mark.parametrize("inp, why", [
    ({"name": "T", "data_type": "TYPE_FP32", "dims": ["-1", "3"]}, "input 'T' has a variable shape"),
    ({"name": "T", "data_type": "TYPE_STRING", "dims": ["1"]}, "input 'T' is TYPE_STRING"),
    ({"name": "T", "data_type": "TYPE_INT32", "dims": ["2"], "is_shape_tensor": True}, "input 'T' is a shape tensor"),
])
def test_samples_are_not_made_where_zero_data_is_not_a_known_request(inp, why):
    samples, what = warmup.samples({"max_batch_size": 8, "input": [inp]}, {1: 5})
    assert samples is None and what.startswith(why), what
    assert warmup.samples({"max_batch_size": 8}, {}) == (None, "the config declares no inputs")


SEEN = {"instances": 2, "delay_us": 0, "reason": "HoldStable", "tracing": "off",
        "obs": {"span_s": 20, "arrival_rps": 50, "completion_rps": 50, "p99_ms": 12.0, "p99_source": "summary",
                "busy": 0.3, "avg_batch": 1.2, "queue_ms": 0.5, "compute_ms": 9.0,
                "cold_start": {"instances": 1, "delay_us": 0, "executions": 12, "ms": 75.0, "usual_ms": 9.0}}}


def _rows(model: dict) -> dict[str, str]:
    return dict((ln[:15].strip(), ln[15:]) for ln in format_model("m", model)[1:])


def test_status_says_what_warms_the_model_and_why_not():
    one = {"instances": 1, "delay_us": 0}
    rows = _rows(dict(SEEN, warm_up={"state": "added", "detail": "zero data at batch size(s) 1, 2", "live": True,
                                     "by": "controller", "sizes": [1, 2]},
                      last_change={"time": 0, "ago_s": 25, "from": one, "to": one, "reason": "WarmUpColdStart",
                                   "kind": "full_reload", "apply_s": 5.0, "ok": True}))
    assert rows["last change"].endswith("(25 s ago) same settings (1 instance, delay 0 us): WarmUpColdStart "
                                        "(full reload, 5.0 s)"), rows["last change"]
    assert rows["cold start"].endswith("75.0 ms each, against 9.0 ms after them: new instances now warm up before "
                                       "they serve (warm-up below)")
    assert rows["warm-up"] == ("Triton's model_warmup, added by the controller after it read a cold start "
                               "(zero data at batch size(s) 1, 2)")
    # a later controller finds its warm-up in the live config (no attempt of its own)
    rows = _rows(dict(SEEN, warm_up={"state": None, "detail": None, "live": True, "by": "controller",
                                     "sizes": [1, 2, 3, 4, 8]}))
    assert rows["warm-up"].endswith("after it read a cold start (zero data at batch size(s) 1-4, 8)")
    rows = _rows(dict(SEEN, warm_up={"state": None, "detail": None, "live": True, "by": "model", "sizes": [8]}))
    assert rows["warm-up"] == "Triton's model_warmup, the model's own (batch size(s) 8)"
    rows = _rows(dict(SEEN, warm_up={"state": "cannot", "detail": "input 'T' is TYPE_STRING: empty strings ...",
                                     "live": False}))
    assert rows["cold start"].endswith("warm the model up before it is ready (in initialize, or Triton's model_warmup); "
                                       "until then every instance a reload starts serves its first requests slowly, "
                                       "and the planner changes the delay (a full reload) only where it must")
    assert rows["warm-up"].startswith("not added: input 'T' is TYPE_STRING")
    rows = _rows(dict(SEEN, warm_up={"state": "failed", "detail": "zero data at batch size(s) 1: load failed",
                                     "live": False}))
    assert rows["warm-up"].startswith("the reload with Triton's model_warmup failed (zero data at batch size(s) 1: "
                                      "load failed); it serves on unwarmed, not tried again")
    rows = _rows(dict(SEEN, warm_up={"state": "waiting", "detail": None, "live": False}))
    assert rows["cold start"].endswith("9.0 ms after them: the controller is adding a warm-up (below); until then every "
                                       "instance a reload starts serves its first requests slowly")
    assert rows["warm-up"] == ("to be added by the controller (Triton's model_warmup, a full reload at the live "
                               "settings) at a quiet tick with its instances at most 50% busy (or after 5 minutes of waiting), "
                               "no other reload in flight and room for a second copy")
    rows = _rows(dict(SEEN, warm_up={"state": "added", "detail": "zero data at batch size(s) 1-8", "live": False}))
    assert rows["warm-up"] == ("added by the controller (zero data at batch size(s) 1-8), since gone from the live "
                               "config: not added again")
    assert "warm-up" not in _rows(SEEN)


COLD = {'"cold_first_execution_ms", value: { string_value: "0" }': '"cold_first_execution_ms", value: { string_value: "800" }',
        '"cold_new_batch_size_ms", value: { string_value: "0" }': '"cold_new_batch_size_ms", value: { string_value: "50" }'}


def _requests(server, model: str, rate: float, seconds: float, seed: int) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(open_loop(server, model, rate, seconds, seed)))
    thread.start()
    return thread, out


@pytest.mark.slow
def test_live_a_cold_model_is_warmed_up_once_and_its_next_scale_up_serves_warm(tmp_path):
    """sim_accel with a cold start (800 ms on each instance's first execution, 50 ms on its first of each batch size)
    on a real tritonserver 2.51. A warm-up the model refuses fails its load and the old copy serves on. The controller
    (planner, held at one instance) reads the cold start from the first requests, reloads the model once with Triton's
    model_warmup, and in-place scale-ups to 2 instances under load afterwards serve no request late, but for Triton's
    occasional request let in before the samples (below): without the warm-up the new instance's first batch waits
    800 ms (882 ms seen, 4 clients, docs in warmup.py)."""
    model, repo = "cold", tmp_path / "repo"
    sim_copy(repo, model, COLD)
    server = start_server([model], repository=repo)
    try:
        act = Actuator(TritonControl(server.grpc_url, server.http_url))
        bad = [{"name": "bad", "batch_size": 1, "count": 1,
                "inputs": {"INPUT": {"data_type": "TYPE_FP32", "dims": ["15"], "zero_data": True}}}]
        refused = act.warm_up(model, bad)
        assert not refused.ok and "unexpected shape" in refused.error, refused
        assert refused.live == Settings(1, 0) and "model_warmup" not in act.control.config(model)
        log = tmp_path / "decisions.jsonl"
        cfg = ControllerConfig(
            server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url),
            loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, decision_log=str(log),
                            gpu="simulated", tracing=False),
            models={model: ModelLimits(p99_target_ms=100.0, min_instances=1, max_instances=1)})
        with running_controller(cfg) as controller:
            load, first = _requests(server, model, 40.0, 24.0, seed=11)
            deadline = time.time() + 40
            while time.time() < deadline and (controller.models[model].warm_up or {}).get("state") not in ("added", "failed"):
                time.sleep(0.25)
            load.join()
            status = warm_up_status(controller.models[model])
        records = [json.loads(ln) for ln in log.read_text().splitlines()]
        warmed = [r for r in records if r["reason"] == WARM_UP]
        assert [r["action"] for r in warmed] == ["warming_up", "warmed_up"], [(r["reason"], r["action"]) for r in records]
        assert warmed[-1]["kind"] == "full_reload" and warmed[-1]["live"] == {"instances": 1, "delay_us": 0}
        assert first and all(r.ok for r in first), [r.error for r in first if not r.ok][:3]   # nothing lost in the reload
        live = act.control.config(model)
        assert warmup.ours(live) and 1 in warmup.batch_sizes(live), live.get("model_warmup")
        assert status["live"] and status["by"] == "controller" and status["state"] == "added", status
        # the next scale-ups, in place, under load: each new instance runs the samples before it takes requests,
        # mostly. Triton 2.51 sometimes lets a request in first: in 1 of 17 scale-ups measured alone one request took
        # 894 ms (the cold execution), more often beside other work (CI 125: 2 of 3, with CI's other worker), so six
        # are made and at most three may hold a late request; without the warm-up every one does (882 ms,
        # warmup.py). Why six and three rather than three and one: at 1 in 5 late (a busy machine) three and one
        # fail 10% of the runs that work, six and three 2%, and a missing warm-up fails both every time
        cycles = []
        for seed in (12, 13, 14, 15, 16, 17):
            load, served = _requests(server, model, 60.0, 7.0, seed=seed)
            time.sleep(2.0)
            began = time.monotonic()
            scaled = act.apply(model, Settings(2, 0))
            took = time.monotonic() - began
            load.join()
            cycles.append((scaled, took, served))
            assert act.apply(model, Settings(1, 0)).ok
    finally:
        server.stop()
    late = []
    for scaled, took, served in cycles:
        assert scaled.ok and scaled.kind == "in_place", scaled
        assert took >= 0.8, took      # the 800-ms cold execution ran inside the load, before the instance was ready
        assert served and all(r.ok for r in served), [r.error for r in served if not r.ok][:3]
        late.append(sorted(round(r.latency_s, 3) for r in served if r.latency_s > 0.4))
    print("warm-up", [(r["t"], r["action"], r.get("apply_s"), r["detail"]) for r in warmed], "scale-ups",
          [round(took, 2) for _, took, _ in cycles], "late", late, "first load's slowest",
          round(max(r.latency_s for r in first), 3))
    assert sum(1 for x in late if x) <= 3 and all(len(x) <= 3 for x in late), late
