"""Find, start and stop a tritonserver process.

Three places a server binary can come from, in this order:
1. an explicit path (`--tritonserver PATH`);
2. `tritonserver` on PATH (the NGC container puts it in /opt/tritonserver/bin);
3. the Triton 2.51 build inside the `nvidia-pytriton` wheel ("embedded").

The embedded build needs two things the wheel does not arrange by itself (see
shared notes): a backend folder holding the Python backend *and the stub built for
the running Python*, and LD_LIBRARY_PATH pointing at the wheel's bundled libraries.

The server always starts in `--model-control-mode=explicit` with every endpoint on
loopback (unless told otherwise); models are loaded through the repository API after
the server is live, so a model that fails to load gives a clear per-model error.
"""
from __future__ import annotations

import compileall
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = PACKAGE_ROOT / "model_repository"


# Logged by every server without a GPU; never the reason something failed.
HARMLESS_LOG_LINES = ("NVML", "DCGM", "CudaDriverHelper", "CUDA driver", "GPU metrics", "pinned memory")
# the first line of what an aborting tritonserver prints: libstdc++'s uncaught exception, glibc's heap check, or its
# own signal handler
CRASH_MARKERS = ("terminate called", "Signal (", "corrupted ", "double free", "free(): ", "malloc(): ",
                 "munmap_chunk(): ", "realloc(): ")
CRASH_LINES = 24
# tritonserver's own handler of a fatal signal (SIGSEGV, SIGABRT, ...) prints this line first, then a backtrace, then
# ends the process; the Python backend's stub prints no such line
FATAL_SIGNAL_LINE = re.compile(rb"^Signal \((\d+)\) received\.", re.M)
# a server still alive this long after that line is wedged: the handler hangs (see ServerSupervisor)
WEDGED_AFTER_S = 5.0
LOG_READ_BYTES = 1 << 20     # the most of the log the watch reads in one poll
# a live server whose gRPC health check has gone unanswered this long is hung (see ServerSupervisor): measured here,
# the check answers in about 2 ms while a model loads for 25 s and under open-loop load; Kubernetes' default liveness
# probe gives up after 3 x 10 s
DEAF_AFTER_S = 60.0
PROBE_EVERY_S = 5.0          # one gRPC ServerLive this often, each given PROBE_TIMEOUT_S
PROBE_TIMEOUT_S = 5.0
# why: the repository index's states of a model the server runs: a full reload keeps it READY, an unload makes it
# UNLOADING, then UNAVAILABLE (checked on 2.51)
LIVE_STATES = ("READY", "LOADING")
SLOW_STOP_S = 3.0      # a stop that takes longer than this is named in the log (see TritonServer.stop)

log = logging.getLogger("controller.server")


class ServerError(RuntimeError):
    """A problem starting or talking to the server, with a one-line message for the user."""


class ModelFileMissing(ServerError):
    """A Python model's file is not there (missing_python_file): its load is not asked for, with or without an
    override."""


@dataclasses.dataclass
class ServerOptions:
    repository: Path = DEFAULT_REPOSITORY
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    tritonserver: str | None = None
    models: list[str] | None = None          # None: every model folder in the repository
    restricted_key: tuple[str, str] | None = None   # (header name, value) guarding the repository API
    summary_latencies: bool = True
    trace_file: bool = True                  # start with a request-trace file in the work dir, tracing OFF;
                                             # the controller turns TIMESTAMPS on per model at run time
    log_verbose: int = 0
    log_path: Path | None = None             # None: a file in the work dir
    keep_workdir: bool = False               # keep the work dir (backend folder, default log) after stop
    startup_timeout_s: float = 120.0
    load_timeout_s: float = 300.0            # one model's load (a large engine's can take minutes)
    extra_args: list[str] = dataclasses.field(default_factory=list)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes of listening TCP sockets (IPv4 and IPv6, any address) on `port`, from /proc/net."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            # why: columns sl, local address (hex ip:port), remote, state (0A = LISTEN), ..., inode (10th)
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def _proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _port_pids(port: int) -> list[int]:
    """The processes that hold a listening socket on `port` (a server and the stub processes that inherit its
    sockets), from Linux's /proc; [] where none can be read."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    holders: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(entry / "fd" / fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                holders.append(int(entry.name))
                break
    return holders


def _parent(pid: int) -> int:
    stat = _proc_text(pid, "stat")
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return 0


def repository_of_argv(argv: list[str], cwd: Path | None) -> tuple[Path | None, str]:
    """The model repository a tritonserver command line names, as a folder here, and else why not (pure but for
    checking that the folder exists). `--model-repository=X`, `--model-repository X` and the older `--model-store`;
    a relative path is taken from the server's working folder `cwd`. Several repositories, a remote one (s3://,
    gs://, as://) or a folder this machine does not see give None.
    Example: ["tritonserver", "--model-repository=/models", "--model-control-mode=explicit"] -> /models."""
    repos: list[str] = []
    for i, a in enumerate(argv):
        for flag in ("--model-repository", "--model-store"):
            if a == flag and i + 1 < len(argv):
                repos.append(argv[i + 1])
            elif a.startswith(flag + "="):
                repos.append(a.split("=", 1)[1])
    if not repos:
        return None, "its command line names no --model-repository"
    if len(set(repos)) > 1:
        return None, f"it serves {len(set(repos))} repositories ({', '.join(sorted(set(repos)))})"
    repo = repos[0]
    if "://" in repo:
        return None, f"its repository {repo} is not a folder on this machine"
    path = Path(repo)
    if not path.is_absolute():
        if cwd is None:
            return None, f"its repository {repo} is relative to a working folder not readable here"
        path = cwd / path
    if not path.is_dir():
        return None, f"its repository {path} is not a folder this machine sees"
    return path, ""


def tritonserver_pid(port: int) -> int | None:
    """The pid of the tritonserver listening on `port` on this machine (not one of its stubs, which inherit its
    sockets), from Linux's /proc; None where none can be read (another user's, machine's or container's)."""
    pids = [p for p in _port_pids(port) if _proc_text(p, "comm") == "tritonserver"]
    return next((p for p in pids if _parent(p) not in pids), None)


def served_repository(port: int) -> tuple[Path | None, str]:
    """The model repository of the tritonserver listening on `port` on this machine (its command line, from
    /proc), and where it came from; (None, why) where no such process can be read (another user's, another
    machine's, another container's) or its repository is not one folder here. `run` uses it where the config sets
    no `server.repository`."""
    pid = tritonserver_pid(port)
    if pid is None:
        return None, f"no tritonserver process this user can read listens on port {port}"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError as e:
        return None, f"tritonserver pid {pid}'s command line is not readable ({e.strerror})"
    try:
        cwd: Path | None = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        cwd = None
    path, why = repository_of_argv([a for a in argv if a], cwd)
    return (path, f"the --model-repository of tritonserver pid {pid}") if path is not None else \
        (None, f"tritonserver pid {pid}: {why}")


def port_holder(port: int) -> str | None:
    """Who listens on `port`, in words for an error ("tritonserver (pid 4242), started by serve pid 4200"), from
    Linux's /proc; None where that cannot be read (another user's process, no /proc).

    Why: the first thing a user does after a serve that was killed (kill -9, an OOM kill) is start it again, and a
    tritonserver it left (one stuck in a model's load ignores the SIGTERM its parent's death sends) holds the ports;
    "in use" alone leaves them to find it. A server's stub processes inherit its sockets, so of the processes that
    hold one, the one whose parent does not hold it too is named."""
    holders = _port_pids(port)
    if not holders:
        return None
    pid = next((h for h in holders if _parent(h) not in holders), holders[0])
    comm = _proc_text(pid, "comm")
    words = f"{comm or 'a process'} (pid {pid})"
    ppid = _parent(pid)
    argv = _proc_text(ppid, "cmdline").split() if ppid > 1 else []
    if "serve" in argv and any(a == "controller" or a.endswith("triton-autotune") for a in argv):
        words += f", started by serve pid {ppid} (`python -m controller status --pid {ppid}`)"
    elif comm == "tritonserver":
        words += ", which no running serve started (one left by a serve that was killed? stop it: kill " \
                 f"{pid}, or kill -9 {pid} where it ignores that)"
    return words


def held_by(port: int | None, words: str = " by {}") -> str:
    """`words` with port_holder's answer in it, for an error about a taken port; "" where it has none."""
    holder = port_holder(port) if port else None
    return words.format(holder) if holder else ""


