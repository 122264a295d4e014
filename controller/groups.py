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
field of each group, passive groups. Adding on one GPU of a group that spans several GPUs splits it: the
group keeps its other GPUs and a copy of it, named `<name>_gpu<k>`, holds GPU k with one more instance;
when the counts become equal again the copy merges back. A device the user placed the model on keeps at
least one instance (so the smallest total is one per device: `min_total`).
"""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
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


def total_instances(config: dict, visible_gpus: Sequence[int] | None = None) -> int:
    """The instances that serve requests (passive groups left out)."""
    return sum(instances_per_device(config, visible_gpus).values())


def min_total(config: dict, visible_gpus: Sequence[int] | None = None) -> int:
    """The smallest total that keeps one instance on every device the groups place the model on."""
    return max(1, len(instances_per_device(config, visible_gpus)))


# ---- one instance more or less on one device --------------------------------------------------------

def add_one(config: dict, device: str, visible_gpus: Sequence[int] | None = None) -> dict:
    """A copy of `config` with one more instance on `device` (one of the devices its active groups use)."""
    new = copy.deepcopy(config)
    groups = new["instance_group"] = _groups(new)
    views = [g for g in view(new, visible_gpus) if not g.passive and device in g.devices]
    if not views:
        raise GroupError(f"no active instance group places the model on {device}")
    single = [g for g in views if len(g.devices) == 1]
    g = single[0] if single else views[0]
    group = groups[g.index]
    if len(g.devices) == 1:
        group["count"] = g.count + 1
    else:
        _split(groups, g, device, g.count + 1)
    return _merge(new, visible_gpus)


def remove_one(config: dict, device: str, visible_gpus: Sequence[int] | None = None) -> dict:
    """A copy of `config` with one instance fewer on `device`; it keeps at least one there."""
    new = copy.deepcopy(config)
    groups = new["instance_group"] = _groups(new)
    views = [g for g in view(new, visible_gpus) if not g.passive and device in g.devices]
    on_device = sum(g.count for g in views)
    if on_device <= 1:
        raise GroupError(f"{device} has {on_device} instance(s); the controller keeps at least one on each device "
                         "the instance groups name")
    # why this order: a plain count change first; dropping or splitting a group only when no group allows one
    order = sorted(views, key=lambda g: (len(g.devices) > 1, g.count == 1, g.index))
    g = order[0]
    group = groups[g.index]
    if len(g.devices) == 1:
        if g.count > 1:
            group["count"] = g.count - 1
        else:
            del groups[g.index]
    elif g.count > 1:
        _split(groups, g, device, g.count - 1)
    else:
        group["gpus"] = [int(d[3:]) for d in g.devices if d != device]
    return _merge(new, visible_gpus)


def _split(groups: list[dict], g: GroupView, device: str, count: int) -> None:
    """Group g spans several GPUs: it keeps the others; a copy of it holds `device` with `count` instances."""
    group = groups[g.index]
    if not device.startswith("gpu") or device == "gpu":
        raise GroupError(f"cannot place an instance on {device} alone in a group over {', '.join(g.devices)}")
    mine = copy.deepcopy(group)
    group["gpus"] = [int(d[3:]) for d in g.devices if d != device]
    mine["gpus"] = [int(device[3:])]
    mine["count"] = count
    if group.get("name"):
        mine["name"] = f"{group['name']}{SPLIT_SUFFIX}{device[3:]}"
    groups.insert(g.index + 1, mine)


def _merge(config: dict, visible_gpus: Sequence[int] | None) -> dict:
    """Fold a split copy (`<name>_gpu<k>`) back into its group when both run the same count again."""
    groups = config["instance_group"]
    changed = True
    while changed:
        changed = False
        for i, base in enumerate(groups):
            name = base.get("name")
            if not name or _kind(base, visible_gpus) != KIND_GPU:
                continue
            for j, other in enumerate(groups):
                m = re.fullmatch(re.escape(name) + SPLIT_SUFFIX + r"(\d+)", str(other.get("name") or ""))
                if j == i or not m:
                    continue
                same = {k: v for k, v in other.items() if k not in ("name", "gpus")} == \
                    {k: v for k, v in base.items() if k not in ("name", "gpus")}
                if same and other.get("gpus"):
                    base["gpus"] = sorted(set(int(x) for x in (base.get("gpus") or [])) | set(int(x) for x in other["gpus"]))
                    del groups[j]
                    changed = True
                    break
            if changed:
                break
    return config


# ---- a new total ------------------------------------------------------------------------------------

def _rank(device: str, prefer: Sequence[str]) -> int:
    return prefer.index(device) if device in prefer else len(prefer)


def with_total(config: dict, total: int, prefer: Sequence[str] = (), visible_gpus: Sequence[int] | None = None,
               room: Mapping[str, int] | None = None) -> dict:
    """A copy of `config` running `total` active instances, one step at a time.

    Each added instance goes to the device that comes first in `prefer` (devices not in it come after, in
    the order the groups name them), among equals to the one with the fewest instances; each removed one
    from the device with the most instances among the least preferred. Only devices the active groups
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
        d = max((k for k in order if per[k] > 1), key=lambda k: (_rank(k, prefer), per[k], order.index(k)))
        new = remove_one(new, d, visible_gpus)
        per[d] -= 1
    return new


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
