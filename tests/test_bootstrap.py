"""`bmeg.evaluation.bootstrap`: normal traces -> twin -> trained, calibrated model on disk."""

import json
from dataclasses import replace
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import click
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

import bmeg
from bmeg.datasets.loader import load_dataset
from bmeg.datasets.family import CPU_FAULT_SCENARIOS, DEFAULT_CPU_FAULTS
from bmeg.evaluation.bootstrap import bootstrap, cached_run_dir
from bmeg.cli import main
from bmeg.evaluation.rankers import default_rankers
from bmeg.models.features import BOOTSTRAP_FEATURES
from bmeg.faultinject import load_topology
from bmeg.faultinject.twin import simulated_spans
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.models.normal import NormalStats
from bmeg.models.router import Router
from bmeg.models.window import WindowDetector, WindowRanker, window_gcn_of
from bmeg.models.window_gcn import WINDOW_GCN_FILE
from bmeg.paths import NORMAL_TRACES_FILE
from bmeg.training.config import TRAINING_WINDOWS
from bmeg.serving.app import create_app
from bmeg.serving.model_process import ModelProcess
from bmeg.traces import to_otlp_proto_bytes
from bmeg.traces.io import read_spans, write_spans
from serving_fixtures import KEY_HEADER, keyed_settings


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory):
    """(recorded traces, their normal traces' file, the run bootstrapped from them, its metrics)."""
    root = tmp_path_factory.mktemp("bootstrap")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BMEG_CACHE", str(root / "cache"))
        recorded = load_dataset("hotelreservation", traces=400, imbalance=0.3, seed=3, progress=False)
        normal = recorded.traces.filter(pc.invert(recorded.traces["anomalous"]))["trace_id"]
        write_spans(recorded.spans.filter(pc.is_in(recorded.spans["trace_id"], value_set=normal)),
                    root / "normal.parquet", "parquet")
        # 3 epochs: a 1-epoch model of `relative-siblings` ranked the profile service's store above it
        # in the recent-traffic test below (1 was enough with `relative`)
        # the window GCN as the product trains it: on 64 windows it ranked the search service above
        # the slowed profile service in the recent-traffic test below (200: second, the fusion's first)
        detector, metrics = bootstrap(root / "normal.parquet", root / "run", traces=400, epochs=3, progress=False)
    return recorded, root / "normal.parquet", root / "run", detector, metrics


def test_bootstrap_writes_a_calibrated_model_that_loads(bootstrapped):
    _, _, run_dir, detector, metrics = bootstrapped
    calibration = metrics["calibration"]
    assert detector.metrics["calibration"] == calibration  # the returned model carries it, as the saved one does
    assert json.loads((run_dir / "metrics.json").read_text())["calibration"] == calibration
    loaded = Detector.load(run_dir, device="cpu")
    assert loaded.metrics["calibration"] == calibration and loaded.thresholds == detector.thresholds
    assert loaded.encoder.variant == BOOTSTRAP_FEATURES == "relative-siblings"  # the default since session 13
    # the window GCN bmeg's window ranker fuses (issue 12, session 20), trained on the twin's windows
    assert (run_dir / WINDOW_GCN_FILE).is_file() and window_gcn_of(loaded) is not None
    assert 0 < metrics["window_gcn"]["windows"] <= TRAINING_WINDOWS and 0.0 <= metrics["window_gcn"]["train_top1"] <= 1.0


def test_a_bootstrapped_model_ranks_a_window_against_the_normal_traces_it_kept(bootstrapped):
    """`bmeg diagnose --window` on a bootstrapped model compares the window with the normal
    traces the twin came from (kept in the run directory) with the ranker `bmeg evaluate rca`
    measures as `bmeg`."""
    recorded, normal_file, run_dir, _, _ = bootstrapped
    kept = read_spans(run_dir / NORMAL_TRACES_FILE, format="parquet")
    assert 0 < kept.num_rows < read_spans(normal_file).num_rows  # the part the twin was fitted from

    diagnosis = bmeg.diagnose(recorded.spans, model=run_dir, window=True)
    ranker = WindowRanker(Detector.load(run_dir), kept)
    assert ranker.window_gcn is not None  # its fusion reads the run's window GCN
    expected, health = ranker.ranking(recorded.spans)
    assert diagnosis.ranking == expected and diagnosis.ranking[0].bottleneck
    # 200-odd kept traces are too few to calibrate "nothing changed": ranked as before, no answer
    assert health is None and diagnosis.window_health is None
    assert diagnosis.window_method == "normal-period"
    # the harness's `bmeg` row ranks the same window the same way
    harness = default_rankers(Detector.load(run_dir), rpc_view(kept), published=False)[0]
    measured = harness.rank(rpc_view(recorded.spans), NormalStats.from_forest(rpc_view(kept)))
    assert harness.name == "bmeg" and [service for service, _ in measured] == [s.service for s in expected]


