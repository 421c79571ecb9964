"""The GNN alone, the per-trace SVM alone, the routed detector and the self-time rule, judged on
traces of fault draws the models never saw, and what each model costs; everything in one run.

Per case, one detector is trained as `bmeg train` trains it (`fit_detector`: thresholds chosen
on validation traces, which share the training campaign's fault draws; the router's cuts, judged
by culprit F1 and trace F1, `bmeg.models.router.choose`, on a synthetic dataset of other fault
draws (seed 7, bottlenecked traces stratified by fault source, normal ones of the whole scenario, `pipeline.fresh_decision_data`), or on the testbed on the faults of held-out
services by a probe detector fitted without them), then judged on *fresh* traces:
- synthetic (`single` scenario at each imbalance of `--ratios`): a third dataset generated with
  another seed (99), so other faults on other services at other times;
- the testbed's labelled dataset (`--testbed DIR`, real faults on the running testbed): split by
  time, the earlier 60% of the campaign to train on and the later 40% as the fresh traces (later
  faults), each thinned to every k-th trace in time order to stay under `--testbed-traces`.

Rows per case: `gnn` (the GNN stages on every trace), `svm` (the trace SVM on every trace, its
services ranked by the `CulpritScorer`: own time, queue and callers' gap against the baselines), `svm-times` (the trace SVM's input as it was
until session 8: the per-key log self times and the trace's largest deviations, no services'
deviations, `TraceVectorizer()`), `svm-per-key` (as it was before that: each baseline
deviation's largest per (service, operation) key instead of the trace's largest,
`TraceVectorizer(per_key_deviations=True)`; both trained, thresholded and ranked as `svm`), `routed` (the router that `choose` picked),
`cheapest-tie` (the router the earlier rule picked: the cheapest cut within the tolerance of
the best validation quality, even when the GNN alone ties it), and `self-time` (no model: a
trace is flagged when some service's SVM-path culprit score (`CulpritScorer`; before it, its own
time against its baseline) is high, threshold chosen on validation like the models'; services
ranked by the same score). Each
with BP, BR, NBR, AC@1 on the fresh traces; the router's decision (culprit F1 of the GNN alone
and of the chosen cut on its decision traces, and its reason in words) is printed per case.

Cost, per case, measured in this run on the same machine: training CPU time of the two GNN
stages (their `fit` calls) against the trace SVM's `fit` on the same training traces; inference
CPU time per trace of `Detector.diagnosis_document` on up to 1,000 fresh traces under each
router (`bmeg.training.evaluate.measure_cost`, best of 5), printed as µs per trace and traces/s
per CPU second, with the SVM's and the routed detector's ratio to the GNN alone's; model size (parameters and learned
arrays, bytes).

`--devset DIR` (a Nezha-layout real dataset: `fault/`, `normal/*.csv.gz`, `fault_list.json`) adds
the window check on real faults with a model bootstrapped from its normal traces (no real label):
AC@1 per fault of the detector's window ranking under each router, beside the self-time rule.
It has no per-trace labels, so it takes no part in the router's decision.

    nice -n 10 python bench/router.py --testbed ~/.cache/bmeg/testbed-dataset [--devset DIR] --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from bmeg.datasets.loader import Dataset, load_dataset, read_dataset
from bmeg.models.detector import Detector, Scores
from bmeg.models.router import Router
from bmeg.models.svm import TraceSVM, TraceVectorizer
from bmeg.training import pipeline
from bmeg.training.evaluate import measure_cost, true_services
from bmeg.training.labelled import Labelled
from bmeg.training.metrics import accuracy_at_k, classification_table, threshold_for_precision

#: The split of the testbed's campaign: this earlier share of its time to train on.
TESTBED_TRAIN_SHARE = 0.6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--apps", default="socialnet,hotelreservation")
    parser.add_argument("--traces", type=int, default=20000, help="synthetic training dataset")
    parser.add_argument("--fresh", type=int, default=5000, help="synthetic fresh dataset")
    parser.add_argument("--ratios", default="0.3,0.1", help="synthetic imbalance ratios")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--testbed", type=Path, default=None, help="the testbed's labelled dataset")
    parser.add_argument("--testbed-traces", type=int, default=110_000, help="cap on the testbed traces used (both parts)")
    parser.add_argument("--devset", type=Path, default=None, help="a Nezha-layout real dataset (run once)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("BMEG_CACHE", os.path.join(tempfile.gettempdir(), "bmeg-bench-cache"))
    started = time.time()

    cases: dict[str, tuple[Dataset, Dataset, Labelled | None]] = {}
    for app in [a for a in args.apps.split(",") if a]:
        for ratio in [float(r) for r in args.ratios.split(",") if r]:
            # the router's decision draws as `bmeg train` makes them (`fresh_decision_data`), not the judged ones
            cases[f"{app} {ratio:g}"] = (load_dataset(app, args.traces, ratio, seed=0, progress=False),
                                         load_dataset(app, args.fresh, ratio, seed=99, progress=False),
                                         pipeline.fresh_decision_data(pipeline.TrainConfig(dataset=app, imbalance=ratio)))
    if args.testbed is not None:
        cases["testbed"] = (*split_by_time(read_dataset(args.testbed), TESTBED_TRAIN_SHARE, args.testbed_traces), None)
    results: dict[str, object] = {name: run_case(name, train_set, fresh_set, decision_set, args.epochs)
                                  for name, (train_set, fresh_set, decision_set) in cases.items()}
    if args.devset is not None:
        results["devset"] = devset_check(args.devset)
    results["wall_s"] = time.time() - started
    print(f"\nwall time {results['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))


def split_by_time(dataset: Dataset, train_share: float, cap: int) -> tuple[Dataset, Dataset]:
    """The earlier `train_share` of the campaign's traces and the later rest, each thinned to
    every k-th trace in time order so that both together hold at most `cap` traces."""
    order = np.argsort(dataset.traces["start_ns"].to_numpy(), kind="stable")
    step = max(1, int(np.ceil(len(order) / cap)))
    cut = int(len(order) * train_share)
    ids = dataset.traces["trace_id"].to_numpy(zero_copy_only=False)
    return tuple(_subset(dataset, ids[part[::step]]) for part in (order[:cut], order[cut:]))  # type: ignore[return-value]


def _subset(dataset: Dataset, ids: np.ndarray) -> Dataset:
    """The traces `ids`, with every other trace of the campaign as their history context (read
    only before each trace's start: the fresh part reads the training part's last minutes, as the
    stream would, and the traces thinned out stay history, as a generated dataset's unsampled ones)."""
    keep = pa.array(ids.tolist())

    def take(table: pa.Table) -> pa.Table:
        return table.filter(pc.is_in(table["trace_id"], value_set=keep))

    others = dataset.spans.filter(pc.invert(pc.is_in(dataset.spans["trace_id"], value_set=keep)))
    context = others if dataset.context is None else pa.concat_tables([dataset.context, others], promote_options="default")
    return Dataset(dataset.path, take(dataset.spans), take(dataset.traces), take(dataset.nodes), dataset.cards, context)


def run_case(name: str, train_set: Dataset, fresh_set: Dataset, decision: Labelled | None, epochs: int) -> dict:
    config = pipeline.TrainConfig(fit=pipeline.FitConfig(epochs=epochs, progress=False, device="cpu"))
    data = pipeline.label(train_set, config.seed)
    timer = _timed_gnn_fit()
    detector, _, raw = pipeline.fit_detector(data, config, application=train_set.card["topology"]["name"],
                                             fresh=decision)
    gnn_train_s = timer.total()
    svm_train_s = _svm_fit_seconds(detector, data, config)

    fresh = pipeline.label(fresh_set, config.seed)
    fresh = replace(fresh, test=np.arange(fresh.forest.num_traces))
    # read with its history (the generated dataset's unsampled traces), as training and `bmeg
    # experiment imbalance` read theirs: without it the history features of the fresh traces differ
    fresh_raw = detector.score(fresh.forest, all_models=True, replay=True, context=fresh.context)

    self_time_val = _self_time_score(raw)[data.val]
    self_time_threshold = threshold_for_precision(data.y[data.val], self_time_val, config.min_precision)
    choice = detector.hparams.get("router_choice", {})
    cheapest_tie = _cheapest_within_tolerance(detector, raw, data, config.router_tolerance)
    routers = {"gnn": Router(), "svm": Router.everything(), "routed": detector.router, "cheapest-tie": cheapest_tie}
    rows = {}
    truth = true_services(fresh, fresh_raw)
    for model, router in routers.items():
        routed = detector.route(fresh_raw, router)
        rows[model] = _figures(fresh.y, routed.anomalous, routed.service, fresh_raw, truth)
        rows[model]["share_to_svm"] = float(np.mean(routed.to_svm))
        rows[model]["router"] = router.to_state()
    score = _self_time_score(fresh_raw)
    rows["self-time"] = _figures(fresh.y, score >= self_time_threshold, fresh_raw.svm_service, fresh_raw, truth)
    deviations = detector.vectorizer.deviations
    for model, vectorizer in (("svm-times", TraceVectorizer(deviations=deviations)),
                              ("svm-per-key", TraceVectorizer(deviations=deviations, per_key_deviations=True))):
        rows[model] = _earlier_svm_figures(detector, vectorizer, data, fresh, fresh_raw, truth, config)
    costs = measure_cost(detector, fresh.forest, fresh.test, {m: routers[m] for m in ("gnn", "svm", "routed")})
    for model, seconds in costs.items():
        rows[model]["us_per_trace"] = seconds * 1e6
        rows[model]["traces_per_s"] = 1.0 / seconds
    result = {
        "train_traces": int(data.forest.num_traces), "fresh_traces": int(fresh.forest.num_traces),
        "fresh_bottlenecked": int(fresh.y.sum()), "validation_bottlenecked": int(data.y[data.val].sum()),
        "rows": rows, "router_choice": choice, "self_time_threshold": self_time_threshold,
        "train_cpu_s": {"gnn": gnn_train_s, "svm": svm_train_s},
        "model_bytes": {"gnn": _torch_bytes(detector.dgcnn) + _torch_bytes(detector.gcn),
                        "svm": _state_bytes(detector.svm.to_state()["learned"])},
    }
    _print_case(name, result)
    return result


class _timed_gnn_fit:
    """CPU seconds spent in the trainer's first two `fit` calls (the served detector's two GNN
    stages; the router's probe detector, fitted after them, is not counted) while this object is alive."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.original = pipeline.fit

        def fit(*args, **kwargs):
            began = time.process_time()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds.append(time.process_time() - began)

        pipeline.fit = fit

    def total(self) -> float:
        pipeline.fit = self.original
        return sum(self.seconds[:2])


def _svm_fit_seconds(detector: Detector, data: Labelled, config: pipeline.TrainConfig) -> float:
    """CPU seconds of the trace SVM's `fit` on the training traces (their vectors built beforehand,
    as the GNN's graphs are built before its `fit`)."""
    vectors = _trace_vectors(detector, data.forest, data.context)[data.train]
    began = time.process_time()
    TraceSVM(C=config.svm_C, random_state=config.seed).fit(vectors, data.y[data.train])
    return time.process_time() - began


def _trace_vectors(detector: Detector, forest, context) -> np.ndarray:
    """The trace SVM's input over a recorded forest read with its history `context`, under the
    detector's vectorizer."""
    from bmeg.graphs import node_services, operation_keys

    keys = operation_keys(forest, node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False))
    return detector.trace_vectors(forest, detector.encoder.transform(forest, context=context), keys)


