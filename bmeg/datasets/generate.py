"""Generate a labelled dataset with the simulator: episodes of a scenario, sampled to an imbalance.

How the requested ratio R of anomalous (bottlenecked) to normal traces is met: the job runs
episodes of the scenario one after another (each a fresh simulation with its own seed, its
faults drawn anew). From each episode it keeps at most a fixed quota of anomalous and of
normal traces, chosen at random after the warm-up, so the kept traces spread over many
episodes and fault rounds; it stops as soon as both totals are met. A sparse scenario and a
high R therefore cost more simulated traces than kept ones (the card says how many).

The traces an episode simulated but did not keep (warm-up, and those beyond the quotas) are
written too, as context (`context.parquet`, spans only): they are never samples (no labels,
never split, trained on or scored), only the history that history features read. A trace's
temporal context (`recent_z_self_time`, `bmeg.models.features`) is the mean over its service's
recent visits in the stream; over the kept traces alone, a dataset sampled down to 1%
bottlenecked traces has dropped most of a faulty service's slow visits that a served stream
would hold. Training and evaluation read the kept traces' history over kept + context in time
order (`bmeg.training.pipeline.label`). Cards of this layout say `"format": DATASET_FORMAT`;
a folder without a context file (format 1) loads as before, its history over the kept traces.

Episodes are independent, so `workers` processes run them in parallel; results are consumed
in episode order, so the output does not depend on the number of workers. Worker processes are
spawned, so a script calling this with workers > 1 needs the usual `if __name__ == "__main__":`.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from bmeg.faultinject.labels import LABEL_RULE, Thresholds, calibrate, label_episode
from bmeg.faultinject.scenario import Scenario, check_against, load_scenario, plan_faults, scenario_path
from bmeg.faultinject.simulator import simulate
from bmeg.faultinject.spec import TopologySpec, load_topology, topology_path
from bmeg.faultinject.tables import NODES_SCHEMA, TRACES_SCHEMA, EpisodeTables, episode_tables
from bmeg.traces.schema import SPAN_SCHEMA

#: 2024-01-01T00:00:00Z: episodes are laid out one after another from here.
BASE_EPOCH_NS = 1_704_067_200 * 10**9
#: A shard's episodes start this far after the previous shard's (about 11.6 days).
SHARD_STRIDE_NS = 10**6 * 10**9
#: Give up when a scenario yields too few anomalous traces: this many times the planned episodes.
MAX_EPISODE_FACTOR = 50
#: The dataset layout's version, in the card: 2 adds the context file. A cached dataset of
#: another version is generated again (`bmeg.datasets.loader.load_dataset`).
DATASET_FORMAT = 2


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'i/n' with 0 <= i < n."""
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"shard {text!r} is not of the form i/n (e.g. 0/4)") from None
        if not 0 <= index < count:
            raise ValueError(f"shard {text!r}: need 0 <= i < n")
        return cls(index, count)

    def share(self, total: int) -> int:
        return total // self.count + (1 if self.index < total % self.count else 0)


@dataclass(frozen=True)
class EpisodeJob:
    """Everything one worker needs to simulate, label and sample one episode."""

    topology: TopologySpec
    scenario: Scenario
    thresholds: Thresholds
    seed: int
    shard: Shard
    episode: int
    anomalous_quota: int
    normal_quota: int

    def seed_sequence(self) -> np.random.SeedSequence:
        return np.random.SeedSequence([self.seed, self.shard.index, self.shard.count, self.episode])

    def epoch_ns(self) -> int:
        episode_ns = int((self.scenario.duration_s + 60) * 1e9)
        return BASE_EPOCH_NS + self.shard.index * SHARD_STRIDE_NS + self.episode * episode_ns


@dataclass(frozen=True)
class EpisodeOutput:
    """The kept traces' tables of an episode and the spans of its other traces (context)."""

    tables: EpisodeTables
    context: pa.Table


def run_episode(job: EpisodeJob) -> EpisodeOutput:
    plan_seed, sim_seed, sample_seed = job.seed_sequence().spawn(3)
    faults = plan_faults(job.scenario, job.topology, np.random.default_rng(plan_seed))
    result = simulate(job.topology, faults, job.scenario.duration_s, sim_seed)
    labels = label_episode(result, job.thresholds)
    rng = np.random.default_rng(sample_seed)
    after_warmup = result.trace_start >= job.scenario.warmup_s * 1e9
    keep = np.concatenate(
        [
            _sample(np.flatnonzero(after_warmup & labels.trace_anomalous), job.anomalous_quota, rng),
            _sample(np.flatnonzero(after_warmup & ~labels.trace_anomalous), job.normal_quota, rng),
        ]
    )
    keep = np.sort(keep)
    tables = episode_tables(result, labels, keep, job.episode, job.epoch_ns(), rng)
    # the context's ids from a seed of their own, so the kept traces are those generated without it
    others = np.setdiff1d(np.arange(len(result.trace_start)), keep)
    context_rng = np.random.default_rng(job.seed_sequence().spawn(5)[4])
    context = episode_tables(result, labels, others, job.episode, job.epoch_ns(), context_rng).spans
    return EpisodeOutput(tables, context)


