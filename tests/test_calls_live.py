"""A BLS model's calls, seen in the request traces of a real 2.51 (controller/calls.py): `bls` of the mixed
repository calls `plain` once per row, passing its request's trace on (`trace=request.trace()`). The controller,
told only of `bls`, learns the call, manages `plain` under `bls`'s target (its own, the defaults', is looser),
and `status` says both. A caller that does not pass its trace on is found in its source instead, where the
repository is readable here. A caller that sends its calls at once (`async_exec`) is seen waiting for fewer of them
in sequence than it sends."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from conftest import ROOT, open_loop, running_controller, start_server
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.status import format_model

MIXED = ROOT / "scripts" / "scenarios" / "repos" / "mixed"


def _bls_config(server, tmp_path, repository=None, dry_run=False):
    """Only bls named (60 ms, at most 2 instances), plain left to the defaults' 1 s."""
    return ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url,
                            repository=repository),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, tracing=True, dry_run=dry_run,
                        decision_log=str(tmp_path / "decisions.jsonl"), gpu="simulated", owner_mark=False),
        defaults=ModelLimits(p99_target_ms=1000.0),
        models={"bls": ModelLimits(p99_target_ms=60.0, max_instances=2)})


@pytest.mark.slow
def test_a_bls_models_callee_is_found_in_its_traces_and_runs_under_its_target(tmp_path):
    server = start_server(["bls", "plain"], repository=MIXED)
    cfg = _bls_config(server, tmp_path)
    try:
        with running_controller(cfg) as controller:
            records = open_loop(server, "bls", rate_rps=20.0, seconds=12.0, seed=5)
            assert records and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
            assert controller.calls.edges() == (("bls", "plain"),)
            assert controller.calls.calls_per_request("bls", "plain") == 1.0      # one row a request: one call
            plain = controller.models.get("plain")
            assert plain is not None, "plain is managed as a model bls calls"
            assert plain.limits.p99_target_ms == 60.0 and plain.target_from is not None
            assert plain.target_from.ensemble == "bls" and "bls calls plain" in plain.target_from.why
            snap = controller.status_snapshot()["models"]
            assert snap["bls"]["calls"] == {"plain": {"per_request": 1.0, "in_sequence": 1.0, "traced": True}}
            assert snap["plain"]["called_by"] == ["bls"]
            text = "\n".join(format_model("plain", {**snap["plain"], "state": "READY"}))
            called_by = [ln.split() for ln in text.splitlines() if ln.strip().startswith("called by")]
            assert "(target p99 60.0 ms from bls" in text, text
            assert called_by == [["called", "by", "bls,", "seen", "in", "their", "request", "traces"]], text
    finally:
        server.stop()


@pytest.mark.slow
def test_a_callers_callee_is_found_in_its_source_where_its_calls_are_not_traced(tmp_path):
    """bls_check's untraced arm: the same bls without `trace=` (plain's calls carry no parent). With the
    repository readable (serve's, or `server.repository`), bls's model.py names plain: plain runs under bls's
    target all the same, and status says the calls are not measured."""
    from conftest import load_script
    repo = tmp_path / "repo"
    load_script("bls_check").make_repo(repo, traced=False)
    server = start_server(["bls", "plain"], repository=repo)
    cfg = _bls_config(server, tmp_path, repository=str(repo), dry_run=True)
    try:
        with running_controller(cfg) as controller:
            records = open_loop(server, "bls", rate_rps=20.0, seconds=8.0, seed=5)
            assert records and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
            assert controller.calls.edges() == (("bls", "plain"),)
            assert not controller.calls.traced("bls", "plain"), "the untraced bls's calls carry no parent_id"
            plain = controller.models.get("plain")
            assert plain is not None and plain.limits.p99_target_ms == 60.0
            assert "bls calls plain (named in its model.py" in plain.target_from.why
            snap = controller.status_snapshot()["models"]
            text = "\n".join(format_model("bls", {**snap["bls"], "state": "READY"}))
            assert "plain named in its model.py" in text and "trace=request.trace()" in text, text
    finally:
        server.stop()


