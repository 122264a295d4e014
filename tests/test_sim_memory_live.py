"""The SIMULATED device's memory reading after reloads, against the real server: what the controller's
memory budget rests on. A full reload starts new stubs with the same instance names before the old ones
finalize, and an in-place scale-up can start a stub with a live instance's name; each stub's memory must
count once."""
from __future__ import annotations

import time

from conftest import start_server

from controller.actuation import Actuator, TritonControl
from controller.gpu import SIM_MEMORY_METRIC
from controller.signals import Scraper
from controller.types import Settings

MODEL = "sim_accel"
MiB = 2**20


def _settles_at(scraper: Scraper, expected: float, within_s: float = 15.0) -> float | None:
    """The memory reading once it equals `expected` (the old version of a full reload unloads, and its
    stubs finalize, a little after the load returns: until then old + new is what the device holds),
    else the last reading after `within_s`."""
    deadline = time.monotonic() + within_s
    value = None
    while time.monotonic() < deadline:
        counters = (scraper.metrics() or {}).get(MODEL)
        value = None if counters is None else counters.custom.get(SIM_MEMORY_METRIC)
        if value == expected:
            return value
        time.sleep(0.3)
    return value


def test_memory_follows_the_instances_through_in_place_and_full_reloads():
    server = start_server([MODEL])
    try:
        act = Actuator(TritonControl(server.grpc_url, server.http_url))
        scraper = Scraper(server.metrics_url, server.http_url)
        # 1 -> 2 with a delay (full): the old sim_accel_0_0's finalize used to zero the new one's series (seen:
        # 64 MiB for 2 instances, then 0; the controller then overran a shared memory budget)
        for settings in (Settings(1, 0), Settings(2, 8000), Settings(2, 0), Settings(2, 500), Settings(3, 0),
                         Settings(1, 2000), Settings(3, 0)):
            assert act.apply(MODEL, settings).ok
            expected = settings.instance_count * 64 * MiB
            assert _settles_at(scraper, expected) == expected, settings
    finally:
        server.stop()


def test_memory_after_an_in_place_scale_up_that_reuses_a_live_instance_name():
    """2 -> 1 removes sim_accel_0_0; 1 -> 3 then adds stubs named sim_accel_0_1 (again: the kept instance is
    sim_accel_0_1 too) and sim_accel_0_2. Keyed by instance name the two _0_1 stubs shared a series and the
    reading was 128 MiB for 3 instances (two_models_tight bench: a budget of 3 overrun to 4); each stub now
    has its own series (`stub` label)."""
    server = start_server([MODEL])
    try:
        act = Actuator(TritonControl(server.grpc_url, server.http_url))
        scraper = Scraper(server.metrics_url, server.http_url)
        for settings in (Settings(2, 0), Settings(1, 0), Settings(3, 0)):
            assert act.apply(MODEL, settings).ok
        assert _settles_at(scraper, 3 * 64 * MiB, within_s=8.0) == 3 * 64 * MiB
    finally:
        server.stop()
