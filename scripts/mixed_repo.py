"""A mixed repository under load with `serve` (issue 15): an ensemble, a BLS model and a model without batching.

    .venv/bin/python scripts/mixed_repo.py --minutes 4 --out docs/bench/mixed_repo.json

Runs `python -m controller serve --repository scripts/scenarios/repos/mixed --config scripts/scenarios/mixed.yaml`
(the ensemble `ens` has a p99 target, its step `ens_step` is managed under the target it passes down; `bls` calls
`plain`; `plain` has no batching), drives open-loop Poisson load at `ens`, `bls` and `plain` at once, takes a
`python -m controller status` snapshot half-way, stops serve and reports from the clients and the decision log:

* failed requests per model (must be 0);
* failed (refused) reloads in the decision log, per model (must be 0), and the changes applied;
* the ensemble's client-side p99 per minute against its target, beside the ensemble's server-side p99 (its
  request traces, from the controller's observation log) and its step's p99, instances and derived target.

Exit status 0 when no request failed and no reload failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.evaluation.loadgen import inputs_from_config, load_trace, poisson_schedule, run_open_loop_sync  # noqa: E402
from controller.decision_log import read_rotated  # noqa: E402
from controller.evaluation.serveproc import ServeProcess  # noqa: E402
from controller.server import free_port  # noqa: E402

REPOSITORY = ROOT / "scripts" / "scenarios" / "repos" / "mixed"
CONFIG = ROOT / "scripts" / "scenarios" / "mixed.yaml"
ENSEMBLE, STEP = "ens", "ens_step"


class Load(threading.Thread):
    """Open-loop Poisson load at one model for `seconds`; the records are kept (times from `t0`)."""

    def __init__(self, grpc_url: str, model: str, cfg: dict, rate_rps: float, seconds: float, seed: int):
        super().__init__(daemon=True)
        self.grpc_url, self.model, self.cfg = grpc_url, model, cfg
        trace = load_trace({"phases": [{"name": "busy", "duration_s": seconds, "rate_rps": rate_rps}]})
        self.schedule = poisson_schedule(trace, seed=seed, max_requests=int(rate_rps * seconds * 2) + 10)
        self.records: list = []
        self.t0 = 0.0

    def run(self) -> None:
        self.t0 = time.time()
        self.records = run_open_loop_sync(self.grpc_url, self.model, self.schedule, inputs_from_config(self.cfg),
                                          timeout_s=10.0)


def _p99(values) -> float | None:
    return round(float(np.percentile(values, 99)), 1) if len(values) else None


def per_minute_client(load: Load, minutes: int) -> list[dict]:
    """Client-side p99 per minute of completion (ok requests), with counts."""
    rows = []
    done = np.array([r.done_s for r in load.records if r.ok])
    lat = np.array([1000 * r.latency_s for r in load.records if r.ok])
    for m in range(minutes):
        sel = (done >= 60 * m) & (done < 60 * (m + 1))
        rows.append({"minute": m + 1, "requests": int(sel.sum()), "client_p99_ms": _p99(lat[sel]),
                     "client_p50_ms": round(float(np.median(lat[sel])), 1) if sel.any() else None})
    return rows


def per_minute_server(observations: list[dict], t0: float, minutes: int, model: str) -> list[dict]:
    """The controller's view per minute: median of its per-tick p99 (and source), instances, target."""
    rows = []
    for m in range(minutes):
        obs = [o for o in observations if o["model"] == model and t0 + 60 * m <= o["time"] < t0 + 60 * (m + 1)]
        valid = [o for o in obs if o["obs"].get("valid", True) and o["obs"].get("p99_ms") is not None]
        p99 = [o["obs"]["p99_ms"] for o in valid]
        mean = [o["obs"]["mean_ms"] for o in valid if o["obs"].get("mean_ms")]
        inst = [o["current"]["instances"] for o in obs if o.get("current")]
        target = [o["target_ms"] for o in obs if o.get("target_ms") is not None]
        rows.append({"minute": m + 1, "ticks": len(obs),
                     "server_p99_ms_median": round(float(np.median(p99)), 1) if p99 else None,
                     "server_p99_ms_max": round(float(max(p99)), 1) if p99 else None,
                     "server_mean_ms_median": round(float(np.median(mean)), 1) if mean else None,
                     "p99_sources": sorted({o["obs"].get("p99_source") for o in valid}),
                     "instances_last": inst[-1] if inst else None,
                     "target_ms_last": target[-1] if target else None})
    return rows


