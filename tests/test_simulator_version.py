"""`SIMULATOR_VERSION` follows the simulator's output: the dataset and bootstrap caches are keyed
by it, so a change to the output that leaves it unbumped would reuse stale data silently (it did
once: a changed mechanic passed a warm `make test` on datasets generated before it)."""

from __future__ import annotations

import hashlib

import numpy as np

from builders import chain_topology

from bmeg.faultinject import Fault, simulate
from bmeg.faultinject.simulator import SIMULATOR_VERSION

#: The digest of the episode below, for each version it was recorded at. When the test fails
#: because the output changed: bump `SIMULATOR_VERSION` and record the new digest here.
RECORDED = {
    2: "f087e4321bf1dff6",
    # a visit takes its replica's fault from its arrival (visit_fault); the labels changed too (a
    # faulted miss of a cache that misses often when healthy no longer counts, `bmeg.faultinject.labels`)
    3: "c85ff2abf721a89c",
    # a network delay may be inbound (on the requests its service receives); the episode gained one,
    # the others' output is unchanged (without it the digest is still version 3's)
    4: "4d65489961d26569",
}


def _episode_digest() -> str:
    """A small episode with every kind of fault the simulator's mechanics treat apart (fluid and
    scheduler-shaped CPU faults, a pause, network delays of both forms), spans rounded to whole microseconds
    so that a last-bit difference in floating point is no change."""
    faults = [
        Fault("mid", "saturation", "single", 0.5, 1.0, {"quota": 0.6}),
        Fault("leaf", "saturation", "single", 0.7, 1.1, {"capacity": 0.3}),
        Fault("mid", "interference", "single", 1.3, 1.8, {"factor": 20, "slice_ms": 3}),
        Fault("leaf", "interference", "single", 1.5, 2.0, {"factor": 3}),
        Fault("mid", "background", "single", 2.1, 2.6, {"pause_ms": 50, "every_ms": 200}),
        Fault("leaf", "network", "single", 2.4, 2.8, {"delay_ms": 5}),
        Fault("mid", "network", "single", 2.5, 2.9, {"delay_ms": 4, "jitter_ms": 1, "inbound": 1}),
    ]
    result = simulate(chain_topology(), faults, 3, 0)
    digest = hashlib.sha256()
    for column in (result.span_trace, result.span_parent, result.span_service, result.span_kind, result.span_error,
                   np.round(result.span_start / 1e3), np.round(result.span_end / 1e3), result.visit_fault):
        digest.update(np.ascontiguousarray(column).astype(np.float64).tobytes())
    return digest.hexdigest()[:16]


def test_the_simulators_output_is_the_one_recorded_for_its_version():
    assert _episode_digest() == RECORDED.get(SIMULATOR_VERSION), (
        "the simulator's output changed: bump SIMULATOR_VERSION in bmeg/faultinject/simulator.py "
        "(the caches are keyed by it) and record the new digest in RECORDED")
