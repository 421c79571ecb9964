"""REST benchmark: `bmeg serve` on loopback under a constant request rate.

    python bench/serve.py --model RUN_DIR [--rate 200] [--seconds 20] [--concurrency 64]
                          [--spans-per-trace 30 | --dataset-traces] [--model-process]

Starts `bmeg serve` in a subprocess, waits for /readyz, then sends one-trace OTLP protobuf
requests (random call trees of `--spans-per-trace` spans over socialnet's services, from
bench/ingest.py's generator, or with `--dataset-traces` the model's own dataset's traces,
cycled) from an aiohttp client (lighter than httpx, whose client could not keep up 200 req/s
while sharing the 2 cores with the server) on an open-loop
schedule: request i is due at i / rate seconds, whether or not earlier ones have answered,
so a slow server shows up as latency, not as a lower offered rate. Latency is measured from
the due time, after `--warmup` seconds at the same rate (connections opened, both ends warm). Prints offered and achieved rates, p50/p90/p99/max and errors.
Target: p99 <= 50 ms at 200 req/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.datasets.loader import load_dataset
from bmeg.models.detector import Detector
from bmeg.serving.assembler import split_by_trace
from bmeg.traces import to_otlp_proto_bytes
from ingest import random_traces  # bench/ingest.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="Run directory of `bmeg train`.")
    parser.add_argument("--rate", type=float, default=200.0, help="Requests per second offered.")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=64, help="Most requests in flight.")
    parser.add_argument("--warmup", type=float, default=2.0, help="Seconds at the same rate before measuring.")
    parser.add_argument("--traces", type=int, default=500, help="Distinct traces to cycle through.")
    parser.add_argument("--spans-per-trace", type=int, default=30)
    parser.add_argument("--dataset-traces", action="store_true", help="Use the model's dataset instead.")
    parser.add_argument("--model-process", action="store_true", help="Serve with the model in a child process.")
    args = parser.parse_args()

    spans = dataset_spans(args.model) if args.dataset_traces else random_traces(args.traces, args.spans_per_trace)
    bodies = [to_otlp_proto_bytes(trace) for _, trace in split_by_trace(spans)][:args.traces]
    spans_per_trace = spans.num_rows / pc.count_distinct(spans["trace_id"]).as_py()
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "bmeg"), "serve", "--model", str(args.model),
                               "--device", "cpu", "--port", str(port), "--log-level", "warning", "--no-auth",
                               "--model-process" if args.model_process else "--in-process"],
                              env={**os.environ, "BMEG_RECENT_DIAGNOSES": "50"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        # This process imported torch and pyarrow for the traces: a full GC pass over them would
        # stall the sender ~200 ms and show up as the server's latency.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # nanobind checks at exit that its objects were collected
        latencies, errors, elapsed, (cpu_used, main_used, client_used) = asyncio.run(
            load(base, bodies, args.rate, args.seconds, args.concurrency, args.warmup, server.pid))
    finally:
        server.terminate()
        server.wait(30)
    report(latencies, errors, elapsed, args, spans_per_trace)
    per_request_ms = 1e3 / max(len(latencies), 1)
    print(f"server CPU: {cpu_used * per_request_ms:.2f} ms per request, {main_used * per_request_ms:.2f} of them in "
          f"the HTTP process ({cpu_used / elapsed:.2f} cores busy); load generator {client_used / elapsed:.2f} cores; "
          f"machine load average {os.getloadavg()[0]:.1f}")


def dataset_spans(run_dir: Path) -> pa.Table:
    """Spans of the dataset the model was trained on."""
    return load_dataset(Path(Detector.load(run_dir, device="cpu").metrics["config"]["dataset_path"])).spans


def server_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children (the server's worker processes)."""
    process = psutil.Process(pid)
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def own_cpu_s(pid: int | None = None) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(base: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


async def load(base: str, bodies: list[bytes], rate: float, seconds: float, concurrency: int, warmup_s: float,
               server_pid: int):
    """Latencies (s), errors by kind, elapsed seconds and CPU seconds (server, its HTTP process,
    this client) of `seconds` at `rate`, after `warmup_s` at the same rate that opens the
    connections and warms both ends up (not counted)."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base, connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as client:
        slots = asyncio.Semaphore(concurrency)
        await open_loop(client, slots, bodies, rate, warmup_s)

        def cpu() -> np.ndarray:
            return np.array([server_cpu_s(server_pid), own_cpu_s(server_pid), own_cpu_s()])

        before = cpu()
        latencies, errors, elapsed = await open_loop(client, slots, bodies, rate, seconds)
        return latencies, errors, elapsed, cpu() - before


async def open_loop(client: aiohttp.ClientSession, slots: asyncio.Semaphore, bodies: list[bytes], rate: float,
                    seconds: float):
    """Request i is sent at i / rate s, whatever the answers so far; latency counts from then."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    headers = {"content-type": "application/x-protobuf"}

    async def one(i: int, due: float) -> None:
        async with slots:
            try:
                async with client.post("/diagnose", data=bodies[i % len(bodies)], headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        errors[str(response.status)] = errors.get(str(response.status), 0) + 1
            except (aiohttp.ClientError, TimeoutError) as error:
                errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1
                return
        latencies.append(time.perf_counter() - due)

    started = time.perf_counter()
    sent = []
    for i in range(int(rate * seconds)):
        due = started + i / rate
        await asyncio.sleep(due - time.perf_counter())
        sent.append(asyncio.create_task(one(i, due)))  # created when due: no burst of tasks at the start
    await asyncio.gather(*sent)
    return np.array(latencies), errors, time.perf_counter() - started


def report(latencies: np.ndarray, errors: dict[str, int], elapsed: float, args, spans_per_trace: float) -> None:
    done = len(latencies)
    p50, p90, p99 = (np.percentile(latencies, q) * 1e3 for q in (50, 90, 99)) if done else (float("nan"),) * 3
    print(f"offered {args.rate:.0f} req/s for {args.seconds:.0f} s, one trace per request "
          f"(~{spans_per_trace:.0f} spans), {os.cpu_count()} cores")
    print(f"achieved {done / elapsed:.1f} req/s ({done} ok in {elapsed:.1f} s), errors: {errors or 0}")
    print(f"latency ms: p50 {p50:.1f}  p90 {p90:.1f}  p99 {p99:.1f}  max {latencies.max() * 1e3 if done else float('nan'):.1f}")
    print(f"target p99 <= 50 ms: {'met' if p99 <= 50 else 'NOT met'}")


if __name__ == "__main__":
    main()
