"""Record the shop (`shop.py`) under real faults: fault-free traffic to bootstrap from, healthy
traffic at rest and with the other core busy, then one fault at a time.

    python testbed/shop/record.py --out DIR [--rate 30] [--seed 0] [--normal-seconds 120]

Starts Redis, the project's OpenTelemetry Collector (`scripts/otelcol.sh`; OTLP/HTTP in, the
batch processor, the file exporter out, defaults otherwise), the nine services, each in its own
cgroup v1 `cpu` cgroup with a quota of 0.5 core, pinned to CPU 0 or 1 in turn, and in front of each
the socialnet testbed's delay proxy (`testbed/build.sh`'s `socialnet proxy`: every caller, and the
load, reach a service through it); then the open-loop load. The faults are the socialnet testbed's
mechanisms (`bmeg.faultinject.testbed.faults`): `cpu_contention`, a one-core `stress-ng` hog inside
the target's cgroup with `factor - 1` times its weight; `cpu_consumed`, the target's quota cut to
`capacity` x its recent use (`bmeg.faultinject.cpu.saturation_quota`); `network_delay`, the target's
proxy delaying each request into it by `delay_ms` (± `jitter_ms`); `exception` and `return`, code
faults switched on one operation (`shop.py`'s `/_admin/fault`). Writes, in DIR: `spans.parquet` (every span),
`normal.parquet` (the fault-free period's traces), `healthy-rest.parquet`, `healthy-busy.parquet`,
`fault_list.json` (Nezha's format, as `bmeg evaluate rca --faults` reads it) and `recording.json`
(the phases, the faults with their parameters, the load's answers), and `dataset/`: the
faults' phase labelled per trace and per node by the socialnet testbed's rule (`write_dataset`).
Everything it starts lives in
the cgroup tree `bmeg-shop-<port base>` and is stopped and removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bmeg.faultinject.cpu import CFS_PERIOD_US, saturation_quota
from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.campaign import INJECT_TYPES, LABELLED_FILES, label_counts, label_recording, write_labelled
from bmeg.faultinject.testbed.collector import collector_binary, read_collector_spans
from bmeg.faultinject.testbed.faults import admin_post, hog_quota, spawn_hog
from bmeg.faultinject.testbed.labels import AppliedFault
from bmeg.faultinject.testbed.stores import wait_port
from bmeg.faultinject.testbed.supervisor import build_binary
from bmeg.traces.schema import traces_begun_between

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import shop  # noqa: E402 (the application's own module, beside this script)

QUOTA_CORES = 0.5
#: operations a code fault breaks: one or two per service that serves more than the front end
CODE_OPERATIONS = ("list_products", "get_product", "get_cart", "convert", "list_recommendations",
                   "get_quote", "charge", "send_confirmation")
COLLECTOR_CONFIG = """\
receivers:
  otlp:
    protocols:
      http: {{endpoint: "127.0.0.1:{http}"}}
processors:
  batch: {{}}
exporters:
  file: {{path: "{spans}", format: proto, flush_interval: 500ms}}
service:
  telemetry: {{logs: {{level: warn}}, metrics: {{level: none}}}}
  pipelines:
    traces: {{receivers: [otlp], processors: [batch], exporters: [file]}}
