"""Stage 1 against the crowd (`bmeg.models.crowd`): machine-wide slowness holds an alarm, and so
does a busy machine's moderate tail spread over several services while few recent traces are
alarms; a slowness of one service, one that fills half a service's visits, or a stream with a
fault's share of alarms does not; only the stream's past is read."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import star_trace, tiny_detector

from bmeg.models.crowd import CrowdRule
from bmeg.models.detector import CROWD_WARNING
from bmeg.models.history import Observation, StreamHistory
from bmeg.traces import span_table

SERVICES = ["a", "b", "c", "d", "e", "f"]
SECOND = 10**9
RULE = CrowdRule(busy_z=None)  # a stalled machine only (session 11's)
BUSY = CrowdRule()  # and a busy machine (session 15's, gated by the alarm share in session 16: the default)
past_nodes = st.lists(st.tuples(st.sampled_from(SERVICES), st.integers(0, 3 * SECOND), st.floats(-5, 50)),
                      max_size=150)


def crowd(slow: dict[str, float], start_ns: int = 0, visits: int = 20, end_ns: int = SECOND) -> Observation:
    """`visits` visits of every service, spread over [start_ns, end_ns), the given share of each slow."""
    services, starts, z = [], [], []
    for name in SERVICES:
        for i in range(visits):
            services.append(name)
            starts.append(start_ns + (end_ns - start_ns) * i // visits)
            z.append(20.0 if i < slow.get(name, 0.0) * visits else 0.5)
    return Observation(np.array(services, dtype=object), np.array(starts, dtype=np.int64), np.array(z))


def trace(z: dict[str, float], start_ns: int = SECOND) -> Observation:
    """One trace's nodes: one visit per service named, with that self-time z-score."""
    return Observation(np.array(list(z), dtype=object), np.full(len(z), start_ns, dtype=np.int64),
                       np.array(list(z.values()), dtype=np.float64))


def explained(past: Observation, *traces: Observation, rule: CrowdRule = RULE, alarm_share: float = 0.0) -> list[bool]:
    """`rule`'s verdicts, the stream's recent alarm share `alarm_share` for every trace (0: a quiet stream)."""
    nodes = Observation.empty()
    index = []
    for i, one in enumerate(traces):
        nodes = nodes + one
        index += [i] * len(one.services)
    return rule.explained(past, nodes, np.array(index, dtype=np.int64), len(traces),
                          np.full(len(traces), alarm_share)).tolist()


def test_machine_wide_slowness_explains_a_trace_slow_where_the_crowd_is():
    busy = crowd({name: 0.3 for name in SERVICES})
    assert explained(busy, trace({"a": 0.2, "b": 30.0})) == [True]


def test_a_slow_service_alone_does_not_explain_its_traces():
    one_service = crowd({"b": 0.9})  # a fault confined to b: the machine is not slow
    assert explained(one_service, trace({"a": 0.2, "b": 30.0})) == [False]
    # nor do a few slow services, under the machine share
    assert explained(crowd({"a": 0.5, "b": 0.5}), trace({"b": 30.0})) == [False]


