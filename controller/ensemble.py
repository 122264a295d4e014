"""An ensemble's p99 target passed down to the step that holds its latency (pure; issue 15, deliver 2).

An ensemble has no knob of its own (controller/modelkind.py); the latency its clients see is its own
end-to-end p99 (its own request traces or counters, as for any model). What can bring it down is a step:
more instances (or a shorter delay) where requests wait. So, each tick:

1. the step that *holds the latency* is the one whose requests wait longest in its queue
   (`queue_ms_per_request`): that is what another instance removes;
2. that step's target becomes the ensemble's target less what the rest of the ensemble adds (the other
   steps and the ensemble's own overhead: the ensemble's mean request time less the step's, from the
   server's counters; the difference of the two p99s only where a mean is missing, as the two p99s come
   from different sampled requests and their difference is noisy), but never looser than the step's own
   target and never below `MIN_FRACTION` of the ensemble's. While the ensemble's own p99 is over its target,
   the step's target is also at most the step's p99 less that excess: the ensemble's p99, not the split of
   it, is what must meet the target; but that cut stops at the step's compute time per request, as more
   instances remove queueing, not compute (an excess beyond it is not in the step: seen live on 2 shared
   cores, host stalls put the ensemble's p99 23 ms over its step's, and the cut asked the step for 4 ms
   against 9 ms of compute, sending it to its maximum for nothing). The two p99s must cover the same
   seconds: the loop restarts an ensemble's window whenever one of its steps changes;
3. every other step keeps its own target (one step at a time; when the queue moves to another step, the
   target moves with it), but never looser than the ensemble's own: each request of the ensemble passes
   through every step, so a step's latency is part of the ensemble's, and a step under a looser target
   (the defaults' 1 s, say) could be consolidated to where it alone misses the ensemble's;
4. while the ensemble's or its steps' data are missing (a change settling, a failed scrape, no request yet),
   every step keeps the target it has: a gap in the data never hands a step back its looser own target.

A model that calls others (BLS) is handled the same way once its request traces show the calls, or its source
names them (controller/calls.py): its callees are its "steps", each waited for k times a request
(`EnsembleView.calls`; k = 1 for a callee only named in the source). A callee that is an ensemble takes the
target as its own, and its own view passes it to its steps.
It differs from an ensemble in one way: it has a queue and instances of its own, so where it queues at
least as long as any callee, no callee's target is cut (step_targets says how).

A step in several ensembles gets the strictest of their targets. The policy then does what it does for
any model against that target, within the shared memory budget (the arbiter), so the ensemble's p99
meets its target where the step can be scaled to meet it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .types import Observation

MIN_FRACTION = 0.2        # a step's derived target is never below 20% of the ensemble's
HYSTERESIS = 0.1          # a derived target moves only when it changes by more than 10%


@dataclass(frozen=True)
class StepTarget:
    model: str
    target_ms: float
    ensemble: str = ""        # the ensemble whose target this is ("": the step's own)
    why: str = "own target"


def holder(steps: Sequence[str], obs: Mapping[str, Observation | None]) -> str | None:
    """The step whose requests wait longest in its queue (valid observations only); None if none is known."""
    known = [(o.queue_ms_per_request, -i, s) for i, s in enumerate(steps)
             if (o := obs.get(s)) is not None and o.valid]
    return max(known)[2] if known else None


def step_targets(ensemble: str, target_ms: float, ens_obs: Observation | None, steps: Sequence[str],
                 step_obs: Mapping[str, Observation | None], own: Mapping[str, float],
                 calls: Mapping[str, float] | None = None) -> dict[str, StepTarget] | None:
    """Each step's target under this ensemble (see the module's doc); None when the data do not say.

    `calls`: `ensemble` is a model that calls its `steps` (BLS, controller/calls.py), with the calls of each
    that a request of its own waits for one after the other (`CallGraph.calls_in_sequence`). Then the caller
    has a queue and instances of its own: where it queues at least as long as the callee that queues longest,
    its own instances are what helps and no callee's target is cut (each keeps its capped own). A callee
    waited for k times a request gets 1/k of what the caller leaves: (target - rest) / k, rest being the
    caller's mean request time less k times the callee's; an excess over the target is cut from each call's
    p99 by excess / k. Worked example: bls, target 60 ms, mean 40 ms, p99 50 ms, queue 0.5 ms, calls plain
    twice a request, one call after the other; plain mean 15 ms, queue 6 ms: rest = 40 - 2 x 15 = 10 ms, so
    plain's target is (60 - 10) / 2 = 25 ms."""
    out = {s: StepTarget(s, own[s]) for s in steps if s in own}
    if ens_obs is None or not ens_obs.valid or ens_obs.p99_ms is None:
        return None
    h = holder([s for s in steps if s in own], step_obs)
    if h is None or step_obs[h].p99_ms is None:
        return None
    step = step_obs[h]
    if calls is not None and ens_obs.queue_ms_per_request >= step.queue_ms_per_request:
        return out
    k = max(1.0, calls.get(h, 1.0)) if calls is not None else 1.0
    if ens_obs.request_ms_mean > 0 and step.request_ms_mean > 0:
        rest = max(0.0, ens_obs.request_ms_mean - k * step.request_ms_mean)
    else:
        rest = max(0.0, ens_obs.p99_ms - k * step.p99_ms)
    derived = (target_ms - rest) / k
    excess = ens_obs.p99_ms - target_ms
    not_in_queue = False
    if excess > 0 and step.p99_ms - excess / k < derived:
        # what more instances remove is queueing, not compute: the cut stops at the step's compute time per
        # request (an excess beyond that is not in this step's queue: host stalls, time outside the steps)
        floor = min(derived, step.compute_ms_per_request)
        not_in_queue = step.p99_ms - excess / k < floor
        derived = max(step.p99_ms - excess / k, floor)
    derived = max(derived, MIN_FRACTION * target_ms / k)
    if derived >= own[h]:
        return out
    per_call = f", over {k:.2g} calls a request" if k != 1.0 else ""
    why = (f"{ensemble} p99 target {target_ms:g} ms less {rest:.1f} ms the rest of {ensemble} adds{per_call}"
           + (f", or {h}'s p99 {step.p99_ms:.1f} ms less the {excess:.1f} ms {ensemble} is over" if excess > 0 else "")
           + (f", but not below its compute time, {step.compute_ms_per_request:.1f} ms a request: more instances do not "
              f"remove that" if not_in_queue else "")
           + f" ({ensemble} p99 {ens_obs.p99_ms:.1f} ms); {h} queues longest ({step.queue_ms_per_request:.1f} ms)")
    out[h] = StepTarget(h, round(derived, 2), ensemble, why)
    return out


