"""Real repositories on a real tritonserver (issue 15): an ensemble in front of a model on two SIMULATED GPUs,
a model without batching, a Python BLS model. The repository is built in a tmp folder by the fixture.

* `sim2`: the SIMULATED accelerator (model_repository/sim_accel) with two instance groups named
  `sim2_simgpu0` and `sim2_simgpu1`: one instance on each of two simulated GPUs (own slots, own memory series).
* `ens`: an ensemble whose one step is `sim2`. Never reloaded, never given instances.
* `plain`: the simulated model with `max_batch_size: 0` and no dynamic batcher: instances only.
* `bls`: a Python model that calls `sim2` for each request (Business Logic Scripting).
* `hog`: an idle copy of the simulated model with 2 instances on simulated GPU 0 only, for the per-GPU budget.
"""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from conftest import live_stubs, open_loop, running_controller, sim_copy, sim_gpu_memory_mib, start_server
from controller import groups
from controller.actuation import Actuator, TritonControl, settings_of
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.gpu import SIM_GPU_MEMORY
from controller.signals import Scraper

ENSEMBLE = """name: "ens"
platform: "ensemble"
max_batch_size: 32
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [ { model_name: "sim2", model_version: -1, input_map { key: "INPUT", value: "IN" },
           output_map { key: "OUTPUT", value: "OUT" } } ]
}
"""

BLS_CONFIG = """name: "bls"
backend: "python"
max_batch_size: 32
input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

BLS_MODEL = '''import sys
sys.dont_write_bytecode = True
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS: each request is sent on to `sim2`, its answer passed back."""

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT")
            answer = pb_utils.InferenceRequest(model_name="sim2", requested_output_names=["OUTPUT"],
                                               inputs=[pb_utils.Tensor("INPUT", x.as_numpy())]).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(answer.error().message())))
            else:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.get_output_tensor_by_name(answer, "OUTPUT")]))
        return responses