def test_a_trace_slow_where_the_crowd_is_not_stands_out():
    most = crowd({"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5})  # e and f are not slow
    assert explained(most, trace({"a": 30.0, "e": 30.0})) == [False]
    assert explained(most, trace({"a": 30.0, "unknown": 30.0})) == [False]  # a service the crowd has not seen
    assert explained(most, trace({"a": 30.0})) == [True]


def test_a_trace_with_no_slow_visit_is_not_explained():
    """Flagged for something else (structure, an error): not the crowd's doing."""
    assert explained(crowd({name: 0.9 for name in SERVICES}), trace({"a": 1.0, "b": 4.9})) == [False]


def test_only_the_window_before_the_trace_is_read():
    busy_long_ago = crowd({name: 0.9 for name in SERVICES}, start_ns=-5 * SECOND, end_ns=-2 * SECOND)
    busy_later = crowd({name: 0.9 for name in SERVICES}, start_ns=SECOND, end_ns=2 * SECOND)
    slow_trace = trace({"a": 30.0})
    assert explained(busy_long_ago, slow_trace) == [False]
    assert explained(busy_later, slow_trace) == [False]  # begun at the same time or after: not its past
    assert explained(busy_long_ago + busy_later + crowd({name: 0.9 for name in SERVICES}), slow_trace) == [True]


def test_too_few_visits_are_not_counted():
    sparse = crowd({name: 0.9 for name in SERVICES}, visits=RULE.min_visits - 1)
    assert explained(sparse, trace({"a": 30.0})) == [False]
    assert explained(Observation.empty(), trace({"a": 30.0})) == [False]


def observation(nodes) -> Observation:
    if not nodes:
        return Observation.empty()
    services, starts, z = zip(*nodes)
    return Observation(np.array(services, dtype=object), np.array(starts, dtype=np.int64), np.array(z))


def test_a_busy_machine_explains_a_moderate_slowness_where_the_crowd_has_some():
    """A hog taking part of the CPU: a tail of slow visits on a few services (under half of
    them, so no stall), none slow on half its visits."""
    busy = crowd({"a": 0.1, "b": 0.2})
    moderate, strong = BUSY.busy_z - 1, BUSY.busy_z + 1
    assert explained(busy, trace({"a": moderate, "b": moderate, "d": 1.0}), rule=BUSY) == [True]
    assert explained(busy, trace({"a": moderate, "b": strong}), rule=BUSY) == [False]  # beyond a busy machine's
    assert explained(busy, trace({"d": moderate}), rule=BUSY) == [False]  # d has no slow visit in the crowd
    assert explained(busy, trace({"a": moderate}), rule=RULE) == [False]  # session 11: no stall, no hold


def test_a_fault_holding_one_service_keeps_its_alarms_on_a_busy_machine():
    one_service = crowd({"b": 0.2})  # one service slow: not several
    assert explained(one_service, trace({"b": BUSY.busy_z - 1}), rule=BUSY) == [False]
    # a service slow on half its visits or more is a fault's (a delay, a pinned hog), whatever else is slow
    faulty = crowd({"a": 0.1, "c": BUSY.fault_share})
    assert explained(faulty, trace({"a": BUSY.busy_z - 1}), rule=BUSY) == [False]
    assert explained(faulty, trace({"a": BUSY.busy_z - 1}), rule=replace(BUSY, fault_share=0.6)) == [True]


def test_a_stream_with_a_faults_share_of_alarms_keeps_them_on_a_busy_machine():
    """Many recent traces above stage 1's threshold at once is a fault's mark (one that holds a
    service much of the traffic goes through), not a busy machine's: the busy case holds nothing."""
    busy, moderate = crowd({"a": 0.1, "b": 0.2}), trace({"a": BUSY.busy_z - 1})
    assert explained(busy, moderate, rule=BUSY, alarm_share=BUSY.busy_ceiling) == [True]
    assert explained(busy, moderate, rule=BUSY, alarm_share=0.5) == [False]
    assert explained(busy, moderate, rule=replace(BUSY, busy_ceiling=None), alarm_share=0.5) == [True]  # session 15's
    stalled = crowd({name: 0.9 for name in SERVICES})  # the stalled machine's case reads no alarm share
    assert explained(stalled, moderate, alarm_share=1.0) == [True]
    with pytest.raises(ValueError, match="alarm share"):
        BUSY.explained(busy, moderate, np.zeros(1, dtype=np.int64), 1)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * SECOND), st.booleans()), max_size=150),
       st.lists(st.tuples(st.integers(0, 3 * SECOND), st.booleans()), max_size=50),
       st.lists(st.integers(0, 3 * SECOND), min_size=1, max_size=5))
def test_the_alarm_share_reads_only_the_past(past, later, starts):
    """The share of the traces begun in the window before each trace that were alarms: traces
    begun at or after it (later traffic, its batch's later traces) change nothing, and judged
    together or one by one each trace gets the same share."""
    times = np.array([t for t, _ in past], dtype=np.int64)
    above = np.array([a for _, a in past], dtype=bool)
    starts_ns = np.array(starts, dtype=np.int64)
    together = RULE.alarm_share(times, above, starts_ns)
    assert ((together >= 0) & (together <= 1)).all()
    for start, share in zip(starts_ns, together):
        window = (times >= start - RULE.window_s * SECOND) & (times < start)
        assert share == (above[window].mean() if window.any() else 0.0)
        after = np.array([max(t, start) for t, _ in later], dtype=np.int64)
        more = RULE.alarm_share(np.r_[times, after], np.r_[above, [a for _, a in later]], np.array([start]))
        assert more[0] == share


