"""The CPU as the device of the models that run on it, where no GPU (nor the simulated device) reports for them.

Why: the planner's contention between instances comes from a device's utilisation (`planner.ServiceModel`: gamma
= utilisation x the share of an execution on the device) and the device's load bounds what any count can carry
(`planner.DeviceShare`). A model on the CPU had neither: gamma was `DEFAULT_CONTENTION` (0.1), so a second
instance was predicted at ~1.8x the first's capacity and eight at ~4.7x, whatever the cores. Measured here (2
cores, a user's torch MLP with torch's default threads, the shift day): at 237 req/s the planner scaled 1 -> 2
instances predicting a p99 of 18.2 ms where one instance read 152 ms, and the two then measured a gamma of 1.00,
the cap (each execution ~5x as long: 2 x 2 torch threads on 2 cores); `status` put eight resnet_tiny instances at 4,019 req/s on the
same two cores. The server's CPU use says how busy the cores are and which model uses them, as NVML does for a GPU.

What is read (Linux's /proc, every tick, ~1 ms for ~70 processes): the busy time of the cores the server may run
on (its CPU affinity; every process's, from /proc/stat: a load generator or another server on those cores contends
as much as the model's own instances do), the CPU time (user + system) of the tritonserver process and of every
process under it (the Python backend's stubs, one per instance), and each stub's model: the folder of the
`model.py` its command line names (`<repository>/<model>/<version>/model.py`). Under a cgroup CPU quota smaller
than the affinity (a container's limit) the quota's cores are the device and the server's own time its busy time
(the host's other processes run outside the quota). Over a span:

* utilisation = busy seconds / (span x usable cores): the device's busy fraction (`planner.ServiceModel`'s gamma);
* a model's share = the server's part of the busy time x its stubs' share of every stub's CPU (the server process's
  own work, its frontends and batchers, split as the stubs' is): its `device_fraction`, the rest of the busy time
  being the device's other load (`planner.DeviceShare.others`).

Example: 2 usable cores; over 10 s they were busy 18 s, the server's tree 14 of them, model A's stubs 9 and B's 3:
utilisation 0.90; the server's part 0.78; A's share 0.78 x 0.75 = 0.58, B's 0.19.

Only for a model whose executions run on the CPU (`CpuUse.runs_on_cpu`): its stubs use at least CPU_BOUND_MIN
cores per instance executing, or it has no stub (a backend inside the server process). A Python model that waits
on something else (the simulated accelerator sleeps; a BLS caller waits on its callee) keeps no device, as before.

Not read: a server on another machine or in another container (its process is not visible here), a machine
without /proc. Then a model on the CPU is planned as before (`planner.DEFAULT_CONTENTION`, no device bound).
"""
from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger("controller.cpu")

STUB_NAME = "triton_python_backend_stub"
KEPT_S = 200.0            # readings kept: longer than any observation window
CPU_BOUND_MIN = 0.3       # cores a model's stubs use per instance executing, at least, for the CPU to be its device
MIN_BUSY_INSTANCES = 0.05  # ... read over a span where its instances executed at least this much (instance-s per s)


@dataclass(frozen=True)
class CpuReading:
    """Cumulative CPU seconds of each process of the server's tree at `t`, and the model of each stub among them."""
    t: float
    pid: int                          # the server's pid (a restarted server starts a new series)
    cores: float                      # usable cores
    per_pid: dict[int, float]
    model_of: dict[int, str]          # stub pid -> its model
    host_busy_s: float | None = None  # busy seconds of the cores the server may run on, every process's (/proc/stat);
                                      # None under a CPU quota (the quota, not the cores, bounds the server then)


