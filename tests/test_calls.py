"""Who calls whom, from request traces or a Python model's source (controller/calls.py): no server."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.calls import CallGraph, named_in_source, names_in_code
from controller.traces import TraceSample, parse_trace_text


def s(trace_id, model, parent=None):
    return TraceSample(model=model, end_s=0.0, latency_ms=1.0, request_ms=1.0, parent_id=parent, trace_id=trace_id)


def test_the_docstrings_worked_example():
    g = CallGraph()
    g.add([s(1, "bls"), s(2, "plain", 1), s(3, "plain", 1), s(4, "bls"), s(5, "plain", 4)])
    assert g.edges() == (("bls", "plain"),)
    assert g.calls_per_request("bls", "plain") == 1.5
    assert g.callees("bls") == ("plain",) and g.callers("plain") == ("bls",) and g.callees("plain") == ()
    assert g.calls_per_request("plain", "bls") == 0.0


def test_a_child_whose_parent_comes_in_a_later_file_is_counted_once_the_parent_is_seen():
    g = CallGraph()
    g.add([s(2, "plain", 1), s(3, "other", 1)])          # the children end first
    assert g.edges() == ()
    g.add([s(1, "bls"), s(5, "plain", 4)])
    assert g.edges() == (("bls", "other"), ("bls", "plain"))
    g.add([s(4, "bls")])
    assert g.calls_per_request("bls", "plain") == 1.0 and g.calls_per_request("bls", "other") == 1.0


def test_a_request_is_counted_once_per_callee_across_polls():
    g = CallGraph()
    g.add([s(1, "bls"), s(2, "plain", 1)])
    g.add([s(3, "plain", 1), s(4, "plain", 1)])         # more calls of the same request, in a later file
    assert g.calls_per_request("bls", "plain") == 3.0


def test_memory_is_bounded_and_a_self_call_adds_no_edge():
    g = CallGraph(keep=10)
    g.add([s(i, "m", i - 1 if i % 2 else None) for i in range(1000)])
    assert g.edges() == ()
    assert len(g._model_of) <= 10 and len(g._waiting) <= 10 and len(g._counted) <= 10
    g.add([s(2000 + i, "child", 5000 + i) for i in range(100)])     # parents never seen
    assert len(g._waiting) <= 10 and g.edges() == ()


def test_forget_drops_a_models_edges():
    g = CallGraph()
    g.add([s(1, "a"), s(2, "b", 1), s(3, "c"), s(4, "d", 3)])
    g.forget("b")
    assert g.edges() == (("c", "d"),)


def test_samples_parsed_from_a_trace_file_carry_their_ids():
    text = ('[{"id": 7, "model_name": "bls", "model_version": 1},'
            '{"id": 8, "model_name": "plain", "model_version": 1, "parent_id": 7},'
            '{"id": 7, "timestamps": [{"name": "REQUEST_START", "ns": 1000}, {"name": "REQUEST_END", "ns": 9000000}]},'
            '{"id": 8, "timestamps": [{"name": "REQUEST_START", "ns": 2000}, {"name": "REQUEST_END", "ns": 5000000}]}]')
    samples = parse_trace_text(text)
    assert [(x.model, x.trace_id, x.parent_id) for x in samples] == [("bls", 7, None), ("plain", 8, 7)]
    g = CallGraph()
    g.add(samples)
    assert g.edges() == (("bls", "plain"),)


def test_bls_checks_untraced_arm_differs_from_the_shipped_bls_only_by_the_trace_argument(tmp_path):
    from conftest import load_script
    bls_check = load_script("bls_check")
    bls_check.make_repo(tmp_path / "traced", traced=True)
    bls_check.make_repo(tmp_path / "untraced", traced=False)
    traced = (tmp_path / "traced" / "bls" / "1" / "model.py").read_text()
    untraced = (tmp_path / "untraced" / "bls" / "1" / "model.py").read_text()
    assert "trace=request.trace()" in traced and "trace=" not in untraced.replace("# trace=", "")
    assert untraced == traced.replace("trace=request.trace()", "")
    compile(untraced, "model.py", "exec")
    plain = tmp_path / "untraced" / "plain" / "1" / "model.py"
    assert plain.is_file() and not plain.is_symlink()          # the shipped one is a relative link


class _FeedOnce:
    """A TraceFeed stand-in whose first poll (after `after` empty ones) returns `samples` (the loop routes them and
    learns the calls)."""

    def __init__(self, samples, after=0):
        self.samples, self.state, self.after = list(samples), "on", after     # after: empty polls before the first
        self.caution = None

    def poll(self, now, traffic):
        out: dict = {}
        if self.after > 0:
            self.after -= 1
            return out
        for x in self.samples:
            out.setdefault(x.model, []).append(x)
        self.samples = []
        return out

    def start(self):
        pass

    def adapt(self, model, arrival_rps, now):
        pass

    def describe(self, model):
        return "on"

    def forget(self, model):
        pass

    def stop(self):
        pass


def _controller(names, targets, feed, *, configs=None, python=False, repository=None, scraped=None):
    """A loop over FakeControl's `names` (their configs updated by `configs`; every backend "python" if asked),
    `targets` the named models' p99 targets (1,000 ms by default), `feed` the traces, the server's repository
    readable at `repository` if given, and the metrics of `scraped` (default: every model). (ctl, control, clock)."""
    from controller.config import ControllerConfig, ModelLimits, ServerConfig
    from controller.loop import Controller
    from test_loop_ticks import LOOP, Clock, FakeControl, FakeModel, FakeScraper
    clock = Clock()
    control = FakeControl(list(names))
    control.configs.update(configs or {})
    if python:
        for c in control.configs.values():
            c["backend"] = "python"
    cfg = ControllerConfig(server=ServerConfig(repository=repository), loop=LOOP,
                           defaults=ModelLimits(p99_target_ms=1000.0),
                           models={m: ModelLimits(p99_target_ms=ms) for m, ms in targets.items()})
    fakes = {m: FakeModel(20, 5, 4) for m in (names if scraped is None else scraped)}
    return Controller(cfg, control=control, scraper=FakeScraper(clock, fakes), clock=clock, traces=feed), control, clock


def _bls_plain_controller():
    """Only `bls` (60 ms) and `ens` (an ensemble of `net`, 40 ms) named; the traces show bls calling plain and ens
    its step; 4 ticks run."""
    from test_ensemble import ENS
    from test_loop_ticks import model_config, run_ticks
    ctl, _, clock = _controller(("bls", "plain", "ens", "net"), {"bls": 60.0, "ens": 40.0},
                                _FeedOnce([s(1, "bls"), s(2, "plain", 1), s(3, "ens"), s(4, "net", 3)]),
                                configs={"ens": ENS, "net": model_config("net")})
    run_ticks(ctl, clock, 4)
    return ctl, clock


def test_the_loop_passes_a_callers_target_to_its_callee_and_leaves_ensembles_to_their_config():
    """plain is managed under bls's target; ens's steps are not shown as its calls (they are its steps)."""
    from test_loop_ticks import run_ticks
    ctl, clock = _bls_plain_controller()
    assert ctl.calls.edges() == (("bls", "plain"), ("ens", "net"))
    plain = ctl.models["plain"]
    assert plain.limits.p99_target_ms == 60.0 and plain.target_from.ensemble == "bls"
    snap = ctl.status_snapshot()["models"]
    assert snap["bls"]["calls"] == {"plain": {"per_request": 1.0, "in_sequence": 1.0, "traced": True}}
    assert snap["plain"]["called_by"] == ["bls"] and snap["plain"]["called_by_untraced"] is None
    assert snap["ens"]["calls"] is None and snap["net"]["called_by"] is None
    assert snap["net"]["target_ensemble"] == "ens"
    # plain changes: bls's window still reaches back before it, so plain keeps its target until bls's window does not
    ctl._mark_change(plain, clock.t)
    [view] = ctl._caller_views()
    assert view.name == "bls" and view.obs is None
    run_ticks(ctl, clock, 6)           # the window (4 s) now starts after the change
    [view] = ctl._caller_views()
    assert view.obs is not None and view.obs.since >= plain.observer.changed_at
    assert plain.limits.p99_target_ms == 60.0
    ctl.close()


def test_a_callee_that_is_an_ensemble_takes_its_callers_target_and_passes_it_to_its_step():
    """bls calls the ensemble ens (ens -> net); bls is named with 60 ms, ens with its own 500 ms: ens runs under
    60 ms from bls, and its step net under ens's, where both would run under 500 ms without the call."""
    from test_ensemble import ENS
    from test_loop_ticks import model_config, run_ticks
    # the calls are seen once every model's kind is known (the first traces come after the first ticks)
    feed = _FeedOnce([s(1, "bls"), s(2, "ens", 1), s(3, "net", 2)], after=2)
    ctl, control, clock = _controller(("bls", "ens", "net"), {"bls": 60.0, "ens": 500.0}, feed,
                                      configs={"ens": ENS, "net": model_config("net")})
    try:
        run_ticks(ctl, clock, 6)
        assert ctl.calls.edges() == (("bls", "ens"), ("ens", "net"))
        ens, net = ctl.models["ens"], ctl.models["net"]
        assert ens.limits.p99_target_ms == 60.0 and ens.target_from.ensemble == "bls"
        assert net.limits.p99_target_ms == 60.0 and net.target_from.ensemble == "ens"
        assert not [m for m, _ in control.loads if m == "ens"]           # an ensemble is never reloaded
        snap = ctl.status_snapshot()["models"]
        assert snap["ens"]["called_by"] == ["bls"] and snap["ens"]["calls"] is None
    finally:
        ctl.close()


