"""False alarms on fresh healthy traffic: stage 1 calibrated by the plain quantile vs the binomial bound.

    python bench/healthy.py --model RUN --normal NORMAL_TRACES --healthy MORE_HEALTHY_TRACES [--healthy MORE ...] \
        [--anomalous ANOMALOUS_TRACES] [--json OUT]
    python bench/healthy.py --model RUN --normal D/normal.parquet --dataset D   # a testbed dataset D

RUN is a `bmeg bootstrap` run fitted from NORMAL_TRACES; its stage-1 thresholds from before the
calibration (`metrics.json`) are calibrated again here, on the same held-back later part of
NORMAL_TRACES that `bmeg bootstrap` used, once per rule (`bmeg.training.calibration`: the
(1 - α) quantile, and the Clopper-Pearson bound at 95%), and each calibrated detector is scored
on MORE_HEALTHY_TRACES, traces neither the twin nor the calibration saw (e.g. the testbed's
fault-free traces recorded between fault rounds, with the campaign loading the machine).
Prints the share of them flagged, per rule and target rate, in one run (also by the model as
bootstrapped, its own thresholds); several `--healthy` sets (e.g. recorded by `bmeg testbed
record` at rest and with the machine loaded) are scored side by side by the same model, each
named by its file's stem, with the services the bootstrapped model blamed (ranked first) for
the traces it flagged; with ANOMALOUS_TRACES
(traces labelled anomalous), the share of those flagged too: the recall each rule keeps. Beside
stage 1, the simple per-trace rules (`rule_scores`: the signs of `bmeg.models.signs` -- the root's
duration deviation, a changed call pattern, an error that begins in the trace -- and a node's
self-time deviation), each calibrated alone by the plain quantile on the same held-back traces,
are scored on the same sets: what stage 1 would have to beat; and stage 1 with its signs
(`bound95+signs`: the model and the three signs, each at the rate over four, as `bmeg bootstrap`
calibrates it since session 40), whatever the run was bootstrapped with.
With `--dataset D` (a `bmeg generate --backend testbed` dataset), both sets come from it:
healthy, its traces labelled fault-free that neither start nor end within `MARGIN_S` of any
fault's window (the gaps between fault rounds); anomalous, its traces labelled anomalous. The
replayed rows also count "between-rounds, settled": those of them that also end at least
`ONSET_S` before the next fault's labelled start (a fault shows before the campaign stamps its
start: session 17, `bench/between_rounds.py`) and "between-rounds, recovered": those that also
begin after each fault source's measured aftermath (`aftermath_s`: traces still slower end to
end than the calibration period's p99 after a fault's end; session 24), printed per source.

The crowd check (`bmeg.models.crowd`) needs the stream's past, so it is measured on streams
replayed in time order, as `bmeg diagnose` reads a file: each `--healthy` file, and with
`--dataset` the whole dataset (its fault rounds and the gaps between them), of which the
between-rounds and the anomalous traces are counted. The model as bootstrapped is scored so,
without and with the check, side by side ("replayed" rows; the rows above them score each
trace on its own, with no past, as before): the default check (a stalled machine, and a busy
one while the stream's recent alarm share is low: session 16), session 11's (a stalled machine
only: `busy_z=None`) and session 15's (the busy case without the gate: `busy_ceiling=None`);
`--crowd KEY=VALUE[,KEY=VALUE]` (repeatable) adds the check with those parameters of `bmeg.models.crowd.CrowdRule` changed (e.g. `--crowd busy_z=11`);
`--served-batch-s S` also serves each stream as the Kafka consumer does (`served`), so that
the verdicts of a served stream, whose past lacks its batch, can be set beside the replay's
(with the default check, and with session 11's). `--follow KEY=VALUE[,KEY=VALUE]` (repeatable;
`Follow`: window_s, quantile, columns, absorbed) adds the default check on a stage-1 baseline that
follows the machine: each visit's self-time z-score less its service's recent quantile over the
stream's previous minutes, replayed only (session 17: "a baseline that follows the machine").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TypeVar, get_args, get_type_hints

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bmeg.evaluation.bootstrap import HELD_BACK
from bmeg.graphs import node_services
from bmeg.graphs.rpc import rpc_view
from bmeg.models.crowd import CrowdRule
from bmeg.models.detector import CROWD_WARNING, Detector
from bmeg.models.features import RELATIVE_VARIANTS, FeatureEncoder
from bmeg.models.history import StreamHistory
from bmeg.models.signs import trace_signs
from bmeg.traces.io import read_spans
from bmeg.training.calibration import calibrate_on_healthy, split_by_time

T = TypeVar("T")
RULES = {"quantile": None, "bound95": 0.95}
#: The crowd check as session 11 made it (a stalled machine only), and as session 15 (the busy
#: case without the stream's gate); the default is session 16's.
STALL_ONLY = "busy_z=None"
UNGATED = "busy_ceiling=None"
#: A fault's effects (queues draining) may outlast its window by this much (measured, session 17:
#: the target's slow visits back to the between-rounds level within 0.25 s of the labelled end).
MARGIN_S = 0.5
#: A fault shows this long before its labelled start (the campaign stamps the start when the
#: injection has returned; an interference hog runs while it is being set up): measured, session
#: 17 (`bench/between_rounds.py`: the target's share of slow visits above twice the between-rounds
#: level from 0.5 s before the stamp, interference; 0.25 s, network).
ONSET_S = 0.5


def testbed_sets(dataset: Path) -> tuple[pa.Table, pa.Table]:
    """(healthy spans between fault rounds, anomalous spans) of a testbed dataset (see above)."""
    spans, healthy, anomalous = testbed_stream(dataset)
    return (spans.filter(pc.is_in(spans["trace_id"], healthy)),
            spans.filter(pc.is_in(spans["trace_id"], anomalous)))


def testbed_stream(dataset: Path) -> tuple[pa.Table, pa.Array, pa.Array]:
    """(all spans, ids of the healthy traces between fault rounds, ids of the anomalous traces)
    of a testbed dataset (see above)."""
    traces = pq.read_table(dataset / "traces.parquet")
    return (pq.read_table(dataset / "spans.parquet"), between_rounds(dataset),
            traces["trace_id"].filter(traces["anomalous"]))


def between_rounds(dataset: Path, onset_s: float = 0.0, after_s: dict[str, float] | None = None,
                   margin_s: float = MARGIN_S) -> pa.Array:
    """Ids of a testbed dataset's traces labelled fault-free that neither start nor end within
    `margin_s` of any fault's window (with `after_s`, that long after the end of a fault of each
    source, at least `margin_s`) and (with `onset_s`) end that long before a fault's start."""
    traces = pq.read_table(dataset / "traces.parquet")
    faults = json.loads((dataset / "faults.json").read_text())
    start = traces["start_ns"].to_numpy()
    end = start + traces["duration_ns"].to_numpy()
    near_fault = np.zeros(len(start), dtype=bool)
    for fault in faults:
        after = max(margin_s, (after_s or {}).get(fault["source"], 0.0))
        near_fault |= (start < fault["end_ns"] + after * 1e9) & (end > fault["start_ns"] - onset_s * 1e9)
    fault_free = pc.equal(traces["fault_source"], "none").to_numpy(zero_copy_only=False)
    return traces["trace_id"].filter(pa.array(fault_free & ~near_fault))


