"""The `sweep.json` document: what the offline sweep writes and the controller's warm start reads.

The sweep (controller/evaluation/sweep.py) measures cells and writes the document; the controller
(`controller.warm_start: sweep.json`, see loop.warm_start_points) and the bench read it back. Both
sides use this module, so the product never imports the harness. The document::

    {"model": "sim_accel", "sla_ms": 40, "seconds": 4, "warmup_s": 1, "seed": 0, "elapsed_s": 312.5,
     "cells": [{"instance_count": 2, "max_queue_delay_us": 0, "arrival_rps": 200.0, "offered_rps": 199.1,
                "completion_rps": 198.8, "goodput_rps": 198.0, "p50_ms": 9.1, "p99_ms": 31.0,
                "requests": 796, "failed": 0, "met_sla": true}, ...],
     "best_per_level": [{"arrival_rps": 200.0, "instance_count": 2, "max_queue_delay_us": 0,
                         "goodput_rps": 198.0, "p99_ms": 31.0, "met_sla": true}, ...]}

A cell "meets the SLA" when its p99 is within `sla_ms` and no request failed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .types import Settings


@dataclass(frozen=True)
class Cell:
    """One measured (config, offered load) point. Rates are per second of the measured window."""

    instance_count: int
    max_queue_delay_us: int
    arrival_rps: float          # the rate asked for (the load level)
    offered_rps: float          # requests actually scheduled in the measured window, per second
    completion_rps: float       # successful requests per second
    goodput_rps: float          # successful within the SLA per second
    p50_ms: float | None
    p99_ms: float | None
    requests: int
    failed: int
    met_sla: bool

    @property
    def settings(self) -> Settings:
        return Settings(self.instance_count, self.max_queue_delay_us)


def best_per_level(cells: Sequence[Cell]) -> list[dict]:
    """Per load level: fewest instances meeting the SLA, then highest goodput, then shorter delay.

    Example: at 150 req/s, (1 inst, 0 us) misses with p99 80 ms, (2, 0) meets with goodput 149.5
    and (4, 0) meets with goodput 150.0 -> (2, 0): the fewest instances that meet the SLA.
    """
    out = []
    for rate in sorted({c.arrival_rps for c in cells}):
        level = [c for c in cells if c.arrival_rps == rate]
        meeting = [c for c in level if c.met_sla]
        if meeting:
            best = min(meeting, key=lambda c: (c.instance_count, -c.goodput_rps, c.max_queue_delay_us))
        else:
            best = max(level, key=lambda c: (c.goodput_rps, -c.instance_count, -c.max_queue_delay_us))
        out.append({"arrival_rps": rate, "instance_count": best.instance_count,
                    "max_queue_delay_us": best.max_queue_delay_us, "goodput_rps": best.goodput_rps,
                    "p99_ms": best.p99_ms, "met_sla": best.met_sla})
    return out


def sweep_document(model: str, cells: Sequence[Cell], *, sla_ms: float, seconds: float, warmup_s: float,
                   seed: int, elapsed_s: float | None = None) -> dict:
    """The sweep.json document of these cells (shape in the module doc), with the best config per level."""
    return {"model": model, "sla_ms": sla_ms, "seconds": seconds, "warmup_s": warmup_s, "seed": seed,
            "elapsed_s": None if elapsed_s is None else round(elapsed_s, 1),
            "cells": [asdict(c) for c in cells], "best_per_level": best_per_level(cells)}


def load_sweep(path: str | Path) -> dict:
    """Read a sweep.json; ValueError with one line if it is not one."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"sweep file {p}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sweep file {p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), list) or not doc["cells"]:
        raise ValueError(f"sweep file {p}: expected a mapping with a non-empty 'cells' list")
    return doc


def cells_of(doc: dict) -> list[Cell]:
    fields = Cell.__dataclass_fields__
    try:
        return [Cell(**{k: c[k] for k in fields}) for c in doc["cells"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"sweep cells: each needs {', '.join(fields)} ({e})") from None
