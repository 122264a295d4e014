"""Triton Model Analyzer as a bench arm: run it offline on the bench's grid, record its wall time and pick.

What a Triton user does instead of this project: run Model Analyzer (MA) once, offline, with the SLA as its
p99 constraint, and deploy the config it recommends. This module runs that (`run`, from
scripts/model_analyzer.sh, with MA in its own virtualenv) and the bench replays the pick as a fifth,
static arm `model_analyzer` (`load_pick`, `time_to_tuned_line`).

How MA is run (local launch mode, the pip tritonserver of nvidia-pytriton, perf_analyzer from
tritonclient[all]; see ../shared/triton-notes.md):
  * brute search over exactly the bench's grid (`run_config_search_disable` with
    `model_config_parameters`): instance_group count x dynamic_batching max_queue_delay_microseconds;
    MA also profiles the model's own config (`<model>_config_default`);
  * closed-loop concurrency 1, 2, 4, ..., 32 per config (MA's load is concurrency; 32 = max_batch_size);
  * constraint `perf_latency_p99 <= sla_ms`, objective MA's default (throughput);
  * every server MA starts listens on loopback, on free ports.

MA's pick: MA writes `results/metrics-model-inference.csv` with one row per (config, concurrency), the
configs in MA's own ranking (best first) and each config's measurements that meet the constraints first
(`ResultTableManager.tabulate_results` in MA 1.58). The pick is the config of the first row marked
`Satisfies Constraints = Yes`; none such: no pick. The config's instance count and delay are read from
the variant MA wrote (`output_model_repository/<variant>/config.pbtxt`).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..types import Settings

MA_VERSION = "1.58.0"
TRITONCLIENT_VERSION = "2.51.0"
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
RESULT_CSV = Path("results") / "metrics-model-inference.csv"


class ModelAnalyzerError(ValueError):
    """A Model Analyzer run or result that cannot be used; one line for the user."""


# ---------------------------------------------------------------------------------------------
# Pure: MA's config, its result table, its pick
# ---------------------------------------------------------------------------------------------
def ma_config(*, model: str, repository: Path, work: Path, sla_ms: float, instances: Sequence[int],
              delays_us: Sequence[int], concurrency: Sequence[int], tritonserver: Path, perf_analyzer: Path,
              backend_dir: Path, ports: tuple[int, int, int], environment: dict[str, str]) -> dict:
    """The `model-analyzer profile -f` YAML document (as a dict) for the bench's grid.

    Example: instances (1, 2), delays (0, 2000) -> MA profiles 4 configs plus the model's own default.
    """
    http, grpc, metrics = ports
    return {
        "model_repository": str(repository),
        "output_model_repository_path": str(work / "output_model_repository"),
        "override_output_model_repository": True,
        "export_path": str(work / "export"),
        "checkpoint_directory": str(work / "checkpoints"),
        "triton_launch_mode": "local",
        "triton_server_path": str(tritonserver),
        "perf_analyzer_path": str(perf_analyzer),
        "triton_output_path": str(work / "tritonserver.log"),
        "triton_http_endpoint": f"localhost:{http}",
        "triton_grpc_endpoint": f"localhost:{grpc}",
        "triton_metrics_url": f"http://localhost:{metrics}/metrics",
        "triton_server_flags": {"backend-directory": str(backend_dir), "http-address": "127.0.0.1",
                                "grpc-address": "127.0.0.1", "metrics-address": "127.0.0.1"},
        "triton_server_environment": dict(environment),
        "run_config_search_disable": True,
        "constraints": {"perf_latency_p99": {"max": float(sla_ms)}},
        "skip_detailed_reports": True,
        "profile_models": {model: {
            "cpu_only": True,
            "parameters": {"concurrency": [int(c) for c in concurrency]},
            "model_config_parameters": {
                # a list of lists: MA sweeps the outer list (one instance_group per value)
                "instance_group": [[{"kind": "KIND_CPU", "count": int(n)}] for n in instances],
                "dynamic_batching": {"max_queue_delay_microseconds": [int(d) for d in delays_us]},
            },
        }},
    }


@dataclass(frozen=True)
class MARow:
    variant: str                # MA's "Model Config Path", e.g. sim_accel_config_3
    concurrency: int | None
    satisfies: bool
    throughput: float | None    # infer/s
    p99_ms: float | None


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def parse_inference_csv(text: str) -> list[MARow]:
    """MA's metrics-model-inference.csv, rows in file order (MA's ranking).

    Columns used: Model Config Path, Concurrency, Satisfies Constraints, Throughput (infer/sec),
    p99 Latency (ms). Raises ModelAnalyzerError when a needed column is missing.
    """
    reader = csv.DictReader(io.StringIO(text))
    fields = {(f or "").strip(): f for f in reader.fieldnames or []}

    def col(*names: str, required: bool = True) -> str | None:
        for n in names:
            if n in fields:
                return fields[n]
        if required:
            raise ModelAnalyzerError(f"Model Analyzer's result table has no column {names[0]!r} "
                                     f"(columns: {', '.join(fields)})")
        return None

    c_variant, c_sat = col("Model Config Path"), col("Satisfies Constraints")
    c_conc = col("Concurrency", required=False)
    c_thr = col("Throughput (infer/sec)", required=False)
    c_p99 = col("p99 Latency (ms)", required=False)
    rows = []
    for r in reader:
        if not (r.get(c_variant) or "").strip():
            continue
        conc = _num(r.get(c_conc)) if c_conc else None
        rows.append(MARow(variant=r[c_variant].strip(), concurrency=None if conc is None else int(conc),
                          satisfies=(r.get(c_sat) or "").strip().lower() == "yes",
                          throughput=_num(r.get(c_thr)) if c_thr else None,
                          p99_ms=_num(r.get(c_p99)) if c_p99 else None))
    return rows


def best_row(rows: Sequence[MARow]) -> MARow | None:
    """MA's pick: the first row (MA's ranking) that meets the constraints; None if none does."""
    return next((r for r in rows if r.satisfies), None)


def _blocks(text: str, field: str) -> list[str]:
    """The bodies of every `field { ... }` or `field [ ... ]` (brackets balanced) in protobuf text."""
    out = []
    for m in re.finditer(rf"\b{field}\s*:?\s*([\[{{])", text):
        depth, i = 0, m.start(1)
        for j in range(i, len(text)):
            depth += text[j] in "[{"
            depth -= text[j] in "]}"
            if depth == 0:
                out.append(text[i + 1:j])
                break
    return out


def settings_from_pbtxt(text: str) -> Settings:
    """Instance count (summed over instance groups; 1 if none is given) and max_queue_delay_microseconds
    (0 if absent) from a model config in protobuf text format.

    Both forms count: 'instance_group [ { count: 4 kind: KIND_CPU } ]' (as written by hand) and
    'instance_group { count: 4 kind: KIND_CPU }' (as MA writes its variants). Example: that group and
    'dynamic_batching { max_queue_delay_microseconds: 2000 }' -> Settings(4, 2000).
    """
    counts = [int(c) for block in _blocks(text, "instance_group") for c in re.findall(r"\bcount\s*:\s*(\d+)", block)]
    delay = re.search(r"\bmax_queue_delay_microseconds\s*:\s*(\d+)", text)
    return Settings(sum(counts) if counts else 1, int(delay.group(1)) if delay else 0)


def summary_report_best(html: str, model: str) -> str | None:
    """The first config of the table in MA's summary report (result_summary.html or .pdf's html), a cross-check
    of the pick read from the CSV: the table lists each config at its best measurement under the constraints,
    best first. None if the report has no such table."""
    text = re.sub(r"<[^>]*>", " ", html)
    at = text.find("Model Config Name")
    m = re.search(rf"\b({re.escape(model)}_config_\w+)", text[at:]) if at >= 0 else None
    return m.group(1) if m else None


def pick_document(rows: Sequence[MARow], variant_settings: dict[str, Settings]) -> dict | None:
    """The `pick` of model_analyzer.json: MA's best config under the constraint and its measurement."""
    best = best_row(rows)
    if best is None:
        return None
    s = variant_settings.get(best.variant)
    if s is None:
        raise ModelAnalyzerError(f"Model Analyzer picked {best.variant!r} but its config was not found")
    return {"variant": best.variant, "instances": s.instance_count, "delay_us": s.max_queue_delay_us,
            "concurrency": best.concurrency, "throughput_rps": best.throughput, "p99_ms": best.p99_ms}


