"""Shared fixtures: a real tritonserver (the pip one, or TRITONSERVER on PATH) with the shipped repository."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "model_repository" / "resnet_tiny" / "1"))  # network.py, to compare outputs

from controller.server import ServerOptions, TritonServer, free_port  # noqa: E402


def start_server(models: list[str], **kw) -> TritonServer:
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=models, **kw)
    return TritonServer(options).start()


@pytest.fixture(scope="session")
def server():
    """One server for the read-mostly tests; tests that change a model put it back."""
    s = start_server(["resnet_tiny", "sim_accel"])
    yield s
    s.stop()