#: A fault's aftermath (session 24): after its labelled end, in `AFTERMATH_BIN_S` bins up to
#: `AFTERMATH_MAX_S`, the share of fault-free traces slower end to end than the calibration
#: period's p99 of their request type; a source has settled after the last bin above
#: `AFTERMATH_SHARE` (3x what the calibration period has by construction). Read from latency
#: only, never from a model's verdicts.
AFTERMATH_BIN_S = 0.25
AFTERMATH_MAX_S = 3.0
AFTERMATH_SHARE = 0.03
AFTERMATH_MIN_TRACES = 50


def trace_extents(spans: pa.Table) -> pd.DataFrame:
    """Per trace of `spans`: its root operation (the request type), start and duration (ns)."""
    ends = spans.append_column("end_ns", pc.add(spans["start_ns"], spans["duration_ns"])).group_by(
        "trace_id").aggregate([("start_ns", "min"), ("end_ns", "max")]).to_pandas().set_index("trace_id")
    roots = spans.filter(pc.is_null(spans["parent_id"])).to_pandas().drop_duplicates("trace_id").set_index("trace_id")
    return pd.DataFrame({"request_type": roots["operation"], "start_ns": ends["start_ns_min"],
                         "duration_ns": ends["end_ns_max"] - ends["start_ns_min"]}).dropna()


