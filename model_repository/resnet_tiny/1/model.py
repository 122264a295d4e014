"""Triton Python-backend model: serves network.ResNetTiny with torch.

Device choice: an instance Triton made KIND_GPU runs on `cuda:<model_instance_device_id>`
(its own device); a KIND_CPU instance, or a GPU instance where torch sees no CUDA, runs on
the CPU with `(usable cores - 1) // live instances` torch threads (at least 1; `thread_budget`): several
instances do not oversubscribe the cores, and one core is left to the server's own threads (its HTTP/gRPC
frontends, the batcher, the stubs' messages). Why the core left: a torch op runs on a team of threads that
waits for its slowest member, so where the team spans every core, any other thread that runs stalls the op.
Measured on 2 cores (`python -m controller sweep --model resnet_tiny --instances 1,2 --delays-us 0 --rates
150,300,390 --seconds 8`, the load generator on the same cores): one instance with 2 threads missed a 40-ms p99
at 300 and 390 req/s (61.8 and 134.2 ms), with 1 thread it held both (17.6 and 18.0 ms); and while a scale-up's
new stub started (importing torch, building the model: 1.8-5.4 s there), the 2-thread instance's 1-s p99s rose to
0.3-1.2 s (docs/results.md, "The shipped torch model on the CPU"). "Usable cores":
the process's CPU affinity, capped by a container's CPU limit (cgroup `cpu.max` or v1's CFS quota), where
`os.cpu_count()` would give the whole host's (`usable_cpus`); the `cpus` parameter, if set, says it instead.

The number of live instances is NOT read from the config: after an in-place instance update the
running instances keep the config of their own load (a stale count). Instead every CPU instance
registers its stub process in a small shared folder (`$RESNET_TINY_DIR`, else
`<tmp>/resnet_tiny_<tritonserver pid>/<model name>/`, one empty file per stub pid, removed in
finalize, with the folders by the last instance) and, at most once a second at the start of an `execute`,
counts the entries whose process is still alive (a killed stub's file is ignored and removed). Instances
added or removed in place are therefore seen by the old ones within a second of their next batch. The
`cpu_threads_per_instance` parameter, if set, overrides the budget.

Each `execute` call runs every well-formed request of the batch in one forward pass; a malformed
request gets its own error response. If that forward pass raises, the requests are run again one
by one: the good ones are answered and each one that still fails gets its own error.

Before `initialize` returns, each instance runs one forward pass of zeros at each batch size of the
`warmup_batch_sizes` parameter, so that a new instance, one added by a scale-up included, does not serve
its first requests cold. "auto" (the default) is every size up to max_batch_size on a GPU (up to 64, then
powers of two, so that a large max_batch_size does not make every load slow) and 1, 2, 4, ... and
max_batch_size on the CPU; "all" is every size; "0" (or "none", or empty) is none; else a comma-separated
list. A bad value fails the load, naming it.
Measured on an H200 (docs/bench/gpu_h200/): in a fresh process the first pass took 846 ms at batch 1 and
23-76 ms at each further batch size seen for the first time (3 and 5 too, after 1, 2, 4, 8, 16 and 32 had
run; cuDNN's per-shape set-up is the likely cause, not checked), and 1.6-2.1 ms from the second pass on;
without a warm-up the first 3 s at 50 req/s had a p99 of 256-325 ms, with the powers-of-two warm-up 7-9 ms.
Every size on a GPU follows from that per-shape cost (about 0.6 s more per instance load at max_batch_size
32; not yet measured in a bench); on the CPU the first pass at a new size costs little beside the pass
itself, and 32 sizes would add about a second (an estimate) to every load on a 2-core host (the powers of
two took 115-150 ms there).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
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


EVERY_SIZE_UP_TO = 64   # "auto" on a GPU: every batch size up to this, powers of two above (bounds the load time)


def warmup_batch_sizes(text: str, max_batch: int, on_gpu: bool) -> list[int]:
    """The batch sizes of the warm-up (see the module's docstring). Raises ValueError naming a bad value.
    Example, max_batch 32: "auto" on the CPU -> [1, 2, 4, 8, 16, 32]; on a GPU -> [1, 2, ..., 32];
    "8,1" -> [1, 8]; "0" -> []; "4,64" -> ValueError."""
    text = text.strip().lower()
    powers, b = [], 1
    while b < max_batch:
        powers.append(b)
        b *= 2
    powers.append(max_batch)
    if text == "all":
        return list(range(1, max_batch + 1))
    if text == "auto":
        if not on_gpu:
            return powers
        return sorted(set(range(1, min(max_batch, EVERY_SIZE_UP_TO) + 1)) | set(powers))
    if text in ("", "0", "none"):
        return []
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and part.isascii() for part in parts) or \
            any(not 1 <= int(part) <= max_batch for part in parts):
        raise ValueError(f"parameter warmup_batch_sizes {text!r}: expected 'auto', 'all', '0', or comma-separated "
                         f"batch sizes from 1 to max_batch_size {max_batch}")
    return sorted({int(part) for part in parts})


def usable_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup's CPU quota (a container's CPU limit:
    v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded down, at least 1. Example: a pod limited
    to 2.5 CPUs on a 64-core node: 2 (os.cpu_count() says 64)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = None
    for path, period in (("/sys/fs/cgroup/cpu.max", None),
                         ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(path) as f:
                parts = f.read().split()
            if period is not None:
                with open(period) as f:
                    parts = parts[:1] + f.read().split()[:1]
        except OSError:
            continue
        if len(parts) >= 2 and parts[0] not in ("max", "-1"):
            try:
                quota = int(parts[0]) / int(parts[1])
            except (ValueError, ZeroDivisionError):
                quota = None
        break
    if quota is not None and quota > 0:
        n = min(n, int(quota))
    return max(1, n)


def _count_param(config: dict, key: str) -> int:
    """A parameter that counts something: a whole number >= 0 (0 or absent: not set). A bad value fails the load,
    naming it."""
    text = _param(config, key, "0").strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"parameter {key}: expected a whole number >= 0 (0: not set), got {text!r}")
    return int(text)


def thread_budget(cpus: int, live_instances: int) -> int:
    """torch threads for each of `live_instances` CPU instances on `cpus` usable cores: one core left to the
    server's own threads, the rest shared out, at least 1 (see the module docstring). 2 cores: 1 thread at 1
    instance and at 2; 16 cores: 15, 7, 5 at 1, 2, 3 instances."""
    return max(1, (max(1, cpus) - 1) // max(1, live_instances))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (killed, not yet reaped) is not a live instance
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class SiblingRegistry:
    """Live stub processes of this model on this server: one file per pid in a shared folder."""

    def __init__(self, model_name: str):
        given = os.environ.get("RESNET_TINY_DIR")
        base = given or os.path.join(tempfile.gettempdir(), f"resnet_tiny_{os.getppid()}")
        self.dir = os.path.join(base, model_name)
        self.path = os.path.join(self.dir, str(os.getpid()))
        # why: the folders the last instance's close removes; a folder given by the user stays
        self.folders = [self.dir] if given else [self.dir, base]
        for attempt in range(3):
            os.makedirs(self.dir, exist_ok=True)
            try:
                with open(self.path, "w"):
                    pass
                break
            except FileNotFoundError:   # why: the last sibling's close removed the folder between the two calls
                if attempt == 2:
                    raise

    def count(self) -> int:
        live = 0
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:       # why: removed under it (by hand): count itself, never fail a request
            return 1
        for name in names:
            if not name.isdigit():
                continue
            if _alive(int(name)):
                live += 1
            else:
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
        return max(1, live)

    def close(self) -> None:
        """Unregister; the last instance removes the folders too (each server otherwise left two in /tmp)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        for folder in self.folders:
            try:
                os.rmdir(folder)        # only an empty one: a sibling still registered keeps it
            except OSError:
                break


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
        self.max_batch = int(config.get("max_batch_size", 0)) or 1
        # checked before anything is set up, so that a bad value fails the load at once
        sizes = warmup_batch_sizes(_param(config, "warmup_batch_sizes", "auto"), self.max_batch,
                                   self.device.type == "cuda")
        self.fixed_threads = _count_param(config, "cpu_threads_per_instance")
        self.cpus = _count_param(config, "cpus") or usable_cpus()
        self.siblings = SiblingRegistry(self.model_name) if self.device.type == "cpu" and not self.fixed_threads else None
        self.threads, self._threads_checked = 0, 0.0
        if self.device.type == "cpu":
            self._budget_threads(force=True)
        # fault injection for the tests only: with the config parameter `fault_injection: "1"`, a request carrying
        # the request parameter `fail_forward: true` makes the forward pass of its batch raise
        self.fault_injection = _param(config, "fault_injection", "0") == "1"
        weights = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.pt")
        self.net = network.build(int(_param(config, "seed", "0")), weights).to(self.device)
        t0 = time.perf_counter()
        for b in sizes:    # not counted in the model's own metrics below: no request was served
            self._forward([np.zeros((b, *INPUT_SHAPE), np.float32)], [])
        if sizes:
            shown = f"1-{sizes[-1]}" if len(sizes) > 2 and sizes == list(range(1, sizes[-1] + 1)) else ",".join(map(str, sizes))
            pb_utils.Logger.log_info(f"{self.instance_name}: warmed up on {self.device} at batch sizes {shown} "
                                     f"in {(time.perf_counter() - t0) * 1e3:.0f} ms")

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
        self.fam_threads = pb_utils.MetricFamily("model_torch_threads", "torch intra-op threads of this instance", pb_utils.MetricFamily.GAUGE)
        self.m_threads = self.fam_threads.Metric(labels=labels)
        self.m_threads.set(self.threads)
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

    def _budget_threads(self, force: bool = False) -> None:
        """torch threads = thread_budget(usable cores, live sibling instances), re-counted at most once a second."""
        now = time.monotonic()
        if not force and now - self._threads_checked < 1.0:
            return
        self._threads_checked = now
        threads = self.fixed_threads or thread_budget(self.cpus, self.siblings.count())
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
            if hasattr(self, "m_threads"):
                self.m_threads.set(threads)

    def _wants_failure(self, request) -> bool:
        if not self.fault_injection:
            return False
        try:
            return bool(json.loads(request.parameters() or "{}").get("fail_forward"))
        except (ValueError, AttributeError):
            return False

    def _forward(self, xs: list[np.ndarray], reqs: list) -> np.ndarray:
        if any(self._wants_failure(r) for r in reqs):
            raise RuntimeError("injected failure in the forward pass (fault_injection)")
        batch = torch.from_numpy(np.concatenate(xs)).to(self.device)
        with torch.inference_mode():
            return self.net(batch).float().cpu().numpy()

    def execute(self, requests):
        if self.device.type == "cpu":
            self._budget_threads()
        checked = [self._validate(r) for r in requests]
        results: list = list(checked)            # per request: an error text or its logits
        good = [i for i, x in enumerate(checked) if not isinstance(x, str)]
        if good:
            t0 = time.perf_counter()
            try:
                logits = self._forward([checked[i] for i in good], [requests[i] for i in good])
                offsets = np.cumsum([0] + [len(checked[i]) for i in good])
                for i, a, b in zip(good, offsets[:-1], offsets[1:]):
                    results[i] = logits[a:b]
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch: retry one by one
                pb_utils.Logger.log_warn(f"{self.instance_name}: forward pass of a batch of {len(good)} raised "
                                         f"({e}); retrying its requests one by one")
                for i in good:
                    try:
                        results[i] = self._forward([checked[i]], [requests[i]])
                    except Exception as e1:  # noqa: BLE001
                        results[i] = f"forward pass failed: {type(e1).__name__}: {e1}"
            elapsed_us = (time.perf_counter() - t0) * 1e6
            self.m_exec.increment(1)
            self.m_items.increment(len(good))
            self.m_us.increment(elapsed_us)
            self.m_batch.set(len(good))
        responses = []
        for r in results:
            if isinstance(r, str):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(r)))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("LOGITS", r)]))
        return responses

    def finalize(self):
        if self.siblings is not None:
            self.siblings.close()
        self.net = None
