"""`bmeg train`: fit both GNN stages and both SVMs, choose thresholds and the router, evaluate.

The dataset is split 80/20 per class (the thesis's protocol); a fifth of the training part,
again per class, is held out for validation: best epochs, thresholds and the router's cuts are
chosen there, never on the test part. The router's cuts weigh each model's quality and its cost
per trace, measured here on the validation traces (`bmeg.models.router.choose`).

The router's quality figures come from faults the detector it judges never saw: validation
traces share the training campaign's fault draws, where the GNN has learnt each faulted
service (its culprit recall there is near 1.0; on other draws of hotelreservation its AC@1 is
0.03), while the faults a detector meets later are other draws, mostly on other services. On a
simulated application the simulator draws them (`router_fresh` traces generated with another
seed, `fresh_decision_data`): the served detector itself is judged on those. On a recorded
dataset (the testbed's) there is no second draw, so a share (`router_holdout`) of the faulted
services is held out (`held_out_service_split`): a probe detector is fitted, as the real one,
on the training traces without a fault on them, and both of its models are scored on the
validation traces of those services' faults (and the normal ones). The detector served is
fitted on all training traces either way. On such faults a tie between the two models goes to
the cheaper (`choose`'s `tie_to_cheaper`); on plain validation traces (no held-out split), whose
faults the GNN has learnt, a tie says nothing and the GNN stays.

Started by torchrun, every process runs this whole pipeline in torchrun's process group (the
two GNN stages train under DDP across the processes, `bmeg.training.trainer`); only rank 0
writes the run directory. Each machine's local rank 0 loads (or generates) the dataset first.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from bmeg.datasets.loader import Dataset, load_by_source, load_dataset, stratified_pick, with_normals_of
from bmeg.graphs import CriticalPaths, SpanForest, assemble, critical_paths, node_services, operation_keys
from bmeg.graphs.features import self_time_ns
from bmeg.models.detector import Detector, Scores
from bmeg.models.dgcnn import DGCNN
from bmeg.models.features import FeatureEncoder
from bmeg.models.gcn_node import GCNNodeClassifier, GCNNodeEnsemble
from bmeg.models.graphset import GraphSet
from bmeg.models.inference import resolve_device
from bmeg.models.router import Router, checked_sources, choose, loss_words, source_losses_of, worse_sources
from bmeg.models.svm import (
    CONFIRMED,
    CONFIRMED_FROM,
    DEVIATIONS,
    CulpritScorer,
    FirmSVM,
    TraceSVM,
    TraceVectorizer,
    critical_path_frame,
    firm_features,
)
from bmeg.training.evaluate import evaluate, measure_cost, true_services
from bmeg.training.labelled import Labelled
from bmeg.training.metrics import threshold_for_precision
from bmeg.training.plots import plot_run
from bmeg.training.config import FitConfig, TrainConfig
from bmeg.training.trainer import History, callee_emphasis, fit, process_group
from bmeg.traces.schema import span_keys


def load_recipe(name_or_path: str | Path, **overrides) -> TrainConfig:
    """A training recipe (YAML of TrainConfig fields, FitConfig fields under `fit`), with overrides.

    `name_or_path` is a file, or the name of a recipe shipped in `bmeg/training/recipes/`.
    """
    import yaml

    from bmeg.paths import shipped_file, shipped_names

    path = shipped_file(name_or_path, "bmeg.training", "recipes")
    if path is None:
        known = shipped_names("bmeg.training", "recipes")
        raise ValueError(f"no recipe {str(name_or_path)!r}: not a file, and not one of {known}")
    recipe = yaml.safe_load(path.read_text()) or {}
    fit_options = {**recipe.pop("fit", {}), **overrides.pop("fit", {})}
    try:
        return TrainConfig(**{**recipe, **overrides}, fit=FitConfig(**fit_options))
    except TypeError as error:
        raise ValueError(f"{path}: {error}") from None


def run(config: TrainConfig, out: Path | None = None) -> tuple[Detector, dict]:
    """Train on `config.dataset`; returns the detector and the metrics (also written to `out`,
    by rank 0 alone under torchrun)."""
    with process_group(config.fit.device) as group:
        dataset = group.local_leader_first(lambda: load_dataset(
            config.dataset, config.traces, config.imbalance, config.seed, config.scenario,
            progress=config.fit.progress and group.rank == 0))
        data = label(dataset, config.seed)
        fresh = group.local_leader_first(lambda: fresh_decision_data(config, progress=config.fit.progress and group.rank == 0))
        detector, histories, raw = fit_detector(data, config, application=dataset.card["topology"]["name"], fresh=fresh)
    if group.rank != 0:
        out = None
    metrics = evaluate(detector, data, raw, cost=True)
    metrics["config"] = {**asdict(config), "dataset_path": str(dataset.path)}
    metrics["history"] = {name: asdict(history) for name, history in histories.items()}
    detector = replace(detector, metrics=metrics)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        detector = detector.save(out)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        _plot(out, detector, raw, data, histories)
    return detector, metrics


def _plot(out: Path, detector: Detector, raw: Scores, data: Labelled, histories: dict) -> None:
    routed, test = detector.route(raw), data.test
    scores = {"B-MEG": routed.anomaly[test], "SVM": raw.svm_anomaly[test]}
    verdicts = {"B-MEG": routed.anomalous[test], "SVM": raw.svm_anomaly[test] >= detector.thresholds["svm"]}
    plot_run(out, histories, data.y[test], scores, verdicts)


def label(dataset: Dataset, seed: int) -> Labelled:
    forest = assemble(dataset.spans, on_bad_trace="drop")
    positions = pd.Index(forest.trace_ids)
    # one row per assembled trace, in the forest's order (a trace dropped as bad has no row: it
    # sorted first and shifted every label after it onto the wrong trace)
    rows = positions.get_indexer(dataset.traces["trace_id"].to_pylist())
    kept = np.flatnonzero(rows >= 0)
    traces = dataset.traces.take(pa.array(kept[np.argsort(rows[kept])]))
    y = traces["anomalous"].to_numpy(zero_copy_only=False).astype(np.int64)
    bottleneck = pd.Series(dataset.nodes["bottleneck"].to_numpy(zero_copy_only=False), index=span_keys(dataset.nodes))
    node_y = bottleneck.reindex(span_keys(forest.spans)).fillna(False).to_numpy().astype(np.int64)
    split = dataset.split(seed)
    test = np.flatnonzero(positions.isin(list(split.test)))
    train_all = np.flatnonzero(positions.isin(list(split.train)))
    val = stratified_pick(train_all, y[train_all] == 1, 0.2, np.random.default_rng(seed + 1))
    train_part = np.setdiff1d(train_all, val)
    # the context traces are assembled apart: they are read as history, never labelled or split
    context = None if dataset.context is None else assemble(dataset.context, on_bad_trace="drop")
    return Labelled(forest, y, node_y, train_part, np.sort(val), test, traces, context)


def _fit_models(data: Labelled, config: TrainConfig, application: str) -> tuple[Detector, dict, Scores]:
    """Fit every model on `data.train` (best epochs on `data.val`); thresholds and router unset."""
    forest, fit_config = data.forest, config.fit
    paths = critical_paths(forest)
    normal_train = data.train[data.y[data.train] == 0]
    encoder = FeatureEncoder(config.features).fit(_subforest(forest, normal_train))
    graphs = _training_graphs(data, encoder, fit_config, paths)

    torch.manual_seed(config.seed)
    sizes = np.diff(forest.trace_offsets)
    hparams: dict[str, dict] = {"dgcnn": {"k": int(max(10, np.percentile(sizes, 60)))}, "gcn": {"inputs": config.node_inputs}}
    dgcnn = DGCNN(encoder.num_features, **hparams["dgcnn"])
    gcn = GCNNodeClassifier(encoder.num_features, **hparams["gcn"])
    if config.pretrained is not None:
        hparams, dgcnn, gcn = pretrained_stages(config.pretrained, encoder, config.node_inputs)
    histories = {"dgcnn": fit(dgcnn, graphs, data.train, data.val, "graph", fit_config, "stage 1 (DGCNN)")}
    histories["gcn"] = _fit_node_stage(gcn, graphs, data, fit_config, "stage 2 (GCN)")

    services = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False)
    keys = operation_keys(forest, services)
    on_train = np.isin(forest.trace_index, data.train)
    # with baselines, the deviations without the per-key times (`TraceVectorizer`: they generalise
    # to faults on other keys); the thesis's features have none: its service times
    baselines = "z_log_self_time_us" in encoder.names
    # and, where the features have the temporal context, the history-confirmed own time
    # (`CONFIRMED`): the SVM reads the stream's history as the GNN does
    confirmed = (CONFIRMED,) if set(CONFIRMED_FROM) <= set(encoder.names) else ()
    vectorizer = TraceVectorizer(deviations=tuple(name for name in DEVIATIONS if name in encoder.names) + confirmed,
                                 times=not baselines, culprit_top=3 if baselines else 0)
    vectorizer.fit(keys[on_train])
    detector = Detector(
        application=application, encoder=encoder, dgcnn=dgcnn.eval(), gcn=gcn.eval(), vectorizer=vectorizer,
        svm=TraceSVM(C=config.svm_C, random_state=config.seed), firm=_fit_firm(forest, paths, services, data, config),
        thresholds={"graph": 0.5, "node": 0.5, "svm": 0.5, "svm_node": 0.5}, router=Router(), firm_window=config.firm_window,
        services=sorted(set(services)), service_baseline_us=_service_baselines(forest, services, normal_train),
        hparams=hparams, metrics={}, device=resolve_device(fit_config.device),
    )
    detector.svm.fit(detector.trace_vectors(forest, graphs.x, keys, data.train), data.y[data.train])
    if "z_log_self_time_us" in encoder.names:  # the thesis's features have no baselines to deviate from
        detector = replace(detector, culprit=_fit_culprit(detector, forest, graphs.x, services, data, config))
    detector.dgcnn.to(detector.device)
    detector.gcn.to(detector.device)
    raw = detector.score(forest, paths, all_models=True, replay=True, context=data.context)
    return detector, histories, raw


def _training_graphs(data: Labelled, encoder: FeatureEncoder, fit_config: FitConfig,
                     paths: CriticalPaths | None = None) -> GraphSet:
    """The labelled traces as graphs of `encoder`'s features, with the node stage's emphasis."""
    forest = data.forest
    x = encoder.transform(forest, critical_paths(forest) if paths is None else paths, context=data.context)
    graphs = GraphSet.from_forest(forest, x, data.y, data.node_y)
    return replace(graphs, node_emphasis=callee_emphasis(forest.parent, data.node_y, fit_config.hard_negatives))


def _fit_node_stage(gcn: GCNNodeClassifier, graphs: GraphSet, data: Labelled, fit_config: FitConfig,
                    what: str) -> History:
    """Stage 2 learns where the bottleneck is inside the anomalous traces only."""
    def anomalous(part: np.ndarray) -> np.ndarray:
        return part[data.y[part] == 1]

    return fit(gcn, graphs, anomalous(data.train), anomalous(data.val), "node", fit_config, what)


def bagged_node_stage(detector: Detector, draws: list[Path], config: TrainConfig) -> Detector:
    """`detector` with its node stage bagged over draws of training faults (`GCNNodeEnsemble`):
    its own classifier and one more trained on each dataset folder of `draws` (other draws of
    the same application's faults), on the detector's features; stage 1 is left as it is."""
    if isinstance(detector.gcn, GCNNodeEnsemble):
        raise ValueError("the detector's node stage is bagged already")
    members: list[GCNNodeClassifier] = [detector.gcn]
    # each member starts where the first did: the pretrained weights, read once
    start = None if config.pretrained is None else pretrained_stages(config.pretrained, detector.encoder, detector.gcn.inputs)[2]
    for index, folder in enumerate(draws, start=1):
        data = label(load_dataset(folder), config.seed)
        torch.manual_seed(config.seed + index)
        gcn = (GCNNodeClassifier(detector.encoder.num_features, **detector.hparams["gcn"]) if start is None
               else copy.deepcopy(start))
        graphs = _training_graphs(data, detector.encoder, config.fit)
        _fit_node_stage(gcn, graphs, data, config.fit, f"stage 2 (GCN), draw {index + 1} of {len(draws) + 1}")
        members.append(gcn.to(detector.device).eval())
    hparams = {**detector.hparams, "gcn": {**detector.hparams["gcn"], "members": len(members)}}
    return replace(detector, gcn=GCNNodeEnsemble(members), hparams=hparams)


def pretrained_stages(run_dir: str | Path, encoder: FeatureEncoder,
                      node_inputs: str = "raw") -> tuple[dict, DGCNN, GCNNodeClassifier]:
    """Both GNN stages of a saved run, to go on training from (warm start), with their
    hyperparameters (the DGCNN's sort-pooling k included: its layers' shapes depend on it).
    The run must have been trained on the same feature columns, its node classifier reading
    them as `node_inputs` does; the encoder's baselines are not taken (they are the
    pretraining applications', and each run fits its own)."""
    pretrained = Detector.load(run_dir, device="cpu")
    if pretrained.encoder.names != encoder.names:
        raise ValueError(f"{run_dir} was trained on the features {pretrained.encoder.names}, not {encoder.names}: "
                         "pretrain with the same --features")
    if isinstance(pretrained.gcn, GCNNodeEnsemble):
        raise ValueError(f"{run_dir} holds {len(pretrained.gcn.members)} node classifiers (a bagged bootstrap): "
                         "start from a run with one, such as `bmeg pretrain`'s")
    if pretrained.gcn.inputs != node_inputs:
        raise ValueError(f"{run_dir}'s node classifier reads its features {pretrained.gcn.inputs}, not {node_inputs}: "
                         "pretrain with the same node inputs")
    hparams = {name: dict(pretrained.hparams[name]) for name in ("dgcnn", "gcn")}
    return hparams, pretrained.dgcnn.train(), pretrained.gcn.train()


#: The seed of the router's fresh fault draws is the training seed plus this (the bench's fresh
#: traces, `bench/router.py`, are drawn with seed 99: a third draw).
FRESH_SEED_OFFSET = 7


#: The seed of the draw of the whole scenario that gives the router's decision data its normal
#: traces is the training seed plus this (the stratified parts take FRESH_SEED_OFFSET + 1000 i).
NATURAL_SEED_OFFSET = FRESH_SEED_OFFSET + 500
#: The imbalance the router's stratified decision parts are drawn at, whatever the training's: each
#: part of 1,000 traces (`router_fresh` 5,000, five fault sources) then holds 231 bottlenecked
#: traces, as the 0.3 cells' did. Until session 15 they were drawn at the training imbalance, at
#: least 0.1 (`MIN_DECISION_BOTTLENECKED` 500): 91 per source at 0.1 and 0.01, so the evidence
#: the router decides on thinned with the training set's ratio (docs/issue-17.md, session 15). The
#: bottlenecked traces are weighed back to the training imbalance (`decision_weights`).
DECISION_IMBALANCE = 0.3
#: The largest draw of the whole scenario the decision data takes its normal traces from
#: (`decision_normal_draw`): 116,538 at imbalance 0.01; below about 0.0097 the normal traces
#: stop growing and the evidence on false alarms thins as it did for every imbalance before.
MAX_DECISION_NORMAL_DRAW = 120_000


def decision_normal_draw(config: TrainConfig) -> int:
    """Traces of the whole-scenario draw (at the training imbalance) whose normal traces the
    router's decision data takes: as many normal traces as put the stratified parts' bottlenecked
    traces at the training imbalance (bottlenecked / imbalance; `router_fresh` at 0.3). The F1s
    the router compares weigh the bottlenecked traces to the training imbalance, so a false alarm
    counts 1 / (imbalance x normal traces) of their weight, and the thresholds (precision 0.8 on
    validation) let false alarms in at a rate near the imbalance: with a fixed count of normal
    traces, the noise their false alarms put into a comparison grows as 1 / sqrt(imbalance). At
    0.01, 4,950 normal traces stood beside a bottlenecked weight of 49: six false alarms of the
    SVM cost it about 0.01 of trace F1 each (the tolerance), and resampling them alone undid its lead in 7% of draws
    (docs/issue-17.md, session 15). At most `MAX_DECISION_NORMAL_DRAW` (the cost)."""
    if config.imbalance <= 0:  # no bottlenecked traces to stand beside: as many normal ones as allowed
        return MAX_DECISION_NORMAL_DRAW
    bottlenecked = config.router_fresh * DECISION_IMBALANCE / (1 + DECISION_IMBALANCE)
    return min(MAX_DECISION_NORMAL_DRAW, round(bottlenecked * (1 + config.imbalance) / config.imbalance))


def fresh_decision_data(config: TrainConfig, progress: bool = False) -> Labelled | None:
    """The router's decision data on a simulated application: traces of the same scenario drawn
    with another seed (other faults, at other times, mostly on other services). The bottlenecked
    traces are stratified by fault source (`load_by_source`, `router_fresh` traces at
    `DECISION_IMBALANCE`: one draw of the whole scenario held two to four of its five sources, so
    the router decided on sources it was not judged on and the other way round), the same count
    per source at every training imbalance; the normal traces come from a draw of the whole
    scenario at the training imbalance (`with_normals_of`: a stratified part's normal traces are
    an episode of one source's faults, and have no source to weigh them back by), as many as
    stand beside the bottlenecked ones at that imbalance (`decision_normal_draw`). The
    bottlenecked traces are weighed back to the training imbalance by `choose_router`. None for
    a recorded dataset (a folder) or `router_fresh` 0."""
    if config.router_fresh <= 0 or Path(config.dataset).is_dir() or config.svm_max_services is not None:
        return None
    stratified = load_by_source(config.dataset, config.router_fresh, DECISION_IMBALANCE,
                                config.seed + FRESH_SEED_OFFSET, config.scenario, progress=progress)
    natural = load_dataset(config.dataset, decision_normal_draw(config), config.imbalance,
                           config.seed + NATURAL_SEED_OFFSET, config.scenario, progress=progress)
    return label(with_normals_of(stratified, natural), config.seed)


def source_mix_weights(y: np.ndarray, sources: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """float [T]: weights that give each fault source's bottlenecked traces (`y == 1`) the share
    of the bottlenecked traces it has in `reference` (the sources of the training part's
    bottlenecked traces: the campaign's own mix, as a draw of the whole scenario yields it; one
    pseudo-trace per source so that none weighs 0), their sum kept; normal traces weigh 1.
    The stratified decision draws (`fresh_decision_data`) give every source an equal part."""
    weights = np.ones(len(y))
    faulted = np.flatnonzero(y == 1)
    names, counts = np.unique(np.asarray(sources, dtype=object)[faulted].astype(str), return_counts=True)
    if len(names) == 0:
        return weights
    known = pd.Series(np.asarray(reference, dtype=object).astype(str)).value_counts()
    share = known.reindex(names).fillna(0).to_numpy() + 1.0
    share /= share.sum()
    per_source = dict(zip(names, share * len(faulted) / counts))
    weights[faulted] = [per_source[name] for name in np.asarray(sources, dtype=object)[faulted].astype(str)]
    return weights


def fit_detector(data: Labelled, config: TrainConfig, application: str,
                 fresh: Labelled | None = None) -> tuple[Detector, dict, Scores]:
    """Fit every model; returns the detector, the learning histories and its raw scores on all
    traces. The router decides on `fresh` (`fresh_decision_data`) where given."""
    detector, histories, raw = _fit_models(data, config, application)
    detector = replace(detector, thresholds=_thresholds(raw, data, config))
    if config.svm_max_services is not None:
        router = Router(config.svm_max_services, config.svm_max_paths if config.svm_max_paths is not None else 1 << 30)
        return replace(detector, router=router), histories, raw
    return choose_router(detector, raw, data, config, application, fresh), histories, raw


def held_out_service_split(data: Labelled, services: np.ndarray, share: float,
                           seed: int) -> tuple[Labelled, np.ndarray, list[str]] | None:
    """The router's decision data: faults on services the fitting part never saw faulted.

    Of the services with a bottleneck node in some training or validation trace, `share` (at
    least one, never all) is held out, drawn with `seed`. Returns the fitting part (`data` with
    `train` and `val` cut to the traces with no bottleneck on a held-out service), the decision
    part (the normal validation traces, and every training or validation trace whose every
    bottleneck is on a held-out service: the fitting part saw none of them) and the held-out
    services; None when there are fewer than two faulted services or no such faults.
    """
    known = np.union1d(data.train, data.val)
    rows = np.flatnonzero((data.node_y == 1) & np.isin(data.forest.trace_index, known))
    frame = pd.DataFrame({"trace": data.forest.trace_index[rows], "service": np.asarray(services)[rows]})
    faulted = np.array(sorted(frame["service"].unique()), dtype=object)
    if len(faulted) < 2 or share <= 0:
        return None
    count = min(max(1, round(len(faulted) * share)), len(faulted) - 1)
    held = sorted(np.random.default_rng(seed).choice(faulted, size=count, replace=False).tolist())
    per_trace = frame.assign(held=frame["service"].isin(held)).groupby("trace")["held"].agg(["any", "all"])
    any_held = np.zeros(data.forest.num_traces, dtype=bool)
    all_held = np.zeros(data.forest.num_traces, dtype=bool)
    any_held[per_trace.index] = per_trace["any"].to_numpy()
    all_held[per_trace.index] = per_trace["all"].to_numpy()
    faults = known[all_held[known]]
    if len(faults) == 0:
        return None
    decision = np.union1d(data.val[data.y[data.val] == 0], faults)
    fitting = replace(data, train=data.train[~any_held[data.train]], val=data.val[~any_held[data.val]])
    return fitting, decision, held


def decision_weights(y: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """float [D]: weights of decision traces with labels `y` that give them the share of
    bottlenecked traces of the traces labelled `reference` (the validation part's: a held-out
    decision part draws its faults from training traces too; a fresh one holds more
    bottlenecked traces than its imbalance, `fresh_decision_data`), so that F1 weighs false
    alarms as often as the validation traces would."""
    positives, negatives = int(np.sum(y == 1)), int(np.sum(y == 0))
    if positives == 0 or negatives == 0 or not np.any(reference == 0):
        return np.ones(len(y))
    ratio = float(np.sum(reference == 1)) / float(np.sum(reference == 0))
    return np.where(y == 1, ratio * negatives / positives, 1.0)


def _thresholds(raw: Scores, data: Labelled, config: TrainConfig) -> dict[str, float]:
    """Each model's trace and service thresholds, on `data.val` only."""
    val, y = data.val, data.y[data.val]
    truth = true_services(data, raw)
    anomalous_val = val[y == 1]
    node_truth = truth[anomalous_val][raw.present[anomalous_val]]
    return {
        "graph": threshold_for_precision(y, raw.gnn_anomaly[val], config.min_precision),
        "node": threshold_for_precision(node_truth, raw.gnn_service[anomalous_val][raw.present[anomalous_val]], 0.5),
        "svm": threshold_for_precision(y, raw.svm_anomaly[val], config.min_precision),
        "svm_node": threshold_for_precision(node_truth, raw.svm_service[anomalous_val][raw.present[anomalous_val]], 0.5),
    }


def choose_router(detector: Detector, raw: Scores, data: Labelled, config: TrainConfig, application: str,
                  fresh: Labelled | None = None) -> Detector:
    """The router's cuts (`bmeg.models.router.choose`): each model's flags and culprits on
    `fresh` (other fault draws: `detector` itself is judged), else on faults of held-out
    services, judged by a probe detector fitted without them (`held_out_service_split`), or on
    the validation traces where no such split exists; the cost measured on `detector` over the
    validation traces."""
    judge, judged, judge_raw, decision, weights = detector, data, raw, data.val, np.ones(len(data.val))
    held: list[str] = []
    if fresh is not None:
        judged, judge_raw = fresh, detector.score(fresh.forest, all_models=True, replay=True, context=fresh.context)
        decision = np.arange(fresh.forest.num_traces)
        fresh_sources, train_sources = _fault_sources(fresh), _fault_sources(data)
        weights = decision_weights(fresh.y, data.y[data.val]) * (
            1.0 if fresh_sources is None or train_sources is None else
            source_mix_weights(fresh.y, fresh_sources, train_sources[data.train[data.y[data.train] == 1]]))
        where = (f"{len(decision)} traces of other fault draws (simulated: bottlenecked, seed {config.seed + FRESH_SEED_OFFSET}, "
                 f"stratified by fault source, weighed to the training mix and imbalance; normal, seed "
                 f"{config.seed + NATURAL_SEED_OFFSET}, of the whole scenario)")
    else:
        services = node_services(data.forest, storage_nodes=True).to_numpy(zero_copy_only=False)
        split = held_out_service_split(data, services, config.router_holdout, config.seed)
        if split is not None:
            fitting, decision, held = split
            weights = decision_weights(data.y[decision], data.y[data.val])
            judge, _, judge_raw = _fit_models(fitting, config, application)
            judge = replace(judge, thresholds=_thresholds(judge_raw, fitting, config))
        where = (f"faults on held-out services {held} (a probe detector fitted without them)" if held
                 else "validation traces (no held-out split: fewer than two faulted services)")
    y, truth, th = judged.y[decision], true_services(judged, judge_raw), judge.thresholds
    sources = _fault_sources(judged)
    cost = measure_cost(detector, data.forest, data.val, {"gnn": Router(), "svm": Router.everything()})
    verdicts, named = _verdicts_and_culprits(judge_raw, decision, truth, th)
    router, candidates, why = choose(y, verdicts, named, judge_raw.num_services[decision], judge_raw.num_paths[decision],
                                     cost, config.router_tolerance, weights, seed=config.seed,
                                     sources=None if sources is None else sources[decision],
                                     tie_to_cheaper=fresh is not None or bool(held))
    train_sources = _fault_sources(data)
    if train_sources is not None and router != Router():
        covered = set() if sources is None else set(sources[decision][y == 1])
        router, why = _uncovered_sources_check(router, why, detector, raw, data, train_sources, covered,
                                               config.router_tolerance, config.seed)
    router = replace(router, why=f"{why}; decided on {len(decision)} traces, {int(np.sum(y == 1))} bottlenecked, of {where}")
    chosen = next(row for row in candidates if row["max_services"] == router.max_services
                  and row["max_paths"] == router.max_paths)
    detector = replace(detector, router=router)
    detector.hparams["router_choice"] = {
        "cost_s_per_trace": cost, "tolerance": config.router_tolerance, "chosen": chosen, "gnn_only": candidates[0],
        "all_svm": candidates[-1],  # the largest cut: every decision trace to the SVM
        "best_f1": max(row["f1"] for row in candidates), "held_out_services": held,
        "decision_traces": int(len(decision)), "decision_bottlenecked": int(np.sum(y == 1)), "why": router.why,
    }
    return detector


def _uncovered_sources_check(router: Router, why: str, detector: Detector, raw: Scores, data: Labelled,
                             sources: np.ndarray, covered: set, tolerance: float, seed: int,
                             confidence: float = 0.95) -> tuple[Router, str]:
    """The cut `choose` took, checked on the fault sources its decision traces lack: on the
    validation faults of each (the served detector's scores; the training campaign's services),
    it must name culprits no worse than the GNN alone by more than `tolerance`, a loss that holds
    up in resamples (`bmeg.models.router.worse_sources`, Holm's step-down over the uncovered
    sources checked), else the GNN alone stays. Where the
    held-out faults say nothing about a kind of fault, the validation faults are the only
    evidence: in the closed loop's recipe the SVM's own-time scores (before
    `CulpritScorer`) named a misconfigured worker pool's service at 0.13 (queueing is the
    callers' wait), and no misconfiguration fell among the held-out services."""
    val, y = data.val, data.y[data.val]
    verdicts, named = _verdicts_and_culprits(raw, val, true_services(data, raw), detector.thresholds)
    losses = {source: figures for source, figures in source_losses_of(
        router, y, verdicts, named, raw.num_services[val], raw.num_paths[val], sources[val], tolerance,
        seed=seed).items() if source not in covered}
    uncovered = sorted(set(sources[val][y == 1].tolist()) - covered)
    checked = np.isin(sources[val], uncovered)  # the family of these checks: the uncovered sources only
    worse = worse_sources(losses, confidence, checked_sources(y[checked], sources[val][checked]))
    if not uncovered:
        return router, why
    if not worse:
        noise = {source: loss_words(figures) for source, figures in losses.items()}
        return router, (f"{why}; on validation faults of sources the decision faults lack ({uncovered}) no loss "
                        f"that holds in resamples" + (f" (held too rarely: {noise})" if noise else ""))
    return Router(), (f"gnn: {why.removeprefix('svm: ')}; but on validation faults of sources the decision faults "
                      f"lack it names culprits worse: {worse} (culprit recall)")


def _verdicts_and_culprits(raw: Scores, traces: np.ndarray, truth: np.ndarray,
                           thresholds: dict[str, float]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each model's ("gnn", "svm") trace verdicts and culprit credit (`named_culprit`) on `traces`."""
    verdicts = {"gnn": raw.gnn_anomaly[traces] >= thresholds["graph"], "svm": raw.svm_anomaly[traces] >= thresholds["svm"]}
    named = {model: named_culprit(service[traces], raw.present[traces], truth[traces], thresholds[node])
             for model, service, node in (("gnn", raw.gnn_service, "node"), ("svm", raw.svm_service, "svm_node"))}
    return verdicts, named


def _fault_sources(data: Labelled) -> np.ndarray | None:
    """Each trace's fault source (saturation, misconfiguration, ...) where the dataset says."""
    if "fault_source" not in data.traces.column_names:
        return None
    return np.asarray(data.traces["fault_source"].to_numpy(zero_copy_only=False), dtype=object)


#: The lowest score behind a blame that the closed loop can act on: the controller acts on a
#: confidence of at least 0.4 (`bmeg.mitigation.safety.SafetyPolicy.confidence_threshold`), and
#: the planner's confidence is the score times sqrt(share) times a certainty, never above the score.
ACTIONABLE_SCORE = 0.4


def named_culprit(service: np.ndarray, present: np.ndarray, truth: np.ndarray, threshold: float) -> np.ndarray:
    """float [T]: 1 where the trace's top-scored present service is a true bottleneck and its
    diagnosis calls it one (scored at or above the model's node threshold and at or above
    `ACTIONABLE_SCORE`), else 0: the culprit credit of `bmeg.models.router.choose`.

    A count, not the score: the GNN's node scores sit near 1 and the SVM path's are a calibrated
    P(culprit) (`CulpritScorer`), so crediting the score compared two scales and kept the GNN
    where the SVM named more culprits right (trainticket, docs/issue-17.md). The floor keeps what
    the score credit was for: a right culprit scored 0.13 moves no action in the closed loop."""
    scores = np.where(present, service, -np.inf)
    top = np.argmax(scores, axis=1)
    rows = np.arange(len(top))
    named = truth[rows, top] & (scores[rows, top] >= max(threshold, ACTIONABLE_SCORE))
    return named.astype(np.float64)


def _fit_culprit(detector: Detector, forest: SpanForest, x: np.ndarray, services: np.ndarray, data: Labelled,
                 config: TrainConfig) -> CulpritScorer:
    """The SVM path's culprit scorer on the (service, bottlenecked training trace) pairs: culprit or not."""
    codes, names = pd.factorize(services)
    traces = data.train[data.y[data.train] == 1]
    present = np.zeros((forest.num_traces, len(names)), dtype=bool)
    present[forest.trace_index, codes] = True
    truth = np.zeros_like(present)
    rows = np.flatnonzero(data.node_y == 1)
    truth[forest.trace_index[rows], codes[rows]] = True
    features = detector.culprit_features(forest, x, codes, len(names), traces)
    mask = present[traces]
    return CulpritScorer(random_state=config.seed).fit(features[mask], truth[traces][mask].astype(np.int64))


def _fit_firm(forest: SpanForest, paths, services: np.ndarray, data: Labelled, config: TrainConfig) -> FirmSVM:
    """FIRM's SVM on (RI, CI) of each (training trace, service on its critical path): culprit or not."""
    frame = critical_path_frame(forest, services, paths)
    features = firm_features(frame, config.firm_window)
    names = [name for name in frame.columns if not name.startswith("__")]
    on_path = frame[names].notna().to_numpy()
    truth = np.zeros(on_path.shape, dtype=bool)
    column = pd.Index(names).get_indexer(services)
    rows = np.flatnonzero(data.node_y == 1)
    truth[forest.trace_index[rows], column[rows]] = True
    mask = np.zeros(forest.num_traces, dtype=bool)
    mask[data.train] = True
    pairs = on_path & mask[:, None]
    return FirmSVM(random_state=config.seed).fit(features[pairs], truth[pairs].astype(np.int64))


def _service_baselines(forest: SpanForest, services: np.ndarray, normal: np.ndarray) -> dict[str, float]:
    """Median per-trace self time (µs) of each service over normal traces."""
    frame = pd.DataFrame({"trace": forest.trace_index, "service": services, "us": self_time_ns(forest) / 1e3})
    frame = frame[np.isin(forest.trace_index, normal)]
    per_trace = frame.groupby(["trace", "service"])["us"].sum()
    return {service: float(value) for service, value in per_trace.groupby(level="service").median().items()}


def _subforest(forest: SpanForest, traces: np.ndarray) -> SpanForest:
    rows = np.flatnonzero(np.isin(forest.trace_index, traces))
    return assemble(forest.spans.take(pa.array(rows)))
