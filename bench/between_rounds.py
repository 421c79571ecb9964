"""What a model flags between a fault campaign's rounds: the end of a fault still showing, or a healthy system?

    python bench/between_rounds.py --model RUN [--dataset D]   # D: a `bmeg generate --backend testbed` dataset

Replays the dataset as `bmeg diagnose` reads a file (the model's default crowd check) and, for
the traces `bench/healthy.py` counts as "between rounds" that the model flagged, prints when
they came (seconds since the previous fault's labelled end, until the next one's labelled
start), after which fault source, whether the model blamed the fault's target (the one just
ended or the next), how they gather in a few gaps, and their score against the threshold (logit
excess). Then, from the traces themselves, when each source's fault shows: the share of the
target service's visits that are slow (self-time z >= 5 against the model's normal baseline)
in 0.25-s bins around the labelled start and end, and the onset and settle gaps that rule
derives: the farthest bin before the start, and after the end, where any source's target is
slow on more than twice the share of all between-rounds visits. Last, the share the model flags
in the dataset's own fault-free calibration period (recorded just before the first fault).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from healthy import MARGIN_S, between_rounds

from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.traces.io import read_spans

SLOW_Z = 5.0
BIN_S = 0.25
EDGE_BINS = np.arange(-1.0, 1.5 + BIN_S / 2, BIN_S)


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return np.log(p) - np.log1p(-p)


def share_table(title: str, key: np.ndarray, flagged: np.ndarray, bins: list[float] | None = None) -> None:
    """Print, per value (or per [lo, hi) bin) of `key`, the traces, the flagged and their share."""
    print(title)
    groups = ([(f"[{lo:g}, {hi:g})", (key >= lo) & (key < hi)) for lo, hi in zip(bins[:-1], bins[1:])] if bins
              else [(str(value), key == value) for value in sorted(set(key.tolist()))])
    for name, chosen in groups:
        if chosen.any():
            print(f"  {name:>18} {chosen.sum():6d} traces, {flagged[chosen].sum():4d} flagged, {100 * flagged[chosen].mean():5.2f}%")


def slow_share_around(faults: list[dict], edge: str, services: np.ndarray, starts: np.ndarray, z: np.ndarray,
                      source: str) -> np.ndarray:
    """float [bins]: the share of the target's visits (nodes `services`, their traces' `starts`,
    time order, `z`) at z >= SLOW_Z per `EDGE_BINS` bin around each `source` fault's `edge`."""
    slow, visits = np.zeros(len(EDGE_BINS) - 1), np.zeros(len(EDGE_BINS) - 1)
    for fault in (f for f in faults if f["source"] == source):
        lo, hi = np.searchsorted(starts, fault[edge] + (EDGE_BINS[[0, -1]] * 1e9).astype(np.int64))
        target = services[lo:hi] == fault["service"]
        where = np.digitize((starts[lo:hi][target] - fault[edge]) / 1e9, EDGE_BINS) - 1
        visits += np.bincount(where, minlength=len(visits))[:len(visits)]
        slow += np.bincount(where, weights=z[lo:hi][target] >= SLOW_Z, minlength=len(visits))[:len(visits)]
    return slow / np.maximum(visits, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, default=Path.home() / ".cache/bmeg/testbed-dataset-single")
    args = parser.parse_args()
    detector = Detector.load(args.model)
    faults = sorted(json.loads((args.dataset / "faults.json").read_text()), key=lambda f: f["start_ns"])
    fault_start = np.array([f["start_ns"] for f in faults])
    fault_end = np.array([f["end_ns"] for f in faults])
    forest = rpc_view(read_spans(args.dataset / "spans.parquet"))
    scores = detector.score(forest, replay=True, crowd=True)
    between = pc.is_in(pa.array(forest.trace_ids), between_rounds(args.dataset)).to_numpy(zero_copy_only=False)
    start = forest.start_ns[forest.root][between]
    flagged = scores.anomalous[between]
    print(f"between rounds (traces labelled fault-free, not within {MARGIN_S} s after a fault's window): "
          f"{between.sum()} traces, {flagged.sum()} flagged ({100 * flagged.mean():.2f}%) with the default crowd check")
    previous = np.searchsorted(fault_end, start, side="right") - 1
    following = np.searchsorted(fault_start, start, side="right")
    since = np.where(previous >= 0, (start - fault_end[np.maximum(previous, 0)]) / 1e9, np.inf)
    until = np.where(following < len(faults), (fault_start[np.minimum(following, len(faults) - 1)] - start) / 1e9, np.inf)
    share_table("by seconds since the previous fault's labelled end:", since, flagged, [0.5, 1, 1.5, 2, 2.5, 3, 4, np.inf])
    share_table("by seconds until the next fault's labelled start:", until, flagged, [0, 0.5, 1, 1.5, 2, 3, np.inf])
    source = np.array([faults[i]["source"] if i >= 0 else "(before the first)" for i in previous])
    share_table("by the source of the fault just ended:", source, flagged)
    target = np.array([f["service"] for f in faults] + ["-"])
    routed = scores.service[between]
    blamed = np.asarray(scores.services)[np.where(scores.present[between], routed, -np.inf).argmax(axis=1)]
    print(f"flagged blaming the previous fault's target: {(flagged & (blamed == target[previous])).sum()}, "
          f"the next fault's target within 1 s of its start: {(flagged & (blamed == target[following]) & (until < 1)).sum()}; "
          "blamed: " + ", ".join(f"{name} {count}" for name, count in Counter(blamed[flagged].tolist()).most_common(6)))
    per_gap = np.bincount(previous[flagged] + 1, minlength=len(faults) + 1)
    top = np.sort(per_gap)[::-1]
    print(f"flagged per gap (of {len(faults)}): none in {(per_gap[1:] == 0).sum()}, the 10 fullest hold "
          f"{100 * top[:10].sum() / max(per_gap.sum(), 1):.0f}% ({', '.join(map(str, top[:10]))})")
    excess = logit(scores.anomaly) - logit(np.where(scores.to_svm, detector.thresholds["svm"], detector.thresholds["graph"]))
    print("logit excess over the threshold, p10/p50/p90: between rounds "
          f"{np.percentile(excess[between][flagged], [10, 50, 90]).round(2)}, anomalous "
          f"{np.percentile(excess[scores.anomalous & forest_anomalous(args.dataset, forest)], [10, 50, 90]).round(2)}")
    edges(faults, scores, between, forest)
    calibration = rpc_view(read_spans(args.dataset / "normal.parquet"))
    calibrated = detector.score(calibration, replay=True, crowd=True)
    print(f"the dataset's calibration period (fault-free, before the first fault): {calibration.num_traces} traces, "
          f"{100 * calibrated.anomalous.mean():.2f}% flagged (without the crowd check "
          f"{100 * replace(detector, crowd=None).route(calibrated).anomalous.mean():.2f}%)")