def merge(per_ensemble: Sequence[Mapping[str, StepTarget]]) -> dict[str, StepTarget]:
    """A step in several ensembles: the strictest target."""
    out: dict[str, StepTarget] = {}
    for targets in per_ensemble:
        for s, t in targets.items():
            if s not in out or t.target_ms < out[s].target_ms:
                out[s] = t
    return out


def settle(previous_ms: float, new_ms: float, own_ms: float) -> float:
    """The target to use: `new_ms` when it moved by more than HYSTERESIS (or back to the step's own), else
    `previous_ms`, so that tick-to-tick noise in the p99s does not move the target the policy aims at."""
    if new_ms == own_ms or previous_ms <= 0:
        return new_ms
    return new_ms if abs(new_ms - previous_ms) > HYSTERESIS * previous_ms else previous_ms


@dataclass(frozen=True)
class EnsembleView:
    """An ensemble and its steps, or a model that calls others (BLS) and its callees (`calls` set: the calls of
    each callee a request of the caller waits for one after the other, from its request traces; controller/calls.py)."""
    name: str
    target_ms: float
    obs: Observation | None
    steps: tuple[str, ...]
    calls: Mapping[str, float] | None = None
    untraced: frozenset[str] = frozenset()    # callees named in the caller's source, their calls not seen in traces

    def relation(self, step: str) -> str:
        if self.calls is None:
            return f"a request of {self.name} passes through {step}"
        if step in self.untraced:
            return f"{self.name} calls {step} (named in its model.py or config; its calls are not traced)"
        return f"{self.name} calls {step} (seen in its request traces)"


def _tighter(now: StepTarget | None, base: StepTarget) -> StepTarget:
    """What a step runs under while the data do not say: what it has, unless that is looser than its capped own."""
    return base if now is None or now.target_ms > base.target_ms else now


def plan(ensembles: Sequence[EnsembleView], obs: Mapping[str, Observation | None], own: Mapping[str, float],
         current: Mapping[str, StepTarget]) -> dict[str, StepTarget]:
    """The target each step of these ensembles should run under now: the strictest over the ensembles,
    settled against `current` (what the steps run under now; a step missing there runs under its own, capped at
    its ensembles' targets).
    An ensemble whose data do not say leaves its steps' current targets as they are. Steps not in `own`
    are left out."""
    base = {s: StepTarget(s, ms) for s, ms in own.items()}     # each step's own target, capped (point 3)
    for e in ensembles:
        for s in e.steps:
            if s in own and e.target_ms < base[s].target_ms:
                base[s] = StepTarget(s, e.target_ms, e.name,
                                     f"{e.name} p99 target {e.target_ms:g} ms: {e.relation(s)}, "
                                     f"so {s}'s p99 is part of {e.name}'s (its own target {own[s]:g} ms is looser)")
    capped = {s: b.target_ms for s, b in base.items()}
    per_ensemble = []
    for e in ensembles:
        t = step_targets(e.name, e.target_ms, e.obs, e.steps, obs, capped, e.calls)
        per_ensemble.append({s: (x if x.ensemble else base[s]) for s, x in t.items()} if t is not None else
                            {s: _tighter(current.get(s), base[s]) for s in e.steps if s in own})
    merged = merge(per_ensemble)
    out = {}
    for s, t in merged.items():
        now = current.get(s)
        # the hysteresis is for the noise between derived targets: the first one derived replaces the cap at once
        settled = settle(now.target_ms if now is not None and now != base[s] else 0.0, t.target_ms, capped[s])
        out[s] = t if settled == t.target_ms else (now if now is not None else StepTarget(s, settled))
    return out