def timeline(loads: dict[str, Load], observations: list[dict], decisions: list[dict], t0: float, seconds: float,
             step_s: float = 10.0) -> list[dict]:
    """Every `step_s`: each model's client p99 (by completion time), the ensemble's and its step's p99 as the
    controller saw them (last tick in the interval), the step's instances and target, and the changes applied."""
    rows = []
    series = {m: (np.array([r.done_s for r in ld.records if r.ok]), np.array([1000 * r.latency_s for r in ld.records if r.ok]))
              for m, ld in loads.items()}
    for k in range(int(np.ceil(seconds / step_s))):
        a, b = k * step_s, (k + 1) * step_s
        row: dict = {"t_s": int(a)}
        for m, (done, lat) in series.items():
            row[f"{m}_client_p99"] = _p99(lat[(done >= a) & (done < b)])
        for m in (ENSEMBLE, STEP):
            obs = [o for o in observations if o["model"] == m and t0 + a <= o["time"] < t0 + b]
            if obs:
                row[f"{m}_p99"] = obs[-1]["obs"].get("p99_ms")
                if m == STEP:
                    row["step_instances"] = (obs[-1].get("current") or {}).get("instances")
                    row["step_target"] = obs[-1].get("target_ms")
        row["changes"] = [f'{d["model"]} {d["reason"]} -> {d["target"]["instances"]} inst/{d["target"]["delay_us"]} us'
                          for d in decisions if d["action"] in ("applied", "failed", "claimed", "claim_failed") and t0 + a <= d["time"] < t0 + b]
        rows.append(row)
    return rows


