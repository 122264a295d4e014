"""GPU signals behind one small interface, so no decision ever depends on NVML existing.

`GpuSource.read()` returns one `GpuObservation` per device, `()` when there are no
devices to report, or `None` when a read failed ("no data"). It never raises.

* `NvmlSource`: NVML through `pynvml` (package `nvidia-ml-py`). Construction raises
  `GpuUnavailable` when the library or the driver is missing.
* `NullSource`: always `()` (CPU-only machines).
* `FakeGpuSource`: a scripted sequence for tests.
* `SimulatedDeviceSource`: the SIMULATED device of the `sim_accel` model (machines without a GPU),
  fed each tick with the scraped model metrics.
* `open_gpu_source(mode)`: picks one ("auto" falls back to `NullSource` with one info line).
"""
from __future__ import annotations

import importlib
import logging
import re
import time
from collections.abc import Iterable
from types import ModuleType
from typing import Any, Protocol, Union, runtime_checkable

from controller.types import GpuObservation

log = logging.getLogger("controller.gpu")

Reading = Union[tuple[GpuObservation, ...], None]


class GpuUnavailable(RuntimeError):
    """NVML cannot be used here (library absent, no driver, init failed)."""


@runtime_checkable
class GpuSource(Protocol):
    def read(self) -> tuple[GpuObservation, ...] | None:
        """One observation per device; `()` for no devices; `None` for "no data"."""
        ...


class NullSource:
    """No GPU: nothing to report, which is not a failure."""

    def read(self) -> tuple[GpuObservation, ...]:
        return ()


class FakeGpuSource:
    """Replays scripted readings; an `Exception` in the script is raised by that `read`.

    After the script runs out the last entry repeats (an empty script reads `()`).
    `calls` counts the reads.
    """

    def __init__(self, script: Iterable[Reading | BaseException]) -> None:
        self.script = list(script)
        self.calls = 0

    def read(self) -> tuple[GpuObservation, ...] | None:
        self.calls += 1
        if not self.script:
            return ()
        item = self.script[min(self.calls, len(self.script)) - 1]
        if isinstance(item, BaseException):
            raise item
        return item


SIM_MEMORY_METRIC = "sim_device_memory_bytes"
SIM_BUSY_METRIC = "sim_device_busy_us_total"   # slot-holding time, summed over the device's instances
SIM_GPU_MEMORY = re.compile(r"sim_gpu(\d+)_memory_bytes")
SIM_GPU_BUSY = re.compile(r"sim_gpu(\d+)_busy_us(?:_total)?")


class SimulatedDeviceSource:
    """The SIMULATED device of `sim_accel`-style models, as a `GpuSource`.

    Its memory in use is what the models' instances report in `sim_device_memory_bytes` (each
    instance holds its buffer); its size is configured. `feed()` gives it each tick's scrape
    (`{model: counters with a .custom dict}`, or None when the scrape failed). Only models that
    report simulated memory live on it (`hosts`). Example: two models reporting 128 MiB and 64 MiB
    on a 2048 MiB device read as one device with 192 MiB used of 2048 MiB.

    Its utilisation is the share of its slots' time in use between two feeds (the models' busy
    counters over elapsed time x `slots`): 1.5 s of slot time in 1 s on a 2-slot device is 75%. A
    counter that went down (an instance unloaded) gives no reading that tick.

    Several SIMULATED GPUs: models whose instances sit on simulated GPU k (a `*_simgpu<k>` instance group,
    see model_repository/sim_accel) also report `sim_gpu<k>_memory_bytes` and `sim_gpu<k>_busy_us_total`;
    then each k is a device of its own (index k, `total_mb` each), with its own utilisation.
    """

    def __init__(self, total_mb: float, clock=time.monotonic) -> None:
        self.total_bytes = int(total_mb * 2**20)
        self._scraped: Any = None
        self._clock = clock
        self._busy: tuple[float, dict[int, float]] | None = None     # (time, slot-us per device) at the last feed
        self._util: dict[int, float] = {}

    def feed(self, scraped: Any, now: float | None = None, slots: int | None = None) -> None:
        self._scraped = scraped
        self._util = {}
        if scraped is None:
            return
        now = self._clock() if now is None else now
        busy = self._per_gpu(scraped, SIM_GPU_BUSY) or {
            0: float(sum(c.custom.get(SIM_BUSY_METRIC, 0.0) for c in scraped.values() if self.hosts(c)))}
        if self._busy is not None and now > self._busy[0]:
            t0, before = self._busy
            per_s = 1e6 * (now - t0) * max(1, slots or 1)
            self._util = {k: min(100.0, 100.0 * (v - before[k]) / per_s)
                          for k, v in busy.items() if k in before and v >= before[k]}
        self._busy = (now, busy)

    @staticmethod
    def _per_gpu(scraped: Any, pattern: re.Pattern) -> dict[int, float]:
        out: dict[int, float] = {}
        for c in scraped.values():
            for key, value in getattr(c, "custom", {}).items():
                m = pattern.fullmatch(key)
                if m:
                    out[int(m.group(1))] = out.get(int(m.group(1)), 0.0) + value
        return out

    def hosts(self, counters: Any) -> bool:
        return counters is not None and SIM_MEMORY_METRIC in getattr(counters, "custom", {})

    def read(self) -> tuple[GpuObservation, ...] | None:
        if self._scraped is None:
            return None
        per_gpu = self._per_gpu(self._scraped, SIM_GPU_MEMORY)
        if per_gpu:
            return tuple(GpuObservation(index=k, utilization_pct=self._util.get(k), memory_used_bytes=int(per_gpu[k]),
                                        memory_total_bytes=self.total_bytes) for k in sorted(per_gpu))
        used = [c.custom[SIM_MEMORY_METRIC] for c in self._scraped.values() if self.hosts(c)]
        if not used:
            return ()
        return (GpuObservation(index=0, utilization_pct=self._util.get(0), memory_used_bytes=int(sum(used)),
                               memory_total_bytes=self.total_bytes),)