@settings(max_examples=60, deadline=None)
@given(past_nodes, st.lists(st.dictionaries(st.sampled_from(SERVICES), st.floats(-5, 50), min_size=1), min_size=1, max_size=4))
def test_the_busy_case_only_adds_moderate_traces_to_the_stall(past, traces):
    """What session 11's rule explains (a stalled machine) the busy rule still explains; what it adds
    are traces whose every visit is below `busy_z`, with a crowd slow on several services."""
    history = observation(past)
    judged = [trace(z, 3 * SECOND) for z in traces]
    stall, both = explained(history, *judged), explained(history, *judged, rule=BUSY)
    _, visits, slow_visits = BUSY.crowd_counts(history, np.full(1, 3 * SECOND))
    slow = (visits >= BUSY.min_visits) & (slow_visits >= BUSY.slow_share * visits)
    for z, old, new in zip(traces, stall, both):
        assert new >= old
        if new and not old:
            assert max(z.values()) < BUSY.busy_z and slow.sum() >= BUSY.busy_services


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"slow_share": 0}, {"machine_share": 1.5}, {"min_visits": 0},
                                    {"fault_share": 0}, {"busy_z": 4.0}, {"busy_z": 12.0, "busy_services": 0},
                                    {"busy_ceiling": 1.5}, {"busy_ceiling": -0.1}])
def test_bad_parameters_are_a_clear_error(kwargs):
    with pytest.raises(ValueError):
        CrowdRule(**kwargs)


@settings(max_examples=60, deadline=None)
@given(past_nodes, past_nodes, st.lists(st.dictionaries(st.sampled_from(SERVICES), st.floats(-5, 50), min_size=1),
                                        min_size=1, max_size=4),
       st.integers(0, 3 * SECOND))
def test_a_verdict_reads_only_its_past_and_never_its_batch(past, later, traces, start_ns):
    """Adding traces begun at or after a trace's start (later traffic, its batch) changes nothing,
    and judging traces together gives each the verdict it gets alone."""
    history = observation([node for node in past if node[1] < start_ns])
    after = observation([(s, max(t, start_ns), z) for s, t, z in later])
    judged = [trace(z, start_ns) for z in traces]
    together = explained(history, *judged)
    assert together == [explained(history, one)[0] for one in judged]
    assert explained(history + after, *judged) == together


def stream(slow_everywhere: set[int], slow_one: set[int], n: int = 100, busy: set[int] = frozenset()) -> dict[str, list]:
    """`n` star traces 20 ms apart (many_traces' shape); those in `slow_everywhere` are slow on
    every leaf (a stalled machine), those in `slow_one` on svc1 only (a fault), those in `busy`
    moderately (1.5 x) on svc0 or svc2, one trace in five each (a busy machine's tail)."""
    merged: dict[str, list] = {}
    for t in range(n):
        leaf = [100 + t % 7, 200 + t % 5, 50]
        if t in slow_everywhere:
            leaf = [us * 40 for us in leaf]
        if t in slow_one:
            leaf[1] = 8000
        if t in busy and t % 5 in (0, 2):
            leaf[t % 5] = leaf[t % 5] * 3 // 2
        spans = star_trace(f"t{t:04d}", leaf)
        spans["start_ns"] = [start + t * 20_000_000 for start in spans["start_ns"]]
        for key, values in spans.items():
            merged.setdefault(key, []).extend(values)
    return merged


def always_flagging():
    """A detector whose stage 1 flags every trace: what is left unflagged, the crowd held."""
    detector = tiny_detector()
    return replace(detector, thresholds={**detector.thresholds, "graph": 0.0, "svm": 0.0})


def test_the_detector_holds_alarms_in_a_stalled_stretch_and_keeps_a_fault():
    detector = always_flagging()
    stalled = set(range(20, 40))
    table = span_table(stream(stalled, slow_one={95, 97}))  # a second after the stall
    diagnosis = detector.diagnose(table, replay=True)
    flagged = {trace.trace_id for trace in diagnosis.traces if trace.anomalous}
    held = {trace.trace_id for trace in diagnosis.traces if CROWD_WARNING in trace.warnings}
    assert held and held <= {f"t{t:04d}" for t in stalled}  # only inside the stall, once its past shows it
    assert "t0020" not in held  # the stall's first trace has no slow past
    assert {"t0095", "t0097"} <= flagged  # a slow service alone stands out
    assert held.isdisjoint(flagged) and len(flagged) + len(held) == len(diagnosis.traces)
    # without the check every trace is flagged
    assert all(trace.anomalous for trace in replace(detector, crowd=None).diagnose(table, replay=True).traces)