FAN = """import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            calls = [pb_utils.InferenceRequest(model_name="plain", requested_output_names=["OUTPUT"],
                                               inputs=[pb_utils.Tensor("INPUT", row[None, :])],
                                               trace=request.trace()).async_exec() for row in x]
            rows = [pb_utils.get_output_tensor_by_name(a, "OUTPUT").as_numpy()[0] for a in await asyncio.gather(*calls)]
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", np.stack(rows).astype(np.float32))]))
        return responses
"""


@pytest.mark.slow
def test_calls_sent_at_once_are_seen_as_fewer_in_sequence(tmp_path):
    """`fan` sends each of a request's 4 rows to `plain` at once; `plain` has 4 instances (on a device of 2 slots):
    4 calls a request, and the request waits for fewer than 4 call times."""
    repo = tmp_path / "repo"
    shutil.copytree(MIXED / "plain", repo / "plain", symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    plain_cfg = repo / "plain" / "config.pbtxt"
    plain_cfg.write_text(plain_cfg.read_text().replace("{ count: 1, kind: KIND_CPU }", "{ count: 4, kind: KIND_CPU }"))
    shutil.copytree(MIXED / "bls", repo / "fan", ignore=shutil.ignore_patterns("__pycache__", "model.py"))
    (repo / "fan" / "config.pbtxt").write_text((repo / "fan" / "config.pbtxt").read_text().replace('"bls"', '"fan"'))
    (repo / "fan" / "1" / "model.py").write_text(FAN)
    server = start_server(["fan", "plain"], repository=repo)
    cfg = ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=1.0, min_span_s=2.0, tracing=True, dry_run=True,
                        decision_log=str(tmp_path / "decisions.jsonl"), gpu="simulated", owner_mark=False),
        models={"fan": ModelLimits(p99_target_ms=100.0), "plain": ModelLimits(p99_target_ms=100.0, min_instances=4,
                                                                              max_instances=4)})
    try:
        with running_controller(cfg) as controller:
            records = open_loop(server, "fan", rate_rps=10.0, seconds=8.0, seed=7, batch_size=4)
            assert records and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
            assert controller.calls.edges() == (("fan", "plain"),)
            assert controller.calls.calls_per_request("fan", "plain") == 4.0
            # one call after the other would read 4.0; the calls' spans overlap here (measured once: 1.2)
            assert 1.0 <= controller.calls.calls_in_sequence("fan", "plain") < 3.0
    finally:
        server.stop()


TO_ENS = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            answer = pb_utils.InferenceRequest(model_name="ens", requested_output_names=["OUT"],
                                               inputs=[pb_utils.Tensor("IN", x)], trace=request.trace()).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(answer.error().message())))
                continue
            out = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses
"""


@pytest.mark.slow
def test_a_bls_model_calling_an_ensemble_passes_its_target_through_it_to_the_ensembles_step(tmp_path):
    """`bls` sends each request to the ensemble `ens` (-> `ens_step`), its trace passed on: on 2.51 the ensemble's
    request is traced as bls's child and its step as the ensemble's. ens (its own target 500 ms) runs under bls's
    60 ms, and ens_step under ens's."""
    repo = tmp_path / "repo"
    for m in ("ens", "ens_step"):
        shutil.copytree(MIXED / m, repo / m, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(MIXED / "bls", repo / "bls", ignore=shutil.ignore_patterns("__pycache__", "model.py"))
    (repo / "bls" / "1" / "model.py").write_text(TO_ENS)
    server = start_server(["bls", "ens", "ens_step"], repository=repo)
    cfg = _bls_config(server, tmp_path, dry_run=True)
    cfg = dataclasses.replace(cfg, models={**cfg.models, "ens": ModelLimits(p99_target_ms=500.0)})
    try:
        with running_controller(cfg) as controller:
            records = open_loop(server, "bls", rate_rps=20.0, seconds=10.0, seed=3)
            assert records and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
            assert controller.calls.edges() == (("bls", "ens"), ("ens", "ens_step"))
            ens, step = controller.models["ens"], controller.models["ens_step"]
            assert ens.limits.p99_target_ms == 60.0 and ens.target_from.ensemble == "bls"
            assert step.limits.p99_target_ms <= 60.0 and step.target_from.ensemble == "ens"
    finally:
        server.stop()