def timed(trace_id, model, parent, start_ms, ms):
    return TraceSample(model=model, end_s=(start_ms + ms) / 1000.0, latency_ms=ms, request_ms=ms, parent_id=parent,
                       trace_id=trace_id)


def test_calls_sent_at_once_count_as_one_in_sequence_the_docstrings_example():
    one_after_the_other = CallGraph()
    one_after_the_other.add([s(1, "bls"), timed(2, "plain", 1, 0, 10), timed(3, "plain", 1, 10, 10),
                             s(4, "bls"), timed(5, "plain", 4, 50, 10)])
    assert one_after_the_other.calls_per_request("bls", "plain") == 1.5
    assert one_after_the_other.calls_in_sequence("bls", "plain") == 1.5
    at_once = CallGraph()
    at_once.add([s(1, "bls"), timed(2, "plain", 1, 0, 10), timed(3, "plain", 1, 0, 10),
                 s(4, "bls"), timed(5, "plain", 4, 50, 10)])
    assert at_once.calls_per_request("bls", "plain") == 1.5
    assert abs(at_once.calls_in_sequence("bls", "plain") - 1.0) < 1e-9


def test_a_fan_out_split_across_files_is_counted_by_its_union():
    """Eight calls at once, half of them in a later file: the union is 12 ms (the calls overlap), so one of eight in
    sequence, however the calls arrive."""
    g = CallGraph()
    g.add([s(1, "bls")] + [timed(10 + i, "net", 1, i * 0.25, 11) for i in range(4)])
    g.add([timed(20 + i, "net", 1, 1 + i * 0.25, 11) for i in range(4)])
    assert g.calls_per_request("bls", "net") == 8.0
    assert abs(g.calls_in_sequence("bls", "net") - 8 * 12.75 / 88) < 1e-9 and g.calls_in_sequence("bls", "net") >= 1.0


