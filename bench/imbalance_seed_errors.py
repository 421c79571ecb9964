"""Where a trained run's errors on a simulated dataset lie against the faults that made it
(docs/issue-12.md, session 18: "simulated imbalance 0.01, seed 1").

The dataset's episodes are simulated again from their seeds (the generator's own jobs, so the
very same traces, matched by start time) with each visit's arrival recorded, so every test trace
can be placed against the episode's faults: which fault round it fell in or after, and whether a
visit to a faulted service was slow (local time above the operation's p99) although its label
says normal, and why (it waited for a worker during the fault but started after its end; it
arrived after the fault's end, while the backlog drained).

    nice -n 15 python bench/imbalance_seed_errors.py --run RUN_DIR --traces 40000 --imbalance 0.01 --seed 1
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import pandas as pd

from bmeg.datasets.generate import EpisodeJob, Shard
from bmeg.datasets.loader import load_dataset
from bmeg.faultinject.labels import calibrate, label_episode
from bmeg.faultinject.scenario import load_scenario, plan_faults
from bmeg.faultinject.simulator import Simulator
from bmeg.faultinject.spec import load_topology, topology_path
from bmeg.graphs import critical_paths
from bmeg.models.detector import Detector
from bmeg.training.pipeline import label

#: After a fault's end, how long a slow visit counts as the fault's aftermath (seconds).
AFTERMATH_S = 5.0


class RecordingSimulator(Simulator):
    """The simulator, also recording each visit's arrival (for where it waited)."""

    def _reset_output(self) -> None:
        super()._reset_output()
        self.visit_arrive: list[float] = []

    def _post_done(self, visit, t: float) -> None:
        super()._post_done(visit, t)
        self.visit_arrive.append(visit.t_arrive)


