"""How many of a testbed recording's anomalous labels chance alone would give, per label quantile,
and the recording relabelled at another quantile for `bmeg train` (issue 12, session 23).

    python bench/label_noise.py chance D [--quantiles 0.99,0.995,0.999]
    python bench/label_noise.py relabel D OUT --quantile 0.999 [--aftermath]

A node exposed to a fault is a bottleneck when its time passes its operation's fault-free bounds
(`bmeg.faultinject.testbed.labels`). `chance`: per quantile, the anomalous labels and how many of
them are expected by chance (per exposed trace, 1 - the product over its exposed nodes of 1 - the
rate at which its operation passes the same bounds in the calibration period). `relabel`: the
recording's tables at another quantile, its spans linked (at 0.99 the recorded tables come back);
with `--aftermath`, each fault's nodes also exposed after its end for as long as its source's
traces stay slower than calibration (`bench/healthy.py`'s `aftermath_s`, session 24).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from healthy import aftermath_s

from bmeg.faultinject.scenario import scenario_path
from bmeg.faultinject.testbed import labels as labelling
from bmeg.faultinject.testbed.campaign import LabelledRecording, label_recording, load_testbed_scenario

#: what `bmeg generate --backend testbed` writes beside the labels, linked into a relabelled copy
LINKED = ("spans.parquet", "normal.parquet", "faults.json", "fault_list.json")


def labelled(dataset: Path, high: float, aftermath_s: dict[str, float] | None = None) -> LabelledRecording:
    """The recording in `dataset` labelled anew with bounds at the `high` quantile (and each
    source's aftermath)."""
    card = json.loads((dataset / "dataset.json").read_text())
    spans = pa.concat_tables([pq.read_table(dataset / "normal.parquet"), pq.read_table(dataset / "spans.parquet")])
    faults = [labelling.AppliedFault(**fault) for fault in json.loads((dataset / "faults.json").read_text())]
    plan, _, _ = load_testbed_scenario(scenario_path(card["scenario"]["name"]))  # its episodes' length
    return label_recording(spans, faults, card["generation"]["calibration_end_ns"], plan.duration_s, high, aftermath_s)


def expected_by_chance(recording: LabelledRecording) -> float:
    """Anomalous labels among the kept traces that chance alone would give (see the module)."""
    frame, labels = recording.frame, recording.labels
    keys = frame.key.astype(str)
    passes = labelling.shows(frame, recording.calibration)
    normal = frame.is_node & ~recording.span_keep
    rate = {key: float(passes[normal & (keys == key)].mean()) for key in np.unique(keys[normal])}
    exposed = labels.span_exposed & recording.span_keep
    node_rate = np.array([rate.get(key, 1.0) for key in keys[exposed]])
    log_clear = np.zeros(frame.forest.num_traces)
    np.add.at(log_clear, frame.forest.trace_index[exposed], np.log1p(-np.minimum(node_rate, 1.0 - 1e-12)))
    return float((1.0 - np.exp(log_clear))[labels.trace_exposed & recording.keep].sum())


def chance(args: argparse.Namespace) -> None:
    for high in (float(q) for q in args.quantiles.split(",")):
        recording = labelled(args.dataset, high)
        anomalous = int((recording.labels.trace_anomalous & recording.keep).sum())
        expected = expected_by_chance(recording)
        print(f"p{high * 100:g} / p{(1 - high) * 100:g}: anomalous {anomalous}, exposed "
              f"{int((recording.labels.trace_exposed & recording.keep).sum())}, expected by chance "
              f"{expected:.0f} ({expected / max(anomalous, 1):.1%})")


def relabel(args: argparse.Namespace) -> None:
    aftermath = {source: s for source, (s, _) in aftermath_s(args.dataset).items()} if args.aftermath else None
    if aftermath:
        print("aftermath (s) by source:", aftermath)
    recording = labelled(args.dataset, args.quantile, aftermath)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if not (args.out / name).exists():
            os.symlink((args.dataset / name).resolve(), args.out / name)
    pq.write_table(recording.nodes, args.out / "nodes.parquet")
    pq.write_table(recording.traces, args.out / "traces.parquet")
    card = json.loads((args.dataset / "dataset.json").read_text())
    anomalous = int(np.asarray(recording.traces["anomalous"]).sum())
    card.update(anomalous_traces=anomalous, normal_traces=recording.traces.num_rows - anomalous,
                labels=f"{card['labels']} Relabelled with bounds at p{args.quantile * 100:g} / p{(1 - args.quantile) * 100:g}"
                       + (f", each fault's nodes exposed for its source's aftermath after its end {aftermath}." if aftermath else "."))
    (args.out / "dataset.json").write_text(json.dumps(card, indent=2))
    print(f"{args.out}: {recording.traces.num_rows} traces, {anomalous} anomalous")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    first = commands.add_parser("chance")
    first.add_argument("dataset", type=Path)
    first.add_argument("--quantiles", default="0.99,0.995,0.999")
    second = commands.add_parser("relabel")
    second.add_argument("dataset", type=Path)
    second.add_argument("out", type=Path)
    second.add_argument("--quantile", type=float, required=True)
    second.add_argument("--aftermath", action="store_true",
                        help="expose each fault's nodes after its end for its source's aftermath (bench/healthy.py)")
    args = parser.parse_args()
    {"chance": chance, "relabel": relabel}[args.command](args)


if __name__ == "__main__":
    main()
