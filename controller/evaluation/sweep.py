"""Offline sweep, Model-Analyzer style: instances x max_queue_delay_us x offered load.

One fresh tritonserver serves the whole grid. Configs are visited delay-major (every instance
count for one delay, then the next delay), so only a delay change pays a full reload and every
instance change is an in-place update. For each cell:

1. apply the config with the Actuator (and wait until it is READY);
2. run open-loop Poisson load at the cell's rate for `warmup_s + seconds`; the first `warmup_s`
   are discarded (queues and batching reach their steady state), the rest are measured;
3. record offered and completion rate, p50/p99 (from each request's *scheduled* time), goodput
   (completions within the SLA per second) and failures.

A cell "meets the SLA" when its p99 is within `sla_ms` and no request failed. Per load level the
best config is the one with the fewest instances that meets the SLA, then the highest goodput,
then the shorter delay; a level where nothing meets it reports the highest-goodput cell, marked
`met_sla: false`.

Outputs: `sweep.json` (cells + best per level, its shape in controller/sweep_schema.py), `sweep.png` (throughput vs p99 per config) and a
table, ending with where the batching delay pays (`delay_effect`: per level, does a delay save instances,
only cut a p99, or neither). `controller.warm_start: sweep.json` turns the cells into perf points a controller can
warm-start from.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .inputs import InputSpec, describe, variable_notes
from .loadgen import (Trace, client_bound, inputs_from_config, live_config, load_trace, poisson_schedule,
                      run_open_loop_sync, send_lag_p99_ms)
from ..sweep_schema import Cell, cells_of, sweep_document
from ..types import Settings

SCHEDULE_MAX_REQUESTS = 2_000_000
LEVEL_MERGE_RATIO = 1.25          # scenario rates closer than 25% share one sweep level


def cell_from_records(records, settings: Settings, rate_rps: float, warmup_s: float, seconds: float,
                      sla_ms: float) -> Cell:
    """Measure one cell from load-generator records, ignoring those scheduled in the warm-up.

    Example: 1200 requests scheduled in a 6 s window, 1190 ok of which 1180 within 40 ms, 0 failed
    -> offered 200/s, completion 198.3/s, goodput 196.7/s.
    """
    kept = [r for r in records if r.scheduled_s >= warmup_s]
    ok_ms = np.array([1000.0 * r.latency_s for r in kept if r.ok], dtype=float)
    failed = sum(1 for r in kept if not r.ok)
    good = int((ok_ms <= sla_ms).sum())
    p99 = float(np.percentile(ok_ms, 99)) if ok_ms.size else None
    p50 = float(np.percentile(ok_ms, 50)) if ok_ms.size else None
    met = failed == 0 and p99 is not None and p99 <= sla_ms
    return Cell(settings.instance_count, settings.max_queue_delay_us, float(rate_rps),
                len(kept) / seconds, ok_ms.size / seconds, good / seconds, p50, p99, len(kept), failed, met)


# ---------------------------------------------------------------------------------------------
# Pure: load levels from a trace
# ---------------------------------------------------------------------------------------------
def rates_from_trace(trace: Trace, merge_ratio: float = LEVEL_MERGE_RATIO) -> list[float]:
    """Load levels covering a trace: every phase's start, end and burst rate, merged when close.

    Rates are rounded to whole req/s; a rate within `merge_ratio` of the last level kept is
    dropped, except the highest, which always stays (it replaces the last level kept if the two
    are close). Example: rates 30, 40, 200, 220, 320, 400 -> 30, 40, 200, 320, 400
    (220 < 1.25 * 200 is merged; 400 is the peak).
    """
    raw = set()
    for p in trace.phases:
        raw.update((p.from_rps, p.to_rps))
        if p.burst is not None:
            raw.add(p.burst.rate_rps)
    rates = sorted({float(round(r)) for r in raw if r > 0})
    if not rates:
        return []
    kept = [rates[0]]
    for r in rates[1:]:
        if r >= kept[-1] * merge_ratio:
            kept.append(r)
    if kept[-1] != rates[-1]:
        if len(kept) > 1 and rates[-1] < kept[-1] * merge_ratio:
            kept[-1] = rates[-1]
        else:
            kept.append(rates[-1])
    return kept


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------
class Progress:
    """The sweep's progress on a stream (stderr). On a terminal, a tqdm bar (count, elapsed, time left,
    the cell being measured); on anything else (a log file, a pipe) tqdm stays silent and each finished
    cell is one plain line instead, so a redirected run's log has no carriage returns or escape codes:

        sweep 5/24: 4 inst, 0 us, 200 req/s (37 s)
    """

    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        self.total, self.done = max(1, total), 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        # disable=None: tqdm turns itself off when the stream is not a terminal
        self.bar = tqdm(total=self.total, file=self.stream, disable=None, unit="cell", desc="sweep",
                        dynamic_ncols=True)

    def show(self, label: str) -> None:
        """The cell now being measured."""
        self.bar.set_postfix_str(label)

    def step(self, label: str = "") -> None:
        """One more cell done."""
        self.done += 1
        if self.bar.disable:
            self.stream.write(f"sweep {self.done}/{self.total}: {label} ({time.monotonic() - self.t0:.0f} s)\n")
            self.stream.flush()
        else:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def measure_cell(url: str, model: str, make_inputs, settings: Settings, rate_rps: float, *, seconds: float,
                 warmup_s: float, sla_ms: float, seed: int, timeout_s: float = 10.0) -> tuple[Cell, float | None]:
    """Open-loop Poisson load at `rate_rps` for warm-up + measured window, measured as one Cell, and the client's
    p99 send lag over the measured window (ms: how far behind its schedule the load generator sent)."""
    trace = load_trace({"phases": [{"name": "cell", "duration_s": warmup_s + seconds, "rate_rps": rate_rps}]})
    schedule = poisson_schedule(trace, seed, SCHEDULE_MAX_REQUESTS)
    records = run_open_loop_sync(url, model, schedule, make_inputs, protocol="grpc", timeout_s=timeout_s)
    lag_ms = send_lag_p99_ms([r for r in records if r.scheduled_s >= warmup_s])
    return cell_from_records(records, settings, rate_rps, warmup_s, seconds, sla_ms), lag_ms


def run_sweep(model: str, instances: Sequence[int], delays_us: Sequence[int], rates_rps: Sequence[float], *,
              seconds: float = 6.0, warmup_s: float = 1.0, sla_ms: float = 40.0, seed: int = 0,
              repository: Path | None = None, progress: Progress | None = None,
              on_cell: Callable[[Cell], None] | None = None, inputs: InputSpec | None = None) -> dict:
    """Start one fresh server, measure every cell, and return the sweep document (see module doc).

    `inputs`: --shape/--input-data (default: random values, a variable dim as 1); recorded in the document.
    """
    from ..actuation import Actuator, TritonControl
    from ..server import DEFAULT_REPOSITORY, ServerError, ServerOptions, TritonServer, free_port

    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            models=[model], repository=repository or DEFAULT_REPOSITORY)
    configs = [Settings(i, d) for d in delays_us for i in instances]      # delay-major: few full reloads
    cells: list[Cell] = []
    lags: list[float | None] = []
    t0 = time.monotonic()
    with TritonServer(options) as server:
        control = TritonControl(server.grpc_url, server.http_url)
        progress = progress or Progress(len(configs) * len(rates_rps))
        try:
            actuator = Actuator(control)
            config = live_config(server.http_url, model)
            make_inputs = inputs_from_config(config, spec=inputs)
            for note in variable_notes(config, inputs):
                print(f"note: {note}", file=sys.stderr, flush=True)
            for settings in configs:
                result = actuator.apply(model, settings)
                if not result.ok:
                    raise ServerError(f"cannot apply {settings.instance_count} instance(s) / "
                                      f"{settings.max_queue_delay_us} us to {model}: {result.error}")
                for k, rate in enumerate(rates_rps):
                    label = f"{settings.instance_count} inst, {settings.max_queue_delay_us} us, {rate:g} req/s"
                    progress.show(label)
                    cell, lag_ms = measure_cell(server.grpc_url, model, make_inputs, settings, rate, seconds=seconds,
                                                warmup_s=warmup_s, sla_ms=sla_ms, seed=seed + k)
                    cells.append(cell)
                    lags.append(lag_ms)
                    if on_cell:
                        on_cell(cell)
                    progress.step(label)
        finally:
            progress.close()
            control.close()
    doc = sweep_document(model, cells, sla_ms=sla_ms, seconds=seconds, warmup_s=warmup_s, seed=seed,
                         elapsed_s=time.monotonic() - t0)
    doc["inputs"] = describe(inputs)
    for c, lag_ms in zip(doc["cells"], lags):
        c["client_lag_p99_ms"] = None if lag_ms is None else round(lag_ms, 2)
    return doc


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.1f}"


DELAY_LATENCY_GAIN = 0.10         # a delay "cuts the p99" at a count when it lowers it by at least 10%


def delay_effect(cells: Sequence[Cell], gain: float = DELAY_LATENCY_GAIN) -> list[dict]:
    """What the sweep says about the batching delay, per load level measured both with and without one.

    verdict "saves": some delay meets the SLA with fewer instances than any count without one (the delay
    replaces instances); "latency": no instance saved, but at some count a delay lowers the p99 by at least
    `gain` (it pays only under a tighter target, or where that count is forced); "none": neither.
    `fewest_at_0` is (instances, p99) of the fewest instances meeting the SLA at 0 us (None: no count does),
    `fewest_delayed` the same over the delays > 0, with the delay; `cut` the count and delay with the
    largest relative p99 cut, as (instances, delay_us, p99 at 0 us, p99 with the delay).

    Example (shift_tight's sweep, SLA 25 ms, 390 req/s): 4 instances at 0 us miss (p99 27.4 ms), 6 meet;
    4 at 2,000 us meet (21.3 ms) -> "saves": the delay stands in for 2 instances. At 300 req/s 4 at 0 us
    meet (18.0 ms) and no delayed cell meets with fewer -> "latency" or "none", from the cut.
    """
    out = []
    for rate in sorted({c.arrival_rps for c in cells}):
        level = [c for c in cells if c.arrival_rps == rate]
        zero = {c.instance_count: c for c in level if c.max_queue_delay_us == 0}
        delayed = [c for c in level if c.max_queue_delay_us > 0]
        if not zero or not delayed:
            continue
        meet0 = [c for c in zero.values() if c.met_sla]
        meetd = [c for c in delayed if c.met_sla]
        f0 = min(meet0, key=lambda c: (c.instance_count, c.p99_ms or math.inf), default=None)
        fd = min(meetd, key=lambda c: (c.instance_count, c.p99_ms or math.inf), default=None)
        cuts = [(1 - c.p99_ms / zero[c.instance_count].p99_ms, c) for c in delayed
                if c.instance_count in zero and c.p99_ms is not None and zero[c.instance_count].p99_ms
                and c.failed == 0]
        best_cut = max(cuts, key=lambda x: x[0], default=None)
        if fd is not None and (f0 is None or fd.instance_count < f0.instance_count):
            verdict = "saves"
        elif best_cut is not None and best_cut[0] >= gain:
            verdict = "latency"
        else:
            verdict = "none"
        cut = None
        if best_cut is not None:
            c = best_cut[1]
            cut = (c.instance_count, c.max_queue_delay_us, zero[c.instance_count].p99_ms, c.p99_ms)
        out.append({"arrival_rps": rate, "verdict": verdict,
                    "fewest_at_0": None if f0 is None else (f0.instance_count, f0.p99_ms),
                    "fewest_delayed": None if fd is None else (fd.instance_count, fd.max_queue_delay_us, fd.p99_ms),
                    "cut": cut})
    return out


def _delay_lines(effects: list[dict]) -> list[str]:
    if not effects:
        return []
    saves = sum(e["verdict"] == "saves" for e in effects)
    lines = [f"where the batching delay pays: it saves instances at {saves} of {len(effects)} load level(s)"]
    for e in effects:
        f0, fd, cut = e["fewest_at_0"], e["fewest_delayed"], e["cut"]
        if e["verdict"] == "saves":
            text = (f"saves instances: {fd[0]} inst at {fd[1]} us meet the SLA (p99 {_ms(fd[2])} ms) where 0 us "
                    + (f"takes {f0[0]} (p99 {_ms(f0[1])} ms)" if f0 else "meets it at no count of the grid"))
        elif f0 is None:
            text = "nothing meets the SLA, with or without a delay"
        else:
            text = f"no instance saved: {f0[0]} inst at 0 us are the fewest meeting the SLA (p99 {_ms(f0[1])} ms)"
            if cut and e["verdict"] == "latency":
                text += f"; at {cut[0]} inst a {cut[1]}-us delay cuts p99 {_ms(cut[2])} -> {_ms(cut[3])} ms"
            elif cut:
                text += f"; no delay cuts the p99 by {DELAY_LATENCY_GAIN:.0%} at any count"
        lines.append(f"  {e['arrival_rps']:>6g} req/s: {text}")
    return lines


def format_table(doc: dict) -> str:
    cells = cells_of(doc)
    lines = [f"{'inst':>4} {'delay_us':>8} {'rate':>6} {'offered':>8} {'done/s':>7} {'goodput':>8} "
             f"{'p50_ms':>7} {'p99_ms':>8} {'failed':>6}  SLA {doc['sla_ms']:g} ms"]
    for c in cells:
        lines.append(f"{c.instance_count:>4} {c.max_queue_delay_us:>8} {c.arrival_rps:>6g} {c.offered_rps:>8.1f} "
                     f"{c.completion_rps:>7.1f} {c.goodput_rps:>8.1f} {_ms(c.p50_ms):>7} {_ms(c.p99_ms):>8} "
                     f"{c.failed:>6}  {'met' if c.met_sla else 'MISSED'}")
    lines.append("best config per load level (fewest instances meeting the SLA, then goodput):")
    for b in doc["best_per_level"]:
        lines.append(f"  {b['arrival_rps']:>6g} req/s -> {b['instance_count']} inst, {b['max_queue_delay_us']} us "
                     f"(goodput {b['goodput_rps']:.1f}/s, p99 {_ms(b['p99_ms'])} ms){'' if b['met_sla'] else '  NONE MEETS THE SLA'}")
    lines.extend(_delay_lines(delay_effect(cells)))
    lines.extend(client_bound_lines(doc))
    return "\n".join(lines)


def client_bound_lines(doc: dict) -> list[str]:
    """A warning per cell whose latencies the load generator set (its send lag a large part of the p99): such a
    cell measured the client, not the server (a rate this machine's client cannot send on time)."""
    bound = [c for c in doc.get("cells", []) if client_bound(c.get("client_lag_p99_ms"), c.get("p99_ms"))]
    if not bound:
        return []
    lines = [f"warning: in {len(bound)} cell(s) the client fell behind its schedule by a large part of the p99 "
             "(their latencies are partly the load generator's; run the sweep where a core is free, or lower "
             "the rate):"]
    for c in bound:
        lines.append(f"  {c['instance_count']} inst, {c['max_queue_delay_us']} us, {c['arrival_rps']:g} req/s: "
                     f"send lag p99 {c['client_lag_p99_ms']:.1f} ms of a p99 of {c['p99_ms']:.1f} ms")
    return lines


def plot_sweep(doc: dict, path: str | Path) -> None:
    """Throughput (completions/s) against p99 per config, one line per config across load levels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = cells_of(doc)
    fig, ax = plt.subplots(figsize=(8, 5))
    for settings in sorted({c.settings for c in cells}, key=lambda s: (s.max_queue_delay_us, s.instance_count)):
        pts = sorted((c for c in cells if c.settings == settings), key=lambda c: c.arrival_rps)
        xs = [c.completion_rps for c in pts]
        ys = [c.p99_ms if c.p99_ms is not None else np.nan for c in pts]
        style = "-" if settings.max_queue_delay_us == 0 else "--"
        ax.plot(xs, ys, style, marker="o", label=f"{settings.instance_count} inst, {settings.max_queue_delay_us} us")
    ax.axhline(doc["sla_ms"], color="red", linewidth=1, linestyle=":", label=f"SLA {doc['sla_ms']:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (completions/s)")
    ax.set_ylabel("p99 latency (ms, from scheduled send time)")
    ax.set_title(f"{doc['model']}: throughput vs p99 per config (open-loop Poisson)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(doc: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sweep.json"
    path.write_text(json.dumps(doc, indent=1))
    plot_sweep(doc, out / "sweep.png")
    return path
