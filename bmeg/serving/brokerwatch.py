"""Whether the broker answers and the consumer's topic exists, asked on a thread of its own.

The consumer's poll loop must never wait on the broker without a bound: kafka-python 3.0.12's
`KafkaConsumer.partitions_for_topic` waits for a metadata refresh with no timeout, so a broker
that vanishes while the loop waits for its topic blocks the loop for good (the liveness probe
then fails and SIGTERM is not honoured). `BrokerWatch` asks instead, every `interval_s`, with a
metadata request for the topic (never creating it) from an admin client of its own (request
timeout `timeout_s`; a connection being set up gives up after kafka-python's 10 s), and only
records the answers; the loop reads them without waiting:

- `last_contact`: the monotonic time at which the last answered request was sent (an answer
  proves the broker was up then). The assembler's idle clock counts only up to it
  (`TraceAssembler.heard_from_broker`).
- `partitions`: the topic's partition count in that answer (0 while it does not exist).

The admin client bootstraps in the constructor (bounded by `timeout_s` too), as the
consumer's own client does: a broker that is away at start is an error at start.
"""

from __future__ import annotations

import logging
import threading
import time

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

__all__ = ["BrokerWatch"]

log = logging.getLogger(__name__)


class BrokerWatch:
    def __init__(self, bootstrap: str, topic: str, interval_s: float = 1.0, timeout_s: float = 2.0):
        self.topic, self.interval_s = topic, interval_s
        timeout_ms = int(timeout_s * 1e3)
        # Reconnection backs off at most `timeout_s` (kafka-python's default grows to 30 s):
        # the broker's return is seen within a few seconds.
        self._admin = KafkaAdminClient(
            bootstrap_servers=bootstrap, client_id="bmeg-broker-watch", request_timeout_ms=timeout_ms,
            reconnect_backoff_max_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms)
        self.last_contact = time.monotonic()  # the bootstrap was answered
        self.partitions = 0
        self._failing = False
        self._stop = threading.Event()
        self.ask()
        self._thread = threading.Thread(target=self._watch, name="bmeg-broker-watch", daemon=True)
        self._thread.start()

    def ask(self) -> bool:
        """One metadata request for the topic; returns whether the broker answered."""
        sent = time.monotonic()
        try:
            (described,) = self._admin.describe_topics([self.topic])
        except (KafkaError, ValueError) as error:  # ValueError: no answer to unpack
            if not self._failing:
                log.warning("the broker does not answer (asked again every %.0f s): %s", self.interval_s, error)
            self._failing = True
            return False
        if self._failing:
            log.warning("the broker answers again after %.1f s", sent - self.last_contact)
        self._failing = False
        self.partitions = len(described["partitions"]) if described["error_code"] == 0 else 0
        self.last_contact = sent
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop asking (the request in flight ends within its timeout) and close the client."""
        self._stop.set()
        self._thread.join(timeout_s)
        try:
            self._admin.close()
        except KafkaError as error:
            log.warning("closing the broker watch's admin client: %s", error)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.ask()
