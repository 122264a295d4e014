"""Which model calls which, learned from request traces (pure), or read in a Python model's source.

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

**A caller that does not pass its trace on** (`pb_utils.InferenceRequest(...)` without `trace=`) leaves no
`parent_id`, so its calls are not in the traces at all, and its callee would run under its own (often the
defaults' loose) target while every request of the caller waits on it. Where this machine can read the
repository (serve's; `server.repository` for `run`), `named_in_source` reads the Python model's own `.py`
files: one that builds an `InferenceRequest` and holds a string constant equal to the name of another model of
the repository (`CALLEE = "plain"`, `model_name="plain"`, or a config parameter's value where the code reads the
name from there) is taken to call it. `CallGraph.declare` records
such an edge; until the traces show it, it counts as one call a request, one in sequence (the least a caller
that calls can make), and `traced` says it was not measured. A name built otherwise at run time (from an
environment variable, say, or by joining strings) is not found; a constant naming a model the code never calls is taken as a call (it asks the
named model for the caller's target: instances, never a missed target).
"""
from __future__ import annotations

import ast
import math
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .traces import TraceSample

KEEP = 20_000    # recent trace ids remembered, and children waiting for their parent's record
SOURCE_FILES = 64              # a model's .py files read at most (named_in_source)
SOURCE_BYTES = 1 << 20         # a larger .py file is skipped (generated code, vendored libraries)
SOURCE_ENTRIES = 2000          # directory entries walked at most under one model's folder
NAME_CHARS = 256               # longer string constants are no model's name (Triton's names are short)


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


def _constants(text: str) -> tuple[bool, frozenset[str]]:
    """Whether Python source `text` builds an `InferenceRequest` (a name or an attribute:
    `pb_utils.InferenceRequest`), and then its string constants (else none); (False, {}) where it is not Python."""
    if "InferenceRequest" not in text:
        return False, frozenset()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False, frozenset()
    builds, found = False, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "InferenceRequest" or \
                isinstance(node, ast.Attribute) and node.attr == "InferenceRequest":
            builds = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) <= NAME_CHARS:
            found.add(node.value)
    return (True, frozenset(found)) if builds else (False, frozenset())


def names_in_code(text: str, names: Iterable[str]) -> set[str]:
    """The `names` that `text` (Python source) holds as a whole string constant, where it builds an
    `InferenceRequest`; empty otherwise. A docstring that mentions a model among other words is not its name.
    Example: `CALLEE = "plain"` ... `pb_utils.InferenceRequest(model_name=CALLEE, ...)` with names {"plain", "ens"}
    gives {"plain"}."""
    return set(_constants(text)[1] & set(names))


def _py_files(model_dir: Path) -> list[Path]:
    """The model's .py files, at most SOURCE_FILES, found in at most SOURCE_ENTRIES directory entries (a vendored
    library under the model's folder is not walked to its end), caches and hidden folders left out."""
    out: list[Path] = []
    seen = 0
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        seen += len(dirs) + len(files)
        if seen > SOURCE_ENTRIES:
            break
        out += [Path(root) / f for f in sorted(files) if f.endswith(".py")]
        if len(out) >= SOURCE_FILES:
            break
    return out[:SOURCE_FILES]


def named_in_source(model_dir: Path, names: Iterable[str],
                    cache: dict[Path, tuple[int, int, bool, frozenset[str]]] | None = None,
                    parameters: Iterable[str] = ()) -> tuple[str, ...]:
    """The other models (of `names`) that the Python model in `model_dir` names where it builds an
    `InferenceRequest` (`names_in_code`), over its `.py` files (`_py_files`, each under SOURCE_BYTES); () where
    none can be read. `parameters`: the string values of the model's config parameters, which count as its
    constants where one of its files builds an InferenceRequest (`model_name=self.params["downstream"]`, a BLS
    model told its callee in its config). The model's own name is never its callee. `cache` (path -> (mtime ns,
    size, builds, constants)) spares reading a file again that has not changed (the loop reads every few seconds)."""
    others = set(names) - {model_dir.name}
    found: set[str] = set()
    builds = False
    try:
        files = _py_files(model_dir)
    except OSError:
        return ()
    for f in files:
        try:
            st = f.stat()
            if not f.is_file() or st.st_size > SOURCE_BYTES:
                continue
            hit = cache.get(f) if cache is not None else None
            if hit is None or hit[:2] != (st.st_mtime_ns, st.st_size):
                hit = (st.st_mtime_ns, st.st_size, *_constants(f.read_text(errors="replace")))
                if cache is not None:
                    cache[f] = hit
            builds = builds or hit[2]
            found |= hit[3] & others
        except OSError:
            continue
    if builds:
        found |= set(parameters) & others
    return tuple(sorted(found))


class CallGraph:
    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._declared: set[tuple[str, str]] = set()       # (caller, callee) named in the caller's source
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

    def declare(self, caller: str, callees: Iterable[str]) -> None:
        """`caller` calls `callees`, as read in its source (`named_in_source`; replaces what was declared for it)."""
        self._declared = {k for k in self._declared if k[0] != caller} | {(caller, c) for c in callees if c != caller}

    def _all(self) -> set[tuple[str, str]]:
        return set(self._edges) | self._declared

    def callees(self, model: str) -> tuple[str, ...]:
        """The models `model` calls (seen in its traces, or named in its source), by name."""
        return tuple(sorted(c for p, c in self._all() if p == model))

    def callers(self, model: str) -> tuple[str, ...]:
        return tuple(sorted(p for p, c in self._all() if c == model))

    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self._all()))

    def traced(self, caller: str, callee: str) -> bool:
        """True where the calls were seen in the traces; False where they are only named in the caller's source."""
        e = self._edges.get((caller, callee))
        return e is not None and e.requests > 0

    def declared(self, caller: str, callee: str) -> bool:
        """True where the caller's source names the callee (`declare`)."""
        return (caller, callee) in self._declared

    def calls_per_request(self, caller: str, callee: str) -> float:
        """Mean calls of `callee` per traced request of `caller` that made one; 1.0 for an edge named only in the
        caller's source (0.0: neither)."""
        e = self._edges.get((caller, callee))
        if e is not None and e.requests:
            return e.calls / e.requests
        return 1.0 if (caller, callee) in self._declared else 0.0

    def calls_in_sequence(self, caller: str, callee: str) -> float:
        """How many of those calls a request waits for one after the other: the calls a request, times the time
        they cover (their union) over their summed time; 1.0 to calls_per_request (1.0 for an edge named only in
        the caller's source; 0.0: neither)."""
        e = self._edges.get((caller, callee))
        if e is None or not e.requests:
            return 1.0 if (caller, callee) in self._declared else 0.0
        k = e.calls / e.requests
        return k if e.call_ms <= 0 else min(k, max(1.0, k * e.span_ms / e.call_ms))

    def forget(self, model: str) -> None:
        """A model unloaded: its edges go (they are learned again if it returns and calls)."""
        self._edges = {k: v for k, v in self._edges.items() if model not in k}
        self._declared = {k for k in self._declared if model not in k}
