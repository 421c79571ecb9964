"""`bmeg critical-path`: the critical path of each trace in a file."""

from __future__ import annotations

from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table
from bmeg.graphs import assemble, trace_paths
from bmeg.traces import TraceInputError
from bmeg.traces.io import FORMATS, read_spans


@click.command("critical-path")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--format", "input_format", type=click.Choice(FORMATS), help="Input format (default: guessed from the file)."
)
@json_option
def critical_path(file: Path, input_format: str | None, as_json: bool) -> None:
    """Print the critical path (CRISP) of each trace in FILE, with exclusive times in us.

    Repairs made to the traces (orphans, clock skew, ...) are printed to stderr.
    """
    try:
        forest = assemble(read_spans(file, format=input_format))
    except TraceInputError as error:
        raise click.ClickException(str(error)) from error
    for warning in forest.warnings:
        click.echo(f"warning: {warning}", err=True)
    paths = [path.to_json() for path in trace_paths(forest)]
    if as_json:
        print_json(paths[0] if len(paths) == 1 else paths)
        return
    rows = [
        {
            "trace": path["trace_id"],
            "total_us": path["total_us"],
            "service": step["service"],
            "operation": step["operation"],
            "exclusive_us": step["exclusive_us"],
            "share": step["exclusive_us"] / path["total_us"] if path["total_us"] else 1.0,
        }
        for path in paths
        for step in path["path"]
    ]
    print_table(rows, title=f"Critical paths of {len(paths)} trace(s) in {file.name}")
