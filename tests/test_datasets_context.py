"""Datasets' context traces: the simulated traces not sampled, read as history, never samples.

A trace's temporal context (`recent_z_self_time`) over kept + context traces must be what it is
over the whole simulated stream; context traces must never be labelled, split, trained on or
scored; a dataset without a context file (an older format) loads and trains as before.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml
from builders import SCENARIO, chain_spec

from bmeg.datasets import generate_dataset, load_dataset, read_dataset
from bmeg.datasets.generate import DATASET_FORMAT
from bmeg.datasets.merge import merge_shards
from bmeg.datasets.generate import Shard
from bmeg.graphs import assemble
from bmeg.models.features import FeatureEncoder
from bmeg.training.pipeline import label
from bmeg.traces.schema import span_keys


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    topology, scenario = root / "chain.yaml", root / "quick.yaml"
    topology.write_text(yaml.safe_dump(chain_spec(rate=200)))
    scenario.write_text(yaml.safe_dump(SCENARIO))
    return topology, scenario, root


@pytest.fixture(scope="module")
def dataset(specs):
    topology, scenario, root = specs
    generate_dataset(root / "d", topology, 400, 0.05, 2, scenario, progress=False)
    return read_dataset(root / "d")


def test_context_holds_the_unsampled_traces_and_never_a_sample(dataset):
    assert dataset.card["format"] == DATASET_FORMAT and dataset.context is not None
    context_ids = set(dataset.context["trace_id"].to_pylist())
    assert len(context_ids) == dataset.card["context_traces"] > 0
    assert not context_ids & set(dataset.traces["trace_id"].to_pylist())
    assert not context_ids & set(dataset.nodes["trace_id"].to_pylist())
    data = label(dataset, seed=0)
    # every sample of the forest is a kept trace, and the splits cover exactly them
    assert set(data.forest.trace_ids) == set(dataset.traces["trace_id"].to_pylist())
    assert np.array_equal(np.sort(np.r_[data.train, data.val, data.test]), np.arange(data.forest.num_traces))
    assert data.context is not None and set(data.context.trace_ids) == context_ids


def test_history_over_kept_and_context_equals_the_whole_stream(dataset):
    data = label(dataset, seed=0)
    normal = assemble(dataset.spans.filter(pc.is_in(dataset.spans["trace_id"],
                                                     dataset.traces.filter(pc.invert(dataset.traces["anomalous"]))["trace_id"])))
    encoder = FeatureEncoder().fit(normal)
    column = encoder.names.index("recent_z_self_time")
    with_context = encoder.transform(data.forest, context=data.context)[:, column]
    stream = assemble(pa.concat_tables([dataset.spans, dataset.context]))
    whole = pd.Series(encoder.transform(stream)[:, column], index=span_keys(stream.spans))
    expected = whole.reindex(span_keys(data.forest.spans)).to_numpy()
    np.testing.assert_allclose(with_context, expected, rtol=1e-5, atol=1e-6)
    # the context changes the history (without it, the sample's own traces are all there is)
    without = encoder.transform(data.forest)[:, column]
    assert not np.allclose(without, expected, atol=1e-3)


def test_a_dataset_without_context_loads_and_labels_as_before(dataset, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(dataset.path, old)
    (old / "context.parquet").unlink()
    card = json.loads((old / "dataset.json").read_text())
    del card["format"], card["context_traces"], card["files"]["context"]
    (old / "dataset.json").write_text(json.dumps(card))
    loaded = read_dataset(old)
    assert loaded.context is None and loaded.traces.equals(dataset.traces) and loaded.spans.equals(dataset.spans)
    data = label(loaded, seed=0)
    assert data.context is None
    encoder = FeatureEncoder().fit(data.forest)
    assert np.array_equal(encoder.transform(data.forest), encoder.transform(data.forest, context=None))


def test_a_cached_dataset_of_an_older_format_is_generated_again(specs, tmp_path, monkeypatch):
    topology, scenario, _ = specs
    monkeypatch.setenv("BMEG_CACHE", str(tmp_path / "cache"))
    first = load_dataset(str(topology), traces=200, imbalance=0.1, seed=0, scenario=str(scenario), progress=False)
    card_path = first.path / "dataset.json"
    card = json.loads(card_path.read_text())
    del card["format"]
    card_path.write_text(json.dumps(card))
    (first.path / "context.parquet").unlink()
    again = load_dataset(str(topology), traces=200, imbalance=0.1, seed=0, scenario=str(scenario), progress=False)
    assert again.card["format"] == DATASET_FORMAT and again.context is not None
    assert again.traces.equals(first.traces)  # the same seed draws the same samples


def test_shards_merge_their_context(specs, tmp_path):
    topology, scenario, _ = specs
    for index in range(2):
        generate_dataset(tmp_path / "job" / str(index), topology, 300, 0.2, 1, scenario, Shard(index, 2), progress=False)
    card = merge_shards([tmp_path / "job" / "0", tmp_path / "job" / "1"], tmp_path / "merged")
    merged, parts = read_dataset(tmp_path / "merged"), read_dataset(tmp_path / "job")
    assert merged.context is not None and merged.context.num_rows == parts.context.num_rows
    assert card["context_traces"] == sum(part["context_traces"] for part in parts.cards)
