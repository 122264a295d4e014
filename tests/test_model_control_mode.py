"""A server that takes no model loads (Triton's default --model-control-mode=none, or poll), against a real server:
`run` says so in one line before its loop starts, instead of failing every change with Triton's own words ("...
not allowed if polling is enabled", in mode none too); a dry run goes on; a reload that meets such a server says
what to do; and the probe that asks (the unload of a name no repository holds) changes nothing on a server in
explicit mode."""
from __future__ import annotations

import logging
import time

import pytest

from conftest import TEST_EXIT_TIMEOUT_S, sim_copy
from controller.actuation import CONTROL_OFF, Actuator, TritonControl, classify_error, explain_error
from controller.cli import main
from controller.server import ServerOptions, TritonServer, free_port
from controller.types import Settings

MODEL = "sim_accel"


class _ServerWithoutModelControl(TritonServer):
    """tritonserver in mode `mode`: it loads the repository's models itself at start and takes no load calls."""

    def __init__(self, options: ServerOptions, mode: str) -> None:
        super().__init__(options)
        self.mode = mode

    def command(self, binary, backend_dir):
        cmd = [f"--model-control-mode={self.mode}" if a == "--model-control-mode=explicit" else a
               for a in super().command(binary, backend_dir)]
        return cmd + (["--repository-poll-secs=30"] if self.mode == "poll" else [])

    def load_model(self, name, config=None):
        control = TritonControl(self.grpc_url, self.http_url, "http")
        deadline = time.monotonic() + 60       # why: the server loads it on its own; wait until it serves
        try:
            while not control.ready(name):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not become ready")
                time.sleep(0.2)
        finally:
            control.close()


@pytest.fixture(scope="module", params=["none", "poll"])
def off_server(request, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    sim_copy(repo, MODEL, {})
    s = _ServerWithoutModelControl(ServerOptions(
        repository=repo, models=[MODEL], http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        extra_args=[f"--exit-timeout-secs={TEST_EXIT_TIMEOUT_S}"]), request.param).start()
    yield s
    s.stop()


def _config(server, tmp_path, protocol: str):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"server:\n  http_url: {server.http_url}\n  grpc_url: {server.grpc_url}\n"
                   f"  metrics_url: {server.metrics_url}\n  control_protocol: {protocol}\n"
                   f"models:\n  {MODEL}: {{p99_target_ms: 40}}\n")
    return cfg


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_run_beside_a_server_without_model_control_is_one_line_and_a_dry_run_goes_on(off_server, tmp_path, capsys,
                                                                                       caplog, protocol):
    control = TritonControl(off_server.grpc_url, off_server.http_url, protocol)
    assert control.takes_model_loads() is False
    cfg = _config(off_server, tmp_path, protocol)
    rc = main(["run", "--config", str(cfg), "--duration-s", "5"])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc != 0 and len(lines) == 1 and "Traceback" not in out + err, err
    assert "takes no model loads" in lines[0] and "--model-control-mode=explicit" in lines[0], lines[0]
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    assert main(["run", "--config", str(cfg), "--duration-s", "3", "--dry-run"]) == 0
    assert time.monotonic() - t0 >= 2.5                                        # it ran its loop
    assert any("takes no model loads" in r.getMessage() for r in caplog.records)


def test_a_reload_refused_for_model_control_says_what_to_do(off_server):
    act = Actuator(TritonControl(off_server.grpc_url, off_server.http_url, "grpc"))
    result = act.apply(MODEL, Settings(2, 0))
    assert not result.ok and "not allowed" in result.error and "--model-control-mode=explicit" in result.error
    assert act.read(MODEL)[1] == Settings(1, 0)                                # nothing changed


def test_the_probe_changes_nothing_on_a_server_in_explicit_mode(sim_server):
    for protocol in ("http", "grpc"):
        control = TritonControl(sim_server.grpc_url, sim_server.http_url, protocol)
        before = control.repository_index()
        assert control.takes_model_loads() is True
        assert control.repository_index() == before


def test_the_refusal_reads_as_model_control_off_not_as_an_unreachable_server():
    class GrpcError(Exception):           # what tritonclient.grpc raises: status() and message()
        def status(self):
            return "StatusCode.UNAVAILABLE"

        def message(self):
            return "explicit model load / unload is not allowed if polling is enabled"
    assert classify_error(GrpcError(), key_sent=False) == CONTROL_OFF
    line = explain_error(GrpcError(), "127.0.0.1:8001", key_sent=False)
    assert "takes no model loads" in line and "--model-control-mode=explicit" in line