def _embedded_root() -> Path | None:
    try:
        import pytriton  # noqa: F401  (the nvidia-pytriton wheel)
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def find_tritonserver(explicit: str | None = None) -> tuple[Path, bool]:
    """Return (binary, embedded). `embedded` means the nvidia-pytriton build."""
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise ServerError(f"--tritonserver {explicit}: no executable file there")
        return p.resolve(), _embedded_root() is not None and p.resolve() == (_embedded_root() / "bin" / "tritonserver").resolve()
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path).resolve(), False
    root = _embedded_root()
    if root is not None:
        return root / "bin" / "tritonserver", True
    raise ServerError(
        "no tritonserver found: pass --tritonserver PATH, put tritonserver on PATH "
        "(as in the NGC container), or `pip install nvidia-pytriton==0.7.0`"
    )


def embedded_library_dir() -> Path | None:
    root = _embedded_root()
    if root is None:
        return None
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return libs if libs.is_dir() else None


def assemble_backend_dir(dest: Path) -> Path:
    """Build `<dest>/python/` with the Python backend and the stub for this Python."""
    root = _embedded_root()
    if root is None:
        raise ServerError("the nvidia-pytriton wheel is not installed; cannot assemble its Python backend")
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / minor / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {minor}")
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    src = root / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(src / name, py / name)
    shutil.copy2(stub, py / "triton_python_backend_stub")
    os.chmod(py / "triton_python_backend_stub", 0o755)
    return dest


def precompile_models(repository: Path, names: list[str]) -> None:
    """Write up-to-date bytecode for each model's Python files before the server starts.

    The backend stub ignores PYTHONDONTWRITEBYTECODE and writes `1/__pycache__/` during the first
    load (seen on 2.51). That change to the version folder turns the next instance-count change
    into a full reload instead of an in-place update. With fresh .pyc files already there, the stub
    writes nothing. A read-only repository is left alone (the stub cannot write there either).
    """
    for name in names:
        folder = Path(repository) / name
        if os.access(folder, os.W_OK):
            compileall.compile_dir(str(folder), quiet=2)


def is_model_folder(folder: Path) -> bool:
    """A model the server can load: a folder with its config.pbtxt, or without one (the server then completes a
    minimal config from the model file: a Python model's `auto_complete_config`, an ONNX model's inputs) a numeric
    version folder holding a model file by its default name (`1/model.py`, `1/model.onnx`, `1/model.plan`, ...).
    A folder of other files (`logs/2024/`) is not one; an unreadable folder is not one either."""
    folder = Path(folder)
    try:
        if not folder.is_dir() or folder.name.startswith("."):
            return False
        if (folder / "config.pbtxt").is_file():
            return True
        return any(v.is_dir() and v.name.isdigit() and any(f.name.startswith("model.") for f in v.iterdir())
                   for v in folder.iterdir())
    except OSError:
        return False


def parse_config_text(text: str) -> dict:
    """A config.pbtxt parsed as this client's ModelConfig, in the JSON form of a live config. Raises
    google.protobuf.text_format.ParseError where it does not parse here (a field of a newer server, a typo)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2
    return json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                     preserving_proto_field_name=True)


def _config_of_text(text: str) -> dict | None:
    """`parse_config_text`, None where the file does not parse here."""
    from google.protobuf import text_format
    try:
        return parse_config_text(text)
    except text_format.ParseError:
        return None


def _policy_of_text(text: str) -> dict:
    """A config.pbtxt's `version_policy` as the JSON form of a live config ({} where none, or where unread), read by
    patterns: for a file that does not parse as this client's ModelConfig."""
    if re.search(r"^\s*version_policy\s*:?\s*\{\s*all\b", text, re.M):
        return {"all": {}}
    m = re.search(r"^\s*version_policy\s*:?\s*\{\s*specific\s*:?\s*\{([^}]*)\}", text, re.M)
    if m:
        return {"specific": {"versions": [int(v) for v in re.findall(r"\d+", m.group(1))]}}
    m = re.search(r"^\s*version_policy\s*:?\s*\{\s*latest\s*:?\s*\{[^}]*?num_versions\s*:\s*(\d+)", text, re.M)
    return {"latest": {"num_versions": int(m.group(1))}} if m else {}


def _version_folders(folder: Path) -> list[Path]:
    """A model folder's version folders (named by a number), oldest first; OSError where it cannot be read."""
    return sorted((v for v in folder.iterdir() if v.is_dir() and v.name.isdigit()), key=lambda v: int(v.name))


