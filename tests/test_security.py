"""Triton's restricted repository API: an unauthenticated load is refused (HTTP 403, gRPC UNAVAILABLE with
"This protocol is restricted"), the controller's loads, which send the header named in its config with the
value from the environment variable it names, succeed over gRPC and HTTP, and the key never reaches a log."""
from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, start_server
from controller.actuation import Actuator, TritonControl
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller.loop import Controller
from controller.server import free_port
from controller.types import Settings

MODEL = "sim_accel"
HEADER = "admin-key"
KEY = "s3cr3t-KEY-4f9a1c"              # distinctive, so a leak anywhere is found by a substring search
WRONG_KEY = "wrong-KEY-77b2e0"
ENV = "SECURITY_TEST_ADMIN_KEY"


@pytest.fixture(scope="module")
def guarded():
    s = start_server([MODEL], restricted_key=(HEADER, KEY))
    yield s
    s.stop()


def _http_load(server, headers: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/models/{MODEL}/load", data=b"",
                                 method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_unauthenticated_loads_are_refused_over_http_and_grpc(guarded):
    for headers in ({}, {HEADER: WRONG_KEY}):
        status, body = _http_load(guarded, headers)
        assert status == 403, (status, body)
        assert "restricted" in body and KEY not in body
        with pytest.raises(InferenceServerException) as err:
            grpcclient.InferenceServerClient(guarded.grpc_url).load_model(
                MODEL, headers={f"triton-grpc-protocol-{k}": v for k, v in headers.items()})
        assert err.value.status() == "StatusCode.UNAVAILABLE" and "restricted" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            grpcclient.InferenceServerClient(guarded.grpc_url).get_model_repository_index(headers=headers)
        assert "restricted" in err.value.message()
    # inference and reading a config stay open; the model still serves
    assert httpclient.InferenceServerClient(guarded.http_url).get_model_config(MODEL)["name"] == MODEL
    assert grpcclient.InferenceServerClient(guarded.grpc_url).is_model_ready(MODEL)


def test_the_key_holder_can_load(guarded):
    status, body = _http_load(guarded, {HEADER: KEY})
    assert status == 200, body


def _config(server, log_path: Path, protocol: str, env: str = ENV, min_instances: int = 1) -> ControllerConfig:
    return ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url,
                            control_protocol=protocol, auth_header=HEADER, auth_key_env=env, timeout_s=5.0),
        loop=LoopConfig(interval_s=0.2, window_s=2.0, settle_s=0.2, min_span_s=1.0, decision_log=str(log_path),
                        gpu="none", failure_backoff_s=60.0),
        models={MODEL: ModelLimits(min_instances=min_instances, max_instances=4, max_delay_us=0,
                                   scale_down_delay_s=600.0)})


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_controller_loads_with_the_key_from_its_config_and_never_logs_it(guarded, tmp_path, caplog, monkeypatch, protocol):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(ENV, KEY)
    monkeypatch.setenv("WRONG_" + ENV, WRONG_KEY)
    log_path = tmp_path / "decisions.jsonl"
    act = Actuator(TritonControl(guarded.grpc_url, guarded.http_url, headers={HEADER: KEY}))
    assert act.apply(MODEL, Settings(1, 0)).ok
    # min_instances 2 makes the controller load a new config through the loop (ScaleUpToMin) after one window
    controller = Controller(_config(guarded, log_path, protocol, min_instances=2))
    wrong = Controller(_config(guarded, tmp_path / "wrong.jsonl", protocol, env="WRONG_" + ENV, min_instances=3))
    try:
        stop = threading.Event()
        t = threading.Thread(target=controller.run, args=(stop,))
        t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and act.read(MODEL)[1] != Settings(2, 0):
            time.sleep(0.1)
        stop.set()
        t.join(30)
        assert act.read(MODEL)[1] == Settings(2, 0)
        # a controller with the wrong key: its load is refused, reported, and the wrong key is not logged either
        wrong.run(threading.Event(), max_ticks=20)
        assert act.read(MODEL)[1] == Settings(2, 0)
    finally:
        controller.close()
        wrong.close()
        act.apply(MODEL, Settings(1, 0))
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert any(r["action"] == "applied" and r["reason"] == "ScaleUpToMin" for r in records), records
    refused = [json.loads(line) for line in (tmp_path / "wrong.jsonl").read_text().splitlines()
               if json.loads(line)["action"] == "failed"]
    assert len(refused) == 1 and "restricted" in refused[0]["error"], refused
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records) + log_path.read_text() + \
        (tmp_path / "wrong.jsonl").read_text()
    assert "restricted" in logged          # the refusal was logged ...
    assert KEY not in logged and WRONG_KEY not in logged   # ... and neither value ever was


def test_serve_restricts_the_repository_api_and_prints_no_key(tmp_path):
    """`serve` starts the server with the restriction on (the key from $TRITON_ADMIN_KEY here, generated
    otherwise), the controller it runs loads through it, and the key is only in a 0600 file."""
    ports = {"--http-port": free_port(), "--grpc-port": free_port(), "--metrics-port": free_port()}
    args = [sys.executable, "-m", "controller", "serve", "--models", MODEL, "--duration-s", "6",
            "--decision-log", str(tmp_path / "d.jsonl")]
    for flag, port in ports.items():
        args += [flag, str(port)]
    env = {**os.environ, "TRITON_ADMIN_KEY": KEY}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("controller managing"):
                break
        key_file = Path(next(ln for ln in lines if "repository API restricted" in ln).split(" in ")[1].split(" ")[0])
        assert key_file.read_text() == KEY
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

        class _S:
            http_url = f"127.0.0.1:{ports['--http-port']}"
        assert _http_load(_S, {})[0] == 403
        with pytest.raises(InferenceServerException, match="restricted"):
            grpcclient.InferenceServerClient(f"127.0.0.1:{ports['--grpc-port']}").load_model(MODEL)
        # the controller that serve runs reads the live config through the guarded API
        control = TritonControl(f"127.0.0.1:{ports['--grpc-port']}", _S.http_url, headers={HEADER: KEY})
        assert control.repository_index()
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert KEY not in output
    assert "Traceback" not in output