def test_status_shows_the_calls_in_sequence_where_a_request_sends_them_at_once():
    from controller.status import format_model
    m = {"state": "READY", "calls": {"net": {"per_request": 8.0, "in_sequence": 1.16},
                                     "plain": {"per_request": 1.0, "in_sequence": 1.0}}}
    line = next(ln for ln in format_model("bls", m) if ln.strip().startswith("calls"))
    assert "net (8.0 a request, 1.2 of them in sequence), plain (1.0 a request), seen in its request traces" in line


def test_a_callers_other_service_curves_go_when_its_callee_changes():
    """bls's curve at 1 instance was measured while plain, which it waits on, was slower: kept, it would keep bls at
    a count it no longer needs. Only the live curve stays, fed on."""
    from controller.types import Settings
    ctl, clock = _bls_plain_controller()
    bls, plain = ctl.models["bls"], ctl.models["plain"]
    live = bls.current
    other = Settings(live.instance_count + 1, live.max_queue_delay_us)
    bls.observer.service._accumulate(other, {1: (60, 60 * 40_000_000)}, 100.0)    # 60 executions of 40 ms
    assert other in bls.observer.service.configs()
    ctl._callee_changed(plain)
    assert bls.observer.service.configs() in ([live], [])
    ctl.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(0, 1000), st.floats(0, 500)), min_size=1, max_size=6),
                min_size=1, max_size=8),
       st.integers(1, 3), st.booleans())
