"""The decision log (and the observation log, same format): one JSON object per line.

The writer is `JsonLog`, used by the control loop (controller/loop.py): an append-only JSONL file,
rotated by size. The reader is `read_records`, used by `status` (recent decisions per model when
no controller answers) and by the evaluation harness (the adaptive arm's applied changes).

A decision record, as the loop writes it (only target changes and reason transitions)::

    {"time": 1767000000.12, "t": 42.0, "model": "sim_accel", "action": "applied",
     "reason": "ScaleUpQueueGrowing", "detail": "...", "current": null,
     "target": {"instances": 2, "delay_us": 0}, "obs": {...}, "tracing": {...},
     "kind": "in_place", "apply_s": 0.41, "error": null, "live": {"instances": 2, "delay_us": 0}}
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("controller.decision_log")


class JsonLog:
    """Append-only JSONL file (None: nothing is written), rotated by size.

    With `max_bytes`, a line that would take the file past it first rotates: `<path>` -> `<path>.1`,
    `.1` -> `.2`, ... up to `.<keep>`; the oldest is dropped. So at most (keep + 1) x max_bytes stay on disk.
    """

    def __init__(self, path: str | None, max_bytes: int | None = None, keep: int = 3):
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes if max_bytes and max_bytes > 0 else None
        self.keep = max(1, keep)
        self._size = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._size = self.path.stat().st_size if self.path.exists() else 0

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        n = len(line.encode())
        if self.max_bytes is not None and self._size > 0 and self._size + n > self.max_bytes:
            self._rotate()
        with self.path.open("a") as f:
            f.write(line)
        self._size += n

    def _rotate(self) -> None:
        try:
            for i in range(self.keep, 0, -1):
                src = self.path if i == 1 else self.path.with_name(f"{self.path.name}.{i - 1}")
                if src.exists():
                    src.replace(self.path.with_name(f"{self.path.name}.{i}"))   # replaces (drops) the oldest
        except OSError as e:   # a failed rotation must not stop the controller: keep appending
            log.warning("cannot rotate %s (%s); appending", self.path, e)
            return
        self._size = 0

    def files(self) -> list[Path]:
        """The current file and its rotated ones that exist, newest first."""
        if self.path is None:
            return []
        names = [self.path] + [self.path.with_name(f"{self.path.name}.{i}") for i in range(1, self.keep + 1)]
        return [p for p in names if p.exists()]


def read_records(path: str | Path | None) -> list[dict]:
    """Every record of one JSONL file, in order; a missing or unreadable file is no records.

    A line that is not a JSON object (a torn last line while the controller writes) is skipped.
    Only `path` itself is read, not its rotated files (`read_rotated` reads them all).
    """
    if not path:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_rotated(path: str | Path) -> list[dict]:
    """Every record of a log and of its rotated files (`<path>.1`, `.2` ... as `JsonLog` writes them),
    oldest first: the highest-numbered file first (numerically: `.10` is older than `.9`), `path` last."""
    path = Path(path)
    rotated = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    out = []
    for _, p in sorted(rotated, reverse=True):
        out += read_records(p)
    return out + read_records(path)


def by_model(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by their `model`, each list in file order (oldest first)."""
    out: dict[str, list[dict]] = {}
    for rec in records:
        out.setdefault(rec.get("model"), []).append(rec)
    return out
