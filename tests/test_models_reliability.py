"""Issue 13, item 1, against a real tritonserver: per-request errors when resnet_tiny's forward pass raises,
and a torch thread budget that follows in-place instance updates."""
from __future__ import annotations

import copy
import os
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as http

import network  # model_repository/resnet_tiny/1/network.py (conftest puts it on sys.path)
from conftest import start_server
from controller.actuation import Actuator, TritonControl
from controller.types import Settings


@pytest.fixture(scope="module")
def srv():
    s = start_server(["resnet_tiny"])
    yield s
    s.stop()


def _infer(url: str, x: np.ndarray, **params):
    client = http.InferenceServerClient(url)
    inp = http.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("resnet_tiny", [inp], parameters=params or None).as_numpy("LOGITS")


def _threads(metrics_url: str) -> dict[str, int]:
    text = urllib.request.urlopen(metrics_url).read().decode()
    return {m.group(1): int(float(m.group(2))) for m in
            re.finditer(r'model_torch_threads\{instance="([^"]+)",model="resnet_tiny"\} (\S+)', text)}


def test_a_failing_forward_pass_fails_only_its_own_request(srv):
    control = TritonControl(srv.grpc_url, srv.http_url)
    act = Actuator(control)
    original = control.config("resnet_tiny")
    faulty = copy.deepcopy(original)
    faulty.setdefault("parameters", {})["fault_injection"] = {"string_value": "1"}
    faulty["dynamic_batching"]["max_queue_delay_microseconds"] = "300000"   # the four requests share one batch
    control.load("resnet_tiny", faulty)
    try:
        assert control.ready("resnet_tiny")
        goods = [np.full((1, 3, 32, 32), i, np.float32) for i in (1, 2, 3)]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_infer, srv.http_url, goods[0], fail_forward=True)]
            futures += [pool.submit(_infer, srv.http_url, x) for x in goods]
            results = []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as e:  # noqa: BLE001
                    results.append(e)
        assert "forward pass failed" in str(results[0]) and "injected" in str(results[0])
        net = network.build(0).eval()
        with torch.inference_mode():
            for x, got in zip(goods, results[1:]):
                assert isinstance(got, np.ndarray), got
                np.testing.assert_allclose(got, net(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-5)
        log = srv.log_path.read_text(errors="replace")
        assert "retrying its requests one by one" in log    # they really were in one batch that raised
    finally:
        control.load("resnet_tiny", original)
    assert act.read("resnet_tiny")[1] == Settings(1, 0)


def test_thread_budget_follows_in_place_instance_updates(srv):
    cpus = os.cpu_count() or 1
    act = Actuator(TritonControl(srv.grpc_url, srv.http_url))
    assert act.read("resnet_tiny")[1] == Settings(1, 0)
    x = np.zeros((1, 3, 32, 32), np.float32)

    def drive(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with ThreadPoolExecutor(4) as pool:
            while time.monotonic() < deadline:
                list(pool.map(lambda _: _infer(srv.http_url, x), range(8)))

    drive(2.5)   # a full reload just before (the test above) had old + new stubs alive for a moment
    assert _threads(srv.metrics_url)["resnet_tiny_0_0"] == cpus
    offset = len(srv.log_path.read_text(errors="replace"))
    try:
        up = act.apply("resnet_tiny", Settings(2, 0))
        assert up.ok and up.kind == "in_place"
        assert "unloaded 'resnet_tiny'" not in srv.log_path.read_text(errors="replace")[offset:]
        drive(2.5)     # the old instance re-counts its siblings within a second of its next batch
        threads = _threads(srv.metrics_url)
        assert threads["resnet_tiny_0_0"] == max(1, cpus // 2), threads   # not the stale count of its config (1)
        assert threads["resnet_tiny_0_1"] == max(1, cpus // 2), threads
    finally:
        down = act.apply("resnet_tiny", Settings(1, 0))
    assert down.ok and down.kind == "in_place"
    drive(2.5)
    live = _threads(srv.metrics_url)
    # the removed instance's series stays at its last value (the server keeps it); the one left serves alone
    stubs = [n for n in os.listdir(_registry(srv)) if n.isdigit()]
    assert len(stubs) == 1, stubs
    assert cpus in live.values(), live


def _registry(srv) -> str:
    import subprocess
    import tempfile
    pid = subprocess.run(["pgrep", "-f", f"http-port={srv.http_url.rsplit(':', 1)[1]}"], capture_output=True,
                         text=True).stdout.split()[0]
    return os.path.join(os.environ.get("RESNET_TINY_DIR") or os.path.join(tempfile.gettempdir(), f"resnet_tiny_{pid}"),
                        "resnet_tiny")