def test_calls_in_sequence_stays_between_one_and_the_calls_a_request(requests, files, parents_first):
    """Any calls (start ms, duration ms), any split into files, the parents' records before or after their calls':
    1 <= in sequence <= calls a request, and the counts do not depend on the split."""
    samples, whole = [], CallGraph()
    next_id = 1
    for calls in requests:
        parent = next_id
        samples.append(s(parent, "bls"))
        for start, ms in calls:
            next_id += 1
            samples.append(timed(next_id, "plain", parent, start, ms))
        next_id += 1
    whole.add(samples)
    split = CallGraph()
    if parents_first:
        split.add([x for x in samples if x.parent_id is None])
    for i in range(files):            # the calls in pieces
        split.add([x for j, x in enumerate(samples) if x.parent_id is not None and j % files == i])
    if not parents_first:
        split.add([x for x in samples if x.parent_id is None])
    k = whole.calls_per_request("bls", "plain")
    assert k == sum(len(c) for c in requests) / len(requests)
    assert 1.0 <= whole.calls_in_sequence("bls", "plain") <= k + 1e-9
    assert split.calls_per_request("bls", "plain") == k
    assert abs(split.calls_in_sequence("bls", "plain") - whole.calls_in_sequence("bls", "plain")) < 1e-6


# ---- calls named in a caller's source (a caller that does not pass its trace on) -------------------------------

BLS_SOURCE = '''"""Sends each row on to `plain` (a docstring naming a model is not a call)."""
import triton_python_backend_utils as pb_utils

CALLEE = "plain"


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceRequest(model_name=CALLEE, requested_output_names=["OUTPUT"], inputs=[]).exec()
                for _ in requests]
'''


def test_a_string_constant_naming_a_model_counts_only_where_the_code_builds_an_inference_request():
    names = {"plain", "ens", "OUTPUT"}
    assert names_in_code(BLS_SOURCE, names) == {"plain", "OUTPUT"}     # OUTPUT: a model named like a tensor is named
    assert names_in_code(BLS_SOURCE, {"ens"}) == set()
    direct = 'from triton_python_backend_utils import InferenceRequest\nr = InferenceRequest(model_name="ens")\n'
    assert names_in_code(direct, names) == {"ens"}
    not_bls = 'NAME = "plain"\nprint(NAME)\n'                       # names plain, never builds a request
    assert names_in_code(not_bls, names) == set()
    assert names_in_code("def broken(:\n  'plain' InferenceRequest", names) == set()
    assert names_in_code('"""Calls plain."""\nInferenceRequest = None\n', names) == set()   # a mention in words


def test_named_in_source_reads_the_models_py_files_but_not_its_own_name_caches_or_large_files(tmp_path):
    from controller import calls
    bls = tmp_path / "bls"
    (bls / "1").mkdir(parents=True)
    (bls / "1" / "model.py").write_text(BLS_SOURCE.replace('CALLEE = "plain"', 'CALLEE = "plain"\nME = "bls"'))
    (bls / "1" / "helpers.py").write_text('import triton_python_backend_utils as pb_utils\n'
                                          'def tokenize(x):\n    return pb_utils.InferenceRequest(model_name="tok")\n')
    (bls / "1" / "__pycache__").mkdir()
    (bls / "1" / "__pycache__" / "stale.py").write_text(BLS_SOURCE.replace('"plain"', '"gone"'))
    (bls / "big.py").write_text(BLS_SOURCE.replace('"plain"', '"huge"') + "#" * calls.SOURCE_BYTES)
    names = {"bls", "plain", "tok", "gone", "huge", "other"}
    assert named_in_source(bls, names) == ("plain", "tok")
    assert named_in_source(tmp_path / "absent", names) == ()


def test_a_file_unchanged_since_it_was_read_is_not_read_again_and_a_changed_one_is(tmp_path):
    import os
    code = tmp_path / "bls" / "1" / "model.py"
    code.parent.mkdir(parents=True)
    code.write_text(BLS_SOURCE)
    cache: dict = {}
    names = {"plain", "tok"}
    assert named_in_source(tmp_path / "bls", names, cache) == ("plain",) and list(cache) == [code]
    mtime, size, builds, _ = cache[code]
    assert builds
    cache[code] = (mtime, size, True, frozenset({"tok"}))      # what an unchanged file's entry says is what counts
    assert named_in_source(tmp_path / "bls", names, cache) == ("tok",)
    code.write_text(BLS_SOURCE.replace('"plain"', '"tok"') + "\n")
    os.utime(code, ns=(mtime + 10**9, mtime + 10**9))
    assert named_in_source(tmp_path / "bls", names, cache) == ("tok",) and cache[code][3] >= {"tok"}
    code.write_text(BLS_SOURCE + "\n\n")
    os.utime(code, ns=(mtime + 2 * 10**9, mtime + 2 * 10**9))
    assert named_in_source(tmp_path / "bls", names, cache) == ("plain",)