def _import_pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as error:
        raise GpuUnavailable(f"pynvml not installed: {error}") from error


def _optional(pynvml: ModuleType, call: Any, *args: Any) -> Any:
    """`call(*args)`, or None when NVML says the query is not supported on this device (MIG, old cards)."""
    not_supported = getattr(pynvml, "NVMLError_NotSupported", None)
    try:
        return call(*args)
    except Exception as error:  # noqa: BLE001
        if not_supported is not None and isinstance(error, not_supported):
            return None
        raise


def _process_memory(pynvml: ModuleType, handle: Any) -> tuple[tuple[int, int], ...]:
    """(pid, used bytes) per compute process; () where NVML cannot say (containers, MIG, old drivers)."""
    try:
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001  why: per-process memory is a nice-to-have, never a failed read
        return ()
    pairs = []
    for process in processes or ():
        pid, used = getattr(process, "pid", None), getattr(process, "usedGpuMemory", None)
        if isinstance(pid, int) and isinstance(used, int) and used >= 0:
            pairs.append((pid, used))
    return tuple(pairs)


def _read_device(pynvml: ModuleType, index: int) -> GpuObservation:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    utilization = _optional(pynvml, pynvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _optional(pynvml, pynvml.nvmlDeviceGetMemoryInfo, handle)
    return GpuObservation(
        index=index,
        utilization_pct=float(utilization.gpu) if utilization is not None else None,
        memory_used_bytes=int(memory.used) if memory is not None else None,
        memory_total_bytes=int(memory.total) if memory is not None else None,
        process_memory_bytes=_process_memory(pynvml, handle),
    )


class NvmlSource:
    """NVML readings. `nvmlInit` runs once here; `GpuUnavailable` if it cannot.

    A read that raises returns None and is retried at most once within the same call
    (after re-running `nvmlInit`), so a broken driver costs two attempts per call, never a
    spin. The first failure of a streak logs one warning; the first success after logs info.
    """

    def __init__(self, pynvml: ModuleType | None = None) -> None:
        self._nvml = pynvml if pynvml is not None else _import_pynvml()
        try:
            self._nvml.nvmlInit()
        except Exception as error:  # noqa: BLE001  why: NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise GpuUnavailable(f"nvmlInit failed: {error}") from error
        self._failing = False

    def _read_all(self) -> tuple[GpuObservation, ...]:
        count = int(self._nvml.nvmlDeviceGetCount())
        return tuple(_read_device(self._nvml, i) for i in range(count))

    def read(self) -> tuple[GpuObservation, ...] | None:
        try:
            result = self._read_all()
        except Exception as first_error:  # noqa: BLE001
            result = self._retry_once(first_error)
            if result is None:
                return None
        if self._failing:
            log.info("NVML reads recovered")
            self._failing = False
        return result

    def _retry_once(self, first_error: Exception) -> tuple[GpuObservation, ...] | None:
        try:
            self._nvml.nvmlInit()  # why: a driver reset can invalidate the old session
            return self._read_all()
        except Exception:  # noqa: BLE001
            if not self._failing:
                log.warning("NVML read failed (%s); GPU signals are no data until it recovers", first_error)
            self._failing = True
            return None

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001  why: shutting down a broken NVML must not fail the caller
            pass


def open_gpu_source(mode: str = "auto") -> GpuSource:
    """"auto": NVML if it works, else `NullSource` and one info line; "nvml": NVML or
    `GpuUnavailable`; "none": `NullSource`."""
    if mode == "none":
        return NullSource()
    if mode == "nvml":
        return NvmlSource()
    if mode == "auto":
        try:
            return NvmlSource()
        except GpuUnavailable as error:
            log.info("NVML not available (%s); using CPU signals only", error)
            return NullSource()
    raise ValueError(f"gpu mode must be one of 'auto', 'nvml', 'none'; got {mode!r}")


__all__ = ["GpuSource", "GpuUnavailable", "NvmlSource", "NullSource", "FakeGpuSource", "SimulatedDeviceSource",
           "SIM_MEMORY_METRIC", "open_gpu_source"]
