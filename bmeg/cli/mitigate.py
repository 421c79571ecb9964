"""`bmeg mitigate`: the mitigation controller.

  bmeg mitigate --sim socialnet --scenario FILE [--json]     closed loop on the simulator
  bmeg mitigate --testbed socialnet --scenario NAME [--json] closed loop on the real testbed (root)
  bmeg mitigate --kubeconfig PATH --bootstrap HOST:PORT      on a cluster, fed by Kafka diagnoses
  bmeg mitigate --in-cluster --bootstrap HOST:PORT           the same from a pod (mitigation/controller.yaml)
                [--leader-elect]                             ... by the replica holding the Lease only
  bmeg mitigate rbac --topology APP --namespace NS           the controller's Role, from the topology
  bmeg mitigate plan DIAGNOSIS.json [--telemetry FILE]       decisions for one diagnosis
  bmeg mitigate log [--json]                                 the audit log
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from bmeg.cli.output import json_option, print_json, print_table


@click.group(invoke_without_command=True)
@click.option("--sim", "application", help="Run the closed loop on this simulated application (e.g. socialnet).")
@click.option("--testbed", "testbed_app", type=click.Choice(["socialnet"]),
              help="Run the closed loop on the real testbed (started if it does not run, stopped after).")
@click.option("--scenario", help="--sim: a scenario file, or the name of one shipped in bmeg/mitigation/scenarios/; "
                                 "--testbed: saturation, interference or misconfiguration.")
@click.option("--arms", default="none,bmeg,hpa", show_default=True,
              help="--testbed: the runs, in order: none (no mitigation), bmeg (the controller), hpa (CPU scaler); "
                   "an arm may repeat (none,bmeg,bmeg,none: alternated arms meet the machine's load alike).")
@click.option("--fault-s", default=45.0, show_default=True, help="--testbed: seconds each run's fault lasts.")
@click.option("--normal-s", default=15.0, show_default=True, help="--testbed: seconds of normal load before each fault.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True),
              help="--testbed: load in requests/s when the testbed is started here (default 50).")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Trained detector run directory for --sim (default: the slowest-leaf rule); "
                   "train one with `bmeg train --recipe socialnet-mitigation --out RUN`.")
@click.option("--window", "window_s", type=float,
              help="Seconds per control window (default 2.5 with --sim, 4 with --testbed): shorter reacts "
                   "sooner, on fewer traces per diagnosis.")
@click.option("--seed", default=0, show_default=True)
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Act on the cluster of this kubeconfig, fed by diagnoses from Kafka.")
@click.option("--in-cluster", is_flag=True, help="Act on the cluster this pod runs in, as its ServiceAccount.")
@click.option("--topology", "topology_name", default="socialnet", show_default=True,
              help="The application's topology (name or spec file): the only services acted on.")
@click.option("--namespace", default="socialnet", show_default=True)
@click.option("--bootstrap", default="127.0.0.1:9092", show_default=True, help="Kafka bootstrap servers.")
@click.option("--topic", default="bmeg.mitigations", show_default=True)
@click.option("--max-messages", type=int, help="Stop after this many diagnoses (default: run until stopped).")
@click.option("--apply", "apply_changes", is_flag=True, help="Really act (the default is a dry run).")
@click.option("--leader-elect", is_flag=True,
              help="Act only while holding the Lease bmeg-mitigation (run several replicas; one acts).")
@click.option("--lease-namespace", default="bmeg", show_default=True, help="Namespace of the Lease.")
@click.option("--identity", help="This replica's name in the Lease (default: $POD_NAME, else host-pid).")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Safety policy YAML (default: the shipped bmeg/mitigation/policy.yaml).")
@click.option("--audit", "audit_path", type=click.Path(dir_okay=False, path_type=Path), help="Audit log SQLite file.")
@json_option
@click.pass_context
def mitigate(ctx: click.Context, application, testbed_app, scenario, arms, fault_s, normal_s, rate, model_dir, window_s,
             seed, kubeconfig, in_cluster, topology_name, namespace, bootstrap, topic, max_messages, apply_changes,
             leader_elect, lease_namespace, identity, policy_path, audit_path, as_json) -> None:
    """Scale or retune the services a diagnosis names, safely (dry run unless --apply).

    \b
    With --sim, the closed loop on the simulator reports p95/p99 latencies (ms):
      p95_normal_ms    before the fault
      p95_fault_ms     every window that overlaps a fault, no mitigation
      p95_mitigated_ms the fault's windows after the controller's last kept action (applied
                       and not rolled back) took effect; the whole fault period when none
      p95_hpa_ms       the same for the CPU-based HPA baseline, after its last scaling
      p95_fault_period_mitigated_ms / p95_fault_period_hpa_ms   every fault window,
                       the ones before any action included
      recovery_s       seconds from the fault until the p95 stays within 1.5x of normal

    \b
    With --testbed, each run (no mitigation, bmeg, HPA) goes through the same real fault in
    turn; per run (ms, end-to-end from the traces' root spans): p95 normal, p95 over the fault,
    p95/p99 late (its second half), SLO-violation seconds (1-s p95 above 1.5x normal),
    recovery s (until every later window's p95 is within that SLO).
    """
    if ctx.invoked_subcommand is not None:
        return
    if sum(map(bool, (application, testbed_app, kubeconfig, in_cluster))) > 1:
        raise click.UsageError("give one of --sim, --testbed, --kubeconfig and --in-cluster")
    if application:
        _closed_loop(application, scenario, model_dir, window_s or 2.5, seed, policy_path, as_json)
    elif testbed_app:
        _testbed_loop(testbed_app, scenario, arms, fault_s, normal_s, rate, model_dir, window_s or 4.0, seed,
                      policy_path, as_json)
    elif kubeconfig or in_cluster:
        election = _election(identity, lease_namespace) if leader_elect else None
        _on_cluster(kubeconfig, topology_name, namespace, bootstrap, topic, max_messages, apply_changes, policy_path,
                    audit_path, as_json, election)
    else:
        click.echo(ctx.get_help())


def _policy(policy_path, **overrides):
    from bmeg.mitigation import load_policy
    from bmeg.mitigation.safety import DEFAULT_POLICY

    try:
        return load_policy(policy_path or DEFAULT_POLICY, **overrides)
    except ValueError as error:
        raise click.ClickException(str(error)) from None


def _closed_loop(application, scenario, model_dir, window_s, seed, policy_path, as_json) -> None:
    from bmeg.faultinject import SpecError, load_scenario, load_topology
    from bmeg.mitigation import load_catalogue
    from bmeg.mitigation.closed_loop import LoopSettings, run_closed_loop
    from bmeg.paths import shipped_file

    if not scenario:
        raise click.UsageError("--sim needs --scenario FILE")
    # a closed-loop scenario shipped with the controller, else a campaign name or a file
    shipped = shipped_file(scenario, "bmeg.mitigation", "scenarios")
    try:
        topology = load_topology(application)
        loaded = load_scenario(shipped or scenario)
    except SpecError as error:
        raise click.ClickException(str(error)) from None
    detector = None
    if model_dir:
        from bmeg.models.detector import Detector
        from bmeg.models.window import WindowDetector

        # a bootstrapped run ranks a window against its normal traces, a trained one by the mean node score
        detector = WindowDetector(Detector.load(model_dir, application=application))
    # the simulated minute is short: cooldown and verification are scaled to the window
    policy = _policy(policy_path, dry_run=False, cooldown_s=2 * window_s, verify_after_s=window_s, actions_per_hour=120)
    report = run_closed_loop(topology, loaded, load_catalogue(), policy, LoopSettings(window_s=window_s, seed=seed),
                             detector, progress=not as_json)
    if as_json:
        print_json(report.__dict__)
        return
    rows = [{"run": name, "p95 ms": p95, "p99 ms": p99, "from s": start, "fault period p95 ms": period, "recovery s": recovery}
            for name, p95, p99, start, period, recovery in [
                ("normal", report.p95_normal_ms, report.p99_normal_ms, None, None, None),
                ("fault, no mitigation", report.p95_fault_ms, report.p99_fault_ms, None, report.p95_fault_ms,
                 report.recovery_unmitigated_s),
                ("fault, bmeg controller", report.p95_mitigated_ms, report.p99_mitigated_ms, report.mitigated_from_s,
                 report.p95_fault_period_mitigated_ms, report.recovery_s),
                ("fault, HPA baseline", report.p95_hpa_ms, report.p99_hpa_ms, report.hpa_from_s,
                 report.p95_fault_period_hpa_ms, report.recovery_hpa_s)]]
    print_table(rows, title=f"{application} / {report.scenario} (detector: {report.detector})")
    acted = [a for a in report.actions if a["status"] != "refused"]
    print_table([{k: a.get(k) for k in ("time_s", "service", "action", "status", "detail")} for a in acted],
                title="controller actions")
    print_table([{k: a.get(k) for k in ("time_s", "service", "action", "detail")} for a in report.hpa_actions],
                title="HPA actions")


def _testbed_loop(application, scenario, arms, fault_s, normal_s, rate, model_dir, window_s, seed, policy_path,
                  as_json) -> None:
    from dataclasses import asdict

    from bmeg.faultinject.testbed.supervisor import DEFAULT_RATE, Testbed, down, up
    from bmeg.faultinject.testbed.system import TestbedError
    from bmeg.mitigation import load_catalogue
    from bmeg.mitigation.testbed import SCENARIOS, TestbedLoopSettings, report_rows, run_testbed_loop

    if scenario not in SCENARIOS:
        raise click.UsageError(f"--testbed needs --scenario, one of {', '.join(SCENARIOS)}")
    try:
        settings = TestbedLoopSettings(window_s=window_s, normal_s=normal_s, fault_s=fault_s,
                                       arms=tuple(a.strip() for a in arms.split(",") if a.strip()), seed=seed)
        bed = Testbed.default()
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    detector = None
    if model_dir:
        from bmeg.models.detector import Detector
        from bmeg.models.window import WindowDetector

        # a bootstrapped run ranks a window against its normal traces, a trained one by the mean node score
        detector = WindowDetector(Detector.load(model_dir, application=application))
    say = (lambda line: None) if as_json else (lambda line: click.echo(line, err=True))
    running = bed.state()
    started_here = running is None or not all(r.alive() for r in running.processes.values() if r.role == "service")
    try:
        if started_here:
            say(f"starting the testbed at {rate or DEFAULT_RATE:g} req/s")
            up(bed, rate=rate or DEFAULT_RATE, seed=seed)
        report = run_testbed_loop(bed, scenario, load_catalogue(), _policy(policy_path), settings, detector, say)
    except TestbedError as error:
        raise click.ClickException(str(error)) from None
    finally:
        if started_here:
            down(bed)
    if as_json:
        print_json(asdict(report))
        return
    fault = report.fault
    print_table(report_rows(report), title=f"testbed {application} / {scenario}: {fault['source']} on {fault['service']} "
                f"{fault['parameters']} at {report.rate:g} req/s, SLO p95 {report.slo_ms:g} ms (detector: {report.detector})")
    for arm in report.arms:
        acted = [a for a in arm.actions if a["status"] not in ("refused", "advice")]
        if acted:
            print_table([{k: a.get(k) for k in ("time_s", "service", "action", "status", "detail")} for a in acted],
                        title=f"{arm.arm} actions (time_s: seconds from the fault's start)")


def _topology(name: str):
    from bmeg.faultinject import SpecError, load_topology

    try:
        return load_topology(name)
    except SpecError as error:
        raise click.ClickException(str(error)) from None


def _election(identity: str | None, lease_namespace: str):
    from bmeg.mitigation.leader import Election, default_identity

    try:
        return Election(identity=identity or default_identity(), namespace=lease_namespace)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def _on_cluster(kubeconfig, topology_name, namespace, bootstrap, topic, max_messages, apply_changes, policy_path,
                audit_path, as_json, election=None) -> None:
    import signal
    import sys

    from bmeg.mitigation import ActionError, AuditLog, Controller, load_catalogue
    from bmeg.mitigation.audit import default_audit_path
    from bmeg.mitigation.feed import consume
    from bmeg.cluster.kubernetes import KubernetesExecutor, api_client

    catalogue = load_catalogue()
    services = _topology(topology_name).services
    try:
        api = api_client(kubeconfig)
    except ActionError as error:
        raise click.ClickException(str(error)) from None
    policy = _policy(policy_path, **({"dry_run": False} if apply_changes else {}))
    audit = AuditLog(audit_path or default_audit_path())
    controller = Controller(KubernetesExecutor(api, namespace, catalogue), catalogue, policy, audit, services=services)

    def act(stop=None) -> None:
        for outcomes in consume(controller, bootstrap, topic, max_messages=max_messages, stop=stop):
            for outcome in outcomes:
                row = {"service": outcome.decision.service, "action": outcome.decision.action,
                       "status": outcome.status, "detail": outcome.detail}
                click.echo(json.dumps(row) if as_json else f"{row['service']}: {row['action']} {row['status']} ({row['detail']})")

    if election is None:
        act()
        return
    from bmeg.mitigation.leader import lead

    # SIGTERM (a rolling update, a scale-in) ends leadership cleanly: the Lease is released
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    lead(api, election, act)


@mitigate.command()
@click.option("--topology", "topology_name", default="socialnet", show_default=True, help="Topology name or spec file.")
@click.option("--namespace", default="socialnet", show_default=True, help="The application's namespace.")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default: stdout).")
def rbac(topology_name: str, namespace: str, out: Path | None) -> None:
    """The controller's ServiceAccount, Roles and RoleBindings: only the verbs it uses, only on the
    topology's Deployments (and their ConfigMaps and autoscalers) by name."""
    from bmeg.mitigation import load_catalogue
    from bmeg.mitigation.rbac import controller_rbac, render

    topology = _topology(topology_name)
    text = render(controller_rbac(topology.services, namespace, load_catalogue()), topology_name, namespace)
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)


@mitigate.command()
@click.argument("diagnosis_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--telemetry", "telemetry_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON: service -> {replicas, cpu_utilization, cpu_limit_cores, parameters, replica_p95_ms}.")
@json_option
def plan(diagnosis_file: Path, telemetry_file: Path | None, as_json: bool) -> None:
    """Decide, for one diagnosis, what each bottleneck's source is and what would fix it."""
    from pydantic import ValidationError

    from bmeg.diagnosis import Diagnosis
    from bmeg.mitigation import ServiceTelemetry, load_catalogue
    from bmeg.mitigation import plan as make_plan

    try:
        diagnosis = Diagnosis.model_validate_json(diagnosis_file.read_text())
        raw = json.loads(telemetry_file.read_text()) if telemetry_file else {}
        telemetry = {service: ServiceTelemetry.model_validate(values) for service, values in raw.items()}
    except (ValidationError, ValueError) as error:
        raise click.ClickException(f"bad input: {error}") from None
    rows = [{"service": d.service, "source": d.source, "action": d.action, "confidence": d.confidence,
             "target": d.target, "reason": d.reason} for d in make_plan(diagnosis, load_catalogue(), telemetry)]
    print_json(rows) if as_json else print_table(rows, title="mitigation plan")


@mitigate.command()
@click.option("--audit", "audit_path", type=click.Path(dir_okay=False, path_type=Path), help="Audit log SQLite file.")
@click.option("--service", help="Only this service.")
@click.option("--kind", type=click.Choice(["decision", "action", "verification", "rollback", "refused", "error"]))
@click.option("--limit", type=int, help="Only the newest N records.")
@json_option
def log(audit_path: Path | None, service: str | None, kind: str | None, limit: int | None, as_json: bool) -> None:
    """Show the audit log: every decision, action, verification and rollback."""
    from bmeg.mitigation import AuditLog
    from bmeg.mitigation.audit import default_audit_path

    path = audit_path or default_audit_path()
    if not path.is_file():
        raise click.ClickException(f"no audit log at {path}")
    records = AuditLog(path).records(service=service, kind=kind, limit=limit)
    if as_json:
        print_json([record.__dict__ for record in records])
        return
    print_table([{"id": r.id, "time": _time(r.time), "kind": r.kind, "service": r.service, "action": r.action,
                  "outcome": r.outcome, "dry run": r.dry_run} for r in records], title=str(path))


def _time(seconds: float) -> str:
    import datetime

    if not math.isfinite(seconds):
        return ""
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