def test_a_callee_named_in_the_models_config_parameters_counts_where_its_code_builds_a_request(tmp_path):
    """A BLS model told its callee in its config (`parameters {key: "downstream" value {string_value: "plain"}}`,
    read as `model_name=params["downstream"]["string_value"]`): the parameter's value counts as a constant of its
    code, where that code builds an InferenceRequest, and not for a model whose code builds none."""
    (tmp_path / "bls" / "1").mkdir(parents=True)
    (tmp_path / "bls" / "1" / "model.py").write_text(
        "import json\nimport triton_python_backend_utils as pb_utils\n\n\nclass TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        self.callee = json.loads(args['model_config'])['parameters']['downstream']['string_value']\n\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceRequest(model_name=self.callee, inputs=[]).exec() for _ in requests]\n")
    (tmp_path / "net" / "1").mkdir(parents=True)
    (tmp_path / "net" / "1" / "model.py").write_text("x = 'plain'\n")
    names = {"bls", "net", "plain", "tok"}
    assert named_in_source(tmp_path / "bls", names) == ()
    assert named_in_source(tmp_path / "bls", names, parameters=["plain", "fp16", "bls"]) == ("plain",)
    assert named_in_source(tmp_path / "net", names, parameters=["plain"]) == ()
    from controller.loop import _parameter_values
    assert _parameter_values({"parameters": {"downstream": {"string_value": "plain"}, "n": {"x": 1}}}) == ("plain",)
    assert _parameter_values(None) == () and _parameter_values({"parameters": []}) == ()


def test_a_vendored_tree_under_a_model_is_not_walked_to_its_end(tmp_path):
    from controller import calls
    bls = tmp_path / "bls"
    (bls / "1").mkdir(parents=True)
    (bls / "1" / "model.py").write_text(BLS_SOURCE)
    lib = bls / "1" / "zz_vendor"
    lib.mkdir()
    for i in range(calls.SOURCE_ENTRIES + 10):
        (lib / f"f{i}.txt").write_text("")
    (lib / "deep.py").write_text(BLS_SOURCE.replace('"plain"', '"tok"'))
    files = calls._py_files(bls)
    assert (bls / "1" / "model.py") in files and (lib / "deep.py") not in files
    assert named_in_source(bls, {"plain", "tok"}) == ("plain",)


def test_the_mixed_repositorys_bls_names_plain_and_its_other_python_models_name_nothing(tmp_path):
    from conftest import ROOT, load_script
    mixed = ROOT / "scripts" / "scenarios" / "repos" / "mixed"
    names = {p.name for p in mixed.iterdir() if (p / "config.pbtxt").is_file()}
    assert names == {"bls", "plain", "ens", "ens_step"}
    assert named_in_source(mixed / "bls", names) == ("plain",)
    assert [named_in_source(mixed / m, names) for m in ("plain", "ens_step")] == [(), ()]
    load_script("bls_check").make_repo(tmp_path, traced=False)      # the untraced arm: the same name, no trace=
    assert named_in_source(tmp_path / "bls", names) == ("plain",)


def test_an_edge_named_in_the_source_counts_one_call_until_the_traces_measure_it():
    g = CallGraph()
    g.declare("bls", ["plain", "bls"])                       # its own name is never a callee
    assert g.edges() == (("bls", "plain"),) and g.callers("plain") == ("bls",) and g.callees("bls") == ("plain",)
    assert not g.traced("bls", "plain") and g.declared("bls", "plain")
    assert (g.calls_per_request("bls", "plain"), g.calls_in_sequence("bls", "plain")) == (1.0, 1.0)
    g.add([s(1, "bls"), timed(2, "plain", 1, 0, 10), timed(3, "plain", 1, 10, 10)])
    assert g.traced("bls", "plain") and g.edges() == (("bls", "plain"),)
    assert (g.calls_per_request("bls", "plain"), g.calls_in_sequence("bls", "plain")) == (2.0, 2.0)
    g.declare("bls", ["net"])                                # read again: what the source names now replaces it
    assert g.edges() == (("bls", "net"), ("bls", "plain")) and not g.declared("bls", "plain")
    g.forget("net")
    assert g.edges() == (("bls", "plain"),)
    assert g.calls_per_request("x", "y") == 0.0 and g.calls_in_sequence("x", "y") == 0.0


