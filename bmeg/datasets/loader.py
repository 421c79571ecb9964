"""Load a dataset by name (generated into the cache on first use) or from a folder.

A dataset folder holds `spans.parquet` (SPAN_SCHEMA), `traces.parquet` (per-trace labels),
`nodes.parquet` (per-span bottleneck labels), `dataset.json` (its card) and, from format 2 on
(`bmeg.datasets.generate.DATASET_FORMAT`), `context.parquet`: the spans of the simulated traces
not kept, history only, never samples (`Dataset.context`; None for a folder without it). A folder whose
sub-folders are such datasets (the shards of one job, `bmeg generate --shard i/n`) loads as
their union. `load_by_source` generates a dataset stratified by fault source: one part per
source the scenario can draw, unioned.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from bmeg.datasets.generate import (
    BASE_EPOCH_NS,
    DATASET_FORMAT,
    DEFAULT_IMBALANCE,
    DEFAULT_TRACES,
    SHARD_STRIDE_NS,
    generate_dataset,
)
from bmeg.faultinject.errors import SpecError
from bmeg.faultinject.scenario import load_scenario, only_source, scenario_path, scenario_sources
from bmeg.faultinject.simulator import SIMULATOR_VERSION
from bmeg.faultinject.spec import topology_path
from bmeg.paths import cache_dir
from bmeg.traces.schema import conform

TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Split:
    train: frozenset[str]
    test: frozenset[str]


@dataclass
class Dataset:
    path: Path
    spans: pa.Table
    traces: pa.Table  # trace labels: trace_id, anomalous, fault_kind, fault_source, fault_services, ...
    nodes: pa.Table  # node labels: trace_id, span_id, service, bottleneck
    cards: list[dict]
    # spans of traces that are history only (never labelled, split or scored); None: none stored
    context: pa.Table | None = None

    @property
    def card(self) -> dict:
        return self.cards[0]

    def split(self, seed: int = 0, test_fraction: float = TEST_FRACTION) -> Split:
        """Stratified train/test trace ids: `test_fraction` of each class (anomalous, normal) to test."""
        ids = np.array(self.traces["trace_id"].to_pylist(), dtype=object)
        flags = self.traces["anomalous"].to_numpy(zero_copy_only=False)
        test_set = frozenset(stratified_pick(ids, flags, test_fraction, np.random.default_rng(seed)).tolist())
        return Split(frozenset(ids.tolist()) - test_set, test_set)

    def sample(self, anomalous: int, normal: int) -> pa.Table:
        """The spans of the first `anomalous` anomalous traces and the first `normal` normal ones (or all there are)."""
        flags = self.traces["anomalous"]
        ids = pa.concat_arrays([self.traces.filter(flags)["trace_id"][:anomalous].combine_chunks(),
                                self.traces.filter(pc.invert(flags))["trace_id"][:normal].combine_chunks()])
        return self.spans.filter(pc.is_in(self.spans["trace_id"], value_set=ids))


def stratified_pick(items: np.ndarray, positive: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """`fraction` of the positive items and `fraction` of the others (rounded), drawn by `rng`:
    the per-class draw of the thesis's splits. The positives' picks come first."""
    return np.concatenate([rng.permutation(part)[: round(len(part) * fraction)] for part in (items[positive], items[~positive])])


def _dataset_dirs(path: Path) -> list[Path]:
    if (path / "dataset.json").is_file():
        return [path]
    shards = sorted(child for child in path.iterdir() if (child / "dataset.json").is_file()) if path.is_dir() else []
    if not shards:
        raise FileNotFoundError(f"{path} holds no dataset (no dataset.json in it or its sub-folders)")
    return shards


def read_dataset(path: str | Path) -> Dataset:
    path = Path(path)
    folders = _dataset_dirs(path)

    def table(name: str) -> pa.Table:
        return pa.concat_tables([pq.read_table(folder / f"{name}.parquet") for folder in folders])

    cards = [json.loads((folder / "dataset.json").read_text()) for folder in folders]
    traces = table("traces")
    if len(folders) > 1:
        _check_distinct_traces(path, traces)
    return Dataset(path, conform(table("spans")), traces, table("nodes"), cards, _context(folders))


def _context(folders: list[Path]) -> pa.Table | None:
    """The folders' context spans, unioned; None when none has a context file."""
    tables = [pq.read_table(folder / "context.parquet") for folder in folders if (folder / "context.parquet").is_file()]
    return conform(pa.concat_tables(tables)) if tables else None


