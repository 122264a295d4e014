"""Instance groups across devices (controller/groups.py) and their use by actuation: pure, no server."""
from __future__ import annotations

import copy

import pytest

from controller import groups as G
from controller.actuation import ActuationError, settings_of, with_settings
from controller.types import Settings


def cfg(*groups, **extra) -> dict:
    return {"name": "m", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": "0"},
            "instance_group": [dict(g) for g in groups], **extra}


EIGHT = list(range(8))


# ---- reading --------------------------------------------------------------------------------------

def test_one_cpu_group_is_its_count():
    c = cfg({"count": 3, "kind": "KIND_CPU"})
    assert G.instances_per_device(c) == {"cpu": 3}
    assert G.total_instances(c) == 3 and G.min_total(c) == 1


def test_one_gpu_explicit():
    c = cfg({"count": 2, "kind": "KIND_GPU", "gpus": [0]})
    assert G.instances_per_device(c) == {"gpu0": 2}


def test_count_is_per_listed_gpu():
    c = cfg({"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]})
    assert G.instances_per_device(c) == {"gpu0": 2, "gpu1": 2}
    assert G.total_instances(c) == 4 and G.min_total(c) == 2


def test_gpus_left_out_means_every_visible_gpu():
    c = cfg({"count": 2, "kind": "KIND_GPU"})
    assert G.total_instances(c, visible_gpus=EIGHT) == 16
    assert G.instances_per_device(c, visible_gpus=EIGHT) == {f"gpu{k}": 2 for k in range(8)}
    assert G.instances_per_device(c, visible_gpus=[0, 1]) == {"gpu0": 2, "gpu1": 2}
    # unknown GPUs (a file read without the server): one "gpu" device with the per-GPU count
    assert G.instances_per_device(c) == {"gpu": 2}


def test_auto_kind_follows_the_visible_gpus():
    c = cfg({"count": 1})
    assert G.instances_per_device(c, visible_gpus=[]) == {"cpu": 1}
    assert G.instances_per_device(c, visible_gpus=[0, 1]) == {"gpu0": 1, "gpu1": 1}


def test_several_groups_pinning_different_gpus():
    c = cfg({"name": "a", "count": 1, "kind": "KIND_GPU", "gpus": [0]},
            {"name": "b", "count": 3, "kind": "KIND_GPU", "gpus": [1, 2]})
    assert G.instances_per_device(c) == {"gpu0": 1, "gpu1": 3, "gpu2": 3}
    assert G.total_instances(c) == 7


def test_passive_groups_are_not_counted():
    c = cfg({"count": 2, "kind": "KIND_GPU", "gpus": [0]},
            {"count": 4, "kind": "KIND_GPU", "gpus": [1], "passive": True})
    assert G.instances_per_device(c) == {"gpu0": 2}
    assert G.instances_per_device(c, passive=True) == {"gpu1": 4}
    assert settings_of(c).instance_count == 2


def test_cpu_and_model_kinds_are_not_per_gpu():
    c = cfg({"count": 2, "kind": "KIND_MODEL"}, {"count": 1, "kind": "KIND_CPU"})
    assert G.instances_per_device(c, visible_gpus=EIGHT) == {"model": 2, "cpu": 1}


# ---- changing ---------------------------------------------------------------------------------------

def test_single_group_count_becomes_the_total():
    c = cfg({"count": 1, "kind": "KIND_CPU"})
    assert G.with_total(c, 4)["instance_group"] == [{"count": 4, "kind": "KIND_CPU"}]
    assert G.with_total(G.with_total(c, 4), 2)["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert c["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]     # the input is not touched


def test_no_instance_group_gets_one():
    assert G.with_total({"name": "m"}, 3)["instance_group"] == [{"count": 3}]


def test_one_gpu_count_changes_in_its_group():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0]})
    assert G.with_total(c, 3)["instance_group"] == [{"name": "m_0", "count": 3, "kind": "KIND_GPU", "gpus": [0]}]


