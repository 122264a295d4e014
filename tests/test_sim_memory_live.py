"""The SIMULATED device's memory reading after reloads, against the real server: what the controller's
memory budget rests on. A full reload starts new stubs with the same instance names before the old ones
finalize, and an in-place scale-up can start a stub with a live instance's name; each stub's memory must
count once. With two simulated GPUs, each GPU's reading must follow its own group's count through in-place
updates (the groups' host policies keep Triton from moving an instance between them)."""
from __future__ import annotations

import copy
import time

import pytest
from conftest import sim_copy, sim_gpu_memory_mib, start_server

from controller import groups
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


def _two_gpu_repo(tmp_path):
    sim_copy(tmp_path, "sim2", {"{ count: 1, kind: KIND_CPU }":
                                '{ name: "sim2_simgpu0", count: 1, kind: KIND_CPU, host_policy: "simgpu0" },\n'
                                '  { name: "sim2_simgpu1", count: 1, kind: KIND_CPU, host_policy: "simgpu1" }'})
    return tmp_path


@pytest.fixture(scope="module")
def two_gpu_server(tmp_path_factory):
    """A server with `sim2`: the simulated model with one group on each of two simulated GPUs."""
    s = start_server(["sim2"], repository=_two_gpu_repo(tmp_path_factory.mktemp("repo")))
    yield s
    s.stop()


def test_each_simulated_gpu_reports_its_own_groups_instances_through_in_place_updates(two_gpu_server):
    """Triton keeps a live instance wherever the new config has a group of the same signature, which ignores
    group names: without the groups' host policies 1+3 -> 1+1 kept two of gpu1's instances (one as gpu0's)
    and the reading was 0 / 128 MiB (the CI flake of the per-GPU budget test). Every step of a sequence
    that moves counts both ways must read 64 MiB per instance of each group, on its own GPU."""
    control = TritonControl(two_gpu_server.grpc_url, two_gpu_server.http_url)
    scraper = Scraper(two_gpu_server.metrics_url, two_gpu_server.http_url)
    for counts in [(1, 3), (1, 1), (3, 1), (1, 1), (2, 2), (1, 1)]:
        new = copy.deepcopy(control.config("sim2"))
        for group, n in zip(new["instance_group"], counts):
            group["count"] = n
        control.load("sim2", new)
        assert groups.instances_per_device(control.config("sim2")) == {"gpu0": counts[0], "gpu1": counts[1]}
        expected = {0: 64.0 * counts[0], 1: 64.0 * counts[1]}
        deadline, seen = time.monotonic() + 10.0, None
        while time.monotonic() < deadline and seen != expected:
            try:
                seen = sim_gpu_memory_mib(scraper)
            except RuntimeError:                       # a scrape that failed: read again
                pass
            time.sleep(0.3)
        assert seen == expected, (counts, seen)


def test_a_simulated_gpu_group_without_its_host_policy_does_not_load_and_says_why(two_gpu_server):
    control = TritonControl(two_gpu_server.grpc_url, two_gpu_server.http_url)
    bad = control.config("sim2")
    del bad["instance_group"][1]["host_policy"]
    bad["dynamic_batching"]["max_queue_delay_microseconds"] = "100"   # a full reload: new stubs read this config
    try:
        control.load("sim2", bad)
    except Exception as e:  # noqa: BLE001 - the client's error type differs by protocol
        message = str(e)
    else:
        message = ""
    assert 'needs host_policy: "simgpu1"' in message, message
    assert control.ready("sim2")                     # the version that was serving goes on serving
    assert control.config("sim2")["instance_group"][1]["host_policy"] == "simgpu1"
