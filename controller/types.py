"""Plain data shared by the loop's four parts (signals -> decision -> actuation, config).

Everything here is an immutable value: no I/O, no clocks. Times are seconds on the
controller's monotonic clock unless the name says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # why: service.py imports Settings from here
    from .cpu import CpuUse
    from .service import Jitter, ServiceFit


@dataclass(frozen=True)
class Settings:
    """The two knobs the controller turns for one model."""

    instance_count: int
    max_queue_delay_us: int


@dataclass(frozen=True)
class GpuObservation:
    """One device as NVML (or the simulated device) reports it."""

    index: int
    utilization_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    process_memory_bytes: tuple[tuple[int, int], ...] = ()  # (pid, used bytes) per compute process, where NVML reports it


@dataclass(frozen=True)
class Observation:
    """What one model did over one sliding window, derived from server counters.

    Rates are per second over `span_s`, the time actually covered by valid samples
    (shorter than the configured window after a counter reset or at start-up).
    `valid` is False when there is not enough data to judge (fewer than two samples
    since the last reset, or the scrape failed); every other field is then meaningless.
    """

    valid: bool
    span_s: float = 0.0
    since: float = 0.0                    # time of the oldest sample used
    arrival_rps: float = 0.0              # requests that reached the server
    completion_rps: float = 0.0           # successful requests
    failure_rps: float = 0.0              # failed requests, every reason
    shed_rps: float = 0.0                 # ... of which refused by the scheduler or cancelled (load, not a fault)
    exec_rps: float = 0.0                 # model executions (batches) per second
    avg_batch_size: float = 0.0           # inferences per execution
    items_per_request: float = 1.0        # items (inferences) a successful request carried on average: Triton's batch
                                          # sizes count items, its rates requests (a client may send 4 items at once)
    pending_mean: float = 0.0             # nv_inference_pending_request_count, mean over window
    queue_ms_per_request: float = 0.0     # mean time a request waited in the scheduler queue
    compute_ms_per_request: float = 0.0   # mean input+infer+output time charged to a request
    request_ms_mean: float = 0.0          # mean end-to-end server time per request
    p99_ms: float | None = None           # see observer.ModelObserver: the best figure available
    p99_source: str = "none"              # "trace" | "summary" | "mean_x_tail_ratio" | "interval_mean_max" | "none"
    p99_samples: int = 0                  # with "trace": the sampled requests behind the figure
    tail_ratio: float | None = None       # with "mean_x_tail_ratio": the factor on the mean ...
    tail_ratio_measured: bool = False     # ... learned from the server's summaries (False: the default, 2.0)
    predicted_p99_ms: float | None = None  # planner.simulate for the live config at this arrival rate (the planner's check)
    predicted_mean_ms: float | None = None  # ... and its mean latency (the check where no request is traced)
    tail_check: float | None = None       # untraced: the summaries' p99/mean over the simulation's for their last quiet
                                          # minute (observer._check_tail); None when traced or not yet measured
    busy_fraction: float = 0.0            # instance-seconds spent executing per second / instances
    busy_source: str = "requests"         # "batch_stats" (exact: observer) | "requests" (signals.busy_fraction: reads high)
    gpus: tuple[GpuObservation, ...] = ()
    cpu: "CpuUse | None" = None           # where the CPU is this model's device (cpu.py): the server's CPU over the window
    placement: tuple[tuple[str, int], ...] = ()   # this model's live instances per device (groups.py keys: "gpu1", "cpu")
    service: "ServiceFit | None" = None   # compute time per execution vs batch size, of the live config
    jitter: "Jitter | None" = None        # ... and how much one execution varies around it (service.execution_jitter)
    warming_up: bool = False              # the span holds the model's first executions since it loaded (observer)
    cold_start: "dict | None" = None      # the model's measured cold start after loads, or None (ServiceTimes.cold_start)
    loads_warm: bool = False              # its live config has Triton's model_warmup: a load's instances run it before
                                          # they serve, so a cold start no longer reaches requests (warmup.py)
    invalid_reason: str = ""              # when valid=False: "no_samples" | "scrape_failed" | "too_few_samples" | "span_too_short"

    @property
    def fault_rps(self) -> float:
        """Failed requests per second that are a fault (the model or an instance failed them), not load shed."""
        return max(0.0, self.failure_rps - self.shed_rps)


class Cap(str, Enum):
    """What holds a model's instance count when it wants more (the lowest ceiling wins)."""

    MAX = "max"                   # the configured max_instances
    LEARNED_MAX = "learned_max"   # a larger count failed to load recently (e.g. out of memory)
    SATURATED = "saturated"       # the last instance added brought nothing
    MEMORY = "memory"             # the memory budget

    @property
    def hold_reason(self) -> str:
        return {"max": "HoldAtMax", "learned_max": "HoldLearnedMax", "saturated": "HoldSaturated",
                "memory": "HoldMemoryCap"}[self.value]


@dataclass(frozen=True)
class Decision:
    """The policy's answer. `valid=False` means "do nothing", whatever `target` says.

    `held_by` is set when the model wants more instances than a ceiling allows: which ceiling.
    Other parts (the arbiter) act on that value, never on the reason text. `mode` says who decided:
    the planner's model ("model"), or the reactive rules ("reactive" when the planner is off,
    "fallback" when it stood aside; `detail` then says why); empty when a gate held (warm-up,
    settling, backoff, no data, a reload in flight) and nobody decided.
    """

    target: Settings
    reason: str
    valid: bool = True
    detail: str = ""
    held_by: Cap | None = None
    mode: str = ""                        # "model" | "reactive" | "fallback" (reactive, planner set aside) | "arbiter"; "": a gate held
    plan: dict | None = None              # with "model": the forecast band, the live and chosen candidates (for the log)
