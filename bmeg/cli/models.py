"""`bmeg train`, `bmeg diagnose`, `bmeg experiment` and `bmeg demo` (the main job)."""

from __future__ import annotations

from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table
from bmeg.training.config import LOSSES, VARIANTS, FitConfig, TrainConfig
from bmeg.training.experiment import DEFAULT_RATIOS, DEFAULT_TRACES, imbalance_experiment

TABLE_COLUMNS = ("accuracy", "nbp", "bp", "nbr", "br", "ac1", "ac3")


def metrics_rows(metrics: dict, models=("bmeg", "gnn", "svm")) -> list[dict]:
    """The thesis's table: one row per model."""
    names = {"bmeg": "B-MEG (routed)", "svm": "SVM (per trace)", "gnn": "GNN only"}
    return [{"model": names[m], **{c.upper(): metrics[m][c] for c in TABLE_COLUMNS}} for m in models]


@click.command("train")
@click.option("--recipe", default=None,
              help="Training recipe: a YAML file, or a shipped name (socialnet, socialnet-mitigation, ...); "
                   "options given here override it.")
# The options default to None, "not given": the recipe's value, else the library's default (shown).
@click.option("--dataset", default=None, help=f"Topology name or dataset folder [default: {TrainConfig.dataset}].")
@click.option("--traces", type=int, default=None, help=f"Traces to generate [default: {TrainConfig.traces}].")
@click.option("--imbalance", type=float, default=None,
              help=f"Bottlenecked : normal traces [default: {TrainConfig.imbalance}].")
@click.option("--scenario", default=None, help=f"Scenario name or YAML file [default: {TrainConfig.scenario}].")
@click.option("--epochs", type=int, default=None, help=f"[default: {FitConfig.epochs}]")
@click.option("--features", type=click.Choice(VARIANTS), default=None, help=f"[default: {TrainConfig.features}]")
@click.option("--loss", type=click.Choice(LOSSES), default=None, help=f"[default: {FitConfig.loss}]")
@click.option("--device", default=None, help=f"auto, cpu, cuda, cuda:1, ... [default: {FitConfig.device}]")
@click.option("--nproc", type=int, default=None,
              help=f"Processes for distributed training on this machine [default: {FitConfig.nproc}]; across "
                   "machines, start `bmeg train` with torchrun instead (python -m torch.distributed.run ... -m bmeg train).")
@click.option("--seed", type=int, default=None, help=f"[default: {TrainConfig.seed}]")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Run directory (default: the cache).")
@json_option
def train(recipe, dataset, traces, imbalance, scenario, epochs, features, loss, device, nproc, seed, out, as_json) -> None:
    """Train both GNN stages and the SVM, evaluate on the held-out 20%, save the run.

    Started by torchrun, the processes train together (DDP) and only rank 0 saves and prints."""
    from bmeg.models.detector import default_run_dir
    from bmeg.training.pipeline import load_recipe, run
    from bmeg.training.trainer import is_main_process, torchrun_group

    overrides = _given(dataset=dataset, traces=traces, imbalance=imbalance, scenario=scenario, features=features, seed=seed)
    fit = _given(epochs=epochs, loss=loss, device=device, nproc=nproc) | {"progress": not as_json}
    try:
        config = load_recipe(recipe, **overrides, fit=fit) if recipe else TrainConfig(**overrides, fit=FitConfig(**fit))
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    out = out or default_run_dir(Path(config.dataset).name)
    if config.fit.nproc > 1 and torchrun_group() is not None:
        raise click.UsageError("under torchrun, start more processes with its --nproc-per-node, not --nproc")
    _, metrics = run(config, out)
    if not is_main_process():
        return
    if as_json:
        print_json(metrics)
        return
    print_table(metrics_rows(metrics), title=f"Held-out test ({metrics['test_traces']} traces, "
                                             f"{metrics['test_anomalous']} bottlenecked)")
    click.echo(f"run saved to {out} (model.pt, metrics.json, plots)")


def _given(**options) -> dict:
    """The options given on the command line (not None)."""
    return {name: value for name, value in options.items() if value is not None}


@click.command("diagnose")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--model", "run_dir", type=click.Path(path_type=Path), default=None, help="Run directory of `bmeg train`.")
@click.option("--format", "input_format", default=None, help="Input format (default: detected).")
@click.option("--window", is_flag=True, help="Also rank services over all the traces given: against the normal "
              "traces a `bmeg bootstrap` run keeps (or --normal), else by the mean node score (the output's "
              "window_method says which).")
@click.option("--normal", "normal_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="Traces of a fault-free period of the same application: the window's ranking compares "
                   "with it (bmeg's ranker, as `bmeg evaluate rca` measures it). Implies --window.")
@click.option("--since", "since", default=None, metavar="TIME",
              help="Diagnose only the traces begun from TIME on (ISO 8601, UTC unless it says; or Unix "
                   "seconds), as a window ranked against the latest 300 earlier traces of SOURCE (within "
                   "60 s), as the server ranks a window against the traffic before it. Implies --window.")
@json_option
def diagnose(source: Path, run_dir: Path | None, input_format: str | None, window: bool, normal_path: Path | None,
             since: str | None, as_json: bool) -> None:
    """Diagnose the traces in SOURCE (a file or a folder of trace files)."""
    import bmeg
    from bmeg.models.checkpoint import CheckpointError
    from bmeg.traces import TraceInputError
    from bmeg.traces.io import read_spans

    try:
        normal = None if normal_path is None else read_spans(normal_path, format=input_format)
        diagnosis = bmeg.diagnose(read_spans(source, format=input_format), model=run_dir, window=window, normal=normal,
                                  since_ns=None if since is None else _time_ns(since))
    except (CheckpointError, TraceInputError) as error:
        raise click.ClickException(str(error)) from error
    if as_json:
        print_json(diagnosis.model_dump(mode="json"))
        return
    print_diagnosis(diagnosis)


