"""How every command prints results: a table on the terminal, JSON with `--json`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import click
from rich.console import Console
from rich.table import Table

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=_jsonable))


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> None:
    """Print rows (dicts with the same keys) as a table; floats get 3 decimals."""
    table = Table(title=title)
    columns = list(rows[0]) if rows else []
    for column in columns:
        table.add_column(str(column))
    for row in rows:
        table.add_row(*(_cell(row.get(column)) for column in columns))
    Console().print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "" if value is None else str(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "isoformat"):  # datetimes, as pydantic writes them
        return value.isoformat()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")
