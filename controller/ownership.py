"""One controller per model: the owner mark in the configs a controller applies, and the check of a foreign one.

Every config a controller loads carries a ModelConfig parameter

    parameters { key: "triton_autotune_owner" value { string_value: '{"owner": "<host>:<pid>:<start>",
                                                                      "status_url": "http://.../status"}' } }

The mark never changes during a controller's life (no timestamp in it): a config change that leaves the
parameters map as it was stays an in-place instance update; only the first change a controller applies
to a model that carries no mark, or another controller's, is a full reload (Triton 2.51 reloads the whole
model when anything but `instance_group` differs). `serve` avoids even that one: the first load of each model
carries the mark (`marked_file_config`).

Liveness is not in the config (refreshing it would need a reload): it is the owner's own `/status`.
A controller that finds another owner's mark asks that URL (at most every `probe_every_s`):

- it answers with the same owner id and lists the model -> the owner lives: refuse to act (hold);
- it answers but does not manage the model, or answers as another controller (its port reused),
  or the owner's pid is gone on this same host -> the owner is gone: take over now;
- it does not answer -> take over once it has not answered for `stale_after_s`.

Without a status URL (a controller run without an endpoint), a mark from this host is alive while its pid is;
one from another host is judged by the timeout alone.
"""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import runstate

OWNER_KEY = "triton_autotune_owner"

MINE, UNMARKED, FOREIGN_LIVE, FOREIGN_UNREACHABLE, TAKE_OVER = (
    "mine", "unmarked", "foreign_live", "foreign_unreachable", "take_over")