def configs_table(rows: Sequence[MARow], variant_settings: dict[str, Settings]) -> list[dict]:
    """Per config in MA's ranking: its settings, its best measurement meeting the constraint (if any)."""
    out: dict[str, dict] = {}
    for r in rows:
        s = variant_settings.get(r.variant)
        e = out.setdefault(r.variant, {"variant": r.variant,
                                       "instances": None if s is None else s.instance_count,
                                       "delay_us": None if s is None else s.max_queue_delay_us,
                                       "measurements": 0, "best_passing": None})
        e["measurements"] += 1
        if r.satisfies and e["best_passing"] is None:
            e["best_passing"] = {"concurrency": r.concurrency, "throughput_rps": r.throughput, "p99_ms": r.p99_ms}
    return list(out.values())


def load_pick(path: Path) -> tuple[Settings, dict]:
    """Read model_analyzer.json for the bench: (the pick as Settings, the whole document).

    Raises ModelAnalyzerError if the file has no pick (MA failed, or nothing met the constraint).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ModelAnalyzerError(f"{path}: {e}") from None
    pick = doc.get("pick") if isinstance(doc, dict) else None
    if not isinstance(pick, dict) or not isinstance(pick.get("instances"), int) or not isinstance(pick.get("delay_us"), int):
        why = doc.get("error") if isinstance(doc, dict) else None
        raise ModelAnalyzerError(f"{path}: no Model Analyzer pick" + (f" ({why})" if why else ""))
    if pick["instances"] < 1 or pick["delay_us"] < 0:
        raise ModelAnalyzerError(f"{path}: pick out of range: {pick}")
    if not isinstance(doc.get("wall_s"), (int, float)):
        raise ModelAnalyzerError(f"{path}: no wall_s")
    return Settings(pick["instances"], pick["delay_us"]), doc


def time_to_tuned_line(ma_wall_s: float | None, first_good_config_s: float | None) -> str:
    """The bench table's comparison of time-to-tuned.

    Example: (412.3, 3.0) -> 'time-to-tuned: Model Analyzer 412 s offline (before serving) vs adaptive
    3 s online (first_good_config_s), 137x'.
    """
    ma = "not run" if ma_wall_s is None else f"{ma_wall_s:.0f} s offline (before serving)"
    ad = "not measured" if first_good_config_s is None else f"{first_good_config_s:.0f} s online (first_good_config_s)"
    line = f"time-to-tuned: Model Analyzer {ma} vs adaptive {ad}"
    if ma_wall_s is not None and first_good_config_s:
        line += f", {ma_wall_s / first_good_config_s:.0f}x"
    return line


def summary_entry(doc: dict, path: str) -> dict:
    """What summary.json gets from model_analyzer.json: `model_analyzer` (the pick and how it was found)
    and `model_analyzer_wall_s`."""
    keep = ("version", "wall_s", "sla_ms", "pick", "grid", "command", "summary_report_best", "measurements")
    return {"model_analyzer": {"file": path, **{k: doc.get(k) for k in keep}},
            "model_analyzer_wall_s": doc.get("wall_s")}


def model_analyzer_lines(summary: dict) -> list[str]:
    """The bench table's lines on the model_analyzer arm: its pick, time-to-tuned, and the whole-trace
    goodput and instance-seconds against the adaptive arm.

    Example: pick 2 inst / 0 us found in 412 s, adaptive first good config at 3 s, adaptive 250.0/s and
    600 instance-s vs model_analyzer 240.0/s and 360 instance-s -> three lines.
    """
    ma = summary.get("model_analyzer") or {}
    pick = ma.get("pick") or {}
    grid = ma.get("grid") or {}
    conc = grid.get("concurrency") or []
    lines = [f"model_analyzer: pick {pick.get('instances')} inst, {pick.get('delay_us')} us (Model Analyzer "
             f"{ma.get('version') or '?'}, p99 <= {ma.get('sla_ms', summary.get('sla_ms'))} ms"
             + (f", closed-loop concurrency {min(conc)}..{max(conc)}" if conc else "") + ")",
             time_to_tuned_line(summary.get("model_analyzer_wall_s"), summary.get("first_good_config_s"))]
    arms = summary.get("arms") or {}
    if "adaptive" in arms and "model_analyzer" in arms:
        ad, m = arms["adaptive"], arms["model_analyzer"]
        g = (ad["goodput_rps"] / m["goodput_rps"]) if m["goodput_rps"] else None
        i = (ad["instance_seconds"] / m["instance_seconds"]) if m["instance_seconds"] else None
        lines.append(f"whole trace: goodput adaptive {ad['goodput_rps']:.1f}/s vs model_analyzer {m['goodput_rps']:.1f}/s"
                     + (f" ({g:.3f})" if g is not None else "")
                     + f"; instance-s adaptive {ad['instance_seconds']:.0f} vs model_analyzer {m['instance_seconds']:.0f}"
                     + (f" ({i:.3f})" if i is not None else ""))
    return lines


# ---------------------------------------------------------------------------------------------
# Running MA (from scripts/model_analyzer.sh)
# ---------------------------------------------------------------------------------------------
def _ma_environment(venv: Path, sim_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(environment for MA and perf_analyzer, extra environment for the tritonservers MA starts)."""
    from ..server import embedded_library_dir

    server_libs = embedded_library_dir()
    if server_libs is None:
        raise ModelAnalyzerError("nvidia-pytriton is not installed in this Python: no tritonserver for MA")
    # perf_analyzer needs libb64.so.0d: the server wheel ships it under a hashed name; link it by its soname
    extra = venv / "lib-extra"
    extra.mkdir(exist_ok=True)
    b64 = sorted(server_libs.glob("libb64*.so*"))
    if not b64:
        raise ModelAnalyzerError(f"no libb64 in {server_libs}: perf_analyzer cannot start")
    link = extra / "libb64.so.0d"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(b64[0])
    cudart = sorted(venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    libs = [str(extra), *(str(c) for c in cudart), str(server_libs)]
    old = os.environ.get("LD_LIBRARY_PATH")
    ld = os.pathsep.join(libs + ([old] if old else []))
    ma_env = dict(os.environ, LD_LIBRARY_PATH=ld, PATH=str(venv / "bin") + os.pathsep + os.environ.get("PATH", ""))
    # the model's Python stub runs with the interpreter environment it finds first on PATH: this project's
    server_env = {"LD_LIBRARY_PATH": ld, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
                  "PYTHONDONTWRITEBYTECODE": "1", "SIM_ACCEL_DIR": str(sim_dir)}
    return ma_env, server_env


def run(*, model: str, repository: Path, out: Path, venv: Path, sla_ms: float, instances: Sequence[int],
        delays_us: Sequence[int], concurrency: Sequence[int], scenario: str | None, invocation: str | None = None) -> dict:
    """Run MA once and write OUT/model_analyzer.json (also when MA fails: then with `error`, no pick)."""
    import yaml

    from ..server import assemble_backend_dir, find_tritonserver, free_port

    out = out.resolve()
    work = out / "model_analyzer"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    binary, embedded = find_tritonserver(None)
    if not embedded:
        print(f"note: using the tritonserver on PATH: {binary}", file=sys.stderr)
    backend = assemble_backend_dir(work / "backends")
    ma_env, server_env = _ma_environment(venv.resolve(), work / "sim_device")
    ports = (free_port(), free_port(), free_port())
    cfg = ma_config(model=model, repository=Path(repository).resolve(), work=work, sla_ms=sla_ms, instances=instances,
                    delays_us=delays_us, concurrency=concurrency, tritonserver=binary,
                    perf_analyzer=venv.resolve() / "bin" / "perf_analyzer", backend_dir=backend, ports=ports,
                    environment=server_env)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    venv = venv.resolve()
    cmd = [str(venv / "bin" / "model-analyzer"), "profile", "-f", str(cfg_path)]
    version = subprocess.run([str(venv / "bin" / "model-analyzer"), "--version"], capture_output=True, text=True,
                             env=ma_env).stdout.strip().splitlines()
    log_path = work / "model_analyzer.log"
    print(f"running Model Analyzer: {' '.join(cmd)} (log {log_path})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        # in the work folder: perf_analyzer writes its <model>-results.csv into the current folder
        proc = subprocess.run(cmd, env=ma_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              cwd=work)
    wall_s = round(time.monotonic() - t0, 1)
    doc: dict = {"tool": "triton-model-analyzer", "version": version[-1] if version else None,
                 "model": model, "scenario": scenario, "sla_ms": sla_ms, "wall_s": wall_s,
                 "exit_code": proc.returncode, "run_by": invocation, "command": " ".join(cmd), "config": cfg,
                 "grid": {"instances": list(instances), "delays_us": list(delays_us), "concurrency": list(concurrency)},
                 "pick": None}
    log_tail = log_path.read_text(errors="replace").splitlines()[-40:]
    csv_path = work / "export" / RESULT_CSV
    if not csv_path.is_file():
        doc["error"] = f"Model Analyzer wrote no {RESULT_CSV} (exit code {proc.returncode})"
        doc["log_tail"] = log_tail
    else:
        rows = parse_inference_csv(csv_path.read_text())
        variants = {}
        for d in (work / "output_model_repository").glob(f"{model}_config_*"):
            if (d / "config.pbtxt").is_file():
                variants[d.name] = settings_from_pbtxt((d / "config.pbtxt").read_text())
        doc["measurements"] = len(rows)
        doc["configs"] = configs_table(rows, variants)
        doc["pick"] = pick_document(rows, variants)
        report = work / "export" / "reports" / "summaries" / model / "result_summary.html"
        if report.is_file():
            doc["summary_report_best"] = summary_report_best(report.read_text(errors="replace"), model)
        if doc["pick"] is None:
            doc["error"] = f"no config met the p99 <= {sla_ms:g} ms constraint"
        if proc.returncode != 0:
            doc["warning"] = (f"Model Analyzer exited with code {proc.returncode} after writing its result table "
                              f"(see log_tail)")
            doc["log_tail"] = log_tail
    (out / "model_analyzer.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from ..server import DEFAULT_REPOSITORY, ServerError

    p = argparse.ArgumentParser(prog="python -m controller.evaluation.model_analyzer",
                                description="run Triton Model Analyzer on the bench's grid; write OUT/model_analyzer.json")
    p.add_argument("--venv", type=Path, required=True, help="the virtualenv with triton-model-analyzer and tritonclient[all]")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="sim_accel")
    p.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    p.add_argument("--scenario", help="recorded in the JSON (MA's load is its own: closed-loop concurrency)")
    p.add_argument("--sla-ms", type=float, default=40.0)
    p.add_argument("--invocation", help="the command that ran this (recorded in the JSON as run_by)")
    p.add_argument("--instances", default="1,2,4,6")
    p.add_argument("--delays-us", default="0,2000")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)))
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        doc = run(model=a.model, repository=a.repository, out=a.out, venv=a.venv, sla_ms=a.sla_ms,
                  instances=ints(a.instances), delays_us=ints(a.delays_us), concurrency=ints(a.concurrency),
                  scenario=a.scenario, invocation=a.invocation)
    except (ModelAnalyzerError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    pick = doc.get("pick")
    print(f"Model Analyzer {doc.get('version')}: {doc['wall_s']:.0f} s wall, exit code {doc['exit_code']}, "
          + (f"pick {pick['instances']} instance(s), {pick['delay_us']} us ({pick['variant']}, "
             f"{pick['throughput_rps']} infer/s at concurrency {pick['concurrency']}, p99 {pick['p99_ms']} ms)"
             if pick else f"no pick: {doc.get('error')}"))
    print(f"wrote {a.out / 'model_analyzer.json'}")
    return 0 if pick else 1


if __name__ == "__main__":
    sys.exit(main())
