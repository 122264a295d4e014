"""Bad input through the command line: every mistake is one line on stderr and exit code 2 (1 for a server
that cannot be reached), naming the field or option and its valid range; never a traceback."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from controller.cli import main
from controller.server import free_port


def _one_line_error(capsys, rc: int, expected_rc: int = 2) -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == expected_rc, (rc, out, err)
    assert len(lines) == 1, err
    assert "Traceback" not in out + err
    return lines[0]


BAD_CONFIGS = [
    ("malformed-yaml", "controller: {interval_s: 2\n", ["not valid YAML at line 2, column 1"]),
    ("malformed-indent", "server:\n  http_url: a\n grpc_url: b\n", ["not valid YAML at line"]),
    ("out-of-range-int", "models:\n  sim_accel: {max_instances: 0}\n",
     ["models.sim_accel.max_instances", "must be an integer in [1, 64], got 0"]),
    ("out-of-range-float", "controller: {interval_s: 0.01}\n", ["controller.interval_s", "[0.1, 600]", "0.01"]),
    ("wrong-type", "defaults: {p99_target_ms: fast}\n", ["defaults.p99_target_ms", "must be a number in [0.1, 600000]", "'fast'"]),
    ("negative-budget", "defaults: {memory_budget_mb: -5}\n", ["defaults.memory_budget_mb", "[1, 1e+07]"]),
    ("bad-choice", "controller: {gpu: cuda}\n", ["controller.gpu", "auto, nvml, simulated, none", "'cuda'"]),
    ("unknown-field", "controller: {intervl_s: 2}\n", ["controller.intervl_s: unknown field; valid fields:", "interval_s"]),
    ("unknown-model-field", "models:\n  sim_accel: {max_instance: 3}\n", ["models.sim_accel.max_instance: unknown field"]),
    ("unknown-section", "controllers: {}\n", ["controllers: unknown section"]),
    ("cross-field", "defaults: {min_instances: 5, max_instances: 2}\n", ["defaults.min_instances", "<= max_instances (2)"]),
    ("port-range", "controller: {metrics_port: 70000}\n", ["controller.metrics_port", "[0, 65535]"]),
]


@pytest.mark.parametrize("verb", ["run", "status", "serve"])
@pytest.mark.parametrize("name, text, expected", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_is_exit_2_naming_the_field_and_range(tmp_path, capsys, verb, name, text, expected):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    line = _one_line_error(capsys, main([verb, "--config", str(cfg)]))
    assert line.startswith("config error: ")
    for piece in expected:
        assert piece in line, line


def test_missing_config_file(tmp_path, capsys):
    line = _one_line_error(capsys, main(["run", "--config", str(tmp_path / "nope.yaml")]))
    assert "cannot read config file" in line and "nope.yaml" in line


def test_auth_header_without_its_key_is_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CLI_TEST_ADMIN_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: {auth_header: admin-key, auth_key_env: CLI_TEST_ADMIN_KEY}\n")
    line = _one_line_error(capsys, main(["run", "--config", str(cfg), "--duration-s", "1"]))
    assert "server.auth_header" in line and "CLI_TEST_ADMIN_KEY" in line


BAD_ARGS = [
    ("no-verb", [], ["required: verb"]),
    ("unknown-verb", ["frobnicate"], ["invalid choice: 'frobnicate'", "soak"]),
    ("unknown-option", ["run", "--bogus"], ["unrecognized arguments: --bogus"]),
    ("port-zero", ["serve", "--http-port", "0"], ["--http-port", "[1, 65535]", "got 0"]),
    ("port-too-big", ["serve", "--grpc-port", "70000"], ["--grpc-port", "[1, 65535]", "70000"]),
    ("port-not-int", ["serve", "--metrics-port", "abc"], ["--metrics-port", "[1, 65535]", "'abc'"]),
    ("duration-negative", ["run", "--duration-s", "-1"], ["--duration-s", "outside [0.1, 1e+07]"]),
    ("duration-nan", ["serve", "--duration-s", "nan"], ["--duration-s", "nan"]),
    ("soak-no-reloads", ["soak", "--out", "x"], ["required: --reloads"]),
    ("soak-zero-reloads", ["soak", "--reloads", "0", "--out", "x"], ["--reloads", "outside [1, 100000]"]),
    ("soak-rate", ["soak", "--reloads", "2", "--out", "x", "--rate-rps", "200000"], ["--rate-rps", "[0.1, 100000]"]),
    ("soak-not-loopback", ["soak", "--reloads", "2", "--out", "x", "--url", "10.0.0.8:8000"],
     ["--url", "refusing to send load to '10.0.0.8'"]),
    ("soak-no-port", ["soak", "--reloads", "2", "--out", "x", "--url", "localhost"], ["--url", "explicit port"]),
    ("soak-grpc-without-url", ["soak", "--reloads", "2", "--out", "x", "--grpc-url", "127.0.0.1:1"], ["need --url"]),
]


@pytest.mark.parametrize("name, argv, expected", BAD_ARGS, ids=[a[0] for a in BAD_ARGS])
def test_bad_arguments_are_one_line_and_exit_2(capsys, name, argv, expected):
    line = _one_line_error(capsys, main(argv))
    for piece in expected:
        assert piece in line, line


def test_soak_against_nothing_is_a_one_line_server_error(tmp_path, capsys):
    port = free_port()
    rc = main(["soak", "--reloads", "1", "--out", str(tmp_path), "--url", f"127.0.0.1:{port}",
               "--grpc-url", f"127.0.0.1:{free_port()}", "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics"])
    line = _one_line_error(capsys, rc, expected_rc=1)
    assert line.startswith("error: cannot read the config of model 'sim_accel'")
    assert not (tmp_path / "soak.json").exists()


@pytest.mark.parametrize("argv, rc, piece", [
    (["frobnicate"], 2, "invalid choice"),
    (["serve", "--http-port", "99999"], 2, "--http-port"),
    (["run", "--config", "MALFORMED"], 2, "not valid YAML"),
])
def test_the_process_exits_with_one_line_and_no_traceback(tmp_path, argv, rc, piece):
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""\
        controller:
          interval_s: [2
        """))
    argv = [str(bad) if a == "MALFORMED" else a for a in argv]
    r = subprocess.run([sys.executable, "-m", "controller", *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == rc and len(lines) == 1 and piece in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_a_taken_controller_metrics_port_is_one_line_naming_its_holder(server, tmp_path):
    """`run` (and `serve`) where the controller's port is taken: one line, the process that holds it named."""
    import os
    import socket
    from pathlib import Path
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(textwrap.dedent(f"""\
            server: {{http_url: {server.http_url}, grpc_url: {server.grpc_url}, metrics_url: {server.metrics_url}}}
            controller: {{metrics_port: {port}}}
            models: [sim_accel]
            """))
        r = subprocess.run([sys.executable, "-m", "controller", "run", "--config", str(cfg)], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
    comm = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert r.returncode == 1, r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line == [f"error: cannot serve the controller's metrics on 127.0.0.1:{port}: Address already in use "
                    f"(by {comm} (pid {os.getpid()})) (choose another with --controller-metrics-port or "
                    "controller.metrics_port)"], r.stderr


@pytest.mark.slow
def test_sigterm_stops_a_sweep_as_ctrl_c_does_leaving_nothing_behind(tmp_path):
    """SIGTERM (a CI job's timeout, `kill`) to sweep: its server stopped, its work folder removed, exit 143; Python's
    default had ended the process at once and left the folder (traces, backend copy) in /tmp."""
    import os
    import signal
    import time
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "controller", "sweep", "--instances", "1", "--delays-us", "0",
                             "--rates", "20", "--seconds", "120", "--warmup-s", "0", "--out", str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not any(
                "successfully loaded" in log.read_text(errors="replace") for log in tmp.glob("triton-ctl-*/*.log")):
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        time.sleep(2)                                       # its one cell of 120 s under way
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert time.monotonic() - t0 < 30                       # not at the cell's end
    assert "Traceback" not in err, err
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("triton-ctl-")]
    assert not subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout
    assert not (tmp_path / "out" / "sweep.json").exists()