def test_a_windows_gnn_ranking_is_the_gnns_whatever_the_router_sends_to_the_svm(bootstrapped):
    """The window rankers read the GNN's node score of every trace: a router that sends every
    trace to the SVM ranks a window as one that sends none, in the harness (`bmeg`, `bmeg-gnn`)
    and in the product's `diagnose(window=True)` (a bootstrap whose router took the SVM for the
    small graphs once left the GNN's window score reading 4% of the traces)."""
    recorded, _, run_dir, _, _ = bootstrapped
    kept = read_spans(run_dir / NORMAL_TRACES_FILE, format="parquet")
    normal, window = rpc_view(kept), rpc_view(recorded.spans)
    detector = Detector.load(run_dir, device="cpu")
    rankings = {}
    for name, router in (("gnn", Router()), ("svm", Router.everything())):
        routed = replace(detector, router=router)
        harness = default_rankers(routed, normal, published=False)[:2]
        rankings[name] = {ranker.name: [s for s, _ in ranker.rank(window, NormalStats.from_forest(normal))]
                          for ranker in harness}
        diagnosis = routed.diagnose(recorded.spans, window=True, replay=True, ranker=WindowRanker(routed, kept))
        rankings[name]["diagnose"] = [entry.service for entry in diagnosis.ranking]
        rankings[name]["routed to the svm"] = bool(all(t.model == "svm" for t in diagnosis.traces))
    assert list(rankings["gnn"]) == ["bmeg", "bmeg-gnn", "diagnose", "routed to the svm"]
    assert rankings["svm"].pop("routed to the svm") and not rankings["gnn"].pop("routed to the svm")
    assert rankings["svm"] == rankings["gnn"]


@pytest.fixture(scope="module")
def long_normal(bootstrapped):
    """4 s of the application's fault-free traffic (~4,000 traces: enough to hold back windows
    of 256) and 2 s more, later, from another seed."""
    spec = load_topology("hotelreservation")
    return simulated_spans(spec, 4.0, seed=11), simulated_spans(spec, 2.0, seed=12, epoch_ns=10 * 10**9)


def test_a_healthy_window_names_no_bottleneck_and_a_faulty_one_is_ranked_as_before(bootstrapped, long_normal):
    """Fault-free traffic the ranker never saw changes nothing: the window is healthy and no
    service is its bottleneck. The recording's anomalous traces are ranked as without the
    answer: the same order, the first the bottleneck."""
    recorded, _, run_dir, _, _ = bootstrapped
    normal, later = long_normal
    ranker = WindowRanker(Detector.load(run_dir, device="cpu"), normal)

    ranking, health = ranker.ranking(later)
    assert health is not None and health.healthy and ranking and not any(entry.bottleneck for entry in ranking)
    assert health.time_shift <= health.time_bound and health.calibration_windows > 1

    anomalous = recorded.traces.filter(recorded.traces["anomalous"])["trace_id"]
    faulty = recorded.spans.filter(pc.is_in(recorded.spans["trace_id"], value_set=anomalous))
    ranking, health = ranker.ranking(faulty)
    assert health is not None and not health.healthy
    assert [entry.service for entry in ranking] == [service for service, _ in ranker.rank(rpc_view(faulty))]
    assert ranking[0].bottleneck and not any(entry.bottleneck for entry in ranking[1:])


