"""What a model is from its live config (controller/modelkind.py), and what the loop does with it: no server."""
from __future__ import annotations

import logging

from controller.config import ControllerConfig, ModelLimits, ServerConfig
from controller.loop import Controller
from controller import modelkind
from controller.modelkind import classify
from controller.observer import TraceFeed
from controller.types import Settings
from test_loop_ticks import LOOP, Clock, FakeControl, FakeModel, FakeScraper, model_config, run_ticks

# as server 2.51 answers GET /v2/models/<m>/config (trimmed)
ENSEMBLE = {"name": "ens", "platform": "ensemble", "backend": "", "max_batch_size": 32, "instance_group": [],
            "ensemble_scheduling": {"step": [{"model_name": "sim_accel", "model_version": -1,
                                              "input_map": {"INPUT": "IN"}, "output_map": {"OUTPUT": "OUT"}}]}}
DECOUPLED = {"name": "stream", "backend": "python", "max_batch_size": 0,
             "model_transaction_policy": {"decoupled": True},
             "instance_group": [{"name": "stream_0", "count": 1, "kind": "KIND_CPU"}]}
NO_BATCH = {"name": "plain", "backend": "python", "max_batch_size": 0,
            "instance_group": [{"name": "plain_0", "count": 1, "kind": "KIND_CPU"}]}
BATCHED = {"name": "sim", "backend": "python", "max_batch_size": 32,
           "dynamic_batching": {"max_queue_delay_microseconds": "0"},
           "model_transaction_policy": {"decoupled": False},
           "instance_group": [{"name": "sim_0", "count": 1, "kind": "KIND_CPU"}]}
SEQUENCE = {"name": "seq", "backend": "onnxruntime", "max_batch_size": 8, "sequence_batching": {"max_sequence_idle_microseconds": "1000"},
            "instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0]}]}


def test_ensemble_has_no_knobs():
    k = classify(ENSEMBLE)
    assert k.ensemble and not k.managed and not k.instances and not k.delay
    assert k.steps == ("sim_accel",) and k.hold_reason == "HoldEnsemble"
    assert "ensemble of sim_accel" in k.describe() and "never reloaded" in k.knobs()


def test_ensemble_by_its_scheduling_even_without_platform():
    assert classify({"name": "e", "ensemble_scheduling": {"step": [{"model_name": "a"}, {"model_name": "b"}]}}).steps == ("a", "b")


def test_decoupled_is_left_alone_with_a_reason():
    k = classify(DECOUPLED)
    assert k.decoupled and not k.managed and k.hold_reason == "HoldDecoupled"
    assert "first response" in k.knobs()
    assert classify({**DECOUPLED, "model_transaction_policy": {"decoupled": "true"}}).decoupled   # string spelling


def test_no_batching_is_instances_only():
    k = classify(NO_BATCH)
    assert k.managed and k.instances and not k.delay and k.hold_reason == ""
    assert k.knobs().startswith("instances only: no batching")


def test_batched_with_dynamic_batcher_has_both_knobs():
    k = classify(BATCHED)
    assert k.managed and k.instances and k.delay and not k.decoupled
    assert k.describe() == "python, batching up to 32, dynamic batcher; knobs: instances and batching delay"


def test_sequence_batcher_is_instances_only():
    k = classify(SEQUENCE)
    assert k.instances and not k.delay and "sequence batcher" in k.knobs()


def test_batching_without_dynamic_batcher_is_instances_only():
    assert classify({"name": "x", "backend": "tensorrt", "max_batch_size": 8}).knobs().startswith(
        "instances only: no dynamic_batching")


def test_only_a_batcher_puts_several_requests_in_one_execution():
    """The planner simulates one request an execution under Triton's default scheduler (no batcher written)."""
    assert classify(BATCHED).batches_requests and classify(SEQUENCE).batches_requests
    assert not classify({"name": "x", "backend": "tensorrt", "max_batch_size": 8}).batches_requests
    assert not classify(NO_BATCH).batches_requests


# ---- the loop ----------------------------------------------------------------------------------------

def make(configs: dict[str, dict], fakes: dict[str, FakeModel], clock: Clock, limits: ModelLimits):
    control = FakeControl(list(configs))
    control.configs.update(configs)
    cfg = ControllerConfig(server=ServerConfig(), loop=LOOP, models={n: limits for n in configs})
    return Controller(cfg, control=control, scraper=FakeScraper(clock, fakes), clock=clock,
                      traces=TraceFeed(None)), control


HOT = ModelLimits(p99_target_ms=40.0, max_instances=4, scale_up_cooldown_s=0.0, max_delay_us=4000)
QUEUEING = dict(rps=300, latency_ms=30, compute_ms=5, pending=4)   # queue builds, p99 near the target: wants more


def test_an_ensemble_is_never_reloaded_and_says_why(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="controller.loop")
    ctl, control = make({"ens": ENSEMBLE, "sim_accel": model_config("sim_accel")},
                        {"ens": FakeModel(**QUEUEING), "sim_accel": FakeModel(**QUEUEING)}, clock, HOT)
    run_ticks(ctl, clock, 8)
    ctl.wait_for_pending()
    assert [m for m, _ in control.loads] and all(m == "sim_accel" for m, _ in control.loads)
    ens = ctl.models["ens"]
    assert ens.last_decision.reason == "HoldEnsemble" and not ens.last_decision.valid
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("ens: ensemble of sim_accel; knobs: none") for line in lines) == 1
    assert sum(line.startswith("sim_accel: ") and line.endswith("knobs: instances and batching delay")
               for line in lines) == 1
    status = ctl.status_snapshot()["models"]["ens"]
    assert status["instances"] is None and "never reloaded" in status["knobs"]
    ctl.close()


