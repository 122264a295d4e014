"""`python -m controller serve` as a child process, driven the way a user drives it: the scripts that check
`serve` end to end (scripts/long_run.py, scripts/mixed_repo.py, scripts/serve_first_load_check.py) start it
here and read its start-up lines up to "controller managing", after which the server answers and the
controller runs.

    with ServeProcess(["--models", "sim_accel", "--http-port", "8000", ...], cwd=ROOT) as serve:
        ...                       # drive load at the ports given; serve.decision_log is the log serve printed
    print(serve.exit_code, serve.tail())

A serve that stops before that line (a taken port, a model that fails to load) raises `ServeStopped` with
its last lines, rather than leaving the caller to drive load at a server that is not there. After start-up a
thread keeps reading its output (a full pipe would block serve), keeping the last `keep_lines` lines: where
the server dies, serve's last words hold the server log's tail.
"""
from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Mapping, Sequence

READY_LINE = "controller managing"


class ServeStopped(RuntimeError):
    """serve exited before its "controller managing" line."""


class ServeProcess:
    """One `python -m controller serve <args>`, started by `start()` (or `with`), stopped by `stop()`."""

    def __init__(self, args: Sequence[str], *, cwd: Path | str, env: Mapping[str, str] | None = None,
                 keep_lines: int = 200) -> None:
        self.command = [sys.executable, "-m", "controller", "serve", *args]
        self.cwd, self.env = cwd, dict(env) if env is not None else None
        self.proc: subprocess.Popen | None = None
        self.decision_log: str | None = None      # as serve printed it ("decision log: PATH")
        self._tail: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._lock = threading.Lock()

    def start(self) -> "ServeProcess":
        self.proc = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        try:
            for line in self.proc.stdout:
                self._tail.append(line)
                if "decision log: " in line:
                    path = line.rsplit("decision log: ", 1)[1].strip()
                    self.decision_log = None if path == "none" else path
                if line.startswith(READY_LINE):
                    break
            else:
                self.proc.wait(timeout=30)
                raise ServeStopped(f"serve exited ({self.proc.returncode}) before the controller started:\n"
                                   + self.tail())
        except BaseException:
            self.stop(timeout_s=10)
            raise
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self._tail.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self) -> str:
        """serve's last lines (start-up included while there are few)."""
        with self._lock:
            return "".join(self._tail)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Ctrl-C (serve stops its controller, then the server), SIGKILL after `timeout_s`; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
