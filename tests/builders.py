"""What several test modules build: span tables, topologies, a tiny detector, hypothesis strategies.

Test modules import these from here (`from builders import ...`), never from each other.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

from bmeg.cluster.executor import Applied, ServiceState
from bmeg.diagnosis import Diagnosis, ServiceLatency, ServiceScore, TraceDiagnosis
from bmeg.faultinject import parse_topology
from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.state import netns_prefix
from bmeg.faultinject.testbed.supervisor import Testbed, down, up
from bmeg.graphs import assemble
from bmeg.graphs.rpc import rpc_view
from bmeg.traces import SPAN_SCHEMA, span_table
from bmeg.traces.schema import SPAN_KINDS, STATUS_CODES


def spans(rows, trace_id: str = "t1"):
    """A span table from (span_id, parent_id, start, duration[, kind]) rows of one trace."""
    rows = [row if len(row) == 5 else (*row, "server") for row in rows]
    return span_table(
        {
            "trace_id": [trace_id] * len(rows),
            "span_id": [row[0] for row in rows],
            "parent_id": [row[1] for row in rows],
            "service": [f"svc-{row[0]}" for row in rows],
            "operation": [f"op-{row[0]}" for row in rows],
            "start_ns": [row[2] for row in rows],
            "duration_ns": [row[3] for row in rows],
            "kind": [row[4] for row in rows],
        }
    )


def chain(trace_id: str, start_ns: list[int], duration_ns: list[int]):
    """One trace whose spans form a single chain, span i the parent of span i + 1."""
    n = len(start_ns)
    return span_table({
        "trace_id": [trace_id] * n, "span_id": [f"{i:x}" for i in range(n)],
        "parent_id": [None] + [f"{i:x}" for i in range(n - 1)], "service": ["s"] * n, "operation": ["o"] * n,
        "start_ns": start_ns, "duration_ns": duration_ns,
    })


def chain_spec(rate: float = 300, **overrides) -> dict:
    """front -> mid -> leaf, mid also reads a cache that falls through to a database."""
    spec = {
        "name": "chain",
        "workload": {"rate": rate},
        "requests": {"get": {"entry": "front:get", "weight": 1}},
        "services": {
            "front": {"cores": 2, "workers": 32, "operations": {"get": {
                "self_time": {"median_us": 200, "p99_us": 600},
                "calls": [{"call": "mid:work_server", "timeout_ms": 2000}]}}},
            "mid": {"cores": 1, "workers": 8, "operations": {"work_server": {
                "self_time": {"median_us": 300, "p99_us": 900},
                "calls": [
                    {"call": "leaf:compute"},
                    {"cache": "cache:get", "hit_ratio": 0.9, "on_miss": [{"call": "db:find"}]},
                ]}}},
            "leaf": {"cores": 1, "workers": 8, "operations": {"compute": {"self_time": {"median_us": 800, "p99_us": 2000}}}},
            "cache": {"storage": "memcached", "workers": 4, "operations": {"get": {"self_time": {"median_us": 100, "p99_us": 300}}}},
            "db": {"storage": "mongodb", "cores": 2, "workers": 16, "operations": {"find": {"self_time": {"median_us": 1500, "p99_us": 4000}}}},
        },
    }
    spec.update(overrides)
    return spec


# A three-service shop: web calls cart and pay (the feature tests simulate faults on it)
SHOP_SPEC = {
    "name": "shop",
    "workload": {"rate": 100},
    "requests": {"buy": {"entry": "web:buy", "weight": 1}},
    "services": {
        "web": {"cores": 4, "workers": 64, "operations": {"buy": {
            "self_time": {"median_us": 300, "sigma": 0.3},
            "calls": [{"call": "cart:get"}, {"call": "pay:charge"}]}}},
        "cart": {"cores": 2, "operations": {"get": {"self_time": {"median_us": 800, "sigma": 0.3}}}},
        "pay": {"cores": 2, "operations": {"charge": {"self_time": {"median_us": 1500, "sigma": 0.3}}}},
    },
}


def chain_topology(rate: float = 300):
    return parse_topology(chain_spec(rate))


#: A short single-fault campaign for the chain topology (datasets' tests).
SCENARIO = {
    "name": "quick",
    "kind": "single",
    "duration_s": 6,
    "warmup_s": 0.5,
    "campaign": {"start_s": 1, "every_s": 2.5, "burst_s": 1.5,
                 "sources": {"interference": {"factor": [3, 5]}, "saturation": {"capacity": [0.2, 0.4]}}},
}


def star_trace(trace_id: str, leaf_us: list[int], operation: str = "op") -> dict[str, list]:
    """A root with one child per entry of `leaf_us`, run one after the other."""
    spans = {"trace_id": [], "span_id": [], "parent_id": [], "service": [], "operation": [], "start_ns": [], "duration_ns": []}
    total = sum(leaf_us) + 10
    rows = [("r", None, "front", "GET /", 0, total * 1000)]
    start = 5
    for i, us in enumerate(leaf_us):
        rows.append((f"c{i}", "r", f"svc{i}", operation, start * 1000, us * 1000))
        start += us
    for span_id, parent, service, op, begin, duration in rows:
        for key, value in zip(spans, (trace_id, f"{trace_id}-{span_id}", parent and f"{trace_id}-{parent}", service, op, begin, duration)):
            spans[key].append(value)
    return spans


def many_traces(n: int, slow: int | None = None) -> dict[str, list]:
    merged: dict[str, list] = {}
    for t in range(n):
        leaf = [100 + t % 7, 200 + t % 5, 50]
        if slow is not None and t == slow:
            leaf[1] = 5000
        for key, values in star_trace(f"t{t:04d}", leaf).items():
            merged.setdefault(key, []).extend(values)
    return merged


def tiny_detector(features: str = "full"):
    """An untrained detector over `many_traces`' services, on the `features` variant (imported
    here: torch only for its users)."""
    from bmeg.models.detector import Detector
    from bmeg.models.dgcnn import DGCNN
    from bmeg.models.features import FeatureEncoder
    from bmeg.models.gcn_node import GCNNodeClassifier
    from bmeg.models.router import Router
    from bmeg.models.svm import FirmSVM, TraceSVM, TraceVectorizer

    forest = assemble(span_table(many_traces(20)))
    encoder = FeatureEncoder(features).fit(forest)
    rng = np.random.default_rng(0)
    firm = FirmSVM().fit(rng.normal(size=(40, 2)), np.r_[np.zeros(30), np.ones(10)])
    keys = np.char.add(np.char.add(forest.spans["service"].to_numpy(zero_copy_only=False).astype(str), "\x1f"),
                       forest.spans["operation"].to_numpy(zero_copy_only=False).astype(str))
    vectorizer = TraceVectorizer().fit(keys)
    svm = TraceSVM().fit(rng.normal(size=(40, vectorizer.num_columns)), np.r_[np.zeros(30), np.ones(10)])
    return Detector(
        application="toy", encoder=encoder, dgcnn=DGCNN(encoder.num_features, k=10).eval(),
        gcn=GCNNodeClassifier(encoder.num_features).eval(), vectorizer=vectorizer, svm=svm, firm=firm,
        thresholds={"graph": 0.5, "node": 0.5, "svm": 0.5, "svm_node": 0.5}, router=Router(), firm_window=20,
        services=["front", "svc0", "svc1", "svc2"], service_baseline_us={"svc1": 200.0},
        hparams={"dgcnn": {"k": 10}, "gcn": {}}, metrics={},
    )


def sent_spans(run: str) -> pa.Table:
    """Three traces of frontend -> cart (-> its redis, named by server.address), microsecond times."""
    rows = []
    for number in range(3):
        trace_id = f"{run}{number:04x}".ljust(32, "0")[:32]
        start = 1_700_000_000_000_000_000 + number * 10_000_000
        rows += [
            dict(trace_id=trace_id, span_id=f"{number:02x}" + "01" * 7, parent_id=None, service="frontend",
                 operation="GET /cart", start_ns=start, duration_ns=9_000_000, kind="server", status="ok",
                 peer_service=None, db_system=None, instance="frontend-0"),
            dict(trace_id=trace_id, span_id=f"{number:02x}" + "02" * 7, parent_id=f"{number:02x}" + "01" * 7,
                 service="frontend", operation="cart.Get", start_ns=start + 1_000_000, duration_ns=6_000_000,
                 kind="client", status="unset", peer_service="cart", db_system=None, instance="frontend-0"),
            dict(trace_id=trace_id, span_id=f"{number:02x}" + "03" * 7, parent_id=f"{number:02x}" + "02" * 7,
                 service="cart", operation="cart.Get", start_ns=start + 2_000_000, duration_ns=4_000_000,
                 kind="server", status="error", peer_service=None, db_system=None, instance="cart-1"),
            dict(trace_id=trace_id, span_id=f"{number:02x}" + "04" * 7, parent_id=f"{number:02x}" + "03" * 7,
                 service="cart", operation="HGET", start_ns=start + 3_000_000, duration_ns=1_000,
                 kind="client", status="unset", peer_service="cart-redis", db_system="redis", instance="cart-1"),
        ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=SPAN_SCHEMA)


MAX_START = 2**62  # start + duration stays within int64


def hex_ids(size: int):
    return st.binary(min_size=size, max_size=size).map(bytes.hex)


names = st.text(st.characters(codec="utf-8"), max_size=12)


@st.composite
def span_tables(draw, time_step: int = 1) -> pa.Table:
    """Random span tables: a few traces, random hex ids, unicode names, optional nulls.
    `time_step` makes times multiples of it (1000 for Jaeger's microseconds)."""
    trace_ids = draw(st.lists(hex_ids(16), min_size=1, max_size=3))
    rows = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "trace_id": st.sampled_from(trace_ids),
                    "span_id": hex_ids(8),
                    "parent_id": st.none() | hex_ids(8),
                    "service": names,
                    "operation": names,
                    "start_ns": st.integers(1, MAX_START // time_step).map(lambda t: t * time_step),
                    "duration_ns": st.integers(0, (MAX_START - 1) // time_step).map(lambda t: t * time_step),
                    "kind": st.sampled_from(SPAN_KINDS),
                    "status": st.sampled_from(STATUS_CODES),
                    "peer_service": st.none() | names,
                    "db_system": st.none() | names,
                    "instance": st.none() | names,
                }
            ),
            max_size=12,
        )
    )
    return pa.Table.from_pylist(rows, schema=SPAN_SCHEMA)


