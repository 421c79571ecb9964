"""Merging the shards of one generation job: the merged dataset has the unsharded one's
distribution, and shards that do not belong together are refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from builders import SCENARIO, chain_spec

from bmeg.cli import main
from bmeg.datasets import Shard, generate_dataset, read_dataset
from bmeg.datasets.merge import ShardMismatch, check_shards, merge_shards

#: Short episodes (2 s, a fault round every 0.15 s), so a few thousand traces span many
#: episodes and fault rounds: the fault mix is then a sample, not one episode's draw.
SHORT_SCENARIO = {
    "name": "short",
    "kind": "single",
    "duration_s": 2,
    "warmup_s": 0.2,
    "campaign": {"start_s": 0.2, "every_s": 0.15, "burst_s": 0.12, "faults_per_round": [1, 1],
                 "sources": {"interference": {"factor": [2, 6]}, "saturation": {"capacity": [0.1, 0.3]},
                             "network": {"delay_ms": [20, 50], "jitter_ms": [0, 5]},
                             "background": {"pause_ms": [50, 200], "every_ms": [300, 1000]}}},
}


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A small topology and scenario, and the two shards of one job made from them."""
    root = tmp_path_factory.mktemp("chain")
    topology, scenario = root / "chain.yaml", root / "quick.yaml"
    topology.write_text(yaml.safe_dump(chain_spec(rate=200)))
    scenario.write_text(yaml.safe_dump(SCENARIO))
    for index in range(2):
        generate_dataset(root / "job" / str(index), topology, 300, 0.2, 1, scenario, Shard(index, 2), progress=False)
    return topology, scenario, root


def shard(chain, name: str, index: int = 0, count: int = 2, **changes) -> Path:
    """One shard like the job's, with `changes` (seed, imbalance, traces, topology, scenario)."""
    topology, scenario, root = chain
    options = {"topology": topology, "traces": 300, "imbalance": 0.2, "seed": 1, "scenario": scenario} | changes
    generate_dataset(root / name, shard=Shard(index, count), progress=False, **options)
    return root / name


def job(chain) -> list[Path]:
    return [chain[2] / "job" / "0", chain[2] / "job" / "1"]


def test_the_shards_of_one_job_merge(chain, tmp_path):
    card = merge_shards(job(chain), tmp_path / "merged")
    dataset = read_dataset(tmp_path / "merged")
    assert card["traces"] == dataset.traces.num_rows == 300 and card["shard"] == "0/1"
    assert [part["shard"] for part in card["merged_from"]] == ["0/2", "1/2"]
    assert json.loads((tmp_path / "merged" / "dataset.json").read_text()) == card


def test_shards_given_in_any_order_merge_in_shard_order(chain, tmp_path):
    card = merge_shards(job(chain)[::-1], tmp_path / "merged")
    assert [part["shard"] for part in card["merged_from"]] == ["0/2", "1/2"]


@pytest.mark.parametrize("change, message", [
    ({"seed": 2}, "different seed (2 vs 1)"),
    ({"imbalance": 0.3}, "different imbalance (0.3 vs 0.2)"),
    ({"traces": 400}, "different requested traces (400 vs 300)"),
])
def test_shards_of_another_job_are_refused(chain, tmp_path, change, message):
    other = shard(chain, f"other-{'-'.join(change)}", index=1, **change)
    with pytest.raises(ShardMismatch, match=message.replace("(", r"\(").replace(")", r"\)")):
        merge_shards([job(chain)[0], other], tmp_path / "merged")
    assert not (tmp_path / "merged").exists()  # nothing written


def test_a_shard_of_another_spec_or_scenario_is_refused(chain, tmp_path):
    root = chain[2]
    edited_topology, edited_scenario = root / "chain2.yaml", root / "quick2.yaml"
    edited_topology.write_text(yaml.safe_dump(chain_spec(rate=180)))
    edited_scenario.write_text(yaml.safe_dump({**SCENARIO, "warmup_s": 0.7}))
    for name, change, what in (("spec", {"topology": edited_topology}, "topology spec"),
                               ("scenario", {"scenario": edited_scenario}, "scenario")):
        other = shard(chain, f"other-{name}", index=1, **change)
        with pytest.raises(ShardMismatch, match=f"different {what} "):
            merge_shards([job(chain)[0], other], tmp_path / name)


def test_a_different_shard_count_is_refused(chain, tmp_path):
    other = shard(chain, "other-count", index=1, count=3)
    with pytest.raises(ShardMismatch, match="different numbers of shares: .*0/2.*1/3"):
        merge_shards([job(chain)[0], other], tmp_path / "merged")


def test_a_missing_or_duplicate_shard_is_refused(chain, tmp_path):
    first, second = job(chain)
    with pytest.raises(ShardMismatch, match="missing shard\\(s\\) 1/2 of 2"):
        merge_shards([first], tmp_path / "merged")
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    with pytest.raises(ShardMismatch, match="shard 0/2 given twice"):
        merge_shards([first, copy, second], tmp_path / "merged")
    with pytest.raises(ShardMismatch, match="shard 0/2 given twice"):
        merge_shards([first, first, second], tmp_path / "merged")


