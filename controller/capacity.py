"""How much of this pod's capacity a model uses: the signal a fleet scaler (HPA, KEDA) reads.

Two levels of control (see README "Kubernetes"): inside the pod the policy adds instances and tunes
the batching delay within seconds; the fleet scaler adds pods within minutes and sees only what we
export. So the figure exported here is *relative to the most this pod can do within the p99 target
at the best configuration it may use* (its instance ceiling: max_instances, the memory budget, a
learned maximum or a saturation mark, whichever is lowest), not queue time, which the tuner itself
drives down. 1.0 means "at the limit even after tuning".

`utilization(...)` is pure: it reads what the policy already knows (its perf points, the ceiling it
computed, the live settings, the cap that holds the model) and the current observation.

The rule (n = live instance count, N = ceiling, a = arrival rate, T = p99 target, p = p99):

* capacity known from measurement: ``C_k`` = the highest arrival rate served within the target
  (met_target and completion >= 0.95 x arrival) by any point with k instances; a planner's prediction
  (`planned_capacity_rps`: the most any count up to N is predicted to carry, which can be fewer than N where
  instances contend) replaces it when given;
* the current load fraction ``f = p / T`` (how close the live configuration is to its latency limit
  now; the instances' busy fraction only when there is no p99: busy time includes waiting for a
  shared device, so it reads high long before the latency does);
* **at the ceiling (n >= N) and p >= T** (the tuner can add nothing and the target is missed, e.g.
  held by the memory budget): ``u = max(1, min(SATURATED_MAX, max(a / C_N, p / T)))``; `saturated` is
  True. Bounded: in an overload p99 grows with the queue (seconds against a 100 ms target) and says
  nothing about how many pods are missing; 2 lets the fleet at most double per evaluation of the HPA;
* **at the ceiling, within the target**: capacity = ``max(C_N, a / f)`` (at least what was served,
  at least the current rate extrapolated to full load), ``u = a / capacity``; u >= 1 only when
  the extrapolation says so (f >= 1), and then `saturated`; with the planner's figure, ``max(C_N, a)``
  instead (below);
* **below the ceiling** (an instance can still be added): capacity at N is the planner's prediction for
  N instances when given, else estimated as ``max(C_N, max(C_n, a / f) x N / n)`` (what the live count
  does, scaled by the instances still available: optimistic, since a device's capacity does not grow
  linearly: 1 sim_accel instance at 200 req/s extrapolated to ~4,600 req/s at 8, where the planner,
  which knows the instances share one device, predicted ~2,000), and by ``c(n) / c(N)`` where the
  contention between instances is known (`contention`, the planner's gamma: c(k) = 1 + gamma (k - 1), each
  execution that much longer with k instances; measured, or read from the device, even while the planner's
  p99 is set aside); never less than what the live count has been measured to do: ``C_n``, and ``a`` while
  within the target; and
  ``u = min(a / capacity, HEADROOM_MAX)``: below 1 by construction, so a fleet scaler with a target
  of about 0.8 (HPA tolerance 10%: scale-out above 0.88) never adds a pod while the tuner can still
  add an instance.

Why the planner's figure is not floored by ``a / f``: f = p / T reads the p99 as growing in proportion to the
load, where at a light load the p99 is the service time and the queue's growth comes late and steep. A light
load so extrapolates far past what the instances carry (seen under `serve`: resnet_tiny at 298.5 req/s, p99 12.6
ms of a 100-ms target, read 2,365 req/s by that rule on 2 CPU cores, where the planner, which models the queue,
put its 8 instances at 1,229.7): a capacity too high is a utilisation too low, and the fleet scaler adds pods too
late. Without the planner it is the only estimate there is, and stays.

Utilisation is None (the gauge absent, not zero) while there is no valid observation.

Worked example (target 100 ms, max_instances 2, so N = 2):

* 1 instance, 90 req/s, p99 85 ms: f = 0.85, C_1 unknown, capacity at 1 = 90 / 0.85 = 105.9 req/s,
  at 2 = 211.8 req/s: u = 90 / 211.8 = 0.42 (the tuner adds an instance; no new pod).
* the same with the planner's prediction for 2 instances at the live delay, 150 req/s (the two share one
  device): capacity = max(150, 105.9) = 150 req/s, u = 0.6.
* 2 instances, 120 req/s, p99 60 ms; served before at 2: 120 req/s: f = 0.6, capacity =
  max(120, 120 / 0.6) = 200 req/s: u = 0.6.
* 2 instances, 200 req/s, p99 900 ms (queue growing): u = max(1, min(2, max(200 / 120, 9.0))) = 2.0,
  saturated: an HPA at target 0.8 with 2 such pods wants ceil(2 x 2.0 / 0.8) = 5 pods.
* 2 instances, 10 req/s afterwards, p99 25 ms: capacity = max(120, 10 / 0.25) = 120: u = 0.08;
  two such pods: ceil(2 x 0.08 / 0.8) = 1 pod.
* the first example with a contention of 1.0 (a torch model using every core: two instances take turns):
  capacity at 2 = 105.9 x 2 / 1 x c(1) / c(2) = 105.9 req/s, u = 0.85 (the bound; linearly it read 0.42).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .types import Cap, Observation, Settings

HEADROOM_MAX = 0.85     # utilisation reported while an instance can still be added stays at or below this
SATURATED_MAX = 2.0     # utilisation reported when saturated stays at or below this
SERVED_FRACTION = 0.95  # a point "served" its load when completions reached this fraction of arrivals


@dataclass(frozen=True)
class Capacity:
    """One model's use of this pod's capacity (see the module docstring for the rule)."""

    utilization: float              # arrival rate / capacity at the ceiling (>= 1: at the limit)
    capacity_rps: float | None      # the capacity estimate behind it (None when saturated without one)
    saturated: bool                 # at the ceiling and at or past the limit
    p99_over_target: float | None   # p99 / target (None without a p99)
    ceiling: int                    # the most instances allowed now
    held_by: str | None             # the cap that holds the model, when one does
    source: str                     # "measured" | "extrapolated" | "planner" | "saturated"

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(float(x), 3)  # noqa: E731
        return {"utilization": r(self.utilization), "capacity_rps": r(self.capacity_rps),
                "saturated": self.saturated, "p99_over_target": r(self.p99_over_target),
                "ceiling": self.ceiling, "held_by": self.held_by, "source": self.source}


def served_max(points: Iterable, instances: int) -> float | None:
    """The highest arrival rate served within the target by `instances` instances (any delay)."""
    rates = [p.arrival_rps for p in points
             if p.instance_count == instances and p.met_target and p.arrival_rps > 0
             and p.completion_rps >= SERVED_FRACTION * p.arrival_rps]
    return max(rates) if rates else None


def utilization(obs: Observation | None, current: Settings | None, ceiling: int, p99_target_ms: float,
                points: Iterable = (), held_by: Cap | None = None,
                planned_capacity_rps: float | None = None, contention: float | None = None) -> Capacity | None:
    """This model's utilisation of the pod's capacity at its ceiling; None while unknown."""
    if obs is None or not obs.valid or current is None or ceiling < 1:
        return None
    points = tuple(points)
    n, a = current.instance_count, max(0.0, obs.arrival_rps)
    p = obs.p99_ms
    p_t = None if p is None else p / p99_target_ms
    f = p_t if p_t is not None else min(1.0, max(0.0, obs.busy_fraction))
    held = None if held_by is None else held_by.value
    c_n = served_max(points, ceiling)
    source = "measured"
    if planned_capacity_rps is not None and planned_capacity_rps > 0:
        c_n, source = planned_capacity_rps, "planner"
    planned = source == "planner"
    within = a if p_t is not None and p_t < 1.0 else None     # served now, within the target: measured
    if n >= ceiling:
        if p_t is not None and p_t >= 1.0:
            u = max(1.0, min(SATURATED_MAX, max(a / c_n if c_n else 1.0, p_t)))
            return Capacity(u, c_n, True, p_t, ceiling, held, "saturated")
        extrapolated = within if planned else (a / f if f > 0 else None)
        cap = max(x for x in (c_n, extrapolated, 0.0) if x is not None)
        if extrapolated is not None and (c_n is None or extrapolated > c_n):
            source = "measured" if planned else "extrapolated"
        if a <= 0:
            return Capacity(0.0, cap or None, False, p_t, ceiling, held, source)
        u = a / cap if cap > 0 else 1.0
        # why: saturated is the extrapolation's word (f >= 1); within the target, the planner's figure under the
        # rate served reads 1.0, at the limit, not past it
        return Capacity(u, cap, u >= 1.0 and not planned, p_t, ceiling, held, source)
    # below the ceiling: the tuner still has instances to add
    now_served = served_max(points, n)
    if planned:
        floor = max(x for x in (now_served, within, 0.0) if x is not None)
        cap = max(c_n, floor)
        if c_n < floor:
            source = "measured"
    else:
        now_cap = max(x for x in (now_served, a / f if f > 0 else None, 0.0) if x is not None)
        scaled = now_cap * ceiling / max(n, 1)
        if contention is not None and contention > 0:
            scaled *= (1 + contention * (max(n, 1) - 1)) / (1 + contention * (ceiling - 1))
        cap = max(c_n or 0.0, scaled)
        if (c_n or 0.0) < scaled:
            source = "extrapolated"
    u = 0.0 if a <= 0 else (a / cap if cap > 0 else HEADROOM_MAX)
    return Capacity(min(u, HEADROOM_MAX), cap or None, False, p_t, ceiling, held, source)


def pod_utilization(per_model: Iterable[Capacity | None]) -> float | None:
    """The pod's figure: the highest over its models (the one that runs out first); None if none known."""
    known = [c.utilization for c in per_model if c is not None]
    return max(known) if known else None
