"""A BLS model whose callee holds its latency, with and without the call traced (controller/calls.py).

    .venv/bin/python scripts/bls_check.py --seconds 150 --out docs/bench/bls_check.json

Two runs of `python -m controller serve`, one after the other, on a copy of the mixed repository's `bls` and
`plain` (scripts/scenarios/repos/mixed): `bls` calls `plain` once per row. The controller's config names
`bls` with a p99 target and `plain` with the defaults' (loose) one, as a user who cares for the model their
clients call would write it. The arms differ in one line of `bls/1/model.py`:

* `traced`: the call passes the request's trace on (`trace=request.trace()`, as shipped), so the controller
  sees that bls calls plain and runs plain under bls's target (controller/ensemble.py);
* `untraced`: the same without `trace=` (the call is then not traced; since the forty-fourth session the
  controller finds `plain` named in bls's model.py instead, serve's repository being readable: calls.py).

The same open-loop Poisson load in both: `bls` and, directly, `plain`. Printed per arm: each model's client
p99 and failures, the share of `bls`'s 10-s buckets over its target, the changes applied, and the target
plain ran under. Exit status 0 when no request failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from controller.decision_log import read_rotated  # noqa: E402
from controller.evaluation.serveproc import ServeProcess  # noqa: E402
from controller.server import free_port  # noqa: E402
from mixed_repo import Load, _p99  # noqa: E402

MIXED = ROOT / "scripts" / "scenarios" / "repos" / "mixed"
TRACE_ARG = "trace=request.trace()"


def make_repo(dest: Path, traced: bool) -> None:
    for model in ("bls", "plain"):
        # why: symlinks=False: plain's model.py is a relative link, which a copy elsewhere would leave dangling
        shutil.copytree(MIXED / model, dest / model, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    if not traced:
        code = dest / "bls" / "1" / "model.py"
        text = code.read_text()
        assert TRACE_ARG in text, "the shipped bls passes its trace on"
        code.write_text(text.replace(TRACE_ARG, ""))


def run_arm(traced: bool, seconds: float, rates: dict[str, float], target_ms: float, work: Path) -> dict:
    repo = work / "repo"
    make_repo(repo, traced)
    config = work / "controller.yaml"
    config.write_text(yaml.safe_dump({
        "controller": {"gpu": "simulated", "observation_log": str(work / "observations.jsonl")},
        "defaults": {"p99_target_ms": 1000},
        "models": {"bls": {"p99_target_ms": target_ms, "max_instances": 3}, "plain": {"max_instances": 3}}}))
    http, grpc, metrics = free_port(), free_port(), free_port()
    decision_log = work / "decisions.jsonl"
    env = {**os.environ, "TRITON_AUTOTUNE_RUN_DIR": str(work / "run")}
    serve = ServeProcess(["--repository", str(repo), "--config", str(config), "--http-port", str(http),
                          "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--decision-log",
                          str(decision_log)], cwd=ROOT, env=env)
    loads: dict[str, Load] = {}
    try:
        serve.start()
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        for i, (model, rate) in enumerate(rates.items()):
            cfg = client.get_model_config(model, as_json=True)["config"]
            loads[model] = Load(f"127.0.0.1:{grpc}", model, cfg, rate, seconds, seed=200 + i)
        for load in loads.values():
            load.start()
        for load in loads.values():
            load.join(timeout=seconds + 60)
    finally:
        serve.stop(timeout_s=60)
    decisions = read_rotated(decision_log)
    observations = read_rotated(work / "observations.jsonl")
    out: dict = {"arm": "traced" if traced else "untraced", "serve_exit": serve.exit_code, "models": {},
                 # the controller's lines about the call: targets passed, curves dropped
                 "serve_lines": [ln for ln in serve.tail().splitlines()
                                 if any(k in ln for k in ("p99 target", "managed as", "dropped the service"))]}
    for model, load in loads.items():
        ok = [r for r in load.records if r.ok]
        lat = np.array([1000 * r.latency_s for r in ok])
        done = np.array([r.done_s for r in ok])
        buckets = [_p99(lat[(done >= a) & (done < a + 10)]) for a in range(0, int(seconds), 10)]
        out["models"][model] = {
            "requests": len(load.records), "failed": len(load.records) - len(ok), "client_p99_ms": _p99(lat),
            "client_p99_per_10s": buckets,
            "changes": [f'{round(d["t"] - decisions[0]["t"])} s {d["reason"]} -> {d["target"]["instances"]} inst'
                        for d in decisions if d["model"] == model and d["action"] == "applied"],
            "targets_ms": sorted({o["target_ms"] for o in observations if o["model"] == model}),
            "hold_ticks": dict(Counter(o["reason"] for o in observations if o["model"] == model
                                       and o.get("reason")).most_common(4)),
            "instance_s": round(sum(((o.get("current") or {}).get("instances") or 0) for o in observations
                                    if o["model"] == model) * 2.0, 1)}
    b = out["models"]["bls"]["client_p99_per_10s"]
    out["bls_buckets_over_target"] = f"{sum(x is not None and x > target_ms for x in b)} of {len(b)}"
    return out


def report(doc: dict) -> str:
    lines = []
    for arm in doc["arms"]:
        lines.append(f'{arm["arm"]}: bls 10-s buckets over {doc["target_ms"]:g} ms: {arm["bls_buckets_over_target"]}')
        for m, d in arm["models"].items():
            lines.append(f'  {m}: {d["requests"]} requests, {d["failed"]} failed, client p99 {d["client_p99_ms"]} ms; '
                         f'targets {d["targets_ms"]}; ~{d["instance_s"]} instance-s; changes {d["changes"]}')
            lines.append(f'    p99 per 10 s: {d["client_p99_per_10s"]}')
            lines.append(f'    reasons (ticks): {d["hold_ticks"]}')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--bls-rps", type=float, default=45.0)
    p.add_argument("--plain-rps", type=float, default=50.0)
    p.add_argument("--target-ms", type=float, default=60.0, help="bls's p99 target")
    p.add_argument("--arms", default="untraced,traced")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rates = {"bls": args.bls_rps, "plain": args.plain_rps}
    doc = {"seconds": args.seconds, "rates_rps": rates, "target_ms": args.target_ms, "started": time.time(),
           "arms": []}
    for arm in args.arms.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bls_check_{arm}_") as tmp:
            doc["arms"].append(run_arm(arm == "traced", args.seconds, rates, args.target_ms, Path(tmp)))
        print(report({**doc, "arms": doc["arms"][-1:]}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(d["failed"] == 0 for a in doc["arms"] for d in a["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
