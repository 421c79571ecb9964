"""`bmeg generate`: build a labelled dataset with the fault-injection simulator."""

from __future__ import annotations

from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table


@click.command()
@click.argument("topology")
@click.option("--traces", type=click.IntRange(min=1), default=20_000, show_default=True, help="Traces to keep.")
@click.option("--imbalance", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="Ratio of bottlenecked to normal traces (0.3, 0.1, 0.01, 0.001).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output folder.")
@click.option("--scenario", default="single", show_default=True,
              help="Scenario file, or the name of a shipped campaign (single, multiple, cascading, hot-paths).")
@click.option("--shard", default="0/1", show_default=True,
              help="i/n: generate the i-th of n shares of the traces, with its own seeds. Give each shard "
                   "its own --out under one parent folder; loading the parent reads them all.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Processes.")
@json_option
def generate(topology, traces, imbalance, seed, out, scenario, shard, workers, as_json) -> None:
    """Simulate TOPOLOGY (socialnet, hotelreservation, trainticket, or a spec file) under faults."""
    from bmeg.datasets.generate import Shard, generate_dataset
    from bmeg.faultinject.errors import SpecError

    try:
        card = generate_dataset(out, topology, traces, imbalance, seed, scenario, Shard.parse(shard), workers,
                                progress=not as_json)
    except (SpecError, ValueError, RuntimeError) as error:  # bad input, or a scenario too sparse
        raise click.ClickException(str(error)) from None
    if as_json:
        print_json(card)
        return
    rows = [
        {"what": "traces", "value": card["traces"]},
        {"what": "anomalous", "value": card["anomalous_traces"]},
        {"what": "imbalance (achieved)", "value": card["achieved_imbalance"]},
        {"what": "episodes simulated", "value": card["episodes"]},
        {"what": "seconds", "value": card["generation"]["seconds"]},
        {"what": "traces/s", "value": card["generation"]["traces_per_second"]},
    ]
    rows += [{"what": f"source {name}", "value": count} for name, count in card["fault_sources"].items()]
    print_table(rows, title=f"{card['name']} -> {out}")
