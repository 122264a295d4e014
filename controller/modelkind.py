"""What a model is, read from its live config, and which knobs the controller may turn on it.

`classify(config)` looks only at the ModelConfig JSON that `GET /v2/models/<m>/config` (or gRPC
`get_model_config`) returns. The rules:

* **ensemble** (`platform: "ensemble"`): no instances of its own (its steps run in their own models) and
  no batching delay; loading it with an instance count is refused by the server. Never reloaded: not
  managed. Its steps (`ensemble_scheduling.step[].model_name`) are managed, and its p99 target is passed
  to the step that holds its latency (controller/ensemble.py).
* **decoupled** (`model_transaction_policy.decoupled: true`, streaming): **not managed**. Every latency
  figure the controller has (request traces REQUEST_START -> REQUEST_END, the server's queue and compute
  counters, the summary quantile) measures a request until its *last* response, while a streaming client
  waits for the *first*; a p99 target would be misread and instances added for long streams rather than for
  a queue. The model is observed and shown in `status`, and the start-up line says so; nothing is changed.
* **no batching** (`max_batch_size: 0`): instances only; the delay knob does not exist.
* **batching without `dynamic_batching`** (e.g. `sequence_batching`): instances only; the controller does
  not add a dynamic batcher the user did not write. With no scheduler at all (`max_batch_size` > 0 alone: Triton's
  default scheduler) each request runs alone, so the planner simulates executions of one request
  (`batches_requests`).
* **a sequence batcher** (stateful: `sequence_batching`): instances are **only added** while it has requests,
  unless the model's `sequence_scale_down: true`, and it is never claimed with a full reload (loop._claim_now).
  Once no request has come for longer than its `max_sequence_idle_microseconds` (Triton's own idle timeout, 1 s
  by default; `sequence_idle_s`) and a margin, Triton has ended every sequence itself, so none is live and
  instances may be removed again (loop._keep_sequences). Measured on 2.51
  (an accumulator per sequence held in the instance, 6-8 live sequences, each request checked): a full reload
  ended all 6 live sequences (their next request: "must specify the START flag on the first request of the
  sequence"); of 11 in-place scale-downs (3 -> 1, 2 -> 1) one ended 2 of its 6 checked (the others kept every
  sequence on its instance; 8 of them, that one included, ran beside up to 6 unchecked sequences more: see
  docs/results.md); no in-place scale-up ended any. Those refusals are counted in no
  `nv_inference_request_failure` series, so the controller could not even see the requests it lost. A repair
  (a crashed instance: a full reload) still happens: the dead instance's sequences are lost already.
* otherwise: instances and the batching delay.

A Python model that calls other models (BLS) has the same config as any Python model, so it cannot be told
apart here: it is managed like any other (its compute time includes the time of the models it calls; the
policy's check that an added instance brought throughput or a lower p99 is what stops it scaling a BLS
model whose callee is the bottleneck). Where it passes its request's trace on to its calls
(`trace=request.trace()`), the request traces show whom it calls (controller/calls.py), and its target is
passed to them as an ensemble's is to its steps (controller/ensemble.py).
"""
from __future__ import annotations

from dataclasses import dataclass

ENSEMBLE = "ensemble"


