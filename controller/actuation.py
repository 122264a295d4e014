"""Actuation: the one narrow adapter that changes a model on the server.

`Actuator.apply(model, target)`:
  1. GET the live config (a config override is parsed as a complete ModelConfig, so we always
     start from the whole live config, never from the file);
  2. change the instance count (groups.with_total: the groups the user wrote are kept; with one group its
     `count`) and/or `dynamic_batching.max_queue_delay_microseconds`;
  3. load it with the override (gRPC by default: HTTP loads block HTTP inference workers);
  4. wait until the model is READY and read the config back to confirm.
On failure the server keeps serving the old model; we read back what is live and report it.

Only the instance count changed -> Triton updates instances in place (cheap). The delay changed
-> a full reload (a second copy loads before the first goes: double memory for a few seconds).
"""
from __future__ import annotations

import copy
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import groups

from .ownership import OwnerMark, mark_of, with_mark
from .server import load_error_text
from .types import Settings

log = logging.getLogger("controller.actuation")

REPAIR_KEY = "triton_autotune_repair"   # a config parameter whose new value forces a full reload (Actuator.repair)


class ActuationError(RuntimeError):
    pass


@dataclass(frozen=True)
class ApplyResult:
    ok: bool
    kind: str                 # "in_place" | "full_reload" | "none"
    live: Settings | None     # what the server runs after the attempt (None if unreadable)
    seconds: float
    error: str = ""


def settings_of(config: dict) -> Settings:
    """The two knobs as they stand in a ModelConfig JSON: the instances that serve requests, over every
    instance group and device (a KIND_GPU group's count is per listed GPU; passive groups left out; see
    groups.py), and the dynamic batcher's delay."""
    count = groups.total_instances(config)
    batching = config.get("dynamic_batching")
    delay = int((batching or {}).get("max_queue_delay_microseconds", 0) or 0)
    return Settings(instance_count=count, max_queue_delay_us=delay)


def has_dynamic_batching(config: dict) -> bool:
    return "dynamic_batching" in config


def with_settings(config: dict, target: Settings, prefer: Sequence[str] = (),
                  room: Mapping[str, int] | None = None) -> dict:
    """A copy of `config` running `target`. With one instance group its count becomes the target; with
    several, instances are added on (removed from) the devices `prefer` names first, and added only where
    `room` allows (groups.with_total), keeping the groups the user wrote."""
    try:
        new = groups.with_total(config, target.instance_count, prefer, room=room)
    except groups.GroupError as e:
        raise ActuationError(str(e)) from e
    if has_dynamic_batching(new):
        new["dynamic_batching"]["max_queue_delay_microseconds"] = str(target.max_queue_delay_us)
    elif target.max_queue_delay_us:
        raise ActuationError("the model has no dynamic_batching section; its queue delay cannot be set")
    return new


GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class TritonControl:
    """The few repository/health calls the controller makes, over gRPC or HTTP."""

    def __init__(self, grpc_url: str, http_url: str, protocol: str = "grpc", headers: dict | None = None,
                 timeout_s: float = 10.0, load_timeout_s: float = 120.0):
        self.protocol = protocol
        self.headers = dict(headers or {})
        if protocol == "grpc":
            # why: Triton's --grpc-restricted-protocol=<p>:<key>=<value> expects the gRPC metadata key
            # "triton-grpc-protocol-<key>"; the bare HTTP header name is refused (UNAVAILABLE)
            self.headers = {k if k.lower().startswith(GRPC_HEADER_PREFIX) else GRPC_HEADER_PREFIX + k: v
                            for k, v in self.headers.items()}
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        if protocol == "grpc":
            import tritonclient.grpc as grpcclient
            self._client = grpcclient.InferenceServerClient(grpc_url)
        else:
            import tritonclient.http as httpclient
            self._client = httpclient.InferenceServerClient(http_url, connection_timeout=timeout_s,
                                                            network_timeout=max(timeout_s, load_timeout_s))

    def _kw(self, timeout: float | None = None) -> dict:
        kw = {"headers": self.headers} if self.headers else {}
        if self.protocol == "grpc":
            kw["client_timeout"] = timeout or self.timeout_s
        return kw

    def live(self) -> bool:
        return bool(self._client.is_server_live(**self._kw()))

    def ready(self, model: str) -> bool:
        return bool(self._client.is_model_ready(model, **self._kw()))

    def config(self, model: str) -> dict:
        if self.protocol == "grpc":
            cfg = self._client.get_model_config(model, as_json=True, **self._kw())
            return cfg["config"]   # proto field names; int64 as strings: fine for a load override
        return self._client.get_model_config(model, **self._kw())

    def takes_model_loads(self) -> bool:
        """Whether the server runs in explicit model-control mode, asked without touching a model: the unload of a
        name no repository holds is a no-op there (HTTP 200, gRPC OK; checked on 2.51), and is refused with
        "explicit model load / unload is not allowed ..." in modes none and poll. Other errors are raised."""
        try:
            self._client.unload_model(_PROBE_MODEL, **self._kw())
        except Exception as e:  # noqa: BLE001
            if _CONTROL_OFF_TEXT in _msg(e):
                return False
            raise
        return True

    def load(self, model: str, config: dict | None = None) -> None:
        kw = self._kw(self.load_timeout_s)
        if config is None:
            self._client.load_model(model, **kw)
        else:
            self._client.load_model(model, config=json.dumps(config), **kw)

    def repository_index(self) -> list[dict]:
        if self.protocol == "grpc":
            idx = self._client.get_model_repository_index(as_json=True, **self._kw())
            return idx.get("models", [])
        return self._client.get_model_repository_index(**self._kw())

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


