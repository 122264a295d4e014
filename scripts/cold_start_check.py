"""What the controller reads of a model's cold start, change by change, on a real tritonserver.

    .venv/bin/python scripts/cold_start_check.py                          # resnet_tiny, then sim_accel
    .venv/bin/python scripts/cold_start_check.py --repository scripts/scenarios/repos/cold_start --models sim_cold

For each model, one fresh server: 5 s of open-loop load at one instance, then three changes each under 8 s of
load (the change 2 s in): an in-place scale-up to 2 instances, a full reload to 2 x 2000 us, an in-place
scale-down to 1. A `service.ServiceTimes` is fed the model's statistics every 0.5 s as the controller's is
(no configuration while a reload is in flight), and after each change the script prints the reading of that
change's settle (`excess_executions`: the executions around it took that many executions' worth more than the
configuration's curve; 25 or more and 1.25x the curve reads cold) and, at the end, the model-level
`cold_start()` (cold where 2 of the last 8 settles read cold).

Measured here (2 cores, no GPU; docs/bench/cold_start/calibration.txt), executions' worth for the load, the
scale-up, the full reload and the scale-down: resnet_tiny (40 req/s) -6.9, 2.6, 2.2, 3.9 and sim_accel (90
req/s) 2.2, -1.2, 4.9, -0.2, no cold start; sim_cold (sim_accel with an 800-ms first execution, 50 ms more per
new batch size) 101.6, 81.8, 144.2 and -0.1 (a scale-down starts nothing): cold. (A per-change line can show
the settle before it where the new one has not ended yet; the "every settle" line has them all.) Exit status 0
when every change applied.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RATES = {"resnet_tiny": 40.0}       # req/s per model; others DEFAULT_RATE
DEFAULT_RATE = 90.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--repository", type=Path, help="model repository (default: the shipped one)")
    p.add_argument("--models", default="resnet_tiny,sim_accel", help="comma-separated models (default resnet_tiny,sim_accel)")
    args = p.parse_args(argv)
    from controller.actuation import Actuator, TritonControl
    from controller.evaluation.loadgen import load_trace, make_inputs_from_config, poisson_schedule, run_open_loop_sync
    from controller.server import DEFAULT_REPOSITORY, ServerOptions, TritonServer, free_port
    from controller.service import ServiceTimes
    from controller.signals import Scraper
    from controller.types import Settings

    ok = True
    for model in args.models.split(","):
        rate = RATES.get(model, DEFAULT_RATE)
        server = TritonServer(ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                            models=[model], repository=args.repository or DEFAULT_REPOSITORY)).start()
        stop, live, times = threading.Event(), {"settings": Settings(1, 0)}, ServiceTimes(half_life_s=None)

        def poll() -> None:
            scraper = Scraper(server.metrics_url, server.http_url)
            while not stop.is_set():
                every = scraper.all_stats()
                times.add(live["settings"], None if every is None else every.get(model), time.monotonic())
                stop.wait(0.5)

        def load(seconds: float, seed: int) -> None:
            schedule = poisson_schedule(load_trace({"phases": [{"name": "p", "duration_s": seconds, "rate_rps": rate}]}),
                                        seed=seed, max_requests=10_000)
            run_open_loop_sync(server.grpc_url, model, schedule, make_inputs_from_config(server.http_url, model),
                               timeout_s=10.0)

        poller = threading.Thread(target=poll, daemon=True)
        try:
            act = Actuator(TritonControl(server.grpc_url, server.http_url))
            ok = act.apply(model, live["settings"]).ok and ok
            poller.start()
            time.sleep(1.0)
            load(5.0, seed=3)
            for k, target in enumerate((Settings(2, 0), Settings(2, 2000), Settings(1, 2000))):
                background = threading.Thread(target=load, args=(8.0, 4 + k))
                background.start()
                time.sleep(2.0)
                live["settings"] = None                 # as the controller: no configuration while it reloads
                result = act.apply(model, target)
                live["settings"] = target
                ok = result.ok and ok
                background.join()
                time.sleep(1.5)
                readings = times.settle_readings()
                print(f"{model} -> {target.instance_count} x {target.max_queue_delay_us}us ({result.kind}): "
                      f"{readings[-1] if readings else None}", flush=True)
            stop.set()
            poller.join()
            print(f"{model}: every settle {times.settle_readings()}")
            print(f"{model}: cold_start() = {times.cold_start()}", flush=True)
        finally:
            stop.set()
            server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