def _check_distinct_traces(path: Path, traces: pa.Table) -> None:
    """Datasets unioned from sub-folders must not share trace ids (their labels would clash)."""
    counts = pc.value_counts(traces["trace_id"])
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if len(repeated):
        raise ValueError(
            f"{path}: its sub-folders share {len(repeated)} trace ids (e.g. {repeated[0].as_py()}): "
            "generate them with different --seed values, or as shards of one job (--shard i/n)"
        )


def cached_path(topology: str | Path, traces: int, imbalance: float, seed: int, scenario: str | Path) -> Path:
    """`<topology>-<scenario>-n<traces>-r<imbalance>-s<seed>-v<simulator version>`; spec files
    given by path add a content hash. The simulator's version (`SIMULATOR_VERSION`) is in the
    key so that data generated before a change to the simulator's output is not reused."""
    parts = []
    for given, resolved in ((topology, topology_path(topology)), (scenario, scenario_path(scenario))):
        named = resolved.stem == str(given)
        parts.append(resolved.stem if named else f"{resolved.stem}.{hashlib.sha256(resolved.read_bytes()).hexdigest()[:8]}")
    return cache_dir() / "datasets" / f"{parts[0]}-{parts[1]}-n{traces}-r{imbalance:g}-s{seed}-v{SIMULATOR_VERSION}"


