"""One model under `serve` as a user runs it, with a phased open-loop load: who decided each tick, and how well.

    .venv/bin/python scripts/walkthrough.py                                        # resnet_tiny, 6 req/s, 150 s
    .venv/bin/python scripts/walkthrough.py --model sim_accel --phases 60x40,300x40,60x40 --out results/walk

Starts `python -m controller serve --models MODEL` from this checkout (the pip tritonserver, the shipped
repository, the controller's defaults, its observation log on), waits for the model, drives open-loop Poisson
load through `--phases` (RATExSECONDS, comma-separated), takes a `python -m controller status` snapshot at the
end and stops serve. Then it reads the observation log (one line per tick) and the decision log and prints:

* the ticks per reason, and how many the planner's model decided ("model") and the reactive rules
  ("fallback" while the planner stands aside);
* the window's traced p99 over the observer's predicted p99 (median, p10, p90) on the ticks that had both;
* the changes applied, with their times from the start;
* requests sent and failed.

Two checkouts side by side (the same command in each, one after the other, on the same machine) compare two
versions of the controller on the same load; the run-to-run noise of a shared machine is as large as many a
difference, so run pairs, interleaved. Exit status 0 when no request failed.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GATES = {"HoldWarmup", "HoldSettling", "HoldNoData", "HoldReloading", "HoldBackoff"}


def parse_phases(text: str) -> list[dict]:
    """"6x150,25x40" -> two phases of (rate 6 req/s, 150 s) and (25 req/s, 40 s)."""
    phases = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        rate, sep, seconds = part.partition("x")
        try:
            r, s = float(rate), float(seconds)
        except ValueError:
            raise ValueError(f"--phases: expected RATExSECONDS, got {part!r}") from None
        if not sep or r <= 0 or s <= 0:
            raise ValueError(f"--phases: rate and seconds must be > 0, got {part!r}")
        phases.append({"name": f"p{i}", "duration_s": s, "rate_rps": r})
    if not phases:
        raise ValueError("--phases: at least one RATExSECONDS")
    return phases


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="walkthrough.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet_tiny", help="a model of the shipped repository (default resnet_tiny)")
    p.add_argument("--phases", default="6x150", help="RATExSECONDS, comma-separated (default 6x150)")
    p.add_argument("--seed", type=int, default=3, help="the arrivals' seed (default 3)")
    p.add_argument("--out", help="folder for the logs, the status snapshot and summary.json (default: a temporary one)")
    args = p.parse_args(argv)
    try:
        args.phase_list = parse_phases(args.phases)
    except ValueError as e:
        p.error(str(e))
    return args


def summarise(observations: list[dict], decisions: list[dict], model: str) -> dict:
    """Ticks per reason and per mode, traced / predicted p99, and the changes applied, from the two logs."""
    from controller.traces import nearest_rank
    ticks = [r for r in observations if r.get("model") == model]
    reasons = collections.Counter(str(r.get("reason")) for r in ticks)
    decided = [r for r in ticks if r.get("reason") not in GATES and r.get("mode")]
    modes = collections.Counter(r["mode"] for r in decided)
    ratios = sorted(r["obs"]["p99_ms"] / r["obs"]["predicted_p99_ms"] for r in decided
                    if r["obs"].get("p99_ms") and r["obs"].get("predicted_p99_ms"))
    start = ticks[0]["t"] if ticks else 0.0
    changes = [{"t_s": round(d["t"] - start, 1), "reason": d["reason"], "target": d.get("target")}
               for d in decisions if d.get("model") == model and d.get("action") == "applied"]

    def at(q: float) -> float | None:
        value = nearest_rank(ratios, q)
        return None if value is None else round(value, 2)

    return {"ticks": len(ticks), "reasons": dict(reasons), "modes": dict(modes),
            "traced_over_predicted": {"ticks": len(ratios), "median": at(0.5), "p10": at(0.1), "p90": at(0.9)},
            "changes": changes}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from controller.decision_log import read_rotated
    from controller.evaluation.arm import stop_process
    from controller.evaluation.loadgen import load_trace, make_inputs_from_config, poisson_schedule, run_open_loop_sync
    from controller.server import free_port

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="walkthrough-"))
    out.mkdir(parents=True, exist_ok=True)
    http, grpc, metrics, status_port = free_port(), free_port(), free_port(), free_port()
    config = out / "controller.yaml"
    config.write_text(f"controller:\n  observation_log: {out / 'observations.jsonl'}\n"
                      f"  decision_log: {out / 'decisions.jsonl'}\n")
    seconds = sum(p["duration_s"] for p in args.phase_list)
    serve_log = open(out / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "controller", "serve", "--models", args.model, "--config", str(config),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--controller-metrics-port", str(status_port), "--duration-s", str(seconds + 120)],
        cwd=ROOT, stdout=serve_log, stderr=subprocess.STDOUT)
    records: list = []
    try:
        deadline = time.time() + 180
        while True:
            if serve.poll() is not None or time.time() > deadline:
                print(f"serve did not make {args.model} ready (see {out / 'serve.log'})", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{args.model}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1.0)
        inputs = make_inputs_from_config(f"http://127.0.0.1:{http}", args.model)
        trace = load_trace({"phases": args.phase_list})
        schedule = poisson_schedule(trace, seed=args.seed, max_requests=10_000_000)
        records = run_open_loop_sync(f"127.0.0.1:{grpc}", args.model, schedule, inputs, timeout_s=10.0)
        time.sleep(2.5)                                   # a tick more reads the last traces
        status = subprocess.run([sys.executable, "-m", "controller", "status", "--pid", str(serve.pid)], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        (out / "status.txt").write_text(status.stdout + status.stderr)
    finally:
        stop_process(serve, timeout_s=60.0)
        serve_log.close()
    summary = summarise(read_rotated(out / "observations.jsonl"), read_rotated(out / "decisions.jsonl"), args.model)
    failed = sum(1 for r in records if not r.ok)
    summary.update(model=args.model, phases=args.phases, requests=len(records), failed=failed)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    t = summary["traced_over_predicted"]
    print(f"{args.model}, phases {args.phases} (req/s x s): {len(records)} requests, {failed} failed; logs in {out}")
    print(f"ticks {summary['ticks']}: {summary['modes'].get('model', 0)} decided by the planner's model, "
          f"{summary['modes'].get('fallback', 0)} by the reactive rules (planner aside)")
    print(f"traced / predicted p99 over {t['ticks']} ticks: median {t['median']}, p10 {t['p10']}, p90 {t['p90']}")
    print("reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["reasons"].items(), key=lambda kv: -kv[1])))
    for c in summary["changes"]:
        print(f"  {c['t_s']:7.1f} s  {c['reason']} -> {c['target']}")
    return 0 if records and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
