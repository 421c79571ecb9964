"""The detector in a process of its own (`bmeg serve --model-process`).

The model side (`bmeg.serving.payloads`: parsing, the model, the planner) then holds its own
GIL on its own core, and a crash or a runaway allocation there does not take the server down.
On 2 cores the hop costs more than it saves (pickling answers back, the pool's management
thread): the default keeps the model on a thread of the server. The child is started with
`spawn` (forking a threaded server that has loaded torch is unsafe) and keeps the stream's
state, the history of the traces it has served (`StreamedDetector`), between calls. If the child dies (killed,
out of memory), it is started again and the requests of that moment are answered 503, to be
sent again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pyarrow as pa

from bmeg.diagnosis import Diagnosis
from bmeg.serving.model import freeze_heap
from bmeg.serving.payloads import Answer, Limits, Parts, Payload, RequestRefused, diagnose_payloads

log = logging.getLogger(__name__)
_detector = None  # the child's detector, set by _load


class ModelProcess:
    """A `DiagnosisModel` whose detector (`Detector.load(run_dir, device)`) lives in a child process.

    Load errors (a missing or stale run directory) are raised here, as the in-process load raises them.
    """

    def __init__(self, run_dir: Path, device: str = "cpu", torch_threads: int = 1):
        self._load_args = (run_dir, device, torch_threads)
        self._start()
        self.application, self.version, run, self.services = self._loaded
        self.run_dir = Path(run)

    @property
    def pid(self) -> int:
        return self._call(os.getpid)

    def diagnose(self, spans: pa.Table, window: bool = False) -> Diagnosis:
        return self._call(_diagnose, spans, window)

    def diagnose_payloads(self, payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Parts | Exception]:
        """`bmeg.serving.payloads.diagnose_payloads` in the child: parsing and planning happen there too."""
        return self._call(_diagnose_payloads, payloads, window, limits)

    def _start(self) -> None:
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            self._loaded = self._pool.submit(_load, *self._load_args, os.getpid()).result()
        except BaseException:
            self.close()
            raise

    def _call(self, function, *args):
        try:
            return self._pool.submit(function, *args).result()
        except BrokenProcessPool:
            log.error("the model process died; starting it again")
            self.close()
            self._start()
            raise RequestRefused(503, "the model process died while diagnosing and was started again: "
                                      "send the request again") from None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _load(run_dir: Path, device: str, torch_threads: int, parent_pid: int) -> tuple[str, str, str, list[str]]:
    global _detector
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from bmeg.models.detector import Detector
    from bmeg.models.history import StreamedDetector
    from bmeg.models.inference import limit_cpu_threads

    limit_cpu_threads(torch_threads)
    _detector = StreamedDetector(Detector.load(run_dir, device=device))  # the child owns the stream's history
    freeze_heap()
    return _detector.application, _detector.version, str(_detector.run_dir), list(_detector.services)


def _exit_with_parent(parent_pid: int) -> None:
    """A server killed outright (SIGKILL) cannot stop its model process: the process notices alone."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _diagnose(spans: pa.Table, window: bool) -> Diagnosis:
    assert _detector is not None, "the model process's initializer loads the model first"
    return _detector.diagnose(spans, window=window)


def _diagnose_payloads(payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Parts | Exception]:
    return diagnose_payloads(_detector, payloads, window, limits)
