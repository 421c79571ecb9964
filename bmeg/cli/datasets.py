"""`bmeg datasets merge`: join the shards of one generation job into one dataset."""

from __future__ import annotations

from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table


@click.group("datasets")
def datasets() -> None:
    """Work with generated datasets."""


@datasets.command("merge")
@click.argument("shards", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the merged dataset (must not hold one yet).")
@json_option
def merge(shards: tuple[Path, ...], out: Path, as_json: bool) -> None:
    """Merge SHARDS (the folders of `bmeg generate --shard i/n`, all n of one job) into one dataset.

    A single folder whose sub-folders are the shards may be given instead of the shards."""
    from bmeg.datasets.merge import ShardMismatch, merge_shards

    folders = list(shards)
    if len(folders) == 1 and not (folders[0] / "dataset.json").is_file():
        folders = sorted(child for child in folders[0].iterdir() if (child / "dataset.json").is_file())
    try:
        card = merge_shards(folders or list(shards), out)
    except ShardMismatch as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        print_json(card)
        return
    rows = [{"shard": part["shard"], "folder": part["folder"], "traces": part["traces"]} for part in card["merged_from"]]
    rows.append({"shard": "merged", "folder": str(out), "traces": card["traces"]})
    print_table(rows, title=f"{card['name']}: {card['anomalous_traces']} anomalous, "
                            f"achieved imbalance {card['achieved_imbalance']}")
