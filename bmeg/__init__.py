"""bmeg: find and fix the microservices that make an application slow, from distributed traces.

Data flows one way: readers (`bmeg.traces`) -> span table -> call graphs (`bmeg.graphs`)
-> models (`bmeg.models`) -> `Diagnosis` -> REST / Kafka / mitigation.
"""

from pathlib import Path

from bmeg.version import __version__

__all__ = ["__version__", "diagnose"]


def diagnose(spans, model=None, window: bool = False, normal=None):
    """Diagnose a span table (see `bmeg.traces.read_spans`) with a trained model.

    `model` is a `bmeg.models.detector.Detector` or a run directory (default: the run that
    `bmeg train` writes by default). The spans are a recorded stream: each trace reads the
    earlier traces among them for its history features. With `window`, the services are also
    ranked over all the spans; given `normal` (a span table of a fault-free period of the same
    application), that ranking compares the window with it (`bmeg.evaluation.rankers.window_ranking`,
    the ranker `bmeg evaluate rca` measures as `bmeg`); a model of `bmeg bootstrap` keeps the
    normal traces it was fitted from, and a window is ranked against them unless `normal` is
    given. Returns a `bmeg.diagnosis.Diagnosis` whose anomalous traces carry mitigation hints.
    """
    from bmeg.mitigation.planner import suggest
    from bmeg.models.detector import Detector, default_run_dir
    from bmeg.paths import NORMAL_TRACES_FILE
    from bmeg.traces.io import read_spans

    detector = model if isinstance(model, Detector) else Detector.load(model or default_run_dir())
    kept = None if detector.run_dir is None else Path(detector.run_dir) / NORMAL_TRACES_FILE
    if normal is None and window and kept is not None and kept.is_file():
        normal = read_spans(kept, format="parquet")
    if normal is None:
        return suggest(detector.diagnose(spans, window=window, replay=True))
    from bmeg.evaluation.rankers import window_ranking
    from bmeg.graphs.rpc import rpc_view

    diagnosis = detector.diagnose(spans, replay=True)
    ranking = window_ranking(detector, rpc_view(spans), rpc_view(normal))
    return suggest(diagnosis.model_copy(update={"ranking": ranking}))
