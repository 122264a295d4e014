"""GPU sources: NVML through a fake `pynvml` module, the fallbacks, and the test double."""
from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass

import pytest

from controller.gpu import FakeGpuSource, GpuSource, GpuUnavailable, NullSource, NvmlSource, open_gpu_source
from controller.types import GpuObservation

GIB = 1 << 30


@dataclass
class _Util:
    gpu: int
    memory: int = 0


@dataclass
class _Mem:
    used: int
    total: int
    free: int = 0


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815  (NVML's spelling)


class _FakeNvml:
    """Just enough of pynvml: per-device readings, switchable failures, call counts."""

    def __init__(self, devices: list[dict], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.fail_reads = 0          # how many upcoming nvmlDeviceGetCount calls raise
        self.init_calls = 0
        self.count_calls = 0
        module = types.ModuleType("pynvml")

        class NVMLError(Exception):
            pass

        class NVMLError_NotSupported(NVMLError):  # noqa: N801
            pass

        module.NVMLError = NVMLError
        module.NVMLError_NotSupported = NVMLError_NotSupported
        module.nvmlInit = self._init
        module.nvmlShutdown = lambda: None
        module.nvmlDeviceGetCount = self._count
        module.nvmlDeviceGetHandleByIndex = lambda i: self.devices[i]
        module.nvmlDeviceGetUtilizationRates = lambda h: self._field(h, "util")
        module.nvmlDeviceGetMemoryInfo = lambda h: self._field(h, "mem")
        module.nvmlDeviceGetComputeRunningProcesses = lambda h: self._field(h, "procs")
        self.module = module

    def _init(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def _count(self) -> int:
        self.count_calls += 1
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise self.module.NVMLError("GPU is lost")
        return len(self.devices)

    def _field(self, handle: dict, key: str):
        value = handle[key]
        if value == "not_supported":
            raise self.module.NVMLError_NotSupported("Not Supported")
        if isinstance(value, Exception):
            raise value
        return value


def _two_devices() -> list[dict]:
    return [
        {"util": _Util(gpu=37), "mem": _Mem(used=3 * GIB, total=80 * GIB),
         "procs": [_Proc(pid=101, usedGpuMemory=GIB), _Proc(pid=102, usedGpuMemory=None)]},
        {"util": _Util(gpu=0), "mem": _Mem(used=0, total=80 * GIB), "procs": []},
    ]


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> _FakeNvml:
    fake = _FakeNvml(_two_devices())
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    return fake


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "controller.gpu" and r.levelno == level]


# -- absent NVML -------------------------------------------------------------------

def test_auto_without_pynvml_gives_null_source_and_exactly_one_info_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    caplog.set_level(logging.DEBUG, logger="controller.gpu")
    source = open_gpu_source("auto")
    assert isinstance(source, NullSource)
    assert source.read() == ()
    lines = [r for r in caplog.records if r.name == "controller.gpu"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "NVML not available" in lines[0].getMessage()
    assert "using CPU signals only" in lines[0].getMessage()


def test_auto_when_nvml_init_fails_gives_null_source(monkeypatch, caplog):
    fake = _FakeNvml([], init_error=RuntimeError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    caplog.set_level(logging.DEBUG, logger="controller.gpu")
    assert isinstance(open_gpu_source("auto"), NullSource)
    lines = [r.getMessage() for r in caplog.records if r.name == "controller.gpu"]
    assert len(lines) == 1 and "Shared Library Not Found" in lines[0]


def test_mode_nvml_raises_when_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuUnavailable, match="pynvml not installed"):
        open_gpu_source("nvml")


def test_mode_nvml_raises_when_init_fails(monkeypatch):
    fake = _FakeNvml([], init_error=RuntimeError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    with pytest.raises(GpuUnavailable, match="Driver Not Loaded"):
        open_gpu_source("nvml")


def test_mode_none_never_touches_nvml(fake_nvml, caplog):
    caplog.set_level(logging.DEBUG, logger="controller.gpu")
    assert isinstance(open_gpu_source("none"), NullSource)
    assert fake_nvml.init_calls == 0
    assert caplog.records == []


def test_unknown_mode_says_the_valid_ones():
    with pytest.raises(ValueError, match="'auto', 'nvml', 'none'"):
        open_gpu_source("cuda")


def test_this_machine_auto_gives_a_working_source():
    # No GPU here: auto must fall back quietly; on a GPU machine it must read devices.
    source = open_gpu_source("auto")
    reading = source.read()
    assert isinstance(source, GpuSource)
    assert reading is None or all(isinstance(g, GpuObservation) for g in reading)


# -- good readings -------------------------------------------------------------------

def test_good_readings_map_to_gpu_observations(fake_nvml):
    source = open_gpu_source("auto")
    assert isinstance(source, NvmlSource)
    assert source.read() == (
        GpuObservation(index=0, utilization_pct=37.0, memory_used_bytes=3 * GIB, memory_total_bytes=80 * GIB,
                       process_memory_bytes=((101, GIB),)),  # pid 102's usage is unknown: left out
        GpuObservation(index=1, utilization_pct=0.0, memory_used_bytes=0, memory_total_bytes=80 * GIB,
                       process_memory_bytes=()),
    )
    assert fake_nvml.init_calls == 1  # once, at construction


def test_unsupported_query_is_none_not_a_failed_read(fake_nvml):
    fake_nvml.devices[0]["util"] = "not_supported"      # e.g. a MIG slice
    fake_nvml.devices[1]["procs"] = RuntimeError("no permission")
    reading = NvmlSource().read()
    assert reading is not None
    assert reading[0].utilization_pct is None
    assert reading[0].memory_used_bytes == 3 * GIB
    assert reading[1].process_memory_bytes == ()


def test_no_devices_reads_empty_tuple(monkeypatch):
    fake = _FakeNvml([])
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    assert NvmlSource().read() == ()


# -- failures mid-run ------------------------------------------------------------------

def test_read_failing_mid_run_returns_none_logs_once_and_recovers(fake_nvml, caplog):
    caplog.set_level(logging.DEBUG, logger="controller.gpu")
    source = NvmlSource()
    assert source.read() is not None
    fake_nvml.fail_reads = 10**6
    before = fake_nvml.count_calls
    results = [source.read() for _ in range(3)]
    assert results == [None, None, None]
    assert fake_nvml.count_calls - before == 6          # one try + one retry per call, no spin
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "GPU is lost" in warnings[0].getMessage()

    fake_nvml.fail_reads = 0
    assert source.read() is not None and len(source.read()) == 2
    assert len(_records(caplog, logging.INFO)) == 1     # "recovered", once
    fake_nvml.fail_reads = 10**6
    assert source.read() is None
    assert len(_records(caplog, logging.WARNING)) == 2  # a new streak logs again


def test_one_transient_failure_is_absorbed_by_the_single_retry(fake_nvml, caplog):
    caplog.set_level(logging.DEBUG, logger="controller.gpu")
    source = NvmlSource()
    fake_nvml.fail_reads = 1
    reading = source.read()
    assert reading is not None and reading[0].utilization_pct == 37.0
    assert fake_nvml.init_calls == 2                    # the retry re-initialised NVML
    assert _records(caplog, logging.WARNING) == []


# -- test double -------------------------------------------------------------------------

def test_fake_source_replays_script_then_repeats_last():
    gpu = GpuObservation(index=0, utilization_pct=50.0, memory_used_bytes=1, memory_total_bytes=2)
    source = FakeGpuSource([(gpu,), None, RuntimeError("boom"), ()])
    assert source.read() == (gpu,)
    assert source.read() is None
    with pytest.raises(RuntimeError, match="boom"):
        source.read()
    assert source.read() == ()
    assert source.read() == ()
    assert source.calls == 5
    assert FakeGpuSource([]).read() == ()


def test_all_sources_satisfy_the_protocol(fake_nvml):
    for source in (NullSource(), FakeGpuSource([]), NvmlSource()):
        assert isinstance(source, GpuSource)