def test_two_gpus_add_on_the_preferred_gpu_splits_the_group():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    new = G.with_total(c, 3, prefer=["gpu1", "gpu0"])
    assert G.instances_per_device(new) == {"gpu0": 1, "gpu1": 2}
    assert new["instance_group"] == [{"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0]},
                                     {"name": "m_0_gpu1", "count": 2, "kind": "KIND_GPU", "gpus": [1]}]


def test_two_gpus_balanced_without_preference_and_merged_back():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    three = G.with_total(c, 3)
    assert G.instances_per_device(three) == {"gpu0": 2, "gpu1": 1}   # the fewest first; ties: the order written
    four = G.with_total(three, 4)
    assert four["instance_group"] == [{"name": "m_0", "count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}]
    assert G.with_total(four, 2)["instance_group"] == c["instance_group"]


def test_two_gpus_without_explicit_gpus_written_out_when_split():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU"})
    new = G.with_total(c, 3, prefer=["gpu1"], visible_gpus=[0, 1])
    assert G.instances_per_device(new, visible_gpus=[0, 1]) == {"gpu0": 1, "gpu1": 2}
    assert [g.get("gpus") for g in new["instance_group"]] == [[0], [1]]


def test_eight_gpus_without_gpus_one_more_on_gpu5():
    c = cfg({"name": "m_0", "count": 2, "kind": "KIND_GPU"})
    new = G.with_total(c, 17, prefer=["gpu5"], visible_gpus=EIGHT)
    per = G.instances_per_device(new, visible_gpus=EIGHT)
    assert per == {**{f"gpu{k}": 2 for k in range(8)}, "gpu5": 3}
    assert new["instance_group"][0]["gpus"] == [0, 1, 2, 3, 4, 6, 7]
    assert new["instance_group"][1] == {"name": "m_0_gpu5", "count": 3, "kind": "KIND_GPU", "gpus": [5]}
    back = G.with_total(new, 16, visible_gpus=EIGHT)
    assert back["instance_group"] == [{"name": "m_0", "count": 2, "kind": "KIND_GPU", "gpus": EIGHT}]


def test_eight_gpus_explicit_scale_down_keeps_one_per_gpu():
    c = cfg({"name": "m_0", "count": 2, "kind": "KIND_GPU", "gpus": EIGHT})
    assert G.min_total(c) == 8
    eight = G.with_total(c, 8)
    assert eight["instance_group"] == [{"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": EIGHT}]
    with pytest.raises(G.GroupError, match="8 devices"):
        G.with_total(c, 7)


def test_pinned_groups_change_on_their_own_gpu_and_passive_untouched():
    passive = {"name": "p", "count": 4, "kind": "KIND_GPU", "gpus": [0], "passive": True}
    c = cfg({"name": "a", "count": 1, "kind": "KIND_GPU", "gpus": [0]},
            {"name": "b", "count": 1, "kind": "KIND_GPU", "gpus": [1]}, passive)
    new = G.with_total(c, 4, prefer=["gpu1"])
    assert new["instance_group"] == [{"name": "a", "count": 1, "kind": "KIND_GPU", "gpus": [0]},
                                     {"name": "b", "count": 3, "kind": "KIND_GPU", "gpus": [1]}, passive]
    down = G.with_total(new, 2, prefer=["gpu1"])
    assert G.instances_per_device(down) == {"gpu0": 1, "gpu1": 1}
    assert down["instance_group"][2] == passive


def test_remove_prefers_a_plain_count_change_over_dropping_a_group():
    c = cfg({"name": "a", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},
            {"name": "b", "count": 2, "kind": "KIND_GPU", "gpus": [1]})
    new = G.remove_one(c, "gpu1")
    assert new["instance_group"][0] == c["instance_group"][0]
    assert new["instance_group"][1]["count"] == 1
    newer = G.remove_one(new, "gpu1")      # b has one left: the group goes, a still covers GPU 1
    assert newer["instance_group"] == [c["instance_group"][0]]
    with pytest.raises(G.GroupError):
        G.remove_one(newer, "gpu1")


def test_add_only_on_devices_the_groups_use():
    c = cfg({"count": 1, "kind": "KIND_GPU", "gpus": [0]})
    with pytest.raises(G.GroupError):
        G.add_one(c, "gpu3")
    assert G.instances_per_device(G.with_total(c, 2, prefer=["gpu3"])) == {"gpu0": 2}


def test_only_passive_groups_are_left_alone():
    c = cfg({"count": 1, "kind": "KIND_CPU", "passive": True})
    with pytest.raises(G.GroupError, match="passive"):
        G.with_total(c, 2)


def test_other_group_fields_are_kept():
    g = {"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1], "rate_limiter": {"priority": 2},
         "host_policy": "", "secondary_devices": [], "profile": ["p"]}
    new = G.with_total(cfg(g), 3, prefer=["gpu1"])
    for group in new["instance_group"]:
        assert group["rate_limiter"] == {"priority": 2} and group["profile"] == ["p"]


def test_preference_by_utilisation_then_instances():
    per = {"gpu0": 2, "gpu1": 2, "gpu2": 1}
    assert G.preference(per) == ["gpu2", "gpu0", "gpu1"]
    assert G.preference(per, {"gpu0": 95.0, "gpu1": 12.0, "gpu2": 91.0}) == ["gpu1", "gpu2", "gpu0"]
    assert G.preference(per, {"gpu0": 11.0, "gpu1": 19.0, "gpu2": None})[0] == "gpu2"   # unknown counts as idle


def test_adds_stop_on_a_device_without_memory_room():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    # gpu0 is preferred (idle) but has no room; gpu1 has room for 2: both new instances go to gpu1
    new = G.with_total(c, 4, prefer=["gpu0", "gpu1"], room={"gpu0": 0, "gpu1": 2})
    assert G.instances_per_device(new) == {"gpu0": 1, "gpu1": 3}
    # room for one on each: the preferred first, then the other, not two on the preferred
    new = G.with_total(c, 4, prefer=["gpu0", "gpu1"], room={"gpu0": 1, "gpu1": 1})
    assert G.instances_per_device(new) == {"gpu0": 2, "gpu1": 2}
    assert sum(G.instances_per_device(G.with_total(c, 5, room={"gpu0": 1, "gpu1": 2})).values()) == 5
    with pytest.raises(G.GroupError, match="no room for 6 instance"):
        G.with_total(c, 6, room={"gpu0": 1, "gpu1": 2})
    # removing is not limited by room (a device over its budget gives first when least preferred)
    four = G.with_total(c, 4, prefer=["gpu1"])
    assert sum(G.instances_per_device(G.with_total(four, 3, prefer=["gpu1", "gpu0"], room={"gpu0": -1})).values()) == 3


def test_preference_puts_devices_without_room_last():
    per = {"gpu0": 1, "gpu1": 3, "gpu2": 1}
    assert G.preference(per, {"gpu0": 5.0, "gpu1": 50.0, "gpu2": 5.0}, room={"gpu0": 0, "gpu1": 2, "gpu2": -1}) \
        == ["gpu1", "gpu0", "gpu2"]


def test_with_settings_passes_room_to_the_groups():
    c = cfg({"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    new = with_settings(c, Settings(3, 0), prefer=["gpu0"], room={"gpu0": 0})
    assert G.instances_per_device(new) == {"gpu0": 1, "gpu1": 2}


# ---- actuation keeps its single-group behaviour -----------------------------------------------------------

def test_with_settings_single_group_unchanged():
    c = cfg({"count": 1, "kind": "KIND_CPU"})
    new = with_settings(c, Settings(3, 500))
    assert new["instance_group"] == [{"count": 3, "kind": "KIND_CPU"}]
    assert new["dynamic_batching"]["max_queue_delay_microseconds"] == "500"
    assert settings_of(new) == Settings(3, 500)


def test_with_settings_multi_gpu_and_refusal():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    new = with_settings(c, Settings(3, 0), prefer=["gpu1"])
    assert G.instances_per_device(new) == {"gpu0": 1, "gpu1": 2}
    with pytest.raises(ActuationError, match="2 devices"):
        with_settings(c, Settings(1, 0))


def test_with_settings_does_not_touch_the_input():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    before = copy.deepcopy(c)
    with_settings(c, Settings(5, 100))
    assert c == before


# ---- SIMULATED GPUs (model_repository/sim_accel: a KIND_CPU group named *_simgpu<k>) ----------------------

def test_simulated_gpu_groups_read_as_gpus():
    # (the simulator needs host_policy "simgpu<k>" on such a group; a count change keeps it)
    c = cfg({"name": "sim_simgpu0", "count": 1, "kind": "KIND_CPU", "host_policy": "simgpu0"},
            {"name": "sim_simgpu1", "count": 2, "kind": "KIND_CPU", "host_policy": "simgpu1"})
    assert G.instances_per_device(c) == {"gpu0": 1, "gpu1": 2}
    new = G.with_total(c, 4, prefer=["gpu0"])
    assert new["instance_group"] == [{"name": "sim_simgpu0", "count": 2, "kind": "KIND_CPU", "host_policy": "simgpu0"},
                                     {"name": "sim_simgpu1", "count": 2, "kind": "KIND_CPU", "host_policy": "simgpu1"}]
    assert G.min_total(c) == 2