def _earlier_svm_figures(detector: Detector, vectorizer: TraceVectorizer, data: Labelled, fresh: Labelled,
                         fresh_raw: Scores, truth: np.ndarray, config: pipeline.TrainConfig) -> dict:
    """The trace SVM on an earlier input layout (`vectorizer`, not yet fitted), trained,
    thresholded on validation and judged exactly as the `svm` row; same service ranking."""
    earlier = replace(detector, vectorizer=vectorizer.fit(np.asarray(detector.vectorizer.keys, dtype=object)))
    vectors = _trace_vectors(earlier, data.forest, data.context)
    svm = TraceSVM(C=config.svm_C, random_state=config.seed).fit(vectors[data.train], data.y[data.train])
    threshold = threshold_for_precision(data.y[data.val], svm.predict_proba(vectors[data.val])[:, 1],
                                        config.min_precision)
    flagged = svm.predict_proba(_trace_vectors(earlier, fresh.forest, fresh.context))[:, 1] >= threshold
    return _figures(fresh.y, flagged, fresh_raw.svm_service, fresh_raw, truth)


def _self_time_score(raw: Scores) -> np.ndarray:
    """[T]: the largest own-time score of the trace's services (the SVM's service ranking score)."""
    return np.where(raw.present, raw.svm_service, -np.inf).max(axis=1)