def test_the_mitigation_loops_detector_uses_the_runs_normal_traces_when_it_keeps_them(bootstrapped, long_normal,
                                                                                      tmp_path):
    """`bmeg mitigate --model RUN` diagnoses a window with `WindowDetector`: a run that keeps
    normal traces names no bottleneck in a healthy window (the controller has nothing to act
    on); a run without them ranks by the mean node score; each says which."""
    _, _, run_dir, _, _ = bootstrapped
    normal, later = long_normal
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns(NORMAL_TRACES_FILE, "data"))
    fallback = WindowDetector(Detector.load(run, device="cpu"))
    diagnosis = fallback.diagnose(later, window=True)
    assert fallback.window_method == diagnosis.window_method == "mean-node-score" and diagnosis.window_health is None

    write_spans(normal, run / NORMAL_TRACES_FILE, "parquet")
    detector = WindowDetector(Detector.load(run, device="cpu"))
    diagnosis = detector.diagnose(later, window=True)
    assert detector.window_method == diagnosis.window_method == "normal-period"
    assert diagnosis.window_health is not None and diagnosis.window_health.healthy
    assert diagnosis.ranking and not any(entry.bottleneck for entry in diagnosis.ranking)


def test_a_bootstrapped_runs_window_is_scored_once(bootstrapped, monkeypatch):
    """The traces' own scores serve the window's ranking: its baselines are the kept period's."""
    recorded, _, run_dir, _, _ = bootstrapped
    scored = []
    original = Detector.score
    monkeypatch.setattr(Detector, "score", lambda self, forest, *a, **k: scored.append(forest.num_traces)
                        or original(self, forest, *a, **k))
    bmeg.diagnose(recorded.spans, model=run_dir, window=True)
    kept = rpc_view(read_spans(run_dir / NORMAL_TRACES_FILE, format="parquet")).num_traces
    window = rpc_view(recorded.spans).num_traces
    assert sorted(scored) == sorted([kept, window])  # the normal period once, the window once


def test_the_rest_window_ranking_is_the_commands(bootstrapped, tmp_path):
    """`POST /diagnose?window=true` ranks a window as `bmeg diagnose --window` does on the same
    traces and run: against the run's normal traces, read once when the model loads."""
    recorded, _, run_dir, _, _ = bootstrapped
    window = recorded.spans.filter(pc.is_in(recorded.spans["trace_id"],
                                            value_set=recorded.traces["trace_id"].slice(0, 150)))
    body = to_otlp_proto_bytes(window)
    (tmp_path / "window.pb").write_bytes(body)
    command = CliRunner().invoke(main, ["diagnose", str(tmp_path / "window.pb"), "--model", str(run_dir),
                                        "--window", "--json"])
    assert command.exit_code == 0, command.output
    expected = json.loads(command.output)

    with TestClient(create_app(Detector.load(run_dir, device="cpu"), keyed_settings()), headers=KEY_HEADER) as client:
        ranker = client.app.state.slot.model.window_ranker
        answers = [client.post("/diagnose?window=true", content=body,
                               headers={"content-type": "application/x-protobuf"}) for _ in range(2)]
        assert client.app.state.slot.model.window_ranker is ranker  # built at load, not per request
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["window_method"] == expected["window_method"] == "normal-period"
        assert answer.json()["ranking"] == expected["ranking"]


def test_without_normal_traces_the_window_is_ranked_by_the_mean_node_score_and_says_so(bootstrapped, tmp_path):
    """A run that keeps no normal traces (as `bmeg train` writes one) falls back, and says so."""
    recorded, _, run_dir, _, _ = bootstrapped
    bare = tmp_path / "run"
    shutil.copytree(run_dir, bare, ignore=shutil.ignore_patterns(NORMAL_TRACES_FILE, "data"))
    write_spans(recorded.spans, tmp_path / "window.parquet", "parquet")

    diagnosis = bmeg.diagnose(recorded.spans, model=bare, window=True)
    assert diagnosis.window_method == "mean-node-score" and diagnosis.ranking
    command = CliRunner().invoke(main, ["diagnose", str(tmp_path / "window.parquet"), "--model", str(bare), "--window"])
    assert command.exit_code == 0, command.output
    assert "by the mean node score: no normal traces" in " ".join(command.output.split())


@pytest.mark.integration  # spawns a torch process: seconds
def test_the_model_process_ranks_a_window_against_the_runs_normal_traces(bootstrapped):
    """`bmeg serve --model-process`: the child reads the run's normal traces when it loads and
    ranks a window as `bmeg.diagnose` does."""
    recorded, _, run_dir, _, _ = bootstrapped
    child = ModelProcess(run_dir, device="cpu")
    try:
        ranked = child.diagnose(recorded.spans, window=True)
    finally:
        child.close()
    expected = bmeg.diagnose(recorded.spans, model=run_dir, window=True)
    assert ranked.window_method == "normal-period" and ranked.ranking == expected.ranking


