"""`bmeg.evaluation.bootstrap`: normal traces -> twin -> trained, calibrated model on disk."""

import json

import pyarrow.compute as pc

from bmeg.datasets.loader import load_dataset
from bmeg.evaluation.bootstrap import bootstrap
from bmeg.models.detector import Detector
from bmeg.traces.io import write_spans


def test_bootstrap_writes_a_calibrated_model_that_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path / "cache"))
    recorded = load_dataset("hotelreservation", traces=400, imbalance=0.0, seed=3, progress=False)
    normal = recorded.traces.filter(pc.invert(recorded.traces["anomalous"]))["trace_id"]
    write_spans(recorded.spans.filter(pc.is_in(recorded.spans["trace_id"], value_set=normal)),
                tmp_path / "normal.parquet", "parquet")

    detector, metrics = bootstrap(tmp_path / "normal.parquet", tmp_path / "run", traces=400, epochs=1, progress=False)

    calibration = metrics["calibration"]
    assert detector.metrics["calibration"] == calibration  # the returned model carries it, as the saved one does
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["calibration"] == calibration
    loaded = Detector.load(tmp_path / "run", device="cpu")
    assert loaded.metrics["calibration"] == calibration and loaded.thresholds == detector.thresholds