"""
#: each fault kind's source, as the socialnet testbed's labels name them (its fault list's names, read back)
SOURCES = {kind: source for source, kind in INJECT_TYPES.items()} | {"return": "code"}
#: seconds over which a service's CPU use is measured before a fault (its clock ticks are 10 ms)
DEMAND_S = 4.0
#: the SDK's export delay (5 s), the Collector's batch (200 ms) and file flush (500 ms), and spare
FLUSH_S = 7.0


@dataclass
class Fault:
    service: str
    kind: str  # Nezha's inject_type: cpu_contention, cpu_consumed, network_delay, exception, return
    parameters: dict
    start_ns: int = 0
    end_ns: int = 0


class Shop:
    """The running shop: its processes and cgroups, under one port base."""

    def __init__(self, base: int, run: Path):
        self.base, self.run = base, run
        self.group = system.cgroup_path(f"bmeg-shop-{base}")
        self.records: dict[str, system.ProcessRecord] = {}

    def port(self, service: str) -> int:
        return self.base + shop.SERVICES.index(service)

    def proxy(self, service: str) -> int:
        """The port of the delay proxy in front of `service` (its callers' and the load's address)."""
        return self.base + 20 + shop.SERVICES.index(service)

    def proxy_admin(self, service: str) -> str:
        return f"127.0.0.1:{self.base + 40 + shop.SERVICES.index(service)}"

    def cgroup(self, name: str) -> Path:
        return self.group / name

    def start(self) -> None:
        system.kill_cgroup_tree(self.group)  # what a killed run left
        system.make_cgroup(self.group, None, CFS_PERIOD_US)
        logs = self.run / "logs"
        redis_port, http_port = self.base + 60, self.base + 91
        system.make_cgroup(self.cgroup("stores"), None, CFS_PERIOD_US)
        self.records["redis"] = system.spawn("redis", "store", [
            "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            logs / "redis.log", cpu=1, cgroup=self.cgroup("stores"))
        wait_port(redis_port, 30, "Redis", self.records["redis"].alive)
        config = self.run / "otelcol.yaml"
        config.write_text(COLLECTOR_CONFIG.format(http=http_port, spans=self.spans_file))
        self.records["collector"] = system.spawn("collector", "collector", [collector_binary(), "--config", str(config)],
                                                 logs / "collector.log", cgroup=self.cgroup("stores"))
        wait_port(http_port, 60, "the OpenTelemetry Collector", self.records["collector"].alive)
        binary = build_binary()
        system.make_cgroup(self.cgroup("proxies"), None, CFS_PERIOD_US)
        for service in shop.SERVICES:
            self.records[f"proxy:{service}"] = system.spawn(f"proxy:{service}", "proxy", [
                binary, "proxy", "--listen", f"127.0.0.1:{self.proxy(service)}",
                "--upstream", f"127.0.0.1:{self.port(service)}", "--admin", self.proxy_admin(service)],
                logs / f"proxy-{service}.log", cgroup=self.cgroup("proxies"))
        peers = ",".join(f"{s}=127.0.0.1:{self.proxy(s)}" for s in shop.SERVICES)
        for index, service in enumerate(shop.SERVICES):
            system.make_cgroup(self.cgroup(service), QUOTA_CORES, CFS_PERIOD_US)
            env = {"PATH": "/usr/bin:/bin", "OTEL_SERVICE_NAME": service,
                   "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}"}
            self.records[service] = system.spawn(service, "service", [
                sys.executable, str(HERE / "shop.py"), "serve", service, "--port", str(self.port(service)),
                "--peers", peers, "--redis", f"127.0.0.1:{redis_port}"], logs / f"{service}.log",
                cpu=index % 2, cgroup=self.cgroup(service), env=env)
        for service in shop.SERVICES:
            wait_port(self.port(service), 60, service, self.records[service].alive)
            wait_port(self.proxy(service), 10, f"the proxy of {service}", self.records[f"proxy:{service}"].alive)

    @property
    def spans_file(self) -> Path:
        return self.run / "spans.otlp"

    def load(self, seconds: float, rate: float, seed: int) -> system.ProcessRecord:
        system.make_cgroup(self.cgroup("load"), None, CFS_PERIOD_US)  # in the tree: `stop` ends it on a failure too
        record = system.spawn(f"load-{seed}", "load", [
            sys.executable, str(HERE / "shop.py"), "load", "--target", f"127.0.0.1:{self.proxy(shop.ENTRY)}",
            "--rate", str(rate), "--seconds", str(seconds), "--seed", str(seed)], self.run / "logs" / "load.log",
            cgroup=self.cgroup("load"))
        self.records[record.name] = record
        return record

    def stop(self) -> None:
        proxies = [f"proxy:{service}" for service in shop.SERVICES]
        for name in [*shop.SERVICES, *proxies, "collector", "redis"]:  # services first: their SDKs flush on SIGTERM
            if name in self.records:
                system.stop(self.records[name], timeout_s=10)
        system.kill_cgroup_tree(self.group)
        system.remove_cgroup_tree(self.group)


# --- faults --------------------------------------------------------------------------------


def plan_faults(seed: int, limit: int | None = None) -> list[Fault]:
    """Every service's two CPU faults and network delay (not the entry's), and the code faults, shuffled by `seed`."""
    rng = random.Random(seed)
    faults = []
    for service in shop.SERVICES:  # the socialnet testbed's strengths (campaigns/testbed-dataset-single.yaml)
        faults.append(Fault(service, "cpu_contention", {"factor": round(rng.uniform(15, 25), 2)}))
        faults.append(Fault(service, "cpu_consumed", {"capacity": round(rng.uniform(0.25, 0.45), 3)}))
        if service != shop.ENTRY:  # the load is not traced: no span would see a delay into the entry
            faults.append(Fault(service, "network_delay", {"delay_ms": round(rng.uniform(20, 50), 1),
                                                           "jitter_ms": round(rng.uniform(0, 5), 1)}))
    for operation in CODE_OPERATIONS:
        faults.append(Fault(shop.SERVES[operation], rng.choice(["exception", "return"]), {"operation": operation}))
    rng.shuffle(faults)
    return faults[:limit] if limit else faults


def apply(bed: Shop, fault: Fault, seconds: float, demand_cores: float) -> dict:
    """Start `fault` (`demand_cores`: the target's CPU use just before); what `undo` needs to end it."""
    target = bed.cgroup(fault.service)
    if fault.kind == "cpu_contention":
        quota = system.quota_cores(target)
        system.set_quota(target, hog_quota(quota))
        cpu = bed.records[fault.service].cpu
        assert cpu is not None, "Shop.start pins every service"
        record = spawn_hog(f"hog-{fault.service}", target / "hog", fault.parameters["factor"], cpu, int(seconds) + 30,
                           bed.run / "logs" / "hogs.log")
        return {"hog": record, "quota": quota}
    if fault.kind == "cpu_consumed":
        quota = system.quota_cores(target)
        cores, period = saturation_quota(fault.parameters["capacity"], demand_cores)
        fault.parameters["cut_cores"] = round(cores, 5)
        system.set_period(target, period)
        system.set_quota(target, cores)
        return {"quota": quota}
    if fault.kind == "network_delay":
        admin_post(bed.proxy_admin(fault.service), "/_admin/delay",
                   {"ms": fault.parameters["delay_ms"], "jitter_ms": fault.parameters["jitter_ms"]})
        return {}
    mode = "error" if fault.kind == "exception" else "return"
    admin_post(f"127.0.0.1:{bed.port(fault.service)}", "/_admin/fault", {"operation": fault.parameters["operation"], "mode": mode})
    return {}


def demand(bed: Shop, service: str, seconds: float) -> float:
    """The CPU `service` uses per second over the next `seconds` (its share of the load now)."""
    target = bed.cgroup(service)
    used, began = system.cpu_usage_s(target), time.monotonic()
    time.sleep(seconds)
    return (system.cpu_usage_s(target) - used) / (time.monotonic() - began)


def undo(bed: Shop, fault: Fault, state: dict) -> None:
    target = bed.cgroup(fault.service)
    if "hog" in state:
        system.stop(state["hog"], timeout_s=2)
        system.remove_cgroup_tree(target / "hog")
    if "quota" in state:
        system.set_period(target, CFS_PERIOD_US)
        system.set_quota(target, state["quota"])
    if fault.kind == "network_delay":
        admin_post(bed.proxy_admin(fault.service), "/_admin/delay", {"ms": 0})
    if fault.kind in ("exception", "return"):
        admin_post(f"127.0.0.1:{bed.port(fault.service)}", "/_admin/fault", {"operation": fault.parameters["operation"], "mode": None})


# --- the recording -------------------------------------------------------------------------


def record(out: Path, rate: float, seed: int, normal_s: float, healthy_s: float, fault_s: float,
           gap_s: float, faults: list[Fault], warmup_s: float = 10.0, base: int = 23000) -> dict:
    """Run the phases and `faults` in turn; write the recording into `out` and return its summary."""
    out.mkdir(parents=True, exist_ok=True)
    bed = Shop(base, out)
    total_s = warmup_s + normal_s + 2 * healthy_s + len(faults) * (fault_s + gap_s) + 5.0
    phases: dict[str, list[int]] = {}
    bed.start()
    try:
        load = bed.load(total_s, rate, seed)
        time.sleep(warmup_s)
        phases["normal"] = timed(normal_s)
        phases["healthy-rest"] = timed(healthy_s)
        busy = system.spawn("busy", "hog", ["stress-ng", "--cpu", "1", "--cpu-method", "int64", "--taskset", "0",
                                            "--timeout", f"{int(healthy_s) + 5}s", "--quiet"], out / "logs" / "busy.log")
        phases["healthy-busy"] = timed(healthy_s)
        system.stop(busy, timeout_s=2)
        time.sleep(gap_s)
        for fault in faults:
            # the last DEMAND_S of the gap before each fault measure the target's use (the quota cut's base)
            used = demand(bed, fault.service, DEMAND_S)
            fault.start_ns = time.time_ns()
            state = apply(bed, fault, fault_s, used)
            fault.parameters["demand_cores"] = round(used, 5)
            time.sleep(max(0.0, fault_s - (time.time_ns() - fault.start_ns) / 1e9))
            undo(bed, fault, state)
            fault.end_ns = time.time_ns()
            time.sleep(max(0.0, gap_s - DEMAND_S))
        while load.alive():
            time.sleep(0.5)
        time.sleep(FLUSH_S)
        answers = Path(load.log).read_text().strip().splitlines()[-1:]
    finally:
        bed.stop()
    return write(out, read_collector_spans(bed.spans_file), phases, faults, answers, rate, seed)


def timed(seconds: float) -> list[int]:
    start = time.time_ns()
    time.sleep(seconds)
    return [start, time.time_ns()]


def write(out: Path, spans: pa.Table, phases: dict[str, list[int]], faults: list[Fault], answers: list[str],
          rate: float, seed: int) -> dict:
    pq.write_table(spans, out / "spans.parquet")
    for phase, (start, end) in phases.items():
        pq.write_table(traces_begun_between(spans, start, end), out / f"{phase}.parquet")
    fault_list: dict[str, list[dict]] = {}
    for fault in faults:
        hour = time.strftime("%Y-%m-%d %H", time.gmtime(fault.start_ns / 1e9))
        fault_list.setdefault(hour, []).append({
            "inject_timestamp": f"{fault.start_ns / 1e9:.3f}", "end_timestamp": f"{fault.end_ns / 1e9:.3f}",
            "inject_pod": f"{fault.service}-shop-0", "inject_type": fault.kind, **fault.parameters})
    (out / "fault_list.json").write_text(json.dumps(fault_list, indent=1))
    summary = {"rate": rate, "seed": seed, "spans": spans.num_rows,
               "traces": len(pc.unique(spans["trace_id"])), "phases": phases,
               "faults": [asdict(f) for f in faults], "load_answers": json.loads(answers[0]) if answers else None}
    (out / "recording.json").write_text(json.dumps(summary, indent=1))
    write_dataset(out, spans, summary)
    return summary


def write_dataset(out: Path, spans: pa.Table, summary: dict) -> dict:
    """The recording labelled per trace and per node by the socialnet testbed's rule
    (`bmeg.faultinject.testbed.labels`), as a dataset in `out/dataset` (`bmeg.datasets` reads it;
    `bench/healthy.py --dataset` scores stage 1 on it): calibrated on the normal period, whose
    traces are its `normal.parquet`; its traces are those of the faults' phase (the healthy periods
    are left out: they are `healthy-*.parquet`), each fault its own episode. Returns its card."""
    phases, faults = summary["phases"], summary["faults"]
    faults_began = phases["healthy-busy"][1]
    labelled = pa.concat_tables([traces_begun_between(spans, *phases["normal"]),
                                 traces_begun_between(spans, faults_began)])
    applied = [AppliedFault(i, f["service"], SOURCES[f["kind"]], "single", f["start_ns"], f["end_ns"],
                            {"inject_type": f["kind"], **f["parameters"]}) for i, f in enumerate(faults)]
    episode_s = (faults[1]["start_ns"] - faults[0]["start_ns"]) / 1e9 if len(faults) > 1 else 1.0
    recording = label_recording(labelled, applied, phases["normal"][1], episode_s)
    write_labelled(out / "dataset", recording, applied)
    card = {"name": f"shop-n{recording.traces.num_rows}-s{summary['seed']}", "backend": "shop",
            "topology": {"name": "shop", "services": list(shop.SERVICES), "rate": summary["rate"]},
            **label_counts(recording, applied), "seed": summary["seed"], "files": LABELLED_FILES}
    (out / "dataset" / "dataset.json").write_text(json.dumps(card, indent=2))
    return card


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=30.0, help="requests/s into the frontend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--normal-seconds", type=float, default=120.0)
    parser.add_argument("--healthy-seconds", type=float, default=60.0, help="each of the two healthy periods")
    parser.add_argument("--fault-seconds", type=float, default=15.0)
    parser.add_argument("--gap-seconds", type=float, default=15.0)
    parser.add_argument("--faults", type=int, default=None, help="only the first N faults of the plan")
    parser.add_argument("--port-base", type=int, default=23000)
    parser.add_argument("--label-only", action="store_true",
                        help="label the recording already in --out again (its dataset/), recording nothing")
    args = parser.parse_args()
    if args.label_only:
        try:
            summary = json.loads((args.out / "recording.json").read_text())
            spans = pq.read_table(args.out / "spans.parquet")
        except (OSError, ValueError, pa.ArrowInvalid) as error:  # missing, unreadable or malformed
            parser.error(f"--label-only needs a recording made by this script in {args.out}: {error}")
        try:
            card = write_dataset(args.out, spans, summary)
        except (KeyError, TypeError, IndexError) as error:
            parser.error(f"{args.out / 'recording.json'} is not a recording this script wrote (no {error})")
        print(json.dumps({k: card[k] for k in ("traces", "anomalous_traces", "exposed_traces", "fault_sources")}))
        return
    if subprocess.run(["which", "stress-ng", "redis-server"], capture_output=True).returncode:
        parser.error("needs stress-ng and redis-server (scripts/apt-install.sh installs them)")
    summary = record(args.out, args.rate, args.seed, args.normal_seconds, args.healthy_seconds, args.fault_seconds,
                     args.gap_seconds, plan_faults(args.seed, args.faults), base=args.port_base)
    print(json.dumps({k: summary[k] for k in ("spans", "traces", "load_answers")}))


if __name__ == "__main__":
    main()