def _policy_versions(versions: list[Path], policy: dict | None) -> list[Path]:
    """The version folders a version policy loads (Triton's default: the newest one)."""
    policy = policy or {}
    if "all" in policy:
        return versions
    if "specific" in policy:
        wanted = {int(v) for v in (policy["specific"] or {}).get("versions", [])}
        return [v for v in versions if int(v.name) in wanted]
    n = int(((policy.get("latest") or {}).get("num_versions")) or 1)
    return versions[-n:]


def missing_python_file(folder: Path, config: dict | None = None) -> str | None:
    """Where `folder` holds a Python-backend model (its config, `config` or its config.pbtxt, says `backend:
    "python"`) and a version folder its version policy loads (the newest under the default) lacks the model file
    (`model.py`, or its `default_model_filename`), that file's expected path; else None.
    Why: Triton 2.51's Python backend does not answer the load of such a model (its stub says "Python model file
    not found" and the load waits; measured here: no answer in 300 s), so serve checks before it asks. One version
    lacking it is enough (measured: `version_policy: { all {} }`, 2/model.py present, 1/ without: no answer in
    40 s, and the server then ignored SIGTERM)."""
    folder = Path(folder)
    path = folder / "config.pbtxt"
    try:
        versions = _version_folders(folder)
        text = path.read_text(errors="replace") if config is None and path.is_file() else ""
    except OSError:
        return None                     # why: not ours to judge; the server's load says what is wrong
    if config is None and text:
        config = _config_of_text(text)
    if config is not None:
        backend, filename = config.get("backend"), config.get("default_model_filename") or None
        policy = config.get("version_policy") if isinstance(config.get("version_policy"), dict) else {}
    else:
        m = re.search(r'^\s*backend\s*:\s*"([^"]*)"', text, re.M)
        f = re.search(r'^\s*default_model_filename\s*:\s*"([^"]*)"', text, re.M)
        backend, filename, policy = m and m.group(1), f and f.group(1), _policy_of_text(text)
    if backend != "python" or not versions:
        return None
    filename = filename or "model.py"
    lacking = [v for v in _policy_versions(versions, policy) if not (v / filename).is_file()]
    return str(lacking[0] / filename) if lacking else None


def version_change(folder: Path, config: Mapping[str, Any] | None, live: set[int]) -> tuple[list[int], list[int]]:
    """What a load of the model in `folder` with `config` (its live config: the version policy a reload keeps) would
    change in the versions that serve, `live`: (the versions it would load, those it would unload), sorted; ([], [])
    where it would change none, or where the folder cannot be read. Why: a reload re-reads the repository. With
    the default policy (the newest version), a version folder dropped in after the last load is loaded by the next
    reload, and the old one unloaded: measured on 2.51, an instance-count change of version 1 made version 2 READY
    and version 1 UNLOADING. So the controller, whose reloads change instances and delay and nothing else, would
    deploy a version its operator had not loaded yet (or one still being copied)."""
    try:
        versions = _version_folders(Path(folder))
    except OSError:
        return [], []
    policy = (config or {}).get("version_policy")
    wanted = {int(v.name) for v in _policy_versions(versions, policy if isinstance(policy, dict) else {})}
    return sorted(wanted - live), sorted(live - wanted)


def _dangling(path: str) -> str:
    """": it is a symbolic link to X, which does not exist" where `path` is such a link (a model folder copied with its
    relative links, e.g. `cp -r` of a folder whose model.py links to a shared file); else ""."""
    try:
        return f": it is a symbolic link to {os.readlink(path)}, which does not exist" if os.path.islink(path) else ""
    except OSError:
        return ""


def repository_models(repository: Path) -> list[str]:
    """Every folder of the repository that holds a model (`is_model_folder`), sorted."""
    return sorted(p.name for p in Path(repository).iterdir() if is_model_folder(p))


# Run by a fresh interpreter between fork and the server's exec: PR_SET_PDEATHSIG, then exec. Not a preexec_fn:
# with one, subprocess runs the parent's at-fork hooks in the child before the exec (Python's docs: not safe with
# threads), and in CI a child of the test process, which had gRPC threads, aborted there: exit -6, its log one
# line from gRPC ("epoll_wait error: Bad file descriptor") 20 ms after gRPC's "skipping fork() handlers".
_EXEC_DYING_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
except OSError:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)                                  # the parent died before the line above: nobody to serve
try:
    os.execvp(sys.argv[2], sys.argv[2:])         # PATH searched, as Popen does
except OSError as e:
    print(f"cannot start {sys.argv[2]}: {e}", file=sys.stderr)
    sys.exit(127)
"""


def spawn_dying_with_parent(cmd: list[str], **popen_kw) -> subprocess.Popen:
    """Start `cmd` so that Linux SIGTERMs it if the process that started it dies (even kill -9): `serve`
    never leaves an orphaned server behind. Its pid is the command's (the interpreter in between execs it)."""
    return subprocess.Popen([sys.executable, "-I", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd],
                            **popen_kw)


def remove_shm_regions(prefix: str, shm_dir: Path = Path("/dev/shm")) -> int:
    """Remove the Python backend's shared-memory regions named `prefix`*, once their server is gone.
    Returns how many were removed (0 where there is no /dev/shm)."""
    removed = 0
    for path in shm_dir.glob(f"{prefix}*") if prefix and shm_dir.is_dir() else ():
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


_FRAMES_RE = re.compile(r"\s*\bAt:\s*\n((?:[ \t]*\S[^\n]*\n?)+?)[ \t]*;?[ \t]*(?:\n|$)")


def load_error_text(text: str) -> str:
    """Triton's load error on one line. A Python backend's model that raised in `initialize` comes with the stub's
    traceback block, "RuntimeError: no weights\n\nAt:\n  /repo/m/1/model.py(3): initialize\n;": the block becomes
    "(at /repo/m/1/model.py(3): initialize)", its first frame (the one that raised; "+ N frames" when there are
    more). Example: "...: Internal: RuntimeError: no weights (at /repo/m/1/model.py(3): initialize)"."""
    def frames(m: re.Match) -> str:
        lines = [ln.strip() for ln in m.group(1).splitlines() if ln.strip() and ln.strip() != ";"]
        if not lines:
            return " "
        more = f" + {len(lines) - 1} frame{'s' if len(lines) > 2 else ''}" if len(lines) > 1 else ""
        return f" (at {lines[0]}{more}) "
    return " ".join(_FRAMES_RE.sub(frames, text).split())