def forest_anomalous(dataset: Path, forest) -> np.ndarray:
    """bool [T]: the forest's traces the dataset labels anomalous."""
    traces = pq.read_table(dataset / "traces.parquet", columns=["trace_id", "anomalous"])
    return pc.is_in(pa.array(forest.trace_ids), traces["trace_id"].filter(traces["anomalous"])).to_numpy(
        zero_copy_only=False)


def edges(faults: list[dict], scores, between: np.ndarray, forest) -> None:
    """The target's slow share around each source's labelled start and end, and the gaps it derives."""
    observation = scores.observation
    order = np.argsort(observation.trace_start_ns, kind="stable")
    services, starts, z = (np.asarray(observation.services)[order], observation.trace_start_ns[order],
                           observation.z_self[order])
    level = (z[np.isin(starts, forest.start_ns[forest.root][between])] >= SLOW_Z).mean()
    print(f"the target's visits at z >= {SLOW_Z:g}, by seconds from the fault's labelled start / end "
          f"(all between-rounds visits: {100 * level:.1f}%)")
    onset, settle = 0.0, 0.0
    for edge in ("start_ns", "end_ns"):
        print(f"  {edge[:-3]:>18} " + " ".join(f"{b:>5.2f}" for b in EDGE_BINS[:-1]))
        for source in sorted({f["source"] for f in faults}):
            share = slow_share_around(faults, edge, services, starts, z, source)
            print(f"  {source:>18} " + " ".join(f"{100 * s:4.0f}%" for s in share))
            above = share > 2 * level
            if edge == "start_ns" and above[EDGE_BINS[:-1] < 0].any():
                onset = max(onset, -EDGE_BINS[:-1][above & (EDGE_BINS[:-1] < 0)].min())
            if edge == "end_ns" and above[EDGE_BINS[:-1] >= 0].any():
                settle = max(settle, EDGE_BINS[1:][above & (EDGE_BINS[:-1] >= 0)].max())
    print(f"derived: a fault shows from {onset:g} s before its labelled start; its target settles within {settle:g} s "
          "of its labelled end (the farthest bins above twice the between-rounds level)")


if __name__ == "__main__":
    main()
