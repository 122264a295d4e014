"""One Markdown table over several bench runs (what scripts/bench_all.sh prints and writes).

    python -m controller.evaluation.report results/all/*/summary.json > results/all/table.md

One row per (scenario, arm) from each bench's summary.json, with the ratios against that run's
best_static arm (all arms of a scenario ran side by side in one run, so the ratios are the figures
to compare across machines), then one line per scenario on the adaptive arm's timing. Nothing is
recomputed here: every number is read from the summaries. Example row::

    | shift | 40 | adaptive | 190.5 | 1.00 | 288 | 0.80 | 30.3 | 0 | 2 |
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable

ARM_ORDER = ("default", "best_static", "oracle", "adaptive", "model_analyzer")

HEADER = ("| scenario | SLA ms | arm | config | goodput req/s | vs best_static | instance-s | vs best_static "
          "| p99 ms | failed | reloads |\n"
          "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")


class ReportError(ValueError):
    """A summary that cannot be read; the message names the file."""


def _load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: cannot read a bench summary ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("arms"), dict) or "sla_ms" not in doc:
        raise ReportError(f"{path}: not a bench summary.json (no arms/sla_ms)")
    return doc


def _name(doc: dict, path: Path) -> str:
    scenario = doc.get("scenario")
    return Path(scenario).stem if scenario else path.parent.name


def _ratio(x: float | None, ref: float | None) -> str:
    return "n/a" if x is None or not ref else f"{x / ref:.2f}"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _config(arm: str, a: dict, doc: dict) -> str:
    """What the arm ran: a fixed config, or the range of instance counts and the delays it went through."""
    if arm == "best_static" and doc.get("best_static"):
        b = doc["best_static"]
        return f"{b['instances']} inst, {b['delay_us']} us"
    if arm == "model_analyzer" and doc.get("model_analyzer"):
        p = doc["model_analyzer"]["pick"]
        return f"{p['instances']} inst, {p['delay_us']} us"
    changes = [c for c in a.get("changes", []) if c.get("kind") != "initial"]
    first = (a.get("changes") or [{}])[0]
    if not changes:
        return f"{first.get('instances', '?')} inst, {first.get('delay_us', '?')} us" if first else "n/a"
    counts = sorted({c["instances"] for c in a["changes"]})
    delays = sorted({c["delay_us"] for c in a["changes"]})
    return f"{counts[0]}-{counts[-1]} inst, {'/'.join(map(str, delays))} us"


def rows(doc: dict, path: Path) -> list[str]:
    name, sla = _name(doc, path), doc["sla_ms"]
    arms = doc["arms"]
    ref = arms.get("best_static", {})
    out = []
    for arm in [a for a in ARM_ORDER if a in arms] + sorted(set(arms) - set(ARM_ORDER)):
        a = arms[arm]
        reloads = a.get("reloads")
        out.append(f"| {name} | {sla:g} | {arm} | {_config(arm, a, doc)} | {_num(a.get('goodput_rps'), '.1f')} "
                   f"| {_ratio(a.get('goodput_rps'), ref.get('goodput_rps'))} | {_num(a.get('instance_seconds'), '.0f')} "
                   f"| {_ratio(a.get('instance_seconds'), ref.get('instance_seconds'))} | {_num(a.get('p99_ms'), '.1f')} "
                   f"| {a.get('failed_requests', 'n/a')} | {'n/a' if reloads is None else reloads} |")
    return out


def timing_line(doc: dict, path: Path) -> str:
    lags = [x["lag_s"] for x in doc.get("scale_up_lag_s") or [] if x.get("lag_s") is not None]
    lag = f"{max(lags):.1f} s" if lags else "none (the oracle never scaled up)"
    # the first rise after the oracle's (issue 10's "first scale-up"), where the summary has it (older ones do not)
    firsts = [x.get("first_up_s") for x in doc.get("scale_up_lag_s") or [] if "first_up_s" in x]
    if firsts and lags:
        lag += (" (to the oracle's count; on one step no scale-up at all)" if None in firsts
                else f" (to the oracle's count; its first scale-up at most {max(firsts):.1f} s after the oracle's)")
    parts = [f"first good config {_num(doc.get('first_good_config_s'), '.0f')} s",
             f"worst scale-up lag behind the oracle {lag}",
             f"controller CPU {_num(doc.get('controller_cpu_pct'), '.2f')}%"]
    if doc.get("model_analyzer_wall_s") is not None:
        parts.append(f"Model Analyzer's offline search {doc['model_analyzer_wall_s']:.0f} s")
    return f"- **{_name(doc, path)}** (adaptive): " + "; ".join(parts)


def markdown(paths: Iterable[Path]) -> str:
    docs = [(p, _load(p)) for p in paths]
    if not docs:
        raise ReportError("no summary.json given")
    lines = [HEADER]
    for p, d in docs:
        lines.extend(rows(d, p))
    lines.append("")
    lines.extend(timing_line(d, p) for p, d in docs)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m controller.evaluation.report", description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="+", type=Path, help="bench summary.json files")
    args = ap.parse_args(argv)
    try:
        sys.stdout.write(markdown(args.summaries))
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
