"""`run` beside a server started otherwise: the repository its tritonserver was given, read from /proc where the
config sets no `server.repository` (controller/server.py `served_repository`, controller/cli.py); and `status
--config FILE` finding the `run` started with FILE on the free port it took (controller/runstate.py)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, start_server
from controller import runstate
from controller.cli import main
from controller.config import load_config
from controller.status import gather, resolve
from controller.server import free_port, repository_of_argv, served_repository


def test_the_repository_a_command_line_names(tmp_path):
    (tmp_path / "models").mkdir()
    here = str(tmp_path / "models")
    assert repository_of_argv(["tritonserver", f"--model-repository={here}", "--strict-model-config=false"], None) \
        == (Path(here), "")
    assert repository_of_argv(["tritonserver", "--model-repository", here], None) == (Path(here), "")
    assert repository_of_argv(["tritonserver", f"--model-store={here}"], None) == (Path(here), "")
    assert repository_of_argv(["tritonserver", "--model-repository=models"], tmp_path) == (tmp_path / "models", "")
    cases = {
        "names no --model-repository": ["tritonserver", "--http-port=8000"],
        "serves 2 repositories": ["tritonserver", f"--model-repository={here}", "--model-repository=/other"],
        "is not a folder on this machine": ["tritonserver", "--model-repository=s3://bucket/models"],
        "relative to a working folder not readable here": ["tritonserver", "--model-repository=models"],
        "is not a folder this machine sees": ["tritonserver", f"--model-repository={tmp_path / 'gone'}"],
    }
    for why, argv in cases.items():
        path, said = repository_of_argv(argv, None)
        assert path is None and why in said, (argv, said)


def test_nothing_listening_is_said_as_such():
    port = free_port()
    assert served_repository(port) == (None, f"no tritonserver process this user can read listens on port {port}")


@pytest.mark.slow
def test_run_without_server_repository_reads_the_one_its_local_server_was_given(tmp_path, caplog):
    server = start_server(["sim_accel"])
    try:
        port = int(server.http_url.rsplit(":", 1)[1])
        path, why = served_repository(port)
        assert path == (ROOT / "model_repository").resolve() and why.startswith("the --model-repository of "), why
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"server: {{http_url: '{server.http_url}', grpc_url: '{server.grpc_url}', "
                       f"metrics_url: '{server.metrics_url}'}}\n"
                       f"controller: {{decision_log: '{tmp_path / 'd.jsonl'}'}}\n")
        caplog.set_level(logging.INFO, logger="controller")
        # the config names no metrics port: run takes a free one, and `status --config` finds it by the file's path
        docs: list[dict] = []

        def ask() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not docs:
                if runstate.controller_for_config(cfg) is not None:
                    docs.append(gather(resolve(str(cfg), None, load_config)))
                time.sleep(0.2)
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        assert main(["run", "--config", str(cfg), "--duration-s", "6", "--dry-run"]) == 0     # signals: main thread
        asking.join(5)
        assert docs and docs[0]["controller"] is not None and docs[0]["controller_error"] is None, docs
        assert docs[0]["controller"]["status_url"] is None     # a port it picked itself: it writes no owner mark
        assert runstate.controller_for_config(cfg) is None               # its file goes when it stops
        said = [r.getMessage() for r in caplog.records if "server.repository" in r.getMessage()]
        assert said == [f"server.repository not set: reading {path}, {why}"], said
    finally:
        server.stop()
