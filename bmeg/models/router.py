"""The router: which model judges a trace, from the size and shape of its call graph.

The B-MEG thesis found the SVM as good as the GNN, and cheaper, on small and simple call graphs
(hotel reservation: 5 services, 3 paths; train ticket: 11 services, 7 paths), so a trace goes to
the SVM when it has at most `max_services` distinct services AND at most `max_paths` distinct
paths (root-to-leaf sequences of (service, operation)); every other trace goes to the GNN
stages. `max_services = -1` sends every trace to the GNN.

The cuts are chosen at training time (`choose`) on decision traces whose faults the judged
models never saw in training (`bmeg.training.pipeline.choose_router`: other fault draws of a
simulated application, or a probe detector fitted without the faults of some services, judged
on those). What the closed loop acts on is the flag (which traces are slow) and the culprit (the
service it acts on), so a cut's quality is its culprit F1: a flagged bottlenecked trace whose
top-ranked service is a true bottleneck, named one (at or above its model's node threshold and
a score the closed loop can act on), counts as a hit, whatever the model's score scale
(`bmeg.training.pipeline.named_culprit`); and the loop must handle every kind of fault, whatever
the decision draw's mix of them, so a cut's quality is its culprit F1 under a uniform mix of
fault sources (`uniform_mix_culprit_f1`: the mean over the sources of the culprit F1 each
source's bottlenecked traces give alone at the draw's imbalance; issue 17, session 14: a loss on
one source may be traded for gains on others, as the mean weighs them). The GNN alone is kept
unless some cut (1) flags traces no worse (trace F1) than the GNN alone by more than
`tolerance`, (2) names culprits better under the uniform mix by more than `tolerance`, and (3)
is still ahead in 95% of paired resamples of the decision traces, resampled within each fault
source (a lead on a few dozen bottlenecked traces is no evidence); among such cuts within
`tolerance` of the best, the cheapest per trace, measured. Where no cut is ahead so, a cut is
tied with the GNN alone when the resamples show it no worse: in 95% of them its culprit F1
under the uniform mix and its trace F1 are no more than `tolerance` below the GNN alone's (not
merely when the GNN alone fails to be ahead in 95% of them: on a few dozen bottlenecked
decision traces nothing is ahead in 95%, and absence of evidence took the worse model,
docs/issue-17.md, session 12), and the GNN alone is not ahead in 95% of them either (a cut measurably
worse, though within the tolerance, is not taken for its cost); a tie goes to the cheaper
model: the cheapest cut that passes (1) and is tied so. The reason, in words, names the
criterion that decided and travels with the router (`why`) into every GNN-routed trace's
`route`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.graphs import SpanForest

_PRIME = np.int64(1_000_003)
_MODULUS = np.int64((1 << 61) - 1)


def distinct_paths(forest: SpanForest, keys: np.ndarray | pa.Array) -> np.ndarray:
    """int64 [T]: distinct root-to-leaf sequences of node keys in each trace."""
    # any consistent numbering will do (only equal paths are counted): hashing, not np.unique's sort of strings
    if isinstance(keys, pa.Array):
        codes = pc.dictionary_encode(keys).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        codes, _ = pd.factorize(np.asarray(keys, dtype=object))
    path = np.zeros(forest.num_spans, dtype=np.int64)
    for depth in range(int(forest.depth.max(initial=0)) + 1):
        level = np.flatnonzero(forest.depth == depth)
        above = np.where(forest.parent[level] >= 0, path[np.maximum(forest.parent[level], 0)], 0)
        # a polynomial hash of the path: collisions at 2^-61 per pair are far below any count here
        path[level] = (above % _MODULUS * _PRIME + codes[level] + 1) % _MODULUS
    has_child = np.zeros(forest.num_spans, dtype=bool)
    has_child[forest.parent[forest.parent >= 0]] = True
    leaves = np.flatnonzero(~has_child)
    trace, leaf_path = forest.trace_index[leaves], path[leaves]
    order = np.lexsort((leaf_path, trace))  # (trace, path) pairs sorted: a pair differing from the one before is new
    trace, leaf_path = trace[order], leaf_path[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (trace[1:] != trace[:-1]) | (leaf_path[1:] != leaf_path[:-1])
    return np.bincount(trace[new], minlength=forest.num_traces).astype(np.int64)


@dataclass(frozen=True)
class Router:
    max_services: int = -1  # -1: no trace goes to the SVM
    max_paths: int = -1
    why: str = field(default="", compare=False)  # how the cuts were chosen, in words

    @classmethod
    def everything(cls) -> Router:
        """Every trace to the SVM."""
        return cls(1 << 30, 1 << 30)

    def to_svm(self, services: np.ndarray, paths: np.ndarray) -> np.ndarray:
        """bool [T]: the traces the SVM judges."""
        return (services <= self.max_services) & (paths <= self.max_paths)

    def reasons(self, services: np.ndarray, paths: np.ndarray) -> list[str]:
        """Per trace, why its model was chosen (the `route` of its diagnosis)."""
        if self.max_services < 0:
            why = self.why or "gnn: the SVM was not measurably better on the decision traces"
            return [f"gnn: every trace goes to the GNN ({why.removeprefix('gnn: ')})"] * len(services)
        reasons = []
        for s, p in zip(services.tolist(), paths.tolist()):
            if s > self.max_services:
                reasons.append(f"gnn: {s} services > {self.max_services}")
            elif p > self.max_paths:
                reasons.append(f"gnn: {p} distinct paths > {self.max_paths}")
            else:
                reasons.append(f"svm: {s} services <= {self.max_services} and {p} distinct paths <= {self.max_paths}")
        return reasons

    def to_state(self) -> dict[str, int | str]:
        return {"max_services": self.max_services, "max_paths": self.max_paths, "why": self.why}

    @classmethod
    def from_state(cls, state: dict) -> Router:
        return cls(int(state["max_services"]), int(state["max_paths"]), str(state.get("why", "")))


def choose(y: np.ndarray, verdicts: dict[str, np.ndarray], named: dict[str, np.ndarray], services: np.ndarray,
           paths: np.ndarray, cost_s: dict[str, float], tolerance: float = 0.01, weights: np.ndarray | None = None,
           confidence: float = 0.95, seed: int = 0, sources: np.ndarray | None = None,
           tie_to_cheaper: bool = True) -> tuple[Router, list[dict], str]:
    """The router for decision traces with labels `y`, given each model's ("gnn", "svm")
    verdicts [T], its culprit credit [T] in [0, 1] (`bmeg.training.pipeline.named_culprit`: 1
    where its top-ranked service is a true bottleneck it calls one, else 0; read on the traces
    with `y == 1`), its
    cost in seconds per trace, measured, optional trace weights (default 1) and fault sources.

    Every pair of cuts seen in the data is tried (plus "never the SVM"). A cut's quality is its
    culprit F1 under a uniform mix of the fault sources (`uniform_mix_culprit_f1`: each source
    weighs the same, whatever the draw's mix; no sources given: one source, the plain culprit
    F1). A cut is eligible when its trace F1 is no worse than the GNN alone's by more than
    `tolerance`; "never" wins unless some eligible cut's quality beats it by more than
    `tolerance`. Otherwise the cheapest eligible cut within `tolerance` of the best quality is
    taken, ties to the one sending fewer traces to the SVM, if it holds up when the decision
    traces are resampled within each fault source (paired bootstrap, 200 draws with `seed`): in
    at least `confidence` of the draws its quality is above the GNN alone's and its trace F1 no
    worse than `tolerance` below it. Else, with `tie_to_cheaper`, the cheapest eligible cut
    cheaper than the GNN alone is taken that is tied with it: whose quality is no worse than the
    GNN alone's by more than `tolerance`, which in at least `confidence` of the draws has a
    quality and a trace F1 no worse than `tolerance` below it, and which the GNN alone beats
    (a higher quality, or a trace F1 higher by more than `tolerance`) in fewer than `confidence`
    of them; else (or without `tie_to_cheaper`: decision traces that share the training faults,
    where a tie says nothing) the GNN alone stays. A loss on one fault source is traded for the
    gains on others as the uniform mix weighs them (issue 17, session 14; until then any loss
    that held in resamples blocked a cut): a taken cut's reason names its losses. Returns the
    router, every candidate with its figures and the reason in words.
    """
    weights = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
    sources = np.full(len(y), "", dtype=object) if sources is None else np.asarray(sources, dtype=object)
    codes = source_codes(y, sources)
    count = mixed_sources(codes)
    mix = f"a uniform mix of {count} fault source{'s' if count != 1 else ''}"
    candidates = [Router()] + [Router(int(s), int(p)) for s in np.unique(services) for p in np.unique(paths)]
    rows: list[dict[str, Any]] = []
    gnn = _routed(np.zeros(len(y), dtype=bool), y, verdicts, named)
    for router in candidates:
        predicted, right = _routed(router.to_svm(services, paths), y, verdicts, named)
        bottlenecked = weights[y == 1]
        credit = float(np.sum(bottlenecked * right[y == 1]) / np.sum(bottlenecked)) if len(bottlenecked) else 1.0
        share = float(np.mean(router.to_svm(services, paths))) if len(y) else 0.0
        rows.append({"max_services": router.max_services, "max_paths": router.max_paths,
                     "f1": _f1(y, predicted, weights), "culprit_credit": credit,
                     "quality": uniform_mix_culprit_f1(codes, predicted, right, weights),
                     "pooled_culprit_f1": _culprit_f1(y, predicted, right, weights),
                     "share_to_svm": share, "cost_s_per_trace": share * cost_s["svm"] + (1 - share) * cost_s["gnn"],
                     "by_source": _by_source(y, predicted, right, weights, sources)})
    gnn_alone = rows[0]
    # The closed loop acts on the flag (which traces are slow) and on the culprit (the service
    # it acts on): the SVM must name culprits better AND flag traces about as well.
    eligible = [row for row in rows if row["f1"] >= gnn_alone["f1"] - tolerance]
    best = max(row["quality"] for row in eligible)

    def cut_of(row: dict[str, Any]) -> Router:
        return Router(int(row["max_services"]), int(row["max_paths"]))

    def shares(row: dict[str, Any]) -> tuple[float, float, float]:
        return _bootstrap_shares(y, weights, codes, _routed(cut_of(row).to_svm(services, paths), y, verdicts, named),
                                 gnn, tolerance, seed)

    def figures(row: dict[str, Any]) -> str:
        return (f"culprit F1 {row['quality']:.3f} against the GNN alone's {gnn_alone['quality']:.3f} (under {mix}; "
                f"under the draw's own mix {row['pooled_culprit_f1']:.3f} against {gnn_alone['pooled_culprit_f1']:.3f}), "
                f"trace F1 {row['f1']:.3f} against {gnn_alone['f1']:.3f}")

    def traded(row: dict[str, Any]) -> str:
        """The taken cut's losses on single fault sources, traded under the uniform mix, or ''."""
        losses = source_losses(y, _routed(cut_of(row).to_svm(services, paths), y, verdicts, named), gnn, weights,
                               sources, tolerance, seed)
        return (f"; worse on faults of {({source: loss_words(figures) for source, figures in losses.items()})} "
                f"(culprit recall), traded for the gains on the others under the uniform mix" if losses else "")

    if best > gnn_alone["quality"] + tolerance:
        row = min((row for row in eligible if row["quality"] >= best - tolerance),
                  key=lambda row: (row["cost_s_per_trace"], row["share_to_svm"]))
        ahead, _, _ = shares(row)
        if ahead >= confidence:
            return (cut_of(row), rows,
                    f"svm: at most {row['max_services']} services and {row['max_paths']} distinct paths, by the "
                    f"lead under a uniform mix of fault sources: {figures(row)}, ahead in {ahead:.0%} of decision "
                    f"sets resampled within each source (needs {confidence:.0%}){traded(row)}")
        why = (f"gnn: the best cut ({row['max_services']} services, {row['max_paths']} paths) is not reliably better "
               f"under a uniform mix of fault sources: {figures(row)}, ahead in {ahead:.0%} of decision sets "
               f"resampled within each source (needs {confidence:.0%})")
    else:
        why = (f"gnn: no cut that flags traces as well (trace F1 >= {gnn_alone['f1']:.3f} - {tolerance:g}) names "
               f"culprits better than the GNN alone under {mix} by more than {tolerance:g} (culprit F1 {best:.3f} "
               f"against {gnn_alone['quality']:.3f})")
    if not tie_to_cheaper:
        return Router(), rows, why
    # Tied: no model measurably ahead, and the cut measurably no worse. The cuts are chosen "by
    # the measured quality and cost of each model" (issue 17), so a tie goes to the cheaper one;
    # but that neither is ahead in `confidence` of the resamples is no evidence of a tie where
    # the decision traces are few (50 bottlenecked at imbalance 0.01, docs/issue-17.md, session
    # 12): the cut must be no worse, within the tolerance, in `confidence` of them, and the GNN
    # not ahead in `confidence` of them (a cut measurably worse is not traded for its cost).
    tied = sorted((row for row in eligible[1:] if row["cost_s_per_trace"] < gnn_alone["cost_s_per_trace"]
                   and row["quality"] >= gnn_alone["quality"] - tolerance),
                  key=lambda row: (row["cost_s_per_trace"], row["share_to_svm"]))
    seen: set[tuple[float, float, float]] = set()
    closest: tuple[float, float, int, int] = (-1.0, 0.0, 0, 0)  # (no worse, behind, cut): the candidate nearest a tie
    for row in tied:
        key = (row["share_to_svm"], row["quality"], row["f1"])  # cuts routing the same traces: one resampling
        if key in seen:
            continue
        seen.add(key)
        _, no_worse, behind = shares(row)
        if no_worse >= confidence and behind < confidence:
            return (cut_of(row), rows,
                    f"svm: tied on quality, cheaper: at most {row['max_services']} services and "
                    f"{row['max_paths']} distinct paths: {figures(row)}, no worse than the GNN alone (within "
                    f"{tolerance:g}) in {no_worse:.0%} of decision sets resampled within each source (needs "
                    f"{confidence:.0%}), the GNN alone ahead in {behind:.0%}, "
                    f"{row['cost_s_per_trace'] * 1e6:.0f} against {gnn_alone['cost_s_per_trace'] * 1e6:.0f} µs per trace"
                    f"{traded(row)}")
        closest = max(closest, (no_worse, behind, row["max_services"], row["max_paths"]))
    shown = (f"; the nearest, {closest[2]} services and {closest[3]} paths, no worse in {closest[0]:.0%}, "
             f"the GNN alone ahead in {closest[1]:.0%}" if closest[0] >= 0 else "")
    return Router(), rows, (f"{why}; nor is a cheaper cut shown tied with it (each flags traces worse, names culprits "
                            f"worse under the uniform mix, is no worse than it within {tolerance:g} in fewer than "
                            f"{confidence:.0%} of resampled decision sets, or is beaten in {confidence:.0%}{shown})")


