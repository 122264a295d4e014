"""Instance groups as Triton reads them, and count changes that keep the groups the user wrote.

Pure functions on a ModelConfig JSON (`instance_group` list); no I/O.

Triton's semantics (model_config_utils.cc, NormalizeInstanceGroup; docs "Instance Groups"):

* `KIND_GPU`: `count` is instances **per GPU listed in `gpus`**; with `gpus` left out, per GPU the server
  sees (the live config then lists them all: the server fills `gpus` in). `{count: 2, kind: KIND_GPU}` on
  an 8-GPU server is 16 instances.
* `KIND_CPU` and `KIND_MODEL`: `count` is the number of instances (the model places KIND_MODEL ones itself).
* `KIND_AUTO` (or no kind): GPU where the server has GPUs, else CPU; the live config shows the kind chosen.
* `passive: true`: the instances are loaded but the scheduler never sends them requests. The controller
  leaves passive groups exactly as they are and does not count them.

A *device* here is a key: `"gpu<k>"`, `"cpu"`, `"model"` (KIND_MODEL), or `"gpu"` for a GPU group whose
GPUs are not known (a file config read without `visible_gpus`; never a live config).

SIMULATED GPUs (machines without a GPU, model_repository/sim_accel): a KIND_CPU group named
`<anything>_simgpu<k>` (with `host_policy: "simgpu<k>"`, which the simulator requires and a count change
keeps) runs its instances on simulated GPU k, so it is read as a group on `gpu<k>`.

A change of the total adds or removes one instance at a time on one device, chosen by `prefer` (see
`with_total`), and keeps everything else the user wrote: the kinds, which GPUs the model is on, every other
field of each group, passive groups. A device the user placed the model on keeps at least one instance (so
the smallest total is one per device: `min_total`).

A change must also keep the instances it does not mean to touch. On an in-place update Triton 2.51 keeps a
live instance only where the new config has a group of the same *signature*: the group's fields except
`name` and `count`, and the device (core: `TritonModelInstance::Signature`, `EquivalentInInstanceConfig`).
So a change never edits the `gpus` of a group over several GPUs to add an instance: one more on GPU k of
`m_0 {count: 1, gpus: [0..7]}` adds a group `m_0_gpu<k> {count: 1, gpus: [k]}` (the *extra* instances on k)
and leaves `m_0` as it is: Triton loads one instance. Rewriting `m_0` to `gpus: [0..6]` with a copy holding
two on GPU 7 (what this module did before) changed every instance's signature: Triton loaded 9 new instances
and unloaded the 8 old ones, each GPU briefly holding both, to add one. Removing takes the extra instances
first (a count change or the extra group dropped), so scaling back returns the config the user wrote.
Only a step below the user's own layout on a device can rebuild instances (see `remove_one`).
"""
from __future__ import annotations

import copy
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

KIND_GPU, KIND_CPU, KIND_MODEL, KIND_AUTO = "KIND_GPU", "KIND_CPU", "KIND_MODEL", "KIND_AUTO"
SPLIT_SUFFIX = "_gpu"
SIM_GPU_GROUP = re.compile(r".*_simgpu(\d+)")


class GroupError(ValueError):
    """The change cannot be made while keeping the groups the user wrote."""


@dataclass(frozen=True)
class GroupView:
    index: int                  # position in `instance_group`
    kind: str                   # KIND_GPU | KIND_CPU | KIND_MODEL (KIND_AUTO resolved where it can be)
    devices: tuple[str, ...]    # the devices it places instances on
    count: int                  # instances per device
    passive: bool


def gpu_key(index: int) -> str:
    return f"gpu{int(index)}"


_GPU_KEY = re.compile(r"gpu(\d+)")      # gpu_key's form


def gpu_index(device: str) -> int | None:
    """The GPU id in a key gpu_key made ("gpu3" -> 3); None for any other device ("gpu": ids not known, "cpu",
    "model", "auto")."""
    m = _GPU_KEY.fullmatch(device)
    return int(m.group(1)) if m else None


def _groups(config: dict) -> list[dict]:
    return list(config.get("instance_group") or [{"count": 1}])


def _count(group: dict) -> int:
    return int(group.get("count", 1) or 1)


def _passive(group: dict) -> bool:
    p = group.get("passive", False)
    return p is True or str(p).lower() == "true"


def _kind(group: dict, visible_gpus: Sequence[int] | None) -> str:
    kind = str(group.get("kind") or KIND_AUTO)
    if kind == KIND_AUTO:
        if group.get("gpus") or visible_gpus:
            return KIND_GPU
        return KIND_CPU if visible_gpus is not None else KIND_AUTO
    return kind


def _gpus(group: dict, visible_gpus: Sequence[int] | None) -> tuple[int, ...] | None:
    """The GPU ids of a GPU group; None when it names none and the visible GPUs are unknown."""
    listed = group.get("gpus")
    if listed:
        return tuple(int(g) for g in listed)
    return None if visible_gpus is None else tuple(int(g) for g in visible_gpus)


