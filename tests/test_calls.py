"""Who calls whom, from request traces (controller/calls.py): no server."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.calls import CallGraph
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
    """A TraceFeed stand-in whose first poll returns `samples` (the loop routes them and learns the calls)."""

    def __init__(self, samples):
        self.samples, self.state = list(samples), "on"

    def poll(self, now, traffic):
        out: dict = {}
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


def _bls_plain_controller():
    """Only `bls` (60 ms) and `ens` (an ensemble of `net`, 40 ms) named; the traces show bls calling plain and ens
    its step; 4 ticks run."""
    from controller.config import ControllerConfig, ModelLimits, ServerConfig
    from controller.loop import Controller
    from test_ensemble import ENS
    from test_loop_ticks import LOOP, Clock, FakeControl, FakeModel, FakeScraper, model_config, run_ticks
    clock = Clock()
    control = FakeControl(["bls", "plain", "ens", "net"])
    control.configs.update(ens=ENS, net=model_config("net"))
    cfg = ControllerConfig(server=ServerConfig(), loop=LOOP, defaults=ModelLimits(p99_target_ms=1000.0),
                           models={"bls": ModelLimits(p99_target_ms=60.0), "ens": ModelLimits(p99_target_ms=40.0)})
    fakes = {m: FakeModel(20, 5, 4) for m in ("bls", "plain", "ens", "net")}
    feed = _FeedOnce([s(1, "bls"), s(2, "plain", 1), s(3, "ens"), s(4, "net", 3)])
    ctl = Controller(cfg, control=control, scraper=FakeScraper(clock, fakes), clock=clock, traces=feed)
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
    assert snap["bls"]["calls"] == {"plain": {"per_request": 1.0, "in_sequence": 1.0}}
    assert snap["plain"]["called_by"] == ["bls"]
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
