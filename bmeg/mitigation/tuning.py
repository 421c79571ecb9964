"""Online tuning of a service's parameters around its current configuration.

The search is OPPerTune's HybridBandits: numeric parameters live in the unit cube (the
catalogue's `to_unit`); each step samples u on the unit sphere, tries the centre moved by
ε·u (clipped to the range), and moves the centre by (η/ε)·reward·u; categorical parameters
are drawn from exponential weights, and the chosen value's weight grows by η·reward / p.
There is no need for the repeatable measurements Bayesian optimization wants.

Each candidate is judged as TUNA does: measured on several replicas, unstable when the
relative range (max − min) / mean exceeds 0.3, and scored by its worst replica, never the
mean. The reward is the worst replica's improvement on a running reference latency; an
unstable candidate never earns a positive reward and never becomes the best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bmeg.cluster.catalogue import Parameter

#: TUNA's threshold on the relative range across replicas.
UNSTABLE_RELATIVE_RANGE = 0.3

Configuration = dict[str, float | str]


@dataclass(frozen=True)
class Judgement:
    """A configuration's measurements on several replicas (lower is better, e.g. p95 ms)."""

    worst: float
    mean: float
    relative_range: float

    @property
    def unstable(self) -> bool:
        return self.relative_range > UNSTABLE_RELATIVE_RANGE


def judge(measurements: Sequence[float]) -> Judgement:
    values = np.asarray(measurements, dtype=float)
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"measurements must be finite, non-negative and not empty, got {list(values)}")
    mean = float(values.mean())
    spread = float(values.max() - values.min())
    return Judgement(worst=float(values.max()), mean=mean, relative_range=spread / mean if mean > 0 else 0.0)


@dataclass
class Candidate:
    values: Configuration
    direction: np.ndarray  # u, the numeric step's unit direction
    probabilities: dict[str, float]  # P(chosen value) of each categorical parameter


@dataclass
class Step:
    values: Configuration
    judgement: Judgement
    reward: float


@dataclass
class HybridBandit:
    parameters: list[Parameter]
    start: Configuration
    epsilon: float = 0.1
    eta: float = 0.02
    unstable_penalty: float = 0.1
    seed: int = 0
    history: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.numeric = [p for p in self.parameters if p.numeric]
        self.categorical = [p for p in self.parameters if not p.numeric]
        self.centre = np.array([p.to_unit(float(self.start.get(p.name, p.default))) for p in self.numeric])
        self.weights = {p.name: np.zeros(len(p.choices)) for p in self.categorical}
        for p in self.categorical:  # start leaning to the current value
            self.weights[p.name][p.choices.index(self.start.get(p.name, p.default))] = 1.0
        self.reference: float | None = None
        self.best: Step | None = None

    def propose(self) -> Candidate:
        direction = self.rng.standard_normal(len(self.numeric))
        norm = np.linalg.norm(direction)
        direction = direction / norm if norm > 0 else direction
        point = np.clip(self.centre + self.epsilon * direction, 0.0, 1.0)
        values: Configuration = {p.name: p.from_unit(x) for p, x in zip(self.numeric, point)}
        probabilities = {}
        for p in self.categorical:
            odds = _softmax(self.weights[p.name])
            index = int(self.rng.choice(len(p.choices), p=odds))
            values[p.name] = p.choices[index]
            probabilities[p.name] = float(odds[index])
        return Candidate(values, direction, probabilities)

    def update(self, candidate: Candidate, judgement: Judgement) -> Step:
        if self.reference is None:
            self.reference = judgement.worst
        reward = (self.reference - judgement.worst) / max(self.reference, 1e-12)
        if judgement.unstable:
            reward = min(reward, 0.0) - self.unstable_penalty
        self.reference += 0.3 * (judgement.worst - self.reference)
        self.centre = np.clip(self.centre + (self.eta / self.epsilon) * reward * candidate.direction, 0.0, 1.0)
        for p in self.categorical:
            index = p.choices.index(candidate.values[p.name])
            self.weights[p.name][index] += self.eta * reward / candidate.probabilities[p.name]
        step = Step(candidate.values, judgement, reward)
        self.history.append(step)
        if not judgement.unstable and (self.best is None or judgement.worst < self.best.judgement.worst):
            self.best = step
        return step

    def centre_configuration(self) -> Configuration:
        values: Configuration = {p.name: p.from_unit(x) for p, x in zip(self.numeric, self.centre)}
        for p in self.categorical:
            values[p.name] = p.choices[int(np.argmax(self.weights[p.name]))]
        return values


def tune(
    bandit: HybridBandit,
    measure: Callable[[Configuration], Sequence[float]],
    steps: int,
) -> Step | None:
    """Run `steps` rounds: propose, measure on the replicas, judge, update. Returns the best
    stable step (None if every candidate was unstable)."""
    for _ in range(steps):
        candidate = bandit.propose()
        bandit.update(candidate, judge(measure(candidate.values)))
    return bandit.best


#: Candidates an online retune tries: bounded, so a controller's action stays quick.
ONLINE_STEPS = 6


def search_around(parameter: Parameter, current: float, measure: Callable[[float], Sequence[float]],
                  steps: int = ONLINE_STEPS, epsilon: float = 0.25, eta: float = 0.08, seed: int = 0) -> Step | None:
    """HybridBandits over one numeric parameter, from its current value: `steps` candidates
    around a moving centre, each measured on several replicas (`measure(value)` gives one
    latency per replica) and judged TUNA-style. The best stable candidate, or None."""
    if not parameter.numeric:
        raise ValueError(f"{parameter.name} is categorical: search_around tunes numeric parameters")
    bandit = HybridBandit([parameter], {parameter.name: float(current)}, epsilon=epsilon, eta=eta, seed=seed)
    return tune(bandit, lambda values: measure(float(values[parameter.name])), steps)


def _softmax(weights: np.ndarray) -> np.ndarray:
    shifted = np.exp(weights - weights.max())
    return shifted / shifted.sum()
