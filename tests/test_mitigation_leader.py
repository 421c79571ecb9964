"""Leader election of the mitigation controller on the real API server: two candidate processes
(the Kubernetes client's `kubernetes.leaderelection` helper, through `bmeg.mitigation.leader`),
one Lease; one leads, the other takes over when the first stops, never both at once.

The candidates use the admin kubeconfig: the controller's Role gains its Lease verbs in
mitigation/rbac.yaml, which this test does not own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bmeg.mitigation.leader import Election, holder

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]

#: A candidate: leads while it holds the Lease, writing when it starts and stops leading.
CANDIDATE = """
import sys, time
from kubernetes import config
from bmeg.mitigation.leader import Election, lead

kubeconfig, namespace, identity, lease_s, renew_s = sys.argv[1:6]
api = config.new_client_from_config(config_file=kubeconfig)

def work(stop):
    print(f"leading {identity} {time.time()}", flush=True)
    while not stop.wait(0.1):
        pass
    print(f"stopped {identity} {time.time()}", flush=True)

import signal
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
lead(api, Election(identity=identity, namespace=namespace, lease_s=int(lease_s), renew_s=int(renew_s), retry_s=1), work)
"""


@pytest.fixture
def lease_namespace(kube_admin):
    from kubernetes import client

    name = f"bmeg-lease-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(kube_admin)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


class Candidates:
    def __init__(self, kubeconfig: Path, namespace: str, logs: Path, lease_s: int, renew_s: int):
        self.args = [str(kubeconfig), namespace]
        self.timing = [str(lease_s), str(renew_s)]
        self.logs = logs
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, identity: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.logs / f"{identity}.log", "w") as out:
            self.processes[identity] = subprocess.Popen(
                [sys.executable, "-c", CANDIDATE, *self.args, identity, *self.timing],
                stdout=out, stderr=subprocess.STDOUT, env=env)

    def events(self, identity: str, kind: str) -> list[float]:
        lines = (self.logs / f"{identity}.log").read_text().splitlines()
        return [float(line.split()[2]) for line in lines if line.startswith(f"{kind} {identity} ")]

    def wait_leading(self, identity: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.events(identity, "leading"):
                return self.events(identity, "leading")[0]
            time.sleep(0.2)
        raise AssertionError(f"{identity} did not lead within {timeout_s} s:\n"
                             + (self.logs / f"{identity}.log").read_text()[-2000:])

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)


@pytest.fixture
def candidates(request, kube_admin_kubeconfig, lease_namespace, tmp_path):
    lease_s, renew_s = request.param
    group = Candidates(kube_admin_kubeconfig, lease_namespace, tmp_path, lease_s, renew_s)
    yield group
    group.close()


@pytest.mark.parametrize("candidates", [(4, 3)], indirect=True)
def test_one_leads_and_the_other_takes_over_when_it_dies(kube_admin, lease_namespace, candidates):
    candidates.start("first")
    candidates.wait_leading("first", 60)
    candidates.start("second")
    time.sleep(6)  # longer than the lease: the second sees it renewed, and follows
    assert holder(kube_admin, namespace=lease_namespace) == "first"
    assert candidates.events("second", "leading") == []

    killed_at = time.time()
    candidates.processes["first"].send_signal(signal.SIGKILL)  # no release: the lease must run out
    took_over_at = candidates.wait_leading("second", 60)
    assert took_over_at > killed_at + 1  # not before the first's last renewal had expired
    assert holder(kube_admin, namespace=lease_namespace) == "second"


@pytest.mark.parametrize("candidates", [(40, 30)], indirect=True)
def test_a_leader_that_stops_hands_over_at_once(kube_admin, lease_namespace, candidates):
    """SIGTERM: the leader stops its work, then releases the Lease; the follower takes over on
    its next retry, long before the 40 s lease would have run out."""
    candidates.start("first")
    candidates.wait_leading("first", 60)
    candidates.start("second")
    time.sleep(3)
    assert candidates.events("second", "leading") == []

    stopped_at = time.time()
    candidates.processes["first"].send_signal(signal.SIGTERM)
    assert candidates.processes["first"].wait(30) == 0
    took_over_at = candidates.wait_leading("second", 30)
    (first_stopped,) = candidates.events("first", "stopped")
    assert first_stopped <= took_over_at  # the first's work had ended before the second led
    assert took_over_at - stopped_at < 20
    assert holder(kube_admin, namespace=lease_namespace) == "second"


def test_bad_timing_is_a_clear_error():
    with pytest.raises(ValueError, match="renew_s < lease_s"):
        Election(identity="a", lease_s=5, renew_s=5)
    with pytest.raises(ValueError, match="identity"):
        Election(identity="")


def test_a_controller_that_stops_leading_leaves_the_rest_to_the_next(kafka_bootstrap):
    """The feed handles no message once `stop` is set (leadership lost): what it did not handle
    is not committed, and the next leader, in the same group, reads it."""
    import threading

    from kafka import KafkaProducer
    from builders import ReadOnlyDeployments, one_diagnosis

    from bmeg.mitigation import AuditLog, Controller, load_catalogue
    from bmeg.mitigation.feed import consume, encode
    from bmeg.mitigation.safety import SafetyPolicy

    topic = f"bmeg.mitigations.leader-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for _ in range(3):
        producer.send(topic, encode(one_diagnosis()), key=b"socialnet")  # one key: one partition, in order
    producer.flush()
    producer.close()

    def controller() -> Controller:
        return Controller(ReadOnlyDeployments(), load_catalogue(), SafetyPolicy(confidence_threshold=0.3), AuditLog())

    stop = threading.Event()
    first = []
    for outcomes in consume(controller(), kafka_bootstrap, topic, group=topic, idle_timeout_s=30, stop=stop,
                            offset_reset="earliest"):
        first.append(outcomes)
        stop.set()  # lost the lease after the first message
    assert len(first) == 1
    second = list(consume(controller(), kafka_bootstrap, topic, group=topic, max_messages=2, idle_timeout_s=30,
                          offset_reset="earliest"))
    assert len(second) == 2 and all(len(outcomes) == 1 for outcomes in second)