def in_order(table: pa.Table) -> pa.Table:
    """Writers group spans (by service, by trace): compare tables as sets of rows."""
    return table.sort_by([(name, "ascending") for name in SPAN_SCHEMA.names])


class ReadOnlyDeployments:
    """An executor that only reads: every service has 2 replicas, 1 core and 512 MB (dry-run tests)."""

    def state(self, service: str) -> ServiceState:
        return ServiceState(service, 2, 1.0, 512.0, {})


def one_diagnosis() -> Diagnosis:
    trace = TraceDiagnosis(trace_id="t", spans=5, total_us=40_000, anomalous=True, anomaly_score=0.9, threshold=0.5,
                           model="gnn", bottlenecks=[ServiceScore(service="text-service", score=0.95, bottleneck=True)],
                           latencies=[ServiceLatency(service="text-service", latency_us=30_000, baseline_us=2_000, ratio=15)])
    return Diagnosis(model_version="t", application="socialnet", traces=[trace])


def assert_restricted(spec: dict) -> None:
    """The restricted Pod Security profile's rules, and resource limits, over a pod spec."""
    pod = spec.get("securityContext", {})
    assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0
    assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    assert all("hostPath" not in volume for volume in spec.get("volumes", []))
    for container in spec["containers"] + spec.get("initContainers", []):
        context = container.get("securityContext", {})
        assert context.get("allowPrivilegeEscalation") is False, container["name"]
        assert context.get("readOnlyRootFilesystem") is True, container["name"]
        assert context.get("capabilities") == {"drop": ["ALL"]}, container["name"]
        assert not context.get("privileged"), container["name"]
        assert {"cpu", "memory"} <= set(container["resources"]["limits"]), container["name"]


