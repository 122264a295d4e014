"""What the requests carry (controller/evaluation/inputs.py): random tensors shaped by the config and --shape, the
user's --input-data entries in turn, and a one-line reason for each that does not fit. Live: `load`, `sweep` and
`bench`'s arms send them to a real tritonserver running a model of variable dims that writes down what it got."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, start_server
from controller.cli import main
from controller.evaluation.inputs import (InputSpec, InputSpecError, describe, input_sets, make_spec, parse_shape,
                                          read_input_data, variable_notes)

TOKENS = {"name": "tokens", "max_batch_size": 4, "input": [
    {"name": "TOKENS", "data_type": "TYPE_INT64", "dims": ["-1"]},
    {"name": "MASK", "data_type": "TYPE_INT64", "dims": ["-1"], "optional": True},
]}


def _data(tmp_path: Path, entries, name: str = "data.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"data": entries}))
    return path


# ----------------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize("text,expected", [("TOKENS:128", ("TOKENS", (128,))), ("X:3,224,224", ("X", (3, 224, 224))),
                                           ("a:b:4", ("a:b", (4,)))])
def test_parse_shape(text, expected):
    assert parse_shape(text) == expected


@pytest.mark.parametrize("text,piece", [("TOKENS", "NAME:D1"), ("TOKENS:", "NAME:D1"), (":4", "NAME:D1"),
                                        ("T:4,x", "integers"), ("T:0", "at least 1"), ("T:-1", "at least 1")])
def test_parse_shape_refuses(text, piece):
    with pytest.raises(ValueError, match=piece):
        parse_shape(text)


def test_random_inputs_take_the_shape_given_and_1_for_a_variable_dim_otherwise():
    one = input_sets(TOKENS)
    assert len(one) == 1 and one[0]["TOKENS"].shape == (1, 1) and one[0]["TOKENS"].dtype == np.int64
    assert one[0]["MASK"].shape == (1, 1)                     # an optional input is still sent with random values
    shaped = input_sets(TOKENS, InputSpec(shapes={"TOKENS": (128,)}), batch_size=3)[0]
    assert shaped["TOKENS"].shape == (3, 128) and shaped["MASK"].shape == (3, 1)
    assert 0 <= shaped["TOKENS"].min() and shaped["TOKENS"].max() <= 9          # safe as token ids
    assert variable_notes(TOKENS, InputSpec(shapes={"TOKENS": (128,)})) == [
        "input MASK has variable dims [-1]: sending [1] (--shape MASK:... sets them, --input-data FILE gives real "
        "requests)"]
    # the same seed, the same values (a bench's arms send alike); another seed, others
    assert np.array_equal(input_sets(TOKENS, seed=5)[0]["TOKENS"], input_sets(TOKENS, seed=5)[0]["TOKENS"])
    x = {"name": "x", "max_batch_size": 0, "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [64]}]}
    assert not np.array_equal(input_sets(x, seed=1)[0]["X"], input_sets(x, seed=2)[0]["X"])
    assert input_sets(x)[0]["X"].shape == (64,)               # no batch dim where the model does not batch


@pytest.mark.parametrize("shapes,piece", [
    ({"TOKENS": (2, 3)}, "takes dims [-1]"),
    ({"NOPE": (3,)}, "has no input 'NOPE'"),
])
def test_a_shape_that_does_not_fit_is_named(shapes, piece):
    with pytest.raises(InputSpecError, match=piece.replace("[", r"\[").replace("]", r"\]")):
        input_sets(TOKENS, InputSpec(shapes=shapes))


def test_a_fixed_dim_must_be_kept():
    cfg = {"name": "img", "max_batch_size": 8,
           "input": [{"name": "IMG", "data_type": "TYPE_FP32", "dims": ["3", "-1", "-1"]}]}
    assert input_sets(cfg, InputSpec(shapes={"IMG": (3, 224, 160)}))[0]["IMG"].shape == (1, 3, 224, 160)
    with pytest.raises(InputSpecError, match=r"takes dims \[3, -1, -1\] \(-1: any\); got \[4, 224, 224\]"):
        input_sets(cfg, InputSpec(shapes={"IMG": (4, 224, 224)}))


def test_data_entries_are_sent_in_turn_with_their_shapes():
    spec = InputSpec(data=({"TOKENS": [101, 7, 102]},
                           {"TOKENS": {"content": [101, 8, 9, 102], "shape": [4]}, "MASK": [1, 1, 1, 0]}))
    sets = input_sets(TOKENS, spec)
    assert [s["TOKENS"].tolist() for s in sets] == [[[101, 7, 102]], [[101, 8, 9, 102]]]
    assert "MASK" not in sets[0] and sets[1]["MASK"].tolist() == [[1, 1, 1, 0]]     # optional: only where given
    assert variable_notes(TOKENS, spec) == []


def test_a_flat_list_is_shaped_by_the_config_then_by_shape():
    cfg = {"name": "m", "max_batch_size": 0,
           "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["2", "-1"]}]}
    assert input_sets(cfg, InputSpec(data=({"X": [1, 2, 3, 4, 5, 6]},)))[0]["X"].shape == (2, 3)
    assert input_sets(cfg, InputSpec(data=({"X": [1, 2, 3, 4]},)))[0]["X"].dtype == np.float32
    with pytest.raises(InputSpecError, match="5 values do not fill dims"):
        input_sets(cfg, InputSpec(data=({"X": [1, 2, 3, 4, 5]},)))
    two = {"name": "m", "max_batch_size": 0, "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1, -1]}]}
    with pytest.raises(InputSpecError, match="2 variable dims; give its shape"):
        input_sets(two, InputSpec(data=({"X": [1, 2, 3, 4]},)))
    assert input_sets(two, InputSpec(shapes={"X": (1, 4)}, data=({"X": [1, 2, 3, 4]},)))[0]["X"].shape == (1, 4)
    with pytest.raises(InputSpecError, match=r"3 values for shape \[1, 4\]"):
        input_sets(two, InputSpec(shapes={"X": (1, 4)}, data=({"X": [1, 2, 3]},)))


@pytest.mark.parametrize("dtype,values,expected", [
    ("TYPE_STRING", ["héllo", 7], [b"h\xc3\xa9llo", b"7"]),
    ("TYPE_BOOL", [True, False], [True, False]),
    ("TYPE_FP16", [0.5, 2], [0.5, 2.0]),
    ("TYPE_UINT8", [0, 255], [0, 255]),
])
def test_values_convert_to_the_inputs_type(dtype, values, expected):
    cfg = {"name": "m", "max_batch_size": 0, "input": [{"name": "X", "data_type": dtype, "dims": [2]}]}
    assert input_sets(cfg, InputSpec(data=({"X": values},)))[0]["X"].tolist() == expected


@pytest.mark.parametrize("dtype,values,piece", [
    ("TYPE_UINT8", [0, 256], "fit uint8"),
    ("TYPE_INT32", [1.5, 2], "fit int32"),
    ("TYPE_FP32", ["a", 2], "not a number"),
    ("TYPE_INT64", [None, 2], "not a number"),
])
def test_values_that_do_not_convert_are_named(dtype, values, piece):
    cfg = {"name": "m", "max_batch_size": 0, "input": [{"name": "X", "data_type": dtype, "dims": [2]}]}
    with pytest.raises(InputSpecError, match=f"data\\[0\\]: input 'X': values do not convert .*{piece}"):
        input_sets(cfg, InputSpec(data=({"X": values},)))


def test_a_required_input_missing_from_an_entry_and_an_unknown_one_are_named():
    with pytest.raises(InputSpecError, match=r"data\[1\]: input 'TOKENS' is missing"):
        input_sets(TOKENS, InputSpec(data=({"TOKENS": [1]}, {"MASK": [1]})))
    with pytest.raises(InputSpecError, match=r"data\[0\].IDS: the model has no input 'IDS' \(its inputs: TOKENS, MASK\)"):
        input_sets(TOKENS, InputSpec(data=({"TOKENS": [1], "IDS": [2]},)))


def test_a_batch_stacks_entries_in_turn_and_refuses_shapes_that_do_not_stack():
    spec = InputSpec(data=({"TOKENS": [1, 2]}, {"TOKENS": [3, 4]}, {"TOKENS": [5, 6]}))
    sets = input_sets(TOKENS, spec, batch_size=2)
    assert [s["TOKENS"].tolist() for s in sets] == [[[1, 2], [3, 4]], [[5, 6], [1, 2]], [[3, 4], [5, 6]]]
    two = input_sets(TOKENS, InputSpec(data=({"TOKENS": [1]}, {"TOKENS": [2]})), batch_size=2)
    assert [s["TOKENS"].tolist() for s in two] == [[[1], [2]]]       # every request alike: one set held
    import controller.evaluation.inputs as inputs_mod
    big = InputSpec(data=tuple({"TOKENS": list(range(1000))} for _ in range(3)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inputs_mod, "MAX_SETS_BYTES", 3 * 4 * 8000 - 1)
        with pytest.raises(InputSpecError, match="3 distinct requests of 4 entries would hold about 0 MiB"):
            input_sets(TOKENS, big, batch_size=4)
    assert len(input_sets(TOKENS, big, batch_size=4)) == 3
    with pytest.raises(InputSpecError, match="--batch-size 2 a request stacks entries in turn"):
        input_sets(TOKENS, InputSpec(data=({"TOKENS": [1, 2]}, {"TOKENS": [3]})), batch_size=2)


@pytest.mark.parametrize("content,piece", [
    ("{", "not JSON (line 1"),
    ("[]", 'expected {"data"'),
    ('{"data": []}', "at least one entry"),
    ('{"data": [[{"X": [1]}]]}', "sequence streams"),
    ('{"data": [{"X": {"b64": "AAAA"}}]}', "b64 content is not supported"),
    ('{"data": [{"X": {"shape": [1]}}]}', '"content"'),
    ('{"data": [{"X": {"content": [1], "shape": [0]}}]}', "integers >= 1"),
    ('{"data": [{"X": 3}]}', "expected a list of values"),
    ('{"data": [{}]}', "an object of input name"),
])
def test_a_bad_data_file_is_one_line(tmp_path, content, piece):
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(InputSpecError, match=piece.replace("[", r"\[").replace("(", r"\(")):
        read_input_data(path)


def test_make_spec_and_describe(tmp_path):
    assert make_spec([], None) is None and describe(None) == {"random": True}
    spec = make_spec([("TOKENS", (8,)), ("TOKENS", (8,))], _data(tmp_path, [{"TOKENS": [1]}]))
    assert describe(spec) == {"random": False, "shapes": {"TOKENS": [8]}, "data": str(tmp_path / "data.json"),
                              "entries": 1}
    with pytest.raises(InputSpecError, match="--shape TOKENS: given twice"):
        make_spec([("TOKENS", (8,)), ("TOKENS", (9,))], None)
    with pytest.raises(InputSpecError, match="--input-data: .*no such file|--input-data: .*No such file"):
        make_spec([], tmp_path / "missing.json")
    batched = make_spec([], None, 3)          # --batch-size alone is a spec: every verb sends and records it
    assert batched is not None and describe(batched) == {"random": True, "batch_size": 3}
    assert make_spec([], None, 1) is None


def test_batch_size_stacks_items_and_is_refused_where_the_model_cannot_take_it():
    sets = input_sets(TOKENS, InputSpec(shapes={"TOKENS": (5,), "MASK": (5,)}, batch_size=3))
    assert [a.shape for a in sets[0].values()] == [(3, 5), (3, 5)]
    with pytest.raises(InputSpecError, match="^--batch-size 5: model 'tokens' takes at most 4 per request$"):
        input_sets(TOKENS, InputSpec(batch_size=5))
    with pytest.raises(InputSpecError, match="^--batch-size 2: model 'tokens' takes no batch dimension$"):
        input_sets({**TOKENS, "max_batch_size": 0}, InputSpec(batch_size=2))


# ----------------------------------------------------------------------------------------------- live

MODEL_PY = '''
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes each request's TOKENS length and writes down what each request carried (seen.jsonl)."""

    def initialize(self, args):
        self.seen = os.path.join(args["model_repository"], "seen.jsonl")

    def execute(self, requests):
        responses = []
        with open(self.seen, "a") as f:
            for request in requests:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS").as_numpy()
                mask = pb_utils.get_input_tensor_by_name(request, "MASK")
                f.write(json.dumps({"tokens": tokens.tolist(),
                                    "mask": None if mask is None else mask.as_numpy().tolist()}) + "\\n")
                lengths = np.full((tokens.shape[0], 1), tokens.shape[-1], dtype=np.int64)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LEN", lengths)]))
        return responses
