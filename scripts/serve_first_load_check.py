"""What a model's first minute under `serve` costs: serve the cold_start repository (sim_cold, whose every new
instance's first execution takes 800 ms, as a GPU model's CUDA context and autotuning do), drive open-loop Poisson
load from serve's "controller managing" line on, and print the client p99 and max per 10 s with the changes the
controller applied (its decision log).

    .venv/bin/python scripts/serve_first_load_check.py [--rate 40] [--seconds 70]

Run it from two checkouts to compare them side by side (docs/bench/serve_first_load/). Exit status 0 when no
request failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.evaluation.loadgen import load_trace, make_inputs_from_config, poisson_schedule, run_open_loop_sync  # noqa: E402
from controller.evaluation.serveproc import ServeProcess  # noqa: E402
from controller.server import free_port  # noqa: E402

MODEL = "sim_cold"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=40.0, help="requests per second (Poisson)")
    p.add_argument("--seconds", type=float, default=70.0, help="how long the load runs")
    args = p.parse_args()
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    serve = ServeProcess(["--repository", "scripts/scenarios/repos/cold_start", "--http-port", str(http_port),
                          "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                          "--duration-s", str(args.seconds + 60)], cwd=ROOT)
    with serve:
        schedule = poisson_schedule(load_trace({"phases": [{"name": "load", "duration_s": args.seconds,
                                                             "rate_rps": args.rate}]}), seed=3, max_requests=10**6)
        t0 = time.monotonic()
        results = run_open_loop_sync(f"127.0.0.1:{grpc_port}", MODEL, schedule,
                                     make_inputs_from_config(f"127.0.0.1:{http_port}", MODEL), timeout_s=10.0)
        decision_log = serve.decision_log
        records = [json.loads(x) for x in Path(decision_log).read_text().splitlines()] if decision_log else []
    failed = sum(not r.ok for r in results)
    print(f"{len(results)} requests at {args.rate:g} req/s for {args.seconds:g} s, {failed} failed")
    for start in range(0, int(args.seconds), 10):
        lat = [1000 * (r.done_s - r.sent_s) for r in results if r.ok and start <= r.scheduled_s < start + 10]
        if lat:
            print(f"  {start:4d}-{start + 10:4d} s: client p99 {np.percentile(lat, 99):7.1f} ms, max {max(lat):7.1f} ms, "
                  f"{len(lat)} requests")
    changes = [r for r in records if r.get("action") != "hold"]
    print(f"changes in the decision log ({decision_log}): {len(changes) or 'none'}")
    for r in changes:
        print(f"  {r['t'] - t0:6.1f} s  {r.get('model')}  {r.get('action')}  {r.get('reason')}  {r.get('target')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
