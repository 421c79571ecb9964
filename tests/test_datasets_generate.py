"""Datasets: the requested imbalance, determinism, splits, the cache, shards and the CLI."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from builders import chain_spec

from builders import SCENARIO

from bmeg.cli import main
from bmeg.datasets import Shard, generate_dataset, load_dataset, read_dataset
from bmeg.traces.schema import SPAN_SCHEMA


@pytest.fixture
def specs(tmp_path):
    topology, scenario = tmp_path / "chain.yaml", tmp_path / "quick.yaml"
    topology.write_text(yaml.safe_dump(chain_spec(rate=200)))
    scenario.write_text(yaml.safe_dump(SCENARIO))
    return topology, scenario


@pytest.mark.parametrize("imbalance", [0.3, 0.01])
def test_imbalance_is_met_exactly(specs, tmp_path, imbalance):
    topology, scenario = specs
    card = generate_dataset(tmp_path / "d", topology, 1000, imbalance, 3, scenario, progress=False)
    traces = pq.read_table(tmp_path / "d" / "traces.parquet")
    anomalous = pc.sum(traces["anomalous"]).as_py()
    assert traces.num_rows == card["traces"] == 1000
    assert anomalous == card["anomalous_traces"] == round(1000 * imbalance / (1 + imbalance))
    assert sum(card["fault_sources"].values()) == 1000 and card["fault_sources"]["none"] == 1000 - anomalous
    assert card["labels"].startswith("A node") and card["seed"] == 3 and card["topology"]["name"] == "chain"


def test_files_hold_spans_and_consistent_labels(specs, tmp_path):
    topology, scenario = specs
    generate_dataset(tmp_path / "d", topology, 500, 0.1, 0, scenario, progress=False)
    dataset = read_dataset(tmp_path / "d")
    assert dataset.spans.schema.equals(SPAN_SCHEMA)
    assert dataset.nodes.num_rows == dataset.spans.num_rows
    assert set(dataset.spans["trace_id"].to_pylist()) == set(dataset.traces["trace_id"].to_pylist())
    bottleneck_traces = set(dataset.nodes.filter(dataset.nodes["bottleneck"])["trace_id"].to_pylist())
    anomalous = set(dataset.traces.filter(dataset.traces["anomalous"])["trace_id"].to_pylist())
    assert bottleneck_traces == anomalous


def test_same_seed_same_dataset(specs, tmp_path):
    topology, scenario = specs
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        generate_dataset(tmp_path / name, topology, 400, 0.1, seed, scenario, progress=False)
    a, b, c = (read_dataset(tmp_path / name) for name in "abc")
    assert a.spans.equals(b.spans) and a.nodes.equals(b.nodes) and a.traces.equals(b.traces)
    assert not a.spans.equals(c.spans)


def test_split_is_stratified_80_20(specs, tmp_path):
    topology, scenario = specs
    generate_dataset(tmp_path / "d", topology, 1100, 0.1, 0, scenario, progress=False)
    dataset = read_dataset(tmp_path / "d")
    split = dataset.split(seed=1)
    anomalous = set(dataset.traces.filter(dataset.traces["anomalous"])["trace_id"].to_pylist())
    assert not split.train & split.test and len(split.train | split.test) == 1100
    assert len(split.test) == 220 and len(split.test & anomalous) == 20
    assert dataset.split(seed=1) == split and dataset.split(seed=2) != split


def test_sample_holds_the_spans_of_the_first_traces_of_each_class(specs, tmp_path):
    topology, scenario = specs
    generate_dataset(tmp_path / "d", topology, 200, 0.3, 0, scenario, progress=False)
    dataset = read_dataset(tmp_path / "d")
    sample = dataset.sample(anomalous=5, normal=3)
    flags = dict(zip(dataset.traces["trace_id"].to_pylist(), dataset.traces["anomalous"].to_pylist()))
    anomalous = [t for t, flag in flags.items() if flag][:5]
    normal = [t for t, flag in flags.items() if not flag][:3]
    assert set(sample["trace_id"].to_pylist()) == set(anomalous + normal)
    assert sample.num_rows == pc.sum(pc.is_in(dataset.spans["trace_id"], value_set=pa.array(anomalous + normal))).as_py()


def test_load_dataset_by_name_generates_once_into_the_cache(specs, tmp_path, monkeypatch):
    topology, scenario = specs
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path / "cache"))
    first = load_dataset(str(topology), traces=300, imbalance=0.1, seed=0, scenario=str(scenario), progress=False)
    assert first.path.parent == tmp_path / "cache" / "datasets"
    stamp = (first.path / "spans.parquet").stat().st_mtime_ns
    again = load_dataset(str(topology), traces=300, imbalance=0.1, seed=0, scenario=str(scenario), progress=False)
    assert (again.path / "spans.parquet").stat().st_mtime_ns == stamp and again.traces.equals(first.traces)
    assert load_dataset(first.path).traces.num_rows == 300
    with pytest.raises(FileNotFoundError, match="neither a dataset folder nor a known topology"):
        load_dataset("no-such-thing")


def test_shards_split_the_traces_and_load_together(specs, tmp_path):
    topology, scenario = specs
    for index in range(2):
        generate_dataset(tmp_path / "job" / f"shard-{index}", topology, 501, 0.1, 0, scenario, Shard(index, 2), progress=False)
    dataset = read_dataset(tmp_path / "job")
    assert dataset.traces.num_rows == 501 and len(dataset.cards) == 2
    assert len(set(dataset.traces["trace_id"].to_pylist())) == 501


@pytest.mark.parametrize("text", ["1/1", "x", "3/2", "-1/2"])
def test_bad_shard_is_refused(text):
    with pytest.raises(ValueError, match="shard"):
        Shard.parse(text)


def test_cli_generate_writes_a_dataset(specs, tmp_path):
    topology, scenario = specs
    out = tmp_path / "cli"
    result = CliRunner().invoke(main, ["generate", str(topology), "--traces", "300", "--imbalance", "0.3",
                                       "--seed", "1", "--out", str(out), "--scenario", str(scenario), "--json"])
    assert result.exit_code == 0, result.output
    card = json.loads(result.output)
    assert card == json.loads((out / "dataset.json").read_text())
    assert card["traces"] == 300 and card["anomalous_traces"] == 69


def test_cli_reports_bad_input_clearly(specs, tmp_path):
    topology, _ = specs
    result = CliRunner().invoke(main, ["generate", str(topology), "--out", str(tmp_path / "x"), "--scenario", "nope"])
    assert result.exit_code != 0 and "no scenario 'nope'" in result.output
    result = CliRunner().invoke(main, ["generate", str(topology), "--out", str(tmp_path / "x"), "--imbalance", "-1"])
    assert result.exit_code != 0 and "imbalance" in result.output


@pytest.mark.integration
def test_workers_do_not_change_the_dataset(specs, tmp_path):
    topology, scenario = specs
    generate_dataset(tmp_path / "one", topology, 3000, 0.3, 2, scenario, workers=1, progress=False)
    generate_dataset(tmp_path / "two", topology, 3000, 0.3, 2, scenario, workers=2, progress=False)
    one, two = read_dataset(tmp_path / "one"), read_dataset(tmp_path / "two")
    assert one.spans.equals(two.spans) and one.traces.equals(two.traces) and one.nodes.equals(two.nodes)