def view(config: dict, visible_gpus: Sequence[int] | None = None) -> list[GroupView]:
    """Each group as the server reads it. `visible_gpus`: the GPU ids the server sees (None: unknown)."""
    out = []
    for i, g in enumerate(_groups(config)):
        kind = _kind(g, visible_gpus)
        if kind == KIND_GPU:
            gpus = _gpus(g, visible_gpus)
            devices = ("gpu",) if gpus is None else tuple(gpu_key(k) for k in gpus)
        elif kind == KIND_CPU and SIM_GPU_GROUP.fullmatch(str(g.get("name") or "")):
            devices = (gpu_key(int(SIM_GPU_GROUP.fullmatch(str(g["name"])).group(1))),)
        elif kind == KIND_MODEL:
            devices = ("model",)
        elif kind == KIND_CPU:
            devices = ("cpu",)
        else:
            devices = ("auto",)
        out.append(GroupView(i, kind, devices, _count(g), _passive(g)))
    return out


def instances_per_device(config: dict, visible_gpus: Sequence[int] | None = None,
                         passive: bool = False) -> dict[str, int]:
    """Active instances on each device, in the order the groups name them (passive ones with passive=True)."""
    per: dict[str, int] = {}
    for g in view(config, visible_gpus):
        if g.passive != passive:
            continue
        for d in g.devices:
            per[d] = per.get(d, 0) + g.count
    return per


def may_share_memory(a: Collection[str], b: Collection[str]) -> bool:
    """Whether two models placed on devices `a` and `b` (instances_per_device's keys) can draw on one GPU's
    memory. Only models both placed on named GPUs alone are known apart: {gpu0} and {gpu1, gpu2} are not;
    {gpu0} and {gpu0, gpu1} are; "gpu" (ids not known), "cpu", "model", "auto" or an unknown placement may be
    anywhere, so it is taken as shared."""
    if not a or not b or any(gpu_index(d) is None for d in (*a, *b)):
        return True
    return bool(set(a) & set(b))


def total_instances(config: dict, visible_gpus: Sequence[int] | None = None) -> int:
    """The instances that serve requests (passive groups left out)."""
    return sum(instances_per_device(config, visible_gpus).values())


def min_total(config: dict, visible_gpus: Sequence[int] | None = None) -> int:
    """The smallest total that keeps one instance on every device the groups place the model on."""
    return max(1, len(instances_per_device(config, visible_gpus)))


# ---- one instance more or less on one device --------------------------------------------------------

def add_one(config: dict, device: str, visible_gpus: Sequence[int] | None = None) -> dict:
    """A copy of `config` with one more instance on `device` (one of the devices its active groups use).

    A group on `device` alone grows by one (the extra group first, then the user's own); where only groups
    over several GPUs place the model there, an extra group `<name>_gpu<k>` with `gpus: [k]`, count 1, is
    added after the first of them, which is left as it is (the module's docstring says why)."""
    new = copy.deepcopy(config)
    groups = new["instance_group"] = _groups(new)
    views = [g for g in view(new, visible_gpus) if not g.passive and device in g.devices]
    if not views:
        raise GroupError(f"no active instance group places the model on {device}")
    single = sorted((g for g in views if len(g.devices) == 1), key=lambda g: (not _is_extra(groups, g), g.index))
    if single:
        groups[single[0].index]["count"] = single[0].count + 1
        return new
    base = groups[views[0].index]
    at = views[0].index + 1
    prefix = f"{base.get('name')}{SPLIT_SUFFIX}"
    while base.get("name") and at < len(groups) and str(groups[at].get("name") or "").startswith(prefix):
        at += 1                                              # after the extra groups it already has
    groups.insert(at, _extra(base, views[0], device, 1))
    return new


def remove_one(config: dict, device: str, visible_gpus: Sequence[int] | None = None) -> dict:
    """A copy of `config` with one instance fewer on `device`; it keeps at least one there.

    In this order, each keeping every other instance's signature: an extra group's count (or the extra
    group, at 1), then a count of the user's own group on `device` alone, then such a group at 1 (another
    group still covers the device). Below that only a group over several GPUs places the model there, and
    the step changes its instances: at count c > 1 it runs c - 1 per GPU and an extra instance on each of
    its other GPUs (Triton keeps c - 1 per GPU and loads one on each of the others); at count 1 the device
    leaves its `gpus` (Triton reloads its instances on the other GPUs, each briefly held twice)."""
    new = copy.deepcopy(config)
    groups = new["instance_group"] = _groups(new)
    views = [g for g in view(new, visible_gpus) if not g.passive and device in g.devices]
    on_device = sum(g.count for g in views)
    if on_device <= 1:
        raise GroupError(f"{device} has {on_device} instance(s); the controller keeps at least one on each device "
                         "the instance groups name")
    order = sorted(views, key=lambda g: (len(g.devices) > 1, not _is_extra(groups, g), g.count == 1, g.index))
    g = order[0]
    group = groups[g.index]
    if len(g.devices) == 1:
        if g.count > 1:
            group["count"] = g.count - 1
        else:
            del groups[g.index]
        return new
    _gpu_id(device, g)
    if g.count > 1:
        group["count"] = g.count - 1
        for other in g.devices:
            if other != device:
                new = add_one(new, other, visible_gpus)
        return new
    group["gpus"] = [_gpu_id(d, g) for d in g.devices if d != device]
    return new