@pytest.mark.parametrize("batch", [1, 7, 100])
@pytest.mark.parametrize("machine", ["stalled", "busy", "busy, every trace an alarm"])
def test_a_served_stream_judges_as_a_replay(batch, machine):
    """Fed in time order, in batches of any size, the served stream gives each trace the crowd
    verdict the replay of the whole recording gives it: its past is the traces begun before
    it, whether they came in an earlier batch or in its own. The busy stream is judged by the
    busy case alone (no stall: all services would have to be slow), without the alarm share's
    gate; with it, the stream's every trace an alarm (this detector flags all) is a fault's
    share, so the busy case holds none, served (the history's alarms read) as replayed."""
    detector = always_flagging()
    if machine == "stalled":
        table = span_table(stream(set(range(10, 45)), slow_one={50}))
    else:
        gate = None if machine == "busy" else BUSY.busy_ceiling
        detector = replace(detector, crowd=replace(BUSY, machine_share=1.0, busy_ceiling=gate))
        table = span_table(stream(set(), slow_one=set(), busy=set(range(10, 100))))
    replayed = {trace.trace_id: trace.anomalous for trace in detector.diagnose(table, replay=True).traces}
    history = StreamHistory(visits=detector.encoder.history)
    served = {}
    ids = sorted(set(table["trace_id"].to_pylist()))
    for first in range(0, len(ids), batch):
        chosen = table.filter(np.isin(table["trace_id"].to_numpy(zero_copy_only=False), ids[first:first + batch]))
        served.update({trace.trace_id: trace.anomalous for trace in detector.diagnose(chosen, history=history).traces})
    assert served == replayed and all(served.values()) == (machine == "busy, every trace an alarm")


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 99), st.sets(st.integers(0, 99), max_size=30))
def test_later_traces_in_a_batch_change_no_verdict(cut, extra):
    """A batch of traces begun up to `cut` gives each of them the verdict it gets with any later
    traces added to the batch; the stream is stalled from trace 10 on, so there is a crowd."""
    detector = always_flagging()
    table = span_table(stream(set(range(10, 100)), slow_one={60}))
    number = np.array([int(key[1:]) for key in table["trace_id"].to_pylist()])
    history = StreamHistory(visits=detector.encoder.history)
    detector.diagnose(table.filter(number < 5), history=history)
    batch = table.filter((number >= 5) & (number <= cut))
    more = table.filter((number >= 5) & ((number <= cut) | np.isin(number, list(extra))))
    alone = {t.trace_id: t.anomalous for t in detector.diagnose(batch, history=history.copy()).traces}
    together = {t.trace_id: t.anomalous for t in detector.diagnose(more, history=history.copy()).traces}
    assert alone == {key: together[key] for key in alone}


def test_the_history_keeps_only_recent_nodes():
    history = StreamHistory(retain_s=2.0)
    history.record(crowd({"a": 0.5}, start_ns=0, end_ns=SECOND))
    history.record(crowd({}, start_ns=4 * SECOND, end_ns=5 * SECOND))
    assert history.recent.trace_start_ns.min() >= 4 * SECOND
    assert len(history.recent.services) == len(SERVICES) * 20


def test_the_history_keeps_only_recent_alarms():
    history = StreamHistory(retain_s=2.0)
    history.record_alarms(np.arange(10, dtype=np.int64) * SECOND // 10, np.ones(10, dtype=bool))
    history.record_alarms(4 * SECOND + np.arange(10, dtype=np.int64) * SECOND // 10, np.arange(10) < 3)
    starts, above = history.alarms_between(-10 * SECOND, 10 * SECOND)
    assert (starts >= 4 * SECOND).all() and above.tolist() == [True] * 3 + [False] * 7
    assert len(history.alarms_between(4 * SECOND, 4 * SECOND + 1)[0]) == 1


def test_a_trace_stamped_far_off_does_not_empty_the_history_for_good():
    history = StreamHistory(retain_s=2.0)
    history.record(crowd({}, start_ns=0, end_ns=SECOND))
    history.record(trace({"a": 1.0}, start_ns=10**18))  # a wrong clock: its own batch
    history.record(crowd({}, start_ns=SECOND, end_ns=2 * SECOND))
    assert history.recent.trace_start_ns.max() < 2 * SECOND  # the far-off trace is gone
    # a batch of normal traces with one far-off trace keeps the stream's recent past
    history.record(crowd({}, start_ns=2 * SECOND, end_ns=3 * SECOND) + trace({"a": 1.0}, start_ns=10**18))
    kept = history.recent.trace_start_ns
    assert kept.min() < 2 * SECOND and kept.max() < 3 * SECOND


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.tuples(st.sampled_from(SERVICES), st.integers(0, 30 * SECOND),
                                           st.floats(-3, 30)), min_size=1, max_size=20), min_size=1, max_size=80),
       window=st.tuples(st.integers(-SECOND, 31 * SECOND), st.integers(0, 5 * SECOND)))
