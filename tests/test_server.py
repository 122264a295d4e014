"""The foundation against a real tritonserver: launcher, models, live config changes."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as http

import network  # model_repository/resnet_tiny/1/network.py (conftest puts it on sys.path)
from conftest import ROOT, process_alive, sim_copy, start_server
from controller.actuation import Actuator, TritonControl
from controller.ownership import mark_of
from controller.server import (ServerError, ServerOptions, TritonServer, find_tritonserver, free_port, port_holder,
                               missing_python_file, remove_shm_regions, repository_models, spawn_dying_with_parent)
from controller.types import Settings


def _infer(client, x: np.ndarray, model="resnet_tiny", name="INPUT", out="LOGITS"):
    inp = http.InferInput(name, list(x.shape), "FP32" if x.dtype == np.float32 else "FP64")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy(out)


def _stats(url: str, model: str) -> dict:
    with urllib.request.urlopen(f"http://{url}/v2/models/{model}/stats") as r:
        return json.load(r)["model_stats"][0]


def test_embedded_server_is_found():
    binary, embedded = find_tritonserver(None)
    assert binary.name == "tritonserver" and binary.exists()
    assert embedded or os.environ.get("PATH", "").count("tritonserver") or binary.is_file()


def test_output_equals_the_torch_network(server):
    client = http.InferenceServerClient(server.http_url)
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    got = _infer(client, x)
    with torch.inference_mode():
        want = network.build(0).eval()(torch.from_numpy(x)).numpy()
    assert got.shape == (4, 10)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_concurrent_clients_all_get_their_own_answer(server):
    xs = [np.full((1, 3, 32, 32), i / 10, dtype=np.float32) for i in range(24)]
    net = network.build(0).eval()

    def one(x):
        return _infer(http.InferenceServerClient(server.http_url), x)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, xs))
    with torch.inference_mode():
        for x, got in zip(xs, outs):
            np.testing.assert_allclose(got, net(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape,dtype,why", [
    ((1, 3, 16, 16), np.float32, "unexpected shape"),
    ((1, 3, 32, 32), np.float64, "FP32"),
], ids=["wrong-shape", "wrong-dtype"])
def test_bad_request_gets_an_error_and_server_keeps_serving(server, shape, dtype, why):
    client = http.InferenceServerClient(server.http_url)
    with pytest.raises(Exception) as err:
        _infer(client, np.zeros(shape, dtype))
    assert why.lower() in str(err.value).lower()
    assert _infer(client, np.zeros((1, 3, 32, 32), np.float32)).shape == (1, 10)


def test_missing_input_is_rejected(server):
    client = http.InferenceServerClient(server.http_url)
    inp = http.InferInput("NOT_AN_INPUT", [1, 16], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
    with pytest.raises(Exception, match="(?i)input"):
        client.infer("sim_accel", [inp])
    assert client.is_model_ready("sim_accel")


def test_malformed_request_fails_alone_inside_a_batch(server):
    """A NaN request batched with good ones gets its own error; the others get their answers."""
    act = Actuator(TritonControl(server.grpc_url, server.http_url))
    before = act.read("resnet_tiny")[1]
    assert act.apply("resnet_tiny", Settings(1, 300_000)).ok   # a long delay so the four requests share a batch
    try:
        execs_before = int(_stats(server.http_url, "resnet_tiny")["execution_count"])
        bad = np.full((1, 3, 32, 32), np.nan, np.float32)
        goods = [np.full((1, 3, 32, 32), i, np.float32) for i in (1, 2, 3)]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_infer, http.InferenceServerClient(server.http_url), x) for x in [bad] + goods]
            results = []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as e:  # noqa: BLE001
                    results.append(e)
        assert "NaN" in str(results[0])
        assert all(isinstance(r, np.ndarray) and r.shape == (1, 10) for r in results[1:])
        assert int(_stats(server.http_url, "resnet_tiny")["execution_count"]) - execs_before == 1
    finally:
        assert act.apply("resnet_tiny", before).ok


def test_model_publishes_its_own_metrics(server):
    client = http.InferenceServerClient(server.http_url)
    _infer(client, np.zeros((3, 3, 32, 32), np.float32))
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    for name in ("model_executions_total", "model_executed_items_total", "model_execution_us_total", "model_last_batch_size"):
        assert f'{name}{{instance="resnet_tiny_0_0",model="resnet_tiny"}}' in text


class _Load:
    """Closed-loop clients sending until stopped; counts successes and failures."""

    def __init__(self, url: str, model: str, x: np.ndarray, inp: str, out: str, clients: int = 4):
        self.ok, self.failed, self.errors = 0, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, model, x, inp, out)) for _ in range(clients)]

    def _run(self, url, model, x, inp, out):
        client = http.InferenceServerClient(url)
        while not self._stop.is_set():
            try:
                _infer(client, x, model, inp, out)
                self.ok += 1
            except Exception as e:  # noqa: BLE001
                self.failed += 1
                self.errors.append(str(e)[:200])

    def __enter__(self):
        for t in self._threads:
            t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)
        self._stop.set()
        for t in self._threads:
            t.join()


def _log_since(server: TritonServer, offset: int) -> str:
    return server.log_path.read_text(errors="replace")[offset:]


def test_instance_count_change_applies_in_place_under_load(server):
    act = Actuator(TritonControl(server.grpc_url, server.http_url))
    assert act.read("sim_accel")[1] == Settings(1, 0)
    offset = len(server.log_path.read_text(errors="replace"))
    x = np.ones((1, 16), np.float32)
    with _Load(server.http_url, "sim_accel", x, "INPUT", "OUTPUT") as load:
        up = act.apply("sim_accel", Settings(3, 0))
        mid_ready = TritonControl(server.grpc_url, server.http_url).ready("sim_accel")
        down = act.apply("sim_accel", Settings(1, 0))
    assert up.ok and up.kind == "in_place" and down.ok
    assert mid_ready
    assert load.failed == 0, load.errors[:3]
    assert load.ok > 20
    log = _log_since(server, offset)
    assert "sim_accel_0_1" in log and "sim_accel_0_2" in log    # only the new instances were created ...
    assert "sim_accel_0_0 (CPU" not in log                      # ... the running one was not re-initialised
    assert "unloaded 'sim_accel'" not in log                    # no full reload


def test_delay_change_is_a_full_reload_and_loses_no_request(server):
    act = Actuator(TritonControl(server.grpc_url, server.http_url))
    offset = len(server.log_path.read_text(errors="replace"))
    x = np.ones((1, 16), np.float32)
    with _Load(server.http_url, "sim_accel", x, "INPUT", "OUTPUT") as load:
        first = act.apply("sim_accel", Settings(1, 2000))
        back = act.apply("sim_accel", Settings(1, 0))
    assert first.ok and first.kind == "full_reload" and back.ok
    assert load.failed == 0, load.errors[:3]
    assert load.ok > 20
    deadline = time.monotonic() + 15   # the old copy is unloaded in the background after the new one is live
    while _log_since(server, offset).count("successfully unloaded 'sim_accel'") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _log_since(server, offset).count("successfully unloaded 'sim_accel'") == 2
    live = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2/models/sim_accel/config").read())
    assert int(live["dynamic_batching"]["max_queue_delay_microseconds"]) == 0


# ---- launcher errors: one clear line, non-zero exit, nothing left behind ---------------------------

def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_missing_binary_is_a_clear_error():
    r = _cli("serve", "--tritonserver", "/nonexistent/tritonserver", "--no-controller")
    assert r.returncode == 1
    assert "no executable file there" in r.stderr and "Traceback" not in r.stderr


def test_taken_port_is_a_clear_error_that_names_who_holds_it(server):
    """The holder named: here a tritonserver that no serve started (this test run's), said with how to stop it."""
    taken = server.http_url.rsplit(":", 1)[1]
    r = _cli("serve", "--http-port", taken, "--grpc-port", str(free_port()), "--metrics-port", str(free_port()))
    assert r.returncode == 1
    assert f"HTTP port 127.0.0.1:{taken} is already in use by tritonserver (pid {server.process.pid}), which no " \
           f"running serve started" in r.stderr and f"kill -9 {server.process.pid}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len([ln for ln in r.stderr.splitlines() if "port" in ln]) == 1, r.stderr


def test_port_holder_names_the_listening_process_and_none_for_a_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_holder(port) is None                 # bound, not listening: nobody serves there
        s.listen()
        assert port_holder(port) == f"{Path(f'/proc/{os.getpid()}/comm').read_text().strip()} (pid {os.getpid()})"
    assert port_holder(port) is None


def test_a_second_serve_on_a_running_serves_port_names_that_serve():
    lines: list[str] = []
    proc, http_port = _serve("sim_accel", lines)
    try:
        r = _cli("serve", "--http-port", str(http_port), "--grpc-port", str(free_port()),
                 "--metrics-port", str(free_port()), "--no-controller")
        assert r.returncode == 1
        assert f"HTTP port 127.0.0.1:{http_port} is already in use by tritonserver (pid " in r.stderr, r.stderr
        assert f"), started by serve pid {proc.pid} (`python -m controller status --pid {proc.pid}`)" in r.stderr
    finally:
        _ctrl_c(proc, lines, http_port)


def test_a_model_folder_is_one_with_a_config_or_a_version_folder(tmp_path):
    """`serve` loads what the server could: a folder with a config.pbtxt, or one whose version folder the server
    auto-completes a config for (a config-less model: tests/test_ownership.py loads one)."""
    (tmp_path / "with_config").mkdir()
    (tmp_path / "with_config" / "config.pbtxt").write_text('backend: "python"\n')
    (tmp_path / "no_config" / "1").mkdir(parents=True)
    (tmp_path / "no_config" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a model\n")
    (tmp_path / "logs" / "2024").mkdir(parents=True)                 # a numeric folder, no model file in it
    (tmp_path / "logs" / "2024" / "run.log").write_text("\n")
    (tmp_path / ".cache" / "1").mkdir(parents=True)
    (tmp_path / "README.md").write_text("the repository's own notes\n")
    assert repository_models(tmp_path) == ["no_config", "with_config"]
    options = ServerOptions(repository=tmp_path, models=["no_config", "notes", "logs"])
    with pytest.raises(ServerError, match=r"model\(s\) notes, logs not found in .* 1/model.py, 1/model.onnx"):
        TritonServer(options).model_names()
    (tmp_path / "empty").mkdir()
    r = _cli("serve", "--repository", str(tmp_path / "empty"))
    assert r.returncode == 1 and "no model in" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_model_that_fails_to_load_is_a_clear_error(tmp_path):
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: 0\n'
                                                  'input [{name: "X", data_type: TYPE_FP32, dims: [1]}]\n'
                                                  'output [{name: "Y", data_type: TYPE_FP32, dims: [1]}]\n')
    (repo / "broken" / "1" / "model.py").write_text("raise RuntimeError('this model cannot load')\n")
    with pytest.raises(ServerError, match="model 'broken' failed to load"):
        start_server(["broken"], repository=repo)


def test_a_python_model_without_its_file_is_found_before_its_load(tmp_path, caplog):
    """Triton 2.51's Python backend never answers the load of a model whose model.py is missing (300 s here, then
    the client's timeout): serve finds it first, in the newest version folder (the default policy) or each one the
    config's policy loads, under the file name the config gives; a model of another backend is not its business."""
    def model(name: str, config: str, files: dict[str, str]) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(config)
        for rel in files:
            (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / rel).write_text("")
        return tmp_path / name
    py = 'backend: "python"\n'
    assert missing_python_file(model("ok", py, {"1/model.py": ""})) is None
    assert missing_python_file(model("none", py, {"1/other.py": ""})) == str(tmp_path / "none" / "1" / "model.py")
    newest = str(tmp_path / "old" / "2" / "model.py")
    assert missing_python_file(model("old", py, {"1/model.py": "", "2/x": ""})) == newest
    # a policy of the config's: every version folder it loads must hold the file (one lacking it hangs the load)
    policy = py + "version_policy: { all {} }\n"
    assert missing_python_file(model("pol", policy, {"1/model.py": "", "2/x": ""})) == str(tmp_path / "pol/2/model.py")
    one_lacks = {"1/x": "", "2/model.py": ""}
    assert missing_python_file(model("pol1", policy, one_lacks)) == str(tmp_path / "pol1/1/model.py")
    assert missing_python_file(model("both", policy, {"1/model.py": "", "2/model.py": ""})) is None
    latest2 = py + "version_policy {\n  latest {\n    num_versions: 2\n  }\n}\n"
    files = {"1/x": "", "2/model.py": "", "3/model.py": ""}
    assert missing_python_file(model("lat", latest2, files)) is None                      # 1 is not loaded
    specific = py + "version_policy: { specific { versions: [1, 3] } }\n"
    assert missing_python_file(model("spec", specific, files)) == str(tmp_path / "spec/1/model.py")
    live = model("livepol", 'backend: "onnxruntime"\n', files)
    assert missing_python_file(live, {"backend": "python", "version_policy": {"latest": {"num_versions": 1}}}) is None
    assert missing_python_file(live, {"backend": "python", "version_policy": {"specific": {"versions": ["1", "3"]}}}) \
        == str(live / "1" / "model.py")                        # a live config's int64 versions come as strings
    assert missing_python_file(live, {"backend": "python", "version_policy": {"all": {}}}) == str(live / "1/model.py")
    # the file is parsed as a ModelConfig (a comment inside the policy is no policy lost) ...
    commented = py + "version_policy {\n  # every version we ship\n  all {}\n}\n"
    assert missing_python_file(model("cmtpol", commented, one_lacks)) == str(tmp_path / "cmtpol/1/model.py")
    # ... and read by patterns where it does not parse here (a field of a newer server)
    newer = policy + "a_field_of_a_newer_server: 1\n"
    assert missing_python_file(model("newer", newer, one_lacks)) == str(tmp_path / "newer/1/model.py")
    assert missing_python_file(model("named", py + 'default_model_filename: "m.py"\n', {"1/m.py": ""})) is None
    assert missing_python_file(model("onnx", 'backend: "onnxruntime"\n', {"1/x": ""})) is None
    assert missing_python_file(model("cmt", '# backend: "python"\nbackend: "onnxruntime"\n', {"1/x": ""})) is None
    folder = model("live", 'backend: "onnxruntime"\n', {"1/x": ""})       # the config given wins over the file
    assert missing_python_file(folder, {"backend": "python"}) == str(folder / "1" / "model.py")
    assert missing_python_file(tmp_path / "absent") is None
    repo = tmp_path / "repo"
    sim_copy(repo, "nofile", {})
    (repo / "nofile" / "1" / "model.py").unlink()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"model 'nofile' failed to load: .*nofile/1/model.py not found"):
        start_server(["nofile"], repository=repo)
    assert time.monotonic() - t0 < 60
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=["nofile"],
                            repository=repo)
    # a folder copied with its relative link (cp -r) holds a link to nothing: said so
    (repo / "nofile" / "1" / "model.py").symlink_to("../../../elsewhere/model.py")
    with caplog.at_level(logging.WARNING, logger="controller.server"):
        with pytest.raises(ServerError, match=r"model 'nofile' failed to load: .*nofile/1/model.py not found: it is "
                                              r"a symbolic link to (\.\./){3}elsewhere/model.py, which does not exist"):
            TritonServer(options).start({"nofile": {"name": "nofile", "backend": "python"}})    # serve's marked load
    assert "loading it from its file" not in caplog.text            # no second try: it could only fail the same


