"""Which model calls which, learned from request traces (pure).

A Python model that calls other models (BLS, `pb_utils.InferenceRequest(...).exec()`) has the config of any
Python model: nothing in it names its callees (controller/modelkind.py). Its requests' latency holds theirs,
though, so a callee under a looser target than its caller's (the defaults' 1 s, say) could be consolidated to
where the caller misses its own. Triton says who called whom where the caller passes its request's trace on
(`pb_utils.InferenceRequest(..., trace=request.trace())`): the callee's trace record then carries
`parent_id`, the caller's trace id (seen on 2.51; without the `trace=` the call is not traced at all). An
ensemble's composing steps carry their ensemble's id the same way; those edges are recorded too and left to
the caller to tell apart (the ensemble's steps are known from its config already).

`CallGraph.add(samples)` takes each poll's trace samples (controller/traces.py, which keep their own
`trace_id` and `parent_id`). A child's parent may come in a later file than the child (a child's trace ends
first, and the server writes a file every `log_frequency` traces), so the ids of recent traces and the
children still waiting for their parent are kept, each bounded (`KEEP` ids).

`calls_per_request` is the mean number of calls a caller's traced request made, over the requests that made
at least one. `calls_in_sequence` is how many of them the request waits for one after the other: a caller
that sends its calls at once (`async_exec`, a fan-out) waits for about one call's time, not for all of them.
From each request's calls' intervals (REQUEST_START -> REQUEST_END, on the server's clock): the calls a request
times the time they cover (their union) over their summed time, between 1 and the calls a request. That is
the count the caller's target is divided by (controller/ensemble.py). A caller that calls only now and then is
counted as calling every time: erring high asks more of the callee, not less.

Worked example: traces 1 (model `bls`), 2 and 3 (model `plain`, parent 1), 4 (`bls`), 5 (`plain`, parent 4)
give the edge bls -> plain with 3 calls over 2 requests: `calls_per_request("bls", "plain") == 1.5`. Were 2 and
3 each 10 ms, one after the other (0-10 and 10-20 ms), and 5 10 ms, the calls cover 30 ms of their 30: 1.5 in
sequence; were 2 and 3 at the same time (0-10 ms both), they cover 20 ms of 30: 1.5 x 20 / 30 = 1.0.

An edge stays for the controller's life (a caller gone quiet still calls when its traffic returns), until
`forget` drops a model that was unloaded.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from .traces import TraceSample

KEEP = 20_000    # recent trace ids remembered, and children waiting for their parent's record


@dataclass
class _Edge:
    calls: int = 0          # the callee's traced requests made by the caller's
    requests: int = 0       # the caller's traced requests that made at least one of them
    call_ms: float = 0.0    # the calls' request times, summed
    span_ms: float = 0.0    # per caller's request, the time covered by its calls (their union), summed


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """The length in ms of the union of (start_s, end_s) intervals."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return 1000.0 * total


class CallGraph:
    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._model_of: OrderedDict[int, str] = OrderedDict()                  # trace id -> its model
        self._waiting: OrderedDict[int, list[TraceSample]] = OrderedDict()     # parent id -> children seen so far
        # parent id -> callee -> (its calls' intervals, the union counted so far)
        self._counted: OrderedDict[int, dict[str, tuple[list[tuple[float, float]], float]]] = OrderedDict()
        self._edges: dict[tuple[str, str], _Edge] = {}

    def add(self, samples: Iterable[TraceSample]) -> None:
        samples = list(samples)
        for s in samples:
            if s.trace_id is not None:
                self._remember(self._model_of, s.trace_id, s.model)
        for s in samples:
            if s.parent_id is None:
                continue
            if s.parent_id in self._model_of:
                self._count(s.parent_id, s)
            else:
                self._remember(self._waiting, s.parent_id, self._waiting.get(s.parent_id) or [])
                self._waiting[s.parent_id].append(s)
        for pid in [p for p in self._waiting if p in self._model_of]:
            for child in self._waiting.pop(pid):
                self._count(pid, child)

    def _remember(self, d: OrderedDict, key: int, value) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.keep:
            d.popitem(last=False)

    def _count(self, parent_id: int, child: TraceSample) -> None:
        parent = self._model_of[parent_id]
        if parent == child.model:
            return    # why: a model calling itself adds no edge a target could follow
        edge = self._edges.setdefault((parent, child.model), _Edge())
        edge.calls += 1
        edge.call_ms += child.request_ms
        per_callee = self._counted.get(parent_id)
        if per_callee is None:
            per_callee = {}
            self._remember(self._counted, parent_id, per_callee)
        intervals, counted = per_callee.get(child.model, ([], 0.0))
        if not intervals:
            edge.requests += 1
        intervals.append((child.end_s - child.request_ms / 1000.0, child.end_s))
        union = _union_ms(intervals)
        edge.span_ms += union - counted
        per_callee[child.model] = (intervals, union)

    def callees(self, model: str) -> tuple[str, ...]:
        """The models `model` was seen calling, by name."""
        return tuple(sorted(c for p, c in self._edges if p == model))

    def callers(self, model: str) -> tuple[str, ...]:
        return tuple(sorted(p for p, c in self._edges if c == model))

    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self._edges))

    def calls_per_request(self, caller: str, callee: str) -> float:
        """Mean calls of `callee` per traced request of `caller` that made one (0.0: never seen)."""
        e = self._edges.get((caller, callee))
        return e.calls / e.requests if e is not None and e.requests else 0.0

    def calls_in_sequence(self, caller: str, callee: str) -> float:
        """How many of those calls a request waits for one after the other: the calls a request, times the time
        they cover (their union) over their summed time; 1.0 to calls_per_request (0.0: never seen)."""
        e = self._edges.get((caller, callee))
        if e is None or not e.requests:
            return 0.0
        k = e.calls / e.requests
        return k if e.call_ms <= 0 else min(k, max(1.0, k * e.span_ms / e.call_ms))

    def forget(self, model: str) -> None:
        """A model unloaded: its edges go (they are learned again if it returns and calls)."""
        self._edges = {k: v for k, v in self._edges.items() if model not in k}
