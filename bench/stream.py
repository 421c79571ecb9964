"""Streaming benchmark: traces in the OpenTelemetry Collector's message shapes through Kafka and
one `StreamConsumer`, end to end.

    python bench/stream.py --model RUN_DIR [--bootstrap 127.0.0.1:19092] [--traces 20000]
                           [--spans-per-trace 30] --shape trace-per-message|batches [--json]
    python bench/stream.py --model RUN_DIR --compare OTHER_CHECKOUT [--runs 3] [--shape ...]

Shapes (the Collector's `kafka` exporter writes one or the other):
- `trace-per-message`: as with `partition_traces_by_id: true`: each message holds one trace
  and is keyed by its trace id (so it lands on the trace's partition);
- `batches`: as without it, behind the batch processor: each message is one service's spans of
  `--window` consecutive traces, and each service's windows are offset from the others' (each
  SDK exports on its own schedule), so one trace's spans are spread over as many messages as it
  has services, interleaved with other traces' pieces; unkeyed, spread over the partitions.

The traces are random call trees of `--spans-per-trace` spans over socialnet's services, shaped
as instrumented services write them: a call into another service is the caller's `client`
span and the callee's `server` span under it; a database call is a `client` span with
`db.system`. Everything is produced first; then one consumer reads
it all and a separate process (as a real reader of `bmeg.diagnoses` would be) counts the
diagnoses. Prints traces/s from the consumer's start to the last diagnosis (and from the first
diagnosis to the last: start-up, the group's join and first fetch, left out; the longest wait
between new diagnoses shows whether an idle timeout was waited out inside the run), the
consumer's CPU time per trace (all its threads: steadier than traces/s on a shared machine),
lost traces (no diagnosis) and split ones (more than one diagnosis, or one with fewer spans than
sent, or marked partial). Target: >= 2,000 traces/s per consumer process, 0 lost, 0 split.

With `--stages` it measures instead the CPU time per trace of the consumer's own stages without
Kafka (reading, assembling, diagnosing, and within diagnosing the crowd check with its history),
where the time of a change shows without the broker's and the shared machine's noise. `--rate N`
starts the traces N a second one after another, as a live stream's (the crowd check's history
then holds its last 10 s), instead of at random over 1,000 s.

With `--consumers 1,2` it measures instead, one after the other in the same run, that many
consumer processes in one group (each its own interpreter, as replicas would run), each on a
fresh topic of the broker's default partition count holding the same traces: traces/s from the
moment every process is ready (model loaded, subscribed) to the last diagnosis published.

`--compare OTHER_CHECKOUT` runs this benchmark `--runs` times alternately with this checkout's
bmeg and with OTHER_CHECKOUT's (e.g. a `git worktree` of main), each in a fresh process, and
prints each side's median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa

import numpy as np

from ingest import SERVICES, STORE_CALLS  # bench/ingest.py, beside this file

SHAPES = ("trace-per-message", "batches")
HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="Run directory of `bmeg train`.")
    parser.add_argument("--bootstrap", default=os.environ.get("BMEG_KAFKA_BOOTSTRAP", "127.0.0.1:19092"))
    parser.add_argument("--traces", type=int, default=20_000)
    parser.add_argument("--spans-per-trace", type=int, default=30)
    parser.add_argument("--shape", choices=SHAPES, default="trace-per-message")
    parser.add_argument("--window", type=int, default=50, help="Traces per service export (batches shape).")
    parser.add_argument("--idle-timeout", type=float, default=0.5)
    parser.add_argument("--batch-traces", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="Print one JSON line of the figures.")
    parser.add_argument("--compare", type=Path, help="Another checkout: alternate runs with its bmeg, print medians.")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--consumers", help="Comma-separated consumer process counts to compare, e.g. 1,2.")
    parser.add_argument("--rate", type=float,
                        help="Traces begun per second, one after another as in a live stream (the crowd check's "
                             "history then holds its last 10 s); default: begun at random over 1,000 s.")
    parser.add_argument("--stages", action="store_true",
                        help="CPU per trace of the consumer's stages, without Kafka (read, assemble, diagnose).")
    args = parser.parse_args()
    if args.stages and args.compare is None:
        print(json.dumps(measure_stages(args)))
        return
    if args.consumers:
        compare_consumer_processes(args, [int(n) for n in args.consumers.split(",")])
        return
    if args.compare is not None:
        compare(args)
        return
    figures = measure(args)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{figures['traces']} traces of {figures['spans_per_trace']} spans, shape {args.shape}: "
          f"{figures['messages']} messages")
    print(f"{figures['traces_per_s']:.0f} traces/s end to end, {figures['traces_per_s_after_start']:.0f} after the first "
          f"diagnosis (start-up {figures['start_s']:.1f} s; longest wait between new diagnoses "
          f"{figures['longest_gap_s']:.1f} s); consumer CPU {figures['cpu_us_per_trace']:.0f} us per trace "
          f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")
    print(f"lost: {figures['lost']}, split: {figures['split']}")
    met = figures["traces_per_s"] >= 2000 and figures["lost"] == 0 and figures["split"] == 0
    print(f"target >= 2000 traces/s, 0 lost, 0 split: {'met' if met else 'NOT met'}")


def measure(args) -> dict:
    import torch

    from bmeg.models.detector import Detector
    from bmeg.serving.consumer import ConsumerConfig, StreamConsumer

    torch.set_num_threads(1)
    detector = Detector.load(args.model, device="cpu")
    spans = instrumented_traces(args.traces, args.spans_per_trace, seed=int.from_bytes(os.urandom(4), "little"),
                                rate=args.rate)
    messages = trace_per_message(spans) if args.shape == "trace-per-message" else batches(spans, args.window)
    expected = dict(Counter(spans["trace_id"].to_pylist()))
    name = f"bmeg-bench-{uuid.uuid4().hex[:8]}"
    config = ConsumerConfig(bootstrap=args.bootstrap, topic=name, group_id=f"{name}-group",
                            diagnoses_topic=f"{name}.diagnoses", mitigations_topic=f"{name}.mitigations",
                            dead_letter_topic=f"{name}.dlq", idle_timeout_s=args.idle_timeout,
                            batch_traces=args.batch_traces)
    produce(args.bootstrap, name, messages)

    # The counter starts (imports, subscribes) before the consumer, so the two share no start-up time.
    context = multiprocessing.get_context("spawn")
    results, counter_end = context.Pipe(duplex=False)
    counter = context.Process(target=count_diagnoses, args=(args.bootstrap, config.diagnoses_topic, expected,
                                                            counter_end))
    counter.start()
    results.recv()  # "ready"
    consumer = StreamConsumer(detector, config)
    stop = threading.Event()
    started, cpu_started = time.monotonic(), time.process_time()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    received, split, last_at, first_at, first_count, longest_gap_s = results.recv()
    counter.join()
    cpu_s = time.process_time() - cpu_started  # this process runs only the consumer now
    stop.set()
    thread.join(60)
    elapsed = last_at - started
    return {"shape": args.shape, "traces": args.traces, "spans_per_trace": args.spans_per_trace,
            "messages": len(messages), "traces_per_s": received / elapsed,
            "traces_per_s_after_start": (received - first_count) / max(last_at - first_at, 1e-9),
            "start_s": first_at - started, "longest_gap_s": longest_gap_s,
            "cpu_us_per_trace": cpu_s * 1e6 / max(received, 1), "lost": args.traces - received, "split": split,
            "load_average": os.getloadavg()[0]}


def measure_stages(args) -> dict:
    """The consumer's stages on the same messages, one after the other in this process, CPU
    time per trace (steady on a shared machine): reading runs of up to `MAX_RUN_MESSAGES`
    messages as the loop does (with its per-message encoding check), assembling, diagnosing in
    batches with a stream history. No Kafka: its client's fetching and sending are left out."""
    import gc

    import torch

    from bmeg.models.detector import Detector
    from bmeg.models.history import Observation, StreamHistory
    from bmeg.serving.assembler import TraceAssembler
    from bmeg.serving.consumer import MAX_RUN_MESSAGES
    from bmeg.serving.publishing import diagnose_batch
    from bmeg.traces.io import detect_encoding, read_spans_bytes

    torch.set_num_threads(1)
    crowd_s = _timing_the_crowd_check(Detector, StreamHistory, Observation)
    detector = Detector.load(args.model, device="cpu")
    spans = instrumented_traces(args.traces, args.spans_per_trace, seed=0, rate=args.rate)
    messages = [value for _, value in (trace_per_message(spans) if args.shape == "trace-per-message"
                                       else batches(spans, args.window))]
    gc.collect()
    gc.freeze()  # as the consumer freezes its heap

    def read() -> list:
        runs = [messages[start:start + MAX_RUN_MESSAGES] for start in range(0, len(messages), MAX_RUN_MESSAGES)]
        return [read_spans_bytes(b"".join(run), encoding="otlp_proto")
                for run in runs if all(detect_encoding(value, "otlp_proto") for value in run)]

    def assemble(tables: list) -> list:
        assembler, done = TraceAssembler(args.idle_timeout), []
        for source, table in enumerate(tables):
            assembler.add(table, source)
            done += assembler.finished()
        return done + assembler.drain()

    def diagnose(traces: list) -> None:
        history = StreamHistory(visits=detector.encoder.history)
        for start in range(0, len(traces), args.batch_traces):
            diagnose_batch(detector, traces[start:start + args.batch_traces], history=history)

    figures: dict[str, float] = {}
    for repeat in range(2):  # the first pass warms up (imports, the model's first calls)
        started, crowd_s[0] = time.process_time(), 0.0
        tables = read()
        read_at = time.process_time()
        traces = assemble(tables)
        assembled_at = time.process_time()
        diagnose(traces)
        ended = time.process_time()
        figures = {"shape": args.shape, "traces": len(traces), "read_us": (read_at - started) * 1e6 / len(traces),
                   "assemble_us": (assembled_at - read_at) * 1e6 / len(traces),
                   "diagnose_us": (ended - assembled_at) * 1e6 / len(traces),
                   "crowd_us": crowd_s[0] * 1e6 / len(traces),
                   "total_us": (ended - started) * 1e6 / len(traces)}
    return figures