def episode_frame(spec, plan, thresholds, seed: int, episode: int) -> tuple[pd.DataFrame, list]:
    """One row per simulated trace: start (ns in episode), label, and how its slowest visit at a
    faulted service relates to the faults."""
    job = EpisodeJob(spec, plan, thresholds, seed, Shard(), episode, 0, 0)
    plan_seed, sim_seed, _ = job.seed_sequence().spawn(3)
    faults = plan_faults(plan, spec, np.random.default_rng(plan_seed))
    simulator = RecordingSimulator(spec, faults, sim_seed)
    result = simulator.run(plan.duration_s)
    arrive = np.array(simulator.visit_arrive)
    labels = label_episode(result, thresholds)
    limits = thresholds.for_keys(result.op_keys)[result.visit_key]
    slow = result.visit_local > limits
    visit_trace = result.span_trace[result.visit_span]
    visit_service = np.array(result.services)[result.span_service[result.visit_span]]
    peer = result.span_peer[result.visit_span]
    visit_service = np.where(peer >= 0, np.array(result.services)[np.maximum(peer, 0)], visit_service)
    n = len(result.trace_start)
    kind = np.full(n, "", dtype=object)  # why a normal trace has a slow visit at a faulted service
    fault_of = np.full(n, -1)
    for index, fault in enumerate(faults):
        start, end = fault.start_s * 1e9, fault.end_s * 1e9
        at = (visit_service == fault.service) & slow & (result.visit_fault < 0)
        during = at & (arrive >= start) & (arrive < end)
        after = at & (arrive >= end) & (arrive < end + AFTERMATH_S * 1e9)
        for mask, name in ((during, "queued in fault, started after"), (after, "arrived in aftermath")):
            traces = np.unique(visit_trace[mask])
            traces = traces[~labels.trace_anomalous[traces] & (kind[traces] == "")]
            kind[traces] = name
            fault_of[traces] = index
    # which fault round each trace lies in (or after)
    t = result.trace_start
    phase = np.full(n, "no fault yet", dtype=object)
    near = np.full(n, -1)
    for index, fault in enumerate(faults):
        start, end = fault.start_s * 1e9, fault.end_s * 1e9
        phase[(t >= start) & (t < end)] = f"in {index}"
        near[(t >= start) & (t < end)] = index
        phase[(t >= end) & (t < end + AFTERMATH_S * 1e9)] = f"<{AFTERMATH_S:g}s after {index}"
        near[(t >= end) & (t < end + AFTERMATH_S * 1e9)] = index
    # how far the trace's bottleneck visits (else its visits) sit above their p99: max local / p99
    ratio = result.visit_local / limits
    bottleneck = (result.visit_fault >= 0) & (slow | result.visit_cache_fault)
    excess = np.zeros(n)
    np.maximum.at(excess, visit_trace[bottleneck], ratio[bottleneck])
    # the same over visits at a replica under a fault (for a normal trace: how close to showing)
    exposed = np.zeros(n)
    np.maximum.at(exposed, visit_trace[result.visit_fault >= 0], ratio[result.visit_fault >= 0])
    any_excess = np.zeros(n)
    np.maximum.at(any_excess, visit_trace, ratio)
    cache_only = np.zeros(n, dtype=bool)
    cache_only[visit_trace[bottleneck & result.visit_cache_fault & ~slow]] = True
    cache_only[visit_trace[bottleneck & slow]] = False
    frame = pd.DataFrame({"start": np.rint(t).astype(np.int64), "y": labels.trace_anomalous, "kind": kind,
                          "excess": excess, "exposed": exposed, "any_excess": any_excess, "cache_only": cache_only,
                          "fault_of": fault_of, "phase": phase, "near": near, "episode": episode})
    return frame, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=None, help="a run of `bmeg train` on the dataset; without: the labels only")
    parser.add_argument("--dataset", default="socialnet")
    parser.add_argument("--traces", type=int, default=40_000)
    parser.add_argument("--imbalance", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scenario", default="single")
    parser.add_argument("--json", default=None, help="write the per-trace table (test traces) here as CSV")
    args = parser.parse_args()

    dataset = load_dataset(args.dataset, args.traces, args.imbalance, args.seed, args.scenario, progress=False)
    data = label(dataset, args.seed)
    spec, plan = load_topology(topology_path(args.dataset)), load_scenario(args.scenario)
    thresholds = calibrate(spec, args.seed)
    episode_s = plan.duration_s + 60
    # rows of `traces` in forest order (label() keeps that order)
    traces = data.traces.to_pandas()
    frames, all_faults = [], {}
    for episode in sorted(traces["episode"].unique()):
        frame, faults = episode_frame(spec, plan, thresholds, args.seed, int(episode))
        frames.append(frame)
        all_faults[int(episode)] = faults
    sim = pd.concat(frames, ignore_index=True)
    base = 1_704_067_200 * 10**9
    traces["start"] = traces["start_ns"] - base - traces["episode"].astype(np.int64) * int(episode_s * 1e9)
    merged = traces.merge(sim, on=["episode", "start"], how="left", suffixes=("", "_sim"))
    assert len(merged) == len(traces), "start times not unique"
    assert merged["y"].notna().all(), "a trace not found in its episode's simulation"
    assert (merged["y"].astype(bool) == merged["anomalous"]).all(), "labels differ from the simulation's"

    test = merged.iloc[data.test]
    bad = test[test["anomalous"]]
    print(f"test: {len(bad)} bottlenecked, {int(bad['cache_only'].sum())} only by a faulted cache miss "
          f"(sources {dict(Counter(bad['fault_source']))}); labelled normal with a slow visit at a faulted "
          f"service outside its fault: {dict(Counter(test[~test['anomalous']]['kind']))}")
    if args.run is None:
        return
    detector = Detector.load(args.run, device="cpu")
    raw = detector.score(data.forest, critical_paths(data.forest), all_models=True, replay=True, context=data.context)
    routed = detector.route(raw)
    th = detector.thresholds
    merged["gnn"] = raw.gnn_anomaly >= th["graph"]
    merged["svm"] = raw.svm_anomaly >= th["svm"]
    merged["routed"] = routed.anomalous
    merged["gnn_score"] = raw.gnn_anomaly
    merged["svm_score"] = raw.svm_anomaly
    test = merged.iloc[data.test].copy()

    print("faults per episode:")
    for episode, faults in all_faults.items():
        for index, fault in enumerate(faults):
            params = {k: round(v, 2) for k, v in fault.parameters.items()}
            print(f"  ep {episode} #{index} {fault.start_s:5.1f}-{fault.end_s:5.1f}s {fault.service:32s} {fault.source:16s} {params}")

    print("\nall kept traces, normal ones with a slow visit at a faulted service outside its fault (label says normal):")
    normal = merged[~merged["anomalous"]]
    print(normal["kind"].replace("", "-").value_counts().to_string())
    print("\nsimulated traces (all, not only kept) by label and kind:")
    print(pd.crosstab(sim["y"], sim["kind"].replace("", "-")).to_string())

    for model in ("gnn", "svm", "routed"):
        fa = test[~test["anomalous"] & test[model]]
        miss = test[test["anomalous"] & ~test[model]]
        hit = test[test["anomalous"] & test[model]]
        print(f"\n== {model}: {len(hit)} caught, {len(miss)} missed of {int(test['anomalous'].sum())}; "
              f"{len(fa)} false alarms of {int((~test['anomalous']).sum())} normal")
        print("  caught by source:", dict(Counter(hit["fault_source"])))
        print("  missed by source:", dict(Counter(miss["fault_source"])))
        print("  missed by service:", dict(Counter(s for v in miss["fault_services"] for s in v)))
        print("  false alarms by kind:", dict(Counter(fa["kind"].replace("", "-"))))
        print("  false alarms by phase:", dict(Counter(fa["phase"])))
        print("  false alarms: max local / p99 at a faulted replica (0: none visited):",
              np.round(np.sort(fa["exposed"].to_numpy()), 2).tolist())
        print("  normal test traces by phase:", dict(Counter(test[~test["anomalous"]]["phase"])))
        # false-alarm rate by kind
        for kind, group in test[~test["anomalous"]].groupby(test["kind"].replace("", "-")):
            print(f"    kind {kind!r}: {int(group[model].sum())} / {len(group)} flagged")
    bad = test[test["anomalous"]]
    print("\nbottlenecked test traces: max local / p99 over their bottleneck visits (cache-only misses apart)")
    for source, group in bad.groupby("fault_source"):
        for caught, part in group.groupby("gnn"):
            values = np.sort(part["excess"].to_numpy())
            print(f"  {source:16s} gnn {'caught' if caught else 'missed'} n={len(part)} cache-only={int(part['cache_only'].sum())} "
                  f"excess quartiles {np.round(np.quantile(values, [0, .25, .5, .75, 1]), 2).tolist()}")
    good = test[~test["anomalous"]]
    print("  normal test traces: max local / p99 over all visits, quantiles .5/.9/.99/.999:",
          np.round(np.quantile(good["any_excess"], [.5, .9, .99, .999]), 2).tolist(),
          "share > 1:", round(float(np.mean(good["any_excess"] > 1)), 3))
    print("\ntest bottlenecked by source:", dict(Counter(test[test['anomalous']]["fault_source"])))
    if args.json:
        test.drop(columns=["fault_services"]).to_csv(args.json, index=False)


if __name__ == "__main__":
    main()
