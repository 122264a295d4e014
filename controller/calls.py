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
at least one. A caller that calls only now and then is counted as calling every time: the count divides the
caller's target among the calls (controller/ensemble.py), so erring high asks more of the callee, not less.

Worked example: traces 1 (model `bls`), 2 and 3 (model `plain`, parent 1), 4 (`bls`), 5 (`plain`, parent 4)
give the edge bls -> plain with 3 calls over 2 requests: `calls_per_request("bls", "plain") == 1.5`.

An edge stays for the controller's life (a caller gone quiet still calls when its traffic returns), until
`forget` drops a model that was unloaded.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from .traces import TraceSample

KEEP = 20_000    # recent trace ids remembered, and children waiting for their parent's record


@dataclass
class _Edge:
    calls: int = 0          # the callee's traced requests made by the caller's
    requests: int = 0       # the caller's traced requests that made at least one of them


class CallGraph:
    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._model_of: OrderedDict[int, str] = OrderedDict()          # trace id -> its model
        self._waiting: OrderedDict[int, Counter[str]] = OrderedDict()  # parent id -> its children's models
        self._counted: OrderedDict[int, set[str]] = OrderedDict()      # parent id -> callees already counted
        self._edges: dict[tuple[str, str], _Edge] = {}

    def add(self, samples: Iterable[TraceSample]) -> None:
        samples = list(samples)
        for s in samples:
            if s.trace_id is not None:
                self._remember(self._model_of, s.trace_id, s.model)
        for s in samples:
            if s.parent_id is None:
                continue
            parent = self._model_of.get(s.parent_id)
            if parent is None:
                self._remember(self._waiting, s.parent_id, self._waiting.get(s.parent_id) or Counter())
                self._waiting[s.parent_id][s.model] += 1
            else:
                self._count(s.parent_id, parent, s.model, 1)
        for pid in [p for p in self._waiting if p in self._model_of]:
            for child, n in self._waiting.pop(pid).items():
                self._count(pid, self._model_of[pid], child, n)

    def _remember(self, d: OrderedDict, key: int, value) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.keep:
            d.popitem(last=False)

    def _count(self, parent_id: int, parent: str, child: str, n: int) -> None:
        if parent == child:
            return    # why: a model calling itself adds no edge a target could follow
        edge = self._edges.setdefault((parent, child), _Edge())
        edge.calls += n
        seen = self._counted.get(parent_id)
        if seen is None:
            seen = set()
            self._remember(self._counted, parent_id, seen)
        if child not in seen:
            seen.add(child)
            edge.requests += 1

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

    def forget(self, model: str) -> None:
        """A model unloaded: its edges go (they are learned again if it returns and calls)."""
        self._edges = {k: v for k, v in self._edges.items() if model not in k}
