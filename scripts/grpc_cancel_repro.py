"""tritonserver 2.51 and gRPC clients that cancel late calls: the crash, and the load generator's way around it.

    .venv/bin/python scripts/grpc_cancel_repro.py --seconds 180

Two arms, each on its own fresh server (the pip tritonserver, `sim_accel`, one instance), the same Poisson
load (`--rate` req/s) with a client deadline near the model's latency (`--timeout-ms`), in 30-s rounds:

* `cancel`: a late gRPC call is cancelled at its deadline (what the load generator did before; what a client
  with a gRPC deadline does). In 2.51 (r24.10) a cancellation that races the answer can crash the server
  (SIGSEGV in the gRPC frontend's `ModelInferHandler::Process`; upstream triton-inference-server/server#7840,
  fixed in r24.12).
* `keep`: a late call is recorded as a timeout but left to finish (the load generator now, over gRPC).

Prints one line per round and one per arm: the rounds it ran, the late calls, and whether the server was
still up (or its exit code and the last lines of its log). The crash is a race: it may take a few rounds,
and a short run may not show it. Exit status 0 when the `keep` arm's server stayed up.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.evaluation import loadgen  # noqa: E402
from controller.server import ServerError, ServerOptions, TritonServer, free_port  # noqa: E402

MODEL = "sim_accel"
ROUND_S = 30.0


def arm(mode: str, seconds: float, rate: float, timeout_s: float) -> bool:
    """Runs one arm; True when its server was still up at the end."""
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), models=[MODEL])
    with TritonServer(options) as server:
        from controller.actuation import TritonControl
        make_inputs = loadgen.inputs_from_config(TritonControl(server.grpc_url, server.http_url).config(MODEL))
        rounds = max(1, round(seconds / ROUND_S))
        late = 0
        for i in range(rounds):
            trace = loadgen.load_trace({"phases": [{"name": "load", "duration_s": ROUND_S, "rate_rps": rate}]})
            schedule = loadgen.poisson_schedule(trace, seed=i, max_requests=10**7)
            records = loadgen.run_open_loop_sync(server.grpc_url, MODEL, schedule, make_inputs, timeout_s=timeout_s,
                                                 keep_late_calls=mode == "keep")
            late_now = sum(1 for r in records if r.error == loadgen.ERROR_TIMEOUT and r.sent_s is not None)
            late += late_now
            code = server.process.poll()
            print(f"{mode} round {i + 1}/{rounds}: {len(records)} requests, {sum(r.ok for r in records)} ok, "
                  f"{late_now} late in flight; server {'up' if code is None else f'exited {code}'}", flush=True)
            if code is not None:
                tail = Path(server.log_path).read_text(errors="replace").splitlines()[-10:]
                print(f"{mode}: the server died after {i + 1} round(s), {late} late calls; its log ends:\n  "
                      + "\n  ".join(tail), flush=True)
                return False
        print(f"{mode}: {rounds} round(s), {late} late calls, the server stayed up", flush=True)
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=180.0, help="load per arm (30-s rounds)")
    p.add_argument("--rate", type=float, default=250.0, help="requests per second")
    p.add_argument("--timeout-ms", type=float, default=30.0, help="the client's deadline per request")
    p.add_argument("--arms", default="cancel,keep", help="which arms, in order: cancel, keep")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ("cancel", "keep") for a in arms):
        p.error("--arms: a comma-separated list of cancel and keep")
    if args.seconds <= 0 or args.rate <= 0 or args.timeout_ms <= 0:
        p.error("--seconds, --rate and --timeout-ms must be > 0")
    try:
        up = {a: arm(a, args.seconds, args.rate, args.timeout_ms / 1e3) for a in arms}
    except (ServerError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("summary: " + ", ".join(f"{a}: server {'up' if ok else 'died'}" for a, ok in up.items()))
    return 0 if up.get("keep", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
