"""The detector in a child process (`bmeg serve`'s default): same diagnoses, clear load errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from bmeg.models.checkpoint import CheckpointError
from bmeg.models.history import StreamedDetector
from bmeg.serving.model_process import ModelProcess
from bmeg.serving.payloads import Limits, Payload, RequestRefused, diagnose_payloads
from bmeg.traces import to_otlp_proto_bytes
from serving_fixtures import traces_of

pytestmark = pytest.mark.integration  # spawns a torch process: seconds


@pytest.fixture(scope="module")
def model_process(trained_run_dir):
    model = ModelProcess(trained_run_dir, device="cpu")
    yield model
    model.close()


def test_the_child_diagnoses_as_the_detector_does_in_process(model_process, detector, hotel_dataset):
    trace_ids = hotel_dataset.traces["trace_id"].to_pylist()[:6]
    payloads = [Payload(to_otlp_proto_bytes(traces_of(hotel_dataset.spans, ids)), "application/x-protobuf")
                for ids in (trace_ids[:2], trace_ids[2:], trace_ids[2:3])]  # the third shares a trace: alone
    limits = Limits(max_spans=10_000, max_batch_spans=10_000)

    assert (model_process.application, model_process.version) == (detector.application, detector.version)
    # A fresh in-process detector holding the stream's history as the child does (the third
    # payload's trace reads the first two's): a plain Detector reads none, and its scores differ
    # wherever the history features count (this test's model since the router's session-6 training).
    fresh = StreamedDetector(type(detector).load(detector.run_dir, device="cpu"))
    in_child = model_process.diagnose_payloads(payloads, False, limits)
    in_process = diagnose_payloads(fresh, payloads, False, limits)
    assert [a.diagnosis for a in in_child] == [a.diagnosis for a in in_process]
    assert [[t.trace_id for t in a.diagnosis.traces] for a in in_child] == [trace_ids[:2], trace_ids[2:], trace_ids[2:3]]
    assert all(a.spans.equals(b.spans) for a, b in zip(in_child, in_process))


def test_a_killed_child_is_started_again_and_its_requests_are_refused_with_503(model_process, hotel_dataset):
    spans = traces_of(hotel_dataset.spans, hotel_dataset.traces["trace_id"].to_pylist()[:1])
    old_pid = model_process.pid
    os.kill(old_pid, signal.SIGKILL)

    with pytest.raises(RequestRefused) as refused:
        model_process.diagnose(spans)
    assert refused.value.status == 503 and "send the request again" in refused.value.message
    assert model_process.pid != old_pid
    assert len(model_process.diagnose(spans).traces) == 1


def test_the_child_exits_when_the_server_is_killed_outright(trained_run_dir, tmp_path):
    script = tmp_path / "server.py"
    script.write_text(
        "import sys\nfrom bmeg.serving.model_process import ModelProcess\n"
        "if __name__ == '__main__':\n"
        f"    model = ModelProcess({str(trained_run_dir)!r})\n"
        "    print(model.pid, flush=True)\n    sys.stdin.read()\n")
    server = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(server.stdout.readline()))
    server.kill()
    server.wait()
    child.wait(timeout=10)  # psutil.TimeoutExpired if it is still there


def test_a_run_directory_that_does_not_load_fails_in_the_parent(tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        ModelProcess(tmp_path, device="cpu")
