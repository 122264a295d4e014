"""Arbitration between models that share one device and one memory budget (pure, like policy.py).

Each model first gets its own decision from `policy.decide`. A model that wants another instance
but is held by the memory budget (`decision.held_by is Cap.MEMORY`) is *hot*. The arbiter then looks for a *donor*
on the same device and, if it finds one, overrides the donor's decision with "give back one
instance" — one move per tick, so the budget is never exceeded: the donor's instance is gone
before the hot model's next tick sees the freed memory and adds its own (in place, so no double
memory; a full reload is only allowed by `policy.full_reload_fits`, which counts old + new).

Who donates, in order:
1. an idle model (its planner predicts one instance fewer still meets its target at the upper band of its
   forecast; without the planner, the policy's low-load rule `policy.is_low`), lowest priority first:
   `RebalanceToHotModel`. With the planner the hot model is marked as soon as its forecast says its
   ceiling will not hold, so the instance moves before its queue builds;
2. failing that, a model of *lower priority* than the hot one even if it is busy: its SLA is given up
   for the higher-priority model's, and the reason says so: `RebalanceToHigherPriority`;
3. failing that, with the planner's goodput for both (`ModelView.goodput`: req/s predicted within the target
   at a demand, for n instances: `planner.goodput`), a busy model of equal or lower priority whose instance
   buys clearly less goodput than it would buy the hot model: `RebalanceForGoodput`. Goodput bought by an
   instance = goodput with it - goodput without it. The hot model's gain is weighed at the high end of its
   forecast band, the donor's loss at the low end of its band (a scale-up on the upper band, a scale-down on
   the lower, as for one model), and the move is made when gain >= GOODPUT_GAIN x loss + GOODPUT_MIN_RPS
   *and*, at both forecasts' mid points, gain >= loss + GOODPUT_MIN_RPS: the second makes the reverse move
   never also worth it (reversed, the gain and loss at the mid points swap), so two models whose bands
   overlap do not trade an instance back and forth. Without a band: the arrival rate for all three.
   Example: hot `a` at 2 instances, band 300-350-400 req/s, goodput 290 at 2 and 385 at 3 at 400 (gain 95),
   280 at 2 and 345 at 3 at 350 (mid gain 65); `b` at 3 on a falling load, band 100-160-220 req/s, loses 0 at
   100 (2 instances hold it), 40 at 160 and 80 at 220: 95 >= 1.5 x 0 + 5 and 65 >= 40 + 5, so `b` gives one
   to `a`. Weighed at b's high end (95 < 1.5 x 80 + 5), the move would wait until b's load had fallen.
Several hot models: the one of highest priority first; among equals, the one an instance buys the most
goodput for (where the planner can say), then the one deepest into its target. A model never goes below
its `min_instances`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .config import ModelLimits
from .policy import is_low
from .types import Cap, Decision, Observation, Settings


@dataclass(frozen=True)
class ModelView:
    """What the arbiter needs of one model this tick."""

    name: str
    current: Settings
    decision: Decision
    obs: Observation
    limits: ModelLimits
    instance_memory_bytes: float | None = None
    goodput: Callable[[int, float], float | None] | None = None   # planner.goodput: (n, demand) -> req/s in target


GOODPUT_GAIN = 1.5       # a busy donor gives only if the hot model's gain is this many times its loss ...
GOODPUT_MIN_RPS = 5.0    # ... plus this many req/s


LOW, MID, HIGH = 0, 1, 2    # the forecast band's ends (planner.Forecast.band)


def _demand(v: ModelView, end: int = HIGH) -> float:
    band = (v.decision.plan or {}).get("band_rps")
    return float(band[end]) if band else v.obs.arrival_rps


def _bought(v: ModelView, without: int, with_: int, end: int) -> float | None:
    """Goodput (req/s within target) the instance between `without` and `with_` instances buys this model
    at the `end` of its forecast band; None where the planner cannot say."""
    if v.goodput is None:
        return None
    d = _demand(v, end)
    lo, hi = v.goodput(without, d), v.goodput(with_, d)
    if lo is None or hi is None:
        return None
    return max(0.0, hi - lo)


def _gain(v: ModelView, end: int = HIGH) -> float | None:
    n = v.current.instance_count
    return _bought(v, n, n + 1, end)


def _loss(v: ModelView, end: int = LOW) -> float | None:
    n = v.current.instance_count
    return _bought(v, n - 1, n, end)


def _worth(hot: ModelView, donor: ModelView, gain: float) -> float | None:
    """The donor's loss (at the low end of its band) if its instance is clearly worth more to `hot`, else None."""
    loss, gain_mid, loss_mid = _loss(donor), _gain(hot, MID), _loss(donor, MID)
    if loss is None or gain_mid is None or loss_mid is None:
        return None
    if gain >= GOODPUT_GAIN * loss + GOODPUT_MIN_RPS and gain_mid >= loss_mid + GOODPUT_MIN_RPS:
        return loss
    return None


