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

from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.deployment import SERVICES, service_cpu
from bmeg.faultinject.testbed.faults import apply_fault, undo_fault
from bmeg.faultinject.testbed.labels import AppliedFault, calibrate, label, node_frame
from bmeg.faultinject.testbed.state import netns_prefix
from bmeg.faultinject.testbed.system import SOURCE_ROOT
from bmeg.faultinject.testbed.supervisor import Testbed, down, status, up
from bmeg.traces import read_spans
from bmeg.traces.schema import conform

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (cgroups, namespaces)"),
    pytest.mark.skipif(not (SOURCE_ROOT / "testbed" / "build.sh").is_file(), reason="no testbed/build.sh"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="bash scripts/apt-install.sh redis-server ..."),
]
TARGET = "post-storage-service"  # on every read path: home and user timelines
FAULTS = {
    "interference": {"factor": 6.0},
    "saturation": {"capacity": 0.05},
    "network": {"delay_ms": 30.0, "jitter_ms": 2.0},
    "misconfiguration": {"pool_size": 1},
    "background": {"pause_ms": 150.0, "every_ms": 300.0},
}
FAULT_S, GAP_S = 8.0, 4.0


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    testbed = Testbed(26000 + os.getpid() % 10 * 200, tmp_path_factory.mktemp("testbed"))  # own ports per process
    try:
        up(testbed, rate=40)
        yield testbed
    finally:
        down(testbed)
    assert not testbed.group.exists()
    assert not system.list_netns(netns_prefix(testbed.base))
    assert testbed.state() is None


def test_each_source_slows_the_target_and_not_the_others(bed):
    state = bed.state()
    assert status(bed)["running"]
    began = time.time_ns()
    time.sleep(15)  # calibration
    calibration_end = time.time_ns()
    applied = []
    for index, (source, parameters) in enumerate(FAULTS.items()):
        start = time.time_ns()
        apply_fault(bed, state, f"t{index}", TARGET, source, parameters, time.time() + FAULT_S)
        time.sleep(FAULT_S)
        end = undo_fault(bed, state, f"t{index}")
        applied.append(AppliedFault(index, TARGET, source, "single", start, end, parameters))
        time.sleep(GAP_S)
    assert not bed.state().faults
    time.sleep(4)  # spans flushed by the SDK's batcher and the Collector
    spans = conform(read_spans(Path(state.spans_file), "otlp-json"))
    spans = spans.filter(pc.greater_equal(spans["start_ns"], began))
    frame = node_frame(spans)
    normal = frame.start_ns < calibration_end
    calibration = calibrate(frame, normal)
    labels = label(frame, applied, calibration)
    report = {}
    for fault in applied:
        during = (frame.start_ns >= fault.start_ns) & (frame.start_ns < fault.end_ns) & frame.is_node
        target = during & (frame.caller_service == TARGET)
        base = normal & frame.is_node & (frame.caller_service == TARGET)
        ratio = np.quantile(frame.local_ns[target], 0.95) / np.quantile(frame.local_ns[base], 0.95)
        report[fault.source] = {"target_p95_ratio": round(float(ratio), 2),
                                "bottleneck_nodes": int(labels.span_bottleneck[during].sum())}
        assert ratio > 1.5, (fault.source, report)
        assert set(frame.caller_service[labels.span_bottleneck & during].tolist()) == {TARGET}
        # services the fault did not touch (for a CPU hog: those on the other CPU) keep their local times
        others = [s for s in SERVICES if s != TARGET and (fault.source != "interference" or service_cpu(s) != service_cpu(TARGET))]
        for other in others:
            mine = during & (frame.node_service == other) & (frame.caller_service == other)
            usual = normal & (frame.node_service == other) & (frame.caller_service == other) & frame.is_node
            if mine.sum() >= 20 and usual.sum() >= 20:
                other_ratio = np.quantile(frame.local_ns[mine], 0.5) / np.quantile(frame.local_ns[usual], 0.5)
                assert other_ratio < 2.0, (fault.source, other, other_ratio)
    print(report)