class Actuator:
    """`mark`: the owner mark `claim` puts into the live config (see ownership.py). `apply` keeps whatever
    parameters the live config has (a mark among them): a count change then stays in place."""

    def __init__(self, control: TritonControl, ready_timeout_s: float = 120.0, mark: OwnerMark | None = None):
        self.control = control
        self.ready_timeout_s = ready_timeout_s
        self.mark = mark

    def read(self, model: str) -> tuple[dict, Settings]:
        cfg = self.control.config(model)
        return cfg, settings_of(cfg)

    def apply(self, model: str, target: Settings, prefer: Sequence[str] = (),
              room: Mapping[str, int] | None = None) -> ApplyResult:
        """`prefer`: the devices to add instances on first; `room`: how many more fit on each (policy.memory_room);
        both for a model on several devices (groups.with_total)."""
        t0 = time.monotonic()
        try:
            live_cfg, live = self.read(model)
        except Exception as e:  # noqa: BLE001 - any client error is a failed attempt, not a crash
            return ApplyResult(False, "none", None, time.monotonic() - t0, f"cannot read live config: {_msg(e)}")
        if live == target:
            return ApplyResult(True, "none", live, time.monotonic() - t0)
        kind = "in_place" if live.max_queue_delay_us == target.max_queue_delay_us else "full_reload"
        try:
            new_cfg = with_settings(live_cfg, target, prefer, room)    # keeps the live parameters, an owner mark among them
            self.control.load(model, new_cfg)
            self._wait_ready(model)
            _, after = self.read(model)
        except Exception as e:  # noqa: BLE001
            after = self._read_quietly(model)
            return ApplyResult(False, kind, after, time.monotonic() - t0, _reload_error(e))
        if after != target:
            return ApplyResult(False, kind, after, time.monotonic() - t0,
                               f"server reports {after} after loading {target}")
        return ApplyResult(True, kind, after, time.monotonic() - t0)

    def claim(self, model: str) -> ApplyResult:
        """Load the live config with this actuator's owner mark, settings unchanged (a full reload)."""
        mark = self.mark

        def edit(cfg: dict) -> dict | None:
            return None if mark is None or mark_of(cfg) == mark else with_mark(cfg, mark)

        return self._reload_live(model, edit, lambda cfg, after, live: None if mark_of(cfg) == mark
                                 else "the owner mark did not stick")

    def repair(self, model: str) -> ApplyResult:
        """Reload the live config in full, settings unchanged: every instance (a dead stub among them) is created
        anew while the old copy serves. Loading an identical config changes nothing on 2.51, so the config
        carries a fresh `REPAIR_KEY` parameter (a parameter change is a full reload, as the owner mark's is);
        it stays in the live config, and the next repair replaces it."""
        def edit(cfg: dict) -> dict:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + f".{time.time_ns() % 1_000_000_000:09d}"
            cfg.setdefault("parameters", {})[REPAIR_KEY] = {"string_value": stamp}
            return cfg

        return self._reload_live(model, edit, lambda cfg, after, live: None if after == live
                                 else f"server reports {after} after repairing {live}")

    def warm_up(self, model: str, samples: list[dict]) -> ApplyResult:
        """Reload the live config in full with Triton's `model_warmup` set to `samples` (warmup.py), settings
        unchanged: the new copy's instances run them before it serves, the old one serves meanwhile. Nothing to do
        where the live config already has a warm-up (the model's own is never replaced)."""
        def edit(cfg: dict) -> dict | None:
            if cfg.get("model_warmup"):
                return None
            cfg["model_warmup"] = copy.deepcopy(samples)
            return cfg

        return self._reload_live(model, edit, lambda cfg, after, live: None if cfg.get("model_warmup") and after == live
                                 else f"server reports {after}, warm-up {'kept' if cfg.get('model_warmup') else 'absent'}, "
                                      f"after warming {live} up")

    def _reload_live(self, model: str, edit: Callable[[dict], dict | None],
                     check: Callable[[dict, Settings, Settings], str | None]) -> ApplyResult:
        """A full reload of the live config as `edit` changes it (given a copy; None: nothing to do), waiting
        for READY and reading the result back; `check(config after, settings after, settings before)` says
        what is wrong with the result (None: nothing). The shared path of `claim` and `repair`."""
        t0 = time.monotonic()
        try:
            live_cfg, live = self.read(model)
        except Exception as e:  # noqa: BLE001
            return ApplyResult(False, "none", None, time.monotonic() - t0, f"cannot read live config: {_msg(e)}")
        cfg = edit(copy.deepcopy(live_cfg))
        if cfg is None:
            return ApplyResult(True, "none", live, time.monotonic() - t0)
        try:
            self.control.load(model, cfg)
            self._wait_ready(model)
            after_cfg, after = self.read(model)
        except Exception as e:  # noqa: BLE001
            return ApplyResult(False, "full_reload", self._read_quietly(model), time.monotonic() - t0,
                               _reload_error(e))
        wrong = check(after_cfg, after, live)
        if wrong is not None:
            return ApplyResult(False, "full_reload", after, time.monotonic() - t0, wrong)
        return ApplyResult(True, "full_reload", after, time.monotonic() - t0)

    def _wait_ready(self, model: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.control.ready(model):
                return
            time.sleep(0.1)
        raise ActuationError(f"model {model} not READY {self.ready_timeout_s:g} s after load")

    def _read_quietly(self, model: str) -> Settings | None:
        try:
            return self.read(model)[1]
        except Exception:  # noqa: BLE001
            return None


def _msg(e: Exception) -> str:
    text = getattr(e, "message", None)
    text = text() if callable(text) else text
    return load_error_text(str(text or e))[:500]     # one line; a Python model's traceback as "(at file(line))"


_PROBE_MODEL = "triton-autotune-probe-no-such-model"     # a name no repository holds: takes_model_loads

# Triton's answer to a load or unload when it runs in --model-control-mode=none or poll (the text says "polling"
# in both modes: core's ModelRepositoryManager), over HTTP (503) and gRPC (UNAVAILABLE) alike
_CONTROL_OFF_TEXT = "explicit model load / unload is not allowed"
CONTROL_OFF_WHY = "it runs with --model-control-mode=none (the default) or poll"


def control_off_text(where: str | None = None) -> str:
    """What a server without model control means and what to do, in one line (`where`: its address)."""
    server = f"the server at {where}" if where else "the server"
    return (f"{server} takes no model loads: {CONTROL_OFF_WHY}; restart it with --model-control-mode=explicit "
            "(and --load-model='*' to load every model at start)")


def _reload_error(e: Exception) -> str:
    """A failed load's message, with what to do where the server's model control is off."""
    text = _msg(e)
    return f"{text} ({control_off_text()})" if _CONTROL_OFF_TEXT in text else text


# ---- what a refusal means ---------------------------------------------------------------------
# Triton 2.51 answers a request to a restricted API the same way whether the header is missing or
# carries the wrong value (one message in the binary for each protocol):
#   gRPC: StatusCode.UNAVAILABLE "This protocol is restricted, expecting header 'triton-grpc-protocol-<key>'"
#   HTTP: 403 {"error": "This API is restricted, expecting header '<key>'"}
# so "wrong key" is "restricted although a key was sent". A server that is not there is also
# UNAVAILABLE over gRPC ("failed to connect to all addresses ... Connection refused"), or
# DEADLINE_EXCEEDED when nothing answers; over HTTP a ConnectionRefusedError or a timeout.

UNREACHABLE, RESTRICTED, WRONG_KEY, CONTROL_OFF, OTHER = "unreachable", "restricted", "wrong_key", "control_off", "other"

_RESTRICTED_RE = re.compile(r"is restricted, expecting header '([^']*)'")
_UNREACHABLE_TEXT = ("failed to connect to all addresses", "connection refused", "deadline exceeded",
                     "socket closed", "connection reset", "name resolution", "timed out", "no route to host")


def classify_error(e: BaseException, key_sent: bool) -> str:
    """UNREACHABLE, RESTRICTED (no key sent), WRONG_KEY (a key was sent and refused), CONTROL_OFF (the server takes
    no model loads: not in explicit model-control mode) or OTHER."""
    text = _msg(e)
    status = getattr(e, "status", None)
    status = str(status() if callable(status) else status or "")
    if _RESTRICTED_RE.search(text) or status == "403":
        return WRONG_KEY if key_sent else RESTRICTED
    if _CONTROL_OFF_TEXT in text:       # why: before the status test; gRPC says UNAVAILABLE, yet the server answered
        return CONTROL_OFF
    if isinstance(e, (ConnectionError, TimeoutError, socket.timeout)):
        return UNREACHABLE
    if status in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"):
        return UNREACHABLE
    if any(t in text.lower() for t in _UNREACHABLE_TEXT):
        return UNREACHABLE
    return OTHER


def explain_error(e: BaseException, where: str, key_sent: bool, key_env: str = "TRITON_ADMIN_KEY") -> str:
    """One line for the user, by what the error means (see classify_error)."""
    kind = classify_error(e, key_sent)
    text = _msg(e)[:200]
    m = _RESTRICTED_RE.search(text)
    header = m.group(1)[len(GRPC_HEADER_PREFIX):] if m and m.group(1).startswith(GRPC_HEADER_PREFIX) else \
        (m.group(1) if m else "admin-key")
    if kind == RESTRICTED:
        return (f"the repository API of the server at {where} is restricted (it expects header '{header}'); pass the "
                f"key: export {key_env}=<value from the key file> and set server.auth_header: {header}, or run status "
                "on the same machine as serve, which finds it")
    if kind == WRONG_KEY:
        return (f"the server at {where} refused the key sent in header '{header}' (its repository API is restricted "
                f"to another key): check ${key_env} against the key file that serve printed")
    if kind == CONTROL_OFF:
        return control_off_text(where)
    if kind == UNREACHABLE:
        return f"cannot reach the server at {where}: {text}"
    return f"the server at {where} answered with an error: {text}"
