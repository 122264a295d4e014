"""A model of the server: what p99 a configuration gives at an arrival rate (pure, no I/O).

Today the controller only *checks* this model: each observation carries the p99 predicted for the
live configuration at the measured arrival rate (`Observation.predicted_p99_ms`), logged next to the
measured one, so the bench can say how far prediction and reality are apart before anything decides
on it (issue 10 builds the choice on top).

The model is a small event simulation of Triton's dynamic batcher in front of `n` instances:

* requests arrive as a Poisson process of rate λ;
* an instance that is free takes the queued requests as one batch (at most `max_batch`) as soon as
  the oldest has waited `delay_us` or the queue holds a full batch; with a delay of 0 it takes
  whatever is queued at once (so under load a queue batches by itself);
* an execution of a batch of b takes s(b) ms, the service curve measured for this configuration
  (`service.ServiceFit.predict_ms`), the same for every instance: contention between instances on
  one device is already inside a curve measured at this instance count;
* a request's latency is its wait in the queue plus its batch's execution.

Worked example (`simulate(100, 1, 0, 8, lambda b: 6 + 1.5 * b)`): one instance busy 7.5 ms for a
lone request could serve 133 req/s unbatched; at 100 req/s requests often arrive while it is busy and
leave together: batches average ~1.2, the instance is busy ~63% of the time, p99 ~19 ms (mean ~11).
The same load on 2 instances: batches of ~1.04, busy ~36%, p99 ~14 ms. At 600 req/s one instance
cannot keep up even with full batches of 8 (8 / 18 ms = 444 req/s): `stable` is False.
Each call simulates `requests` arrivals (default 2,000, a few ms of CPU) with a fixed seed, so the
same inputs give the same answer.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Prediction:
    """What the simulation says for one configuration at one arrival rate."""

    p99_ms: float
    mean_ms: float
    mean_batch: float
    busy: float            # mean fraction of time the instances spend executing
    stable: bool           # False when the queue grew to the end: the configuration cannot hold the load


def simulate(arrival_rps: float, instances: int, delay_us: int, max_batch: int,
             service_ms: Callable[[int], float], requests: int = 2000, seed: int = 0) -> Prediction | None:
    """Simulate the dynamic batcher; None when there is nothing to predict (no arrivals, bad inputs)."""
    if not (arrival_rps > 0 and math.isfinite(arrival_rps)) or instances < 1 or requests < 10:
        return None
    max_batch = max(1, int(max_batch))
    delay_s = max(0, int(delay_us)) / 1e6
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / arrival_rps, requests))
    queue: deque[float] = deque()
    free_at = [0.0] * instances                 # when each instance is next free
    heapq.heapify(free_at)
    latencies: list[float] = []
    batches: list[int] = []
    busy_s = 0.0
    i = 0
    while i < requests or queue:
        t_free = free_at[0]
        if not queue:                           # wait for the next arrival
            queue.append(arrivals[i])
            i += 1
            continue
        # the batch leaves when an instance is free and (the oldest waited long enough or the batch is full)
        ready = max(t_free, queue[0] + delay_s)
        while i < requests and len(queue) < max_batch and arrivals[i] <= ready:
            queue.append(arrivals[i])
            i += 1
        start = max(t_free, queue[0] + delay_s) if len(queue) < max_batch else max(t_free, queue[max_batch - 1])
        b = min(len(queue), max_batch)
        run_s = max(0.0, float(service_ms(b))) / 1000.0
        heapq.heapreplace(free_at, start + run_s)
        for _ in range(b):
            latencies.append(start + run_s - queue.popleft())
        batches.append(b)
        busy_s += run_s
    horizon = max(max(free_at), arrivals[-1])
    in_order = np.array(latencies) * 1000.0          # batches leave in arrival order
    half = len(in_order) // 2
    # why: a queue that only grows makes the later requests wait far longer than the earlier ones
    stable = bool(np.mean(in_order[half:]) < 2.0 * np.mean(in_order[:half]) + 1.0)
    lat = np.sort(in_order)
    return Prediction(p99_ms=float(lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]),
                      mean_ms=float(lat.mean()), mean_batch=float(np.mean(batches)),
                      busy=busy_s / (horizon * instances), stable=stable)
