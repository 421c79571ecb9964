"""Merge the shards of one generation job (`bmeg generate --shard i/n`) into one dataset.

Shards belong together when they are the n shares of one job: every card names the same
topology and scenario (by content hash, so a spec edited between shards is caught), the same
seed, imbalance, requested traces and shard count n, and their shard indices are exactly
0..n-1, each once. Anything else is refused with a message naming the shard folders that
differ and how; nothing is written then.

The merged folder is an ordinary dataset (`read_dataset` reads it as one): the three Parquet
tables are the shards' tables one after another, in shard order; trace ids must be distinct
across shards (each shard draws its own, from its own seeds); the `episode` column is
renumbered so that episodes of different shards stay distinct. Its card sums the shards'
counts and lists the shards it came from (folder, card name, trace count). The shards'
context spans (history only, `bmeg.datasets.generate`) are merged likewise when every shard
has them; otherwise the merged folder has none, as shards of an older format.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bmeg.datasets.generate import Shard
from bmeg.faultinject.tables import NODES_SCHEMA, TRACES_SCHEMA
from bmeg.traces.schema import SPAN_SCHEMA

#: What every shard of one job has in common: card field -> how a mismatch reads.
JOB_FIELDS = {
    ("topology", "sha256"): "topology spec",
    ("scenario", "sha256"): "scenario",
    ("seed",): "seed",
    ("imbalance",): "imbalance",
    ("requested_traces",): "requested traces",
}
TABLES = {"spans": SPAN_SCHEMA, "traces": TRACES_SCHEMA, "nodes": NODES_SCHEMA}


class ShardMismatch(ValueError):
    """The folders given are not the complete, consistent shards of one job."""


def read_card(folder: Path) -> dict:
    card_path = folder / "dataset.json"
    if not card_path.is_file():
        raise ShardMismatch(f"{folder} is not a dataset shard (no dataset.json)")
    try:
        card = json.loads(card_path.read_text())
        Shard.parse(card["shard"])
        int(card["episodes"]), int(card["traces"]), int(card["anomalous_traces"])
        for field in JOB_FIELDS:
            _field(card, field)
    except (ValueError, KeyError, TypeError) as error:
        raise ShardMismatch(f"{card_path} is not a dataset card of `bmeg generate` ({error})") from None
    return card


def _field(card: dict, path: tuple[str, ...]):
    value = card
    for key in path:
        value = value[key]
    return value


def check_shards(folders: Sequence[Path]) -> list[tuple[Path, dict]]:
    """The (folder, card) pairs in shard order, or ShardMismatch saying why they do not belong together."""
    if not folders:
        raise ShardMismatch("no shard folders given")
    cards = [(Path(folder), read_card(Path(folder))) for folder in folders]
    first_folder, first = cards[0]
    for folder, card in cards[1:]:
        for field, what in JOB_FIELDS.items():
            if _field(card, field) != _field(first, field):
                raise ShardMismatch(
                    f"{folder} and {first_folder} are not shards of one job: different {what} "
                    f"({_field(card, field)!r} vs {_field(first, field)!r})")
    shards = [Shard.parse(card["shard"]) for _, card in cards]
    counts = {shard.count for shard in shards}
    if len(counts) > 1:
        raise ShardMismatch("the shards were cut into different numbers of shares: "
                            + ", ".join(f"{folder}: {card['shard']}" for folder, card in cards))
    (count,) = counts
    by_index: dict[int, Path] = {}
    for (folder, _), shard in zip(cards, shards):
        if shard.index in by_index:
            raise ShardMismatch(f"shard {shard.index}/{count} given twice: {by_index[shard.index]} and {folder}")
        by_index[shard.index] = folder
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise ShardMismatch(f"missing shard(s) {', '.join(f'{i}/{count}' for i in missing)} of {count} "
                            f"(given: {', '.join(str(by_index[i]) for i in sorted(by_index))})")
    return [pair for _, pair in sorted(zip([shard.index for shard in shards], cards), key=lambda item: item[0])]


def merge_shards(folders: Sequence[str | Path], out: str | Path) -> dict:
    """Check the shards, write the merged dataset into `out` (which must not hold one yet); return its card."""
    shards = check_shards([Path(folder) for folder in folders])
    out = Path(out)
    if (out / "dataset.json").exists():
        raise ShardMismatch(f"{out} already holds a dataset; merge into a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    # write beside the target and rename, so a failed merge leaves no half dataset
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _write_tables(shards, staging)
        card = _merged_card(shards)
        (staging / "dataset.json").write_text(json.dumps(card, indent=2))
        if out.exists():
            out.rmdir()  # an empty folder (e.g. a mount point's child made by the Job) is replaced
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return card


def _write_tables(shards: list[tuple[Path, dict]], out: Path) -> None:
    seen: set[str] = set()
    first_episode = 0
    writers = {name: pq.ParquetWriter(out / f"{name}.parquet", schema) for name, schema in TABLES.items()}
    try:
        for folder, card in shards:
            traces = pq.read_table(folder / "traces.parquet", schema=TRACES_SCHEMA)
            ids = set(traces["trace_id"].to_pylist())
            shared = ids & seen
            if shared:
                raise ShardMismatch(f"{folder} repeats {len(shared)} trace ids of earlier shards "
                                    f"(e.g. {min(shared)}): were two shards generated with the same seeds?")
            seen |= ids
            episode = traces["episode"]
            traces = traces.set_column(traces.schema.get_field_index("episode"), TRACES_SCHEMA.field("episode"),
                                       pc.add(episode, pa.scalar(first_episode, pa.int32())))
            first_episode += int(card["episodes"])
            writers["traces"].write_table(traces)
            for name in ("spans", "nodes"):
                writers[name].write_table(pq.read_table(folder / f"{name}.parquet", schema=TABLES[name]))
    finally:
        for writer in writers.values():
            writer.close()
    if all((folder / "context.parquet").is_file() for folder, _ in shards):
        with pq.ParquetWriter(out / "context.parquet", SPAN_SCHEMA) as writer:
            for folder, _ in shards:
                writer.write_table(pq.read_table(folder / "context.parquet", schema=SPAN_SCHEMA))


def _merged_card(shards: list[tuple[Path, dict]]) -> dict:
    cards = [card for _, card in shards]
    first = cards[0]
    traces = sum(card["traces"] for card in cards)
    anomalous = sum(card["anomalous_traces"] for card in cards)
    normal = traces - anomalous
    seconds = [card.get("generation", {}).get("seconds", 0.0) for card in cards]
    with_context = all("context_traces" in card for card in cards)
    files = {name: file for name, file in first.get("files", {}).items() if with_context or name != "context"}
    return {
        **{key: value for key, value in first.items() if with_context or key not in ("context_traces", "format")},
        **({"context_traces": sum(card["context_traces"] for card in cards)} if with_context else {}),
        "files": files,
        "traces": traces,
        "anomalous_traces": anomalous,
        "normal_traces": normal,
        "achieved_imbalance": anomalous / normal if normal else None,
        "shard": "0/1",
        "episodes": sum(card["episodes"] for card in cards),
        "fault_kinds": _sum_tallies(card["fault_kinds"] for card in cards),
        "fault_sources": _sum_tallies(card["fault_sources"] for card in cards),
        "merged_from": [{"folder": str(folder), "shard": card["shard"], "traces": card["traces"]}
                        for folder, card in shards],
        "generation": {
            "shards": len(cards),
            "seconds": round(max(seconds), 2),  # shards run in parallel: the slowest one
            "shard_seconds": seconds,
            "traces_per_second": round(traces / max(seconds), 1) if max(seconds) > 0 else None,
        },
    }


def _sum_tallies(tallies) -> dict[str, int]:
    total: dict[str, int] = {}
    for tally in tallies:
        for key, count in tally.items():
            total[key] = total.get(key, 0) + count
    return dict(sorted(total.items()))