def test_the_history_keeps_the_nodes_the_whole_window_rule_kept_and_reads_any_span_of_them(batches, window):
    """The history keeps each batch apart (recording no longer joins every batch to the whole
    retained window): the nodes kept, in order, are those of joining and trimming the whole
    window at each batch, and `between` is those of them begun in the span asked for."""
    history, reference = StreamHistory(retain_s=3.0), Observation.empty()
    for nodes in batches:
        services, starts, z = zip(*nodes)
        batch = Observation(np.array(services, dtype=object), np.array(starts, dtype=np.int64), np.array(z))
        history.record(batch)
        joined = reference + batch
        now = int(np.median(batch.trace_start_ns))
        reference = joined.where(np.abs(joined.trace_start_ns - now) <= 3 * SECOND)
        kept = history.recent
        assert kept.services.tolist() == reference.services.tolist()
        assert kept.trace_start_ns.tolist() == reference.trace_start_ns.tolist()
        assert kept.z_self.tolist() == reference.z_self.tolist()
    lower, upper = window[0], window[0] + window[1]
    inside = (reference.trace_start_ns >= lower) & (reference.trace_start_ns < upper)
    read = history.between(lower, upper)
    assert read.trace_start_ns.tolist() == reference.trace_start_ns[inside].tolist()
    assert read.services.tolist() == reference.services[inside].tolist()


def test_a_history_of_many_small_batches_keeps_every_node_in_order():
    """Past 64 batches kept apart they are joined into one: nothing is lost or reordered."""
    history = StreamHistory(retain_s=100.0)
    for i in range(150):
        history.record(trace({"a": float(i)}, start_ns=i * SECOND // 10))
    assert history.recent.z_self.tolist() == [float(i) for i in range(150)]
    assert history.between(SECOND, 2 * SECOND).z_self.tolist() == [float(i) for i in range(10, 20)]


@settings(max_examples=80, deadline=None)
@given(batches=st.lists(st.lists(st.tuples(st.sampled_from(SERVICES), st.integers(0, 8 * SECOND),
                                           st.sampled_from([0.0, 4.9, 5.0, 30.0, float("nan")])),
                                 min_size=0, max_size=25), min_size=1, max_size=12),
       window_s=st.sampled_from([0.5, 1.0, 2.5]), keep=st.sampled_from(SERVICES[:4]))
def test_the_crowd_counted_from_the_kept_batches_is_its_definition(batches, window_s, keep):
    """The crowd a batch's traces read from the history's batches (each sorted by service once,
    searched where the windows overlap) and from the batch itself counts, per trace and service,
    exactly the visits and slow visits of its definition: every node the stream has kept or
    brought whose trace began in [start - window_s, start), counted one by one."""
    rule, history, kept = CrowdRule(window_s=window_s), StreamHistory(retain_s=3.0), Observation.empty()
    for nodes in batches:
        services, starts, z = zip(*nodes) if nodes else ((), (), ())
        # as the detector hands it over: numbered with every service of the batch, some left out
        batch = Observation(np.array(services, dtype=object), np.array(starts, dtype=np.int64),
                            np.array(z, dtype=np.float64)).of([name for name in SERVICES if name != keep])
        if len(batch.services):
            judged = np.unique(batch.trace_start_ns)
            past = [*history.overlapping(*rule.reads(judged)), batch]
            names, visits, slow = rule.crowd_counts(past, judged)
            everything = kept + batch
            for t, start in enumerate(judged):
                inside = (everything.trace_start_ns >= start - int(window_s * SECOND)) & (everything.trace_start_ns < start)
                for name in SERVICES:
                    mine = inside & (everything.services == name)
                    slow_ones = int(np.sum(mine & (everything.z_self >= rule.slow_z)))
                    count = (visits[t, names.index(name)], slow[t, names.index(name)]) if name in names else (0, 0)
                    assert count == (int(mine.sum()), slow_ones)
        history.record(batch)
        kept = history.recent
