"""bmeg: find and fix the microservices that make an application slow, from distributed traces.

Data flows one way: readers (`bmeg.traces`) -> span table -> call graphs (`bmeg.graphs`)
-> models (`bmeg.models`) -> `Diagnosis` -> REST / Kafka / mitigation.
"""

from bmeg.version import __version__

__all__ = ["__version__", "diagnose"]


def diagnose(spans, model=None, window: bool = False, normal=None, since_ns: int | None = None):
    """Diagnose a span table (see `bmeg.traces.read_spans`) with a trained model.

    `model` is a `bmeg.models.detector.Detector` or a run directory (default: the run that
    `bmeg train` writes by default). The spans are a recorded stream: each trace reads the
    earlier traces among them for its history features. With `window`, the services are also
    ranked over all the spans: against a fault-free period of the same application when one is
    at hand (`bmeg.models.window.WindowRanker`, the ranker `bmeg evaluate rca` measures as
    `bmeg`): `normal`, a span table of such a period, or else the normal traces a run of `bmeg
    bootstrap` keeps; without one, by the detector's mean node score. The diagnosis's
    `window_method` says which. Giving `normal` implies `window`. With `since_ns` only the traces
    begun from then on are diagnosed, as a window, and the earlier ones are the traffic just
    before it: the window is compared with the latest of them (`bmeg.models.window.latest_before`,
    as the REST server compares a window with the traffic it received) where a normal period is
    at hand and they are enough, else as without. Returns a `bmeg.diagnosis.Diagnosis` whose
    anomalous traces carry mitigation hints.
    """
    from bmeg.mitigation.planner import suggest
    from bmeg.models.detector import Detector, default_run_dir
    from bmeg.models.window import WindowRanker, latest_before
    from bmeg.traces.schema import traces_begun_between

    detector = model if isinstance(model, Detector) else Detector.load(model or default_run_dir())
    window = window or normal is not None or since_ns is not None
    ranker = None
    if normal is not None:
        ranker = WindowRanker(detector, normal)
    elif window:
        ranker = WindowRanker.of_run(detector)
    if since_ns is not None:
        if ranker is not None:
            ranker = ranker.against(latest_before(spans, since_ns))
        spans = traces_begun_between(spans, since_ns)
    return suggest(detector.diagnose(spans, window=window, replay=True, ranker=ranker))