def test_a_load_the_server_does_not_answer_or_dies_in_is_one_line(tmp_path):
    """A model whose initialize outlasts the load timeout, and one whose initialize kills tritonserver: each a
    ServerError naming the model and what happened (never a socket error's traceback)."""
    cfg = ('name: "{n}"\nbackend: "python"\nmax_batch_size: 0\n'
           'input [{{name: "X", data_type: TYPE_FP32, dims: [1]}}]\n'
           'output [{{name: "Y", data_type: TYPE_FP32, dims: [1]}}]\n')
    body = {"slow": "import time\nclass TritonPythonModel:\n    def initialize(self, args):\n        time.sleep(20)\n",
            "killer": "import os, signal\nclass TritonPythonModel:\n    def initialize(self, args):\n"
                      "        os.kill(os.getppid(), signal.SIGKILL)\n"}
    repo = tmp_path / "repo"
    for name, code in body.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(cfg.format(n=name))
        (repo / name / "1" / "model.py").write_text(code)
    with pytest.raises(ServerError, match=r"^model 'slow' failed to load: the server did not answer its load "
                                          r"within 2 s \(see its log: .*\)$"):
        start_server(["slow"], repository=repo, load_timeout_s=2.0)
    with pytest.raises(ServerError, match=r"^model 'killer' failed to load: tritonserver exited with code -9 "
                                          r"\(SIGKILL\) while loading it: "):
        start_server(["killer"], repository=repo)