def test_a_decoupled_model_is_observed_not_changed():
    clock = Clock()
    ctl, control = make({"stream": DECOUPLED}, {"stream": FakeModel(**QUEUEING)}, clock, HOT)
    run_ticks(ctl, clock, 8)
    assert control.loads == [] and ctl.models["stream"].last_decision.reason == "HoldDecoupled"
    assert ctl.models["stream"].last_obs.valid and ctl.models["stream"].last_obs.arrival_rps > 0   # observed all the same
    ctl.close()


def test_a_non_batching_model_only_changes_instances():
    clock = Clock()
    ctl, control = make({"plain": NO_BATCH}, {"plain": FakeModel(**QUEUEING)}, clock, HOT)
    run_ticks(ctl, clock, 12)
    ctl.wait_for_pending()
    assert control.loads and all(s.max_queue_delay_us == 0 for _, s in control.loads)
    assert max(s.instance_count for _, s in control.loads) > 1
    assert "dynamic_batching" not in control.configs["plain"]
    assert ctl.models["plain"].limits.max_delay_us == 0
    ctl.close()


def test_a_model_on_two_gpus_grows_on_the_idle_one():
    clock = Clock()
    two = {"name": "g", "backend": "python", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": "0"},
           "instance_group": [{"name": "g_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]}
    ctl, control = make({"g": two}, {"g": FakeModel(**QUEUEING)}, clock, ModelLimits(p99_target_ms=40.0, max_instances=3,
                                                                                       scale_up_cooldown_s=0.0, max_delay_us=0))
    from controller.types import GpuObservation
    ctl._devices = lambda scraped: (GpuObservation(0, 97.0, None, None), GpuObservation(1, 20.0, None, None))
    sent, load = [], control.load
    control.load = lambda model, config=None: (sent.append(config), load(model, config))
    for _ in range(6):                # until the first load (the pressure is seen 2-4 ticks in)
        run_ticks(ctl, clock, 1)
        ctl.wait_for_pending()
        if control.loads:
            break
    mm = ctl.models["g"]
    assert mm.limits.min_instances == 2                       # one per GPU the group names
    assert control.loads and control.loads[0][1] == Settings(3, 0)
    assert sent[0]["instance_group"] == [{"name": "g_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},
                                         {"name": "g_0_gpu1", "count": 1, "kind": "KIND_GPU", "gpus": [1]}]
    run_ticks(ctl, clock, 1)
    assert ctl.status_snapshot()["models"]["g"]["per_device"] == {"gpu0": 1, "gpu1": 2}
    run_ticks(ctl, clock, 12)         # the fake's throughput does not grow: it steps back: the extra group goes, the user's is as written
    ctl.wait_for_pending()
    assert control.configs["g"]["instance_group"] == two["instance_group"]
    ctl.close()


def test_status_shows_what_the_model_is_its_devices_and_a_passed_target():
    from controller.status import format_model
    m = {"state": "READY", "instances": 3, "delay_us": 0, "p99_target_ms": 22.5, "reason": "HoldSteady",
         "knobs": "python, batching up to 4, dynamic batcher; knobs: instances and batching delay",
         "per_device": {"gpu0": 2, "gpu1": 1}, "target_from": "ens p99 target 25 ms less 2.5 ms ..."}
    text = "\n".join(format_model("sim2", m))
    assert "model" in text and "knobs: instances and batching delay" in text
    assert "gpu0 2, gpu1 1" in text and "ens p99 target 25 ms" in text


def test_sequence_idle_timeout_read_in_either_spelling_with_triton_default():
    assert modelkind.sequence_idle_s({"sequence_batching": {"max_sequence_idle_microseconds": "5000000"}}) == 5.0
    assert modelkind.sequence_idle_s({"sequenceBatching": {"maxSequenceIdleMicroseconds": 250000}}) == 0.25
    assert modelkind.sequence_idle_s({"sequence_batching": {}}) == 1.0            # Triton's default
    assert modelkind.sequence_idle_s({"sequence_batching": {"max_sequence_idle_microseconds": 0}}) == 1.0
    assert modelkind.sequence_idle_s({"sequence_batching": {"max_sequence_idle_microseconds": "x"}}) == 1.0
    assert modelkind.sequence_idle_s({}) == 1.0