def _timing_the_crowd_check(*owners) -> list[float]:
    """CPU seconds spent in the crowd check and the history's recording of its nodes (part of
    diagnosing): every call of `Detector.crowd_explained`, `StreamHistory.record` and
    `Observation.of` is timed (a call inside another once). Returns the running total."""
    spent, depth = [0.0], [0]

    def timed(function):
        def call(*args, **kwargs):
            depth[0] += 1
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.process_time() - started
        return call

    for owner, name in zip(owners, ("crowd_explained", "record", "of")):
        setattr(owner, name, timed(getattr(owner, name)))
    return spent


def compare_consumer_processes(args: argparse.Namespace, counts: list[int]) -> None:
    from kafka import KafkaConsumer

    from bmeg.serving.consumer import ConsumerConfig

    spans = instrumented_traces(args.traces, args.spans_per_trace, seed=0, rate=args.rate)
    messages = trace_per_message(spans) if args.shape == "trace-per-message" else batches(spans, args.window)
    expected = dict(Counter(spans["trace_id"].to_pylist()))
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
        counter = spawn.Process(target=count_diagnoses, args=(args.bootstrap, config.diagnoses_topic, expected,
                                                              counter_end))
        counter.start()
        results.recv()  # "ready"
        started = time.monotonic()
        go.set()
        received, split, last_at, *_ = results.recv()
        counter.join()
        stop.set()
        for worker in workers:
            worker.join(60)
        rates.setdefault(count, []).append(received / (last_at - started))
        partitions = len(KafkaConsumer(bootstrap_servers=args.bootstrap).partitions_for_topic(name) or ())
        print(f"{count} consumer process(es), {partitions} partitions: {received} traces in {last_at - started:.1f} s, "
              f"{rates[count][-1]:.0f} traces/s end to end, lost {args.traces - received}, split {split} "
              f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")
    medians = {count: statistics.median(values) for count, values in rates.items()}
    first = counts[0]
    for count in sorted(set(counts) - {first}):
        print(f"{count} vs {first} consumer process(es), medians of {len(rates[count])} and {len(rates[first])} runs: "
              f"{medians[count]:.0f} vs {medians[first]:.0f} traces/s, x{medians[count] / medians[first]:.2f}")


def consume_in_process(model: Path, config, ready, go, stop) -> None:
    """One replica: load the model, join the group, wait for the start, consume until stopped."""
    import torch

    from bmeg.models.detector import Detector
    from bmeg.serving.consumer import StreamConsumer

    torch.set_num_threads(1)
    consumer = StreamConsumer(Detector.load(model, device="cpu"), config)
    ready.wait()
    go.wait()
    consumer.run(stop)


def instrumented_traces(count: int, spans_per_trace: int, seed: int, rate: float | None = None) -> pa.Table:
    """Random traces as instrumented services write them (module docstring); times nest. They
    begin `rate` a second one after another, or (None) at random over 1,000 s."""
    from bmeg.traces import span_table

    rng = np.random.default_rng(seed)
    columns: dict[str, list] = {name: [] for name in ("trace_id", "span_id", "parent_id", "service", "operation",
                                                      "start_ns", "duration_ns", "kind", "db_system")}

    def add(trace_id, parent, service, operation, start, duration, kind, db=None) -> tuple:
        span_id = f"{int(rng.integers(1, 2**63)):016x}"
        for name, value in zip(columns, (trace_id, span_id, parent, service, operation, start, duration, kind, db)):
            columns[name].append(value)
        return span_id, service, start, duration

    for number in range(count):
        trace_id = f"{int(rng.integers(1, 2**63)):016x}{int(rng.integers(1, 2**63)):016x}"
        start = 1_700_000_000_000_000_000 + (int(rng.integers(0, 10**12)) if rate is None else int(number * 1e9 / rate))
        servers = [add(trace_id, None, SERVICES[0], "compose_post_server", start, int(rng.lognormal(np.log(10e6), 0.5)),
                       "server")]
        made = 1
        while made < spans_per_trace:
            span_id, service, up_start, up_duration = servers[int(rng.integers(0, len(servers)))]
            call_start = up_start + int(rng.random() * 0.5 * up_duration)
            call_duration = max(int(rng.uniform(0.05, 0.5) * up_duration), 2)
            if made + 2 > spans_per_trace or rng.random() < 0.3:  # a database call
                store = STORE_CALLS[int(rng.integers(0, len(STORE_CALLS)))]
                add(trace_id, span_id, service, store, call_start, call_duration, "client", store.split("_")[0])
                made += 1
                continue
            callee = SERVICES[int(rng.integers(1, len(SERVICES)))]
            operation = callee.replace("-service", "") + "_server"
            client = add(trace_id, span_id, service, operation, call_start, call_duration, "client")
            servers.append(add(trace_id, client[0], callee, operation, call_start + 1, call_duration - 1, "server"))
            made += 2
    return span_table(columns)


def trace_per_message(spans: pa.Table) -> list[tuple[bytes | None, bytes]]:
    from bmeg.serving.assembler import split_by_trace
    from bmeg.traces import to_otlp_proto_bytes

    return [(trace_id.encode(), to_otlp_proto_bytes(trace)) for trace_id, trace in split_by_trace(spans)]


def batches(spans: pa.Table, window: int) -> list[tuple[bytes | None, bytes]]:
    """Each service's spans of `window` consecutive traces per message, the services' windows
    offset from one another, in the order the exports would leave."""
    import pyarrow.compute as pc

    from bmeg.traces import to_otlp_proto_bytes

    trace_ids = spans["trace_id"].unique().to_pylist()
    position = pc.index_in(spans["trace_id"], pa.array(trace_ids))
    spans = spans.append_column("position", position)
    timed = []
    for s, service in enumerate(SERVICES):
        phase = s * window // len(SERVICES)
        mine = spans.filter(pc.equal(spans["service"], service))
        edges = [0, *range(phase or window, len(trace_ids) + window, window)]
        for low, high in zip(edges, edges[1:]):
            part = mine.filter(pc.and_(pc.greater_equal(mine["position"], low), pc.less(mine["position"], high)))
            if part.num_rows:
                timed.append((high, s, to_otlp_proto_bytes(part.drop_columns(["position"]))))
    return [(None, message) for _, _, message in sorted(timed, key=lambda item: item[:2])]


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1 << 20, max_request_size=16 << 20)
    for key, message in messages:
        producer.send(topic, message, key=key)
    producer.flush()
    producer.close()