def aftermath_s(dataset: Path) -> dict[str, tuple[float, list[float]]]:
    """Per fault source of a testbed dataset: (seconds after a fault's labelled end until its
    traces are no slower than calibration, the share slow in each `AFTERMATH_BIN_S` bin)."""
    calibration = trace_extents(pq.read_table(dataset / "normal.parquet"))
    p99 = calibration.groupby("request_type")["duration_ns"].quantile(0.99)
    traces = pq.read_table(dataset / "traces.parquet").to_pandas()
    # the gaps between rounds only: fault-free traces during another fault, or in the next one's
    # onset, would be read as this one's aftermath
    traces = traces[traces["trace_id"].isin(between_rounds(dataset, ONSET_S, {}, margin_s=0.0).to_pylist())]
    slow = (traces["duration_ns"] > p99.reindex(traces["request_type"]).to_numpy()).to_numpy()
    start = traces["start_ns"].to_numpy()
    edges = np.arange(0.0, AFTERMATH_MAX_S + AFTERMATH_BIN_S / 2, AFTERMATH_BIN_S)
    faults = json.loads((dataset / "faults.json").read_text())
    settle = {}
    for source in sorted({fault["source"] for fault in faults}):
        hits, counts = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
        for fault in (f for f in faults if f["source"] == source):
            since = (start - fault["end_ns"]) / 1e9
            hits += np.histogram(since[slow], edges)[0]
            counts += np.histogram(since, edges)[0]
        share = hits / np.maximum(counts, 1)
        above = np.flatnonzero((share > AFTERMATH_SHARE) & (counts >= AFTERMATH_MIN_TRACES))
        settle[source] = (float(edges[above[-1] + 1]) if len(above) else 0.0, share.round(3).tolist())
    return settle


RATES = (0.01, 0.005)
#: The simple per-trace rules scored beside stage 1 (issue 12: every model figure with the simple
#: rules beside it): the signs stage 1 may read (`bmeg.models.signs`: the root's duration deviation, a
#: changed call pattern, an error that begins in the trace) and the largest self-time deviation of any node.
MAX_SELF_TIME = "max self-time z"


#: A following baseline's shift is read once per this many seconds (on a grid of absolute time,
#: so that how a stream is cut into batches cannot change it), from the window before the step.
FOLLOW_STEP_S = 1.0
#: Fewer visits of a service than this in its window: no shift (the stream's start).
FOLLOW_MIN_VISITS = 200


@dataclass(frozen=True)
class Follow:
    """A stage-1 baseline that follows the machine (bench only, session 17): each visit's
    self-time z-score (and with `columns` 3 its duration's and wait's) less the `quantile` of its
    service's z-scores over the traces begun in the `window_s` seconds before the visit's
    `FOLLOW_STEP_S` step began (never its own step's), where that is positive (a busier machine is
    forgiven; a quieter one is not read as more sensitive). `absorbed`: the worst case of a fault
    lasting longer than the window, the visits begun inside a dataset's fault window shifted by
    the quantile of their service's visits in that same window. `refit`: the spread re-fitted too,
    the shifted z-score divided by the window's 90th percentile less its median where that is above 1
    (the baseline's own spread, in its z-scores). `unflagged`: fitted on the visits of the traces
    the model as bootstrapped did not put above its threshold only (a fault's flagged traces do not
    move the baseline). `fault_s`: a dataset's faults read as if each had lasted that long (a time
    into a long fault): a fault's visits shifted by the quantile of its service's visits in the
    `window_s - fault_s` seconds before the fault's start and the fault's own visits standing for
    `fault_s` seconds of them (repeated, its window's length to `fault_s`)."""

    window_s: float = 300.0
    quantile: float = 0.5
    columns: int = 1
    absorbed: bool = False
    refit: bool = False
    unflagged: bool = False
    fault_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Follow:
        return dataclass_overrides(cls, text, "--follow")

    @property
    def name(self) -> str:
        forms = "".join(f" {name}" for name in ("refit", "unflagged") if getattr(self, name))
        return (f"following W={self.window_s:g}s q={self.quantile:g}{forms} "
                f"{'self' if self.columns == 1 else 'self+duration+wait'}{', fault absorbed' if self.absorbed else ''}"
                f"{f', {self.fault_s:g} s into a fault' if self.fault_s else ''}")


