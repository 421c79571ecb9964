"""`bmeg generate`: build a labelled dataset with the fault-injection simulator."""

from __future__ import annotations

from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table
from bmeg.datasets.generate import DEFAULT_IMBALANCE, DEFAULT_SCENARIO, DEFAULT_TRACES, Shard, generate_dataset


@click.command()
@click.argument("topology")
@click.option("--traces", type=click.IntRange(min=1), default=DEFAULT_TRACES, show_default=True, help="Traces to keep.")
@click.option("--imbalance", type=click.FloatRange(min=0), default=DEFAULT_IMBALANCE, show_default=True,
              help="Ratio of bottlenecked to normal traces (0.3, 0.1, 0.01, 0.001).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output folder.")
@click.option("--scenario", default=DEFAULT_SCENARIO, show_default=True,
              help="Scenario file, or the name of a shipped campaign (single, multiple, cascading, hot-paths).")
@click.option("--shard", default="0/1", show_default=True,
              help="i/n: generate the i-th of n shares of the traces, with its own seeds. Give each shard "
                   "its own --out under one parent folder; loading the parent reads them all.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Processes.")
@click.option("--backend", type=click.Choice(["simulator", "testbed"]), default="simulator", show_default=True,
              help="testbed: inject real faults into the running socialnet testbed (socialnet only; "
                   "scenarios testbed-single, testbed-multiple, testbed-cascading, testbed-dataset, testbed-dataset-single) and label its real traces.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True),
              help="testbed: load in requests/s when the campaign starts the testbed itself (default 50).")
@click.option("--calibration", "calibration_s", type=click.FloatRange(min=1), default=20.0, show_default=True,
              help="testbed: seconds of fault-free traffic that calibrate the labels.")
@json_option
def generate(topology, traces, imbalance, seed, out, scenario, shard, workers, backend, rate, calibration_s,
             as_json) -> None:
    """Simulate TOPOLOGY (socialnet, hotelreservation, trainticket, or a spec file) under faults,
    or (--backend testbed) inject real faults into the socialnet testbed."""
    from bmeg.faultinject.errors import SpecError

    if backend == "testbed":
        _testbed_campaign(topology, traces, seed, out, scenario, rate, calibration_s, as_json)
        return
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


def _testbed_campaign(topology, traces, seed, out, scenario, rate, calibration_s, as_json) -> None:
    from bmeg.faultinject.errors import SpecError
    from bmeg.faultinject.testbed.campaign import run_campaign
    from bmeg.faultinject.testbed.system import TestbedError

    if topology != "socialnet":
        raise click.UsageError("--backend testbed runs socialnet only")
    try:
        card = run_campaign(out, scenario, traces, seed, rate, calibration_s,
                            progress=(lambda line: None) if as_json else click.echo)
    except (SpecError, ValueError, TestbedError) as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        print_json(card)
        return
    rows = [{"what": key, "value": card[key]} for key in ("traces", "anomalous_traces", "exposed_traces", "faults")]
    rows += [{"what": f"faults {name}", "value": count} for name, count in card["faults_per_source"].items()]
    print_table(rows, title=f"{card['name']} -> {out}")
