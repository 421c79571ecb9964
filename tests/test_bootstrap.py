"""`bmeg.evaluation.bootstrap`: normal traces -> twin -> trained, calibrated model on disk."""

import json

import pyarrow.compute as pc
import pytest

import bmeg
from bmeg.datasets.loader import load_dataset
from bmeg.evaluation.bootstrap import bootstrap
from bmeg.evaluation.rankers import window_ranking
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.paths import NORMAL_TRACES_FILE
from bmeg.traces.io import read_spans, write_spans


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
        detector, metrics = bootstrap(root / "normal.parquet", root / "run", traces=400, epochs=1, progress=False)
    return recorded, root / "normal.parquet", root / "run", detector, metrics


def test_bootstrap_writes_a_calibrated_model_that_loads(bootstrapped):
    _, _, run_dir, detector, metrics = bootstrapped
    calibration = metrics["calibration"]
    assert detector.metrics["calibration"] == calibration  # the returned model carries it, as the saved one does
    assert json.loads((run_dir / "metrics.json").read_text())["calibration"] == calibration
    loaded = Detector.load(run_dir, device="cpu")
    assert loaded.metrics["calibration"] == calibration and loaded.thresholds == detector.thresholds


def test_a_bootstrapped_model_ranks_a_window_against_the_normal_traces_it_kept(bootstrapped):
    """`bmeg diagnose --window` on a bootstrapped model compares the window with the normal
    traces the twin came from (kept in the run directory), as `bmeg evaluate rca` does."""
    recorded, normal_file, run_dir, _, _ = bootstrapped
    kept = read_spans(run_dir / NORMAL_TRACES_FILE, format="parquet")
    assert 0 < kept.num_rows < read_spans(normal_file).num_rows  # the part the twin was fitted from

    diagnosis = bmeg.diagnose(recorded.spans, model=run_dir, window=True)
    expected = window_ranking(Detector.load(run_dir), rpc_view(recorded.spans), rpc_view(kept))
    assert diagnosis.ranking == expected and diagnosis.ranking[0].bottleneck