def test_the_cached_run_follows_the_normal_traces_not_only_their_path(tmp_path):
    # A testbed dataset regenerated at the same path got the old dataset's cached model.
    normal = tmp_path / "normal.parquet"
    normal.write_bytes(b"first dataset")
    first = cached_run_dir(normal)
    assert cached_run_dir(normal) == first
    normal.write_bytes(b"the regenerated dataset")
    assert cached_run_dir(normal) != first
    folder = tmp_path / "normal"
    folder.mkdir()
    (folder / "a.csv").write_text("1")
    before = cached_run_dir(folder)
    (folder / "b.csv").write_text("2")
    assert cached_run_dir(folder) != before


def test_the_cached_run_follows_every_option_that_changes_it(tmp_path, monkeypatch):
    # A cached fluid-trained run would have been reused for the scheduler's CPU faults, and a
    # run trained on an older simulator's data after the simulator changed.
    from bmeg.faultinject import simulator

    normal = tmp_path / "normal.parquet"
    normal.write_bytes(b"traces")
    first = cached_run_dir(normal)
    assert cached_run_dir(normal, None, DEFAULT_CPU_FAULTS) == first
    others = {cached_run_dir(normal, None, model) for model in CPU_FAULT_SCENARIOS if model != DEFAULT_CPU_FAULTS}
    assert others and first not in others
    assert cached_run_dir(normal, "csv") != first
    monkeypatch.setattr(simulator, "SIMULATOR_VERSION", simulator.SIMULATOR_VERSION + 1)
    assert cached_run_dir(normal) != first


def test_the_cached_run_follows_the_bootstraps_default_features(tmp_path, monkeypatch):
    # a run cached while `relative` was the default must not be reused for the new default
    normal = tmp_path / "normal.parquet"
    normal.write_bytes(b"traces")
    first = cached_run_dir(normal)
    former = tuple("relative" if value == BOOTSTRAP_FEATURES else value for value in bootstrap.__defaults__)
    assert former != bootstrap.__defaults__
    monkeypatch.setattr(bootstrap, "__defaults__", former)
    assert cached_run_dir(normal) != first


def test_the_cached_run_follows_the_training_campaigns(tmp_path, monkeypatch):
    # a run trained on a campaign's former fault draws must not outlive an edit to the campaign
    from bmeg.faultinject import scenario

    normal = tmp_path / "normal.parquet"
    normal.write_bytes(b"traces")
    first = cached_run_dir(normal)
    edited = tmp_path / "edited.yaml"
    name = CPU_FAULT_SCENARIOS[DEFAULT_CPU_FAULTS][0]
    edited.write_text(scenario.scenario_path(name).read_text() + "# edited\n")
    real = scenario.scenario_path
    monkeypatch.setattr(scenario, "scenario_path", lambda given: edited if given == name else real(given))
    assert cached_run_dir(normal) != first