def _time_ns(text: str) -> int:
    """Unix seconds or an ISO 8601 time (UTC when it names no zone), in nanoseconds."""
    from datetime import UTC, datetime, timedelta
    from decimal import Decimal, InvalidOperation

    try:
        ns = int(Decimal(text) * 10**9)  # exact: a float has no nanoseconds left at today's seconds
    except (InvalidOperation, ValueError, OverflowError):  # not a number, NaN, infinity
        try:
            moment = datetime.fromisoformat(text)
        except ValueError as error:
            raise click.BadParameter(f"{text!r} is neither Unix seconds nor an ISO 8601 time",
                                     param_hint="--since") from error
        since_epoch = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)) - datetime(1970, 1, 1, tzinfo=UTC)
        ns = since_epoch // timedelta(microseconds=1) * 1000
    if not 0 <= ns < 2**63:  # span times are int64 nanoseconds since 1970 (to the year 2262)
        raise click.BadParameter(f"{text!r} is outside 1970-2262, the span times' range", param_hint="--since")
    return ns


def print_diagnosis(diagnosis) -> None:
    rows = [
        {
            "trace": trace.trace_id[:16], "spans": trace.spans, "total_ms": trace.total_us / 1e3,
            "anomalous": "yes" if trace.anomalous else "no", "score": trace.anomaly_score, "model": trace.model,
            "top services": ", ".join(f"{s.service} ({s.score:.2f})" for s in trace.bottlenecks[:3]),
            "mitigation": "; ".join(f"{hint.action} {hint.service}" for hint in trace.mitigations),
        }
        for trace in diagnosis.traces
    ]
    print_table(rows, title=f"Diagnosis by {diagnosis.model_version}")
    if diagnosis.ranking:
        print_table([s.model_dump() for s in diagnosis.ranking[:10]],
                    title=f"Services over the window ({WINDOW_METHOD_WORDS[diagnosis.window_method or '']})")
    health = diagnosis.window_health
    if health is not None:
        verdict = "healthy: nothing changed, no bottleneck" if health.healthy else "changed"
        click.echo(f"Window {verdict} (largest time shift {health.time_shift:.2f} log2 at {health.service}, "
                   f"bound {health.time_bound:.2f}; call-gap lead {health.gap_lead:.2f}, bound {health.gap_bound:.2f}; "
                   f"structure {health.structure_excess:.2f}, bound {health.structure_bound:.2f})")


#: How `print_diagnosis` names each `Diagnosis.window_method`.
WINDOW_METHOD_WORDS = {
    "normal-period": "ranked against the normal period",
    "recent-traffic": "ranked against the traffic just before it",
    "mean-node-score": "by the mean node score: no normal traces; give --normal or a `bmeg bootstrap` run",
    "": "",
}


@click.group("experiment")
def experiment() -> None:
    """Experiments of the thesis, reproduced."""


@experiment.command("imbalance")
@click.option("--dataset", "datasets", multiple=True, default=[TrainConfig.dataset], show_default=True)
@click.option("--ratios", default=",".join(map(str, DEFAULT_RATIOS)), show_default=True,
              help="Comma-separated imbalance ratios.")
@click.option("--traces", type=int, default=DEFAULT_TRACES, show_default=True, help="Traces per dataset.")
@click.option("--epochs", type=int, default=FitConfig.epochs, show_default=True)
@click.option("--scenario", default=TrainConfig.scenario, show_default=True)
@click.option("--loss", type=click.Choice(LOSSES), default=FitConfig.loss, show_default=True)
@click.option("--seed", type=int, default=TrainConfig.seed, show_default=True)
@json_option
def imbalance(datasets, ratios: str, traces: int, epochs: int, scenario: str, loss: str, seed: int, as_json: bool) -> None:
    """B-MEG vs the SVM at each imbalance ratio, next to the thesis's figures."""
    values = [float(value) for value in ratios.split(",")]
    rows = imbalance_experiment(datasets, values, traces, epochs, seed=seed, progress=not as_json,
                                scenario=scenario, loss=loss)
    if as_json:
        print_json(rows)
    else:
        print_table([{k: v for k, v in row.items() if k != "router"} for row in rows],
                    title="Imbalance experiment (held-out 20%)")
        for row in rows:
            if row["router"]:
                click.echo(f"router, {row['dataset']} {row['imbalance']:g}: {row['router']}")


@click.command("demo")
@click.option("--traces", type=int, default=None, help="Training traces (default: the dataset default).")
@click.option("--epochs", type=int, default=FitConfig.epochs, show_default=True)
def demo(traces: int | None, epochs: int) -> None:
    """The main job: simulate socialnet, train, evaluate, and diagnose fresh faulty traces."""
    import bmeg
    from bmeg.datasets.loader import load_dataset
    from bmeg.models.detector import default_run_dir
    from bmeg.training import train as run_training

    out = default_run_dir("socialnet")
    options = {"traces": traces} if traces else {}
    detector, metrics = run_training("socialnet", out=out, epochs=epochs, **options)
    print_table(metrics_rows(metrics), title="socialnet: held-out test")
    click.echo(f"run saved to {out}")
    fresh = load_dataset("socialnet", traces=400, imbalance=0.3, seed=12345)
    click.echo("diagnosing 5 freshly simulated faulty and 3 normal traces:")
    print_diagnosis(bmeg.diagnose(fresh.sample(anomalous=5, normal=3), model=detector, window=True))