def test_a_model_whose_initialize_raises_is_one_line_naming_where_and_how_to_serve_the_others(tmp_path):
    """A user's repository with one broken model: the server's answer carries the stub's Python traceback over
    several lines ("At:" and its frames); serve's error is one line with the raising frame, and says how to serve
    the other models (it stops, as tritonserver does with --exit-on-error)."""
    repo = tmp_path / "repo"
    sim_copy(repo, "good", {})
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: 0\n'
                                                  'input [{name: "X", data_type: TYPE_FP32, dims: [1]}]\n'
                                                  'output [{name: "Y", data_type: TYPE_FP32, dims: [1]}]\n')
    (repo / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n"
        "        raise RuntimeError('weights file missing')\n")
    with pytest.raises(ServerError) as e:
        start_server(None, repository=repo)
    text = str(e.value)
    assert "\n" not in text, text
    assert "RuntimeError: weights file missing (at " in text and "model.py(3): initialize)" in text, text
    assert text.endswith("to serve the others, name them: --models good"), text


def test_a_load_errors_python_traceback_becomes_its_first_frame():
    from controller.server import load_error_text
    two = "load failed: Internal: ValueError: bad\n\nAt:\n  /a/lib.py(10): load\n  /m/1/model.py(5): initialize\n;\n"
    assert load_error_text(two) == "load failed: Internal: ValueError: bad (at /a/lib.py(10): load + 1 frame)"
    assert load_error_text("plain\nmessage  here") == "plain message here"
    assert load_error_text("a path At: b") == "a path At: b"          # no frames block: only the spaces change


