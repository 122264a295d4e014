"""Shared fixtures: a real tritonserver (the pip one, or TRITONSERVER on PATH) with the shipped repository."""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "model_repository" / "resnet_tiny" / "1"))  # network.py, to compare outputs

from controller.server import ServerOptions, TritonServer, free_port  # noqa: E402

# Every `serve` the tests start (in-process or as a subprocess) leaves its run-state file and decision log in a
# throwaway folder, never in the user's: a test must not find, or be found by, a serve the user is running.
os.environ["TRITON_AUTOTUNE_RUN_DIR"] = tempfile.mkdtemp(prefix="triton-autotune-tests-")
atexit.register(shutil.rmtree, os.environ["TRITON_AUTOTUNE_RUN_DIR"], True)


def process_alive(pid: int | str) -> bool:
    """Running, not a zombie (this container's init may not reap orphans): /proc/<pid>/stat's state is not Z."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def live_stubs(server: TritonServer) -> dict[int, list[str]]:
    """The live (not zombie) `triton_python_backend_stub` children of a started server: pid -> argv
    (argv[1] is the model's model.py, argv[-2] the instance's name)."""
    kids = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout.split()
    out = {}
    for k in kids:
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and argv[0].endswith("triton_python_backend_stub") and process_alive(k):
            out[int(k)] = argv
    return out


# why: after a failed full reload (a test of one) tritonserver 2.51's shutdown waits its whole exit timeout
# (30 s by default) for the failed version, which stays "live"; three module teardowns lost 30 s each to it in CI.
# A healthy test server stops in ~2 s. `serve` keeps Triton's default for users (a graceful drain).
TEST_EXIT_TIMEOUT_S = 5


@contextlib.contextmanager
def running_controller(cfg):
    """A Controller on `cfg`, ticking on its own thread until the block ends; then stopped and closed."""
    from controller.loop import Controller
    controller = Controller(cfg)
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,))
    thread.start()
    try:
        yield controller
    finally:
        stop.set()
        thread.join()
        controller.close()


def open_loop(server: TritonServer, model: str, rate_rps: float, seconds: float, seed: int,
              batch_size: int = 1) -> list:
    """Open-loop Poisson requests at `model` at `rate_rps` for `seconds` (inputs from its live config, `batch_size`
    items each), each failed if not answered within 10 s; their records."""
    from controller.actuation import TritonControl
    from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync
    trace = load_trace({"phases": [{"name": "busy", "duration_s": seconds, "rate_rps": rate_rps}]})
    schedule = poisson_schedule(trace, seed=seed, max_requests=int(rate_rps * seconds * 2))
    cfg = TritonControl(server.grpc_url, server.http_url).config(model)
    return run_open_loop_sync(server.grpc_url, model, schedule, inputs_from_config(cfg, batch_size=batch_size),
                              timeout_s=10.0)


def start_server(models: list[str], **kw) -> TritonServer:
    kw["extra_args"] = [f"--exit-timeout-secs={TEST_EXIT_TIMEOUT_S}", *kw.get("extra_args", [])]
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=models, **kw)
    return TritonServer(options).start()


@pytest.fixture(scope="session")
def server():
    """One server for the read-mostly tests; tests that change a model put it back."""
    s = start_server(["resnet_tiny", "sim_accel"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sim_server():
    """A server with only the SIMULATED accelerator model, one per test module."""
    s = start_server(["sim_accel"])
    yield s
    s.stop()


def sim_copy(repo: Path, name: str, replace: dict[str, str]) -> None:
    """A copy of model_repository/sim_accel named `name` in `repo`, with each `replace` (old: new) made in its
    config.pbtxt (each old text must be there)."""
    shutil.copytree(ROOT / "model_repository" / "sim_accel", repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / name / "config.pbtxt"
    text = cfg.read_text().replace('name: "sim_accel"', f'name: "{name}"')
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    cfg.write_text(text)


def sim_gpu_memory_mib(scraper) -> dict[int, float]:
    """Memory in use per simulated GPU, as the instances report it on the server's /metrics (`scraper`: a
    controller.signals.Scraper); RuntimeError when /metrics cannot be read."""
    from controller.gpu import SIM_GPU_MEMORY
    metrics = scraper.metrics()
    if metrics is None:
        raise RuntimeError("the server's /metrics could not be read")
    out: dict[int, float] = {}
    for c in metrics.values():
        for key, value in c.custom.items():
            m = SIM_GPU_MEMORY.fullmatch(key)
            if m:
                out[int(m.group(1))] = out.get(int(m.group(1)), 0.0) + value / 2**20
    return out


def load_script(name: str):
    """scripts/<name>.py as a module (registered under `name`, so its dataclasses resolve), for the tests of the
    scripts that are not part of the package."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
