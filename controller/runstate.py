"""Run-state files: how `status` and `run` find a `serve` on the same machine without flags.

Each `serve` writes `serve-<pid>.json` (mode 0600, written to a temporary name and renamed) into the
run-state folder and removes it when it stops:

    {"pid": 4242, "started": 1700000000.0, "phase": "running", "http_url": "127.0.0.1:8000",
     "grpc_url": "127.0.0.1:8001", "metrics_url": "http://127.0.0.1:8002/metrics",
     "auth_header": "admin-key", "key_file": "/tmp/triton-ctl-x/admin-key",
     "decision_log": ".../serve-4242/decisions.jsonl", "controller_port": 40123, "models": [...]}

The file holds the *path* of the key file, never the key. The folder is, in this order:
`$TRITON_AUTOTUNE_RUN_DIR`; `$XDG_RUNTIME_DIR/triton-autotune` when that is set and writable;
`~/.cache/triton-autotune/run`. Readers drop (and delete) files whose process is gone, so a `serve`
killed with SIGKILL does not leave `status` pointing at a dead server.

`run` with no flags beside a `serve --no-controller` writes `run-beside-<serve pid>-<its pid>.json` (its
controller's port and decision log), so that `status` with no flags shows that controller's view; `run --config
FILE` whose config names no `controller.metrics_port` writes `run-config-<its pid>.json` (FILE's full path and the
port it took), so that `status --config FILE` does.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_RUN_DIR = "TRITON_AUTOTUNE_RUN_DIR"
PREFIX = "serve-"
BESIDE = "run-beside-"     # `run` beside a `serve --no-controller`: run-beside-<serve pid>-<run pid>.json
CONFIG_RUN = "run-config-"  # `run --config FILE` whose config names no metrics port: run-config-<run pid>.json


class RunStateError(RuntimeError):
    """No usable `serve`: the message says what to do."""


class NothingRunning(RunStateError):
    pass


class SeveralRunning(RunStateError):
    def __init__(self, serves: list["ServeState"]):
        self.serves = serves
        super().__init__(f"{len(serves)} serves are running (pids {', '.join(str(s.pid) for s in serves)}); "
                         "choose one with --pid N")

    def listing(self) -> str:
        return "\n".join("  " + s.describe() for s in self.serves)


def run_dir(create: bool = True) -> Path:
    """The run-state folder (created with mode 0700 when `create`)."""
    explicit = os.environ.get(ENV_RUN_DIR)
    if explicit:
        path = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
            path = Path(xdg) / "triton-autotune"
        else:
            path = Path.home() / ".cache" / "triton-autotune" / "run"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def state_path(pid: int, folder: Path | None = None) -> Path:
    return (folder or run_dir()) / f"{PREFIX}{pid}.json"


def serve_dir(pid: int, folder: Path | None = None) -> Path:
    """The folder for one serve's files that outlive it (its decision log)."""
    return (folder or run_dir()) / f"{PREFIX}{pid}"


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), None if unknown.
    Together with the pid it names one process: a reused pid has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def pid_alive(pid: int, start: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                    # someone else's process: alive
    if start is not None:
        now = _process_start(pid)
        if now is not None and now != start:
            return False        # the pid was reused
    return True


def _write_json(path: Path, doc: dict[str, Any]) -> Path:
    """`doc` to `path` atomically (a temporary name, then renamed), mode 0600."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _stamped(pid: int, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with the pid and start time that name its process (pid_alive checks both)."""
    return {"pid": pid, "process_start": _process_start(pid), **doc}


def write(state: dict[str, Any], folder: Path | None = None) -> Path:
    """Write this process's run-state file atomically, mode 0600; returns its path."""
    folder = folder or run_dir()
    pid = int(state.get("pid") or os.getpid())
    return _write_json(state_path(pid, folder), _stamped(pid, state))


# ---- a controller that `run` started beside a `serve --no-controller` -----------------------------------------

def beside_path(serve_pid: int, pid: int, folder: Path | None = None) -> Path:
    return (folder or run_dir()) / f"{BESIDE}{serve_pid}-{pid}.json"


def write_beside(serve_pid: int, state: dict[str, Any], folder: Path | None = None) -> Path:
    """`run`'s file beside the serve it runs a controller for (`controller_port`, `decision_log`): how `status`
    with no flags finds that controller. Not a serve's file (`live_serves` does not list it)."""
    pid = os.getpid()
    return _write_json(beside_path(serve_pid, pid, folder), _stamped(pid, {"serve_pid": serve_pid, **state}))


def _live_files(pattern: str, folder: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The run-state files matching `pattern` whose process runs, with their contents, oldest first; files of
    processes that are gone are deleted."""
    folder = folder or run_dir(create=False)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob(pattern)):
        try:
            doc = json.loads(path.read_text())
            pid = int(doc["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue            # half-written by someone else, or not ours: leave it alone
        if not pid_alive(pid, doc.get("process_start")):
            path.unlink(missing_ok=True)
            continue
        found.append((path, doc))
    return sorted(found, key=lambda f: (f[1].get("started", 0), int(f[1]["pid"])))


def controller_beside(serve_pid: int, folder: Path | None = None) -> dict[str, Any] | None:
    """The live `run` beside serve `serve_pid` (the newest, if several), else None; files of gone ones deleted."""
    found = _live_files(f"{BESIDE}{serve_pid}-*.json", folder)
    return found[-1][1] if found else None


# ---- a controller that `run --config FILE` started (its config names no metrics port) ---------------------------

def config_run_path(pid: int, folder: Path | None = None) -> Path:
    return (folder or run_dir()) / f"{CONFIG_RUN}{pid}.json"


def write_config_run(config: Path, state: dict[str, Any], folder: Path | None = None) -> Path:
    """`run --config FILE`'s file (the config's full path, `controller_port`): how `status --config FILE` finds the
    controller when the config names no port."""
    pid = os.getpid()
    return _write_json(config_run_path(pid, folder), _stamped(pid, {"config": str(Path(config).resolve()), **state}))


def controller_for_config(config: Path, folder: Path | None = None) -> dict[str, Any] | None:
    """The live `run` started with this config file (the newest, if several), else None."""
    want = str(Path(config).resolve())
    found = [d for _, d in _live_files(f"{CONFIG_RUN}*.json", folder) if d.get("config") == want]
    return found[-1] if found else None


def remove(pid: int | None = None, folder: Path | None = None) -> None:
    try:
        state_path(pid or os.getpid(), folder or run_dir(create=False)).unlink(missing_ok=True)
    except OSError:
        pass


@dataclass(frozen=True)
class ServeState:
    path: Path
    doc: dict[str, Any]

    @property
    def pid(self) -> int:
        return int(self.doc["pid"])

    def get(self, key: str, default: Any = None) -> Any:
        return self.doc.get(key, default)

    def describe(self) -> str:
        """One line: "pid 4242, started 12:00:01, HTTP 127.0.0.1:8000, gRPC ..., controller port 40123"."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.get("started", 0)))
        ctl = f"controller port {self.get('controller_port')}" if self.get("controller_port") else "no controller"
        return (f"pid {self.pid}, started {started}, HTTP {self.get('http_url')}, gRPC {self.get('grpc_url')}, "
                f"metrics {self.get('metrics_url')}, {ctl}")


def live_serves(folder: Path | None = None) -> list[ServeState]:
    """Every running serve's state, oldest first; files of processes that are gone are deleted."""
    return [ServeState(path, doc) for path, doc in _live_files(f"{PREFIX}*.json", folder)]


def choose(pid: int | None = None, folder: Path | None = None) -> ServeState:
    """The one serve to talk to: `pid` if given, else the only one running.
    Raises NothingRunning, SeveralRunning (with the list) or RunStateError (no such pid)."""
    serves = live_serves(folder)
    if pid is not None:
        for s in serves:
            if s.pid == pid:
                return s
        raise RunStateError(f"no serve with pid {pid} is running"
                            + (f" (running: {', '.join(str(s.pid) for s in serves)})" if serves else ""))
    if not serves:
        raise NothingRunning("nothing is running: no `python -m controller serve` on this machine "
                             "(for a server started otherwise, pass --config FILE)")
    if len(serves) > 1:
        raise SeveralRunning(serves)
    return serves[0]