@dataclass(frozen=True)
class CpuUse:
    """The CPU over a span, as a device: how busy its usable cores were, how much of that the server's processes
    did, and each model's part of the server's."""
    utilisation: float                # busy fraction of the usable cores (every process's; the server's under a quota)
    cores: float
    server: float                     # the server's process tree's part of that busy time (1.0 under a quota)
    stubs: dict[str, float]           # model -> its stubs' share of every stub's CPU ({}: no stub ran, in-process)
    span_s: float
    stub_cores: dict[str, float] = field(default_factory=dict)   # model -> cores its stubs used over the span

    def runs_on_cpu(self, model: str, busy_instances: float) -> bool:
        """Whether the CPU is where `model`'s executions run: its stubs used at least CPU_BOUND_MIN cores per instance
        executing (`busy_instances`: the instances' busy fraction x their count), read where they executed at least
        MIN_BUSY_INSTANCES; a model with no stub of its own (a backend inside the server process: its work is the
        server's) is taken as on the CPU. Why: a Python model whose executions wait on something else (the
        simulated accelerator's sleeps: ~0.05 cores per executing instance; a BLS caller waiting on its callee)
        does not contend for the cores, and the cores' busy time from other processes (another server, a load
        generator) would read as its device's load. Example: resnet_tiny 0.82 busy on one instance, its stub 0.80
        cores: 0.98, on the CPU; sim_accel 0.9 busy on two instances, its stubs 0.09 cores: 0.05, not."""
        if model not in self.stub_cores:
            return True
        per_exec = self.cores_per_execution(model, busy_instances)
        return per_exec is not None and per_exec >= CPU_BOUND_MIN

    def cores_per_execution(self, model: str, busy_instances: float) -> float | None:
        """The cores `model`'s stubs used per instance executing over the span (`busy_instances`: the instances' busy
        fraction x their count); None without a stub of its own or where they executed under MIN_BUSY_INSTANCES."""
        own = self.stub_cores.get(model)
        if own is None or busy_instances < MIN_BUSY_INSTANCES:
            return None
        return own / busy_instances

    def contention(self, model: str, busy_instances: float) -> float | None:
        """How much longer each execution takes when a second instance of `model` executes beside one, from the
        cores: an execution uses c cores (its stubs' cores per instance executing), the cores not busy with anything
        else (other models, the server's own work, a load generator) number F; one execution alone takes
        max(1, c / F) of its unhindered time, two at once max(1, 2c / F) each: the contention is their quotient
        less one, within [0, 1] (`planner.ServiceModel`'s gamma). None where it cannot be read (no stub of its
        own: a backend inside the server; an instance that barely executed).

        Why: the contention prior from the utilisation (gamma = u) cannot see threads. A torch model with torch's
        default threads (one per core) keeps all the cores busy while it executes, at any utilisation: two such
        instances take turns at best and oversubscribe at worst (the MLP of scripts/scenarios/repos/cpu_mlp: one
        instance 67% busy, gamma 0.67 from the utilisation, the two measured 1.00, each execution ~5x as long).
        Example: 2 cores, 67% busy (1.34 cores), the MLP's stubs 1.19 cores at 0.7 instances executing: c = 1.7,
        F = 2 - 0.15 = 1.85, one alone 1.0, two 3.4 / 1.85 = 1.84: 0.84. resnet_tiny (one torch thread) at 0.72
        instances executing, 0.58 cores, 43% busy: c = 0.8, F = 2 - 0.28 = 1.72, two 0.93: 0."""
        per_exec = self.cores_per_execution(model, busy_instances)
        if per_exec is None:
            return None
        free = max(0.1, self.cores - max(0.0, self.utilisation * self.cores - self.stub_cores[model]))
        one, two = max(1.0, per_exec / free), max(1.0, 2.0 * per_exec / free)
        return min(1.0, max(0.0, two / one - 1.0))

    def share(self, model: str) -> float | None:
        """The model's part of the device's busy time: its stubs' share of the server's part (the server process's
        own work, its frontends and batchers, split as the stubs' is); None where no stub says (in-process
        backends). Example: the cores 90% busy, the server 80% of that, model A's stubs 75% of every stub's CPU:
        0.8 x 0.75 = 0.6 (the other 0.4: model B's 0.2, a load generator's 0.2)."""
        return self.server * self.stubs[model] if model in self.stubs else None


