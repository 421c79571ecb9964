"""Training to a stated minimum on small generated data, the saved run, and the CLI (integration)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest_infra import free_port

from bmeg.cli import main
from bmeg.datasets import generate_dataset
from bmeg.datasets.loader import load_dataset
from bmeg.models.detector import Detector
from bmeg.traces.io import write_spans
from bmeg.training import train

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]

#: What a small run (3,000 traces, 8 epochs) must reach on its held-out 20% (55 bottlenecked traces).
MIN_BR, MIN_BP = 0.6, 0.6


def test_small_run_reaches_the_stated_minimum(trained_run):
    metrics = json.loads((trained_run / "metrics.json").read_text())
    assert metrics["bmeg"]["br"] >= MIN_BR
    assert metrics["bmeg"]["bp"] >= MIN_BP
    assert metrics["bmeg"]["ac3"] >= 0.7
    for name in ("training_curves.png", "confusion_matrices.png", "precision_recall.png"):
        assert (trained_run / name).stat().st_size > 1000


def test_saved_run_diagnoses_fresh_faulty_traces(trained_run, tmp_path, monkeypatch):
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path))
    fresh = load_dataset("socialnet", traces=1000, imbalance=0.3, seed=99, progress=False)  # ~230 faulty: recall to +-0.06
    detector = Detector.load(trained_run)
    diagnosis = detector.diagnose(fresh.spans, window=True, replay=True)  # a recorded stream
    truth = dict(zip(fresh.traces["trace_id"].to_pylist(), fresh.traces["anomalous"].to_pylist()))
    flagged = np.array([trace.anomalous for trace in diagnosis.traces])
    actual = np.array([truth[trace.trace_id] for trace in diagnosis.traces])
    assert (flagged & actual).sum() / actual.sum() >= 0.5  # recall on fresh traces
    assert diagnosis.ranking and diagnosis.ranking[0].score >= diagnosis.ranking[-1].score
    trace = diagnosis.traces[0]
    assert trace.critical_path and trace.latencies and trace.model in ("gnn", "svm")


def test_diagnose_cli_prints_json(trained_run, tmp_path, monkeypatch):
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path))
    fresh = load_dataset("socialnet", traces=50, imbalance=0.3, seed=7, progress=False)
    write_spans(fresh.spans, tmp_path / "traces.json", "otlp-json")
    result = CliRunner().invoke(main, ["diagnose", str(tmp_path / "traces.json"), "--model", str(trained_run), "--window", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output[result.output.index("{"):])
    assert len(payload["traces"]) == 50 and payload["ranking"]


def test_diagnose_cli_rejects_a_stale_model(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"\x00garbage")
    (tmp_path / "t.json").write_text('{"resourceSpans": []}')
    result = CliRunner().invoke(main, ["diagnose", str(tmp_path / "t.json"), "--model", str(tmp_path)])
    assert result.exit_code != 0 and "not a bmeg checkpoint" in result.output


def test_two_processes_train_as_well_as_one(tmp_path, monkeypatch):
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path))
    options = dict(traces=2000, imbalance=0.2, epochs=4, seed=5, progress=False)
    _, one = train("socialnet", nproc=1, **options)
    _, two = train("socialnet", nproc=2, **options)
    assert two["bmeg"]["br"] >= one["bmeg"]["br"] - 0.15
    assert two["bmeg"]["accuracy"] >= one["bmeg"]["accuracy"] - 0.05


def test_torchrun_two_nodes_train_as_well_as_one_process(tmp_path, monkeypatch):
    """`torchrun --nnodes 2 --nproc-per-node 1` twice on this machine, as two nodes would start
    it (c10d rendezvous on loopback): DDP across the two, rank 0 alone writes its run."""
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    generate_dataset(data, "socialnet", 2000, 0.2, seed=5, progress=False)
    _, one = train(str(data), epochs=4, seed=5, progress=False)

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BMEG_CACHE": str(tmp_path / "cache")}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bmeg-{port}",
             "-m", "bmeg", "train", "--dataset", str(data), "--epochs", "4", "--seed", "5",
             "--out", str(tmp_path / f"run-{node}"), "--json"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in range(2)
    ]
    outputs = [node.communicate(timeout=900) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    written = [tmp_path / f"run-{node}" for node in range(2) if (tmp_path / f"run-{node}").exists()]
    printed = [stdout for stdout, _ in outputs if stdout.strip()]
    assert len(written) == 1 and len(printed) == 1  # rank 0 alone writes and prints
    two = json.loads(printed[0])
    assert json.loads((written[0] / "metrics.json").read_text())["bmeg"] == two["bmeg"]
    assert two["history"]["dgcnn"]["processes"] == two["history"]["gcn"]["processes"] == 2
    assert one["history"]["dgcnn"]["processes"] == 1
    # the thresholds of the --nproc test above
    assert two["bmeg"]["br"] >= one["bmeg"]["br"] - 0.15
    assert two["bmeg"]["accuracy"] >= one["bmeg"]["accuracy"] - 0.05
    Detector.load(written[0])  # a whole run


def test_the_router_decided_on_other_fault_draws(trained_run):
    """A simulated application's router is judged on another draw of faults (`router_fresh`),
    not on validation traces of the training draws, and says so."""
    routing = json.loads((trained_run / "metrics.json").read_text())["routing"]
    assert ("traces of other fault draws (simulated: bottlenecked, seed 10, stratified by fault source, weighed to "
            "the training mix and imbalance; normal, seed 510, of the whole scenario)") in routing["why"]
    bottlenecked, traces = routing["decision_bottlenecked"], routing["decision_traces"]
    # the same bottlenecked traces per fault source at every training imbalance (231 of each of the
    # 5 sources), beside as many normal traces as put them at the training imbalance (0.1 here)
    assert 1_000 <= bottlenecked <= 1_300 and abs(bottlenecked / traces - 0.1 / 1.1) < 0.01
    assert routing["held_out_services"] == []
