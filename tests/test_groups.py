"""Instance groups across devices (controller/groups.py) and their use by actuation: pure, no server."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings, strategies as st

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


def loaded(old: dict, new: dict, visible_gpus=None) -> int:
    """The instances Triton 2.51 loads to go from `old` to `new` in place: it keeps a live instance where the
    new config has one of the same signature (the group's fields but `name` and `count`, with `gpus` as the
    server fills it in; and the device: core's TritonModelInstance::Signature) and loads the rest."""
    import json
    from collections import Counter

    def instances(c: dict) -> Counter:
        out: Counter = Counter()
        for v, g in zip(G.view(c, visible_gpus), G._groups(c)):
            if v.passive:
                continue
            sig = {k: x for k, x in g.items() if k not in ("name", "count")}
            if v.kind == G.KIND_GPU and "gpus" not in sig and visible_gpus is not None:
                sig["gpus"] = list(visible_gpus)
            for d in v.devices:
                out[(json.dumps(sig, sort_keys=True), d)] += v.count
        return out
    before, after = instances(old), instances(new)
    return sum(max(0, n - before[key]) for key, n in after.items())


def test_two_gpus_add_on_the_preferred_gpu_adds_an_extra_group_and_keeps_the_users():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    new = G.with_total(c, 3, prefer=["gpu1", "gpu0"])
    assert G.instances_per_device(new) == {"gpu0": 1, "gpu1": 2}
    assert new["instance_group"] == [{"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},
                                     {"name": "m_0_gpu1", "count": 1, "kind": "KIND_GPU", "gpus": [1]}]
    assert loaded(c, new) == 1           # rewriting m_0 to gpus [0] and a copy of 2 on [1] loaded 3


def test_two_gpus_balanced_without_preference_and_back_to_the_users_groups():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]})
    three = G.with_total(c, 3)
    assert G.instances_per_device(three) == {"gpu0": 2, "gpu1": 1}   # the fewest first; ties: the order written
    four = G.with_total(three, 4)
    assert four["instance_group"] == [{"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},
                                      {"name": "m_0_gpu0", "count": 1, "kind": "KIND_GPU", "gpus": [0]},
                                      {"name": "m_0_gpu1", "count": 1, "kind": "KIND_GPU", "gpus": [1]}]
    assert loaded(three, four) == 1
    two = G.with_total(four, 2)
    assert two["instance_group"] == c["instance_group"] and loaded(four, two) == 0


def test_two_gpus_without_explicit_gpus_the_users_group_stays_as_written():
    c = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU"})
    new = G.with_total(c, 3, prefer=["gpu1"], visible_gpus=[0, 1])
    assert G.instances_per_device(new, visible_gpus=[0, 1]) == {"gpu0": 1, "gpu1": 2}
    assert [g.get("gpus") for g in new["instance_group"]] == [None, [1]]
    assert loaded(c, new, visible_gpus=[0, 1]) == 1


def test_eight_gpus_without_gpus_one_more_on_gpu5_loads_one_instance():
    c = cfg({"name": "m_0", "count": 2, "kind": "KIND_GPU"})
    new = G.with_total(c, 17, prefer=["gpu5"], visible_gpus=EIGHT)
    per = G.instances_per_device(new, visible_gpus=EIGHT)
    assert per == {**{f"gpu{k}": 2 for k in range(8)}, "gpu5": 3}
    assert new["instance_group"] == [c["instance_group"][0],
                                     {"name": "m_0_gpu5", "count": 1, "kind": "KIND_GPU", "gpus": [5]}]
    assert loaded(c, new, visible_gpus=EIGHT) == 1                    # not 17 (16 unloaded) as before
    back = G.with_total(new, 16, visible_gpus=EIGHT)
    assert back["instance_group"] == c["instance_group"]


def test_below_the_users_layout_on_one_gpu_keeps_what_it_can():
    c = cfg({"name": "m_0", "count": 2, "kind": "KIND_GPU", "gpus": [0, 1, 2]})
    new = G.remove_one(c, "gpu1")
    assert G.instances_per_device(new) == {"gpu0": 2, "gpu1": 1, "gpu2": 2}
    assert loaded(c, new) == 2            # one on each other GPU; editing gpus would have loaded 5
    one = cfg({"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},
              {"name": "b", "count": 1, "kind": "KIND_GPU", "gpus": [1, 2]})
    fewer = G.remove_one(one, "gpu1")     # at count 1 gpu1 leaves a group's gpus: that group reloads
    assert G.instances_per_device(fewer) == {"gpu0": 1, "gpu1": 1, "gpu2": 1}


@settings(max_examples=200, deadline=None)
@given(gpus=st.lists(st.integers(0, 7), min_size=2, max_size=5, unique=True), count=st.integers(1, 3),
       pinned=st.integers(0, 3), steps=st.lists(st.tuples(st.integers(0, 12), st.permutations(range(8))),
                                                min_size=1, max_size=8))
def test_steps_at_or_above_the_users_layout_load_only_the_instances_they_add(gpus, count, pinned, steps):
    """From any layout the user wrote (a group over several GPUs, and one pinned to a GPU), any sequence of
    totals at or above it loads exactly the instances each step adds (none on the way down), and coming
    back to the layout's total gives the user's groups back."""
    groups = [{"name": "m_0", "count": count, "kind": "KIND_GPU", "gpus": gpus}]
    if pinned:
        groups.append({"name": "p", "count": pinned, "kind": "KIND_GPU", "gpus": [gpus[0]]})
    c = cfg(*groups)
    base = G.total_instances(c)
    now = c
    for extra, order in steps:
        nxt = G.with_total(now, base + extra, prefer=[f"gpu{k}" for k in order])
        assert G.total_instances(nxt) == base + extra
        assert loaded(now, nxt) == max(0, G.total_instances(nxt) - G.total_instances(now))
        now = nxt
    assert G.with_total(now, base)["instance_group"] == c["instance_group"]


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


@pytest.mark.parametrize("a, b, shared", [
    (["gpu0"], ["gpu1"], False),
    (["gpu0", "gpu1"], ["gpu1"], True),
    (["gpu10"], ["gpu1"], False),                 # gpu10 is not gpu1
    (["gpu"], ["gpu1"], True),                    # ids not known
    (["model"], ["gpu1"], True), (["auto"], ["gpu0"], True), (["cpu"], ["cpu"], True),
    ([], ["gpu0"], True),                         # placement not read yet
])
def test_models_apart_only_on_named_gpus_that_differ(a, b, shared):
    assert G.may_share_memory(a, b) is shared and G.may_share_memory(b, a) is shared