def _sample(indices: np.ndarray, quota: int, rng: np.random.Generator) -> np.ndarray:
    if len(indices) <= quota:
        return indices
    return rng.choice(indices, size=quota, replace=False)


def _trim(output: EpisodeOutput, anomalous: int, normal: int, seed: np.random.SeedSequence) -> EpisodeOutput:
    """Keep `anomalous` anomalous and `normal` normal traces of an episode (the last one needed);
    the spans of the others join the context."""
    tables = output.tables
    rng = np.random.default_rng(seed)
    flags = tables.traces["anomalous"].to_numpy(zero_copy_only=False)
    keep = np.sort(
        np.concatenate(
            [_sample(np.flatnonzero(flags), anomalous, rng), _sample(np.flatnonzero(~flags), normal, rng)]
        )
    )
    traces = tables.traces.take(pa.array(keep))
    kept = pc.is_in(tables.spans["trace_id"], traces["trace_id"])
    return EpisodeOutput(
        EpisodeTables(tables.spans.filter(kept), traces,
                      tables.nodes.filter(pc.is_in(tables.nodes["trace_id"], traces["trace_id"]))),
        pa.concat_tables([output.context, tables.spans.filter(pc.invert(kept))]),
    )


#: What a dataset is generated with when nothing else is said (`bmeg generate`, `bmeg train`).
DEFAULT_TRACES = 20_000
DEFAULT_IMBALANCE = 0.1
DEFAULT_SCENARIO = "single"