def test_the_loop_passes_a_callers_target_to_a_callee_its_source_names_and_status_says_how_it_knows(tmp_path):
    """No trace shows the call (the caller does not pass its trace on); the repository is readable here: bls's
    model.py names plain, so plain runs under bls's target, and status says where that came from and what to do."""
    from controller.status import format_model
    from test_loop_ticks import model_config, run_ticks
    by_param = BLS_SOURCE.replace('CALLEE = "plain"', 'CALLEE = PARAMS["downstream"]["string_value"]')
    for name, code in (("bls", BLS_SOURCE), ("plain", "x = 1\n"), ("other", BLS_SOURCE.replace('"plain"', '"gone"')),
                       ("cfgbls", by_param)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text(code)
    # cfgbls names its callee in its config
    cfgbls = {**model_config("cfgbls"), "parameters": {"downstream": {"string_value": "plain"}}}
    ctl, _, clock = _controller(("bls", "plain", "cfgbls"), {"bls": 60.0, "cfgbls": 500.0}, _FeedOnce([]),
                                configs={"cfgbls": cfgbls}, python=True, repository=str(tmp_path))
    try:
        run_ticks(ctl, clock, 4)
        assert ctl.calls.edges() == (("bls", "plain"), ("cfgbls", "plain")) and not ctl.calls.traced("bls", "plain")
        plain = ctl.models["plain"]
        assert plain.limits.p99_target_ms == 60.0 and plain.target_from.ensemble == "bls"
        assert "named in its model.py" in plain.target_from.why
        snap = ctl.status_snapshot()["models"]
        assert snap["bls"]["calls"] == {"plain": {"per_request": 1.0, "in_sequence": 1.0, "traced": False}}
        assert snap["plain"]["called_by_untraced"] == ["bls", "cfgbls"]
        calls = next(ln for ln in format_model("bls", {**snap["bls"], "state": "READY"}) if "calls" in ln.split()[:1])
        assert "plain named in its model.py" in calls and "trace=request.trace()" in calls, calls
        called_by = next(ln for ln in format_model("plain", {**snap["plain"], "state": "READY"})
                         if ln.split()[:2] == ["called", "by"])
        assert "bls, cfgbls, which name it in their model.py or config (calls not traced)" in called_by, called_by
        # request tracing off (a Triton < 2.57 under `tracing: auto`): the calls cannot be measured whatever the
        # caller passes, so status says that rather than asking for trace=request.trace()
        off = "off: Triton 2.51.0 can crash under request tracing (...)"
        calls_off = next(ln for ln in format_model("bls", {**snap["bls"], "state": "READY", "tracing": off})
                         if "calls" in ln.split()[:1])
        assert "(request tracing is off, so its calls are not measured)" in calls_off, calls_off
        assert "trace=request.trace()" not in calls_off, calls_off
        called_off = next(ln for ln in format_model("plain", {**snap["plain"], "state": "READY", "tracing": off})
                          if ln.split()[:2] == ["called", "by"])
        assert called_off.endswith("which name it in their model.py or config (request tracing off)"), called_off
    finally:
        ctl.close()


def test_a_callee_its_caller_no_longer_names_runs_under_its_own_target_again(tmp_path):
    """bls's model.py named plain, then was edited not to (read again every DISCOVER_EVERY_S): plain's target goes
    back to its own, rather than keeping bls's for the controller's life."""
    from controller.loop import DISCOVER_EVERY_S
    from test_loop_ticks import run_ticks
    (tmp_path / "bls" / "1").mkdir(parents=True)
    code = tmp_path / "bls" / "1" / "model.py"
    code.write_text(BLS_SOURCE)
    ctl, _, clock = _controller(("bls", "plain"), {"bls": 60.0}, _FeedOnce([]), python=True,
                                repository=str(tmp_path))
    try:
        run_ticks(ctl, clock, 4)
        plain = ctl.models["plain"]
        assert plain.limits.p99_target_ms == 60.0 and plain.target_from.ensemble == "bls"
        code.write_text(BLS_SOURCE.replace('"plain"', '"elsewhere"') + "\n")
        clock.t += DISCOVER_EVERY_S
        run_ticks(ctl, clock, 2)
        assert ctl.calls.edges() == () and plain.limits.p99_target_ms == 1000.0 and plain.target_from is None
    finally:
        ctl.close()


def test_without_a_readable_repository_no_source_is_read():
    from test_loop_ticks import run_ticks
    ctl, _, clock = _controller(("bls", "plain"), {"bls": 60.0}, _FeedOnce([]), scraped=("bls",))
    try:
        run_ticks(ctl, clock, 3)
        assert ctl.calls.edges() == () and "plain" not in ctl.models
    finally:
        ctl.close()