def _pressure(v: ModelView) -> float:
    """How far p99 is into its target (1.0 = at the target); 0 without a figure."""
    if not v.obs.valid or v.obs.p99_ms is None:
        return 0.0
    return v.obs.p99_ms / v.limits.p99_target_ms


def _idle_enough(v: ModelView) -> bool:
    """One instance fewer would still leave this model comfortable: its planner predicts so (`spare` in
    the decision's plan: its consolidation check passed, i.e. fewer instances are predicted under the
    consolidation margin at the upper band of its forecast, or the ones it would drop buy nothing at that
    load), or, without the planner, the policy's low-load rule."""
    if not v.obs.valid:
        return False
    if v.decision.mode == "model" and v.decision.plan is not None:
        return v.decision.plan.get("spare", 0) >= 1
    return is_low(v.obs, v.current, v.limits)


def _can_give(v: ModelView) -> bool:
    # why: a model failing requests (a crashed instance: policy.repair) looks idle (its dead instance is never
    # busy), but its readings describe the fault, and a scale-down would cancel the repair it waits for
    return v.current.instance_count > v.limits.min_instances and v.decision.target == v.current \
        and not (v.obs.valid and v.obs.fault_rps > 0)


def arbitrate(views: list[ModelView]) -> dict[str, Decision]:
    """Overrides for this tick's decisions: {model: decision}. Empty when nobody is blocked by memory."""
    hot = [v for v in views if v.decision.valid and v.decision.held_by is Cap.MEMORY]
    if not hot:
        return {}
    # The most important blocked model first; among equals, the one an instance buys the most goodput for,
    # then the one deepest into its target.
    hot.sort(key=lambda v: (-v.limits.priority, -(_gain(v) or 0.0), -_pressure(v)))
    busy_elsewhere = any(v.decision.target != v.current for v in views)
    if busy_elsewhere:
        return {}   # why: one move at a time on a shared device; let the change in flight land first
    for h in hot:
        donors = [v for v in views if v.name != h.name and _can_give(v)]
        idle = sorted((v for v in donors if _idle_enough(v)),
                      key=lambda v: (v.limits.priority, v.obs.busy_fraction))
        if idle:
            d = idle[0]
            return {d.name: _give(d, h, "RebalanceToHotModel",
                                  f"idle ({d.obs.busy_fraction:.0%} busy); frees {_mib(d)} for {h.name} "
                                  f"(p99 {_ms(h.obs.p99_ms)} of {h.limits.p99_target_ms:g} ms)")}
        lower = sorted((v for v in donors if v.limits.priority < h.limits.priority),
                       key=lambda v: (v.limits.priority, _pressure(v)))
        if lower:
            d = lower[0]
            return {d.name: _give(d, h, "RebalanceToHigherPriority",
                                  f"the budget cannot meet every target: {d.name} (priority {d.limits.priority}) "
                                  f"gives up its {d.limits.p99_target_ms:g} ms target for {h.name} "
                                  f"(priority {h.limits.priority}, p99 {_ms(h.obs.p99_ms)} of {h.limits.p99_target_ms:g} ms)")}
        gain = _gain(h)
        if gain is None:
            continue
        worth = [(loss, v) for v in donors if v.limits.priority <= h.limits.priority
                 for loss in [_worth(h, v, gain)] if loss is not None]
        if worth:
            loss, d = min(worth, key=lambda x: (x[0], x[1].limits.priority, x[1].name))
            return {d.name: _give(d, h, "RebalanceForGoodput",
                                  f"one instance buys {h.name} {gain:.0f} req/s within its target and costs "
                                  f"{d.name} {loss:.0f} (predicted, at {_demand(h):.0f} and {_demand(d, LOW):.0f} "
                                  f"req/s; {_gain(h, MID):.0f} and {_loss(d, MID):.0f} at {_demand(h, MID):.0f} and "
                                  f"{_demand(d, MID):.0f})")}
    return {}


def _give(donor: ModelView, hot: ModelView, reason: str, detail: str) -> Decision:
    target = dataclasses.replace(donor.current, instance_count=donor.current.instance_count - 1)
    return Decision(target=target, reason=reason, detail=detail, mode="arbiter")


def _mib(v: ModelView) -> str:
    return "one instance" if v.instance_memory_bytes is None else f"{v.instance_memory_bytes / 2**20:.0f} MiB"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"
