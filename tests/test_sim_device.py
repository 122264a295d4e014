"""sim_accel's shared device folder (model_repository/sim_accel/1/model.py, SimulatedDevice): the last instance to
close removes it, and the base folder `/tmp/sim_accel_<server pid>` where the user set no SIM_ACCEL_DIR (every
server left one before); an instance that starts while the last one closes gets a folder of its own, never slot
files that were removed. The class is loaded from the model file with a stand-in for the backend's utilities;
several devices in one process stand for several stub processes (flock locks of separate opens conflict as those
of separate processes do). The real server's path: tests/test_sim_memory_live.py and every live test that loads
sim_accel (serve puts the folder in its work dir)."""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
import time
import types

import pytest

from conftest import ROOT


@pytest.fixture
def device_class(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    spec = importlib.util.spec_from_file_location("sim_accel_model", ROOT / "model_repository/sim_accel/1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("SIM_ACCEL_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return module.SimulatedDevice


def _base(tmp_path):
    return tmp_path / f"sim_accel_{os.getppid()}"


def test_the_last_instance_removes_the_folders_and_a_sibling_keeps_them(tmp_path, device_class):
    a = device_class("sim0", 2, "m", {"instance": "m_0"})
    b = device_class("sim0", 2, "m2", {"instance": "m2_0"})      # another model on the same device
    other = device_class("sim1", 1, "n", {"instance": "n_0"})    # another device under the same base
    assert sorted(os.listdir(_base(tmp_path) / "sim0")) == ["slot0", "slot1", "stubs"]
    assert os.stat(a.slots[0]).st_ino == os.fstat(b.fds[0]).st_ino           # one file, shared
    a.close()
    assert (_base(tmp_path) / "sim0" / "slot0").exists()                        # b still runs
    b.close()
    assert not (_base(tmp_path) / "sim0").exists() and (_base(tmp_path) / "sim1").exists()
    other.close()
    assert not _base(tmp_path).exists()
    assert os.listdir(tmp_path) == []


def test_a_crashed_stubs_registration_keeps_the_folder(tmp_path, device_class):
    a = device_class("sim0", 2, "m", {"instance": "m_0"})
    (_base(tmp_path) / "sim0" / "stubs" / "m.999999").write_text("{}")       # a stub that never closed
    a.close()
    assert (_base(tmp_path) / "sim0" / "stubs" / "m.999999").exists()


def test_a_folder_the_user_gave_stays(tmp_path, device_class, monkeypatch):
    monkeypatch.setenv("SIM_ACCEL_DIR", str(tmp_path / "mine"))
    a = device_class("sim0", 2, "m", {"instance": "m_0"})
    a.close()
    assert os.listdir(tmp_path / "mine") == []


def test_an_instance_starting_while_the_last_closes_gets_a_folder_of_its_own(tmp_path, device_class):
    """The closing instance holds the lock and removes everything; the starting one, waiting on the lock of the
    folder that is then removed, makes the folder again and opens slot files that exist (and that the next
    instance shares)."""
    a = device_class("sim0", 2, "m", {"instance": "m_0"})
    started: list = []
    with a._locked():                       # the last instance's close, from the inside
        # why other model names: in one process the same model's registrations would be one file (model.pid)
        t = threading.Thread(target=lambda: started.append(device_class("sim0", 2, "m1", {"instance": "m1_0"})))
        t.start()
        time.sleep(0.3)
        assert not started                  # waiting for the lock
        for fd in a.fds:
            os.close(fd)
        a.fds = []
        for path in [*a.slots, a.stub_file]:
            os.remove(path)
        for folder in (a.stubs_dir, a.dir, a.base):
            os.rmdir(folder)
    t.join(5)
    b = started[0]
    assert os.path.isfile(b.stub_file) and all(os.path.isfile(p) for p in b.slots)
    c = device_class("sim0", 2, "m2", {"instance": "m2_0"})
    assert [os.fstat(fd).st_ino for fd in b.fds] == [os.fstat(fd).st_ino for fd in c.fds]
    b.close()
    c.close()
    assert not _base(tmp_path).exists()


def test_slots_are_still_exclusive(tmp_path, device_class):
    a = device_class("sim0", 1, "m", {"instance": "m_0"})
    b = device_class("sim0", 1, "m1", {"instance": "m1_0"})
    fd = a.acquire()
    got: list = []
    t = threading.Thread(target=lambda: got.append(b.acquire()))
    t.start()
    time.sleep(0.2)
    assert not got                          # the one slot is held
    a.release(fd)
    t.join(5)
    assert got
    b.release(got[0])
    a.close()
    b.close()


def test_a_real_server_without_sim_accel_dir_leaves_no_folder(tmp_path, monkeypatch):
    """A user's own server (no SIM_ACCEL_DIR, which serve and the bench set): the folder is
    /tmp/sim_accel_<server pid> while sim_accel runs, through an in-place 1 -> 3 -> 1, and gone after its unload."""
    from conftest import start_server
    monkeypatch.setenv("SIM_ACCEL_DIR", "")      # the server's environment keeps it; the model reads "" as unset
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    server = start_server(["sim_accel"])
    try:
        base = tmp_path / f"sim_accel_{server.process.pid}"
        assert sorted(os.listdir(base / "sim0")) == ["slot0", "slot1", "stubs"]
        _, cfg = server._http("GET", "/v2/models/sim_accel/config")
        for count in (3, 1):
            cfg["instance_group"][0]["count"] = count
            server.load_model("sim_accel", cfg)
            deadline = time.monotonic() + 20
            while len(os.listdir(base / "sim0" / "stubs")) != count:   # a removed stub closes after the load
                assert time.monotonic() < deadline, os.listdir(base / "sim0" / "stubs")
                time.sleep(0.1)
        status, _ = server._http("POST", "/v2/models/sim_accel/infer", {"inputs": [
            {"name": "INPUT", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]})
        assert status == 200
        status, _ = server._http("POST", "/v2/repository/models/sim_accel/unload", {})
        assert status == 200
        deadline = time.monotonic() + 20
        while base.exists():
            assert time.monotonic() < deadline, list(base.rglob("*"))
            time.sleep(0.1)
    finally:
        server.stop()