def load_dataset(
    name_or_path: str | Path,
    traces: int = DEFAULT_TRACES,
    imbalance: float = DEFAULT_IMBALANCE,
    seed: int = 0,
    scenario: str | Path = "single",
    workers: int = 1,
    progress: bool = True,
) -> Dataset:
    """A dataset folder, or a topology name (`socialnet`, ...) generated into the cache once."""
    path = Path(name_or_path)
    if path.is_dir():
        return read_dataset(path)
    try:
        topology_path(name_or_path)
    except SpecError:
        raise FileNotFoundError(f"{name_or_path!r} is neither a dataset folder nor a known topology") from None
    target = cached_path(name_or_path, traces, imbalance, seed, scenario)
    if not _current(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        # generate beside the target and rename, so an interrupted run leaves no half dataset
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            generate_dataset(staging, name_or_path, traces, imbalance, seed, scenario, workers=workers, progress=progress)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return read_dataset(target)


def with_normals_of(bottlenecked: Dataset, normal: Dataset) -> Dataset:
    """The anomalous traces of `bottlenecked` and the normal traces of `normal`, the latter on a
    stretch of time after the former's (`_shifted`), the context of both: the router's decision
    draw (`bmeg.training.pipeline.fresh_decision_data`). A normal trace has no fault source to
    weigh it by, and the normal traces of `load_by_source`'s parts are each an episode of one
    source's faults in every round: they are not the stream's. Under one such part (a saturation
    draw) the GNN flagged 177 of 990 normal traces; on a draw of the whole scenario, 2 of 4,950
    (docs/issue-17.md, session 12)."""
    end = max(int(pc.max(table["start_ns"]).as_py()) for table in (bottlenecked.spans, bottlenecked.context)
              if table is not None)
    offset = -(-(end - BASE_EPOCH_NS) // SHARD_STRIDE_NS) * SHARD_STRIDE_NS  # the next whole stride
    normal = _shifted(normal, offset, int(pc.max(bottlenecked.traces["episode"]).as_py()) + 1)
    parts = (_traces_where(bottlenecked, True), _traces_where(normal, False))
    traces = pa.concat_tables([part.traces for part in parts])
    _check_distinct_traces(bottlenecked.path, traces)
    contexts = [part.context for part in parts if part.context is not None]
    return Dataset(bottlenecked.path, pa.concat_tables([part.spans for part in parts]), traces,
                   pa.concat_tables([part.nodes for part in parts]), bottlenecked.cards + normal.cards,
                   pa.concat_tables(contexts) if contexts else None)


def _traces_where(dataset: Dataset, anomalous: bool) -> Dataset:
    """`dataset` cut to its anomalous (or normal) traces; its context whole."""
    traces = dataset.traces.filter(pc.equal(dataset.traces["anomalous"], anomalous))

    def of_those(table: pa.Table) -> pa.Table:
        return table.filter(pc.is_in(table["trace_id"], value_set=traces["trace_id"]))

    return Dataset(dataset.path, of_those(dataset.spans), traces, of_those(dataset.nodes), dataset.cards, dataset.context)


def _shifted(dataset: Dataset, offset_ns: int, first_episode: int) -> Dataset:
    """`dataset` `offset_ns` later (every span, context span and trace start), its episodes
    numbered from `first_episode`. Every generated dataset starts at `BASE_EPOCH_NS`: unioned
    as they are, the parts of `load_by_source` ran at the same instants, and the history
    features (`recent_z_self_time`, read over kept + context traces in time order) of one
    part's traces read the other parts' faults (the GNN's false alarms on the router's
    decision traces at imbalance 0.01: 281 of 4,950 normal traces, against 0.2% on test)."""

    def later(table: pa.Table) -> pa.Table:
        start = table.schema.get_field_index("start_ns")
        return table.set_column(start, table.schema.field(start), pc.add(table["start_ns"], pa.scalar(offset_ns, pa.int64())))

    traces = later(dataset.traces)
    episode = traces.schema.get_field_index("episode")
    traces = traces.set_column(episode, traces.schema.field(episode),
                               pc.add(traces["episode"], pa.scalar(first_episode, pa.int32())))
    return Dataset(dataset.path, later(dataset.spans), traces, dataset.nodes, dataset.cards,
                   None if dataset.context is None else later(dataset.context))


def _current(folder: Path) -> bool:
    """Whether a cached dataset is there in this bmeg's layout (an older one is generated again)."""
    card = folder / "dataset.json"
    return card.is_file() and json.loads(card.read_text()).get("format", 1) == DATASET_FORMAT


#: The parts of `load_by_source` are drawn with the seed plus this times the part's index, so
#: that no two parts share trace ids (ids are drawn from the seed).
SOURCE_SEED_STRIDE = 1000


def load_by_source(
    topology: str,
    traces: int,
    imbalance: float,
    seed: int,
    scenario: str | Path = "single",
    progress: bool = False,
) -> Dataset:
    """`traces` traces of the topology at `imbalance`, an equal part for each fault source the
    scenario draws (`scenario_sources`): each part generated (and cached) as `load_dataset`
    does, under the scenario restricted to that source (`only_source`, written into the cache
    as a scenario file) with seed `seed + SOURCE_SEED_STRIDE * i`; the parts unioned, each on a
    stretch of time of its own (`_shifted`), as the shards of one job are.

    One draw of the whole scenario covers only the sources its few fault rounds happened to
    draw (5,000 traces of `single` are one 60 s episode: four rounds, so at most four of the
    five sources, often two); stratified, every source the scenario can draw is present. A
    source whose faults bottleneck too few traces to fill its part (the generator gives up,
    `generate_dataset`) is left out with a warning; the card of each part names its source."""
    plan = load_scenario(scenario)
    sources = scenario_sources(plan)
    folder = cache_dir() / "scenarios"
    folder.mkdir(parents=True, exist_ok=True)
    parts: list[Dataset] = []
    for index, source in enumerate(sources):
        restricted = only_source(plan, source)
        path = folder / f"{scenario_path(scenario).stem}-only-{source}.yaml"
        text = yaml.safe_dump(restricted.model_dump(mode="json"), sort_keys=False)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        share = traces // len(sources) + (index < traces % len(sources))
        try:
            part = load_dataset(topology, share, imbalance, seed + SOURCE_SEED_STRIDE * index, path, progress=progress)
            parts.append(_shifted(part, len(parts) * SHARD_STRIDE_NS,
                                  sum(int(pc.max(earlier.traces["episode"]).as_py()) + 1 for earlier in parts)))
        except RuntimeError as error:
            warnings.warn(f"{topology}: no {source} part in the stratified draw: {error}", stacklevel=2)
    if not parts:
        raise RuntimeError(f"{topology}: no fault source of scenario {plan.name!r} bottlenecked enough traces")

    def union(name: str) -> pa.Table:
        return pa.concat_tables([getattr(part, name) for part in parts])

    traces_table = union("traces")
    _check_distinct_traces(parts[0].path.parent, traces_table)
    contexts = [part.context for part in parts if part.context is not None]
    return Dataset(parts[0].path.parent, union("spans"), traces_table, union("nodes"),
                   [card for part in parts for card in part.cards], pa.concat_tables(contexts) if contexts else None)
