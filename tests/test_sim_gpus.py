"""The SIMULATED device source with several simulated GPUs (controller/gpu.py): pure, no server."""
from __future__ import annotations

from types import SimpleNamespace

from controller.gpu import SimulatedDeviceSource

MiB = 2**20


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def scrape(**models):
    return {m: SimpleNamespace(custom=dict(c)) for m, c in models.items()}


def test_one_device_without_simulated_gpus():
    src = SimulatedDeviceSource(1024)
    src.feed(scrape(a={"sim_device_memory_bytes": 64 * MiB}, b={"sim_device_memory_bytes": 128 * MiB}))
    (dev,) = src.read()
    assert dev.index == 0 and dev.memory_used_bytes == 192 * MiB and dev.memory_total_bytes == 1024 * MiB


def test_one_device_per_simulated_gpu_with_utilisation():
    clock = Clock()
    src = SimulatedDeviceSource(1024, clock=clock)
    first = {"sim_device_memory_bytes": 192 * MiB, "sim_gpu0_memory_bytes": 64 * MiB, "sim_gpu1_memory_bytes": 128 * MiB,
             "sim_gpu0_busy_us_total": 0.0, "sim_gpu1_busy_us_total": 0.0}
    src.feed(scrape(m=first, other={"sim_gpu1_memory_bytes": 64 * MiB, "sim_gpu1_busy_us_total": 0.0}))
    devices = src.read()
    assert [(d.index, d.memory_used_bytes // MiB, d.utilization_pct) for d in devices] == [(0, 64, None), (1, 192, None)]
    clock.t += 2.0
    src.feed(scrape(m={**first, "sim_gpu0_busy_us_total": 0.5e6, "sim_gpu1_busy_us_total": 1.5e6},
                    other={"sim_gpu1_memory_bytes": 64 * MiB, "sim_gpu1_busy_us_total": 0.4e6}))
    assert [d.utilization_pct for d in src.read()] == [25.0, 95.0]
    clock.t += 1.0
    src.feed(None)                     # a failed scrape: no data, and the next rate spans the gap
    assert src.read() is None


def test_one_device_utilisation_is_slot_time_over_its_slots_and_a_reset_gives_no_reading():
    src = SimulatedDeviceSource(1024)
    mem = {"sim_device_memory_bytes": 64 * MiB}
    src.feed(scrape(a={**mem, "sim_device_busy_us_total": 1e6}, b={**mem, "sim_device_busy_us_total": 0.0}), 10.0, 2)
    assert src.read()[0].utilization_pct is None                     # one feed: no rate yet
    src.feed(scrape(a={**mem, "sim_device_busy_us_total": 2e6}, b={**mem, "sim_device_busy_us_total": 0.5e6}), 11.0, 2)
    assert src.read()[0].utilization_pct == 75.0                      # 1.5 s of slot time in 1 s on 2 slots
    src.feed(scrape(a={**mem, "sim_device_busy_us_total": 0.1e6}), 12.0, 2)   # an instance unloaded: counter went down
    assert src.read()[0].utilization_pct is None
    src.feed(scrape(a={**mem, "sim_device_busy_us_total": 9e6}), 13.0, 2)
    assert src.read()[0].utilization_pct == 100.0                     # capped
