"""Configuration (controller/config.py): defaults, a full file, and every kind of bad input.

Bad input must fail with a ConfigError whose message names the field path and the valid range.
"""
from __future__ import annotations

import dataclasses
import textwrap

import pytest
import yaml

from controller.config import (
    ConfigError,
    ControllerConfig,
    LoopConfig,
    ModelLimits,
    ServerConfig,
    load_config,
    parse_config,
)


def write(tmp_path, text: str, name: str = "controller.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# =====================================================================================
# defaults
# =====================================================================================

def test_defaults_load_with_none():
    cfg = load_config(None)
    assert cfg == ControllerConfig()
    assert cfg.server == ServerConfig() and cfg.loop == LoopConfig() and cfg.defaults == ModelLimits()
    assert cfg.models == {}
    # the documented defaults, with units in the names
    assert (cfg.loop.interval_s, cfg.loop.window_s, cfg.loop.settle_s, cfg.loop.min_span_s) == (2.0, 20.0, 3.0, 4.0)
    assert (cfg.defaults.p99_target_ms, cfg.defaults.min_instances, cfg.defaults.max_instances) == (100.0, 1, 8)
    assert cfg.defaults.memory_budget_mb is None
    assert cfg.loop.gpu == "auto" and cfg.server.control_protocol == "grpc"


@pytest.mark.parametrize("raw", [None, {}], ids=["null-document", "empty-mapping"])
def test_parse_empty_document_gives_defaults(raw):
    assert parse_config(raw) == ControllerConfig()


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == ControllerConfig()
    assert load_config(write(tmp_path, "# only a comment\n", "c.yaml")) == ControllerConfig()


def test_limits_for_unconfigured_model_is_defaults():
    cfg = parse_config({"defaults": {"p99_target_ms": 70}, "models": {"a": {"max_instances": 2}}})
    assert cfg.limits_for("other") == cfg.defaults
    assert cfg.limits_for("a").max_instances == 2


def test_with_models_keeps_configured_and_defaults_the_rest():
    cfg = parse_config({"defaults": {"p99_target_ms": 70}, "models": {"a": {"max_instances": 2}}})
    managed = cfg.with_models(["a", "b"])
    assert list(managed.models) == ["a", "b"]
    assert managed.models["a"] == cfg.models["a"]
    assert managed.models["b"] == cfg.defaults
    assert cfg.models.keys() == {"a"}          # the original is not changed


# =====================================================================================
# a full file
# =====================================================================================

FULL = """\
server:
  http_url: 10.0.0.5:8000
  grpc_url: 10.0.0.5:8001
  metrics_url: http://10.0.0.5:8002/metrics
  control_protocol: http
  auth_header: admin-key
  auth_key_env: MY_ADMIN_KEY
  timeout_s: 5
controller:
  interval_s: 1.5
  window_s: 30
  settle_s: 2
  min_span_s: 5
  dry_run: true
  decision_log: /tmp/decisions.jsonl
  metrics_port: 9109
  gpu: simulated
  simulated_device_memory_mb: 4096
  reload_timeout_s: 60
  failure_backoff_s: 15
defaults:
  p99_target_ms: 80
  min_instances: 1
  max_instances: 6
  min_delay_us: 0
  max_delay_us: 20000
  delay_step_us: 250
  scale_up_cooldown_s: 6
  scale_down_delay_s: 60
  delay_cooldown_s: 40
  memory_budget_mb: 8000
  memory_headroom_pct: 5
  min_gain_pct: 15
  priority: 1
models:
  resnet_tiny: {p99_target_ms: 50, max_instances: 4}
  sim_accel:
    min_instances: 2
    memory_budget_mb: 1024.5
    priority: -3
"""


def test_full_file_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    assert cfg.server == ServerConfig(http_url="10.0.0.5:8000", grpc_url="10.0.0.5:8001",
                                      metrics_url="http://10.0.0.5:8002/metrics", control_protocol="http",
                                      auth_header="admin-key", auth_key_env="MY_ADMIN_KEY", timeout_s=5.0)
    assert cfg.loop == LoopConfig(interval_s=1.5, window_s=30.0, settle_s=2.0, min_span_s=5.0, dry_run=True,
                                  decision_log="/tmp/decisions.jsonl", metrics_port=9109, gpu="simulated",
                                  simulated_device_memory_mb=4096.0, reload_timeout_s=60.0, failure_backoff_s=15.0)
    defaults = ModelLimits(p99_target_ms=80.0, min_instances=1, max_instances=6, min_delay_us=0, max_delay_us=20000,
                           delay_step_us=250, scale_up_cooldown_s=6.0, scale_down_delay_s=60.0, delay_cooldown_s=40.0,
                           memory_budget_mb=8000.0, memory_headroom_pct=5.0, min_gain_pct=15.0, priority=1)
    assert cfg.defaults == defaults
    assert list(cfg.models) == ["resnet_tiny", "sim_accel"]
    assert cfg.models["resnet_tiny"] == dataclasses.replace(defaults, p99_target_ms=50.0, max_instances=4)
    assert cfg.models["sim_accel"] == dataclasses.replace(defaults, min_instances=2, memory_budget_mb=1024.5, priority=-3)
    # numbers given as integers become floats where the field is a float
    assert isinstance(cfg.defaults.p99_target_ms, float) and isinstance(cfg.loop.window_s, float)
    assert isinstance(cfg.defaults.max_instances, int)


def test_full_file_dumped_and_reloaded_is_equal(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    raw = {"server": dataclasses.asdict(cfg.server), "controller": dataclasses.asdict(cfg.loop),
           "defaults": dataclasses.asdict(cfg.defaults),
           "models": {name: dataclasses.asdict(lim) for name, lim in cfg.models.items()}}
    again = load_config(write(tmp_path, yaml.safe_dump(raw), "dumped.yaml"))
    assert again == cfg


def test_module_docstring_example_is_valid(tmp_path):
    import controller.config as module
    doc = module.__doc__
    example = doc[doc.index("server:"):doc.index("Errors name")]
    cfg = load_config(write(tmp_path, textwrap.dedent("    " + example)))
    assert cfg.models["resnet_tiny"].p99_target_ms == 50.0
    assert cfg.models["resnet_tiny"].max_instances == 4
    assert cfg.defaults.p99_target_ms == 100.0
    assert cfg.server.auth_header == "admin-key" and cfg.loop.metrics_port == 9109


def test_memory_budget_may_be_null_when_default_is_none():
    assert parse_config({"defaults": {"memory_budget_mb": None}}).defaults.memory_budget_mb is None


def test_decision_log_may_be_null():
    assert parse_config({"controller": {"decision_log": None}}).loop.decision_log is None


# =====================================================================================
# models: list form and overlay on the defaults
# =====================================================================================

def test_models_as_list_get_the_defaults():
    cfg = parse_config({"defaults": {"p99_target_ms": 40, "max_instances": 3}, "models": ["resnet_tiny", "sim_accel"]})
    assert list(cfg.models) == ["resnet_tiny", "sim_accel"]
    assert all(lim == cfg.defaults for lim in cfg.models.values())
    assert cfg.models["sim_accel"].p99_target_ms == 40.0


def test_models_list_in_yaml_file(tmp_path):
    cfg = load_config(write(tmp_path, "models:\n  - resnet_tiny\n  - sim_accel\n"))
    assert cfg.models == {"resnet_tiny": ModelLimits(), "sim_accel": ModelLimits()}


def test_model_settings_overlay_defaults_section():
    cfg = parse_config({"defaults": {"p99_target_ms": 80, "max_instances": 6, "scale_down_delay_s": 90},
                        "models": {"a": {"p99_target_ms": 30}, "b": None, "c": {}}})
    a = cfg.models["a"]
    assert a.p99_target_ms == 30.0                       # its own setting
    assert a.max_instances == 6 and a.scale_down_delay_s == 90.0   # from the defaults section, not the class defaults
    assert a.min_gain_pct == ModelLimits().min_gain_pct  # neither: the class default
    assert cfg.models["b"] == cfg.defaults and cfg.models["c"] == cfg.defaults


def test_model_cross_check_uses_overlaid_values():
    # min 4 is fine against the defaults' max 6, but not against this model's max 2
    with pytest.raises(ConfigError) as e:
        parse_config({"defaults": {"max_instances": 6}, "models": {"m": {"min_instances": 4, "max_instances": 2}}})
    assert str(e.value) == "models.m.min_instances: must be <= max_instances (2), got 4"
    # and a model may lower max below a default min only if it lowers min too
    with pytest.raises(ConfigError, match=r"^models\.m\.min_instances: must be <= max_instances \(2\), got 3$"):
        parse_config({"defaults": {"min_instances": 3}, "models": {"m": {"max_instances": 2}}})


def test_numeric_model_names_become_strings():
    cfg = parse_config({"models": {123: {"max_instances": 2}}})
    assert cfg.models == {"123": dataclasses.replace(ModelLimits(), max_instances=2)}


# =====================================================================================
# invalid input: the message names the field path and the valid range
# =====================================================================================

def bad(id: str, raw, message: str):
    """`message`: the exact error text."""
    return pytest.param(raw, message, id=id)


INVALID = [
    bad("model-max-instances-zero", {"models": {"resnet_tiny": {"max_instances": 0}}},
        "models.resnet_tiny.max_instances: must be an integer in [1, 64], got 0"),
    bad("model-max-instances-too-many", {"models": {"resnet_tiny": {"max_instances": 65}}},
        "models.resnet_tiny.max_instances: must be an integer in [1, 64], got 65"),
    bad("model-max-instances-float", {"models": {"resnet_tiny": {"max_instances": 2.5}}},
        "models.resnet_tiny.max_instances: must be an integer in [1, 64], got 2.5"),
    bad("model-max-instances-bool", {"models": {"resnet_tiny": {"max_instances": True}}},
        "models.resnet_tiny.max_instances: must be an integer in [1, 64], got True"),
    bad("model-max-instances-string", {"models": {"resnet_tiny": {"max_instances": "4"}}},
        "models.resnet_tiny.max_instances: must be an integer in [1, 64], got '4'"),
    bad("defaults-p99-target-zero", {"defaults": {"p99_target_ms": 0}},
        "defaults.p99_target_ms: must be a number in [0.1, 600000], got 0"),
    bad("defaults-p99-target-negative", {"defaults": {"p99_target_ms": -5.0}},
        "defaults.p99_target_ms: must be a number in [0.1, 600000], got -5.0"),
    bad("defaults-p99-target-string", {"defaults": {"p99_target_ms": "fast"}},
        "defaults.p99_target_ms: must be a number in [0.1, 600000], got 'fast'"),
    bad("defaults-p99-target-null", {"defaults": {"p99_target_ms": None}},
        "defaults.p99_target_ms: must be a number in [0.1, 600000], got None"),
    bad("defaults-p99-target-nan", {"defaults": {"p99_target_ms": float("nan")}},
        "defaults.p99_target_ms: must be a number in [0.1, 600000], got nan"),
    bad("defaults-p99-target-inf", {"defaults": {"p99_target_ms": float("inf")}},
        "defaults.p99_target_ms: must be a number in [0.1, 600000], got inf"),
    bad("defaults-headroom-over-90", {"defaults": {"memory_headroom_pct": 95}},
        "defaults.memory_headroom_pct: must be a number in [0, 90], got 95"),
    bad("defaults-min-gain-over-100", {"defaults": {"min_gain_pct": 150}},
        "defaults.min_gain_pct: must be a number in [0, 100], got 150"),
    bad("defaults-delay-step-zero", {"defaults": {"delay_step_us": 0}},
        "defaults.delay_step_us: must be an integer in [1, 1000000], got 0"),
    bad("defaults-memory-budget-below-1", {"defaults": {"memory_budget_mb": 0.5}},
        "defaults.memory_budget_mb: must be a number in [1, 1e+07], got 0.5"),
    bad("controller-gpu-choices", {"controller": {"gpu": "cuda"}},
        "controller.gpu: must be one of auto, nvml, simulated, none, got 'cuda'"),
    bad("server-control-protocol-choices", {"server": {"control_protocol": "rest"}},
        "server.control_protocol: must be one of grpc, http, got 'rest'"),
    bad("controller-interval-longer-than-window", {"controller": {"interval_s": 30, "window_s": 20}},
        "controller.interval_s: must be <= window_s (20), got 30"),
    bad("controller-interval-too-small", {"controller": {"interval_s": 0.01}},
        "controller.interval_s: must be a number in [0.1, 600], got 0.01"),
    bad("controller-metrics-port-too-big", {"controller": {"metrics_port": 70000}},
        "controller.metrics_port: must be an integer in [0, 65535], got 70000"),
    bad("controller-dry-run-not-bool", {"controller": {"dry_run": "yes please"}},
        "controller.dry_run: must be true or false, got 'yes please'"),
    bad("controller-tracing-not-a-choice", {"controller": {"tracing": "sometimes"}},
        "controller.tracing: must be true, false or auto, got 'sometimes'"),
    bad("controller-tracing-a-number", {"controller": {"tracing": 1}},
        "controller.tracing: must be true, false or auto, got 1"),
    bad("controller-decision-log-not-string", {"controller": {"decision_log": 5}},
        "controller.decision_log: must be a string, got 5"),
    bad("server-http-url-null", {"server": {"http_url": None}}, "server.http_url: must be a string, got null"),
    bad("server-timeout-negative", {"server": {"timeout_s": -1}},
        "server.timeout_s: must be a number in [0.1, 600], got -1"),
    bad("unknown-field-in-model", {"models": {"resnet_tiny": {"max_instance": 4}}},
        "models.resnet_tiny.max_instance: unknown field; valid fields: delay_cooldown_s, delay_step_us, "
        "max_delay_us, max_instances, memory_budget_mb, memory_headroom_pct, min_delay_us, min_gain_pct, "
        "min_instances, p99_target_ms, priority, scale_down_delay_s, scale_up_cooldown_s, sequence_scale_down"),
    bad("unknown-field-in-controller", {"controller": {"window": 20}},
        "controller.window: unknown field; valid fields: cpu_device, decision_log, decision_log_max_mb, dry_run, failure_backoff_s, gpu, interval_s, "
        "log_files_kept, metrics_address, metrics_port, min_span_s, observation_log, owner_mark, owner_stale_after_s, planner, reload_timeout_s, repair, repair_after_s, repair_backoff_s, settle_s, simulated_device_memory_mb, trace_file, trace_samples_per_s, tracing, warm_start, warm_up, window_s"),
    bad("unknown-section", {"model": {"resnet_tiny": {}}},
        "model: unknown section; valid sections: controller, defaults, models, server"),
    bad("defaults-min-over-max", {"defaults": {"min_instances": 5, "max_instances": 3}},
        "defaults.min_instances: must be <= max_instances (3), got 5"),
    bad("model-min-over-max", {"models": {"resnet_tiny": {"min_instances": 9}}},
        "models.resnet_tiny.min_instances: must be <= max_instances (8), got 9"),
    bad("model-min-delay-over-max-delay", {"models": {"m": {"min_delay_us": 5000, "max_delay_us": 1000}}},
        "models.m.min_delay_us: must be <= max_delay_us (1000), got 5000"),
    bad("window-shorter-than-min-span", {"controller": {"window_s": 3, "min_span_s": 4}},
        "controller.window_s: must be >= min_span_s (4), got 3"),
    bad("top-level-list", ["server", "models"],
        "top level: must be a mapping with keys server, controller, defaults, models; got list"),
    bad("top-level-string", "models: resnet",
        "top level: must be a mapping with keys server, controller, defaults, models; got str"),
    bad("section-not-mapping", {"controller": [1, 2]}, "controller: must be a mapping, got list"),
    bad("model-settings-not-mapping", {"models": {"resnet_tiny": 4}}, "models.resnet_tiny: must be a mapping, got int"),
    bad("models-not-mapping-or-list", {"models": "resnet_tiny"},
        "models: must be a mapping of model name to settings, got str"),
    bad("models-list-of-non-names", {"models": ["a", {"b": 1}]}, "models: a list must hold model names (strings)"),
]


@pytest.mark.parametrize("text, value", [("", "auto"), ("tracing: auto", "auto"), ("tracing: true", True),
                                         ("tracing: false", False), ("tracing: off", False)])
def test_tracing_is_auto_unless_set_to_true_or_false(text, value):
    raw = yaml.safe_load("controller: {" + text + "}")
    assert parse_config(raw).loop.tracing == value


@pytest.mark.parametrize("raw, message", INVALID)
def test_invalid_config(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert str(e.value) == message


@pytest.mark.parametrize("raw, message", INVALID)
def test_invalid_config_from_file(tmp_path, raw, message):
    """The same errors through a YAML file (NaN and inf spelled the YAML way)."""
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_malformed_yaml_names_line_and_column(tmp_path):
    p = write(tmp_path, """\
        controller:
          interval_s: 2
          window_s: [20
        models: {}
        """)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: not valid YAML at line ")
    assert "line 4, column 7" in msg


def test_malformed_yaml_bad_indent(tmp_path):
    p = write(tmp_path, "server:\n  http_url: a\n grpc_url: b\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3, column 2: "):
        load_config(p)


def test_malformed_yaml_tab(tmp_path):
    p = tmp_path / "tab.yaml"
    p.write_text("server:\n\thttp_url: a\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 2, column 1"):
        load_config(p)


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"cannot read config file {p}: No such file or directory"


def test_unreadable_file_is_a_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"cannot read config file {tmp_path}: Is a directory"


def test_errors_are_one_line_without_traceback_chain(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "a: [\n"))
    assert "\n" not in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_load_config_accepts_str_path(tmp_path):
    p = write(tmp_path, "defaults: {p99_target_ms: 42}\n")
    assert load_config(str(p)).defaults.p99_target_ms == 42.0


# =====================================================================================
# auth headers from the environment
# =====================================================================================

def test_auth_headers_none_configured(monkeypatch):
    monkeypatch.setenv("TRITON_ADMIN_KEY", "secret")
    assert ServerConfig().auth_headers() == {}


def test_auth_headers_reads_env(monkeypatch):
    monkeypatch.setenv("MY_ADMIN_KEY", "s3cret")
    cfg = parse_config({"server": {"auth_header": "admin-key", "auth_key_env": "MY_ADMIN_KEY"}})
    assert cfg.server.auth_headers() == {"admin-key": "s3cret"}


def test_auth_headers_default_env_var(monkeypatch):
    monkeypatch.setenv("TRITON_ADMIN_KEY", "k")
    assert ServerConfig(auth_header="admin-key").auth_headers() == {"admin-key": "k"}


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_auth_headers_error_when_env_empty(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("MY_ADMIN_KEY", raising=False)
    else:
        monkeypatch.setenv("MY_ADMIN_KEY", value)
    server = ServerConfig(auth_header="admin-key", auth_key_env="MY_ADMIN_KEY")
    with pytest.raises(ConfigError) as e:
        server.auth_headers()
    assert str(e.value) == "server.auth_header is set but the environment variable MY_ADMIN_KEY is empty"


def test_auth_key_is_read_when_asked_not_at_load(monkeypatch, tmp_path):
    # loading the file must not need the secret (so `status` or a dry check can run without it)
    monkeypatch.delenv("MY_ADMIN_KEY", raising=False)
    cfg = load_config(write(tmp_path, "server: {auth_header: admin-key, auth_key_env: MY_ADMIN_KEY}\n"))
    monkeypatch.setenv("MY_ADMIN_KEY", "later")
    assert cfg.server.auth_headers() == {"admin-key": "later"}