def _cheapest_within_tolerance(detector: Detector, raw: Scores, data: Labelled, tolerance: float) -> Router:
    """The router the rule before `choose`'s GNN preference picked, from the same candidates."""
    rows = _validation_candidates(detector, raw, data)
    best = max(row["quality"] for row in rows)
    eligible = [row for row in rows if row["quality"] >= best - tolerance]
    chosen = min(eligible, key=lambda row: (row["cost_s_per_trace"], row["share_to_svm"]))
    return Router(int(chosen["max_services"]), int(chosen["max_paths"]))


def _validation_candidates(detector: Detector, raw: Scores, data: Labelled) -> list[dict]:
    """Every cut scored as `choose` scores it, on the served detector's validation traces."""
    from bmeg.models.router import choose

    val, y, th = data.val, data.y[data.val], detector.thresholds
    truth = true_services(data, raw)
    cost = detector.hparams["router_choice"]["cost_s_per_trace"]
    verdicts = {"gnn": raw.gnn_anomaly[val] >= th["graph"], "svm": raw.svm_anomaly[val] >= th["svm"]}
    named = {model: pipeline.named_culprit(service[val], raw.present[val], truth[val], th[node])
             for model, service, node in (("gnn", raw.gnn_service, "node"), ("svm", raw.svm_service, "svm_node"))}
    _, rows, _ = choose(y, verdicts, named, raw.num_services[val], raw.num_paths[val], cost, tolerance=0.0)
    return rows


