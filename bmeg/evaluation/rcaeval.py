"""The published TraceRCA and MicroRank, as RCAEval implements them, called unchanged on our windows.

RCAEval (Pham et al., 2025; `pip install rcaeval`, the `eval` extra) ships `tracerca` and
`microrank` in `RCAEval/e2e/`. Each takes one span DataFrame holding a normal period *and* the
faulty period, and the injection time that splits them (spans that end before it are normal).
We give them exactly that:

- the data: the normal period's spans (moved in time so that they end just before the
  injection, as a fault-free lead-up would) followed by the window's spans, in RCAEval's span
  columns (`traceID, spanID, parentSpanID, serviceName, methodName, operationName, startTime,
  duration`, times in microseconds, as in RCAEval's own trace datasets);
- `inject_time`: the fault's start in microseconds;
- both periods in the RPC view, the same spans every other ranker sees.

**Operations to services.** Both methods rank *operations* (`serviceName_methodName`). A
service's rank is the rank of its best-ranked operation; a service none of whose operations is
ranked comes after every ranked one (in the order of its first span). The service of a span is
the span's `service` column, the same one every ranker in the harness names.

Where a method raises (TraceRCA looks up every window operation in the normal period's table
and fails on an operation the normal period never saw), the error is kept and its ranking is
empty: the fault counts as a miss, and the harness reports the error.

RCAEval's `RCAEval.e2e` package imports every method it ships on Python 3.11 (including RCD's
`causallearn`), so the two modules are loaded from their files: their code runs as published.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd

from bmeg.models.normal import NormalStats, Ranking
from bmeg.graphs import SpanForest

#: The RCAEval methods the harness runs, by ranker name.
METHODS = {"tracerca (RCAEval)": "tracerca", "microrank (RCAEval)": "microrank"}
#: Between the normal period's last span end and the injection.
LEAD_NS = 1_000_000_000


class RCAEvalUnavailable(RuntimeError):
    """RCAEval is not installed."""


@cache
def rcaeval_method(name: str) -> Callable:
    """RCAEval's `name` function (`tracerca`, `microrank`), loaded from its module file."""
    spec = importlib.util.find_spec("RCAEval")
    if spec is None or not spec.submodule_search_locations:
        raise RCAEvalUnavailable("RCAEval is not installed: `pip install 'bmeg[eval]'` (or `pip install rcaeval`)")
    path = Path(next(iter(spec.submodule_search_locations))) / "e2e" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"_rcaeval_{name}", path)
    if module_spec is None or module_spec.loader is None:
        raise RCAEvalUnavailable(f"RCAEval has no {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def rcaeval_available() -> bool:
    return importlib.util.find_spec("RCAEval") is not None


def span_frame(forest: SpanForest, shift_ns: int = 0) -> pd.DataFrame:
    """RCAEval's span columns for a forest (times in µs, shifted by `shift_ns`)."""
    spans = forest.spans
    span_ids = spans["span_id"].to_numpy(zero_copy_only=False)
    parent = np.where(forest.parent >= 0, span_ids[np.maximum(forest.parent, 0)], "")
    operation = spans["operation"].to_numpy(zero_copy_only=False)
    return pd.DataFrame({
        "traceID": spans["trace_id"].to_numpy(zero_copy_only=False),
        "spanID": span_ids,
        "parentSpanID": parent,
        "serviceName": spans["service"].to_numpy(zero_copy_only=False),
        "methodName": operation,
        "operationName": operation,
        "startTime": (forest.start_ns + shift_ns) // 1000,
        "duration": forest.duration_ns // 1000,
    })


def method_input(window: SpanForest, normal: SpanForest, inject_ns: int) -> pd.DataFrame:
    """The normal period moved to end `LEAD_NS` before `inject_ns`, then the window."""
    shift = inject_ns - LEAD_NS - int(normal.end_ns.max())
    return pd.concat([span_frame(normal, shift), span_frame(window)], ignore_index=True)


def services_from_operations(ranked_operations: list[str], frame: pd.DataFrame) -> list[str]:
    """Services in the order of their best-ranked operation; unranked services after them."""
    service_of = dict(zip(frame["serviceName"] + "_" + frame["methodName"], frame["serviceName"]))
    ordered: list[str] = []
    for operation in ranked_operations:
        service = service_of.get(operation)
        if service is not None and service not in ordered:
            ordered.append(service)
    ordered += [s for s in pd.unique(frame["serviceName"]) if s not in ordered]
    return ordered


class RCAEvalRanker:
    """One RCAEval method as a harness ranker (see the module docstring for what it is given)."""

    def __init__(self, name: str):
        if name not in METHODS:
            raise ValueError(f"unknown RCAEval method {name!r}; choose from {sorted(METHODS)}")
        self.name = name
        self.method = rcaeval_method(METHODS[name])
        self.errors: list[str] = []

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        inject_ns = int(window.start_ns.min())
        frame = method_input(window, normal.forest, inject_ns)
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                result = self.method(frame.copy(), inject_time=inject_ns // 1000)
        except Exception as error:  # noqa: BLE001 - a published method's own failure is a result
            self.errors.append(f"{type(error).__name__}: {error}")
            return []
        services = services_from_operations(list(result["ranks"]), frame)
        return [(service, float(len(services) - i)) for i, service in enumerate(services)]