def test_the_server_ranks_a_window_against_the_traffic_just_before_it(bootstrapped, tmp_path):
    """The stream's own recent traffic replaces the kept normal period where it holds enough
    traces: the geo service slowed (no fault: a change that came before) from the start, the
    profile service only from the window on. Against the kept normal period the drift is a
    change too; against the traffic before the window only the profile service changed."""
    from datetime import UTC, datetime

    from bmeg.faultinject import Fault, simulate, spans_of
    from bmeg.models.history import StreamedDetector
    from bmeg.models.window import MIN_RECENT_TRACES, latest_before

    _, _, run_dir, _, _ = bootstrapped
    topology = load_topology("hotelreservation")
    topology = topology.model_copy(update={"workload": topology.workload.model_copy(update={"rate": 60})})
    drift = Fault("geo", "interference", "single", 0.0, 16.0, {"factor": 5.0})
    fault = Fault("profile", "interference", "single", 8.0, 16.0, {"factor": 5.0})
    spans = spans_of(simulate(topology, [drift, fault], 16, 5), 1_700_000_000 * 10**9)
    start = pc.min(spans["start_ns"]).as_py() + 8 * 10**9
    first = spans.group_by("trace_id").aggregate([("start_ns", "min")])
    window_ids = first.filter(pc.greater_equal(first["start_ns_min"], start))["trace_id"]
    window = spans.filter(pc.is_in(spans["trace_id"], window_ids))
    before = spans.filter(pc.invert(pc.is_in(spans["trace_id"], window_ids)))

    streamed = StreamedDetector(Detector.load(run_dir, device="cpu"))
    alone = streamed.diagnose(window, window=True)  # nothing served yet: the kept normal period
    assert alone.window_method == "normal-period"
    for part in range(0, before.num_rows, 500):  # served as they came, in batches
        streamed.diagnose(before.slice(part, 500))
    recent = streamed.diagnose(window, window=True)
    assert recent.window_method == "recent-traffic"
    assert rpc_view(latest_before(before, start)).num_traces >= MIN_RECENT_TRACES
    expected, _ = streamed.window_ranker.against(latest_before(before, start)).ranking(window)
    assert recent.ranking == expected  # the rule `bmeg evaluate rca --recent-traces` measures
    assert recent.ranking[0].service == "profile"
    # against the kept normal period the drift is a change too (first or second: which of the two
    # changes leads there depends on the model the bootstrap drew); against recent traffic it sinks
    alone_order, recent_order = ([row.service for row in diagnosis.ranking] for diagnosis in (alone, recent))
    assert alone_order.index("geo") < 2 and alone_order.index("geo") < recent_order.index("geo")

    # a recording of the same stream, its window named by time: ranked as the server ranked it
    recorded = bmeg.diagnose(spans, model=run_dir, since_ns=start)
    assert recorded.window_method == "recent-traffic" and recorded.ranking == recent.ranking
    assert {trace.trace_id for trace in recorded.traces} == set(window_ids.to_pylist())
    write_spans(spans, tmp_path / "stream.parquet", "parquet")
    since = datetime.fromtimestamp(start / 1e9, UTC).isoformat()
    command = CliRunner().invoke(main, ["diagnose", str(tmp_path / "stream.parquet"), "--model", str(run_dir),
                                        "--since", since, "--json"])
    assert command.exit_code == 0, command.output
    assert json.loads(command.output)["ranking"][0]["service"] == "profile"
    bad = CliRunner().invoke(main, ["diagnose", str(tmp_path / "stream.parquet"), "--model", str(run_dir), "--since", "noon"])
    assert bad.exit_code != 0 and "neither Unix seconds nor an ISO 8601 time" in bad.output


def test_recent_traffic_keeps_the_latest_traces_within_its_bytes():
    from bmeg.models.window import RecentTraffic, latest_before

    spans = load_dataset("hotelreservation", traces=60, imbalance=0.0, seed=4, progress=False).spans
    first = spans.group_by("trace_id").aggregate([("start_ns", "min")]).sort_by("start_ns_min")
    ids, starts = first["trace_id"].to_pylist(), first["start_ns_min"].to_pylist()
    chosen = latest_before(spans, starts[40], traces=10)
    assert set(chosen["trace_id"].to_pylist()) == set(ids[30:40])
    assert latest_before(spans, starts[40], traces=10, max_age_s=(starts[40] - starts[35]) / 1e9).column(
        "trace_id").unique().to_pylist() == ids[35:40]
    traffic = RecentTraffic(max_bytes=spans.nbytes * 2)
    for part in range(3):  # the oldest copy is let go: twice the bytes fit
        traffic.record(spans)
    window = spans.filter(pc.is_in(spans["trace_id"], pa.array(ids[40:])))
    kept = traffic.before(window)
    assert set(kept["trace_id"].to_pylist()) == set(ids[:40])  # none of the window's own, none after
    assert traffic._bytes <= traffic.max_bytes
    assert RecentTraffic().before(window).num_rows == 0


def test_since_reads_unix_seconds_and_iso_times_to_the_nanosecond():
    from bmeg.cli.models import _time_ns

    assert _time_ns("1700000000.123456789") == 1_700_000_000_123_456_789
    assert _time_ns("2023-11-14T22:13:20Z") == _time_ns("2023-11-15T00:13:20+02:00") == 1_700_000_000 * 10**9
    assert _time_ns("2023-11-14T22:13:20.5") == 1_700_000_000_500_000_000  # no zone: UTC
    for hostile in ("nan", "inf", "1e400", "-5", "9999-01-01", "noon", ""):
        with pytest.raises(click.BadParameter):
            _time_ns(hostile)


