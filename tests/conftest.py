"""Shared fixtures: a real tritonserver (the pip one, or TRITONSERVER on PATH) with the shipped repository."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
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


def start_server(models: list[str], **kw) -> TritonServer:
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