def _routed(to_svm: np.ndarray, y: np.ndarray, verdicts: dict[str, np.ndarray],
            named: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Under a routing: each trace's verdict, and its culprit credit (0 on normal traces)."""
    return (np.where(to_svm, verdicts["svm"], verdicts["gnn"]),
            np.where(to_svm, named["svm"], named["gnn"]) * (y == 1))


def source_losses_of(router: Router, y: np.ndarray, verdicts: dict[str, np.ndarray], named: dict[str, np.ndarray],
                     services: np.ndarray, paths: np.ndarray, sources: np.ndarray, tolerance: float = 0.01,
                     seed: int = 0) -> dict[str, dict[str, float]]:
    """`source_losses` of traces routed by `router` against the GNN alone, unweighted."""
    cut = _routed(router.to_svm(services, paths), y, verdicts, named)
    gnn = _routed(np.zeros(len(y), dtype=bool), y, verdicts, named)
    return source_losses(y, cut, gnn, np.ones(len(y)), np.asarray(sources, dtype=object), tolerance, seed)


def source_losses(y: np.ndarray, cut: tuple[np.ndarray, np.ndarray], gnn: tuple[np.ndarray, np.ndarray],
                  weights: np.ndarray, sources: np.ndarray, tolerance: float, seed: int,
                  draws: int = 200) -> dict[str, dict[str, float]]:
    """source -> {cut, gnn, traces, held} for each fault source whose culprit recall under `cut`
    is below `gnn`'s by more than `tolerance`: both recalls, its bottlenecked traces, and the
    share of paired resamples of those traces (`draws`, with `seed`) in which the loss is still
    above `tolerance`."""
    cut_recall, gnn_recall = (_by_source(y, *routed, weights, sources) for routed in (cut, gnn))
    losses = {}
    for source in (source for source in cut_recall if cut_recall[source] < gnn_recall[source] - tolerance):
        rows = np.flatnonzero((y == 1) & (sources == source))
        pick = rows[np.random.default_rng(seed).integers(0, len(rows), (draws, len(rows)))]
        w = weights[pick]
        loss = (np.sum(w * gnn[0][pick] * gnn[1][pick], axis=1) - np.sum(w * cut[0][pick] * cut[1][pick], axis=1)) \
            / np.sum(w, axis=1)
        losses[str(source)] = {"cut": cut_recall[source], "gnn": gnn_recall[source], "traces": float(len(rows)),
                               "held": float(np.mean(loss > tolerance))}
    return losses


#: The fewest bottlenecked traces of a fault source that the uniform mix weighs as a source
#: (`source_codes`) and on which a loss can block a cut in the check on sources the decision
#: draws lack (`worse_sources`). A resample
#: of n traces keeps a point loss in most draws whatever n: 3 traces the cut gets wrong and the
#: GNN right are a loss in every resample (the testbed's code+misconfiguration, docs/issue-17.md),
#: yet one such trace moves that source's recall by 1/n. At 15 one trace is 0.067.
MIN_SOURCE_TRACES = 15


def checked_sources(y: np.ndarray, sources: np.ndarray, min_traces: int = MIN_SOURCE_TRACES) -> int:
    """How many fault sources have at least `min_traces` bottlenecked traces: the per-source
    checks a cut takes (`worse_sources`' family)."""
    _, counts = np.unique(np.asarray(sources, dtype=object)[np.asarray(y) == 1].astype(str), return_counts=True)
    return int(np.sum(counts >= min_traces))


def worse_sources(losses: dict[str, dict[str, float]], confidence: float, checked: int,
                  min_traces: int = MIN_SOURCE_TRACES) -> dict[str, str]:
    """source -> the figures in words, for the `source_losses` on at least `min_traces`
    bottlenecked traces that hold in enough of the resamples: the sources a cut names culprits
    worse on (the check on validation faults of the sources the decision draws lack,
    `bmeg.training.pipeline`; until session 14 also `choose`'s, where a uniform mix of the
    sources now trades a loss on one for gains on others).

    A loss must be shown as a lead must (`_bootstrap_shares`): a source with a few dozen
    bottlenecked traces moves 0.03 per trace, so a point loss of one trace blocked the SVM on
    noise; a real loss on many traces still holds in the resamples and still blocks. The
    `checked` sources (`checked_sources`) are as many tests, each of which can block: at
    `confidence` each, a cut no worse on any of 5 sources was blocked by one of them with a
    chance up to 1 - 0.95^5 = 23% (docs/issue-17.md, session 13). Holm's step-down keeps that
    chance at most 1 - `confidence`: the loss held in the largest share of resamples must hold in
    1 - (1 - `confidence`) / `checked` of them, the next in 1 - (1 - `confidence`) / (`checked`
    - 1), and so on until one falls short; one source checked, `confidence` as before."""
    candidates = sorted(((source, figures) for source, figures in losses.items() if figures["traces"] >= min_traces),
                        key=lambda item: -item[1]["held"])
    family = max(checked, len(candidates))
    worse = {}
    for rank, (source, figures) in enumerate(candidates):
        needed = holm_share(confidence, family - rank)
        if figures["held"] < needed - 1e-9:  # a hair under: 190 of 200 draws meet 95%
            break
        worse[source] = loss_words(figures, needed)
    return worse


def holm_share(confidence: float, remaining: int) -> float:
    """The share of resamples a loss must hold in with `remaining` tests left in Holm's step-down."""
    return 1.0 - (1.0 - confidence) / max(remaining, 1)


def loss_words(figures: dict[str, float], needed: float | None = None) -> str:
    return (f"{figures['cut']:.3f} against {figures['gnn']:.3f} on {figures['traces']:.0f} traces, "
            f"in {figures['held']:.0%} of resamples" + ("" if needed is None else f" (needs {needed * 100:.4g}%)"))


def source_codes(y: np.ndarray, sources: np.ndarray, min_traces: int = MIN_SOURCE_TRACES) -> np.ndarray:
    """int [T]: each bottlenecked trace's fault source numbered 0..k-1 among the sources of at
    least `min_traces` bottlenecked traces (the uniform mix's sources), -2 on a bottlenecked trace
    of a smaller source, -1 on a normal trace. Where no source is that large (or none is given),
    every bottlenecked trace is of one source, 0."""
    bottlenecked = np.asarray(y) == 1
    _, numbers, counts = np.unique(np.asarray(sources, dtype=object)[bottlenecked].astype(str),
                                   return_inverse=True, return_counts=True)
    large = counts >= min_traces
    codes = np.full(len(bottlenecked), -1, dtype=np.int64)
    # below the floor a resample keeps a point loss whatever its size (`MIN_SOURCE_TRACES`): such
    # a source, weighed as much as one of hundreds of traces, would decide on a handful's noise
    codes[bottlenecked] = np.where(large, np.cumsum(large) - 1, -2)[numbers] if large.any() else 0
    return codes


def mixed_sources(codes: np.ndarray) -> int:
    """How many fault sources the uniform mix weighs (`source_codes`)."""
    return int(codes.max(initial=-1)) + 1


def uniform_mix_culprit_f1(codes: np.ndarray, predicted: np.ndarray, right: np.ndarray, weights: np.ndarray) -> float:
    """The culprit F1 (`_culprit_f1`) under a uniform mix of fault sources: the mean over the
    sources of `codes` (`source_codes`) of the culprit F1 of that source's bottlenecked traces
    alone, weighed up to all the bottlenecked traces' weight, beside every normal trace (so each
    source at the draw's imbalance, and the draw's mix of sources decides nothing). One source:
    the plain culprit F1 of its bottlenecked and the normal traces."""
    sources = mixed_sources(codes)
    if sources == 0:
        return 0.0
    mixed = codes >= 0

    def per_source(values: np.ndarray) -> np.ndarray:
        return np.bincount(codes[mixed], (weights * values)[mixed], minlength=sources)

    targets, hits, claims = per_source(np.ones(len(codes))), per_source(predicted * right), per_source(predicted)
    false_claims = float(np.sum((weights * predicted)[codes == -1]))
    scale = np.sum(targets) / np.maximum(targets, 1e-12)  # each source weighed up to every mixed bottlenecked trace
    return float(np.mean(2 * scale * hits / np.maximum(scale * (claims + targets) + false_claims, 1e-12)))


def _by_source(y: np.ndarray, predicted: np.ndarray, right: np.ndarray, weights: np.ndarray,
               sources: np.ndarray) -> dict[str, float]:
    """Culprit recall per fault source: the credit of flagged culprits over the bottlenecked traces."""
    figures = {}
    for source in sorted(set(sources[y == 1].tolist())):
        mask = (y == 1) & (sources == source)
        figures[str(source)] = float(np.sum(weights[mask] * predicted[mask] * right[mask]) / np.sum(weights[mask]))
    return figures


def _bootstrap_shares(y: np.ndarray, weights: np.ndarray, codes: np.ndarray, cut: tuple[np.ndarray, np.ndarray],
                      gnn: tuple[np.ndarray, np.ndarray], tolerance: float, seed: int,
                      draws: int = 200) -> tuple[float, float, float]:
    """The shares of paired resamples of the decision traces, resampled within each fault source
    of `codes` (`source_codes`; the normal traces one stratum, the small sources' another), in
    which `cut` is ahead (a culprit F1 under the uniform mix (`uniform_mix_culprit_f1`) above
    `gnn`'s and a trace F1 no worse than `tolerance` below it), in which it is no worse (both no
    worse than `tolerance` below `gnn`'s), and in which `gnn` is ahead (a culprit F1 under the
    uniform mix above `cut`'s, or a trace F1 above it by more than `tolerance`)."""
    rng = np.random.default_rng(seed)
    strata = [np.flatnonzero(codes == code) for code in np.unique(codes)]
    ahead = no_worse = behind = 0
    for _ in range(draws):
        pick = np.concatenate([stratum[rng.integers(0, len(stratum), len(stratum))] for stratum in strata]
                              ) if strata else np.zeros(0, dtype=np.int64)
        yy, ww, cc = y[pick], weights[pick], codes[pick]
        cut_f1 = uniform_mix_culprit_f1(cc, cut[0][pick], cut[1][pick], ww)
        gnn_f1 = uniform_mix_culprit_f1(cc, gnn[0][pick], gnn[1][pick], ww)
        cut_flags, gnn_flags = _f1(yy, cut[0][pick], ww), _f1(yy, gnn[0][pick], ww)
        ahead += int(cut_f1 > gnn_f1 and cut_flags >= gnn_flags - tolerance)
        no_worse += int(cut_f1 >= gnn_f1 - tolerance and cut_flags >= gnn_flags - tolerance)
        behind += int(gnn_f1 > cut_f1 or cut_flags < gnn_flags - tolerance)
    return ahead / draws, no_worse / draws, behind / draws


def _culprit_f1(y: np.ndarray, predicted: np.ndarray, right: np.ndarray, weights: np.ndarray) -> float:
    """F1 of the culprits a router's diagnoses name: a flagged bottlenecked trace counts its
    culprit credit as a hit; every flagged trace is a claim, every bottlenecked trace a target."""
    hits = float(np.sum(weights * predicted * right))
    return 2 * hits / max(float(np.sum(weights[predicted]) + np.sum(weights[y == 1])), 1e-12)


def _f1(y: np.ndarray, predicted: np.ndarray, weights: np.ndarray) -> float:
    return _culprit_f1(y, predicted, (y == 1).astype(np.float64), weights)