def test_a_bagged_bootstrap_adds_node_classifiers_from_further_draws_and_leaves_stage_1(bootstrapped, tmp_path):
    """`node_draws` 2: the node stage is the first run's classifier (the same weights as without
    bagging) and one more trained on a further draw of the twin's faults; stage 1 and its
    calibration are the unbagged run's. A bagged run is refused as a warm start (its members
    are not one classifier to go on from)."""
    import torch

    from bmeg.models.features import FeatureEncoder
    from bmeg.models.gcn_node import GCNNodeEnsemble
    from bmeg.training.pipeline import pretrained_stages

    _, normal_file, _, _, _ = bootstrapped
    runs = {}
    for draws in (1, 2):
        runs[draws], metrics = bootstrap(normal_file, tmp_path / f"draws-{draws}", traces=400, epochs=2, progress=False,
                                         window_gcn_windows=0, node_draws=draws)
        assert metrics.get("node_draws", 1) == draws
    single, bagged = runs[1], Detector.load(tmp_path / "draws-2", device="cpu")
    assert isinstance(bagged.gcn, GCNNodeEnsemble) and len(bagged.gcn.members) == 2
    assert (tmp_path / "draws-2" / "draws" / "1").is_dir()
    for name, tensor in single.gcn.state_dict().items():
        assert torch.equal(tensor.cpu(), bagged.gcn.members[0].state_dict()[name])
    assert any(not torch.equal(a, b) for a, b in zip(bagged.gcn.members[0].state_dict().values(),
                                                     bagged.gcn.members[1].state_dict().values()))
    assert bagged.thresholds == single.thresholds
    assert bagged.metrics["calibration"] == single.metrics["calibration"]
    with pytest.raises(ValueError, match="2 node classifiers"):
        pretrained_stages(tmp_path / "draws-2", FeatureEncoder(BOOTSTRAP_FEATURES))
    with pytest.raises(ValueError, match="node_draws"):
        bootstrap(normal_file, tmp_path / "none", node_draws=0)


def test_a_bootstrap_whose_node_classifier_reads_asinh_keeps_it_and_older_runs_read_raw(bootstrapped, tmp_path):
    """`node_inputs="asinh"`: the saved run's node classifier reads asinh of its features after
    loading; a run saved before the choice (no `inputs` in its hyperparameters) reads them raw;
    a warm start from a run that reads them otherwise, an unknown choice and the command line's
    unknown choice are refused."""
    import torch

    from bmeg.models.checkpoint import CheckpointError
    from bmeg.models.features import FeatureEncoder
    from bmeg.training.pipeline import pretrained_stages

    _, normal_file, _, _, _ = bootstrapped
    bootstrap(normal_file, tmp_path / "asinh", traces=400, epochs=1, progress=False, window_gcn_windows=0,
              node_inputs="asinh")
    loaded = Detector.load(tmp_path / "asinh", device="cpu")
    assert loaded.gcn.inputs == "asinh" and loaded.hparams["gcn"]["inputs"] == "asinh"
    older = replace(loaded, hparams={**loaded.hparams, "gcn": {}}).save(tmp_path / "older")
    assert Detector.load(older.run_dir, device="cpu").gcn.inputs == "raw"
    for hostile in ("log", ["asinh"], {"inputs": "asinh"}, "x" * 100_000):
        forged = replace(loaded, hparams={**loaded.hparams, "gcn": {"inputs": hostile}}).save(tmp_path / "forged")
        with pytest.raises(CheckpointError, match="inputs must be one of"):
            Detector.load(forged.run_dir, device="cpu")
    x = torch.randn(5, loaded.encoder.num_features) * 30
    edges = torch.tensor([[0, 0, 1, 1], [1, 2, 3, 4]])
    raw = Detector.load(older.run_dir, device="cpu").gcn
    assert torch.allclose(loaded.gcn(x, edges), raw(torch.asinh(x), edges), atol=1e-5)
    with pytest.raises(ValueError, match="reads its features asinh, not raw"):
        pretrained_stages(tmp_path / "asinh", FeatureEncoder(BOOTSTRAP_FEATURES))
    with pytest.raises(ValueError, match="node_inputs"):
        bootstrap(normal_file, tmp_path / "none", node_inputs="log")
    command = CliRunner().invoke(main, ["bootstrap", str(normal_file), "--out", str(tmp_path / "cli"), "--node-inputs", "log"])
    assert command.exit_code == 2 and "'log' is not one of 'raw', 'asinh'" in command.output
