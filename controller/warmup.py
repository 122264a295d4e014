"""Triton's `model_warmup` for a model that starts cold: which samples, and whether they can be made.

Why: a model whose first executions after a load are slow (a CUDA context, cuDNN's per-shape autotuning, a lazily
built graph; `service.ServiceTimes.cold_start` reads it from the settles) serves every scale-up's first requests
late: the new instance takes its share of the queue at once. cold_start r85 / r86 (sim_cold, an 800-ms first
execution per instance): the morning ramp's in-place scale-up put the phase's p99 at 141.6 / 133.2 ms against
28.5 ms for the static arm. Triton 2.51 runs a model config's `model_warmup` samples in each new instance before
that instance takes requests, on a full load and on an in-place instance update alike (checked here on sim_cold:
a scale-up under 4 clients served its first requests in at most 28 ms with a warm-up, 882 ms without). So where
the model reads cold and its config has no `model_warmup`, the controller reloads it once with one (a full reload
at the live settings, at a quiet moment; the old copy serves meanwhile), and every later change keeps it
(`actuation.with_settings` starts from the live config).

The samples: zero data (Triton's `zero_data`) for each required input at its declared shape, one execution
(`count: 1`) per batch size. The sizes: those that made up 99% of the model's executions since it loaded (its
statistics' `batch_stats`), most frequent first (the smaller of equals), at most MAX_SIZES, and always 1. Each size warmed adds one
execution to every instance's load; a size left out is paid once per new instance, on the first batch of that
size, as a 23-76 ms extra pass did on an H200 (docs/results.md, "A real GPU (H200)"). Example: executions since
load {1: 700, 2: 250, 3: 40, 7: 10} (1000) -> 1, 2 and 3 make 99.0% -> sizes [1, 2, 3].

Not made (`samples` says why, and `status` shows it) where zero data is not a request the model is known to take:
an input of variable shape (a -1 dimension: which shape?), a string input (empty strings), a shape tensor (zeros
as a shape). A warm-up the model refuses fails the load; Triton then keeps the old copy serving, and the controller
does not try again (`loop.ControlLoop._warm_up_now`). A config that has its own `model_warmup` is left as it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAMPLE_PREFIX = "triton_autotune_warmup_b"   # our samples' names: `status` tells them from the model's own
COVER = 0.99        # the sizes warmed make up this share of the executions since the load ...
MAX_SIZES = 8       # ... up to this many sizes
_NO_ZERO_TYPES = ("TYPE_STRING", "TYPE_BYTES")


def has_warmup(config: Mapping[str, Any] | None) -> bool:
    """Whether the config carries `model_warmup` samples (its own or ours)."""
    return bool((config or {}).get("model_warmup"))


def ours(config: Mapping[str, Any] | None) -> bool:
    """Whether the config's warm-up samples are the ones this controller adds (named SAMPLE_PREFIX<size>)."""
    samples = (config or {}).get("model_warmup") or []
    return bool(samples) and all(str(s.get("name", "")).startswith(SAMPLE_PREFIX) for s in samples)


def batch_sizes(config: Mapping[str, Any] | None) -> list[int]:
    """The batch sizes of the config's warm-up samples, in order."""
    out = []
    for s in (config or {}).get("model_warmup") or []:
        try:
            out.append(int(s.get("batch_size", s.get("batchSize", 1)) or 1))
        except (TypeError, ValueError):
            continue
    return out


def sizes(executed: Mapping[int, int], max_batch_size: int) -> list[int]:
    """The batch sizes to warm (see the module's doc): [1] for a model without batching (max_batch_size 0) or with
    no execution counted yet."""
    if max_batch_size <= 0:
        return [1]
    counts = sorted(((n, b) for b, n in executed.items() if 1 <= b <= max_batch_size and n > 0), key=lambda c: (-c[0], c[1]))
    total = sum(n for n, _ in counts)
    chosen, covered = {1}, 0
    for n, b in counts:
        if covered >= COVER * total or len(chosen | {b}) > MAX_SIZES:
            break
        chosen.add(b)
        covered += n
    return sorted(chosen)


def _dims(inp: Mapping[str, Any]) -> list[int] | None:
    try:
        return [int(d) for d in inp.get("dims") or []]
    except (TypeError, ValueError):
        return None


def samples(config: Mapping[str, Any], executed: Mapping[int, int]) -> tuple[list[dict] | None, str]:
    """(the `model_warmup` list for `config`, a one-line description) or (None, why it cannot be made)."""
    inputs = [i for i in config.get("input") or [] if isinstance(i, Mapping)]
    required = [i for i in inputs if not i.get("optional")] or inputs
    if not required:
        return None, "the config declares no inputs"
    tensors = {}
    for inp in required:
        name, dtype = str(inp.get("name", "")), str(inp.get("data_type", inp.get("dataType", "")))
        dims = _dims(inp)
        if dims is None or any(d < 0 for d in dims):
            return None, f"input {name!r} has a variable shape {inp.get('dims')}: which shape would a warm-up send?"
        if dtype in _NO_ZERO_TYPES:
            return None, f"input {name!r} is {dtype}: empty strings may not be a request the model takes"
        if inp.get("is_shape_tensor") or inp.get("isShapeTensor"):
            return None, f"input {name!r} is a shape tensor: zeros are not a shape"
        tensors[name] = {"data_type": dtype, "dims": [str(d) for d in dims], "zero_data": True}
    try:
        max_batch = int(config.get("max_batch_size", config.get("maxBatchSize", 0)) or 0)
    except (TypeError, ValueError):
        max_batch = 0
    chosen = sizes(executed, max_batch)
    entries = [{"name": f"{SAMPLE_PREFIX}{b}", "batch_size": b, "count": 1, "inputs": dict(tensors)} for b in chosen]
    return entries, f"zero data at batch size(s) {', '.join(map(str, chosen))}"
