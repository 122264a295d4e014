"""The CPU as a model's device (controller/cpu.py): reading a server's process tree from a /proc laid out in a
temporary folder, the use over a span, and what the planner and the loop make of it. The real /proc of a real
tritonserver is read in `test_the_cpu_of_a_real_server_and_its_stubs` below."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from controller import cpu as cpu_mod
from controller.cpu import CpuReading, CpuSeries, CpuUse, ServerCpu, stub_model, usable_cores
from controller.planner import CPU_SHARE, DEFAULT_CONTENTION, DEVICE_SHARE, DeviceShare, ServiceModel
from controller.service import fit_service
from controller.types import Settings

TCK = cpu_mod._CLK_TCK
STUB = "/opt/tritonserver/backends/python/triton_python_backend_stub"


class FakeProc:
    """A /proc: processes (pid -> ppid, CPU seconds, argv) and per-CPU busy seconds."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def process(self, pid: int, ppid: int, cpu_s: float, argv: list[str], name: str = "x") -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        ticks = int(round(cpu_s * TCK))
        user, system = ticks - ticks // 4, ticks // 4
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        (d / "stat").write_text(f"{pid} ({name} with spaces) S {ppid} 1 1 0 -1 0 0 0 0 0 {user} {system} 0 0 20 0\n")
        (d / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        (d / "cgroup").write_text("0::/\n")

    def gone(self, pid: int) -> None:
        for f in (self.root / str(pid)).iterdir():
            f.unlink()
        (self.root / str(pid)).rmdir()

    def cpus(self, busy_s: dict[int, float]) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for k, b in sorted(busy_s.items()):
            t = int(round(b * TCK))
            lines.append(f"cpu{k} {t - t // 2} 0 {t // 2} 999999 7 0 0 0 0 0")   # user, nice, system, idle, iowait...
        (self.root / "stat").write_text("\n".join(lines) + "\n")


def _server(proc: FakeProc, server_s: float, stubs: dict[int, tuple[str, float]], busy: float | None = None) -> None:
    proc.process(100, 1, server_s, ["tritonserver", "--model-repository=/models"], name="tritonserver")
    for pid, (model, s) in stubs.items():
        proc.process(pid, 100, s, [STUB, f"/models/{model}/1/model.py", "shm", "1048576", "100", model + "_0_0"])
    proc.process(7, 1, 50.0, ["python", "-m", "controller", "load"])          # not under the server
    if busy is not None:
        proc.cpus({0: busy / 2, 1: busy / 2})


def _reader(tmp_path: Path, proc: FakeProc) -> ServerCpu:
    r = ServerCpu(lambda: 100, proc=proc.root, cgroup_root=tmp_path / "cgroup")
    r.cores, r.cpus = 2.0, frozenset({0, 1})
    r.pid = 100              # found already: usable_cores reads this process's affinity, not the fake's
    return r


def test_stub_model_from_its_command_line():
    assert stub_model([STUB, "/models/mlp/1/model.py", "shm"]) == "mlp"
    assert stub_model([STUB, "relative/ens_step/3/model.py"]) == "ens_step"
    assert stub_model(["tritonserver", "/models/mlp/1/model.py"]) is None
    assert stub_model([STUB]) is None
    assert stub_model([]) is None


def test_a_span_reads_the_cores_busy_time_the_servers_part_and_each_models_part(tmp_path):
    """The module's example: 2 cores busy 18 s of 20, the server's tree 14 (A's stubs 9, B's 3, the server 2): 0.90
    busy, the server's part 0.78, A's share 0.58, B's 0.19; the load generator (not under the server) is in the busy
    time, never in a share."""
    proc = FakeProc(tmp_path / "proc")
    reader = _reader(tmp_path, proc)
    series = CpuSeries()
    _server(proc, 10.0, {201: ("a", 5.0), 202: ("b", 1.0)}, busy=100.0)
    series.add(reader.read(0.0))
    _server(proc, 12.0, {201: ("a", 14.0), 202: ("b", 4.0)}, busy=118.0)
    series.add(reader.read(10.0))
    use = series.span(0.0, 10.0)
    assert use is not None and use.span_s == pytest.approx(10.0)
    assert use.utilisation == pytest.approx(0.90, abs=0.01)
    assert use.server == pytest.approx(14 / 18, abs=0.01)
    assert use.stubs == pytest.approx({"a": 0.75, "b": 0.25})
    assert use.share("a") == pytest.approx(14 / 18 * 0.75, abs=0.01)
    assert use.share("b") == pytest.approx(14 / 18 * 0.25, abs=0.01)
    assert use.share("c") is None


def test_a_new_stub_counts_whole_a_gone_one_not_and_a_restart_starts_a_new_series(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    reader = _reader(tmp_path, proc)
    series = CpuSeries()
    _server(proc, 10.0, {201: ("a", 30.0)}, busy=100.0)
    series.add(reader.read(0.0))
    # an in-place scale-up's new stub (2 s in the span), and the first stub replaced by a full reload's (gone)
    proc.gone(201)
    _server(proc, 11.0, {202: ("a", 2.0), 203: ("a", 3.0)}, busy=106.0)
    series.add(reader.read(10.0))
    use = series.span(0.0, 10.0)
    # why 6: the server 1 + the new stubs 2 + 3; the gone stub's 30 s are not taken off as negative use
    assert use.server == pytest.approx(1.0)        # busy (6) from the cores is what the tree grew by
    assert use.utilisation == pytest.approx(6 / 20, abs=0.01)
    assert use.stubs == {"a": 1.0}
    # a restarted server (a new pid): the span starts at its first reading
    series.add(CpuReading(20.0, 300, 2.0, {300: 1.0}, {}, 107.0))
    series.add(CpuReading(24.0, 300, 2.0, {300: 3.0}, {}, 110.0))
    use = series.span(0.0, 24.0)
    assert use.span_s == pytest.approx(4.0) and use.utilisation == pytest.approx(3 / 8)
    assert use.stubs == {} and use.share("a") is None
    assert series.span(20.0, 21.0) is None            # one reading: no span


def test_without_the_cores_readings_the_servers_own_time_is_the_busy_time(tmp_path):
    """Under a CPU quota (no per-core reading): the server's tree is the device's whole load."""
    series = CpuSeries()
    series.add(CpuReading(0.0, 100, 1.5, {100: 1.0, 201: 4.0}, {201: "a"}, None))
    series.add(CpuReading(10.0, 100, 1.5, {100: 2.0, 201: 10.0}, {201: "a"}, None))
    use = series.span(0.0, 10.0)
    assert use.utilisation == pytest.approx(7 / 15) and use.server == 1.0 and use.share("a") == 1.0


def test_usable_cores_within_a_cgroup_quota(tmp_path):
    proc = tmp_path / "proc"
    (proc / "55").mkdir(parents=True)
    root = tmp_path / "cgroup"
    (root / "pod" / "c1").mkdir(parents=True)
    (proc / "55" / "cgroup").write_text("0::/pod/c1\n")
    affinity = len(os.sched_getaffinity(0))
    (root / "pod" / "c1" / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(os.getpid(), proc, root) == affinity   # no cgroup file for this pid under the fake root
    # the quota read for a process whose cgroup file says so (affinity from this process: the fake pid has none)
    assert cpu_mod._cgroup_quota(55, proc, root) == pytest.approx(0.5)
    (root / "pod" / "c1" / "cpu.max").write_text("max 100000\n")
    assert cpu_mod._cgroup_quota(55, proc, root) is None
    (proc / "55" / "cgroup").write_text("4:cpu,cpuacct:/pod/c1\n")          # cgroup v1
    (root / "cpu,cpuacct" / "pod" / "c1").mkdir(parents=True)
    (root / "cpu,cpuacct" / "pod" / "c1" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu,cpuacct" / "pod" / "c1" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_mod._cgroup_quota(55, proc, root) == pytest.approx(3.0)


def test_a_server_not_found_is_looked_for_again_after_a_while(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    found = iter([None, 100])
    asked = []

    def find():
        asked.append(1)
        return next(found)

    r = ServerCpu(find, proc=proc.root, cgroup_root=tmp_path / "cgroup", retry_s=30.0)
    _server(proc, 1.0, {}, busy=1.0)
    assert r.read(0.0) is None and r.read(10.0) is None and len(asked) == 1
    reading = r.read(31.0)
    assert reading is not None and reading.pid == 100 and len(asked) == 2


def _fit(points):
    return fit_service({b: (100, ms) for b, ms in points.items()})


def test_the_cpus_utilisation_sets_the_contention_of_instances_not_yet_measured():
    """A CPU model is all on the CPU (CPU_SHARE): gamma = utilisation. A torch model keeping 2 cores 96% busy:
    two instances each ~1.96x as slow (measured 1.00 gamma for the user MLP in cpu.py's doc), where the GPU's
    prior (half on the device) says 1.48x and the default (no reading) 1.1x."""
    fits = [(Settings(1, 0), _fit({1: 3.0, 2: 5.8, 4: 11.2}))]
    cpu = ServiceModel.build(fits, 0.96, device_share=CPU_SHARE)
    gpu = ServiceModel.build(fits, 0.96)
    none = ServiceModel.build(fits, None, device_share=CPU_SHARE)
    assert cpu.gamma_source == "utilisation" and cpu.gamma == pytest.approx(0.96)
    assert gpu.gamma == pytest.approx(0.96 * DEVICE_SHARE)
    assert none.gamma == DEFAULT_CONTENTION
    assert cpu.curve(2)(1) == pytest.approx(1.96 * cpu.curve(1)(1))


def test_the_cpus_other_load_stays_outside_the_models_share():
    """DeviceShare from a CPU reading: 90% busy, the model's part 0.6 (a load generator's 0.3 stays as it is): at
    twice the rate in the same batches the CPU would be 0.3 + 2 x 0.6 = 1.5 busy; with the model's part taken as
    the whole (no share) 1.8."""
    fit = _fit({1: 3.0, 2: 5.8, 4: 11.2})
    shared = DeviceShare.at(0.9, 100.0, 1.0, fit, 0.6 / 0.9)
    alone = DeviceShare.at(0.9, 100.0, 1.0, fit, None)
    assert shared.load(200.0, 1.0) == pytest.approx(0.3 + 1.2)
    assert alone.load(200.0, 1.0) == pytest.approx(1.8)


def test_the_cpu_is_the_device_of_a_model_whose_executions_use_it():
    """`CpuUse.runs_on_cpu`: resnet_tiny's stub 0.80 cores while its one instance is 0.82 busy: on the CPU; the
    simulated accelerator's stubs 0.09 cores over two instances 0.9 busy (they sleep): not; an in-process backend (no
    stub): on the CPU; a model that barely ran: not known, not taken."""
    use = CpuUse(0.6, 2.0, 0.9, {"resnet_tiny": 0.9, "sim_accel": 0.1}, 10.0,
                 {"resnet_tiny": 0.80, "sim_accel": 0.09})
    assert use.runs_on_cpu("resnet_tiny", 0.82)
    assert not use.runs_on_cpu("sim_accel", 2 * 0.9)
    assert use.runs_on_cpu("onnx_model", 0.5)
    assert not use.runs_on_cpu("resnet_tiny", 0.01)


def test_the_cores_an_execution_uses_against_those_free_give_the_contention_of_a_second_instance():
    """`CpuUse.contention`, the docstring's examples: the MLP (torch's 2 threads on 2 cores) 0.84; resnet_tiny (one
    thread) 0; an execution alone already short of cores (3 cores' worth on 2 free): two halve what one gets, 1.0;
    the cores busy with something else leave fewer free; no stub of its own, or barely executing: None."""
    mlp = CpuUse(0.67, 2.0, 0.9, {"mlp": 1.0}, 10.0, {"mlp": 1.19})
    assert mlp.contention("mlp", 0.7) == pytest.approx(3.4 / 1.85 - 1.0)
    assert round(mlp.contention("mlp", 0.7), 2) == 0.84
    resnet = CpuUse(0.43, 2.0, 0.9, {"resnet_tiny": 1.0}, 10.0, {"resnet_tiny": 0.58})
    assert resnet.contention("resnet_tiny", 0.72) == 0.0
    wide = CpuUse(0.75, 2.0, 1.0, {"m": 1.0}, 10.0, {"m": 1.5})
    assert wide.contention("m", 0.5) == pytest.approx(1.0)                      # 3 cores per execution: 1.5 -> 3.0
    crowded = CpuUse(0.8, 2.0, 0.5, {"r": 1.0}, 10.0, {"r": 0.4})               # 1.2 cores busy with other work
    assert crowded.contention("r", 0.5) == pytest.approx(1.6 / 0.8 - 1.0)       # 0.8 per execution of 0.8 free
    assert resnet.contention("onnx_model", 0.7) is None                         # in-process: no stub
    assert resnet.contention("resnet_tiny", 0.01) is None


def test_the_cores_raise_the_contention_prior_never_lower_it_nor_a_measured_one():
    fits = [(Settings(1, 0), fit_service({1: (100, 5.0), 2: (100, 8.0)}))]
    assert ServiceModel.build(fits, 0.67, device_share=CPU_SHARE, contention_floor=0.84).gamma == pytest.approx(0.84)
    assert ServiceModel.build(fits, 0.67, device_share=CPU_SHARE, contention_floor=0.84).gamma_source == "cores"
    low = ServiceModel.build(fits, 0.43, device_share=CPU_SHARE, contention_floor=0.0)
    assert (low.gamma, low.gamma_source) == (pytest.approx(0.43), "utilisation")
    assert ServiceModel.build(fits, None, contention_floor=0.5).gamma_source == "cores"
    two = fits + [(Settings(2, 0), fit_service({1: (100, 6.0), 2: (100, 9.6)}))]
    measured = ServiceModel.build(two, 0.67, device_share=CPU_SHARE, contention_floor=0.84)
    assert measured.gamma_source == "measured" and measured.gamma == pytest.approx(0.2)


def test_cpu_use_share_is_the_servers_part_times_the_stubs():
    use = CpuUse(0.9, 2.0, 0.8, {"a": 0.75, "b": 0.25}, 10.0)
    assert use.share("a") == pytest.approx(0.6) and use.share("b") == pytest.approx(0.2)


class FakeCpu:
    """A ServerCpu's readings, scripted: the server and one stub per model, growing at the given cores busy."""

    def __init__(self, per_model_cores: dict[str, float], server_cores: float = 0.2, other_cores: float = 0.0):
        self.per_model, self.server, self.other = per_model_cores, server_cores, other_cores

    def read(self, now: float) -> CpuReading:
        stubs = {200 + i: m for i, m in enumerate(sorted(self.per_model))}
        per_pid = {100: self.server * now, **{pid: self.per_model[m] * now for pid, m in stubs.items()}}
        busy = sum(per_pid.values()) + self.other * now
        return CpuReading(now, 100, 2.0, per_pid, stubs, busy)


def test_the_loop_gives_a_cpu_model_the_cpu_as_its_device_and_only_without_a_gpu():
    """Without a GPU: the observation carries the CPU over its window, the planner's inputs the CPU's share of an
    execution and the model's part of the busy cores; the observation log and `status` show it. With a GPU read
    (NVML's source), the CPU is the device of a model on the CPU alone, not of one on the GPU."""
    from test_loop_ticks import LOOP, Clock, FakeControl, FakeModel, FakeScraper, HOT, run_ticks
    from controller.config import ControllerConfig, ServerConfig
    from controller.gpu import FakeGpuSource
    from controller.loop import Controller, summarize_obs
    from controller.status import format_model
    from controller.types import GpuObservation

    def make(gpu=None):
        clock = Clock()
        # s: 180 req/s x 5 ms, 0.9 busy, its stub 0.02 cores (it waits on something else: not on the CPU)
        fakes = {"a": FakeModel(100.0, 10.0, 5.0), "b": FakeModel(50.0, 10.0, 5.0), "s": FakeModel(180.0, 10.0, 5.0)}
        cfg = ControllerConfig(server=ServerConfig(), loop=LOOP, models={"a": HOT, "b": HOT, "s": HOT})
        control = FakeControl(["a", "b", "s"])
        if gpu is not None:
            control.configs["a"]["instance_group"] = [{"count": 1, "kind": "KIND_GPU", "gpus": [0]}]
        ctl = Controller(cfg, control=control, scraper=FakeScraper(clock, fakes), clock=clock,
                         cpu=FakeCpu({"a": 0.9, "b": 0.3, "s": 0.02}, server_cores=0.18, other_cores=0.4), gpu=gpu)
        return ctl, clock

    ctl, clock = make()
    run_ticks(ctl, clock, 8)
    a = ctl.models["a"]
    use = a.last_obs.cpu
    assert use is not None
    assert use.utilisation == pytest.approx(1.8 / 2.0)            # 0.9 + 0.3 + 0.02 + 0.18 + a load generator's 0.4
    assert use.server == pytest.approx(1.4 / 1.8)
    assert use.stubs == pytest.approx({"a": 0.9 / 1.22, "b": 0.3 / 1.22, "s": 0.02 / 1.22})
    assert ctl._device_fraction(a, a.last_obs) == pytest.approx(1.4 / 1.8 * 0.9 / 1.22)
    assert a.plan_inputs.device_share == CPU_SHARE
    busy = a.last_obs.busy_fraction * a.current.instance_count
    assert a.plan_inputs.contention_floor == pytest.approx(use.contention("a", busy)) and busy > 0
    logged = summarize_obs(a.last_obs)["cpu"]
    assert logged == {"util": 0.9, "cores": 2.0, "server": 0.778, "stubs": {"a": 0.738, "b": 0.246, "s": 0.016}}
    snap = ctl.status_snapshot()["models"]["a"]
    text = "\n".join(format_model("a", snap))
    assert "cpu          the device: 2 usable cores 90% busy, 78% of it the server's processes; " \
           "this model's instances 74% of its models'" in text
    s = ctl.models["s"]                                            # busy on something else: no device, as before
    assert s.last_obs.valid and s.last_obs.cpu is None and s.plan_inputs.device_share == DEVICE_SHARE
    assert s.plan_inputs.contention_floor is None
    assert ctl._device_fraction(s, s.last_obs) is None

    gpu = FakeGpuSource([(GpuObservation(0, 40.0, 1 << 30, 8 << 30),)])
    ctl, clock = make(gpu=gpu)
    run_ticks(ctl, clock, 8)
    a, b = ctl.models["a"], ctl.models["b"]
    assert a.last_obs.cpu is None and a.plan_inputs.device_share == DEVICE_SHARE       # on gpu0
    assert [g.index for g in a.last_obs.gpus] == [0]
    assert "cpu " not in "\n".join(format_model("a", ctl.status_snapshot()["models"]["a"]))
    assert b.last_obs.cpu is not None and b.last_obs.gpus == () and b.plan_inputs.device_share == CPU_SHARE


def test_the_cpu_of_a_real_server_and_its_stubs(server):
    """A real tritonserver: found by its gRPC port (as the controller finds one it did not start), its stubs named
    by model, and under load on resnet_tiny (a torch model computing on the CPU) the cores' busy time is mostly
    the server's and the stubs' CPU mostly resnet_tiny's, not sim_accel's (whose device is simulated: it sleeps), and
    only resnet_tiny's executions read as run on the CPU."""
    import threading
    import time

    from conftest import open_loop
    from controller.server import tritonserver_pid

    port = int(server.grpc_url.rsplit(":", 1)[1])
    assert tritonserver_pid(port) == server.process.pid
    reader = ServerCpu(lambda: tritonserver_pid(port))
    first = reader.read(time.monotonic())
    assert first is not None and first.pid == server.process.pid and reader.cores >= 1
    assert set(first.model_of.values()) >= {"resnet_tiny", "sim_accel"}
    series = CpuSeries()
    series.add(first)
    load = threading.Thread(target=open_loop, args=(server, "resnet_tiny", 150.0, 4.0, 3))
    sim = threading.Thread(target=open_loop, args=(server, "sim_accel", 100.0, 4.0, 4))
    load.start()
    sim.start()
    t0 = time.monotonic()
    while load.is_alive() or sim.is_alive():
        time.sleep(1.0)
        series.add(reader.read(time.monotonic()))
    load.join()
    sim.join()
    use = series.span(t0 - 1.0, time.monotonic())
    assert use is not None and use.span_s >= 3.0
    assert 0.05 < use.utilisation <= 1.0
    assert 0.3 < use.server <= 1.0
    assert use.stubs["resnet_tiny"] > 0.6 and use.stubs["sim_accel"] < 0.3
    # 150 req/s keep resnet_tiny's instance ~0.35 busy and its stub ~0.27 cores (measured here): on the CPU;
    # sim_accel at 100 req/s keeps its instance 0.5-0.8 busy mostly sleeping, its stub ~0.03 cores: not
    print("stub cores", use.stub_cores, "utilisation", use.utilisation, "server", use.server)
    assert use.stub_cores["resnet_tiny"] > 0.1 and use.runs_on_cpu("resnet_tiny", 0.35)
    assert use.stub_cores["sim_accel"] < 0.1 and not use.runs_on_cpu("sim_accel", 0.5)


def test_each_model_reads_the_gpus_its_instances_are_on():
    """A model reads the GPUs its live instance groups are on (`Controller._model_devices`): a group on gpu1 reads
    gpu1; a KIND_CPU group no GPU, so another model filling gpu0's memory does not hold its scale-ups and it gets
    the CPU as its device, unless its own stubs hold memory on a GPU in NVML's process lists (a Python model that
    moves its work to the GPU itself); KIND_MODEL (the model places its instances) every GPU, as before."""
    from test_loop_ticks import LOOP, Clock, FakeControl, FakeModel, FakeScraper, HOT, run_ticks
    from controller.config import ControllerConfig, ServerConfig
    from controller.gpu import FakeGpuSource
    from controller.loop import Controller
    from controller.types import GpuObservation

    names = ["c", "cg", "g0", "g1", "km"]
    gib = 1 << 30
    # FakeCpu's stub pids: 200 + the model's place in sorted order: "c" 200, "cg" 201, ...
    gpus = (GpuObservation(0, 90.0, int(7.9 * gib), 8 * gib, ((100, gib), (201, gib))),
            GpuObservation(1, 20.0, 2 * gib, 8 * gib, ((100, gib),)))
    control = FakeControl(names)
    control.configs["g0"]["instance_group"] = [{"count": 1, "kind": "KIND_GPU", "gpus": [0]}]
    control.configs["g1"]["instance_group"] = [{"count": 1, "kind": "KIND_GPU", "gpus": [1]}]
    control.configs["km"]["instance_group"] = [{"count": 1, "kind": "KIND_MODEL"}]
    clock = Clock()
    # every model over its 40-ms target (60 ms a request): each wants a second instance
    fakes = {n: FakeModel(100.0, 60.0, 5.0) for n in names}
    cfg = ControllerConfig(server=ServerConfig(), loop=LOOP,
                           models={n: HOT for n in names})
    ctl = Controller(cfg, control=control, scraper=FakeScraper(clock, fakes), clock=clock,
                     cpu=FakeCpu({n: 0.5 for n in names}), gpu=FakeGpuSource([gpus]))
    run_ticks(ctl, clock, 8)
    seen = {n: tuple(g.index for g in ctl.models[n].last_obs.gpus) for n in names}
    assert seen == {"c": (), "cg": (0,), "g0": (0,), "g1": (1,), "km": (0, 1)}
    assert ctl.models["c"].last_obs.cpu is not None                     # the CPU is its device
    assert all(ctl.models[n].last_obs.cpu is None for n in ("cg", "g0", "g1", "km"))
    grown = {m for m, s in control.loads if s.instance_count == 2}
    assert {"c", "g1"} <= grown                                         # gpu0's full memory is not theirs
    assert not grown & {"cg", "g0"}, control.loads                      # on gpu0, at its budget