def following_shift(follow: Follow, services: np.ndarray, starts: np.ndarray, z: np.ndarray,
                    windows: np.ndarray | None = None,
                    flagged: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float [nodes, follow.columns] twice: each node's shift and scale (see `Follow`); `windows`
    [F, 2]: the dataset's fault windows (start, end ns), read with `follow.absorbed`; `flagged`
    [nodes]: the node's trace was above the threshold, read with `follow.unflagged`."""
    codes, names = pd.factorize(services)
    step = int(FOLLOW_STEP_S * 1e9)
    shift = np.zeros((len(z), follow.columns))
    scale = np.ones((len(z), follow.columns))

    def fit(rows: np.ndarray, values: np.ndarray) -> None:
        if not len(values):
            return
        center = np.quantile(values, follow.quantile, axis=0)
        shift[rows] = np.maximum(center, 0.0)
        if follow.refit:
            scale[rows] = np.maximum(np.quantile(values, 0.9, axis=0) - np.quantile(values, 0.5, axis=0), 1.0)

    for code in range(len(names)):
        rows = np.flatnonzero(codes == code)
        rows = rows[np.argsort(starts[rows], kind="stable")]
        times, values = starts[rows], z[rows, : follow.columns]
        used = np.ones(len(rows), bool) if flagged is None or not follow.unflagged else ~flagged[rows]
        steps, first = np.unique(times // step, return_index=True)
        lower = np.searchsorted(times, steps * step - int(follow.window_s * 1e9))
        for lo, hi, end in zip(lower, first, np.r_[first[1:], len(rows)]):
            if hi - lo >= FOLLOW_MIN_VISITS:
                fit(rows[hi:end], values[lo:hi][used[lo:hi]])
        if (follow.absorbed or follow.fault_s) and windows is not None:
            for start, stop in windows:
                inside = (times >= start) & (times < stop)
                if not inside.any():
                    continue
                if follow.absorbed:
                    fit(rows[inside], values[inside & used])
                    continue
                before = (times >= start - int((follow.window_s - follow.fault_s) * 1e9)) & (times < start) & used
                repeats = max(1, round(follow.fault_s * 1e9 / (stop - start)))
                fit(rows[inside], np.concatenate([values[before], np.repeat(values[inside & used], repeats, axis=0)]))
    return shift, scale


@dataclass
class FollowingEncoder(FeatureEncoder):
    """The model's encoder with a `Follow` baseline, on a replayed stream (`transform` with `past` None)."""

    follow: Follow = field(default_factory=Follow)
    windows: np.ndarray | None = None
    flagged: np.ndarray | None = None  # [nodes of the forest transformed]
    _nodes: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    def transform(self, forest, paths=None, services=None, past=None, context=None):  # type: ignore[no-untyped-def]
        if services is None:
            services = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False)
        self._nodes = services, forest.start_ns[forest.root][forest.trace_index]
        try:
            return super().transform(forest, paths, services, past, context)
        finally:
            self._nodes = None

    def _z_scores(self, position, columns, count=None):  # type: ignore[no-untyped-def]
        z, known = super()._z_scores(position, columns, count)
        if self._nodes is not None and len(z) == len(self._nodes[0]) and z.shape[1] >= self.follow.columns:
            shift, scale = following_shift(self.follow, *self._nodes, z, self.windows, self.flagged)
            z[:, : self.follow.columns] = (z[:, : self.follow.columns] - shift) / scale
        return z, known


def following(detector: Detector, follow: Follow, dataset: Path | None, flagged: np.ndarray) -> Detector:
    """`detector` with its encoder's self-time baseline following the stream (`Follow`); `flagged`
    [nodes]: whether each node's trace was above the threshold as bootstrapped."""
    state = detector.encoder.to_state()
    state.pop("names")
    windows = None
    if dataset is not None:
        faults = json.loads((dataset / "faults.json").read_text())
        windows = np.array([(f["start_ns"], f["end_ns"]) for f in faults], dtype=np.int64)
    return replace(detector, encoder=FollowingEncoder(**state, follow=follow, windows=windows, flagged=flagged))


def crowd_rule(overrides: str) -> CrowdRule:
    """The default `CrowdRule` with `overrides` ("KEY=VALUE,KEY=VALUE"; VALUE a number or None) changed."""
    return dataclass_overrides(CrowdRule, overrides, "--crowd")


def dataclass_overrides(cls: type[T], text: str, option: str) -> T:
    """`cls()` (a dataclass whose fields all have defaults) with the fields `text` names changed:
    "KEY=VALUE,KEY=VALUE", each VALUE read as its field's default's type (a bool as 1/0/true/false,
    an int or a float as a number) or as None where the field's type allows it. Exits with
    `option` and what is wrong: an unknown key, a value of the wrong kind, or the class's own checks."""
    hints, defaults = get_type_hints(cls), cls()
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]  # a dataclass (above)
    changes: dict[str, object] = {}
    for item in text.split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if key not in names:
            raise SystemExit(f"{option}: no {cls.__name__} parameter {key!r}")
        default, optional = getattr(defaults, key), type(None) in get_args(hints[key])
        if optional and value == "None":
            changes[key] = None
        elif isinstance(default, bool):
            if value.lower() not in ("1", "0", "true", "false"):
                raise SystemExit(f"{option}: {key} takes 1, 0, true or false, not {value!r}")
            changes[key] = value.lower() in ("1", "true")
        else:
            try:
                changes[key] = (int if isinstance(default, int) else float)(float(value))
            except ValueError:
                raise SystemExit(f"{option}: {key} takes a number{' or None' if optional else ''}, not {value!r}") from None
    try:
        return cls(**changes)
    except ValueError as error:  # the class's own checks (CrowdRule's shares, busy_z above slow_z, ...)
        raise SystemExit(f"{option} {text}: {error}") from None