def usable_cores(pid: int, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> float:
    """The cores `pid` may run on: its affinity's size, within its cgroup's CPU quota where one is set (cgroup v2
    `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`). Example: affinity {0..7}, cpu.max "200000 100000": 2.0."""
    return _usable(_affinity(pid), _cgroup_quota(pid, proc, cgroup_root))


def _affinity(pid: int) -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:
        return frozenset()


def _usable(affinity: frozenset[int], quota: float | None) -> float:
    """`usable_cores` from the affinity (empty: unknown, the machine's count) and the quota (None: none set)."""
    cores = float(len(affinity)) if affinity else float(os.cpu_count() or 1)
    return max(0.1, min(cores, quota)) if quota is not None else max(1.0, cores)


def _cgroup_quota(pid: int, proc: Path, root: Path) -> float | None:
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1], parts[2].lstrip("/")
        if controllers == "":                                  # v2: "0::/path"
            candidates = [(root / rel / "cpu.max", None), (root / "cpu.max", None)]
        elif "cpu" in controllers.split(","):                  # v1: "4:cpu,cpuacct:/path"
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            candidates = [(base / rel / "cpu.cfs_quota_us", base / rel / "cpu.cfs_period_us"),
                          (base / "cpu.cfs_quota_us", base / "cpu.cfs_period_us")]
        else:
            continue
        for quota_file, period_file in candidates:
            try:
                if period_file is None:
                    q, p = quota_file.read_text().split()[:2]
                else:
                    q, p = quota_file.read_text().strip(), period_file.read_text().strip()
            except (OSError, ValueError):
                continue
            if q in ("max", "-1"):
                break
            try:
                if float(p) > 0 and float(q) > 0:
                    return float(q) / float(p)
            except ValueError:
                pass
            break
    return None


