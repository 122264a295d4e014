"""The load generator and Python's garbage collector: a full collection's pause, read as server latency.

    .venv/bin/python scripts/gc_pause_repro.py                     # plain, then frozen
    .venv/bin/python scripts/gc_pause_repro.py --arms frozen,plain  # the other order

One process holds a big heap (`--objects` small long-lived objects, as a long test session or a bench process
may) while a neighbour thread calls `gc.collect()` every `--every-s` seconds, the way the collector runs by
itself when allocations pile up. In that process, one fresh server (the pip tritonserver, `sim_accel`, one
instance) is swept at `--rates` for `--seconds` each, twice:

* `plain`: the load generator without `loadgen.gc_frozen` (what it was before): every full collection walks the
  whole heap while holding the GIL, the event loop stops, and the requests due meanwhile go out late. Their
  latency counts from the scheduled time, so the p99 reads the client's pause as the server's.
* `frozen`: the load generator as it is: the heap alive when a run starts is frozen out of the collector
  (gc.freeze), so the neighbour's collections walk only what the run allocates.

Prints each arm's sweep table. Measured here (2 cores, 3 M objects, every 0.7 s, 60 and 61 req/s, 3-s cells):
p99 674 / 730 ms plain against 19.0 / 17.6 ms frozen; in the other order 29.0 / 22.6 frozen, 933 / 980 plain.
Exit status 0 when every frozen cell met the SLA.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ("plain", "frozen")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gc_pause_repro.py", description=__doc__.split("\n")[0])
    p.add_argument("--objects", type=int, default=3_000_000, help="long-lived objects in the heap (default 3 M)")
    p.add_argument("--every-s", type=float, default=0.7, help="seconds between the neighbour's collections")
    p.add_argument("--rates", default="60,61", help="comma-separated req/s, one sweep cell each")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell (after 1 s of warm-up)")
    p.add_argument("--arms", default="plain,frozen", help="the arms, in order: plain, frozen or both")
    p.add_argument("--out", default="results/gc_pause", help="folder for each arm's sweep output")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms: expected plain and/or frozen, got {args.arms!r}")
    if args.objects < 0 or args.every_s <= 0 or args.seconds <= 0:
        p.error("--objects must be >= 0, --every-s and --seconds > 0")
    args.arm_list = arms
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import json

    from controller.cli import main as cli
    from controller.evaluation import loadgen

    heap = [{"a": [i, str(i)], "b": (i,)} for i in range(args.objects)]     # noqa: F841  (held, not used)
    stop = threading.Event()

    def neighbour() -> None:
        while not stop.wait(args.every_s):
            gc.collect()

    real, frozen_ok = loadgen.gc_frozen, True
    for arm in args.arm_list:
        loadgen.gc_frozen = real if arm == "frozen" else contextlib.nullcontext
        print(f"== {arm}: {args.objects:,} objects held, a full collection every {args.every_s:g} s", flush=True)
        t0 = time.perf_counter()
        gc.collect()
        print(f"   (one full collection over this heap, unfrozen: {1e3 * (time.perf_counter() - t0):.0f} ms)", flush=True)
        thread = threading.Thread(target=neighbour, daemon=True)
        stop.clear()
        thread.start()
        out = Path(args.out) / arm
        try:
            rc = cli(["sweep", "--model", "sim_accel", "--instances", "1", "--delays-us", "0", "--rates", args.rates,
                      "--seconds", f"{args.seconds:g}", "--warmup-s", "1", "--sla-ms", "40", "--out", str(out)])
        finally:
            stop.set()
            thread.join()
            loadgen.gc_frozen = real
        if rc != 0:
            return rc
        if arm == "frozen":
            frozen_ok = all(c["met_sla"] for c in json.loads((out / "sweep.json").read_text())["cells"])
    return 0 if frozen_ok else 1


if __name__ == "__main__":
    sys.exit(main())