class TritonServer:
    """One tritonserver child process. Use as a context manager, or start()/stop()."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.process: subprocess.Popen | None = None
        self._workdir: Path | None = None
        self.log_path: Path | None = None
        self.log_offset = 0          # where the running process's lines begin in log_path (appended to at a restart)
        self.embedded = False
        self._binary: Path | None = None
        # why: a Python-backend stub killed while it shuts down leaves its /dev/shm region behind (about one
        # per ten minutes of reloads here); a prefix of our own lets stop() remove exactly this server's
        self.shm_prefix = f"tritonctl_{os.getpid()}_{secrets.token_hex(4)}_"

    @property
    def workdir(self) -> Path:
        return self._workdir

    @property
    def trace_path(self) -> Path | None:
        """Base name of the rotated request-trace files (`<path>.0`, `<path>.1`, ...), or None."""
        if not self.options.trace_file or self._workdir is None:
            return None
        return self._workdir / "traces" / "trace.json"

    # -- addresses -----------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    # -- lifecycle -----------------------------------------------------------------
    def command(self, binary: Path, backend_dir: Path | None) -> list[str]:
        o = self.options
        cmd = [
            str(binary),
            f"--model-repository={Path(o.repository).resolve()}",
            "--model-control-mode=explicit",
            f"--http-address={o.host}", f"--http-port={o.http_port}",
            f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=true",
            "--metrics-interval-ms=1000",
            f"--log-verbose={o.log_verbose}",
            "--exit-on-error=false",
        ]
        if o.summary_latencies:
            cmd.append("--metrics-config=summary_latencies=true")
        if o.trace_file and self._workdir is not None:
            # why: the trace file can only be set on the command line (the API refuses it); level OFF until
            # the controller asks for TIMESTAMPS per model, with the rate and log frequency it adapts
            cmd += [f"--trace-config=triton,file={self.trace_path}", "--trace-config=triton,log-frequency=50",
                    "--trace-config=rate=1000", "--trace-config=level=OFF"]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if o.restricted_key is not None:
            k, v = o.restricted_key
            cmd.append(f"--http-restricted-api=model-repository:{k}={v}")
            cmd.append(f"--grpc-restricted-protocol=model-repository:{k}={v}")
        if not any("shm-region-prefix-name" in a for a in o.extra_args):
            cmd.append(f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}")
        cmd.extend(o.extra_args)
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONDONTWRITEBYTECODE"] = "1"   # keeps version folders unchanged: instance updates stay in place
        env["PYTHONUNBUFFERED"] = "1"
        # The stub runs the model with the interpreter environment it was started from: put ours first.
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        if self.embedded:
            libs = embedded_library_dir()
            if libs is not None:
                env["LD_LIBRARY_PATH"] = str(libs) + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        # A per-server folder for the simulated accelerator's shared device state.
        env.setdefault("SIM_ACCEL_DIR", str(self._workdir / "sim_device"))
        return env

    def model_names(self) -> list[str]:
        """The models `start` loads: `models` of the options, else every model of the repository (checked there)."""
        o = self.options
        repo = Path(o.repository)
        if not repo.is_dir():
            raise ServerError(f"model repository {repo} is not a directory")
        try:
            names = o.models if o.models is not None else repository_models(repo)
        except OSError as e:
            raise ServerError(f"cannot read the model repository {repo}: {e.strerror or e}") from None
        if not names:
            raise ServerError(f"no model in {repo} (a model folder holds a config.pbtxt, or a version folder such as 1/ "
                              "with the model file: 1/model.py, 1/model.onnx, ...)")
        missing = [m for m in names if not is_model_folder(repo / m)]
        if missing:
            raise ServerError(f"model(s) {', '.join(missing)} not found in {repo} (a model folder holds a config.pbtxt, "
                              "or a version folder such as 1/ with the model file: 1/model.py, 1/model.onnx, ...)")
        return names

    def start(self, configs: Mapping[str, dict] | None = None) -> "TritonServer":
        """Start the server and load its models; `configs`: a load override for some of them (the first load then
        carries it, e.g. the controller's owner mark: ownership.marked_file_config), loaded first, so that an ensemble
        loaded after its steps finds them loaded with theirs; `configs` may name a model of the repository that
        `models` does not list (an ensemble's step), loaded with its override too."""
        o = self.options
        names = self._load_order(configs or {})
        taken = self._taken_port()
        if taken is not None:
            label, port = taken
            raise ServerError(f"{label} port {o.host}:{port} is already in use{held_by(port)}; choose another with "
                              f"--{label.lower()}-port")
        binary, self.embedded = find_tritonserver(o.tritonserver)
        precompile_models(Path(o.repository), names)
        self._workdir = Path(tempfile.mkdtemp(prefix="triton-ctl-"))
        self._binary = binary
        self.log_path = Path(o.log_path) if o.log_path else self._workdir / "tritonserver.log"
        try:
            self._launch()
            self._load_models(names, configs or {})
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, configs: Mapping[str, dict] | None = None, names: list[str] | None = None,
                cancel: threading.Event | None = None) -> list[str]:
        """Start the server again after its process died (see ServerSupervisor): the same command (ports, key, trace
        file, shm prefix), work dir and log (appended to). `names`: the models to load (what the dead one ran; None:
        those `start` loads), in `start`'s order, `configs` being the overrides to load them with now (their last
        live configs: the instances and delay the controller had chosen). What the dead one left (stub processes,
        shared-memory regions) is removed first. A model that fails to load now is left out, not the whole server:
        the others ran minutes ago and their clients wait; the returned list says which, with why. Raises ServerError
        where the server cannot start, or `cancel` is set meanwhile (serve stops); the process is then stopped, the
        work dir kept for another try (`stop` removes it)."""
        if self._workdir is None:
            raise ServerError("restart() of a server that was never started")
        configs = configs or {}
        order = self._load_order(configs, names)
        self._halt()
        taken = self._taken_port()
        if taken is not None:
            raise ServerError(f"{taken[0]} port {self.options.host}:{taken[1]} was taken while tritonserver was down"
                              + held_by(taken[1], ", by {}"))
        try:
            self._launch(cancel)
            return self._load_models(order, configs, cancel, strict=False)
        except BaseException:
            self._halt()
            raise

    def _taken_port(self) -> tuple[str, int] | None:
        """The first of the server's ports that something holds, as (label, port); None where all are free."""
        o = self.options
        for label, port in (("HTTP", o.http_port), ("gRPC", o.grpc_port), ("metrics", o.metrics_port)):
            if _port_in_use(o.host, port):
                return label, port
        return None

    def _load_order(self, configs: Mapping[str, dict], names: list[str] | None = None) -> list[str]:
        """The models to load, in order: a model only `configs` names (an ensemble's step) first, then those with an
        override, then the rest (an ensemble after its steps). `names`: the models to load, `model_names()` if None
        (then `configs` may add some; with `names`, `configs` names none that it lacks)."""
        repo = Path(self.options.repository)
        if names is not None:
            return [n for n in names if n in configs] + [n for n in names if n not in configs]
        names = self.model_names()
        extra = [n for n in configs if n not in names and is_model_folder(repo / n)]
        return extra + [n for n in names if n in configs] + [n for n in names if n not in configs]

    def _launch(self, cancel: threading.Event | None = None) -> None:
        """Spawn the server process (its log appended to) and wait until it is live."""
        backend = self._workdir / "backends"
        backend_dir = (backend if backend.is_dir() else assemble_backend_dir(backend)) if self.embedded else None
        if self.trace_path is not None:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")
        self.log_offset = log_file.tell()
        self.process = spawn_dying_with_parent(
            self.command(self._binary, backend_dir), stdout=log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=self.environment(), start_new_session=True,
        )
        log_file.close()
        self._wait_live(self.options.startup_timeout_s, cancel)

    def _load_models(self, names: list[str], configs: Mapping[str, dict], cancel: threading.Event | None = None,
                     strict: bool = True) -> list[str]:
        """Load `names` in order, each with its override in `configs` (the file where that is refused). A model that
        fails: `strict` (a start) raises; otherwise it is left out and named, with why, in the returned list."""
        o = self.options
        failed: list[str] = []
        for name in names:
            if cancel is not None and cancel.is_set():
                raise ServerError("stopped while its models were loading")
            try:
                self._load_one(name, configs.get(name))
            except ServerError as e:
                if not strict:
                    if self._exited():
                        raise                   # why: a dead server's trouble is every model's, not this one's
                    failed.append(str(e))
                    continue
                others = [n for n in names if n != name]
                if o.models is None and others:
                    # why: one broken model of a user's repository stops it all, as tritonserver's own start does
                    # (--exit-on-error); the way on without it is to name the others
                    raise ServerError(f"{e}; serve loads every model of {o.repository} and stops when one fails, "
                                      f"as tritonserver does: to serve the others, name them: --models "
                                      f"{','.join(others)}") from None
                raise
        return failed

    def _exited(self) -> bool:
        """No server process, or one that has exited."""
        return self.process is None or self.process.poll() is not None

    def _load_one(self, name: str, config: dict | None) -> None:
        """Load one model with its override, from its file where the server refuses that (not where its file is
        missing, nor where the server died in the load: a second try could only fail the same way)."""
        if config is not None:
            try:
                self.load_model(name, config)
                return
            except ModelFileMissing:
                raise
            except ServerError as e:
                if self._exited():
                    raise
                log.warning("%s: its load with an override failed (%s); loading it from its file", name, e)
        self.load_model(name)

    def _http(self, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method=method)
        if self.options.restricted_key is not None:
            req.add_header(*self.options.restricted_key)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw else {})
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"error": raw.decode(errors="replace")}

    def _wait_live(self, timeout_s: float, cancel: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise ServerError("stopped while tritonserver was starting")
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} during start-up: {self.log_tail()}")
            try:
                if self._http("GET", "/v2/health/live", timeout=2)[0] == 200:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not live after {timeout_s:.0f} s: {self.log_tail()}")

    def live_models(self, timeout_s: float = 5.0, known: Mapping[str, dict | None] | None = None
                    ) -> dict[str, dict | None]:
        """What the server runs now: each model its repository index lists READY or LOADING (a full reload keeps a
        model READY; an unload makes it UNLOADING, then UNAVAILABLE), with its live config (`GET
        /v2/models/<m>/config`), None where that read failed (a model still loading). A model `known` holds a
        config for keeps that one unread (the index alone, for a frequent check of which models run). Raises
        ServerError where the index cannot be read."""
        try:
            status, index = self._http("POST", "/v2/repository/index", {}, timeout=timeout_s)
        except (OSError, ValueError) as e:
            raise ServerError(f"cannot read the repository index: {e}") from None
        if status != 200 or not isinstance(index, list):
            raise ServerError(f"cannot read the repository index: HTTP {status} {index}")
        running: dict[str, dict | None] = {}
        for entry in index:
            name = entry.get("name")
            if not name or entry.get("state") not in LIVE_STATES or name in running:
                continue
            if known is not None and known.get(name) is not None:
                running[name] = known[name]
                continue
            try:
                status, config = self._http("GET", f"/v2/models/{name}/config", timeout=timeout_s)
            except (OSError, ValueError):
                status, config = 0, None
            running[name] = config if status == 200 and isinstance(config, dict) else None
        return running

    def load_model(self, name: str, config: dict | None = None) -> None:
        missing = missing_python_file(Path(self.options.repository) / name, config)
        if missing is not None:
            raise ModelFileMissing(f"model '{name}' failed to load: {missing} not found{_dangling(missing)} (a Python "
                                   "model's file; Triton's Python backend would wait for it without an answer)")
        body = None if config is None else {"parameters": {"config": json.dumps(config)}}
        done = threading.Event()
        threading.Thread(target=self._end_a_dead_load, args=(done,), daemon=True, name="load-watch").start()
        try:
            status, body = self._http("POST", f"/v2/repository/models/{name}/load", body,
                                      timeout=self.options.load_timeout_s)
        except (OSError, ValueError) as e:
            # why: a timeout or a dropped connection is the server's trouble, said as such, never a traceback
            p = self.process
            if p is not None:
                try:
                    p.wait(timeout=1.0)         # why: a server that died drops the connection just before it exits
                except subprocess.TimeoutExpired:
                    pass
            if p is not None and p.poll() is not None:
                raise ServerError(f"model '{name}' failed to load: tritonserver {exit_words(p.returncode)} while "
                                  f"loading it: {self.log_tail()}") from None
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                raise ServerError(f"model '{name}' failed to load: the server did not answer its load within "
                                  f"{self.options.load_timeout_s:.0f} s (see its log: {self.log_path})") from None
            raise ServerError(f"model '{name}' failed to load: {' '.join(str(e).split())[:300]}") from None
        finally:
            done.set()
        if status != 200:
            raise ServerError(f"model '{name}' failed to load: {load_error_text(str(body.get('error', body)))}")

    def _end_a_dead_load(self, done: threading.Event) -> None:
        """While a load is under way: where the server dies, kill its process group, whose stub processes (forked
        by the server, its sockets inherited) would otherwise hold the load's connection open until its timeout
        (measured: a model whose initialize killed tritonserver left the load unanswered past 60 s, the client's
        timeout being 300 s)."""
        p = self.process
        while p is not None and not done.wait(0.5):
            if p.poll() is not None:
                self.kill_group()
                return

    def log_tail(self, lines: int = 5) -> str:
        """The log's last error lines (else its last lines), joined on one line. Where the server aborted, its
        last words from the abort on instead: the exception's what() and the backtrace (its first frames are the
        signal handler's and libc's; the frame that threw comes after them), up to `CRASH_LINES` lines."""
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        # why from log_offset: a server started again appends to the same log, and an earlier death's abort there
        # was read as the last words of the next one (seen: a SIGILL named by the SIGABRT before it)
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                raw = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        text = [ln.strip() for ln in raw.splitlines() if ln.strip() and not any(h in ln for h in HARMLESS_LOG_LINES)]
        marks = [i for i, ln in enumerate(text) if ln.startswith(CRASH_MARKERS)]
        if marks:
            # the last abort (a stub's earlier crash may have printed its own); its "terminate called" and what()
            # come just before the handler's "Signal (6) received."
            start = marks[-1]
            for i in reversed(marks[:-1]):
                if start - i > 3:
                    break
                start = i
            return " | ".join(text[start:start + CRASH_LINES])
        errors = [ln for ln in text if ln[:1] in "EW" or "error" in ln.lower()]
        return " | ".join((errors or text)[-lines:])

    def keep_log(self, repoint: bool = True) -> Path | None:
        """Copy the log out of the work dir (which `stop` removes) to `<tmp>/tritonserver-<pid>.log`, and point
        `log_path` there (unless not `repoint`: the server is started again and goes on writing the one in the work
        dir): where the server died, its full log is what a user (or an upstream bug report) needs. The log's path if
        it is kept (one given in the options stays where it is), else None."""
        if self.log_path is None or not self.log_path.exists():
            return None
        if self._workdir is None or self.options.keep_workdir or self._workdir not in self.log_path.parents:
            return self.log_path
        pid = self.process.pid if self.process is not None else os.getpid()
        kept = Path(tempfile.gettempdir()) / f"tritonserver-{pid}.log"
        try:
            shutil.copyfile(self.log_path, kept)
        except OSError:
            return None
        if repoint:
            self.log_path = kept
        return kept

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server (it shuts its stub processes down), then kill the group if needed; the work dir goes
        (unless kept)."""
        p = self.process
        try:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                first = min(SLOW_STOP_S, timeout_s)
                try:
                    p.wait(timeout=first)
                except subprocess.TimeoutExpired:
                    # why: Triton waits up to its exit timeout (--exit-timeout-secs, 30 s by default) for its models
                    # to unload, and 2.51 waits all of it after a failed reload (the failed version stays "live"):
                    # said, so that a slow stop does not read as a hang
                    if timeout_s > first:
                        log.info("waiting up to %.0f s more for tritonserver (pid %d) to unload its models and exit",
                                 timeout_s - first, p.pid)
                    try:
                        p.wait(timeout=timeout_s - first)
                    except subprocess.TimeoutExpired:
                        log.warning("tritonserver (pid %d) did not exit within %.0f s of SIGTERM; killing it",
                                    p.pid, timeout_s)
        finally:
            # why finally: a Ctrl-C or SIGTERM (cli: KeyboardInterrupt) during the wait must not leave the server or
            # its work dir behind; the interrupt goes on once they are gone
            self._halt()
            if self._workdir is not None and not self.options.keep_workdir:
                shutil.rmtree(self._workdir, ignore_errors=True)

    def kill_group(self) -> None:
        """SIGKILL the server's process group (its stubs with it), from any thread; the owner of the process still
        reaps it (`_halt`)."""
        p = self.process
        if p is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _halt(self) -> None:
        """Kill what is left of the process and its group, and remove its shared-memory regions."""
        p = self.process
        if p is None:
            return
        self.kill_group()       # why: stubs are in the server's process group (new session at start)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.process = None
        remove_shm_regions(self.shm_prefix)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def exit_words(returncode: int | None) -> str:
    """"exited with code -11 (SIGSEGV)": a negative code is the signal that ended the process."""
    if returncode is None:
        return "exited"
    if returncode < 0:
        try:
            return f"exited with code {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"exited with code {returncode}"


class RestartBudget:
    """When a server whose process died is started again. The first restart at once; each further one after a wait
    that doubles from `backoff_s` up to `max_backoff_s`; none once `max_restarts` restarts fall within the last
    `window_s`: a server that keeps dying is given up (Kubernetes' CrashLoopBackOff ends the same way, in a failed
    pod, not in an endless loop). A restart older than `window_s` no longer counts, so a server that has run that
    long since is treated as healthy again. A failed try counts as a restart.

    Example (the defaults: 3 within 600 s, 5 s doubling): deaths at 0, 100 and 130 s wait 0, 5 and 10 s; a fourth at
    200 s is given up (3 restarts in the window); deaths at 0 and 700 s wait 0 s each."""

    def __init__(self, max_restarts: int = 3, window_s: float = 600.0, backoff_s: float = 5.0,
                 max_backoff_s: float = 60.0):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._restarts: list[float] = []

    def next_wait(self, now: float) -> float | None:
        """Seconds to wait before the next restart, None where there is to be none."""
        self._restarts = [t for t in self._restarts if now - t < self.window_s]
        n = len(self._restarts)
        if n >= self.max_restarts:
            return None
        return 0.0 if n == 0 else min(self.backoff_s * 2 ** (n - 1), self.max_backoff_s)

    def record(self, now: float) -> None:
        self._restarts.append(now)

    @property
    def recent(self) -> int:
        return len(self._restarts)

    def describe(self) -> str:
        if self.max_restarts <= 0:
            return "restarts are off (--max-restarts 0)"
        return f"{self.recent} restart(s) within {self.window_s:.0f} s, the most allowed (--max-restarts)"


class ServerSupervisor:
    """Watch a started TritonServer; where its process exits on its own, keep a copy of its log and start it again
    (TritonServer.restart: same ports and key) within a RestartBudget, with what it ran. Where the budget is spent
    (at once with `max_restarts` 0), `stop` and `gave_up` are set and `last_words` says why. Requests in flight when
    the server died are lost (their clients see an error), and those sent while it is down are refused; nothing
    else is.

    What it ran: every `snapshot_s` (and at the start) the watch reads which models the server runs (its repository
    index), and every `configs_every_s` their live configs (TritonServer.live_models; a model new in the index at
    once): those serve loaded, those an operator loaded by hand since, with whatever config they were loaded with;
    not one an operator unloaded. A restart loads those, each with its last live config (an ensemble, or a model
    whose config was not read yet, from its file), where `configs()` (the controller's: read every tick, its owner
    mark in) gives a fresher one for a model it manages. A model loaded less than `snapshot_s` before the death can
    be missed, and so can an operator's change to the config of a model the controller does not manage made less
    than `configs_every_s` before it; without any snapshot (a death in the first moment) the restart loads what
    `start` loaded.
    Why two periods: the index is one small read; the configs are one read per model (at 1 s, 40 models would be
    40 reads a second against the server that serves), and a config changed by hand is rarer than a load.

    Why restart: Triton 2.51 has crashed under load after an in-place instance-count change (SIGSEGV in its request
    free; upstream issue 7723), twice in this project's runs, and a server that stays down loses every request after.

    A server can also crash without dying. Seen here once (open-loop load on two Python models, no reload near it):
    glibc found the heap corrupt ("corrupted double-linked list"), aborted, and Triton's handler printed "Signal (6)
    received." and then hung (its backtrace allocates, and the allocator's lock is held by the thread that aborted):
    the process lived on, its HTTP health still said live, and every gRPC call timed out, for as long as it was left.
    So the watch also reads the log the running process writes (from where its lines begin): where the handler's
    line is there and the process is still alive `wedged_after_s` later (a handler that works prints its backtrace
    and ends the process within a second), the process group is killed and restarted like any dead server.

    A server can also hang without that line (a deadlock). So, like a Kubernetes liveness probe, the watch asks the
    live process's gRPC endpoint whether it is live every `probe_every_s` (`probe`; default a gRPC ServerLive with a
    PROBE_TIMEOUT_S deadline): where no check has been answered for `deaf_after_s` (DEAF_AFTER_S; counted from the
    process's start or its last answer, so one slow answer is no failure), the group is killed and restarted, its
    death named "was running but answered no gRPC health check for N s (hung; killed)". gRPC, because the hang seen
    here left HTTP's health answering while every gRPC call timed out. The check answers in about 2 ms while a model
    loads (25 s, measured) and under load, so a load or a busy server is not read as a hang. `deaf_after_s=None`
    turns it off.

    The watch runs in a thread that lives until `stop` is set, and the restarted process is spawned from it: Linux's
    parent-death signal (spawn_dying_with_parent) follows the *thread* that spawned, so the server must not be
    spawned from a thread that ends sooner. `lock` is held through a restart: the owner sets `stop` (which ends a
    restart under way at its next step: the server's start-up wait, or between two models' loads), then takes the
    lock before `stop()`, so that no restart leaves a server behind."""

    def __init__(self, server: TritonServer, stop: threading.Event,
                 configs: Callable[[], Mapping[str, dict]] | None = None, budget: RestartBudget | None = None,
                 say: Callable[[str], None] | None = None, on_restart: Callable[[list[dict]], None] | None = None,
                 poll_s: float = 0.5, snapshot_s: float = 1.0, configs_every_s: float = 5.0,
                 wedged_after_s: float = WEDGED_AFTER_S, deaf_after_s: float | None = DEAF_AFTER_S,
                 probe_every_s: float = PROBE_EVERY_S, probe: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.server = server
        self.stop = stop
        self.budget = budget if budget is not None else RestartBudget()
        self.lock = threading.Lock()
        self.gave_up = threading.Event()
        self.last_words: str | None = None
        self.restarts: list[dict] = []      # {"at": wall time, "exit", "log", "ok", and "took_s", "pid" or "error"}
        self.running: dict[str, dict | None] | None = None   # the last snapshot: model -> live config (None: unread)
        self._configs = configs
        self._on_restart = on_restart
        self._say = say or log.warning
        self._poll_s = poll_s
        self._snapshot_s = snapshot_s
        self._configs_every_s = configs_every_s
        self._clock = clock
        self._failed: str | None = None     # a restart's error, read as the next death
        self._wedged_after_s = wedged_after_s
        self._log_pid: int | None = None    # the process whose log lines are read, from _log_pos on
        self._log_pos = 0
        self._fatal: tuple[int, float] | None = None   # the signal its handler reported, and when that was read
        self._wedged: str | None = None     # why the watch killed it: the exit words of the death that follows
        self._deaf_after_s = deaf_after_s
        self._probe_every_s = probe_every_s
        self._probe = probe or self._grpc_live
        self._grpc = None                   # the default probe's client (made again after a check that failed)
        self._probed_pid: int | None = None
        self._answered_at = 0.0             # the running process's start or its last answer to the probe
        self._next_probe = 0.0
        self._thread: threading.Thread | None = None

    def _restarted(self) -> None:
        """Tell the owner (under `lock`, so that it is not told after it stopped the server)."""
        if self._on_restart is not None:
            try:
                self._on_restart(list(self.restarts))
            except Exception as e:  # noqa: BLE001 - a notice only (the run-state file): the watch goes on
                log.warning("after the restart: %s", e)

    @contextlib.contextmanager
    def ended(self, wait_s: float = 10.0):
        """For the owner about to stop the server: set `stop` and hold `lock` (no restart after this). A restart under
        way ends at its next step; where it has not within `wait_s` (a model's load that does not answer), the
        server's process group is killed, which ends that load at once, and then the lock is taken."""
        self.stop.set()
        if not self.lock.acquire(timeout=wait_s):
            self._say(f"a restart of tritonserver still under way after {wait_s:.0f} s; stopping it")
            self.server.kill_group()
            self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    def start(self) -> "ServerSupervisor":
        self._thread = threading.Thread(target=self._watch, name="server-supervisor", daemon=True)
        self._thread.start()
        return self

    def snapshot(self, configs: bool = True) -> None:
        """Read what the server runs now into `running`; a config that could not be read keeps the last one read, a
        failed index read keeps the whole last snapshot. `configs=False`: read the configs of new models only."""
        try:
            now = self.server.live_models() if configs else self.server.live_models(known=self.running or {})
        except Exception as e:  # noqa: BLE001 - ServerError, OSError: the server is down or busy; the last stands
            log.debug("cannot read what the server runs: %s", e)
            return
        last = self.running or {}
        self.running = {name: config if config is not None else last.get(name) for name, config in now.items()}

    def _what_ran(self) -> tuple[list[str] | None, dict[str, dict]]:
        """The models to load at a restart and their overrides (see the class doc)."""
        fresher = dict(self._configs()) if self._configs is not None else {}
        if self.running is None:
            return None, fresher
        names = list(self.running)
        configs = {n: c for n, c in self.running.items() if c is not None and c.get("platform") != "ensemble"}
        configs.update((n, c) for n, c in fresher.items() if n in self.running)
        return names, configs

    def _watch(self) -> None:
        next_snapshot = next_configs = self._clock()
        while True:
            now = self._clock()
            if now >= next_snapshot and self.server.process is not None \
                    and self.server.process.poll() is None and self._failed is None:
                configs = now >= next_configs
                self.snapshot(configs)
                # why: from the time the read began, so the cadence does not drift by each read's own time
                next_snapshot = now + self._snapshot_s
                if configs:
                    next_configs = now + self._configs_every_s
            if self.stop.wait(self._poll_s):
                return
            if self._failed is not None:
                why, self._failed, kept = self._failed, None, None
                ended = "did not start again"
            else:
                p = self.server.process
                if p is None:
                    continue
                if p.poll() is None:
                    self._end_if_wedged(p)
                    self._end_if_deaf(p)
                    continue
                kept = self.server.keep_log(repoint=False)
                ended, self._wedged = self._wedged or exit_words(p.returncode), None
                why = f"tritonserver {ended}: {self.server.log_tail()}" + (f" (full log: {kept})" if kept else "")
            self._after_death(why, ended, kept)

    def fatal_signal(self) -> int | None:
        """The signal tritonserver's handler reported in the running process's log lines (None: none yet). Reads
        the lines written since the last call, whole lines only."""
        p, path = self.server.process, self.server.log_path
        if p is None or path is None:
            return None
        if p.pid != self._log_pid:
            self._log_pid, self._log_pos, self._fatal = p.pid, self.server.log_offset, None
        if self._fatal is None:
            try:
                with open(path, "rb") as f:
                    f.seek(self._log_pos)
                    chunk = f.read(LOG_READ_BYTES)
            except OSError:
                return None
            # why whole lines: a line half written now is read whole at the next poll; a full read is taken as it is
            # (a line longer than a read must not stall the watch)
            whole = chunk[:chunk.rfind(b"\n") + 1] if len(chunk) < LOG_READ_BYTES else chunk
            self._log_pos += len(whole)
            m = FATAL_SIGNAL_LINE.search(whole)
            if m:
                self._fatal = (int(m.group(1)), self._clock())
        return self._fatal[0] if self._fatal else None

    def _end_if_wedged(self, p) -> None:
        """Kill a live server whose handler reported a fatal signal `wedged_after_s` ago (see the class doc)."""
        signum = self.fatal_signal()
        if signum is None or self._clock() - self._fatal[1] < self._wedged_after_s or self.stop.is_set():
            return
        try:
            name = f" ({signal.Signals(signum).name})"
        except ValueError:
            name = ""
        self._kill_hung(p, f"received signal {signum}{name} and was still running {self._wedged_after_s:g} s later "
                           "(its crash handler hangs; killed)")

    def _kill_hung(self, p, why: str) -> None:
        """Kill the group of a live server that no longer serves; `why` becomes the exit words of its death."""
        self._wedged = why
        log.warning("tritonserver (pid %d) %s", p.pid, why)
        self.server.kill_group()

    def _grpc_live(self) -> bool:
        """The default probe: does the server's gRPC endpoint answer ServerLive within PROBE_TIMEOUT_S."""
        try:
            if self._grpc is None:
                import tritonclient.grpc as grpcclient
                self._grpc = grpcclient.InferenceServerClient(self.server.grpc_url)
            self._grpc.is_server_live(client_timeout=PROBE_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - any failure to answer (deadline, refused, reset) is no answer
            # why a new channel at the next check: a gRPC channel whose connection failed waits ever longer before it
            # tries again (backoff up to 120 s), so a server back after a restart could go unasked past deaf_after_s
            client, self._grpc = self._grpc, None
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass
            return False

    def _end_if_deaf(self, p) -> None:
        """Kill a live server that has answered no health check for `deaf_after_s` (see the class doc)."""
        if self._deaf_after_s is None or self.stop.is_set() or self._wedged is not None:
            return
        now = self._clock()
        if p.pid != self._probed_pid:       # a new process: its silence counts from its start
            self._probed_pid, self._answered_at, self._next_probe = p.pid, now, now
        if now < self._next_probe:
            return
        self._next_probe = now + self._probe_every_s
        if self._probe():
            self._answered_at = self._clock()
            return
        silent_s = self._clock() - self._answered_at
        if silent_s < self._deaf_after_s or p.poll() is not None or self.stop.is_set():
            return
        took = f"{silent_s:.0f}" if silent_s >= 10 else f"{silent_s:.1f}"
        self._kill_hung(p, f"was running but answered no gRPC health check for {took} s (hung; killed)")

    def _after_death(self, why: str, ended: str, kept: Path | None) -> None:
        wait = self.budget.next_wait(self._clock())
        if wait is None:
            self.last_words = f"{why}; not started again: {self.budget.describe()}"
            self.gave_up.set()
            self.stop.set()
            return
        self._say(f"{why}; starting it again{f' in {wait:.0f} s' if wait else ''} (restart {self.budget.recent + 1} "
                  f"of at most {self.budget.max_restarts} within {self.budget.window_s:.0f} s)")
        if self.stop.wait(wait):
            return
        with self.lock:
            if self.stop.is_set():
                return
            self.budget.record(self._clock())
            record = {"at": time.time(), "exit": ended, "log": str(kept) if kept else None, "ok": False}
            self.restarts.append(record)
            t0 = self._clock()
            try:
                names, configs = self._what_ran()
                not_loaded = self.server.restart(configs, names, cancel=self.stop)
            except Exception as e:  # noqa: BLE001 - ServerError, OSError: counted, said, and tried again
                record["error"] = " ".join(str(e).split())[:600]
                if not self.stop.is_set():      # why: a stop of serve's own is no failure to try again
                    self._failed = f"tritonserver did not start again: {record['error']}"
                self._restarted()
                return
            record.update(ok=True, took_s=round(self._clock() - t0, 2), pid=self.server.process.pid)
            if not_loaded:
                record["not_loaded"] = [" ".join(e.split())[:300] for e in not_loaded]
            self._restarted()
        how = " with the live configs they had" if configs else " from their files"
        which = "its models" if names is None else f"{len(names) - len(not_loaded)} model(s)"
        left = f"; not loaded: {'; '.join(record['not_loaded'])}" if not_loaded else ""
        self._say(f"tritonserver started again in {record['took_s']:.1f} s (pid {record['pid']}), same ports; "
                  f"{which} loaded{how}{left}")