@dataclass(frozen=True)
class ModelKind:
    backend: str                 # "ensemble", "python", "onnxruntime", "tensorrt", ... ("?" when unknown)
    decoupled: bool = False
    max_batch_size: int = 0
    dynamic_batching: bool = False
    sequence_batching: bool = False
    steps: tuple[str, ...] = ()  # an ensemble's composing models, in step order

    @property
    def ensemble(self) -> bool:
        return self.backend == ENSEMBLE

    @property
    def batches_requests(self) -> bool:
        """The server puts several requests into one execution: a dynamic or a sequence batcher does; the default
        scheduler (neither written: `max_batch_size` > 0 alone) runs each request as it came, with the items the
        client put in it (Triton's scheduler docs; tests/test_items_live.py measured it on 2.51: batch sizes
        only ever the requests' own)."""
        return self.max_batch_size > 0 and (self.dynamic_batching or self.sequence_batching)

    @property
    def managed(self) -> bool:
        return not self.ensemble and not self.decoupled

    @property
    def instances(self) -> bool:
        """The instance count is a knob."""
        return self.managed

    @property
    def delay(self) -> bool:
        """The dynamic batcher's max_queue_delay_microseconds is a knob."""
        return self.managed and self.max_batch_size > 0 and self.dynamic_batching

    @property
    def hold_reason(self) -> str:
        """The decision reason while the model is left alone ("" when it is managed)."""
        if self.ensemble:
            return "HoldEnsemble"
        if self.decoupled:
            return "HoldDecoupled"
        return ""

    def what(self) -> str:
        """e.g. "python, batching up to 32, dynamic batcher"."""
        if self.ensemble:
            return "ensemble of " + (", ".join(self.steps) if self.steps else "no steps")
        parts = [self.backend]
        if self.decoupled:
            parts.append("decoupled")
        parts.append(f"batching up to {self.max_batch_size}" if self.max_batch_size > 0 else "no batching (max_batch_size 0)")
        if self.dynamic_batching:
            parts.append("dynamic batcher")
        if self.sequence_batching:
            parts.append("sequence batcher")
        return ", ".join(parts)

    def knobs(self) -> str:
        """Which knobs, and why, in a few words: the start-up line and `status` show it."""
        if self.ensemble:
            return ("none: an ensemble has no instances of its own and is never reloaded "
                    "(its target goes to the step that holds its latency)")
        if self.decoupled:
            return ("none: decoupled (streaming); the latency figures measure a request until its last response, "
                    "not the time to first response, so it is observed but not changed")
        if self.delay:
            return "instances and batching delay"
        if self.max_batch_size <= 0:
            return "instances only: no batching (max_batch_size 0), so no batching delay"
        if self.sequence_batching:
            return ("instances only, added but not removed while it has requests (unless sequence_scale_down: "
                    "true): a sequence batcher (stateful), not a dynamic one")
        return "instances only: no dynamic_batching section (the controller does not add one)"

    def describe(self) -> str:
        return f"{self.what()}; knobs: {self.knobs()}"


def classify(config: dict) -> ModelKind:
    """The kind of the model whose live ModelConfig JSON is `config` (HTTP or gRPC JSON, either spelling)."""
    platform = str(config.get("platform") or "")
    backend = str(config.get("backend") or "")
    scheduling = config.get("ensemble_scheduling") or config.get("ensembleScheduling") or {}
    if platform == ENSEMBLE or scheduling:
        steps = tuple(str(s.get("model_name") or s.get("modelName") or "?") for s in scheduling.get("step", []))
        return ModelKind(ENSEMBLE, steps=steps)
    policy = config.get("model_transaction_policy") or config.get("modelTransactionPolicy") or {}
    return ModelKind(
        backend=backend or platform or "?",
        decoupled=_true(policy.get("decoupled")),
        max_batch_size=int(config.get("max_batch_size", config.get("maxBatchSize", 0)) or 0),
        dynamic_batching="dynamic_batching" in config or "dynamicBatching" in config,
        sequence_batching=bool(config.get("sequence_batching") or config.get("sequenceBatching")),
    )


DEFAULT_SEQUENCE_IDLE_S = 1.0     # Triton's max_sequence_idle_microseconds when the config leaves it 0 or out


def sequence_idle_s(config: dict) -> float:
    """A sequence batcher's idle timeout in seconds: Triton ends a sequence that has had no request for this
    long (`max_sequence_idle_microseconds`, either JSON spelling, a number or a string; 1 s when 0 or absent)."""
    seq = config.get("sequence_batching") or config.get("sequenceBatching") or {}
    if not isinstance(seq, dict):
        return DEFAULT_SEQUENCE_IDLE_S
    raw = seq.get("max_sequence_idle_microseconds", seq.get("maxSequenceIdleMicroseconds"))
    try:
        us = float(raw or 0)
    except (TypeError, ValueError):
        us = 0.0
    return us / 1e6 if us > 0 else DEFAULT_SEQUENCE_IDLE_S


def _true(value) -> bool:
    return value is True or str(value).lower() == "true"


def start_line(name: str, kind: ModelKind) -> str:
    """The one line logged per managed model at start: what it is, which knobs and why."""
    return f"{name}: {kind.describe()}"