def count_diagnoses(bootstrap: str, topic: str, expected: dict[str, int], results, quiet_s: float = 30) -> None:
    """Send "ready", then (traces diagnosed, traces split, `time.monotonic()` when the last new
    trace came, when the first came, how many came with it, the longest wait between new traces:
    an idle timeout waited out inside the run shows there); stops when every trace is in or
    after `quiet_s` without a new one."""
    from kafka import KafkaConsumer

    reader = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    reader.poll(timeout_ms=100)  # joins the topic now, not while the consumer runs
    results.send("ready")
    seen: Counter[str] = Counter()
    short: set[str] = set()
    last_at = waiting_since = time.monotonic()
    first_at, first_count, longest_gap_s = 0.0, 0, 0.0
    while len(seen) < len(expected) and time.monotonic() - waiting_since < quiet_s:
        for batch in reader.poll(timeout_ms=200).values():
            before = len(seen)
            for record in batch:
                (trace,) = json.loads(record.value)["traces"]
                seen[trace["trace_id"]] += 1
                if trace["spans"] != expected.get(trace["trace_id"]) or trace.get("partial"):
                    short.add(trace["trace_id"])
            if len(seen) > before:
                now = time.monotonic()
                if not first_at:
                    first_at, first_count = now, len(seen)
                else:
                    longest_gap_s = max(longest_gap_s, now - last_at)
                last_at = waiting_since = now
    time.sleep(1)  # a split trace's second diagnosis would come now
    for batch in reader.poll(timeout_ms=500).values():
        seen.update(json.loads(record.value)["traces"][0]["trace_id"] for record in batch)
    reader.close()
    split = short | {trace_id for trace_id, count in seen.items() if count > 1}
    results.send((len(seen), len(split), last_at, first_at or last_at, first_count, longest_gap_s))