def _serve(model: str, lines: list[str], env: dict | None = None, *more: str) -> tuple[subprocess.Popen, int]:
    """`python -m controller serve` of `model` (and `more` arguments) on free ports, read up to its "controller
    managing" line (into `lines`); the process and its HTTP port."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "controller", "serve", "--http-port", str(http_port),
                             "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--models", model,
                             *more], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("controller managing"):
                break
    except BaseException:
        proc.kill()                                     # e.g. the test's timeout while serve starts: no process left
        raise
    return proc, http_port


def _ctrl_c(proc: subprocess.Popen, lines: list[str], http_port: int) -> str:
    """Ctrl-C serve (SIGKILL if it has not exited in 60 s); its remaining output. It must exit 0 and leave no server
    on its port."""
    try:
        proc.send_signal(2)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + rest
    assert not subprocess.run(["pgrep", "-f", f"http-port={http_port}"], capture_output=True, text=True).stdout
    return rest


def test_serve_answers_then_stops_cleanly_leaving_no_process(tmp_path):
    t0 = time.monotonic()
    lines: list[str] = []
    proc, http_port = _serve("resnet_tiny", lines)
    try:
        client = http.InferenceServerClient(f"127.0.0.1:{http_port}")
        assert _infer(client, np.zeros((1, 3, 32, 32), np.float32)).shape == (1, 10)
        assert time.monotonic() - t0 < 30, "serve must answer inference within 30 s"
        mark = mark_of(client.get_model_config("resnet_tiny"))
        assert mark is not None and mark.pid == proc.pid, "loaded with serve's owner mark: no claim (a full reload) to follow"
        server_pids = subprocess.run(["pgrep", "-f", f"http-port={http_port}"], capture_output=True, text=True).stdout.split()
        assert server_pids
        stub_pids = _children_of(server_pids)
        assert stub_pids, "the Python backend runs one stub process per instance"
        cmdline = Path(f"/proc/{server_pids[0]}/cmdline").read_bytes().decode().split("\0")
        prefix = next(a.split("shm-region-prefix-name=", 1)[1] for a in cmdline if "shm-region-prefix-name=" in a)
        assert list(Path("/dev/shm").glob(f"{prefix}*")), "the stubs' shared memory carries this server's prefix"
    finally:
        rest = _ctrl_c(proc, lines, http_port)
    assert "stopped" in rest
    assert not [pid for pid in stub_pids if process_alive(pid)]
    assert not list(Path("/dev/shm").glob(f"{prefix}*")), "no shared-memory region outlives the server"


def test_serve_refuses_a_config_model_the_repository_lacks_and_names_one_it_does_not_load(tmp_path):
    """`serve --config` whose models: name one the repository does not hold (a typo: the model meant would go
    unmanaged) is a one-line error before the server starts; one it holds but `serve` did not load (not in
    --models) is named at start-up as waiting, not left to a warning per model in the log."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("models:\n  sim_acel: {p99_target_ms: 40}\n")
    r = subprocess.run([sys.executable, "-m", "controller", "serve", "--config", str(typo), "--models", "sim_accel",
                        "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port",
                        str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "models: sim_acel not in the repository" in r.stderr and "its models: resnet_tiny, sim_accel" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "tritonserver ready" not in r.stdout
    both = tmp_path / "both.yaml"
    both.write_text("models:\n  sim_accel: {p99_target_ms: 40}\n  resnet_tiny: {p99_target_ms: 60}\n")
    lines: list[str] = []
    proc, _ = _serve("sim_accel", lines, None, "--config", str(both))
    try:
        assert lines[-1].startswith("controller managing"), "".join(lines)
        assert any(line.startswith("not loaded: resnet_tiny (named in the config, not loaded by serve --models "
                                   "sim_accel)") for line in lines), "".join(lines)
        proc.send_signal(2)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0


def test_a_serve_that_stops_before_its_controller_runs_is_said_so_with_its_last_lines():
    """evaluation.serveproc.ServeProcess, which the scripts that drive `serve` share: a serve that exits before
    "controller managing" (here a taken port) raises with serve's own error line, and leaves no process."""
    from controller.evaluation.serveproc import ServeProcess, ServeStopped
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = str(s.getsockname()[1])
        serve = ServeProcess(["--http-port", taken, "--grpc-port", str(free_port()), "--metrics-port",
                              str(free_port())], cwd=ROOT)
        with pytest.raises(ServeStopped, match=f"before the controller started:(.|\n)*HTTP port 127.0.0.1:{taken}"):
            serve.start()
    assert serve.exit_code not in (None, 0)


def test_stop_removes_only_its_own_shm_regions(tmp_path):
    for name in ("tritonctl_1_ab_x", "tritonctl_1_ab_y", "tritonctl_2_cd_x", "triton_python_backend_shm_region_z"):
        (tmp_path / name).write_bytes(b"")
    assert remove_shm_regions("tritonctl_1_ab_", tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["triton_python_backend_shm_region_z", "tritonctl_2_cd_x"]
    assert remove_shm_regions("", tmp_path) == 0                    # an empty prefix never matches everything
    assert remove_shm_regions("x_", tmp_path / "no_such_dir") == 0   # no /dev/shm: nothing to do


def test_a_users_own_shm_prefix_is_kept():
    ours = TritonServer(ServerOptions()).command(Path("tritonserver"), None)
    assert sum("shm-region-prefix-name=tritonctl_" in a for a in ours) == 1
    theirs = TritonServer(ServerOptions(extra_args=["--backend-config=python,shm-region-prefix-name=mine_"]))
    cmd = theirs.command(Path("tritonserver"), None)
    assert [a for a in cmd if "shm-region-prefix-name" in a] == ["--backend-config=python,shm-region-prefix-name=mine_"]


def _children_of(pids: list[str]) -> list[str]:
    out = []
    for pid in pids:
        r = subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True)
        out += r.stdout.split()
    return out


def _in_python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw)


def test_a_started_server_dies_with_the_process_that_started_it():
    parent = _in_python("import time\nfrom controller.server import spawn_dying_with_parent\n"
                        "p = spawn_dying_with_parent(['sleep', '60'])\nprint(p.pid, flush=True)\ntime.sleep(60)")
    pid = parent.stdout.readline().strip()

    def argv() -> list[bytes]:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
        except OSError:
            return []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and argv() != [b"sleep", b"60"]:
            time.sleep(0.05)
        assert argv() == [b"sleep", b"60"]           # the interpreter in between exec'd the command, same pid
        parent.kill()                                 # kill -9: no cleanup of its own
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process_alive(pid):
            time.sleep(0.05)
        assert not process_alive(pid), "the command outlived the process that started it"
    finally:
        parent.kill()
        if process_alive(pid) and argv() == [b"sleep", b"60"]:
            os.kill(int(pid), 9)


def test_no_at_fork_hook_of_the_parent_runs_before_the_server_execs(tmp_path):
    """subprocess runs a parent's at-fork hooks (gRPC's among them) in the child only for a preexec_fn; ours has none."""
    code = ("import os, subprocess, sys\nfrom controller.server import spawn_dying_with_parent\n"
            "os.register_at_fork(after_in_child=lambda: open(sys.argv[1], 'w').close())\n"
            "spawn_dying_with_parent(['true']).wait() if sys.argv[2] == 'ours' else "
            "subprocess.Popen(['true'], preexec_fn=lambda: None).wait()\n")
    for how, hook_ran in (("ours", False), ("preexec_fn", True)):     # the second: the check can see a hook run
        marker = tmp_path / how
        subprocess.run([sys.executable, "-c", code, str(marker), how], cwd=ROOT, check=True, timeout=60)
        assert marker.exists() == hook_ran, how


def test_a_command_that_cannot_start_says_why(tmp_path):
    p = spawn_dying_with_parent([str(tmp_path / "no_such_binary")], stderr=subprocess.PIPE, text=True)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 127 and "cannot start" in err and "No such file" in err, (p.returncode, err)


def test_starting_a_process_beside_busy_grpc_threads_never_aborts_it(server):
    """The CI abort, reproduced: with 4 threads calling the server over gRPC, a preexec_fn Popen's child died -6
    in 15 and 31 of 400 starts (one-off script); spawn_dying_with_parent's in 0 of 400. 100 starts here."""
    import tritonclient.grpc as grpcclient
    stop = threading.Event()

    def hammer():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        while not stop.is_set():
            try:
                client.is_server_live()
            except Exception:  # noqa: BLE001 - only the load matters here
                pass
        client.close()

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        codes = [spawn_dying_with_parent(["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait(timeout=30)
                 for _ in range(100)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert codes == [0] * 100, {c: codes.count(c) for c in set(codes)}


def test_an_aborted_servers_last_words_are_its_exception_and_backtrace(tmp_path):
    # the CI abort of stop 33, as tritonserver 2.51 writes one (frames 0-8: its signal handler, libc, libstdc++)
    log = tmp_path / "tritonserver.log"
    frames = [f" {i}# 0x00007F48278A3F16 in /lib/x86_64-linux-gnu/libc.so.6" for i in range(9)]
    log.write_text("\n".join([
        "Signal (11) received.", " 0# 0x0000556CD01DE52D in triton_python_backend_stub",  # an earlier one's
        *[f'I1204 06:19:5{i}.0 1 model_lifecycle.cc:472] "loading: sim_accel:1"' for i in range(5)],
        'I1204 06:20:01.1 1 model_lifecycle.cc:839] "successfully loaded \'sim_accel\'"',
        "W1204 06:20:02.2 1 metrics.cc:1] \"an earlier warning\"",
        "terminate called after throwing an instance of 'std::length_error'",
        "  what():  vector::_M_default_append",
        "Signal (6) received.", *frames,
        " 9# std::__throw_length_error(char const*) in /lib/x86_64-linux-gnu/libstdc++.so.6",
        "10# triton::core::SomeFunction() in /opt/lib/libtritonserver.so"]) + "\n")
    server = TritonServer(ServerOptions())
    server.log_path = log                               # what start() sets
    tail = server.log_tail()
    assert tail.startswith("terminate called after throwing an instance of 'std::length_error' | what():  "
                           "vector::_M_default_append | Signal (6) received.")
    assert tail.endswith("10# triton::core::SomeFunction() in /opt/lib/libtritonserver.so")   # the frame that threw
    assert "an earlier warning" not in tail
    # without an abort: the last error or warning lines, as before
    log.write_text("I1 x] \"fine\"\nE2 y] \"failed to load 'm'\"\nI3 z] \"still fine\"\n")
    assert server.log_tail() == "E2 y] \"failed to load 'm'\""
    # a server started again appends to the same log: its last words are its own lines', not the earlier abort's
    log.write_text("corrupted double-linked list (not small)\nSignal (6) received.\n")
    server.log_offset = log.stat().st_size                      # what a restart's launch sets
    with open(log, "a") as f:
        f.write("I1 x] \"started again\"\nI2 y] \"successfully loaded 'm'\"\n")
    assert server.log_tail() == "I1 x] \"started again\" | I2 y] \"successfully loaded 'm'\""


def test_serve_names_the_abort_and_keeps_the_log_of_a_server_that_died(tmp_path):
    lines: list[str] = []
    proc, http_port = _serve("sim_accel", lines, {**os.environ, "TRITON_AUTOTUNE_RUN_DIR": str(tmp_path)},
                             "--max-restarts", "0")
    try:
        server_pid = int(subprocess.run(["pgrep", "-f", f"http-port={http_port}"], capture_output=True,
                                        text=True).stdout.split()[0])
        os.kill(server_pid, 6)                          # SIGABRT: tritonserver's handler prints its backtrace
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 1, out
    last = rest.strip().splitlines()[-1]
    assert "tritonserver exited with code -6 (SIGABRT): Signal (6) received. | 0# " in last, out
    assert last.endswith("; not started again: restarts are off (--max-restarts 0)"), out
    kept = Path(re.search(r"\(full log: (\S+)\)", last).group(1))
    try:
        assert kept.parent == Path(tempfile.gettempdir()) and "Signal (6) received." in kept.read_text(), out
        assert "successfully loaded 'sim_accel'" in kept.read_text()          # the whole log, not its tail
    finally:
        kept.unlink(missing_ok=True)


def _lines_after(proc: subprocess.Popen, lines: list[str], wanted: str, timeout_s: float) -> str:
    """Read serve's output (into `lines`) until a line starting with `wanted`; that line. A reader thread, so that a
    serve that never prints it fails the test after `timeout_s` instead of hanging it."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(wanted):
                found.append(line)
                return
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert found, f"no line starting {wanted!r} within {timeout_s:.0f} s:\n" + "".join(lines)
    return found[0]


def _status_until(url: str, cond, timeout_s: float = 30.0) -> dict:
    """The controller's /status entry for sim_accel once `cond` holds of it (fails the test after `timeout_s`)."""
    deadline, model = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as r:
            model = json.loads(r.read()).get("models", {}).get("sim_accel") or {}
        if cond(model):
            return model
        time.sleep(0.5)
    pytest.fail(f"not so within {timeout_s:.0f} s: {model}")


def test_serve_starts_a_dead_server_again_with_its_live_configs(tmp_path):
    """SIGSEGV under serve (Triton 2.51 has crashed so after an in-place scale-up): serve starts tritonserver again on
    the same ports, the model loaded with the live config it had (2 instances and 700 us set by an operator, where
    the file says 1 and 0 us), and a model the operator loaded by hand (not serve's) loaded again too; the controller
    goes on, and `status` names the restart."""
    env = {**os.environ, "TRITON_AUTOTUNE_RUN_DIR": str(tmp_path), "TRITON_ADMIN_KEY": "k123"}
    lines: list[str] = []
    # why --dry-run: the controller changes nothing itself, so the live config is the operator's throughout
    proc, http_port = _serve("sim_accel", lines, env, "--dry-run")
    try:
        client = http.InferenceServerClient(f"127.0.0.1:{http_port}")
        cfg = client.get_model_config("sim_accel")
        assert cfg["instance_group"][0]["count"] == 1
        cfg["instance_group"][0]["count"] = 2
        cfg["dynamic_batching"]["max_queue_delay_microseconds"] = "700"
        client.load_model("sim_accel", config=json.dumps(cfg), headers={"admin-key": "k123"})
        status_url = re.search(r"or (http://127\.0\.0\.1:\d+/status)", "".join(lines)).group(1)
        _status_until(status_url, lambda m: m.get("instances") == 2)   # the controller read the operator's config
        client.load_model("resnet_tiny", headers={"admin-key": "k123"})
        time.sleep(6)                                   # why: serve reads what the server runs every 5 s
        before = subprocess.run(["pgrep", "-f", f"http-port={http_port}"], capture_output=True,
                                text=True).stdout.split()
        assert len(before) == 1
        os.kill(int(before[0]), signal.SIGSEGV)
        died = _lines_after(proc, lines, "tritonserver exited with code -11 (SIGSEGV)", 30)
        assert "starting it again (restart 1 of at most 3 within 600 s)" in died, died
        kept = Path(re.search(r"\(full log: (\S+)\)", died).group(1))
        _lines_after(proc, lines, "tritonserver started again", 60)
        after = subprocess.run(["pgrep", "-f", f"http-port={http_port}"], capture_output=True, text=True).stdout.split()
        assert len(after) == 1 and after != before
        live = client.get_model_config("sim_accel")
        assert live["instance_group"][0]["count"] == 2, live["instance_group"]
        assert int(live["dynamic_batching"]["max_queue_delay_microseconds"]) == 700
        assert _infer(client, np.ones((1, 16), np.float32), "sim_accel", "INPUT", "OUTPUT").shape[0] == 1
        assert client.is_model_ready("resnet_tiny")
        shown = subprocess.run([sys.executable, "-m", "controller", "status"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "tritonserver died and was restarted 1 time(s)" in shown.stdout, shown.stdout
        assert "exited with code -11 (SIGSEGV), started again" in shown.stdout, shown.stdout
        # the controller reads the server again after the gap
        _status_until(status_url, lambda m: m.get("reachable") and m.get("reason") not in ("HoldServerUnreachable",
                                                                                          "HoldNotLoaded"))
    finally:
        _ctrl_c(proc, lines, http_port)
    try:
        assert "Signal (11) received." in kept.read_text()
    finally:
        kept.unlink(missing_ok=True)


def test_a_slow_stop_is_named_and_a_server_that_ignores_sigterm_is_killed(caplog):
    # a stand-in for a tritonserver waiting out its exit timeout: it ignores SIGTERM for 60 s
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    server = TritonServer(ServerOptions())
    server.process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert server.process.stdout.readline() == b"up\n"      # its handler is set before SIGTERM comes
    server.process.stdout.close()                            # it writes nothing more
    pid = server.process.pid
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="controller.server"):
        server.stop(timeout_s=4.0)
    took = time.monotonic() - start
    messages = [r.getMessage() for r in caplog.records]
    assert f"waiting up to 1 s more for tritonserver (pid {pid}) to unload its models and exit" in messages, messages
    assert f"tritonserver (pid {pid}) did not exit within 4 s of SIGTERM; killing it" in messages, messages
    assert 4.0 <= took < 15, took
    assert server.process is None and not process_alive(pid)


def test_a_quick_stop_says_nothing(caplog):
    server = TritonServer(ServerOptions())
    server.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    with caplog.at_level(logging.INFO, logger="controller.server"):
        server.stop(timeout_s=30.0)                     # SIGTERM's default action ends it at once
    assert not [r for r in caplog.records if r.name == "controller.server"], caplog.records
