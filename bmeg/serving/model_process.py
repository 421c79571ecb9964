"""The detector in a process of its own, so the model's Python work never holds the server's GIL.

A served request costs the event loop ~2 ms (HTTP, parsing, the answer) and the model ~4 ms a
call. In one process both take turns on one core and answers wait for each other; with the
model in a child process the two run on two cores. The child is started with `spawn` (forking a
threaded server that has loaded torch is unsafe) and keeps the detector's state, such as the
SVM's window of recent traces, between calls.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pyarrow as pa

from bmeg.diagnosis import Diagnosis
from bmeg.serving.payloads import Answer, Limits, Payload, diagnose_payloads

_detector = None  # the child's detector, set by _load


class ModelProcess:
    """A `DiagnosisModel` whose detector (`Detector.load(run_dir, device)`) lives in a child process.

    Load errors (a missing or stale run directory) are raised here, as the in-process load raises them.
    """

    def __init__(self, run_dir: Path, device: str = "cpu", torch_threads: int = 1):
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            self.application, self.version, run = self._pool.submit(_load, run_dir, device, torch_threads).result()
        except BaseException:
            self.close()
            raise
        self.run_dir = Path(run)

    def diagnose(self, spans: pa.Table, window: bool = False) -> Diagnosis:
        return self._pool.submit(_diagnose, spans, window).result()

    def diagnose_payloads(self, payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Exception]:
        """`bmeg.serving.payloads.diagnose_payloads` in the child: parsing and planning happen there too."""
        return self._pool.submit(_diagnose_payloads, payloads, window, limits).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _load(run_dir: Path, device: str, torch_threads: int) -> tuple[str, str, str]:
    global _detector
    import torch

    from bmeg.models.detector import Detector

    torch.set_num_threads(torch_threads)
    _detector = Detector.load(run_dir, device=device)
    return _detector.application, _detector.version, str(_detector.run_dir)


def _diagnose(spans: pa.Table, window: bool) -> Diagnosis:
    return _detector.diagnose(spans, window=window)


def _diagnose_payloads(payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Exception]:
    return diagnose_payloads(_detector, payloads, window, limits)