def compare(args) -> None:
    """Alternate runs of this checkout's bmeg and the other's; print each side's median."""
    sides = {"this": HERE.parent, "other": args.compare.resolve()}
    passed = ["--model", str(args.model), "--bootstrap", args.bootstrap, "--traces", str(args.traces),
              "--spans-per-trace", str(args.spans_per_trace), "--shape", args.shape, "--window", str(args.window),
              "--idle-timeout", str(args.idle_timeout), "--batch-traces", str(args.batch_traces),
              *(["--stages"] if args.stages else []), *(["--rate", str(args.rate)] if args.rate else [])]
    figures: dict[str, list[dict]] = {side: [] for side in sides}
    for run in range(args.runs):
        for side, checkout in (sides.items() if run % 2 == 0 else reversed(sides.items())):
            output = subprocess.run([sys.executable, str(Path(__file__).resolve()), *passed, "--json"], check=True,
                                    capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
            figures[side].append(json.loads(output.stdout.strip().splitlines()[-1]))
            print(f"run {run + 1} {side} ({checkout}): {figures[side][-1]}", flush=True)
    for side, runs in figures.items():
        median = {key: statistics.median(run[key] for run in runs)
                  for key, value in runs[0].items() if isinstance(value, (int, float))}
        if args.stages:
            print(f"{side} ({sides[side]}), median of {len(runs)}, CPU us per trace: read {median['read_us']:.0f}, "
                  f"assemble {median['assemble_us']:.0f}, diagnose {median['diagnose_us']:.0f} (of which the "
                  f"crowd check and its history {median['crowd_us']:.1f}), total {median['total_us']:.0f}")
            continue
        print(f"{side} ({sides[side]}), median of {len(runs)}: {median['traces_per_s']:.0f} traces/s "
              f"({median['traces_per_s_after_start']:.0f} after the first diagnosis), "
              f"{median['cpu_us_per_trace']:.0f} us CPU per trace, lost {median['lost']:.0f}, split {median['split']:.0f}")


if __name__ == "__main__":
    main()