def run(minutes: float, rates: dict[str, float], work: Path, log=print) -> dict:
    http, grpc, metrics = free_port(), free_port(), free_port()
    cfg_doc = yaml.safe_load(CONFIG.read_text())
    cfg_doc.setdefault("controller", {})["observation_log"] = str(work / "observations.jsonl")
    config = work / "controller.yaml"
    config.write_text(yaml.safe_dump(cfg_doc))
    decision_log = work / "decisions.jsonl"
    env = {**os.environ, "TRITON_AUTOTUNE_RUN_DIR": str(work / "run")}
    serve_args = ["--repository", str(REPOSITORY), "--config", str(config), "--http-port", str(http), "--grpc-port",
                  str(grpc), "--metrics-port", str(metrics), "--decision-log", str(decision_log)]
    log("$ -m controller serve " + " ".join(serve_args))
    serve = ServeProcess(serve_args, cwd=ROOT, env=env, keep_lines=100_000)
    loads: dict[str, Load] = {}
    status_text = status_json = None
    t_start = time.time()
    try:
        serve.start()
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        seconds = minutes * 60
        for i, (model, rate) in enumerate(rates.items()):
            cfg = client.get_model_config(model, as_json=True)["config"]
            loads[model] = Load(f"127.0.0.1:{grpc}", model, cfg, rate, seconds, seed=100 + i)
        t_start = time.time()
        for load in loads.values():
            load.start()
        time.sleep(seconds / 2)
        st = [sys.executable, "-m", "controller", "status", "--pid", str(serve.pid)]
        status_text = subprocess.run(st, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30).stdout
        log(status_text)
        status_json = json.loads(subprocess.run(st + ["--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                                                timeout=30).stdout or "null")
        for load in loads.values():
            load.join(timeout=seconds + 60)
    finally:
        serve.stop(timeout_s=60)
    decisions = read_rotated(decision_log)
    observations = read_rotated(work / "observations.jsonl")
    n_min = max(1, int(round(minutes)))
    target = float(cfg_doc["models"][ENSEMBLE]["p99_target_ms"])
    out = {"minutes": minutes, "rates_rps": rates, "ensemble_target_ms": target,
           "serve_command": f"-m controller serve --repository {REPOSITORY.relative_to(ROOT)} "
                            "--config scripts/scenarios/mixed.yaml (+ observation_log)",
           "serve_exit": serve.exit_code, "models": {}, "reloads": {},
           # why: a request that failed because the server died and was started again is told apart from one refused
           "serve_notices": [ln for ln in serve.tail().splitlines() if "starting it again" in ln or "killed" in ln
                             or "started again" in ln]}
    for model, load in loads.items():
        recs = load.records
        failed = [r for r in recs if not r.ok]
        errors: dict[str, int] = {}
        for r in failed:
            errors[(r.error or "?")[:120]] = errors.get((r.error or "?")[:120], 0) + 1
        lat = [1000 * r.latency_s for r in recs if r.ok]
        out["models"][model] = {"rate_rps": rates[model], "requests": len(recs), "failed": len(failed), "errors": errors,
                                "client_p99_ms": _p99(lat), "per_minute": per_minute_client(load, n_min)}
    for model in sorted({d["model"] for d in decisions}):
        mine = [d for d in decisions if d["model"] == model]
        out["reloads"][model] = {
            "applied": [f'{d["reason"]}: {d["target"]["instances"]} inst, {d["target"]["delay_us"]} us ({d.get("kind")})'
                        for d in mine if d["action"] in ("applied", "claimed")],
            "failed": [f'{d["reason"]}: {d.get("error")}' for d in mine if d["action"] in ("failed", "claim_failed")],
            "hold_reasons": sorted({d["reason"] for d in mine if d["action"] == "hold"})}
    server_ens = per_minute_server(observations, t_start, n_min, ENSEMBLE)
    server_step = per_minute_server(observations, t_start, n_min, STEP)
    out["ensemble_per_minute"] = [
        {"minute": c["minute"], "client_p99_ms": c["client_p99_ms"], "target_ms": target,
         "meets": c["client_p99_ms"] is not None and c["client_p99_ms"] <= target,
         "server_p99_ms": s["server_p99_ms_median"], "server_p99_ms_max": s["server_p99_ms_max"],
         "server_mean_ms": s["server_mean_ms_median"],
         "step_p99_ms": st_["server_p99_ms_median"], "step_mean_ms": st_["server_mean_ms_median"],
         "step_instances": st_["instances_last"], "step_target_ms": st_["target_ms_last"]}
        for c, s, st_ in zip(out["models"][ENSEMBLE]["per_minute"], server_ens, server_step)]
    out["timeline_10s"] = timeline(loads, observations, decisions, t_start, minutes * 60)
    out["per_minute_server"] = {m: per_minute_server(observations, t_start, n_min, m) for m in (*rates, STEP)}
    # the same gap on every model, ensemble or not, says where it comes from: outside the server's request span
    out["client_vs_server_p99_ms"] = {
        m: [[c["client_p99_ms"], sv["server_p99_ms_max"]] for c, sv in zip(out["models"][m]["per_minute"], out["per_minute_server"][m])]
        for m in rates}
    out["failed_requests"] = sum(m["failed"] for m in out["models"].values())
    out["failed_reloads"] = sum(len(r["failed"]) for r in out["reloads"].values())
    out["status_text"] = status_text
    out["status_json"] = status_json
    out["serve_log_tail"] = [line for line in serve.tail().splitlines() if "p99 target" in line or "managed as" in line
                             or "knobs" in line or "error" in line.lower()][-60:]
    return out


def report(doc: dict) -> str:
    lines = [f'{m}: {d["requests"]} requests at {d["rate_rps"]:g}/s, {d["failed"]} failed, client p99 {d["client_p99_ms"]} ms'
             for m, d in doc["models"].items()]
    for m, r in doc["reloads"].items():
        lines.append(f'{m}: {len(r["applied"])} changes applied, {len(r["failed"])} failed')
    lines.append(f'ens per minute (target {doc["ensemble_target_ms"]:g} ms): client p99 / server p99 (median, max of the '
                 f'controller\'s windows) / step p99 / step target / step instances')
    for row in doc["ensemble_per_minute"]:
        lines.append(f'  min {row["minute"]}: {row["client_p99_ms"]} / {row["server_p99_ms"]}, {row["server_p99_ms_max"]} / {row["step_p99_ms"]} / '
                     f'{row["step_target_ms"]} / {row["step_instances"]}{"" if row["meets"] else "  (over)"}')
    for m, rows in (doc.get("client_vs_server_p99_ms") or {}).items():
        lines.append(f'{m} per minute, client p99 vs the highest server-side p99 the controller saw: '
                     + ", ".join(f"{c} vs {sv}" for c, sv in rows))
    lines.append(f'failed requests {doc["failed_requests"]}, failed reloads {doc["failed_reloads"]}')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--ens-rps", type=float, default=150.0)
    p.add_argument("--bls-rps", type=float, default=30.0)
    p.add_argument("--plain-rps", type=float, default=40.0)
    p.add_argument("--out", type=Path, help="write the report as JSON here (e.g. docs/bench/mixed_repo.json)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mixed_repo_") as tmp:
        doc = run(args.minutes, {"ens": args.ens_rps, "bls": args.bls_rps, "plain": args.plain_rps}, Path(tmp))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(report(doc))
    return 0 if doc["failed_requests"] == 0 and doc["failed_reloads"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
