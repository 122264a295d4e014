"""Triton's `model_warmup` for a model that starts cold: which samples, and whether they can be made.

Why: a model whose first executions after a load are slow (a CUDA context, cuDNN's per-shape autotuning, a lazily
built graph; `service.ServiceTimes.cold_start` reads it from the settles) serves every scale-up's first requests
late: the new instance takes its share of the queue at once. cold_start r85 / r86 (sim_cold, an 800-ms first
execution per instance): the morning ramp's in-place scale-up put the phase's p99 at 141.6 / 133.2 ms against
28.5 / 23.8 ms for the static arm. Triton 2.51 runs a model config's `model_warmup` samples in each new instance before
that instance takes requests, on a full load and on an in-place instance update alike (checked here on sim_cold:
a scale-up under 4 clients served its first requests in at most 28 ms with a warm-up, 882 ms without), almost
always: in 2 of about 26 in-place scale-ups under load measured here one request took 889-894 ms, before the
update had returned: Triton let it into the new instance ahead of the samples (the Python backend's; not seen
on a full load). So where
the model reads cold and its config has no `model_warmup`, the controller reloads it once with one (a full reload
at the live settings, at a quiet moment; the old copy serves meanwhile), and every later change keeps it
(`actuation.with_settings` starts from the live config).

The samples: zero data (Triton's `zero_data`) for each required input at its declared shape, one execution
(`count: 1`) per batch size. The sizes: every size up to `max_batch_size` where that is at most ALL_UP_TO; above,
the powers of two up to it and itself, then the sizes that made up 99% of the model's executions since it loaded
(its statistics' `batch_stats`; most frequent first, the smaller of equals) up to MAX_SIZES in all. Each size
warmed adds one execution to every instance's load; a size left out is paid on the first batch of that size in
each new instance, as a 23-76 ms extra pass did on an H200 (docs/results.md, "A real GPU (H200)"). Why not only
the sizes executed so far: a busier hour makes sizes a quiet one never ran. cold_start r87 warmed 1, 2, 3 and 5,
what the night had run; on the morning ramp each new size's first run (50 ms more on sim_cold) queued requests
into still larger, still cold, batches on the one instance: p99s of 146-161 ms in four seconds before the
scale-up. Examples: max_batch_size 8 -> [1, ..., 8]; max_batch_size 128 with executions since the load
{3: 700, 5: 250, 1: 40, 6: 10} -> [1, 2, 4, 8, 16, 32, 64, 128] and 3, 5 (1 is there: 99.0%) -> 10 sizes.

Not made (`samples` says why, and `status` shows it) where zero data is not a request the model is known to take:
an input of variable shape (a -1 dimension: which shape?), a string input (empty strings), a shape tensor (zeros
as a shape). A warm-up the model refuses fails the load; Triton then keeps the old copy serving, and the controller
does not try again (`loop.Controller._warm_up_now`). A config that has its own `model_warmup` is left as it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAMPLE_PREFIX = "triton_autotune_warmup_b"   # our samples' names: `status` tells them from the model's own
ALL_UP_TO = 32      # every batch size up to max_batch_size where that is at most this ...
COVER = 0.99        # ... else powers of two, and sizes making up this share of the executions since the load, ...
MAX_SIZES = 16      # ... up to this many sizes in all
MILD_SHARE = 0.05   # a cold start costing each of its executions less than this share of the p99 target is mild
BUSY_MAX = 0.5      # the warm-up's full reload waits for a tick where the instances are at most this busy ...
WAIT_MAX_S = 300.0  # ... or until it has waited this long (`loop.Controller._warm_up_now`)
_NO_ZERO_TYPES = ("TYPE_STRING",)


def mild(cold: Mapping[str, Any], target_ms: float) -> bool:
    """Whether a cold start (`service.ServiceTimes.cold_start`'s reading) is too mild to pay for the full reload that
    adds a warm-up: its executions took on average less than MILD_SHARE x the p99 target more than the curve's.

    Why: a settle reads cold on its total excess (the executions' worth it lost) and a ratio of 1.25 over the curve,
    which a CPU model's first executions reach with warm caches and thread pools still to come, as a GPU's reach
    with its clocks still low: the torch MLP of scripts/scenarios/repos/cpu_mlp (r111) read 4.7 ms against 3.3 and
    was warmed up by a full reload on the morning ramp (its p99 there 45.6 ms, the static arm's worst phase 32.7),
    1.4 ms an execution against a 100-ms target, which no request misses its target by. A cold start that matters
    is one a request waits on: sim_cold's 800-ms first execution per instance read 19.9 ms against 10.0 (10 ms
    more on average, diluted by the warm instance beside it; 25% of its 40-ms target). Examples, target 100 ms:
    4.7 against 3.3 ms -> mild; 19.9 against 10.0 -> not."""
    more = excess_ms(cold)
    return more is not None and more < MILD_SHARE * float(target_ms)


def excess_ms(cold: Mapping[str, Any]) -> float | None:
    """How much longer a cold start's executions took on average than the curve's (ms); None where unreadable."""
    try:
        return float(cold["ms"]) - float(cold["usual_ms"])
    except (KeyError, TypeError, ValueError):
        return None


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
    """The batch sizes to warm (see the module's doc); [1] for a model without batching (max_batch_size 0)."""
    if max_batch_size <= 0:
        return [1]
    if max_batch_size <= ALL_UP_TO:
        return list(range(1, max_batch_size + 1))
    chosen = {max_batch_size} | {1 << k for k in range(max_batch_size.bit_length()) if 1 << k <= max_batch_size}
    counts = sorted(((n, b) for b, n in executed.items() if 1 <= b <= max_batch_size and n > 0), key=lambda c: (-c[0], c[1]))
    total, covered = sum(n for n, _ in counts), 0
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
    return entries, f"zero data at batch size(s) {spans(chosen)}"


def spans(values: list[int]) -> str:
    """Sorted integers, runs of three or more as a span: [1, 2, 3, 4, 8, 16] -> "1-4, 8, 16"."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b - a >= 2 else (f"{a}, {b}" if b > a else f"{a}") for a, b in runs)