def test_a_folder_that_is_not_a_shard_is_refused(chain, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardMismatch, match="no dataset.json"):
        merge_shards([job(chain)[0], tmp_path / "empty"], tmp_path / "merged")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "dataset.json").write_text('{"shard": "x"}')
    with pytest.raises(ShardMismatch, match="not a dataset card"):
        merge_shards([tmp_path / "bad"], tmp_path / "merged")


def test_merging_onto_a_dataset_is_refused(chain, tmp_path):
    merge_shards(job(chain), tmp_path / "merged")
    with pytest.raises(ShardMismatch, match="already holds a dataset"):
        merge_shards(job(chain), tmp_path / "merged")


def test_the_cli_merges_a_parent_folder_and_explains_refusals(chain, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["datasets", "merge", str(chain[2] / "job"), "--out", str(tmp_path / "m"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["traces"] == 300
    result = runner.invoke(main, ["datasets", "merge", str(job(chain)[1]), "--out", str(tmp_path / "m2")])
    assert result.exit_code == 1 and "missing shard(s) 0/2 of 2" in result.output
    assert "Traceback" not in result.output


def _write_card(folder: Path, shard_text: str) -> Path:
    folder.mkdir(parents=True)
    card = {"shard": shard_text, "topology": {"sha256": "t"}, "scenario": {"sha256": "s"}, "seed": 0,
            "imbalance": 0.1, "requested_traces": 100, "episodes": 1, "traces": 10, "anomalous_traces": 1}
    (folder / "dataset.json").write_text(json.dumps(card))
    return folder


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 6), indices=st.lists(st.integers(0, 5), min_size=1, max_size=8))
def test_shard_sets_are_accepted_exactly_when_complete(tmp_path_factory, count, indices):
    root = tmp_path_factory.mktemp("cards")
    indices = [index % count for index in indices]
    folders = [_write_card(root / str(position), f"{index}/{count}") for position, index in enumerate(indices)]
    if sorted(indices) == list(range(count)):
        assert [card["shard"] for _, card in check_shards(folders)] == [f"{i}/{count}" for i in range(count)]
    else:
        with pytest.raises(ShardMismatch, match="given twice|missing shard"):
            check_shards(folders)


@pytest.mark.integration
def test_merged_shards_have_the_unsharded_distribution(tmp_path):
    """socialnet, 8,000 traces at imbalance 0.3: once whole, once as 4 shards merged."""
    scenario = tmp_path / "short.yaml"
    scenario.write_text(yaml.safe_dump(SHORT_SCENARIO))
    options = {"topology": "socialnet", "traces": 8000, "imbalance": 0.3, "seed": 4, "scenario": scenario,
               "progress": False}
    whole_card = generate_dataset(tmp_path / "whole", **options)
    for index in range(4):
        generate_dataset(tmp_path / "shards" / str(index), shard=Shard(index, 4), **options)
    card = merge_shards([tmp_path / "shards" / str(index) for index in range(4)], tmp_path / "merged")
    whole, merged = read_dataset(tmp_path / "whole"), read_dataset(tmp_path / "merged")

    # the same size and imbalance (each shard rounds its own share: at most one trace each)
    assert card["traces"] == merged.traces.num_rows == whole.traces.num_rows == 8000
    assert abs(card["anomalous_traces"] - whole_card["anomalous_traces"]) <= 4
    assert card["achieved_imbalance"] == pytest.approx(0.3, abs=0.005)
    # distinct traces, each with its spans and node labels
    ids = merged.traces["trace_id"]
    assert pc.count_distinct(ids).as_py() == 8000
    assert set(merged.spans["trace_id"].unique().to_pylist()) == set(ids.to_pylist())
    assert merged.nodes.num_rows == merged.spans.num_rows
    assert not set(ids.to_pylist()) & set(whole.traces["trace_id"].to_pylist())
    assert pc.count_distinct(merged.traces["episode"]).as_py() == card["episodes"]
    # the same fault mix within sampling error
    assert set(card["fault_kinds"]) == set(whole_card["fault_kinds"])
    for source in set(card["fault_sources"]) | set(whole_card["fault_sources"]):
        _assert_same_share(whole.traces, merged.traces, source)


def _assert_same_share(first, second, source: str) -> None:
    """Share of anomalous traces with this fault source, equal within 3 standard errors.

    Traces of one fault round share its source, so the independent draws are the rounds
    (episode, source, services), not the traces: the share is a ratio of per-round sums and
    its standard error is the cluster-robust (linearised) one over rounds."""
    shares, variances = [], []
    for traces in (first, second):
        anomalous = traces.filter(traces["anomalous"]).to_pandas()
        rounds = anomalous.groupby([anomalous["episode"], anomalous["fault_source"],
                                    anomalous["fault_services"].map(tuple)]).size()
        totals = rounds.to_numpy(dtype=float)
        hits = np.where(rounds.index.get_level_values(1) == source, totals, 0.0)
        share = hits.sum() / totals.sum()
        n = len(totals)
        shares.append(share)
        variances.append(n / (n - 1) * np.sum((hits - share * totals) ** 2) / totals.sum() ** 2)
    error = math.sqrt(sum(variances))
    assert abs(shares[0] - shares[1]) <= 3 * error, (source, shares, error)