'''


SLOW = {'"fixed_overhead_ms", value: { string_value: "4" }': '"fixed_overhead_ms", value: { string_value: "8" }',
        '"device_parallelism", value: { string_value: "2" }': '"device_parallelism", value: { string_value: "1" }'}


@pytest.fixture(scope="module")
def repo_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    sim_copy(repo, "sim2", {
        **SLOW, "max_batch_size: 32": "max_batch_size: 4",
        "{ count: 1, kind: KIND_CPU }": '{ name: "sim2_simgpu0", count: 1, kind: KIND_CPU, host_policy: "simgpu0" },\n'
                                        '  { name: "sim2_simgpu1", count: 1, kind: KIND_CPU, host_policy: "simgpu1" }'})
    (repo / "ens" / "1").mkdir(parents=True)
    (repo / "ens" / "config.pbtxt").write_text(ENSEMBLE.replace("max_batch_size: 32", "max_batch_size: 4"))
    sim_copy(repo, "plain", {
        **SLOW, "max_batch_size: 32": "max_batch_size: 0", "dims: [ 16 ]": "dims: [ 1, 16 ]",
        "dynamic_batching {\n  max_queue_delay_microseconds: 0\n}\n": "",
        '"device_name", value: { string_value: "sim0" }': '"device_name", value: { string_value: "plain_dev" }'})
    (repo / "bls" / "1").mkdir(parents=True)
    (repo / "bls" / "config.pbtxt").write_text(BLS_CONFIG)
    (repo / "bls" / "1" / "model.py").write_text(BLS_MODEL)
    sim_copy(repo, "hog", {"{ count: 1, kind: KIND_CPU }": '{ name: "hog_simgpu0", count: 2, kind: KIND_CPU, host_policy: "simgpu0" }'})
    s = start_server(["sim2", "ens", "plain", "bls", "hog"], repository=repo)
    yield s
    s.stop()


def _config(server, tmp_path, models: dict[str, ModelLimits]) -> ControllerConfig:
    return ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, gpu="simulated",
                        decision_log=str(tmp_path / "decisions.jsonl"), observation_log=str(tmp_path / "obs.jsonl")),
        models=models)


def _limits(max_instances=4):
    return ModelLimits(p99_target_ms=20.0, max_instances=max_instances, scale_up_cooldown_s=1.0,
                       scale_down_delay_s=600.0, delay_cooldown_s=600.0, max_delay_us=0)


def _load(server, model, rate_rps: float, seconds: float, out: list, seed=5):
    out.extend(open_loop(server, model, rate_rps, seconds, seed))


def _memory_evidence(server) -> str:
    """What the simulated GPUs' memory reading is made of, for a failure message: the server's
    sim_gpu<k>_memory_bytes series (labelled by instance and stub pid) and its stub processes alive now."""
    import urllib.request
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
            series = [line for line in r.read().decode().splitlines() if SIM_GPU_MEMORY.match(line)]
    except OSError as e:
        series = [f"/metrics not read: {e}"]
    stubs = [f"pid {pid}: {argv[-2]} ({argv[1]})" for pid, argv in sorted(live_stubs(server).items()) if len(argv) > 2]
    return "\n".join(["memory series:"] + series + ["stubs alive:"] + stubs)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_ensemble_is_never_reloaded_and_its_step_grows_on_the_two_simulated_gpus(repo_server, tmp_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="controller.loop")
    control = TritonControl(repo_server.grpc_url, repo_server.http_url)
    live = control.config("sim2")
    assert groups.instances_per_device(live) == {"gpu0": 1, "gpu1": 1}
    cfg = _config(repo_server, tmp_path, {"ens": _limits(), "sim2": _limits()})
    results: list = []
    with running_controller(cfg) as controller:
        _load(repo_server, "ens", rate_rps=200, seconds=25, out=results)
    failed = [r for r in results if not r.ok]
    assert results and not failed, failed[:3]
    records = _records(tmp_path / "decisions.jsonl")
    assert not [r for r in records if r["model"] == "ens" and r["action"] != "hold"], \
        [(r["action"], r["reason"]) for r in records if r["model"] == "ens"]
    assert {r["reason"] for r in records if r["model"] == "ens"} <= {"HoldEnsemble"}
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("ens: ensemble of sim2; knobs: none") for line in lines), lines[:5]
    assert any(line.startswith("sim2: python, batching up to 4") for line in lines), lines[:5]
    # the step grew (the planner's or the reactive rules' reason): it starts at 2 instances
    ups = [r for r in records if r["model"] == "sim2" and r["action"] == "applied" and r["target"]["instances"] > 2]
    assert ups, [(r["model"], r["action"], r["reason"]) for r in records]
    assert all(r["kind"] == "in_place" for r in records if r["model"] == "sim2" and r["action"] == "applied")
    after = control.config("sim2")
    per = groups.instances_per_device(after)
    live = controller.models["sim2"].current.instance_count
    assert set(per) == {"gpu0", "gpu1"} and sum(per.values()) == live >= 2
    # it may step back where the added instances bought nothing on this machine (a CI run: 4 instances read a
    # p99 of 35.0 ms where 2 had read 30.0, contention measured at gamma 0.12: "2x0us predicted buys nothing");
    # then by a scale-down decision, each on both GPUs
    applied = [r for r in records if r["model"] == "sim2" and r["action"] == "applied"]
    downs = [b for a, b in zip(applied, applied[1:]) if b["target"]["instances"] < a["target"]["instances"]]
    assert live >= 3 or (downs and all(r["reason"].startswith("ScaleDown") for r in downs)), \
        [(r["reason"], r["target"], r["detail"][:120]) for r in applied]
    assert [(g["name"], g["kind"]) for g in after["instance_group"]] == [("sim2_simgpu0", "KIND_CPU"),
                                                                        ("sim2_simgpu1", "KIND_CPU")]
    devices = controller.models["sim2"].last_obs.gpus
    assert [g.index for g in devices] == [0, 1] and all(g.memory_used_bytes > 0 for g in devices)
    assert control.ready("ens")


def test_a_model_without_batching_only_changes_instances(repo_server, tmp_path):
    cfg = _config(repo_server, tmp_path, {"plain": _limits()})
    results: list = []
    with running_controller(cfg) as controller:
        _load(repo_server, "plain", rate_rps=130, seconds=20, out=results)
        mm = controller.models["plain"]
        assert mm.kind is not None and not mm.kind.delay and mm.kind.instances
    assert results and all(r.ok for r in results), [r for r in results if not r.ok][:3]
    applied = [r for r in _records(tmp_path / "decisions.jsonl") if r["action"] in ("applied", "failed")]
    assert applied and all(r["action"] == "applied" and r["kind"] == "in_place" for r in applied), applied
    assert all(r["target"]["delay_us"] == 0 for r in applied)
    assert "dynamic_batching" not in TritonControl(repo_server.grpc_url, repo_server.http_url).config("plain")


def test_a_bls_model_is_managed_and_serves_without_failures(repo_server, tmp_path):
    cfg = _config(repo_server, tmp_path, {"bls": _limits(max_instances=3)})
    results: list = []
    with running_controller(cfg) as controller:
        _load(repo_server, "bls", rate_rps=60, seconds=12, out=results)
        mm = controller.models["bls"]
        assert mm.kind is not None and mm.kind.managed and mm.kind.backend == "python"
    assert results and all(r.ok for r in results), [r for r in results if not r.ok][:3]
    records = _records(tmp_path / "decisions.jsonl")
    assert not [r for r in records if r["action"] == "failed"], records
    assert records and all(r["model"] == "bls" for r in records)


def test_the_ensemble_target_is_passed_to_its_step(repo_server, tmp_path, caplog):
    """Only the ensemble has a target (25 ms); its step is not named and its own (default) target is loose
    (1 s). The controller manages the step as part of the ensemble, on the ensemble's target."""
    import logging

    import numpy as np
    from controller.types import Settings
    caplog.set_level(logging.INFO, logger="controller.loop")
    assert Actuator(TritonControl(repo_server.grpc_url, repo_server.http_url)).apply("sim2", Settings(2, 0)).ok
    cfg = _config(repo_server, tmp_path, {"ens": dataclasses.replace(_limits(), p99_target_ms=25.0)})
    cfg = dataclasses.replace(cfg, defaults=dataclasses.replace(_limits(), p99_target_ms=1000.0))
    results: list = []
    with running_controller(cfg) as controller:
        _load(repo_server, "ens", rate_rps=200, seconds=25, out=results, seed=11)
        step = controller.models.get("sim2")
        assert step is not None and step.target_from is not None and step.target_from.ensemble == "ens"
        assert step.limits.p99_target_ms <= 25.0
    assert results and all(r.ok for r in results), [r for r in results if not r.ok][:3]
    assert any(m.startswith("sim2: managed as a step of ensemble ens") for m in caplog.messages)
    records = _records(tmp_path / "decisions.jsonl")
    assert not [r for r in records if r["model"] == "ens" and r["action"] != "hold"]
    # the step grew (the planner's or the reactive rules' reason): it starts at 2 instances
    ups = [r for r in records if r["model"] == "sim2" and r["action"] == "applied" and r["target"]["instances"] > 2]
    assert ups, "\n".join([f"{r['model']} {r['action']} {r['reason']} {r.get('mode')}: {r['detail']}" for r in records]
                           + [_memory_evidence(repo_server)])
    done = np.array([r.done_s for r in results])
    lat = np.array([1000 * r.latency_s for r in results])
    late = lat[done >= np.median(done)]
    print(f"ensemble client p99: first half {np.percentile(lat[done < np.median(done)], 99):.1f} ms, "
          f"second half {np.percentile(late, 99):.1f} ms (target 25 ms); step at "
          f"{controller.models['sim2'].current.instance_count} instances")


def test_the_memory_budget_holds_on_each_gpu_and_instances_go_where_there_is_room(repo_server, tmp_path):
    """sim2 has one instance on each simulated GPU; `hog` fills GPU 0 up to the 192 MiB budget (2 + 1 instances
    of 64 MiB), GPU 1 holds 64 MiB. Under load sim2 may grow by 2, on GPU 1 only: the budget holds on each GPU
    (summed over both GPUs, 256 MiB of a 192 MiB budget would have allowed none)."""
    from controller.actuation import Actuator
    from controller.types import Settings
    control = TritonControl(repo_server.grpc_url, repo_server.http_url)
    assert Actuator(control).apply("sim2", Settings(2, 0)).ok
    assert groups.instances_per_device(control.config("sim2")) == {"gpu0": 1, "gpu1": 1}
    budget_mb = 192.0
    limits = dataclasses.replace(_limits(max_instances=6), memory_budget_mb=budget_mb)
    cfg = _config(repo_server, tmp_path, {"sim2": limits})
    stop, samples, errors = threading.Event(), [], []

    def watch():
        watcher = TritonControl(repo_server.grpc_url, repo_server.http_url)
        scraper = Scraper(repo_server.metrics_url, repo_server.http_url)
        while not stop.wait(0.25):
            try:
                samples.append((groups.instances_per_device(watcher.config("sim2")), sim_gpu_memory_mib(scraper)))
            except Exception as e:  # noqa: BLE001 - a missed sample is counted, not fatal
                errors.append(repr(e))
        watcher.close()

    results: list = []
    thread = threading.Thread(target=watch)
    thread.start()
    try:
        with running_controller(cfg):
            _load(repo_server, "sim2", rate_rps=260, seconds=25, out=results, seed=13)
    finally:
        stop.set()
        thread.join()
    assert results and all(r.ok for r in results), [r for r in results if not r.ok][:3]
    assert len(samples) >= 60 and len(errors) <= len(samples) // 10, errors[:3]
    # why str: pytest shortens a non-str message's repr to a line, which cut the evidence of the memory flake
    # (a CI run read gpu0 128 / gpu1 128 MiB where 192 / 64 were held); each reading of the first 10 s is kept
    early = "\n".join(f"{k * 0.25:5.2f} s: {per} {mem}" for k, (per, mem) in enumerate(samples[:40]))
    assert all(per["gpu0"] == 1 for per, _ in samples), f"placements with gpu0 != 1 (the budget is full there):\n" \
        f"{early}\n{_memory_evidence(repo_server)}"
    # grew on gpu1, within its room of 2; whether by 1 or 2 is the planner's call on the predicted gain (a
    # 4th instance at ~282 req/s was predicted under 10% better than three in one run, so it stayed at 3)
    assert 2 <= max(per["gpu1"] for per, _ in samples) <= 3, f"gpu1 did not grow within its room of 2:\n{early}\n" \
        f"{_memory_evidence(repo_server)}"
    over = [mem for _, mem in samples if any(v > budget_mb for v in mem.values())]
    assert not over, over[:3]                                            # as the device reported it, per GPU
    records = _records(tmp_path / "decisions.jsonl")
    assert not [r for r in records if r["action"] == "failed"], [r for r in records if r["action"] == "failed"][:2]
    # the memory ceiling is 4, per GPU: 1 on the full gpu0 + 3 on gpu1 (summed over the GPUs, 256 MiB used of
    # a 192 MiB budget, it would be the live 2)
    capped = [r for r in records if r["reason"] == "HoldMemoryCap" and r.get("mode") == "model"]
    assert capped and all("up to 4 instance(s)" in r["detail"] for r in capped), \
        [(r["reason"], r.get("mode"), r["detail"]) for r in records]
    # the decision log says where the instances are (what scripts/gpu_bench.sh prints for two real GPUs)
    assert records[0]["per_device"] == {"gpu0": 1, "gpu1": 1}
    assert any(r.get("per_device") in ({"gpu0": 1, "gpu1": 2}, {"gpu0": 1, "gpu1": 3}) for r in records)


def test_warm_up_samples_load_on_a_model_without_batching_and_a_bls_model(repo_server):
    """warmup.py's samples as Triton 2.51 takes them: batch size 1 of the declared [1, 16] for a model without
    batching; every size up to 32 for the BLS model, whose samples call its callee during the load. Over HTTP for
    the one (its config JSON has `dims` as numbers and an empty `model_warmup` list), gRPC for the other. Each model
    is put back as it was (a full reload without them) for the module's other tests."""
    from controller import warmup
    for model, sizes, protocol in (("plain", [1], "http"), ("bls", list(range(1, 33)), "grpc")):
        act = Actuator(TritonControl(repo_server.grpc_url, repo_server.http_url, protocol=protocol))
        before = act.control.config(model)
        assert not warmup.has_warmup(before)
        samples, what = warmup.samples(before, {})
        try:
            result = act.warm_up(model, samples)
            after = act.control.config(model)
            assert result.ok and result.kind == "full_reload" and result.live == settings_of(before), result
            assert warmup.ours(after) and warmup.batch_sizes(after) == sizes, (what, after.get("model_warmup"))
            served = open_loop(repo_server, model, 40.0, 1.0, seed=3)
            assert served and all(r.ok for r in served), [r.error for r in served if not r.ok][:3]
        finally:
            act.control.load(model, before)
        assert not warmup.has_warmup(act.control.config(model))