def _gpu_id(device: str, g: GroupView) -> int:
    """The GPU id of `device` ("gpu<k>") in group g over several GPUs; GroupError where it names none."""
    k = gpu_index(device)
    if k is None:
        raise GroupError(f"cannot place or remove an instance on {device} alone in a group over {', '.join(g.devices)}")
    return k


def _extra(group: dict, g: GroupView, device: str, count: int) -> dict:
    """A copy of group g (over several GPUs) that holds `count` more instances on `device` alone."""
    k = _gpu_id(device, g)
    mine = copy.deepcopy(group)
    mine["gpus"] = [k]
    mine["count"] = count
    if group.get("name"):
        mine["name"] = f"{group['name']}{SPLIT_SUFFIX}{k}"
    return mine


def _is_extra(groups: list[dict], g: GroupView) -> bool:
    """Group g is an extra group (`<name>_gpu<k>` beside a group named `<name>`)."""
    name = str(groups[g.index].get("name") or "")
    m = re.fullmatch(r"(.+)" + SPLIT_SUFFIX + r"\d+", name)
    return bool(m) and any(str(other.get("name") or "") == m.group(1) for other in groups)


# ---- a new total ------------------------------------------------------------------------------------

def _rank(device: str, prefer: Sequence[str]) -> int:
    return prefer.index(device) if device in prefer else len(prefer)


def with_total(config: dict, total: int, prefer: Sequence[str] = (), visible_gpus: Sequence[int] | None = None,
               room: Mapping[str, int] | None = None) -> dict:
    """A copy of `config` running `total` active instances, one step at a time.

    Each added instance goes to the device that comes first in `prefer` (devices not in it come after, in
    the order the groups name them), among equals to the one with the fewest instances; each removed one
    from a device with an extra group first (then one with a group of its own, then any: `_removal_tier`),
    among those from the device with the most instances among the least preferred. Only devices the active groups
    already use are ever chosen. With one group this is the old behaviour: its count becomes `total`.
    `room` (device -> instances that still fit there, e.g. policy.memory_room) stops adds on a device once
    its room is used up; a device it does not name is not limited. GroupError when no device has room left.
    """
    new = copy.deepcopy(config)
    if not config.get("instance_group"):
        new["instance_group"] = [{"count": 1}]
    per = instances_per_device(new, visible_gpus)
    if not per:
        raise GroupError("the model has only passive instance groups; the controller leaves them alone")
    order = list(per)
    if total < len(per):
        raise GroupError(f"cannot run {total} instance(s): the instance groups place the model on {len(per)} devices "
                         f"({', '.join(order)}), each keeps at least one")
    left = dict(room or {})
    while sum(per.values()) < total:
        open_ = [k for k in order if left.get(k, 1) > 0]
        if not open_:
            raise GroupError(f"no room for {total} instance(s): every device the model is on is at its memory "
                             f"budget at {sum(per.values())} ({', '.join(f'{k}: {per[k]}' for k in order)})")
        d = min(open_, key=lambda k: (_rank(k, prefer), per[k], order.index(k)))
        new = add_one(new, d, visible_gpus)
        per[d] += 1
        if d in left:
            left[d] -= 1
    while sum(per.values()) > total:
        # why the tier first: an extra group's instance goes without touching the others (and the user's
        # groups come back); a step inside a group over several GPUs makes Triton reload instances
        d = max((k for k in order if per[k] > 1),
                key=lambda k: (-_removal_tier(new, k, visible_gpus), _rank(k, prefer), per[k], order.index(k)))
        new = remove_one(new, d, visible_gpus)
        per[d] -= 1
    return new


def _removal_tier(config: dict, device: str, visible_gpus: Sequence[int] | None) -> int:
    """What removing one instance on `device` touches: 0 an extra group, 1 a group of the user's on `device`
    alone, 2 a group over several GPUs (Triton reloads instances: see `remove_one`)."""
    groups = _groups(config)
    single = [g for g in view(config, visible_gpus) if not g.passive and g.devices == (device,)]
    if any(_is_extra(groups, g) for g in single):
        return 0
    return 1 if single else 2


def preference(per_device: dict[str, int], utilization: dict[str, float | None] | None = None,
               room: Mapping[str, int] | None = None) -> list[str]:
    """The order in which to add instances: the device with the most headroom first.

    Devices without memory room (`room` <= 0, when given) come last: instances are added elsewhere and
    removed there first. Then headroom: the device's utilisation (NVML, 10-point steps so noise does not flip
    the order) where known, then this model's instances on it (fewest first). With no readings: the fewest
    instances first.
    """
    utilization, room = utilization or {}, room or {}

    def key(d: str):
        u = utilization.get(d)
        return (room.get(d, 1) <= 0, 0 if u is None else int(u // 10), per_device[d], list(per_device).index(d))
    return sorted(per_device, key=key)