def _stat(proc: Path, pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) from /proc/<pid>/stat; None where it cannot be read."""
    try:
        raw = (proc / pid / "stat").read_bytes().decode(errors="replace")
        fields = raw.rsplit(")", 1)[1].split()
        # why: after the name's ")", field 3 (state) is fields[0]; ppid fields[1]; utime, stime fields[11], fields[12]
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


_CLK_TCK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def stub_model(argv: list[str]) -> str | None:
    """The model a Python backend stub serves, from its command line: the folder of the `model.py` (any .py) it
    names, `<repository>/<model>/<version>/model.py`. Example: [".../triton_python_backend_stub",
    "/models/mlp/1/model.py", "shm", ...] -> "mlp"; another process -> None."""
    if not argv or not argv[0].endswith(STUB_NAME) or len(argv) < 2 or not argv[1].endswith(".py"):
        return None
    parts = Path(argv[1]).parts
    return parts[-3] if len(parts) >= 3 else None


class ServerCpu:
    """Reads the CPU time of one tritonserver's process tree (see the module's doc). `find_pid` says which server:
    called at the first read and again whenever that process is gone (a restarted server), at most once per
    `retry_s` while none is found."""

    def __init__(self, find_pid: Callable[[], int | None], proc: Path = Path("/proc"),
                 cgroup_root: Path = Path("/sys/fs/cgroup"), retry_s: float = 30.0):
        self.find_pid = find_pid
        self.proc, self.cgroup_root, self.retry_s = proc, cgroup_root, retry_s
        self.pid: int | None = None
        self.cores = 1.0
        self.cpus: frozenset[int] | None = None       # the server's affinity, where no quota bounds it
        self._looked_at = None
        self._models: dict[int, str | None] = {}     # pid -> model, or None for a process that is not a stub

    def read(self, now: float) -> CpuReading | None:
        if self.pid is None or not (self.proc / str(self.pid)).exists():
            if self._looked_at is not None and now - self._looked_at < self.retry_s:
                return None
            self._looked_at = now
            pid = self.find_pid()
            if pid is None:
                if self.pid is not None:
                    log.info("the server's process is gone; its CPU is not read until one is found")
                self.pid = None
                return None
            if pid != self.pid:
                affinity, quota = _affinity(pid), _cgroup_quota(pid, self.proc, self.cgroup_root)
                self.cores = _usable(affinity, quota)
                self.cpus = affinity if affinity and (quota is None or quota >= len(affinity)) else None
                log.info("CPU: reading tritonserver pid %d and its stubs, %.3g usable cores (%s)", pid, self.cores,
                         "busy time of every process on them" if self.cpus else "its CPU quota")
            self.pid, self._models = pid, {}
        tree = self._tree(self.pid)
        if tree is None:
            return None
        models = {pid: m for pid in tree if (m := self._model(pid)) is not None}
        return CpuReading(now, self.pid, self.cores, tree, models, self._host_busy())

    def _host_busy(self) -> float | None:
        """Busy seconds of the server's cores since boot, every process's: /proc/stat's per-CPU lines, user + nice +
        system + irq + softirq + steal (steal: the hypervisor kept the core). None under a quota or unreadable."""
        if not self.cpus:
            return None
        try:
            lines = (self.proc / "stat").read_text().splitlines()
        except OSError:
            return None
        busy, seen = 0.0, 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in self.cpus:
                continue
            try:
                f = [int(x) for x in rest.split()[:8]]
            except ValueError:
                return None
            f += [0] * (8 - len(f))
            busy += f[0] + f[1] + f[2] + f[5] + f[6] + f[7]
            seen += 1
        return busy / _CLK_TCK if seen else None

    def _tree(self, root: int) -> dict[int, float] | None:
        """CPU seconds of `root` and every process under it; None where `root` cannot be read."""
        stats: dict[int, tuple[int, float]] = {}
        try:
            entries = [e.name for e in os.scandir(self.proc) if e.name.isdigit()]
        except OSError:
            return None
        for name in entries:
            s = _stat(self.proc, name)
            if s is not None:
                stats[int(name)] = s
        if root not in stats:
            return None
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = {}, [root]
        while todo:
            pid = todo.pop()
            if pid in out:
                continue
            out[pid] = stats[pid][1]
            todo.extend(children.get(pid, ()))
        self._models = {p: m for p, m in self._models.items() if p in out}
        return out

    def _model(self, pid: int) -> str | None:
        if pid not in self._models:
            try:
                argv = (self.proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                argv = []
            self._models[pid] = stub_model(argv)
        return self._models[pid]


class CpuSeries:
    """The last KEPT_S of readings, and the CPU use over any span of them (`span`)."""

    def __init__(self) -> None:
        self.readings: deque[CpuReading] = deque()

    def add(self, reading: CpuReading | None) -> None:
        if reading is None:
            return
        self.readings.append(reading)
        while self.readings and self.readings[0].t < reading.t - KEPT_S:
            self.readings.popleft()

    def stub_pids(self, model: str) -> frozenset[int]:
        """The pids of `model`'s Python stubs in the latest reading (none read: empty)."""
        if not self.readings:
            return frozenset()
        return frozenset(pid for pid, m in self.readings[-1].model_of.items() if m == model)

    def span(self, since: float, now: float) -> CpuUse | None:
        """The use between the first reading at or after `since` and the last at or before `now`, over one server
        process (a restart between: from the restart on). A process counted at both ends adds its growth; one that
        started in between (a new instance's stub) adds all its time; one that ended in between adds nothing (its
        time after the first reading is lost with it: a little under, never over). None with less than 2 s between
        the readings."""
        rows = [r for r in self.readings if since - 1e-6 <= r.t <= now + 1e-6]
        if len(rows) < 2:
            return None
        last = rows[-1]
        first = next(r for r in rows if r.pid == last.pid)
        dt = last.t - first.t
        if dt < 2.0 or last.cores <= 0:
            return None
        grew = {pid: max(0.0, s - first.per_pid.get(pid, 0.0)) for pid, s in last.per_pid.items()}
        models: dict[str, float] = {}
        for pid, m in last.model_of.items():
            models[m] = models.get(m, 0.0) + grew.get(pid, 0.0)
        stubs = sum(models.values())
        server = sum(grew.values())
        busy = server
        if first.host_busy_s is not None and last.host_busy_s is not None:
            busy = max(server, last.host_busy_s - first.host_busy_s)   # why max: the two are read a moment apart
        util = busy / (dt * last.cores)
        shares = {m: s / stubs for m, s in models.items()} if stubs > 0 else {}
        return CpuUse(min(1.0, util), last.cores, server / busy if busy > 0 else 1.0, shares, dt,
                      {m: s / dt for m, s in models.items()})
