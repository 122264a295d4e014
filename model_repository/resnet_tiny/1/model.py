"""Triton Python-backend model: serves network.ResNetTiny with torch.

Device choice: an instance Triton made KIND_GPU runs on `cuda:<model_instance_device_id>`
(its own device); a KIND_CPU instance, or a GPU instance where torch sees no CUDA, runs on
the CPU with `cpu_count // total instances` torch threads (at least 1), so that several
instances do not oversubscribe the cores. Each `execute` call runs every well-formed request
of the batch in one forward pass; a malformed request gets its own error response.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.dont_write_bytecode = True  # a __pycache__ in the version folder would turn count changes into full reloads

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import network  # noqa: E402

INPUT_SHAPE = (3, 32, 32)


def _param(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.instance_name = args["model_instance_name"]
        kind = args.get("model_instance_kind", "CPU")
        device_id = int(args.get("model_instance_device_id", 0) or 0)
        if kind == "GPU" and torch.cuda.is_available():
            self.device = torch.device(f"cuda:{device_id}")
        else:
            if kind == "GPU":
                pb_utils.Logger.log_warn(f"{self.instance_name}: KIND_GPU but torch has no CUDA; running on CPU")
            self.device = torch.device("cpu")
            total = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
            threads = int(_param(config, "cpu_threads_per_instance", "0")) or max(1, (os.cpu_count() or 1) // total)
            torch.set_num_threads(threads)
        weights = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.pt")
        self.net = network.build(int(_param(config, "seed", "0")), weights).to(self.device)
        self.max_batch = int(config.get("max_batch_size", 0)) or 1

        # Own metrics. The families stay referenced on self: if a family is garbage-collected,
        # every later set()/increment() on its metrics fails (and with it every request).
        labels = {"model": self.model_name, "instance": self.instance_name}
        self.fam_exec = pb_utils.MetricFamily("model_executions_total", "Batches executed by this instance", pb_utils.MetricFamily.COUNTER)
        self.fam_items = pb_utils.MetricFamily("model_executed_items_total", "Requests run in those batches", pb_utils.MetricFamily.COUNTER)
        self.fam_us = pb_utils.MetricFamily("model_execution_us_total", "Microseconds spent in forward passes", pb_utils.MetricFamily.COUNTER)
        self.fam_batch = pb_utils.MetricFamily("model_last_batch_size", "Size of the last executed batch", pb_utils.MetricFamily.GAUGE)
        self.m_exec = self.fam_exec.Metric(labels=labels)
        self.m_items = self.fam_items.Metric(labels=labels)
        self.m_us = self.fam_us.Metric(labels=labels)
        self.m_batch = self.fam_batch.Metric(labels=labels)
        pb_utils.Logger.log_info(f"{self.instance_name}: resnet_tiny on {self.device}")

    def _validate(self, request) -> np.ndarray | str:
        tensor = pb_utils.get_input_tensor_by_name(request, "INPUT")
        if tensor is None:
            return "missing input 'INPUT'"
        x = tensor.as_numpy()
        if x.dtype != np.float32:
            return f"INPUT must be FP32, got {x.dtype}"
        if x.ndim != 4 or tuple(x.shape[1:]) != INPUT_SHAPE:
            return f"INPUT must have shape [batch, 3, 32, 32], got {list(x.shape)}"
        if not np.isfinite(x).all():
            return "INPUT contains NaN or Inf"
        return x

    def execute(self, requests):
        checked = [self._validate(r) for r in requests]
        good = [x for x in checked if not isinstance(x, str)]
        outputs = []
        if good:
            t0 = time.perf_counter()
            batch = torch.from_numpy(np.concatenate(good)).to(self.device)
            with torch.inference_mode():
                logits = self.net(batch).float().cpu().numpy()
            elapsed_us = (time.perf_counter() - t0) * 1e6
            self.m_exec.increment(1)
            self.m_items.increment(len(good))
            self.m_us.increment(elapsed_us)
            self.m_batch.set(len(good))
            offsets = np.cumsum([0] + [len(x) for x in good])
            outputs = [logits[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        responses, it = [], iter(outputs)
        for x in checked:
            if isinstance(x, str):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(x)))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("LOGITS", next(it))]))
        return responses

    def finalize(self):
        self.net = None