'''

CONFIG = '''
name: "tokens"
backend: "python"
max_batch_size: 4
input [
  { name: "TOKENS", data_type: TYPE_INT64, dims: [ -1 ] },
  { name: "MASK", data_type: TYPE_INT64, dims: [ -1 ], optional: true }
]
output [ { name: "LEN", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
'''


@pytest.fixture(scope="module")
def tokens_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "tokens" / "1").mkdir(parents=True)
    (repo / "tokens" / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    (repo / "tokens" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    s = start_server(["tokens"], repository=repo)
    yield s, repo / "tokens" / "seen.jsonl"
    s.stop()


def _seen(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    path.unlink(missing_ok=True)
    return rows


def _load(server, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", "load", "--model", "tokens", "--url",
                           f"127.0.0.1:{server.options.grpc_port}", "--seconds", "1", "--every", "5", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_load_names_a_variable_dim_sent_as_1_and_takes_shape(tokens_server):
    server, seen = tokens_server
    _seen(seen)
    r = _load(server, "--rate", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith("note: input TOKENS has variable dims [-1]: sending [1] (--shape")
    rows = _seen(seen)
    assert rows and all(len(row["tokens"]) == 1 and len(row["tokens"][0]) == 1 for row in rows)
    r = _load(server, "--rate", "20", "--shape", "TOKENS:16", "--shape", "MASK:16", "--batch-size", "2")
    assert r.returncode == 0 and "note:" not in r.stdout, r.stdout + r.stderr
    rows = _seen(seen)
    assert rows and all(np.shape(row["tokens"]) == (2, 16) and np.shape(row["mask"]) == (2, 16) for row in rows)


def test_load_sends_the_data_files_entries_in_turn(tokens_server, tmp_path):
    server, seen = tokens_server
    data = _data(tmp_path, [{"TOKENS": [101, 7, 102]},
                            {"TOKENS": {"content": [101, 8, 9, 102], "shape": [4]}, "MASK": [1, 1, 1, 0]}])
    _seen(seen)
    r = _load(server, "--rate", "30", "--input-data", str(data), "--json", str(tmp_path / "load.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "load.json").read_text())
    assert summary["inputs"] == {"random": False, "data": str(data), "entries": 2} and summary["batch_size"] == 1
    assert f"(2 distinct, from {data} in turn)" in r.stdout.splitlines()[0]
    rows = _seen(seen)
    n = int(r.stdout.splitlines()[0].split()[1])
    assert len(rows) == n > 10
    first = {"tokens": [[101, 7, 102]], "mask": None}
    second = {"tokens": [[101, 8, 9, 102]], "mask": [[1, 1, 1, 0]]}
    assert sorted(rows, key=lambda row: len(row["tokens"][0])) == [first] * ((n + 1) // 2) + [second] * (n // 2)


@pytest.mark.parametrize("argv,piece", [
    (["--shape", "NOPE:3"], "load: --shape NOPE: the model has no input 'NOPE' (its inputs: TOKENS, MASK)"),
    (["--shape", "TOKENS:3,4"], "load: --shape: input 'TOKENS' takes dims [-1] (-1: any); got [3, 4]"),
    (["--shape", "TOKENS"], "expected NAME:D1,D2,..."),
    (["--input-data", "/nonexistent/d.json"], "--input-data: /nonexistent/d.json: No such file or directory"),
])
def test_load_refuses_a_bad_spec_in_one_line(tokens_server, argv, piece):
    server, _ = tokens_server
    r = _load(server, "--rate", "5", *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    assert piece in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_load_refuses_entries_that_do_not_stack_or_miss_an_input(tokens_server, tmp_path):
    server, _ = tokens_server
    r = _load(server, "--rate", "5", "--batch-size", "2",
              "--input-data", str(_data(tmp_path, [{"TOKENS": [1, 2]}, {"TOKENS": [3]}])))
    assert r.returncode == 2 and "a request stacks entries in turn" in r.stderr, r.stderr
    r = _load(server, "--rate", "5", "--input-data", str(_data(tmp_path, [{"MASK": [1]}], "m.json")))
    assert r.returncode == 2 and "data[0]: input 'TOKENS' is missing" in r.stderr, r.stderr


@pytest.mark.slow
def test_sweep_sends_the_shape_given_and_records_it(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "tokens" / "1").mkdir(parents=True)
    (repo / "tokens" / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    (repo / "tokens" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    out = tmp_path / "sweep"
    rc = main(["sweep", "--repository", str(repo), "--model", "tokens", "--instances", "1", "--delays-us", "0",
               "--rates", "20", "--seconds", "1", "--warmup-s", "0", "--shape", "TOKENS:32", "--shape", "MASK:32",
               "--batch-size", "2", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["inputs"] == {"random": True, "shapes": {"MASK": [32], "TOKENS": [32]}, "batch_size": 2}
    assert doc["cells"][0]["failed"] == 0
    rows = _seen(repo / "tokens" / "seen.jsonl")
    assert rows and all(np.shape(row["tokens"]) == (2, 32) for row in rows)
    assert "note:" not in capsys.readouterr().err


def _tokens_repo(root: Path) -> Path:
    (root / "tokens" / "1").mkdir(parents=True)
    (root / "tokens" / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    (root / "tokens" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    return root


@pytest.mark.slow
def test_the_benchs_arms_send_the_data_and_a_sweep_of_other_inputs_is_named(tmp_path, capsys):
    from controller.sweep_schema import Cell, sweep_document
    repo = _tokens_repo(tmp_path / "repo")
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text("phases:\n  - {name: low, duration_s: 2, rate_rps: 20}\n")
    sweep = tmp_path / "sweep.json"       # measured with random inputs (no "inputs" key: a sweep from before)
    cells = [Cell(n, 0, 20.0, 20.0, 20.0, 20.0, 5.0, 9.0, 40, 0, True) for n in (1, 2)]
    sweep.write_text(json.dumps({k: v for k, v in sweep_document("tokens", cells, sla_ms=40, seconds=2, warmup_s=0,
                                                                 seed=0).items() if k != "inputs"}))
    data = _data(tmp_path, [{"TOKENS": [5, 6, 7, 8, 9]}])
    rc = main(["bench", "--repository", str(repo), "--model", "tokens", "--scenario", str(scenario), "--sweep",
               str(sweep), "--arms", "default,best_static", "--sla-ms", "40", "--input-data", str(data),
               "--out", str(tmp_path / "bench")])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"warning: the sweep {sweep} sent inputs {{'random': True}}, the bench sends {{'random': False" in err
    assert "note:" not in err                               # the file's requests set every dim
    rows = _seen(repo / "tokens" / "seen.jsonl")
    assert len(rows) > 40 and all(row["tokens"] == [[5, 6, 7, 8, 9]] for row in rows)   # two arms of ~40
    # a dim neither --shape nor the data sets is named by each arm, as the sweep and load name it
    rc = main(["bench", "--repository", str(repo), "--model", "tokens", "--scenario", str(scenario), "--sweep",
               str(sweep), "--arms", "default", "--sla-ms", "40", "--shape", "TOKENS:3", "--out", str(tmp_path / "b2")])
    assert rc == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "arm default: note: tokens: input MASK has variable dims [-1]: sending [1]" in notes[0]
    rows = _seen(repo / "tokens" / "seen.jsonl")
    assert rows and all(np.shape(row["tokens"]) == (1, 3) and np.shape(row["mask"]) == (1, 1) for row in rows)


@pytest.mark.slow
def test_soak_takes_the_same_options_and_refuses_a_shape_its_model_does_not_take(tmp_path, capsys):
    rc = main(["soak", "--reloads", "1", "--out", str(tmp_path / "soak"), "--shape", "INPUT:8"])
    err = capsys.readouterr().err
    assert rc == 2 and "--shape: input 'INPUT' takes dims [16]; got [8]" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra", [["--batch-size", "2"], ["--shape", "INPUT:8"]])
def test_a_two_model_bench_refuses_the_options_of_one_models_requests(tmp_path, capsys, extra):
    rc = main(["bench", "--scenario", str(ROOT / "scripts" / "scenarios" / "two_models.yaml"), *extra,
               "--out", str(tmp_path / "b")])
    assert rc == 2
    assert "--shape, --input-data and --batch-size: only for a one-model scenario" in capsys.readouterr().err
