"""`bmeg testbed up|down|status`: the socialnet testbed on this machine (real processes)."""

from __future__ import annotations

import click

from bmeg.cli.output import json_option, print_json, print_table


@click.group()
def testbed() -> None:
    """Run the socialnet application for real: services, stores, Collector, load (needs root)."""


def _testbed():
    from bmeg.faultinject.testbed.supervisor import Testbed

    try:
        return Testbed.default()
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@testbed.command()
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=50.0, show_default=True,
              help="Open-loop load in requests/s (the socialnet mix).")
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
def up(rate, seed, as_json) -> None:
    """Repair what an earlier run left, then start everything."""
    from bmeg.faultinject.testbed.supervisor import status
    from bmeg.faultinject.testbed.supervisor import up as start
    from bmeg.faultinject.testbed.system import TestbedError

    bed = _testbed()
    try:
        start(bed, rate=rate, seed=seed)
    except TestbedError as error:
        raise click.ClickException(str(error)) from None
    _show(status(bed), as_json)


@testbed.command()
@json_option
def down(as_json) -> None:
    """Stop everything the testbed started and undo every fault (also after a killed run)."""
    from bmeg.faultinject.testbed.supervisor import down as stop
    from bmeg.faultinject.testbed.system import TestbedError

    try:
        done = stop(_testbed())
    except TestbedError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        print_json({"done": done})
    else:
        click.echo("\n".join(done) if done else "nothing was running")


@testbed.command()
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), required=True,
              help="How long to record.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="The span Parquet file to write.")
@json_option
def record(seconds, out, as_json) -> None:
    """Record the running testbed's fault-free traffic for a time (for `bmeg bootstrap`, or
    as fresh healthy traffic); no fault may be in force."""
    from bmeg.faultinject.testbed.campaign import record_healthy
    from bmeg.faultinject.testbed.system import TestbedError

    try:
        card = record_healthy(out, seconds, _testbed())
    except TestbedError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        print_json(card)
        return
    print_table([{"what": key, "value": card[key]} for key in ("seconds", "rate", "traces", "spans", "load_average_1_5_15")],
                title=f"fault-free testbed traffic -> {card['out']}")


@testbed.command()
@json_option
def status(as_json) -> None:
    """What runs: processes, pids, ports, CPU quotas, the load rate, faults in force."""
    from bmeg.faultinject.testbed.supervisor import status as describe

    _show(describe(_testbed()), as_json)


def _show(report: dict, as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    if "processes" not in report:
        click.echo(f"not running (run dir {report['run_dir']}); leftovers: "
                   f"{report['leftover_cgroups'] or 'none'} {report['leftover_netns'] or ''}")
        return
    keys = ("name", "role", "pid", "alive", "port", "cpu", "cpu_quota_cores", "cpu_used_s")
    print_table([{k: p.get(k) for k in keys} for p in report["processes"]],
                title=f"testbed {'running' if report['running'] else 'DEGRADED'}: {report['rate']:g} req/s "
                      f"into {report['entry']}, up {report['uptime_s']} s")
    for fault_id, fault in report["faults"].items():
        click.echo(f"fault {fault_id}: {fault['source']} on {fault['service']} {fault['parameters']}")