def served(detector: Detector, spans: pa.Table, batch_s: float) -> dict[str, tuple[bool, bool]]:
    """Each trace's (flagged without the crowd check, held by it) when the stream is served as
    the Kafka consumer serves it: whole traces in batches of the traces that ended in the same
    `batch_s` seconds, each batch diagnosed (`diagnosis_document`, the consumer's call) with the
    `StreamHistory` of the batches before it."""
    ends = spans.append_column("end_ns", pc.add(spans["start_ns"], spans["duration_ns"])).group_by(
        "trace_id").aggregate([("end_ns", "max")])
    end = ends["end_ns_max"].to_numpy()
    batch = pa.table({"trace_id": ends["trace_id"], "batch": (end - end.min()) // int(batch_s * 1e9)})
    ordered = spans.join(batch, "trace_id").sort_by("batch")
    bounds = np.flatnonzero(np.diff(ordered["batch"].to_numpy())) + 1
    history = StreamHistory(visits=detector.encoder.history)
    verdicts = {}
    for start, stop in zip(np.r_[0, bounds], np.r_[bounds, ordered.num_rows]):
        document = detector.diagnosis_document(ordered.slice(start, stop - start), history=history)
        for trace in document["traces"]:
            held = CROWD_WARNING in trace["warnings"]
            verdicts[trace["trace_id"]] = (trace["anomalous"] or held, held)
    return verdicts


def held_by_source(dataset: Path | None, held: np.ndarray) -> dict[str, int]:
    """How many of the `held` trace ids come from each fault source of the dataset ({} without one)."""
    if dataset is None or len(held) == 0:
        return {}
    names, counts = np.unique(fault_sources(dataset, held), return_counts=True)
    return {str(name): int(count) for name, count in zip(names, counts)}


def fault_sources(dataset: Path, trace_ids: np.ndarray) -> np.ndarray:
    """The fault source of each of `trace_ids` (traces of the dataset), in their order."""
    traces = pq.read_table(dataset / "traces.parquet", columns=["trace_id", "fault_source"])
    source = dict(zip(traces["trace_id"].to_pylist(), traces["fault_source"].to_pylist()))
    return np.array([source.get(trace_id, "unknown") for trace_id in np.asarray(trace_ids).tolist()], dtype=object)


def recall_by_source(dataset: Path | None, trace_ids: np.ndarray, flagged: np.ndarray, part: str) -> dict[str, float]:
    """The share of the anomalous traces (`trace_ids`) flagged, per fault source ({} but for the dataset's anomalous)."""
    if dataset is None or part != "anomalous":
        return {}
    sources = fault_sources(dataset, trace_ids)
    return {str(name): float(flagged[sources == name].mean()) for name in np.unique(sources)}


def replayed(detector: Detector, healthy: list[Path], dataset: Path | None, overrides: list[str],
             batch_s: float | None, follows: tuple[Follow, ...] = ()) -> list[dict]:
    """The model as bootstrapped on streams replayed in time order, without and with the crowd
    check (its default, session 11's, session 15's, and each of `overrides`: `crowd_rule`), and with `batch_s`
    also served (`served`, the default check and session 11's): per set, the share flagged
    (healthy sets) or the recall (the dataset's anomalous)."""
    streams: list[tuple[str, pa.Table, dict[str, pa.Array | None]]] = [
        (path.stem, read_spans(path), {path.stem: None}) for path in healthy]
    if dataset is not None:
        spans, between, anomalous = testbed_stream(dataset)
        settled = between_rounds(dataset, ONSET_S)
        aftermath = aftermath_s(dataset)
        print("aftermath (s after a fault's end until no slower than calibration; share slow per "
              f"{AFTERMATH_BIN_S:g}-s bin):", json.dumps(aftermath))
        recovered = between_rounds(dataset, ONSET_S, {source: s for source, (s, _) in aftermath.items()})
        streams.append((dataset.name, spans, {"between-rounds": between, "between-rounds, settled": settled,
                                               "between-rounds, recovered": recovered,
                                               "anomalous": anomalous}))
    rows = []
    for _, spans, parts in streams:
        forest = rpc_view(spans)
        scores = detector.score(forest, replay=True, crowd=True)
        ids = pa.array(forest.trace_ids)
        above = scores.above_threshold
        rules = {"default": (above, scores.crowd_explained)}
        for change in [STALL_ONLY, UNGATED, *overrides]:
            other = replace(detector, crowd=crowd_rule(change))
            rules[change] = above, other.crowd_explained(forest, scores.observation, scores.observation, None,
                                                         replay=True, above=above)
        for follow in follows:
            if follow.absorbed and dataset is None:
                continue
            moved = following(detector, follow, dataset, above[forest.trace_index]).score(forest, replay=True, crowd=True)
            rules[f"default, {follow.name}"] = moved.above_threshold, moved.crowd_explained
        for part, chosen in parts.items():
            mask = np.ones(forest.num_traces, bool) if chosen is None else pc.is_in(ids, chosen).to_numpy(
                zero_copy_only=False)
            for rule, (rule_above, explained) in rules.items():
                without = rule_above[mask]
                held = explained[mask] & without
                kept_ids = np.asarray(forest.trace_ids)[mask]
                rows.append({"set": part, "rule": rule, "traces": int(mask.sum()),
                             "flagged_without_crowd": float(without.mean()),
                             "flagged_with_crowd": float((without & ~held).mean()), "held_by_crowd": int(held.sum()),
                             "held_by_source": held_by_source(dataset, kept_ids[held]),
                             "recall_by_source": recall_by_source(dataset, kept_ids, without & ~held, part),
                             "recall_by_source_without_crowd": recall_by_source(dataset, kept_ids, without, part)})
        for rule in ["default", STALL_ONLY] if batch_s is not None else []:
            verdicts = served(replace(detector, crowd=crowd_rule(rule) if rule != "default" else detector.crowd),
                              spans, batch_s)
            for part, chosen in parts.items():
                keys = forest.trace_ids if chosen is None else chosen.to_pylist()
                flagged, held = np.array([verdicts[key] for key in keys], dtype=bool).reshape(-1, 2).T
                rows.append({"set": part, "rule": f"{rule}, served in {batch_s}-s batches", "traces": len(keys),
                             "flagged_without_crowd": float(flagged.mean()),
                             "flagged_with_crowd": float((flagged & ~held).mean()), "held_by_crowd": int(held.sum()),
                             "held_by_source": held_by_source(dataset, np.asarray(keys)[held])})
    return rows


def healthy_sets(paths: list[Path], dataset: Path | None) -> tuple[dict[str, pa.Table], pa.Table | None]:
    """({name: fresh healthy spans}, anomalous spans or None): each `--healthy` file under its
    stem, a testbed dataset's traces between fault rounds under "between-rounds"."""
    sets = {path.stem: read_spans(path) for path in paths}
    if len(sets) < len(paths):
        raise SystemExit("give the --healthy files distinct names: each set is reported under its file's stem")
    if dataset is None:
        return sets, None
    sets["between-rounds"], anomalous = testbed_sets(dataset)
    return sets, anomalous


def blamed(detector: Detector, scores) -> dict[str, int]:
    """How many flagged traces each service was blamed for (ranked first), most first."""
    routed = detector.route(scores)
    flagged = np.flatnonzero(routed.anomalous)
    first = np.where(routed.present, routed.service, -np.inf)[flagged].argmax(axis=1)
    names, counts = np.unique(np.asarray(routed.services)[first], return_counts=True)
    return {str(n): int(c) for n, c in sorted(zip(names, counts), key=lambda item: (-item[1], item[0]))}


def rule_scores(encoder: FeatureEncoder, forest) -> dict[str, np.ndarray]:
    """Each simple rule's score per trace of `forest` (its traces judged each alone: no past)."""
    x = encoder.transform(forest)
    largest = np.full(forest.num_traces, -np.inf)
    np.maximum.at(largest, forest.trace_index, x[:, encoder.names.index("z_log_self_time_us")].astype(np.float64))
    return {**trace_signs(forest, x, encoder.names), MAX_SELF_TIME: largest}


def rule_rows(encoder: FeatureEncoder, held_back, sets: dict, faulty_forest, dataset: Path | None) -> list[dict]:
    """The simple rules (`rule_scores`) calibrated as stage 1 is (the plain quantile at each of `RATES` on the held-back
    traces; a trace flagged strictly above it), scored on the same fresh forests and anomalous traces."""
    held = rule_scores(encoder, held_back)
    fresh = {name: rule_scores(encoder, forest) for name, forest in sets.items()}
    faulty = rule_scores(encoder, faulty_forest) if faulty_forest is not None else None
    rows = []
    for name in held:
        for rate in RATES:
            threshold = float(np.quantile(held[name], 1.0 - rate))
            flagged = None if faulty is None else faulty[name] > threshold
            rows.append({"rule": name, "rate": rate, "threshold": threshold,
                         "held_back_flagged": float((held[name] > threshold).mean()),
                         "fresh_flagged": {s: float((scores[name] > threshold).mean()) for s, scores in fresh.items()},
                         "recall": None if flagged is None else float(flagged.mean()),
                         "recall_by_source": {} if flagged is None or faulty_forest is None else recall_by_source(
                             dataset, np.asarray(faulty_forest.trace_ids), flagged, "anomalous")})
    return rows


def percent(shares: dict[str, float]) -> str:
    return " / ".join(f"{name} {100 * share:.1f}" for name, share in shares.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--normal", type=Path, required=True)
    parser.add_argument("--healthy", type=Path, action="append", default=[],
                        help="fresh healthy traces; repeat for sets scored side by side (named by file stem)")
    parser.add_argument("--anomalous", type=Path, default=None)
    parser.add_argument("--dataset", type=Path, default=None, help="a testbed dataset: both sets from it")
    parser.add_argument("--crowd", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also the crowd check with these CrowdRule parameters changed (repeatable), replayed")
    parser.add_argument("--follow", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also the default check with a baseline that follows the machine (Follow: window_s, "
                             "quantile, columns, absorbed), replayed (repeatable)")
    parser.add_argument("--served-batch-s", type=float, default=None,
                        help="also serve the streams as the Kafka consumer does, in batches of this many seconds")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.healthy and args.dataset is None:
        parser.error("give --healthy (and --anomalous) or --dataset")
    if args.dataset is not None and args.anomalous is not None:
        parser.error("--dataset brings its own anomalous traces: leave out --anomalous")
    sets, anomalous_spans = healthy_sets(args.healthy, args.dataset)
    if args.anomalous is not None:
        anomalous_spans = read_spans(args.anomalous)
    loaded = Detector.load(args.model)
    uncalibrated = replace(loaded, thresholds=loaded.metrics["calibration"]["thresholds_before"])
    _, held_back = split_by_time(read_spans(args.normal), HELD_BACK)
    held_back_forest = rpc_view(held_back)
    forests = {name: rpc_view(spans) for name, spans in sets.items()}
    scores = {name: uncalibrated.score(forest) for name, forest in forests.items()}
    faulty_forest = rpc_view(anomalous_spans) if anomalous_spans is not None else None
    faulty = uncalibrated.score(faulty_forest) if faulty_forest is not None else None

    def recall(detector: Detector) -> float | None:
        return None if faulty is None else float(detector.route(faulty).anomalous.mean())

    def by_source(detector: Detector) -> dict[str, float]:
        if faulty_forest is None or faulty is None:
            return {}
        return recall_by_source(args.dataset, np.asarray(faulty_forest.trace_ids), detector.route(faulty).anomalous,
                                "anomalous")

    def flagged(detector: Detector) -> dict[str, float]:
        return {name: float(detector.route(s).anomalous.mean()) for name, s in scores.items()}

    rows = [{"rule": "as bootstrapped", "rate": None, "held_back_flagged": None, "graph_threshold": loaded.thresholds["graph"],
             "fresh_flagged": flagged(loaded), "recall": recall(loaded), "recall_by_source": by_source(loaded)},
            {"rule": "uncalibrated", "rate": None, "held_back_flagged": None,
             "fresh_flagged": flagged(uncalibrated), "recall": recall(uncalibrated)}]
    for rate in RATES:
        variants = {rule: (confidence, False) for rule, confidence in RULES.items()}
        if loaded.encoder.variant in RELATIVE_VARIANTS:  # the features the signs read
            variants["bound95+signs"] = (RULES["bound95"], True)
        for rule, (confidence, signs) in variants.items():
            calibrated, calibration = calibrate_on_healthy(uncalibrated, held_back_forest, rate, confidence, signs)
            rows.append({"rule": rule, "rate": rate, "held_back_flagged": calibration.flagged_after,
                         "bound_met": calibration.bound_met, "graph_threshold": calibration.after["graph"],
                         "fresh_flagged": flagged(calibrated), "recall": recall(calibrated),
                         "recall_by_source": by_source(calibrated)})
    traces = {name: len(s.anomalous) for name, s in scores.items()}
    simple = rule_rows(loaded.encoder, held_back_forest, forests, faulty_forest, args.dataset)
    blame = {name: blamed(loaded, s) for name, s in scores.items()}
    streams = replayed(loaded, args.healthy, args.dataset, args.crowd, args.served_batch_s,
                       tuple(Follow.parse(text) for text in args.follow))
    result = {"held_back_traces": held_back_forest.num_traces, "fresh_traces": traces, "rows": rows,
              "simple_rules": simple, "as_bootstrapped_blamed": blame, "replayed": streams}
    for row in rows + simple:
        shares = ", ".join(f"{name} {share:.4f} of {traces[name]}" for name, share in row["fresh_flagged"].items())
        print(f"{row['rule']:>24} rate {row['rate']!s:>6}: held-back flagged {row['held_back_flagged']!s:>22}; "
              f"fresh flagged: {shares}; anomalous flagged {row['recall']}"
              + (f" (by source {percent(row['recall_by_source'])})" if row.get("recall_by_source") else ""))
    for name, counts in blame.items():
        print(f"as bootstrapped, {name}: {sum(counts.values())} of {traces[name]} flagged, blamed: "
              + (", ".join(f"{service} {count}" for service, count in counts.items()) or "none"))
    for row in streams:
        print(f"as bootstrapped, replayed, {row['set']} ({row['traces']} traces), crowd check {row['rule']}: flagged "
              f"{row['flagged_without_crowd']:.4f} without the crowd check, {row['flagged_with_crowd']:.4f} with it "
              f"({row['held_by_crowd']} held{', by fault source ' + str(row['held_by_source']) if row.get('held_by_source') else ''})"
              + (f"; recall by source {percent(row['recall_by_source'])} (without the check "
                 f"{percent(row['recall_by_source_without_crowd'])})" if row.get("recall_by_source") else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