def generate_dataset(
    out: str | Path,
    topology: str | Path = "socialnet",
    traces: int = DEFAULT_TRACES,
    imbalance: float = DEFAULT_IMBALANCE,
    seed: int = 0,
    scenario: str | Path = DEFAULT_SCENARIO,
    shard: Shard = Shard(),
    workers: int = 1,
    progress: bool = True,
) -> dict:
    """Write spans.parquet, traces.parquet, nodes.parquet, context.parquet and dataset.json into
    `out`; return the card."""
    if traces < 1:
        raise ValueError(f"traces must be at least 1, not {traces}")
    if imbalance < 0:
        raise ValueError(f"imbalance (anomalous : normal) must not be negative, not {imbalance}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    spec_file, scenario_file = topology_path(topology), scenario_path(scenario)
    spec, plan = load_topology(spec_file), load_scenario(scenario_file)
    check_against(plan, spec, str(scenario_file))
    started = time.perf_counter()
    thresholds = calibrate(spec, seed)

    total = shard.share(traces)
    need = {"anomalous": round(total * imbalance / (1 + imbalance))}
    need["normal"] = total - need["anomalous"]
    anomalous_target = need["anomalous"]
    # spread the kept traces evenly over the episodes a full yield would need
    planned = max(1, math.ceil(total / (spec.workload.rate * (plan.duration_s - plan.warmup_s))))
    quotas = (math.ceil(need["anomalous"] / planned), math.ceil(need["normal"] / planned))
    jobs = (
        EpisodeJob(spec, plan, thresholds, seed, shard, episode, *quotas)
        for episode in range(planned * MAX_EPISODE_FACTOR)
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = _Counts()
    with _Writers(out) as writers, tqdm(total=total, unit="trace", disable=not progress, desc=spec.name) as bar:
        for job, output in _episodes(jobs, workers):
            counts.simulated_episodes += 1
            output = _take_needed(output, need, job)
            writers.write(output)
            counts.add(output.tables.traces)
            counts.context_traces += pc.count_distinct(output.context["trace_id"]).as_py()
            bar.update(output.tables.traces.num_rows)
            if not any(need.values()):
                break
    if any(need.values()):
        raise RuntimeError(
            f"scenario {plan.name!r} produced only {counts.anomalous} of {anomalous_target} anomalous traces in "
            f"{counts.simulated_episodes} episodes; use a denser scenario or a lower imbalance"
        )
    elapsed = time.perf_counter() - started
    card = _card(spec, spec_file, plan, scenario_file, thresholds, traces, imbalance, seed, shard, workers, counts, elapsed)
    (out / "dataset.json").write_text(json.dumps(card, indent=2))
    return card


def _take_needed(output: EpisodeOutput, need: dict[str, int], job: EpisodeJob) -> EpisodeOutput:
    flags = output.tables.traces["anomalous"].to_numpy(zero_copy_only=False)
    have = {"anomalous": int(flags.sum()), "normal": int((~flags).sum())}
    take = {kind: min(have[kind], need[kind]) for kind in need}
    if take != have:
        output = _trim(output, take["anomalous"], take["normal"], job.seed_sequence().spawn(4)[3])
    for kind in need:
        need[kind] -= take[kind]
    return output


def _episodes(jobs, workers: int):
    """(job, tables) in episode order; with workers > 1, up to `workers` episodes run ahead.

    Episodes still running when the caller stops are waited for, not killed: terminating a pool
    while a worker writes its (large) result leaves half a message in the results pipe, and the
    pool's result thread then waits for the rest for good (a CI run hung so in `Pool.terminate`)."""
    if workers == 1:
        for job in jobs:
            yield job, run_episode(job)
        return
    pool = multiprocessing.get_context("spawn").Pool(workers)
    running: deque = deque()
    try:
        for job in jobs:
            running.append((job, pool.apply_async(run_episode, (job,))))
            if len(running) >= workers:
                done_job, pending = running.popleft()
                yield done_job, pending.get()
        while running:
            done_job, pending = running.popleft()
            yield done_job, pending.get()
    finally:
        for _, pending in running:
            pending.wait()
        pool.close()
        pool.join()


class _Writers:
    def __init__(self, out: Path):
        self.writers = {
            "spans": pq.ParquetWriter(out / "spans.parquet", SPAN_SCHEMA),
            "traces": pq.ParquetWriter(out / "traces.parquet", TRACES_SCHEMA),
            "nodes": pq.ParquetWriter(out / "nodes.parquet", NODES_SCHEMA),
            "context": pq.ParquetWriter(out / "context.parquet", SPAN_SCHEMA),
        }

    def write(self, output: EpisodeOutput) -> None:
        for name, writer in self.writers.items():
            writer.write_table(output.context if name == "context" else getattr(output.tables, name))

    def __enter__(self) -> _Writers:
        return self

    def __exit__(self, *exc) -> None:
        for writer in self.writers.values():
            writer.close()


class _Counts:
    def __init__(self):
        self.simulated_episodes = 0
        self.traces = self.anomalous = self.spans = self.context_traces = 0
        self.kinds: dict[str, int] = {}
        self.sources: dict[str, int] = {}

    def add(self, traces: pa.Table) -> None:
        self.traces += traces.num_rows
        self.anomalous += int(pc.sum(traces["anomalous"]).as_py() or 0)
        for column, tally in (("fault_kind", self.kinds), ("fault_source", self.sources)):
            for row in traces.group_by(column).aggregate([(column, "count")]).to_pylist():
                tally[row[column]] = tally.get(row[column], 0) + row[f"{column}_count"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _card(spec, spec_file, plan, scenario_file, thresholds, traces, imbalance, seed, shard, workers, counts, elapsed) -> dict:
    normal = counts.traces - counts.anomalous
    return {
        "name": f"{spec.name}-{plan.name}-n{traces}-r{imbalance:g}-s{seed}",
        "format": DATASET_FORMAT,
        "topology": {"name": spec.name, "file": str(spec_file), "sha256": _sha256(spec_file)},
        "scenario": {"name": plan.name, "kind": plan.kind, "file": str(scenario_file), "sha256": _sha256(scenario_file)},
        "traces": counts.traces,
        "anomalous_traces": counts.anomalous,
        "normal_traces": normal,
        "imbalance": imbalance,
        "achieved_imbalance": counts.anomalous / normal if normal else None,
        "seed": seed,
        "shard": f"{shard.index}/{shard.count}",
        "requested_traces": traces,
        "episodes": counts.simulated_episodes,
        "episode_seconds": plan.duration_s,
        "fault_kinds": dict(sorted(counts.kinds.items())),
        "fault_sources": dict(sorted(counts.sources.items())),
        "labels": LABEL_RULE,
        "calibration_p99_local_us": {key: round(value / 1e3, 1) for key, value in thresholds.local_ns.items()},
        # context: the simulated traces not kept, as history only (never samples; module docstring)
        "context_traces": counts.context_traces,
        "files": {"spans": "spans.parquet", "traces": "traces.parquet", "nodes": "nodes.parquet",
                  "context": "context.parquet"},
        "generation": {"workers": workers, "seconds": round(elapsed, 2), "traces_per_second": round(counts.traces / elapsed, 1)},
    }
