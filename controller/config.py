"""The controller's one configuration file: schema, defaults and validation.

Every default lives in the dataclasses below (this is the one place). A YAML file looks like::

    server:
      http_url: 127.0.0.1:8000
      grpc_url: 127.0.0.1:8001
      metrics_url: http://127.0.0.1:8002/metrics
      control_protocol: grpc          # grpc | http  (HTTP loads block HTTP inference workers)
      auth_header: admin-key          # optional: Triton's restricted repository API
      auth_key_env: TRITON_ADMIN_KEY  # the environment variable holding its value
      repository: /models             # optional: the server's model repository, if readable here (see loop.py)
    controller:
      interval_s: 2
      window_s: 20
      dry_run: false
      decision_log: decisions.jsonl
      metrics_port: 9109              # 0 (the default): a free loopback port, which `status` finds
      metrics_address: 127.0.0.1      # an IP address; 0.0.0.0 exposes /metrics and /status (a sidecar)
      gpu: auto                       # auto | nvml | simulated | none
      cpu_device: true                # without a GPU, the server's CPU use is the device of CPU models (cpu.py)
      tracing: auto                   # p99 from sampled request traces: auto (on from Triton 2.57) | true | false
    defaults:                         # apply to every model unless overridden below
      p99_target_ms: 100
    models:
      resnet_tiny: {p99_target_ms: 50, max_instances: 4}

Errors name the field and its valid range: ``models.resnet_tiny.max_instances: must be an
integer in [1, 64], got 0``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and its valid range."""


@dataclass(frozen=True)
class ModelLimits:
    """Targets and bounds for one model. Units are in the names."""

    p99_target_ms: float = 100.0        # latency objective the controller keeps p99 under
    min_instances: int = 1
    max_instances: int = 8
    min_delay_us: int = 0               # bounds for dynamic_batching.max_queue_delay_microseconds
    max_delay_us: int = 10_000
    delay_step_us: int = 500            # additive increase of the delay
    scale_up_cooldown_s: float = 4.0    # after any change, wait this long before adding more
    scale_down_delay_s: float = 30.0    # load must stay low this long before an instance is removed
    delay_cooldown_s: float = 20.0      # at least this long between two delay changes (full reloads)
    memory_budget_mb: float | None = None   # per GPU the model is on; None: the GPU's total less headroom
    memory_headroom_pct: float = 10.0   # of the device's total memory, kept free
    min_gain_pct: float = 10.0          # an added instance must raise throughput this much
    priority: int = 0                   # higher wins when one budget cannot meet every target
    sequence_scale_down: bool = False   # a stateful model (sequence batcher): may instances be removed while it has
                                        # requests? Triton 2.51 ends the live sequences a removed instance holds (see
                                        # modelkind.py); once it has had none past its idle timeout they may be anyway


@dataclass(frozen=True)
class LoopConfig:
    interval_s: float = 2.0             # scrape and decide this often
    window_s: float = 20.0              # observations cover at most this much time
    settle_s: float = 3.0               # after a change, ignore this much data (instances warming up)
    min_span_s: float = 4.0             # a decision needs at least this much fresh data
    dry_run: bool = False               # decide and log, apply nothing
    decision_log: str | None = None     # JSONL file; None: none
    metrics_port: int = 0               # the controller's own /metrics and /status; 0: a free loopback port (run, serve)
    metrics_address: str = "127.0.0.1"  # where it binds; another address (a sidecar: 0.0.0.0) exposes /metrics and /status
    gpu: str = "auto"                   # auto | nvml | simulated | none
    simulated_device_memory_mb: float = 2048.0   # device size when gpu: simulated
    reload_timeout_s: float = 120.0
    failure_backoff_s: float = 30.0     # first wait after a failed reload; doubles each time
    warm_start: str | None = None       # a `sweep.json`: its cells seed the model's memory of what works
    tracing: bool | str = "auto"        # p99 from sampled request traces when the server has a trace file: true,
    #                                     false, or auto: on where the server's Triton traces safely (2.57 and later;
    #                                     before, its trace release can crash it: traces.trace_release_unsafe)
    trace_file: str | None = None       # where the server's trace file is visible from here; None: ask the server
    trace_samples_per_s: float = 20.0   # sampled requests per second and model the trace rate aims at
    observation_log: str | None = None  # JSONL: every tick's observation per model (benchmarks); None: none
    decision_log_max_mb: float = 10.0   # the decision and observation logs rotate at this size (0: never) ...
    log_files_kept: int = 3             # ... keeping this many old files: decisions.jsonl.1 ... .3
    owner_mark: bool = True             # mark the configs it applies; refuse models another live controller marked
    owner_stale_after_s: float = 60.0   # another owner's /status silent this long: its mark is stale, take over
    planner: bool = True                # instances and delay from the planner's model (reactive rules as fallback)
    repair: bool = True                 # a full reload of a model whose requests keep failing (a crashed instance)
    repair_after_s: float = 10.0        # ... once failures have been seen this long, at least REPAIR_MIN_FAILURES
    repair_backoff_s: float = 300.0     # ... and again, if they persist, after this long (doubling, at most 1 h)
    cpu_device: bool = True             # without a GPU, the server's CPU use (its process tree, /proc) is the device
                                        # of the models on no other (cpu.py): the planner's contention and capacity bound
    warm_up: bool = True                # a model read to start cold, with no model_warmup of its own, is reloaded once
                                        # with Triton's model_warmup (zero data; warmup.py) so new instances warm first


