"""The catalogue of tunable parameters per kind of service (`bmeg/cluster/parameters.yaml`).

Each parameter says its range or choices, its default, what a change costs (reload, restart
with downtime, reboot) and how its value reaches the service on Kubernetes (an environment
variable or a ConfigMap key). The tuner works in a normalized space: `to_unit` / `from_unit`
map a numeric value to [0, 1] and back (log scale for ranges over decades).
"""

from __future__ import annotations

import math
from fnmatch import fnmatch
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator, PrivateAttr

from bmeg.paths import shipped_folder

DEFAULT_CATALOGUE = shipped_folder("bmeg.cluster", ".") / "parameters.yaml"


class CatalogueError(ValueError):
    """The catalogue file is missing or malformed; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ConfigMapKey(_Strict):
    name: str
    key: str


class Parameter(_Strict):
    name: str = ""  # filled from the mapping key
    type: Literal["integer", "number", "categorical"]
    min: float | None = None
    max: float | None = None
    scale: Literal["linear", "log"] = "linear"
    default: float | str
    choices: list[str] | None = None
    change: Literal["reload", "restart", "reboot"]
    downtime_s: float = Field(ge=0)
    importance: float = Field(default=0.0, ge=0, le=1)
    env: str | None = None
    configmap: ConfigMapKey | None = None
    simulator: Literal["pool_size", "hit_ratio"] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Parameter:
        if self.type == "categorical":
            if not self.choices or self.default not in self.choices:
                raise ValueError(f"categorical default {self.default!r} must be one of choices {self.choices}")
        else:
            if self.min is None or self.max is None or self.min > self.max:
                raise ValueError(f"numeric range [{self.min}, {self.max}] needs min <= max")
            if isinstance(self.default, str) or not self.min <= self.default <= self.max:
                raise ValueError(f"default {self.default!r} lies outside [{self.min}, {self.max}]")
            if self.scale == "log" and self.min <= 0:
                raise ValueError(f"log scale needs min > 0, not {self.min}")
        if (self.env is None) == (self.configmap is None):
            raise ValueError("give exactly one of env or configmap (how the value reaches the service)")
        return self

    @property
    def numeric(self) -> bool:
        return self.type != "categorical"

    def to_unit(self, value: float) -> float:
        """A numeric value as a point of [0, 1]."""
        low, high, x = float(self.min), float(self.max), float(value)
        if high == low:
            return 0.0
        if self.scale == "log":
            low, high, x = math.log(low), math.log(high), math.log(max(x, self.min))
        return min(1.0, max(0.0, (x - low) / (high - low)))

    def from_unit(self, unit: float) -> float:
        """The value at a point of [0, 1], clipped to the range and rounded for integers."""
        unit = min(1.0, max(0.0, unit))
        low, high = float(self.min), float(self.max)
        value = (math.exp(math.log(low) + unit * (math.log(high) - math.log(low)))
                 if self.scale == "log" else low + unit * (high - low))
        return float(round(value)) if self.type == "integer" else value

    def check(self, value: float | str) -> float | str:
        """`value` if it is allowed, else a ValueError saying what is."""
        if self.type == "categorical":
            if value not in self.choices:
                raise ValueError(f"{self.name}: {value!r} is not one of {self.choices}")
            return value
        if isinstance(value, str) or not self.min <= float(value) <= self.max:
            raise ValueError(f"{self.name}: {value!r} lies outside [{self.min:g}, {self.max:g}]")
        return float(value)


class ServiceKind(_Strict):
    name: str = ""
    match: list[str]
    container: str | None = None
    parameters: dict[str, Parameter]

    def matches(self, service: str) -> bool:
        return any(fnmatch(service, pattern) for pattern in self.match)


class Catalogue(_Strict):
    kinds: dict[str, ServiceKind]
    # service -> its kind: every anomalous trace the consumer publishes asks, for each service
    # it names, and matching the patterns each time was a tenth of the hints' cost
    _kind_by_service: dict[str, ServiceKind | None] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _name_entries(self) -> Catalogue:
        for kind_name, kind in self.kinds.items():
            kind.name = kind_name
            for parameter_name, parameter in kind.parameters.items():
                parameter.name = parameter_name
        return self

    def kind_of(self, service: str) -> ServiceKind | None:
        """The first kind whose patterns match the service's name."""
        if service not in self._kind_by_service:
            self._kind_by_service[service] = next((kind for kind in self.kinds.values() if kind.matches(service)), None)
        return self._kind_by_service[service]

    def parameters_for(self, service: str) -> dict[str, Parameter]:
        kind = self.kind_of(service)
        return dict(kind.parameters) if kind else {}

    def parameter(self, service: str, name: str) -> Parameter:
        parameters = self.parameters_for(service)
        if name not in parameters:
            raise KeyError(f"{service!r} has no tunable parameter {name!r} (known: {sorted(parameters)})")
        return parameters[name]


def parse_catalogue(data: object, source: str = "catalogue") -> Catalogue:
    try:
        return Catalogue.model_validate(data)
    except ValidationError as error:
        problems = "\n  ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise CatalogueError(f"{source} is not a valid parameter catalogue:\n  {problems}") from None


def load_catalogue(path: str | Path = DEFAULT_CATALOGUE) -> Catalogue:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise CatalogueError(f"cannot read parameter catalogue {path}: {error}") from None
    return parse_catalogue(data, str(path))
