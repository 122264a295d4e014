"""SIMULATED ACCELERATOR model for machines without a GPU (labelled as such everywhere).

Cost model of one execution of a batch of `b` requests (parameters from config.pbtxt):

    host part   : fixed_overhead_ms + host_per_item_ms * b      (device free: pre/post-processing,
                                                                 copies, launch gaps)
    device part : compute_base_ms + compute_per_item_ms * b, holding one of
                  `device_parallelism` slots of the shared device

With the shipped values (4 + 1/item on the host, 2 + 0.5/item on the device, 2 slots) one
instance at b=1 takes 7.5 ms (133 req/s) and at b=8 18 ms (444 req/s). The device runs
2 / 2.5 ms = 800 executions/s at b=1, so instances help up to about 6 and then saturate; at
b=8 an execution holds a slot for 6 ms, so batching raises the device's ceiling to
2 * 8 / 6 ms = 2667 req/s.

The slots are advisory file locks (fcntl.flock) in `$SIM_ACCEL_DIR/<device_name>/` (default
`<tmp>/sim_accel_<server pid>/`; the last instance to close removes it), so every
instance (one process each) and every model naming the same device share them. Sleeping costs
almost no CPU, so two cores are enough to simulate many instances.
Each instance keeps a buffer of `instance_memory_mb` (touched, so it is resident) and reports it
as `sim_device_memory_bytes`; `sim_device_busy_us_total` counts slot-holding time.

COLD START (off by default): `cold_first_execution_ms` is added to each instance's first execution and
`cold_new_batch_size_ms` to its first execution of each batch size, on the host side, as a GPU model that
does not warm up pays its CUDA context and per-shape kernel set-up in its first requests (measured on an
H200 with resnet_tiny and no warm-up: 846 ms for the first forward pass, 23-76 ms for each new batch size,
docs/bench/gpu_h200/). It lets the controller's handling of such models be tested on a CPU machine.

SEVERAL SIMULATED GPUs: an instance of a group named `<anything>_simgpu<k>` (KIND_CPU: the server has no
GPU) runs on simulated GPU k: its own slots (`<device_name>_gpu<k>`), and its memory and slot time also
reported as `sim_gpu<k>_memory_bytes` and `sim_gpu<k>_busy_us_total`. The controller reads such a group as
a group on GPU k (controller/groups.py) and the simulated device source reports one device per k.
Such a group must also say `host_policy: "simgpu<k>"`, or the model does not load. Why: on an in-place
update Triton 2.51 keeps a live instance wherever the new config has a group with the same *signature*,
which ignores the group's name and count (core's EquivalentInInstanceConfig); two KIND_CPU groups that
differ only in name are one signature, so an instance started as `m_simgpu1_0` could stay on as gpu0's
instance and go on reporting on GPU 1 (measured: 1+3 -> 1+1 read 0 MiB on GPU 0 and 128 on GPU 1). Real
GPU groups differ in `gpus`; the host policy plays that part here (one not defined on the server's command
line is an empty policy: no effect).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sys
import tempfile
import time

sys.dont_write_bytecode = True

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


def _param(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class SimulatedDevice:
    """`parallelism` slots shared across processes through flock'ed files in `<base>/<name>/`, and the instances
    that use them registered in its `stubs/` (one file per stub process, `record` in it).

    The last instance to close removes the device's folder, and the base folder where the user gave none
    (`/tmp/sim_accel_<server pid>`: every server that loaded the model left one behind). Opening and registering,
    and unregistering and removing, each happen under a lock on the base folder, so that an instance starting as
    the last one closes either registers first (and the folder stays) or finds it gone and makes it again; never
    holds slot files that were removed (its locks would then not be shared with the next instance's). A folder
    with a registration left in it (a stub that crashed, whose metrics a sibling zeroes) stays."""

    def __init__(self, name: str, parallelism: int, model_name: str, record: dict):
        given = os.environ.get("SIM_ACCEL_DIR")
        self.base = given or os.path.join(tempfile.gettempdir(), f"sim_accel_{os.getppid()}")
        self.remove_base = not given
        self.dir = os.path.join(self.base, name)
        self.stubs_dir = os.path.join(self.dir, "stubs")
        self.stub_file = os.path.join(self.stubs_dir, f"{model_name}.{os.getpid()}")
        self.slots = [os.path.join(self.dir, f"slot{i}") for i in range(parallelism)]
        with self._locked():
            os.makedirs(self.stubs_dir, exist_ok=True)
            self.fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o644) for path in self.slots]
            with open(self.stub_file, "w") as f:
                json.dump(record, f)
        self._next = os.getpid()

    @contextlib.contextmanager
    def _locked(self):
        """An exclusive lock on the base folder (made where missing); taken again where the folder was removed
        while this process waited for it."""
        while True:
            os.makedirs(self.base, exist_ok=True)
            try:
                fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:      # removed between the two calls
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.base).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)                   # releases the lock

    def acquire(self) -> int:
        for fd in self.fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                continue
        self._next += 1
        fd = self.fds[self._next % len(self.fds)]
        fcntl.flock(fd, fcntl.LOCK_EX)  # all slots busy: wait on one
        return fd

    @staticmethod
    def release(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unregister; the last instance removes the folders (see the class doc)."""
        with self._locked():
            for fd in self.fds:
                os.close(fd)
            self.fds = []
            try:
                os.remove(self.stub_file)
            except OSError:
                pass
            try:
                if os.listdir(self.stubs_dir):
                    return                 # a sibling, or a crashed stub's registration
            except FileNotFoundError:
                pass
            for path in self.slots:
                try:
                    os.remove(path)
                except OSError:
                    pass
            for folder in [self.stubs_dir, self.dir] + ([self.base] if self.remove_base else []):
                try:
                    os.rmdir(folder)       # only an empty one: another device's folder keeps the base
                except FileNotFoundError:
                    continue
                except OSError:
                    break


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed stub the server has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


SIM_GPU_GROUP = re.compile(r".*_simgpu(\d+)")   # a group on simulated GPU k (the controller's groups.py reads the same)


def _check_sim_gpu_groups(config: dict) -> None:
    """Every `*_simgpu<k>` group carries `host_policy: "simgpu<k>"` (see the module's docstring: without it an
    in-place update can move an instance to another simulated GPU's group while it reports on its own)."""
    for group in config.get("instance_group", []):
        m = SIM_GPU_GROUP.fullmatch(str(group.get("name", "")))
        if m and group.get("host_policy") != f"simgpu{m.group(1)}":
            raise pb_utils.TritonModelException(
                f"instance group '{group['name']}' runs on simulated GPU {m.group(1)} and needs "
                f"host_policy: \"simgpu{m.group(1)}\" (Triton matches instances across groups that differ only "
                f"in name, so without it an in-place update can move an instance to another simulated GPU)")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.instance_name = args["model_instance_name"]
        total = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        # why: an in-place instance update hands a new instance the config of the first load (the old count),
        # so the instance's own index (<model>_<group>_<index>) is what tells how many instances now exist
        try:
            total = max(total, int(self.instance_name.rsplit("_", 1)[1]) + 1)
        except (IndexError, ValueError):
            pass
        oom_above = int(_param(config, "oom_above_instances", "0"))
        if oom_above and total > oom_above:
            raise pb_utils.TritonModelException(
                f"simulated out of device memory: {total} instances requested, at most {oom_above} fit")
        self.overhead_s = float(_param(config, "fixed_overhead_ms", "4")) / 1e3
        self.host_per_item_s = float(_param(config, "host_per_item_ms", "1.0")) / 1e3
        self.base_s = float(_param(config, "compute_base_ms", "2")) / 1e3
        self.per_item_s = float(_param(config, "compute_per_item_ms", "0.5")) / 1e3
        self.cold_first_s = float(_param(config, "cold_first_execution_ms", "0")) / 1e3
        self.cold_size_s = float(_param(config, "cold_new_batch_size_ms", "0")) / 1e3
        self.sizes_run: set[int] = set()       # batch sizes this instance has executed (for the cold start)
        m = SIM_GPU_GROUP.fullmatch(self.instance_name.rsplit("_", 1)[0])
        self.sim_gpu = int(m.group(1)) if m else None      # which simulated GPU, for a `*_simgpu<k>` group
        _check_sim_gpu_groups(config)
        device = _param(config, "device_name", "sim0") + ("" if self.sim_gpu is None else f"_gpu{self.sim_gpu}")
        self.model_name = args["model_name"]
        self.device = SimulatedDevice(device, int(_param(config, "device_parallelism", "2")), self.model_name,
                                      {"instance": self.instance_name, "sim_gpu": self.sim_gpu})
        memory_bytes = int(float(_param(config, "instance_memory_mb", "64")) * 2**20)
        self.buffer = np.ones(memory_bytes // 8, dtype=np.float64)  # resident, like weights on a device

        # why `stub`: Triton 2.51 names the instances an in-place update adds by their index in the new count,
        # so 1 -> 3 can start a second live `<model>_0_1` beside the kept one; keyed by instance name alone the
        # two would share one series and the device's memory would read one instance short (a shared memory
        # budget was then overrun). One series per stub process; a full reload's new stubs get their own too.
        labels = {"model": args["model_name"], "instance": self.instance_name, "stub": str(os.getpid())}
        self.fam_mem = pb_utils.MetricFamily("sim_device_memory_bytes", "SIMULATED device memory held by this instance", pb_utils.MetricFamily.GAUGE)
        self.fam_busy = pb_utils.MetricFamily("sim_device_busy_us_total", "SIMULATED device slot time used by this instance", pb_utils.MetricFamily.COUNTER)
        self.fam_exec = pb_utils.MetricFamily("model_executions_total", "Batches executed by this instance", pb_utils.MetricFamily.COUNTER)
        self.fam_items = pb_utils.MetricFamily("model_executed_items_total", "Requests run in those batches", pb_utils.MetricFamily.COUNTER)
        self.fam_us = pb_utils.MetricFamily("model_execution_us_total", "Microseconds spent executing batches", pb_utils.MetricFamily.COUNTER)
        self.fam_batch = pb_utils.MetricFamily("model_last_batch_size", "Size of the last executed batch", pb_utils.MetricFamily.GAUGE)
        self.m_mem = self.fam_mem.Metric(labels=labels)
        self.m_busy = self.fam_busy.Metric(labels=labels)
        self.m_exec = self.fam_exec.Metric(labels=labels)
        self.m_items = self.fam_items.Metric(labels=labels)
        self.m_us = self.fam_us.Metric(labels=labels)
        self.m_batch = self.fam_batch.Metric(labels=labels)
        self.m_mem.set(self.buffer.nbytes)
        self.m_gpu_mem = self.m_gpu_busy = None
        if self.sim_gpu is not None:
            k = self.sim_gpu
            self.fam_gpu_mem = pb_utils.MetricFamily(f"sim_gpu{k}_memory_bytes", f"SIMULATED GPU {k}: memory held by this instance", pb_utils.MetricFamily.GAUGE)
            self.fam_gpu_busy = pb_utils.MetricFamily(f"sim_gpu{k}_busy_us_total", f"SIMULATED GPU {k}: slot time used by this instance", pb_utils.MetricFamily.COUNTER)
            self.m_gpu_mem = self.fam_gpu_mem.Metric(labels=labels)
            self.m_gpu_busy = self.fam_gpu_busy.Metric(labels=labels)
            self.m_gpu_mem.set(self.buffer.nbytes)
        # why: the server keeps a stub's series after the stub is gone; finalize() zeroes its memory, but a stub
        # that crashed never ran it, so the stubs of this model that died are zeroed here (their pid files)
        self.stubs_dir = self.device.stubs_dir
        self._release_dead_stubs()
        self._released_at = time.monotonic()

    def _release_dead_stubs(self) -> None:
        for name in os.listdir(self.stubs_dir):
            stem, _, pid = name.rpartition(".")
            if stem != self.model_name or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            path = os.path.join(self.stubs_dir, name)
            try:
                with open(path) as f:
                    dead = json.load(f)
                os.remove(path)
                labels = {"model": self.model_name, "instance": str(dead["instance"]), "stub": pid}
                k = dead.get("sim_gpu")
            except (OSError, ValueError, KeyError, TypeError):
                continue
            self.fam_mem.Metric(labels=labels).set(0)
            if isinstance(k, int):
                pb_utils.MetricFamily(f"sim_gpu{k}_memory_bytes", f"SIMULATED GPU {k}: memory held by this instance",
                                      pb_utils.MetricFamily.GAUGE).Metric(labels=labels).set(0)

    def execute(self, requests):
        inputs, responses = [], [None] * len(requests)
        for i, r in enumerate(requests):
            t = pb_utils.get_input_tensor_by_name(r, "INPUT")
            x = None if t is None else t.as_numpy()
            if x is None or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != 16:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError("INPUT must be FP32 [batch, 16]"))
            elif not np.isfinite(x).all():
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError("INPUT contains NaN or Inf"))
            else:
                inputs.append((i, x))
        if time.monotonic() - self._released_at > 1.0:     # a stub killed since (never finalized): zero it
            self._released_at = time.monotonic()
            self._release_dead_stubs()
        if inputs:
            items = sum(len(x) for _, x in inputs)
            t0 = time.perf_counter()
            cold = (0.0 if self.sizes_run else self.cold_first_s) + (0.0 if items in self.sizes_run else self.cold_size_s)
            self.sizes_run.add(items)
            time.sleep(self.overhead_s + self.host_per_item_s * items + cold)   # host side: device free
            fd = self.device.acquire()
            try:
                t_dev = time.perf_counter()
                time.sleep(self.base_s + self.per_item_s * items)  # device side: one slot held
            finally:
                self.device.release(fd)   # why: a slot kept after an exception would starve every instance
            t1 = time.perf_counter()
            self.m_busy.increment((t1 - t_dev) * 1e6)
            if self.m_gpu_busy is not None:
                self.m_gpu_busy.increment((t1 - t_dev) * 1e6)
            self.m_exec.increment(1)
            self.m_items.increment(items)
            self.m_us.increment((t1 - t0) * 1e6)
            self.m_batch.set(items)
            for i, x in inputs:
                responses[i] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", (x * 2.0).astype(np.float32))])
        return responses

    def finalize(self):
        # The server keeps a removed stub's metric series (its own: labelled by pid): report its memory released.
        self.m_mem.set(0)
        if self.m_gpu_mem is not None:
            self.m_gpu_mem.set(0)
        self.device.close()
        self.buffer = None