@contextlib.contextmanager
def running_testbed(base_port: int, prefix: str, rate: float):
    """The testbed up on ports from `base_port`, in a run dir the stores (user nobody) can reach
    (pytest's are 0700); afterwards everything it started is checked gone."""
    run = Path(tempfile.mkdtemp(prefix=prefix))
    testbed = Testbed(base_port, run)
    started: list[system.ProcessRecord] = []
    try:
        started = list(up(testbed, rate=rate).processes.values())
        yield testbed
    finally:
        final = testbed.state()
        started += list(final.processes.values()) if final else []
        down(testbed)
    assert not testbed.group.exists()
    assert not system.list_netns(netns_prefix(testbed.base))
    assert testbed.state() is None
    assert not [r.name for r in started if r.alive()]
    shutil.rmtree(run)


def mitigation_trace(i: int, service: str, ratio: float, anomalous: bool = True) -> TraceDiagnosis:
    """A trace whose one service ran `ratio` times its baseline (anomalous by default)."""
    return TraceDiagnosis(
        trace_id=f"t{i}", spans=8, total_us=20_000, anomalous=anomalous, anomaly_score=0.9 if anomalous else 0.1,
        threshold=0.5, model="gnn",
        bottlenecks=[ServiceScore(service=service, score=0.9, bottleneck=anomalous)],
        latencies=[ServiceLatency(service=service, latency_us=1000 * ratio, baseline_us=1000, ratio=ratio)],
    )