@dataclass(frozen=True)
class ServerConfig:
    http_url: str = "127.0.0.1:8000"
    grpc_url: str = "127.0.0.1:8001"
    metrics_url: str = "http://127.0.0.1:8002/metrics"
    control_protocol: str = "grpc"
    auth_header: str | None = None
    auth_key_env: str = "TRITON_ADMIN_KEY"
    timeout_s: float = 10.0
    repository: str | None = None   # the server's model repository, where this machine can read it (serve sets it)

    def auth_headers(self) -> dict[str, str]:
        """The repository-API header, read from the environment; {} when none is configured."""
        if not self.auth_header:
            return {}
        value = os.environ.get(self.auth_key_env)
        if not value:
            raise ConfigError(f"server.auth_header is set but the environment variable {self.auth_key_env} is empty")
        return {self.auth_header: value}


@dataclass(frozen=True)
class ControllerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    defaults: ModelLimits = field(default_factory=ModelLimits)
    models: dict[str, ModelLimits] = field(default_factory=dict)   # empty: every loaded model, with defaults

    def limits_for(self, model: str) -> ModelLimits:
        return self.models.get(model, self.defaults)

    def with_models(self, names: list[str]) -> "ControllerConfig":
        """Manage `names` (those not configured get the defaults)."""
        return dataclasses.replace(self, models={n: self.models.get(n, self.defaults) for n in names})


# ---- validation ------------------------------------------------------------------------------

_INT_RANGES = {
    "min_instances": (1, 64), "max_instances": (1, 64), "min_delay_us": (0, 1_000_000),
    "max_delay_us": (0, 1_000_000), "delay_step_us": (1, 1_000_000), "priority": (-1000, 1000),
    "metrics_port": (0, 65535), "log_files_kept": (1, 100),
}
_FLOAT_RANGES = {
    "p99_target_ms": (0.1, 600_000.0), "scale_up_cooldown_s": (0.0, 3600.0),
    "scale_down_delay_s": (0.0, 86_400.0), "delay_cooldown_s": (0.0, 86_400.0),
    "memory_budget_mb": (1.0, 10_000_000.0), "memory_headroom_pct": (0.0, 90.0), "min_gain_pct": (0.0, 100.0),
    "interval_s": (0.1, 600.0), "window_s": (1.0, 3600.0), "settle_s": (0.0, 600.0), "min_span_s": (0.5, 600.0),
    "simulated_device_memory_mb": (1.0, 10_000_000.0), "reload_timeout_s": (1.0, 3600.0),
    "failure_backoff_s": (0.0, 3600.0), "repair_after_s": (0.0, 3600.0), "repair_backoff_s": (1.0, 86_400.0), "owner_stale_after_s": (0.0, 86_400.0), "decision_log_max_mb": (0.0, 1_000_000.0), "timeout_s": (0.1, 600.0), "trace_samples_per_s": (0.1, 100_000.0),
}
_CHOICES = {"gpu": ("auto", "nvml", "simulated", "none"), "control_protocol": ("grpc", "http")}


