"""What a tritonserver crash under `serve` costs: serve sim_accel, drive open-loop Poisson load, SIGSEGV the server
part-way (as Triton 2.51's own crash after an in-place scale-up did in this project's runs), and count the requests
that failed; twice, side by side on the same schedule: serve as shipped (it starts the server again) and with
`--max-restarts 0` (it stops with the server, as before). Prints, per arm, the failed requests, the window they
fell in, the live config before and after the crash, and serve's notices.

    .venv/bin/python scripts/server_crash_check.py [--rate 100] [--seconds 60] [--kill-at 20]

Exit status 0 when the restarting arm lost requests only within `--max-gap-s` of the crash and served every one
after it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.evaluation.loadgen import (load_trace, make_inputs_from_config, poisson_schedule,  # noqa: E402
                                           run_open_loop_sync)
from controller.evaluation.serveproc import ServeProcess  # noqa: E402
from controller.server import free_port  # noqa: E402

MODEL = "sim_accel"


def _live(http_port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{MODEL}/config", timeout=5) as r:
            cfg = json.loads(r.read())
    except OSError as e:
        return f"unreadable ({' '.join(str(e).split())[:80]})"
    delay = (cfg.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0)
    return f"{sum(int(g.get('count', 1)) for g in cfg.get('instance_group', []))} inst/{delay} us"


def arm(name: str, extra: list[str], schedule, args) -> dict:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    serve = ServeProcess(["--models", MODEL, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                          "--metrics-port", str(metrics_port), "--duration-s", str(args.seconds + 60), *extra],
                         cwd=ROOT)
    seen: dict = {}

    def crash(t0: float) -> None:
        time.sleep(max(0.0, t0 + args.kill_at - time.monotonic()))
        seen["before"] = _live(http_port)
        pid = subprocess.run(["pgrep", "-f", f"http-port={http_port}"], capture_output=True, text=True).stdout.split()
        os.kill(int(pid[0]), signal.SIGSEGV)
        seen["killed_at"] = time.monotonic() - t0

    with serve:
        t0 = time.monotonic()
        killer = threading.Thread(target=crash, args=(t0,), daemon=True)
        killer.start()
        results = run_open_loop_sync(f"127.0.0.1:{grpc_port}", MODEL, schedule,
                                     make_inputs_from_config(f"127.0.0.1:{http_port}", MODEL), timeout_s=10.0)
        killer.join()
        seen["after"] = _live(http_port)
        tail = serve.tail()
    failed = [r for r in results if not r.ok]
    k = seen["killed_at"]
    return {"name": name, "requests": len(results), "failed": len(failed),
            "ok_after_kill": sum(r.ok for r in results if r.scheduled_s > k),
            "sent_after_kill": sum(r.scheduled_s > k for r in results),
            "first_failed_s": min((r.scheduled_s for r in failed), default=None),
            "last_failed_s": max((r.scheduled_s for r in failed), default=None),
            "killed_at_s": round(k, 2), "before": seen["before"], "after": seen["after"],
            "notices": [ln.strip()[:200] for ln in tail.splitlines()
                        if ln.startswith(("tritonserver exited", "tritonserver started again",
                                          "tritonserver did not start"))]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (Poisson)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--kill-at", type=float, default=20.0, help="SIGSEGV the server this many seconds in")
    p.add_argument("--max-gap-s", type=float, default=10.0, help="the longest window of failures that passes")
    args = p.parse_args()
    schedule = poisson_schedule(load_trace({"phases": [{"name": "load", "duration_s": args.seconds,
                                                         "rate_rps": args.rate}]}), seed=5, max_requests=10**6)
    arms = [arm("restarts (default)", [], schedule, args), arm("--max-restarts 0", ["--max-restarts", "0"],
                                                                 schedule, args)]
    print(f"{len(schedule)} requests at {args.rate:g} req/s for {args.seconds:g} s; SIGSEGV at {args.kill_at:g} s")
    for a in arms:
        lo, hi = a["first_failed_s"], a["last_failed_s"]
        window = "none" if lo is None else f"{lo:.2f}-{hi:.2f} s ({hi - lo:.2f} s)"
        print(f"{a['name']:>20}: {a['failed']} failed of {a['requests']} "
              f"(goodput {1 - a['failed'] / a['requests']:.3f}); failures scheduled {window}; after the kill {a['ok_after_kill']} of {a['sent_after_kill']} ok; "
              f"live config {a['before']} before, {a['after']} at the end")
        for n in a["notices"]:
            print(f"{'':>22}{n}")
    a = arms[0]
    good = (a["first_failed_s"] is None or a["last_failed_s"] - a["killed_at_s"] <= args.max_gap_s)
    print(json.dumps({"arms": arms}, indent=1), file=sys.stderr)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