def service_diagnosis(service: str, ratios: list[float]) -> Diagnosis:
    """A diagnosis of traces through `service` at these latency ratios (above 1.5: anomalous)."""
    return Diagnosis(model_version="t", application="socialnet",
                     traces=[mitigation_trace(i, service, r, anomalous=r > 1.5) for i, r in enumerate(ratios)])


SLOW = [3.0] * 20  # every trace three times its baseline


class FakeExecutor:
    """Keeps replicas in a dict; enough to watch the controller's bookkeeping."""

    def __init__(self):
        self.replicas = {"a": 2}

    def state(self, service):
        return ServiceState(service, self.replicas[service])

    def scale(self, service, replicas):
        previous, self.replicas[service] = self.replicas[service], replicas
        return Applied(service, "scale", {"replicas": previous}, {"replicas": replicas})

    def rollback(self, applied):
        return self.scale(applied.service, applied.previous["replicas"])


FRONT_EPOCH = 1_700_000_000 * 10**9
#: `front`'s callees in the order it calls them: `svc2` first, `svc0` next, the rest only after it.
CALLEES = ["svc2", "svc0", "svc1", "svc3", "svc4", "svc5"]


def front_calling(n: int, failed: set[int] = frozenset(), returned: set[int] = frozenset(),
                   svc2_gap_us: int = 200):
    """`n` traces: `front` calls each of `CALLEES` (a client span and the callee's server span, 1 ms
    of server time). In trace i of `failed`, `svc0` raises (an error in its span and in front's call
    of it) and front makes no further call; in trace i of `returned`, front returns after `svc0` with
    no error (an early return of its own). `svc2_gap_us`: the gap of front's call of svc2."""
    rows: dict[str, list] = {name: [] for name in ("trace_id", "span_id", "parent_id", "service", "operation",
                                                   "start_ns", "duration_ns", "status")}

    def span(trace, span_id, parent, service, operation, start, duration_us, status="ok"):
        for name, value in zip(rows, (trace, span_id, parent, service, operation, start, duration_us * 1000, status)):
            rows[name].append(value)

    for i in range(n):
        start, trace = FRONT_EPOCH + i * 50_000_000, f"t{i}"
        stops = i in failed or i in returned
        span(trace, "f", None, "front", "GET /", start, 40_000, "error" if i in failed else "ok")
        for k, callee in enumerate(CALLEES[:2] if stops else CALLEES):
            gap = (svc2_gap_us if callee == "svc2" else 200) + i % 5
            status = "error" if i in failed and callee == "svc0" else "ok"
            offset = start + (100 + k * 5_000) * 1000
            span(trace, f"c{k}", "f", "front", f"call {callee}", offset, 1_000 + gap, status)
            span(trace, f"s{k}", f"c{k}", callee, "op", offset + gap // 2 * 1000, 1_000, status)
    return rpc_view(span_table(rows))


def bench_module(name: str):
    """A script of `bench/` (`name`.py) imported as a module, to test its functions."""
    path = Path(__file__).parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None, f"no bench script {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
