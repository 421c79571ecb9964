"""Streaming benchmark: OTLP traces through Kafka and `StreamConsumer`, end to end.

    python bench/stream.py --model RUN_DIR --bootstrap 127.0.0.1:19092 [--traces 20000]
                           [--spans-per-trace 30 | --dataset-traces] [--traces-per-message 50]

Produces `--traces` traces to a new topic as OTLP protobuf, `--traces-per-message` traces per
message as the OpenTelemetry Collector batches them, spread over the partitions: random
well-formed call trees of `--spans-per-trace` spans over socialnet's services (bench/ingest.py's
generator), or with `--dataset-traces` the model's own dataset (cycled under fresh trace ids). Then one consumer
diagnoses them all and the benchmark counts the diagnoses on the output topic, in a process
of its own (as a real reader of `bmeg.diagnoses` would: not in the consumer's interpreter).
Prints traces/s from the consumer's start to the last diagnosis published (this includes
one idle timeout, the wait that ends the last traces), the same without it, and the traces
lost (must be 0). Target: >= 2,000 traces/s through one consumer.

With `--consumers 1,2` it measures instead, one after the other in the same run, that many
consumer processes in one group (each its own interpreter, as replicas would run), each on a
fresh topic of the broker's default partition count holding the same traces: traces/s from the
moment every process is ready (model loaded, subscribed) to the last diagnosis published.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from kafka import KafkaConsumer, KafkaProducer

from bmeg.datasets.loader import load_dataset
from bmeg.models.detector import Detector
from bmeg.serving.assembler import split_by_trace
from bmeg.serving.consumer import ConsumerConfig, StreamConsumer
from bmeg.traces import to_otlp_proto_bytes
from ingest import random_traces  # bench/ingest.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="Run directory of `bmeg train`.")
    parser.add_argument("--bootstrap", default=os.environ.get("BMEG_KAFKA_BOOTSTRAP", "127.0.0.1:19092"))
    parser.add_argument("--traces", type=int, default=20_000)
    parser.add_argument("--spans-per-trace", type=int, default=30)
    parser.add_argument("--dataset-traces", action="store_true", help="Use the model's dataset instead.")
    parser.add_argument("--traces-per-message", type=int, default=50)
    parser.add_argument("--idle-timeout", type=float, default=0.5)
    parser.add_argument("--batch-traces", type=int, default=512)
    parser.add_argument("--consumers", help="Comma-separated consumer process counts to compare, e.g. 1,2.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.consumers:
        compare_consumer_processes(args, [int(n) for n in args.consumers.split(",")])
        return

    detector = Detector.load(args.model, device="cpu")
    source = dataset_traces(detector) if args.dataset_traces else trace_tables(random_traces(2_000, args.spans_per_trace))
    messages, spans_per_trace = build_messages(source, args.traces, args.traces_per_message)
    name = f"bmeg-bench-{uuid.uuid4().hex[:8]}"
    config = ConsumerConfig(bootstrap=args.bootstrap, topic=name, group_id=f"{name}-group",
                            diagnoses_topic=f"{name}.diagnoses", mitigations_topic=f"{name}.mitigations",
                            dead_letter_topic=f"{name}.dlq", idle_timeout_s=args.idle_timeout,
                            batch_traces=args.batch_traces)
    produced_s = produce(args.bootstrap, name, messages)
    print(f"produced {args.traces} traces (~{spans_per_trace:.0f} spans each) in {len(messages)} messages "
          f"in {produced_s:.1f} s")

    # The counter starts (imports, subscribes) before the consumer, so the two share no start-up time.
    results, counter_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
    counter = multiprocessing.get_context("spawn").Process(
        target=count_diagnoses, args=(args.bootstrap, config.diagnoses_topic, args.traces, counter_end))
    counter.start()
    results.recv()  # "ready"
    consumer = StreamConsumer(detector, config)
    stop = threading.Event()
    started, cpu_started = time.monotonic(), time.process_time()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    received, last_at = results.recv()
    counter.join()
    stop.set()
    thread.join(60)

    elapsed = last_at - started
    print(f"diagnosed {received} traces in {elapsed:.1f} s: {received / elapsed:.0f} traces/s end to end, "
          f"{received / max(elapsed - args.idle_timeout, 1e-9):.0f} traces/s without the final idle timeout "
          f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")
    # This process runs only the consumer now (the counter has its own): its CPU time is the
    # consumer's, a steadier figure than traces/s on a shared machine.
    print(f"consumer CPU time: {(time.process_time() - cpu_started) * 1e6 / max(received, 1):.0f} us per trace "
          f"(all its threads, until it stopped)")
    print(f"lost: {args.traces - received}")
    print(f"target >= 2000 traces/s: {'met' if received / elapsed >= 2000 else 'NOT met'}")


def compare_consumer_processes(args: argparse.Namespace, counts: list[int]) -> None:
    detector = Detector.load(args.model, device="cpu")
    source = dataset_traces(detector) if args.dataset_traces else trace_tables(random_traces(2_000, args.spans_per_trace))
    messages, _ = build_messages(source, args.traces, args.traces_per_message)
    spawn = multiprocessing.get_context("spawn")
    rates: dict[int, list[float]] = {}
    for count in counts:
        name = f"bmeg-bench-{uuid.uuid4().hex[:8]}"
        config = ConsumerConfig(bootstrap=args.bootstrap, topic=name, group_id=f"{name}-group",
                                diagnoses_topic=f"{name}.diagnoses", mitigations_topic=f"{name}.mitigations",
                                dead_letter_topic=f"{name}.dlq", idle_timeout_s=args.idle_timeout,
                                batch_traces=args.batch_traces)
        produce(args.bootstrap, name, messages)
        ready, go, stop = spawn.Barrier(count + 1), spawn.Event(), spawn.Event()
        workers = [spawn.Process(target=consume_in_process, args=(args.model, config, ready, go, stop))
                   for _ in range(count)]
        for worker in workers:
            worker.start()
        ready.wait()  # every process has loaded the model and subscribed
        results, counter_end = spawn.Pipe(duplex=False)
        counter = spawn.Process(target=count_diagnoses,
                                args=(args.bootstrap, config.diagnoses_topic, args.traces, counter_end))
        counter.start()
        results.recv()  # "ready"
        started = time.monotonic()
        go.set()
        received, last_at = results.recv()
        counter.join()
        stop.set()
        for worker in workers:
            worker.join(60)
        rates.setdefault(count, []).append(received / (last_at - started))
        partitions = len(KafkaConsumer(bootstrap_servers=args.bootstrap).partitions_for_topic(name) or ())
        print(f"{count} consumer process(es), {partitions} partitions: {received} traces in {last_at - started:.1f} s, "
              f"{rates[count][-1]:.0f} traces/s end to end, lost {args.traces - received} "
              f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")
    medians = {count: float(np.median(values)) for count, values in rates.items()}
    first = counts[0]
    for count in sorted(set(counts) - {first}):
        print(f"{count} vs {first} consumer process(es), medians of {len(rates[count])} and {len(rates[first])} runs: "
              f"{medians[count]:.0f} vs {medians[first]:.0f} traces/s, x{medians[count] / medians[first]:.2f}")


def consume_in_process(model: Path, config: ConsumerConfig, ready, go, stop) -> None:
    """One replica: load the model, join the group, wait for the start, consume until stopped."""
    torch.set_num_threads(1)
    consumer = StreamConsumer(Detector.load(model, device="cpu"), config)
    ready.wait()
    go.wait()
    consumer.run(stop)


def dataset_traces(detector: Detector) -> list[pa.Table]:
    return trace_tables(load_dataset(Path(detector.metrics["config"]["dataset_path"])).spans)


def trace_tables(spans: pa.Table) -> list[pa.Table]:
    return [trace for _, trace in split_by_trace(spans)]


def build_messages(traces: list[pa.Table], count: int, per_message: int) -> tuple[list[bytes], float]:
    """OTLP messages of `per_message` traces each: the given traces, cycled under new ids."""
    messages = []
    for first in range(0, count, per_message):
        chosen = [renamed(traces[i % len(traces)], i) for i in range(first, min(first + per_message, count))]
        messages.append(to_otlp_proto_bytes(pa.concat_tables(chosen)))
    return messages, sum(trace.num_rows for trace in traces) / len(traces)


def renamed(trace: pa.Table, copy: int) -> pa.Table:
    trace_id = f"{copy:032x}"
    return trace.set_column(trace.schema.get_field_index("trace_id"), "trace_id",
                            pa.array([trace_id] * trace.num_rows, pa.string()))


def produce(bootstrap: str, topic: str, messages: list[bytes]) -> float:
    started = time.perf_counter()
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1 << 20,
                             max_request_size=16 << 20)
    for message in messages:
        producer.send(topic, message)
    producer.flush()
    producer.close()
    return time.perf_counter() - started


def count_diagnoses(bootstrap: str, topic: str, expected: int, results, quiet_s: float = 30) -> None:
    """Send "ready", then (distinct trace ids diagnosed, `time.monotonic()` when the last new one
    arrived); stops when all are in or after `quiet_s` without a new one."""
    reader = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    reader.poll(timeout_ms=100)  # joins the topic now, not while the consumer runs
    results.send("ready")
    seen: set[bytes] = set()
    last_at = waiting_since = time.monotonic()
    while len(seen) < expected and time.monotonic() - waiting_since < quiet_s:
        for batch in reader.poll(timeout_ms=200).values():
            before = len(seen)
            seen.update(record.key for record in batch)
            if len(seen) > before:
                last_at = waiting_since = time.monotonic()
    reader.close()
    results.send((len(seen), last_at))


if __name__ == "__main__":
    main()