def _check_value(path: str, name: str, value: Any, default: Any) -> Any:
    if name in _INT_RANGES:
        lo, hi = _INT_RANGES[name]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{path}: must be an integer in [{lo}, {hi}], got {value!r}")
        return value
    if name in _FLOAT_RANGES:
        lo, hi = _FLOAT_RANGES[name]
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= float(value) <= hi:
            raise ConfigError(f"{path}: must be a number in [{lo:g}, {hi:g}], got {value!r}")
        return float(value)
    if name == "tracing":
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(f"{path}: must be true, false or auto, got {value!r}")
        return value
    if name in _CHOICES:
        if value not in _CHOICES[name]:
            raise ConfigError(f"{path}: must be one of {', '.join(_CHOICES[name])}, got {value!r}")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{path}: must be a string, got {value!r}")
    if value is None and default is not None:
        raise ConfigError(f"{path}: must be a string, got null")
    return value


def _build(cls, raw: Any, path: str, base=None):
    """Overlay the mapping `raw` on `base` (or the class defaults), checking every field."""
    base = base if base is not None else cls()
    if raw is None:
        return base
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, raw)) - known)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown field; valid fields: {', '.join(sorted(known))}")
    values = {k: _check_value(f"{path}.{k}", k, v, getattr(base, k)) for k, v in raw.items()}
    return dataclasses.replace(base, **values)


def _check_limits(limits: ModelLimits, path: str) -> ModelLimits:
    if limits.min_instances > limits.max_instances:
        raise ConfigError(f"{path}.min_instances: must be <= max_instances ({limits.max_instances}), got {limits.min_instances}")
    if limits.min_delay_us > limits.max_delay_us:
        raise ConfigError(f"{path}.min_delay_us: must be <= max_delay_us ({limits.max_delay_us}), got {limits.min_delay_us}")
    return limits


def _check_address(path: str, value: str) -> None:
    import ipaddress
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{path}: must be an IP address (127.0.0.1, 0.0.0.0, ::), got {value!r}") from None


def parse_config(raw: Any) -> ControllerConfig:
    """Validate a parsed YAML document (a mapping, or None for all defaults)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"top level: must be a mapping with keys server, controller, defaults, models; got {type(raw).__name__}")
    allowed = {"server", "controller", "defaults", "models"}
    unknown = sorted(set(map(str, raw)) - allowed)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section; valid sections: {', '.join(sorted(allowed))}")
    server = _build(ServerConfig, raw.get("server"), "server")
    loop = _build(LoopConfig, raw.get("controller"), "controller")
    if loop.interval_s > loop.window_s:
        raise ConfigError(f"controller.interval_s: must be <= window_s ({loop.window_s:g}), got {loop.interval_s:g}")
    _check_address("controller.metrics_address", loop.metrics_address)
    if loop.window_s < loop.min_span_s:
        raise ConfigError(f"controller.window_s: must be >= min_span_s ({loop.min_span_s:g}), got {loop.window_s:g}")
    defaults = _check_limits(_build(ModelLimits, raw.get("defaults"), "defaults"), "defaults")
    models_raw = raw.get("models") or {}
    if isinstance(models_raw, list):   # a plain list of names: defaults for each
        if not all(isinstance(m, str) for m in models_raw):
            raise ConfigError("models: a list must hold model names (strings)")
        models_raw = {m: {} for m in models_raw}
    if not isinstance(models_raw, dict):
        raise ConfigError(f"models: must be a mapping of model name to settings, got {type(models_raw).__name__}")
    models = {str(name): _check_limits(_build(ModelLimits, spec or {}, f"models.{name}", defaults), f"models.{name}")
              for name, spec in models_raw.items()}
    return ControllerConfig(server=server, loop=loop, defaults=defaults, models=models)


def load_config(path: str | Path | None) -> ControllerConfig:
    """Read and validate a YAML file; None gives every default."""
    if path is None:
        return ControllerConfig()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: {yaml_error_text(e)}") from None
    return parse_config(raw)


def yaml_error_text(e: Exception) -> str:
    """A YAML parse error in one line: "not valid YAML at line 3, column 1: expected ',' or '}', but got '<stream
    end>'" (PyYAML's own text spans several lines, with the offending line drawn under a caret)."""
    where = getattr(e, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"not valid YAML{at}: {what}"