@dataclass(frozen=True)
class OwnerMark:
    owner: str                       # "<host>:<pid>:<start time, unix s>"
    status_url: str | None = None    # the owner's /status

    def encode(self) -> str:
        return json.dumps({"owner": self.owner, "status_url": self.status_url}, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def decode(text: str) -> "OwnerMark | None":
        try:
            doc = json.loads(text)
            return OwnerMark(str(doc["owner"]), doc.get("status_url") or None)
        except (ValueError, KeyError, TypeError):
            return OwnerMark(str(text), None) if text else None

    @property
    def host(self) -> str:
        return self.owner.rsplit(":", 2)[0]

    @property
    def pid(self) -> int | None:
        try:
            return int(self.owner.rsplit(":", 2)[1])
        except (IndexError, ValueError):
            return None


_issued: set[str] = set()
_running: set[str] = set()     # owner ids of the controllers running in this process (see running/stopped)


def running(owner: str) -> None:
    _running.add(owner)


def stopped(owner: str) -> None:
    _running.discard(owner)


def identity(started: float | None = None) -> str:
    """"<host>:<pid>:<start time>" (ms; two controllers in one process, as in tests, get distinct ids)."""
    t = started if started is not None else time.time()
    ident = f"{socket.gethostname()}:{os.getpid()}:{t:.3f}"
    while ident in _issued:
        t += 0.001
        ident = f"{socket.gethostname()}:{os.getpid()}:{t:.3f}"
    _issued.add(ident)
    return ident


def mark_of(config: dict) -> OwnerMark | None:
    """The owner mark in a live ModelConfig (JSON as the server returns it), or None."""
    value = (config.get("parameters") or {}).get(OWNER_KEY) or {}
    text = value.get("string_value") if isinstance(value, dict) else None
    return OwnerMark.decode(text) if text else None


def with_mark(config: dict, mark: OwnerMark) -> dict:
    """`config` (modified in place and returned) carrying `mark`."""
    config.setdefault("parameters", {})[OWNER_KEY] = {"string_value": mark.encode()}
    return config


def marked_file_config(model_dir: Path, mark: OwnerMark) -> tuple[dict | None, str]:
    """The model's `config.pbtxt` as a load override carrying `mark`, for a model's first load (`serve`), with ""; or
    None and why where that cannot be had. Loaded with it, the model is marked from the start and no claim (a full
    reload of every instance, cold again, under the load that has begun meanwhile) follows.

    The override is the file as it stands, parsed as this client's ModelConfig; the server treats an override as
    the whole config and normalises it as it does the file (the live configs are compared in
    tests/test_ownership.py). Where the file does not parse here (a field of a newer server, say) the model loads
    from its file and the controller claims it later, as `run` does beside a server it did not start.
    Example: sim_accel's file with `parameters { key: "triton_autotune_owner" ... }` added, the name from the
    folder where the file has none; for a model without a config.pbtxt, the name and the mark alone."""
    from google.protobuf import text_format

    from .server import parse_config_text
    path = Path(model_dir) / "config.pbtxt"
    if not path.exists():
        # why: a model without a file: the server completes a config from the model file, for an override holding
        # only the name as for none (tests/test_ownership.py compares the two)
        return with_mark({"name": Path(model_dir).name}, mark), ""
    try:
        config = parse_config_text(path.read_text())
    except (OSError, UnicodeDecodeError, text_format.ParseError) as e:
        return None, f"{path} not read here ({' '.join(str(e).split())[:160]})"
    config.setdefault("name", Path(model_dir).name)
    return with_mark(config, mark), ""


def probe_status(url: str, timeout_s: float = 1.0) -> dict | None:
    """The owner's /status document, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None




@dataclass(frozen=True)
class Verdict:
    state: str                        # MINE | UNMARKED | FOREIGN_LIVE | FOREIGN_UNREACHABLE | TAKE_OVER
    mark: OwnerMark | None
    detail: str = ""

    @property
    def may_act(self) -> bool:
        return self.state in (MINE, UNMARKED, TAKE_OVER)


@dataclass
class _Seen:
    owner: str
    checked_at: float
    verdict: Verdict
    unreachable_since: float | None = None


@dataclass
class OwnershipGuard:
    me: OwnerMark
    stale_after_s: float = 60.0
    probe_every_s: float = 5.0
    probe: Callable[[str], dict | None] = probe_status
    pid_alive: Callable[[int], bool] = runstate.pid_alive
    hostname: str = field(default_factory=socket.gethostname)
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def check(self, model: str, mark: OwnerMark | None, now: float) -> Verdict:
        if mark is None:
            self._seen.pop(model, None)
            return Verdict(UNMARKED, None)
        if mark.owner == self.me.owner:
            self._seen.pop(model, None)
            return Verdict(MINE, mark)
        seen = self._seen.get(model)
        if seen is not None and seen.owner == mark.owner and now - seen.checked_at < self.probe_every_s:
            return seen.verdict       # why: the probe is a network call on the loop thread; not every tick
        if seen is None or seen.owner != mark.owner:
            seen = self._seen[model] = _Seen(mark.owner, now, Verdict(FOREIGN_UNREACHABLE, mark))
        alive, why = self._alive(model, mark)
        if alive is True:
            seen.unreachable_since = None
            verdict = Verdict(FOREIGN_LIVE, mark, why)
        elif alive is False:
            verdict = Verdict(TAKE_OVER, mark, why)
        else:
            if seen.unreachable_since is None:
                seen.unreachable_since = now
            gone = now - seen.unreachable_since
            verdict = Verdict(TAKE_OVER, mark, f"{why} for {gone:.0f} s (stale after {self.stale_after_s:g} s)") \
                if gone >= self.stale_after_s else Verdict(FOREIGN_UNREACHABLE, mark, f"{why} for {gone:.0f} s")
        seen.checked_at, seen.verdict = now, verdict
        return verdict

    def _alive(self, model: str, mark: OwnerMark) -> tuple[bool | None, str]:
        """True: the owner lives and manages `model`; False: it is provably gone; None: cannot tell yet."""
        same_host = mark.host == self.hostname
        if same_host and mark.pid == os.getpid():   # a controller of this very process (tests, an embedding app)
            return (True, "alive in this process") if mark.owner in _running else (False, "stopped (this process)")
        if same_host and mark.pid is not None and not self.pid_alive(mark.pid):
            return False, f"its process {mark.pid} is gone"
        if mark.status_url:
            doc = self.probe(mark.status_url)
            if doc is None:
                return None, f"{mark.status_url} does not answer"
            if doc.get("owner") != mark.owner:
                return False, f"{mark.status_url} answers as another controller ({doc.get('owner')})"
            if model not in (doc.get("models") or {}):
                return False, f"it does not manage {model}"
            return True, f"alive at {mark.status_url}"
        if same_host and mark.pid is not None:
            return True, f"its process {mark.pid} runs on this host (no status URL)"
        return None, "no status URL to ask"
