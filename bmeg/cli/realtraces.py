"""`bmeg twin fit`, `bmeg evaluate rca` and `bmeg bootstrap`: models and scores from real traces."""

from __future__ import annotations

from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table
from bmeg.datasets.family import CPU_FAULT_SCENARIOS, DEFAULT_CPU_FAULTS
from bmeg.faultinject.family import FamilyParams
from bmeg.models.features import BOOTSTRAP_FEATURES, NODE_INPUTS, VARIANTS
from bmeg.training.config import NODE_DRAWS, TRAINING_WINDOWS, FitConfig

format_option = click.option("--format", "input_format", default=None, help="Trace format (default: detected).")


@click.group("twin")
def twin() -> None:
    """Digital twins fitted from real traces."""


@twin.command("fit")
@click.argument("normal_traces", type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Spec YAML to write.")
@click.option("--name", default="twin", show_default=True, help="Name of the fitted topology.")
@click.option("--check-seconds", type=float, default=60.0, show_default=True,
              help="Simulate this long and compare with the traces (0: skip).")
@format_option
@json_option
def twin_fit(normal_traces: Path, out: Path, name: str, check_seconds: float, input_format: str | None,
             as_json: bool) -> None:
    """Fit a topology spec from the fault-free traces in NORMAL_TRACES (a file or a folder)."""
    from bmeg.faultinject.twin import fit_twin, twin_fidelity
    from bmeg.traces import TraceInputError
    from bmeg.traces.io import read_spans

    try:
        spans = read_spans(normal_traces, format=input_format)
        spec = fit_twin(spans, name=name, description=f"twin fitted from {normal_traces}")
    except TraceInputError as error:
        raise click.ClickException(str(error)) from error
    out.write_text(spec.to_yaml())
    summary = {"spec": str(out), "services": len(spec.services), "requests": len(spec.requests),
               "rate": spec.workload.rate}
    if check_seconds > 0:
        summary |= twin_fidelity(spans, spec, check_seconds).summary()
    if as_json:
        print_json(summary)
    else:
        print_table([{"measure": k, "value": v} for k, v in summary.items()], title=f"twin {name}")


#: How the node classifier reads the features; a bootstrap from a pretrained run must match it.
node_inputs_option = click.option(
    "--node-inputs", type=click.Choice(NODE_INPUTS), default="raw", show_default=True,
    help="How the node classifier reads its features: as they are, or through asinh (logarithmic far out: "
         "the GNN alone's latency AC@1 on the three testbed recordings it was developed on 0.79 -> 0.87, on a "
         "fresh one only 0.90 -> 0.91; on the twins' own faults 0.87 -> 0.81; docs/issue-12.md, sessions 31-32).")


@click.command("bootstrap")
@click.argument("normal_traces", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Run directory to write.")
@click.option("--traces", type=int, default=6000, show_default=True, help="Synthetic traces to train on.")
@click.option("--epochs", type=int, default=10, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--features", type=click.Choice(VARIANTS), default=BOOTSTRAP_FEATURES, show_default=True,
              help="Node features (see bmeg.models.features).")
@click.option("--held-back", type=float, default=0.25, show_default=True,
              help="Later share of the normal traces held back to calibrate stage 1 on.")
@click.option("--false-alarm-rate", type=float, default=0.01, show_default=True,
              help="Share of healthy traces stage 1 may flag.")
@click.option("--confidence", type=float, default=0.95, show_default=True,
              help="How sure the calibration must be that healthy traffic is flagged at most that often "
                   "(a binomial bound on the held-back traces; 0: their plain quantile).")
@click.option("--pretrained", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Run directory (`bmeg pretrain`) whose GNN weights training starts from.")
@click.option("--cpu-faults", type=click.Choice(sorted(CPU_FAULT_SCENARIOS)), default=DEFAULT_CPU_FAULTS, show_default=True,
              help="How the training faults slow a CPU: every burst alike (fluid), or as the kernel's scheduler "
                   "does (a CFS quota's periods, a CPU hog's time slices; with a third shard of them on the "
                   "services that call stores).")
@click.option("--hard-negatives", type=click.FloatRange(min=1.0), default=FitConfig.hard_negatives, show_default=True,
              help="How many times more the node stage's loss weighs a non-bottleneck node whose parent is a "
                   "bottleneck (its client spans; 1: as much as any other; tried at 4, not better: docs/issue-12.md, "
                   "session 12).")
@click.option("--window-gcn-windows", type=click.IntRange(min=0), default=TRAINING_WINDOWS, show_default=True,
              help="Windows simulated from the twin that the window GCN trains on (0: no window GCN; the window "
                   "ranker then fuses the per-trace GNN's ranking).")
@click.option("--node-draws", type=click.IntRange(min=1), default=NODE_DRAWS, show_default=True,
              help="Draws of the twin's training faults the node stage is bagged over: one node classifier each, "
                   "their P(bottleneck) averaged.")
@click.option("--signs/--no-signs", default=False, show_default=True,
              help="Stage 1 also flags a trace by simple per-trace signs (its end-to-end time, a changed call "
                   "pattern, an error that begins in it), each calibrated beside the model (bmeg.models.signs): "
                   "on real traces it doubled stage 1's recall, and raised false alarms between a campaign's "
                   "faults past 1% (testbed, shop under load), so it is not the default (docs/issue-12.md, "
                   "sessions 40-41).")
@node_inputs_option
@format_option
@json_option
def bootstrap(normal_traces: Path, out: Path, traces: int, epochs: int, seed: int, features: str, held_back: float,
              false_alarm_rate: float, confidence: float, pretrained: Path | None, cpu_faults: str,
              hard_negatives: float, window_gcn_windows: int, node_draws: int, signs: bool, node_inputs: str,
              input_format: str | None, as_json: bool) -> None:
    """Train a model with no labels: twin from NORMAL_TRACES, synthetic faults, training."""
    from bmeg.cli.models import metrics_rows
    from bmeg.evaluation.bootstrap import bootstrap as run_bootstrap

    try:
        _, metrics = run_bootstrap(normal_traces, out, traces=traces, epochs=epochs, seed=seed,
                                   input_format=input_format, progress=not as_json, features=features,
                                   held_back=held_back, false_alarm_rate=false_alarm_rate,
                                   confidence=confidence or None, pretrained=pretrained, cpu_faults=cpu_faults,
                                   hard_negatives=hard_negatives, window_gcn_windows=window_gcn_windows,
                                   node_draws=node_draws, node_inputs=node_inputs, signs=signs)
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    if as_json:
        print_json(metrics)
        return
    print_table(metrics_rows(metrics), title="held-out synthetic test traces (twin)")
    calibration = metrics["calibration"]
    click.echo(f"stage 1 on {calibration['healthy_traces']} held-back real healthy traces: "
               f"{calibration['flagged_before']:.1%} flagged before calibration, {calibration['flagged_after']:.1%} after")
    if not calibration["bound_met"]:
        click.echo(f"too few held-back traces to bound the false-alarm rate of each of stage 1's thresholds at "
                   f"{calibration['per_threshold_rate']:.2%} with confidence {calibration['confidence']}: each flags none "
                   "of them; hold back more")
    if "window_gcn" in metrics:
        window_gcn = metrics["window_gcn"]
        click.echo(f"window GCN trained on {window_gcn['windows']} windows simulated from the twin: its first is a "
                   f"faulty service in {window_gcn['train_top1']:.1%} of them")
    click.echo(f"run saved to {out} (twin.yaml, model, window GCN, metrics.json)")


@click.command("pretrain")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Run directory to write.")
@click.option("--apps", type=int, default=12, show_default=True, help="Random applications in the family.")
@click.option("--traces", type=int, default=3000, show_default=True, help="Synthetic traces per application.")
@click.option("--services", type=(int, int), default=FamilyParams.services, show_default=True,
              help="Range of services (stores included) an application has.")
@click.option("--depth", type=(int, int), default=FamilyParams.depth, show_default=True, help="Range of call depths.")
@click.option("--fan-out", type=(int, int), default=FamilyParams.fan_out, show_default=True,
              help="Range of calls an operation makes.")
@click.option("--epochs", type=int, default=5, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--features", type=click.Choice(VARIANTS), default=BOOTSTRAP_FEATURES, show_default=True,
              help="Node features (the bootstrap that starts from this run must use the same).")
@node_inputs_option
@json_option
def pretrain(out: Path, apps: int, traces: int, services: tuple[int, int], depth: tuple[int, int],
             fan_out: tuple[int, int], epochs: int, seed: int, features: str, node_inputs: str, as_json: bool) -> None:
    """Train the GNN on a randomised family of synthetic applications (for `bmeg bootstrap --pretrained`)."""
    from bmeg.cli.models import metrics_rows
    from bmeg.evaluation.bootstrap import pretrain_on_family

    try:
        params = FamilyParams(services=services, depth=depth, fan_out=fan_out)
        _, metrics = pretrain_on_family(out, apps=apps, traces=traces, epochs=epochs, seed=seed, params=params,
                                        features=features, node_inputs=node_inputs, progress=not as_json)
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    if as_json:
        print_json(metrics)
        return
    print_table(metrics_rows(metrics), title=f"held-out synthetic test traces ({apps} random applications)")
    click.echo(f"run saved to {out}: start a bootstrap from it with --pretrained {out}")


@click.group("evaluate")
def evaluate() -> None:
    """Score diagnosis against labelled real faults."""


@evaluate.command("rca")
@click.option("--traces", "traces_path", type=click.Path(exists=True, path_type=Path), required=True,
              help="Trace file or folder covering the faults.")
@click.option("--faults", "faults_path", type=click.Path(exists=True, path_type=Path), required=True,
              help="Fault list (Nezha's fault_list.json layout).")
@click.option("--normal", "normal_path", type=click.Path(exists=True, path_type=Path), required=True,
              help="Fault-free traces (file or folder): the normal period.")
@click.option("--model", "run_dir", type=click.Path(exists=True, path_type=Path), default=None,
              help="Run directory (default: bootstrap one from --normal, cached).")
@click.option("--window-minutes", type=float, default=2.0, show_default=True, help="Window after each injection.")
@click.option("--pod-suffix-parts", type=int, default=2, show_default=True,
              help="Dash-separated parts a pod name has after its service name (0: the pod is the service).")
@click.option("--offset-hours", type=int, default=0, show_default=True,
              help="Shift the fault list's times by whole hours (a fault list in another time zone).")
@click.option("--recent-minutes", type=float, default=None,
              help="Compare each window with the traces of this many minutes before its fault "
                   "(default: with --normal; --normal is still used where those are too few).")
@click.option("--recent-traces", type=int, default=None,
              help="Compare each window with the latest this many traces before its fault, as the REST "
                   "server ranks a window (300 there; --normal where fewer than 100).")
@click.option("--published/--no-published", default=True, show_default=True,
              help="Run RCAEval's TraceRCA and MicroRank too (when the `eval` extra is installed).")
@format_option
@json_option
def rca(traces_path: Path, faults_path: Path, normal_path: Path, run_dir: Path | None, window_minutes: float,
        pod_suffix_parts: int, offset_hours: int, recent_minutes: float | None, recent_traces: int | None,
        published: bool,
        input_format: str | None, as_json: bool) -> None:
    """Rank root-cause services after each injected fault; AC@k for bmeg and the baselines."""
    from bmeg.evaluation.bootstrap import cached_bootstrap
    from bmeg.evaluation.faults import read_fault_list
    from bmeg.evaluation.rankers import default_rankers
    from bmeg.evaluation.rca import hour_offset, report, run_rca
    from bmeg.evaluation.windows import TraceFiles
    from bmeg.graphs.rpc import rpc_view
    from bmeg.models.detector import Detector
    from bmeg.traces import TraceInputError
    from bmeg.traces.io import read_spans

    try:
        faults = read_fault_list(faults_path, pod_suffix_parts)
        normal = rpc_view(read_spans(normal_path, format=input_format))
        detector = Detector.load(run_dir or cached_bootstrap(normal_path, input_format, progress=not as_json))
        rankers = default_rankers(detector, normal, published)
        files = TraceFiles(traces_path, input_format, progress=not as_json)
        slip = hour_offset(files, faults, window_minutes)
        results = run_rca(files, faults, normal, rankers, window_minutes, progress=not as_json,
                          offset_hours=offset_hours, recent_minutes=recent_minutes, recent_traces=recent_traces)
    except (TraceInputError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    summary = report(results, [r.name for r in rankers], files, window_minutes)
    summary["time_zone_check"] = slip
    summary["method_errors"] = {r.name: errors for r in rankers if (errors := getattr(r, "errors", None))}
    if as_json:
        print_json(summary)
        return
    _print_scores(summary, f"(window {window_minutes:g} min)")
    rows = [{"type": kind, "ranker": name, **values}
            for kind, groups in summary["by_type"].items() for name, values in groups.items()]
    print_table(rows, title="by fault type")
    for skipped in summary["skipped"]:
        click.echo(f"skipped: {skipped['type']} on {skipped['service']} at {skipped['start_ns']}: {skipped['reason']}")
    if slip["hours"] and slip["hours"] != offset_hours:
        click.echo(f"time-zone slip? shifting the fault list by {slip['hours']:+d} h puts {slip['windows_over_traces']} "
                   f"fault windows over the traces, against {slip['unshifted_windows_over_traces']} unshifted: "
                   f"check the list's time zone, and pass --offset-hours {slip['hours']} if it is one")
    for name, errors in summary["method_errors"].items():
        click.echo(f"{name} failed on {len(errors)} fault(s) (counted as misses): {errors[0]}")


@evaluate.command("healthy")
@click.argument("traces", type=click.Path(exists=True, path_type=Path))
@click.option("--model", "run_dir", type=click.Path(exists=True, path_type=Path), required=True)
@format_option
@json_option
def healthy(traces: Path, run_dir: Path, input_format: str | None, as_json: bool) -> None:
    """The share of the fault-free traces in TRACES that stage 1 flags (false alarms)."""
    from bmeg.graphs.rpc import rpc_view
    from bmeg.models.detector import Detector
    from bmeg.traces import TraceInputError
    from bmeg.traces.io import read_spans
    from bmeg.training.calibration import flagged_share

    try:
        forest = rpc_view(read_spans(traces, format=input_format))
    except TraceInputError as error:
        raise click.ClickException(str(error)) from error
    summary = {"traces": forest.num_traces, "flagged_share": flagged_share(Detector.load(run_dir), forest)}
    if as_json:
        print_json(summary)
    else:
        click.echo(f"{summary['flagged_share']:.2%} of {summary['traces']} healthy traces flagged anomalous")


@evaluate.command("rca-sim")
@click.argument("topology", type=click.Path(exists=True, path_type=Path))
@click.option("--model", "run_dir", type=click.Path(exists=True, path_type=Path), required=True,
              help="Run directory (e.g. from `bmeg bootstrap`, whose twin.yaml is a TOPOLOGY).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for the simulated traces.")
@click.option("--window-seconds", type=float, default=60.0, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--published/--no-published", default=True, show_default=True)
@click.option("--cpu-faults", type=click.Choice(["fluid", "scheduler"]), default="fluid", show_default=True,
              help="How the CPU faults slow a service: every burst alike (a smaller core, a noisy neighbour), or as "
                   "the kernel's scheduler makes them (a CFS quota, a CPU hog's time slices), as the testbed injects them.")
@json_option
def rca_sim(topology: Path, run_dir: Path, out: Path, window_seconds: float, seed: int, published: bool,
            cpu_faults: str, as_json: bool) -> None:
    """The rca harness on faults simulated from TOPOLOGY (one per service and source): synthetic validation."""
    from bmeg.evaluation.faults import read_fault_list
    from bmeg.evaluation.rankers import default_rankers
    from bmeg.evaluation.rca import report, run_rca
    from bmeg.evaluation.simulated import simulated_faults
    from bmeg.evaluation.windows import TraceFiles
    from bmeg.faultinject import load_topology
    from bmeg.graphs.rpc import rpc_view
    from bmeg.models.detector import Detector

    sim = simulated_faults(load_topology(topology), out, normal_s=2 * window_seconds, window_s=window_seconds, seed=seed,
                           scheduler=cpu_faults == "scheduler")
    normal = rpc_view(sim.normal)
    rankers = default_rankers(Detector.load(run_dir), normal, published)
    files = TraceFiles(sim.traces)
    results = run_rca(files, read_fault_list(sim.fault_list, 0), normal, rankers, sim.window_minutes,
                      progress=not as_json)
    summary = report(results, [r.name for r in rankers], files, sim.window_minutes)
    if as_json:
        print_json(summary)
        return
    _print_scores(summary, "(simulated)")


def _print_scores(summary: dict, note: str) -> None:
    """The rankers' scores on the latency faults and on all faults, a table each."""
    for group in ("latency_faults", "overall"):
        rows = [{"ranker": name, **values} for name, values in summary[group].items()]
        print_table(rows, title=f"{group.replace('_', ' ')} {note}")

