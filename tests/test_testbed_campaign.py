"""End to end on the real testbed: up, one short fault of each source on one service, labels
checked against the real traces (the injected service's spans are slower or changed, the
others' are not), down, and nothing left running or changed."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from builders import running_testbed

from bmeg.faultinject.testbed.collector import read_collector_spans
from bmeg.faultinject.testbed.deployment import SERVICES, service_cpu
from bmeg.faultinject.testbed.faults import apply_fault, undo_fault
from bmeg.faultinject.testbed.labels import AppliedFault, calibrate, label, node_frame
from bmeg.faultinject.testbed.system import SOURCE_ROOT
from bmeg.faultinject.testbed.supervisor import status
from bmeg.graphs.features import self_time_ns

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (cgroups, namespaces)"),
    pytest.mark.skipif(not (SOURCE_ROOT / "testbed" / "build.sh").is_file(), reason="no testbed/build.sh"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="bash scripts/apt-install.sh redis-server ..."),
]
TARGET = "post-storage-service"  # on every read path: home and user timelines
RATE = 100.0
#: one fault of each source on the target; a pool of 1 plus a cache of 4 entries, so that the
#: misconfiguration shows at this rate (each operation takes ~1 ms: a pool of 1 alone barely queues)
FAULTS: dict[str, dict] = {
    "interference": {"factor": 20.0},
    "saturation": {"capacity": 0.4},  # 0.8x its use: on the warm testbed 0.6 left it x1.23 once (session 23)
    "network": {"delay_ms": 30.0, "jitter_ms": 2.0},
    "misconfiguration": {"pool_size": 1, "hit_ratio": 0.1},
    "background": {"pause_ms": 150.0, "every_ms": 300.0},
    "code": {"operation": "/read_posts", "error": 1.0},
}
FAULT_S, GAP_S, CALIBRATION_S = 8.0, 4.0, 15.0


@pytest.fixture(scope="module")
def bed():
    # ports of its own per process
    with running_testbed(26000 + os.getpid() % 10 * 200, "bmeg-testbed-test-", rate=RATE) as testbed:
        yield testbed


def _p95(values: np.ndarray) -> float:
    return float(np.quantile(values, 0.95)) if len(values) else float("nan")


def _share_calling_stores(frame, mask: np.ndarray) -> float:
    """The share of the target's server spans (in `mask`) that call one of its stores."""
    kind = frame.forest.spans["kind"].to_numpy(zero_copy_only=False)
    served = mask & (frame.node_service == TARGET) & (kind == "server")
    calls = mask & (frame.node_service != TARGET) & (frame.forest.parent >= 0)
    calling = np.zeros(len(served), dtype=bool)
    calling[frame.forest.parent[calls]] = True
    return float((calling & served).sum()) / max(1, int(served.sum()))


def test_each_source_changes_the_target_and_not_the_others(bed):
    state = bed.state()
    assert status(bed)["running"]
    assert set(state.demand_marks) == set(SERVICES)  # a quota is sized from the use after start-up
    began = time.time_ns()
    time.sleep(CALIBRATION_S)
    calibration_end = time.time_ns()
    applied = []
    for index, (source, parameters) in enumerate(FAULTS.items()):
        start = time.time_ns()
        apply_fault(bed, state, f"t{index}", TARGET, source, parameters, time.time() + FAULT_S)
        time.sleep(FAULT_S)
        end = undo_fault(bed, state, f"t{index}")
        assert end is not None
        applied.append(AppliedFault(index, TARGET, source, "single", start, end, parameters))
        time.sleep(GAP_S)
    assert not bed.state().faults
    time.sleep(6)  # spans flushed by the SDK's batcher (5 s) and the Collector
    spans = read_collector_spans(Path(state.spans_file))
    spans = spans.filter(pc.greater_equal(spans["start_ns"], began))
    frame = node_frame(spans)
    normal = frame.start_ns < calibration_end
    labels = label(frame, applied, calibrate(frame, normal))
    own = self_time_ns(frame.forest).astype(np.float64)
    kind = frame.forest.spans["kind"].to_numpy(zero_copy_only=False)
    report = {}
    for fault in applied:
        during = (frame.start_ns >= fault.start_ns) & (frame.start_ns < fault.end_ns) & frame.is_node
        target = during & (frame.caller_service == TARGET)
        base = normal & frame.is_node & (frame.caller_service == TARGET)
        ratio = _p95(frame.local_ns[target]) / _p95(frame.local_ns[base])
        errors = float(frame.error[target].mean())
        store_share = (_share_calling_stores(frame, target), _share_calling_stores(frame, base))
        report[fault.source] = {"target_p95_local_ratio": round(ratio, 2), "target_error_share": round(errors, 3),
                                "share_calling_stores": [round(x, 2) for x in store_share],
                                "bottleneck_nodes": int(labels.span_bottleneck[during].sum())}
        # slower, or changed: a cache too small sends reads to the stores (a pool of 1 barely
        # queues at this rate, each operation taking ~1 ms); a code fault makes error spans
        # the CPU faults at least 3x (they were asserted above 1.3x while they barely showed;
        # measured 7.9x-17x under the hog, 125x-183x under the quota)
        changed = {"misconfiguration": store_share[0] > max(0.8, store_share[1] + 0.2), "code": errors > 0.5,
                   "interference": ratio > 3.0, "saturation": ratio > 3.0}.get(fault.source, ratio > 1.3)
        assert changed, (fault.source, report)
        assert labels.span_bottleneck[target].sum() > 0, (fault.source, report)
        assert set(frame.caller_service[labels.span_bottleneck & during].tolist()) == {TARGET}
        # services the fault did not touch (for a CPU hog: those on the other CPU) keep their own
        # times: their server spans' exclusive time (a local time also holds the caller's side of
        # the call, and a caller on the hog's CPU is slowed as much as the target). A hog takes one
        # of the two cores: the unpinned processes (proxies, Collector, load) crowd onto the other,
        # so its services may slow a little too
        others = [s for s in SERVICES if s != TARGET and (fault.source != "interference" or service_cpu(s) != service_cpu(TARGET))]
        limit = 3.0 if fault.source == "interference" else 2.0
        for other in others:
            served = frame.is_node & (frame.node_service == other) & (kind == "server")
            mine, usual = during & served, normal & served
            if mine.sum() >= 20 and usual.sum() >= 20:
                # the median, with 0.5 ms of slack: unique-id's 30 us spans double with the
                # machine's scheduling noise alone, while every fault here adds milliseconds
                during_us, usual_us = np.median(own[mine]) / 1e3, np.median(own[usual]) / 1e3
                assert during_us < limit * usual_us + 500, (fault.source, other, during_us, usual_us, report)
    print(report)