def _figures(y: np.ndarray, flagged: np.ndarray, service: np.ndarray, raw: Scores, truth: np.ndarray) -> dict:
    table = classification_table(y, flagged)
    names = np.array(raw.services, dtype=object)
    rankings, truths = [], []
    for t in np.flatnonzero((y == 1) & truth.any(axis=1)):
        row = np.where(raw.present[t], service[t], -np.inf)
        rankings.append(names[np.argsort(-row, kind="stable")].tolist())
        truths.append(set(names[truth[t]].tolist()))
    return {**{k: table[k] for k in ("accuracy", "bp", "br", "nbr")},
            "ac1": accuracy_at_k(rankings, truths, 1), "ac3": accuracy_at_k(rankings, truths, 3)}


def _torch_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _state_bytes(learned: dict) -> int:
    """float64 bytes of the learned arrays (what the checkpoint holds for the SVM)."""
    return sum(np.asarray(value, dtype=np.float64).nbytes for value in learned.values())


def _print_case(name: str, result: dict) -> None:
    choice = result["router_choice"]
    print(f"\n== {name}: trained on {result['train_traces']} traces ({result['validation_bottlenecked']} bottlenecked "
          f"in validation), judged on {result['fresh_traces']} fresh traces ({result['fresh_bottlenecked']} bottlenecked)")
    if choice:
        print(f"router: GNN alone culprit F1 {choice['gnn_only']['quality']:.3f} (trace F1 {choice['gnn_only']['f1']:.3f}), "
              f"chosen {choice['chosen']['max_services']}/{choice['chosen']['max_paths']} culprit F1 "
              f"{choice['chosen']['quality']:.3f}: {choice.get('why', '')}")
    print(f"{'model':<13} {'acc':>6} {'BP':>6} {'BR':>6} {'NBR':>6} {'AC@1':>6} {'AC@3':>6} {'to SVM':>7} {'us/trace':>9} "
          f"{'traces/s':>9}")
    for model, row in result["rows"].items():
        cost = (f"{row['us_per_trace']:9.0f} {row['traces_per_s']:9.0f}" if "us_per_trace" in row
                else f"{'-':>9} {'-':>9}")
        print(f"{model:<13} {row['accuracy']:6.3f} {row['bp']:6.3f} {row['br']:6.3f} {row['nbr']:6.3f} {row['ac1']:6.3f} "
              f"{row['ac3']:6.3f} {row.get('share_to_svm', 0.0):7.2f} {cost}")
    train, size, rows = result["train_cpu_s"], result["model_bytes"], result["rows"]
    print(f"cost: training CPU s GNN {train['gnn']:.1f} / SVM {train['svm']:.2f} ({train['gnn'] / max(train['svm'], 1e-9):,.0f}x); "
          f"inference us/trace GNN {rows['gnn']['us_per_trace']:.0f} / SVM {rows['svm']['us_per_trace']:.0f} "
          f"({rows['gnn']['us_per_trace'] / rows['svm']['us_per_trace']:.2f}x); traces/s against the GNN alone: "
          f"SVM {rows['svm']['traces_per_s'] / rows['gnn']['traces_per_s']:.2f}x, routed "
          f"{rows['routed']['traces_per_s'] / rows['gnn']['traces_per_s']:.2f}x; "
          f"model bytes GNN {size['gnn']:,} / SVM {size['svm']:,} ({size['gnn'] / max(size['svm'], 1):,.0f}x)")


