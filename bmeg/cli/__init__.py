"""The `bmeg` command: a thin layer that parses options and calls the library.

Subcommands live in `bmeg/cli/<stage>.py` and are imported only when used, so `bmeg --help`
stays fast (no torch import).
"""

from __future__ import annotations

import importlib

import click

#: command name -> "module:attribute" of a click command or group.
COMMANDS = {
    "demo": "bmeg.cli.models:demo",
    "diagnose": "bmeg.cli.models:diagnose",
    "experiment": "bmeg.cli.models:experiment",
    "train": "bmeg.cli.models:train",
    "critical-path": "bmeg.cli.graphs:critical_path",
    "generate": "bmeg.cli.generate:generate",
    "datasets": "bmeg.cli.datasets:datasets",
    "twin": "bmeg.cli.realtraces:twin",
    "evaluate": "bmeg.cli.realtraces:evaluate",
    "bootstrap": "bmeg.cli.realtraces:bootstrap",
    "pretrain": "bmeg.cli.realtraces:pretrain",
    "serve": "bmeg.cli.serving:serve",
    "consume": "bmeg.cli.serving:consume",
    "mitigate": "bmeg.cli.mitigate:mitigate",
    "testbed": "bmeg.cli.testbed:testbed",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


@click.group(cls=LazyGroup)
@click.version_option(package_name="bmeg")
def main() -> None:
    """Find and fix the microservices that make an application slow, from its traces."""
