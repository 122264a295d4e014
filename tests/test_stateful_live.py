"""A stateful model (a sequence batcher) under the controller, against a real tritonserver: live sequences keep
their state. Triton 2.51 ends the live sequences of an instance removed in place, and every live sequence on a full
reload (modelkind.py has the measurements), so the controller removes none of its instances while it has requests
and never claims it with a full reload (loop._keep_sequences); it may still add instances. Once it has had no request
past its sequence idle timeout (Triton has then ended every sequence) its instances may go."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

from conftest import start_server
from controller.config import ControllerConfig, LoopConfig, ModelLimits, ServerConfig
from controller import loop as loop_mod
from controller.loop import Controller
from controller.ownership import mark_of

CONFIG = """name: "seq"
backend: "python"
max_batch_size: 4
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [0, 1] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [0, 1] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [1] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [1] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# a running sum per sequence, held in the instance (as a stateful model's state is): a sequence moved to another
# instance reads NaN, and one whose slot is gone is refused by the server
MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.acc = {}

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(r, "START").as_numpy()
            corr = pb_utils.get_input_tensor_by_name(r, "CORRID").as_numpy()
            vals = []
            for i in range(x.shape[0]):
                k = int(corr[i][0])
                if start[i][0]:
                    self.acc[k] = 0.0
                self.acc[k] = self.acc.get(k, float("nan")) + float(x[i][0])
                vals.append([self.acc[k]])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array(vals, dtype=np.float32))]))
        return out
"""


def _sequences(url: str, worker: int, stop: threading.Event, errors: list, done: list) -> None:
    client = grpcclient.InferenceServerClient(url)
    sid = 1000 * (worker + 1)
    while not stop.is_set():
        sid += 1
        for step in range(40):
            inp = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            inp.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
            try:
                r = client.infer("seq", [inp], sequence_id=sid, sequence_start=step == 0, sequence_end=step == 39)
            except Exception as e:  # noqa: BLE001 - every refusal is a lost request here
                errors.append(" ".join(str(e).split())[:200])
                break
            if float(r.as_numpy("OUTPUT")[0][0]) != step + 1:
                errors.append(f"sequence {sid} step {step}: {float(r.as_numpy('OUTPUT')[0][0])}")
                break
            done.append(1)
            time.sleep(0.05)
    client.close()


def _seq_server(tmp_path, config: str = CONFIG):
    """`seq` on a real server, and a controller's config for it: light load on 2 instances and a 2-s scale-down
    delay, where a model without a sequence batcher loses one. Returns (server, config, decision log path)."""
    repo = tmp_path / "repo"
    (repo / "seq" / "1").mkdir(parents=True)
    (repo / "seq" / "config.pbtxt").write_text(config)
    (repo / "seq" / "1" / "model.py").write_text(MODEL)
    server = start_server(["seq"], repository=repo)
    log_path = tmp_path / "decisions.jsonl"
    cfg = ControllerConfig(
        server=ServerConfig(http_url=server.http_url, grpc_url=server.grpc_url, metrics_url=server.metrics_url),
        loop=LoopConfig(interval_s=0.5, window_s=4.0, settle_s=0.5, min_span_s=2.0, decision_log=str(log_path),
                        gpu="none"),
        models={"seq": ModelLimits(p99_target_ms=200.0, max_instances=3, scale_down_delay_s=2.0, max_delay_us=0)})
    return server, cfg, log_path


def test_a_stateful_model_keeps_its_instances_and_its_live_sequences(tmp_path):
    server, cfg, log_path = _seq_server(tmp_path)
    controller = Controller(cfg)
    controller.set_status_url("http://127.0.0.1:1/status")   # a controller that marks (claims) what it manages
    stop, errors, done = threading.Event(), [], []
    threads = [threading.Thread(target=_sequences, args=(server.grpc_url, w, stop, errors, done)) for w in range(6)]
    threads.append(threading.Thread(target=controller.run, args=(stop,)))
    try:
        for t in threads:
            t.start()
        time.sleep(16)
    finally:
        stop.set()
        for t in threads:
            t.join()
        live = controller.control.config("seq")
        controller.close()
        server.stop()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert errors == [], errors[:5]
    assert len(done) > 300, len(done)
    assert controller.models["seq"].limits.min_instances == 2
    assert int(live["instance_group"][0]["count"]) == 2 and mark_of(live) is None, live
    assert not [r for r in records if r["action"] in ("started", "claiming")], records[-5:]
    assert {r["reason"] for r in records} - {"HoldNoData", "HoldWarmup"}, records[-5:]     # it did decide


def test_a_quiet_stateful_model_gives_its_instances_back_and_keeps_later_sequences(tmp_path, monkeypatch):
    """Once no request has come for the sequence idle timeout (1 s here) and the margin, Triton has ended every
    sequence: the floor is the configured one again and the consolidation removes the extra instance; sequences
    that start afterwards keep their state, and the floor follows the live count again."""
    monkeypatch.setattr(loop_mod, "SEQUENCE_QUIET_MARGIN_S", 3.0)
    server, cfg, log_path = _seq_server(tmp_path, CONFIG.replace("5000000", "1000000"))
    controller = Controller(cfg)
    errors, done = [], []
    stop = threading.Event()
    runner = threading.Thread(target=controller.run, args=(stop,))

    def traffic(seconds: float) -> None:
        halt = threading.Event()
        workers = [threading.Thread(target=_sequences, args=(server.grpc_url, w, halt, errors, done)) for w in range(4)]
        for t in workers:
            t.start()
        time.sleep(seconds)
        halt.set()
        for t in workers:
            t.join()

    def count() -> int:
        return int(controller.control.config("seq")["instance_group"][0]["count"])

    try:
        runner.start()
        traffic(6.0)
        kept_under_traffic = (count(), controller.models["seq"].limits.min_instances)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and count() > 1:
            time.sleep(0.5)
        after_quiet = count()
        traffic(4.0)
        floor_after = controller.models["seq"].limits.min_instances
    finally:
        stop.set()
        runner.join()
        controller.close()
        server.stop()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    downs = [r for r in records if r["action"] == "applied" and r["target"]["instances"] == 1]
    assert errors == [], errors[:5]
    assert kept_under_traffic == (2, 2)             # under traffic: the live count is the floor
    assert after_quiet == 1 and len(downs) == 1, downs
    assert len(done) > 150, len(done)               # the sequences after the scale-down all kept their sums
    assert floor_after == 1                         # the floor follows the live count (1) again