def devset_check(root: Path) -> dict:
    """AC@1 of the detector's window ranking under each router on a Nezha-layout real dataset."""
    normal = sorted((root / "normal").glob("*.csv.gz"))[0]
    return window_check(root.name, root / "fault", root / "fault_list.json", normal)


def window_check(name: str, traces: Path, fault_list: Path, normal_path: Path, bootstrap_traces: int = 6000,
                 epochs: int = 10, limit: int | None = None) -> dict:
    """AC@1 per fault of the detector's window ranking under each router, beside the self-time
    rule, with a model bootstrapped from `normal_path` (as `bmeg evaluate rca` bootstraps one)."""
    from bmeg.evaluation.bootstrap import bootstrap
    from bmeg.evaluation.faults import read_fault_list
    from bmeg.evaluation.rankers import SelfTimeRanker
    from bmeg.evaluation.rca import report, run_rca
    from bmeg.evaluation.windows import TraceFiles
    from bmeg.graphs.rpc import rpc_view
    from bmeg.traces.io import read_spans

    with tempfile.TemporaryDirectory() as run_dir:
        detector, _ = bootstrap(normal_path, run_dir, traces=bootstrap_traces, epochs=epochs, progress=False)
    rankers = [_RouterWindowRanker(detector, ranker, router) for ranker, router in
               (("gnn", Router()), ("svm", Router.everything()), ("routed", detector.router))]
    rankers.append(SelfTimeRanker())  # type: ignore[arg-type]
    normal = rpc_view(read_spans(normal_path))
    files = TraceFiles(traces, None, progress=False)
    results = run_rca(files, read_fault_list(fault_list)[:limit], normal, rankers)
    summary = report(results, [r.name for r in rankers], files)
    figures = {group: summary[group] for group in ("latency_faults", "overall")}
    print(f"\n== {name} (model bootstrapped from {normal_path.name}, router {detector.router})")
    for group, by_ranker in figures.items():
        print(group, {ranker: f"AC@1 {v['ac1']} ({v['n']})" for ranker, v in by_ranker.items()})
    return {"router": detector.router.to_state(), **figures}


class _RouterWindowRanker:
    """The detector's window ranking (what `bmeg diagnose --window` prints) under one router."""

    def __init__(self, detector: Detector, name: str, router: Router):
        self.detector, self.name = replace(detector, router=router), name

    def rank(self, window, normal) -> list[tuple[str, float]]:
        ranking = self.detector.diagnose(window, window=True, replay=True).ranking or []
        return [(item.service, item.score) for item in ranking]


if __name__ == "__main__":
    main()
