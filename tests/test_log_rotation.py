"""Issue 13, item 5: the decision and observation logs rotate by size and keep a few files; the reader."""
from __future__ import annotations

import json

import pytest

from controller.config import ConfigError, ControllerConfig, LoopConfig, parse_config
from controller.decision_log import JsonLog, by_model, read_records


def _lines(paths) -> list[dict]:
    out = []
    for p in paths:
        out += [json.loads(x) for x in p.read_text().splitlines()]
    return out


def test_rotates_at_the_size_and_keeps_three_old_files(tmp_path):
    path = tmp_path / "decisions.jsonl"
    log = JsonLog(str(path), max_bytes=1000, keep=3)
    for i in range(400):
        log.write({"i": i, "pad": "x" * 40})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2", "decisions.jsonl.3"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    kept = _lines(reversed(log.files()))                   # oldest file first
    ids = [r["i"] for r in kept]
    assert ids == list(range(ids[0], 400))                 # contiguous, newest last: only the oldest were dropped
    assert 3 * 15 < len(ids) <= 4 * 1000 // 50


def test_a_reopened_log_counts_what_is_already_there(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("x" * 995 + "\n")
    log = JsonLog(str(path), max_bytes=1000, keep=2)
    log.write({"a": 1})
    assert (tmp_path / "d.jsonl.1").read_text().startswith("x" * 995)
    assert _lines([path]) == [{"a": 1}]


def test_without_a_limit_it_never_rotates_and_none_writes_nothing(tmp_path):
    log = JsonLog(str(tmp_path / "d.jsonl"))
    for i in range(200):
        log.write({"i": i, "pad": "x" * 100})
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]
    JsonLog(None).write({"a": 1})


def test_a_failed_rotation_keeps_appending(tmp_path, monkeypatch, caplog):
    path = tmp_path / "d.jsonl"
    log = JsonLog(str(path), max_bytes=100, keep=2)
    log.write({"pad": "x" * 80})
    monkeypatch.setattr(type(path), "replace", lambda self, target: (_ for _ in ()).throw(PermissionError("ro")))
    log.write({"pad": "y" * 80})
    assert len(_lines([path])) == 2 and "cannot rotate" in caplog.text


def test_the_reader_reads_what_the_writer_wrote_and_skips_torn_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    log = JsonLog(str(path))
    log.write({"model": "a", "i": 1})
    log.write({"model": "b", "i": 2})
    log.write({"model": "a", "i": 3})
    with path.open("a") as f:
        f.write('[1, 2]\n{"model": "a", "i"')           # not an object, then a torn last line
    assert [r["i"] for r in read_records(path)] == [1, 2, 3]
    assert {m: [r["i"] for r in rs] for m, rs in by_model(read_records(str(path))).items()} == {"a": [1, 3], "b": [2]}
    assert read_records(tmp_path / "missing.jsonl") == [] and read_records(None) == []


def test_config_fields_reach_both_logs(tmp_path):
    from controller.loop import Controller
    from test_loop_ticks import Clock, FakeControl, FakeScraper
    from controller.observer import TraceFeed
    clock = Clock()
    loop = LoopConfig(decision_log=str(tmp_path / "d.jsonl"), observation_log=str(tmp_path / "o.jsonl"),
                      decision_log_max_mb=0.5, log_files_kept=5, gpu="none", owner_mark=False)
    ctl = Controller(ControllerConfig(loop=loop), control=FakeControl(["m"]), scraper=FakeScraper(clock, {}),
                     clock=clock, traces=TraceFeed(None))
    assert ctl.decision_log.max_bytes == ctl.observation_log.max_bytes == 512 * 1024
    assert ctl.decision_log.keep == ctl.observation_log.keep == 5
    assert JsonLog(str(tmp_path / "x"), *(None, 3)).max_bytes is None
    assert LoopConfig().decision_log_max_mb == 10.0 and LoopConfig().log_files_kept == 3
    ctl.close()


@pytest.mark.parametrize("raw,msg", [
    ({"decision_log_max_mb": -1}, "controller.decision_log_max_mb: must be a number in [0, 1e+06], got -1"),
    ({"log_files_kept": 0}, "controller.log_files_kept: must be an integer in [1, 100], got 0"),
])
def test_config_ranges(raw, msg):
    with pytest.raises(ConfigError) as e:
        parse_config({"controller": raw})
    assert str(e.value) == msg


def test_read_rotated_reads_every_file_oldest_first_in_numeric_order(tmp_path):
    from controller.decision_log import read_rotated
    log = tmp_path / "decisions.jsonl"
    for n in (1, 2, 9, 10):                          # .10 is older than .9: numeric, not lexical order
        (tmp_path / f"decisions.jsonl.{n}").write_text(json.dumps({"n": n}) + "\n")
    (tmp_path / "decisions.jsonl.bak").write_text(json.dumps({"n": "bak"}) + "\n")    # not a rotated file
    log.write_text(json.dumps({"n": 0}) + "\n" + '{"torn')
    assert [r["n"] for r in read_rotated(log)] == [10, 9, 2, 1, 0]
    assert read_rotated(tmp_path / "absent.jsonl") == []
